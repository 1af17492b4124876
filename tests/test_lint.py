"""The project's own quality gates run with the suite, so CI enforces them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def _tool(name: str) -> str:
    path = BIN / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if not found:
        pytest.fail(f"{name} is not installed: run ./install.sh --dev")
    return found


def test_ruff_is_clean() -> None:
    r = subprocess.run([_tool("ruff"), "check", "edged", "tests", "tools", "bench"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy_is_clean_on_the_package() -> None:
    r = subprocess.run([_tool("mypy"), "edged"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-2000:]
