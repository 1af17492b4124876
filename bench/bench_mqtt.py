"""MQTT request/response latency and throughput, next to a plain MQTT echo and the raw engine.

One run, same machine, same local mosquitto:
  1. raw: the engines edged picks for ``digits`` and ``mobilenet`` (same profile), called in-process;
  2. a real ``edged run`` daemon (MQTT only) spawned as a subprocess;
  3. an echo responder (a separate process, paho, replying from its message callback) that answers the
     same request payload with a reply as large as edged's and with the same MQTT 5 properties: the
     broker + client floor.
Requests are MQTT 5 (Response Topic + Correlation Data), QoS 0 unless ``--qos 1``, pipelined at
concurrency 1 and 8 from one client; echo and edged blocks alternate so drift hits both alike.
Goal: edged median at concurrency 1 <= echo median + raw inference + 0.2 ms.

    .venv/bin/python bench/bench_mqtt.py [--requests 2000] [--qos 0]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import paho.mqtt.client as mqtt  # noqa: E402
from paho.mqtt.enums import CallbackAPIVersion  # noqa: E402

from edged.protocol.mqtt import HEADER_LENGTH_PROPERTY  # noqa: E402
from edged.protocol.mqtt_properties import publish_properties  # noqa: E402
from edged.protocol.mqtt_tcp import no_delay  # noqa: E402
from edged.protocol.v2 import dumps  # noqa: E402
from tests.mqtt_helpers import Broker  # noqa: E402

GOAL_MS = 0.2
ECHO_SIZE = "echo-size"
ECHO_CONTENT_TYPE = "echo-content-type"




def _client(port: int, name: str) -> mqtt.Client:
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=name, protocol=mqtt.MQTTv5)
    c.on_socket_open = no_delay  # as edged does: the echo and the driver get the same treatment
    c.connect("127.0.0.1", port, keepalive=60)
    return c


# ---- the echo responder (runs in its own process) ----------------------------------------------
def serve_echo(port: int, model: Path | None = None) -> None:
    """Answers on bench/echo/#; given a model, runs it once before each answer on bench/echo-engine/#
    (bench/floor_engine.py): the least an inference over MQTT can take with paho here."""
    ready = threading.Event()
    run = None
    if model is not None:
        from bench.floor_engine import engine_run

        run = engine_run(model)

    def on_message(c: mqtt.Client, u: Any, msg: mqtt.MQTTMessage) -> None:
        # The reply mirrors edged's: same size, same properties (content type, header length).
        if run is not None:
            run()
        p: Any = msg.properties
        users = dict(p.UserProperty)
        size = int(users.pop(ECHO_SIZE))
        content_type = users.pop(ECHO_CONTENT_TYPE)
        body = bytes(msg.payload[:size]).ljust(size, b" ")
        c.publish(p.ResponseTopic, body, qos=msg.qos, properties=publish_properties(
            correlation=p.CorrelationData, content_type=content_type, user=list(users.items())))

    c = _client(port, "bench-echo" if run is None else "bench-echo-engine")
    c.on_message = on_message
    c.on_subscribe = lambda *a: ready.set()
    c.subscribe("bench/echo/#" if run is None else "bench/echo-engine/#", qos=1)
    c.loop_start()
    ready.wait(10)
    print("ready", flush=True)
    sys.stdin.read()  # until the parent closes our stdin


# ---- the load driver ----------------------------------------------------------------------------

def reply_topic_for(topic: str) -> str:
    """Where replies to a request on ``topic`` go: inside the addressed daemon's reply namespace
    (``edged/<device>/reply/#``, the default ``[mqtt] reply_topics``), so that two daemons with their
    own device ids (bench.ab_trees) both answer; the echo responder's topic keeps ``bench``'s."""
    parts = topic.split("/")
    device = parts[1] if len(parts) >= 3 and parts[0] == "edged" and parts[2] == "infer" else "bench"
    return f"edged/{device}/reply/bench"

class Driver:
    """Keeps ``concurrency`` requests in flight from one paho client; records each round trip."""

    def __init__(self, port: int, qos: int) -> None:
        self.qos = qos
        self.c = _client(port, "bench-driver")
        self.c.suppress_exceptions = True
        self.run_id = 0
        self.c.on_message = self._on_message
        sub = threading.Event()
        self.c.on_subscribe = lambda *a: sub.set()
        self.c.subscribe("edged/+/reply/bench", qos=1)  # each daemon's reply namespace ([mqtt] reply_topics)
        self.c.loop_start()
        assert sub.wait(10)
        self._done = threading.Event()
        self._lock = threading.Lock()
        self.last_reply: mqtt.MQTTMessage | None = None

    def run(self, topic: str, payload: bytes, users: list[tuple[str, str]], *, concurrency: int,
            n: int, timeout: float = 120) -> tuple[list[float], float]:
        self.topic, self.payload, self.users = topic, payload, users
        self.reply_topic = reply_topic_for(topic)
        self.n, self.sent, self.received = n, 0, 0
        self.sent_at: dict[int, int] = {}
        self.lat: list[float] = []
        self.errors = 0
        self.run_id += 1
        self._done.clear()
        t0 = time.perf_counter()
        for _ in range(concurrency):
            self._send()
        if not self._done.wait(timeout):
            raise SystemExit(f"{topic}: only {self.received}/{n} replies arrived")
        elapsed = time.perf_counter() - t0
        if self.errors:
            example = self.last_reply.payload[:200] if self.last_reply else b""
            raise SystemExit(f"{topic}: {self.errors} error replies, e.g. {example!r}")
        return self.lat, n / elapsed

    def _send(self) -> None:
        with self._lock:
            if self.sent >= self.n:
                return
            i = self.sent
            self.sent += 1
        props = publish_properties(response_topic=self.reply_topic, user=self.users,
                                   correlation=(self.run_id << 32 | i).to_bytes(8, "big"))
        self.sent_at[i] = time.perf_counter_ns()
        self.c.publish(self.topic, self.payload, qos=self.qos, properties=props)

    def _on_message(self, c: mqtt.Client, u: Any, msg: mqtt.MQTTMessage) -> None:
        now = time.perf_counter_ns()
        corr = int.from_bytes(msg.properties.CorrelationData, "big")  # type: ignore[union-attr]
        if corr >> 32 != self.run_id:
            return  # a late reply to an earlier run
        self.lat.append((now - self.sent_at.pop(corr & 0xFFFFFFFF)) / 1e6)
        self.last_reply = msg
        if msg.payload[:9] == b'{"error":':
            self.errors += 1
        self.received += 1
        if self.received >= self.n:
            self._done.set()
        else:
            self._send()


@dataclass
class Case:
    label: str
    model: str
    payload: bytes
    users: list[tuple[str, str]]
    raw_ms: float
    reply_size: int = 0
    reply_content_type: str = ""


def stats(lat: list[float]) -> tuple[float, float]:
    s = sorted(lat)
    return statistics.median(s), s[min(len(s) - 1, int(0.99 * len(s)))]


def binary_request(name: str, x: np.ndarray) -> tuple[bytes, list[tuple[str, str]]]:
    header = dumps({"inputs": [{"name": name, "datatype": "FP32", "shape": list(x.shape),
                                "parameters": {"binary_data_size": x.nbytes}}]})
    return header + x.tobytes(), [(HEADER_LENGTH_PROPERTY, str(len(header)))]


def raw_ms(engine: Any, inputs: dict[str, np.ndarray], n: int) -> float:
    for _ in range(50):
        engine.infer(inputs)
    lat = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        engine.infer(inputs)
        lat.append((time.perf_counter_ns() - t0) / 1e6)
    return statistics.median(lat)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000, help="requests per case and concurrency (digits)")
    ap.add_argument("--qos", type=int, choices=[0, 1], default=0)
    ap.add_argument("--rounds", type=int, default=4, help="alternating echo/edged blocks per case")
    ap.add_argument("--broker-nagle", action="store_true",
                    help="leave mosquitto's set_tcp_nodelay at its default (false): QoS 1 round trips then "
                         "often wait 40 ms for delayed ACKs, for the echo as much as for edged")
    ap.add_argument("--profile", default="generic",
                    help="device profile for both the daemon and the raw engine; the default picks one engine "
                         "deterministically (profiles that benchmark candidates may pick differently per process)")
    ap.add_argument("--echo", type=int, help=argparse.SUPPRESS)  # internal: run the echo responder
    ap.add_argument("--echo-engine", type=Path, help=argparse.SUPPRESS)  # internal: ... with this model run
    args = ap.parse_args()
    if args.echo:
        serve_echo(args.echo, args.echo_engine)
        return 0

    tmp = Path(tempfile.mkdtemp(prefix="edged-bench-mqtt-"))
    procs: list[subprocess.Popen[bytes]] = []
    broker = Broker(tmp / "broker", nodelay=not args.broker_nagle).start()
    try:
        for name in ("digits", "mobilenet"):
            shutil.copytree(ROOT / "models" / name, tmp / "models" / name)
        from tests.netutil import free_port

        http_port = free_port()  # only to read the daemon's own engine timings at the end
        cfg_path = tmp / "edged.toml"
        cfg_path.write_text(f"""
[device]
id = "bench"
state_dir = "{tmp / 'state'}"
runtime_dir = "{tmp / 'run'}"
model_repository = "{tmp / 'models'}"
profile = "{args.profile}"
[http]
listen = "127.0.0.1:{http_port}"
[shm]
enabled = false
[telemetry]
enabled = false
[mqtt]
url = "{broker.url}"
[logging]
level = "warning"
""")
        from edged.config import load_config
        from edged.daemon import build_runtime

        rng = np.random.default_rng(0)
        xd = (rng.random((1, 64), dtype=np.float32) * 16).astype(np.float32)
        xm = rng.random((1, 3, 48, 192), dtype=np.float32)

        # 1. raw engine time, measured before the daemon runs so their threads do not compete.
        rt = build_runtime(load_config(cfg_path))
        engines = {}
        for m in ("digits", "mobilenet"):
            mv = rt.manager.table.find(m)
            assert mv is not None and mv.engine is not None, f"{m} did not load"
            engines[m] = (mv.engine, mv.candidate.label if mv.candidate else "?")
        raw_d = raw_ms(engines["digits"][0], {"pixels": xd}, 2000)
        raw_m = raw_ms(engines["mobilenet"][0], {"image": xm}, 1000)
        labels = {m: e[1] for m, e in engines.items()}
        rt.manager.shutdown()
        del rt, engines
        time.sleep(0.2)

        # 2. the daemon and 3. the echo responder.
        exe = ROOT / ".venv" / "bin" / "edged"
        argv = [str(exe)] if exe.exists() else [sys.executable, "-m", "edged"]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        daemon = subprocess.Popen([*argv, "run", "--config", str(cfg_path)], cwd=ROOT, env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        procs.append(daemon)
        echo = subprocess.Popen([sys.executable, __file__, "--echo", str(broker.port)], cwd=ROOT, env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        procs.append(echo)
        assert echo.stdout is not None and echo.stdout.readline().strip() == b"ready"

        driver = Driver(broker.port, args.qos)
        json_d = dumps({"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1, 64], "data": xd.ravel()}]})
        bin_d, users_d = binary_request("pixels", xd)
        bin_m, users_m = binary_request("image", xm)
        cases = [Case("digits  JSON  ", "digits", json_d, [], raw_d),
                 Case("digits  binary", "digits", bin_d, users_d, raw_d),
                 Case("mobilenet binary", "mobilenet", bin_m, users_m, raw_m)]

        deadline = time.monotonic() + 180  # wait until the daemon answers (first start times engines)
        while True:
            try:
                driver.run("edged/bench/infer/digits", json_d, [], concurrency=1, n=1, timeout=1)
                break
            except SystemExit:
                if time.monotonic() > deadline or daemon.poll() is not None:
                    err = daemon.stderr.read().decode() if daemon.stderr and daemon.poll() is not None else ""
                    raise SystemExit(f"edged run did not answer over MQTT\n{err[-2000:]}") from None
        for case in cases:
            driver.run(f"edged/bench/infer/{case.model}", case.payload, case.users, concurrency=1, n=20)
            assert driver.last_reply is not None
            case.reply_size = len(driver.last_reply.payload)
            case.reply_content_type = str(getattr(driver.last_reply.properties, "ContentType", ""))

        print(f"mosquitto on 127.0.0.1 (set_tcp_nodelay {str(not args.broker_nagle).lower()}), MQTT 5, "
              f"QoS {args.qos}; engines: "
              + ", ".join(f"{m} {lab}" for m, lab in labels.items()))
        print(f"{'case':<18}{'conc':>5}{'req B':>8}{'rep B':>7} | {'edged p50':>10}{'p99':>8}{'req/s':>9} | "
              f"{'echo p50':>9}{'req/s':>9} | {'raw':>6} | {'overhead':>9}")
        misses = 0
        for case in cases:
            scale = 1 if case.model == "digits" else 2
            for conc in (1, 8):
                n = max(50, args.requests // scale // args.rounds)
                e_lat: list[float] = []
                d_lat: list[float] = []
                e_tp: list[float] = []
                d_tp: list[float] = []
                echo_users = [*case.users, (ECHO_SIZE, str(case.reply_size)),
                              (ECHO_CONTENT_TYPE, case.reply_content_type)]
                driver.run("bench/echo/x", case.payload, echo_users, concurrency=conc, n=50)  # warm up
                driver.run(f"edged/bench/infer/{case.model}", case.payload, case.users, concurrency=conc, n=50)
                for _ in range(args.rounds):
                    lat, tp = driver.run("bench/echo/x", case.payload, echo_users, concurrency=conc, n=n)
                    e_lat += lat
                    e_tp.append(tp)
                    lat, tp = driver.run(f"edged/bench/infer/{case.model}", case.payload, case.users, concurrency=conc,
                                         n=n)
                    d_lat += lat
                    d_tp.append(tp)
                d50, d99 = stats(d_lat)
                e50, _ = stats(e_lat)
                over = d50 - e50 - case.raw_ms
                verdict = ""
                if conc == 1:
                    ok = over <= GOAL_MS
                    misses += not ok
                    verdict = f"  goal <= {GOAL_MS} ms: {'PASS' if ok else 'MISS'}"
                print(f"{case.label:<18}{conc:>5}{len(case.payload):>8}{case.reply_size:>7} | {d50:>8.3f}ms"
                      f"{d99:>6.2f}ms{statistics.median(d_tp):>9.0f} | {e50:>7.3f}ms{statistics.median(e_tp):>9.0f} | "
                      f"{case.raw_ms:>4.3f} | {over:>7.3f}ms{verdict}")
        print("overhead = edged p50 - echo p50 - raw engine p50 (concurrency 1 is the goal; at 8, batching "
              "and queueing make it a throughput comparison)")
        from edged.client.http import HttpClient

        with HttpClient(f"127.0.0.1:{http_port}") as http:
            for case in cases[::2]:
                st = http.statistics(case.model)[0]
                one = next((b for b in st["batch_stats"] if b["batch_size"] == 1), None)
                if one and one["compute_infer"]["count"]:
                    inside = one["compute_infer"]["ns"] / one["compute_infer"]["count"] / 1e6
                    sizes = ", ".join(f"{b['batch_size']}x{b['compute_infer']['count']}" for b in st["batch_stats"])
                    print(f"{case.model}: engine time inside the daemon, batch 1, mean {inside:.3f} ms "
                          f"(raw in isolation, median {case.raw_ms:.3f} ms); batches run: {sizes}")
        driver.c.loop_stop()
        return 1 if misses else 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
        broker.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
