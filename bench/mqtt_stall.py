"""Where MQTT round trips stall on a stock mosquitto: every request/reply QoS pair, three kinds of client.

One run, one machine: a mosquitto with Debian's stock configuration (no ``set_tcp_nodelay``), a real
``edged run`` (MQTT only, ``digits``), and closed loops at concurrency 1 from
  * edged's own Python client (``edged.client.mqtt.MqttClient``),
  * ``mosquitto_pub -l`` + ``mosquitto_sub`` (two connections, the tools' defaults),
  * a plain paho client (one connection, paho's defaults: Nagle on, no quick ACKs).
A row shows the median round trip and the rate; a median near 40 ms (or 80 ms) is the delayed-ACK
stall. ``--broker-nodelay`` repeats the table on a tuned broker (the reference), in the same run.

    .venv/bin/python bench/mqtt_stall.py [--seconds 2] [--broker-nodelay]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edged.client.mqtt import MqttClient  # noqa: E402
from tests.mqtt_helpers import (  # noqa: E402
    DIGIT,
    Broker,
    EdgedRun,
    LoopResult,
    MosquittoCliRequester,
    PahoRequester,
    closed_loop,
)

DEVICE = "bench"
TOPIC = f"edged/{DEVICE}/infer/digits"


def edged_client(broker: Broker, qos: int, reply_qos: int) -> tuple[Callable[[int], bool], Callable[[], None]]:
    c = MqttClient(broker.url, DEVICE, qos=qos, reply_qos=reply_qos)
    x = {"pixels": np.asarray([DIGIT], np.float32)}

    def call(i: int) -> bool:
        c.infer("digits", x)
        return True

    return call, c.close


def table(broker: Broker, seconds: float) -> list[tuple[str, int, int, LoopResult]]:
    rows = []
    for name in ("edged", "mosquitto_pub/sub", "paho"):
        for qos in (0, 1, 2):
            for reply_qos in (0, 1):
                if name == "edged":
                    call, close = edged_client(broker, qos, reply_qos)
                elif name == "paho":
                    r = PahoRequester(broker.port, TOPIC, qos=qos, reply_qos=reply_qos)
                    call, close = r, r.close
                else:
                    m = MosquittoCliRequester(broker.port, TOPIC, qos=qos, reply_qos=reply_qos)
                    call, close = m, m.close
                try:
                    res = closed_loop(call, seconds)
                finally:
                    close()
                rows.append((name, qos, reply_qos, res))
                print(f"| {name} | {qos} | {reply_qos} | {res.p50_ms:.2f} | {res.rate:,.0f} |", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=2.0, help="closed loop per row")
    ap.add_argument("--broker-nodelay", action="store_true", help="also run the table on a tuned broker")
    ap.add_argument("--daemon-config", default="", help="extra [mqtt] TOML lines for the daemon")
    args = ap.parse_args()
    print(f"load: {os.getloadavg()[0]:.2f} (1 min) on {os.cpu_count()} cores")
    brokers = [("stock mosquitto", False)] + ([("mosquitto set_tcp_nodelay true", True)] if args.broker_nodelay
                                              else [])
    for label, nodelay in brokers:
        tmp = Path(tempfile.mkdtemp(prefix="edged-bench-stall-"))
        broker = Broker(tmp / "broker", stock=not nodelay, nodelay=nodelay).start()
        daemon = EdgedRun(tmp / "edged", broker, DEVICE, args.daemon_config)
        try:
            print(f"\n{label}: median round trip and rate at concurrency 1 ({args.seconds:g} s per row)\n")
            print("| client | request QoS | reply QoS | p50 ms | req/s |\n|---|---|---|---|---|")
            table(broker, args.seconds)
        finally:
            daemon.stop()
            broker.stop()
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
