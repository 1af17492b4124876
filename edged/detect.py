"""``edged detect``: the probed facts, the chosen device profile and why, as text or JSON."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from edged.hardware.facts import HardwareFacts, facts_as_dict

if TYPE_CHECKING:
    from edged.profiles import BackendPreference, ProfileMatch


def _backend_line(b: BackendPreference) -> str:
    opts = ", ".join(f"{k}={json.dumps(v)}" for k, v in b.options.model_dump(mode="json", exclude_unset=True).items())
    return f"{b.backend} {b.device} [{', '.join(b.precisions)}]" + (f" {{{opts}}}" if opts else "")


def render_detect(facts: HardwareFacts, match: ProfileMatch, *, as_json: bool) -> str:
    """Output of ``edged detect``: the facts, the chosen profile and why."""
    profile = match.profile
    flat = facts_as_dict(facts)
    budget = profile.effective_memory_budget_mb(facts)
    if as_json:
        return json.dumps({
            "facts": flat,
            "profile": profile.name,
            "description": profile.description,
            "source": str(profile.source) if profile.source else None,
            "select": profile.select,
            "threads": profile.threads,
            "memory_budget_mb": budget,
            "reasons": match.reasons,
            "rejected": [{"profile": name, "failed": why} for name, why in match.rejected],
            "backends": [b.model_dump(mode="json") for b in profile.backends],
            "jetpack": match.release.as_dict() if match.release else None,
            "unavailable": [{**b.model_dump(mode="json"), "reason": why} for b, why in match.unavailable],
            "added": [b.model_dump(mode="json") for b in match.added],
        }, indent=2)
    lines = [f"profile: {profile.name}" + (f"  ({profile.source})" if profile.source else "")]
    if profile.description:
        lines.append(f"  {profile.description}")
    lines.append("matched because:")
    lines += [f"  - {r}" for r in match.reasons]
    how = ("first that loads; CPU engines measured, fastest kept" if profile.select == "first"
           else "benchmarked, fastest kept")
    lines.append(f"backends ({how}):")
    lines += [f"  {i}. {_backend_line(b)}" + ("  (added: the host's CPU engines come last in every profile)"
                                              if b in match.added else "")
              for i, b in enumerate(profile.backends, 1)]
    lines += [f"  -  {_backend_line(b)}: unavailable: {why}" for b, why in match.unavailable]
    if match.release is not None:
        row = match.release
        lines.append(f"JetPack {row.jetpack} (L4T {row.l4t}; Ubuntu {row.ubuntu}, system Python "
                     f"{row.system_python}, TensorRT {row.tensorrt}, CUDA {row.cuda}):")
        lines += [f"  {key:<15}  {s.status:<11}  {s.how}" for key, s in row.engines.items()]
    threads = "engine default" if profile.threads == 0 else str(profile.threads)
    lines.append(f"threads: {threads}; memory budget: {budget:g} MB")
    if match.rejected:
        lines.append("earlier profiles not matched:")
        lines += [f"  - {name}: {why}" for name, why in match.rejected]
    # Unknown values and absent devices are noise here; --json shows every key.
    absent = {key.rsplit(".", 1)[0] for key, value in flat.items() if key.endswith(".present") and not value}
    if not flat.get("engines.probed"):
        absent |= {"engines.onnxruntime", "engines.openvino", "engines.tensorrt"}
    shown = {k: v for k, v in flat.items()
             if v is not None and v != [] and k.rsplit(".", 1)[0] not in absent}
    lines.append("facts (unknown and absent ones omitted; --json lists all):")
    width = max(len(k) for k in shown)
    for key, value in shown.items():
        text = ", ".join(value) if isinstance(value, list) else str(value).lower() if isinstance(
            value, bool) else str(value)
        lines.append(f"  {key:<{width}}  {text}")
    return "\n".join(lines) + "\n"
