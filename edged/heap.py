"""The daemon's objects under CPython's cyclic garbage collector: what start-up made is frozen.

Why: a READY daemon tracks ~94,000 objects (the bundled 11 model versions and pipelines, grpcio,
pydantic, numpy), and a full collection walks all of them with the GIL held: 49-60 ms on a 2-vCPU
VM, during which no transport answers anyone. CPython runs one whenever the objects that survived
two collections have grown by a quarter: under load every few thousand requests (grpcio alone leaves
a few cyclic objects per call), and the memory trimmer runs one after each burst. Frozen
(``gc.freeze``), start-up's objects are skipped; a full collection then walks only what serving made
since, well under a millisecond.

What freezing costs: an object frozen at start-up that later becomes cyclic garbage stays until it is
unfrozen. Engines free their native memory when unloaded whatever the collector does, so what waits
is Python objects; :class:`HeapKeeper` unfreezes, collects and freezes again soon after a model
version is retired (:func:`review_soon`) and every ``REVIEW_S`` regardless: one full pause then, not
one every few seconds of traffic.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

REVIEW_S = 600.0  # the longest a frozen object that died waits to be collected
SOON_S = 2.0  # after review_soon: let the rest of an unload (or of several) happen first

_keeper: HeapKeeper | None = None
_keeper_lock = threading.Lock()
_collect_lock = threading.Lock()  # explicit full collections, one at a time (this module's, the trimmer's)


@dataclass(frozen=True)
class Frozen:
    objects: int  # frozen now
    full_ms: float  # the full collection before freezing (what each one cost until now)
    after_ms: float  # a full collection once frozen


def collect() -> int:
    """A full collection, never beside another explicit one. (An automatic collection another thread is
    in the middle of makes CPython return at once without collecting: rare, and the next review catches up.)"""
    with _collect_lock:
        return gc.collect()


def review(unless: threading.Event | None = None) -> Frozen | None:
    """Unfreeze (anything frozen before), collect what is dead, freeze the rest; None (nothing done)
    once ``unless`` is set, checked under the lock that ``HeapKeeper.stop`` unfreezes under, so that
    nothing is frozen after it."""
    with _collect_lock:
        if unless is not None and unless.is_set():
            return None
        gc.unfreeze()
        t0 = time.perf_counter()
        gc.collect()
        t1 = time.perf_counter()
        gc.freeze()
        gc.collect()
        t2 = time.perf_counter()
    return Frozen(gc.get_freeze_count(), (t1 - t0) * 1e3, (t2 - t1) * 1e3)


def review_soon() -> None:
    """Ask the running keeper (if any) for a review in ``SOON_S``: frozen objects may have died."""
    keeper = _keeper
    if keeper is not None:
        keeper.soon()


class HeapKeeper:
    """Freezes start-up's objects and reviews them: after ``soon()`` and every ``interval_s``.

    One keeper per process: starting another retires the one before (two daemons in one process, as in
    tests); only the current keeper's ``stop`` unfreezes."""

    def __init__(self, interval_s: float = REVIEW_S, soon_s: float = SOON_S) -> None:
        self.interval_s, self.soon_s = interval_s, soon_s
        self.reviews = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Frozen:
        """Freeze now (the caller's thread: a daemon about to say READY) and keep reviewing."""
        global _keeper
        with _keeper_lock:
            before, _keeper = _keeper, self
        if before is not None and before is not self:
            before.stop()  # no longer current: it stops its thread and leaves the freeze to this one
        frozen = review()
        assert frozen is not None  # nothing to stop it: it was not asked to
        self._thread = threading.Thread(target=self._run, name="edged-heap", daemon=True)
        self._thread.start()
        return frozen

    def soon(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        """Stop reviewing; the current keeper also unfreezes (the collector works as before ``start``)."""
        global _keeper
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5.0)
        with _keeper_lock:
            current = _keeper is self
            if current:
                _keeper = None
        if current:
            with _collect_lock:  # after a review still running past the join: it froze, this unfreezes
                gc.unfreeze()

    def _run(self) -> None:
        while not self._stop.is_set():
            asked = self._wake.wait(self.interval_s)
            if self._stop.is_set():
                return
            if asked and self._stop.wait(self.soon_s):
                return
            self._wake.clear()
            try:
                frozen = review(unless=self._stop)
            except Exception:  # a keeper that died would leave the heap frozen for good: log, go on
                log.exception("heap review failed")
                continue
            if frozen is None:
                return
            self.reviews += 1
            log.debug("heap review: %d objects frozen, the full collection took %.1f ms",
                      frozen.objects, frozen.full_ms)
