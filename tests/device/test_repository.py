from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from edged.config import ModelsSection, parse_config
from edged.errors import ManifestError
from edged.fsutil import sha256_file
from edged.repository.digests import DigestCache
from edged.repository.manifest import parse_manifest
from edged.repository.store import scan_repository

MakeRepo = Callable[..., Path]


def _entries(repo: Path, policy: str = "") -> dict[tuple[str, int], object]:
    models = parse_config(policy).models if policy else ModelsSection()
    return {(e.model, e.version): e for e in scan_repository(repo, models)}


def test_bundled_repository_is_clean(model_repo: MakeRepo) -> None:
    entries = _entries(model_repo())
    assert set(entries) == {("digits", 1), ("mobilenet", 1)}
    for e in entries.values():
        assert e.error is None and not e.bad_variants  # type: ignore[attr-defined]


def test_unknown_manifest_key_names_model_version_and_key(model_repo: MakeRepo) -> None:
    repo = model_repo("digits")
    m = repo / "digits" / "1" / "model.toml"
    m.write_text(m.read_text().replace("max_batch_size = 64", "max_batch_size = 64\nmax_bach = 3"))
    with pytest.raises(ManifestError) as ei:
        parse_manifest(m, model="digits", version=1)
    assert "model 'digits' version 1 (model.toml)" in str(ei.value)
    assert "max_bach: unknown key" in str(ei.value)


def test_wrong_datatype_is_reported(model_repo: MakeRepo) -> None:
    repo = model_repo("digits")
    m = repo / "digits" / "1" / "model.toml"
    m.write_text(m.read_text().replace('datatype = "FP32"', 'datatype = "FLOAT"', 1))
    e = _entries(repo)[("digits", 1)]
    assert "inputs[0].datatype" in e.error  # type: ignore[attr-defined]


def test_digest_mismatch_skips_only_that_variant(model_repo: MakeRepo) -> None:
    repo = model_repo("digits")
    f = repo / "digits" / "1" / "model.int8.onnx"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    e = _entries(repo)[("digits", 1)]
    assert e.error is None  # type: ignore[attr-defined]
    assert "sha256 mismatch for model.int8.onnx" in e.bad_variants["model.int8.onnx"]  # type: ignore[attr-defined]
    assert [v.file for v in e.usable_variants] == ["model.onnx", "openvino/model.xml"]  # type: ignore[attr-defined]


def test_every_variant_bad_makes_the_version_unusable(model_repo: MakeRepo) -> None:
    repo = model_repo("mobilenet")
    (repo / "mobilenet" / "1" / "model.onnx").write_bytes(b"not a model")
    (repo / "mobilenet" / "1" / "openvino" / "model.bin").unlink()
    e = _entries(repo)[("mobilenet", 1)]
    assert "no usable variant" in e.error  # type: ignore[attr-defined]
    assert "openvino/model.bin is missing" in e.error  # type: ignore[attr-defined]


def test_versions_follow_the_policy(model_repo: MakeRepo) -> None:
    import shutil

    repo = model_repo("digits")
    for v in (2, 3):
        shutil.copytree(repo / "digits" / "1", repo / "digits" / str(v))
    (repo / "digits" / "notaversion").mkdir()
    assert set(_entries(repo)) == {("digits", 3)}
    assert set(_entries(repo, "[models.version_policy]\nlatest = 2\n")) == {("digits", 2), ("digits", 3)}
    assert set(_entries(repo, "[models.policies.digits]\nspecific = [1, 3]\n")) == {("digits", 1), ("digits", 3)}


def test_path_escape_in_manifest_is_refused(model_repo: MakeRepo) -> None:
    repo = model_repo("digits")
    m = repo / "digits" / "1" / "model.toml"
    m.write_text(m.read_text().replace('file = "model.onnx"', 'file = "../../../etc/passwd"'))
    e = _entries(repo)[("digits", 1)]
    assert "variants[0].file" in e.error  # type: ignore[attr-defined]


def test_digest_cache_rehashes_changed_files(tmp_path: Path) -> None:
    f = tmp_path / "a.bin"
    f.write_bytes(b"one")
    cache = DigestCache(tmp_path / "digests.json")
    assert cache.digest(f) == sha256_file(f)
    cache.save()
    f.write_bytes(b"two!")
    again = DigestCache(tmp_path / "digests.json")
    assert again.digest(f) == sha256_file(f)


def test_the_packaged_repository_is_seeded_once_and_crash_safely(tmp_path: Path) -> None:
    from edged.repository.seed import seed_repository, serving_repository

    seed = tmp_path / "share" / "models"
    (seed / "digits" / "1").mkdir(parents=True)
    (seed / "digits" / "1" / "model.toml").write_text("x = 1\n")
    repo = tmp_path / "state" / "models"
    assert serving_repository(repo, seed) == seed  # before the daemon's first start: read the seed, create nothing
    assert not repo.exists()
    leftover = tmp_path / "state" / ".models.seeding"
    (leftover / "half").mkdir(parents=True)  # a start that died while copying
    assert seed_repository(repo, seed)
    assert not leftover.exists()
    assert (repo / "digits" / "1" / "model.toml").read_text() == "x = 1\n"
    assert serving_repository(repo, seed) == repo
    (repo / "digits" / "2").mkdir()  # the device's own from now on: an update installed version 2
    (seed / "digits" / "1" / "model.toml").write_text("x = 2\n")
    assert not seed_repository(repo, seed)
    assert (repo / "digits" / "2").is_dir() and (repo / "digits" / "1" / "model.toml").read_text() == "x = 1\n"
    assert not seed_repository(tmp_path / "other", None) and not (tmp_path / "other").exists()
