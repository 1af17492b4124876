"""ModelInferRequest/ModelInferResponse <-> the shared v2 codec (edged.protocol.v2).

A gRPC request becomes the same header + binary tail the HTTP binary extension
carries (``raw_input_contents`` in input order, typed ``contents`` as data lists,
parameters as plain values), so every check of the v2 codec applies unchanged.
Outputs always travel as ``raw_output_contents`` (what Triton's clients read), one entry
per output; an output written to system shared memory has an empty entry.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar, cast

from google.protobuf.message import DecodeError, Message

from edged import datatypes
from edged.errors import InvalidInputError
from edged.protocol.grpc.gen import grpc_service_pb2 as pb
from edged.protocol.types import InferResponse
from edged.protocol.v2 import DecodedRequest, decode_raw_request, decode_request, tensor_bytes
from edged.transports.shm.sysshm import ShmView
from edged.transports.v2_ops import encode_outputs, parse_version

M = TypeVar("M", bound=Message)

# The typed-contents field each datatype travels in (FP16/BF16 have none: raw only).
CONTENTS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
            "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
            "UINT32": "uint_contents", "UINT64": "uint64_contents", "FP32": "fp32_contents",
            "FP64": "fp64_contents", "BYTES": "bytes_contents"}


def parse(cls: type[M], data: bytes) -> M:
    """A request message from its bytes; malformed protobuf is the client's error, not ours."""
    try:
        return cast(M, cls.FromString(data))
    except (DecodeError, ValueError) as e:
        raise InvalidInputError(f"the request is not a valid {cls.DESCRIPTOR.name} protobuf message ({e})") from None


def param_value(p: pb.InferParameter) -> Any:
    which = p.WhichOneof("parameter_choice")
    return None if which is None else getattr(p, which)


def params(m: Any) -> dict[str, Any]:
    return {k: param_value(v) for k, v in m.items()}


# A typed content element decoded: a Python object (up to 32 bytes), its list slot, its numpy value.
TYPED_ELEMENT_COST = 48


def typed_elements(req: pb.ModelInferRequest) -> int:
    """How many typed content elements the request carries (counted without copying any)."""
    total = 0
    for t in req.inputs:
        if t.HasField("contents"):
            field = CONTENTS.get(t.datatype)
            if field is not None:
                total += len(getattr(t.contents, field))
    return total


def decode_infer(req: pb.ModelInferRequest, shm: ShmView,
                 raw: Sequence[bytes | memoryview] | None = None) -> DecodedRequest:
    """The shared codec's request for a ModelInferRequest (every output raw unless in shared memory);
    ``raw``: its raw input contents when they were kept out of the parsed message (parse_infer)."""
    if not req.model_name:
        raise InvalidInputError("'model_name' is empty")
    version = parse_version(req.model_version) if req.model_version else None
    raws: Sequence[bytes | memoryview] = req.raw_input_contents if raw is None else raw
    n_raw = len(raws)
    if plain(req, n_raw):
        # What tritonclient and perf_analyzer send: raw contents for every input and no parameters.
        return decode_raw_request(
            zip((t.name for t in req.inputs), (t.datatype for t in req.inputs), (t.shape for t in req.inputs),
                raws, strict=True),
            model=req.model_name, version=version, outputs=[o.name for o in req.outputs], rid=req.id or None)
    chunks: list[bytes | memoryview] = []
    inputs: list[dict[str, Any]] = []
    for t in req.inputs:
        where = f"input {t.name!r}"
        p = params(t.parameters)
        entry: dict[str, Any] = {"name": t.name, "datatype": t.datatype, "shape": list(t.shape), "parameters": p}
        if t.HasField("contents"):
            field = CONTENTS.get(t.datatype)
            if field is None:
                raise InvalidInputError(f"{where}: {t.datatype} has no typed contents; send raw_input_contents")
            if "shared_memory_region" in p or n_raw:
                raise InvalidInputError(f"{where}: typed contents cannot be mixed with raw_input_contents or "
                                        "shared memory")
            entry["data"] = list(getattr(t.contents, field))
        elif "shared_memory_region" not in p:
            if len(chunks) >= n_raw:
                raise InvalidInputError(f"{where} has no contents, raw_input_contents or shared memory parameters")
            chunk = raws[len(chunks)]
            p["binary_data_size"] = len(chunk)
            chunks.append(chunk)
        inputs.append(entry)
    if len(chunks) != n_raw:
        raise InvalidInputError(f"{n_raw} raw_input_contents for {len(chunks)} inputs that take raw data")
    header: dict[str, Any] = {"inputs": inputs, "parameters": params(req.parameters)}
    if req.outputs:
        header["outputs"] = [{"name": o.name, "parameters": params(o.parameters)} for o in req.outputs]
    if req.id:
        header["id"] = req.id
    tail = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    decoded = decode_request(header, tail, model=req.model_name, version=version, shm=shm.read)
    decoded.binary_default = True
    for opt in decoded.outputs.values():
        opt.binary = True
    return decoded


def plain(req: pb.ModelInferRequest, n_raw: int) -> bool:
    """Every input in raw_input_contents, and no parameters anywhere (no shared memory, no options)."""
    return (n_raw == len(req.inputs) and not req.parameters
            and not any(t.parameters or t.HasField("contents") for t in req.inputs)
            and not any(o.parameters for o in req.outputs))


def encode_infer(resp: InferResponse, decoded: DecodedRequest, shm: ShmView) -> pb.ModelInferResponse:
    if not any(o.shm for o in decoded.outputs.values()):
        # Every output raw, in order: straight into the message, without a header of dicts first.
        out = pb.ModelInferResponse(model_name=resp.model, model_version=str(resp.version), id=resp.id or "")
        for name, arr in resp.outputs.items():
            dt = datatypes.from_numpy(arr.dtype)
            out.outputs.add(name=name, datatype=dt, shape=arr.shape)
            out.raw_output_contents.append(tensor_bytes(arr, dt))
        return out
    header, chunks = encode_outputs(resp, decoded, shm)
    out = pb.ModelInferResponse(model_name=header["model_name"], model_version=header["model_version"],
                                id=header.get("id") or "")
    it = iter(chunks)
    for o in header["outputs"]:
        out.outputs.add(name=o["name"], datatype=o["datatype"], shape=o["shape"])
        # One entry per output, as Triton sends: its C++ client indexes raw_output_contents by the
        # output's position for every output, and reads past the end (perf_analyzer segfaulted)
        # when outputs written to shared memory had none. Those get an empty entry.
        out.raw_output_contents.append(next(it) if "parameters" in o else b"")
    return out


def error_response(req: pb.ModelInferRequest | None) -> pb.ModelInferResponse:
    """The infer_response of a failed stream request: enough to tell which request it answers."""
    if req is None:
        return pb.ModelInferResponse()
    return pb.ModelInferResponse(model_name=req.model_name, model_version=req.model_version, id=req.id)
