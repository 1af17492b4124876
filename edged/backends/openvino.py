"""OpenVINO: Intel CPUs, iGPUs and NPUs; compiled blobs are cached under the state dir."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from edged import datatypes
from edged.backends.base import Backend, Engine, EngineTensor, LoadRequest
from edged.backends.options import OpenVinoOptions
from edged.errors import EngineUnavailableError, ModelLoadError

log = logging.getLogger(__name__)

_core_lock = threading.Lock()
_core: Any = None


def _missing(why: object) -> EngineUnavailableError:
    return EngineUnavailableError(
        f"OpenVINO is not installed ({why}); install it with: pip install 'edged[openvino]' "
        "(Debian package: apt install edged-openvino)")


def _import() -> Any:
    try:
        import openvino
    except ImportError as e:
        raise _missing(e) from None
    return openvino


def _find() -> None:
    """Whether OpenVINO is installed, without importing it: the import maps ~34 MB (its runtime and
    frontends) into a daemon that may only ever list it as an alternative it has not measured yet
    (a remembered engine choice). A broken installation shows when an engine is loaded (``_import``)."""
    if "openvino" in sys.modules:
        if sys.modules["openvino"] is None:  # an import that failed, or a test's stand-in for a missing one
            raise _missing("No module named 'openvino'")
        return
    try:
        found = importlib.util.find_spec("openvino") is not None
    except (ImportError, ValueError) as e:
        raise _missing(e) from None
    if not found:
        raise _missing("No module named 'openvino'")


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


# How long a request waits for a restore in flight before it runs on what is there (a restore takes
# tens to hundreds of milliseconds: bench/bench_ov_restore.py).
RESTORE_WAIT_S = 30.0


class _Compiled:
    """One compiled model and its pool of infer requests (an infer request is not thread-safe)."""

    def __init__(self, compiled: Any, nrequests: int) -> None:
        self.compiled = compiled
        self.ports = {p.get_any_name(): p for p in compiled.outputs}
        self.feeds = {p.get_any_name(): (p, _numpy_dtype(p)) for p in compiled.inputs}
        self.pool: queue.SimpleQueue[Any] = queue.SimpleQueue()
        for _ in range(max(1, nrequests)):
            self.pool.put(compiled.create_infer_request())

    def take(self) -> Any:
        try:
            return self.pool.get_nowait()
        except queue.Empty:
            return self.compiled.create_infer_request()


Remake = Callable[[Any], Any]


# Element types whose arrays are the tensor's bytes as they are (OpenVINO maps bf16 to float16: not so).
_EXACT = {"f16": np.float16, "f32": np.float32, "f64": np.float64, "i8": np.int8, "i16": np.int16, "i32": np.int32,
          "i64": np.int64, "u8": np.uint8, "u16": np.uint16, "u32": np.uint32, "u64": np.uint64, "boolean": np.bool_}


def _numpy_dtype(port: Any) -> np.dtype[Any] | None:
    """The array dtype an input port takes; None where the library's own conversion is left to run."""
    exact = _EXACT.get(port.get_element_type().get_type_name())
    return None if exact is None else np.dtype(exact)


def _feed(req: Any, feeds: Mapping[str, tuple[Any, np.dtype[Any] | None]], inputs: Mapping[str, np.ndarray]) -> bool:
    """Copy each input into the tensor the request owns, reshaped to it (a batch varies from run to run).

    What OpenVINO's dispatcher does for an array, without its layers. The request keeps no
    reference to the caller's array, whose memory (an HTTP body, a client's shared-memory
    segment) may be released once the call returns. False, with nothing copied, when an input
    needs the library's handling (an unknown name, another dtype, a scalar): the caller hands the
    request to the library's own ``infer`` instead.
    """
    tensors = []
    for name, arr in inputs.items():
        port, dtype = feeds.get(name, (None, None))
        if dtype is None or arr.dtype != dtype or arr.ndim == 0:
            return False
        tensors.append((req.get_tensor(port), arr))
    for tensor, arr in tensors:
        if tuple(tensor.shape) != arr.shape:
            tensor.shape = arr.shape
        np.copyto(tensor.data, arr, casting="no")
    return True


