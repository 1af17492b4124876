"""A custom step's own helpers and vendored pure-Python packages, from its version folder, on a real service.

- a step module imports a vendored package and a helper of its folder *relatively*; listed with
  their digests, the pipeline serves and answers with them (the helper imported lazily at run time);
- a vendored file not listed under [[files]] refuses the pipeline at load, naming it;
- the bytes executed are the bytes checked: a helper changed after load fails the request that
  would import it, naming the file, and the daemon serves on;
- a vendored package is private to its folder: an absolute ``import minilib`` does not find it.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import numpy as np
import pytest

from edged.errors import InternalError
from edged.protocol.types import InferRequest
from tests.conftest import MODELS
from tests.in_process import served

PIPELINE = """
[[inputs]]
name = "x"
datatype = "FP32"
shape = [-1, 64]

[[outputs]]
name = "probs"
datatype = "FP32"
shape = [-1, 10]

[[steps]]
name = "prep"
function = "prep:run"
inputs = { x = "x" }
outputs = { y = "y" }
output_ports = { y = { datatype = "FP32", shape = [-1, 64] } }

[[steps]]
name = "classifier"
model = "digits"
inputs = { pixels = "y" }
outputs = { probabilities = "probs" }
"""

FILES = {
    "prep.py": "from .vendor.minilib import double\n\n\ndef run(inputs, params):\n"
               "    from . import late  # imported when the first request runs\n"
               "    return {'y': late.clip(double(inputs['x']))}\n",
    "late.py": "import numpy as np\n\n\ndef clip(x):\n    return np.minimum(x, np.float32(16))\n",
    "vendor/__init__.py": "",
    "vendor/minilib/__init__.py": "from .core import double\n\n__all__ = ['double']\n",
    "vendor/minilib/core.py": "def double(x):\n    return x * 2\n",
}


def _version(repo: Path, name: str, files: dict[str, str], unlisted: tuple[str, ...] = ()) -> Path:
    folder = repo / name / "1"
    listing = ""
    for rel, text in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(text)
        if rel not in unlisted:
            listing += f'[[files]]\nfile = "{rel}"\nsha256 = "{hashlib.sha256(text.encode()).hexdigest()}"\n\n'
    (folder / "pipeline.toml").write_text(listing + PIPELINE)
    return folder



def test_custom_step_imports_its_listed_vendored_package(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(MODELS / "digits", repo / "digits")
    good = _version(repo, "vendored", FILES)
    _version(repo, "vendored_unlisted", FILES, unlisted=("vendor/minilib/core.py",))
    _version(repo, "vendored_absolute", {**FILES, "prep.py": FILES["prep.py"].replace(
        "from .vendor.minilib import double", "from minilib import double")})
    x = np.random.default_rng(3).uniform(0, 12, (3, 64)).astype(np.float32)
    with served(repo) as service:
        status = {s["name"]: s for s in service.manager.statuses()}
        assert status["vendored"]["state"] == "ready", status["vendored"]
        unlisted = str(status["vendored_unlisted"]["reason"])
        assert status["vendored_unlisted"]["state"] != "ready"
        assert "vendor/minilib/core" in unlisted and "not listed under [[files]]" in unlisted, unlisted
        absolute = str(status["vendored_absolute"]["reason"])
        assert status["vendored_absolute"]["state"] != "ready"
        assert "No module named 'minilib'" in absolute, absolute

        (good / "late.py").write_text(FILES["late.py"].replace("16", "15"))  # changed after the load
        with pytest.raises(InternalError, match=r"'late\.py' does not match its listed sha256"):
            service.infer(InferRequest(model="vendored", inputs={"x": x}), timeout=60)
        (good / "late.py").write_text(FILES["late.py"])
        got = service.infer(InferRequest(model="vendored", inputs={"x": x}), timeout=60).outputs["probs"]
        want = service.infer(InferRequest(model="digits", inputs={"pixels": np.minimum(x * 2, 16)}),
                             timeout=60).outputs["probabilities"]
        np.testing.assert_allclose(got, want, rtol=1e-6)
