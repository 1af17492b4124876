"""A pipeline compiled from its definition: wiring checked at load, run as a DAG.

Compiling refuses, naming the step and the tensor: duplicate names, a tensor read
that nothing produces, a tensor produced twice, a cycle, a pipeline input nothing
reads, a pipeline output nothing produces, an unknown step kind or model, and any
type/shape mismatch (``Port.accepts``) between a producer and its consumer.

Running starts every step as soon as the tensors it reads exist, so independent
branches overlap. Built-in and custom steps run in a worker thread (they are CPU
work and must not block the event loop); model steps go through a ``ModelGateway``,
which is the daemon's scheduler, so concurrent requests batch in the model's own
dynamic batcher. A model step never hands a model more rows than its ``max_batch_size``:
a larger batch (a fan-out's crops) is split into chunks of that size, submitted together
through the model's scheduler (so they batch with other requests) and their answers joined
in order; when one of them fails, the others are called off. The request's deadline and
priority go with every model call, and the deadline is checked before every step starts, so a
chain of CPU steps fails with DEADLINE_EXCEEDED too instead of answering late (a step already
running is not interrupted). A request that ends early (cancelled, or a step failed) cancels
its other steps and ends only once each has: a step in a worker thread cannot be stopped, so
it is waited for, and the request's memory is released after it.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import numpy as np

from edged.datatypes import DataType, to_numpy
from edged.errors import DeadlineExceededError, EdgedError, InternalError, InvalidInputError
from edged.pipeline import custom_import
from edged.pipeline.contract import ANY, PipelineDefinitionError, Port, Step, StepInputError
from edged.pipeline.definition import WIDTHS_PORT, PipelineSpec, StepSpec

Tensors = dict[str, np.ndarray]
CustomFunction = Callable[[dict[str, np.ndarray], dict[str, Any]], Mapping[str, np.ndarray]]


class ModelCaller(Protocol):
    """Who answers a pipeline request's model steps: the inference service that started the request."""

    def call_model(self, model: str, version: int | None, inputs: Tensors, context: CallContext) -> Awaitable[Tensors]:
        """One call through the model's scheduler, under the pipeline request's deadline and priority."""
        ...


@dataclass(frozen=True)
class CallContext:
    """What a pipeline request hands every model call it makes: who answers them (``models``), its
    deadline (``time.monotonic()``) and its request parameters that the scheduler reads (``priority``)."""

    deadline: float | None = None
    parameters: Mapping[str, Any] = field(default_factory=dict)
    models: ModelCaller | None = None


NO_CONTEXT = CallContext()


class ModelGateway(Protocol):
    """What compiling (and splitting a model step's batch) needs of the served models."""

    def model_ports(self, model: str, version: int | None) -> tuple[dict[str, Port], dict[str, Port]]:
        """The model's input and output ports; PipelineDefinitionError when it is not served."""
        ...

    def max_batch_size(self, model: str, version: int | None) -> int:
        """The most rows one call may carry (0: the model has no batch dimension)."""
        ...

    def model_metadata(self, model: str, version: int | None) -> Mapping[str, str]:
        """The key/value metadata the model's file carries (ONNX ``metadata_props``)."""
        ...



def _port(datatype: DataType, shape: list[int]) -> Port:
    return Port(datatype, tuple(shape))


def _describe(port: Port) -> str:
    return f"{port.datatype}{list(port.shape)}"


Runner = Callable[[Tensors, CallContext], Awaitable[Tensors]]


@dataclass
class _Node:
    spec: StepSpec
    reads: dict[str, str]  # port -> tensor
    writes: dict[str, str]  # port -> tensor
    runner: Runner = field(repr=False)


def _load_custom(folder: Path, spec: StepSpec, modules: dict[str, ModuleType], root: str) -> CustomFunction:
    """Import ``module:function`` from the version folder only (never from sys.path), as a module of
    the folder's private package ``root`` (its relative imports reach the folder's listed files).

    A module is imported once per pipeline, so its steps share its state."""
    assert spec.function is not None
    module_name, _, func_name = spec.function.partition(":")
    module = modules.get(module_name)
    if module is None:
        module = _import_custom(folder, spec, module_name, root)
        modules[module_name] = module
    func = getattr(module, func_name, None)
    if not callable(func):
        raise PipelineDefinitionError(f"step {spec.name!r}: {module_name}.py has no function {func_name!r}",
                                      step=spec.name)
    return func  # type: ignore[no-any-return]


