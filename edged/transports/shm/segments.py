"""Daemon side of client memory: verify a passed memfd, map it, bounds-check ranges, clean up leftovers.

A segment is mapped only after ``F_GET_SEALS`` shows ``F_SEAL_SHRINK`` and
``fstat`` shows exactly the announced size: the client can then never truncate
the file under the mapping, so touching any in-bounds byte cannot SIGBUS the
daemon. memfds have no name in /dev/shm, so nothing is left behind when either
side crashes; :func:`clean_stale_shm` still removes ``edged-*`` files that an
older version or a POSIX-shm fallback could leave there.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import stat
import sys
from pathlib import Path
from typing import Any

import numpy as np

from edged.errors import EdgedError, ErrorCode, InvalidInputError
from edged.protocol import shm as p

log = logging.getLogger(__name__)

STALE_PREFIX = "edged-"
# Python >= 3.13 can map without keeping a duplicate descriptor per segment; older versions keep one.
_NO_FD: dict[str, Any] = {"trackfd": False} if sys.version_info >= (3, 13) else {}


def fds_needed(max_clients: int, max_segments: int) -> int:
    """Descriptors the transport may hold at its limits (a socket per client, one per mapped segment)."""
    return max_clients * (1 + (0 if _NO_FD else max_segments)) + 64


class SegmentError(EdgedError):
    """A segment cannot be registered (not a sealed memfd, wrong size, over a limit)."""

    code = ErrorCode.FAILED_PRECONDITION


class Segment:
    """One client memfd mapped read-write into the daemon."""

    __slots__ = ("busy", "id", "mm", "size")

    def __init__(self, seg_id: int, mm: mmap.mmap, size: int) -> None:
        self.id = seg_id
        self.mm = mm
        self.size = size
        self.busy = 0  # requests in flight that use this segment

    def view(self, dtype: np.dtype[np.generic], shape: tuple[int, ...], offset: int) -> np.ndarray:
        """An ndarray over [offset, offset + nbytes); the caller has checked the range."""
        return p.segment_view(self.mm, dtype, shape, offset)

    def close(self) -> bool:
        """Unmap now; False when views are still alive (then the mapping goes with the last view)."""
        try:
            self.mm.close()
        except BufferError:
            return False
        return True


def check_range(seg: Segment, offset: int, nbytes: int, what: str) -> None:
    """Overflow-safe bounds check (Python integers do not wrap; the order avoids offset + nbytes anyway)."""
    if offset < 0 or nbytes < 0 or offset > seg.size or nbytes > seg.size - offset:
        raise InvalidInputError(
            f"{what}: range offset {offset} + {nbytes} bytes is outside segment {seg.id} ({seg.size} bytes)")


def map_segment(fd: int, size: int, seg_id: int) -> Segment:
    """Verify the fd is a shrink-sealed memfd of ``size`` bytes and map it; does not close ``fd``."""
    if size <= 0:
        raise SegmentError("segment size must be positive")
    try:
        st = os.fstat(fd)
    except OSError:
        raise SegmentError("the passed file descriptor cannot be inspected") from None
    if not stat.S_ISREG(st.st_mode):
        raise SegmentError("the passed file descriptor is not a memory file (use memfd_create)")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise SegmentError("the passed file does not support sealing (use memfd_create with MFD_ALLOW_SEALING)") \
            from None
    if not seals & fcntl.F_SEAL_SHRINK:
        raise SegmentError("the segment must be sealed against shrinking (F_SEAL_SHRINK) before registering")
    # Read the size after the seal check: once sealed it cannot shrink, so this size stays valid.
    st = os.fstat(fd)
    if st.st_size != size:
        raise SegmentError(f"segment size is {st.st_size} bytes, the request announced {size}")
    try:
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE, **_NO_FD)
    except (OSError, ValueError):
        raise SegmentError("the segment cannot be mapped read-write (is it write-sealed?)") from None
    return Segment(seg_id, mm, size)


def clean_stale_shm(directory: Path = Path("/dev/shm"), prefix: str = STALE_PREFIX) -> list[str]:
    """Remove our leftover POSIX shm files: ``edged-*`` owned by us whose creator pid is gone.

    Names are ``edged-<pid>-...``; a file whose pid is still alive belongs to a running
    process and is kept, as is anything another user owns.
    """
    removed: list[str] = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    uid = os.geteuid()
    for e in entries:
        if not e.name.startswith(prefix):
            continue
        try:
            if not e.is_file(follow_symlinks=False) or e.stat(follow_symlinks=False).st_uid != uid:
                continue
        except OSError:
            continue
        pid_part = e.name[len(prefix):].split("-", 1)[0]
        if pid_part.isdigit() and _alive(int(pid_part)):
            continue
        with contextlib.suppress(OSError):
            os.unlink(e.path)
            removed.append(e.name)
    if removed:
        log.info("removed %d stale shared-memory file(s) left by a crashed process", len(removed))
    return removed


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
