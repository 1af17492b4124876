"""The pipeline graph: wiring refused at load naming step and tensor, DAG execution with
real built-in steps, a real model through the InferenceService, custom Python steps."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from edged.core.service import InferenceService
from edged.errors import ErrorCode, InternalError, InvalidInputError
from edged.pipeline.contract import PipelineDefinitionError, StepInputError
from edged.pipeline.definition import MAX_PIPELINE_FILE, load_pipeline, parse_pipeline
from edged.pipeline.graph import CallContext, ModelCaller, Pipeline, compile_pipeline
from edged.protocol.types import InferRequest
from edged.protocol.v2_models import statistics_entry
from tests.in_process import served

HEAD = """
[[inputs]]
name = "x"
datatype = "FP32"
shape = [-1, 64]
"""

# digits: x -> passthrough -> model -> probabilities; top-3 and a softmax branch side by side
GOOD = HEAD + """
[[outputs]]
name = "top"
datatype = "INT64"
shape = [-1, 3]

[[outputs]]
name = "soft"
datatype = "FP32"
shape = [-1, 10]

[[steps]]
name = "pass"
kind = "passthrough"
inputs = { tensor = "x" }
outputs = { tensor = "pixels" }

[[steps]]
name = "classifier"
model = "digits"
inputs = { pixels = "pixels" }
outputs = { probabilities = "probs" }

[[steps]]
name = "best"
kind = "topk"
inputs = { scores = "probs" }
outputs = { indices = "top" }
params = { k = 3 }

