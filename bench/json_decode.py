"""JSON tensor decoding in-process: the body through Python numbers (orjson, then numpy) against the
data arrays parsed straight into numpy (edged.protocol.v2_json), interleaved in one run.

    .venv/bin/python -m bench.json_decode [--rounds N]

The body is the suite's HTTP JSON request (mobilenet, 3x48x192 FP32, 27,648 numbers). Each path's
figure is the median over rounds; the ratio is taken within a round. The results are compared bit for
bit before timing.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import orjson

from edged.protocol import v2_json
from edged.protocol.v2 import decode_request, loads
from edged.protocol.v2_json import loads_request


def _timed(fn: Callable[[], object], n: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    x = np.random.default_rng(0).random((1, 3, 48, 192), dtype=np.float32)
    body = orjson.dumps({"inputs": [{"name": "image", "datatype": "FP32", "shape": list(x.shape),
                                     "data": x.ravel()}]}, option=orjson.OPT_SERIALIZE_NUMPY)

    def through_lists() -> np.ndarray:
        return decode_request(loads(body), model="m", version=None).request.inputs["image"]

    def straight() -> np.ndarray:
        return decode_request(loads_request(body), model="m", version=None).request.inputs["image"]

    def straight_without_simdjson() -> np.ndarray:
        v2_json._local.parser = False  # the path of a device without the pysimdjson wheel
        try:
            return straight()
        finally:
            v2_json._local.parser = None

    for fn in (through_lists, straight, straight_without_simdjson):
        assert np.array_equal(fn().view(np.uint32), x.view(np.uint32)), fn.__name__
    paths = {"through Python lists": through_lists, "straight into numpy": straight,
             "straight, without simdjson": straight_without_simdjson}
    times: dict[str, list[float]] = {k: [] for k in paths}
    for _ in range(args.rounds):
        for k, fn in paths.items():
            times[k].append(_timed(fn, 20))
    ref = times["through Python lists"]
    print(f"body {len(body)} bytes, {x.size} numbers; median of {args.rounds} interleaved rounds")
    for k, ts in times.items():
        ratio = statistics.median(r / t for r, t in zip(ref, ts, strict=True))
        print(f"  {k:28s} {statistics.median(ts) * 1e3:.3f} ms  ({ratio:.2f}x the list path's speed)")


if __name__ == "__main__":
    main()
