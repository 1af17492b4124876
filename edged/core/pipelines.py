"""Pipelines served like models: compiled against the models the repository serves, run on one loop.

A version folder holding ``pipeline.toml`` becomes a :class:`ModelVersion` whose
``pipeline`` is set (no engine, no scheduler of its own), so the table, the v2
endpoints, statuses and telemetry see it as they see a model. It compiles against
:class:`ServedModels` (the table); its model steps go back through the InferenceService
that started the request (handed with it, :func:`start_pipeline_request`), i.e. to the
model's own scheduler: concurrent pipeline requests overlap and batch there, nothing
serializes them at the pipeline.

Pipeline requests run as coroutines on one event loop in a thread of its own
(:class:`PipelineRunner`), whatever transport or thread submits them; their CPU
steps go to worker threads, so the loop only waits.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Coroutine
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from typing import Any, TypeVar

from edged.core.model_versions import ModelState, ModelTable, ModelVersion
from edged.core.stats import ModelStats
from edged.errors import (
    DeadlineExceededError,
    EdgedError,
    InvalidInputError,
    ManifestError,
    model_not_ready,
)
from edged.membudget import MemoryBudget, set_current
from edged.pipeline.contract import ANY, PipelineDefinitionError, Port
from edged.pipeline.definition import PIPELINE_FILE, files_read, load_pipeline
from edged.pipeline.graph import CallContext, ModelCaller, compile_pipeline
from edged.protocol.types import InferRequest, InferResponse
from edged.repository.digests import DigestCache
from edged.repository.manifest import TensorSpec
from edged.repository.onnx_metadata import read_metadata
from edged.repository.store import VersionEntry, check_file

log = logging.getLogger(__name__)
T = TypeVar("T")


class ServedModels:
    """The graph's ModelGateway over the table (``version=None`` follows the serving version): what a
    pipeline compiles against. The manager compiles pipelines before any service exists; calling the
    models is the service's, handed to each request (``CallContext.models``)."""

    def __init__(self, table: ModelTable) -> None:
        self.table = table

    def model_ports(self, model: str, version: int | None) -> tuple[dict[str, Port], dict[str, Port]]:
        mv = self.table.find(model, version)
        what = f"model {model!r}" + (f" version {version}" if version is not None else "")
        if mv is None:
            raise PipelineDefinitionError(f"{what} is not served (not loaded)")
        if mv.pipeline is not None or mv.entry.pipeline:
            raise PipelineDefinitionError(f"{what} is a pipeline; a model step calls a model")
        if mv.state is not ModelState.READY:
            why = f": {mv.reason}" if mv.reason else ""
            raise PipelineDefinitionError(f"{what} is not served ({mv.state.value}){why}")
        lead: tuple[int, ...] = (ANY,) if mv.max_batch_size > 0 else ()

        def ports(specs: list[TensorSpec]) -> dict[str, Port]:
            return {s.name: Port(s.datatype, lead + tuple(ANY if d < 0 else d for d in s.shape)) for s in specs}
        return ports(list(mv.inputs)), ports(list(mv.outputs))

    def model_metadata(self, model: str, version: int | None) -> dict[str, str]:
        """The ONNX ``metadata_props`` of the model's ONNX variant (the one serving, else the first)."""
        mv = self.table.find(model, version)
        if mv is None or mv.entry.manifest is None:
            raise PipelineDefinitionError(f"model {model!r} is not in the repository (its metadata was asked for)")
        variants = [mv.candidate.variant] if mv.candidate is not None else []
        variants += [v for v in mv.manifest.variants if v.format == "onnx"]
        for variant in variants:
            if variant.format == "onnx" and variant.file not in mv.entry.bad_variants:
                try:
                    return read_metadata(mv.entry.path / variant.file)
                except ManifestError as exc:
                    raise PipelineDefinitionError(f"model {model!r}: {exc.message}") from None
        raise PipelineDefinitionError(f"model {model!r} has no usable ONNX variant to read metadata from")

    def max_batch_size(self, model: str, version: int | None) -> int:
        mv = self.table.find(model, version)
        return mv.max_batch_size if mv is not None and mv.entry.manifest is not None else 0


