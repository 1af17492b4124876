"""TensorRT: NVIDIA GPUs and Jetson (GPU and DLA cores).

A variant is either a prebuilt plan (``format = "tensorrt"``), deserialized as is,
or an ONNX file that is built into a plan on the device: FP16, INT8 (with the
calibration cache shipped in the model version, or from an INT8 ONNX file with
its own quantization), an optimization profile over the batch dimension (min 1,
opt = the preferred batch, max = ``max_batch_size``) and a layer-timing cache.
Plans land in the engine cache keyed by GPU, compute capability, L4T, library
versions, precision and shape profile (:mod:`edged.backends.enginecache`). A build
takes minutes on a Jetson, so ``load`` raises ``EngineBuildRequiredError`` with the
build as a function and the loader runs it in the background while the model
serves through the next candidate.

CUDA is reached through ``ctypes`` on ``libcudart`` (:mod:`edged.backends.cudart`:
no pycuda or cuda-python to install). Inference uses the named-tensor API of
TensorRT 8.5+/10 (``set_input_shape``, ``set_tensor_address``,
``execute_async_v3``); each concurrent caller gets its own execution context,
CUDA stream and device buffers from a pool.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import queue
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from edged import datatypes
from edged.backends.base import Backend, Engine, EngineTensor, LoadRequest
from edged.backends.build import EngineBuildRequiredError
from edged.backends.cudart import D2H, H2D, INSTALL_HINT, CudaRuntime, cuda_runtime
from edged.backends.enginecache import EngineCache, EngineCacheKey, variant_digest
from edged.backends.options import BackendOptions, TensorRtOptions
from edged.errors import EngineUnavailableError, InternalError, InvalidInputError, ModelLoadError
from edged.fsutil import atomic_write_bytes
from edged.hardware.facts import HardwareFacts

log = logging.getLogger(__name__)


def _import_trt() -> Any:
    try:
        import tensorrt
    except ImportError as e:
        raise EngineUnavailableError(f"TensorRT is not installed ({e}); {INSTALL_HINT}") from None
    return tensorrt


def _platform_of(f: HardwareFacts) -> str:
    """The L4T/JetPack release (Jetson) or driver version (discrete GPU) that plans depend on."""
    if f.jetson.present:
        return f"l4t {f.jetson.l4t} jetpack {f.jetson.jetpack} soc {f.jetson.soc}"
    return f"driver {f.nvidia_gpu.driver_version}" if f.nvidia_gpu.driver_version else ""


@functools.lru_cache(maxsize=1)
def _probed_platform() -> str:
    """:func:`_platform_of` this machine, probed once; for callers without the daemon's facts."""
    try:
        from edged.hardware.probe import probe
        f = probe(Path("/"), engines=False)
    except Exception as e:  # best effort: the CUDA versions in the key still cover most changes
        log.warning("tensorrt: hardware probe failed: %s", e)
        return ""
    return _platform_of(f)


def _platform(facts: HardwareFacts | None) -> str:
    return _platform_of(facts) if facts is not None else _probed_platform()


# ---- TensorRT logging ---------------------------------------------------------------------------
def _make_logger(trt: Any) -> Any:
    class _Logger(trt.ILogger):  # type: ignore[misc]
        """Routes TensorRT's messages to our log and keeps the errors for the failure message."""

        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.errors: list[str] = []

        def log(self, severity: Any, msg: str) -> None:
            level = int(severity)
            if level <= 1:  # INTERNAL_ERROR, ERROR
                self.errors.append(msg)
                log.error("tensorrt: %s", msg)
            elif level == 2:
                log.warning("tensorrt: %s", msg)
            elif level == 3:
                log.debug("tensorrt: %s", msg)

        def summary(self) -> str:
            return "; ".join(self.errors[-3:]) or "no error message from TensorRT"

    return _Logger()


