"""Test-only fault injection: die with SIGKILL at a named step of an update. Off unless a variable is set.

``EDGED_SYNC_FAULT_POINT=<point>`` kills the process the first time it reaches ``point``.
``EDGED_SYNC_FAULT_FILE=<path>`` does the same for the point named in that file, and
deletes the file first, so one long-running process can be armed again and again and a
restarted one does not die at the same place. A point may be written ``name:N`` to die at
its N-th occurrence (e.g. ``download.chunk:3``). The points are listed in :data:`POINTS`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading

FAULT_ENV = "EDGED_SYNC_FAULT_POINT"
FAULT_FILE_ENV = "EDGED_SYNC_FAULT_FILE"

POINTS: tuple[str, ...] = (
    "download.start", "download.chunk", "download.file", "verify.done", "prepare.done", "install.renamed",
    "activate.before", "activate.loaded", "trial.start", "trial.tick", "commit.before", "commit.saved",
    "rollback.before", "rollback.loaded",
)

_counts: dict[str, int] = {}
_lock = threading.Lock()


def _matches(spec: str, name: str) -> bool:
    spec = spec.strip()
    point, _, nth = spec.partition(":")
    if point != name:
        return False
    with _lock:  # counted per spec, so arming a new spec starts from zero
        _counts[spec] = _counts.get(spec, 0) + 1
        return _counts[spec] >= (int(nth) if nth.isdigit() else 1)


def fault_point(name: str) -> None:
    """Reached a named step: die here if a test asked for it."""
    if (spec := os.environ.get(FAULT_ENV)) and _matches(spec, name):
        os.kill(os.getpid(), signal.SIGKILL)
    path = os.environ.get(FAULT_FILE_ENV)
    if not path:
        return
    try:
        with open(path, encoding="utf-8") as f:
            spec = f.read()
    except OSError:
        return
    if spec and _matches(spec, name):
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.kill(os.getpid(), signal.SIGKILL)


def reset() -> None:
    with _lock:
        _counts.clear()
