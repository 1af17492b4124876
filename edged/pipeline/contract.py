"""The contract between a pipeline's graph and its steps.

The graph (wiring, load-time checks, execution, transports) and the built-in steps
(decode, resize, normalize, NMS, CTC...) are written apart; this module is all
either side may assume of the other. A step sees one request at a time: the
leading dimension of every array is that request's own batch (images in a
``BYTES`` input of shape ``[N]``, crops after a fan-out). Batching *across*
requests happens only in model steps, through the model's own scheduler.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

import numpy as np
from pydantic import BaseModel

from edged.datatypes import DataType
from edged.errors import InvalidInputError, ManifestError

ANY = -1  # a dimension of any size


@dataclass(frozen=True)
class Port:
    """What one tensor between steps is: its v2 datatype and shape (``ANY`` for a free dimension).

    The shape includes the leading (per-request batch) dimension. Checked between
    steps when the pipeline loads, so a mis-wired pipeline never serves.
    """

    datatype: DataType
    shape: tuple[int, ...]

    def accepts(self, other: Port) -> bool:
        """Whether a tensor described by ``other`` may flow into a port described by ``self``."""
        if self.datatype != other.datatype or len(self.shape) != len(other.shape):
            return False
        return all(ANY in (a, b) or a == b for a, b in zip(self.shape, other.shape, strict=True))


class PipelineDefinitionError(ManifestError):
    """A pipeline is missing a step, mis-wired or mistyped: the message names the step and the tensor."""


class StepInputError(InvalidInputError):
    """A request's data cannot go through a step (a corrupt JPEG, a WAV with the wrong rate).

    The message names the pipeline input at fault; transports answer it as a bad
    request (HTTP 400, an MQTT error reply) and the daemon serves the next one.
    """


class Step(Protocol):
    """One built-in (or custom) processing step.

    ``kind`` is its name in the pipeline file; ``Params`` its options, a pydantic
    model with ``extra="forbid"`` so a typo is refused at load. ``folder`` is the
    model version's folder (labels files, character lists) and every file a step
    reads from it must be listed in the version's digests.
    """

    kind: ClassVar[str]
    Params: ClassVar[type[BaseModel]]

    def __init__(self, params: Any, folder: Path) -> None: ...

    def bind(self, inputs: Mapping[str, Port]) -> dict[str, Port]:
        """Check the ports wired into the step and describe its outputs; raise PipelineDefinitionError."""
        ...

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Process one request's tensors; raise StepInputError for data the step cannot take."""
        ...
