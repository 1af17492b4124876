"""Tell an input the engine cannot take (400, naming the input and dimension) from an internal fault.

Validation against the declared tensors cannot know every limit of a model with dynamic
dimensions (a reflect pad needs enough samples, an index must be inside a table). When the
engine fails, the input is to blame if the engine's library says so, or if the request's
shapes differ from shapes this engine last ran with; otherwise it is an internal fault (500).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from edged.errors import EdgedError, EngineInputError, InternalError, InvalidInputError

_MAX_MESSAGE = 400


class GoodShapes:
    """The per-input shapes (batch dimension excluded when batched) the engine last ran with."""

    def __init__(self, batched: bool) -> None:
        self._skip = 1 if batched else 0
        self._good: dict[str, tuple[int, ...]] = {}

    def record(self, inputs: Mapping[str, np.ndarray]) -> None:
        good = self._good
        for name, arr in inputs.items():
            shape = arr.shape[self._skip:]
            if good.get(name) != shape:
                good[name] = shape

    def differences(self, inputs: Mapping[str, np.ndarray]) -> tuple[list[str], bool]:
        """What differs from the known-good shapes, and whether any good shape was known at all."""
        out: list[str] = []
        known = bool(self._good)
        for name, arr in inputs.items():
            shape = arr.shape[self._skip:]
            good = self._good.get(name)
            if good is None or good == shape:
                continue
            if len(good) != len(shape):
                out.append(f"input {name!r} has shape {list(arr.shape)}")
                continue
            for i, (have, was) in enumerate(zip(shape, good, strict=True)):
                if have != was:
                    out.append(f"input {name!r} dimension {i + self._skip} is {have} (it last ran with {was})")
        return out, known

    def explain(self, where: str, inputs: Mapping[str, np.ndarray], exc: BaseException) -> EdgedError:
        msg = " ".join(str(exc).split())[:_MAX_MESSAGE] or type(exc).__name__
        diffs, known = self.differences(inputs)
        if isinstance(exc, InvalidInputError):
            what = "; ".join(diffs) if diffs else "input values or shapes " + ", ".join(
                f"{n!r} {list(a.shape)}" for n, a in inputs.items())
            return EngineInputError(f"{where} cannot take this input ({what}): {msg}")
        if diffs and known:
            return EngineInputError(f"{where} cannot take this input ({'; '.join(diffs)}): {msg}")
        return InternalError(f"{where}: engine failed: {msg}")


def failure_key(err: EdgedError) -> str:
    """The statistics key for a failed request: its code, except that an input the engine refused
    after it passed validation is counted apart. The client still gets a 400, but a version whose
    engine refuses what its manifest accepts is at fault, so trials and rollout gates count these
    against the previous version's rate while plain invalid arguments stay the client's."""
    return ENGINE_REFUSED if isinstance(err, EngineInputError) else err.code.value


ENGINE_REFUSED = "engine_refused_input"
