"""Shared helpers for the benchmark scripts: timing loops, ratio reporting, stopping helper processes."""

from __future__ import annotations

import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Result:
    name: str
    throughput: float  # samples per second
    median_ms: float
    p99_ms: float

    def row(self) -> str:
        return f"{self.name:<40} {self.throughput:>10.1f}/s  p50 {self.median_ms:7.3f} ms  p99 {self.p99_ms:7.3f} ms"


def measure(name: str, fn: Callable[[], object], *, seconds: float, samples_per_call: int = 1,
            concurrency: int = 1, warmup: int = 20) -> Result:
    """Run ``fn`` in ``concurrency`` threads for ``seconds``; throughput counts samples."""
    for _ in range(warmup):
        fn()
    latencies: list[list[float]] = [[] for _ in range(concurrency)]
    stop = time.monotonic() + seconds
    start_gate = threading.Barrier(concurrency + 1)

    def loop(k: int) -> None:
        lat = latencies[k]
        start_gate.wait()
        while True:
            t0 = time.perf_counter()
            fn()
            lat.append(time.perf_counter() - t0)
            if time.monotonic() >= stop:
                return

    threads = [threading.Thread(target=loop, args=(k,)) for k in range(concurrency)]
    for t in threads:
        t.start()
    start_gate.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    flat = sorted(x for lat in latencies for x in lat)
    calls = len(flat)
    return Result(name, calls * samples_per_call / elapsed, statistics.median(flat) * 1e3,
                  flat[min(calls - 1, int(calls * 0.99))] * 1e3)


def ratio_line(label: str, value: float, reference: float, goal: float, *, higher_is_better: bool = True) -> str:
    r = value / reference if reference else float("nan")
    ok = r >= goal if higher_is_better else r <= goal
    op = ">=" if higher_is_better else "<="
    return f"{label:<52} {r:6.3f}x  (goal {op} {goal})  {'PASS' if ok else 'MISS'}"


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 15) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout``."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
