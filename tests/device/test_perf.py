"""``edged perf`` against a real ``edged run`` (shm, HTTP and MQTT through a real mosquitto), plus its pure parts.

No timed assertions: the checks are that each transport is loaded, the CSV/JSON
have the documented columns and the values are sane (throughput > 0, p50 <= p99).
"""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from edged.errors import InvalidInputError
from edged.perf.inputs import ModelInfo, build_inputs, parse_shapes
from edged.perf.measure import Settings, Window, is_stable, percentile
from edged.perf.plot import latency_throughput_png, nice_step
from edged.perf.ranges import concurrency_levels, rate_levels
from edged.perf.report import CSV_COLUMNS
from tests.conftest import EDGED, MODELS, REPO_ROOT
from tests.edged_process import edged_run
from tests.mqtt_helpers import Broker
from tests.netutil import free_port

TRANSPORTS = ("http", "shm", "grpc", "mqtt")
FAST = ["-p", "300", "-r", "3", "-s", "100"]  # short windows; stability within 100% so three windows do


def _perf_wired() -> bool:
    from edged.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return "perf" in (sub.choices or {})


def perf_argv(cfg: Path, *args: str) -> list[str]:
    if _perf_wired():
        return [*EDGED, "--config", str(cfg), "perf", *args]
    return [sys.executable, "-m", "edged.perf", "--config", str(cfg), *args]


