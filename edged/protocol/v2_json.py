"""JSON tensor data straight into numpy, without a Python list of numbers in between.

A v2 JSON request is mostly its ``data`` arrays: 27,648 floats for a 110 KB image. Parsing them as
JSON builds one Python float per element and numpy then walks that list again, about 1 ms on this
class of machine. Here the request body is split first: each flat ``"data": [...]`` array (no strings,
no nesting) is cut out and replaced by a placeholder, orjson parses the small remainder, and the array
bytes are turned into numpy only once the input's datatype is known (simdjson's flat buffer where the
``pysimdjson`` wheel is installed, orjson otherwise). The split is only trusted when every placeholder
lands exactly at an ``inputs[i].data``; anything else is parsed whole, as before.

Refusals name the tensor: booleans, nulls or strings in a numeric tensor, fractions or exponents in an
integer tensor, and values the datatype cannot hold.
"""

from __future__ import annotations

import os
import re
import threading
from typing import Any, Literal, cast

import numpy as np
import orjson

from edged import datatypes
from edged.errors import InvalidInputError

# A placeholder no client can forge: the nonce is drawn per process and never leaves it.
_NONCE = os.urandom(12).hex()
_MARK = f"\x00edged-span-{_NONCE}-"
_MARK_JSON = orjson.dumps(_MARK)[:-1]  # the opening quote and escaped text, without the closing quote
_DATA_KEY = re.compile(rb'"data"\s*:\s*\[')
_LITERAL_LETTERS = (b"t", b"f", b"n", b"N", b"I")  # true, false, null, NaN, Infinity
_FRACTION_CHARS = (b".", b"e", b"E")
_FLOAT_TYPES = frozenset({"FP16", "FP32", "FP64"})
_SIGNED_TYPES = frozenset({"INT8", "INT16", "INT32", "INT64"})
_UNSIGNED_TYPES = frozenset({"UINT8", "UINT16", "UINT32", "UINT64"})
NUMERIC_TYPES = _FLOAT_TYPES | _SIGNED_TYPES | _UNSIGNED_TYPES
_local = threading.local()


class JsonArray:
    """The raw bytes of one JSON array (``[`` to ``]``), converted once the datatype is known."""

    __slots__ = ("text",)

    def __init__(self, text: bytes) -> None:
        self.text = text

    def parsed(self) -> Any:
        return _loads(self.text)


def _loads(data: bytes | memoryview | str) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise InvalidInputError(f"body is not valid JSON: {e}") from None


def loads_request(body: bytes | memoryview) -> Any:
    """Parse a v2 request header, leaving flat ``inputs[i].data`` arrays as :class:`JsonArray`."""
    raw = bytes(body) if isinstance(body, memoryview) else body
    pieces: list[bytes] = []
    spans: list[bytes | None] = []
    pos = scan = 0
    while (m := _DATA_KEY.search(raw, scan)) is not None:
        start = m.end() - 1
        end = raw.find(b"]", start)
        if end < 0:
            break
        # Only flat arrays without strings: inside them every bracket and comma is structural. A skipped
        # one is skipped to its first "]": nothing before that can be a flat array of an input, and
        # every byte is searched once however many "data" keys a hostile body holds.
        if raw.find(b"[", start + 1, end) >= 0 or raw.find(b'"', start, end) >= 0:
            scan = end + 1
            continue
        pieces.append(raw[pos:start])
        pieces.append(_MARK_JSON + str(len(spans)).encode() + b'"')
        spans.append(raw[start:end + 1])
        pos = scan = end + 1
    if not spans:
        return _loads(raw)
    pieces.append(raw[pos:])
    try:
        header = orjson.loads(b"".join(pieces))
    except orjson.JSONDecodeError:
        return _loads(raw)
    if not _place(header, spans):
        return _loads(raw)
    return header


def _place(header: Any, spans: list[bytes | None]) -> bool:
    """Swap each placeholder at an ``inputs[i].data`` for its array; False unless all landed there."""
    inputs = header.get("inputs") if isinstance(header, dict) else None
    if not isinstance(inputs, list):
        return False
    placed = 0
    for item in inputs:
        if not isinstance(item, dict):
            continue
        value = item.get("data")
        if isinstance(value, str) and value.startswith(_MARK):
            k = int(value[len(_MARK):])
            text = spans[k]
            if text is None:
                return False
            item["data"] = JsonArray(text)
            spans[k] = None
            placed += 1
    return placed == len(spans)


def _simdjson_buffer(text: bytes, kind: Literal["d", "i", "u"]) -> Any:
    """simdjson's flat buffer of the array, or None where the wheel is missing or the array does not fit."""
    parser: Any = getattr(_local, "parser", None)
    if parser is None:
        try:
            import simdjson  # optional: a wheel on x86_64 and aarch64
        except ImportError:
            _local.parser = False
            return None
        parser = _local.parser = simdjson.Parser()
    elif parser is False:
        return None
    try:
        doc: Any = parser.parse(text)
    except (ValueError, TypeError, RuntimeError):  # refusals are reported by the exact path
        return None
    try:
        return doc.as_buffer(of_type=kind)
    except (ValueError, TypeError, RuntimeError):
        return None
    finally:
        del doc  # a parser cannot be reused while a document from it is alive


