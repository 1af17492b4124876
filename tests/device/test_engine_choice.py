"""Serve first, choose after, choose again: a real daemon picks its engine on the traffic that comes.

The model computes ``y = 2 * x`` (``x [batch, n]``) from two files with opposite costs
(tests/made_models.py): ``quadratic.onnx`` builds an n x n matrix per run (nothing for
n = 16, tens of milliseconds for n = 2048) and ``fixed`` (an OpenVINO IR converted here)
costs about a millisecond whatever n is. With the profile listing OpenVINO first the
daemon is READY on ``openvino (fixed.xml)`` before anything is measured; the background
choice on the declared shape (n = 16) switches to the quadratic file; traffic at
n = 2048 makes the daemon measure again on that traffic and switch back. A client loop
runs the whole time: every answer exact, none failed, and the statistics count the
client's requests only (no self-test, no benchmark run).
"""

from __future__ import annotations

import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edged.core.traffic import TrafficMix
from tests import made_models
from tests.conftest import REPO_ROOT, device_config, sha256_file
from tests.edged_process import QUICK_CHOICE_EDGED, edged_run
from tests.http_client import web
from tests.netutil import free_port
from tests.polling import wait_until

pytest.importorskip("openvino")
pytest.importorskip("onnxruntime")

PROFILE = textwrap.dedent("""
    name = "test-choice"
    priority = 0
    select = "benchmark"
    [match]
    [[backends]]
    backend = "openvino"
    device = "CPU"
    precisions = ["fp32"]
    [[backends]]
    backend = "onnxruntime"
    device = "CPU"
    precisions = ["fp32"]
    """)

def make_doubler(repo: Path) -> Path:
    import openvino as ov

    vdir = repo / "doubler" / "1"
    made_models.doubler_quadratic(vdir / "quadratic.onnx")
    fixed = made_models.doubler_fixed(repo.parent / "fixed.onnx")
    ov.save_model(ov.convert_model(str(fixed)), str(vdir / "fixed.xml"), compress_to_fp16=False)
    (vdir / "model.toml").write_text(textwrap.dedent(f"""
        max_batch_size = 8
        [[inputs]]
        name = "x"
        datatype = "FP32"
        shape = [-1]
        [[outputs]]
        name = "y"
        datatype = "FP32"
        shape = [-1]
        [[variants]]
        file = "quadratic.onnx"
        format = "onnx"
        sha256 = "{sha256_file(vdir / 'quadratic.onnx')}"
        [[variants]]
        file = "fixed.xml"
        format = "openvino"
        sha256 = "{sha256_file(vdir / 'fixed.xml')}"
        [[variants.extra_files]]
        file = "fixed.bin"
        sha256 = "{sha256_file(vdir / 'fixed.bin')}"
        [warmup.shapes.x]
        shape = [16]
        [batching]
        max_queue_delay_us = 200
        preferred_batch_sizes = [4]
        """))
    return vdir


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[str]:
    repo = tmp_path / "models"
    make_doubler(repo)
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    (profiles / "test-choice.toml").write_text(PROFILE)
    port = free_port()
    cfg = device_config(tmp_path, repo, f"""
        profiles_dir = "{profiles}"
        profile = "test-choice"
        [http]
        listen = "127.0.0.1:{port}"
        [mqtt]
        enabled = false
        """, device_id="choice-test")
    url = f"http://127.0.0.1:{port}"
    with edged_run(cfg, tmp_path / "edged.log",
                   lambda: web().get(f"{url}/v2/health/ready", timeout=2).status_code == 200,
                   timeout=60, interval=0.05, edged=QUICK_CHOICE_EDGED):
        yield url


def _meta(url: str) -> dict[str, Any]:
    r = web().get(f"{url}/v2/models/doubler", timeout=10)
    r.raise_for_status()
    params: dict[str, Any] = r.json()["parameters"]
    return params


