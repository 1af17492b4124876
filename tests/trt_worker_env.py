"""A Python for the TensorRT engine worker in tests: JetPack 5's 3.8 where one is installed, numpy, the stand-in.

On a JetPack 5 device the worker runs under the system Python 3.8 with numpy and
TensorRT. Here it runs under a real CPython 3.8 when this machine has one
(``EDGED_TEST_PY38``, ``python3.8`` on PATH, or a pyenv build), in a venv under
the test cache with numpy from the package index and the TensorRT stand-in
(tests/trt_standin) on its path; without a 3.8 the current interpreter takes its
place and the 3.8-only test says it skipped.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.wheel_cache import UnavailableError, cache_root

STANDIN = Path(__file__).parent / "trt_standin"


def _works(python: str) -> tuple[int, int] | None:
    try:
        out = subprocess.run([python, "-c", "import sys; print(sys.version_info[0], sys.version_info[1])"],
                             capture_output=True, text=True, timeout=30, check=True).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return int(out[0]), int(out[1])


def find_python38() -> str | None:
    """A working CPython 3.8 on this machine, or None."""
    candidates = [os.environ.get("EDGED_TEST_PY38", ""), shutil.which("python3.8") or ""]
    pyenv = os.environ.get("PYENV_ROOT", str(Path.home() / ".pyenv"))
    candidates += sorted(glob.glob(f"{pyenv}/versions/3.8*/bin/python3.8"), reverse=True)
    return next((c for c in candidates if c and _works(c) == (3, 8)), None)


def worker_python(base: str) -> Path:
    """A venv of ``base`` with numpy and the stand-in, made once per interpreter and cached."""
    version = _works(base)
    if version is None:
        raise UnavailableError(f"{base} does not run")
    venv = cache_root() / f"trt-worker-py{version[0]}{version[1]}"
    python = venv / "bin" / "python"
    stamp = venv / ".edged-ready"
    if not stamp.exists():
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([base, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=120)
        numpy = "numpy<1.25" if version == (3, 8) else "numpy"  # 1.24 is numpy's last release for 3.8
        r = subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", numpy],
                           capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise UnavailableError(f"pip could not install {numpy} for Python {version}: {r.stderr.strip()[-300:]}")
        stamp.write_text(json.dumps({"base": base}))
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True, timeout=30).stdout.strip()
    # Written every time: the checkout (and so the stand-in's path) may have moved since the venv was made.
    (Path(site) / "edged-trt-standin.pth").write_text(f"{STANDIN}\n")
    return python


def default_worker_python() -> tuple[Path, bool]:
    """(the worker's Python, whether it is a real 3.8)."""
    py38 = find_python38()
    return worker_python(py38 or sys.executable), py38 is not None
