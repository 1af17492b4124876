"""A small synchronous v2 gRPC client (what ``edged infer`` and ``edged perf`` use over gRPC).

Tensors always travel as ``raw_input_contents``/``raw_output_contents``. ``stream()``
opens one ModelStreamInfer stream on which each call sends a request and waits for
its answer (closed loop, like one perf_analyzer context in ``--streaming`` mode).
Errors come back as EdgedErrors with the transport-neutral code the daemon sent with them
(``edged-code``: a gRPC status cannot tell overloaded from unavailable); an error without it,
from another server or from grpcio itself, is mapped from its status.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from edged import datatypes
from edged.errors import EdgedError, ErrorCode
from edged.protocol.grpc import ERROR_CODE_KEY, require_grpc
from edged.protocol.v2 import bytes_from_buffer, bytes_to_buffer, tensor_bytes

_SERVICE = "/inference.GRPCInferenceService/"
_MAX_MESSAGE = 2047 * 1024 * 1024  # the client accepts what the server is configured to send
# By status, where the error does not carry its code (grpcio's own refusals: a message over the size limit,
# [grpc] max_concurrent_rpcs (_RPC_LIMIT); another server).
_CODES = {"INVALID_ARGUMENT": ErrorCode.INVALID_ARGUMENT, "NOT_FOUND": ErrorCode.NOT_FOUND,
          "UNAVAILABLE": ErrorCode.UNAVAILABLE, "RESOURCE_EXHAUSTED": ErrorCode.RESOURCE_EXHAUSTED,
          "DEADLINE_EXCEEDED": ErrorCode.DEADLINE_EXCEEDED, "FAILED_PRECONDITION": ErrorCode.FAILED_PRECONDITION,
          "UNAUTHENTICATED": ErrorCode.UNAUTHENTICATED, "PERMISSION_DENIED": ErrorCode.PERMISSION_DENIED}


# grpcio's refusal of an RPC over [grpc] max_concurrent_rpcs: sent before any handler runs, so without the
# daemon's code; a full server, which the caller should try again shortly, not a request too large.
_RPC_LIMIT = "Concurrent RPC limit exceeded!"


def status_code(status: str, details: str | None, sent: str | None) -> ErrorCode:
    """The ErrorCode of a failed RPC: what the daemon sent in its trailer, else what the status means."""
    if sent is None and status == "RESOURCE_EXHAUSTED" and details == _RPC_LIMIT:
        return ErrorCode.OVERLOADED
    return error_code(sent, _CODES.get(status, ErrorCode.INTERNAL))


def error_code(value: str | None, default: ErrorCode) -> ErrorCode:
    """The ErrorCode an ``edged-code`` value names; ``default`` when there is none or it names none."""
    try:
        return default if value is None else ErrorCode(value)
    except ValueError:
        return default


def infer_request(model: str, inputs: Mapping[str, np.ndarray], version: int | None) -> Any:
    from edged.protocol.grpc.gen import grpc_service_pb2 as pb

    req = pb.ModelInferRequest(model_name=model, model_version="" if version is None else str(version))
    for name, arr in inputs.items():
        dt = datatypes.from_numpy(arr.dtype)
        req.inputs.add(name=name, datatype=dt, shape=list(arr.shape))
        req.raw_input_contents.append(tensor_bytes(arr, dt))
    return req


_KEPT = 32  # serialized request heads a client keeps
_RAW_INPUT_TAG = b"\x3a"  # ModelInferRequest.raw_input_contents: field 7, length-delimited


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def infer_message(model: str, inputs: Mapping[str, np.ndarray], version: int | None,
                  kept: dict[tuple[object, ...], bytes]) -> bytes:
    """A ModelInferRequest serialized, as :func:`infer_request` would make it but for the order of its
    fields (every parser takes them in any order): everything but the tensors' bytes is serialized once
    per model, version, input names, dtypes and shapes and kept in ``kept`` (a camera loop sends that
    over and over), then each input's ``raw_input_contents`` is appended, its bytes copied once (the
    message way copies them three times)."""
    key = (model, version, *((name, arr.dtype, arr.shape) for name, arr in inputs.items()))
    head = kept.get(key)
    if head is None:
        from edged.protocol.grpc.gen import grpc_service_pb2 as pb

        req = pb.ModelInferRequest(model_name=model, model_version="" if version is None else str(version))
        for name, arr in inputs.items():
            req.inputs.add(name=name, datatype=datatypes.from_numpy(arr.dtype), shape=list(arr.shape))
        head = req.SerializeToString()
        if len(kept) >= _KEPT:
            kept.clear()
        kept[key] = head
    parts: list[bytes | memoryview] = [head]
    for arr in inputs.values():
        raw: bytes | memoryview = (bytes_to_buffer(arr) if arr.dtype.kind == "O"
                                   else np.ascontiguousarray(arr).reshape(-1).data.cast("B"))
        parts += (_RAW_INPUT_TAG + _varint(len(raw)), raw)
    return b"".join(parts)


def infer_outputs(resp: Any) -> dict[str, np.ndarray]:
    """The outputs of a ModelInferResponse; one the client cannot decode raises an INTERNAL EdgedError
    (the decoders' own errors would say ValueError, or INVALID_ARGUMENT: the caller's fault)."""
    out: dict[str, np.ndarray] = {}
    try:
        for i, t in enumerate(resp.outputs):
            shape = tuple(int(d) for d in t.shape)
            raw = resp.raw_output_contents[i] if i < len(resp.raw_output_contents) else b""
            if t.datatype == "BYTES":
                out[t.name] = bytes_from_buffer(raw, math.prod(shape), f"output {t.name!r}").reshape(shape)
            else:
                out[t.name] = np.frombuffer(raw, datatypes.to_numpy(t.datatype)).reshape(shape)
    except (ValueError, TypeError, EdgedError) as e:
        raise EdgedError(f"malformed inference response: {e}", code=ErrorCode.INTERNAL) from None
    return out


class GrpcClient:
    def __init__(self, address: str = "127.0.0.1:8001", *, timeout: float = 60.0, token: str | None = None) -> None:
        from edged.protocol.grpc.gen import grpc_service_pb2 as pb

        self._grpc = grpc = require_grpc()
        self._pb = pb
        self.address, self.timeout = address, timeout
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._rpcs: dict[str, Any] = {}
        self._heads: dict[tuple[object, ...], bytes] = {}  # infer_message()'s
        self._channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", _MAX_MESSAGE),
                                                                ("grpc.max_send_message_length", _MAX_MESSAGE)])

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> GrpcClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _error(self, e: Any) -> EdgedError:
        """An RpcError as an EdgedError: the code the daemon sent in the trailer, else the status's."""
        status = e.code()
        sent = dict(e.trailing_metadata() or ()).get(ERROR_CODE_KEY)
        return EdgedError(f"edged at {self.address}: {e.details() or status.name}",
                          code=status_code(status.name, e.details(), sent))

    def call(self, method: str, request: Any, reply: type[Any]) -> Any:
        """One unary call; ``request`` a message, or its bytes already serialized."""
        raw = isinstance(request, bytes)
        rpc = self._rpcs.get(method + "#raw" if raw else method)
        if rpc is None:
            rpc = self._rpcs[method + "#raw" if raw else method] = self._channel.unary_unary(
                _SERVICE + method, request_serializer=None if raw else type(request).SerializeToString,
                response_deserializer=reply.FromString)
        try:
            return rpc(request, timeout=self.timeout, metadata=self._metadata)
        except self._grpc.RpcError as e:
            raise self._error(e) from None

    def metadata(self, model: str, version: int | None = None) -> dict[str, Any]:
        """v2 model metadata, plus ``max_batch_size`` from the model config (metadata cannot say it)."""
        from google.protobuf import json_format

        pb, v = self._pb, "" if version is None else str(version)
        md = self.call("ModelMetadata", pb.ModelMetadataRequest(name=model, version=v), pb.ModelMetadataResponse)
        cfg = self.call("ModelConfig", pb.ModelConfigRequest(name=model, version=v), pb.ModelConfigResponse)
        out: dict[str, Any] = json_format.MessageToDict(md, preserving_proto_field_name=True)
        for t in out.get("inputs", []) + out.get("outputs", []):
            t["shape"] = [int(d) for d in t.get("shape", [])]
        out["max_batch_size"] = int(cfg.config.max_batch_size)
        return out

    def infer(self, model: str, inputs: Mapping[str, np.ndarray], version: int | None = None) -> dict[str, np.ndarray]:
        pb = self._pb
        return infer_outputs(self.call("ModelInfer", infer_message(model, inputs, version, self._heads),
                                       pb.ModelInferResponse))

    def stream(self, timeout: float | None = None) -> GrpcStream:
        """A ModelStreamInfer stream; ``timeout``: seconds each answer is awaited (default: this client's)."""
        return GrpcStream(self, timeout)


