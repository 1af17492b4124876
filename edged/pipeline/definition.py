"""The pipeline file (``pipeline.toml`` in a model version's folder), parsed strictly.

Only the shape of the file is checked here; the wiring (unknown tensors, cycles,
types between steps) is checked by :mod:`edged.pipeline.graph` when it compiles.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from edged.datatypes import DataType
from edged.errors import format_validation_error
from edged.pipeline.contract import PipelineDefinitionError
from edged.protocol.names import PIPELINE_NAME

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PIPELINE_FILE = PIPELINE_NAME
WIDTHS_PORT = "<widths>"  # the port under which a model step reads its ``widths`` tensor (never a model input)
MAX_PIPELINE_FILE = 1 << 20  # a pipeline file is a few kB; refuse anything absurd before parsing


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TensorSpec(_Strict):
    """A pipeline input or output (or a custom step's output port): name, v2 datatype, shape (-1 free)."""

    name: str = Field(min_length=1)
    datatype: DataType
    shape: list[int] = Field(min_length=1)

    @model_validator(mode="after")
    def _dims(self) -> TensorSpec:
        if any(d < -1 or d == 0 for d in self.shape):
            raise ValueError(f"tensor {self.name!r}: dimensions are positive or -1, got {self.shape}")
        return self


class PortSpec(_Strict):
    """The declared type of one output port of a custom Python step."""

    datatype: DataType
    shape: list[int] = Field(min_length=1)


class StepSpec(_Strict):
    """One step: exactly one of ``kind`` (built-in), ``model`` (a repository model) or
    ``function`` (``module:function`` in the version's folder). ``inputs`` maps the step's
    port names to pipeline tensor names, ``outputs`` likewise (Triton ensemble semantics)."""

    name: str = Field(min_length=1)
    kind: str | None = None
    model: str | None = None
    version: int | None = Field(default=None, ge=1)
    function: str | None = None
    inputs: dict[str, str] = Field(default_factory=dict)
    outputs: dict[str, str] = Field(min_length=1)
    params: dict[str, Any] = Field(default_factory=dict)
    output_ports: dict[str, PortSpec] = Field(default_factory=dict)
    # model steps: a tensor [M] giving each row's width along the last axis of the inputs (crop_boxes'
    # batch_widths); rows of one width run together, cut to it, and outputs are zero-padded back
    widths: str | None = None

    def reads(self) -> dict[str, str]:
        """Every tensor the step waits for, by port (``widths`` under its own key)."""
        return {**self.inputs, WIDTHS_PORT: self.widths} if self.widths is not None else dict(self.inputs)

    @model_validator(mode="after")
    def _one_target(self) -> StepSpec:
        targets = [t for t in (self.kind, self.model, self.function) if t is not None]
        if len(targets) != 1:
            raise ValueError(f"step {self.name!r}: give exactly one of kind, model or function")
        if self.version is not None and self.model is None:
            raise ValueError(f"step {self.name!r}: version applies to model steps only")
        if self.params and self.model is not None:
            raise ValueError(f"step {self.name!r}: a model step takes no params")
        if self.widths is not None and self.model is None:
            raise ValueError(f"step {self.name!r}: widths applies to model steps only")
        if self.function is not None:
            module, _, func = self.function.partition(":")
            if not module.isidentifier() or not func.isidentifier():
                raise ValueError(f"step {self.name!r}: function must be 'module:function', got {self.function!r}")
            missing = sorted(set(self.outputs) - set(self.output_ports))
            if missing:
                raise ValueError(f"step {self.name!r}: output_ports must declare the type of {missing}")
        elif self.output_ports:
            raise ValueError(f"step {self.name!r}: output_ports apply to function steps only")
        return self


class FileDigest(_Strict):
    """A file of the version folder a step reads (labels, character lists, custom modules), with its digest.

    Checked when the pipeline loads, like a model's variant files: a missing or changed
    file refuses the pipeline. Every such file must be listed (see ``files_read``).
    """

    file: str = Field(min_length=1)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class PipelineSpec(_Strict):
    description: str = ""
    files: list[FileDigest] = Field(default_factory=list)
    inputs: list[TensorSpec] = Field(min_length=1)
    outputs: list[TensorSpec] = Field(min_length=1)
    steps: list[StepSpec] = Field(min_length=1)


def parse_pipeline(text: str, *, source: str = PIPELINE_FILE) -> PipelineSpec:
    """Parse a pipeline file's text; PipelineDefinitionError says what is wrong and where."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PipelineDefinitionError(f"{source}: not valid TOML: {exc}", file=source) from None
    try:
        return PipelineSpec.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(format_validation_error(exc))
        raise PipelineDefinitionError(f"{source}: {problems}", file=source) from None


def load_pipeline(folder: Path) -> PipelineSpec:
    """Read ``pipeline.toml`` from a version folder, size checked before reading."""
    path = folder / PIPELINE_FILE
    try:
        size = path.stat().st_size
        if size > MAX_PIPELINE_FILE:
            raise PipelineDefinitionError(f"{PIPELINE_FILE}: {size} bytes, more than {MAX_PIPELINE_FILE}")
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PipelineDefinitionError(f"{PIPELINE_FILE}: cannot read: {exc}", file=str(path)) from None
    return parse_pipeline(text)


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def files_read(spec: PipelineSpec, folder: Path) -> dict[str, str]:
    """Files of ``folder`` the steps will read -> the step reading them: custom modules, and any
    string param naming a file there (labels, characters). Each must be listed in ``files``."""
    out: dict[str, str] = {}
    for step in spec.steps:
        if step.function is not None:
            out.setdefault(step.function.partition(":")[0] + ".py", step.name)
        for value in _strings(step.params):
            if value and "\x00" not in value and (folder / value).is_file():
                out.setdefault(value, step.name)
    return out
