"""A real InferenceService in the test's own process, for tests that drive the service directly."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from edged.config import ModelsSection
from edged.core.manager import ModelManager
from edged.core.service import InferenceService
from edged.profiles import BackendPreference

ORT_CPU = [BackendPreference(backend="onnxruntime", device="CPU", precisions=["fp32"])]


@contextmanager
def served(repo: Path) -> Iterator[InferenceService]:
    """Every model of ``repo`` loaded on ONNX Runtime's CPU engine, served, and shut down afterwards."""
    manager = ModelManager(repo, ModelsSection(), ORT_CPU)
    manager.load_all()
    try:
        yield InferenceService(manager)
    finally:
        manager.shutdown()
