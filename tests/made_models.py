"""Small ONNX models built at test time with the ``onnx`` package, shaped like the models users bring.

``vad``: a voice-activity-like model: audio ``[batch, samples]`` (both dynamic), a true scalar
INT64 sample rate ``sr`` (shape ``[]``), and a recurrent ``state`` in and out. It reflect-pads the
audio by 64 samples, so it cannot run on fewer than 65 samples (a made-up 1-sample input fails).

``multidyn``: several dynamic dimensions and an INT64 input whose values index a table:
``image [batch, 3, height, width]`` and ``ids [batch, tokens]`` (ids must be < 100); every input
and output starts with a dynamic dimension.

``misdeclared``: an output whose declared shape its answers contradict.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

VAD_PAD = 64
VOCAB = 100


def _save(graph: object, path: Path) -> Path:
    import onnx
    from onnx import helper

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def vad(path: Path) -> Path:
    from onnx import TensorProto, helper, numpy_helper

    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    nodes = [
        helper.make_node("Pad", ["input", "pads"], ["padded"], mode="reflect"),
        helper.make_node("ReduceMean", ["padded"], ["level"], axes=[1], keepdims=1),
        helper.make_node("Cast", ["sr"], ["sr_f"], to=f32),
        helper.make_node("Mul", ["sr_f", "micro"], ["sr_term"]),
        helper.make_node("ReduceMean", ["state"], ["state_mean"], axes=[0, 2], keepdims=0),
        helper.make_node("Unsqueeze", ["state_mean", "one"], ["state_col"]),
        helper.make_node("Add", ["level", "sr_term"], ["a"]),
        helper.make_node("Add", ["a", "state_col"], ["b"]),
        helper.make_node("Sigmoid", ["b"], ["output"]),
        helper.make_node("Mul", ["state", "half"], ["decayed"]),
        helper.make_node("Add", ["decayed", "level"], ["stateN"]),
    ]
    inits = [numpy_helper.from_array(np.array([0, VAD_PAD, 0, VAD_PAD], np.int64), "pads"),
             numpy_helper.from_array(np.array(1e-6, np.float32), "micro"),
             numpy_helper.from_array(np.array(0.5, np.float32), "half"),
             numpy_helper.from_array(np.array([1], np.int64), "one")]
    graph = helper.make_graph(
        nodes, "vad",
        [helper.make_tensor_value_info("input", f32, ["batch", "samples"]),
         helper.make_tensor_value_info("sr", i64, []),
         helper.make_tensor_value_info("state", f32, [2, "batch", 16])],
        [helper.make_tensor_value_info("output", f32, ["batch", 1]),
         helper.make_tensor_value_info("stateN", f32, [2, "batch", 16])],
        inits)
    return _save(graph, path)


def vad_reference(audio: np.ndarray, sr: int, state: np.ndarray) -> dict[str, np.ndarray]:
    """What ``vad`` computes, in numpy (an engine-independent reference)."""
    padded = np.pad(audio, ((0, 0), (VAD_PAD, VAD_PAD)), mode="reflect")
    level = padded.mean(axis=1, keepdims=True)
    b = level + np.float32(sr) * np.float32(1e-6) + state.mean(axis=(0, 2))[:, None]
    return {"output": (1 / (1 + np.exp(-b))).astype(np.float32),
            "stateN": (state * 0.5 + level).astype(np.float32)}


def multidyn(path: Path) -> Path:
    from onnx import TensorProto, helper, numpy_helper

    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    table = (np.arange(VOCAB * 8, dtype=np.float32).reshape(VOCAB, 8) % 13) / 13
    nodes = [
        helper.make_node("ReduceMean", ["image"], ["pooled"], axes=[2, 3], keepdims=0),
        helper.make_node("Gather", ["table", "ids"], ["emb"], axis=0),
        helper.make_node("ReduceSum", ["emb", "axis1"], ["embedding"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes, "multidyn",
        [helper.make_tensor_value_info("image", f32, ["batch", 3, "height", "width"]),
         helper.make_tensor_value_info("ids", i64, ["batch", "tokens"])],
        [helper.make_tensor_value_info("pooled", f32, ["batch", 3]),
         helper.make_tensor_value_info("embedding", f32, ["batch", 8])],
        [numpy_helper.from_array(table, "table"), numpy_helper.from_array(np.array([1], np.int64), "axis1")])
    return _save(graph, path)


def nan(path: Path) -> Path:
    """Loads and runs, but answers NaN for inputs in [0, 1): the daemon's self-test must refuse it."""
    from onnx import TensorProto, helper, numpy_helper

    f32 = TensorProto.FLOAT
    graph = helper.make_graph(
        [helper.make_node("Sub", ["x", "ten"], ["d"]), helper.make_node("Sqrt", ["d"], ["y"])], "nan",
        [helper.make_tensor_value_info("x", f32, [4])], [helper.make_tensor_value_info("y", f32, [4])],
        [numpy_helper.from_array(np.array(10, np.float32), "ten")])
    return _save(graph, path)


def misdeclared(path: Path) -> Path:
    """Declares its output ``[1, n]`` but answers ``[width / 2, 2]`` (as ddddocr declares ``[1, -1]`` and
    answers ``[20, 1, 8210]``): input ``x [1, width]``, width even."""
    from onnx import TensorProto, helper, numpy_helper

    f32 = TensorProto.FLOAT
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "to"], ["y"])], "misdeclared",
        [helper.make_tensor_value_info("x", f32, [1, "width"])], [helper.make_tensor_value_info("y", f32, [1, "n"])],
        [numpy_helper.from_array(np.array([-1, 2], np.int64), "to")])
    return _save(graph, path)


