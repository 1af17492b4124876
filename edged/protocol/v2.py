"""Open Inference Protocol (KServe v2) request/response codec, JSON and binary tensor forms.

The binary form (Triton's extension) is a JSON header followed by raw tensor
bytes in input order; ``binary_data_size`` in each tensor's parameters says how
many bytes belong to it. HTTP and MQTT both use this codec; only the framing of
the header length differs (an HTTP header or an MQTT user property / prefix).
"""

from __future__ import annotations

import base64
import binascii
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from edged import datatypes
from edged.errors import InvalidInputError
from edged.protocol.types import InferRequest, InferResponse
from edged.protocol.v2_json import NUMERIC_TYPES, JsonArray, array_from_json, numbers_from_list

# (region, offset, byte_size) -> the byte_size bytes of an input slot
ShmResolver = Callable[[str, int, int], memoryview]
# (region, offset, slot byte_size, bytes used) -> a writable buffer of exactly `used` bytes at the
# output slot's start, after checking the slot lies inside the region
ShmWriter = Callable[[str, int, int, int], memoryview]


@dataclass
class OutputOptions:
    binary: bool = False
    shm: tuple[str, int, int] | None = None  # region, offset, byte_size


@dataclass
class DecodedRequest:
    request: InferRequest
    outputs: dict[str, OutputOptions] = field(default_factory=dict)
    binary_default: bool = False
    # The v2_plans.RequestPlan that decoded it, if any (held as an object: v2_plans builds on this module).
    plan: object = None


def _param(params: Any, key: str, where: str, kind: type) -> Any:
    if not isinstance(params, dict) or key not in params:
        return None
    value = params[key]
    if kind is int and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise InvalidInputError(f"{where}: parameter {key!r} must be a non-negative integer")
    if kind is bool and not isinstance(value, bool):
        raise InvalidInputError(f"{where}: parameter {key!r} must be true or false")
    if kind is str and not isinstance(value, str):
        raise InvalidInputError(f"{where}: parameter {key!r} must be a string")
    return value


def _shape(raw: Any, where: str) -> tuple[int, ...]:
    if not isinstance(raw, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in raw):
        raise InvalidInputError(f"{where}: 'shape' must be a list of non-negative integers")
    if len(raw) > 16:
        raise InvalidInputError(f"{where}: 'shape' has more than 16 dimensions")
    return tuple(raw)


def bytes_from_buffer(buf: memoryview | bytes, count: int, where: str) -> np.ndarray:
    """Decode BYTES elements: each is a 4-byte little-endian length followed by the bytes.

    Every element takes at least its 4-byte length, so a count the data cannot hold is refused
    before the object array (8 bytes per element) is allocated: a 118-byte request declaring
    2^31 elements must not cost 16 GiB.
    """
    mv = memoryview(buf)
    if not 0 <= count <= len(mv) // 4:
        raise InvalidInputError(
            f"{where}: shape declares {count} BYTES elements but the data has {len(mv)} bytes "
            f"(each element takes at least 4)")
    out = np.empty(count, dtype=object)
    pos = 0
    for i in range(count):
        if pos + 4 > len(mv):
            raise InvalidInputError(f"{where}: BYTES data ends before element {i}")
        (n,) = struct.unpack_from("<I", mv, pos)
        pos += 4
        if pos + n > len(mv):
            raise InvalidInputError(f"{where}: BYTES element {i} is longer than the data")
        out[i] = bytes(mv[pos:pos + n])
        pos += n
    if pos != len(mv):
        raise InvalidInputError(f"{where}: {len(mv) - pos} bytes left over after {count} BYTES elements")
    return out


def bytes_to_buffer(arr: np.ndarray) -> bytes:
    parts = []
    for item in arr.ravel():
        b = item if isinstance(item, bytes) else str(item).encode()
        parts.append(struct.pack("<I", len(b)))
        parts.append(b)
    return b"".join(parts)


def tensor_bytes(arr: np.ndarray, datatype: str) -> bytes:
    """A tensor's bytes on the wire: BYTES elements length-prefixed, anything else raw, row-major."""
    return bytes_to_buffer(arr) if datatype == "BYTES" else np.ascontiguousarray(arr).tobytes()


def _from_raw(buf: memoryview | bytes, datatype: str, shape: tuple[int, ...], where: str) -> np.ndarray:
    count = datatypes.element_count(shape, where)
    if datatype == "BYTES":
        return bytes_from_buffer(buf, count, where).reshape(shape)
    dtype = datatypes.to_numpy(datatype)
    expected = count * dtype.itemsize
    if len(buf) != expected:
        raise InvalidInputError(
            f"{where}: got {len(buf)} bytes of data but shape {list(shape)} of {datatype} needs {expected}")
    # frombuffer keeps a zero-copy view; the caller owns the buffer for the request's lifetime.
    return np.frombuffer(buf, dtype=dtype).reshape(shape)


