"""The one inference service every transport calls: look up, validate, queue, answer.

Transports decode their wire format into an :class:`InferRequest`, call
:meth:`InferenceService.submit` (or ``infer`` / ``infer_async``) and encode the
:class:`InferResponse` or the :class:`~edged.errors.EdgedError` they get back.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, NamedTuple, TypeVar

from edged.backends.specs import platform_of
from edged.config import VersionPolicy
from edged.core.manager import ModelManager
from edged.core.model_versions import ModelState, ModelVersion
from edged.core.pipelines import load_pipeline_version, start_pipeline_request
from edged.core.scheduler import Scheduler
from edged.core.validation import validate
from edged.errors import DeadlineExceededError, ModelNotReadyError, model_not_ready, unknown_model
from edged.membudget import MemoryBudget
from edged.pipeline.graph import CallContext, Tensors
from edged.protocol.names import valid_model_name
from edged.protocol.types import InferRequest, InferResponse
from edged.protocol.v2_models import (
    ModelDescription,
    RepositoryEntry,
    TensorDescription,
    VersionStatistics,
    statistics_entry,
)
from edged.repository.digests import DigestCache
from edged.repository.manifest import TensorSpec
from edged.repository.store import VersionEntry

T = TypeVar("T")


def ready_now(mv: ModelVersion) -> bool:
    """Loaded and able to answer now: not while its engine restores a clean state after a failed run
    (requests wait for it meanwhile; readiness must not say 200 for a model that cannot answer yet)."""
    if mv.state is not ModelState.READY:
        return False
    sched = mv.scheduler
    return sched is None or not sched.engine.restoring


class _Owned:
    """The request's reservation (``InferRequest.memory``), released on leaving unless a future took it
    over: a request answered at once or refused gives its memory back here, a queued one when it ends."""

    def __init__(self, req: InferRequest) -> None:
        self.memory, req.memory = req.memory, None

    def __enter__(self) -> _Owned:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.memory is not None:
            self.memory.release()


def _heard(answer: asyncio.Future[InferResponse]) -> None:
    """Take a late step's outcome, which nobody waits for any more (no "never retrieved" warning)."""
    if not answer.cancelled():
        answer.exception()


def _release_when_done(future: Future[InferResponse], owned: _Owned) -> None:
    memory, owned.memory = owned.memory, None
    if memory is not None:
        future.add_done_callback(lambda _f: memory.release())


class LoadCheck(NamedTuple):
    """What loading a version aside (never published) showed: the engine it got, or why it did not load."""

    engine: str | None
    reason: str | None


