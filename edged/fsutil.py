"""Crash-safe file writes: a device may lose power at any instant."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write to a temp file in the same folder, fsync it, rename over ``path``, fsync the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str, mode: int = 0o644) -> None:
    atomic_write_bytes(path, text.encode("utf-8"), mode)


def fsync_tree(root: Path) -> None:
    """fsync every file and folder under ``root`` (deepest first), then ``root`` itself."""
    for path in sorted(root.rglob("*"), reverse=True):
        if path.is_symlink():
            continue
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        elif path.is_dir():
            fsync_dir(path)
    fsync_dir(root)


def publish_dir(tmp: Path, final: Path) -> None:
    """Make the fully written folder ``tmp`` appear as ``final`` with one rename, durably.

    ``tmp`` must be a sibling of ``final`` (same file system). Its contents are fsynced
    first, so after a power loss ``final`` is either absent, the previous folder, or
    complete. An existing ``final`` is moved aside to a hidden sibling and removed
    afterwards (put back if the rename fails).
    """
    fsync_tree(tmp)
    old: Path | None = None
    if final.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
        old.rmdir()
        final.rename(old)
    try:
        tmp.rename(final)
    except BaseException:
        if old is not None:
            with contextlib.suppress(OSError):
                old.rename(final)
        raise
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
