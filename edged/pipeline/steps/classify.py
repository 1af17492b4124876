"""Output steps for classifiers: softmax, top-k with a labels file, threshold.

Results are named tensors and, for top-k, one JSON document per item in a ``BYTES``
output (``json``): ``[{"index": 3, "label": "cat", "score": 0.91}, ...]``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from pydantic import Field

from edged.pipeline.contract import ANY, PipelineDefinitionError, Port
from edged.pipeline.steps._base import FLOATS, BuiltinStep, Labels, StepParams


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Softmax in FP32, stable for large logits."""
    z: np.ndarray = x.astype(np.float32) - x.max(axis=axis, keepdims=True).astype(np.float32)
    np.exp(z, out=z)
    z /= z.sum(axis=axis, keepdims=True)
    return z


def bytes_array(items: list[bytes], shape: tuple[int, ...]) -> np.ndarray:
    out = np.empty(len(items), dtype=object)
    out[:] = items
    return out.reshape(shape)


class SoftmaxParams(StepParams):
    axis: int = -1


class Softmax(BuiltinStep):
    """logits -> probabilities (FP32, same shape)."""

    kind = "softmax"
    Params = SoftmaxParams
    params: SoftmaxParams

    def bind(self, inputs: Mapping[str, Port]) -> dict[str, Port]:
        port = self.port(inputs, "logits", FLOATS)
        if not -len(port.shape) <= self.params.axis < len(port.shape):
            raise PipelineDefinitionError(f"step 'softmax': axis {self.params.axis} is outside {list(port.shape)}")
        return {"probabilities": Port("FP32", port.shape)}

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"probabilities": softmax(self.array(inputs, "logits"), self.params.axis)}


class TopKParams(StepParams):
    """``k`` best classes per item; ``labels``: a file in the version folder (JSON list or one per line)."""

    k: int = Field(default=5, gt=0, le=1000)
    labels: str | None = None


class TopK(BuiltinStep):
    """scores [N,C] -> indices INT64 [N,k], scores FP32 [N,k], labels BYTES [N,k], json BYTES [N]."""

    kind = "topk"
    Params = TopKParams
    params: TopKParams

    def __init__(self, params: Any, folder: Path) -> None:
        super().__init__(params, folder)
        self.labels = Labels(folder, self.params.labels, self.kind)

    def bind(self, inputs: Mapping[str, Port]) -> dict[str, Port]:
        port = self.port(inputs, "scores", FLOATS, rank=2)
        classes = port.shape[1]
        if classes != ANY and self.params.k > classes:
            raise PipelineDefinitionError(f"step 'topk': k={self.params.k} but input 'scores' has {classes} classes")
        self.labels.check(classes)
        n = port.shape[0]
        return {"indices": Port("INT64", (n, self.params.k)), "scores": Port("FP32", (n, self.params.k)),
                "labels": Port("BYTES", (n, self.params.k)), "json": Port("BYTES", (n,))}

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        scores = self.array(inputs, "scores", ndim=2)
        k = min(self.params.k, scores.shape[1])
        # stable: equal scores keep the lower index first, as a plain argsort on -scores does
        top = np.argsort(-scores, axis=1, kind="stable")[:, :k].astype(np.int64)
        values = np.take_along_axis(scores, top, axis=1).astype(np.float32)
        names = [[self.labels(int(i), "scores") for i in row] for row in top]
        docs = [orjson.dumps([{"index": int(i), "label": name, "score": float(s)}
                              for i, name, s in zip(row, row_names, vals, strict=True)])
                for row, row_names, vals in zip(top, names, values, strict=True)]
        labels = bytes_array([n.encode() for row in names for n in row], (len(scores), k))
        return {"indices": top, "scores": values, "labels": labels, "json": bytes_array(docs, (len(scores),))}


class ThresholdParams(StepParams):
    threshold: float
    above: bool = True  # keep values above (>=) the threshold, or below (<) it


class Threshold(BuiltinStep):
    """scores -> mask BOOL (same shape)."""

    kind = "threshold"
    Params = ThresholdParams
    params: ThresholdParams

    def bind(self, inputs: Mapping[str, Port]) -> dict[str, Port]:
        port = self.port(inputs, "scores", FLOATS)
        return {"mask": Port("BOOL", port.shape)}

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        scores = self.array(inputs, "scores")
        mask = scores >= self.params.threshold if self.params.above else scores < self.params.threshold
        return {"mask": mask}
