"""Engines that take minutes to make (TensorRT builds) without holding up serving.

A backend whose engine is not ready yet raises :class:`EngineBuildRequiredError` from
``load`` with a *builder* function instead of building inline; the model loader
then serves through the next candidate and runs the build in the background
(:mod:`edged.core.upgrade`). :class:`EngineBuild` is the build's state machine::

    pending -> building -> ready
                        -> failed(reason)
    pending -> cancelled            (the model was unloaded before the build started)
    building -> cancelled           (unloaded while building: the result is released, never used)

The builder is injected, so the state machine is the same whether it wraps a real
TensorRT build on a GPU or a stand-in in a test.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from edged.backends.base import Engine
from edged.errors import EdgedError, ModelLoadError

log = logging.getLogger(__name__)

Builder = Callable[[], Engine]


class EngineBuildRequiredError(ModelLoadError):
    """The engine must be built first; ``builder`` does it (slowly, blocking) and returns the engine."""

    def __init__(self, message: str, builder: Builder, **context: Any) -> None:
        super().__init__(message, **context)
        self.builder = builder


class BuildState(str, enum.Enum):
    PENDING = "pending"
    BUILDING = "building"
    READY = "ready"
    FAILED = "failed"
    CANCELLED = "cancelled"


_NEXT = {
    BuildState.PENDING: {BuildState.BUILDING, BuildState.CANCELLED},
    BuildState.BUILDING: {BuildState.READY, BuildState.FAILED, BuildState.CANCELLED},
    BuildState.READY: {BuildState.FAILED},  # built, but failed the checks before it could serve
    BuildState.FAILED: set(),
    BuildState.CANCELLED: set(),
}


class EngineBuild:
    """One build of one candidate engine; thread-safe, runs at most once."""

    def __init__(self, label: str, builder: Builder) -> None:
        self.label = label
        self._builder = builder
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._cancel_requested = False
        self.state = BuildState.PENDING
        self.reason: str | None = None
        self.engine: Engine | None = None
        self._t0: float | None = None
        self._t1: float | None = None

    def _move(self, new: BuildState) -> None:
        # Called with the lock held; an illegal transition is a bug in the caller.
        if new not in _NEXT[self.state]:
            raise RuntimeError(f"engine build {self.label}: cannot go from {self.state.value} to {new.value}")
        self.state = new
        if new is BuildState.BUILDING:
            self._t0 = time.monotonic()
        elif new in (BuildState.READY, BuildState.FAILED, BuildState.CANCELLED):
            self._t1 = time.monotonic()
            self._done.set()

    def run(self) -> Engine:
        """Build in the calling thread; returns the engine or raises ModelLoadError with the reason."""
        with self._lock:
            if self.state is BuildState.CANCELLED:
                raise ModelLoadError(f"engine build for {self.label} was cancelled")
            self._move(BuildState.BUILDING)
        log.info("engine build started: %s", self.label)
        try:
            engine = self._builder()
        except EdgedError as e:
            self._fail(str(e))
            raise ModelLoadError(str(e)) from None
        except Exception as e:  # a library bug must not escape the build thread unexplained
            self._fail(f"unexpected {type(e).__name__}: {e}")
            raise ModelLoadError(self.reason or "build failed") from None
        with self._lock:
            if self._cancel_requested:
                self._move(BuildState.CANCELLED)
                cancelled = True
            else:
                self.engine = engine
                self._move(BuildState.READY)
                cancelled = False
        if cancelled:
            engine.unload()
            raise ModelLoadError(f"engine build for {self.label} was cancelled")
        log.info("engine build ready: %s in %.1fs", self.label, self.seconds)
        return engine

    def _fail(self, reason: str) -> None:
        with self._lock:
            self.reason = reason
            self._move(BuildState.FAILED)
        log.warning("engine build failed: %s: %s", self.label, reason)

    def fail(self, reason: str) -> None:
        """Mark a build that produced an engine as failed after all (it did not pass its checks)."""
        with self._lock:
            if self.state is BuildState.READY:
                self.reason = reason
                self.engine = None
                self._move(BuildState.FAILED)

    def cancel(self) -> None:
        """Stop before it starts, or discard the result when it finishes; a running build is not interrupted."""
        with self._lock:
            self._cancel_requested = True
            if self.state is BuildState.PENDING:
                self._move(BuildState.CANCELLED)

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    @property
    def seconds(self) -> float:
        if self._t0 is None:
            return 0.0
        return (self._t1 if self._t1 is not None else time.monotonic()) - self._t0

    def status(self) -> dict[str, Any]:
        return {"candidate": self.label, "state": self.state.value, "reason": self.reason,
                "seconds": round(self.seconds, 3)}
