"""The daemon's threads sized together from the CPUs it may use, so its pools never outnumber them.

Three pools do CPU work at once in a busy daemon: each engine's own pool (ONNX Runtime's intra-op
threads, OpenVINO's inference threads), the event loop's worker pool that decodes and encodes large
requests, and the transports' own threads (one per shm client, paho's network thread). The engine
pool is the one that matters for throughput; the worker pool is for the rare large body. Python's
default worker pool is ``min(32, CPUs + 4)`` threads whatever the engine takes; here it is half the
usable CPUs plus two for control calls, so a model load never holds every decoder.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from edged.config import LimitsSection
from edged.cpus import DEFAULT_SPIN_US, cgroup_cpu_quota, constrained_cpus, threads_per_process, usable_cpus

CONTROL_THREADS = 2  # model loads and file work share the loop's worker pool with the decoders
T = TypeVar("T")


@dataclass(frozen=True)
class ThreadPlan:
    cpus: int  # what this process may use: affinity, capped by the cgroup CPU quota
    engine: int  # each engine's pool; 0: the engine's default (a thread per physical core)
    decode: int  # loop workers for large decodes/encodes (plus CONTROL_THREADS for control calls)
    reasons: tuple[str, ...]
    processes: int = 0  # CPU engines in this many worker processes each, sharing ``engine`` threads (0: in-process)
    spin_us: int = DEFAULT_SPIN_US  # idle engine threads spin this long before they sleep (-1: the library's own)
    # ONNX Runtime's sessions in the daemon's process share one pool of this many threads (0: the library's
    # default); None: a pool each ([limits] engine_pool, as the process really set it up)
    shared_pool: int | None = None

    def describe(self) -> str:
        engine = f"{self.engine} thread(s)" if self.engine else "the engine's default (a thread per physical core)"
        where = "" if not self.processes else (
            f", split over {self.processes} engine worker process(es) of "
            f"{threads_per_process(self.engine or self.cpus, self.processes)} thread(s) for CPU engines")
        spin = "the library's own" if self.spin_us < 0 else f"{self.spin_us} us"
        shared = "" if self.shared_pool is None else (
            f" (but ONNX Runtime in the daemon's process: one pool of {self.shared_pool or 'its default'} "
            "thread(s) for every model, spinning as the library does)")
        return (f"threads: {self.cpus} usable CPU(s) ({'; '.join(self.reasons)}); each engine's pool {engine}"
                f"{where}, idle after a spin of {spin}{shared}; {self.decode} decode worker(s) + "
                f"{CONTROL_THREADS} for control calls")


class WorkerPool(ThreadPoolExecutor):
    """The loop's worker pool, whose shutdown can be told not to wait for a call that cannot end soon.

    Model loads asked for over the repository API or by fleet sync run here, and an engine's native
    call (a build, a warm-up) cannot be interrupted: the loop's closing shutdown of its default executor,
    and the interpreter's exit after it, would wait for it however long it takes. Once the daemon has
    stopped in order it bounds that wait (:meth:`stop_waiting_after`) and, when :meth:`busy` still,
    exits without joining (``Daemon.exit_past_abandoned``)."""

    def __init__(self, max_workers: int, thread_name_prefix: str) -> None:
        super().__init__(max_workers=max_workers, thread_name_prefix=thread_name_prefix)
        self._calls = threading.Condition()
        self._running = 0
        self._wait_s: float | None = None

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        def counted() -> T:
            with self._calls:
                self._running += 1
            try:
                return fn(*args, **kwargs)
            finally:
                with self._calls:
                    self._running -= 1
                    self._calls.notify_all()
        return super().submit(counted)

    def stop_waiting_after(self, seconds: float) -> None:
        """From now on a waiting shutdown waits at most ``seconds`` for the calls still running."""
        self._wait_s = seconds

    def busy(self) -> bool:
        """A call is still running in the pool."""
        with self._calls:
            return self._running > 0

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        if not wait or self._wait_s is None:
            super().shutdown(wait, cancel_futures=cancel_futures)
            return
        super().shutdown(False, cancel_futures=True)  # queued calls are dropped, idle threads leave
        end = time.monotonic() + self._wait_s
        with self._calls:
            while self._running and (left := end - time.monotonic()) > 0:
                self._calls.wait(left)


def install_worker_pool(loop: asyncio.AbstractEventLoop, limits: LimitsSection) -> WorkerPool:
    """The loop's default executor (``asyncio.to_thread``) becomes the sized worker pool; called before
    the loop's first ``to_thread``, since a replaced executor is not shut down."""
    pool = WorkerPool(decode_threads(limits) + CONTROL_THREADS, "edged-worker")
    loop.set_default_executor(pool)
    return pool


AUTO_PROCESSES_FROM = 12  # usable CPUs from which "auto" runs CPU engines in worker processes
CPUS_PER_PROCESS = 4


def engine_processes(limits: LimitsSection, cpus: int | None = None) -> int:
    """Worker processes per CPU engine: the configured count, or for "auto" one per CPUS_PER_PROCESS usable
    CPUs from AUTO_PROCESSES_FROM up (below that, one interpreter keeps up with the engine: 0)."""
    if limits.engine_processes != "auto":
        return int(limits.engine_processes)
    cpus = usable_cpus() if cpus is None else cpus
    return cpus // CPUS_PER_PROCESS if cpus >= AUTO_PROCESSES_FROM else 0


def decode_threads(limits: LimitsSection) -> int:
    return limits.decode_threads or max(1, usable_cpus() // 2)


def plan_threads(limits: LimitsSection, profile_threads: int, shared_pool: int | None = None) -> ThreadPlan:
    cpus = usable_cpus()
    quota = cgroup_cpu_quota()
    reasons = [f"cgroup CPU quota {quota}" if quota is not None and quota <= cpus else "affinity mask"]
    if limits.engine_threads:
        engine = limits.engine_threads
        reasons.append("[limits] engine_threads")
    elif profile_threads:
        engine = profile_threads
        reasons.append("the profile's threads")
    else:
        engine = constrained_cpus()
    return ThreadPlan(cpus=cpus, engine=engine, decode=decode_threads(limits), reasons=tuple(reasons),
                      processes=engine_processes(limits, cpus), spin_us=limits.engine_spin_us,
                      shared_pool=shared_pool)
