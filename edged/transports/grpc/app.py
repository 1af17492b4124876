"""Every RPC of ``inference.GRPCInferenceService``, answered through the one inference service.

Handlers take and return raw bytes (no grpcio (de)serializers) so that a malformed
message is refused with INVALID_ARGUMENT like any other bad input, not grpcio's
generic INTERNAL. Each EdgedError becomes the status its code maps to, with the
message scrubbed of internal paths and the code itself in the trailing metadata
(``edged-code``: statuses are coarser than ErrorCode); anything unexpected is logged
and answered INTERNAL "internal error" while the server goes on.

ModelStreamInfer computes up to ``[grpc] max_stream_inflight`` requests of one stream
at once and answers strictly in request order; a request that fails gets its error
in its own place in the stream, and the stream stays open.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NoReturn

import grpc
from google.protobuf import json_format

from edged.core.service import InferenceService
from edged.errors import EdgedError, ErrorCode, InvalidInputError
from edged.membudget import Reservation
from edged.protocol.grpc import ERROR_CODE_KEY
from edged.protocol.grpc.gen import grpc_service_pb2 as pb
from edged.protocol.grpc.gen import model_config_pb2 as mc
from edged.protocol.grpc.wire import stream_response
from edged.protocol.types import InferResponse
from edged.protocol.v2 import dumps, loads
from edged.protocol.v2_models import metadata_response, statistics_response
from edged.transports import v2_ops
from edged.transports.authority import Authority, Peer, bearer
from edged.transports.grpc.codec import (
    TYPED_ELEMENT_COST,
    decode_infer,
    error_response,
    parse,
    typed_elements,
)
from edged.transports.grpc.infer_messages import InferMessage, InferPlans
from edged.transports.http.config import model_config
from edged.transports.redact import Scrubber
from edged.transports.shm.sysshm import ShmCaller, ShmView, SystemShmRegions

log = logging.getLogger(__name__)

SERVICE = "inference.GRPCInferenceService"
# Overloaded (a full queue, a full request memory budget: retry soon) is UNAVAILABLE, the status gRPC retry
# policies retry and Triton answers for a full queue; RESOURCE_EXHAUSTED is kept for what no retry will fix (a
# request larger than any may be). The trailer (ERROR_CODE_KEY) tells overloaded from unavailable.
STATUS: dict[ErrorCode, Any] = {
    ErrorCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.OVERLOADED: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorCode.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorCode.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorCode.INTERNAL: grpc.StatusCode.INTERNAL,
    ErrorCode.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    ErrorCode.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
}

Unary = Callable[[Any, Any], Awaitable[Any]]
# An inference message is held at most four times at once: grpcio's buffer, its bytes, and when it is
# parsed whole, the parsed message and the raw contents taken out of that (each access to a bytes field
# is a new copy). The common message is parsed without its raw contents, which stay in its bytes.
MESSAGE_COPIES = 4
RECEIVED_COPIES = 2  # grpcio's buffer and its bytes
READ_SWEEP_S = 1.0  # how often waits for room and reads are checked against [grpc] message_timeout_s
# The largest message is held to this share of what large requests may fill of the request memory budget
# (MemoryBudget.large_limit), so that at least this many of them can be read at once while nothing else
# holds any.
CONCURRENT_LARGEST = 8


class ReadDeadlines:
    """Bounds how long a ModelInfer call waits for room to reserve its largest message and for the message.

    Both waits count from the call's start. One sweep a second while any call waits, instead of a timer
    per call: asyncio's ``call_later`` and its cancellation cost ~12 us on a lone call's path (the engine
    run has just evicted the caches they touch), a clock read and two dictionary updates almost nothing.
    A wait expires between ``timeout_s`` and ``timeout_s`` + READ_SWEEP_S after the call's start,
    whatever ``timeout_s``: each sweep compares the waits' start times with the clock.

    Room is handed out first come first served: a call that finds others waiting queues behind them,
    and freed room goes to the head of the queue when a gRPC request shrinks or releases its
    reservation (:meth:`admit`), or at the next sweep when another transport freed it."""

    def __init__(self, timeout_s: float, take: Callable[[], Reservation | None]) -> None:
        self.timeout_s = timeout_s
        self._take = take  # one message's reservation, or None while the request memory budget has no room
        self._reads: dict[asyncio.Task[Any], float] = {}  # task -> when its deadline counts from (monotonic)
        self._waiting: deque[tuple[float, asyncio.Future[Reservation | None]]] = deque()  # in arrival order
        self._expired: set[asyncio.Task[Any]] = set()
        self._sweeper: asyncio.TimerHandle | None = None

    def reserve(self) -> Reservation | None:
        """One message's reservation, if there is room now and no call waits for it before this one."""
        if self._waiting:
            self.admit()
            if self._waiting:
                return None
        return self._take()

    async def room(self, since: float) -> Reservation | None:
        """One message's reservation once room frees, in arrival order; None if ``timeout_s`` passes first
        (counted from ``since``, time.monotonic())."""
        fut: asyncio.Future[Reservation | None] = asyncio.get_running_loop().create_future()
        self._waiting.append((since, fut))
        self._sweep_later()
        try:
            return await fut
        except asyncio.CancelledError:  # the call ended: room handed to it meanwhile goes to the next one
            if fut.done() and not fut.cancelled() and (hold := fut.result()) is not None:
                hold.release()
                self.admit()
            raise

    def admit(self) -> None:
        """Hand the room there is now to the calls waiting for it, in arrival order."""
        waiting = self._waiting
        while waiting:
            fut = waiting[0][1]
            if not fut.done():  # else its call ended while it waited
                hold = self._take()
                if hold is None:
                    return
                fut.set_result(hold)
            waiting.popleft()

    def start(self, task: asyncio.Task[Any], since: float | None = None) -> None:
        """A read begins; it expires ``timeout_s`` after ``since`` (time.monotonic(); default: now)."""
        self._reads[task] = time.monotonic() if since is None else since
        self._sweep_later()

    def end(self, task: asyncio.Task[Any]) -> bool:
        """The read is over (arrived, failed or cancelled); True if it was cancelled for its deadline."""
        self._reads.pop(task, None)
        if task in self._expired:
            self._expired.discard(task)
            return True
        return False

    def _sweep_later(self) -> None:
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().call_later(READ_SWEEP_S, self._sweep)

    def _sweep(self) -> None:
        now, timeout = time.monotonic(), self.timeout_s
        for task, started in list(self._reads.items()):
            if now - started >= timeout:
                del self._reads[task]
                self._expired.add(task)
                task.cancel()
        self.admit()  # room another transport freed since
        waiting = self._waiting
        while waiting and now - waiting[0][0] >= timeout:
            fut = waiting.popleft()[1]
            if not fut.done():
                fut.set_result(None)
        self._sweeper = None
        if self._reads or waiting:
            self._sweep_later()

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None


