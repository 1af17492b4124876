"""What a pipeline request holds in the request memory budget, and that it is all given back.

- a client that goes away while one of its steps runs in a worker thread: the step stops at its
  next charge (nothing is allocated for nobody) and the request releases only once that thread has
  ended, so no charge ever lands on a reservation already released (which nothing would release);
- a resize whose output size follows the image (``short_side``, ``limit``) refuses, before
  resizing, an image that would become more than ``max_pixels``, and charges what it allocates:
  a thin image of a few thousand pixels must not become gigabytes.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest

from edged.core.model_versions import ModelState, ModelVersion
from edged.core.pipelines import PipelineRunner, start_pipeline_request
from edged.core.stats import ModelStats
from edged.errors import ResourceExhaustedError
from edged.membudget import MemoryBudget, RequestEndedError, charge, set_current
from edged.pipeline.contract import Port, Step, StepInputError
from edged.pipeline.definition import parse_pipeline
from edged.pipeline.graph import CallContext, Tensors, compile_pipeline
from edged.pipeline.steps import builtin_step
from edged.pipeline.steps._base import BuiltinStep
from edged.protocol.types import InferRequest
from edged.repository.store import VersionEntry

cv2 = pytest.importorskip("cv2", reason="the pipeline extra (opencv-python-headless) is not installed")

from tests.device.pipeline.test_steps_input import bytes_tensor, encoded  # noqa: E402  (needs cv2)

MIB = 1 << 20

GATED = """
[[inputs]]
name = "x"
datatype = "FP32"
shape = [-1]

[[outputs]]
name = "y"
datatype = "FP32"
shape = [-1]

