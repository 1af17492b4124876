"""Exact served-request counts at the registry: real daemons (``edged run`` under a test service manager with
a watchdog), a real ``edged-registry serve``, a clean restart and a kill -9 (issue 40, items 1 and 2)."""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import EDGED
from tests.http_client import web
from tests.netutil import free_port
from tests.registry_helpers import ADMIN_TOKEN, Keys, RegistryServer, wait_for
from tests.systemd_helpers import NotifyListener, start_edged

DEVICE = "count-dev"


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[RegistryServer]:
    keys = Keys.make(tmp_path / "keys")
    server = RegistryServer(tmp_path / "reg", [keys.public]).start()
    yield server
    server.stop()


def _admin(url: str, method: str, path: str, **kw: Any) -> Any:
    r = web().request(method, url + path, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30, **kw)
    assert r.status_code in (200, 201), r.text
    return r.json()


def _config(tmp_path: Path, repo: Path, registry: RegistryServer, http_port: int) -> Path:
    token = _admin(registry.url, "POST", "/api/v1/enrollment-tokens", json={"uses": 1})["token"]
    cfg = tmp_path / "edged.toml"
    # One telemetry sample a minute: a kill -9 between two samples is what the counter journal is for.
    cfg.write_text(f"""
[device]
id = "{DEVICE}"
state_dir = "{tmp_path / 'state'}"
runtime_dir = "{tmp_path / 'run'}"
model_repository = "{repo}"
profile = "x86-64-cpu"
[http]
listen = "127.0.0.1:{http_port}"
[mqtt]
enabled = false
[shm]
enabled = false
[registry]
enabled = true
url = "{registry.url}"
enrollment_token = "{token}"
public_keys = ["{registry.public_keys[0]}"]
poll_interval_s = 0.5
[telemetry]
interval_s = 60
upload_interval_s = 0.2
""")
    return cfg


