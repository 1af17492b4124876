"""A pipeline of CPU steps only (no model call) keeps to its request's deadline.

The deadline used to be checked only where a step called a model through the scheduler: a chain of
normalize/layout steps over a large image answered long after the caller's deadline. Now it is
checked before every step: a request whose deadline passes mid-chain fails with DEADLINE_EXCEEDED,
naming the pipeline and the step it did not start, and the pipeline serves the next request.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from edged.errors import DeadlineExceededError, ErrorCode
from edged.protocol.types import InferRequest
from tests.in_process import served

LAYOUT_STEPS = 12  # alternating CHW/HWC transposes of a 1024x1024x3 FP32 image (12 MB each)

CPU_CHAIN = f"""
[[inputs]]
name = "pixels"
datatype = "UINT8"
shape = [-1, -1, -1, 3]

[[outputs]]
name = "t{LAYOUT_STEPS}"
datatype = "FP32"
shape = [-1, -1, -1, -1]

[[steps]]
name = "norm"
kind = "normalize"
inputs = {{ pixels = "pixels" }}
outputs = {{ tensor = "t0" }}
""" + "".join(f"""
[[steps]]
name = "layout{i}"
kind = "layout"
inputs = {{ tensor = "t{i - 1}" }}
outputs = {{ tensor = "t{i}" }}
params = {{ target = "{'CHW' if i % 2 else 'HWC'}" }}
""" for i in range(1, LAYOUT_STEPS + 1))


def test_cpu_only_chain_fails_at_its_deadline(tmp_path: Path) -> None:
    """A 1 ms deadline against a chain of 13 CPU steps over a 1024x1024 image (tens of ms even on a
    fast idle host): DEADLINE_EXCEEDED naming the pipeline and a step; the next request, with a
    roomy deadline, is answered in full."""
    repo = tmp_path / "repo"
    (repo / "cpu_chain" / "1").mkdir(parents=True)
    (repo / "cpu_chain" / "1" / "pipeline.toml").write_text(CPU_CHAIN)
    image = np.random.default_rng(0).integers(0, 256, (1, 1024, 1024, 3), dtype=np.uint8)
    with served(repo) as service:
        mv = service.ready_model("cpu_chain")
        assert mv.pipeline is not None and not mv.pipeline.models  # CPU steps only
        late = service.submit(InferRequest(model="cpu_chain", inputs={"pixels": image},
                                           deadline=time.monotonic() + 0.001))
        with pytest.raises(DeadlineExceededError) as caught:
            late.result(60)
        assert caught.value.code is ErrorCode.DEADLINE_EXCEEDED
        message = caught.value.message
        assert "'cpu_chain'" in message, message
        assert "step '" in message or "before it started" in message, message
        roomy = service.submit(InferRequest(model="cpu_chain", inputs={"pixels": image},
                                            deadline=time.monotonic() + 60)).result(60)
        out = roomy.outputs[f"t{LAYOUT_STEPS}"]
        assert out.shape == (1, 1024, 1024, 3) and out.dtype == np.float32
        np.testing.assert_allclose(out, image.astype(np.float32) / 255.0, rtol=1e-6)
        assert mv.stats is not None
        counts = mv.stats.snapshot()
        assert counts.failures_by_code == {"deadline_exceeded": 1}, counts.failures_by_code
        assert counts.success.count == 1
