"""The daemon's last few log lines, kept in memory, for a failed update's report to the registry.

An operator looking at a rollback on the dashboard needs what the device itself said around
it (the model that would not load, the golden check that failed) without a shell on the
device. A :class:`LogRing` is a logging handler that keeps the last records' text in a
bounded deque: no I/O, no formatting beyond the message, one append per record.
:meth:`LogRing.tail` gives them back within the protocol's bounds
(:data:`~edged.protocol.fleet.messages.MAX_LOG_LINES` and friends), control characters
stripped, each line capped, newest kept when the byte budget runs out.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from edged.protocol.fleet.messages import CONTROL_RE, MAX_LOG_BYTES, MAX_LOG_LINE, MAX_LOG_LINES

KEEP = 200  # records kept; a report takes the last MAX_LOG_LINES of them


class LogRing(logging.Handler):
    def __init__(self, keep: int = KEEP) -> None:
        super().__init__(logging.INFO)
        self._records: deque[tuple[float, str, str, str]] = deque(maxlen=keep)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
        except Exception:  # a bad format string must not lose the record, nor raise into the caller
            text = str(record.msg)
        if record.exc_info and record.exc_info[1] is not None:
            e = record.exc_info[1]
            text += f" ({type(e).__name__}: {e})"
        self._records.append((record.created, record.levelname, record.name, text))

    def tail(self, lines: int = MAX_LOG_LINES, max_bytes: int = MAX_LOG_BYTES) -> list[str]:
        """The last ``lines`` records as text, oldest first, within ``max_bytes`` (UTF-8) in all."""
        out: list[str] = []
        used = 0
        for created, level, name, text in reversed(list(self._records)[-lines:]):
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created))
            line = CONTROL_RE.sub(" ", f"{stamp}Z {level} {name}: {text}")[:MAX_LOG_LINE]
            size = len(line.encode())
            if used + size > max_bytes:
                break
            out.append(line)
            used += size
        out.reverse()
        return out


def install(logger: logging.Logger | None = None) -> LogRing:
    """The ring on ``logger`` (default: the root logger), added once per process and shared after that."""
    target = logger or logging.getLogger()
    for h in target.handlers:
        if isinstance(h, LogRing):
            return h
    ring = LogRing()
    target.addHandler(ring)
    return ring
