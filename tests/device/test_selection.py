"""Engine choice: the profile's first working choice with reasons for the rest, or the fastest by measurement."""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edged.backends.base import Engine, EngineTensor
from edged.backends.benchmark import (
    BenchmarkResult,
    BenchmarkSettings,
    CandidateTiming,
    SelectionMemory,
    choose,
    fastest,
    measure,
    selection_key,
    typical_call_s,
)
from edged.backends.factory import get_backend
from edged.backends.selection import Candidate, candidates
from edged.config import ModelsSection
from edged.core.manager import ModelManager
from edged.core.model_versions import ModelVersion
from edged.core.service import InferenceService
from edged.errors import EngineUnavailableError
from edged.profiles import BackendPreference
from edged.protocol.types import InferRequest
from edged.protocol.v2_models import metadata_response
from edged.repository.manifest import Variant

MakeRepo = Callable[..., Path]
OV = BackendPreference(backend="openvino", device="CPU", precisions=["fp32"])
ORT = BackendPreference(backend="onnxruntime", device="CPU", precisions=["fp32", "int8"])
FAST = BenchmarkSettings(time_per_candidate_s=0.15, total_s=0.8, rounds=3)


def _manager(repo: Path, prefs: list[BackendPreference], *, select: str = "first",
             cache_dir: Path | None = None) -> ModelManager:
    mgr = ModelManager(repo, ModelsSection(), prefs, cache_dir=cache_dir, select=select)
    mgr.loader.benchmark_settings = FAST  # keep the suite quick; the bench script uses the defaults
    mgr.load_all()
    return mgr


def _status(mgr: ModelManager, name: str) -> dict[str, Any]:
    return next(s for s in mgr.statuses() if s["name"] == name and s["state"] != "reload_failed")


def _break_openvino_ir(version_dir: Path) -> None:
    """A corrupt IR that still matches its manifest digest (as if it had been published broken)."""
    xml = version_dir / "openvino" / "model.xml"
    old = hashlib.sha256(xml.read_bytes()).hexdigest()
    xml.write_text("<net name='broken' version='11'><layers><layer id='0' type='NoSuchOp'/></layers></net>")
    manifest = version_dir / "model.toml"
    manifest.write_text(manifest.read_text().replace(old, hashlib.sha256(xml.read_bytes()).hexdigest()))


# ---- select = "first" -------------------------------------------------------------------------
def test_first_choice_then_the_next_when_it_fails(model_repo: MakeRepo, tmp_path: Path) -> None:
    repo = model_repo("mobilenet")
    mgr = _manager(repo, [OV, ORT], cache_dir=tmp_path / "cache")
    svc = InferenceService(mgr)
    try:
        s = _status(mgr, "mobilenet")
        assert (s["backend"], s["device"], s["precision"], s["variant"]) == (
            "openvino", "CPU", "fp32", "openvino/model.xml"), "the profile's first choice"
        assert s["skipped"] == []
        _break_openvino_ir(repo / "mobilenet" / "1")
        mgr.load_model("mobilenet")  # the reload meets the broken IR
        s = _status(mgr, "mobilenet")
        assert s["state"] == "ready" and s["variant"] == "model.onnx", "served through the next candidate"
        (skip,) = s["skipped"]
        assert skip["candidate"] == "openvino/CPU/fp32 (openvino/model.xml)"
        assert "OpenVINO could not compile it" in skip["reason"]
        meta = metadata_response(svc.describe("mobilenet"))
        assert meta["parameters"]["skipped"] == s["skipped"]
        x = np.zeros((1, 3, 48, 192), np.float32)
        assert svc.infer(InferRequest("mobilenet", {"image": x}), timeout=10).outputs["probabilities"].shape == (1, 37)
    finally:
        mgr.shutdown()


