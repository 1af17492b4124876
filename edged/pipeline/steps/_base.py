"""What every built-in step shares: strict params, port checks, the lazy OpenCV import, label files."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict

from edged.datatypes import DataType
from edged.errors import MissingDependencyError
from edged.pipeline.contract import ANY, PipelineDefinitionError, Port, StepInputError

FLOATS: tuple[DataType, ...] = ("FP16", "FP32", "FP64")
PIXELS: tuple[DataType, ...] = ("UINT8", "FP32")


class StepParams(BaseModel):
    """Options of a step: unknown keys are refused so a typo fails at load."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class BuiltinStep:
    """Base of the built-ins: keeps params and folder, names itself in errors."""

    kind: ClassVar[str]
    Params: ClassVar[type[BaseModel]] = StepParams

    def __init__(self, params: Any, folder: Path) -> None:
        self.params = params if isinstance(params, self.Params) else self.Params.model_validate(params or {})
        self.folder = folder

    def port(self, inputs: Mapping[str, Port], name: str, datatypes: tuple[DataType, ...],
             rank: int | tuple[int, ...] | None = None) -> Port:
        """The port wired to input ``name``, checked for datatype and rank at load."""
        port = inputs.get(name)
        if port is None:
            raise PipelineDefinitionError(f"step {self.kind!r}: input {name!r} is not wired "
                                          f"(wired: {sorted(inputs) or 'none'})")
        if port.datatype not in datatypes:
            raise PipelineDefinitionError(f"step {self.kind!r}: input {name!r} is {port.datatype}, "
                                          f"expected {' or '.join(datatypes)}")
        ranks = (rank,) if isinstance(rank, int) else rank
        if ranks is not None and len(port.shape) not in ranks:
            raise PipelineDefinitionError(f"step {self.kind!r}: input {name!r} has shape {list(port.shape)}, "
                                          f"expected {' or '.join(str(r) for r in ranks)} dimensions")
        return port

    def array(self, inputs: Mapping[str, np.ndarray], name: str, *, ndim: int | None = None) -> np.ndarray:
        """Input ``name`` of one request, its rank checked (the graph checked types at load)."""
        try:
            value = inputs[name]
        except KeyError:
            raise StepInputError(f"step {self.kind!r}: input {name!r} missing", input=name) from None
        if ndim is not None and value.ndim != ndim:
            raise StepInputError(f"step {self.kind!r}: input {name!r} has shape {list(value.shape)}, "
                                 f"expected {ndim} dimensions", input=name)
        return value


def opencv() -> ModuleType:
    """OpenCV, imported on first use; its absence is explained (it is in the ``pipeline`` extra)."""
    try:
        import cv2
    except ImportError as exc:
        raise MissingDependencyError(
            "image pipeline steps need OpenCV: pip install 'edged[pipeline]' (opencv-python-headless)"
        ) from exc
    cv2.setNumThreads(1)  # steps run on the daemon's worker threads; OpenCV's own pool would oversubscribe
    return cv2


def read_labels(folder: Path, name: str, kind: str) -> list[str]:
    """A labels or character file in the model version's folder: a JSON list, or one entry per line."""
    path = folder / name
    if Path(name).is_absolute() or ".." in Path(name).parts:
        raise PipelineDefinitionError(f"step {kind!r}: labels file {name!r} must be inside the version folder")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise PipelineDefinitionError(f"step {kind!r}: cannot read labels file {name!r}: {exc.strerror}") from None
    if path.suffix == ".json":
        try:
            labels = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PipelineDefinitionError(f"step {kind!r}: labels file {name!r} is not JSON: {exc}") from None
        if not isinstance(labels, list) or not all(isinstance(x, str) for x in labels):
            raise PipelineDefinitionError(f"step {kind!r}: labels file {name!r} must be a JSON list of strings")
        return labels
    return text.splitlines()


class Labels:
    """Class names from an optional labels file; without one a class is named by its index."""

    def __init__(self, folder: Path, name: str | None, kind: str) -> None:
        self.file, self.kind = name, kind
        self.names = read_labels(folder, name, kind) if name else None

    def check(self, classes: int) -> None:
        """Refuse at load a labels file shorter than the model's class count."""
        if classes != ANY and self.names is not None and len(self.names) < classes:
            raise PipelineDefinitionError(f"step {self.kind!r}: labels file {self.file!r} has {len(self.names)} "
                                          f"labels for {classes} classes")

    def __call__(self, index: int, source: str) -> str:
        if self.names is None:
            return str(index)
        if not 0 <= index < len(self.names):
            raise StepInputError(f"step {self.kind!r}: class {index} has no label in {self.file!r}", input=source)
        return self.names[index]


def shape(*dims: int) -> tuple[int, ...]:
    return tuple(ANY if d < 0 else d for d in dims)


def as_bytes_list(value: np.ndarray, kind: str, name: str) -> list[bytes]:
    """The encoded items of a ``BYTES`` input ([N] or [N, 1]), as bytes."""
    items = value.reshape(-1) if value.ndim <= 2 else None
    if items is None or (value.ndim == 2 and value.shape[1] != 1):
        raise StepInputError(f"step {kind!r}: input {name!r} must be [N] or [N, 1] encoded items, "
                             f"got shape {list(value.shape)}", input=name)
    out: list[bytes] = []
    for i, item in enumerate(items):
        if isinstance(item, (bytes, bytearray, memoryview)):
            out.append(bytes(item))
        elif isinstance(item, np.ndarray) and item.dtype == np.uint8:
            out.append(item.tobytes())
        else:
            raise StepInputError(f"step {kind!r}: input {name!r}[{i}] is {type(item).__name__}, expected bytes",
                                 input=name)
    return out
