"""The engine-choice benchmarks' corpus: ten real public models from PyPI wheels, with the inputs they see.

tests/corpus.py's six single-input models (detectors with dynamic height and width, OCR
recognition with a dynamic width, classifiers, a static layout detector), plus Silero VAD (a
recurrent model: audio, a state carried from call to call and a 0-d INT64 sample rate), magika
(INT32 byte values), and ddddocr's recogniser (dynamic width, batch fixed at 1) and detector.
Each is written as a variant-only manifest declaring the shapes it really sees.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tests import corpus
from tests.wheel_cache import fetch_wheel


@dataclass(frozen=True)
class Input:
    shape: tuple[int, ...]  # batch dimension included
    dtype: str = "float32"
    value: float | None = None  # a constant (a sample rate); else random data in [0, 1) (ints: zeros)


@dataclass(frozen=True)
class Model:
    name: str
    requirement: str
    member: str
    inputs: dict[str, Input]
    what: str
    batched: bool  # every input and output starts dynamic: max_batch_size is auto-completed (4)
    batch: int = 4  # the batch the scheduler forms under load (the auto-completed maximum)
    other: dict[str, tuple[int, ...]] = field(default_factory=dict)  # a shape unlike the declared one, per input

    def fetch(self) -> Path:
        return fetch_wheel(self.requirement) / self.member

    def sample(self, batch: int = 1, shapes: dict[str, tuple[int, ...]] | None = None) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(0)
        out = {}
        for n, spec in self.inputs.items():
            shape = (shapes or {}).get(n, spec.shape)
            if self.batched:
                shape = (batch, *shape[1:])
            if spec.value is not None:
                out[n] = np.full(shape, spec.value, dtype=spec.dtype)
            elif np.dtype(spec.dtype).kind == "f":
                out[n] = rng.random(shape, dtype=np.float32).astype(spec.dtype)
            else:
                out[n] = np.zeros(shape, dtype=spec.dtype)
        return out


def _from_corpus(m: corpus.CorpusModel, other: tuple[int, ...]) -> Model:
    return Model(m.name, m.requirement, m.member, {m.input: Input(m.shape)}, m.what, m.batched,
                 other={m.input: other})


_BASE = {m.name: m for m in corpus.CORPUS}
MODELS = [
    _from_corpus(_BASE["nudenet"], (1, 3, 640, 640)),
    _from_corpus(_BASE["layout"], (1, 3, 800, 608)),
    _from_corpus(_BASE["orientation"], (1, 3, 224, 224)),
    _from_corpus(_BASE["ocr_det"], (1, 3, 960, 960)),
    _from_corpus(_BASE["ocr_rec"], (1, 3, 48, 1280)),
    _from_corpus(_BASE["ocr_cls"], (1, 3, 48, 192)),
    Model("vad", "silero-vad==6.2.3", "silero_vad/data/silero_vad.onnx",
          {"input": Input((1, 512)), "state": Input((2, 1, 128)), "sr": Input((), "int64", 16000)},
          "Silero VAD: recurrent state, 0-d INT64 sample rate", batched=False,
          other={"input": (1, 4096)}),
    Model("magika", "magika==1.0.3", "magika/models/standard_v3_3/model.onnx",
          {"bytes": Input((1, 2048), "int32")}, "magika file-type classifier, INT32 byte input", batched=True),
    Model("ddddocr", "ddddocr==1.6.1", "ddddocr/common.onnx", {"input1": Input((1, 1, 64, 256))},
          "ddddocr captcha recogniser, dynamic width", batched=False, other={"input1": (1, 1, 64, 1024)}),
    Model("ddddocr_det", "ddddocr==1.6.1", "ddddocr/common_det.onnx", {"images": Input((1, 3, 416, 416))},
          "ddddocr detector (static shape)", batched=False),
]


def fetch(models: list[Model]) -> dict[str, Path]:
    return {m.name: m.fetch() for m in models}


def write_version(repo: Path, m: Model, onnx: Path) -> Path:
    """``<repo>/<name>/1``: a variant-only manifest declaring the real shapes (and constant values)."""
    vdir = repo / m.name / "1"
    vdir.mkdir(parents=True, exist_ok=True)
    target = vdir / "model.onnx"
    target.write_bytes(onnx.read_bytes())
    digest = hashlib.sha256(target.read_bytes()).hexdigest()
    text = f'description = "{m.what}"\n[[variants]]\nfile = "model.onnx"\nformat = "onnx"\nsha256 = "{digest}"\n'
    for n, spec in m.inputs.items():
        shape = list(spec.shape[1:] if m.batched else spec.shape)
        text += f"\n[warmup.shapes.{n}]\nshape = {shape}\n"
        if spec.value is not None:
            text += f"value = {spec.value}\n"
    (vdir / "model.toml").write_text(text)
    return vdir
