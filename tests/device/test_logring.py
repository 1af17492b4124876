"""The daemon's in-memory ring of its last log lines (what a failed update's report carries)."""

from __future__ import annotations

import logging

from edged.logring import LogRing, install
from edged.protocol.fleet.messages import MAX_LOG_BYTES, MAX_LOG_LINE, MAX_LOG_LINES, ReportEvent


def test_the_ring_keeps_the_last_lines_within_the_protocols_bounds() -> None:
    log = logging.getLogger("test.logring")
    log.propagate = False
    ring = LogRing(keep=300)
    log.addHandler(ring)
    log.setLevel(logging.DEBUG)
    try:
        log.debug("below the ring's level")
        for i in range(120):
            log.warning("line %d \x1b[31mred\x1b[0m\nsecond line", i)
        try:
            raise OSError(28, "No space left on device")
        except OSError:
            log.exception("staging failed")
        log.error("%s", "x" * 5000)
        tail = ring.tail()
    finally:
        log.removeHandler(ring)
    assert len(tail) <= MAX_LOG_LINES and sum(len(t.encode()) for t in tail) <= MAX_LOG_BYTES
    assert all(len(t) <= MAX_LOG_LINE and "\x1b" not in t and "\n" not in t for t in tail)
    assert tail[-1].endswith("x" * 50) and " ERROR test.logring: " in tail[-1]  # the newest is kept, capped
    assert "staging failed (OSError: [Errno 28] No space left on device)" in tail[-2]
    assert "line 119" in tail[-3] and "below the ring's level" not in " ".join(tail)
    ReportEvent(seq=1, model="m", step="failed", logs=tail, at=0.0)  # what the ring gives, the protocol takes
    assert ring.tail(lines=3, max_bytes=MAX_LOG_LINE + 10) == tail[-1:]  # the byte budget drops the oldest


def test_install_adds_one_ring_per_logger() -> None:
    target = logging.getLogger("test.logring.install")
    try:
        assert install(target) is install(target)
        assert sum(isinstance(h, LogRing) for h in target.handlers) == 1
    finally:
        for h in list(target.handlers):
            target.removeHandler(h)
