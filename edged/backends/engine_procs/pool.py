"""The daemon's side of engine worker processes: one Engine over N workers, N batches at once.

Why: on one interpreter every request's decoding, batching, futures and encoding share one lock with
the engine calls, so on 16 cores even the least batching service reached half of what the engine does
(issue 41). Here the engine runs in N worker processes (:mod:`.worker`), each with its own interpreter
and ``CPUs / N`` engine threads; the daemon keeps the transports, the scheduler and its batching, and
hands each batch to an idle worker: inputs copied once into that worker's memfd, a descriptor over a
socketpair, outputs copied once out of its output memfd. The scheduler runs ``parallel`` (= N)
batches at once, so N workers compute while the daemon's threads only move bytes.

A call that finds every worker idle runs on a copy of the engine in the daemon's own process instead:
a hand-off to another process and back is two thread wake-ups (up to ~150 us each on some VMs), which
a lone request should not pay when nothing competes for the interpreter (the c1 floor of issue 41).
The workers start only when calls first overlap: a version that serves one call at a time, or a
candidate the engine choice loads to measure, never spawns them.

A worker that dies or hangs fails only the batch it was running (typed, "being restarted") and is
started again (:class:`~edged.backends.worker_client.EngineWorkerClient`); the others serve on.
"""

from __future__ import annotations

import json
import logging
import queue
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import psutil

from edged.backends.base import Engine, LoadRequest
from edged.backends.factory import get_backend
from edged.backends.worker_client import DEFAULT_REQUEST_TIMEOUT_S, EngineWorkerClient
from edged.cpus import threads_per_process
from edged.errors import InternalError

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0  # an OpenVINO compile of a large model in the worker
RETRY_START_S = 60.0  # after workers failed to start, the daemon's copy serves alone this long
WORKER_BASE_MB = 80.0  # a worker's RSS before its model: interpreter, numpy, ONNX Runtime (77 MB measured)


def load_message(backend: str, request: LoadRequest, threads: int) -> bytes:
    """What a worker needs to load the same engine, as JSON (worker.request_from_json reads it)."""
    return json.dumps({
        "backend": backend, "model": request.model, "version": request.version,
        "version_dir": str(request.version_dir), "variant": request.variant.model_dump(mode="json"),
        "device": request.device, "options": request.options.model_dump(mode="json"),
        "precision": request.precision, "max_batch_size": request.max_batch_size,
        "inputs": [t.model_dump(mode="json") for t in request.inputs] if request.inputs is not None else None,
        "shapes": {k: v.model_dump(mode="json") for k, v in request.shapes.items()},
        "threads": threads, "spin_us": request.spin_us,
        "cache_dir": str(request.cache_dir) if request.cache_dir else None,
    }).encode()


class ProcessWorker(EngineWorkerClient):
    """One engine worker process under the daemon's own Python."""

    def __init__(self, backend: str, message: bytes, label: str, *, device: str, precision: str,
                 request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S) -> None:
        self.backend = backend
        self._message = message
        super().__init__(label, device=device, precision=precision, start_timeout_s=START_TIMEOUT_S,
                         request_timeout_s=request_timeout_s)
        self.precision = str(self.info.get("precision") or precision)

    def _command(self, fd: int) -> list[str]:
        return [sys.executable, "-m", "edged.backends.engine_procs.worker", "--fd", str(fd)]

    def _greeting(self) -> bytes:
        return self._message

    def rss_mb(self) -> float:
        pid = self.pid
        if pid is None:
            return 0.0
        try:
            return float(psutil.Process(pid).memory_info().rss) / 1e6
        except psutil.Error:
            return 0.0


