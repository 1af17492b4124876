"""Health gates of a rollout, read from device reports and uploaded telemetry.

Reports: the per-device, per-model row holds each device's last step for the rollout's
release; one grouped count gives how many finished (committed, rolled back, failed).
Telemetry: the new version's and the previous version's windows uploaded since the
rollout began are added up incrementally (a watermark on the row id), so an evaluation
reads only what arrived since the last one, however long the rollout runs.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Text, cast, func, literal, select
from sqlalchemy.orm import Session

from edged.latency_buckets import LATENCY_BUCKETS_S
from edged.protocol.fleet.telemetry import HistCounts, Outcomes
from edged.registry.db import DeviceModelRow, DeviceRow, QualityScoreRow, RolloutRow
from edged.registry.rollout_wire import GateReading, Gates
from edged.registry.telemetry_tables import TelemetryModelRow

# Failures the client caused or that only say the queue was full: not the model's fault (as on the device).
NOT_MODEL_ERRORS = frozenset({"invalid_argument", "overloaded", "cancelled"})
TELEMETRY_BATCH = 20_000
_BUCKETS = len(LATENCY_BUCKETS_S) + 1


@dataclass
class Counts:
    by_state: dict[str, int]

    def n(self, *states: str) -> int:
        return sum(self.by_state.get(s, 0) for s in states)

    @property
    def committed(self) -> int:
        return self.n("committed")

    @property
    def failures(self) -> int:
        return self.n("rolled-back", "failed")

    @property
    def finished(self) -> int:
        return self.n("committed", "rolled-back", "failed")


Judge = Callable[[str, dict[str, Any], dict[str, Any]], bool]  # (device id, operator labels, facts)


@dataclass(frozen=True)
class Population:
    """Whose word a rollout's gates count; made in ONE place, :func:`edged.registry.rollouts.population`.

    Any enrolled device can report any step and upload telemetry for any release. What a device
    outside the rollout says about the release changes no gate, no step and no state (it is stored
    and shown as not counted): ``member`` decides for the release's reports, scores and telemetry.
    ``targeted`` (the rollout's target and the release's selector, admitted or not) decides for the
    previous version's telemetry the new one is compared with: the rollout's own devices, never the
    rest of the fleet. ``facts``: whether either needs the devices' facts (else they are not read).

    ``known``: verdicts already reached, with the labels (and facts) text they were reached on.
    Membership only grows while labels and facts stay the same (cutoffs only rise, groups are only
    added), so a member with unchanged text is one without deciding again, and a non-member is one
    while ``cut`` (the rollout's step, cutoffs and admission) is also unchanged: an evaluation of a
    step where thousands reported costs a read of their rows, not thousands of decisions.
    """

    member: Judge
    targeted: Judge
    facts: bool = True
    known: dict[str, tuple[bool, str, int]] | None = None  # device -> (member, cut, hash of labels and facts)
    cut: str = ""

    def is_member(self, device_id: str, labels_text: str | None, facts_text: str | None) -> bool:
        h = hash((labels_text, facts_text if self.facts else None))
        if self.known is not None:
            seen = self.known.get(device_id)
            if seen is not None and seen[2] == h and (seen[0] or seen[1] == self.cut):
                return seen[0]
        ok = self.member(device_id, _obj(labels_text), _obj(facts_text) if self.facts else {})
        if self.known is not None:
            self.known[device_id] = (ok, self.cut, h)
        return ok


def _obj(text: str | None) -> dict[str, Any]:
    try:
        v = json.loads(text) if text else {}
    except ValueError:
        return {}
    return v if isinstance(v, dict) else {}


def _device_cols(pop: Population) -> list[Any]:
    """A device's id, labels and (when needed) facts as stored text: decoded only for devices not yet known."""
    return [DeviceRow.id, cast(DeviceRow.admin_labels, Text).label("labels"),
            cast(DeviceRow.facts, Text).label("facts") if pop.facts else literal(None).label("facts")]


def judged_devices(s: Session, ids: Iterable[str], pop: Population,
                   targeted_ids: Iterable[str] = ()) -> tuple[set[str], set[str]]:
    """(the members among ``ids``, the targeted devices among ``targeted_ids``): one query per 500 devices for
    their labels (and facts when needed)."""
    ask_member, ask_targeted = set(ids), set(targeted_ids)
    wanted = sorted(ask_member | ask_targeted)
    members: set[str] = set()
    targeted: set[str] = set()
    for i in range(0, len(wanted), 500):
        for row in s.execute(select(*_device_cols(pop)).where(DeviceRow.id.in_(wanted[i:i + 500]))).all():
            if row.id in ask_member and pop.is_member(row.id, row.labels, row.facts):
                members.add(row.id)
            if row.id in ask_targeted and pop.targeted(row.id, _obj(row.labels),
                                                       _obj(row.facts) if pop.facts else {}):
                targeted.add(row.id)
    return members, targeted


def release_counts(s: Session, model_id: int, release: int, pop: Population) -> Counts:
    """Each member's last step for the release, counted by step (non-members' reports are left out)."""
    rows = s.execute(select(DeviceModelRow.state, *_device_cols(pop))
                     .join(DeviceRow, DeviceRow.id == DeviceModelRow.device_id).where(
        DeviceModelRow.model_id == model_id, DeviceModelRow.release_number == release,
        DeviceModelRow.state.is_not(None))).all()
    by_state: dict[str, int] = {}
    for r in rows:
        if pop.is_member(r.id, r.labels, r.facts):
            by_state[str(r.state)] = by_state.get(str(r.state), 0) + 1
    return Counts(by_state)


# ---- evaluation-set scores ------------------------------------------------------------------------
@dataclass
class Quality:
    """Scores the release's devices reported at trial start; ``drop`` pairs each device with itself."""

    devices: int = 0
    score: float | None = None  # mean over devices
    paired: int = 0  # devices that also scored their last-known-good
    baseline: float | None = None  # mean last-known-good score over those
    drop: float | None = None  # mean (baseline - score) over those


def quality_scores(s: Session, model_id: int, release: int, pop: Population) -> Quality:
    """The members' scores only: a device outside the rollout could otherwise pass a bad release or halt a
    good one."""
    rows = s.execute(select(QualityScoreRow.device_id, QualityScoreRow.score, QualityScoreRow.baseline_score).where(
        QualityScoreRow.model_id == model_id, QualityScoreRow.release_number == release)).all()
    if rows:
        counted, _ = judged_devices(s, (r.device_id for r in rows), pop)
        rows = [r for r in rows if r.device_id in counted]
    if not rows:
        return Quality()
    scores = [float(r.score) for r in rows]
    pairs = [(float(r.baseline_score), float(r.score)) for r in rows if r.baseline_score is not None]
    q = Quality(devices=len(rows), score=sum(scores) / len(scores), paired=len(pairs))
    if pairs:
        q.baseline = sum(b for b, _ in pairs) / len(pairs)
        q.drop = sum(b - n for b, n in pairs) / len(pairs)
    return q


# ---- telemetry, incrementally -------------------------------------------------------------------
@dataclass
class Side(Outcomes):
    ok: int = 0
    errors: int = 0
    hist: HistCounts | None = None

    @classmethod
    def load(cls, d: dict[str, Any] | None) -> Side:
        if not d:
            return cls(hist=HistCounts())
        counts = [int(c) for c in d.get("hist", [])][:_BUCKETS]
        return cls(int(d.get("ok", 0)), int(d.get("errors", 0)),
                   HistCounts(counts + [0] * (_BUCKETS - len(counts)), float(d.get("sum", 0.0))))

    def dump(self) -> dict[str, Any]:
        h = self.hist or HistCounts()
        return {"ok": self.ok, "errors": self.errors, "hist": list(h.counts), "sum": h.total}

    def p99_s(self) -> float | None:
        return (self.hist or HistCounts()).quantile(0.99)


def telemetry_watermark(s: Session) -> int:
    return int(s.scalar(select(func.max(TelemetryModelRow.id))) or 0)


def accumulate(s: Session, ro: RolloutRow, model: str, new_version: int, pop: Population) -> tuple[Side, Side]:
    """Add the telemetry uploaded since the last evaluation; returns (new version, previous version).

    The new version's windows count from members only, the previous version's from the rollout's
    targeted devices only (see :class:`Population`); other windows are passed over for good."""
    st = dict(ro.gate_state or {})
    new, base = Side.load(st.get("new")), Side.load(st.get("base"))
    mark = int(st.get("watermark", 0))
    versions = [new_version] + ([ro.baseline_version] if ro.baseline_version is not None else [])
    rows = s.execute(select(TelemetryModelRow.id, TelemetryModelRow.device_id, TelemetryModelRow.version,
                            TelemetryModelRow.success,
                            TelemetryModelRow.failures_by_code, TelemetryModelRow.latency_counts,
                            TelemetryModelRow.latency_sum_s)
                     .where(TelemetryModelRow.model == model, TelemetryModelRow.id > mark,
                            TelemetryModelRow.version.in_(versions))
                     .order_by(TelemetryModelRow.id).limit(TELEMETRY_BATCH)).all()
    if not rows:
        return new, base
    members, targeted = judged_devices(s, (r.device_id for r in rows if r.version == new_version), pop,
                                       (r.device_id for r in rows if r.version != new_version))
    for r in rows:
        mark = max(mark, int(r.id))
        if r.device_id not in (members if r.version == new_version else targeted):
            continue
        side = new if r.version == new_version else base
        side.ok += int(r.success)
        side.errors += sum(int(n) for code, n in (r.failures_by_code or {}).items() if code not in NOT_MODEL_ERRORS)
        counts = [int(c) for c in (r.latency_counts or [])][:_BUCKETS]
        side.hist = (side.hist or HistCounts()).plus(HistCounts(counts + [0] * (_BUCKETS - len(counts)),
                                                                float(r.latency_sum_s or 0.0)))
    ro.gate_state = {**st, "watermark": mark, "new": new.dump(), "base": base.dump()}
    return new, base


# ---- judging --------------------------------------------------------------------------------------
def needed_reports(gates: Gates, members: int) -> int:
    """Devices that must have finished: the gate's minimum, or every member when there are fewer."""
    return max(1, min(gates.min_reporting, members)) if members > 0 else gates.min_reporting


def quality_readings(gates: Gates, q: Quality, need: int) -> list[GateReading]:
    """Judged once ``need`` devices scored the release (the reporting minimum, or every member)."""
    out = []
    enough = q.devices >= need
    scored = (f"{q.devices} device(s) scored the new version {q.score:.4f}" if q.score is not None
              else "no evaluation-set scores reported yet (the release needs [evaluation] in its model.toml)")
    if gates.max_quality_drop is not None:
        judged = enough and q.drop is not None
        ok = not judged or (q.drop is not None and q.drop <= gates.max_quality_drop)
        detail = (f"{scored}; {q.paired} of them scored the last-known-good {q.baseline:.4f} on the same set"
                  if q.baseline is not None else f"{scored}; none scored a last-known-good")
        out.append(GateReading(gate="quality_drop", value=q.drop, limit=gates.max_quality_drop, judged=judged,
                               ok=ok, detail=detail))
    if gates.min_quality is not None:
        judged = enough and q.score is not None
        ok = not judged or (q.score is not None and q.score >= gates.min_quality)
        out.append(GateReading(gate="min_quality", value=q.score, limit=gates.min_quality, judged=judged, ok=ok,
                               detail=scored))
    return out


def readings(gates: Gates, counts: Counts, members: int, new: Side, base: Side, *,
             quality: Quality | None = None) -> list[GateReading]:
    out = []
    need = needed_reports(gates, members)
    fin = counts.finished
    out.append(GateReading(gate="min_reporting", value=float(fin), limit=float(need), judged=True, ok=fin >= need,
                           detail=f"{fin} device(s) finished the update, {need} needed"))
    if gates.max_failure_rate is not None:
        rate = counts.failures / fin if fin else None
        judged = fin >= need
        ok = not judged or rate is None or rate <= gates.max_failure_rate
        out.append(GateReading(gate="failure_rate", value=rate, limit=gates.max_failure_rate, judged=judged, ok=ok,
                               detail=f"{counts.failures} of {fin} finished device(s) rolled back or failed"))
    if gates.max_error_rate is not None:
        judged = new.total >= gates.min_requests
        base_rate = base.error_rate if base.total >= gates.min_requests else 0.0
        excess = new.error_rate - base_rate if judged else None
        ok = excess is None or excess <= gates.max_error_rate
        out.append(GateReading(gate="error_rate", value=excess, limit=gates.max_error_rate, judged=judged, ok=ok,
                               detail=f"new version {new.error_rate:.2%} over {new.total} requests, previous "
                                      f"{base.error_rate:.2%} over {base.total}"))
    if gates.max_p99_ratio is not None:
        p_new, p_base = new.p99_s(), base.p99_s()
        judged = (new.ok >= gates.min_requests and base.ok >= gates.min_requests and p_new is not None
                  and p_base is not None and p_base > 0)
        ratio = p_new / p_base if judged and p_new is not None and p_base else None
        limit_s = max((p_base or 0.0) * gates.max_p99_ratio, gates.p99_floor_ms / 1000.0)
        ok = not judged or p_new is None or p_new <= limit_s
        out.append(GateReading(gate="p99_ratio", value=ratio, limit=gates.max_p99_ratio, judged=judged, ok=ok,
                               detail=(f"p99 {p_new * 1000:.1f} ms over {new.ok} requests, previous "
                                       f"{p_base * 1000:.1f} ms over {base.ok}" if judged and p_new and p_base else
                                       f"{new.ok} and {base.ok} requests so far, {gates.min_requests} needed")))
    out += quality_readings(gates, quality or Quality(), need)
    return out


def crossed(rs: list[GateReading]) -> list[GateReading]:
    """Gates that halt: judged and not ok (the reporting minimum only holds a step back)."""
    return [g for g in rs if g.judged and not g.ok and g.gate != "min_reporting"]


def waiting_for_quality(rs: list[GateReading]) -> bool:
    """A quality gate is set but not judged yet: the step must not count as ready (fail closed)."""
    return any(g.gate in ("quality_drop", "min_quality") and not g.judged for g in rs)


def halt_reason(bad: list[GateReading]) -> str:
    return "health gate crossed: " + "; ".join(
        f"{g.gate} {g.value:.3g} < {g.limit:.3g} ({g.detail})" if g.gate == "min_quality" and g.value is not None
        and g.limit is not None else
        f"{g.gate} {g.value:.3g} > {g.limit:.3g} ({g.detail})" if g.value is not None and g.limit is not None
        else f"{g.gate} ({g.detail})" for g in bad)