class PipelineRunner:
    """One event loop in a daemon thread, started on first use, for every pipeline request."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._settle = ThreadPoolExecutor(max_workers=4, thread_name_prefix="edged-pipeline-done")

    def _ensure(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="edged-pipelines", daemon=True)
                thread.start()
                self._loop, self._thread = loop, thread
            return self._loop

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Run ``coro`` on the loop; its future is settled from a worker thread, so the callers'
        completion callbacks (encoding, a socket write to a slow client) never run on the loop.
        Cancelling the returned future cancels the request."""
        out: Future[T] = Future()
        loop = self._ensure()
        settle = self._settle

        async def run() -> None:
            try:
                value = await coro
            except asyncio.CancelledError:
                out.cancel()
                raise
            except BaseException as exc:  # the request's failure, whatever it is, is the caller's to see
                await loop.run_in_executor(settle, _settle, out, None, exc)
            else:
                await loop.run_in_executor(settle, _settle, out, value, None)

        task = asyncio.run_coroutine_threadsafe(run(), loop)
        out.add_done_callback(lambda f: task.cancel() if f.cancelled() else None)
        return out

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel what still runs (its callers get CancelledError, never a hang), then end the loop."""
        with self._lock:
            loop, thread = self._loop, self._thread
            self._loop = self._thread = None
        if loop is not None and thread is not None:
            try:
                asyncio.run_coroutine_threadsafe(_cancel_all(), loop).result(timeout)
            except Exception:
                log.warning("pipeline requests did not end within %.0fs of shutdown", timeout)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(5.0)
            if not thread.is_alive():
                loop.close()


def _settle(out: Future[T], value: T | None, exc: BaseException | None) -> None:
    try:
        if exc is not None:
            out.set_exception(exc)
        else:
            out.set_result(value)  # type: ignore[arg-type]
    except InvalidStateError:  # the caller cancelled it meanwhile
        pass


async def _cancel_all() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _specs(ports: dict[str, Port]) -> list[TensorSpec]:
    return [TensorSpec(name=n, datatype=p.datatype, shape=list(p.shape)) for n, p in ports.items()]


def check_pipeline_files(entry: VersionEntry, digests: DigestCache) -> Any:
    """Parse the pipeline file and check every file its steps read against the listed digests."""
    spec = load_pipeline(entry.path)
    listed = {f.file: f.sha256 for f in spec.files}
    for rel, step in sorted(files_read(spec, entry.path).items()):
        if rel not in listed:
            raise PipelineDefinitionError(f"step {step!r} reads {rel!r}, which {PIPELINE_FILE} does not list "
                                          "under [[files]] with its sha256", step=step)
    for rel, sha in listed.items():
        problem = check_file(entry.path, rel, sha, digests)
        if problem:
            raise PipelineDefinitionError(f"[[files]]: {problem}", file=rel)
    return spec


def load_pipeline_version(entry: VersionEntry, gateway: ServedModels, digests: DigestCache) -> ModelVersion:
    """Compile a pipeline version against what is served now; a refusal keeps its reason, never raises."""
    mv = ModelVersion(entry.model, entry.version, entry)
    if entry.error:
        mv.state, mv.reason = ModelState.UNAVAILABLE, entry.error
        return mv
    t0 = time.monotonic()
    spec = None
    try:
        spec = check_pipeline_files(entry, digests)
        pipeline = compile_pipeline(spec, entry.path, gateway)
    except EdgedError as exc:
        mv.state, mv.reason = ModelState.UNAVAILABLE, f"pipeline refused: {exc.message}"
        # A pipeline waiting for a model whose files are not fetched yet was said at INFO with the models.
        waits = spec is not None and any(
            (m := gateway.table.find(step.model, step.version)) is not None and m.entry.not_fetched
            for step in spec.steps if step.model is not None)
        log.log(logging.DEBUG if waits else logging.ERROR, "pipeline=%s version=%s refused: %s",
                entry.model, entry.version, exc.message)
        return mv
    mv.pipeline = pipeline
    mv.inputs, mv.outputs = _specs(pipeline.inputs), _specs(pipeline.outputs)
    mv.stats = ModelStats(mv.name, mv.version, "pipeline")
    mv.load_seconds = time.monotonic() - t0
    mv.state = ModelState.READY
    mv.notes = list(pipeline.notes)
    log.info("pipeline=%s version=%s ready (models: %s)", mv.name, mv.version,
             ", ".join(sorted({m for m, _ in pipeline.models})) or "none")
    for note in pipeline.notes:
        log.info("pipeline=%s version=%s: %s", mv.name, mv.version, note)
    return mv


# Request parameters a pipeline's model calls inherit (v2 / Triton's ``priority``; ``timeout`` is the deadline).
INHERITED_PARAMETERS = ("priority",)


def start_pipeline_request(mv: ModelVersion, req: InferRequest, runner: PipelineRunner, models: ModelCaller,
                           budget: MemoryBudget | None = None) -> Future[InferResponse]:
    """Check what can be checked at once, then run the request on the pipeline loop; its model steps
    go to ``models`` (the service that started it) with the request's deadline and priority.

    The request's steps charge what they decode (images, audio, padding) to a reservation on
    ``budget`` before allocating it; it is released when the request ends, whichever way, once
    every step of it has ended (a step in a worker thread included). A cancelled request's
    reservation refuses to grow from then on, so its running steps stop at their next charge."""
    pipeline = mv.pipeline
    if mv.state is not ModelState.READY or pipeline is None:
        why = f": {mv.reason}" if mv.reason else ""
        raise model_not_ready(mv.name, mv.version,
                              f"pipeline {mv.name!r} version {mv.version} is not ready ({mv.state.value}){why}")
    wanted = req.outputs
    if wanted is not None:
        unknown = sorted(set(wanted) - set(pipeline.outputs))
        if unknown:
            raise InvalidInputError(f"pipeline {mv.name!r} has no output(s) {unknown}; "
                                    f"outputs: {sorted(pipeline.outputs)}")
    if req.deadline is not None and time.monotonic() > req.deadline:
        raise DeadlineExceededError(f"request to pipeline {mv.name!r} timed out before it started")
    stats = mv.stats
    assert stats is not None
    context = CallContext(deadline=req.deadline, parameters={k: req.parameters[k] for k in INHERITED_PARAMETERS
                                                             if k in req.parameters}, models=models)
    stats.enter()

    held = budget.reserve(0, f"pipeline {mv.name!r}") if budget is not None else None

    async def run() -> InferResponse:
        start = time.monotonic_ns()
        set_current(held)  # this task's own context: the steps' worker threads inherit it
        try:
            out = await pipeline.run(req.inputs, context)
        except EdgedError as exc:
            stats.record_failure(exc.code.value, total_ns=time.monotonic_ns() - start)
            raise
        except BaseException:
            stats.record_failure("internal", total_ns=time.monotonic_ns() - start)
            raise
        finally:
            if held is not None:
                held.release()
        took = time.monotonic_ns() - start
        first = next(iter(req.inputs.values()), None)
        stats.record_batch(int(first.shape[0]) if first is not None and first.ndim else 1, 1, 0, took, 0)
        stats.record_success(queue_ns=0, total_ns=took)
        if wanted is not None:
            out = {name: out[name] for name in wanted}
        return InferResponse(model=mv.name, version=mv.version, outputs=out, id=req.id)
    answer = runner.submit(run())
    if held is not None:  # a caller that goes away: its steps stop at their next charge, at once
        answer.add_done_callback(lambda f: held.end("was cancelled") if f.cancelled() else None)
    return answer