def _cache_calibrator(trt: Any, cache: bytes) -> Any:
    """An INT8 calibrator that only replays a shipped calibration cache (no calibration data on the device)."""

    class _CacheCalibrator(trt.IInt8EntropyCalibrator2):  # type: ignore[misc]
        def __init__(self) -> None:
            trt.IInt8EntropyCalibrator2.__init__(self)

        def get_batch_size(self) -> int:
            return 1

        def get_batch(self, names: Sequence[str]) -> None:
            return None

        def read_calibration_cache(self) -> bytes:
            return cache

        def write_calibration_cache(self, data: Any) -> None:
            return None

    return _CacheCalibrator()


# ---- the engine ---------------------------------------------------------------------------------
class _Slot:
    """One execution context with its own stream and device buffers: one concurrent caller."""

    def __init__(self, engine: Any, cuda: CudaRuntime) -> None:
        self.context = engine.create_execution_context()
        if self.context is None:
            raise ModelLoadError("TensorRT could not create an execution context (out of GPU memory?)")
        self.stream = cuda.stream_create()
        self.buffers: dict[str, tuple[int, int]] = {}

    def buffer(self, cuda: CudaRuntime, name: str, nbytes: int) -> int:
        ptr, size = self.buffers.get(name, (0, 0))
        if ptr and size >= nbytes:
            return ptr
        if ptr:
            cuda.free(ptr)
            del self.buffers[name]
        size = max(256, nbytes)
        ptr = cuda.malloc(size)
        self.buffers[name] = (ptr, size)
        return ptr

    def close(self, cuda: CudaRuntime) -> None:
        for ptr, _ in self.buffers.values():
            cuda.free(ptr)
        self.buffers.clear()
        if self.stream:
            cuda.stream_destroy(self.stream)
            self.stream = 0
        self.context = None


