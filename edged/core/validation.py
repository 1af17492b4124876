"""Check a request against the model's declared tensors before any work is queued.

The common case (a request that is right) goes through a precomputed plan per model
version: no strings, dicts or sets are built per request. Anything the plan does not
accept at once goes through the full check, which says what is wrong and where.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edged import datatypes
from edged.core.model_versions import ModelVersion
from edged.errors import InvalidInputError
from edged.protocol.types import InferRequest
from edged.repository.manifest import TensorSpec


@dataclass(frozen=True)
class _Plan:
    names: frozenset[str]
    outputs: frozenset[str]  # the outputs a request may ask for
    # (name, numpy dtype, declared shape without the batch dimension, True if it has no dynamic
    # dimension); None: always the full check
    specs: tuple[tuple[str, np.dtype[np.generic], tuple[int, ...], bool], ...] | None
    max_batch_size: int


def _plan(mv: ModelVersion) -> _Plan:
    plan = mv.validation_plan
    if isinstance(plan, _Plan):
        return plan
    bounds = mv.manifest.warmup.shapes
    simple = all(s.datatype != "BYTES" for s in mv.inputs) and not any(
        b.min is not None or b.max is not None for b in (bounds or {}).values())
    specs = tuple((s.name, datatypes.to_numpy(s.datatype), tuple(s.shape), -1 not in s.shape)
                  for s in mv.inputs) if simple else None
    plan = _Plan(frozenset(s.name for s in mv.inputs), frozenset(s.name for s in mv.outputs), specs,
                 mv.max_batch_size)
    mv.validation_plan = plan
    return plan


def _accept(plan: _Plan, req: InferRequest) -> int:
    """The batch size when the request is plainly right, else 0 (then the full check runs)."""
    inputs = req.inputs
    if plan.specs is None or inputs.keys() != plan.names or (
            req.outputs is not None and not plan.outputs.issuperset(req.outputs)):
        return 0
    mbs = plan.max_batch_size
    batch = 0
    for name, dtype, want, fixed in plan.specs:
        arr = inputs[name]
        if type(arr) is not np.ndarray or (arr.dtype is not dtype and arr.dtype != dtype):  # `is`: the usual case
            return 0
        shape = arr.shape
        if mbs > 0:
            if len(shape) != len(want) + 1 or not 1 <= shape[0] <= mbs or (batch and shape[0] != batch):
                return 0
            batch = shape[0]
            dims = shape[1:]
        else:
            dims = shape
            if len(dims) != len(want):
                return 0
        if fixed:
            if dims != want:
                return 0
            continue
        for have, w in zip(dims, want, strict=True):
            if w not in (-1, have):
                return 0
    return batch or 1


def validate(mv: ModelVersion, req: InferRequest) -> int:
    """Raise InvalidInputError naming the tensor and what is wrong; return the batch size (1 if unbatched)."""
    return _accept(_plan(mv), req) or _validate_fully(mv, req)


def _check_datatype(where: str, name: str, arr: object, spec: TensorSpec, *, text: bool) -> None:
    """An input is a tensor of its declared datatype; a text model's strings are UTF-8."""
    if not isinstance(arr, np.ndarray):
        raise InvalidInputError(f"{where}: input {name!r} is not a tensor")
    got = datatypes.from_numpy(arr.dtype)
    if got != spec.datatype:
        raise InvalidInputError(f"{where}: input {name!r} has datatype {got}, expected {spec.datatype}")
    if got == "BYTES" and text:
        not_text = datatypes.utf8_error(arr)
        if not_text is not None:
            raise InvalidInputError(f"{where}: input {name!r} element {not_text[0]} is not UTF-8 text "
                                    f"({not_text[1]}); "
                                    f"this model's string tensors hold text")


