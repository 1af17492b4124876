"""The FP32 model's inputs and outputs, read from the ONNX graph, and its batch convention.

ONNX Runtime (a core dependency) reads the graph, so inspecting a model needs
none of the optional quantization libraries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edged import datatypes
from edged.errors import EdgedError
from edged.optimize.errors import OptimizeInputError
from edged.repository.manifest import TensorSpec

DEFAULT_MAX_BATCH = 64


@dataclass(frozen=True)
class Tensor:
    """A graph tensor with its full shape (batch dimension included); -1 marks a dynamic dimension."""

    name: str
    datatype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ModelIO:
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]
    max_batch_size: int

    @property
    def batched(self) -> bool:
        return self.max_batch_size > 0

    def sample_shape(self, t: Tensor) -> tuple[int, ...]:
        """One sample's shape: without the batch dimension when the model batches."""
        return t.shape[1:] if self.batched else t.shape

    def specs(self, tensors: Sequence[Tensor]) -> list[TensorSpec]:
        """Manifest entries, Triton style (no batch dimension when ``max_batch_size > 0``)."""
        return [TensorSpec(name=t.name, datatype=t.datatype, shape=list(self.sample_shape(t)))
                for t in tensors]


def _dims(shape: Sequence[Any]) -> tuple[int, ...]:
    return tuple(d if isinstance(d, int) and d > 0 else -1 for d in shape)


def _tensor(node: Any, where: str) -> Tensor:
    try:
        dt = datatypes.from_engine(str(node.type))
    except EdgedError:
        raise OptimizeInputError(f"{where}: tensor {node.name!r} has type {node.type}, which edged cannot "
                                 "serve") from None
    return Tensor(node.name, dt, _dims(node.shape))


def inspect_onnx(path: Path, max_batch_size: int | None) -> ModelIO:
    """Read I/O from ``path``; ``max_batch_size`` None picks the default from the batch dimension.

    A dynamic leading dimension on every input means the model batches (default
    ``DEFAULT_MAX_BATCH``); a static one means it does not (``max_batch_size = 0``,
    shapes written in full), and asking for batching then is an error.
    """
    import onnxruntime as ort

    from edged.backends.onnxruntime import session_options

    opts = session_options()
    opts.log_severity_level = 3
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        sess = ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])
    except Exception as e:  # ORT raises its own exception types
        raise OptimizeInputError(f"{path.name}: not a model ONNX Runtime can load: {e}") from None
    inputs = tuple(_tensor(i, path.name) for i in sess.get_inputs())
    outputs = tuple(_tensor(o, path.name) for o in sess.get_outputs())
    if not inputs or not outputs:
        raise OptimizeInputError(f"{path.name}: the graph has no inputs or no outputs")
    dynamic_batch = all(t.shape and t.shape[0] == -1 for t in inputs)
    if max_batch_size is None:
        max_batch_size = DEFAULT_MAX_BATCH if dynamic_batch else 0
    if max_batch_size < 0:
        raise OptimizeInputError(f"--max-batch-size must be >= 0, not {max_batch_size}")
    if max_batch_size > 0 and not dynamic_batch:
        fixed = [f"{t.name} {list(t.shape)}" for t in inputs if not t.shape or t.shape[0] != -1]
        raise OptimizeInputError(f"{path.name}: --max-batch-size {max_batch_size} needs a dynamic first "
                                 f"dimension on every input, but these are fixed: {', '.join(fixed)}")
    if max_batch_size > 0:
        bad = [o.name for o in outputs if not o.shape]
        if bad:
            raise OptimizeInputError(f"{path.name}: outputs {bad} have no batch dimension; use --max-batch-size 0")
    return ModelIO(inputs, outputs, max_batch_size)
