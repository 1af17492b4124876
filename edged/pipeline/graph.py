"""A pipeline compiled from its definition: wiring checked at load, run as a DAG.

Compiling refuses, naming the step and the tensor: duplicate names, a tensor read
that nothing produces, a tensor produced twice, a cycle, a pipeline input nothing
reads, a pipeline output nothing produces, an unknown step kind or model, and any
type/shape mismatch (``Port.accepts``) between a producer and its consumer.

Running starts every step as soon as the tensors it reads exist, so independent
branches overlap. Built-in and custom steps run in a worker thread (they are CPU
work and must not block the event loop); model steps go through a ``ModelGateway``,
which is the daemon's scheduler, so concurrent requests batch in the model's own
dynamic batcher and a fan-out's crops reach the model as one batch.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import numpy as np

from edged.datatypes import DataType, to_numpy
from edged.errors import EdgedError, InternalError, InvalidInputError
from edged.pipeline.contract import ANY, PipelineDefinitionError, Port, Step, StepInputError
from edged.pipeline.definition import PipelineSpec, StepSpec

Tensors = dict[str, np.ndarray]
CustomFunction = Callable[[dict[str, np.ndarray], dict[str, Any]], Mapping[str, np.ndarray]]


class ModelGateway(Protocol):
    """What the graph needs of the repository and its scheduler."""

    def model_ports(self, model: str, version: int | None) -> tuple[dict[str, Port], dict[str, Port]]:
        """The model's input and output ports; PipelineDefinitionError when it is not served."""
        ...

    def infer(self, model: str, version: int | None, inputs: Tensors) -> Awaitable[Tensors]:
        """One call through the model's scheduler."""
        ...


def _port(datatype: DataType, shape: list[int]) -> Port:
    return Port(datatype, tuple(shape))


def _describe(port: Port) -> str:
    return f"{port.datatype}{list(port.shape)}"


@dataclass
class _Node:
    spec: StepSpec
    reads: dict[str, str]  # port -> tensor
    writes: dict[str, str]  # port -> tensor
    runner: Callable[[Tensors], Awaitable[Tensors]] = field(repr=False)


def _load_custom(folder: Path, spec: StepSpec, modules: dict[str, ModuleType]) -> CustomFunction:
    """Import ``module:function`` from the version folder only (never from sys.path).

    A module is imported once per pipeline, so its steps share its state."""
    assert spec.function is not None
    module_name, _, func_name = spec.function.partition(":")
    module = modules.get(module_name)
    if module is None:
        module = _import_custom(folder, spec, module_name)
        modules[module_name] = module
    func = getattr(module, func_name, None)
    if not callable(func):
        raise PipelineDefinitionError(f"step {spec.name!r}: {module_name}.py has no function {func_name!r}",
                                      step=spec.name)
    return func  # type: ignore[no-any-return]


def _import_custom(folder: Path, spec: StepSpec, module_name: str) -> ModuleType:
    path = folder / f"{module_name}.py"
    if not path.is_file():
        raise PipelineDefinitionError(f"step {spec.name!r}: module file {path.name!r} is not in the version folder",
                                      step=spec.name)
    unique = f"edged_pipeline_custom_{abs(hash((str(folder), module_name)))}_{module_name}"
    loader_spec = importlib.util.spec_from_file_location(unique, path)
    if loader_spec is None or loader_spec.loader is None:
        raise PipelineDefinitionError(f"step {spec.name!r}: cannot import {path.name!r}", step=spec.name)
    module = importlib.util.module_from_spec(loader_spec)
    try:
        loader_spec.loader.exec_module(module)
    except Exception as exc:  # a broken custom module refuses this pipeline only
        raise PipelineDefinitionError(f"step {spec.name!r}: importing {path.name!r} failed: "
                                      f"{type(exc).__name__}: {exc}", step=spec.name) from None
    finally:
        sys.modules.pop(unique, None)
    return module


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
                 nodes: list[_Node], models: list[tuple[str, int | None]]) -> None:
        self.spec = spec
        self.inputs = inputs
        self.outputs = outputs
        self.nodes = nodes  # topological order
        self.models = models  # the models this pipeline depends on (load order, unload checks)
        self.stats = PipelineStats()

    async def run(self, inputs: Mapping[str, np.ndarray]) -> Tensors:
        """Run one request; bad data raises an InvalidInputError naming the input at fault."""
        start = time.monotonic_ns()
        ok = False
        try:
            out = await self._run(inputs)
            ok = True
            return out
        finally:
            self.stats.record(ok, time.monotonic_ns() - start)

    async def _run(self, inputs: Mapping[str, np.ndarray]) -> Tensors:
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
            produced = await node.runner(args)
            for port, tensor in node.writes.items():
                tensors[tensor].set_result(produced[port])

        tasks = [asyncio.ensure_future(run_node(node)) for node in self.nodes]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for fut in tensors.values():  # futures nobody will await: no "never retrieved" noise
                if not fut.done():
                    fut.cancel()
            raise
        return {name: tensors[name].result() for name in self.outputs}


