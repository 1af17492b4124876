"""The least a Python inference service can add to an engine run: the floor under edged's core.

A service that swaps versions under load, runs a lone request inline and reports statistics must,
per request, at least find the model's current version, mark an instance busy and free again, and
count the request and its time. :class:`LeastService` does exactly that and nothing else: no
validation, no deadline, no shape memory, no queue, no histogram. The suite runs it in-process
beside ``infer_blocking`` (the service c1 goal) and inside the IPC responder beside the shm path
(the shm c1 goal), on the same engine, so each run shows what these steps cost on this machine.
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
