"""The models Triton's Python example clients use, rebuilt as ONNX, and a scikit-learn text classifier.

Triton's examples (``src/python/examples`` of its client repository) run against ``simple`` (INT32
add/sub), ``simple_int8`` (the same in INT8), ``simple_string`` (BYTES numbers parsed, added and
subtracted, answered as BYTES numbers) and ``simple_identity`` (BYTES in, the same BYTES out), all
with ``max_batch_size = 8`` and ``dims [16]``. ``text_classifier`` is a real string model: a
scikit-learn TF-IDF + logistic regression pipeline over short sentences, converted with skl2onnx,
whose graph tokenises the raw strings itself.
"""

from __future__ import annotations

import hashlib
import textwrap
from pathlib import Path
from typing import Any

EXAMPLE_MODELS = ("simple", "simple_int8", "simple_string", "simple_identity")


def _write(root: Path, name: str, model: object, manifest: str) -> None:
    import onnx

    vdir = root / name / "1"
    vdir.mkdir(parents=True, exist_ok=True)
    onnx.checker.check_model(model)
    data = model.SerializeToString()  # type: ignore[attr-defined]
    (vdir / "model.onnx").write_bytes(data)
    (vdir / "model.toml").write_text(textwrap.dedent(manifest) + textwrap.dedent(f"""
        [[variants]]
        file = "model.onnx"
        format = "onnx"
        sha256 = "{hashlib.sha256(data).hexdigest()}"
        """))


def _model(graph: object) -> object:
    from onnx import helper

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _add_sub(name: str, elem: int, io: int | None = None) -> object:
    """OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1 on ``elem``; ``io``: the tensors' type when
    they differ (strings cast to ``elem`` and back, as Triton's ``simple_string`` does)."""
    from onnx import helper

    t = elem if io is None else io
    nodes = []
    a, b = "INPUT0", "INPUT1"
    if io is not None:
        nodes += [helper.make_node("Cast", ["INPUT0"], ["a"], to=elem),
                  helper.make_node("Cast", ["INPUT1"], ["b"], to=elem)]
        a, b = "a", "b"
    s, d = ("OUTPUT0", "OUTPUT1") if io is None else ("sum", "diff")
    nodes += [helper.make_node("Add", [a, b], [s]), helper.make_node("Sub", [a, b], [d])]
    if io is not None:
        nodes += [helper.make_node("Cast", ["sum"], ["OUTPUT0"], to=io),
                  helper.make_node("Cast", ["diff"], ["OUTPUT1"], to=io)]
    vi = helper.make_tensor_value_info
    return _model(helper.make_graph(nodes, name, [vi("INPUT0", t, ["batch", 16]), vi("INPUT1", t, ["batch", 16])],
                                    [vi("OUTPUT0", t, ["batch", 16]), vi("OUTPUT1", t, ["batch", 16])]))


def _identity() -> object:
    from onnx import TensorProto, helper

    vi = helper.make_tensor_value_info
    return _model(helper.make_graph([helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])], "simple_identity",
                                    [vi("INPUT0", TensorProto.STRING, ["batch", 16])],
                                    [vi("OUTPUT0", TensorProto.STRING, ["batch", 16])]))


def _io(datatype: str, names: tuple[str, ...], kind: str) -> str:
    return "".join(f'\n[[{kind}]]\nname = "{n}"\ndatatype = "{datatype}"\nshape = [16]\n' for n in names)


def build_examples(root: Path) -> Path:
    """Triton's four example models in an edged repository at ``root``."""
    from onnx import TensorProto

    for name, model, dt in (("simple", _add_sub("simple", TensorProto.INT32), "INT32"),
                            ("simple_int8", _add_sub("simple_int8", TensorProto.INT8), "INT8"),
                            ("simple_string", _add_sub("simple_string", TensorProto.INT32, TensorProto.STRING),
                             "BYTES")):
        _write(root, name, model, "max_batch_size = 8\n" + _io(dt, ("INPUT0", "INPUT1"), "inputs")
               + _io(dt, ("OUTPUT0", "OUTPUT1"), "outputs"))
    _write(root, "simple_identity", _identity(),
           "max_batch_size = 8\n" + _io("BYTES", ("INPUT0",), "inputs") + _io("BYTES", ("OUTPUT0",), "outputs"))
    return root


