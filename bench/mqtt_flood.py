"""A QoS 1 request flood over MQTT: does every request get a reply (an answer or 'overloaded')?

One run: a mosquitto (stock configuration unless ``--broker-nodelay``), an in-process MQTT transport
with ``digits``, and one paho client that publishes ``--requests`` QoS 1 requests as fast as paho takes
them, then waits for the replies. Prints what came back and the transport's own counters.

    .venv/bin/python bench/mqtt_flood.py [--requests 5000] [--broker-nodelay]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import queue
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edged.config import ModelsSection, parse_config  # noqa: E402
from edged.core.manager import ModelManager  # noqa: E402
from edged.core.service import InferenceService  # noqa: E402
from edged.profiles import BackendPreference  # noqa: E402
from edged.transports.mqtt.transport import MqttTransport  # noqa: E402
from tests.mqtt_helpers import DIGIT, Broker, TestClient, publish_properties  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--broker-nodelay", action="store_true")
    ap.add_argument("--mqtt", default="", help="extra [mqtt] TOML lines for the transport")
    args = ap.parse_args()
    print(f"load: {os.getloadavg()[0]:.2f} (1 min) on {os.cpu_count()} cores")
    tmp = Path(tempfile.mkdtemp(prefix="edged-bench-flood-"))
    broker = Broker(tmp / "broker", stock=not args.broker_nodelay, nodelay=args.broker_nodelay).start()
    manager = ModelManager(ROOT / "models", ModelsSection(),
                           [BackendPreference(backend="onnxruntime", device="CPU", precisions=["fp32"])])
    manager.load_all()
    cfg = parse_config(f'[device]\nid = "flood"\n[mqtt]\nurl = "{broker.url}"\n{args.mqtt}')
    t = MqttTransport(cfg, InferenceService(manager), "bench")
    asyncio.run(t.start())
    try:
        assert t.wait_ready(10)
        c = TestClient(broker.port).wait_connected()
        c.subscribe("edged/flood/reply/flood", qos=1)
        body = json.dumps({"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1, 64],
                                       "data": DIGIT}]}).encode()
        t0 = time.monotonic()
        for i in range(args.requests):
            props = publish_properties(ResponseTopic="edged/flood/reply/flood", CorrelationData=str(i).encode())
            c.client.publish("edged/flood/infer/digits", body, qos=1, properties=props)
        kinds: collections.Counter[str] = collections.Counter()
        while True:
            try:
                msg = c.messages.get(timeout=10)
            except queue.Empty:
                break
            kinds[json.loads(msg.payload).get("code", "answer")] += 1
        c.close()
        got = sum(kinds.values())
        print(f"{args.requests} QoS 1 requests in {time.monotonic() - t0 - 10:.1f} s: {got} replies {dict(kinds)}, "
              f"{args.requests - got} without a reply")
        print(f"transport counters: {dict(sorted(t.counters.items()))}")
    finally:
        asyncio.run(t.stop())
        manager.shutdown()
        broker.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
