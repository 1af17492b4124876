"""Open Inference Protocol (v2) tensor datatypes and their numpy equivalents."""

from __future__ import annotations

from typing import Literal

import numpy as np

from edged.errors import InvalidInputError

DataType = Literal["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
                   "FP16", "FP32", "FP64", "BYTES"]

_TO_NUMPY: dict[str, np.dtype[np.generic]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(np.object_),
}
_FROM_NUMPY = {v: k for k, v in _TO_NUMPY.items()}

# ONNX element type names as reported by ONNX Runtime ("tensor(float)") and OpenVINO ("f32").
_FROM_ENGINE = {
    "tensor(bool)": "BOOL", "tensor(uint8)": "UINT8", "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32", "tensor(uint64)": "UINT64", "tensor(int8)": "INT8",
    "tensor(int16)": "INT16", "tensor(int32)": "INT32", "tensor(int64)": "INT64",
    "tensor(float16)": "FP16", "tensor(float)": "FP32", "tensor(double)": "FP64",
    "tensor(string)": "BYTES",
    "boolean": "BOOL", "u8": "UINT8", "u16": "UINT16", "u32": "UINT32", "u64": "UINT64",
    "i8": "INT8", "i16": "INT16", "i32": "INT32", "i64": "INT64", "f16": "FP16", "f32": "FP32",
    "f64": "FP64", "string": "BYTES",
}


def to_numpy(datatype: str) -> np.dtype[np.generic]:
    try:
        return _TO_NUMPY[datatype]
    except KeyError:
        raise InvalidInputError(f"unknown datatype {datatype!r}; expected one of {sorted(_TO_NUMPY)}") from None


def from_numpy(dtype: np.dtype[np.generic]) -> str:
    dt = np.dtype(dtype)
    if dt.kind in "SUO":
        return "BYTES"
    try:
        return _FROM_NUMPY[dt]
    except KeyError:
        raise InvalidInputError(f"numpy dtype {dt} has no v2 datatype") from None


def from_engine(type_name: str) -> str:
    """Map an engine's element type name to a v2 datatype."""
    try:
        return _FROM_ENGINE[type_name.lower()]
    except KeyError:
        raise InvalidInputError(f"engine element type {type_name!r} has no v2 datatype") from None


def utf8_error(arr: np.ndarray) -> tuple[int, str] | None:
    """The first element of a BYTES array that is not UTF-8 text, as (flat index, why); None if all are.

    Elements already ``str`` are text; anything else (a number in warm-up data) is not checked.
    """
    if arr.dtype.kind == "U":
        return None
    flat = arr.ravel()
    try:  # one C-level pass: NUL cannot be inside a UTF-8 sequence, so the join decodes iff every element does
        b"\x00".join(flat).decode("utf-8")
        return None
    except (TypeError, UnicodeDecodeError):
        pass  # some element is not bytes, or not UTF-8: find which
    for i, item in enumerate(flat):
        if isinstance(item, bytes):
            try:
                item.decode("utf-8")
            except UnicodeDecodeError as e:
                return i, f"byte {e.start} (0x{item[e.start]:02x}) is not UTF-8"
    return None


def as_text(arr: np.ndarray) -> np.ndarray:
    """A BYTES tensor as the text an engine with string tensors takes: an object array of ``str``.

    Object arrays, not numpy's fixed-width ``U``: those drop trailing NULs ("a\\x00" -> "a"),
    while a string tensor keeps every character. Elements must be UTF-8 (checked at validation).
    """
    out = np.empty(arr.shape, dtype=object)
    flat = out.reshape(-1)
    for i, item in enumerate(arr.ravel()):
        flat[i] = item.decode("utf-8") if isinstance(item, bytes) else item if isinstance(item, str) else str(item)
    return out


def as_bytes(arr: np.ndarray) -> np.ndarray:
    """An engine's string tensor back as a BYTES tensor: an object array of UTF-8 ``bytes``."""
    out = np.empty(arr.shape, dtype=object)
    flat = out.reshape(-1)
    for i, item in enumerate(arr.ravel()):
        flat[i] = item if isinstance(item, bytes) else str(item).encode("utf-8")
    return out


def itemsize(datatype: str) -> int:
    """Bytes per element; 0 for BYTES, whose elements vary in length."""
    return 0 if datatype == "BYTES" else to_numpy(datatype).itemsize


ALL_DATATYPES: tuple[str, ...] = tuple(_TO_NUMPY)


MAX_SPAN = 1 << 40  # bound on the product of a shape's non-zero dimensions


def element_count(shape: tuple[int, ...], where: str) -> int:
    """A declared shape's element count, refused when numpy could not even describe it.

    The product of the non-zero dimensions is bounded as well as the count: ``[0, 2^62, 2^62]``
    holds no element, yet numpy refuses to reshape anything to it (an unhandled ValueError).
    """
    n = span = 1
    for d in shape:
        if d < 0:
            raise InvalidInputError(f"{where}: negative dimension in shape {list(shape)}")
        n *= d
        span *= max(d, 1)
        if span > MAX_SPAN:
            raise InvalidInputError(f"{where}: shape {list(shape)} is too large")
    return n
