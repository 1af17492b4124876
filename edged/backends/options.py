"""Each engine's typed ``options`` (a profile line's ``options = {...}``), read by its backend as is.

Validated once from the profile and carried typed to the backend's ``load``; a key the engine does not
know is refused when the profile loads, not ignored when the model does. Pydantic only: importing
this never imports an engine library.
"""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, ConfigDict

OptionsT = TypeVar("OptionsT", bound="BackendOptions")


class BackendOptions(BaseModel):
    """The common base; an empty instance of it means "this engine's defaults"."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @classmethod
    def of(cls: type[OptionsT], options: BackendOptions) -> OptionsT:
        """``options`` as this engine's model: its own instance as is, the bare base as the defaults.

        Options of another engine are a programming error (the loader pairs each with its backend).
        """
        if isinstance(options, cls):
            return options
        if type(options) is BackendOptions:
            return cls()
        raise TypeError(f"{type(options).__name__} given where {cls.__name__} is wanted")

    def as_text(self) -> dict[str, str]:
        """The options the profile set, as text (what cache keys and reports record)."""
        return {k: str(v) for k, v in sorted(self.model_dump(exclude_unset=True).items())}


class TensorRtOptions(BackendOptions):
    """``options`` of a ``tensorrt`` backend (read by :mod:`edged.backends.tensorrt`)."""

    dla_core: int | None = None
    gpu_fallback: bool = True
    workspace_mb: float | None = None
    gpu_id: int = 0
    opt_batch_size: int | None = None
    engine_worker: str | None = None  # set from the JetPack matrix when the engine runs under the system Python
    worker_timeout_s: float | None = None


class OnnxRuntimeOptions(BackendOptions):
    """``options`` of an ``onnxruntime`` backend (read by :mod:`edged.backends.onnxruntime`)."""

    providers: list[str] | None = None
    intra_op_threads: int | None = None


class OpenVinoOptions(BackendOptions):
    """``options`` of an ``openvino`` backend (read by :mod:`edged.backends.openvino`)."""

    hint: str | None = None
    threads: int | None = None
    inference_precision: str | None = None
    num_streams: int | str | None = None
    cache: bool = True
    static_batch: int | None = None