class Client:
    """A request loop at a settable row length; counts answers, failures and inexact answers."""

    def __init__(self, url: str, n: int) -> None:
        self.url, self.n = url, n
        self.pause_s = 0.002
        self.ok = self.failed = self.wrong = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        rng = np.random.default_rng(1)
        while not self._stop.is_set():
            x = rng.random((1, self.n), dtype=np.float32) + 0.5
            body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}]}
            try:
                r = web().post(f"{self.url}/v2/models/doubler/infer", json=body, timeout=30)
            except Exception as e:
                self.failed += 1
                self.errors.append(repr(e))
                continue
            if r.status_code != 200:
                self.failed += 1
                self.errors.append(r.text[:300])
                continue
            y = np.asarray(r.json()["outputs"][0]["data"], dtype=np.float32).reshape(x.shape)
            if np.array_equal(y, 2 * x):
                self.ok += 1
            else:
                self.wrong += 1
            time.sleep(self.pause_s)  # sleep-ok: the load's pace between requests

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)


def _wait_for(url: str, what: str, pred: Any, timeout: float = 90, interval: float = 0.2) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        meta = _meta(url)
        if pred(meta):
            return meta
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f}s: {meta}"
        time.sleep(interval)


def test_ready_first_then_chosen_in_the_background_and_again_when_traffic_moves(daemon: str) -> None:
    url = daemon
    first = _meta(url)
    # READY on the profile's first candidate, before anything was measured.
    assert first["backend"] == "openvino" and first["state"] == "ready"
    assert first["choice"]["state"] in ("pending", "measuring") and first["choice"]["measurements"] == 0
    assert first["benchmark"] is None
    client = Client(url, 16)
    try:
        # (seen soon after it is made: every n = 16 request counted after the choice is traffic the move to
        # n = 2048 below must outweigh before the daemon measures again)
        chosen = _wait_for(url, "background choice on the declared shape",
                           lambda m: m["choice"]["measurements"] >= 1 and m["choice"]["state"] == "chosen",
                           interval=0.05)
        # At n = 16 the quadratic file runs in microseconds, the fixed one in about a millisecond.
        assert chosen["backend"] == "onnxruntime", chosen["benchmark"]
        assert chosen["choice"]["switches"][-1]["to"].startswith("onnxruntime/CPU/fp32 (quadratic.onnx)")
        assert set(chosen["choice"]["measured_on"]) == {"x[16]@1", "x[16]@4"}
        ok = client.ok
        # traffic goes on on the chosen engine (failures counted below): tens of requests, not hundreds
        wait_until(lambda: client.ok >= ok + 20, 30, 0.01, "requests served on the chosen engine")
        # Traffic unlike the warm-up: now the fixed-cost file wins by far. (With pauses between requests the
        # engines are not busy most of the time: no burst, so the chooser need not wait for one to pass.)
        client.pause_s = 0.05
        client.n = 2048
        moved = _wait_for(url, "re-selection on the served traffic",
                          lambda m: m["choice"]["measurements"] >= 2 and m["backend"] == "openvino")
        assert moved["choice"]["switches"][-1]["to"] == "openvino/CPU/fp32 (fixed.xml)"
        assert "traffic moved" in moved["choice"]["switches"][-1]["why"]
        assert "x[2048]" in moved["chosen_how"] and "openvino*" in moved["chosen_how"]
        assert any(k.startswith("x[2048]") for k in moved["choice"]["measured_on"])
        time.sleep(0.5)  # sleep-ok: traffic goes on on the new engine (failures counted below)
    finally:
        client.stop()
    assert client.failed == 0, client.errors[:3]
    assert client.wrong == 0 and client.ok > 20
    # Only the client's requests are counted: not the self-test, not a benchmark run.
    stats = web().get(f"{url}/v2/models/doubler/stats", timeout=10).json()["model_stats"][0]
    assert stats["inference_stats"]["success"]["count"] == client.ok
    assert stats["inference_count"] == client.ok
    # The choice and its evidence are visible: candidates timed at the served shapes.
    bench = {b["candidate"]: b for b in moved["benchmark"]}
    assert bench["openvino/CPU/fp32 (fixed.xml)"]["chosen"]
    assert all(any(p.startswith("x[2048]") for p in b["points"]) for b in bench.values())


