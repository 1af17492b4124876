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

A worker that dies or hangs fails only the batch it was running (typed, "being restarted") and is
started again (:class:`~edged.backends.trt_worker.supervisor.EngineWorkerClient`); the others serve on.
"""

from __future__ import annotations

import json
import logging
import queue
import sys
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import psutil

from edged.backends.base import Engine, LoadRequest
from edged.backends.factory import get_backend
from edged.backends.worker_client import DEFAULT_REQUEST_TIMEOUT_S, EngineWorkerClient
from edged.errors import InternalError

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0  # an OpenVINO compile of a large model in the worker


def load_message(backend: str, request: LoadRequest, threads: int) -> bytes:
    """What a worker needs to load the same engine, as JSON (worker.request_from_json reads it)."""
    return json.dumps({
        "backend": backend, "model": request.model, "version": request.version,
        "version_dir": str(request.version_dir), "variant": request.variant.model_dump(mode="json"),
        "device": request.device, "options": request.options.model_dump(mode="json"),
        "precision": request.precision, "max_batch_size": request.max_batch_size,
        "inputs": [t.model_dump(mode="json") for t in request.inputs] if request.inputs is not None else None,
        "shapes": {k: v.model_dump(mode="json") for k, v in request.shapes.items()},
        "threads": threads, "cache_dir": str(request.cache_dir) if request.cache_dir else None,
    }).encode()


class ProcessWorker(EngineWorkerClient):
    """One engine worker process under the daemon's own Python."""

    what = "engine worker"

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
    """N engine worker processes of one model variant, used as one engine that runs N calls at once."""

    def __init__(self, backend: str, request: LoadRequest, processes: int, *, local: bool = True) -> None:
        """``local``: also load the engine in this process, for calls that find the workers all idle."""
        if processes < 1:
            raise ValueError("at least one engine process")
        threads = max(1, (request.threads or request.cpu_threads()) // processes)
        message = load_message(backend, request, threads)
        self.backend, self.device, self.precision = backend, request.device.upper(), request.variant.precision
        self.threads_per_process = threads
        label = request.label

        def start(i: int) -> ProcessWorker:
            return ProcessWorker(backend, message, f"{label} [engine process {i + 1}/{processes}]",
                                 device=self.device, precision=self.precision)
        # Started together: each loads (and warms) its own copy of the model.
        with ThreadPoolExecutor(max_workers=processes, thread_name_prefix="edged-engine-start") as pool:
            futures = [pool.submit(start, i) for i in range(processes)]
            workers: list[ProcessWorker] = []
            failure: BaseException | None = None
            for f in futures:
                try:
                    workers.append(f.result())
                except BaseException as e:  # the first reason is raised once all are settled
                    failure = failure or e
        if failure is not None:
            for w in workers:
                w.unload()
            raise failure
        self.workers = workers
        self.parallel = processes
        self.inputs, self.outputs = workers[0].inputs, workers[0].outputs
        self.precision = workers[0].precision
        self._idle: queue.SimpleQueue[ProcessWorker] = queue.SimpleQueue()
        for w in workers:
            self._idle.put(w)
        self._lock = threading.Lock()
        self._running = 0
        self.local: Engine | None = None
        self.local_calls = 0
        if local:
            try:  # every thread of the budget: it runs only while the workers are idle
                self.local = get_backend(backend).load(request)
            except BaseException:
                self.unload()
                raise
        log.info("%s: %s in %d engine process(es) of %d thread(s) each (pids %s)%s", label, backend, processes,
                 threads, ", ".join(str(w.pid) for w in workers),
                 "; a lone call runs in the daemon's own copy" if local else "")

    def infer(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        with self._lock:
            lone = self._running == 0 and self.local is not None
            self._running += 1
        try:
            if lone:
                assert self.local is not None
                self.local_calls += 1
                return self.local.infer(inputs, outputs)
            return self._on_worker(inputs, outputs)
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
        return sum(w.rss_mb() for w in self.workers)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "engine_processes": [
            {"pid": w.pid, "restarts": w.restarts, "threads": self.threads_per_process} for w in self.workers],
            "local_copy": self.local is not None, "local_calls": self.local_calls}

    def health(self) -> list[dict[str, Any]]:
        return [w.health() for w in self.workers]

    def unload(self) -> None:
        for w in self.workers:
            w.unload()
        if self.local is not None:
            self.local.unload()
