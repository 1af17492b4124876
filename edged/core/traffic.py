"""What a model version really serves: engine runs counted by input shapes and batch size.

The engine was chosen on some shapes and batch sizes (declared, or made up); the
traffic that comes may look nothing like them (a detector fed 1280x720 frames after a
320x320 warm-up, a batcher forming batches of 8). The scheduler notes every engine
run that succeeded here, with one sample of each new shape kept as real data to
measure on; :mod:`edged.core.chooser` compares the mix with the one the choice was
made on and measures again when they differ.

Bounded: at most ``MAX_KEYS`` distinct shape/batch keys are counted (later new ones
are ignored until ``reset``) and a kept sample is at most ``MAX_SAMPLE_BYTES``.
Runs of the engine benchmark and the self-test never pass through here.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

MAX_KEYS = 32
MAX_SAMPLE_BYTES = 16 << 20

Shapes = tuple[tuple[str, tuple[int, ...]], ...]  # per input, sorted by name: its shape without the batch dimension


@dataclass(frozen=True)
class Seen:
    """One shape signature at one batch size: how many engine runs, and one real sample (batch 1)."""

    shapes: Shapes
    batch: int
    runs: int
    sample: Mapping[str, np.ndarray] | None


class TrafficMix:
    """Engine runs per (per-sample shapes, batch size); cheap enough to call on every run."""

    def __init__(self, batched: bool) -> None:
        self.batched = batched
        self._counts: dict[tuple[Shapes, int], int] = {}
        self._samples: dict[Shapes, dict[str, np.ndarray]] = {}
        self._lock = threading.Lock()  # only for new keys and reads; counting an old key is one dict store

    def record(self, inputs: Mapping[str, np.ndarray]) -> None:
        batched = self.batched
        if batched:
            batch = 1
            for a in inputs.values():
                batch = a.shape[0] if a.ndim else 1
                break
            named = [(n, a.shape[1:]) for n, a in inputs.items()]
        else:
            batch = 1
            named = [(n, a.shape) for n, a in inputs.items()]
        if len(named) > 1:  # one input (most models) is sorted already: this runs on every inline request
            named.sort()
        shapes = tuple(named)
        key = (shapes, batch)
        counts = self._counts
        n = counts.get(key)
        if n is not None:
            counts[key] = n + 1  # a lost increment under a race only blurs a statistic
            return
        with self._lock:
            if len(counts) >= MAX_KEYS:
                return
            counts[key] = counts.get(key, 0) + 1
            if shapes not in self._samples:
                first = {name: np.array(a[:1] if batched and a.ndim else a, copy=True) for name, a in inputs.items()}
                if sum(a.nbytes for a in first.values()) <= MAX_SAMPLE_BYTES:
                    self._samples[shapes] = first

    def snapshot(self) -> list[Seen]:
        with self._lock:
            items = list(self._counts.items())
            samples = dict(self._samples)
        return [Seen(shapes, batch, runs, samples.get(shapes)) for (shapes, batch), runs in items]

    @staticmethod
    def since(now: list[Seen], before: list[Seen]) -> list[Seen]:
        """The runs counted after ``before`` was taken (a window of recent traffic)."""
        old = {(s.shapes, s.batch): s.runs for s in before}
        out = []
        for s in now:
            runs = s.runs - old.get((s.shapes, s.batch), 0)
            if runs > 0:
                out.append(Seen(s.shapes, s.batch, runs, s.sample))
        return out
