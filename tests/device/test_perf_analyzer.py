"""Triton's own C++ client against the daemon: perf_analyzer, and the response fields it reads.

perf_analyzer is fetched from its public wheel (tests/perf_analyzer.py) and skipped with the
reason when it cannot be had; the second group asserts, without the binary, the exact response
fields Triton's C++ HTTP client requires.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import orjson
import pytest

from edged.client.http import HttpClient
from tests import perf_analyzer
from tests.http_helpers import TOKEN, Segment, Served, copy_models, served

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("perf_analyzer")
    # perf_analyzer names its segments after the tensors: any name, with the token (sent with -H)
    with served(copy_models(tmp / "models", "digits"), tmp, extra='[shm]\nsystem_shm_prefix = ""\n',
                grpc="") as s:
        yield s


@pytest.fixture(scope="module")
def pa() -> perf_analyzer.PerfAnalyzer:
    try:
        return perf_analyzer.get()
    except perf_analyzer.UnavailableError as e:
        pytest.skip(str(e))


SHM = ["--shared-memory", "system", "--output-shared-memory-size", "4096"]
# Every mode perf_analyzer has for a CPU server. gRPC with shared memory segfaulted in Triton's C++
# client while responses lacked an (empty) raw_output_contents entry for outputs written to shm.
MODES = {"http": ("http", []), "http-system-shm": ("http", SHM), "grpc": ("grpc", []),
         "grpc-system-shm": ("grpc", SHM), "grpc-streaming": ("grpc", ["--streaming"]),
         "grpc-streaming-system-shm": ("grpc", ["--streaming", *SHM])}


@pytest.mark.parametrize("mode", list(MODES))
def test_perf_analyzer_runs_against_the_daemon(srv: Served, pa: perf_analyzer.PerfAnalyzer, mode: str) -> None:
    protocol, extra = MODES[mode]
    url = srv.url.removeprefix("http://") if protocol == "http" else srv.grpc_url
    before = _successes(srv)
    # Short time windows (100 ms, any three stable): the test is about exiting 0 with figures, not speed.
    r = pa.run("-m", "digits", "-u", str(url), "-i", protocol, "-b", "4",
               "--concurrency-range", "1", "--measurement-interval", "100", "-s", perf_analyzer.ANY_STABILITY,
               "-H", f"authorization: Bearer {TOKEN}", *extra)  # gRPC metadata keys are lower case
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"exit {r.returncode}: {out[-2000:]}"
    assert "Throughput:" in out and "error" not in out.lower() and "Unable" not in out, out[-2000:]
    assert _successes(srv) > before


def _successes(srv: Served) -> int:
    return sum(s["inference_stats"]["success"]["count"] for s in srv.service.statistics() if s["name"] == "digits")


def _infer(c: HttpClient, outputs: list[dict[str, object]], x: np.ndarray) -> tuple[int, dict[str, object], bytes]:
    header = orjson.dumps({"inputs": [{"name": "pixels", "datatype": "FP32", "shape": list(x.shape),
                                       "parameters": {"binary_data_size": x.nbytes}}], "outputs": outputs})
    r = c.request("POST", "/v2/models/digits/infer", [header, x.tobytes()],
                  {"Inference-Header-Content-Length": str(len(header))})
    hlen = int(r.header("inference-header-content-length") or len(r.body))
    return r.status, orjson.loads(r.body[:hlen]), r.body[hlen:]


def test_output_fields_are_exactly_what_the_cpp_client_reads(srv: Served, tmp_path: Path) -> None:
    x = np.arange(2 * 64, dtype=np.float32).reshape(2, 64) % 17
    tag = uuid.uuid4().hex[:10]
    seg = Segment(f"/pa_out_{tag}", 4096)
    try:
        with HttpClient(srv.url, token=TOKEN) as c:
            r = c.request("POST", f"/v2/systemsharedmemory/region/out_{tag}/register",
                          [orjson.dumps({"key": seg.key, "offset": 0, "byte_size": 4096})])
            assert r.status == 200, r.body
            # Written to system shared memory: name, datatype, shape and nothing else (a
            # "parameters" object would be read as a binary output needing binary_data_size).
            status, head, tail = _infer(c, [{"name": "probabilities", "parameters": {
                "shared_memory_region": f"out_{tag}", "shared_memory_offset": 64,
                "shared_memory_byte_size": 1024}}], x)
            assert status == 200, head
            assert head["outputs"] == [{"name": "probabilities", "datatype": "FP32", "shape": [2, 10]}]
            assert tail == b""
            in_shm = np.frombuffer(seg.read(80, 64), np.float32).reshape(2, 10)
            # Binary: exactly binary_data_size, matching the bytes that follow.
            status, head, tail = _infer(c, [{"name": "probabilities", "parameters": {"binary_data": True}}], x)
            assert status == 200
            assert head["outputs"] == [{"name": "probabilities", "datatype": "FP32", "shape": [2, 10],
                                        "parameters": {"binary_data_size": 80}}]
            np.testing.assert_array_equal(np.frombuffer(tail, np.float32).reshape(2, 10), in_shm)
            assert abs(in_shm.sum() - 2.0) < 1e-4
            # CUDA shared memory: none here; the client's exit-time cleanup must still succeed.
            assert c.request("POST", "/v2/cudasharedmemory/unregister").status == 200
            r = c.request("GET", "/v2/cudasharedmemory/status")
            assert r.status == 200 and orjson.loads(r.body) == []
            r = c.request("POST", "/v2/cudasharedmemory/region/x/register",
                          [b'{"raw_handle":{"b64":""},"device_id":0,"byte_size":16}'])
            assert r.status == 400 and "not supported" in orjson.loads(r.body)["error"]
            c.request("POST", "/v2/systemsharedmemory/unregister")
    finally:
        seg.close()