[[steps]]
name = "again"
kind = "softmax"
inputs = { logits = "probs" }
outputs = { probabilities = "soft" }
"""



def _digits_repo(root: Path) -> Path:
    from tests.conftest import MODELS
    shutil.copytree(MODELS / "digits", root / "digits")
    return root


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InferenceService]:
    with served(_digits_repo(tmp_path_factory.mktemp("repo"))) as svc:
        yield svc


def _compile(text: str, service: InferenceService, folder: Path) -> Pipeline:
    return compile_pipeline(parse_pipeline(text), folder, service.manager.gateway)


def _run(pipeline: Pipeline, models: ModelCaller | None = None, /, **inputs: np.ndarray) -> dict[str, np.ndarray]:
    """One request; ``models`` answers its model steps (the service, as for a request it starts)."""
    return asyncio.run(pipeline.run(inputs, CallContext(models=models)))


def test_runs_model_and_branches_like_by_hand(service: InferenceService, tmp_path: Path) -> None:
    pipeline = _compile(GOOD, service, tmp_path)
    assert pipeline.models == [("digits", None)]
    x = np.random.default_rng(1).uniform(0, 16, (5, 64)).astype(np.float32)
    out = _run(pipeline, service, x=x)
    probs = service.infer(InferRequest(model="digits", inputs={"pixels": x})).outputs["probabilities"]
    assert np.array_equal(out["top"], np.argsort(-probs, axis=1, kind="stable")[:, :3])
    e = np.exp(probs - probs.max(axis=1, keepdims=True))
    np.testing.assert_allclose(out["soft"], e / e.sum(axis=1, keepdims=True), rtol=1e-5)


def _replace(old: str, new: str) -> str:
    assert old in GOOD
    return GOOD.replace(old, new)


REFUSALS: list[tuple[str, str, list[str]]] = [
    ("missing kind", _replace('kind = "topk"', 'kind = "top_kay"'), ["'best'", "top_kay"]),
    ("unknown tensor", _replace('inputs = { scores = "probs" }', 'inputs = { scores = "prob" }'),
     ["'best'", "'prob'", "no pipeline input or step produces"]),
    ("cycle", _replace('inputs = { tensor = "x" }', 'inputs = { tensor = "soft" }'),
     ["cycle", "'pass'", "'soft'"]),
    ("type mismatch", _replace('inputs = { logits = "probs" }', 'inputs = { logits = "top" }'),
     ["'again'", "logits <- top", "INT64"]),
    ("shape mismatch", _replace("shape = [-1, 64]", "shape = [-1, 63]"),
     ["'classifier'", "pixels <- pixels", "FP32[-1, 64]", "FP32[-1, 63]"]),
    ("missing model", _replace('model = "digits"', 'model = "digitz"'), ["'classifier'", "digitz", "not served"]),
    ("unwired model input", _replace('inputs = { pixels = "pixels" }', 'inputs = { pixel = "pixels" }'),
     ["'classifier'", "'pixels' is not wired"]),
    ("produced twice", _replace('outputs = { probabilities = "soft" }', 'outputs = { probabilities = "probs" }'),
     ["'again'", "'probs'", "already produced"]),
    ("output mistyped", _replace('datatype = "INT64"', 'datatype = "FP32"'), ["output 'top'", "INT64"]),
    ("no such output port", _replace('outputs = { indices = "top" }', 'outputs = { index = "top" }'),
     ["'best'", "'index'", "'top'"]),
    ("bad params", _replace("params = { k = 3 }", "params = { k = 3, kk = 1 }"), ["'best'", "kk"]),
]


@pytest.mark.parametrize(("text", "expected"), [(t, e) for _, t, e in REFUSALS], ids=[n for n, _, _ in REFUSALS])
def test_wiring_refused_naming_step_and_tensor(service: InferenceService, tmp_path: Path, text: str,
                                               expected: list[str]) -> None:
    with pytest.raises(PipelineDefinitionError) as info:
        _compile(text, service, tmp_path)
    for part in expected:
        assert part in info.value.message, info.value.message
    # the model the refused pipeline named still serves
    x = np.zeros((1, 64), np.float32)
    assert service.infer(InferRequest(model="digits", inputs={"pixels": x})).outputs["probabilities"].shape == (1, 10)


def test_unused_input_and_file_errors_refused(service: InferenceService, tmp_path: Path) -> None:
    extra = GOOD + '\n[[inputs]]\nname = "y"\ndatatype = "FP32"\nshape = [1]\n'
    with pytest.raises(PipelineDefinitionError, match="pipeline input 'y': no step reads"):
        _compile(extra, service, tmp_path)
    with pytest.raises(PipelineDefinitionError, match="exactly one of kind, model or function"):
        parse_pipeline(_replace('model = "digits"', 'model = "digits"\nkind = "softmax"'))
    with pytest.raises(PipelineDefinitionError, match="not valid TOML"):
        parse_pipeline("[[steps]\n")
    with pytest.raises(PipelineDefinitionError, match="cannot read"):
        load_pipeline(tmp_path)
    (tmp_path / "pipeline.toml").write_bytes(b"#" * (MAX_PIPELINE_FILE + 1))
    with pytest.raises(PipelineDefinitionError, match="bytes, more than"):
        load_pipeline(tmp_path)


def test_bad_request_names_input_and_next_succeeds(service: InferenceService, tmp_path: Path) -> None:
    pipeline = _compile(GOOD, service, tmp_path)
    with pytest.raises(InvalidInputError, match="'x'") as info:
        _run(pipeline, service, x=np.zeros((2, 63), np.float32))
    assert info.value.code is ErrorCode.INVALID_ARGUMENT
    assert _run(pipeline, service, x=np.zeros((2, 64), np.float32))["top"].shape == (2, 3)


CUSTOM = HEAD + """
[[outputs]]
name = "probs"
datatype = "FP32"
shape = [-1, 10]

[[outputs]]
name = "rows"
datatype = "INT32"
shape = [-1]

[[steps]]
name = "fan"
function = "myfan:split"
inputs = { x = "x" }
outputs = { crops = "crops", rows = "rows" }
params = { copies = 3 }
output_ports = { crops = { datatype = "FP32", shape = [-1, 64] }, rows = { datatype = "INT32", shape = [-1] } }