def _b64_element(item: dict[Any, Any], i: int, where: str) -> bytes:
    text = item.get("b64")
    if len(item) != 1 or not isinstance(text, str):
        raise InvalidInputError(f"{where}: BYTES element {i} is an object; the only one taken is "
                                '{"b64": "<base64 string>"}')
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidInputError(f"{where}: BYTES element {i}: 'b64' is not valid base64") from None


def _from_json_data(data: Any, datatype: str, shape: tuple[int, ...], where: str) -> np.ndarray:
    if isinstance(data, JsonArray):
        if datatype in NUMERIC_TYPES:
            return array_from_json(data, datatype, shape, where)
        data = data.parsed()
    count = datatypes.element_count(shape, where)
    # A flat list is the common form: its length settles the count before anything is converted.
    if isinstance(data, list) and len(data) != count and (not data or not isinstance(data[0], list)):
        raise InvalidInputError(f"{where}: {len(data)} elements for shape {list(shape)} ({count} needed)")
    if datatype == "BYTES":
        try:
            flat = np.asarray(data, dtype=object).ravel()
        except ValueError as e:
            raise InvalidInputError(f"{where}: data is not a list of strings ({e})") from None
        if flat.size != count:
            raise InvalidInputError(f"{where}: {flat.size} elements for shape {list(shape)} ({count} needed)")
        out = np.empty(count, dtype=object)
        for i, item in enumerate(flat):
            if isinstance(item, str):
                out[i] = item.encode()
            elif isinstance(item, bytes):  # gRPC's typed bytes_contents
                out[i] = item
            elif isinstance(item, dict):  # {"b64": "..."}: binary data in JSON, as KServe v2 allows
                out[i] = _b64_element(item, i, where)
            else:
                raise InvalidInputError(f"{where}: BYTES element {i} is {type(item).__name__}, not a string")
        return out.reshape(shape)
    return numbers_from_list(data, datatype, shape, count, where)


def _named_input(i: int, name: Any, datatype: Any, seen: Mapping[str, object]) -> tuple[str, str, str]:
    """An input's first checks, shared by both decoders (its name, once, and a known datatype): its name,
    datatype and how messages name it."""
    if not isinstance(name, str) or not name:
        raise InvalidInputError(f"inputs[{i}] has no 'name'")
    where = f"input {name!r}"
    if name in seen:
        raise InvalidInputError(f"{where} appears twice")
    if datatype not in datatypes.ALL_DATATYPES:
        raise InvalidInputError(f"{where}: unknown datatype {datatype!r}")
    return name, datatype, where


def decode_raw_request(inputs: Iterable[tuple[str, str, Sequence[int], bytes | memoryview]], *, model: str,
                       version: int | None, outputs: Sequence[str], rid: str | None) -> DecodedRequest:
    """The common binary request without a header to build: each input is (name, datatype, shape, its
    bytes), nothing has parameters, every output is returned binary. The same checks and messages as
    :func:`decode_request`, which gRPC would otherwise reach through a header of dicts per request."""
    arrays: dict[str, np.ndarray] = {}
    for i, (given, gtype, raw_shape, data) in enumerate(inputs):
        name, dt, where = _named_input(i, given, gtype, arrays)
        arrays[name] = _from_raw(data, dt, _shape(list(raw_shape), where), where)
    if not arrays:
        raise InvalidInputError("request has no 'inputs' list")
    opts = {name: OutputOptions(binary=True) for name in outputs}
    request = InferRequest(model=model, version=version, inputs=arrays, outputs=list(opts) if opts else None,
                           id=rid, parameters={})
    return DecodedRequest(request, opts, binary_default=True)


def decode_request(header: Mapping[str, Any], binary: memoryview | bytes = b"", *, model: str,
                   version: int | None, shm: ShmResolver | None = None) -> DecodedRequest:
    """Turn a v2 request (JSON header + optional binary tail) into an InferRequest."""
    if not isinstance(header, Mapping):
        raise InvalidInputError("request body must be a JSON object")
    raw_inputs = header.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise InvalidInputError("request has no 'inputs' list")
    inputs = _decode_inputs(raw_inputs, memoryview(binary), shm)
    req_params = header.get("parameters") or {}
    if not isinstance(req_params, dict):
        raise InvalidInputError("'parameters' must be an object")
    binary_default = bool(_param(req_params, "binary_data_output", "request", bool))
    outputs: dict[str, OutputOptions] = {}
    raw_outputs = header.get("outputs")
    if raw_outputs is not None:
        if not isinstance(raw_outputs, list):
            raise InvalidInputError("'outputs' must be a list")
        outputs = _decode_outputs(raw_outputs, binary_default, shm)
    rid = header.get("id")
    if rid is not None and not isinstance(rid, str):
        raise InvalidInputError("'id' must be a string")
    timeout_us = _param(req_params, "timeout", "request", int)
    request = InferRequest(model=model, version=version, inputs=inputs,
                           outputs=list(outputs) if outputs else None, id=rid,
                           parameters={"timeout_us": timeout_us} if timeout_us else {})
    return DecodedRequest(request, outputs, binary_default)