def _import_custom(folder: Path, spec: StepSpec, module_name: str, root: str) -> ModuleType:
    path = folder / f"{module_name}.py"
    if not path.is_file():
        raise PipelineDefinitionError(f"step {spec.name!r}: module file {path.name!r} is not in the version folder",
                                      step=spec.name)
    try:
        return custom_import.import_step_module(root, module_name)
    except Exception as exc:  # a broken custom module refuses this pipeline only
        raise PipelineDefinitionError(f"step {spec.name!r}: importing {path.name!r} failed: "
                                      f"{type(exc).__name__}: {exc}", step=spec.name) from None


def _check_custom_result(spec: StepSpec, result: object, ports: dict[str, Port]) -> Tensors:
    if not isinstance(result, Mapping):
        raise InternalError(f"custom step {spec.name!r} returned {type(result).__name__}, not a dict of arrays",
                            step=spec.name)
    out: Tensors = {}
    for name, port in ports.items():
        value = result.get(name)
        if not isinstance(value, np.ndarray):
            raise InternalError(f"custom step {spec.name!r}: output {name!r} missing or not a numpy array",
                                step=spec.name)
        if value.dtype != to_numpy(port.datatype) or len(value.shape) != len(port.shape) or not all(
                d in (-1, v) for d, v in zip(port.shape, value.shape, strict=True)):
            raise InternalError(f"custom step {spec.name!r}: output {name!r} is {value.dtype}{list(value.shape)}, "
                                f"declared {_describe(port)}", step=spec.name)
        out[name] = value
    return out


