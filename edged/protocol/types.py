"""Transport-neutral request and response objects: what every transport decodes into and encodes from."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from edged.membudget import Reservation


@dataclass(slots=True)
class InferRequest:
    model: str
    inputs: Mapping[str, np.ndarray]
    version: int | None = None
    outputs: list[str] | None = None  # None: all outputs
    id: str | None = None
    deadline: float | None = None  # time.monotonic() after which the request is dropped unstarted
    parameters: dict[str, Any] = field(default_factory=dict)
    # The request memory it holds (edged/membudget.py): the service releases it when the request ends.
    memory: Reservation | None = None
    # None: a client's request. Otherwise who inside the daemon sent it ("self-test", "watchdog"): such
    # requests are served like any other but counted apart (ModelStats.internal), never as requests served.
    source: str | None = None


@dataclass(slots=True)
class InferResponse:
    model: str
    version: int
    outputs: dict[str, np.ndarray]
    id: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
