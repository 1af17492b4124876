"""The sync state's report numbers: unique for the device id across lost states, and never sent before saved."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from edged.protocol.fleet.messages import MAX_COUNT, ReportBatch, ReportEvent
from edged.sync.outbox import ReportOutbox
from edged.sync.state import STATE_FILE, StateStore, SyncState, fresh_seq


def test_a_fresh_state_numbers_its_reports_above_any_earlier_life(tmp_path: Path) -> None:
    """An earlier state counted its reports from 1 (or from its own start); the registry ignores numbers it
    holds already, so a state that starts over must start above them: missing and corrupt alike."""
    StateStore(tmp_path).save(SyncState(seq=10_000_000))  # an earlier life that reported ten million times
    (tmp_path / STATE_FILE).write_text('{"seq": "corrupt"}')
    corrupt = StateStore(tmp_path).load()
    assert list(tmp_path.glob(f"{STATE_FILE}.corrupt-*")), "the corrupt state is kept aside"
    missing = StateStore(tmp_path).load()
    assert corrupt.seq > 10_000_000 and missing.seq > 10_000_000
    assert fresh_seq(1_700_000_000.25) == 1_700_000_000_250_000  # microseconds of the wall clock
    # never past what the protocol carries, even with a clock far ahead: room for 2^40 reports
    assert fresh_seq(1e12) + 2**40 <= MAX_COUNT
    ReportEvent(seq=fresh_seq(1e12) + 2**40, model="m", step="failed", at=0.0)
    assert fresh_seq(-5) == 0


class _Registry:
    """Takes every batch and remembers the numbers it was sent."""

    def __init__(self) -> None:
        self.seqs: list[int] = []

    def request(self, method: str, path: str, *, body: bytes) -> tuple[int, dict[str, str], bytes]:
        self.seqs += [e.seq for e in ReportBatch.model_validate_json(body).events]
        return 200, {}, b'{"accepted": 1}'


def test_a_report_is_sent_only_once_its_number_is_saved(tmp_path: Path) -> None:
    """A report saved with the poll's other changes waits for that save: a number sent and then lost in a
    crash would be given to another report, which the registry would ignore as a repeat."""
    store = StateStore(tmp_path)
    state = store.load()
    store.save(state)
    registry = _Registry()
    auth: Any = registry
    outbox = ReportOutbox(auth, store, state)  # no thread started: each report is sent at once if it may be
    outbox.report("m", "failed", version=1, release=1, reason="refused", later=True)
    first = state.seq
    assert registry.seqs == [] and state.outbox
    # the process dies here: the next life never saw the number, and nobody else did either
    assert StateStore(tmp_path).load().seq == first - 1
    outbox.report("m", "downloading", version=2, release=2)  # a step: saved at once, with what waited
    assert registry.seqs == [first, first + 1] and not state.outbox
    outbox.report("m", "failed", version=1, release=3, reason="refused", later=True)
    store.flush(state)
    assert outbox.flush() and registry.seqs == [first, first + 1, first + 2]