def test_a_device_the_engine_lacks_falls_back_to_the_next_engine(model_repo: MakeRepo) -> None:
    if "GPU" in get_backend("openvino").devices():
        pytest.skip("this machine has an OpenVINO GPU")
    ov_gpu = BackendPreference(backend="openvino", device="GPU", precisions=["fp32"])
    mgr = _manager(model_repo("mobilenet"), [ov_gpu, ORT])
    try:
        s = _status(mgr, "mobilenet")
        assert (s["backend"], s["device"], s["precision"]) == ("onnxruntime", "CPU", "fp32")
        assert [k["candidate"] for k in s["skipped"]] == [
            "openvino/GPU/fp32 (openvino/model.xml)", "openvino/GPU/fp32 (model.onnx)"]
        assert all("could not compile it for GPU" in k["reason"] for k in s["skipped"])
    finally:
        mgr.shutdown()


def test_every_candidate_failing_says_why(model_repo: MakeRepo) -> None:
    if "GPU" in get_backend("openvino").devices():
        pytest.skip("this machine has an OpenVINO GPU")
    mgr = _manager(model_repo("mobilenet"), [BackendPreference(backend="openvino", device="GPU",
                                                                precisions=["fp32"])])
    try:
        s = _status(mgr, "mobilenet")
        assert s["state"] == "unavailable" and s["backend"] is None
        assert s["reason"].startswith("every candidate engine failed: openvino/GPU/fp32 (openvino/model.xml): ")
        assert "openvino/GPU/fp32 (model.onnx): " in s["reason"]
    finally:
        mgr.shutdown()


# ---- select = "benchmark" ---------------------------------------------------------------------
def _check_choice(mv_status: Mapping[str, Any]) -> None:
    bench = mv_status["benchmark"]
    chosen = [b for b in bench if b["chosen"]]
    assert len(chosen) == 1
    top = max(b["throughput_per_s"] for b in bench)
    assert chosen[0]["throughput_per_s"] >= 0.95 * top, bench
    label = f"{mv_status['backend']}/{mv_status['device']}/{mv_status['precision']} ({mv_status['variant']})"
    assert chosen[0]["candidate"] == label


def _losses_logged(caplog: pytest.LogCaptureFixture) -> set[int]:
    """The levels at which candidates that lost a measurement were logged (and the log cleared)."""
    levels = {r.levelno for r in caplog.records if "skipped: measured slower" in r.getMessage()}
    caplog.clear()
    return levels


def test_benchmark_keeps_the_fastest_and_remembers_it(model_repo: MakeRepo, tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="edged")
    repo = model_repo("digits", "mobilenet")
    cache = tmp_path / "cache"
    mgr = _manager(repo, [ORT, OV], select="benchmark", cache_dir=cache)
    try:
        first = {n: _status(mgr, n) for n in ("digits", "mobilenet")}
        for name, s in first.items():
            assert s["state"] == "ready"
            _check_choice(s)
            measured = {b["candidate"] for b in s["benchmark"]}
            expected = {c.label for c in candidates(mgr.table.find(name).entry.usable_variants,  # type: ignore[union-attr]
                                                      [ORT, OV])}
            assert measured == expected, "every candidate that loads is timed"
            assert all(b["source"] == "measured" for b in s["benchmark"])
            losers = {k["candidate"] for k in s["skipped"]}
            assert losers == measured - {b["candidate"] for b in s["benchmark"] if b["chosen"]}
            assert all(b["batches"].keys() == {"1", "16"} for b in s["benchmark"]), "batch 1 and preferred"
        # A candidate that lost is the choice working, not a fault: INFO, or every start warns per loser.
        assert _losses_logged(caplog) == {logging.INFO}
        files = sorted(p.name for p in (cache / "select").iterdir())
        assert [re.sub(r"-[0-9a-f]{16}\.json$", "", f) for f in files] == ["digits-1", "mobilenet-1"]
    finally:
        mgr.shutdown()
    # A restart with nothing changed reuses the measurement: same choice, no timing.
    mgr = _manager(repo, [ORT, OV], select="benchmark", cache_dir=cache)
    try:
        for name, before in first.items():
            s = _status(mgr, name)
            assert s["backend"] == before["backend"] and s["variant"] == before["variant"]
            assert all(b["source"] == "remembered" for b in s["benchmark"])
            assert all("remembered" in k["reason"] for k in s["skipped"])
        assert _losses_logged(caplog) == {logging.INFO}
    finally:
        mgr.shutdown()
    # A changed candidate list (here: the profile no longer allows int8) is a new key: measured again.
    mgr = _manager(repo, [BackendPreference(backend="onnxruntime", device="CPU", precisions=["fp32"]), OV],
                   select="benchmark", cache_dir=cache)
    try:
        s = _status(mgr, "digits")
        assert all(b["source"] == "measured" for b in s["benchmark"])
        assert not any("int8" in b["candidate"] for b in s["benchmark"])
        _check_choice(s)
        assert len(list((cache / "select").glob("digits-1-*.json"))) == 1, "the stale result was pruned"
    finally:
        mgr.shutdown()


