"""systemd integration: the notify protocol driven for real, the journal wire format, the unit files.

The notify tests play the service manager: they bind the AF_UNIX datagram socket, pass it
in NOTIFY_SOCKET (and WATCHDOG_USEC) to a real ``edged run`` and read what arrives.
"""

from __future__ import annotations

import array
import io
import json
import logging
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from edged.journal import JournalHandler, encode_native, running_under_journal
from edged.logs import bind, log_fields, setup_logging
from edged.systemd.notify import Notifier, watchdog_interval
from tests.conftest import EDGED, REPO_ROOT
from tests.netutil import free_port
from tests.systemd_helpers import (
    NO_TRANSPORTS,
    NotifyListener,
    make_nan_model,
    make_spin_model,
    service_config,
    start_edged,
)

UNIT = REPO_ROOT / "packaging" / "systemd" / "edged.service"
DROPINS = REPO_ROOT / "packaging" / "systemd" / "dropins"


# ---- the notify client ------------------------------------------------------------------------

@pytest.fixture
def listener(tmp_path: Path) -> Iterator[NotifyListener]:
    lst = NotifyListener(tmp_path / "notify.sock")
    yield lst
    lst.close()


def test_notifier_speaks_the_datagram_protocol(listener: NotifyListener) -> None:
    n = Notifier({"NOTIFY_SOCKET": str(listener.path)})
    assert n.enabled and n.backend == "socket"
    n.status("loading")
    n.ready("serving\nREADY=1")  # a status text cannot inject a second assignment
    n.watchdog()
    n.reloading()
    n.stopping("bye")
    listener.wait_for("STOPPING")
    got = [m.fields for m in listener.snapshot()]
    assert got[0] == {"STATUS": "loading"}
    assert got[1] == {"READY": "1", "STATUS": "serving READY=1"}
    assert got[2] == {"WATCHDOG": "1"}
    assert got[3]["RELOADING"] == "1" and int(got[3]["MONOTONIC_USEC"]) > 0
    assert got[4] == {"STOPPING": "1", "STATUS": "bye"}
    n.close()


def test_notifier_reaches_an_abstract_socket() -> None:
    name = f"edged-test-{os.getpid()}-{time.monotonic_ns()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name.encode())
    sock.settimeout(5)
    try:
        Notifier({"NOTIFY_SOCKET": "@" + name}).ready()
        assert sock.recv(100) == b"READY=1"
    finally:
        sock.close()


