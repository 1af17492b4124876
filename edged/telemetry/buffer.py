"""Store-and-forward buffer for telemetry samples: SQLite (WAL) in the state dir, bounded in size.

Samples wait here until the registry acknowledges them, so neither a network outage nor
a daemon restart loses any. When the buffer would grow past its budget the oldest
samples go first; how many is counted (persistently) and reported with the next upload
and on ``/metrics``.

Sizing: each row is charged its compressed body plus a fixed overhead, against the
budget less what the WAL and the schema may take; the WAL is checkpointed and truncated
well before it could outgrow its share. The files on disk therefore stay within
``[telemetry] buffer_mb`` (a test holds this under a long outage).

Durability: WAL with ``synchronous=NORMAL`` keeps every committed sample across a
process crash or restart; a power cut may lose the last few seconds, never the file.
"""

from __future__ import annotations

import sqlite3
import threading
import time
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path

ROW_OVERHEAD = 48  # bytes per row beyond its body: record header, rowid, cell pointer
PAGE_FILL = 0.85  # b-tree leaves are not packed full
FIXED_PAGES = 6  # schema, table roots, the meta index, free-list trunk
SHM_BYTES = 32 * 1024  # the WAL index file beside the database
WAL_SHARE = 8  # the WAL may take 1/8 of the budget (at least 16 pages) before it is checkpointed and truncated
MIN_CAPACITY = 256 * 1024  # below this the fixed overheads would leave no room for samples

