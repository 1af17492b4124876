"""Writing the version: ``model.toml`` in the repository's own TOML style, staged and swapped in atomically.

The version is built in a hidden sibling folder (``.<version>.optimize-*``, which
the repository scan ignores), every file is fsynced, the manifest is validated
with the daemon's own parser, and only then is the folder renamed into place:
a daemon watching the repository never sees a half-written version.
"""

from __future__ import annotations

import json
import math
import re
import tempfile
from pathlib import Path
from typing import Any

from edged.fsutil import publish_dir
from edged.optimize.errors import OptimizeInputError, VersionExistsError
from edged.protocol.names import valid_model_name
from edged.repository.manifest import ModelManifest, parse_manifest

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError(f"cannot write {v} to TOML")
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    raise TypeError(f"no TOML form for {type(v).__name__}")


def _is_table_list(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)


def to_toml(doc: dict[str, Any], prefix: str = "") -> str:
    """Nested dicts and lists of dicts as TOML tables and arrays of tables; key order kept, None dropped."""
    lines: list[str] = []
    for key, v in doc.items():
        if not _BARE_KEY.fullmatch(key):
            raise ValueError(f"key {key!r} would need quoting")
        if v is not None and not isinstance(v, dict) and not _is_table_list(v):
            lines.append(f"{key} = {_value(v)}")
    for key, v in doc.items():
        path = f"{prefix}{key}"
        if isinstance(v, dict):
            lines.append(f"\n[{path}]")
            lines.append(to_toml(v, path + ".").rstrip("\n"))
        elif _is_table_list(v):
            for item in v:
                lines.append(f"\n[[{path}]]")
                lines.append(to_toml(item, path + ".").rstrip("\n"))
    return "\n".join(x for x in lines if x) + "\n"


def _prune(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _prune(x) for k, x in v.items() if x is not None and x not in ([], {})}
    if isinstance(v, list):
        return [_prune(x) for x in v]
    return v


def manifest_toml(manifest: ModelManifest) -> str:
    """The manifest in field order, without empty lists and unset keys (as a person would write it)."""
    data = manifest.model_dump(mode="json", exclude_none=True)
    if "max_batch_size" not in manifest.model_fields_set:
        data.pop("max_batch_size", None)  # still left to auto-completion from the model file
    return to_toml(_prune(data))


def parse_target(out: Path) -> tuple[Path, str, int]:
    """``REPO/NAME/VERSION`` -> (repo, name, version), checked like the repository scan checks them."""
    name, version_text = out.parent.name, out.name
    if not version_text.isdigit() or version_text.startswith("0"):
        raise OptimizeInputError(f"--out {out}: the last part must be a version number (1, 2, ...), "
                                 f"not {version_text!r}")
    if not valid_model_name(name):
        raise OptimizeInputError(f"--out {out}: {name!r} is not a valid model name")
    return out.parent.parent, name, int(version_text)


def check_target(out: Path, *, force: bool) -> None:
    if out.exists() and not force:
        raise VersionExistsError(f"{out} already exists; a version is never changed in place "
                                 "(pick a new version number, or --force to replace it)")


def stage(out: Path) -> Path:
    """A fresh hidden folder next to ``out`` to build the version in."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.optimize-", dir=out.parent))
    tmp.chmod(0o755)
    return tmp


def publish(tmp: Path, out: Path, *, name: str, version: int, force: bool) -> None:
    """Validate the staged manifest, then rename the staged folder to ``out`` (replacing it with ``force``)."""
    parse_manifest(tmp / "model.toml", model=name, version=version)
    check_target(out, force=force)
    publish_dir(tmp, out)