class Daemon:
    """``edged run`` with NOTIFY_SOCKET and WATCHDOG_USEC set, as systemd starts the packaged unit."""

    def __init__(self, tmp_path: Path, cfg: Path, port: int) -> None:
        self.tmp_path, self.cfg, self.port = tmp_path, cfg, port
        self.runs = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.listener: NotifyListener | None = None

    def start(self) -> NotifyListener:
        self.runs += 1
        self.listener = NotifyListener(self.tmp_path / f"notify-{self.runs}")
        # A watchdog of 0.2 s: a probe through every model each 0.1 s, hundreds of them over the test.
        self.proc = start_edged([*EDGED, "run", "--config", str(self.cfg)], self.listener.path,
                                watchdog_usec=200_000, log=self.tmp_path / f"edged-{self.runs}.log")
        listener, proc = self.listener, self.proc
        wait_for(lambda: proc.poll() is not None or any(m.fields.get("READY") == "1" for m in listener.snapshot()),
                 120, 0.05, "READY=1")
        assert proc.poll() is None, (self.tmp_path / f"edged-{self.runs}.log").read_text()[-3000:]
        ready = self.listener.wait_for("READY", "1")
        self.listener.wait_for("WATCHDOG", "1", after=ready)
        return self.listener

    def send(self, n: int) -> None:
        x = np.zeros((1, 64), dtype=np.float32)
        body = {"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1, 64], "data": x.ravel().tolist()}]}
        for _ in range(n):
            r = web().post(f"http://127.0.0.1:{self.port}/v2/models/digits/infer", json=body, timeout=30)
            assert r.status_code == 200, r.text

    def pings(self) -> int:
        assert self.listener is not None
        return sum(1 for m in self.listener.snapshot() if m.fields.get("WATCHDOG") == "1")

    def end(self, sig: int) -> None:
        assert self.proc is not None and self.listener is not None
        self.proc.send_signal(sig)
        self.proc.wait(60)
        self.listener.close()

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        if self.listener is not None:
            self.listener.close()


def _journaled(tmp_path: Path) -> int:
    """Successes of digits in the last whole line of the daemon's counter journal (0 when it has none)."""
    from edged.telemetry.counter_journal import JOURNAL_FILE, CounterJournal

    line = CounterJournal(tmp_path / "state" / JOURNAL_FILE).last()
    return sum(m.success for m in line.models if m.model == "digits") if line else 0


def _registry_success(url: str) -> tuple[int, int]:
    """(successes the registry stored for digits v1 from this device, samples carrying them)."""
    points = _admin(url, "GET", "/api/v1/models/digits/telemetry",
                    params={"version": 1, "device_id": DEVICE, "limit": 10000})["points"]
    return sum(int(p["success"]) for p in points), len(points)


def test_registry_counts_exactly_the_clients_requests_across_restart_watchdog_and_kill(
        tmp_path: Path, model_repo: Callable[..., Path], registry: RegistryServer) -> None:
    repo = model_repo("digits")
    port = free_port()
    daemon = Daemon(tmp_path, _config(tmp_path, repo, registry, port), port)
    try:
        daemon.start()
        daemon.send(25)
        wait_for(lambda: daemon.pings() >= 10, 30, 0.05, "watchdog probes")
        daemon.end(signal.SIGTERM)  # a clean stop: its last sample covers everything

        daemon.start()
        daemon.send(40)
        wait_for(lambda: daemon.pings() >= 10, 30, 0.05, "watchdog probes")
        # the kill comes once the counter journal (written within a second) holds the 40 (the first run had 25)
        wait_for(lambda: _journaled(tmp_path) >= 40, 30, 0.05, "the 40 requests in the counter journal")
        daemon.end(signal.SIGKILL)  # no last sample: only the counter journal has these 40

        daemon.start()  # replays the journal into the buffer and uploads it
        wait_for(lambda: _registry_success(registry.url)[0] >= 65, 60, 0.2, "the counts to reach the registry")
        wait_for(lambda: daemon.pings() >= 5, 30, 0.05, "watchdog probes")
        total, samples = _registry_success(registry.url)
        assert total == 25 + 40, f"registry counted {total} requests in {samples} samples"
        log = (tmp_path / "edged-3.log").read_text()
        assert "recovered from the counter journal" in log, log[-3000:]
        # The daemon's own requests are counted apart, not lost: /v2 statistics show them by source.
        stats = web().get(f"http://127.0.0.1:{port}/v2/models/digits/versions/1/stats", timeout=10).json()
        entry = stats["model_stats"][0]
        assert entry["inference_stats"]["success"]["count"] == 0
        assert entry["internal_requests"].get("self-test") == 1 and entry["internal_requests"].get("watchdog", 0) >= 1
    finally:
        daemon.close()


def test_journal_replay_is_idempotent_and_a_later_sample_wins(tmp_path: Path, model_repo: Callable[..., Path],
                                                              write_config: Callable[..., Path]) -> None:
    """A crash after the replay (before the journal was emptied) adds nothing again; a stop's sample adds the rest."""
    import asyncio
    import shutil

    from edged.config import ModelsSection, load_config
    from edged.core.manager import ModelManager
    from edged.core.service import InferenceService
    from edged.profiles import BackendPreference
    from edged.protocol.types import InferRequest
    from edged.telemetry.agent import TelemetryAgent
    from edged.telemetry.counter_journal import JOURNAL_FILE
    from edged.telemetry.upload import UploadSettings

    cfg = load_config(write_config(model_repo("digits"), "[telemetry]\ninterval_s = 3600\n"))
    nowhere = UploadSettings(url=f"http://127.0.0.1:{free_port()}", state_dir=cfg.device.state_dir,
                             interval_s=3600, timeout_s=1)
    journal = cfg.device.state_dir / JOURNAL_FILE
    managers: list[ModelManager] = []

    def run(requests: int) -> TelemetryAgent:
        """A daemon start: fresh statistics, an agent over the same state dir, then some requests."""
        mgr = ModelManager(cfg.device.model_repository, ModelsSection(),
                           [BackendPreference(backend="onnxruntime", device="CPU", precisions=["fp32"])])
        managers.append(mgr)
        mgr.load_all()
        svc = InferenceService(mgr)
        a = TelemetryAgent(cfg, svc, upload=nowhere, status_interval_s=3600)
        asyncio.run(a.start())
        for _ in range(requests):
            svc.infer_blocking(InferRequest("digits", {"pixels": np.zeros((1, 64), np.float32)}))
        return a

    def die(a: TelemetryAgent) -> None:
        """Its threads end without a stop's last sample or journal clean-up (as a process killed would leave
        things); the upload thread is woken too, so it does not outlive the test waiting out its interval."""
        a._stop.set()
        a._wake_upload.set()

    def buffered(a: TelemetryAgent) -> int:
        assert a.buffer is not None
        return sum(m.get("success", 0) for _, body in a.buffer.peek(1000, 1 << 24).items
                   for m in json.loads(body).get("models", []))

    try:
        first = run(6)
        first.journal_now()
        die(first)  # the process dies: no stop, no last sample
        saved = tmp_path / "journal.copy"
        shutil.copy(journal, saved)
        second = run(0)
        assert buffered(second) == 6 and journal.stat().st_size == 0
        die(second)
        shutil.copy(saved, journal)  # it died before emptying the journal: the same line is replayed again
        third = run(4)
        assert buffered(third) == 6, "the replayed line was counted twice"
        asyncio.run(third.stop())  # a clean stop: its last sample holds its 4
        fourth = run(0)
        assert buffered(fourth) == 10
        asyncio.run(fourth.stop())
    finally:
        for mgr in managers:
            mgr.shutdown()