class InferenceService:
    """The façade of core: inference, model control, the repository index, readiness and statistics.

    Transports, telemetry, health and sync call these methods and nothing else of core (checked by
    tools/archgraph.py); the types they hand out are named in :mod:`edged.core.public`."""

    def __init__(self, manager: ModelManager, budget: MemoryBudget | None = None) -> None:
        """``budget``: what requests in progress may hold together, shared by every transport."""
        self.manager = manager
        self.budget = budget if budget is not None else MemoryBudget.unlimited()
        # Pipelines: compiled by the manager against its table, run on its pipeline loop; each request's
        # model steps come back here (call_model), handed with the request by _start_pipeline.
        self._pipelines = manager.runner

    # ---- lookup -----------------------------------------------------------------------------
    def model(self, name: str, version: int | None = None) -> ModelVersion:
        mv = self.manager.table.find(name, version)
        if mv is None:
            what = f"model {name!r}" + (f" version {version}" if version is not None else "")
            raise unknown_model(name, version, f"{what} is not in the repository")
        return mv

    def ready_model(self, name: str, version: int | None = None) -> ModelVersion:
        """A served model or pipeline (``pipeline`` set, no scheduler), else ModelNotReadyError."""
        mv = self.model(name, version)
        if mv.state is not ModelState.READY or (mv.scheduler is None and mv.pipeline is None):
            why = f": {mv.reason}" if mv.reason else ""
            raise model_not_ready(name, mv.version, f"model {name!r} version {mv.version} is not ready "
                                                    f"({mv.state.value}){why}")
        return mv

    def is_ready(self, name: str, version: int | None = None) -> bool:
        mv = self.manager.table.find(name, version)
        return mv is not None and ready_now(mv)

    def find(self, name: str, version: int | None = None) -> ModelVersion | None:
        """The version in the table (the serving one for ``None``), or None: never raises."""
        return self.manager.table.find(name, version)

    def versions(self, name: str | None = None) -> list[ModelVersion]:
        """The versions in the table, loaded or refused: of ``name``, or of every model."""
        return self.manager.table.all() if name is None else self.manager.table.versions(name)

    def ready(self) -> bool:
        """Able to infer: some model can answer now, or none is configured (server readiness)."""
        mvs = self.manager.table.all()
        return not mvs or any(ready_now(mv) for mv in mvs)

    def statuses(self) -> list[dict[str, object]]:
        """Every version's status (``models list``, MQTT status), reloads that failed included."""
        return self.manager.statuses()

    def version_policy(self, name: str) -> VersionPolicy:
        """Which versions of ``name`` the live configuration serves."""
        return self.manager.models_cfg.policy_for(name)

    def repository_index(self) -> list[RepositoryEntry]:
        """Every model in the repository: the table's versions, then folders on disk not loaded
        (disabled or unloaded), in no particular order. Reads the disk: not on an event loop."""
        manager = self.manager
        out: list[RepositoryEntry] = []
        loaded: set[str] = set()
        for mv in manager.table.all():
            loaded.add(mv.name)
            out.append(RepositoryEntry(mv.name, mv.version, mv.state.value, mv.reason or ""))
        try:
            on_disk = sorted(p.name for p in manager.repository.iterdir()
                             if p.is_dir() and valid_model_name(p.name) and p.name not in loaded)
        except OSError:
            on_disk = []
        disabled = set(manager.models_cfg.disabled)
        out += [RepositoryEntry(name, None, ModelState.UNAVAILABLE.value,
                                "disabled in the configuration" if name in disabled else "unloaded")
                for name in on_disk]
        return out

    # ---- model control ----------------------------------------------------------------------
    def load(self, name: str, versions: list[int] | None = None) -> list[ModelVersion]:
        """(Re)load ``name`` without downtime (``versions`` None: the version policy decides); blocks."""
        return self.manager.load_model(name, versions)

    def unload(self, name: str, *, by_operator: bool = False) -> None:
        """Drain and unload every version of ``name``; ``by_operator``: asked for through a management API."""
        self.manager.unload_model(name, by_operator=by_operator)

    def unloaded_by_operator(self, name: str) -> bool:
        """Whether an operator unloaded ``name`` (a release's trial pauses instead of failing)."""
        return name in self.manager.operator_unloaded

    def pin(self, name: str, version: int | None) -> None:
        """Make the live version policy serve exactly ``version`` of ``name`` (None: disable the model).
        Takes effect on the next :meth:`load`; a configuration reload (SIGHUP) replaces it."""
        models = self.manager.models_cfg
        if version is None:
            if name not in models.disabled:
                models.disabled.append(name)
            return
        models.policies[name] = VersionPolicy(specific=[version])
        if name in models.disabled:
            models.disabled.remove(name)

    def try_load(self, entry: VersionEntry, stop: threading.Event | None = None) -> LoadCheck:
        """Load a version aside, never published: a model gets its engine (a better engine being built
        finishes first, unless ``stop`` is set) and lets it go; a pipeline compiles against what is
        served now. Blocks for the whole load: run it in a worker thread."""
        if entry.error:
            return LoadCheck(None, entry.error)
        if entry.pipeline:
            mv = load_pipeline_version(entry, self.manager.gateway, DigestCache(None))
            return LoadCheck("pipeline", None) if mv.state is ModelState.READY else LoadCheck(None, mv.reason)
        mv = self.manager.loader.load(entry)
        if mv.upgrade is not None:
            while not mv.upgrade.wait(1.0) and not (stop is not None and stop.is_set()):
                pass
            mv.upgrade.cancel()
        if mv.state is ModelState.READY and mv.engine is not None:
            label = mv.candidate.label if mv.candidate else None
            mv.engine.unload()
            mv.engine = None
            return LoadCheck(label, None)
        return LoadCheck(None, mv.reason or "did not load")

    # ---- inference --------------------------------------------------------------------------
    def _dispatch(self, req: InferRequest, run: Callable[[Scheduler, InferRequest, int], T],
                  pipeline: Callable[[ModelVersion], T]) -> T:
        """Look up (once), validate and hand to the model's scheduler, or start the pipeline.

        A version swapped out between lookup and queueing refuses with ModelNotReadyError;
        an unpinned request then goes to whatever version is current, a pinned one to its version's
        new copy when it was reloaded in place.
        """
        table = self.manager.table
        for attempt in range(3):
            # The served version in one step when there is one (every step here is paid on caches an
            # engine run has just evicted); ready_model says why when there is none.
            mv = table.serving(req.model) if req.version is None else None
            if mv is None or (mv.scheduler is None and mv.pipeline is None):
                mv = self.ready_model(req.model, req.version)
            scheduler = mv.scheduler
            if scheduler is None:
                return pipeline(mv)  # ready_model: no scheduler means a pipeline
            batch = validate(mv, req)
            try:
                return run(scheduler, req, batch)
            except ModelNotReadyError:
                # A pinned request goes on only to a new copy of its own version (a reload in place).
                if attempt == 2 or (req.version is not None and table.find(req.model, req.version) in (mv, None)):
                    raise
        raise AssertionError("unreachable")

    def submit(self, req: InferRequest) -> Future[InferResponse]:
        """Validate and queue; raises EdgedError at once for bad, unknown or overloaded requests.

        A pipeline's request runs on the pipeline loop; its model steps come back here."""
        if req.memory is None:
            return self._dispatch(req, Scheduler.submit, lambda mv: self._start_pipeline(mv, req))
        with _Owned(req) as memory:
            future = self._dispatch(req, Scheduler.submit, lambda mv: self._start_pipeline(mv, req))
            _release_when_done(future, memory)
            return future

    def infer(self, req: InferRequest, timeout: float | None = None) -> InferResponse:
        return self.submit(req).result(timeout)

    def infer_blocking(self, req: InferRequest) -> InferResponse:
        """For callers that own a thread: runs inline when the model is idle (lowest latency)."""
        if req.memory is None:
            return self._dispatch(req, Scheduler.run_inline, lambda mv: self._start_pipeline(mv, req).result())
        with _Owned(req):
            return self._dispatch(req, Scheduler.run_inline, lambda mv: self._start_pipeline(mv, req).result())

    def infer_or_submit(self, req: InferRequest, max_run_ns: int | None) -> InferResponse | Future[InferResponse]:
        """The answer at once when the model is idle and its runs are short enough to block the
        caller (an event loop) for (``max_run_ns`` None: any run, for a thread of its own that must
        go on reading requests rather than wait for a queue); otherwise the request is queued and
        its future returned."""
        def run(scheduler: Scheduler, r: InferRequest, batch: int) -> InferResponse | Future[InferResponse]:
            resp = scheduler.try_inline(r, batch, max_run_ns)
            return resp if resp is not None else scheduler.submit(r, batch)
        if req.memory is None:
            return self._dispatch(req, run, lambda mv: self._start_pipeline(mv, req))
        with _Owned(req) as memory:
            done = self._dispatch(req, run, lambda mv: self._start_pipeline(mv, req))
            if isinstance(done, Future):
                _release_when_done(done, memory)
            return done

    def _start_pipeline(self, mv: ModelVersion, req: InferRequest) -> Future[InferResponse]:
        return start_pipeline_request(mv, req, self._pipelines, self, self.budget)

    async def infer_async(self, req: InferRequest) -> InferResponse:
        return await asyncio.wrap_future(self.submit(req))

    async def call_model(self, model: str, version: int | None, inputs: Tensors,
                         context: CallContext) -> Tensors:
        """A pipeline's model step: queued on the model's scheduler with the pipeline request's deadline
        and priority, and waited for no longer than that deadline. A step still queued or running then
        fails the request at once (the scheduler drops it unstarted when its turn comes; a run already
        started finishes unheard) instead of holding the caller past the time it gave."""
        req = InferRequest(model=model, inputs=inputs, version=version, deadline=context.deadline,
                           parameters=dict(context.parameters))
        answer = asyncio.wrap_future(self.submit(req))
        if context.deadline is not None:
            try:
                # asyncio.wait, not wait_for: the queued step is left for the scheduler to refuse as late.
                done, _ = await asyncio.wait({answer}, timeout=max(0.0, context.deadline - time.monotonic()))
            except asyncio.CancelledError:
                answer.cancel()  # the pipeline request ended otherwise: its step is not wanted any more
                raise
            if not done:
                answer.add_done_callback(_heard)
                raise DeadlineExceededError(f"model {model!r}: the pipeline request's deadline passed while "
                                            "its model step waited")
        return (await answer).outputs

    # ---- metadata ---------------------------------------------------------------------------
    def describe(self, name: str, version: int | None = None) -> ModelDescription:
        """What a v2 server says about the model (protocol.v2_models.metadata_response), plus where it runs."""
        mv = self.model(name, version)

        def tensors(specs: list[TensorSpec]) -> tuple[TensorDescription, ...]:
            return tuple(TensorDescription(s.name, s.datatype, tuple(s.shape)) for s in specs)

        status = mv.status()
        c = mv.candidate
        return ModelDescription(
            name=name,
            versions=tuple(v.version for v in self.manager.table.versions(name)),
            platform="ensemble" if mv.entry.pipeline else platform_of(c.backend if c else None) or "unknown",
            batched=mv.max_batch_size > 0,
            inputs=tensors(mv.inputs),
            outputs=tensors(mv.outputs),
            details={
                "backend": c.backend if c else None, "device": c.device if c else None,
                "precision": c.precision if c else None, "state": mv.state.value,
                "reason": mv.reason, "warmup": mv.warmup_note, "note": mv.output_note,
                "skipped": [{"candidate": k, "reason": r} for k, r in mv.skipped],
                "benchmark": status.get("benchmark"),
                "benchmark_basis": status.get("benchmark_basis"),
                "choice": status.get("choice"),
                "chosen_how": status.get("chosen_how"),
                "upgrade": status.get("upgrade"),
            },
        )

    def version_statistics(self, name: str | None = None, version: int | None = None) -> list[VersionStatistics]:
        """The counters of every version (``name`` None), of a model's versions, or of one version."""
        if name is None:
            mvs = self.manager.table.all()
        elif version is None:
            mvs = self.manager.table.versions(name)
            if not mvs:
                raise unknown_model(name, None, f"model {name!r} is not in the repository")
        else:
            mvs = [self.model(name, version)]
        return [mv.stats.snapshot() for mv in mvs if mv.stats is not None]

    def statistics(self, name: str | None = None, version: int | None = None) -> list[dict[str, Any]]:
        """:meth:`version_statistics` in Triton's shape (counters by their wire names), for an embedding
        program and the tests that compare with what a transport answers; the daemon's own readers (the
        updater's trial, transports, telemetry) take the typed records and format on their side."""
        return [statistics_entry(s) for s in self.version_statistics(name, version)]
