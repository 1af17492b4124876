"""Scan a model repository: models, versions by policy, manifests, and artifact digests.

A bad version is reported with the reason and skipped; it never stops the rest.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from edged.config import ModelsSection
from edged.errors import ManifestError
from edged.protocol.names import MANIFEST_NAME, PIPELINE_NAME, valid_model_name
from edged.repository.digests import DigestCache
from edged.repository.manifest import ModelManifest, Variant, parse_manifest

log = logging.getLogger(__name__)


@dataclass
class VersionEntry:
    model: str
    version: int
    path: Path
    manifest: ModelManifest | None = None
    error: str | None = None
    # variant file -> why it cannot be used (missing file, digest mismatch)
    bad_variants: dict[str, str] = field(default_factory=dict)
    pipeline: bool = False  # the folder holds PIPELINE_NAME instead of a manifest: compiled by the core
    not_fetched: bool = False  # every variant's files are missing and the manifest says how to fetch them

    @property
    def usable_variants(self) -> list[Variant]:
        if self.manifest is None:
            return []
        return [v for v in self.manifest.variants if v.file not in self.bad_variants]


def list_versions(model_dir: Path) -> list[int]:
    out = []
    for child in model_dir.iterdir():
        if child.is_dir() and child.name.isdigit() and not child.name.startswith("0"):
            out.append(int(child.name))
    return sorted(out)


def check_file(version_dir: Path, rel: str, expected: str, digests: DigestCache) -> str | None:
    path = version_dir / rel
    try:
        resolved = path.resolve(strict=True)
    except (FileNotFoundError, RuntimeError):
        return f"file {rel} is missing"
    if not resolved.is_relative_to(version_dir.resolve()):
        return f"file {rel} points outside the version folder"
    if not resolved.is_file():
        return f"{rel} is not a regular file"
    try:
        actual = digests.digest(resolved)
    except OSError as e:
        return f"cannot read {rel}: {e.strerror}"
    if actual != expected:
        return f"sha256 mismatch for {rel}: manifest says {expected[:12]}..., file is {actual[:12]}..."
    return None


def verify_version(entry: VersionEntry, digests: DigestCache) -> None:
    """Check every variant's files against their digests; fill ``bad_variants`` and ``error``."""
    assert entry.manifest is not None
    for variant in entry.manifest.variants:
        for art in [variant, *variant.extra_files]:
            problem = check_file(entry.path, art.file, art.sha256, digests)
            if problem:
                entry.bad_variants[variant.file] = problem
                break
        cache = variant.calibration_cache
        if variant.file not in entry.bad_variants and cache and not (entry.path / cache).is_file():
            entry.bad_variants[variant.file] = f"calibration cache {cache} is missing"
    for rel in (entry.manifest.warmup.file, entry.manifest.warmup.expected, entry.manifest.labels):
        if rel and not (entry.path / rel).is_file():
            where = f"model {entry.model!r} version {entry.version}"
            entry.error = f"{where}: file {rel} named in {MANIFEST_NAME} is missing"
            return
    if not entry.usable_variants:
        reasons = "; ".join(f"{k}: {v}" for k, v in entry.bad_variants.items())
        entry.error = f"model {entry.model!r} version {entry.version}: no usable variant ({reasons})"
        fetch = entry.manifest.fetch
        missing = all(why.startswith("file ") and why.endswith(" is missing") for why in entry.bad_variants.values())
        if fetch and missing:
            entry.not_fetched = True
            entry.error = (f"model {entry.model!r} version {entry.version}: not fetched "
                           f"({'; '.join(entry.bad_variants.values())}); run: {fetch}")


def load_version(model: str, version: int, path: Path, digests: DigestCache) -> VersionEntry:
    entry = VersionEntry(model, version, path)
    if (path / PIPELINE_NAME).is_file():
        entry.pipeline = True
        if (path / MANIFEST_NAME).exists():
            entry.error = (f"model {model!r} version {version}: the folder holds both {MANIFEST_NAME} and "
                           f"{PIPELINE_NAME}; a version is a model or a pipeline")
        return entry
    try:
        entry.manifest = parse_manifest(path / MANIFEST_NAME, model=model, version=version)
    except ManifestError as e:
        entry.error = str(e)
        return entry
    verify_version(entry, digests)
    return entry


def scan_repository(root: Path, models: ModelsSection, digests: DigestCache | None = None) -> list[VersionEntry]:
    """Every selected version of every model, each either usable or with its error."""
    digests = digests or DigestCache(None)
    if not root.is_dir():
        raise ManifestError(f"model repository {root} does not exist or is not a folder")
    entries: list[VersionEntry] = []
    for model_dir in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        name = model_dir.name
        if name in models.disabled:
            continue
        if not valid_model_name(name):
            entries.append(VersionEntry(name, 0, model_dir, error=f"model folder {name!r} is not a valid model name"))
            continue
        versions = list_versions(model_dir)
        if not versions:
            entries.append(VersionEntry(name, 0, model_dir, error=f"model {name!r} has no version folders"))
            continue
        for v in models.policy_for(name).select(versions):
            entries.append(load_version(name, v, model_dir / str(v), digests))
    digests.save()
    # Models whose files are fetched by a command (the examples, from public wheels) are not an error:
    # one INFO line per command says which ones wait for it.
    waiting: dict[str, list[str]] = {}
    for e in entries:
        if e.not_fetched and e.manifest is not None and e.manifest.fetch:
            waiting.setdefault(e.manifest.fetch, []).append(e.model)
    for command, names in waiting.items():
        log.info("model(s) %s: files not fetched here, so they and the pipelines using them stay unavailable; "
                 "to fetch them run: %s", ", ".join(sorted(set(names))), command)
    for e in entries:
        if e.error and e.not_fetched:
            log.debug("model=%s version=%s skipped: %s", e.model, e.version, e.error)
        elif e.error:
            log.error("model=%s version=%s skipped: %s", e.model, e.version, e.error)
        for f, why in e.bad_variants.items():
            if not e.error:
                log.warning("model=%s version=%s variant %s unusable: %s", e.model, e.version, f, why)
    return entries
