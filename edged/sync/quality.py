"""Score a loaded version on a labelled evaluation set (``[evaluation]`` in model.toml).

The samples go straight to the version's engine, never through the scheduler, so they
are not counted as traffic: the trial's request minimum and the telemetry see only real
clients. Sizes are checked before anything is read into memory: the set comes from a
signed, digest-checked release, but a mistake in it must fail the update, not the daemon.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edged.core.public import ModelVersion
from edged.errors import EdgedError, ErrorCode
from edged.repository.manifest import Evaluation

MAX_EVAL_BYTES = 256 << 20
MAX_SAMPLES = 100_000


class EvaluationError(EdgedError):
    """The evaluation set is unusable, or the version could not answer it."""

    code = ErrorCode.FAILED_PRECONDITION


@dataclass(frozen=True)
class Score:
    metric: str
    samples: int
    score: float


def _load(folder: Path, ev: Evaluation) -> tuple[dict[str, np.ndarray], np.ndarray]:
    paths = [folder / ev.inputs, folder / ev.labels]
    try:
        total = sum(p.stat().st_size for p in paths)
    except OSError as e:
        raise EvaluationError(f"evaluation set: {e.strerror or e}: {e.filename}") from None
    if total > MAX_EVAL_BYTES:
        raise EvaluationError(f"evaluation set: {total} bytes, at most {MAX_EVAL_BYTES}")
    try:
        labels = np.load(paths[1], allow_pickle=False)
        with np.load(paths[0], allow_pickle=False) as z:
            inputs = {k: z[k] for k in z.files}
    except (OSError, ValueError) as e:
        raise EvaluationError(f"evaluation set unreadable: {e}") from None
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer) or not 0 < len(labels) <= MAX_SAMPLES:
        raise EvaluationError(f"evaluation labels {ev.labels}: expected 1 to {MAX_SAMPLES} integer class ids, "
                              f"got shape {list(labels.shape)} {labels.dtype}")
    for name, arr in inputs.items():
        if arr.ndim < 1 or arr.shape[0] != len(labels):
            raise EvaluationError(f"evaluation input {name!r}: {list(arr.shape)}, expected {len(labels)} samples "
                                  "on the first axis")
    return inputs, labels


def score(mv: ModelVersion, folder: Path, ev: Evaluation) -> Score:
    """Top-1 accuracy of ``mv`` on the set in ``folder`` (which may be another version's folder)."""
    engine = mv.engine
    if engine is None:
        raise EvaluationError(f"version {mv.version} has no engine loaded")
    inputs, labels = _load(folder, ev)
    mbs = mv.manifest.max_batch_size or mv.auto_max_batch_size or 0
    step = max(1, mbs)
    correct = 0
    for i in range(0, len(labels), step):
        # without a batch dimension one sample per call
        batch = {k: (v[i:i + step] if mbs > 0 else v[i]) for k, v in inputs.items()}
        try:
            out = engine.infer(batch)
        except Exception as e:
            raise EvaluationError(f"version {mv.version} failed on the evaluation set: {e}") from None
        name = ev.output or next(iter(out), None)
        if name is None or name not in out:
            raise EvaluationError(f"evaluation output {name!r} not among the outputs ({sorted(out)})")
        pred = np.asarray(out[name])
        pred = pred.reshape(-1, pred.shape[-1]) if pred.ndim > 1 else pred.reshape(1, -1)
        want = labels[i:i + step] if mbs > 0 else labels[i:i + 1]
        correct += int(np.sum(np.argmax(pred, axis=-1)[: len(want)] == want))
    return Score(ev.metric, len(labels), correct / len(labels))
