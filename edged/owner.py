"""One owner of a device's state folder: the lock a daemon takes before it touches update state.

Why first: a second ``edged run`` on the same state folder used to get as far as the crash-loop
check (counting its own start against the trial, rewriting a stale copy of the state file) before
a transport refused it; three such refused starts rolled a healthy release back. An advisory
``flock`` on ``<state_dir>/edged.lock`` is released by the kernel whenever the owner exits, however
it exits, so a crash never leaves a stale lock behind.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from pathlib import Path

from edged.errors import EdgedError, ErrorCode

LOCK_FILE = "edged.lock"


class StateOwnedError(EdgedError):
    code = ErrorCode.UNAVAILABLE


class StateOwner:
    """Holds the state folder's lock for as long as it is open."""

    def __init__(self, fd: int, path: Path) -> None:
        self.fd = fd
        self.path = path

    def close(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)  # closing the last descriptor releases the flock
            self.fd = -1


def claim_state_dir(state_dir: Path) -> StateOwner:
    """Take ``state_dir``'s lock or raise :class:`StateOwnedError`; reads and writes nothing else there."""
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = state_dir / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise EdgedError(f"cannot open the state lock {path}: {e.strerror}", code=ErrorCode.FAILED_PRECONDITION) \
            from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = _holder(fd)
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise StateOwnedError(
                f"another edged{f' (pid {holder})' if holder else ''} already owns the device state in "
                f"{state_dir}; refusing to start (nothing there was read or changed)") from None
        raise EdgedError(f"cannot lock {path}: {e.strerror}", code=ErrorCode.FAILED_PRECONDITION) from None
    # The holder's pid, for the refusal message only: the lock itself is what decides.
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return StateOwner(fd, path)


def _holder(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
