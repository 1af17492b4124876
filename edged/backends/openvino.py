"""OpenVINO: Intel CPUs, iGPUs and NPUs; compiled blobs are cached under the state dir."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from edged import datatypes
from edged.backends.base import Backend, Engine, EngineTensor, LoadRequest
from edged.errors import EngineUnavailableError, ModelLoadError

_core_lock = threading.Lock()
_core: Any = None


def _import() -> Any:
    try:
        import openvino
    except ImportError as e:
        raise EngineUnavailableError(
            f"OpenVINO is not installed ({e}); install it with: pip install 'edged[openvino]' "
            "(Debian package: apt install edged-openvino)") from None
    return openvino


def _get_core() -> Any:
    # One Core per process: creating it enumerates plugins and devices, which is slow.
    global _core
    with _core_lock:
        if _core is None:
            _core = _import().Core()
        return _core


def _port_shape(port: Any) -> tuple[int, ...]:
    ps = port.get_partial_shape()
    if ps.rank.is_dynamic:
        return ()
    return tuple(d.get_length() if d.is_static else -1 for d in ps)


def _bound_dynamic_dims(model: Any, request: LoadRequest) -> None:
    """Declared min/max ([warmup.shapes]) become bounded dynamic dimensions the plugin can plan for.

    A dimension declared without min/max stays unbounded: the usual shape is not a limit.
    """
    ov = _import()
    skip = 1 if request.max_batch_size > 0 else 0
    new = {}
    for port in model.inputs:
        name = port.get_any_name()
        declared = request.shapes.get(name)
        ps = port.get_partial_shape()
        if declared is None or (declared.min is None and declared.max is None) or ps.rank.is_dynamic \
                or len(ps) != len(declared.shape) + skip:
            continue
        dims = list(ps)
        for i in range(skip, len(dims)):
            if dims[i].is_dynamic:
                lo = declared.min[i - skip] if declared.min is not None else 0
                hi = declared.max[i - skip] if declared.max is not None else -1
                dims[i] = ov.Dimension(lo, hi)
        new[name] = ov.PartialShape(dims)
    if new:
        model.reshape(new)


class OpenVinoEngine(Engine):
    backend = "openvino"

    def __init__(self, compiled: Any, device: str, precision: str, nrequests: int) -> None:
        self._compiled = compiled
        self.device = device
        self.precision = precision
        self.inputs = [EngineTensor(p.get_any_name(), datatypes.from_engine(p.get_element_type().get_type_name()),
                                    _port_shape(p)) for p in compiled.inputs]
        self.outputs = [EngineTensor(p.get_any_name(), datatypes.from_engine(p.get_element_type().get_type_name()),
                                     _port_shape(p)) for p in compiled.outputs]
        self._out_ports = {p.get_any_name(): p for p in compiled.outputs}
        # An infer request is not thread-safe; keep a pool, one per concurrent caller.
        self._pool: queue.SimpleQueue[Any] = queue.SimpleQueue()
        for _ in range(max(1, nrequests)):
            self._pool.put(compiled.create_infer_request())

    def infer(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        names = list(outputs) if outputs else list(self._out_ports)
        compiled = self._compiled
        if compiled is None:
            raise ModelLoadError("engine was unloaded")
        try:
            req = self._pool.get_nowait()
        except queue.Empty:
            req = compiled.create_infer_request()
        try:
            req.infer(dict(inputs))
            out = {n: np.array(req.get_tensor(self._out_ports[n]).data, copy=True) for n in names}
        except BaseException:
            # A request that failed keeps the failed shapes/state: never hand it to the next caller.
            self._pool.put(compiled.create_infer_request())
            raise
        self._pool.put(req)
        return out

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        compiled = self._compiled
        if compiled is not None:
            with contextlib.suppress(Exception):  # not every plugin reports it
                d["execution_precision"] = str(compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name())
        if compiled is not None and self.device == "CPU":
            d["streams"] = int(compiled.get_property("NUM_STREAMS"))
            d["threads"] = int(compiled.get_property("INFERENCE_NUM_THREADS"))
        return d

    def unload(self) -> None:
        self._compiled = None
        while not self._pool.empty():
            self._pool.get_nowait()


class OpenVinoBackend(Backend):
    name = "openvino"
    formats: ClassVar[frozenset[str]] = frozenset({"openvino", "onnx"})
    extra = "openvino"

    def check_available(self) -> None:
        _import()

    def library_version(self) -> str:
        return str(_import().get_version())

    def devices(self) -> list[str]:
        return [str(d) for d in _get_core().available_devices]

    def load(self, request: LoadRequest) -> Engine:
        core = _get_core()
        device = request.device.upper()
        config: dict[str, Any] = {"PERFORMANCE_HINT": str(request.options.get("hint", "LATENCY")).upper()}
        threads = int(request.options.get("threads", request.threads) or 0)
        if threads > 0 and device in ("CPU", "AUTO"):
            config["INFERENCE_NUM_THREADS"] = threads
        # CPUs with bf16/AMX otherwise run an fp32 model in reduced precision; honour the variant
        # (a bf16 variant asks for bf16, which the plugin ignores on CPUs without it: read it back).
        precision = request.options.get("inference_precision") or request.variant.inference_precision
        if precision is None and request.variant.precision in ("fp32", "bf16") and device == "CPU":
            precision = "f32" if request.variant.precision == "fp32" else "bf16"
        if precision:
            config["INFERENCE_PRECISION_HINT"] = str(precision)
        if request.options.get("num_streams") is not None:
            config["NUM_STREAMS"] = str(request.options["num_streams"])
        elif request.instances > 1 and device == "CPU" and config["PERFORMANCE_HINT"] == "LATENCY":
            # One stream (LATENCY) would run the instances' requests one after another; a stream
            # each splits the threads between them.
            config["NUM_STREAMS"] = str(request.instances)
        if request.cache_dir is not None and request.options.get("cache", True):
            request.cache_dir.mkdir(parents=True, exist_ok=True)
            config["CACHE_DIR"] = str(request.cache_dir)
        try:
            model = core.read_model(str(request.file))
            _bound_dynamic_dims(model, request)
            batch = request.options.get("static_batch")
            if batch and request.max_batch_size > 0:
                # A fixed batch lets the plugin pick static kernels (and is required by NPUs).
                model.reshape({p.get_any_name(): [int(batch), *list(p.get_partial_shape())[1:]] for p in model.inputs})
            compiled = core.compile_model(model, device, config)
        except EngineUnavailableError:
            raise
        except Exception as e:  # OpenVINO raises RuntimeError subclasses with the plugin's text
            raise ModelLoadError(f"{request.label}: OpenVINO could not compile it for {device}: {e}",
                                 model=request.model, version=request.version) from None
        return OpenVinoEngine(compiled, device, request.variant.precision, request.instances)