[[steps]]
name = "classifier"
model = "digits"
inputs = { pixels = "crops" }
outputs = { probabilities = "probs" }
"""

MYFAN = '''
import numpy as np

def split(inputs, params):
    x = inputs["x"]
    if float(x.sum()) < 0:
        raise ValueError("negative pixels")
    if float(x.sum()) == 1.0:
        return {"crops": x.astype("float64"), "rows": np.zeros(len(x), np.int32)}
    n = int(params["copies"])
    return {"crops": np.repeat(x, n, axis=0), "rows": np.repeat(np.arange(len(x), dtype=np.int32), n)}
'''


def test_custom_step_fans_out_into_one_model_batch(service: InferenceService, tmp_path: Path) -> None:
    (tmp_path / "myfan.py").write_text(MYFAN)
    pipeline = _compile(CUSTOM, service, tmp_path)
    x = np.random.default_rng(2).uniform(0, 16, (2, 64)).astype(np.float32)
    out = _run(pipeline, service, x=x)
    assert out["rows"].tolist() == [0, 0, 0, 1, 1, 1]
    by_hand = service.infer(InferRequest(model="digits", inputs={"pixels": np.repeat(x, 3, axis=0)}))
    np.testing.assert_allclose(out["probs"], by_hand.outputs["probabilities"], rtol=1e-6)


def test_custom_step_errors_are_contained(service: InferenceService, tmp_path: Path) -> None:
    (tmp_path / "myfan.py").write_text(MYFAN)
    pipeline = _compile(CUSTOM, service, tmp_path)
    with pytest.raises(InternalError, match="custom step 'fan' failed: ValueError: negative pixels"):
        _run(pipeline, service, x=np.full((1, 64), -1, np.float32))
    one = np.zeros((1, 64), np.float32)
    one[0, 0] = 1.0
    with pytest.raises(InternalError, match="output 'crops' is float64"):
        _run(pipeline, service, x=one)
    assert _run(pipeline, service, x=np.ones((1, 64), np.float32))["probs"].shape == (3, 10)


def test_custom_module_missing_or_broken_refused(service: InferenceService, tmp_path: Path) -> None:
    with pytest.raises(PipelineDefinitionError, match=r"'fan'.*'myfan\.py' is not in the version folder"):
        _compile(CUSTOM, service, tmp_path)
    (tmp_path / "myfan.py").write_text("raise RuntimeError('boom')\n")
    with pytest.raises(PipelineDefinitionError, match=r"importing 'myfan\.py' failed: RuntimeError: boom"):
        _compile(CUSTOM, service, tmp_path)
    (tmp_path / "myfan.py").write_text("def other(i, p):\n    return i\n")
    with pytest.raises(PipelineDefinitionError, match=r"myfan\.py has no function 'split'"):
        _compile(CUSTOM, service, tmp_path)


DECODE = """
[[inputs]]
name = "image"
datatype = "BYTES"
shape = [-1]

[[outputs]]
name = "sizes"
datatype = "INT32"
shape = [-1, 2]

[[steps]]
name = "decode"
kind = "decode_image"
inputs = { image = "image" }
outputs = { sizes = "sizes" }
"""


def test_corrupt_jpeg_names_the_input_and_next_succeeds(tmp_path: Path) -> None:
    cv2 = pytest.importorskip("cv2")
    pipeline = compile_pipeline(parse_pipeline(DECODE), tmp_path)
    ok, jpeg = cv2.imencode(".jpg", np.full((30, 40, 3), 128, np.uint8))
    assert ok
    good = jpeg.tobytes()
    with pytest.raises(StepInputError, match="image") as info:
        _run(pipeline, image=np.array([good[: len(good) // 3]], dtype=object))
    assert info.value.code is ErrorCode.INVALID_ARGUMENT
    assert _run(pipeline, image=np.array([good], dtype=object))["sizes"].tolist() == [[30, 40]]



BRANCHES = """
[[inputs]]
name = "x"
datatype = "FP32"
shape = [-1]

[[outputs]]
name = "a"
datatype = "FP32"
shape = [-1]

[[outputs]]
name = "b"
datatype = "FP32"
shape = [-1]

[[steps]]
name = "left"
function = "meet:left"
inputs = { x = "x" }
outputs = { y = "a" }
output_ports = { y = { datatype = "FP32", shape = [-1] } }

