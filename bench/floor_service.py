"""The least a Python inference service can add to an engine run: the floor under edged's core.

A service that swaps versions under load, runs a lone request inline and reports statistics must,
per request, at least find the model's current version, mark an instance busy and free again, and
count the request and its time. :class:`LeastService` does exactly that and nothing else: no
validation, no deadline, no shape memory, no queue, no histogram. The suite runs it in-process
beside ``infer_blocking`` (the service c1 goal) and inside the IPC responder beside the shm path
(the shm c1 goal), on the same engine, so each run shows what these steps cost on this machine.

:class:`LeastBatcher` is the same for the c8 goal: callers on their own threads, one worker that
takes whatever is queued (up to a batch), runs it once and wakes each caller with its row. No
waiting for a batch to fill, no statistics, no futures; what is left is what any batching service
with Python callers pays: a queue, a wake-up each way, and the concatenation.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

Run = Callable[[Mapping[str, Any]], Any]


class LeastService:
    def __init__(self, name: str, run: Run) -> None:
        self._current: dict[str, Run] = {name: run}  # what a version swap replaces
        self._lock = threading.Lock()
        self._busy = 0
        self._stats = threading.Lock()
        self.count = 0
        self.ns = 0

    def infer(self, name: str, inputs: Mapping[str, Any]) -> Any:
        run = self._current[name]
        with self._lock:
            self._busy += 1
        t0 = time.monotonic_ns()
        try:
            outputs = run(inputs)
        finally:
            with self._lock:
                self._busy -= 1
        with self._stats:
            self.count += 1
            self.ns += time.monotonic_ns() - t0
        return outputs


class LeastBatcher:
    """One worker, greedy batches: a batch is whatever waits when the engine comes free."""

    def __init__(self, run: Callable[[Any], Mapping[str, Any]], max_batch: int = 8) -> None:
        self._run = run
        self._max = max_batch
        self._cv = threading.Condition()
        self._queue: list[tuple[Any, list[Any]]] = []
        threading.Thread(target=self._work, name="least-batcher", daemon=True).start()

    def infer(self, x: Any) -> Any:
        """``x`` has a batch dimension of one; the answer is each output's row for it."""
        slot: list[Any] = [None, threading.Event()]
        with self._cv:
            self._queue.append((x, slot))
            self._cv.notify()
        slot[1].wait()
        if isinstance(slot[0], BaseException):
            raise slot[0]
        return slot[0]

    def _work(self) -> None:
        import numpy as np

        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()
                batch, self._queue = self._queue[:self._max], self._queue[self._max:]
            xs = [x for x, _ in batch]
            try:
                out = self._run(np.concatenate(xs) if len(xs) > 1 else xs[0])
            except Exception as e:  # every caller hears of it; the worker stays
                for _, slot in batch:
                    slot[0] = e
                    slot[1].set()
                continue
            for i, (_, slot) in enumerate(batch):
                slot[0] = {name: v[i:i + 1] for name, v in out.items()}
                slot[1].set()
