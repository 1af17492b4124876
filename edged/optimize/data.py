"""Calibration and evaluation data: an ``.npz`` or a folder of ``.npy``/``.npz`` files.

Every array is checked against the model's inputs (name, datatype, static
dimensions) when it is read, so a bad file fails at once with its name rather
than deep inside a quantizer. A file may hold one sample or a stack of them;
the loaded set keeps a leading sample axis on every input.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edged import datatypes
from edged.optimize.errors import OptimizeInputError
from edged.optimize.modelio import ModelIO, Tensor


@dataclass(frozen=True)
class SampleSet:
    """``arrays[name][i]`` is sample ``i`` of input ``name``."""

    arrays: dict[str, np.ndarray]
    source: str

    def __len__(self) -> int:
        return len(next(iter(self.arrays.values())))

    def take(self, n: int) -> SampleSet:
        """At most ``n`` samples spread evenly over the set (files sorted by class stay balanced)."""
        if n <= 0 or n >= len(self):
            return self
        idx = np.unique(np.linspace(0, len(self) - 1, n).round().astype(np.int64))
        return SampleSet({k: np.ascontiguousarray(v[idx]) for k, v in self.arrays.items()}, self.source)

    def feeds(self, io: ModelIO, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
        """Engine inputs: slices of ``batch_size`` samples, or single samples for a model without batching."""
        n = len(self)
        if not io.batched:
            for i in range(n):
                yield {k: v[i] for k, v in self.arrays.items()}
            return
        step = max(1, min(batch_size, io.max_batch_size))
        for start in range(0, n, step):
            yield {k: v[start:start + step] for k, v in self.arrays.items()}

    def count_feeds(self, io: ModelIO, batch_size: int) -> int:
        if not io.batched:
            return len(self)
        step = max(1, min(batch_size, io.max_batch_size))
        return -(-len(self) // step)


def _as_samples(arr: np.ndarray, t: Tensor, io: ModelIO, where: str) -> np.ndarray:
    want_shape = io.sample_shape(t)
    if arr.dtype.kind in "OSUV":
        raise OptimizeInputError(f"{where}: input {t.name!r} holds {arr.dtype} data; numeric arrays only")
    if arr.ndim == len(want_shape):
        arr = arr[np.newaxis]
    elif arr.ndim != len(want_shape) + 1:
        raise OptimizeInputError(
            f"{where}: input {t.name!r} has shape {list(arr.shape)}; expected one sample {list(want_shape)} "
            f"or a stack of them [N, {', '.join(map(str, want_shape))}] (-1: any size)")
    for axis, (got, want) in enumerate(zip(arr.shape[1:], want_shape, strict=True)):
        if want not in (-1, got):
            raise OptimizeInputError(
                f"{where}: input {t.name!r} sample shape {list(arr.shape[1:])} does not fit the model's "
                f"{list(want_shape)} (dimension {axis} is {got}, the model needs {want})")
    dtype = datatypes.to_numpy(t.datatype)
    if arr.dtype != dtype:
        if not np.can_cast(arr.dtype, dtype, "same_kind"):
            raise OptimizeInputError(f"{where}: input {t.name!r} is {arr.dtype} but the model takes "
                                     f"{t.datatype}; convert the data first")
        arr = arr.astype(dtype)
    return np.ascontiguousarray(arr)


def _read(path: Path, display: str) -> dict[str, np.ndarray] | np.ndarray:
    try:
        loaded = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise OptimizeInputError(f"{display}: cannot read as .npy/.npz: {e}") from None
    if isinstance(loaded, np.ndarray):
        return loaded
    with loaded:
        try:
            return {k: loaded[k] for k in loaded.files}
        except (OSError, ValueError, EOFError) as e:
            raise OptimizeInputError(f"{display}: cannot read as .npz: {e}") from None


def _file_samples(path: Path, display: str, io: ModelIO) -> dict[str, np.ndarray]:
    raw = _read(path, display)
    names = [t.name for t in io.inputs]
    if isinstance(raw, np.ndarray):
        if len(io.inputs) != 1:
            raise OptimizeInputError(f"{display}: the model has {len(names)} inputs {names}; give .npz files "
                                     "with one array per input name")
        arrays = {names[0]: raw}
    elif all(n in raw for n in names):
        arrays = {n: raw[n] for n in names}
    elif len(io.inputs) == 1 and len(raw) == 1:
        arrays = {names[0]: next(iter(raw.values()))}
    else:
        missing = [n for n in names if n not in raw]
        raise OptimizeInputError(f"{display}: no array for input(s) {missing}; the file has {sorted(raw)}")
    out = {t.name: _as_samples(arrays[t.name], t, io, display) for t in io.inputs}
    counts = {k: len(v) for k, v in out.items()}
    if len(set(counts.values())) > 1:
        raise OptimizeInputError(f"{display}: inputs hold different numbers of samples: {counts}")
    return out


def load_samples(path: Path, io: ModelIO, *, what: str) -> SampleSet:
    """Read ``path`` (an .npz or .npy file, or a folder of them, sorted by name) for ``what`` (a flag name)."""
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in (".npy", ".npz") and p.is_file())
        if not files:
            raise OptimizeInputError(f"{what} {path}: the folder has no .npy or .npz files")
    elif path.is_file():
        files = [path]
    else:
        raise OptimizeInputError(f"{what} {path}: no such file or folder")
    parts = [_file_samples(f, f"{what} {f.name if f != path else path}", io) for f in files]
    arrays: dict[str, np.ndarray] = {}
    for t in io.inputs:
        chunks = [p[t.name] for p in parts]
        shapes = {c.shape[1:] for c in chunks}
        if len(shapes) > 1:
            raise OptimizeInputError(f"{what} {path}: samples of input {t.name!r} differ in shape "
                                     f"({sorted(map(list, shapes))}); they cannot be stacked")
        arrays[t.name] = chunks[0] if len(chunks) == 1 else np.concatenate(chunks)
    result = SampleSet(arrays, str(path))
    if len(result) == 0:
        raise OptimizeInputError(f"{what} {path}: holds no samples")
    return result


def load_labels(path: Path, n_samples: int) -> np.ndarray:
    """Labels, one entry per evaluation sample: integer classes (or one per position for dense outputs),
    integer sequences, boxes or float targets; the metric checks the form (metrics.check_labels)."""
    raw = _read(path, f"--labels {path.name}")
    if not isinstance(raw, np.ndarray):
        if len(raw) != 1:
            raise OptimizeInputError(f"--labels {path.name}: expected one array, found {sorted(raw)}")
        raw = next(iter(raw.values()))
    if raw.dtype.kind not in "iuf":
        raise OptimizeInputError(f"--labels {path.name}: labels must be numeric, not {raw.dtype}")
    if raw.ndim == 0 or raw.shape[0] != n_samples:
        raise OptimizeInputError(f"--labels {path.name}: {raw.shape[0] if raw.ndim else 0} labels for "
                                 f"{n_samples} evaluation samples")
    return raw
