"""Crash-safe file writes (a device may lose power at any instant), and private runtime folders."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
import tempfile
from pathlib import Path

from edged.errors import UnsafePathError


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


def make_private_dir(path: Path) -> None:
    """Create ``path`` and its missing parents 0700 whatever the umask, and take group and other
    access off ``path`` itself when it is ours (for data at rest: a server's database, blobs)."""
    missing = []
    folder = Path(os.path.abspath(path))
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(folder, 0o700)
        os.chmod(folder, 0o700)
    _tighten(path)


def private_file(path: Path) -> None:
    """Create ``path`` empty and 0600 whatever the umask if missing; else take group and other access off it
    when it is ours."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        _tighten(path)


def _tighten(path: Path) -> None:
    st = os.stat(path)
    if st.st_uid == os.geteuid() and st.st_mode & 0o077:
        os.chmod(path, stat.S_IMODE(st.st_mode) & 0o700)


def ensure_private_dir(path: Path, what: str) -> None:
    """Make ``path`` (missing folders 0700) where nobody but this user and root can swap what is inside.

    Checked before anything is created: every existing folder on the way must belong to root or
    this user and be writable by group or others only when sticky (``/tmp``); a symbolic link on
    the way must belong to root or this user. ``path`` itself must belong to this user and be
    writable by nobody else. So ``/tmp/edged-<uid>`` made in advance by another user is refused
    instead of trusted, and nothing is ever created inside it.
    """
    uid = os.geteuid()
    path = Path(os.path.abspath(path))
    existing = path
    while not os.path.lexists(existing):
        existing = existing.parent
    for folder in [existing, *existing.parents]:
        _check_folder(folder, uid, what, final=folder == path)
    for folder in reversed([path, *path.parents][: len(path.parts) - len(existing.parts)]):
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            pass  # made meanwhile by someone: checked below like any other
        _check_folder(folder, uid, what, final=folder == path)


def _check_folder(folder: Path, uid: int, what: str, *, final: bool) -> None:
    try:
        st = os.lstat(folder)
        if stat.S_ISLNK(st.st_mode):
            if st.st_uid not in (0, uid):
                raise UnsafePathError(f"{what}: {folder} is a symbolic link owned by uid {st.st_uid}, not by root or "
                                      f"this user (uid {uid}); refusing to use it")
            st = os.stat(folder)
    except FileNotFoundError:
        raise UnsafePathError(f"{what}: {folder} vanished while it was being checked") from None
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePathError(f"{what}: {folder} is not a directory")
    if final and st.st_uid != uid:
        raise UnsafePathError(f"{what}: {folder} is owned by uid {st.st_uid}, not by this user (uid {uid}); "
                              "someone else made it: remove it or choose another [device] runtime_dir")
    if st.st_uid not in (0, uid):
        raise UnsafePathError(f"{what}: {folder} is owned by uid {st.st_uid}, not by root or this user (uid {uid}); "
                              "remove it or choose another [device] runtime_dir")
    writable_by_others = st.st_mode & 0o022
    if writable_by_others and (final or not st.st_mode & stat.S_ISVTX):
        raise UnsafePathError(f"{what}: {folder} is writable by {'others' if st.st_mode & 0o002 else 'its group'} "
                              f"(mode {stat.S_IMODE(st.st_mode):o}); refusing to use it")


def sha256_file(path: Path, *, chunk_size: int = 1 << 20) -> str:
    """Hex SHA-256 of a file, read in chunks (model files can be larger than the memory to spare)."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(chunk_size):
            h.update(chunk)
    return h.hexdigest()
