"""Local storage faults during an update, named by their real cause.

A read-only repository, a full disk or a permission problem is the device's, not the
release's: it is reported to the registry as such, kept in the sync state so ``edged
status`` shows a failure (not a step in progress), logged as one line per attempt, and
retried with the agent's back-off (:mod:`edged.backoff`) rather than every poll.
"""

from __future__ import annotations

import errno

from edged.errors import EdgedError, ErrorCode

_CAUSES = {
    errno.EROFS: "read-only file system",
    errno.ENOSPC: "disk full",
    errno.EDQUOT: "disk quota exceeded",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
}
_HINTS = {
    errno.EROFS: "the model repository must be on a writable file system ([device] model_repository; the "
                 "packaged unit serves <state_dir>/models)",
    errno.ENOSPC: "free space on the file system of the model repository",
    errno.EDQUOT: "free space or raise the quota of the daemon's user",
    errno.EACCES: "the daemon's user needs write access to the model repository",
    errno.EPERM: "the daemon's user needs write access to the model repository",
}


class LocalFaultError(EdgedError):
    """An update step failed on this device's storage; the release itself may be fine."""

    code = ErrorCode.UNAVAILABLE


def describe(e: OSError, step: str) -> str:
    """``"read-only file system: /x/.staging (during download); <what to do>"``."""
    cause = _CAUSES.get(e.errno or 0) or (e.strerror or type(e).__name__).lower()
    where = f": {e.filename}" if e.filename else ""
    hint = _HINTS.get(e.errno or 0)
    return f"{cause}{where} (during {step})" + (f"; {hint}" if hint else "")