def test_traffic_mix_counts_shapes_and_batches_and_keeps_one_real_sample() -> None:
    mix = TrafficMix(batched=True)
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    for _ in range(3):
        mix.record({"x": a})
    mix.record({"x": np.ones((1, 6), np.float32)})
    seen = {(s.shapes, s.batch): s for s in mix.snapshot()}
    two = seen[((("x", (4,)),), 2)]
    assert two.runs == 3 and two.sample is not None and two.sample["x"].shape == (1, 4)
    assert np.array_equal(two.sample["x"], a[:1])
    assert seen[((("x", (6,)),), 1)].runs == 1
    before = mix.snapshot()
    mix.record({"x": np.ones((1, 6), np.float32)})
    (window,) = TrafficMix.since(mix.snapshot(), before)
    assert window.runs == 1 and window.batch == 1


def test_the_mix_moves_only_when_the_samples_do() -> None:
    from edged.core.chooser import distance, traffic_points
    from edged.core.traffic import Seen

    measured = {"x[16]@1": 0.5, "x[16]@4": 0.5}
    assert distance({"x[16]@1": 10.0, "x[16]@3": 10.0}, measured) < 0.01, "batches of 3 and 4 are alike"
    assert distance({"x[2048]@1": 1.0}, measured) == 1.0
    assert abs(distance({"x[2048]@1": 1.0, "x[16]@1": 1.0}, measured) - 0.5) < 1e-9
    big = {"x": np.ones((1, 2048), np.float32)}
    small = {"x": np.ones((1, 16), np.float32)}
    window = [Seen((("x", (2048,)),), 1, 30, big), Seen((("x", (2048,)),), 4, 5, big),
              Seen((("x", (16,)),), 1, 10, small)]
    points = {p.label: p for p in traffic_points(window, batched=True)}
    # Shares of samples: 30 + 20 of 2048-long rows (batches of 4 stand for themselves), 10 of 16.
    assert set(points) == {"x[2048]@1", "x[2048]@4", "x[16]@1"}
    assert abs(points["x[2048]@1"].weight - 30 / 60) < 1e-9 and abs(points["x[16]@1"].weight - 10 / 60) < 1e-9
    assert points["x[2048]@4"].sample["x"].shape == (1, 2048)


def test_edged_status_shows_how_each_engine_was_chosen() -> None:
    from edged.status import render
    from edged.telemetry.snapshot import ModelStatus, StatusSnapshot

    how = "chosen by measurement (measured, traffic: x[2048]@1 100%): openvino* 812/s, onnxruntime 40/s"
    snap = StatusSnapshot(state="running", pid=1, device="d", started_at=0.0, written_at=1.0, interval_s=5.0,
                          models=[ModelStatus(model="doubler", version=1, state="ready", backend="openvino",
                                              device="CPU", precision="fp32", choice=how)])
    assert f"doubler v1: {how}" in render(snap, {}, 2.0)