_SCHEMA = """
CREATE TABLE IF NOT EXISTS samples (seq INTEGER PRIMARY KEY, t REAL NOT NULL, size INTEGER NOT NULL,
                                    body BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


@dataclass(frozen=True)
class BufferStats:
    samples: int
    bytes: int  # charged bytes (bodies + row overhead)
    capacity_bytes: int
    dropped_total: int
    dropped_unreported: int
    oldest_t: float | None
    file_bytes: int  # database + WAL on disk


@dataclass(frozen=True)
class Pending:
    """A batch ready to send: raw JSON bodies in sequence order and the drops to report with them."""

    items: list[tuple[int, bytes]]
    dropped: int
    dropped_total: int
    buffer_id: str

    @property
    def last_seq(self) -> int:
        return self.items[-1][0] if self.items else 0


class TelemetryBuffer:
    def __init__(self, path: Path, capacity_bytes: int) -> None:
        self.path = path
        self.capacity_bytes = max(int(capacity_bytes), MIN_CAPACITY)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False, timeout=10)
        try:
            self._setup()
        except BaseException:
            self._db.close()
            raise

    def _setup(self) -> None:
        page = int(self._db.execute("PRAGMA page_size").fetchone()[0])
        wal_bytes = max(self.capacity_bytes // WAL_SHARE, 16 * page)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        # Checkpoint with room to spare: one transaction (insert, drops, meta) adds a few pages past the mark.
        self._db.execute(f"PRAGMA wal_autocheckpoint={max(4, wal_bytes // page - 8)}")
        self._db.execute(f"PRAGMA journal_size_limit={wal_bytes}")
        self._db.executescript(_SCHEMA)
        # What rows may take: the budget less the WAL's share and the fixed pages, at the usual page fill.
        fixed = FIXED_PAGES * page + SHM_BYTES
        self.row_budget = int(max(self.capacity_bytes - wal_bytes - fixed, self.capacity_bytes // 4) * PAGE_FILL)
        with self._tx():
            self.buffer_id = self._meta("buffer_id") or uuid.uuid4().hex
            self._set("buffer_id", self.buffer_id)
        row = self._db.execute("SELECT COUNT(*), COALESCE(SUM(size), 0), COALESCE(MAX(seq), 0) FROM samples").fetchone()
        self._count, self._bytes = int(row[0]), int(row[1]) + ROW_OVERHEAD * int(row[0])
        self._last_seq = max(int(row[2]), int(self._meta("last_seq") or 0))
        self._dropped_total = int(self._meta("dropped_total") or 0)
        self._dropped_unreported = int(self._meta("dropped_unreported") or 0)

    # ---- helpers --------------------------------------------------------------------------------
    def _tx(self) -> sqlite3.Connection:
        """BEGIN now; the connection's context manager commits (or rolls back on an error)."""
        self._db.execute("BEGIN IMMEDIATE")
        return self._db

    def _meta(self, key: str) -> str | None:
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return str(row[0]) if row else None

    def _set(self, key: str, value: object) -> None:
        self._db.execute("INSERT INTO meta(key, value) VALUES(?, ?) "
                         "ON CONFLICT(key) DO UPDATE SET value = excluded.value", (key, str(value)))

    # ---- writing --------------------------------------------------------------------------------
    def next_seq(self) -> int:
        """The sequence number the next :meth:`append` must use (never reused, across restarts too)."""
        with self._lock:
            return self._last_seq + 1

    def append(self, seq: int, body: bytes, t: float | None = None) -> int:
        """Store one sample; returns how many old samples were dropped to make room."""
        blob = zlib.compress(body, 6)
        size = len(blob)
        with self._lock:
            if seq <= self._last_seq:
                raise ValueError(f"telemetry seq {seq} is not after {self._last_seq}")
            dropped = 0
            with self._tx():
                self._db.execute("INSERT INTO samples(seq, t, size, body) VALUES(?, ?, ?, ?)",
                                 (seq, time.time() if t is None else t, size, blob))
                self._bytes += size + ROW_OVERHEAD
                self._count += 1
                while self._bytes > self.row_budget and self._count > 1:
                    rows = self._db.execute("SELECT seq, size FROM samples ORDER BY seq LIMIT 64").fetchall()
                    for old_seq, old_size in rows:
                        if self._bytes <= self.row_budget or self._count <= 1:
                            break
                        self._db.execute("DELETE FROM samples WHERE seq = ?", (old_seq,))
                        self._bytes -= int(old_size) + ROW_OVERHEAD
                        self._count -= 1
                        dropped += 1
                self._last_seq = seq
                self._set("last_seq", seq)
                if dropped:
                    self._dropped_total += dropped
                    self._dropped_unreported += dropped
                    self._set("dropped_total", self._dropped_total)
                    self._set("dropped_unreported", self._dropped_unreported)
            return dropped

    # ---- reading and acknowledging ----------------------------------------------------------------
    def peek(self, max_items: int, max_bytes: int) -> Pending:
        """The oldest samples (at least one if any), up to ``max_items`` and about ``max_bytes`` of JSON."""
        with self._lock:
            rows = self._db.execute("SELECT seq, body FROM samples ORDER BY seq LIMIT ?", (max_items,)).fetchall()
            items: list[tuple[int, bytes]] = []
            total = 0
            for seq, blob in rows:
                body = zlib.decompress(blob)
                if items and total + len(body) > max_bytes:
                    break
                items.append((int(seq), body))
                total += len(body) + 1
            return Pending(items, self._dropped_unreported, self._dropped_total, self.buffer_id)

    def ack(self, last_seq: int, dropped_reported: int) -> int:
        """The registry stored everything up to ``last_seq`` and learnt of ``dropped_reported`` drops."""
        with self._lock, self._tx():
            row = self._db.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM samples WHERE seq <= ?",
                                   (last_seq,)).fetchone()
            self._db.execute("DELETE FROM samples WHERE seq <= ?", (last_seq,))
            self._count -= int(row[0])
            self._bytes -= int(row[1]) + ROW_OVERHEAD * int(row[0])
            self._dropped_unreported = max(0, self._dropped_unreported - dropped_reported)
            self._set("dropped_unreported", self._dropped_unreported)
            return int(row[0])

    def stats(self) -> BufferStats:
        with self._lock:
            oldest = self._db.execute("SELECT MIN(t) FROM samples").fetchone()[0]
            return BufferStats(self._count, self._bytes, self.capacity_bytes, self._dropped_total,
                               self._dropped_unreported, float(oldest) if oldest is not None else None,
                               self.file_bytes())

    def file_bytes(self) -> int:
        total = 0
        for suffix in ("", "-wal", "-shm"):
            try:
                total += Path(str(self.path) + suffix).stat().st_size
            except OSError:
                pass
        return total

    def close(self) -> None:
        with self._lock:
            try:
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            except sqlite3.Error:
                pass
            self._db.close()
