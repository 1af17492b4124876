"""The model manifest (``model.toml``) as pydantic models.

Shapes follow Triton: with ``max_batch_size > 0`` a shape excludes the batch
dimension; ``-1`` marks a dynamic dimension.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from edged.datatypes import DataType
from edged.errors import ManifestError, format_validation_error
from edged.protocol.names import MANIFEST_NAME

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


Format = Literal["onnx", "openvino", "tensorrt"]
Precision = Literal["fp32", "bf16", "fp16", "int8"]
Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$", description="lower-case hex sha256 of the file")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TensorSpec(_Strict):
    name: str = Field(description="tensor name as the model file knows it")
    datatype: DataType = Field(description="v2 datatype name")
    shape: list[Annotated[int, Field(ge=-1)]] = Field(
        description="dimensions without the batch dimension when max_batch_size > 0; -1 is dynamic")


class ArtifactFile(_Strict):
    file: str = Field(description="path relative to the version folder")
    sha256: Sha256

    @field_validator("file")
    @classmethod
    def _inside_version(cls, v: str) -> str:
        p = Path(v)
        if p.is_absolute() or ".." in p.parts or not v:
            raise ValueError("must be a relative path inside the version folder")
        return v


class VariantTiming(_Strict):
    batch_size: int = Field(ge=1)
    throughput_per_s: float = Field(ge=0, description="inferences (samples) per second measured on a device")
    latency_ms: float = Field(ge=0)
    device: str = Field(default="", description="where it was measured, e.g. 'x86_64 CPU'")


class Variant(ArtifactFile):
    format: Format = Field(description="onnx | openvino | tensorrt")
    precision: Precision = Field(
        default="fp32", description="fp32 | bf16 | fp16 | int8; bf16 is an FP32 file run with the engine's bf16 hint")
    extra_files: list[ArtifactFile] = Field(
        default_factory=list, description="more files the variant needs (e.g. OpenVINO's weights .bin)")
    accuracy: float | None = Field(default=None, description="held-out metric recorded when the variant was made")
    timings: list[VariantTiming] = Field(default_factory=list, description="speed measured by `edged optimize`")
    calibration_cache: str | None = Field(default=None, description="TensorRT INT8 calibration cache file")
    inference_precision: Literal["f32", "bf16", "f16"] | None = Field(
        default=None, description="OpenVINO: precision of the layers left in float (its INFERENCE_PRECISION_HINT), "
                                  "e.g. f32 for an INT8 model whose accuracy was validated so; a profile's option wins")


class Batching(_Strict):
    max_queue_delay_us: int = Field(default=0, ge=0, description="how long a request may wait for a batch to fill")
    preferred_batch_sizes: list[Annotated[int, Field(ge=1)]] = Field(default_factory=list)
    max_queue_size: int = Field(default=1024, ge=1, description="queued requests beyond this are refused")
    dynamic: bool = Field(default=True, description="false: each request runs alone, never combined with others")


class Instances(_Strict):
    count: int = Field(default=1, ge=1, le=64, description="engine copies that run concurrently")


Dims = list[Annotated[int, Field(ge=0)]]


class InputShape(_Strict):
    """The shapes one input really sees: drives warm-up, self-test, engine benchmark and engine shapes."""

    shape: Dims = Field(description="the usual shape (batch dimension excluded when max_batch_size > 0)")
    min: Dims | None = Field(default=None, description="smallest shape served (TensorRT profile minimum)")
    max: Dims | None = Field(default=None, description="largest shape served (TensorRT profile maximum)")
    value: float | None = Field(default=None, description="value made-up data is filled with (e.g. a sample rate)")

    @model_validator(mode="after")
    def _check(self) -> InputShape:
        for kind, dims in (("min", self.min), ("max", self.max)):
            if dims is not None and len(dims) != len(self.shape):
                raise ValueError(f"{kind} {dims} has another rank than shape {self.shape}")
        if self.min is not None and any(a > b for a, b in zip(self.min, self.shape, strict=True)):
            raise ValueError(f"min {self.min} is larger than shape {self.shape}")
        if self.max is not None and any(a < b for a, b in zip(self.max, self.shape, strict=True)):
            raise ValueError(f"max {self.max} is smaller than shape {self.shape}")
        return self


class Warmup(_Strict):
    file: str | None = Field(default=None, description=".npz with one array per input; generated when absent")
    expected: str | None = Field(default=None, description=".npz of expected outputs for a golden check")
    rtol: float = Field(default=1e-3, ge=0)
    atol: float = Field(default=1e-4, ge=0)
    shapes: dict[str, InputShape] = Field(
        default_factory=dict, description="per input name: the shapes it really sees, when no file is given")


class Evaluation(_Strict):
    """A labelled evaluation set shipped with the version.

    The device scores the new version on it at trial start, and the version it replaces on
    the same samples; the registry's quality gate compares the two (docs/rollout.md). A golden
    file only proves the model answers as it did when the file was made; this proves it
    answers right.
    """

    inputs: str = Field(description=".npz with one array per model input, samples on the first axis")
    labels: str = Field(description=".npy of integer class ids, one per sample")
    output: str | None = Field(default=None, description="the output whose argmax is the answer (default: the first)")
    metric: Literal["top1"] = "top1"


class ModelManifest(_Strict):
    description: str = ""
    max_batch_size: int = Field(default=0, ge=0, description="0: the model has no batch dimension")
    inputs: list[TensorSpec] | None = Field(default=None, description="read from the model file when omitted")
    outputs: list[TensorSpec] | None = None
    variants: list[Variant] = Field(min_length=1)
    batching: Batching | None = Field(
        default=None, description="dynamic batching; with max_batch_size > 0 and no section, on with the defaults")
    instances: Instances = Field(default_factory=Instances)
    warmup: Warmup = Field(default_factory=Warmup)
    labels: str | None = Field(default=None, description="text file with one class label per line")
    evaluation: Evaluation | None = Field(default=None, description="labelled evaluation set for the quality gate")
    memory_mb: float | None = Field(default=None, ge=0, description="expected resident memory, for admission")
    fetch: str | None = Field(
        default=None, description="the command that puts the model's files in place when they are not shipped "
                                  "with the manifest (public example models): their absence is then said at INFO")

    @model_validator(mode="after")
    def _check(self) -> ModelManifest:
        for kind, specs in (("inputs", self.inputs), ("outputs", self.outputs)):
            names = [s.name for s in specs or []]
            if len(names) != len(set(names)):
                raise ValueError(f"{kind} has duplicate names")
        if self.inputs is not None:
            by_name = {t.name: t for t in self.inputs}
            for name, shp in self.warmup.shapes.items():
                spec = by_name.get(name)
                if spec is None:
                    raise ValueError(f"warmup.shapes.{name}: no such input (inputs: {sorted(by_name)})")
                if len(spec.shape) != len(shp.shape) or any(
                        w not in (-1, h) for w, h in zip(spec.shape, shp.shape, strict=False)):
                    raise ValueError(f"warmup.shapes.{name}: shape {shp.shape} does not fit the input's "
                                     f"shape {spec.shape}")
        if self.batching and self.max_batch_size == 0:
            raise ValueError("batching needs max_batch_size > 0")
        if self.batching:
            too_big = [b for b in self.batching.preferred_batch_sizes if b > self.max_batch_size]
            if too_big:
                raise ValueError(f"preferred_batch_sizes {too_big} exceed max_batch_size {self.max_batch_size}")
        return self


def parse_manifest(path: Path, *, model: str = "", version: int | None = None) -> ModelManifest:
    """Read and validate one ``model.toml``; every problem names the model, version and file."""
    where = f"model {model!r} version {version} ({path.name})" if model else str(path)
    try:
        raw: dict[str, Any] = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ManifestError(f"{where}: no {MANIFEST_NAME}", model=model, version=version) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ManifestError(f"{where}: cannot read: {e}", model=model, version=version) from None
    except tomllib.TOMLDecodeError as e:
        raise ManifestError(f"{where}: not valid TOML: {e}", model=model, version=version) from None
    try:
        return ModelManifest.model_validate(raw)
    except ValidationError as e:
        problems = format_validation_error(e)
        raise ManifestError(f"{where}: " + "; ".join(problems), model=model, version=version) from None