def test_a_gpu_profile_without_its_gpu_engines_measures_the_cpu_engines(model_repo: Any, tmp_path: Path) -> None:
    """nvidia-dgpu on a host where TensorRT and onnxruntime-gpu are missing: the CPU engines the profile
    ends in are measured against each other and the faster serves (issue 37, item 6)."""
    from edged.backends.benchmark import BenchmarkSettings
    from edged.config import ModelsSection
    from edged.core.manager import ModelManager
    from edged.hardware import probe
    from edged.profiles import load_profiles, match_profile

    facts = probe(REPO_ROOT / "tests" / "fixtures" / "sysroots" / "x86-64-nvidia-dgpu", engines=False)
    profile = match_profile(facts, load_profiles()).profile
    assert profile.name == "nvidia-dgpu" and profile.select == "first"
    mgr = ModelManager(model_repo("mobilenet"), ModelsSection(), profile.backends, cache_dir=tmp_path / "c",
                       select=profile.select, defer_choice=True)
    mgr.chooser.settings = BenchmarkSettings(time_per_candidate_s=0.3, total_s=1.5, rounds=4, margin=0.05, duty=0.5)
    try:
        mgr.load_all()
        mv = mgr.table.find("mobilenet")
        assert mv is not None and mv.candidate is not None
        if mv.candidate.device != "CPU":
            pytest.skip(f"a GPU engine works here ({mv.candidate.label})")
        skipped = dict(mv.skipped)
        assert any(k.startswith("tensorrt/GPU") for k in skipped) and any(k.startswith("onnxruntime/GPU")
                                                                           for k in skipped)
        assert mv.choice is not None and mv.choice.status()["state"] == "pending"
        assert {c.split("/")[0] for c in mv.choice.status()["candidates"]} == {"onnxruntime", "openvino"}
        assert mgr.chooser.run_once(force=True) == 1
        assert mv.benchmark is not None and {t.backend for t in mv.benchmark.timings} == {"onnxruntime", "openvino"}
        assert mv.candidate.label == mv.benchmark.chosen
        # Batch-1 runs are served by the engine fastest at batch 1 (within the 5% band); batches of 16 by
        # the fastest there, which may be the other one (then both serve).
        for size, label in ((1, mv.benchmark.chosen), (16, mv.benchmark.chosen_batched or mv.benchmark.chosen)):
            best = max(t.batches[size] for t in mv.benchmark.timings)
            assert mv.benchmark.timing(label).batches[size] >= 0.95 * best, mv.status()["benchmark"]  # type: ignore[union-attr]
    finally:
        mgr.shutdown()


def test_batch_one_and_larger_batches_get_the_engine_that_wins_each(tmp_path: Path) -> None:
    """One file is fastest for single rows, the other for batches of four: both serve, each its runs."""
    from edged.backends.benchmark import BenchmarkSettings
    from edged.config import ModelsSection
    from edged.core.manager import ModelManager
    from edged.core.service import InferenceService
    from edged.profiles import BackendPreference
    from edged.protocol.types import InferRequest

    vdir = tmp_path / "models" / "doubler" / "1"
    made_models.doubler_batch_quadratic(vdir / "rows.onnx")
    made_models.doubler_fixed(vdir / "fixed.onnx")
    variants = "".join(f'[[variants]]\nfile = "{f}"\nformat = "onnx"\nsha256 = "{sha256_file(vdir / f)}"\n'
                       for f in ("fixed.onnx", "rows.onnx"))
    (vdir / "model.toml").write_text(
        'max_batch_size = 8\n[[inputs]]\nname = "x"\ndatatype = "FP32"\nshape = [-1]\n'
        '[[outputs]]\nname = "y"\ndatatype = "FP32"\nshape = [-1]\n' + variants
        + '[warmup.shapes.x]\nshape = [384]\n[batching]\npreferred_batch_sizes = [4]\n')
    ort_cpu = BackendPreference(backend="onnxruntime", device="CPU", precisions=["fp32"])
    mgr = ModelManager(tmp_path / "models", ModelsSection(), [ort_cpu], cache_dir=tmp_path / "c",
                       select="benchmark", defer_choice=True)
    mgr.chooser.settings = BenchmarkSettings(time_per_candidate_s=0.4, total_s=2.0, rounds=4, margin=0.05, duty=0.5)
    try:
        mgr.load_all()
        mv = mgr.table.find("doubler")
        assert mv is not None and mv.candidate is not None and mv.candidate.variant.file == "fixed.onnx"
        assert mgr.chooser.run_once(force=True) == 1
        assert mv.benchmark is not None, mv.status()
        assert mv.candidate.variant.file == "rows.onnx", mv.status()["benchmark"]
        assert mv.benchmark.chosen_batched is not None and "fixed.onnx" in mv.benchmark.chosen_batched
        assert "batches of 2+ on onnxruntime/CPU/fp32 (fixed.onnx)" in mv.status()["chosen_how"]
        assert not any("fixed.onnx" in k for k, _ in mv.skipped), "the batch engine is not 'skipped'"
        svc = InferenceService(mgr)
        rng = np.random.default_rng(3)
        for b in (1, 4, 1, 3):
            x = rng.random((b, 384), dtype=np.float32)
            y = svc.infer(InferRequest("doubler", {"x": x}), timeout=30).outputs["y"]
            assert np.array_equal(y, 2 * x)
    finally:
        mgr.shutdown()
    # A restart remembers both: batch 1 on the rows file at once, batches on the fixed one once READY.
    mgr = ModelManager(tmp_path / "models", ModelsSection(), [ort_cpu], cache_dir=tmp_path / "c",
                       select="benchmark", defer_choice=True)
    try:
        mgr.load_all()
        mv = mgr.table.find("doubler")
        assert mv is not None and mv.candidate is not None and mv.candidate.variant.file == "rows.onnx"
        assert mgr.chooser.run_once() == 0  # nothing measured: the split is only set up again
        assert mv.status()["choice"]["batched"] == "onnxruntime/CPU/fp32 (fixed.onnx)"
    finally:
        mgr.shutdown()



