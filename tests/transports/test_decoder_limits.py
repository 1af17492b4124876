"""Issue #20 item 4 as the attack: tiny requests that declare huge tensors, against a real ``edged run``.

The daemon must refuse them from the bytes it holds, before allocating what they declare. The
memory bound reads the daemon's own peak RSS (``VmHWM``), which counts even a transient allocation;
the blocking bound is ``/v2/health/live`` probed from another connection all the while.
"""

from __future__ import annotations

import http.client
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest

from edged.protocol import mqtt as codec
from tests.conftest import device_config
from tests.edged_process import QUICK_CHOICE_EDGED, edged_run, engines_settled
from tests.http_helpers import copy_models
from tests.memory_attacks import peak_rss, reset_peak_rss
from tests.mqtt_helpers import Broker, TestClient, running_broker
from tests.netutil import free_port
from tests.polling import wait_until

pytestmark = pytest.mark.timeout(180)

HEALTH_BOUND_S = 0.250  # allocating what such a request declares blocks the loop for seconds
RSS_BOUND = 10 * 2**20


def bytes_attack(count: int, rid: str = "") -> tuple[bytes, int]:
    """A binary v2 body: a BYTES input declaring ``count`` elements, followed by one 4-byte element."""
    header = orjson.dumps({"id": rid, "inputs": [{"name": "pixels", "datatype": "BYTES", "shape": [count],
                                                  "parameters": {"binary_data_size": 4}}]})
    return header + b"\0\0\0\0", len(header)


@dataclass
class Daemon:
    proc: subprocess.Popen[bytes]
    port: int
    broker: Broker
    log: Path


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One daemon for the module (starting one and waiting for its engine choice is most of the time)."""
    tmp = tmp_path_factory.mktemp("decoder-limits")
    port = free_port()
    with running_broker(tmp / "broker") as broker:
        cfg = device_config(tmp, copy_models(tmp / "models", "digits"), f"""
            [http]
            listen = "127.0.0.1:{port}"
            [mqtt]
            url = "{broker.url}"
            [telemetry]
            enabled = false
            [logging]
            level = "warning"
            """)
        log = tmp / "edged.log"
        # Ready, and done choosing its engine: loading candidates to measure them would count as the attack's RSS
        # (a brief choice: how long it measures is nothing to these tests).
        with edged_run(cfg, log, lambda: engines_settled(port, "digits"), timeout=120,
                       transient=(OSError,), edged=QUICK_CHOICE_EDGED) as proc:
            yield Daemon(proc, port, broker, log)


class HealthProbe:
    """``GET /v2/health/live`` in a loop on its own keep-alive connection; records each latency."""

    def __init__(self, port: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="health-probe", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                self.conn.request("GET", "/v2/health/live")
                r = self.conn.getresponse()
                r.read()
                if r.status != 200:
                    self.failures.append(f"status {r.status}")
            except OSError as e:
                self.failures.append(repr(e))
                return
            self.latencies.append(time.monotonic() - t0)
            self._stop.wait(0.002)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(15)
        self.conn.close()


def attack_rounds(port: int, attack: Callable[[], None], what: str) -> None:
    """Run ``attack`` while probing health; up to three rounds for the latency bound.

    A decoder that allocates what a request declares blocks the loop for seconds in every round;
    a 2-core machine shared with other work can delay one probe past the bound now and then, but not
    in three rounds running. The peak RSS counts every round.
    """
    worst: list[float] = []
    for _ in range(3):
        with HealthProbe(port) as probe:
            wait_until(lambda: len(probe.latencies) >= 5, 30, 0.01, "health probes before the attack")
            attack()
            n = len(probe.latencies) + 5
            wait_until(lambda n=n: len(probe.latencies) >= n, 30, 0.01, "health probes after the attack")
        assert not probe.failures, probe.failures
        assert len(probe.latencies) > 10
        worst.append(max(probe.latencies))
        if worst[-1] < HEALTH_BOUND_S:
            break
    print(f"{what}: /v2/health/live max per round {', '.join(f'{w * 1e3:.1f} ms' for w in worst)}")
    assert worst[-1] < HEALTH_BOUND_S, worst


def test_tiny_request_declaring_2_31_elements_is_400_without_memory_or_blocking(daemon: Daemon) -> None:
    assert len(bytes_attack(2**31)[0]) == 118  # the request from the issue
    conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=10)
    for _ in range(20):  # warm the paths the attack takes, so the peak below is the attack's own
        conn.request("POST", "/v2/models/digits/infer", body=bytes_attack(1)[0],
                     headers={"Inference-Header-Content-Length": str(bytes_attack(1)[1])})
        conn.getresponse().read()
    reset_peak_rss(daemon.proc.pid)
    before = peak_rss(daemon.proc.pid)

    def attack() -> None:
        for count in (2**31, 2**29, 2**40, 2**31 * 3):
            b, h = bytes_attack(count)
            for _ in range(5):
                t0 = time.monotonic()
                conn.request("POST", "/v2/models/digits/infer", body=b,
                             headers={"Inference-Header-Content-Length": str(h)})
                r = conn.getresponse()
                reply = orjson.loads(r.read())
                assert r.status == 400, reply
                assert "BYTES elements" in reply["error"] and str(count) in reply["error"], reply
                assert time.monotonic() - t0 < 5

    attack_rounds(daemon.port, attack, "HTTP attack (20 requests a round)")
    conn.close()
    growth = peak_rss(daemon.proc.pid) - before
    print(f"HTTP attack: peak RSS growth {growth / 2**20:.2f} MiB")
    assert growth < RSS_BOUND, f"peak RSS grew {growth / 2**20:.1f} MiB"


def test_tiny_mqtt_payloads_declaring_huge_tensors_get_error_replies(daemon: Daemon) -> None:
    client = TestClient(daemon.broker.port).wait_connected()
    try:
        client.subscribe("edged/test-device/reply/attack")
        reset_peak_rss(daemon.proc.pid)
        before = peak_rss(daemon.proc.pid)

        def attack() -> None:
            for i, count in enumerate((2**31, 2**29, 2**40)):
                header = orjson.dumps({"id": f"a{i}", "reply_to": "edged/test-device/reply/attack", "inputs": [
                    {"name": "pixels", "datatype": "BYTES", "shape": [count],
                     "parameters": {"binary_data_size": 4}}]})
                payload = codec.PREFIX.pack(len(header)) + header + b"\0\0\0\0"
                assert len(payload) < 176  # 160 before the reply topic moved into edged/<device>/reply/
                client.publish("edged/test-device/infer/digits", payload, qos=1)
                msg = client.get(timeout=5)
                _, head, _ = codec.split(msg.payload, None)
                reply = orjson.loads(head)
                assert reply["code"] == "invalid_argument" and reply["id"] == f"a{i}", reply
                assert "BYTES elements" in reply["error"], reply

        attack_rounds(daemon.port, attack, "MQTT attack (3 payloads a round)")
        growth = peak_rss(daemon.proc.pid) - before
        print(f"MQTT attack: peak RSS growth {growth / 2**20:.2f} MiB")
        assert growth < RSS_BOUND, f"peak RSS grew {growth / 2**20:.1f} MiB"
    finally:
        client.close()