class EngineProcesses(Engine):
    """N engine worker processes of one model variant behind the daemon's own copy of it.

    The copy serves a call that runs alone (no hop) and everything until the workers are up; the
    workers start when calls first overlap (``start_workers``), so an engine that only ever serves
    one call at a time, or one the engine choice loads just to measure (its calls are lone), never
    spawns them. Until they are ready, overlapping calls share the copy as in-process instances do.
    """

    def __init__(self, backend: str, request: LoadRequest, processes: int) -> None:
        if processes < 1:
            raise ValueError("at least one engine process")
        self.count = processes
        self.threads_per_process = threads_per_process(request.cpu_threads(), processes)
        self._message = load_message(backend, request, self.threads_per_process)
        self.label = request.label
        try:
            self._model_mb = request.file.stat().st_size / 1e6
        except OSError:
            self._model_mb = 0.0
        # Every thread of the budget: it runs alone while the workers are idle.
        self.local: Engine = get_backend(backend).load(request)
        self.backend, self.device, self.precision = backend, self.local.device, self.local.precision
        self.inputs, self.outputs = self.local.inputs, self.local.outputs
        self.parallel = processes
        self.workers: list[ProcessWorker] = []
        self._idle: queue.SimpleQueue[ProcessWorker] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._running = 0
        self._ready = False
        self._starting = False
        self._closed = False
        self._retry_at = 0.0
        self.local_calls = 0
        self.start_error: str | None = None

    # ---- workers ----------------------------------------------------------------------------
    def start_workers(self) -> None:
        """Start the N workers together (each loads and warms its own copy); raises the first failure.
        Nothing to do once they run."""
        if self._ready:
            return
        def start(i: int) -> ProcessWorker:
            return ProcessWorker(self.backend, self._message,
                                 f"{self.label} [engine process {i + 1}/{self.count}]", device=self.device,
                                 precision=self.precision)
        with ThreadPoolExecutor(max_workers=self.count, thread_name_prefix="edged-engine-start") as pool:
            futures = [pool.submit(start, i) for i in range(self.count)]
            workers: list[ProcessWorker] = []
            failure: BaseException | None = None
            for f in futures:
                try:
                    workers.append(f.result())
                except BaseException as e:  # the first reason is raised once all are settled
                    failure = failure or e
        with self._lock:
            closed = self._closed
            if failure is None and not closed:
                self.workers = workers
                for w in workers:
                    self._idle.put(w)
                self._ready = True
        if failure is not None or closed:
            for w in workers:
                w.unload()
            if failure is not None:
                raise failure
            return
        log.info("%s: %s in %d engine process(es) of %d thread(s) each (pids %s); a lone call runs in the "
                 "daemon's own copy", self.label, self.backend, self.count, self.threads_per_process,
                 ", ".join(str(w.pid) for w in workers))

    def _start_later(self) -> None:
        try:
            self.start_workers()
        except Exception as e:  # serving goes on in the daemon's copy; tried again after a while
            self.start_error = str(e)
            self._retry_at = time.monotonic() + RETRY_START_S
            log.error("%s: the engine processes did not start (%s); serving in the daemon's process, trying "
                      "again in %.0f s", self.label, e, RETRY_START_S)
        finally:
            with self._lock:
                self._starting = False

    @property
    def ready(self) -> bool:
        return self._ready

    # ---- Engine -----------------------------------------------------------------------------
    def infer(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        with self._lock:
            lone = self._running == 0
            self._running += 1
            on_worker = not lone and self._ready
            if not lone and not self._ready and not self._starting and not self._closed \
                    and time.monotonic() >= self._retry_at:
                self._starting = True
                threading.Thread(target=self._start_later, name="edged-engine-start", daemon=True).start()
        try:
            if on_worker:
                return self._on_worker(inputs, outputs)
            if lone:
                self.local_calls += 1
            return self.local.infer(inputs, outputs)
        finally:
            with self._lock:
                self._running -= 1

    def _on_worker(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None) -> dict[str, np.ndarray]:
        # The scheduler never runs more than ``parallel`` calls at once; a caller beyond that (a tool
        # calling the engine directly) waits here for a worker instead of failing.
        try:
            worker = self._idle.get(timeout=DEFAULT_REQUEST_TIMEOUT_S)
        except queue.Empty:
            raise InternalError(f"no engine process became free in {DEFAULT_REQUEST_TIMEOUT_S:g} s") from None
        try:
            return worker.infer(inputs, outputs)
        finally:
            self._idle.put(worker)

    def process_memory_mb(self) -> float:
        """The workers' RSS once they run; before, what they will take (an interpreter with the engine
        library, about WORKER_BASE_MB, plus the model's file each), so the model budget counts them."""
        if self._ready:
            return sum(w.rss_mb() for w in self.workers)
        return self.count * (WORKER_BASE_MB + self._model_mb)

    def processes(self) -> dict[str, Any]:
        return {"count": self.count, "threads": self.threads_per_process, "running": self._ready,
                "start_error": self.start_error, "calls_in_daemon": self.local_calls,
                "workers": [{"pid": w.pid, "restarts": w.restarts, "last_exit": w.last_exit} for w in self.workers]}

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "engine_processes": self.processes()}

    def health(self) -> list[dict[str, Any]]:
        return [w.health() for w in self.workers]

    def unload(self) -> None:
        with self._lock:
            self._closed = True
            self._ready = False
            workers, self.workers = self.workers, []
        for w in workers:
            w.unload()
        self.local.unload()