def _batch_and_dims(mv: ModelVersion, where: str, name: str, spec: TensorSpec, shape: tuple[int, ...],
                    batch: int | None) -> tuple[int, tuple[int, ...]]:
    """A batched input's batch size (within 1..max_batch_size, the same as the inputs before it) and
    its other dimensions."""
    mbs = mv.max_batch_size
    if len(shape) != len(spec.shape) + 1:
        raise _shape_error(mv, name, shape, f"{where}: input {name!r} has shape {list(shape)}, expected "
                                            f"[batch, {_fmt(spec.shape)}] with batch <= {mbs}")
    b, dims = shape[0], shape[1:]
    if b > mbs:  # Triton's wording for it
        raise InvalidInputError(f"inference request batch-size must be <= {mbs} for '{mv.name}' "
                                f"({where}: input {name!r} batch size {b} is outside 1..{mbs})")
    if b < 1:
        raise _shape_error(mv, name, shape, f"{where}: input {name!r} batch size {b} is outside 1..{mbs}")
    if batch is not None and b != batch:
        raise InvalidInputError(f"{where}: inputs disagree on batch size ({batch} and {b})")
    return b, dims

def _validate_fully(mv: ModelVersion, req: InferRequest) -> int:
    where = f"model {mv.name!r} version {mv.version}"
    specs = {s.name: s for s in mv.inputs}
    unknown = sorted(set(req.inputs) - set(specs))
    if unknown:
        raise InvalidInputError(f"{where}: unknown input(s) {unknown}; expected {sorted(specs)}")
    missing = sorted(set(specs) - set(req.inputs))
    if missing:
        raise InvalidInputError(f"{where}: missing input(s) {missing}")
    mbs = mv.max_batch_size
    batch: int | None = None
    bounds = mv.manifest.warmup.shapes
    # Checked here, per request, not in the engine: one bad element must not fail a whole batch.
    text = mv.scheduler is not None and mv.scheduler.engine.takes_text
    for name, spec in specs.items():
        arr = req.inputs[name]
        _check_datatype(where, name, arr, spec, text=text)
        shape = arr.shape
        if mbs > 0:
            batch, dims = _batch_and_dims(mv, where, name, spec, shape, batch)
        else:
            dims = shape
            if len(dims) != len(spec.shape):
                raise _shape_error(mv, name, shape,
                                   f"{where}: input {name!r} has shape {list(shape)}, expected {spec.shape}")
        for i, (have, want) in enumerate(zip(dims, spec.shape, strict=True)):
            if want not in (-1, have):
                raise _shape_error(mv, name, shape,
                                   f"{where}: input {name!r} dimension {i + (1 if mbs > 0 else 0)} is {have}, "
                                   f"expected {want} (shape {list(shape)})")
        declared = bounds.get(name) if bounds else None
        if declared is not None and (declared.min is not None or declared.max is not None):
            _check_bounds(where, name, dims, declared.min, declared.max, skip=1 if mbs > 0 else 0)
    if req.outputs is not None:
        known = {s.name for s in mv.outputs}
        bad = sorted(set(req.outputs) - known)
        if bad:
            raise InvalidInputError(f"{where}: unknown output(s) {bad}; the model has {sorted(known)}")
    return batch or 1


def _check_bounds(where: str, name: str, dims: tuple[int, ...], lo: list[int] | None, hi: list[int] | None, *,
                  skip: int) -> None:
    """The declared [warmup.shapes] min/max hold on every engine alike (TensorRT and OpenVINO are built for them)."""
    for i, have in enumerate(dims):
        if lo is not None and i < len(lo) and have < lo[i]:
            raise InvalidInputError(f"{where}: input {name!r} dimension {i + skip} is {have}, below the declared "
                                    f"minimum {lo[i]} ([warmup.shapes.{name}] min = {lo})")
        if hi is not None and i < len(hi) and have > hi[i]:
            raise InvalidInputError(f"{where}: input {name!r} dimension {i + skip} is {have}, above the declared "
                                    f"maximum {hi[i]} ([warmup.shapes.{name}] max = {hi})")


def _shape_error(mv: ModelVersion, name: str, shape: tuple[int, ...], detail: str) -> InvalidInputError:
    """Triton's wording for a shape the model does not take (its full shape, -1 for the batch), then edged's."""
    spec = next(s for s in mv.inputs if s.name == name)
    full = ([-1] if mv.max_batch_size > 0 else []) + list(spec.shape)
    return InvalidInputError(f"unexpected shape for input '{name}' for model '{mv.name}'. Expected "
                             f"{_dims(full)}, got {_dims(shape)} ({detail})")


def _dims(shape: list[int] | tuple[int, ...]) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def _fmt(shape: list[int]) -> str:
    return ", ".join(str(d) for d in shape)
