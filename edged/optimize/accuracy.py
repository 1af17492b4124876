"""Accuracy-aware INT8: when plain INT8 fails the gate, keep the layers that hurt accuracy in float.

Each engine's own mechanism is used:

* ONNX Runtime: the per-layer error of the plain QDQ model is measured against FP32 on a few
  calibration samples (relative L2 error of every node output, minus the worst error already on
  its inputs, so a layer is charged for the error it adds, not for what it inherits; layers that
  write the model's outputs come first). The worst layers are excluded from quantization
  (``nodes_to_exclude``), doubling their number each time; each try is quantized and gated like
  any variant, until one passes, only FP32 would be left, or the budget ends.
* OpenVINO: NNCF's ``quantize_with_accuracy_control`` with the evaluation set and the gate's metric;
  its log names the operations it reverted to floating point.

The budget is wall time on a monotonic clock; NNCF's validation function checks it before every
validation, which is where NNCF spends its time.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edged.optimize import deps
from edged.optimize.data import SampleSet
from edged.optimize.modelio import ModelIO

SENSITIVITY_SAMPLES = 8
NNCF_RANKING_ITEMS = 24
_QDQ = ("QuantizeLinear", "DequantizeLinear")


class BudgetExceededError(Exception):
    """The accuracy-aware search ran out of its time budget."""


@dataclass
class Recovery:
    """What an accuracy-aware search did; ``kept_float`` names the layers left in higher precision."""

    method: str
    passed: bool = False
    kept_float: list[str] = field(default_factory=list)
    quantized_layers: int = 0
    tries: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    stopped: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"method": self.method, "passed": self.passed, "kept_float": self.kept_float,
                "quantized_layers": self.quantized_layers, "tries": self.tries,
                "seconds": round(self.seconds, 2), "stopped": self.stopped}


# ---- ONNX Runtime: per-layer error, then exclusion ----------------------------------------------
def _session(model: Any) -> Any:
    import onnxruntime as ort

    from edged.backends.onnxruntime import session_options

    opts = session_options()
    opts.log_severity_level = 3
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # keep every tensor
    return ort.InferenceSession(model.SerializeToString(), sess_options=opts, providers=["CPUExecutionProvider"])


def _with_outputs(model: Any, names: Sequence[str]) -> Any:
    onnx = deps.onnx()
    m = onnx.ModelProto()
    m.CopyFrom(model)
    have = {o.name for o in m.graph.output}
    for n in names:
        if n not in have:
            m.graph.output.append(onnx.ValueInfoProto(name=n))
    return m


def quantized_nodes(int8_model: Any) -> list[Any]:
    """Nodes of a QDQ graph that take a dequantized input: the layers quantization touched."""
    producer = {o: n for n in int8_model.graph.node for o in n.output}
    return [n for n in int8_model.graph.node if n.op_type not in _QDQ and n.name
            and any(producer.get(i) is not None and producer[i].op_type == "DequantizeLinear" for i in n.input)]


def rank_layers(fp32: Path, int8: Path, samples: SampleSet, model_io: ModelIO) -> list[tuple[str, float]]:
    """Quantized layers by the relative error each adds (worst first), measured on a few samples."""
    onnx = deps.onnx()
    fm, qm = onnx.load(str(fp32)), onnx.load(str(int8))
    float_tensors = {o for n in fm.graph.node for o in n.output}
    producer = {o: n for n in qm.graph.node for o in n.output}

    def source(name: str) -> str | None:
        """The FP32 tensor a quantized input came from (through DequantizeLinear <- QuantizeLinear)."""
        seen = 0
        while name not in float_tensors and name in producer and producer[name].op_type in _QDQ and seen < 4:
            name, seen = producer[name].input[0], seen + 1
        return name if name in float_tensors else None

    layers = [n for n in quantized_nodes(qm) if n.output and n.output[0] in float_tensors]
    watched = sorted({n.output[0] for n in layers} | {s for n in layers for i in n.input if (s := source(i))})
    fs, qs = _session(_with_outputs(fm, watched)), _session(_with_outputs(qm, watched))
    num = dict.fromkeys(watched, 0.0)
    den = dict.fromkeys(watched, 0.0)
    small = samples.take(SENSITIVITY_SAMPLES)
    for feed in small.feeds(model_io, 1):
        fo = dict(zip(watched, fs.run(watched, feed), strict=True))
        qo = dict(zip(watched, qs.run(watched, feed), strict=True))
        for t in watched:
            a, b = np.asarray(fo[t], np.float64), np.asarray(qo[t], np.float64)
            if a.shape == b.shape and a.dtype.kind == "f":
                num[t] += float(np.sum((a - b) ** 2))
                den[t] += float(np.sum(a ** 2))
    err = {t: float(np.sqrt(num[t] / den[t])) if den[t] > 0 else 0.0 for t in watched}
    ranked = []
    for n in layers:
        inherited = max((err.get(s, 0.0) for i in n.input if (s := source(i))), default=0.0)
        ranked.append((str(n.name), err[n.output[0]] - inherited))
    # A layer whose output is the model's answer quantizes the answer itself (a softmax over
    # thousands of classes in 1/255 steps ties its arg-max): those go first, whatever their error.
    answers = {o.name for o in qm.graph.output}
    first = {str(n.name) for n in layers if set(n.output) & answers}
    ranked.sort(key=lambda x: (x[0] not in first, -x[1]))
    return ranked


def exclusion_schedule(n_layers: int) -> list[int]:
    """How many of the worst layers each try excludes: doubling from about 1/32 of them.

    Doubling bounds the tries to about six whatever the model's size; the first step keeps small
    models' first try to one or two layers. Excluding every layer would leave an FP32 model with
    extra steps, not an INT8 variant, so the last try keeps at least one layer quantized.
    """
    out, k = [], max(1, -(-n_layers // 32))
    while k < n_layers:
        out.append(k)
        k *= 2
    if n_layers > 1 and (not out or out[-1] < n_layers - 1):
        out.append(n_layers - 1)
    return out


def onnx_accuracy_aware(fp32: Path, plain_int8: Path, samples: SampleSet, model_io: ModelIO, *,  # noqa: PLR0913  the search's inputs plus keyword-only callbacks
                        build: Callable[[Sequence[str]], None], passes: Callable[[], tuple[bool, float]],
                        budget_s: float, say: Callable[[str], None]) -> Recovery:
    """Exclude the worst layers until ``passes()`` (after ``build(excluded)``) says the gate holds."""
    t0 = time.monotonic()
    rec = Recovery("onnxruntime: sensitive layers excluded (per-layer error)")
    ranked = rank_layers(fp32, plain_int8, samples, model_io)
    rec.quantized_layers = len(ranked)
    for k in exclusion_schedule(len(ranked)):
        if time.monotonic() - t0 > budget_s:
            rec.stopped = f"time budget of {budget_s:g} s spent"
            break
        names = [name for name, _ in ranked[:k]]
        build(names)
        ok, value = passes()
        rec.tries.append({"excluded": k, "score": value, "passed": ok})
        say(f"onnx-int8 accuracy-aware: {k} of {len(ranked)} layers in FP32: "
            f"{'passes' if ok else 'still fails'} the gate")
        if ok:
            rec.passed, rec.kept_float = True, names
            break
    else:
        rec.stopped = rec.stopped or "it would take every quantized layer in FP32"
    rec.seconds = time.monotonic() - t0
    return rec


# ---- OpenVINO: NNCF accuracy control ------------------------------------------------------------
class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def _nncf_log() -> Iterator[_Capture]:
    """NNCF's INFO log captured (it names reverted operations), nothing printed."""
    logger = logging.getLogger("nncf")
    handlers, level, propagate = logger.handlers[:], logger.level, logger.propagate
    capture = _Capture()
    logger.handlers, logger.propagate = [capture], False
    logger.setLevel(logging.INFO)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield capture
    finally:
        logger.handlers, logger.propagate = handlers, propagate
        logger.setLevel(level)


