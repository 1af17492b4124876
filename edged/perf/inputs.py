"""The tensors ``edged perf`` sends: the model's inputs from its metadata, filled from a file or at random.

Requests are built once, before any timing, so the load generator measures the
daemon rather than numpy. Several samples (an .npz holding several, or a JSON
``data`` list) are sent in turn.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edged import datatypes
from edged.errors import InvalidInputError

Inputs = dict[str, np.ndarray]
MAX_REQUESTS = 1024  # distinct requests kept in memory; more samples than that are not needed to load a daemon


@dataclass(frozen=True)
class TensorInfo:
    name: str
    datatype: str
    shape: tuple[int, ...]  # v2 metadata shape: the batch dimension included (as -1) when the model batches


@dataclass(frozen=True)
class ModelInfo:
    name: str
    inputs: tuple[TensorInfo, ...]
    max_batch_size: int | None  # None: the transport does not say (then a leading -1 means batching)

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any], max_batch_size: int | None = None) -> ModelInfo:
        try:
            tensors = tuple(TensorInfo(str(t["name"]), str(t["datatype"]), tuple(int(d) for d in t["shape"]))
                            for t in meta["inputs"])
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidInputError(f"the daemon's metadata for the model has no usable 'inputs': {e}") from None
        mbs = meta.get("max_batch_size", max_batch_size)
        return cls(str(meta.get("name") or meta.get("model") or ""), tensors, None if mbs is None else int(mbs))

    @property
    def batching(self) -> bool:
        if self.max_batch_size is not None:
            return self.max_batch_size > 0
        return all(t.shape[:1] == (-1,) for t in self.inputs)


def parse_shapes(items: list[str]) -> dict[str, tuple[int, ...]]:
    """``--shape NAME:D1,D2`` (perf_analyzer's syntax): the sample shape, without the batch dimension."""
    out: dict[str, tuple[int, ...]] = {}
    for item in items:
        name, sep, dims = item.rpartition(":")
        try:
            shape = tuple(int(d) for d in dims.split(",") if d.strip())
        except ValueError:
            shape = ()
        if not sep or not name or not shape or any(d <= 0 for d in shape):
            raise InvalidInputError(f"--shape {item!r}: expected NAME:D1,D2,... with positive dimensions")
        out[name] = shape
    return out


def _fits(dims: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    return len(shape) == len(dims) and all(d in (-1, g) for d, g in zip(dims, shape, strict=True))


def _sample_shape(t: TensorInfo, batching: bool, shapes: Mapping[str, tuple[int, ...]],
                  data: np.ndarray | None = None) -> tuple[int, ...]:
    """One sample's shape: ``--shape`` when given, else the data's own (an array carries its shape),
    else the model's when it has no dynamic dimension."""
    dims = t.shape[1:] if batching else t.shape
    if t.name in shapes:
        given = shapes[t.name]
        if not _fits(dims, given):
            raise InvalidInputError(f"--shape {t.name}:{','.join(map(str, given))} does not fit the model's "
                                    f"shape {list(dims)}")
        return given
    if not any(d < 0 for d in dims):
        return dims
    hint = f"--shape {t.name}:{','.join('N' if d < 0 else str(d) for d in dims)}"
    if data is None:
        raise InvalidInputError(f"input {t.name!r} has a dynamic shape {list(dims)}: give its size with {hint}")
    # The data's shape: a batch of samples, or one sample without its batch dimension.
    for shape in ((tuple(data.shape[1:]),) if batching and data.ndim == len(dims) + 1 else ()) + (tuple(data.shape),):
        if _fits(dims, shape):
            return shape
    raise InvalidInputError(f"input {t.name!r}: the data's shape {list(data.shape)} does not fit the model's "
                            f"{list(dims)}{' (batch dimension excluded)' if batching else ''}; flat data needs "
                            f"{hint}")


def _random(dt: str, shape: tuple[int, ...], rng: np.random.Generator, zero: bool) -> np.ndarray:
    if dt == "BYTES":
        n = int(np.prod(shape, dtype=np.int64))
        vals = [b"" if zero else bytes(rng.integers(97, 123, 8, dtype=np.uint8)) for _ in range(n)]
        return np.array(vals, dtype=object).reshape(shape)
    np_dt = datatypes.to_numpy(dt)
    if zero:
        return np.zeros(shape, dtype=np_dt)
    if np_dt == np.bool_:
        return rng.integers(0, 2, shape).astype(np.bool_)
    if np_dt.kind in "iu":
        return rng.integers(0, 100, shape).astype(np_dt)
    return rng.random(shape, dtype=np.float64).astype(np_dt)


def _fit(arr: np.ndarray, t: TensorInfo, sample: tuple[int, ...], batching: bool, batch: int) -> np.ndarray:
    """Cast to the model's type and give it the requested batch size (a single sample is repeated)."""
    if t.datatype == "BYTES":
        if arr.dtype != np.object_:
            arr = np.array([x if isinstance(x, bytes) else str(x).encode() for x in arr.ravel()],
                           dtype=object).reshape(arr.shape)
    else:
        want = datatypes.to_numpy(t.datatype)
        if arr.dtype != want:
            if not np.can_cast(arr.dtype, want, "same_kind") and not (arr.dtype.kind in "iub" and want.kind in "iuf"):
                raise InvalidInputError(f"input {t.name!r}: data of type {arr.dtype} does not fit {t.datatype}")
            arr = arr.astype(want)
    if not batching:
        return np.require(arr, requirements="C")  # a scalar stays 0-d
    if arr.ndim == len(sample):
        arr = arr[np.newaxis]
    if arr.shape[0] != batch:
        if arr.shape[0] != 1:
            raise InvalidInputError(f"input {t.name!r}: the data has batch {arr.shape[0]}, -b asks for {batch}")
        arr = np.repeat(arr, batch, axis=0)
    return np.ascontiguousarray(arr)


def _from_json(path: Path) -> list[dict[str, np.ndarray]]:
    """perf_analyzer's input file: ``{"data": [{NAME: [values] | {"content": [...], "shape": [...]}}, ...]}``."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        entries = doc["data"]
        if not isinstance(entries, list) or not entries:
            raise TypeError("'data' must be a non-empty list")
        out = []
        for entry in entries:
            sample: dict[str, np.ndarray] = {}
            for name, value in entry.items():
                if isinstance(value, dict):
                    arr = np.asarray(value["content"])
                    if "shape" in value:
                        arr = arr.reshape(value["shape"])
                else:
                    arr = np.asarray(value)
                sample[str(name)] = arr
            out.append(sample)
        return out
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise InvalidInputError(f"{path}: not a usable input file: {e}") from None


def _from_file(path: Path, info: ModelInfo) -> list[dict[str, np.ndarray]]:
    if path.suffix == ".json":
        return _from_json(path)
    try:
        loaded = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise InvalidInputError(f"{path}: cannot read as .npy/.npz/.json: {e}") from None
    if isinstance(loaded, np.ndarray):
        if len(info.inputs) != 1:
            raise InvalidInputError(f"the model has {len(info.inputs)} inputs: give an .npz with arrays named "
                                    f"{[t.name for t in info.inputs]}")
        return [{info.inputs[0].name: loaded}]
    with loaded:
        return [{k: loaded[k] for k in loaded.files}]


def _reshape_flat(arr: np.ndarray, sample: tuple[int, ...]) -> np.ndarray:
    """A flat JSON list for one sample gets the sample shape (perf_analyzer accepts flattened data)."""
    n = int(np.prod(sample, dtype=np.int64))
    if arr.ndim == 1 and len(sample) != 1 and arr.size == n:
        return arr.reshape(sample)
    return arr


def build_inputs(info: ModelInfo, source: str, *, batch_size: int = 1,
                 shapes: Mapping[str, tuple[int, ...]] | None = None, seed: int = 0) -> list[Inputs]:
    """One or more ready-to-send requests. ``source``: ``random``, ``zero``, an .npy/.npz/.json file, or an
    image or sound file (JPEG, PNG, WebP, WAV) for a model or pipeline whose one input is BYTES."""
    shapes = shapes or {}
    batching = info.batching
    if batch_size < 1:
        raise InvalidInputError("-b/--batch-size must be >= 1")
    if not batching and batch_size != 1:
        raise InvalidInputError(f"model {info.name!r} has no batch dimension: -b must be 1")
    if info.max_batch_size and batch_size > info.max_batch_size:
        raise InvalidInputError(f"-b {batch_size} exceeds the model's max_batch_size {info.max_batch_size}")
    media = _media_request(info, source)
    if media is not None:
        return [media]
    unknown = set(shapes) - {t.name for t in info.inputs}
    if unknown:
        raise InvalidInputError(f"--shape names unknown input(s) {sorted(unknown)}; the model has "
                                f"{[t.name for t in info.inputs]}")
    if source in ("random", "zero"):
        samples = {t.name: _sample_shape(t, batching, shapes) for t in info.inputs}
        rng = np.random.default_rng(seed)
        return [{t.name: _fit(_random(t.datatype, samples[t.name], rng, source == "zero"), t, samples[t.name],
                              batching, batch_size) for t in info.inputs}]
    path = Path(source)
    if not path.is_file():
        raise InvalidInputError(f"--input-data {source!r}: not 'random', 'zero' or an existing file")
    requests: list[Inputs] = []
    for raw in _from_file(path, info):
        missing = [t.name for t in info.inputs if t.name not in raw]
        if missing:
            raise InvalidInputError(f"{path}: no data for input(s) {missing}")
        samples = {t.name: _sample_shape(t, batching, shapes, np.asarray(raw[t.name])) for t in info.inputs}
        arrays = {t.name: _reshape_flat(np.asarray(raw[t.name]), samples[t.name]) for t in info.inputs}
        for chunk in _split(arrays, samples, batching, batch_size):
            requests.append({t.name: _fit(chunk[t.name], t, samples[t.name], batching, batch_size)
                             for t in info.inputs})
            if len(requests) >= MAX_REQUESTS:
                return requests
    return requests


MAX_MEDIA_FILE = 256 << 20


def _media_request(info: ModelInfo, source: str) -> Inputs | None:
    """An image or sound file (by its first bytes) for a model or pipeline whose one input is BYTES."""
    from edged.protocol.media import media_input, media_tensor, sniff_media_type

    path = Path(source)
    if source in ("random", "zero") or not path.is_file():
        return None
    try:
        with path.open("rb") as f:
            if sniff_media_type(f.read(12)) is None:
                return None
        if path.stat().st_size > MAX_MEDIA_FILE:
            raise InvalidInputError(f"{path}: larger than {MAX_MEDIA_FILE} bytes")
        data = path.read_bytes()
    except OSError as e:
        raise InvalidInputError(f"{path}: cannot read: {e.strerror}") from None
    name = media_input(info.name, [(t.name, t.datatype) for t in info.inputs])
    return {name: media_tensor(data)}


def _split(arrays: dict[str, np.ndarray], samples: Mapping[str, tuple[int, ...]], batching: bool,
           batch: int) -> list[dict[str, np.ndarray]]:
    """Arrays holding many samples (an .npz of a data set) become consecutive requests of ``batch`` each."""
    if not batching or any(a.ndim != len(samples[k]) + 1 for k, a in arrays.items()):
        return [arrays]
    sizes = {a.shape[0] for a in arrays.values()}
    n = sizes.pop() if len(sizes) == 1 else 0
    if n <= batch:
        return [arrays]
    return [{k: a[i:i + batch] for k, a in arrays.items()} for i in range(0, n - batch + 1, batch)]
