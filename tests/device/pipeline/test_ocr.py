"""The OCR steps held to PaddleOCR's conventions as RapidOCR implements them, and the ``ocr`` example
(built-in steps only) against RapidOCR's own call on documents made here.

- ``resize`` mode limit with ``multiple_of`` gives RapidOCR's detector input sizes;
- ``unclip`` lands on the pixels pyclipper's offset gives (the library DB-net's post-processing uses);
- ``crop_boxes`` batch_width: groups by aspect ratio, per-group widths, widths out; ``normalize`` pads
  in normalised space; a model step with ``widths`` runs each group at its own width;
- ``rotate_by_class``, ``collect``, ``ctc_decode`` with its characters from the model's metadata;
- the ``ocr`` example, served by a real InferenceService, reads the same lines with the same boxes
  as RapidOCR on a letter and an upside-down page (all ten documents: the slow test).
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from edged.config import ModelsSection
from edged.core.manager import ModelManager
from edged.core.service import InferenceService
from edged.pipeline.contract import Port
from edged.pipeline.steps import builtin_step
from edged.profiles import BackendPreference
from edged.protocol.types import InferRequest
from tests.device.pipeline.examples import EXAMPLES, UnavailableError, model_file

cv2 = pytest.importorskip("cv2", reason="the pipeline extra (opencv-python-headless) is not installed")

ORT_CPU = [BackendPreference(backend="onnxruntime", device="CPU", precisions=["fp32"])]
OCR_MODELS = ("ocr_det", "ocr_cls", "ocr_rec")


def make(kind: str, params: dict[str, object], folder: Path = EXAMPLES) -> object:
    return builtin_step(kind)(params, folder)


def _ref() -> object:
    from tests.device.pipeline.rapidocr_ref import rapidocr
    try:
        return rapidocr()
    except UnavailableError as exc:
        pytest.skip(str(exc))


def test_resize_limit_multiple_of_gives_the_detectors_sizes() -> None:
    step = make("resize", {"mode": "limit", "limit_side": 736, "limit_type": "min", "multiple_of": 32})
    for h, w in [(643, 900), (1880, 1000), (720, 520), (100, 3000), (2000, 800)]:
        ratio = 736 / min(h, w) if min(h, w) < 736 else 1.0  # RapidOCR's DetPreProcess, limit_type "min"
        want = (int(round(int(h * ratio) / 32) * 32), int(round(int(w * ratio) / 32) * 32))
        out = step.run({"pixels": np.zeros((1, h, w, 3), np.uint8)})  # type: ignore[attr-defined]
        assert out["pixels"].shape[1:3] == want, (h, w)
        np.testing.assert_allclose(out["transform"][0, :2], [want[1] / w, want[0] / h], rtol=1e-6)
    small = make("resize", {"mode": "limit", "limit_side": 960, "limit_type": "max", "multiple_of": 32})
    assert small.run({"pixels": np.zeros((1, 500, 300, 3), np.uint8)})["pixels"].shape == (1, 512, 288, 3)  # type: ignore[attr-defined]


def test_unclip_lands_on_pyclippers_pixels() -> None:
    _ref()  # puts pyclipper and shapely (RapidOCR's own dependencies) on the path
    import pyclipper  # type: ignore[import-not-found]
    from shapely.geometry import Polygon  # type: ignore[import-not-found]

    from edged.pipeline.steps.ocr import unclip
    rng = np.random.default_rng(0)
    for _ in range(300):
        c = rng.uniform(20, 900, 2)
        box = cv2.boxPoints(((c[0], c[1]), (rng.uniform(4, 600), rng.uniform(4, 60)), rng.uniform(-10, 10)))
        poly = Polygon(box)
        offset = pyclipper.PyclipperOffset()
        offset.AddPath(box, pyclipper.JT_ROUND, pyclipper.ET_CLOSEDPOLYGON)
        want = cv2.minAreaRect(np.array(offset.Execute(poly.area * 1.6 / poly.length)).reshape(-1, 2).astype(np.int32))
        got = cv2.minAreaRect(unclip(box.astype(np.float32), 1.6))
        assert np.allclose(got[0], want[0]) and np.allclose(got[1], want[1]) and np.isclose(got[2], want[2])


def test_batch_width_groups_by_aspect_and_pads_in_normalised_space() -> None:
    page = np.full((200, 900, 3), 200, np.uint8)
    widths = [50, 800, 60, 300, 70, 90, 400, 120]  # boxes 20 px high: aspect ratios 2.5 .. 40
    boxes = np.zeros((1, len(widths), 4), np.float32)
    for j, w in enumerate(widths):
        boxes[0, j] = (10, 10 + 20 * j, 10 + w, 30 + 20 * j)
    step = make("crop_boxes", {"mode": "batch_width", "height": 48, "min_width": 320, "group": 3})
    out = step.run({"pixels": page[None], "boxes": boxes})  # type: ignore[attr-defined]
    ratios = [w / 20 for w in widths]
    order = np.argsort(ratios)
    assert out["crop_index"][:, 1].tolist() == order.tolist()  # sorted by aspect ratio
    want_group = []
    for start in range(0, len(order), 3):
        widest = max(320 / 48, *(ratios[k] for k in order[start:start + 3]))
        want_group += [int(48 * widest)] * len(order[start:start + 3])
    assert out["batch_widths"].tolist() == want_group
    assert out["widths"].tolist() == [min(g, math.ceil(48 * ratios[k])) for g, k in zip(want_group, order, strict=True)]
    assert out["crops"].shape == (len(widths), 48, max(want_group), 3)
    norm = make("normalize", {"mean": [0.5] * 3, "std": [0.5] * 3, "pad": 0.0})
    x = norm.run({"pixels": out["crops"], "widths": out["widths"]})["tensor"]  # type: ignore[attr-defined]
    for row, width in enumerate(out["widths"].tolist()):
        assert np.all(x[row, :, width:] == 0.0) and np.all(x[row, :, :width] != 0.0)


def test_rotate_by_class_and_collect_restore_per_image_answers() -> None:
    turn = make("rotate_by_class", {"turns": [0, 2], "threshold": 0.9})
    scores = np.array([[0.05, 0.95], [0.2, 0.8], [0.99, 0.01]], np.float32)
    index = np.array([[0, 1], [1, 0], [0, 0]], np.int32)
    boxes = np.zeros((2, 2, 4, 2), np.float32)
    assert turn.run({"scores": scores, "crop_index": index, "boxes": boxes})["turns"].tolist() == [[0, 2], [0, 0]]  # type: ignore[attr-defined]
    collect = make("collect", {"score": "confidence", "min_score": 0.5})
    collect.bind({"crop_index": Port("INT32", (-1, 2)), "text": Port("BYTES", (-1,)),  # type: ignore[attr-defined]
                  "confidence": Port("FP32", (-1,)), "boxes": Port("FP32", (-1, -1, 4, 2))})
    text = np.array([b"second", b"other", b"first"], dtype=object)
    out = collect.run({"crop_index": index, "text": text, "confidence": np.array([0.9, 0.4, 0.8], np.float32),  # type: ignore[attr-defined]
                       "boxes": boxes})
    docs = [json.loads(d) for d in out["json"]]
    assert [[d["text"] for d in doc] for doc in docs] == [["first", "second"], []]  # detection order, 0.4 dropped
    assert out["count"].tolist() == [2, 0] and docs[0][0]["box"] == [[0.0, 0.0]] * 4


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InferenceService]:
    repo = tmp_path_factory.mktemp("ocr") / "models"
    try:
        for model in OCR_MODELS:
            shutil.copytree(EXAMPLES / model, repo / model, ignore=shutil.ignore_patterns("model.onnx"))
            shutil.copyfile(model_file(model), repo / model / "1" / "model.onnx")
    except UnavailableError as exc:
        pytest.skip(str(exc))
    shutil.copytree(EXAMPLES / "ocr", repo / "ocr")
    manager = ModelManager(repo, ModelsSection(), ORT_CPU)
    manager.load_all()
    yield InferenceService(manager)
    manager.shutdown()


def test_model_step_widths_run_each_group_at_its_width(service: InferenceService, tmp_path: Path) -> None:
    """Rows of two widths through ocr_rec with ``widths``: each row equals the model run on that row alone
    at its own width (outputs zero-padded to the longest), and ctc_decode reads the model's characters."""
    from edged.pipeline.definition import parse_pipeline
    from edged.pipeline.graph import compile_pipeline
    text = """
[[inputs]]
name = "x"
datatype = "FP32"
shape = [-1, 3, 48, -1]
[[inputs]]
name = "w"
datatype = "INT32"
shape = [-1]
[[outputs]]
name = "probs"
datatype = "FP32"
shape = [-1, -1, 6625]
[[outputs]]
name = "text"
datatype = "BYTES"
shape = [-1]
[[steps]]
name = "rec"
model = "ocr_rec"
inputs = { x = "x" }
widths = "w"
outputs = { "softmax_11.tmp_0" = "probs" }
[[steps]]
name = "read"
kind = "ctc_decode"
inputs = { logits = "probs" }
outputs = { text = "text" }
params = { characters_from = "ocr_rec" }
"""
    import asyncio

    from edged.pipeline.graph import CallContext
    pipeline = compile_pipeline(parse_pipeline(text), tmp_path, service.manager.gateway)
    x = np.random.default_rng(0).uniform(-1, 1, (3, 3, 48, 640)).astype(np.float32)
    w = np.array([320, 320, 640], np.int32)
    out = asyncio.run(pipeline.run({"x": x, "w": w}, CallContext(models=service)))
    assert out["probs"].shape == (3, 80, 6625)
    for row, width in enumerate(w.tolist()):
        one = np.ascontiguousarray(x[row:row + 1, ..., :width])
        alone = service.infer(InferRequest(model="ocr_rec", inputs={"x": one}))
        probs = alone.outputs["softmax_11.tmp_0"][0]
        np.testing.assert_allclose(out["probs"][row, :len(probs)], probs, atol=1e-5)
        assert not out["probs"][row, len(probs):].any()
    assert out["text"].shape == (3,)


