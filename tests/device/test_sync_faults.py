"""Fault injection: the daemon is SIGKILLed at every step of an update, 54 times.

After each kill: the repository holds only whole, signed versions and the state names
one to serve; after the restart the daemon serves a signed version that is committed or
on trial, and the update is finished (committed) or rolled back (a bad version).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.registry_helpers import FaultHarness


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultHarness]:
    h = FaultHarness(tmp_path_factory.mktemp("faults"), seed=1234)
    yield h
    h.close()


@pytest.mark.slow
@pytest.mark.timeout(900)  # 54 daemon restarts: ~120 s on a quiet 2-core VM, 430 s at load 14
def test_sigkill_at_every_step_of_54_updates(harness: FaultHarness) -> None:
    plan = harness.plan(cycles=3, random_runs=6)
    assert len(plan) >= 50
    for point, delay, bad in plan:
        try:
            harness.run(point, delay=delay, bad=bad)
        except AssertionError as e:
            log = Path(harness.daemon.log_path).read_text(errors="replace")[-4000:]
            raise AssertionError(f"run {len(harness.runs) + 1} ({point or 'random'}, bad={bad}): {e}\n{log}") from e
    runs = harness.runs
    killed = sum(1 for r in runs if r.killed)
    assert len(runs) >= 50 and killed >= 48, (len(runs), killed)
    assert {r.outcome for r in runs} == {"committed", "rolled-back"}
    # a download killed mid-file resumed from where it stopped
    assert harness.resumed_downloads() >= 3
