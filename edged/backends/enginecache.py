"""Compiled-engine cache (TensorRT plans, OpenVINO blobs) keyed by everything that makes a plan valid.

A TensorRT plan only runs on the GPU model, compute capability, TensorRT and CUDA
versions it was built with; loading a plan built for something else either fails
or, worse, misbehaves. So the cache key holds all of those plus the model digest,
precision and shape profile, the file name is derived from the key's digest, and
every entry carries its full key in a header that is compared on read: a key
change means a cache miss and a rebuild, never an incompatible plan. Entries are
written atomically (a device may lose power mid-write) and an entry superseded for
the same model/backend/device/precision slot is pruned when its successor lands.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import shutil
import struct
from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from edged.fsutil import atomic_write_bytes, atomic_write_text
from edged.repository.manifest import Variant

log = logging.getLogger(__name__)

_MAGIC = b"EDGEDENG\x01"
_HEADER_LEN = struct.Struct(">I")
_MAX_HEADER = 1 << 20
_DIGEST_CHARS = 24
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


class EngineCacheKey(BaseModel):
    """Everything a compiled engine depends on; any change must rebuild it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    version: int
    backend: str
    variant: str = Field(default="", description="the source file inside the version folder")
    model_digest: str = Field(description="sha256 of the source variant (and calibration cache)")
    library_versions: dict[str, str] = Field(default_factory=dict, description="e.g. tensorrt, cuda runtime")
    device: str = Field(description="GPU, DLA0, CPU, NPU...")
    hardware: str = Field(default="", description="GPU or SoC name")
    compute_capability: str = ""
    platform: str = Field(default="", description="L4T/JetPack release, driver version")
    precision: str
    shape_profile: str = Field(default="", description="min/opt/max batch and declared input shapes")
    options: dict[str, str] = Field(default_factory=dict, description="build options that change the result")

    def canonical(self) -> str:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    def digest(self) -> str:
        return hashlib.sha256(self.canonical().encode("utf-8")).hexdigest()

    @property
    def slot(self) -> str:
        """What one entry replaces: same model version, source file, backend, device and precision."""
        parts = (self.model, f"v{self.version}", self.variant, self.backend, self.device, self.precision)
        return "-".join(_UNSAFE.sub("_", p) for p in parts)


def variant_digest(variant: Variant, **more: str) -> str:
    """One digest for a variant's files (and e.g. its calibration cache's digest, passed as ``more``)."""
    parts = {"file": variant.sha256, **{f"extra:{x.file}": x.sha256 for x in variant.extra_files}, **more}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode("utf-8")).hexdigest()


class EngineCache:
    """Engine blobs under ``root``; one file per key, or one folder per key for self-managed caches."""

    def __init__(self, root: Path) -> None:
        self.root = root

    # ---- single-file entries (TensorRT plans) -------------------------------------------------
    def path_for(self, key: EngineCacheKey) -> Path:
        return self.root / f"{key.slot}-{key.digest()[:_DIGEST_CHARS]}.engine"

    def get(self, key: EngineCacheKey) -> bytes | None:
        """The blob stored for exactly this key, or None (missing, corrupt, or stored for another key)."""
        path = self.path_for(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("engine cache: cannot read %s: %s", path.name, e)
            return None
        problem, blob = _parse(data, key)
        if problem:
            log.warning("engine cache: ignoring %s: %s; it will be rebuilt", path.name, problem)
            return None
        return blob

    def put(self, key: EngineCacheKey, blob: bytes) -> Path:
        """Store ``blob`` atomically under ``key`` and drop entries it supersedes."""
        header = json.dumps({
            "key": key.model_dump(mode="json"),
            "size": len(blob),
            "sha256": hashlib.sha256(blob).hexdigest(),
        }, sort_keys=True).encode("utf-8")
        path = self.path_for(key)
        atomic_write_bytes(path, b"".join((_MAGIC, _HEADER_LEN.pack(len(header)), header, blob)), mode=0o600)
        self.prune(key)
        return path

    def remove(self, key: EngineCacheKey) -> None:
        """Forget an entry the engine library refused to load."""
        with contextlib.suppress(FileNotFoundError):
            self.path_for(key).unlink()

    # ---- folder entries (libraries that write their own cache files, e.g. OpenVINO) -----------
    def dir_for(self, key: EngineCacheKey) -> Path:
        """A folder that belongs to exactly this key, so a stale blob from another key is never seen."""
        folder = self.root / f"{key.slot}-{key.digest()[:_DIGEST_CHARS]}"
        stamp = folder / "key.json"
        if not stamp.is_file():
            folder.mkdir(parents=True, exist_ok=True)
            atomic_write_text(stamp, key.canonical() + "\n")
            self.prune(key)
        return folder

    # ---- housekeeping -----------------------------------------------------------------------
    def prune(self, key: EngineCacheKey) -> list[Path]:
        """Delete entries of the same slot stored under other keys (an old model digest or library)."""
        keep = key.digest()[:_DIGEST_CHARS]
        removed: list[Path] = []
        if not self.root.is_dir():
            return removed
        pattern = re.compile(re.escape(key.slot) + rf"-([0-9a-f]{{{_DIGEST_CHARS}}})(\.engine)?$")
        for entry in self.root.iterdir():
            m = pattern.fullmatch(entry.name)
            if not m or m.group(1) == keep:
                continue
            try:
                if entry.is_dir():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
                removed.append(entry)
                log.info("engine cache: pruned superseded entry %s", entry.name)
            except OSError as e:
                log.warning("engine cache: cannot prune %s: %s", entry.name, e)
        return removed

    def timing_cache_path(self, hardware: Mapping[str, str]) -> Path:
        """TensorRT's layer-timing cache, shared by every model built on the same GPU and library."""
        digest = hashlib.sha256(json.dumps(dict(hardware), sort_keys=True).encode("utf-8")).hexdigest()
        return self.root / "timing" / f"{digest[:_DIGEST_CHARS]}.timing"


def _parse(data: bytes, key: EngineCacheKey) -> tuple[str | None, bytes]:
    """(problem or None, blob) for one stored entry read back for ``key``."""
    if not data.startswith(_MAGIC) or len(data) < len(_MAGIC) + _HEADER_LEN.size:
        return "not an edged engine cache entry", b""
    (hlen,) = _HEADER_LEN.unpack_from(data, len(_MAGIC))
    start = len(_MAGIC) + _HEADER_LEN.size
    if hlen > _MAX_HEADER or start + hlen > len(data):
        return "truncated header", b""
    try:
        header = json.loads(data[start:start + hlen])
    except ValueError:
        return "unreadable header", b""
    if not isinstance(header, dict):
        return "unreadable header", b""
    if header.get("key") != key.model_dump(mode="json"):
        return "stored for a different key", b""
    blob = data[start + hlen:]
    if header.get("size") != len(blob) or header.get("sha256") != hashlib.sha256(blob).hexdigest():
        return "size or checksum mismatch", b""
    return None, blob