# ---- two files for one function with opposite costs (engine re-selection) -------------------------
def doubler_quadratic(path: Path) -> Path:
    """``y = 2 * x`` for ``x [batch, n]`` as ``x @ (2 * I_n)``: the n x n matrix is built on every call,
    so a run costs O(n^2): nothing for a short row, tens of milliseconds for n = 4096. Exact: every
    product but one is an exact zero."""
    from onnx import TensorProto, helper, numpy_helper

    f32 = TensorProto.FLOAT
    nodes = [
        helper.make_node("Shape", ["x"], ["xshape"]),
        helper.make_node("Slice", ["xshape", "one", "two"], ["n"]),
        helper.make_node("Concat", ["n", "n"], ["nn"], axis=0),
        helper.make_node("ConstantOfShape", ["nn"], ["zeros"], value=numpy_helper.from_array(np.zeros(1, np.float32))),
        helper.make_node("EyeLike", ["zeros"], ["eye"]),
        helper.make_node("Mul", ["eye", "two_f"], ["eye2"]),
        helper.make_node("MatMul", ["x", "eye2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "doubler_quadratic",
        [helper.make_tensor_value_info("x", f32, ["batch", "n"])],
        [helper.make_tensor_value_info("y", f32, ["batch", "n"])],
        [numpy_helper.from_array(np.array([1], np.int64), "one"),
         numpy_helper.from_array(np.array([2], np.int64), "two"),
         numpy_helper.from_array(np.array(2.0, np.float32), "two_f")])
    return _save(graph, path)


def doubler_fixed(path: Path, width: int = 192, depth: int = 4) -> Path:
    """``y = 2 * x`` plus zero times a fixed-size computation that depends on the input (so no engine
    folds it away): about a millisecond per run whatever n is. Exact: the added term is 0."""
    from onnx import TensorProto, helper, numpy_helper

    f32 = TensorProto.FLOAT
    w = (np.random.default_rng(7).random((width, width), dtype=np.float32) - 0.5) * (2.0 / width)
    nodes = [
        helper.make_node("ReduceMean", ["x"], ["level"], keepdims=0),  # a scalar that depends on x
        helper.make_node("Mul", ["w", "level"], ["h0"]),
    ]
    for i in range(depth):
        nodes.append(helper.make_node("MatMul", [f"h{i}", "w"], [f"m{i}"]))
        nodes.append(helper.make_node("Tanh", [f"m{i}"], [f"h{i + 1}"]))
    nodes += [
        helper.make_node("ReduceSum", [f"h{depth}"], ["total"], keepdims=0),
        helper.make_node("Mul", ["total", "zero"], ["nothing"]),
        helper.make_node("Mul", ["x", "two_f"], ["x2"]),
        helper.make_node("Add", ["x2", "nothing"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "doubler_fixed",
        [helper.make_tensor_value_info("x", f32, ["batch", "n"])],
        [helper.make_tensor_value_info("y", f32, ["batch", "n"])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
         numpy_helper.from_array(np.array(2.0, np.float32), "two_f")])
    return _save(graph, path)


def doubler_batch_quadratic(path: Path) -> Path:
    """``y = 2 * x`` for ``x [batch, n]`` through one (batch * n)-square matrix: cheap for one row, costly
    for several (a batch of 4 costs 16 times a row's square). Exact, like :func:`doubler_quadratic`."""
    from onnx import TensorProto, helper, numpy_helper

    f32 = TensorProto.FLOAT
    nodes = [
        helper.make_node("Shape", ["x"], ["xshape"]),
        helper.make_node("Reshape", ["x", "flat"], ["row"]),
        helper.make_node("Shape", ["row"], ["rshape"]),
        helper.make_node("Slice", ["rshape", "one", "two"], ["m"]),
        helper.make_node("Concat", ["m", "m"], ["mm"], axis=0),
        helper.make_node("ConstantOfShape", ["mm"], ["zeros"], value=numpy_helper.from_array(np.zeros(1, np.float32))),
        helper.make_node("EyeLike", ["zeros"], ["eye"]),
        helper.make_node("Mul", ["eye", "two_f"], ["eye2"]),
        helper.make_node("MatMul", ["row", "eye2"], ["yrow"]),
        helper.make_node("Reshape", ["yrow", "xshape"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "doubler_batch_quadratic",
        [helper.make_tensor_value_info("x", f32, ["batch", "n"])],
        [helper.make_tensor_value_info("y", f32, ["batch", "n"])],
        [numpy_helper.from_array(np.array([1, -1], np.int64), "flat"),
         numpy_helper.from_array(np.array([1], np.int64), "one"),
         numpy_helper.from_array(np.array([2], np.int64), "two"),
         numpy_helper.from_array(np.array(2.0, np.float32), "two_f")])
    return _save(graph, path)


def big_answer(path: Path) -> Path:
    """``n`` (INT64 ``[1]``) -> ``out``, that many FP32 ones: a large answer to an 8-byte request, computed
    in microseconds (a run short enough for an event loop, an answer too big to encode on one)."""
    from onnx import TensorProto, helper, numpy_helper

    one = numpy_helper.from_array(np.array([1.0], np.float32), "v")
    graph = helper.make_graph(
        [helper.make_node("ConstantOfShape", ["n"], ["out"], value=one)], "big_answer",
        [helper.make_tensor_value_info("n", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N"])])
    return _save(graph, path)


def sum_int64(path: Path) -> Path:
    """``x`` (INT64 ``[K]``) -> ``y``, its sum: JSON of short numbers ("0,") decodes to 4x its text."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("ReduceSum", ["x"], ["y"], keepdims=0)], "sum_int64",
        [helper.make_tensor_value_info("x", TensorProto.INT64, ["K"])],
        [helper.make_tensor_value_info("y", TensorProto.INT64, [])])
    return _save(graph, path)
