"""TensorRT backend, engine cache and background engine builds.

Without a GPU this covers what does not need one: cache keys and atomic entries,
the refusal of mismatched plans, the OpenVINO per-key cache folder, TensorRT's
clean unavailability and fallback, and the background-build state machine and
zero-downtime engine switch, driven by an injected builder function that compiles
a real OpenVINO engine. Tests marked ``gpu`` build real TensorRT engines and run
only where ``tensorrt`` imports and CUDA sees a device.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edged.backends import factory as registry
from edged.backends.base import Backend, Engine, LoadRequest
from edged.backends.build import BuildState, EngineBuild, EngineBuildRequiredError
from edged.backends.enginecache import EngineCache, EngineCacheKey
from edged.backends.onnxruntime import OnnxRuntimeBackend
from edged.backends.openvino import OpenVinoBackend
from edged.backends.options import TensorRtOptions
from edged.backends.selection import candidates
from edged.backends.specs import SPECS
from edged.config import ModelsSection
from edged.core.manager import ModelManager
from edged.core.service import InferenceService
from edged.core.upgrade import SwappableEngine
from edged.errors import EngineUnavailableError, ModelLoadError
from edged.profiles import BackendPreference
from edged.protocol.types import InferRequest
from edged.repository.manifest import Variant, parse_manifest
from tests.conftest import MODELS

MakeRepo = Callable[..., Path]
DIGITS = MODELS / "digits" / "1"
MOBILENET = MODELS / "mobilenet" / "1"
OV_CPU = BackendPreference(backend="openvino", device="CPU", precisions=["fp32"])
ORT_CPU = BackendPreference(backend="onnxruntime", device="CPU", precisions=["fp32"])
TRT_GPU = BackendPreference(backend="tensorrt", device="GPU", precisions=["fp16", "fp32"])


def _key(**change: Any) -> EngineCacheKey:
    base: dict[str, Any] = dict(
        model="mobilenet", version=1, backend="tensorrt", variant="model.onnx", model_digest="a" * 64,
        library_versions={"tensorrt": "10.3.0", "cuda_runtime": "12.6"}, device="GPU0",
        hardware="Orin", compute_capability="8.7", platform="l4t 36.4.0 jetpack 6.1", precision="fp16",
        shape_profile="batch 1/16/32", options={"gpu_fallback": "True"})
    base.update(change)
    return EngineCacheKey(**base)


# ---- engine cache -------------------------------------------------------------------------------
@pytest.mark.parametrize("change", [
    {"model_digest": "b" * 64}, {"library_versions": {"tensorrt": "10.4.0", "cuda_runtime": "12.6"}},
    {"library_versions": {"tensorrt": "10.3.0", "cuda_runtime": "12.8"}}, {"hardware": "Xavier"},
    {"compute_capability": "7.2"}, {"platform": "l4t 35.5.0 jetpack 5.1.3"}, {"precision": "int8"},
    {"shape_profile": "batch 1/8/32"}, {"device": "DLA0"}, {"options": {"gpu_fallback": "False"}},
    {"variant": "model.fp16.onnx"}, {"version": 2},
])
def test_every_key_field_changes_the_digest(change: dict[str, Any]) -> None:
    assert _key().digest() == _key().digest()  # stable across instances
    assert _key(**change).digest() != _key().digest()


def test_cache_round_trip_is_atomic_and_checked(tmp_path: Path) -> None:
    cache = EngineCache(tmp_path / "trt")
    key = _key()
    assert cache.get(key) is None
    blob = bytes(range(256)) * 100
    path = cache.put(key, blob)
    assert path == cache.path_for(key) and path.name.startswith(key.slot)
    assert cache.get(key) == blob
    assert [p.name for p in path.parent.iterdir()] == [path.name], "no temp files left behind"
    # A flipped bit (SD-card rot) or a torn copy is refused, never handed to TensorRT.
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert cache.get(key) is None
    path.write_bytes(bytes(data[:50]))
    assert cache.get(key) is None
    path.write_bytes(b"garbage")
    assert cache.get(key) is None


def test_a_plan_stored_for_another_key_is_refused(tmp_path: Path) -> None:
    cache = EngineCache(tmp_path)
    old, new = _key(), _key(library_versions={"tensorrt": "10.4.0", "cuda_runtime": "12.6"})
    cache.put(old, b"plan built by TensorRT 10.3")
    # Even if the entry ends up under the new key's name (a copied cache, a collision), its header says
    # which key it was built for, and that is compared in full.
    shutil.copy(cache.path_for(old), cache.path_for(new))
    assert cache.get(new) is None
    assert cache.get(old) == b"plan built by TensorRT 10.3"


def test_put_prunes_entries_it_supersedes(tmp_path: Path) -> None:
    cache = EngineCache(tmp_path)
    old = _key()
    other_precision = _key(precision="int8")
    other_model = _key(model="digits")
    for k in (old, other_precision, other_model):
        cache.put(k, b"x")
    upgraded = _key(library_versions={"tensorrt": "10.4.0", "cuda_runtime": "12.6"})
    cache.put(upgraded, b"y")
    assert not cache.path_for(old).exists(), "the plan for the old TensorRT must go"
    for k in (other_precision, other_model, upgraded):
        assert cache.path_for(k).exists()


def test_folder_entries_for_self_managed_caches(tmp_path: Path) -> None:
    cache = EngineCache(tmp_path)
    key = _key(backend="openvino", library_versions={"openvino": "2025.1"}, device="CPU", precision="fp32")
    folder = cache.dir_for(key)
    assert folder.is_dir() and (folder / "key.json").read_text().strip() == key.canonical()
    (folder / "123.blob").write_bytes(b"compiled")
    assert cache.dir_for(key) == folder and (folder / "123.blob").exists(), "same key, same folder, kept"
    upgraded = key.model_copy(update={"library_versions": {"openvino": "2026.0"}})
    new_folder = cache.dir_for(upgraded)
    assert new_folder != folder and not folder.exists(), "a library upgrade never sees the old blob"


def test_timing_cache_is_per_gpu_and_library(tmp_path: Path) -> None:
    cache = EngineCache(tmp_path)
    a = cache.timing_cache_path({"tensorrt": "10.3", "gpu": "Orin", "compute_capability": "8.7"})
    b = cache.timing_cache_path({"tensorrt": "10.3", "gpu": "Orin", "compute_capability": "8.7"})
    c = cache.timing_cache_path({"tensorrt": "10.4", "gpu": "Orin", "compute_capability": "8.7"})
    assert a == b != c and a.parent == tmp_path / "timing"


def test_openvino_blobs_go_to_a_folder_per_key(model_repo: MakeRepo, tmp_path: Path) -> None:
    repo = model_repo("mobilenet")
    cache_dir = tmp_path / "cache"
    for _ in range(2):
        mgr = ModelManager(repo, ModelsSection(), [OV_CPU], cache_dir=cache_dir)
        mgr.load_all()
        assert mgr.table.find("mobilenet").candidate.backend == "openvino"  # type: ignore[union-attr]
        mgr.shutdown()
    folders = [p for p in (cache_dir / "openvino").iterdir() if p.is_dir()]
    assert len(folders) == 1, "the second start reuses the first start's folder"
    stamp = (folders[0] / "key.json").read_text()
    assert '"backend":"openvino"' in stamp and '"library_versions":{"openvino":' in stamp
    assert any(p.suffix == ".blob" for p in folders[0].iterdir())


# ---- TensorRT without a GPU ----------------------------------------------------------------------
def _tensorrt_usable() -> bool:
    try:
        registry.get_backend("tensorrt").check_available()
    except EngineUnavailableError:
        return False
    return True


def test_tensorrt_unavailable_is_explained_not_crashed() -> None:
    backend = registry.get_backend("tensorrt")
    assert backend.name == "tensorrt" and SPECS["tensorrt"].formats == ("tensorrt", "onnx")
    if _tensorrt_usable():
        pytest.skip("TensorRT and a CUDA device are present here")
    with pytest.raises(EngineUnavailableError) as err:
        backend.check_available()
    assert "TensorRT" in str(err.value) and ("pip install tensorrt" in str(err.value) or "GPU" in str(err.value))


def test_cuda_runtime_through_ctypes_answers_without_a_gpu() -> None:
    from edged.backends.cudart import cuda_runtime
    try:
        cuda = cuda_runtime()
    except EngineUnavailableError:
        pytest.skip("no libcudart on this machine")
    major, minor = cuda.runtime_version().split(".")
    assert int(major) >= 10 and minor.isdigit()
    count, why = cuda.device_count()
    assert count >= 0 and (count > 0 or why)


def test_tensorrt_precisions_from_an_onnx_variant() -> None:
    plain = Variant(file="m.onnx", format="onnx", precision="fp32", sha256="0" * 64)
    calibrated = Variant(file="c.onnx", format="onnx", precision="fp32", sha256="1" * 64,
                         calibration_cache="calib.cache")
    prefs = [BackendPreference(backend="tensorrt", device="GPU", precisions=["int8", "fp16", "fp32"]), ORT_CPU]
    labels = [c.label for c in candidates([plain], prefs)]
    assert labels == ["tensorrt/GPU/fp16 (m.onnx)", "tensorrt/GPU/fp32 (m.onnx)", "onnxruntime/CPU/fp32 (m.onnx)"]
    labels = [c.label for c in candidates([calibrated], prefs)]
    assert labels[0] == "tensorrt/GPU/int8 (c.onnx)", "INT8 only with a shipped calibration cache"


def test_model_falls_back_when_tensorrt_is_missing(model_repo: MakeRepo) -> None:
    if _tensorrt_usable():
        pytest.skip("TensorRT works here")
    mgr = ModelManager(model_repo("digits"), ModelsSection(), [TRT_GPU, ORT_CPU])
    mgr.load_all()
    try:
        status = mgr.table.find("digits").status()  # type: ignore[union-attr]
        assert status["state"] == "ready" and status["backend"] == "onnxruntime"
        trt_skips = [s for s in status["skipped"] if s["candidate"].startswith("tensorrt/")]
        assert trt_skips and all("TensorRT" in s["reason"] for s in trt_skips)
    finally:
        mgr.shutdown()


# ---- the build state machine ----------------------------------------------------------------------
def _ort_engine(version_dir: Path = DIGITS) -> Engine:
    m = parse_manifest(version_dir / "model.toml")
    v = next(v for v in m.variants if v.file == "model.onnx")
    return OnnxRuntimeBackend().load(LoadRequest("m", 1, version_dir, v, max_batch_size=m.max_batch_size))


def test_build_goes_pending_building_ready() -> None:
    gate, seen = threading.Event(), []
    build: EngineBuild

    def builder() -> Engine:
        seen.append(build.state)
        gate.wait(10)
        return _ort_engine()

    build = EngineBuild("ort", builder)
    assert build.state is BuildState.PENDING
    t = threading.Thread(target=build.run)
    t.start()
    gate.set()
    t.join(10)
    assert seen == [BuildState.BUILDING]
    assert build.status()["state"] == "ready" and build.engine is not None and build.wait(0)
    with pytest.raises(RuntimeError):  # runs once
        build.run()


def test_build_failure_keeps_the_reason() -> None:
    def builder() -> Engine:
        raise ModelLoadError("parser: unsupported operator GridSample")

    build = EngineBuild("trt", builder)
    with pytest.raises(ModelLoadError, match="GridSample"):
        build.run()
    assert build.state is BuildState.FAILED and "GridSample" in (build.reason or "")


def test_cancel_before_and_during_a_build() -> None:
    early = EngineBuild("never", _ort_engine)
    early.cancel()
    assert early.state is BuildState.CANCELLED
    with pytest.raises(ModelLoadError, match="cancelled"):
        early.run()

    started, gate = threading.Event(), threading.Event()
    made: list[Engine] = []

    def slow() -> Engine:
        started.set()
        gate.wait(10)
        made.append(_ort_engine())
        return made[0]

    build = EngineBuild("slow", slow)
    errors: list[BaseException | None] = []
    t = threading.Thread(target=lambda: errors.append(_catch(build.run)))
    t.start()
    started.wait(10)
    build.cancel()
    gate.set()
    t.join(10)
    assert build.state is BuildState.CANCELLED and isinstance(errors[0], ModelLoadError)
    with pytest.raises(ModelLoadError, match="unloaded"):  # the result was released, not leaked
        made[0].infer({"pixels": np.zeros((1, 64), np.float32)})


def _catch(fn: Callable[[], object]) -> BaseException | None:
    try:
        fn()
    except BaseException as e:
        return e
    return None


def test_swappable_engine_switches_under_load_without_failures() -> None:
    a, b = _ort_engine(), _ort_engine()
    proxy = SwappableEngine(a)
    x = np.random.default_rng(0).random((2, 64), dtype=np.float32) * 16
    want = a.infer({"pixels": x})["probabilities"]
    stop, failures, calls = threading.Event(), [], [0]

    def hammer() -> None:
        while not stop.is_set():
            try:
                np.testing.assert_allclose(proxy.infer({"pixels": x})["probabilities"], want, atol=1e-6)
                calls[0] += 1
            except BaseException as e:
                failures.append(e)

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    while calls[0] < 200 and not failures:
        stop.wait(0.005)
    old = proxy.swap(b)
    assert old is a
    a.unload()  # safe: swap returned only after the last call on `a` finished
    before = calls[0]
    while calls[0] < before + 200 and not failures:
        stop.wait(0.005)
    stop.set()
    for t in threads:
        t.join(10)
    assert failures == []
    assert proxy.current is b
    proxy.unload()
    assert proxy.swap(_ort_engine()) is None, "a closed proxy releases what it is given"


# ---- background builds through the real loader ------------------------------------------------------
class DeferredOpenVino(Backend):
    """The real OpenVINO backend whose compile is handed to the loader as a background build.

    This stands in for TensorRT's build on machines without a GPU: the loader, the
    state machine and the switch under test are the real ones; only *what* is built
    differs (a real OpenVINO engine instead of a TensorRT plan).
    """

    name = "openvino"

    def __init__(self, gate: threading.Event, fail: str | None = None) -> None:
        self.real = OpenVinoBackend()
        self.gate = gate
        self.fail = fail
        self.started = threading.Event()
        self.built: list[Engine] = []

    def check_available(self) -> None:
        self.real.check_available()

    def library_version(self) -> str:
        return self.real.library_version()

    def load(self, request: LoadRequest) -> Engine:
        def build() -> Engine:
            self.started.set()
            if not self.gate.wait(60):
                raise ModelLoadError("test gate never opened")
            if self.fail:
                raise ModelLoadError(self.fail)
            engine = self.real.load(request)
            self.built.append(engine)
            return engine

        raise EngineBuildRequiredError(f"{request.label}: compiled in the background", build)


@pytest.fixture
def deferred(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., DeferredOpenVino]]:
    def install(fail: str | None = None) -> DeferredOpenVino:
        backend = DeferredOpenVino(threading.Event(), fail)
        monkeypatch.setitem(registry._instances, "openvino", backend)
        return backend

    yield install


def _hammer(svc: InferenceService, x: np.ndarray, want: np.ndarray, *, stop: threading.Event,
            failures: list[BaseException], counts: list[int], k: int) -> None:
    while not stop.is_set():
        try:
            out = svc.infer(InferRequest("digits", {"pixels": x}), timeout=30).outputs["probabilities"]
            np.testing.assert_allclose(out, want, atol=1e-4)
            counts[k] += 1
        except BaseException as e:
            failures.append(e)


def test_serves_at_once_then_switches_to_the_built_engine(
        model_repo: MakeRepo, deferred: Callable[..., DeferredOpenVino],
        digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    backend = deferred()
    mgr = ModelManager(model_repo("digits"), ModelsSection(), [OV_CPU, ORT_CPU])
    mgr.load_all()
    svc = InferenceService(mgr)
    try:
        mv = svc.ready_model("digits")
        assert mv.candidate is not None and mv.candidate.backend == "onnxruntime", "serves through the next one"
        status = mv.status()
        assert status["upgrade"]["state"] == "building"
        assert status["upgrade"]["builds"][0]["candidate"].startswith("openvino/CPU/fp32")
        x = digits_holdout[0][:3]
        want = _ort_engine().infer({"pixels": x})["probabilities"]
        stop, failures, counts = threading.Event(), list[BaseException](), [0] * 4
        threads = [threading.Thread(target=_hammer, args=(svc, x, want),
                                    kwargs={"stop": stop, "failures": failures, "counts": counts, "k": k})
                   for k in range(4)]
        for t in threads:
            t.start()
        while sum(counts) < 200 and not failures:
            stop.wait(0.005)
        backend.gate.set()  # the "build" finishes while requests are in flight
        assert mv.upgrade is not None and mv.upgrade.wait(60)
        switched_at = sum(counts)
        while sum(counts) < switched_at + 200 and not failures:
            stop.wait(0.005)
        stop.set()
        for t in threads:
            t.join(30)
        assert failures == [], failures[:3]
        status = mv.status()
        assert status["upgrade"]["state"] == "ready" and status["backend"] == "openvino"
        assert status["variant"] == "openvino/model.xml"
        assert isinstance(mv.engine, SwappableEngine) and mv.engine.current is backend.built[0]
        assert mv.stats is not None and mv.stats.backend == "openvino"
    finally:
        mgr.shutdown()


def test_a_failed_build_is_kept_and_serving_goes_on(model_repo: MakeRepo,
                                                    deferred: Callable[..., DeferredOpenVino]) -> None:
    backend = deferred(fail="builder ran out of workspace memory")
    mgr = ModelManager(model_repo("digits"), ModelsSection(), [OV_CPU, ORT_CPU])
    mgr.load_all()
    svc = InferenceService(mgr)
    try:
        mv = svc.ready_model("digits")
        backend.gate.set()
        assert mv.upgrade is not None and mv.upgrade.wait(60)
        status = mv.status()
        assert status["upgrade"]["state"] == "failed" and status["backend"] == "onnxruntime"
        reasons = [s["reason"] for s in status["skipped"]]
        assert any("workspace memory" in r for r in reasons), reasons
        assert all(b["state"] == "failed" for b in status["upgrade"]["builds"])
        out = svc.infer(InferRequest("digits", {"pixels": np.zeros((1, 64), np.float32)}), timeout=10)
        assert out.outputs["probabilities"].shape == (1, 10)
    finally:
        mgr.shutdown()


def test_unloading_while_building_discards_the_result(model_repo: MakeRepo,
                                                       deferred: Callable[..., DeferredOpenVino]) -> None:
    backend = deferred()
    mgr = ModelManager(model_repo("digits"), ModelsSection(), [OV_CPU, ORT_CPU])
    mgr.load_all()
    mv = mgr.table.find("digits")
    assert mv is not None and mv.upgrade is not None
    assert backend.started.wait(30)
    mgr.unload_model("digits")
    backend.gate.set()
    assert mv.upgrade.wait(60)
    assert mv.upgrade.state == "cancelled"
    # The OpenVINO engine built after the unload was released (its infer now fails).
    with pytest.raises((ModelLoadError, AttributeError)):
        backend.built[0].infer({"pixels": np.zeros((1, 64), np.float32)})
    mgr.shutdown()


def test_with_nothing_else_to_serve_the_build_runs_inline(model_repo: MakeRepo,
                                                          deferred: Callable[..., DeferredOpenVino]) -> None:
    backend = deferred()
    backend.gate.set()
    mgr = ModelManager(model_repo("digits"), ModelsSection(), [OV_CPU])
    mgr.load_all()
    try:
        (status,) = mgr.statuses()
        assert status["state"] == "ready" and status["backend"] == "openvino" and "upgrade" not in status
    finally:
        mgr.shutdown()


def test_benchmark_profile_measures_the_built_engine_before_switching(
        model_repo: MakeRepo, deferred: Callable[..., DeferredOpenVino], tmp_path: Path) -> None:
    backend = deferred()
    mgr = ModelManager(model_repo("digits"), ModelsSection(), [OV_CPU, ORT_CPU], cache_dir=tmp_path / "c",
                       select="benchmark")
    mgr.load_all()
    try:
        mv = mgr.table.find("digits")
        assert mv is not None and mv.benchmark is not None and not mv.benchmark.complete
        backend.gate.set()
        assert mv.upgrade is not None and mv.upgrade.wait(60)
        assert mv.upgrade.state in ("ready", "kept")
        labels = {t["candidate"] for t in mv.status()["benchmark"]}
        assert any(label.startswith("openvino/") for label in labels), "the built engine was measured"
        assert any(label.startswith("onnxruntime/") for label in labels)
        assert mv.candidate is not None and mv.benchmark.chosen == mv.candidate.label
        # An incomplete measurement is not remembered: the next start measures every candidate.
        assert not list((tmp_path / "c" / "select").glob("*.json"))
    finally:
        mgr.shutdown()


# ---- real TensorRT (GPU machines only) ------------------------------------------------------------
def _needs_gpu() -> None:
    if not _tensorrt_usable():
        pytest.skip("needs TensorRT and a CUDA device")


def _trt_request(version_dir: Path, cache: Path | None, precision: str = "", **options: Any) -> LoadRequest:
    m = parse_manifest(version_dir / "model.toml")
    v = next(v for v in m.variants if v.file == "model.onnx")
    return LoadRequest("mobilenet", 1, version_dir, v, device="GPU", options=TensorRtOptions(**options),
                       precision=precision,
                       max_batch_size=m.max_batch_size, inputs=m.inputs, cache_dir=cache)


def _build_or_load(req: LoadRequest) -> tuple[Engine, bool]:
    try:
        return registry.get_backend("tensorrt").load(req), False
    except EngineBuildRequiredError as pending:
        return EngineBuild(req.label, pending.builder).run(), True


@pytest.mark.gpu
def test_tensorrt_builds_caches_and_agrees_with_onnxruntime(tmp_path: Path) -> None:
    _needs_gpu()
    cache = tmp_path / "trt"
    req = _trt_request(MOBILENET, cache, precision="fp16", opt_batch_size=8)
    engine, built = _build_or_load(req)
    assert built and engine.backend == "tensorrt" and engine.precision == "fp16"
    x = np.random.default_rng(0).random((5, 3, 48, 192), dtype=np.float32)
    want = _ort_engine(MOBILENET).infer({"image": x})["probabilities"]
    for rows in (1, 5):
        got = engine.infer({"image": x[:rows]})["probabilities"]
        np.testing.assert_allclose(got, want[:rows], atol=2e-2)
    engine.unload()
    plans = list(cache.glob("*.engine"))
    assert len(plans) == 1 and list((cache / "timing").iterdir())
    again, built_again = _build_or_load(req)
    assert not built_again, "the cached plan is deserialized, not rebuilt"
    again.unload()
    other, rebuilt = _build_or_load(_trt_request(MOBILENET, cache, precision="fp32", opt_batch_size=8))
    assert rebuilt, "another precision is another key"
    other.unload()


@pytest.mark.gpu
def test_tensorrt_upgrade_through_the_manager(model_repo: MakeRepo, tmp_path: Path) -> None:
    _needs_gpu()
    mgr = ModelManager(model_repo("mobilenet"), ModelsSection(), [TRT_GPU, ORT_CPU], cache_dir=tmp_path / "c")
    mgr.load_all()
    try:
        mv = mgr.table.find("mobilenet")
        assert mv is not None and mv.candidate is not None
        if mv.upgrade is not None:
            assert mv.upgrade.wait(600)
        assert mv.status()["backend"] == "tensorrt", mv.status()
    finally:
        mgr.shutdown()
