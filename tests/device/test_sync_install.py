"""The install step reads a version's files once: models are large, and a re-release of a kept version
number used to hash the repository's folder once per kept entry that names it, then again to install."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from edged.fsutil import sha256_file
from edged.protocol.fleet.release import FileEntry, ReleaseManifest
from edged.sync import repo as repo_mod
from edged.sync.repo import DeviceRepo
from edged.sync.state import ModelSync, Pending, StateStore, SyncState, VersionRef
from edged.sync.update import install
from edged.sync.update.context import UpdateContext

MODEL = "m"


def _files(folder: Path, payload: bytes) -> list[FileEntry]:
    folder.mkdir(parents=True)
    out = []
    for name, data in (("model.toml", b""), ("model.onnx", payload)):
        (folder / name).write_bytes(data)
        out.append(FileEntry(path=name, sha256=sha256_file(folder / name), size=len(data)))
    return out


def _case(tmp_path: Path, staged_payload: bytes) -> tuple[UpdateContext, ReleaseManifest, Path]:
    """Version 1 served and kept as the last-known-good here; release 3 brings version 1 again, staged."""
    repo = DeviceRepo(tmp_path / "repo")
    _files(repo.version_dir(MODEL, 1), b"x" * 4096)
    staged = repo.staging_dir(MODEL, 1, 3)
    files = _files(staged, staged_payload)
    now = int(time.time())
    m = ReleaseManifest(model=MODEL, version=1, release=3, issued_at=now, expires_at=now + 3600, files=files)
    state = SyncState(models={MODEL: ModelSync(
        current=VersionRef(version=1, release=1), lkg=VersionRef(version=1, release=1),
        pending=Pending.model_construct(release=3, version=1, step="install", signed=None, starts=[], fault=None),
    )})
    (tmp_path / "sync").mkdir()
    none: Any = None
    ctx = UpdateContext(settings=none, store=StateStore(tmp_path / "sync"), state=state, client=none, http=none,
                        engine=none, stop=threading.Event(), repo=repo)
    return ctx, m, staged


def _count_hashes(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    read: list[Path] = []

    def counted(path: Path) -> str:
        read.append(path)
        return sha256_file(path)
    monkeypatch.setattr(repo_mod, "sha256_file", counted)
    return read


def test_the_same_files_are_hashed_once_and_the_staged_copy_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctx, m, staged = _case(tmp_path, b"x" * 4096)
    read = _count_hashes(monkeypatch)
    assert install.run(ctx, MODEL, m, staged)
    served = ctx.repo.version_dir(MODEL, 1)
    assert sorted(p.name for p in read) == ["model.onnx", "model.toml"], read  # each served file read once
    assert not staged.exists() and (served / "model.onnx").read_bytes() == b"x" * 4096
    assert ctx.state.models[MODEL].pending is not None and ctx.state.models[MODEL].pending.step == "activate"


def test_other_files_under_a_kept_number_are_refused_after_one_reading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctx, m, _ = _case(tmp_path, b"y" * 4096)
    read = _count_hashes(monkeypatch)
    assert install.replaces_kept(ctx, MODEL, ctx.state.models[MODEL], m) is not None
    assert len(read) <= 2, read  # the first differing file ends the reading; never once per kept entry
    assert (ctx.repo.version_dir(MODEL, 1) / "model.onnx").read_bytes() == b"x" * 4096