def test_a_stop_leaves_the_engine_choice_inside_a_candidates_warm_up(tmp_path: Path) -> None:
    """The engine choice opens each other candidate with its warm-up, one engine call it cannot leave
    (minutes for a big model's compile). A stop waited up to 60 s for it, past the unit's TimeoutStopSec
    (30 s); it now waits as long as for a load (``lock_wait_s``) and leaves that thread to the exit."""
    import shutil

    import psutil

    from edged.config import ModelsSection
    from edged.core.manager import ModelManager
    from edged.profiles import BackendPreference
    from tests.systemd_helpers import make_spin_model, spin_seconds_per_iteration

    d = make_spin_model(tmp_path / "models")  # warm-up n = 1: the first candidate loads at once
    shutil.copy(d / "model.onnx", d / "b.onnx")  # a second candidate: the same graph in another file
    toml = (d / "model.toml").read_text()
    (d / "model.toml").write_text(toml + '[[variants]]\nfile = "b.onnx"\nformat = "onnx"\nprecision = "fp32"\n'
                                  f'sha256 = "{sha256_file(d / "b.onnx")}"\n')
    ort_cpu = BackendPreference(backend="onnxruntime", device="CPU", precisions=["fp32"])
    mgr = ModelManager(tmp_path / "models", ModelsSection(), [ort_cpu], cache_dir=tmp_path / "c",
                       select="benchmark", defer_choice=True)
    mgr.load_all()
    mv = mgr.table.find("spin")
    assert mv is not None and mv.choice is not None, mv and mv.status()
    # From now on a warm-up (the other candidate's, when the choice opens it) runs ~12 s.
    n = int(12.0 / spin_seconds_per_iteration(d))
    np.savez(d / "warmup.npz", n=np.array([n], dtype=np.int64))
    me = psutil.Process()
    mgr.chooser.start()
    wait_until(lambda: mv.choice is not None and mv.choice.state == "measuring", 30, what="the engine choice")
    cpu = sum(me.cpu_times()[:2])
    wait_until(lambda: sum(me.cpu_times()[:2]) - cpu >= 1.0, 30, what="the candidate's warm-up inside the engine")
    t0 = time.monotonic()
    left = mgr.shutdown(0.0, lock_wait_s=1.0)
    took = time.monotonic() - t0
    try:
        assert took < 3.0, f"the stop waited {took:.1f} s for the engine choice"
        assert [t.name for t in left] == ["edged-engine-choice"] and left[0].is_alive()
    finally:
        for t in left:  # the warm-up ends; the choice sees the stop and releases its candidate
            t.join(120)
    assert not any(t.is_alive() for t in left)