class PipelineStats:
    """Requests through the whole pipeline (its models keep their own statistics); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.success_count = 0
        self.failure_count = 0
        self.success_ns = 0  # summed monotonic latency of successful requests

    def record(self, ok: bool, ns: int) -> None:
        with self._lock:
            if ok:
                self.success_count += 1
                self.success_ns += ns
            else:
                self.failure_count += 1

    def to_json(self) -> dict[str, int]:
        with self._lock:
            return {"success_count": self.success_count, "failure_count": self.failure_count,
                    "success_ns": self.success_ns}


class Pipeline:
    """A compiled pipeline: its ports and its steps in a checked order."""

    def __init__(self, spec: PipelineSpec, inputs: dict[str, Port], outputs: dict[str, Port],
                 nodes: list[_Node], models: list[tuple[str, int | None]], *, notes: list[str] | None = None,
                 name: str = "") -> None:
        self.spec = spec
        self.name = name  # the model name it is served under (errors name it)
        self.inputs = inputs
        self.outputs = outputs
        self.nodes = nodes  # topological order
        self.models = models  # the models this pipeline depends on (load order, unload checks)
        self.notes = notes or []  # said at load (log, `models list`): e.g. a fan-out larger than a model's batch
        self.stats = PipelineStats()

    async def run(self, inputs: Mapping[str, np.ndarray], context: CallContext = NO_CONTEXT) -> Tensors:
        """Run one request; bad data raises an InvalidInputError naming the input at fault."""
        start = time.monotonic_ns()
        ok = False
        try:
            out = await self._run(inputs, context)
            ok = True
            return out
        finally:
            self.stats.record(ok, time.monotonic_ns() - start)

    async def _run(self, inputs: Mapping[str, np.ndarray], context: CallContext) -> Tensors:
        tensors: dict[str, asyncio.Future[np.ndarray]] = {}
        loop = asyncio.get_running_loop()
        for name, port in self.inputs.items():
            value = inputs.get(name)
            if value is None:
                raise InvalidInputError(f"pipeline input {name!r} is missing", input=name)
            if value.dtype != to_numpy(port.datatype) or not port.accepts(Port(port.datatype, value.shape)):
                raise InvalidInputError(f"pipeline input {name!r} is {value.dtype}{list(value.shape)}, "
                                        f"expected {_describe(port)}", input=name)
            tensors[name] = loop.create_future()
            tensors[name].set_result(value)
        extra = sorted(set(inputs) - set(self.inputs))
        if extra:
            raise InvalidInputError(f"pipeline has no input(s) {extra}; inputs: {sorted(self.inputs)}")
        for node in self.nodes:
            for tensor in node.writes.values():
                tensors[tensor] = loop.create_future()

        async def run_node(node: _Node) -> None:
            args = {port: await tensors[tensor] for port, tensor in node.reads.items()}
            self._check_deadline(context, node)
            produced = await node.runner(args, context)
            for port, tensor in node.writes.items():
                tensors[tensor].set_result(produced[port])

        tasks = [asyncio.ensure_future(run_node(node)) for node in self.nodes]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            # Every step ends before the request does, a step in a worker thread included (_in_thread):
            # only then is the request's memory released.
            await _call_off(tasks)
            for fut in tensors.values():  # futures nobody will await: no "never retrieved" noise
                if not fut.done():
                    fut.cancel()
            raise
        return {name: tensors[name].result() for name in self.outputs}

    def _check_deadline(self, context: CallContext, node: _Node) -> None:
        """Refuse to start ``node`` once the request's deadline has passed (the error model calls raise).

        Only model calls checked it before, so a chain of CPU steps (decode, resize, normalize,
        postprocessing) answered long after its caller had given up. A step already running is not
        interrupted (a worker thread cannot be stopped): the request fails before the next step."""
        deadline = context.deadline
        if deadline is None:
            return
        late_ms = (time.monotonic() - deadline) * 1e3
        if late_ms > 0:
            raise DeadlineExceededError(f"pipeline {self.name!r}: the request's deadline passed {late_ms:.1f} ms "
                                        f"ago, before step {node.spec.name!r} started", step=node.spec.name)


async def _call_off(tasks: Sequence[asyncio.Future[Any]]) -> None:
    """Cancel ``tasks`` and wait until every one has ended. A second cancellation (shutdown) while
    waiting changes nothing: what called them off is ending already. Their errors are not the
    caller's (it has its own): retrieved, so nothing says they were never retrieved."""
    for task in tasks:
        task.cancel()
    while not all(task.done() for task in tasks):
        try:
            await asyncio.wait(tasks)
        except asyncio.CancelledError:
            continue
    for task in tasks:
        if not task.cancelled():
            task.exception()