def reverted_operations(messages: Sequence[str]) -> list[str]:
    """Operation names from NNCF's "Reverted N operations ..." lines (tab-indented, one per line)."""
    names: list[str] = []
    for msg in messages:
        if msg.startswith("Reverted ") or "were reverted back to the floating-point precision" in msg:
            for line in msg.splitlines()[1:]:
                if line.startswith("\t") and line.strip() not in names:
                    names.append(line.strip())
    return names


def openvino_accuracy_control(fp32: Path, xml: Path, calib: SampleSet, evalset: SampleSet, model_io: ModelIO, *,  # noqa: PLR0913  the search's inputs plus keyword-only gate options
                              score: Callable[[list[int], dict[str, np.ndarray]], float], max_drop: float,
                              budget_s: float) -> Recovery:
    """NNCF accuracy control; ``score(indices, outputs)`` is the gate's metric (higher is better)."""
    ov = deps.openvino()
    nncf = deps.nncf()
    t0 = time.monotonic()
    rec = Recovery("openvino: NNCF quantize_with_accuracy_control")
    calib_items = list(calib.feeds(model_io, 1))
    eval_items = list(enumerate(evalset.feeds(model_io, 1)))

    def validate(compiled: Any, items: Any) -> tuple[float, None]:
        if time.monotonic() - t0 > budget_s:
            raise BudgetExceededError(f"time budget of {budget_s:g} s spent")
        idx: list[int] = []
        parts: dict[str, list[np.ndarray]] = {}
        for i, feed in items:
            result = compiled(feed)
            idx.append(int(i))
            for port in compiled.outputs:
                parts.setdefault(port.get_any_name(), []).append(np.asarray(result[port]))
        join = np.concatenate if model_io.batched else np.stack
        return float(score(idx, {k: join(v) for k, v in parts.items()})), None  # a tuple: NNCF's metric mode

    model = ov.convert_model(str(fp32))
    # NNCF ranks every quantizer group by re-validating on this many items (the ones FP32 and INT8
    # disagree on most); its default of 300 made one PP-OCRv4 recogniser run take over 20 minutes here.
    params = nncf.AdvancedAccuracyRestorerParameters(ranking_subset_size=min(NNCF_RANKING_ITEMS, len(eval_items)))
    with _nncf_log() as log:
        try:
            quantized = nncf.quantize_with_accuracy_control(
                model, nncf.Dataset(calib_items), nncf.Dataset(eval_items), validate,
                max_drop=max_drop, drop_type=nncf.DropType.ABSOLUTE, subset_size=len(calib_items),
                advanced_accuracy_restorer_parameters=params)
        except BudgetExceededError as e:
            rec.stopped, rec.seconds = str(e), time.monotonic() - t0
            return rec
        except Exception as e:  # NNCF wraps errors from the validation function
            if "time budget" in str(e) or isinstance(e.__cause__, BudgetExceededError):
                rec.stopped, rec.seconds = f"time budget of {budget_s:g} s spent", time.monotonic() - t0
                return rec
            raise
    rec.kept_float = reverted_operations(log.messages)
    for msg in log.messages:
        counted = re.match(r"(\d+) out of (\d+)", msg)
        if counted:
            rec.quantized_layers = int(counted.group(2))
    for msg in log.messages:
        if msg.startswith("Algorithm completed") or "could not achieve" in msg or "Maximum number" in msg:
            rec.tries.append({"nncf": msg})
    xml.parent.mkdir(parents=True, exist_ok=True)
    ov.save_model(quantized, str(xml), compress_to_fp16=False)
    rec.seconds = time.monotonic() - t0
    return rec