def array_from_json(span: JsonArray, datatype: str, shape: tuple[int, ...], where: str) -> np.ndarray:
    """The tensor for a flat JSON array; the element count is settled before converting anything."""
    count = datatypes.element_count(shape, where)
    text = span.text
    # Every element takes at least one digit and a comma but the last: a shape the bytes cannot
    # hold is refused before anything is allocated.
    if count > (len(text) - 1) // 2:
        n = text.count(b",") + 1 if text.strip(b"[] \t\r\n") else 0
        raise InvalidInputError(f"{where}: {n} elements for shape {list(shape)} ({count} needed)")
    if datatype in NUMERIC_TYPES:
        integer = datatype not in _FLOAT_TYPES
        kind: Literal["d", "i", "u"] = "d" if not integer else ("u" if datatype in _UNSIGNED_TYPES else "i")
        buf = _simdjson_buffer(text, kind)
        if buf is not None:
            wide = np.frombuffer(buf, dtype={"d": np.float64, "i": np.int64, "u": np.uint64}[kind])
            if wide.size != count:
                raise InvalidInputError(f"{where}: {wide.size} elements for shape {list(shape)} ({count} needed)")
            return _narrow(wide, datatype, where).reshape(shape)
        # simdjson refused (or is not installed). The span holds no strings, so a letter other than an
        # exponent's is a literal (true, false, null, NaN, Infinity); numpy would take true as 1.
        # A few byte searches find them far faster than sorting every byte; orjson refuses the rest.
        if any(c in text for c in _LITERAL_LETTERS):
            raise InvalidInputError(f"{where}: data holds a non-numeric value (boolean, null or string); "
                                    f"{datatype} needs numbers")
        if integer and any(c in text for c in _FRACTION_CHARS):
            raise InvalidInputError(f"{where}: data holds a fraction or exponent; {datatype} needs integers")
    return numbers_from_list(span.parsed(), datatype, shape, count, where)


def _narrow(wide: np.ndarray, datatype: str, where: str) -> np.ndarray:
    """Cast parsed float64/int64 values to the tensor's type, refusing what it cannot hold."""
    dtype = datatypes.to_numpy(datatype)
    if wide.dtype == dtype:
        return wide
    if dtype.kind in "iu":
        if wide.dtype.kind not in "iu":
            raise InvalidInputError(f"{where}: data holds a fraction or exponent; {datatype} needs integers")
        info = np.iinfo(cast(Any, dtype))
        if wide.size and (int(wide.min()) < info.min or int(wide.max()) > info.max):
            raise InvalidInputError(f"{where}: a value is outside the range of {datatype}")
    try:
        with np.errstate(over="raise", invalid="raise"):
            return wide.astype(dtype)
    except FloatingPointError:
        raise InvalidInputError(f"{where}: a value is outside the range of {datatype}") from None


def _unsigned_from_list(data: Any, wide: np.ndarray, where: str) -> np.ndarray:
    """Integers past INT64's range, which numpy widened to float: exact as UINT64 (or refused)."""
    flat = np.asarray(data, dtype=object).ravel()
    if not all(type(v) is int for v in flat):
        return wide
    try:
        return np.array(flat.tolist(), dtype=np.uint64).reshape(wide.shape)
    except OverflowError:
        raise InvalidInputError(f"{where}: a value is outside the range of UINT64") from None


def numbers_from_list(data: Any, datatype: str, shape: tuple[int, ...], count: int, where: str) -> np.ndarray:
    """The tensor for already-parsed numbers (nested JSON lists, gRPC typed contents)."""
    if isinstance(data, list) and len(data) != count and (not data or not isinstance(data[0], list)):
        raise InvalidInputError(f"{where}: {len(data)} elements for shape {list(shape)} ({count} needed)")
    try:
        # numpy's own choice of kind shows booleans, nulls, strings and fractions.
        wide = np.asarray(data, dtype=bool if datatype == "BOOL" else None)
    except (ValueError, TypeError, OverflowError) as e:
        raise InvalidInputError(f"{where}: data is not a list of {datatype} values ({e})") from None
    if wide.size != count:
        raise InvalidInputError(f"{where}: {wide.size} elements for shape {list(shape)} ({count} needed)")
    if datatype in _UNSIGNED_TYPES and wide.dtype.kind in "fO":
        wide = _unsigned_from_list(data, wide, where)
    if datatype != "BOOL":
        if wide.dtype.kind not in "iuf":
            raise InvalidInputError(f"{where}: data holds a non-numeric value (boolean, null or string) or a "
                                    f"number no integer type holds; {datatype} needs numbers")
        wide = _narrow(wide, datatype, where)
    return wide.reshape(shape)
