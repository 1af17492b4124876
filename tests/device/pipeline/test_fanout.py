"""A pipeline's model steps under the consumer's limits and the request's deadline, on a real service.

- a fan-out larger than the next model's ``max_batch_size`` is split into calls of at most that
  size through the model's scheduler, answers in order, and the pipeline says so at load;
- the request's deadline reaches the model steps: a pipeline request whose model call waits past
  it fails with a deadline error instead of running late.
"""

from __future__ import annotations

import re
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from edged.core.types import InferRequest
from edged.errors import DeadlineExceededError
from tests.conftest import MODELS
from tests.device.pipeline.test_graph import HEAD, _close_json, _served

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
    with _served(repo) as service:
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
        sizes = [b["batch_size"] for b in stats.to_triton()["batch_stats"]]
        assert sizes and max(sizes) <= 2, sizes


def test_request_deadline_reaches_the_model_step(tmp_path: Path) -> None:
    """A pipeline request whose model call waits behind a held engine past the request's deadline
    fails with a deadline error; the same wait without a deadline is answered."""
    from tests.http_helpers import held_engine
    repo = tmp_path / "repo"
    shutil.copytree(MODELS / "digits", repo / "digits")
    (repo / "top_digit" / "1").mkdir(parents=True)
    (repo / "top_digit" / "1" / "pipeline.toml").write_text(DIGITS_PIPELINE)
    x = np.ones((1, 64), np.float32)
    with _served(repo) as service:
        mv = service.ready_model("digits")
        assert mv.scheduler is not None
        with held_engine(service, "digits") as entered:
            first = service.submit(InferRequest(model="digits", inputs={"pixels": x}))
            assert entered.wait(60)
            late = service.submit(InferRequest(model="top_digit", inputs={"x": x},
                                               deadline=time.monotonic() + 0.3))
            patient = service.submit(InferRequest(model="top_digit", inputs={"x": x}))
            deadline = time.monotonic() + 60
            while mv.scheduler.queued < 2:  # both pipeline requests wait in the model's queue
                assert time.monotonic() < deadline, "pipeline requests never reached the model's queue"
                time.sleep(0.01)
            threading.Event().wait(0.5)  # past the first one's deadline, still held
        first.result(60)
        with pytest.raises(DeadlineExceededError):
            late.result(60)
        assert patient.result(60).outputs["top"].shape == (1, 1)