def test_benchmark_skips_engines_that_cannot_run_here(model_repo: MakeRepo) -> None:
    trt = BackendPreference(backend="tensorrt", device="GPU", precisions=["fp16"])
    try:
        get_backend("tensorrt").check_available()
    except EngineUnavailableError:
        pass
    else:
        pytest.skip("TensorRT works here")
    mgr = _manager(model_repo("digits"), [trt, ORT, OV], select="benchmark")
    try:
        s = _status(mgr, "digits")
        assert s["state"] == "ready" and s["backend"] in ("onnxruntime", "openvino")
        assert any(k["candidate"].startswith("tensorrt/") and "TensorRT" in k["reason"] for k in s["skipped"])
        assert not any(b["candidate"].startswith("tensorrt/") for b in s["benchmark"])
        _check_choice(s)
    finally:
        mgr.shutdown()


def test_benchmark_winner_serves(model_repo: MakeRepo, digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    mgr = _manager(model_repo("digits"), [ORT, OV], select="benchmark")
    svc = InferenceService(mgr)
    try:
        x, y = digits_holdout
        out = svc.infer(InferRequest("digits", {"pixels": x[:64]}), timeout=10).outputs["probabilities"]
        assert float(np.mean(out.argmax(1) == y[:64])) >= 0.9
        mv: ModelVersion = svc.ready_model("digits")
        assert mv.engine is not None and mv.candidate is not None and mv.engine.backend == mv.candidate.backend
    finally:
        mgr.shutdown()


# ---- the pieces ---------------------------------------------------------------------------------
def _timing(label: str, rate: float) -> CandidateTiming:
    return CandidateTiming(candidate=label, backend="x", device="CPU", precision="fp32", variant="m",
                           batches={1: rate}, throughput_per_s=rate, latency_ms=1000 / rate, iterations=10)


def test_choose_prefers_the_profile_order_within_the_noise_margin() -> None:
    a, b, c = _timing("a", 100.0), _timing("b", 102.0), _timing("c", 150.0)
    assert fastest([a, b]) is b
    assert choose([a, b], margin=0.03) is a, "2% apart: the profile's first wins"
    assert choose([a, b], margin=0.0) is b
    assert choose([a, b, c]) is c


def test_the_typical_call_ranks_not_the_fast_end_and_one_loaded_round_does_not_count_more() -> None:
    # A: most calls 1.0 ms with a fifth at 0.5 ms (a low quantile of pooled calls would say 0.5 ms);
    # B: every call 0.8 ms. A caller waits 1.0 ms on A most of the time: B is faster.
    a = [[0.5e-3] * 20 + [1.0e-3] * 80 for _ in range(8)]
    b = [[0.8e-3] * 100 for _ in range(8)]
    assert typical_call_s(a) == pytest.approx(1.0e-3)
    assert typical_call_s(b) < typical_call_s(a)
    # Other processes' load lands on one round of C (many slow calls there): C stays at its usual speed,
    # where pooling the calls would let that one round's 900 slow calls outvote the other rounds.
    c = [[1.0e-3] * 100 for _ in range(7)] + [[9.0e-3] * 900]
    assert typical_call_s(c) == pytest.approx(1.0e-3)
    with pytest.raises(ValueError):
        typical_call_s([[], []])


class _Broken(Engine):
    """An engine that loads but cannot run the sample (e.g. a shape the plugin rejects)."""

    backend, device, precision = "broken", "CPU", "fp32"
    inputs = [EngineTensor("pixels", "FP32", (-1, 64))]
    outputs = [EngineTensor("probabilities", "FP32", (-1, 10))]

    def infer(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        raise RuntimeError("kernel not found")


def test_measure_drops_an_engine_that_fails_and_times_the_rest(model_repo: MakeRepo) -> None:
    mgr = _manager(model_repo("digits"), [BackendPreference(backend="onnxruntime", device="CPU",
                                                             precisions=["fp32"])])
    try:
        mv = mgr.table.find("digits")
        assert mv is not None and mv.engine is not None and mv.candidate is not None
        broken = Candidate(mv.candidate.variant, "broken", "CPU", "fp32")
        sample = {"pixels": np.ones((1, 64), np.float32)}
        timings, failures = measure([(broken, _Broken()), (mv.candidate, mv.engine)], sample, [1, 8],
                                    batched=True, settings=FAST)
        assert [t.candidate for t in timings] == [mv.candidate.label]
        assert timings[0].batches.keys() == {1, 8} and timings[0].throughput_per_s > 0
        assert failures == [(broken.label, "failed while being measured: kernel not found")]
    finally:
        mgr.shutdown()


def test_selection_key_changes_with_what_the_speed_depends_on() -> None:
    v = Variant(file="model.onnx", format="onnx", sha256="0" * 64)
    c = [Candidate(v, "onnxruntime", "CPU", "fp32")]
    fp = {"cpu": ["x86_64", "GenuineIntel", "Core i7", 8, ["avx2"]]}
    base = selection_key("m", 1, c, {"onnxruntime": "1.20"}, threads=0, batch_sizes=[1, 8], fingerprint=fp)
    same = selection_key("m", 1, c, {"onnxruntime": "1.20"}, threads=0, batch_sizes=[1, 8], fingerprint=fp)
    assert base == same
    changed = [
        selection_key("m", 1, [Candidate(v.model_copy(update={"sha256": "1" * 64}), "onnxruntime", "CPU", "fp32")],
                      {"onnxruntime": "1.20"}, threads=0, batch_sizes=[1, 8], fingerprint=fp),  # new model digest
        selection_key("m", 1, c, {"onnxruntime": "1.21"}, threads=0, batch_sizes=[1, 8], fingerprint=fp),
        selection_key("m", 1, c, {"onnxruntime": "1.20"}, threads=2, batch_sizes=[1, 8], fingerprint=fp),
        selection_key("m", 1, c, {"onnxruntime": "1.20"}, threads=0, batch_sizes=[1, 8],
                      fingerprint={"cpu": ["x86_64", "GenuineIntel", "Core i7", 8, ["avx2", "avx512_vnni"]]}),
        selection_key("m", 2, c, {"onnxruntime": "1.20"}, threads=0, batch_sizes=[1, 8], fingerprint=fp),
        # other declared shapes or warm-up data (core.model_loader.workload_digest)
        selection_key("m", 1, c, {"onnxruntime": "1.20"}, threads=0, batch_sizes=[1, 8], fingerprint=fp,
                      workload="f" * 64),
        # two instances split a CPU engine's threads (OpenVINO: its streams)
        selection_key("m", 1, c, {"onnxruntime": "1.20"}, threads=0, batch_sizes=[1, 8], fingerprint=fp, instances=2),
    ]
    assert len({base, *changed}) == 1 + len(changed)


def test_selection_memory_round_trip_and_refusals(tmp_path: Path) -> None:
    memory = SelectionMemory(tmp_path / "select")
    result = BenchmarkResult(key="a" * 64, chosen="x", timings=[_timing("x", 10.0)], batch_sizes=[1])
    (tmp_path / "select").mkdir()
    memory.save("m", 1, result)
    back = memory.load("m", 1, "a" * 64)
    assert back is not None and back.source == "remembered" and back.timings[0].batches == {1: 10.0}
    assert memory.load("m", 1, "b" * 64) is None
    path = memory.path("m", 1, "a" * 64)
    path.write_text(json.dumps({"key": "a" * 64}))  # damaged: measured again, not a crash
    assert memory.load("m", 1, "a" * 64) is None
