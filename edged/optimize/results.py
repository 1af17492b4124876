"""What ``edged optimize`` is asked for and what it found: options, one outcome per variant, the result.

Apart from the run itself (:mod:`edged.optimize.pipeline`) so that the report writer
(:mod:`edged.optimize.report`) reads them without importing the run that calls it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edged.optimize.gate import Metrics
from edged.optimize.modelio import ModelIO
from edged.optimize.recipes import DEFAULT_VARIANTS, Recipe
from edged.optimize.timing import Timing
from edged.repository.manifest import Variant

DEFAULT_BACKENDS = ("onnxruntime", "openvino")


@dataclass(frozen=True)
class OptimizeOptions:
    model: Path
    calibration: Path
    out: Path
    eval: Path | None = None
    labels: Path | None = None
    max_drop: float = 1.0
    max_abs_error: float | None = None
    calibration_method: str = "minmax"
    calibration_samples: int = 1000
    max_batch_size: int | None = None
    variants: tuple[str, ...] = DEFAULT_VARIANTS
    backends: tuple[str, ...] = DEFAULT_BACKENDS
    timing_budget_s: float = 1.0
    threads: int = 0
    metric_output: str | None = None
    metric: str = "top1"
    ctc_blank: int = 0
    score_threshold: float = 0.25
    accuracy_aware: bool = True
    accuracy_budget_s: float = 300.0
    description: str | None = None
    reduce_range: bool = True
    force: bool = False
    progress: bool = True


@dataclass
class Outcome:
    """What happened to one variant."""

    recipe: Recipe
    status: str = "built"  # reference | kept | left out | skipped | failed
    reasons: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    metrics: Metrics | None = None
    timings: dict[str, list[Timing]] = field(default_factory=dict)
    build_s: float = 0.0
    variant: Variant | None = None
    details: dict[str, Any] = field(default_factory=dict)  # quantization granularity, opsets, recovery
    execution: dict[str, str] = field(default_factory=dict)  # backend -> precision the engine reports running

    @property
    def kept(self) -> bool:
        return self.status in ("reference", "kept")


@dataclass
class OptimizeResult:
    out: Path
    name: str
    version: int
    model_io: ModelIO
    outcomes: list[Outcome]
    with_labels: bool
    eval_samples: int
    calibration_samples: int
    host: str
    notes: list[str] = field(default_factory=list)
    warmup_atol: float = 0.0
    metric: str = "top1"

    def outcome(self, key: str) -> Outcome:
        return next(o for o in self.outcomes if o.recipe.key == key)
