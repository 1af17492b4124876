"""An explicit ``max_batch_size`` without a ``[batching]`` section batches dynamically with the defaults;
``[batching] dynamic = false`` turns it off and says so at load and in the model's status."""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import numpy as np

from edged.config import ModelsSection
from edged.core.manager import ModelManager
from edged.core.service import InferenceService
from edged.profiles import BackendPreference
from edged.protocol.types import InferRequest
from edged.protocol.v2_models import statistics_entry
from tests.conftest import MODELS
from tests.http_helpers import held_engine

ORT_CPU = [BackendPreference(backend="onnxruntime", device="CPU", precisions=["fp32"])]


def _digits(repo: Path, batching: str) -> None:
    shutil.copytree(MODELS / "digits", repo / "digits")
    toml = repo / "digits" / "1" / "model.toml"
    text = re.sub(r"(?ms)^\[batching\]\n.*?(?=^\[instances\])", batching, toml.read_text())
    assert "max_batch_size = 64" in text and "preferred_batch_sizes" not in text
    toml.write_text(text)


def _served(repo: Path) -> InferenceService:
    manager = ModelManager(repo, ModelsSection(), ORT_CPU)
    manager.load_all()
    return InferenceService(manager)


def test_explicit_max_batch_size_batches_with_defaults(tmp_path: Path) -> None:
    _digits(tmp_path, "")
    service = _served(tmp_path)
    try:
        mv = service.ready_model("digits")
        assert mv.scheduler is not None and mv.stats is not None
        assert statistics_entry(mv.stats.snapshot())["batching"]["mode"] == "on"
        assert "notes" not in mv.status()
        x = np.ones((1, 64), np.float32)
        with held_engine(service, "digits") as entered:
            first = service.submit(InferRequest(model="digits", inputs={"pixels": x}))
            assert entered.wait(60)
            rest = [service.submit(InferRequest(model="digits", inputs={"pixels": x})) for _ in range(3)]
            deadline = time.monotonic() + 60
            while mv.scheduler.queued < 3:
                assert time.monotonic() < deadline
                time.sleep(0.01)
        for f in (first, *rest):
            assert f.result(60).outputs["probabilities"].shape == (1, 10)
        sizes = [b["batch_size"] for b in statistics_entry(mv.stats.snapshot())["batch_stats"]]
        assert max(sizes) >= 2, sizes  # the three queued requests ran as one batch
    finally:
        service.manager.shutdown()


def test_dynamic_false_is_off_and_said(tmp_path: Path) -> None:
    _digits(tmp_path, "[batching]\ndynamic = false\n\n")
    service = _served(tmp_path)
    try:
        mv = service.ready_model("digits")
        assert mv.stats is not None and statistics_entry(mv.stats.snapshot())["batching"]["mode"] == "off"
        notes = {s["name"]: s for s in service.manager.statuses()}["digits"].get("notes", [])
        assert any("dynamic batching off" in n for n in notes), notes
    finally:
        service.manager.shutdown()
