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
from collections.abc import Callable, Mapping, Sequence
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
    """Greedy batches: a batch is whatever waits when an engine comes free.

    By default one worker thread concatenates the batch and hands it to ``run``. With ``lanes``, one
    worker thread per lane, each handed the list of waiting inputs to assemble where its engine reads
    them (bench/floor_procs.py: a worker process's shared memory); the lanes share one queue, so a
    batch goes to whichever engine is free first.
    """

    def __init__(self, run: Callable[[Any], Mapping[str, Any]] | None = None, max_batch: int = 8, *,
                 lanes: Sequence[Callable[[list[Any]], Mapping[str, Any]]] = ()) -> None:
        if not lanes:
            assert run is not None
            lanes = [lambda xs: run(_concatenate(xs))]
        self._max = max_batch
        self._cv = threading.Condition()
        self._queue: list[tuple[Any, list[Any]]] = []
        self._closed = False
        self._threads = [threading.Thread(target=self._work, args=(lane,), name=f"least-batcher-{k}", daemon=True)
                         for k, lane in enumerate(lanes)]
        for t in self._threads:
            t.start()

    def infer(self, x: Any) -> Any:
        """``x`` has a batch dimension of one; the answer is each output's row for it."""
        slot: list[Any] = [None, threading.Event()]
        with self._cv:
            if self._closed:
                raise RuntimeError("the batcher is closed")
            self._queue.append((x, slot))
            self._cv.notify()
        slot[1].wait()
        if isinstance(slot[0], BaseException):
            raise slot[0]
        return slot[0]

    def close(self) -> None:
        """The workers finish their batch and stop; whoever still waits in the queue hears of it."""
        with self._cv:
            self._closed = True
            left, self._queue = self._queue, []
            self._cv.notify_all()
        for _, slot in left:
            slot[0] = RuntimeError("the batcher is closed")
            slot[1].set()
        for t in self._threads:
            t.join(5)

    def _work(self, lane: Callable[[list[Any]], Mapping[str, Any]]) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                batch, self._queue = self._queue[:self._max], self._queue[self._max:]
            try:
                out = lane([x for x, _ in batch])
            except Exception as e:  # every caller hears of it; the worker stays
                for _, slot in batch:
                    slot[0] = e
                    slot[1].set()
                continue
            for i, (_, slot) in enumerate(batch):
                slot[0] = {name: v[i:i + 1] for name, v in out.items()}
                slot[1].set()


def _concatenate(xs: list[Any]) -> Any:
    import numpy as np

    return np.concatenate(xs) if len(xs) > 1 else xs[0]
