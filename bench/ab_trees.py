"""Two checkouts' daemons side by side: the same traffic to each, interleaved, against one raw reference.

    .venv/bin/python -m bench.ab_trees OLD_CHECKOUT NEW_CHECKOUT [--rounds 16] [--seconds 0.4]
        [--transports shm,http,grpc,grpc_stream,mqtt]

On a shared VM the machine's speed drifts by more between two suite runs minutes apart than a
change of tens of microseconds; only a comparison inside one run says whether a change helped.
Each checkout's ``edged run`` is started from its own tree (``python -m edged`` with that tree
first on the path, this venv's packages), both serve the bundled mobilenet with the generic
profile, and each round runs every case once in alternating order. Printed: per case, the median
over rounds of (case p50 - raw engine b1 p50 of the same round).
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np

from bench import run_suite as rs
from bench.bench_mqtt import Driver, binary_request
from edged.client.grpc import GrpcClient
from edged.client.http import HttpClient
from edged.client.shm import ShmClient
from edged.config import load_config
from edged.daemon import build_runtime
from tests.mqtt_helpers import Broker
from tests.netutil import free_port

MODEL = rs.MODEL


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trees", nargs=2, type=Path, help="two checkouts of edged (old, new)")
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=0.4, help="per case and round")
    ap.add_argument("--transports", default="shm,http,grpc")
    args = ap.parse_args()
    wanted = set(args.transports.split(","))
    tmp = Path(tempfile.mkdtemp(prefix="edged-ab-"))
    broker = Broker(tmp / "broker").start()
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, tmp, True)
        stack.callback(broker.stop)
        cases: dict[str, Callable[[], object]] = {}
        driver: Driver | None = None
        payload, users = b"", []
        cfg = None
        urls: dict[str, str] = {}
        x1 = np.random.default_rng(0).random((1, 3, 48, 192), dtype=np.float32)
        for label, tree in zip("AB", args.trees, strict=True):
            here = tmp / label
            for name in ("digits", MODEL):
                shutil.copytree(tree / "models" / name, here / "models" / name)
            http_port, grpc_port = free_port(), free_port()
            cfg = rs.write_config(here, http_port, broker, "generic", "edged.toml", grpc_port=grpc_port)
            device = f"{rs.DEVICE}-{label.lower()}"  # each daemon answers its own MQTT topics
            cfg.write_text(cfg.read_text().replace(f'id = "{rs.DEVICE}"', f'id = "{device}"'))
            rs.ROOT = tree.resolve()  # start_daemon runs `python -m edged` from this tree
            rs.EDGED = [sys.executable, "-m", "edged"]
            started = rs.start_daemon(cfg, here / "edged.log", here / "notify.sock")
            stack.callback(rs.stop_daemon, started.proc)
            urls[label] = f"127.0.0.1:{http_port}"
            if "shm" in wanted:
                shm = stack.enter_context(ShmClient(here / "run" / "edged.sock"))
                cases[f"{label} shm"] = partial(shm.infer, MODEL, {"image": x1})
            if "http" in wanted:
                http = stack.enter_context(HttpClient(f"127.0.0.1:{http_port}"))
                cases[f"{label} http"] = partial(http.infer, MODEL, {"image": x1})
            if "grpc" in wanted:
                grpc = GrpcClient(f"127.0.0.1:{grpc_port}")
                stack.callback(grpc.close)
                cases[f"{label} grpc"] = partial(grpc.infer, MODEL, {"image": x1})
            if "mqtt" in wanted:
                if driver is None:
                    driver = Driver(broker.port, qos=0)
                    stack.callback(driver.c.loop_stop)
                    payload, users = binary_request("image", x1)
                cases[f"{label} mqtt"] = partial(driver.run, f"edged/{device}/infer/{MODEL}", payload, users,
                                                 concurrency=1, n=1, timeout=30)
            if "grpc_stream" in wanted:
                streaming = GrpcClient(f"127.0.0.1:{grpc_port}")
                stream = streaming.stream()
                stack.callback(streaming.close)
                stack.callback(stream.close)
                cases[f"{label} grpc_stream"] = partial(stream.infer, MODEL, {"image": x1})
        assert cfg is not None
        rt = build_runtime(load_config(cfg), only=MODEL)
        stack.callback(rt.manager.shutdown)
        engine = rt.service.ready_model(MODEL).engine
        assert engine is not None
        cases = {"raw": lambda: engine.infer({"image": x1}), **cases}
        # A cold daemon measures its engine candidates for tens of seconds after READY=1, and again when
        # the warm-up moves its traffic: rounds measured meanwhile favour whichever daemon settled first.
        for label, url in urls.items():
            print(f"{label}: {rs.first_choices(url)}", flush=True)
        for fn in cases.values():
            rs.serial(fn, 0.3)
        for label, url in urls.items():
            with HttpClient(url) as c:
                meta = c.metadata(MODEL)["parameters"]
                print(f"{label}: {rs.settle_choice(c)}; serving {meta['backend']}/{meta['precision']}", flush=True)
        p50s: dict[str, list[float]] = {k: [] for k in cases}
        for r in range(args.rounds):
            for key in cases if r % 2 == 0 else list(cases)[::-1]:
                time.sleep(0.02)
                p50s[key].append(rs.serial(cases[key], args.seconds).p50)
        print(f"A = {args.trees[0]}, B = {args.trees[1]}; {args.rounds} rounds of {args.seconds} s per case")
        for key, values in p50s.items():
            over = statistics.median(v - r for v, r in zip(values, p50s["raw"], strict=True))
            print(f"{key:14s} p50 {statistics.median(values) * 1e6:8.1f} us   over raw b1 {over * 1e6:7.1f} us")


if __name__ == "__main__":
    main()