[[steps]]
name = "right"
function = "meet:right"
inputs = { x = "x" }
outputs = { y = "b" }
output_ports = { y = { datatype = "FP32", shape = [-1] } }
"""

# Each branch waits for the other to have started: only branches that overlap both finish
# (the 30 s wait is a bound for a broken graph, never reached when it works).
MEET = '''
import threading

barrier = threading.Barrier(2, timeout=30)

def left(inputs, params):
    barrier.wait()
    return {"y": inputs["x"] + 1}

def right(inputs, params):
    barrier.wait()
    return {"y": inputs["x"] * 2}
'''


def test_independent_branches_run_concurrently(tmp_path: Path) -> None:
    (tmp_path / "meet.py").write_text(MEET)
    pipeline = compile_pipeline(parse_pipeline(BRANCHES), tmp_path)
    out = _run(pipeline, x=np.array([1.0, 2.0], np.float32))
    assert out["a"].tolist() == [2.0, 3.0] and out["b"].tolist() == [2.0, 4.0]
    assert pipeline.stats.to_json()["success_count"] == 1


def test_concurrent_requests_batch_in_the_models_scheduler(tmp_path: Path) -> None:
    import time

    from tests.http_helpers import held_engine
    (tmp_path / "repo").mkdir()
    with served(_digits_repo(tmp_path / "repo")) as service:
        pipeline = _compile(GOOD, service, tmp_path)
        mv = service.ready_model("digits")
        assert mv.stats is not None and mv.scheduler is not None
        before = statistics_entry(mv.stats.snapshot())["inference_count"]
        x = np.ones((1, 64), np.float32)

        async def scenario() -> list[dict[str, np.ndarray]]:
            with held_engine(service, "digits") as entered:
                first = asyncio.ensure_future(pipeline.run({"x": x}, CallContext(models=service)))
                assert await asyncio.to_thread(entered.wait, 60)
                rest = [asyncio.ensure_future(pipeline.run({"x": x}, CallContext(models=service))) for _ in range(3)]
                deadline = time.monotonic() + 60
                while mv.scheduler is not None and mv.scheduler.queued < 3:  # all three wait behind the held call
                    assert time.monotonic() < deadline, "pipeline requests never reached the model's queue"
                    await asyncio.sleep(0.01)
            return list(await asyncio.gather(first, *rest))

        results = asyncio.run(scenario())
        assert all(r["top"].shape == (1, 3) for r in results)
        stats = statistics_entry(mv.stats.snapshot())  # read through the statistics, whichever path the steps took
        assert stats["inference_count"] - before == 4
        sizes = [b["batch_size"] for b in stats["batch_stats"]]
        assert max(sizes) >= 2, sizes  # the three queued requests ran together
        assert pipeline.stats.to_json()["success_count"] == 4


@pytest.mark.parametrize("name", ["orientation_classify", "layout_detect", "layout_regions"])
def test_example_pipelines_through_the_service_equal_the_reference(tmp_path: Path, name: str) -> None:
    """The examples of models/ compiled by the graph, their models served by a real
    InferenceService, give what the step-by-step reference gives."""
    pytest.importorskip("cv2", reason="the pipeline extra (opencv-python-headless) is not installed")
    from tests.device.pipeline.examples import EXAMPLES, UnavailableError, model_file, run_pipeline
    from tests.device.pipeline.test_examples import jpeg, page
    repo = tmp_path / "repo"
    try:
        for model in ("layout", "orientation"):
            shutil.copytree(EXAMPLES / model, repo / model)
            shutil.copy(model_file(model), repo / model / "1" / "model.onnx")
    except UnavailableError as exc:
        pytest.skip(str(exc))
    with served(repo) as service:
        folder = EXAMPLES / name / "1"
        pipeline = compile_pipeline(load_pipeline(folder), folder, service.manager.gateway)
        data = jpeg(page(0))  # the steps' own test page: layout regions to find
        batch = np.empty(1, dtype=object)
        batch[:] = [data]
        got = _run(pipeline, service, image=batch)
        want = run_pipeline(name, {"image": batch})
        if name == "layout_regions":  # the fan-out had boxes to crop: the classifier ran on a batch
            assert len(got["crop_index"]) >= 2, got["crop_index"]
        for out in pipeline.outputs:
            assert got[out].shape == want[out].shape, out
            if got[out].dtype == object:
                assert _close_json(got[out].ravel(), want[out].ravel()), (out, got[out], want[out])
            else:
                np.testing.assert_allclose(got[out], want[out], rtol=1e-4, atol=1e-4)


def _close_json(got: np.ndarray, want: np.ndarray) -> bool:
    """BYTES outputs equal item by item, numbers in JSON documents within 1e-3 (the service's
    ORT session and the reference's may round differently)."""
    import json

    def flat(v: object) -> list[object]:
        if isinstance(v, dict):
            return [x for k in sorted(v) for x in [k, *flat(v[k])]]
        if isinstance(v, list):
            return [x for item in v for x in flat(item)]
        return [v]

    def close(x: object, y: object) -> bool:
        if isinstance(x, float) and isinstance(y, float):
            return abs(x - y) <= 1e-3 * max(1.0, abs(y))
        return x == y
    for g, w in zip(got, want, strict=True):
        try:
            p, q = flat(json.loads(g)), flat(json.loads(w))
        except ValueError:
            p, q = [g], [w]
        if len(p) != len(q) or not all(close(x, y) for x, y in zip(p, q, strict=True)):
            return False
    return True