class GrpcStream:
    """One ModelStreamInfer stream; :meth:`infer` is one request and its answer, in turn.

    ``timeout`` (default: the client's) bounds each answer awaited, as the client's timeout bounds each
    unary call, not the stream: it may sit idle between requests for any time (a deadline on the call
    would end a long ``perf --streaming`` run). An answer late by then is DEADLINE_EXCEEDED and cancels
    the stream's call, which the server sees end; the stream is over, and each later request on it is
    UNAVAILABLE at once: open a new one. One watchdog thread a stream times the answers, so a request
    costs two clock reads, not a timer."""

    def __init__(self, client: GrpcClient, timeout: float | None = None) -> None:
        pb = client._pb
        self._client = client
        self.timeout = client.timeout if timeout is None else timeout
        self._requests: queue.Queue[bytes | None] = queue.Queue()
        rpc = client._channel.stream_stream(_SERVICE + "ModelStreamInfer",  # requests go serialized (infer_message)
                                            request_serializer=None,
                                            response_deserializer=pb.ModelStreamInferResponse.FromString)
        self._responses: Any = rpc(iter(self._requests.get, None), metadata=client._metadata)
        self._lock = threading.Lock()
        self._deadline: float | None = None  # when the answer awaited now is late (time.monotonic())
        self._ended: EdgedError | None = None  # why the stream is over, once this side ended it
        self._closed = threading.Event()
        threading.Thread(target=self._watch, name="edged-grpc-stream-timeout", daemon=True).start()

    def infer(self, model: str, inputs: Mapping[str, np.ndarray], version: int | None = None) -> dict[str, np.ndarray]:
        if self._ended is not None:
            raise EdgedError(f"this stream to edged at {self._client.address} is over ({self._ended}): "
                             "open a new one", code=ErrorCode.UNAVAILABLE)
        request = infer_message(model, inputs, version, self._client._heads)
        self._deadline = time.monotonic() + self.timeout
        self._requests.put(request)
        try:
            reply = next(self._responses)
        except self._client._grpc.RpcError as e:
            raise (self._ended or self._client._error(e)) from None
        except StopIteration:
            raise EdgedError(f"edged at {self._client.address} closed the stream", code=ErrorCode.UNAVAILABLE) from None
        finally:
            with self._lock:
                self._deadline = None
        if reply.error_message:
            params = reply.infer_response.parameters
            sent = params[ERROR_CODE_KEY].string_param if ERROR_CODE_KEY in params else None
            raise EdgedError(reply.error_message, code=error_code(sent, ErrorCode.INVALID_ARGUMENT))
        return infer_outputs(reply.infer_response)

    def _watch(self) -> None:
        """Cancel the call once an answer is late. Each deadline is set ``timeout`` after a request, never
        before one already set, so waiting ``timeout`` while none is set (or until the one set) never
        sleeps past one, and a request need not wake this thread."""
        wait = self.timeout
        while not self._closed.wait(wait):
            with self._lock:
                deadline = self._deadline
                wait = self.timeout if deadline is None else deadline - time.monotonic()
                if wait > 0:
                    continue
                self._end(EdgedError(f"edged at {self._client.address} did not answer within {self.timeout:g} s "
                                     "on this stream; the stream was cancelled", code=ErrorCode.DEADLINE_EXCEEDED))
                return

    def _end(self, why: EdgedError) -> None:
        """Over: grpcio's thread that sends the requests ends, and the call is cancelled."""
        if self._ended is None:
            self._ended = why
        self._closed.set()
        self._requests.put(None)
        self._responses.cancel()

    def close(self) -> None:
        self._end(EdgedError("it was closed", code=ErrorCode.UNAVAILABLE))