async def _all_calls(calls: list[Awaitable[Tensors]]) -> list[Tensors]:
    """The answers of a model step's calls (its chunks), in order. When one fails, the others are
    called off (dropped from the model's queue) before the failure is passed on, not left to run on
    the model for a request that has failed."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        await _call_off(tasks)
        raise


async def _in_thread(func: Callable[[Tensors], Tensors], args: Tensors) -> Tensors:
    """``func(args)`` in a worker thread (the request's context, so its steps charge its reservation).

    A thread cannot be stopped. When the request ends first (its caller cancelled it, another step
    failed), this waits for the thread to return before passing the cancellation on, so the request
    releases its memory only once nothing of it runs: a step charging after the release would grow
    a reservation nothing releases again, and what the step still allocates would not be counted."""
    work = asyncio.ensure_future(asyncio.to_thread(func, args))
    cancelled = False
    while not work.done():
        try:
            await asyncio.wait({work})
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        if not work.cancelled():
            work.exception()  # the request is cancelled: what the step ended with is nobody's answer
        raise asyncio.CancelledError
    return work.result()


def _builtin_node(spec: StepSpec, folder: Path, ports: dict[str, Port], lookup: Callable[[str], type[Step]],
                  gateway: ModelGateway | None) -> tuple[Runner, dict[str, Port], int | None]:
    assert spec.kind is not None
    cls = lookup(spec.kind)
    try:
        params = cls.Params.model_validate(spec.params)
    except ValueError as exc:
        raise PipelineDefinitionError(f"params: {exc}") from None
    step = cls(params, folder)
    use_models = getattr(step, "use_models", None)  # a step that reads a model's metadata (ctc_decode)
    if callable(use_models):
        if gateway is None:
            raise PipelineDefinitionError("no models are served here to read metadata from")
        use_models(lambda model: gateway.model_metadata(model, None))
    bound = step.bind(ports)
    fan_out = getattr(step, "fan_out", None)  # the most rows a fan-out step (crop_boxes) may emit

    async def run(args: Tensors, context: CallContext) -> Tensors:
        return await _in_thread(step.run, args)
    return run, bound, fan_out if isinstance(fan_out, int) else None


def _chunks(args: Tensors, size: int) -> list[Tensors]:
    """``args`` split along the leading (batch) dimension into pieces of at most ``size`` rows."""
    rows = next(iter(args.values())).shape[0]
    return [{name: value[i:i + size] for name, value in args.items()} for i in range(0, rows, size)]


def _width_chunks(args: Tensors, widths: np.ndarray, limit: int) -> list[Tensors]:
    """Runs of consecutive rows of one width (at most ``limit`` rows, when > 0), every input of rank >= 3
    cut to that width along its last axis."""
    out: list[Tensors] = []
    values = widths.tolist()
    start = 0
    while start < len(values):
        end = start + 1
        while end < len(values) and values[end] == values[start] and (limit <= 0 or end - start < limit):
            end += 1
        width = max(1, int(values[start]))
        out.append({name: np.ascontiguousarray(a[start:end, ..., :width]) if a.ndim >= 3 else a[start:end]
                    for name, a in args.items()})
        start = end
    return out


def _join_padded(parts: list[Tensors]) -> Tensors:
    """The chunks' outputs joined along the rows, each zero-padded at the end of any axis where the
    chunks differ (a recognizer's time steps follow its input width; zeros decode as CTC blanks)."""
    joined: Tensors = {}
    for name in parts[0]:
        pieces = [p[name] for p in parts]
        if len({x.shape[1:] for x in pieces}) > 1:
            shape = tuple(max(x.shape[k] for x in pieces) for k in range(1, pieces[0].ndim))
            padded = []
            for x in pieces:
                canvas = np.zeros((x.shape[0], *shape), dtype=x.dtype)
                canvas[tuple(slice(0, d) for d in x.shape)] = x
                padded.append(canvas)
            pieces = padded
        joined[name] = np.concatenate(pieces)
    return joined


def _model_node(spec: StepSpec, ports: dict[str, Port], gateway: ModelGateway | None
                ) -> tuple[Runner, dict[str, Port]]:
    assert spec.model is not None
    if gateway is None:
        raise PipelineDefinitionError(f"model {spec.model!r}: no models are served here")
    model_in, model_out = gateway.model_ports(spec.model, spec.version)
    for port_name in model_in:
        if port_name not in ports:
            raise PipelineDefinitionError(f"model {spec.model!r} input {port_name!r} is not wired "
                                          f"(wired: {sorted(ports) or 'none'})")
    for port_name, got in ports.items():
        expected = model_in.get(port_name)
        if expected is None:
            raise PipelineDefinitionError(f"model {spec.model!r} has no input {port_name!r} "
                                          f"(inputs: {sorted(model_in)})")
        if not expected.accepts(got):
            raise PipelineDefinitionError(f"model {spec.model!r} input {port_name!r} takes {_describe(expected)}, "
                                          f"gets {_describe(got)}")
    model, version = spec.model, spec.version
    # A fan-out that found nothing feeds the model a batch of 0: no engine call, empty outputs
    # (every output batched along the same leading dimension, so their shapes are known).
    batched = (*model_in.values(), *model_out.values())
    skippable = bool(model_in) and all(p.shape and p.shape[0] == ANY for p in batched)
    empty = {name: np.empty((0, *(max(d, 0) for d in p.shape[1:])), dtype=to_numpy(p.datatype))
             for name, p in model_out.items()}

    async def run(args: Tensors, context: CallContext) -> Tensors:
        widths = args.pop(WIDTHS_PORT, None)
        if skippable and args and all(a.ndim > 0 and a.shape[0] == 0 for a in args.values()):
            return {name: value.copy() for name, value in empty.items()}
        models = context.models
        if models is None:
            raise InternalError(f"model step {spec.name!r}: pipelines call models only through an InferenceService")
        limit = gateway.max_batch_size(model, version) if skippable else 0
        rows = {a.shape[0] for a in args.values() if a.ndim > 0}
        if widths is not None:
            if not skippable or len(rows) != 1 or widths.shape != (next(iter(rows)),):
                raise StepInputError(f"model step {spec.name!r}: widths {list(widths.shape)} does not match "
                                     f"its inputs' rows {sorted(rows)}", input=spec.widths or "")
            parts = await _all_calls([models.call_model(model, version, part, context)
                                      for part in _width_chunks(args, widths, limit)])
            return _join_padded(parts)
        if limit <= 0 or len(rows) != 1 or rows.pop() <= limit:
            return await models.call_model(model, version, args, context)
        # More rows than one call may carry: chunks of max_batch_size, all submitted at once so the
        # model's scheduler runs them (and other requests' rows) as it would any queued requests.
        parts = await _all_calls([models.call_model(model, version, part, context)
                                  for part in _chunks(args, limit)])
        return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
    return run, model_out


def _custom_node(spec: StepSpec, folder: Path, modules: dict[str, ModuleType], root: str
                 ) -> tuple[Runner, dict[str, Port]]:
    func = _load_custom(folder, spec, modules, root)
    declared = {name: _port(p.datatype, p.shape) for name, p in spec.output_ports.items()}
    params = dict(spec.params)

    def call(args: Tensors) -> Tensors:
        try:
            result = func(dict(args), dict(params))
        except EdgedError:
            raise
        except Exception as exc:  # contained: the request fails, the daemon serves on
            raise InternalError(f"custom step {spec.name!r} failed: {type(exc).__name__}: {exc}",
                                step=spec.name) from exc
        return _check_custom_result(spec, result, declared)

    async def run(args: Tensors, context: CallContext) -> Tensors:
        return await _in_thread(call, args)
    return run, declared


def _order(spec: PipelineSpec) -> list[StepSpec]:
    """Steps in dependency order; refuses duplicates, unknown tensors, double producers and cycles."""
    producer: dict[str, str] = {t.name: "(pipeline input)" for t in spec.inputs}
    names: set[str] = set()
    for step in spec.steps:
        if step.name in names:
            raise PipelineDefinitionError(f"two steps are named {step.name!r}", step=step.name)
        names.add(step.name)
        for tensor in step.outputs.values():
            if tensor in producer:
                raise PipelineDefinitionError(f"step {step.name!r}: tensor {tensor!r} is already produced by "
                                              f"{producer[tensor]}", step=step.name, tensor=tensor)
            producer[tensor] = f"step {step.name!r}"
    for step in spec.steps:
        for port, tensor in step.reads().items():
            if tensor not in producer:
                raise PipelineDefinitionError(f"step {step.name!r}: input {port!r} reads tensor {tensor!r}, "
                                              "which no pipeline input or step produces", step=step.name,
                                              tensor=tensor)
    for out in spec.outputs:
        if out.name not in producer:
            raise PipelineDefinitionError(f"pipeline output {out.name!r}: no step produces tensor {out.name!r}",
                                          tensor=out.name)
    available = {t.name for t in spec.inputs}
    pending = list(spec.steps)
    ordered: list[StepSpec] = []
    while pending:
        ready = [s for s in pending if set(s.reads().values()) <= available]
        if not ready:
            cycle = ", ".join(f"{s.name!r} (waits for {sorted(set(s.reads().values()) - available)})"
                              for s in pending)
            raise PipelineDefinitionError(f"the steps form a cycle: {cycle}", step=pending[0].name)
        for s in ready:
            ordered.append(s)
            available.update(s.outputs.values())
        pending = [s for s in pending if s not in ready]
    read = {t for step in spec.steps for t in step.reads().values()} | {o.name for o in spec.outputs}
    for inp in spec.inputs:
        if inp.name not in read:
            raise PipelineDefinitionError(f"pipeline input {inp.name!r}: no step reads tensor {inp.name!r}",
                                          tensor=inp.name)
    return ordered


def _check_widths(step: StepSpec, ports: dict[str, Port]) -> None:
    """A model step's ``widths`` tensor, when it names one, is a 1-D INT32 or INT64 vector."""
    if step.widths is None:
        return
    got = ports[step.widths]
    if got.datatype not in ("INT32", "INT64") or len(got.shape) != 1:
        raise PipelineDefinitionError(f"widths {step.widths!r} is {_describe(got)}, expected INT32 or INT64 [M]")

def compile_pipeline(spec: PipelineSpec, folder: Path, gateway: ModelGateway | None = None, *,
                     lookup: Callable[[str], type[Step]] | None = None, name: str | None = None) -> Pipeline:
    """Check the wiring and bind every step; PipelineDefinitionError names the step and the tensor.

    ``name``: what the pipeline is served as; by default its model folder's (``folder`` is the
    version folder, ``<repository>/<name>/<version>``)."""
    if lookup is None:
        from edged.pipeline.steps import builtin_step
        lookup = builtin_step
    ordered = _order(spec)
    ports: dict[str, Port] = {t.name: _port(t.datatype, t.shape) for t in spec.inputs}
    nodes: list[_Node] = []
    models: list[tuple[str, int | None]] = []
    modules: dict[str, ModuleType] = {}
    # Custom modules are imported afresh under the folder's private package, reaching its listed files.
    root = (custom_import.open_folder(folder, {f.file: f.sha256 for f in spec.files})
            if any(step.function is not None for step in spec.steps) else "")
    notes: list[str] = []
    # The most rows each tensor may hold, where a fan-out step declares it (crop_boxes' max_crops);
    # carried through the steps after it, so a model step can say when it will split the batch.
    fan_out: dict[str, tuple[int, str]] = {}
    for step in ordered:
        wired = {port: ports[tensor] for port, tensor in step.inputs.items()}
        where = ", ".join(f"{p} <- {t}" for p, t in step.inputs.items()) or "no inputs"
        upstream = max((fan_out[t] for t in step.inputs.values() if t in fan_out), default=None)
        try:
            if step.kind is not None:
                runner, bound, emits = _builtin_node(step, folder, wired, lookup, gateway)
                if emits is not None:
                    upstream = (emits, f"step {step.name!r} ({step.kind}) emits up to {emits} rows")
            elif step.model is not None:
                _check_widths(step, ports)
                runner, bound = _model_node(step, wired, gateway)
                models.append((step.model, step.version))
                assert gateway is not None
                limit = gateway.max_batch_size(step.model, step.version)
                if upstream is not None and 0 < limit < upstream[0]:
                    notes.append(f"{upstream[1]} into model {step.model!r} (step {step.name!r}), whose "
                                 f"max_batch_size is {limit}: a request may be split into up to "
                                 f"{math.ceil(upstream[0] / limit)} calls of at most {limit}")
            else:
                runner, bound = _custom_node(step, folder, modules, root)
        except PipelineDefinitionError as exc:
            target = step.kind or step.model or step.function
            raise PipelineDefinitionError(f"step {step.name!r} ({target}; {where}): {exc.message}",
                                          step=step.name) from None
        for port, tensor in step.outputs.items():
            if port not in bound:
                raise PipelineDefinitionError(f"step {step.name!r}: has no output {port!r} for tensor {tensor!r} "
                                              f"(outputs: {sorted(bound)})", step=step.name, tensor=tensor)
            ports[tensor] = bound[port]
            if upstream is not None:
                fan_out[tensor] = upstream
        nodes.append(_Node(step, step.reads(), dict(step.outputs), runner))
    outputs: dict[str, Port] = {}
    for out in spec.outputs:
        declared = _port(out.datatype, out.shape)
        if not declared.accepts(ports[out.name]):
            raise PipelineDefinitionError(f"pipeline output {out.name!r} is declared {_describe(declared)}, "
                                          f"but tensor {out.name!r} is {_describe(ports[out.name])}",
                                          tensor=out.name)
        outputs[out.name] = declared
    inputs = {t.name: _port(t.datatype, t.shape) for t in spec.inputs}
    return Pipeline(spec, inputs, outputs, nodes, models, notes=notes,
                    name=folder.parent.name if name is None else name)


__all__ = ["CallContext", "ModelCaller", "ModelGateway", "Pipeline", "StepInputError", "compile_pipeline"]