# Short sentences in two classes (weather vs. computing), with accents, emoji and CJK so that UTF-8
# decoding matters: the answer for a sentence must be the one raw ONNX Runtime gives for its str.
TRAIN = [
    ("rain and wind all day, the storm is coming", 0), ("sunny skies and a warm breeze", 0),
    ("snow fell overnight, roads are icy", 0), ("the forecast says thunder and hail", 0),
    ("heavy clouds, drizzle in the afternoon", 0), ("température élevée et soleil ☀️ sur la côte", 0),
    ("台风 approaching the coast with rain", 0), ("fog in the valley until noon", 0),
    ("the compiler crashed on the new kernel", 1), ("reboot the server and check the logs", 1),
    ("memory leak in the python process", 1), ("the GPU driver needs an update", 1),
    ("unit tests fail after the merge", 1), ("le réseau est lent, vérifiez le routeur 🖥️", 1),
    ("数据库 backup finished without errors", 1), ("the cpu runs hot under load", 1),
]
QUERIES = ["storm and rain tonight", "the server logs show a crash", "☀️ soleil et température",
           "routeur réseau 🖥️ lent", "数据库 kernel update", "", "fog, drizzle, compiler"]


def build_text_classifier(root: Path) -> Any:
    """``text_classifier``: ``text`` BYTES [1] per item (max_batch_size 8) -> ``label`` INT64 [] and
    ``probabilities`` FP32 [2], tokenised inside the graph (skl2onnx's TfIdfVectorizer conversion).

    Words are split at spaces and commas, so a word is kept whole whatever its script ("température",
    "数据库"), and text that reaches the graph in another form (``str()`` of the bytes, "b'storm") makes
    other words and another answer. Returns the fitted scikit-learn pipeline.
    """
    from skl2onnx import convert_sklearn
    from skl2onnx.common.data_types import StringTensorType
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import Pipeline

    texts, labels = zip(*TRAIN, strict=True)
    pipe = Pipeline([("tfidf", TfidfVectorizer(token_pattern=r"[^ ,]+")),
                     ("clf", LogisticRegression(max_iter=200))])
    pipe.fit(list(texts), list(labels))
    # C.UTF-8: the lower-casing locale every Linux has (ONNX Runtime's default, en_US.UTF-8, may be missing)
    options = {id(pipe.steps[-1][1]): {"zipmap": False},
               id(pipe.steps[0][1]): {"locale": "C.UTF-8", "separators": [" ", ","]}}
    onx = convert_sklearn(pipe, "text_classifier", initial_types=[("text", StringTensorType([None, 1]))],
                          options=options, target_opset=17)
    outputs = {o.name: o for o in onx.graph.output}
    assert set(outputs) == {"label", "probabilities"}, outputs
    _write(root, "text_classifier", onx, """
        max_batch_size = 8
        [[inputs]]
        name = "text"
        datatype = "BYTES"
        shape = [1]
        [[outputs]]
        name = "label"
        datatype = "INT64"
        shape = []
        [[outputs]]
        name = "probabilities"
        datatype = "FP32"
        shape = [2]
        """)
    return pipe


NAMES = (b"weather", b"computing")
_TAG_STEP = '''import numpy as np


def tag(inputs, params):
    """Each sentence with its class name appended: BYTES in (the pipeline's input), BYTES out."""
    names = [n.encode() for n in params["names"]]
    out = np.empty(len(inputs["text"]), dtype=object)
    for i, (text, label) in enumerate(zip(inputs["text"].reshape(-1), inputs["label"].reshape(-1))):
        if not isinstance(text, bytes):
            raise TypeError(f"text element {i} is {type(text).__name__}, not bytes")
        out[i] = text + b" -> " + names[int(label)]
    return {"tagged": out}
'''


def build_text_pipeline(root: Path) -> Path:
    """``text_pipeline``: its BYTES ``text`` to the ``text_classifier`` model step, then a custom step
    that appends the class name to each sentence (BYTES ``tagged`` [N]); ``probabilities`` as the model's."""
    vdir = root / "text_pipeline" / "1"
    vdir.mkdir(parents=True, exist_ok=True)
    (vdir / "tagstep.py").write_text(_TAG_STEP)
    digest = hashlib.sha256(_TAG_STEP.encode()).hexdigest()
    (vdir / "pipeline.toml").write_text(textwrap.dedent(f"""
        description = "a text classifier's answer and each sentence tagged with its class"
        [[files]]
        file = "tagstep.py"
        sha256 = "{digest}"
        [[inputs]]
        name = "text"
        datatype = "BYTES"
        shape = [-1, 1]
        [[outputs]]
        name = "probabilities"
        datatype = "FP32"
        shape = [-1, 2]
        [[outputs]]
        name = "tagged"
        datatype = "BYTES"
        shape = [-1]
        [[steps]]
        name = "classify"
        model = "text_classifier"
        inputs = {{ text = "text" }}
        outputs = {{ label = "label", probabilities = "probabilities" }}
        [[steps]]
        name = "tag"
        function = "tagstep:tag"
        params = {{ names = {[n.decode() for n in NAMES]!r} }}
        inputs = {{ text = "text", label = "label" }}
        outputs = {{ tagged = "tagged" }}
        output_ports = {{ tagged = {{ datatype = "BYTES", shape = [-1] }} }}
        """))
    return root
