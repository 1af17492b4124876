"""Daemon lifecycle faults under a (test) service manager: signals that arrive while edged is busy starting.

As in test_systemd: the test binds the notify socket, passes it in NOTIFY_SOCKET to a real
``edged run`` and reads what arrives; the daemon's log says what it did.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest

from edged.errors import EdgedError
from tests.conftest import EDGED
from tests.polling import wait_until
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
    # The warm-up input is also the self-test's: two seconds of work on this machine, whatever its speed (the
    # SIGTERM follows the self-test's STATUS within milliseconds).
    n = max(2000, int(2.0 / spin_seconds_per_iteration(d)))
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


# A load far longer than the stop may take: its warm-up alone runs LOAD_S on this machine, as a big model's load
# or an engine build does on a device. SIGTERM must end edged within STOP_BOUND_S all the same.
LOAD_S = 30.0
STOP_BOUND_S = 5.0


def _slow_model(repo: Path, name: str) -> None:
    d = make_spin_model(repo, name=name)
    n = max(20_000, int(LOAD_S / spin_seconds_per_iteration(d)))
    np.savez(d / "warmup.npz", n=np.array([n], dtype=np.int64))


def _log_says(proc: subprocess.Popen[bytes], log: Path, text: str) -> None:
    def seen() -> bool:
        assert proc.poll() is None, f"edged exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
        return text in log.read_text()
    wait_until(seen, 120, what=f"{text!r} in the log")


def _cpu_s(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def _in_the_engine(proc: subprocess.Popen[bytes], log: Path, since: float) -> None:
    """Until the process has run a second of CPU since ``since`` (the load began): for this model, whose
    session opens in milliseconds, the warm-up is then running inside the engine, a call Python cannot
    interrupt."""
    wait_until(lambda: _cpu_s(proc.pid) - since >= 1.0, 60, what="the warm-up inside the engine")
    assert "model=slow version=1 ready" not in log.read_text()


def _stops_promptly(proc: subprocess.Popen[bytes], log: Path) -> None:
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(STOP_BOUND_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"edged still ran {STOP_BOUND_S:g} s after SIGTERM (its model load takes ~{LOAD_S:g} s):\n"
                    f"{log.read_text()[-3000:]}")
    assert code == 0, log.read_text()[-3000:]
    print(f"SIGTERM to exit: {time.monotonic() - t0:.2f} s")


def _sigterm_inside_the_load(proc: subprocess.Popen[bytes], log: Path) -> None:
    """Once the slow model's load is under way and its warm-up inside the engine: SIGTERM, and a prompt exit."""
    _log_says(proc, log, "model=slow version=1 loading")
    _in_the_engine(proc, log, _cpu_s(proc.pid))
    _stops_promptly(proc, log)


def test_sigterm_while_a_model_loads_at_start_stops_at_once(tmp_path: Path, listener: NotifyListener) -> None:
    """SIGTERM while edged loaded its models at start: it waited for the whole load and warm-up (minutes for
    a big model or an engine build on a device) before STOPPING=1, and systemd's TimeoutStopSec killed it."""
    repo = tmp_path / "models"
    _slow_model(repo, "slow")
    log = tmp_path / "edged.log"
    proc = start_edged([*EDGED, "run", "--config", str(service_config(tmp_path, repo, NO_TRANSPORTS))], listener.path,
                       log=log)
    try:
        _sigterm_inside_the_load(proc, log)
    finally:
        if proc.poll() is None:
            proc.kill()
    listener.wait_for("STOPPING", "1", timeout=5)
    assert not any("READY" in m.fields for m in listener.snapshot())
    text = log.read_text()
    assert "edged stopped" in text, text
    assert "model=slow version=1 ready" not in text, text
    assert "edged exits without waiting for the abandoned model load" in text, text  # the warm-up was running


def test_sigterm_while_a_reload_loads_a_model_stops_at_once(tmp_path: Path, listener: NotifyListener) -> None:
    """SIGTERM while SIGHUP loaded a new model: edged waited for that model's whole load and warm-up."""
    repo = tmp_path / "models"
    make_spin_model(repo)  # warm-up n = 1: READY at once
    log = tmp_path / "edged.log"
    proc = start_edged([*EDGED, "run", "--config", str(service_config(tmp_path, repo, NO_TRANSPORTS))], listener.path,
                       log=log)
    try:
        ready = listener.wait_for("READY", "1", timeout=180)
        _slow_model(repo, "slow")
        proc.send_signal(signal.SIGHUP)
        reloading = listener.wait_for("RELOADING", "1", after=ready)
        _sigterm_inside_the_load(proc, log)
    finally:
        if proc.poll() is None:
            proc.kill()
    stopping = listener.wait_for("STOPPING", "1", after=reloading, timeout=5)
    assert not any("READY" in m.fields for m in listener.snapshot()[reloading:stopping]), listener.snapshot()
    text = log.read_text()
    assert "edged stopped" in text, text
    assert "model=slow version=1 ready" not in text, text
    assert "a model load is still inside its engine; releasing the versions served without waiting" in text, text


def test_sigterm_while_the_repository_api_loads_a_model_stops_at_once(tmp_path: Path,
                                                                       listener: NotifyListener) -> None:
    """SIGTERM while a load asked for over the repository API (or by fleet sync) ran: the HTTP transport's
    graceful stop waited 10 s for that request, and the load itself ran on the event loop's worker pool,
    which the interpreter's exit joined, waiting out the whole warm-up."""
    import threading

    from edged.client.http import HttpClient

    repo = tmp_path / "models"
    make_spin_model(repo)  # warm-up n = 1: READY at once
    sock = tmp_path / "http.sock"
    extra = f'[http]\nlisten = "unix:{sock}"\n[mqtt]\nenabled = false\n[shm]\nenabled = false\n'
    log = tmp_path / "edged.log"
    proc = start_edged([*EDGED, "run", "--config", str(service_config(tmp_path, repo, extra))], listener.path, log=log)
    answers: list[int] = []
    try:
        listener.wait_for("READY", "1", timeout=180)
        _slow_model(repo, "slow")

        def load() -> None:  # the daemon's own user over its Unix socket: trusted to load
            with contextlib.suppress(EdgedError, OSError), HttpClient(str(sock), timeout=120) as c:
                answers.append(c.request("POST", "/v2/repository/models/slow/load", [b"{}"]).status)
        caller = threading.Thread(target=load, daemon=True)
        caller.start()
        _sigterm_inside_the_load(proc, log)
        caller.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert "edged stopped" in text, text
    assert "model=slow version=1 ready" not in text, text
    assert answers == [503], f"the load's caller got {answers} (503 at once: edged is stopping)"
    assert "edged exits without waiting for the abandoned model load" in text, text