[[steps]]
name = "slow"
kind = "gate"
inputs = { tensor = "x" }
outputs = { tensor = "y" }
"""


class Gate(BuiltinStep):
    """A CPU step that charges 1 MiB, then waits (in its worker thread) for the test before charging
    another: a decode that reads its headers after a long first image. The 30 s waits bound a broken
    run; they are never reached when it works."""

    kind = "gate"
    entered: ClassVar[threading.Event] = threading.Event()
    go: ClassVar[threading.Event] = threading.Event()
    done: ClassVar[threading.Event] = threading.Event()
    refused: ClassVar[list[BaseException]] = []

    def bind(self, inputs: Mapping[str, Port]) -> dict[str, Port]:
        return {"tensor": inputs["tensor"]}

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        try:
            charge(MIB, "the first part")
            Gate.entered.set()
            assert Gate.go.wait(30)
            try:
                charge(MIB, "the second part")
            except RequestEndedError as exc:
                Gate.refused.append(exc)
                raise
            return {"tensor": inputs["tensor"]}
        finally:
            Gate.done.set()


def _lookup(kind: str) -> type[Step]:
    return Gate if kind == "gate" else builtin_step(kind)


class _NoModels:
    async def call_model(self, model: str, version: int | None, inputs: Tensors, context: CallContext) -> Tensors:
        raise AssertionError("this pipeline has no model step")


def _served_pipeline(folder: Path) -> ModelVersion:
    mv = ModelVersion("gated", 1, VersionEntry("gated", 1, folder, pipeline=True))
    mv.pipeline = compile_pipeline(parse_pipeline(GATED), folder, lookup=_lookup)
    mv.stats = ModelStats("gated", 1, "pipeline")
    mv.state = ModelState.READY
    return mv


def test_cancelled_request_stops_its_thread_step_and_releases_after_it(tmp_path: Path) -> None:
    for event in (Gate.entered, Gate.go, Gate.done):
        event.clear()
    Gate.refused.clear()
    mv = _served_pipeline(tmp_path)
    assert mv.stats is not None
    budget = MemoryBudget(64 * MIB)
    runner = PipelineRunner()
    try:
        answer = start_pipeline_request(mv, InferRequest(model="gated", inputs={"x": np.ones(3, np.float32)}),
                                        runner, _NoModels(), budget)
        assert Gate.entered.wait(30)
        assert budget.used == MIB
        answer.cancel()  # the client went away while the step's thread runs
        Gate.go.set()
        assert Gate.done.wait(30)
        deadline = time.monotonic() + 30
        while mv.stats.snapshot().failures_by_code.get("internal", 0) < 1:  # the request ended
            assert time.monotonic() < deadline, mv.stats.snapshot()
            time.sleep(0.01)
        assert budget.used == 0, f"{budget.used} bytes still held by a request that ended"
        assert [type(e) for e in Gate.refused] == [RequestEndedError]  # nothing allocated for nobody
    finally:
        runner.stop()


def _png(width: int, height: int) -> bytes:
    return encoded(np.full((height, width, 3), 200, np.uint8), ".png")


# The ocr example's detector resize: the shorter side raised to 736, sides multiples of 32.
OCR_RESIZE = {"mode": "limit", "limit_side": 736, "limit_type": "min", "multiple_of": 32}


@pytest.mark.parametrize("params", [OCR_RESIZE, {"mode": "short_side", "short": 736}])
def test_thin_image_upscaled_over_the_pixel_limit_is_refused_before_resizing(params: dict[str, object]) -> None:
    """A 2000x20 PNG (40,000 pixels, well under decode_image's limit) would become 73,600x736: 54 M
    pixels, 162 MB of UINT8 and four times that once normalized; a 1x60000 one 44 G pixels."""
    image = bytes_tensor(_png(2000, 20))
    pixels = builtin_step("decode_image")({"color": "BGR"}, Path(".")).run({"image": image})["pixels"]
    resize = builtin_step("resize")(params, Path("."))
    with pytest.raises(StepInputError, match=r"2000x20 image.*73600x736.*40000000-pixel limit") as err:
        resize.run({"pixels": pixels})
    assert err.value.context["input"] == "pixels"
    decode = builtin_step("decode_image")({"color": "BGR", "resize": params}, Path("."))
    with pytest.raises(StepInputError, match=r"73600x736.*40000000-pixel limit") as err:
        decode.run({"image": bytes_tensor(_png(2000, 20))})
    assert err.value.context["input"] == "image"
    narrower = pixels[:, :, :200]  # 200x20 becomes 7,360x736: 5.4 M pixels, under the limit
    assert resize.run({"pixels": narrower})["pixels"].shape == (1, 736, 7360, 3)


def test_resize_charges_its_output_to_the_request() -> None:
    """A 400x20 image raised to 14,720x736 (32 MB) in a request whose budget holds 8 MiB is refused
    by the budget before the resize allocates, as decode_image's images are."""
    pixels = np.full((1, 20, 400, 3), 200, np.uint8)
    resize = builtin_step("resize")(OCR_RESIZE, Path("."))
    budget = MemoryBudget(8 * MIB)
    held = budget.reserve(0, "a request")

    def run() -> None:
        set_current(held)
        resize.run({"pixels": pixels})

    with pytest.raises(ResourceExhaustedError, match="resiz"):
        contextvars.copy_context().run(run)
    held.release()
    assert budget.used == 0


SPLIT = """
[[inputs]]
name = "x"
datatype = "FP32"
shape = [-1, 4]

[[outputs]]
name = "y"
datatype = "FP32"
shape = [-1, 4]

[[steps]]
name = "model"
model = "pairs"
inputs = { x = "x" }
outputs = { y = "y" }
"""


class _Pairs:
    """A model of max_batch_size 2 (the gateway) whose first call fails at once while the others wait in
    its queue (the caller): each waiting call says whether it was called off."""

    def __init__(self) -> None:
        self.calls = 0
        self.called_off = 0
        self.still_waiting = 0

    def model_ports(self, model: str, version: int | None) -> tuple[dict[str, Port], dict[str, Port]]:
        return {"x": Port("FP32", (-1, 4))}, {"y": Port("FP32", (-1, 4))}

    def max_batch_size(self, model: str, version: int | None) -> int:
        return 2

    def model_metadata(self, model: str, version: int | None) -> dict[str, str]:
        return {}

    async def call_model(self, model: str, version: int | None, inputs: Tensors, context: CallContext) -> Tensors:
        self.calls += 1
        if self.calls == 1:
            raise ResourceExhaustedError("the first chunk is refused")
        self.still_waiting += 1
        try:
            await asyncio.get_running_loop().create_future()  # queued behind a busy engine, never answered
        except asyncio.CancelledError:
            self.called_off += 1
            raise
        finally:
            self.still_waiting -= 1
        raise AssertionError("unreachable")


def test_a_failed_chunk_calls_off_the_rest_of_the_split_model_step(tmp_path: Path) -> None:
    """6 rows into a model of max_batch_size 2 are 3 calls; when one fails the request fails, and the
    two others are called off before it answers, instead of running later on the model for nobody."""
    pairs = _Pairs()
    pipeline = compile_pipeline(parse_pipeline(SPLIT), tmp_path, pairs)

    async def scenario() -> None:
        with pytest.raises(ResourceExhaustedError, match="first chunk"):
            await pipeline.run({"x": np.ones((6, 4), np.float32)}, CallContext(models=pairs))
        assert pairs.calls == 3
        assert (pairs.called_off, pairs.still_waiting) == (2, 0)

    asyncio.run(scenario())