def _lines(service: InferenceService, data: bytes) -> list[dict[str, object]]:
    arr = np.empty(1, dtype=object)
    arr[0] = data
    out = service.infer(InferRequest(model="ocr", inputs={"image": arr}), timeout=300).outputs
    lines: list[dict[str, object]] = json.loads(out["lines"][0])
    assert int(out["line_count"][0]) == len(lines)
    return lines


def _assert_same_as_rapidocr(service: InferenceService, names: list[str]) -> None:
    from tests.device.pipeline.documents import DOCUMENTS
    ref = _ref()
    for name in names:
        data = DOCUMENTS[name](0)
        got = _lines(service, data)
        want, _ = ref(data)  # type: ignore[operator]
        assert [g["text"] for g in got] == [w[1] for w in want], name
        for g, w in zip(got, want, strict=True):
            assert np.array_equal(np.array(g["box"]), np.array(w[0])), (name, g, w)
            assert abs(float(g["confidence"]) - float(w[2])) < 1e-3  # type: ignore[arg-type]


def test_ocr_example_reads_what_rapidocr_reads(service: InferenceService) -> None:
    status = {s["name"]: s for s in service.manager.statuses()}["ocr"]
    assert status["state"] == "ready" and any("ocr_rec" in n for n in status["notes"]), status
    _assert_same_as_rapidocr(service, ["upside_down"])  # the direction classifier turns every line


@pytest.mark.slow
def test_ocr_example_reads_what_rapidocr_reads_on_every_document(service: InferenceService) -> None:
    from tests.device.pipeline.documents import DOCUMENTS
    _assert_same_as_rapidocr(service, list(DOCUMENTS))
