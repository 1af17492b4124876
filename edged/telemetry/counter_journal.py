"""The counter journal: what the telemetry buffer has not got yet, on disk within a second.

A telemetry sample goes into the buffer every ``[telemetry] interval_s`` (60 s by default), so a
kill -9 between two samples used to lose everything counted since the last one. While anything
changes, the agent appends one line a second to ``<state_dir>/telemetry/counters.journal``: the
model windows a sample taken at that moment would carry, and ``after``, the buffer sequence number
of the last sample already taken. Each line is one ``write`` on an ``O_APPEND`` descriptor followed
by one ``fsync`` (the batch is the second's worth of counting), and the file is emptied after every
sample, so it holds at most ``interval_s`` lines.

At the next start the last whole line is replayed. When no sample was buffered after it (the
buffer's last seq is still ``after``) its windows become one sample of the run that died;
otherwise a later sample already holds them. Either way the buffer's last seq then lies past
``after``, so replaying the same line again (a crash during the replay) adds nothing: counts are
never doubled, and at most the last second before the kill is lost.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from edged.protocol.fleet.telemetry import ModelWindow

log = logging.getLogger(__name__)

JOURNAL_FILE = "telemetry/counters.journal"
JOURNAL_INTERVAL_S = 1.0
# Read at most this much of the file's end at start: a line for a few hundred models fits many times over.
MAX_TAIL_BYTES = 4 << 20


class JournalLine(BaseModel):
    """One line: a sample as it would have been taken at ``t``, after buffer sample ``after``."""

    model_config = ConfigDict(extra="ignore")
    run: str = Field(max_length=64)
    after: int = Field(ge=0)
    t: float
    uptime_s: float = Field(ge=0)
    window_s: float = Field(ge=0)
    models: list[ModelWindow] = Field(default_factory=list, max_length=1000)


class CounterJournal:
    """Append-only between two samples; ``clear`` after each sample. Not thread-safe: the agent serialises it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = None
        self._last: bytes | None = None  # the content of the last line written (to skip repeats)

    def last(self) -> JournalLine | None:
        """The last whole, valid line (a line torn by the crash is skipped), or None."""
        try:
            with self.path.open("rb") as f:
                size = f.seek(0, os.SEEK_END)
                f.seek(max(0, size - MAX_TAIL_BYTES))
                data = f.read()
        except FileNotFoundError:
            return None
        lines = data.split(b"\n")[:-1]  # what follows the last newline was never completed
        for raw in reversed(lines):
            try:
                return JournalLine.model_validate_json(raw)
            except ValidationError:
                continue
        return None

    def _open(self) -> int:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        return self._fd

    def write(self, line: JournalLine) -> bool:
        """Append ``line`` and fsync it, unless it says what the previous line said; True when written."""
        content = line.model_dump_json(exclude={"t", "uptime_s", "window_s"}, exclude_none=True).encode()
        if content == self._last:
            return False
        fd = self._open()
        os.write(fd, line.model_dump_json(exclude_none=True).encode() + b"\n")
        os.fsync(fd)
        self._last = content
        return True

    def clear(self) -> None:
        """Everything journalled is in the buffer now: start over (appends go on at the new end)."""
        os.ftruncate(self._open(), 0)
        self._last = None

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