def _refuse_strings(model: Any, request: LoadRequest) -> None:
    """String tensors are refused at load, so that the profile's next engine (ONNX Runtime) serves them.

    OpenVINO's CPU plugin has no string kernels beyond moving them (a Cast from string is "not
    implemented"), and with OpenVINO 2026.4 a model that only passes a string tensor through
    corrupted the process heap when its infer request was freed ("munmap_chunk(): invalid
    pointer"): a crash of the whole daemon, not an error of one request.
    """
    names = [p.get_any_name() for p in (*model.inputs, *model.outputs)
             if p.get_element_type().get_type_name() == "string"]
    if names:
        raise ModelLoadError(
            f"{request.label}: its string tensors {names} are not served with OpenVINO (its CPU plugin has no "
            "string kernels and freeing a string inference crashed the process); ONNX Runtime serves them: "
            "list onnxruntime in the profile", model=request.model, version=request.version)


class OpenVinoEngine(Engine):
    """An OpenVINO compiled model that is put back in a clean state after every failed run.

    OpenVINO's CPU plugin keeps the shapes of a refused input in the compiled model's graph: after
    one request it refuses, requests at the shape that last succeeded fail until one of another
    shape succeeds, and a new infer request does not help (bench/bench_ov_restore.py shows it on
    the public corpus). So a failed run hands the compiled model to a background thread that makes
    a clean one (``remake``: export and import, measured the cheapest); the failing request gets its
    error at once, later ones wait for the clean model, and :attr:`restoring` says not ready meanwhile.
    """

    backend = "openvino"

    def __init__(self, compiled: Any, device: str, precision: str, nrequests: int, *,
                 remake: Remake | None = None, label: str = "") -> None:
        self._nrequests = nrequests
        self._current: _Compiled | None = _Compiled(compiled, nrequests)
        self._remake = remake
        self._label = label or "OpenVINO engine"
        self.device = device
        self.precision = precision
        self.inputs = [EngineTensor(p.get_any_name(), datatypes.from_engine(p.get_element_type().get_type_name()),
                                    _port_shape(p)) for p in compiled.inputs]
        self.outputs = [EngineTensor(p.get_any_name(), datatypes.from_engine(p.get_element_type().get_type_name()),
                                     _port_shape(p)) for p in compiled.outputs]
        self._out_names = [p.get_any_name() for p in compiled.outputs]
        self._lock = threading.Lock()
        self._clean = threading.Event()  # cleared while a restore runs
        self._clean.set()
        self.restores = 0  # clean compiled models made after failures
        self._restorer: threading.Thread | None = None

    @property
    def restoring(self) -> bool:
        return not self._clean.is_set()

    def infer(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        if not self._clean.is_set():
            self._clean.wait(RESTORE_WAIT_S)
        cur = self._current
        if cur is None:
            raise ModelLoadError("engine was unloaded")
        names = list(outputs) if outputs else self._out_names
        req = cur.take()
        try:
            if _feed(req, cur.feeds, inputs):
                req.infer(share_outputs=True)  # nothing to dispatch; outputs as views, copied below
            else:
                req.infer(dict(inputs))  # the library converts what _feed leaves to it
            ports = cur.ports
            out = {n: np.array(req.get_tensor(ports[n]).data, copy=True) for n in names}
        except Exception:
            # Neither this request nor the compiled model behind it is trusted again.
            self._restore(cur)
            raise
        cur.pool.put(req)
        return out

    def _restore(self, failed: _Compiled) -> None:
        """Start making a clean compiled model in the background, once per failed one."""
        with self._lock:
            if failed is not self._current or not self._clean.is_set():
                return
            self._clean.clear()
            self._restorer = threading.Thread(target=self._restore_now, args=(failed,), name="edged-openvino-restore",
                                              daemon=True)
            self._restorer.start()

    def _restore_now(self, failed: _Compiled) -> None:
        t0 = time.monotonic()
        fresh: _Compiled | None = None
        try:
            if self._remake is None:
                raise RuntimeError("no way to remake this compiled model")
            fresh = _Compiled(self._remake(failed.compiled), self._nrequests)
        except Exception as e:
            # Keep serving with what there is (other shapes still run), with fresh infer requests.
            log.error("%s: could not restore a clean compiled model after a failed run: %s", self._label,
                      " ".join(str(e).split())[:300])
        with self._lock:
            if fresh is not None and self._current is failed:
                self._current = fresh
                self.restores += 1
            elif fresh is None and self._current is failed:
                self._current = _Compiled(failed.compiled, self._nrequests)
            self._clean.set()
        if fresh is not None:
            log.info("%s: clean compiled model restored after a failed run in %.0f ms", self._label,
                     (time.monotonic() - t0) * 1e3)

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        cur = self._current
        if cur is not None:
            with contextlib.suppress(Exception):  # not every plugin reports it
                d["execution_precision"] = str(cur.compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name())
        if cur is not None and self.device == "CPU":
            d["streams"] = int(cur.compiled.get_property("NUM_STREAMS"))
            d["threads"] = int(cur.compiled.get_property("INFERENCE_NUM_THREADS"))
        d["restores"] = self.restores
        return d

    def unload(self) -> None:
        # A restore still compiling would outlive the engine, and one still inside OpenVINO when the
        # process exits aborts it ("terminate called without an active exception": the library's
        # threads are torn down under it, as `edged models list` did after a warm-up refusal).
        restorer = self._restorer
        if restorer is not None and restorer is not threading.current_thread():
            restorer.join(RESTORE_WAIT_S)
        with self._lock:
            cur, self._current = self._current, None
        if cur is not None:
            while not cur.pool.empty():
                cur.pool.get_nowait()


def _remaker(core: Any, device: str, config: Mapping[str, Any], recompile: Callable[[], Any]) -> Remake:
    """A clean copy of a compiled model: its own export imported again (no blob held in memory between
    failures; 25-140 ms on the corpus), else a compile from the file as at load."""
    import_config = {k: v for k, v in config.items() if k != "CACHE_DIR"}

    def remake(compiled: Any) -> Any:
        try:
            blob = io.BytesIO()
            compiled.export_model(blob)
            return core.import_model(io.BytesIO(blob.getvalue()), device, import_config)
        except Exception as e:  # a device or plugin without export/import: compile again
            log.debug("OpenVINO export/import unavailable on %s (%s); recompiling", device, e)
            return recompile()

    return remake


class OpenVinoBackend(Backend):
    name = "openvino"

    def check_available(self) -> None:
        _find()

    def library_version(self) -> str:
        return str(_import().get_version())

    def devices(self) -> list[str]:
        return [str(d) for d in _get_core().available_devices]

    def load(self, request: LoadRequest) -> Engine:
        core = _get_core()
        device = request.device.upper()
        opts = OpenVinoOptions.of(request.options)
        config: dict[str, Any] = {"PERFORMANCE_HINT": (opts.hint or "LATENCY").upper()}
        threads = opts.threads if opts.threads is not None else request.pool_threads()
        if threads > 0 and device in ("CPU", "AUTO"):
            config["INFERENCE_NUM_THREADS"] = threads
        # CPUs with bf16/AMX otherwise run an fp32 model in reduced precision; honour the variant
        # (a bf16 variant asks for bf16, which the plugin ignores on CPUs without it: read it back).
        precision = opts.inference_precision or request.variant.inference_precision
        if precision is None and request.variant.precision in ("fp32", "bf16") and device == "CPU":
            precision = "f32" if request.variant.precision == "fp32" else "bf16"
        if precision:
            config["INFERENCE_PRECISION_HINT"] = str(precision)
        if opts.num_streams is not None:
            config["NUM_STREAMS"] = str(opts.num_streams)
        elif request.instances > 1 and device == "CPU" and config["PERFORMANCE_HINT"] == "LATENCY":
            # One stream (LATENCY) would run the instances' requests one after another; a stream
            # each splits the threads between them.
            config["NUM_STREAMS"] = str(request.instances)
        if request.cache_dir is not None and opts.cache:
            request.cache_dir.mkdir(parents=True, exist_ok=True)
            config["CACHE_DIR"] = str(request.cache_dir)

        def compile_it() -> Any:
            model = core.read_model(str(request.file))
            _refuse_strings(model, request)
            _bound_dynamic_dims(model, request)
            batch = opts.static_batch
            if batch and request.max_batch_size > 0:
                # A fixed batch lets the plugin pick static kernels (and is required by NPUs).
                model.reshape({p.get_any_name(): [int(batch), *list(p.get_partial_shape())[1:]] for p in model.inputs})
            return core.compile_model(model, device, config)

        try:
            compiled = compile_it()
        except (EngineUnavailableError, ModelLoadError):
            raise
        except Exception as e:  # OpenVINO raises RuntimeError subclasses with the plugin's text
            raise ModelLoadError(f"{request.label}: OpenVINO could not compile it for {device}: {e}",
                                 model=request.model, version=request.version) from None
        return OpenVinoEngine(compiled, device, request.variant.precision, request.instances,
                              remake=_remaker(core, device, config, compile_it), label=request.label)