class TensorRtEngine(Engine):
    backend = "tensorrt"

    def __init__(self, trt: Any, engine: Any, runtime: Any, logger: Any, cuda: CudaRuntime, *, gpu: int,  # noqa: PLR0913  an engine's TensorRT parts plus keyword-only options
                 device: str, precision: str, instances: int, max_batch_size: int) -> None:
        self._engine, self._runtime, self._logger, self._cuda = engine, runtime, logger, cuda
        self._gpu = gpu
        self.device, self.precision = device, precision
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        self._dtypes = {n: np.dtype(trt.nptype(engine.get_tensor_dtype(n))) for n in names}
        is_input = {n: engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT for n in names}
        tensors = {n: EngineTensor(n, datatypes.from_numpy(self._dtypes[n]),
                                   tuple(int(d) for d in engine.get_tensor_shape(n))) for n in names}
        self.inputs = [tensors[n] for n in names if is_input[n]]
        self.outputs = [tensors[n] for n in names if not is_input[n]]
        self._output_names = [t.name for t in self.outputs]
        if max_batch_size > 0:
            for t in self.inputs:
                top = t.shape[0] if t.shape and t.shape[0] >= 0 else \
                    int(engine.get_tensor_profile_shape(t.name, 0)[2][0])
                if top < max_batch_size:
                    raise ModelLoadError(f"TensorRT engine input {t.name!r} takes at most batch {top}, but the "
                                         f"manifest's max_batch_size is {max_batch_size}")
        self._lock = threading.Lock()
        self._closed = False
        self._pool: queue.SimpleQueue[_Slot] = queue.SimpleQueue()
        cuda.set_device(gpu)
        for _ in range(max(1, instances)):
            self._pool.put(_Slot(engine, cuda))

    def infer(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        if self._closed:
            raise ModelLoadError("engine was unloaded")
        self._cuda.set_device(self._gpu)  # the current device is per thread
        try:
            slot = self._pool.get_nowait()
        except queue.Empty:
            slot = _Slot(self._engine, self._cuda)
        ok = False
        try:
            out = self._run(slot, inputs, list(outputs) if outputs else self._output_names)
            ok = True
            return out
        finally:
            with self._lock:
                closed = self._closed
            # A context that failed may keep the refused shapes: the next caller gets a fresh one.
            if closed or not ok:
                slot.close(self._cuda)
            else:
                self._pool.put(slot)

    def _run(self, slot: _Slot, inputs: Mapping[str, np.ndarray], wanted: list[str]) -> dict[str, np.ndarray]:
        cuda, ctx, stream = self._cuda, slot.context, slot.stream
        unknown = sorted(set(wanted) - set(self._output_names))
        if unknown:
            raise InvalidInputError(f"unknown output(s) {unknown}; the model has {self._output_names}")
        staged = []  # keep host arrays alive until the stream is done with them
        try:
            for t in self.inputs:
                arr = np.require(inputs[t.name], self._dtypes[t.name], "C")  # a scalar stays 0-d
                staged.append(arr)
                if not ctx.set_input_shape(t.name, arr.shape):
                    raise InvalidInputError(f"input {t.name!r} shape {list(arr.shape)} is outside what the "
                                            "TensorRT engine was built for")
                ptr = slot.buffer(cuda, t.name, arr.nbytes)
                if arr.nbytes:
                    cuda.copy_async(ptr, arr.ctypes.data, arr.nbytes, H2D, stream)
                ctx.set_tensor_address(t.name, ptr)
            results: dict[str, tuple[np.ndarray, int]] = {}
            for t in self.outputs:
                shape = tuple(int(d) for d in ctx.get_tensor_shape(t.name))
                if any(d < 0 for d in shape):
                    raise InternalError(f"TensorRT could not resolve the shape of output {t.name!r}")
                host = np.empty(shape, dtype=self._dtypes[t.name])
                ptr = slot.buffer(cuda, t.name, host.nbytes)
                ctx.set_tensor_address(t.name, ptr)
                if t.name in wanted:
                    results[t.name] = (host, ptr)
            if not ctx.execute_async_v3(stream):
                raise InternalError(f"TensorRT execution failed: {self._logger.summary()}")
            for host, ptr in results.values():
                if host.nbytes:
                    cuda.copy_async(host.ctypes.data, ptr, host.nbytes, D2H, stream)
        finally:
            cuda.stream_sync(stream)
        return {n: results[n][0] for n in wanted}

    def unload(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        while True:
            try:
                self._pool.get_nowait().close(self._cuda)
            except queue.Empty:
                break
        # Contexts before the engine, the engine before its runtime.
        self._engine = None
        self._runtime = None


# ---- the backend --------------------------------------------------------------------------------
_build_locks: dict[str, threading.Lock] = {}
_build_locks_guard = threading.Lock()


def _build_lock(key: str) -> threading.Lock:
    # A reload while the first build still runs waits for it and then finds the plan in the cache.
    with _build_locks_guard:
        return _build_locks.setdefault(key, threading.Lock())


def _dla_core(request: LoadRequest) -> int:
    core = TensorRtOptions.of(request.options).dla_core
    if request.device.upper() == "DLA":
        return core if core is not None and core >= 0 else 0
    return core if core is not None else -1


def _opt_batch(request: LoadRequest) -> int:
    mbs = request.max_batch_size
    opt = TensorRtOptions.of(request.options).opt_batch_size or 1
    return max(1, min(opt, mbs)) if mbs > 0 else 1


def _number(value: float | None) -> str:
    """A number as a cache key records it ("" for none; 512, not 512.0, as a profile usually writes it)."""
    if value is None:
        return ""
    return str(int(value)) if float(value).is_integer() else str(value)


def _shape_profile(request: LoadRequest, opt: int) -> str:
    batch = f"batch 1/{opt}/{request.max_batch_size}" if request.max_batch_size > 0 else "no batch dimension"
    declared = ";".join(f"{s.name}:{s.shape}" for s in request.inputs or [])
    ranges = ";".join(f"{n}:{request.shape_range(n)}" for n in sorted(request.shapes))
    return f"{batch} {declared or 'shapes from the model file'}" + (f" ranges {ranges}" if ranges else "")


class TensorRtBackend(Backend):
    name = "tensorrt"

    def check_available(self) -> None:
        _import_trt()
        count, why = cuda_runtime().device_count()
        if count < 1:
            raise EngineUnavailableError(f"TensorRT needs an NVIDIA GPU, but CUDA sees none ({why or 'no device'})")

    def check_available_for(self, options: BackendOptions) -> None:
        worker = TensorRtOptions.of(options).engine_worker
        if not worker:
            self.check_available()
        elif not os.access(worker, os.X_OK):
            raise EngineUnavailableError(f"the TensorRT engine worker's Python {worker} is not there (JetPack 5 "
                                         "puts TensorRT's bindings under /usr/bin/python3: python3-libnvinfer)")

    def library_version(self) -> str:
        return str(_import_trt().__version__)

    def devices(self) -> list[str]:
        trt = _import_trt()
        count, _ = cuda_runtime().device_count()
        if count < 1:
            return []
        dla = int(trt.Builder(_make_logger(trt)).num_DLA_cores)
        return ["GPU", *(["DLA"] if dla > 0 else [])]

    # ---- keys ---------------------------------------------------------------------------------
    def hardware(self, gpu: int = 0, facts: HardwareFacts | None = None) -> dict[str, str]:
        """What a plan and a timing cache are specific to."""
        trt, cuda = _import_trt(), cuda_runtime()
        return {"tensorrt": str(trt.__version__), "cuda_runtime": cuda.runtime_version(),
                "cuda_driver": cuda.driver_version(), "gpu": cuda.device_name(gpu),
                "compute_capability": cuda.compute_capability(gpu), "platform": _platform(facts)}

    def engine_key(self, request: LoadRequest, *, precision: str, dla_core: int, opt_batch: int,
                   gpu: int = 0) -> EngineCacheKey:
        hw = self.hardware(gpu, request.facts)
        opts = TensorRtOptions.of(request.options)
        more: dict[str, str] = {}
        calib = request.variant.calibration_cache
        if precision == "int8" and calib and request.variant.precision != "int8":
            try:
                more["calibration"] = hashlib.sha256((request.version_dir / calib).read_bytes()).hexdigest()
            except OSError as e:
                raise ModelLoadError(f"{request.label}: cannot read calibration cache {calib}: {e.strerror}") from None
        return EngineCacheKey(
            model=request.model, version=request.version, backend="tensorrt", variant=request.variant.file,
            model_digest=variant_digest(request.variant, **more),
            library_versions={"tensorrt": hw["tensorrt"], "cuda_runtime": hw["cuda_runtime"]},
            device=f"DLA{dla_core}" if dla_core >= 0 else f"GPU{gpu}", hardware=hw["gpu"],
            compute_capability=hw["compute_capability"],
            platform=f"{hw['platform']} cuda-driver {hw['cuda_driver']}".strip(), precision=precision,
            shape_profile=_shape_profile(request, opt_batch),
            options={"gpu_fallback": str(opts.gpu_fallback), "workspace_mb": _number(opts.workspace_mb)})

    # ---- loading ------------------------------------------------------------------------------
    def load(self, request: LoadRequest) -> Engine:
        opts = TensorRtOptions.of(request.options)
        if opts.engine_worker:
            return self._load_in_worker(request, opts.engine_worker)
        trt, cuda = _import_trt(), cuda_runtime()
        gpu = opts.gpu_id
        cuda.set_device(gpu)
        precision = request.precision or request.variant.precision
        dla = _dla_core(request)
        if request.variant.format == "tensorrt":
            try:
                plan = request.file.read_bytes()
            except OSError as e:
                raise ModelLoadError(f"{request.label}: cannot read the plan: {e.strerror}") from None
            return self._deserialize(trt, plan, request, precision=precision, dla=dla, gpu=gpu)
        if request.variant.format != "onnx":
            raise ModelLoadError(f"{request.label}: TensorRT cannot load {request.variant.format} files")
        opt = _opt_batch(request)
        key = self.engine_key(request, precision=precision, dla_core=dla, opt_batch=opt, gpu=gpu)
        cache = EngineCache(request.cache_dir) if request.cache_dir is not None else None
        engine = self._from_cache(trt, cache, key, request, precision=precision, dla=dla, gpu=gpu)
        if engine is not None:
            return engine

        def build() -> Engine:
            return self._build(request, key, cache, precision=precision, dla=dla, gpu=gpu, opt=opt)

        raise EngineBuildRequiredError(
            f"{request.label}: no TensorRT {precision} plan for this GPU and library yet; it must be built",
            build, model=request.model, version=request.version)

    def _load_in_worker(self, request: LoadRequest, python: str) -> Engine:
        """JetPack 5: the plan runs in the engine worker under the system Python that has TensorRT."""
        from edged.backends.trt_worker.supervisor import DEFAULT_REQUEST_TIMEOUT_S, WorkerEngine

        if request.variant.format != "tensorrt":
            raise ModelLoadError(f"{request.label}: the TensorRT engine worker serves prebuilt plans only "
                                 "(format = \"tensorrt\"); build one on the device, e.g. with trtexec")
        timeout = TensorRtOptions.of(request.options).worker_timeout_s
        if timeout is None:
            timeout = DEFAULT_REQUEST_TIMEOUT_S
        return WorkerEngine(python, request.file, request.label, device=request.device,
                            precision=request.variant.precision, request_timeout_s=timeout)

    def _from_cache(self, trt: Any, cache: EngineCache | None, key: EngineCacheKey, request: LoadRequest, *,
                    precision: str, dla: int, gpu: int) -> Engine | None:
        blob = cache.get(key) if cache is not None else None
        if blob is None or cache is None:
            return None
        try:
            return self._deserialize(trt, blob, request, precision=precision, dla=dla, gpu=gpu)
        except ModelLoadError as e:
            log.warning("%s: cached plan refused (%s); rebuilding", request.label, e)
            cache.remove(key)
            return None

    def _deserialize(self, trt: Any, plan: bytes, request: LoadRequest, *, precision: str, dla: int,
                     gpu: int) -> Engine:
        logger = _make_logger(trt)
        runtime = trt.Runtime(logger)
        if dla >= 0:
            runtime.DLA_core = dla
        engine = runtime.deserialize_cuda_engine(plan)
        if engine is None:
            raise ModelLoadError(f"{request.label}: TensorRT could not load the plan (built for another GPU or "
                                 f"TensorRT version?): {logger.summary()}", model=request.model,
                                 version=request.version)
        return TensorRtEngine(trt, engine, runtime, logger, cuda_runtime(), gpu=gpu,
                              device="DLA" if dla >= 0 else "GPU", precision=precision,
                              instances=request.instances, max_batch_size=request.max_batch_size)

    def _build(self, request: LoadRequest, key: EngineCacheKey, cache: EngineCache | None, *, precision: str,
               dla: int, gpu: int, opt: int) -> Engine:
        """Runs in the background build thread: build, cache atomically, load."""
        trt, cuda = _import_trt(), cuda_runtime()
        cuda.set_device(gpu)
        with _build_lock(key.digest()):
            engine = self._from_cache(trt, cache, key, request, precision=precision, dla=dla, gpu=gpu)
            if engine is not None:
                return engine
            timing = cache.timing_cache_path(self.hardware(gpu, request.facts)) if cache is not None else None
            plan = build_plan(trt, request, precision=precision, dla=dla, opt=opt, timing_cache=timing)
            if cache is not None:
                try:
                    cache.put(key, plan)
                except OSError as e:
                    log.warning("%s: built plan not cached (%s); it will be rebuilt next start", request.label, e)
        return self._deserialize(trt, plan, request, precision=precision, dla=dla, gpu=gpu)


def _optimization_profile(trt: Any, builder: Any, network: Any, request: LoadRequest, opt: int) -> Any | None:
    """min 1 / opt / max ``max_batch_size`` on the batch axis; other dynamic axes from the manifest."""
    declared = {s.name: s.shape for s in request.inputs or []}
    mbs = request.max_batch_size
    profile = builder.create_optimization_profile()
    dynamic = False
    for i in range(network.num_inputs):
        t = network.get_input(i)
        dims: list[tuple[int, int, int]] = []  # (min, opt, max) per axis
        for axis, d in enumerate(int(x) for x in t.shape):
            if d >= 0:
                dims.append((d, d, d))
                continue
            dynamic = True
            if axis == 0 and mbs > 0:
                dims.append((1, opt, mbs))
                continue
            spec = declared.get(t.name)
            idx = axis - 1 if mbs > 0 else axis
            fixed = spec[idx] if spec is not None and idx < len(spec) and spec[idx] > 0 else None
            rng = request.shape_range(t.name)
            if fixed is None and rng is not None and idx < len(rng[1]):
                dims.append((rng[0][idx], rng[1][idx], rng[2][idx]))  # [warmup.shapes] min / shape / max
                continue
            if fixed is None:
                raise ModelLoadError(f"{request.label}: input {t.name!r} has a dynamic axis {axis} that the "
                                     "manifest does not fix; declare the shapes it sees in [warmup.shapes]")
            dims.append((fixed, fixed, fixed))
        profile.set_shape(t.name, *([dim[k] for dim in dims] for k in range(3)))
    return profile if dynamic else None


def _set_precision(trt: Any, builder: Any, config: Any, request: LoadRequest, precision: str) -> Any:
    """The builder flags for ``precision``; returns the INT8 calibrator (from the variant's shipped
    cache) when an FP32 ONNX is built as INT8, else None."""
    if precision in ("fp16", "int8"):
        if not getattr(builder, "platform_has_fast_fp16", True):  # deprecated in TensorRT 10
            log.warning("%s: this GPU has no fast FP16; the %s engine may be slow", request.label, precision)
        config.set_flag(trt.BuilderFlag.FP16)  # INT8 layers fall back to FP16, not FP32
    if precision != "int8":
        return None
    config.set_flag(trt.BuilderFlag.INT8)
    if request.variant.precision == "int8":
        return None
    # FP32 ONNX + shipped calibration cache
    calib = request.variant.calibration_cache
    if not calib:
        raise ModelLoadError(f"{request.label}: INT8 needs the variant's calibration_cache")
    try:
        calibrator = _cache_calibrator(trt, (request.version_dir / calib).read_bytes())
    except OSError as e:
        raise ModelLoadError(f"{request.label}: cannot read calibration cache {calib}: {e.strerror}") from None
    config.int8_calibrator = calibrator
    return calibrator

def build_plan(trt: Any, request: LoadRequest, *, precision: str, dla: int, opt: int,
               timing_cache: Path | None) -> bytes:
    """Parse the ONNX variant and build a serialized plan (blocking; minutes on a Jetson)."""
    logger = _make_logger(trt)
    builder = trt.Builder(logger)
    major = int(str(trt.__version__).split(".")[0])
    flags = 0 if major >= 10 else 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(request.file)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(min(parser.num_errors, 3)))
        raise ModelLoadError(f"{request.label}: TensorRT's ONNX parser refused it: {errors or logger.summary()}")
    config = builder.create_builder_config()
    opts = TensorRtOptions.of(request.options)
    workspace = opts.workspace_mb
    if workspace:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace) << 20)
    calibrator = _set_precision(trt, builder, config, request, precision)
    profile = _optimization_profile(trt, builder, network, request, opt)
    if profile is not None:
        config.add_optimization_profile(profile)
        if calibrator is not None:
            config.set_calibration_profile(profile)
    if dla >= 0:
        config.default_device_type = trt.DeviceType.DLA
        config.DLA_core = dla
        if opts.gpu_fallback:
            config.set_flag(trt.BuilderFlag.GPU_FALLBACK)
    if timing_cache is not None:
        try:
            previous = timing_cache.read_bytes()
        except OSError:
            previous = b""
        config.set_timing_cache(config.create_timing_cache(previous), False)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise ModelLoadError(f"{request.label}: TensorRT could not build a {precision} engine: {logger.summary()}",
                             model=request.model, version=request.version)
    if timing_cache is not None:
        try:
            atomic_write_bytes(timing_cache, bytes(memoryview(config.get_timing_cache().serialize())))
        except OSError as e:
            log.warning("%s: timing cache not saved: %s", request.label, e)
    return bytes(memoryview(plan))
