"""Shared fixtures: the bundled models copied into throwaway repositories, configs, held-out digits."""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
MODELS = REPO_ROOT / "models"
EDGED = [str(REPO_ROOT / ".venv" / "bin" / "edged")] if (REPO_ROOT / ".venv/bin/edged").exists() else [
    sys.executable, "-m", "edged"]


def sha256_file(path: Path) -> str:
    """The hex SHA-256 of a file, as a model.toml ``sha256`` names it."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load_make_models() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_models", REPO_ROOT / "tools" / "make_models.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["make_models"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def digits_holdout() -> tuple[np.ndarray, np.ndarray]:
    """Held-out digits images (raw 0-16 values, float32) and their labels."""
    _, x_test, _, y_test = load_make_models().digits_split()
    return np.asarray(x_test, dtype=np.float32), np.asarray(y_test)


@pytest.fixture
def model_repo(tmp_path: Path) -> Callable[..., Path]:
    """Copy bundled models into a fresh repository: ``model_repo("digits", "mobilenet")``."""

    def make(*names: str, root: Path | None = None) -> Path:
        repo = root or tmp_path / "models"
        repo.mkdir(parents=True, exist_ok=True)
        for n in names or ("digits", "mobilenet"):
            shutil.copytree(MODELS / n, repo / n)
        return repo

    return make


def device_config(folder: Path, repo: Path, extra: str = "", name: str = "edged.toml", *,
                  device_id: str = "test-device") -> Path:
    """An edged.toml in ``folder`` whose state and runtime dirs live there too; extra TOML is appended
    (its first lines still belong to ``[device]``)."""
    cfg = folder / name
    cfg.write_text(textwrap.dedent(f"""
        [device]
        id = "{device_id}"
        state_dir = "{folder / 'state'}"
        runtime_dir = "{folder / 'run'}"
        model_repository = "{repo}"
        """) + textwrap.dedent(extra))
    return cfg


@pytest.fixture
def write_config(tmp_path: Path) -> Callable[..., Path]:
    """``device_config`` in tmp_path: ``write_config(repo, extra)``."""

    def write(repo: Path, extra: str = "", name: str = "edged.toml") -> Path:
        return device_config(tmp_path, repo, extra, name)

    return write