async def abort(context: Any, code: ErrorCode, text: str) -> NoReturn:
    """End the call with the status ``code`` maps to, ``code`` itself in the trailing metadata."""
    await context.abort(STATUS.get(code, grpc.StatusCode.INTERNAL), text,
                        trailing_metadata=((ERROR_CODE_KEY, code.value),))
    raise AssertionError("unreachable: abort raises")  # pragma: no cover


def _version(raw: str) -> int | None:
    return v2_ops.parse_version(raw) if raw else None


def peer_of(context: Any) -> Peer:
    """The caller as the authority sees it: its address and the bearer token in its metadata.

    grpcio does not expose a Unix-socket peer's kernel credentials, so over gRPC the
    management authority is the ``[control] token`` only.
    """
    credential = None
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            credential = bearer(value)
    return Peer(address=context.peer(), credential=credential)


@dataclass(kw_only=True)
class GrpcApp:
    service: InferenceService
    shm: SystemShmRegions  # the listener's system shared memory regions
    scrub: Scrubber
    authority: Authority
    stream_inflight: int  # [grpc] max_stream_inflight
    max_receive: int = 64 << 20  # the largest message grpcio takes (its max_receive_message_length)
    message_timeout_s: float = 30.0  # [grpc] message_timeout_s
    stopping: bool = False
    # Loads and unloads in progress, answered at once when the transport stops (v2_ops.ModelControl).
    control: v2_ops.ModelControl = field(default_factory=v2_ops.ModelControl, init=False)
    # Inference requests between arriving and being answered, over all calls and streams: a request that
    # is alone runs on the loop when its model is idle and quick (as over HTTP), skipping the hand-off to a
    # scheduler thread and back (two thread wake-ups, ~150 us each on some VMs).
    _active: int = field(default=0, init=False)
    # What repeated inference messages meant, and the heads of their answers (infer_messages)
    plans: InferPlans = field(default_factory=InferPlans, init=False)
    reads: ReadDeadlines = field(init=False)

    def __post_init__(self) -> None:
        self.reads = ReadDeadlines(self.message_timeout_s,
                                   partial(self.service.budget.try_reserve, MESSAGE_COPIES * self.max_receive))

    def handler(self) -> Any:
        """The generic handler grpcio serves: method name -> raw-bytes handler."""
        unary: dict[str, tuple[type[Any], Unary]] = {
            "ServerLive": (pb.ServerLiveRequest, self.server_live),
            "ServerReady": (pb.ServerReadyRequest, self.server_ready),
            "ModelReady": (pb.ModelReadyRequest, self.model_ready),
            "ServerMetadata": (pb.ServerMetadataRequest, self.server_metadata),
            "ModelMetadata": (pb.ModelMetadataRequest, self.model_metadata),
            "ModelConfig": (pb.ModelConfigRequest, self.model_config),
            "ModelStatistics": (pb.ModelStatisticsRequest, self.model_statistics),
            "RepositoryIndex": (pb.RepositoryIndexRequest, self.repository_index),
            "RepositoryModelLoad": (pb.RepositoryModelLoadRequest, self.repository_load),
            "RepositoryModelUnload": (pb.RepositoryModelUnloadRequest, self.repository_unload),
            "SystemSharedMemoryStatus": (pb.SystemSharedMemoryStatusRequest, self.sysshm_status),
            "SystemSharedMemoryRegister": (pb.SystemSharedMemoryRegisterRequest, self.sysshm_register),
            "SystemSharedMemoryUnregister": (pb.SystemSharedMemoryUnregisterRequest, self.sysshm_unregister),
            "CudaSharedMemoryStatus": (pb.CudaSharedMemoryStatusRequest, self.cudashm_status),
            "CudaSharedMemoryRegister": (pb.CudaSharedMemoryRegisterRequest, self.cudashm_register),
            "CudaSharedMemoryUnregister": (pb.CudaSharedMemoryUnregisterRequest, self.cudashm_unregister),
        }
        methods = {name: grpc.unary_unary_rpc_method_handler(self._unary(name, cls, fn))
                   for name, (cls, fn) in unary.items()}
        # Request-streaming on our side (the wire is the same for a unary client): the message is read only
        # once the memory it may take is reserved, so concurrent large messages wait in the client's
        # socket, not in the daemon's memory.
        methods["ModelInfer"] = grpc.stream_unary_rpc_method_handler(self._admitted(self._model_infer()))
        methods["ModelStreamInfer"] = grpc.stream_stream_rpc_method_handler(self.model_stream_infer)
        return grpc.method_handlers_generic_handler(SERVICE, methods)

    def _admitted(self, handle: Callable[[bytes, Any, Reservation], Awaitable[bytes]]
                  ) -> Callable[[Any, Any], Awaitable[bytes]]:
        """Reserve the largest message grpcio may take, read the message, keep what it needs, handle it.

        When the request memory budget has no room for that now, the call waits its turn for room (the
        message waits in the client's socket meanwhile) up to ``message_timeout_s``, then is
        RESOURCE_EXHAUSTED; a message that does not arrive whole within ``message_timeout_s`` of the call's
        start is DEADLINE_EXCEEDED."""
        async def read_then_handle(requests: Any, context: Any) -> bytes:
            # Counted from the call's start, before its message is read: calls that arrive together all
            # count before any of them reaches the model, so none of them is taken for a lone one.
            self._active += 1
            try:
                return await read_and_handle(requests, context)
            finally:
                self._active -= 1

        async def read_and_handle(requests: Any, context: Any) -> bytes:
            reads = self.reads
            began = None  # now, unless the call waited for room
            hold = reads.reserve()
            if hold is None:
                began = time.monotonic()
                try:
                    hold = await self._room(began)
                except EdgedError as e:
                    await abort(context, *self._status(e))
            # Not asyncio.wait_for (a task per call, tens of microseconds): the read deadlines cancel this read.
            task = asyncio.current_task()
            assert task is not None
            reads.start(task, began)
            try:
                data = await context.read()
            except BaseException as e:
                expired = reads.end(task)
                hold.release()
                reads.admit()
                if not (expired and isinstance(e, asyncio.CancelledError)):
                    raise
                await abort(context, ErrorCode.DEADLINE_EXCEEDED,
                            f"the request message did not arrive within {reads.timeout_s:g} s")
            reads.end(task)  # arrived: a sweep since would have cancelled the read (nothing awaits in between)
            if not isinstance(data, bytes):  # EOF: the client sent no message
                hold.release()
                reads.admit()
                await abort(context, ErrorCode.INVALID_ARGUMENT, "no request message")
            return await handle(data, context, hold)
        return read_then_handle

    async def _room(self, since: float) -> Reservation:
        """The largest message's reservation, once the calls before this one have theirs and room frees;
        OverloadedError (counted as refused) if none frees within ``message_timeout_s`` of ``since``,
        ResourceExhaustedError at once if it could never fit."""
        budget, nbytes = self.service.budget, MESSAGE_COPIES * self.max_receive
        if nbytes <= budget.large_limit:
            hold = await self.reads.room(since)
            if hold is not None:
                return hold
        return budget.reserve(nbytes, "a ModelInfer message (up to %d bytes) about to be read", self.max_receive)

    def _unary(self, name: str, cls: type[Any], fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[bytes]]:
        """``fn(message, context)``."""
        async def handle(data: bytes, context: Any) -> bytes:
            try:
                reply = await fn(parse(cls, data), context)
                return bytes(reply.SerializeToString())
            except EdgedError as e:
                code, text = self._status(e)
            except Exception:
                log.exception("gRPC %s failed", name)
                code, text = ErrorCode.INTERNAL, "internal error"
            await abort(context, code, text)
        return handle

    async def _received(self, data: bytes, hold: Reservation) -> InferMessage:
        """An inference message parsed (a large one in a worker thread: the loop keeps answering everyone
        else), its reservation set to what it holds now: its bytes, what parsing made, its typed contents."""
        plans = self.plans
        msg = await asyncio.to_thread(plans.parse, data) if len(data) > v2_ops.HEAVY else plans.parse(data)
        hold.shrink(RECEIVED_COPIES * len(data) + msg.held_bytes)
        if msg.plan is None:  # a planned message has no typed contents
            hold.grow(TYPED_ELEMENT_COST * typed_elements(msg.request), "the message's typed contents")
        self.reads.admit()  # what the worst case reserved for a ModelInfer message and it does not hold
        return msg

    def _model_infer(self) -> Callable[..., Awaitable[bytes]]:
        async def handle(data: bytes, context: Any, hold: Reservation) -> bytes:
            try:
                msg = await self._received(data, hold)
                return await self._infer(msg, context, len(data))
            except EdgedError as e:
                code, text = self._status(e)
            except Exception:
                log.exception("gRPC ModelInfer failed")
                code, text = ErrorCode.INTERNAL, "internal error"
            finally:
                hold.release()
                self.reads.admit()
            await abort(context, code, text)
        return handle

    def _admit(self, data: bytes) -> Reservation:
        """Reserve what an inference message will hold: its bytes and their parsed copy (decoded tensors
        are views of that); refused at once (overloaded) when the request memory budget is full."""
        return self.service.budget.reserve(MESSAGE_COPIES * len(data), "a %d-byte ModelInfer message", len(data))

    def _status(self, e: EdgedError) -> tuple[ErrorCode, str]:
        """The error's code and its message as a client may see it."""
        if e.code is ErrorCode.INTERNAL:
            log.error("internal error: %s", e)
        return e.code, self.scrub.text(str(e))

    def _scrubbed(self, obj: Any) -> Any:
        """Plain data with internal paths replaced, as the HTTP side sends it."""
        return loads(self.scrub.data(dumps(obj)))

    # ---- health and metadata ----------------------------------------------------------------
    async def server_live(self, req: pb.ServerLiveRequest, context: Any) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def server_ready(self, req: pb.ServerReadyRequest, context: Any) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=v2_ops.server_ready(self.service, self.stopping))

    async def model_ready(self, req: pb.ModelReadyRequest, context: Any) -> pb.ModelReadyResponse:
        return pb.ModelReadyResponse(ready=v2_ops.model_ready(self.service, req.name, _version(req.version)))

    async def server_metadata(self, req: pb.ServerMetadataRequest, context: Any) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(**v2_ops.server_metadata())

    async def model_metadata(self, req: pb.ModelMetadataRequest, context: Any) -> pb.ModelMetadataResponse:
        md = self._scrubbed(metadata_response(self.service.describe(req.name, _version(req.version))))
        out = pb.ModelMetadataResponse()
        json_format.ParseDict(md, out, ignore_unknown_fields=True)
        return out

    async def model_config(self, req: pb.ModelConfigRequest, context: Any) -> pb.ModelConfigResponse:
        mv = self.service.model(req.name, _version(req.version))
        cfg = self._scrubbed(model_config(mv, self.service.version_policy(req.name)))
        return pb.ModelConfigResponse(config=json_format.ParseDict(cfg, mc.ModelConfig(), ignore_unknown_fields=True))

    async def model_statistics(self, req: pb.ModelStatisticsRequest, context: Any) -> pb.ModelStatisticsResponse:
        stats = self.service.version_statistics(req.name or None, _version(req.version))
        out = pb.ModelStatisticsResponse()
        json_format.ParseDict(statistics_response(stats), out, ignore_unknown_fields=True)
        return out

    # ---- model repository -------------------------------------------------------------------
    async def repository_index(self, req: pb.RepositoryIndexRequest, context: Any) -> pb.RepositoryIndexResponse:
        index = self._scrubbed(await asyncio.to_thread(v2_ops.repository_index, self.service, req.ready))
        return pb.RepositoryIndexResponse(models=[pb.RepositoryIndexResponse.ModelIndex(**e) for e in index])

    async def repository_load(self, req: pb.RepositoryModelLoadRequest, context: Any) -> pb.RepositoryModelLoadResponse:
        await self._model_control(req, context, "load")
        return pb.RepositoryModelLoadResponse()

    async def repository_unload(self, req: pb.RepositoryModelUnloadRequest,
                                context: Any) -> pb.RepositoryModelUnloadResponse:
        await self._model_control(req, context, "unload")
        return pb.RepositoryModelUnloadResponse()

    async def _model_control(self, req: Any, context: Any, action: str) -> None:
        v2_ops.check_model_control(self.authority, peer_of(context), req.model_name, action, set(req.parameters))
        await self.control.run(self.service, req.model_name, action)

    # ---- system shared memory ---------------------------------------------------------------
    def _shm_scope(self, context: Any) -> str:
        return self.authority.scope(peer_of(context), "use system shared memory")

    def _shm_view(self, context: Any) -> ShmView:
        """The caller's regions; a caller without the credential has none (references fail as unknown).

        With no region registered by anyone, every reference fails as unknown whoever asks: the caller's
        identity (metadata and peer, read from grpcio per call) is not looked up."""
        if not len(self.shm):
            return self.shm.view("")
        return self.shm.view(self.authority.known_scope(peer_of(context)) or "")

    async def sysshm_status(self, req: pb.SystemSharedMemoryStatusRequest,
                            context: Any) -> pb.SystemSharedMemoryStatusResponse:
        regions = self.shm.status(self._shm_scope(context), req.name or None)
        out = pb.SystemSharedMemoryStatusResponse()
        for r in regions:
            out.regions[r["name"]].CopyFrom(pb.SystemSharedMemoryStatusResponse.RegionStatus(**r))
        return out

    async def sysshm_register(self, req: pb.SystemSharedMemoryRegisterRequest,
                              context: Any) -> pb.SystemSharedMemoryRegisterResponse:
        caller = ShmCaller(self._shm_scope(context), None, None)
        self.shm.register(caller, req.name, req.key, req.offset, req.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    async def sysshm_unregister(self, req: pb.SystemSharedMemoryUnregisterRequest,
                                context: Any) -> pb.SystemSharedMemoryUnregisterResponse:
        scope = self._shm_scope(context)
        if req.name:
            self.shm.unregister(scope, req.name)
        else:
            self.shm.unregister_all(scope)
        return pb.SystemSharedMemoryUnregisterResponse()

    # No CUDA shared memory here: answered as a Triton without GPU regions (clients unregister all on exit).
    async def cudashm_status(self, req: pb.CudaSharedMemoryStatusRequest,
                             context: Any) -> pb.CudaSharedMemoryStatusResponse:
        if req.name:
            raise InvalidInputError(f"unable to find cuda shared memory region: {req.name!r}")
        return pb.CudaSharedMemoryStatusResponse()

    async def cudashm_register(self, req: pb.CudaSharedMemoryRegisterRequest,
                               context: Any) -> pb.CudaSharedMemoryRegisterResponse:
        raise InvalidInputError("CUDA shared memory is not supported by this server; use system shared memory")

    async def cudashm_unregister(self, req: pb.CudaSharedMemoryUnregisterRequest,
                                 context: Any) -> pb.CudaSharedMemoryUnregisterResponse:
        return pb.CudaSharedMemoryUnregisterResponse()

    # ---- inference --------------------------------------------------------------------------
    async def _infer(self, msg: InferMessage, context: Any, size: int, *, lone: bool = True) -> bytes:
        """ModelInfer, and each ModelStreamInfer request: the serialized ModelInferResponse; ``size``: the
        message's bytes on the wire; ``lone``: the request may run on the loop if nothing else is in
        flight (a stream's request only when read after every earlier answer was sent, model_stream_infer)."""
        shm = self._shm_view(context)
        if msg.plan is not None:
            decoded = msg.plan.decode(msg.raw)
        else:
            if size > v2_ops.HEAVY:
                decoded = await asyncio.to_thread(decode_infer, msg.request, shm, msg.raw)
            else:
                decoded = decode_infer(msg.request, shm, msg.raw)
            self.plans.learn(msg, decoded)
        v2_ops.prepare_infer(decoded, shm, context.time_remaining())
        if lone and self._active <= 1:
            done = self.service.infer_or_submit(decoded.request, v2_ops.LOOP_INLINE_MAX_NS)
            resp = done if isinstance(done, InferResponse) else await asyncio.wrap_future(done)
        else:
            resp = await asyncio.wrap_future(self.service.submit(decoded.request))
        if v2_ops.encode_is_heavy(resp, decoded):
            return await asyncio.to_thread(self.plans.answer, resp, decoded, shm)
        return self.plans.answer(resp, decoded, shm)

    async def _stream_one(self, data: bytes, context: Any, lone: bool) -> bytes:
        """One stream request's answer, success or error; never raises (the stream goes on)."""
        msg: InferMessage | None = None
        hold = None
        self._active += 1
        try:
            hold = self._admit(data)
            msg = await self._received(data, hold)
            return stream_response(await self._infer(msg, context, len(data), lone=lone))
        except EdgedError as e:
            code, error = self._status(e)
        except Exception:
            log.exception("gRPC ModelStreamInfer request failed")
            code, error = ErrorCode.INTERNAL, "internal error"
        finally:
            self._active -= 1
            if hold is not None:
                hold.release()
                self.reads.admit()
        # which request failed, by its model, version and id (a planned message is parsed for it now), and
        # its code: a stream's error reply has no status of its own
        reply = pb.ModelStreamInferResponse(error_message=error,
                                            infer_response=error_response(msg.request if msg else None))
        reply.infer_response.parameters[ERROR_CODE_KEY].string_param = code.value
        return bytes(reply.SerializeToString())

    async def model_stream_infer(self, requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        """Each request's answer in order, up to ``stream_inflight`` computed at once.

        A client that waits for each answer before it sends the next request (ping-pong) has its lone
        requests run on the loop as unary ones do: no hand-off to a scheduler thread and back. A request
        read before the answer to an earlier one of the stream has been sent is pipelined, and queued,
        where it can be batched with the others in flight (run on the loop, each would hold it while the
        next ones wait, and never be batched).

        "Sent" is when grpcio asks for the next answer, having written this one: its write completes
        through the same completion queue as the reads, in order. A pipelined request was in grpcio's
        buffer when the read for it began, before the earlier answer was computed, so its read completes
        first, every time; a ping-pong client sends its next request only after it has the answer, so that
        read completes after the write. The loop can still resume the reader before grpcio's writer when
        both completions reach it together (a busy 2-core host, about one request in a hundred), so the
        judgement is each request's own: one such inversion costs that request a hand-off, not the rest
        of the stream."""
        # A slot is taken before a request is read and held until its answer is handed to grpcio, so that
        # a slow request at the head cannot let finished answers behind it pile up without bound, and no
        # request is read (held outside the request memory budget) while the window is full.
        window = asyncio.Semaphore(self.stream_inflight)
        answers: asyncio.Queue[asyncio.Task[bytes] | None] = asyncio.Queue()
        unanswered = 0

        async def read() -> None:
            nonlocal unanswered
            it = aiter(requests)
            try:
                while True:
                    await window.acquire()  # before the read: no request is taken beyond the window
                    try:
                        data = await anext(it)
                    except StopAsyncIteration:
                        break
                    lone = unanswered == 0
                    unanswered += 1
                    answers.put_nowait(asyncio.create_task(self._stream_one(data, context, lone)))
            finally:
                answers.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (task := await answers.get()) is not None:
                answer = await task
                window.release()
                yield answer
                unanswered -= 1  # grpcio has written it
            await reader  # a broken request stream ends the RPC with its error
        finally:
            reader.cancel()
            while not answers.empty():
                pending = answers.get_nowait()
                if pending is not None:
                    pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
