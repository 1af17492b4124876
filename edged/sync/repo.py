"""The device's model repository as sync changes it: staging, atomic install, removal.

Staging lives at ``<repo>/.staging/<model>/<version>-r<release>/`` — inside the repository
so that installing is one ``rename`` on one filesystem, and behind a dot so the repository
scan never sees it. Partial downloads sit in ``.parts/`` of the staging folder, named by
digest, and resume after a crash; only verified files get their real names. A version
folder appears in ``<repo>/<model>/`` only by a rename of a complete, verified folder, so
the repository never holds a partial version. Removal renames into ``<repo>/.trash/``
first, which is emptied at start.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from pathlib import Path

from edged.fsutil import fsync_dir, sha256_file
from edged.protocol.fleet.release import FileEntry

log = logging.getLogger(__name__)

STAGING = ".staging"
TRASH = ".trash"
PARTS = ".parts"


def file_ok(path: Path, entry: FileEntry) -> bool:
    try:
        if not path.is_file() or path.is_symlink() or path.stat().st_size != entry.size:
            return False
        return sha256_file(path) == entry.sha256
    except OSError:
        return False


def folder_matches(folder: Path, files: list[FileEntry]) -> bool:
    """Every file of the release is in ``folder`` with the right size and digest."""
    return folder.is_dir() and all(file_ok(folder / f.path, f) for f in files)


def _fsync_tree(root: Path) -> None:
    for dirpath, _dirs, names in os.walk(root):
        for n in names:
            fd = os.open(os.path.join(dirpath, n), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


class DeviceRepo:
    def __init__(self, root: Path) -> None:
        self.root = root

    def version_dir(self, model: str, version: int) -> Path:
        return self.root / model / str(version)

    def staging_dir(self, model: str, version: int, release: int) -> Path:
        return self.root / STAGING / model / f"{version}-r{release}"

    def parts_dir(self, staged: Path) -> Path:
        return staged / PARTS

    # ---- start-up ---------------------------------------------------------------------------
    def empty_trash(self) -> None:
        trash = self.root / TRASH
        if trash.is_dir():
            shutil.rmtree(trash, ignore_errors=True)

    def clean_staging(self, keep: set[Path]) -> None:
        """Remove staging folders of updates no longer in progress."""
        base = self.root / STAGING
        if not base.is_dir():
            return
        for model_dir in base.iterdir():
            for staged in model_dir.iterdir() if model_dir.is_dir() else []:
                if staged not in keep:
                    shutil.rmtree(staged, ignore_errors=True)
            with contextlib.suppress(OSError):
                model_dir.rmdir()

    # ---- changes ----------------------------------------------------------------------------
    def seal(self, staged: Path) -> None:
        """Make a fully verified staging folder durable and free of partials, ready to be renamed."""
        shutil.rmtree(self.parts_dir(staged), ignore_errors=True)
        _fsync_tree(staged)

    def install(
        self, model: str, version: int, staged: Path, files: list[FileEntry], *, same: bool | None = None
    ) -> None:
        """Move a sealed staging folder into the repository in one rename.

        An existing folder with the same content is kept (the staged copy is dropped);
        one with different content is moved aside first. ``same``: whether it has the same content, when
        the caller hashed it already (only the updater writes here, so the answer still holds).
        """
        target = self.version_dir(model, version)
        if target.exists():
            if same if same is not None else folder_matches(target, files):
                self.drop_staging(staged)
                return
            self._to_trash(target)
        if not staged.is_dir():
            raise FileNotFoundError(f"staged version {staged.name} of {model} is missing")
        created = not target.parent.exists()
        target.parent.mkdir(parents=True, exist_ok=True)
        os.rename(staged, target)
        fsync_dir(target.parent)
        if created:
            fsync_dir(self.root)
        self.drop_staging(staged)

    def drop_staging(self, staged: Path) -> None:
        """Remove a staging folder (if still there) and its model folder once empty."""
        shutil.rmtree(staged, ignore_errors=True)
        with contextlib.suppress(OSError):
            staged.parent.rmdir()

    def remove(self, model: str, version: int) -> None:
        target = self.version_dir(model, version)
        if target.exists():
            self._to_trash(target)
            self.empty_trash()

    def _to_trash(self, path: Path) -> None:
        trash = self.root / TRASH
        trash.mkdir(exist_ok=True)
        aside = trash / f"{path.parent.name}.{path.name}.{time.monotonic_ns()}"
        os.rename(path, aside)
        fsync_dir(path.parent)