@pytest.mark.parametrize("backend", ["socket", "systemd-python"])
def test_a_manager_socket_that_went_away_is_reported_not_raised(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    """The daemon stopped with ConnectionRefusedError (and a C++ abort) when the notify socket had
    gone by its STOPPING message: systemd-python raises where sd_notify returns an error."""
    if backend == "systemd-python":
        pytest.importorskip("systemd.daemon", reason="systemd-python is not installed")
    path = tmp_path / "gone.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    n = Notifier(None, prefer_libsystemd=backend == "systemd-python")
    assert n.backend == backend
    assert n.status("loading") is True
    sock.close()  # the manager's end is gone (the path stays: sendto is refused)
    assert n.stopping("bye") is False
    assert n.watchdog() is False


def test_notifier_outside_systemd_is_a_no_op() -> None:
    n = Notifier({})
    assert not n.enabled and n.ready() is False and n.watchdog() is False


def test_watchdog_interval_follows_sd_watchdog_enabled() -> None:
    assert watchdog_interval({}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "0"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "junk"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 30.0
    assert watchdog_interval({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())}) == 2.0
    assert watchdog_interval({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "1"}) is None  # meant for another process


# ---- the journal ------------------------------------------------------------------------------

def _parse_native(data: bytes) -> dict[str, str]:
    fields, i = {}, 0
    while i < len(data):
        nl = data.index(b"\n", i)
        line = data[i:nl]
        if b"=" in line:
            k, v = line.split(b"=", 1)
            fields[k.decode()] = v.decode()
            i = nl + 1
        else:
            (size,) = struct.unpack("<Q", data[nl + 1:nl + 9])
            fields[line.decode()] = data[nl + 9:nl + 9 + size].decode()
            assert data[nl + 9 + size:nl + 10 + size] == b"\n"
            i = nl + 10 + size
    return fields


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[tuple[socket.socket, logging.Logger, JournalHandler]]:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(str(tmp_path / "journal.sock"))
    server.settimeout(5)
    handler = JournalHandler(socket_path=str(tmp_path / "journal.sock"))
    logger = logging.getLogger(f"edged.test.journal.{tmp_path.name}")
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    yield server, logger, handler
    logger.removeHandler(handler)
    handler.close()
    server.close()


def test_journal_records_carry_model_version_and_request_fields(
        journal: tuple[socket.socket, logging.Logger, JournalHandler]) -> None:
    server, logger, handler = journal
    assert handler.backend == "native"
    logger.warning("slow answer for %s", "cam-7", extra=log_fields(model="mobilenet", version=3, request_id="r-42"))
    f = _parse_native(server.recv(65536))
    assert f["MESSAGE"] == "slow answer for cam-7"
    assert (f["MODEL"], f["VERSION"], f["REQUEST_ID"]) == ("mobilenet", "3", "r-42")
    assert f["PRIORITY"] == "4" and f["SYSLOG_IDENTIFIER"] == "edged" and f["LOGGER"] == logger.name

    # The older text style gets the same fields, and its text is unchanged.
    logger.info("model=%s version=%s ready on %s", "digits", 1, "onnxruntime/CPU/fp32")
    f = _parse_native(server.recv(65536))
    assert f["MESSAGE"] == "model=digits version=1 ready on onnxruntime/CPU/fp32"
    assert (f["MODEL"], f["VERSION"], f["PRIORITY"]) == ("digits", "1", "6")
    assert "REQUEST_ID" not in f

    bind(logger, model="digits", version=2).error("engine failed")
    f = _parse_native(server.recv(65536))
    assert (f["MODEL"], f["VERSION"], f["PRIORITY"]) == ("digits", "2", "3")


def test_journal_keeps_multi_line_messages_whole(journal: tuple[socket.socket, logging.Logger, JournalHandler]) -> None:
    server, logger, _ = journal
    try:
        raise ValueError("bad tensor")
    except ValueError:
        logger.exception("inference failed", extra=log_fields(model="digits", version=1))
    f = _parse_native(server.recv(65536))
    assert f["MESSAGE"].startswith("inference failed\nTraceback")
    assert "ValueError: bad tensor" in f["MESSAGE"] and f["MODEL"] == "digits"
    assert encode_native({"A": "x\ny"}) == b"A\n" + struct.pack("<Q", 3) + b"x\ny\n"


def test_journal_sends_a_record_too_big_for_a_datagram_as_a_sealed_memfd(
        journal: tuple[socket.socket, logging.Logger, JournalHandler]) -> None:
    server, logger, _ = journal
    big = "x" * 300_000
    logger.info("payload %s", big)
    fds = array.array("i")
    msg, anc, _flags, _addr = server.recvmsg(16, socket.CMSG_SPACE(fds.itemsize))
    assert msg == b""
    (level, kind, data), = anc
    assert (level, kind) == (socket.SOL_SOCKET, socket.SCM_RIGHTS)
    fds.frombytes(data[:fds.itemsize])
    try:  # journald reads the whole memfd from offset 0, as does this
        f = _parse_native(os.pread(fds[0], os.fstat(fds[0]).st_size, 0))
    finally:
        os.close(fds[0])
    assert f["MESSAGE"].startswith("payload xxx") and f["MESSAGE"].endswith("[truncated]")


def test_journal_detection_follows_journal_stream_and_invocation_id(tmp_path: Path) -> None:
    with (tmp_path / "stream").open("w") as fh:
        st = os.fstat(fh.fileno())
        assert running_under_journal({"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}, fh.fileno())
        assert not running_under_journal({"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino + 1}"}, fh.fileno())
        assert not running_under_journal({"JOURNAL_STREAM": "garbage"}, fh.fileno())
        assert running_under_journal({"INVOCATION_ID": "0123abcd"}, fh.fileno())
        assert not running_under_journal({}, fh.fileno())


def test_stderr_lines_show_fields_the_text_does_not() -> None:
    out = io.StringIO()
    try:
        assert setup_logging("info", stream=out) == "stderr"
        log = logging.getLogger("edged.test.stderr")
        log.info("queue full", extra=log_fields(model="digits", version=1, request_id="abc"))
        log.info("model=%s version=%s ready", "digits", 1, extra=log_fields(model="digits", version=1))
    finally:
        setup_logging("warning", stream=io.StringIO())
    first, second = out.getvalue().splitlines()
    assert first.endswith("queue full [model=digits version=1 request_id=abc]")
    assert second.endswith("model=digits version=1 ready")


def test_stderr_logging_writes_to_the_stderr_of_the_moment(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stderr swapped after setup (and the old one closed) must not turn every record into a logging error."""
    first, second = io.StringIO(), io.StringIO()
    log = logging.getLogger("edged.test.swap")
    try:
        monkeypatch.setattr(sys, "stderr", first)
        assert setup_logging("info", journal=False) == "stderr"
        log.info("to the first")
        first_text = first.getvalue()
        first.close()
        monkeypatch.setattr(sys, "stderr", second)
        log.info("to the second")
    finally:
        setup_logging("warning", stream=io.StringIO())
    assert first_text.rstrip().endswith("to the first")
    assert second.getvalue().rstrip().endswith("to the second") and "Logging error" not in second.getvalue()


# ---- edged run under a (test) service manager -------------------------------------------------



def _statuses(listener: NotifyListener) -> list[str]:
    return [m.fields["STATUS"] for m in listener.snapshot() if "STATUS" in m.fields]


def test_ready_only_after_the_self_test_then_reload_and_clean_stop(
        tmp_path: Path, model_repo: Callable[..., Path], listener: NotifyListener) -> None:
    repo = model_repo("digits")
    make_nan_model(repo)  # loads and warms up, but answers NaN: only the self-test catches it
    cfg = service_config(tmp_path, repo, NO_TRANSPORTS)
    proc = start_edged([*EDGED, "run", "--config", str(cfg)], listener.path, watchdog_usec=2_000_000,
                       log=tmp_path / "edged.log")
    try:
        ready = listener.wait_for("READY", "1", timeout=120)
        msgs = listener.snapshot()
        before = [m.fields.get("STATUS", "") for m in msgs[:ready]]
        assert [s.split(" ")[0] for s in before if s] == ["probing", "self-test", "starting"], before
        assert not any("WATCHDOG" in m.fields for m in msgs[:ready])
        # The READY status is computed after the self-test: the NaN model is already out of service.
        assert msgs[ready].fields["STATUS"].startswith("serving 1 model version(s) (1 unavailable)")
        first_ping = listener.wait_for("WATCHDOG", "1", after=ready)

        # SIGHUP: [models] and [logging] apply live, [http] needs a restart and says so.
        cfg.write_text(cfg.read_text().replace("[http]\nenabled = false", "[http]\nenabled = false\n"
                                               "listen = \"127.0.0.1:9\"") +
                       "[models]\ndisabled = [\"nan\"]\n[logging]\nlevel = \"debug\"\n")
        proc.send_signal(signal.SIGHUP)
        reloading = listener.wait_for("RELOADING", "1", after=first_ping)
        again = listener.wait_for("READY", "1", after=reloading)
        assert listener.messages[again].fields["STATUS"].startswith("serving 1 model version(s) on")
        listener.wait_for("WATCHDOG", "1", after=again)

        proc.send_signal(signal.SIGTERM)
        stopping = listener.wait_for("STOPPING", "1", after=again)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    log = (tmp_path / "edged.log").read_text()
    assert "model=nan version=1 self-test failed" in log and "NaN" in log
    assert "config [http] changed: that needs a restart" in log
    assert "model nan: unloading" in log and "logging level is now debug" in log
    assert not any("WATCHDOG" in m.fields for m in listener.snapshot()[stopping:])


def _infer_spin(port: int, n: int, out: dict[str, object]) -> None:
    body = json.dumps({"inputs": [{"name": "n", "datatype": "INT64", "shape": [1], "data": [n]}]}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v2/models/spin/infer", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            out["status"], out["body"] = resp.status, json.loads(resp.read())
    except Exception as e:
        out["error"] = e
    out["done_at"] = time.monotonic()


def _wait_in_flight(port: int, model: str, client: threading.Thread, timeout: float = 30) -> None:
    """Until the daemon's statistics show the client's request in flight.

    The watchdog probe also passes through the model, but an idle engine answers it in
    milliseconds: in flight on three polls in a row (0.1 s and more) is the client's request.
    """
    deadline = time.monotonic() + timeout
    seen = 0
    while seen < 3:
        assert client.is_alive(), "the request finished before it was seen in flight"
        assert time.monotonic() < deadline, f"no request in flight on {model} after {timeout:.0f} s"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/models/{model}/stats", timeout=10) as resp:
            stats = json.loads(resp.read())["model_stats"]
        seen = seen + 1 if sum(int(s.get("in_flight", 0)) for s in stats) >= 1 else 0
        time.sleep(0.05)


def test_watchdog_pings_stop_while_inference_hangs_and_sigterm_finishes_in_flight_requests(
        tmp_path: Path, model_repo: Callable[..., Path], listener: NotifyListener) -> None:
    pytest.importorskip("edged.transports.http.transport", reason="the HTTP transport carries the client's request")
    repo = model_repo("digits")
    make_spin_model(repo)
    port = free_port()
    cfg = service_config(tmp_path, repo, f'[http]\nlisten = "127.0.0.1:{port}"\n[mqtt]\nenabled = false\n'
                                  '[shm]\nenabled = false\n')
    interval = 1.0
    proc = start_edged([*EDGED, "run", "--config", str(cfg)], listener.path, watchdog_usec=int(interval * 1e6),
                       log=tmp_path / "edged.log")
    try:
        ready = listener.wait_for("READY", "1", timeout=120)
        # One spin request is to keep the model's only engine instance busy for ~7 s: measure it in edged, over a
        # few tenths of a second, so that a moment of load on a shared machine cannot shrink the hang below 5 s
        # (which costs a second hang, twice as long).
        calib: dict[str, object] = {}
        t0 = time.monotonic()
        _infer_spin(port, 3000, calib)
        assert calib.get("status") == 200, calib
        n = max(2000, int(7.0 * 3000 / (time.monotonic() - t0)))
        i = ready
        for _ in range(3):  # healthy: pinging
            i = listener.wait_for("WATCHDOG", "1", after=i + 1)

        # A client's long inference occupies the engine: the probe on that model cannot answer.
        for _attempt in range(4):
            first: dict[str, object] = {}
            hang_at = time.monotonic()
            _infer_spin(port, n, first)
            assert first.get("status") == 200, first
            done_at = float(first["done_at"])  # type: ignore[arg-type]
            if done_at - hang_at > 5 * interval:
                break
            # This machine is shared and its speed varies: busy the engine longer and look again.
            n = int(n * max(2.0, 7.0 / (done_at - hang_at)))
            listener.wait_for("WATCHDOG", "1", after=len(listener.snapshot()), timeout=10)
        assert done_at - hang_at > 5 * interval, (first, n)
        pings = [m.at for m in listener.snapshot() if m.fields.get("WATCHDOG") == "1"]
        # Stopped within two intervals of the hang and stayed stopped while the engine was busy (systemd
        # would have acted). The answer reaches this client a little after the engine is free again and
        # the pings resume, so the window ends one interval before the client has it.
        during = [t - hang_at for t in pings if hang_at + 2 * interval < t < done_at - interval]
        assert not during, (during, done_at - hang_at)
        # ... and resumed once the engine answered again.
        listener.wait_for("WATCHDOG", "1", after=len(listener.snapshot()), timeout=10)

        # SIGTERM with a request in flight (~2 s of work, seen in flight within a few tenths of a second, well
        # inside the 20 s drain): it finishes and is answered, then edged exits 0.
        second: dict[str, object] = {}
        n = max(1000, int(n * 2.0 / (done_at - hang_at)))
        t = threading.Thread(target=_infer_spin, args=(port, n, second), daemon=True)
        t.start()
        _wait_in_flight(port, "spin", t)
        before_term = len(listener.snapshot())
        proc.send_signal(signal.SIGTERM)
        listener.wait_for("STOPPING", "1", after=before_term, timeout=10)
        assert proc.wait(60) == 0
        t.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert second.get("status") == 200, second
    body = second["body"]
    assert isinstance(body, dict) and body["model_name"] == "spin"
    (out,) = body["outputs"]
    assert out["name"] == "y" and np.isfinite(out["data"]).all()
    log = (tmp_path / "edged.log").read_text()
    assert "watchdog: not pinging systemd" in log and "spin v1: no answer" in log
    assert "pinging resumed" in log
    assert re.search(r"finishing [1-9]\d* in-flight request\(s\)", log)


# ---- the unit and its companions ---------------------------------------------------------------

needs_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                   reason="systemd-analyze is not installed (Debian: apt-get install systemd)")


def _exposure(unit_dir: Path, root: Path | None = None) -> float:
    argv = ["systemd-analyze", "security", "--offline=yes", "--no-pager"]
    argv += [f"--root={root}", "edged.service"] if root else [str(unit_dir / "edged.service")]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    line = next(x for x in r.stdout.splitlines() if "Overall exposure level" in x)
    return float(line.split(":")[1].split()[0])


@needs_analyze
@pytest.mark.parametrize("dropin", [None, *sorted(p.name for p in DROPINS.glob("*.conf"))])
def test_unit_exposure_is_two_or_lower(tmp_path: Path, dropin: str | None) -> None:
    unit_dir = tmp_path / "etc" / "systemd" / "system"
    unit_dir.mkdir(parents=True)
    shutil.copy(UNIT, unit_dir / "edged.service")
    if dropin:
        (unit_dir / "edged.service.d").mkdir()
        shutil.copy(DROPINS / dropin, unit_dir / "edged.service.d" / "50-profile.conf")
    score = _exposure(unit_dir, tmp_path)
    print(f"systemd-analyze security exposure ({dropin or 'base unit'}): {score}")
    assert score <= 2.0


@needs_analyze
@pytest.mark.parametrize("dropin", [None, *sorted(p.name for p in DROPINS.glob("*.conf"))])
def test_unit_verifies_clean(tmp_path: Path, dropin: str | None) -> None:
    # verify checks that ExecStart= exists: point it at this checkout's edged instead of /opt/edged.
    edged = shutil.which("edged", path=str(REPO_ROOT / ".venv" / "bin")) or shutil.which("edged")
    if edged is None:
        pytest.skip("no edged executable to stand in for /opt/edged/bin/edged")
    text = UNIT.read_text().replace("/opt/edged/bin/edged", edged)
    (tmp_path / "edged.service").write_text(text)
    if dropin:
        (tmp_path / "edged.service.d").mkdir()
        shutil.copy(DROPINS / dropin, tmp_path / "edged.service.d" / "50-profile.conf")
    env = dict(os.environ, SYSTEMD_UNIT_PATH=f"{tmp_path}:", SYSTEMD_LOG_LEVEL="notice")
    r = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "edged.service")], capture_output=True,
                       text=True, env=env, timeout=60)
    assert r.returncode == 0 and r.stdout == "" and r.stderr == "", r.stdout + r.stderr


def test_unit_keeps_the_contract_the_daemon_relies_on() -> None:
    keys: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            k, v = line.split("=", 1)
            keys.setdefault(k, []).append(v)
    assert keys["Type"] == ["notify"] and keys["NotifyAccess"] == ["main"]
    assert keys["Restart"] == ["on-failure"] and "StartLimitBurst" in keys
    assert int(keys["WatchdogSec"][0]) > 0
    # edged drains for STOP_DRAIN_S after SIGTERM: the unit must wait longer than that.
    from edged.daemon import STOP_DRAIN_S
    assert int(keys["TimeoutStopSec"][0]) > STOP_DRAIN_S
    assert keys["User"] == ["edged"] and keys["CapabilityBoundingSet"] == [""]
    assert keys["RestrictAddressFamilies"] == ["AF_UNIX AF_INET AF_INET6"]
    assert keys["DevicePolicy"] == ["closed"] and keys["RuntimeDirectoryMode"] == ["0750"]


@pytest.mark.skipif(shutil.which("systemd-sysusers") is None or shutil.which("systemd-tmpfiles") is None,
                    reason="systemd-sysusers/systemd-tmpfiles are not installed")
def test_sysusers_and_tmpfiles_create_the_user_and_folders(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "group").write_text("video:x:44:\nrender:x:105:\n")
    subprocess.run(["systemd-sysusers", f"--root={root}", str(REPO_ROOT / "packaging/sysusers.d/edged.conf")],
                   check=True, capture_output=True, timeout=60)
    passwd = {line.split(":")[0]: line.split(":") for line in (root / "etc/passwd").read_text().splitlines()}
    groups = {line.split(":")[0]: line.split(":") for line in (root / "etc/group").read_text().splitlines()}
    assert passwd["edged"][5] == "/var/lib/edged" and passwd["edged"][6].endswith("nologin")
    assert int(passwd["edged"][2]) < 1000  # a system user
    assert "edged" in groups["video"][3].split(",") and "edged" in groups["render"][3].split(",")
    subprocess.run(["systemd-tmpfiles", f"--root={root}", "--create",
                    str(REPO_ROOT / "packaging/tmpfiles.d/edged.conf")], check=True, capture_output=True, timeout=60)
    uid = int(passwd["edged"][2])
    for d in ("var/lib/edged", "var/lib/edged/cache", "run/edged"):
        st = (root / d).stat()
        assert (st.st_uid, st.st_mode & 0o777) == (uid, 0o750), d