class Daemon:
    def __init__(self, cfg: Path, http: str, sock: Path, broker: Broker, proc: subprocess.Popen[bytes]) -> None:
        self.cfg, self.http, self.sock, self.broker, self.proc = cfg, http, sock, broker, proc

    def perf(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(perf_argv(self.cfg, *args), capture_output=True, text=True, timeout=timeout,
                              cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("perf")
    shutil.copytree(MODELS / "digits", tmp / "models" / "digits")
    broker = Broker(tmp / "broker", nodelay=True).start()  # as docs/mqtt.md recommends for request/response
    port = free_port()
    cfg = tmp / "edged.toml"
    cfg.write_text(f"""
[device]
id = "perf-test"
profile = "generic"
state_dir = "{tmp / 'state'}"
runtime_dir = "{tmp / 'run'}"
model_repository = "{tmp / 'models'}"
[http]
listen = "127.0.0.1:{port}"
[grpc]
listen = "127.0.0.1:{free_port()}"
[mqtt]
url = "{broker.url}"
[telemetry]
enabled = false
[logging]
level = "warning"
""")
    http, sock = f"127.0.0.1:{port}", tmp / "run" / "edged.sock"

    def ready() -> bool:
        from edged.client.http import HttpClient

        with HttpClient(http, timeout=2) as c:
            return c.ready("digits") and sock.exists()

    try:
        with edged_run(cfg, tmp / "edged.log", ready, timeout=90) as proc:
            yield Daemon(cfg, http, sock, broker, proc)
    finally:
        broker.stop()


def read_csv(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def check_row(row: dict[str, str], *, server: bool) -> None:
    assert float(row["throughput_infer_per_s"]) > 0
    assert int(row["requests"]) > 0
    assert row["errors"] == "0"
    p = [float(row[f"p{k}_us"]) for k in (50, 90, 95, 99)]
    assert 0 < p[0] <= p[1] <= p[2] <= p[3]
    assert float(row["avg_us"]) > 0
    assert int(row["windows"]) >= 3
    server_cols = [c for c in CSV_COLUMNS if c.startswith("server_")]
    if server:
        assert all(row[c] != "" for c in server_cols), row
        assert float(row["server_compute_infer_us"]) > 0
        assert float(row["server_avg_batch"]) >= 1
    else:
        assert all(row[c] == "" for c in server_cols), row


# ---- against a running daemon ----------------------------------------------------------------
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_perf_each_transport_writes_csv(daemon: Daemon, transport: str, tmp_path: Path) -> None:
    out = tmp_path / f"{transport}.csv"
    r = daemon.perf("-m", "digits", "--transport", transport, "--concurrency-range", "1:3:2", *FAST,
                    "-f", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    header, rows = read_csv(out)
    assert header == list(CSV_COLUMNS)
    assert [row["concurrency"] for row in rows] == ["1", "3"]
    for row in rows:
        assert row["transport"] == transport and row["model"] == "digits" and row["mode"] == "concurrency"
        check_row(row, server=True)  # shm and mqtt read the stats from the config's [http] listen
    assert "server-side statistics: from" in r.stdout
    assert "p99" in r.stdout


def test_grpc_streaming(daemon: Daemon, tmp_path: Path) -> None:
    out = tmp_path / "stream.csv"
    r = daemon.perf("-m", "digits", "--transport", "grpc", "--streaming", "--concurrency-range", "2", *FAST,
                    "-f", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    _, rows = read_csv(out)
    assert [row["concurrency"] for row in rows] == ["2"]
    check_row(rows[0], server=True)
    r = daemon.perf("-m", "digits", "--transport", "http", "--streaming", *FAST)
    assert r.returncode != 0 and "--streaming applies to grpc only" in r.stderr


def test_request_rate_mode_json_and_plot(daemon: Daemon, tmp_path: Path) -> None:
    out, plot = tmp_path / "rate.json", tmp_path / "rate.png"
    r = daemon.perf("-m", "digits", "--transport", "http", "-u", daemon.http, "--request-rate-range", "50,100",
                    "--request-distribution", "poisson", "--max-threads", "2", "--percentile", "95", *FAST,
                    "--json", str(out), "--plot", str(plot))
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(out.read_text())
    assert doc["transport"] == "http" and doc["server_stats"] == "available"
    assert doc["settings"]["mode"] == "request_rate" and doc["settings"]["levels"] == [50, 100]
    assert [x["request_rate"] for x in doc["results"]] == ["50", "100"]
    for row in doc["results"]:
        assert set(CSV_COLUMNS) <= set(row)
        assert row["latency_metric"] == "p95" and float(row["latency_us"]) == float(row["p95_us"])
        check_row(row, server=True)
    png = plot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", png[16:24]) == (800, 520)


def test_stats_unavailable_is_said_and_left_empty(daemon: Daemon, tmp_path: Path) -> None:
    out = tmp_path / "shm.csv"
    r = daemon.perf("-m", "digits", "--transport", "shm", "-u", str(daemon.sock), "--http-url", "none", *FAST,
                    "-f", str(out), "--input-data", "zero")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "server-side statistics: unavailable" in r.stdout and "--http-url" in r.stdout
    _, rows = read_csv(out)
    check_row(rows[0], server=False)

    out2 = tmp_path / "mqtt.csv"
    r = daemon.perf("-m", "digits", "--transport", "mqtt", "--http-url", f"127.0.0.1:{free_port()}", *FAST,
                    "-f", str(out2))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "server-side statistics: unavailable" in r.stdout and "did not answer" in r.stdout
    check_row(read_csv(out2)[1][0], server=False)


def test_input_file_batches_and_json_tensors(daemon: Daemon, tmp_path: Path) -> None:
    data = tmp_path / "samples.npz"
    np.savez(data, pixels=np.random.default_rng(1).random((40, 64), dtype=np.float32) * 16)
    out = tmp_path / "b4.csv"
    r = daemon.perf("-m", "digits", "--transport", "http", "-b", "4", "--input-data", str(data),
                    "--input-tensor-format", "json", *FAST, "-f", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "10 distinct requests" in r.stdout
    row = read_csv(out)[1][0]
    check_row(row, server=True)
    assert row["batch_size"] == "4"
    assert float(row["throughput_infer_per_s"]) == pytest.approx(4 * float(row["requests_per_s"]), rel=1e-3)


def test_errors_are_clear(daemon: Daemon, tmp_path: Path) -> None:
    r = daemon.perf("-m", "no-such-model", "--transport", "http", *FAST)
    assert r.returncode == 1
    assert "no-such-model" in r.stderr and "Traceback" not in r.stderr
    r = daemon.perf("-m", "digits", "--transport", "shm", "-u", str(daemon.sock.parent / "nope.sock"), *FAST)
    assert r.returncode == 1
    assert "cannot connect" in r.stderr and "Traceback" not in r.stderr
    r = daemon.perf("-m", "digits", "--concurrency-range", "4:1", *FAST)
    assert r.returncode == 1 and "end must be >= start" in r.stderr


# ---- the pure parts --------------------------------------------------------------------------
def test_ranges_follow_perf_analyzer() -> None:
    assert concurrency_levels("1:16:2") == [1, 3, 5, 7, 9, 11, 13, 15]
    assert concurrency_levels("4") == [4]
    assert concurrency_levels("1,2,4,8") == [1, 2, 4, 8]
    assert rate_levels("100:300:100") == [100, 200, 300]
    assert rate_levels("0.5:1.5:0.5") == [0.5, 1.0, 1.5]
    for bad in ("0:4", "1:4:0", "a:b", "1.5", "1:2:3:4"):
        with pytest.raises(InvalidInputError):
            concurrency_levels(bad)


def test_inputs_from_metadata() -> None:
    info = ModelInfo.from_metadata({"name": "m", "inputs": [
        {"name": "a", "datatype": "FP32", "shape": [-1, 3]},
        {"name": "b", "datatype": "INT64", "shape": [-1, -1]}]}, max_batch_size=8)
    with pytest.raises(InvalidInputError, match="--shape b:N"):
        build_inputs(info, "random")
    (req,) = build_inputs(info, "random", batch_size=2, shapes=parse_shapes(["b:5"]))
    assert req["a"].shape == (2, 3) and req["a"].dtype == np.float32
    assert req["b"].shape == (2, 5) and req["b"].dtype == np.int64
    with pytest.raises(InvalidInputError, match="max_batch_size"):
        build_inputs(info, "zero", batch_size=9, shapes={"b": (1,)})
    unbatched = ModelInfo.from_metadata({"name": "u", "inputs": [{"name": "t", "datatype": "BYTES", "shape": [2]}],
                                         "max_batch_size": 0})
    (req,) = build_inputs(unbatched, "random")
    assert req["t"].shape == (2,) and req["t"].dtype == np.object_
    with pytest.raises(InvalidInputError, match="no batch dimension"):
        build_inputs(unbatched, "random", batch_size=2)


def test_input_data_arrays_give_the_dynamic_shapes(tmp_path: Path) -> None:
    """An .npz carries its shapes: no --shape for dynamic inputs (a VAD with a 0-d rate and recurrent state)."""
    vad = ModelInfo.from_metadata({"name": "vad", "inputs": [
        {"name": "input", "datatype": "FP32", "shape": [-1, -1]}, {"name": "sr", "datatype": "INT64", "shape": []},
        {"name": "state", "datatype": "FP32", "shape": [2, -1, 128]}]}, max_batch_size=0)
    path = tmp_path / "vad.npz"
    np.savez(path, input=np.ones((1, 512), np.float32), sr=np.array(16000, np.int64),
             state=np.zeros((2, 1, 128), np.float32))
    (req,) = build_inputs(vad, str(path))
    assert {k: v.shape for k, v in req.items()} == {"input": (1, 512), "sr": (), "state": (2, 1, 128)}
    det = ModelInfo.from_metadata({"name": "det", "inputs": [
        {"name": "x", "datatype": "FP32", "shape": [-1, 3, -1, -1]}]}, max_batch_size=4)
    for data, batch, want in ((np.zeros((3, 320, 256), np.float32), 2, (2, 3, 320, 256)),  # one sample
                              (np.zeros((4, 3, 48, 96), np.float32), 2, (2, 3, 48, 96))):  # a batch of samples
        np.save(tmp_path / "x.npy", data)
        reqs = build_inputs(det, str(tmp_path / "x.npy"), batch_size=batch)
        assert all(r["x"].shape == want for r in reqs)
    np.save(tmp_path / "x.npy", np.zeros((4, 320, 256), np.float32))  # 4 channels: not this model's data
    with pytest.raises(InvalidInputError, match=r"the data's shape \[4, 320, 256\] does not fit"):
        build_inputs(det, str(tmp_path / "x.npy"))
    flat = tmp_path / "flat.json"
    flat.write_text(json.dumps({"data": [{"x": [0.0] * 12}]}))
    with pytest.raises(InvalidInputError, match="--shape x:3,N,N"):
        build_inputs(det, str(flat))
    assert build_inputs(det, str(flat), shapes={"x": (3, 2, 2)})[0]["x"].shape == (1, 3, 2, 2)


def test_perf_analyzer_json_input(tmp_path: Path) -> None:
    info = ModelInfo.from_metadata({"name": "d", "inputs": [{"name": "pixels", "datatype": "FP32",
                                                             "shape": [-1, 4]}]}, 64)
    path = tmp_path / "in.json"
    path.write_text(json.dumps({"data": [{"pixels": [1, 2, 3, 4]},
                                         {"pixels": {"content": [5, 6, 7, 8], "shape": [4]}}]}))
    reqs = build_inputs(info, str(path), batch_size=3)
    assert len(reqs) == 2
    assert reqs[1]["pixels"].shape == (3, 4) and reqs[1]["pixels"][2].tolist() == [5, 6, 7, 8]


def test_stability_rule_and_percentiles() -> None:
    def w(n: int, lat_us: int) -> Window:
        return Window(1.0, [lat_us * 1000] * n, 0, None)

    s = Settings(stability_pct=10)
    assert not is_stable([w(100, 10), w(100, 10)], s)
    assert is_stable([w(50, 99), w(100, 10), w(105, 10), w(96, 11)], s)
    assert not is_stable([w(100, 10), w(130, 10), w(100, 10)], s)  # throughput off by more than 10%
    assert not is_stable([w(100, 10), w(100, 14), w(100, 10)], s)  # latency off
    assert not is_stable([w(0, 0), w(0, 0), w(0, 0)], s)
    vals = list(range(1, 101))
    assert percentile(vals, 50) == 50 and percentile(vals, 99) == 99 and percentile(vals, 100) == 100
    assert math.isnan(percentile([], 50))


def test_png_plot_decodes() -> None:
    png = latency_throughput_png([(100.0, 1.0, "1"), (180.0, 2.5, "2"), (200.0, 9.0, "4")], title="t",
                                 x_label="x", y_label="y")
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    w, h = struct.unpack(">II", png[16:24])
    pos, idat = 8, b""
    while pos < len(png):
        (length,) = struct.unpack(">I", png[pos:pos + 4])
        kind = png[pos + 4:pos + 8]
        body = png[pos + 8:pos + 8 + length]
        assert struct.unpack(">I", png[pos + 8 + length:pos + 12 + length])[0] == zlib.crc32(kind + body)
        if kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = zlib.decompress(idat)
    assert len(raw) == h * (1 + 3 * w)
    assert raw.count(bytes((214, 39, 40))) > 0  # the points were drawn
    assert nice_step(97) == 20 and nice_step(0.9) == 0.2 and nice_step(12) == 2.5
