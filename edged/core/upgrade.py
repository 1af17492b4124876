"""Switching a serving model version to a better engine once its background build finishes.

The model serves through a fallback engine from the moment it loads. The engines
still to be built (best first) are built one at a time in a background thread;
the first that builds, passes the I/O check and warm-up (and, when the profile
asks for a benchmark, measures faster) replaces the fallback through a
:class:`SwappableEngine`: later batches go to the new engine, batches already
running finish on the old one, and only then is the old one released. No request
fails because of the switch.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from edged.backends.base import Engine
from edged.backends.build import BuildState, EngineBuild
from edged.backends.selection import Candidate
from edged.errors import EdgedError, ModelLoadError
from edged.heap import review_soon

log = logging.getLogger(__name__)

SWAP_DRAIN_TIMEOUT_S = 30.0


class SwappableEngine(Engine):
    """An engine whose implementation can be replaced while requests run through it.

    It counts the calls running on each implementation so a replaced engine is
    released only after its last call returns. The count costs two uncontended lock
    round trips per batch, which is why the loader wraps only versions that have an
    upgrade coming.
    """

    def __init__(self, engine: Engine) -> None:
        # Every inference takes the lock twice: the C-level lock directly, not the Condition's Python wrapper,
        # and the Condition is notified only while a swap waits for a replaced engine's calls to end.
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._draining = 0
        self._users: dict[int, int] = {}
        self._closed = False
        self._current = engine
        # Runs of more than one sample go here when set (edged.core.chooser: engines that win at batch 1
        # and at the batches the scheduler forms can differ); None: every run goes to ``current``.
        self._batched: Engine | None = None
        self._mirror(engine)

    def _mirror(self, engine: Engine) -> None:
        self.backend, self.device, self.precision = engine.backend, engine.device, engine.precision
        self.inputs, self.outputs = engine.inputs, engine.outputs
        self.takes_text = engine.takes_text  # how BYTES reach it: validation reads it through the proxy
        self.parallel = engine.parallel

    @property
    def current(self) -> Engine:
        return self._current

    def process_memory_mb(self) -> float:
        return self._current.process_memory_mb()

    def processes(self) -> dict[str, Any] | None:
        return self._current.processes()

    @property
    def batched(self) -> Engine | None:
        return self._batched

    @property
    def closed(self) -> bool:
        return self._closed

    def infer(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        with self._lock:
            engine = self._current
            if self._batched is not None:
                for a in inputs.values():
                    if a.ndim and a.shape[0] > 1:
                        engine = self._batched
                    break
            key = id(engine)
            self._users[key] = self._users.get(key, 0) + 1
        try:
            return engine.infer(inputs, outputs)
        finally:
            with self._lock:
                left = self._users[key] - 1
                if left:
                    self._users[key] = left
                else:
                    del self._users[key]
                    if self._draining:
                        self._cv.notify_all()

    def swap(self, new: Engine, timeout: float = SWAP_DRAIN_TIMEOUT_S) -> Engine | None:
        """Route every later call to ``new`` (:meth:`install` with no batched split); return the engine it
        replaced once its running calls are done. An engine that served the batched runs is released here,
        so a background upgrade replaces a split choice whole.

        Returns None (and releases ``new``) when the proxy was unloaded meanwhile.
        """
        old = self.install(new, None, timeout)
        if not old:
            return None
        for engine in old[1:]:
            engine.unload()
        return old[0]

    def install(self, current: Engine, batched: Engine | None, timeout: float = SWAP_DRAIN_TIMEOUT_S
                ) -> list[Engine] | None:
        """Route batch-1 runs to ``current`` and larger ones to ``batched`` (None: to ``current`` too);
        returns the engines no longer used once their running calls are done (the caller releases them).

        Returns None (and releases the new engines) when the proxy was unloaded meanwhile.
        """
        with self._cv:
            if self._closed:
                closed = True
            else:
                closed = False
                before = [self._current, *([self._batched] if self._batched is not None else [])]
                self._current, self._batched = current, batched
                self._mirror(current)
                keep = {id(current), id(batched)}
                old = [e for e in before if id(e) not in keep]
                self._draining += 1
                try:
                    drained = self._cv.wait_for(lambda: not any(id(e) in self._users for e in old), timeout)
                finally:
                    self._draining -= 1
                if not drained:
                    log.warning("engine swap: calls on a replaced engine still running after %.0fs", timeout)
        if closed:
            current.unload()
            if batched is not None and batched is not current:
                batched.unload()
            return None
        return old

    def unload(self) -> None:
        with self._lock:
            self._closed = True
            engine, batched = self._current, self._batched
        engine.unload()
        if batched is not None and batched is not engine:
            batched.unload()

    def describe(self) -> dict[str, Any]:
        return self._current.describe()

    @property
    def restoring(self) -> bool:
        return self._current.restoring


Prepare = Callable[[Candidate, Engine], None]
Judge = Callable[[Candidate, Engine], bool]


class EngineUpgrade:
    """Background builds for one serving version, best candidate first; the first good one is switched in."""

    def __init__(self, label: str, proxy: SwappableEngine, builds: Sequence[tuple[Candidate, EngineBuild]], *,
                 prepare: Prepare, on_switch: Callable[[Candidate], None],
                 on_failure: Callable[[Candidate, str], None], judge: Judge | None = None) -> None:
        self.label = label
        self.proxy = proxy
        self.builds = list(builds)
        self._prepare = prepare
        self._judge = judge
        self._on_switch = on_switch
        self._on_failure = on_failure
        self.state = "pending"
        self.switched_to: str | None = None
        self._thread: threading.Thread | None = None
        self._done = threading.Event()

    def start(self) -> None:
        self.state = "building"
        self._thread = threading.Thread(target=self._run, name=f"edged-build-{self.label}", daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def cancel(self) -> None:
        for _, build in self.builds:
            build.cancel()

    def _run(self) -> None:
        try:
            self.state = self._attempt_all()
        except BaseException:  # the thread must always finish its bookkeeping
            log.exception("%s: engine upgrade crashed", self.label)
            self.state = "failed"
        finally:
            self.cancel()  # builds never started are no longer needed, whatever the outcome
            self._done.set()

    def _attempt_all(self) -> str:
        for cand, build in self.builds:
            if self.proxy.closed:
                self.cancel()
                return "cancelled"
            try:
                engine = build.run()
            except ModelLoadError as e:
                if build.state is BuildState.CANCELLED or self.proxy.closed:
                    self.cancel()
                    return "cancelled"
                self._on_failure(cand, f"background build failed: {e}")
                continue
            outcome = self._adopt(cand, build, engine)
            if outcome is not None:
                return outcome
        return "failed"

    def _adopt(self, cand: Candidate, build: EngineBuild, engine: Engine) -> str | None:
        """Check, maybe compare, then switch; None means try the next build."""
        try:
            self._prepare(cand, engine)
        except EdgedError as e:
            engine.unload()
            build.fail(str(e))
            self._on_failure(cand, f"built, but not usable: {e}")
            return None
        if self._judge is not None:
            try:
                better = self._judge(cand, engine)
            except EdgedError as e:
                better = False
                log.warning("%s: measuring %s failed: %s", self.label, cand.label, e)
            if not better:
                engine.unload()
                log.info("%s: %s built but measured slower than the serving engine; keeping it", self.label,
                         cand.label)
                return "kept"
        old = self.proxy.swap(engine)
        if old is None:
            return "cancelled"
        self.switched_to = cand.label
        self._on_switch(cand)
        old.unload()
        review_soon()  # the replaced engine's objects may be frozen from the collector (edged/heap.py)
        log.info("%s: switched to %s", self.label, cand.label)
        return "ready"

    def status(self) -> dict[str, Any]:
        building = next((b.label for _, b in self.builds if b.state is BuildState.BUILDING), None)
        return {"state": self.state, "building": building, "switched_to": self.switched_to,
                "builds": [b.status() for _, b in self.builds]}
