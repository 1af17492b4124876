"""Daemon lifecycle faults under a (test) service manager: signals that arrive while edged is busy starting.

As in test_systemd: the test binds the notify socket, passes it in NOTIFY_SOCKET to a real
``edged run`` and reads what arrives; the daemon's log says what it did.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import EDGED
from tests.systemd_helpers import (
    NO_TRANSPORTS,
    NotifyListener,
    make_spin_model,
    service_config,
    spin_seconds_per_iteration,
    start_edged,
)


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[NotifyListener]:
    lst = NotifyListener(tmp_path / "notify.sock")
    yield lst
    lst.close()


def test_sigterm_during_the_self_test_ends_it_and_stops(tmp_path: Path, listener: NotifyListener) -> None:
    """SIGTERM while the start-up self-test waited on a slow model: edged went on testing (up to
    SELF_TEST_TIMEOUT_S = 60 s a version, past the unit's TimeoutStopSec = 30) before it stopped."""
    repo = tmp_path / "models"
    d = make_spin_model(repo)
    # The warm-up input is also the self-test's: a few seconds of work on this machine, whatever its speed.
    n = max(2000, int(3.0 / spin_seconds_per_iteration(d)))
    np.savez(d / "warmup.npz", n=np.array([n], dtype=np.int64))
    proc = start_edged([*EDGED, "run", "--config", str(service_config(tmp_path, repo, NO_TRANSPORTS))], listener.path,
                       log=tmp_path / "edged.log")
    try:
        testing = listener.wait_for("STATUS", "self-test of 1 model version(s) on profile test-cpu", timeout=180)
        proc.send_signal(signal.SIGTERM)
        listener.wait_for("STOPPING", "1", after=testing, timeout=120)
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not any("READY" in m.fields for m in listener.snapshot())
    log = (tmp_path / "edged.log").read_text()
    assert "self-test stopped: edged is stopping" in log, log  # with the version's name unless not begun yet
    assert "self-test passed" not in log and "self-test failed" not in log, log


def test_sigterm_during_a_reload_ends_it_without_ready(tmp_path: Path, listener: NotifyListener) -> None:
    """SIGTERM while SIGHUP loaded a slow new model: edged self-tested it anyway and said READY=1
    (after the SIGTERM) before it stopped."""
    repo = tmp_path / "models"
    make_spin_model(repo)  # warm-up n = 1: READY at once
    proc = start_edged([*EDGED, "run", "--config", str(service_config(tmp_path, repo, NO_TRANSPORTS))], listener.path,
                       log=tmp_path / "edged.log")
    try:
        ready = listener.wait_for("READY", "1", timeout=180)
        d = make_spin_model(repo, name="slow")
        n = max(2000, int(3.0 / spin_seconds_per_iteration(d)))
        np.savez(d / "warmup.npz", n=np.array([n], dtype=np.int64))  # its load and its self-test: seconds each
        proc.send_signal(signal.SIGHUP)
        reloading = listener.wait_for("RELOADING", "1", after=ready)
        proc.send_signal(signal.SIGTERM)
        stopping = listener.wait_for("STOPPING", "1", after=reloading, timeout=120)
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not any("READY" in m.fields for m in listener.snapshot()[reloading:stopping]), listener.snapshot()
    log = (tmp_path / "edged.log").read_text()
    assert "model=slow version=1 self-test passed" not in log, log
