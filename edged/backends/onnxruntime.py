"""ONNX Runtime: runs everywhere; execution providers are chosen from an ordered list."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from edged import datatypes
from edged.backends.base import Backend, Engine, EngineTensor, LoadRequest
from edged.backends.options import OnnxRuntimeOptions
from edged.errors import EngineInputError, EngineUnavailableError, ModelLoadError

log = logging.getLogger(__name__)

_PROVIDER_BY_DEVICE = {
    "CPU": ["CPUExecutionProvider"],
    "GPU": ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"],
    "CUDA": ["CUDAExecutionProvider", "CPUExecutionProvider"],
    "OPENVINO": ["OpenVINOExecutionProvider", "CPUExecutionProvider"],
}


def _import() -> Any:
    try:
        import onnxruntime
    except ImportError as e:
        raise EngineUnavailableError(
            f"ONNX Runtime is not installed ({e}); install the 'onnxruntime' package "
            "(or 'onnxruntime-gpu' on CUDA machines)") from None
    return onnxruntime


_SPIN_KEY = "session.intra_op.spin_duration_us"  # ONNX Runtime 1.2x+; older versions ignore unknown keys
# The threads of this process's one shared pool once share_one_pool made it (0: a thread per physical
# core); None: every session has a pool of its own.
_shared_pool: int | None = None
_told_unshared: set[str] = set()  # variants whose own intra_op_threads the shared pool overrides, warned once


def share_one_pool(threads: int) -> bool:
    """Make every ONNX Runtime session created from now on in this process run on one pool of
    ``threads`` (0: a thread per physical core) instead of a pool each.

    Several models run in turn (a pipeline's steps, a detector and its classifier) then find the
    pool's threads awake instead of waking their own while the others' spin beside them. ONNX Runtime
    makes the choice for the whole process and for good: a session with a pool of its own is refused
    from then on (make options with :func:`session_options`), sessions' own thread and spin settings no
    longer apply, and the pool spins as the library does (it has no bound for it). False when ONNX
    Runtime is not installed.
    """
    global _shared_pool
    try:
        ort = _import()
    except EngineUnavailableError as e:
        log.warning("[limits] engine_pool = \"shared\" has nothing to share: %s", e)
        return False
    if _shared_pool is None:
        ort.set_global_thread_pool_sizes(threads, 1)
        _shared_pool = threads
        log.info("ONNX Runtime: one pool of %s thread(s) for every session in this process, spinning as the "
                 "library does", threads or "the library's default number of")
    elif _shared_pool != threads:
        log.warning("ONNX Runtime: this process already shares a pool of %s thread(s); %d asked for now "
                    "applies after a restart", _shared_pool or "the library's default number of", threads)
    return True


def shared_pool_threads() -> int | None:
    """The shared pool's size (0: the library's default), None when sessions have pools of their own."""
    return _shared_pool


def session_options() -> Any:
    """Options for a new session in this process: on the shared pool when there is one (a session with
    a pool of its own would be refused then). Raises EngineUnavailableError without ONNX Runtime."""
    opts = _import().SessionOptions()
    if _shared_pool is not None:
        opts.use_per_session_threads = False
    return opts


def _intra_op_threads(request: LoadRequest) -> int:
    """The session's intra-op pool; 0: ONNX Runtime's default (a thread per physical core).

    The scheduler's instances share one session, and each run works on its caller's thread plus
    the pool's, so N instances running at once keep N + pool - 1 threads busy. A pool of one
    thread per core (the default) would give N - 1 more threads than there are cores, which on a
    small CPU makes every run slower; a pool of ``budget - N + 1`` fills the budget exactly when
    all run, and a lone request still uses all but N - 1 of its threads.
    """
    if request.instances <= 1 or request.device.upper() != "CPU":
        return request.pool_threads()
    return max(1, request.cpu_threads() - request.instances + 1)


def _shape(dims: Sequence[Any]) -> tuple[int, ...]:
    return tuple(d if isinstance(d, int) and d >= 0 else -1 for d in dims)


class OnnxRuntimeEngine(Engine):
    backend = "onnxruntime"
    takes_text = True

    def __init__(self, session: Any, device: str, precision: str, providers: list[str]) -> None:
        self._session = session
        self.device = device
        self.precision = precision
        self.providers = providers
        self.inputs = [EngineTensor(i.name, datatypes.from_engine(i.type), _shape(i.shape))
                       for i in session.get_inputs()]
        self.outputs = [EngineTensor(o.name, datatypes.from_engine(o.type), _shape(o.shape))
                        for o in session.get_outputs()]
        self._output_names = [o.name for o in self.outputs]
        self._text_in = frozenset(t.name for t in self.inputs if t.datatype == "BYTES")
        self._text_out = frozenset(t.name for t in self.outputs if t.datatype == "BYTES")
        self._lock = threading.Lock()

    def infer(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        names = list(outputs) if outputs else self._output_names
        session = self._session
        if session is None:
            raise ModelLoadError("engine was unloaded")
        # InferenceSession.run is thread-safe and releases the GIL during compute; a failed run
        # leaves nothing behind in the session.
        feed = dict(inputs)
        if self._text_in:  # string tensors take str: see Engine.takes_text
            for name in self._text_in.intersection(feed):
                feed[name] = datatypes.as_text(feed[name])
        try:
            results = session.run(names, feed)
        except Exception as e:
            if type(e).__name__ == "InvalidArgument":  # ORT's status INVALID_ARGUMENT: the input's fault
                raise EngineInputError(str(e)) from None
            raise
        out = dict(zip(names, results, strict=True))
        if self._text_out:  # ORT answers str: BYTES are bytes everywhere else
            for name in self._text_out.intersection(out):
                out[name] = datatypes.as_bytes(out[name])
        return out

    def unload(self) -> None:
        with self._lock:
            self._session = None

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d["providers"] = self.providers
        session = self._session
        if session is not None:  # 0: ONNX Runtime's default, one thread per physical core
            opts = session.get_session_options()
            d["pool"] = "per session" if opts.use_per_session_threads else "shared by the process"
            d["intra_op_threads"] = opts.intra_op_num_threads if opts.use_per_session_threads else _shared_pool
            try:
                d["spin_us"] = int(opts.get_session_config_entry(_SPIN_KEY))
            except RuntimeError:  # not set: the library's own
                d["spin_us"] = -1
        return d


class OnnxRuntimeBackend(Backend):
    name = "onnxruntime"

    def check_available(self) -> None:
        _import()

    def library_version(self) -> str:
        return str(_import().__version__)

    def devices(self) -> list[str]:
        available = set(_import().get_available_providers())
        return [d for d, provs in _PROVIDER_BY_DEVICE.items() if provs[0] in available]

    def load(self, request: LoadRequest) -> Engine:
        ort = _import()
        options = OnnxRuntimeOptions.of(request.options)
        wanted = list(options.providers or _PROVIDER_BY_DEVICE.get(request.device.upper(), []))
        if not wanted:
            raise ModelLoadError(f"{request.label}: ONNX Runtime has no device {request.device!r}")
        available = set(ort.get_available_providers())
        providers = [p for p in wanted if p in available]
        accelerated = [p for p in wanted if p != "CPUExecutionProvider"]
        if accelerated and not any(p in available for p in accelerated):
            raise ModelLoadError(
                f"{request.label}: none of the providers {accelerated} is available in this ONNX Runtime "
                f"(available: {sorted(available)})")
        opts = session_options()
        if _shared_pool is not None:  # the process's one pool: its size and spin are set for all
            if options.intra_op_threads is not None and request.label not in _told_unshared:
                _told_unshared.add(request.label)
                log.warning("%s: intra_op_threads = %d not applied: ONNX Runtime's sessions share one pool of "
                            "%s thread(s) ([limits] engine_pool = \"shared\")", request.label,
                            options.intra_op_threads, _shared_pool or "the library's default number of")
        else:
            explicit = options.intra_op_threads
            threads = explicit if explicit is not None else _intra_op_threads(request)
            if threads > 0:
                opts.intra_op_num_threads = threads
            opts.inter_op_num_threads = 1
            if request.spin_us >= 0:  # idle pool threads sleep after this long instead of the library's ~24 ms
                opts.add_session_config_entry(_SPIN_KEY, str(request.spin_us))
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.log_severity_level = 3
        try:
            session = ort.InferenceSession(str(request.file), sess_options=opts, providers=providers)
        except Exception as e:  # ORT raises its own exception types (Fail, InvalidGraph, ...)
            raise ModelLoadError(f"{request.label}: ONNX Runtime could not load it: {e}",
                                 model=request.model, version=request.version) from None
        return OnnxRuntimeEngine(session, request.device.upper(), request.variant.precision,
                                 list(session.get_providers()))
