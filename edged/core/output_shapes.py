"""Declared output shapes against what the engine answers: a contradiction is logged once and noted.

A model file may declare an output shape its graph does not produce (ddddocr declares
``[1, -1]`` and answers ``[20, 1, 8210]``). Clients that size buffers from the metadata
(shared-memory outputs, Triton's clients) then misread the answers, so the first answers of
each model version are compared with the declared shapes; a contradiction is logged once and
kept as the version's note (``/v2/models/{m}``, ``edged models list``, ``edged status``).
The answers are still served as the engine gives them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from edged.repository.manifest import TensorSpec

log = logging.getLogger(__name__)

CHECKED_RUNS = 16  # then the check stops: the hot path pays one attribute test per run


class OutputShapeCheck:
    """Compares a version's first answers with its declared outputs (batch dimension excluded when batched)."""

    def __init__(self, label: str, outputs: Sequence[TensorSpec], *, batched: bool,
                 on_note: Callable[[str], None]) -> None:
        self._label = label
        self._declared = {t.name: tuple(t.shape) for t in outputs}
        self._skip = 1 if batched else 0
        self._on_note = on_note
        self._left = CHECKED_RUNS

    def see(self, outputs: Mapping[str, np.ndarray]) -> bool:
        """Check one run's answers; True when the check is done (a contradiction noted, or enough runs seen)."""
        for name, arr in outputs.items():
            want = self._declared.get(name)
            if want is None:
                continue
            got = arr.shape[self._skip:]
            if len(got) != len(want) or any(w >= 0 and w != g for w, g in zip(want, got, strict=False)):
                shown = [-1, *want] if self._skip else list(want)
                note = (f"output {name!r} is declared with shape {shown} but the engine answers "
                        f"{list(arr.shape)}; the answers are served as the engine gives them, so clients that "
                        "size outputs from this metadata (shared memory) must allow for it")
                log.warning("%s: %s", self._label, note)
                self._on_note(note)
                return True
        self._left -= 1
        return self._left <= 0