def _decode_inputs(raw_inputs: list[Any], tail: memoryview, shm: ShmResolver | None) -> dict[str, np.ndarray]:
    """A request's input tensors, each from shared memory, its share of the binary tail, or JSON data;
    the tail must be claimed to its last byte."""
    pos = 0
    inputs: dict[str, np.ndarray] = {}
    for i, raw in enumerate(raw_inputs):
        if not isinstance(raw, dict):
            raise InvalidInputError(f"inputs[{i}] must be an object")
        name, dt, where = _named_input(i, raw.get("name"), raw.get("datatype"), inputs)
        shape = _shape(raw.get("shape"), where)
        params = raw.get("parameters") or {}
        region = _param(params, "shared_memory_region", where, str)
        bsize = _param(params, "binary_data_size", where, int)
        if region is not None:
            if shm is None:
                raise InvalidInputError(f"{where}: shared memory is not available on this transport")
            size = _param(params, "shared_memory_byte_size", where, int)
            offset = _param(params, "shared_memory_offset", where, int) or 0
            if size is None:
                raise InvalidInputError(f"{where}: shared_memory_byte_size is required")
            inputs[name] = _from_raw(shm(region, offset, size), dt, shape, where)
        elif bsize is not None:
            if pos + bsize > len(tail):
                raise InvalidInputError(f"{where}: binary_data_size {bsize} goes past the end of the body")
            inputs[name] = _from_raw(tail[pos:pos + bsize], dt, shape, where)
            pos += bsize
        elif "data" in raw:
            inputs[name] = _from_json_data(raw["data"], dt, shape, where)
        else:
            raise InvalidInputError(f"{where} has no 'data', binary_data_size or shared memory parameters")
    if pos != len(tail):
        raise InvalidInputError(f"{len(tail) - pos} bytes of binary data are not claimed by any input")
    return inputs


def _decode_outputs(raw_outputs: list[Any], binary_default: bool,
                    shm: ShmResolver | None) -> dict[str, OutputOptions]:
    """How each requested output is to be sent: binary or JSON (``binary_default`` unless it says), or
    into a shared memory region."""
    outputs: dict[str, OutputOptions] = {}
    for i, raw in enumerate(raw_outputs):
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
            raise InvalidInputError(f"outputs[{i}] must be an object with a 'name'")
        where = f"output {raw['name']!r}"
        params = raw.get("parameters") or {}
        opt = OutputOptions()
        b = _param(params, "binary_data", where, bool)
        opt.binary = binary_default if b is None else b
        region = _param(params, "shared_memory_region", where, str)
        if region is not None:
            if shm is None:
                raise InvalidInputError(f"{where}: shared memory is not available on this transport")
            size = _param(params, "shared_memory_byte_size", where, int)
            if size is None:
                raise InvalidInputError(f"{where}: shared_memory_byte_size is required")
            opt.shm = (region, _param(params, "shared_memory_offset", where, int) or 0, size)
        outputs[raw["name"]] = opt
    return outputs


def encode_response(resp: InferResponse, decoded: DecodedRequest | None = None,
                    shm: ShmWriter | None = None) -> tuple[dict[str, Any], list[bytes]]:
    """The v2 response header and, in order, the binary chunks that follow it."""
    opts = decoded.outputs if decoded else {}
    default_binary = decoded.binary_default if decoded else False
    chunks: list[bytes] = []
    outs = []
    for name, arr in resp.outputs.items():
        opt = opts.get(name, OutputOptions(binary=default_binary))
        dt = datatypes.from_numpy(arr.dtype)
        entry: dict[str, Any] = {"name": name, "datatype": dt, "shape": list(arr.shape)}
        if opt.shm is not None:
            assert shm is not None
            region, offset, size = opt.shm
            raw = tensor_bytes(arr, dt)
            if len(raw) > size:
                raise InvalidInputError(
                    f"output {name!r} needs {len(raw)} bytes but its shared memory slot holds {size}")
            shm(region, offset, size, len(raw))[:] = raw
            # Triton describes an output written to shared memory by name, datatype and shape only:
            # its C++ client reads any "parameters" object as a binary-output description and
            # requires binary_data_size in it.
        elif opt.binary:
            raw = tensor_bytes(arr, dt)
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        elif dt == "BYTES":
            entry["data"] = [b.decode("utf-8", "replace") if isinstance(b, bytes) else str(b) for b in arr.ravel()]
        else:
            entry["data"] = np.ascontiguousarray(arr).ravel()  # orjson serialises numpy natively
        outs.append(entry)
    header: dict[str, Any] = {"model_name": resp.model, "model_version": str(resp.version), "outputs": outs}
    if resp.id is not None:
        header["id"] = resp.id
    return header, chunks


def dumps(obj: Any) -> bytes:
    return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY)


def loads(data: bytes | memoryview | str) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise InvalidInputError(f"body is not valid JSON: {e}") from None


def response_json(resp: InferResponse) -> dict[str, Any]:
    """The plain JSON v2 response with data as lists (for printing)."""
    header, _ = encode_response(resp)
    for o in header["outputs"]:
        if isinstance(o.get("data"), np.ndarray):
            o["data"] = o["data"].tolist()
    return header