def _builtin_node(spec: StepSpec, folder: Path, ports: dict[str, Port],
                  lookup: Callable[[str], type[Step]]) -> tuple[Callable[[Tensors], Awaitable[Tensors]],
                                                                dict[str, Port]]:
    assert spec.kind is not None
    cls = lookup(spec.kind)
    try:
        params = cls.Params.model_validate(spec.params)
    except ValueError as exc:
        raise PipelineDefinitionError(f"params: {exc}") from None
    step = cls(params, folder)
    bound = step.bind(ports)

    async def run(args: Tensors) -> Tensors:
        return await asyncio.to_thread(step.run, args)
    return run, bound


def _model_node(spec: StepSpec, ports: dict[str, Port], gateway: ModelGateway | None
                ) -> tuple[Callable[[Tensors], Awaitable[Tensors]], dict[str, Port]]:
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

    async def run(args: Tensors) -> Tensors:
        if skippable and args and all(a.ndim > 0 and a.shape[0] == 0 for a in args.values()):
            return {name: value.copy() for name, value in empty.items()}
        return await gateway.infer(model, version, args)
    return run, model_out


def _custom_node(spec: StepSpec, folder: Path, modules: dict[str, ModuleType]
                 ) -> tuple[Callable[[Tensors], Awaitable[Tensors]], dict[str, Port]]:
    func = _load_custom(folder, spec, modules)
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

    async def run(args: Tensors) -> Tensors:
        return await asyncio.to_thread(call, args)
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
        for port, tensor in step.inputs.items():
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
        ready = [s for s in pending if set(s.inputs.values()) <= available]
        if not ready:
            cycle = ", ".join(f"{s.name!r} (waits for {sorted(set(s.inputs.values()) - available)})"
                              for s in pending)
            raise PipelineDefinitionError(f"the steps form a cycle: {cycle}", step=pending[0].name)
        for s in ready:
            ordered.append(s)
            available.update(s.outputs.values())
        pending = [s for s in pending if s not in ready]
    read = {t for step in spec.steps for t in step.inputs.values()} | {o.name for o in spec.outputs}
    for inp in spec.inputs:
        if inp.name not in read:
            raise PipelineDefinitionError(f"pipeline input {inp.name!r}: no step reads tensor {inp.name!r}",
                                          tensor=inp.name)
    return ordered


def compile_pipeline(spec: PipelineSpec, folder: Path, gateway: ModelGateway | None = None, *,
                     lookup: Callable[[str], type[Step]] | None = None) -> Pipeline:
    """Check the wiring and bind every step; PipelineDefinitionError names the step and the tensor."""
    if lookup is None:
        from edged.pipeline.steps import builtin_step
        lookup = builtin_step
    ordered = _order(spec)
    ports: dict[str, Port] = {t.name: _port(t.datatype, t.shape) for t in spec.inputs}
    nodes: list[_Node] = []
    models: list[tuple[str, int | None]] = []
    modules: dict[str, ModuleType] = {}
    for step in ordered:
        wired = {port: ports[tensor] for port, tensor in step.inputs.items()}
        where = ", ".join(f"{p} <- {t}" for p, t in step.inputs.items()) or "no inputs"
        try:
            if step.kind is not None:
                runner, bound = _builtin_node(step, folder, wired, lookup)
            elif step.model is not None:
                runner, bound = _model_node(step, wired, gateway)
                models.append((step.model, step.version))
            else:
                runner, bound = _custom_node(step, folder, modules)
        except PipelineDefinitionError as exc:
            target = step.kind or step.model or step.function
            raise PipelineDefinitionError(f"step {step.name!r} ({target}; {where}): {exc.message}",
                                          step=step.name) from None
        for port, tensor in step.outputs.items():
            if port not in bound:
                raise PipelineDefinitionError(f"step {step.name!r}: has no output {port!r} for tensor {tensor!r} "
                                              f"(outputs: {sorted(bound)})", step=step.name, tensor=tensor)
            ports[tensor] = bound[port]
        nodes.append(_Node(step, dict(step.inputs), dict(step.outputs), runner))
    outputs: dict[str, Port] = {}
    for out in spec.outputs:
        declared = _port(out.datatype, out.shape)
        if not declared.accepts(ports[out.name]):
            raise PipelineDefinitionError(f"pipeline output {out.name!r} is declared {_describe(declared)}, "
                                          f"but tensor {out.name!r} is {_describe(ports[out.name])}",
                                          tensor=out.name)
        outputs[out.name] = declared
    inputs = {t.name: _port(t.datatype, t.shape) for t in spec.inputs}
    return Pipeline(spec, inputs, outputs, nodes, models)


__all__ = ["ModelGateway", "Pipeline", "StepInputError", "compile_pipeline"]
