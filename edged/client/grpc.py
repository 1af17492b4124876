"""A small synchronous v2 gRPC client (what ``edged infer`` and ``edged perf`` use over gRPC).

Tensors always travel as ``raw_input_contents``/``raw_output_contents``. ``stream()``
opens one ModelStreamInfer stream on which each call sends a request and waits for
its answer (closed loop, like one perf_analyzer context in ``--streaming`` mode).
gRPC statuses come back as EdgedErrors with the transport-neutral code.
"""

from __future__ import annotations

import math
import queue
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from edged import datatypes
from edged.errors import EdgedError, ErrorCode
from edged.protocol.grpc import require_grpc
from edged.protocol.v2 import bytes_from_buffer, tensor_bytes

_SERVICE = "/inference.GRPCInferenceService/"
_MAX_MESSAGE = 2047 * 1024 * 1024  # the client accepts what the server is configured to send
_CODES = {"INVALID_ARGUMENT": ErrorCode.INVALID_ARGUMENT, "NOT_FOUND": ErrorCode.NOT_FOUND,
          "UNAVAILABLE": ErrorCode.UNAVAILABLE, "RESOURCE_EXHAUSTED": ErrorCode.OVERLOADED,
          "DEADLINE_EXCEEDED": ErrorCode.DEADLINE_EXCEEDED, "FAILED_PRECONDITION": ErrorCode.FAILED_PRECONDITION,
          "UNAUTHENTICATED": ErrorCode.UNAUTHENTICATED, "PERMISSION_DENIED": ErrorCode.PERMISSION_DENIED}


def infer_request(model: str, inputs: Mapping[str, np.ndarray], version: int | None) -> Any:
    from edged.protocol.grpc.gen import grpc_service_pb2 as pb

    req = pb.ModelInferRequest(model_name=model, model_version="" if version is None else str(version))
    for name, arr in inputs.items():
        dt = datatypes.from_numpy(arr.dtype)
        req.inputs.add(name=name, datatype=dt, shape=list(arr.shape))
        req.raw_input_contents.append(tensor_bytes(arr, dt))
    return req


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
        self._channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", _MAX_MESSAGE),
                                                                ("grpc.max_send_message_length", _MAX_MESSAGE)])

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> GrpcClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _error(self, e: Any) -> EdgedError:
        code = e.code()
        return EdgedError(f"edged at {self.address}: {e.details() or code.name}",
                          code=_CODES.get(code.name, ErrorCode.INTERNAL))

    def call(self, method: str, request: Any, reply: type[Any]) -> Any:
        rpc = self._rpcs.get(method)
        if rpc is None:
            rpc = self._rpcs[method] = self._channel.unary_unary(
                _SERVICE + method, request_serializer=type(request).SerializeToString,
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
        return infer_outputs(self.call("ModelInfer", infer_request(model, inputs, version), pb.ModelInferResponse))

    def stream(self) -> GrpcStream:
        return GrpcStream(self)


class GrpcStream:
    """One ModelStreamInfer stream; :meth:`infer` is one request and its answer, in turn."""

    def __init__(self, client: GrpcClient) -> None:
        pb = client._pb
        self._client = client
        self._requests: queue.Queue[Any] = queue.Queue()
        rpc = client._channel.stream_stream(_SERVICE + "ModelStreamInfer",
                                            request_serializer=pb.ModelInferRequest.SerializeToString,
                                            response_deserializer=pb.ModelStreamInferResponse.FromString)
        self._responses: Iterator[Any] = rpc(iter(self._requests.get, None), metadata=client._metadata)

    def infer(self, model: str, inputs: Mapping[str, np.ndarray], version: int | None = None) -> dict[str, np.ndarray]:
        self._requests.put(infer_request(model, inputs, version))
        try:
            reply = next(self._responses)
        except self._client._grpc.RpcError as e:
            raise self._client._error(e) from None
        except StopIteration:
            raise EdgedError(f"edged at {self._client.address} closed the stream", code=ErrorCode.UNAVAILABLE) from None
        if reply.error_message:
            raise EdgedError(reply.error_message, code=ErrorCode.INVALID_ARGUMENT)
        return infer_outputs(reply.infer_response)

    def close(self) -> None:
        self._requests.put(None)
        cancel = getattr(self._responses, "cancel", None)
        if cancel is not None:
            cancel()
