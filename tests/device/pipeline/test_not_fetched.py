"""A repository whose example model files are not fetched says so once, at INFO, with the command that
fetches them; neither the models nor the pipelines that use them log an ERROR. A model without a
``fetch`` command whose file is missing is still an ERROR."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from edged.config import ModelsSection
from edged.core.manager import ModelManager
from edged.profiles import BackendPreference
from tests.device.pipeline.examples import EXAMPLES

ORT_CPU = [BackendPreference(backend="onnxruntime", device="CPU", precisions=["fp32"])]


def test_unfetched_examples_are_one_info_line_not_errors(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("cv2", reason="the pipeline extra (opencv-python-headless) is not installed")
    repo = tmp_path / "models"
    for name in ("layout", "orientation", "layout_detect", "orientation_classify", "layout_regions"):
        shutil.copytree(EXAMPLES / name, repo / name, ignore=shutil.ignore_patterns("model.onnx"))
    shutil.copytree(EXAMPLES / "orientation", repo / "mine", ignore=shutil.ignore_patterns("model.onnx"))
    toml = repo / "mine" / "1" / "model.toml"
    toml.write_text("\n".join(line for line in toml.read_text().splitlines() if not line.startswith("fetch =")))
    manager = ModelManager(repo, ModelsSection(), ORT_CPU)
    with caplog.at_level(logging.DEBUG, logger="edged"):
        mvs = manager.load_all()
    try:
        states = {mv.name: mv.state.value for mv in mvs}
        assert set(states.values()) == {"unavailable"}, states
        reasons = {mv.name: mv.reason or "" for mv in mvs}
        assert "tools/fetch_example_models.py" in reasons["layout"], reasons
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and "model=mine" in errors[0] and "is missing" in errors[0], errors
        said = [r.getMessage() for r in caplog.records
                if r.levelno == logging.INFO and "tools/fetch_example_models.py" in r.getMessage()]
        assert len(said) == 1 and "layout, orientation" in said[0], said
    finally:
        manager.shutdown()
