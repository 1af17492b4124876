"""One shared-memory client connection, served by its own thread.

Why a thread per client: a blocking ``recvmsg`` followed by
``service.infer_or_submit`` runs the model in the thread that read the request when
the model is idle, which is the lowest latency Python can offer (no hand-off to
another thread, no event loop). When the client pipelines (it flags the request as
queued, or some are still in flight here) or the model is busy, the thread hands the
request to the scheduler instead and goes back to reading, so requests queue and
batch, and their completions are written from the scheduler's done-callback, possibly
out of order. The thread never waits for a queued run: the requests behind it would
stay unread on the socket, out of the batch.

Everything the client owned (mapped segments) is released when its socket
reaches EOF or reset, which is also what a ``kill -9`` of the client looks like.

Replies go out with ``MSG_DONTWAIT`` (a scheduler thread must never block on one client), so a
full send buffer means the client is not reading: it is disconnected. Each accepted socket's send
buffer is therefore sized to hold ``max_inflight`` unread replies (:func:`fit_send_buffer`), so a
client that reads late, within its limit, is never mistaken for one that does not read.
"""

from __future__ import annotations

import array
import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from edged import datatypes
from edged.core.service import InferenceService
from edged.errors import (
    EdgedError,
    ErrorCode,
    InternalError,
    InvalidInputError,
    ModelNotReadyError,
    OverloadedError,
    ResourceExhaustedError,
)
from edged.protocol import shm as p
from edged.protocol.types import InferRequest, InferResponse
from edged.protocol.v2 import bytes_from_buffer, bytes_to_buffer
from edged.protocol.v2_models import metadata_response
from edged.transports.redact import Scrubber
from edged.transports.shm.segments import Segment, SegmentError, check_range, map_segment

log = logging.getLogger(__name__)

_MAX_FDS = 4
_ANC_SPACE = socket.CMSG_SPACE(_MAX_FDS * array.array("i").itemsize)
_INFER_REPLY = p.INFER | p.REPLY
_TRUNC = int(socket.MSG_TRUNC)
_CTRUNC = int(socket.MSG_CTRUNC)


_PLAN_CACHE = 64

# What the kernel charges a socket's send buffer for one queued reply of up to 1 KiB (an INFER
# reply is a header and a few output descriptors): the payload in a 2 KiB slab plus the skb
# (measured with SIOCOUTQ: 768 bytes for replies up to 192 bytes, 1280 up to 704, 2304 up to 1728).
REPLY_COST = 2304
# Room for replies to control messages (REGISTER, METADATA, ...) besides max_inflight INFER replies.
_CONTROL_REPLIES = 32


def reply_room(max_inflight: int) -> int:
    """Send-buffer bytes that hold every reply a client within ``max_inflight`` may leave unread."""
    return (max_inflight + _CONTROL_REPLIES) * REPLY_COST


def fit_send_buffer(sock: socket.socket, need: int) -> int:
    """Grow ``sock``'s send buffer to at least ``need`` bytes (never shrink it); returns what it holds.

    The kernel doubles what SO_SNDBUF asks for (socket(7)) and caps the request at net.core.wmem_max."""
    have: int = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    if have < need:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, (need + 1) // 2)
        have = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    return have


@dataclass
class _Plan:
    """A checked INFER descriptor: its inputs' places, the segments it uses, output layouts seen."""

    desc: p.InferDesc
    inputs: list[tuple[str, Segment, np.dtype[Any] | None, tuple[int, ...], int, int]]  # dtype None: BYTES
    used: tuple[Segment, ...]  # input segments, then the output segment last
    # per output signature: the encoded descriptors and the views to copy into (made once)
    outputs: dict[tuple[Any, ...], tuple[bytes, list[np.ndarray]]] = field(default_factory=dict)
    # the numeric inputs' views, made once (they hold the mappings open until the plan is dropped,
    # which every path that unmaps a segment does first); None while any input is BYTES
    views: dict[str, np.ndarray] | None = None


@dataclass(frozen=True)
class Limits:
    """Per-client limits; a client over one gets an error reply, never a disconnect."""

    max_segments: int = 128
    max_mapped_bytes: int = 1024 * 2**20
    max_inflight: int = 64


def _take_fds(ancdata: list[tuple[int, int, bytes]]) -> list[int]:
    fds: list[int] = []
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            a = array.array("i")
            a.frombytes(data[: len(data) - len(data) % a.itemsize])
            fds.extend(a)
    return fds


class Connection:
    def __init__(self, sock: socket.socket, creds: tuple[int, int, int], *, service: InferenceService,
                 limits: Limits, on_closed: Callable[[Connection], None], scrub: Scrubber | None = None) -> None:
        self.sock = sock
        self.scrub = scrub or Scrubber()  # model reasons and errors can name internal files
        self.pid, self.uid, self.gid = creds
        self.service = service
        self.limits = limits
        self._on_closed = on_closed
        self.segments: dict[int, Segment] = {}
        # Unregistered while requests in flight still use them: no longer named by any id, unmapped
        # (and counted against the limits until then) when the last of those requests finishes.
        self._retiring: list[Segment] = []
        self.mapped_bytes = 0
        self.requests = 0
        self.inflight = 0
        self._next_segment = 1
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._closing = False
        self._waiters = 0  # threads in wait_idle (completions notify only when someone waits)
        self._plans: dict[bytes, _Plan] = {}
        self._buf = bytearray(p.MAX_MESSAGE)
        self.thread = threading.Thread(target=self._run, name=f"edged-shm-pid{self.pid}", daemon=True)

    def info(self) -> dict[str, Any]:
        return {"pid": self.pid, "uid": self.uid, "gid": self.gid, "segments": len(self.segments),
                "mapped_bytes": self.mapped_bytes, "inflight": self.inflight, "requests": self.requests}

    # ---- life cycle -------------------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def begin_close(self) -> None:
        """Refuse new inference; what is in flight still completes."""
        self._closing = True

    def wait_idle(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        with self._idle:
            self._waiters += 1
            try:
                while self.inflight:
                    left = end - time.monotonic()
                    if left <= 0:
                        return False
                    self._idle.wait(left)
            finally:
                self._waiters -= 1
        return True

    def shutdown(self) -> None:
        """Wake the connection thread (its recv returns EOF), which then releases everything."""
        self._closing = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def _run(self) -> None:
        buf = self._buf
        view = memoryview(buf)
        sock = self.sock
        try:
            while True:
                try:
                    n, anc, flags, _ = sock.recvmsg_into([buf], _ANC_SPACE)
                except OSError:
                    break  # ECONNRESET and friends: the client is gone
                fds = _take_fds(anc)
                if n == 0 and not fds:
                    break  # EOF: closed, exited or killed
                try:
                    self._dispatch(view[:n], fds, flags)
                finally:
                    for fd in fds:  # whatever REGISTER did not keep
                        if fd >= 0:
                            with contextlib.suppress(OSError):
                                os.close(fd)
        except Exception:
            log.exception("shm client pid=%d: connection thread failed", self.pid)
        finally:
            self._release()

    def _release(self) -> None:
        # In-flight requests still read inputs from (and write outputs to) the client's segments:
        # let them finish before unmapping. Their completions go nowhere; that is fine.
        self.wait_idle(60.0)
        segs = [*self.segments.values(), *self._retiring]
        freed = self.mapped_bytes
        self._plans.clear()
        self.segments.clear()
        self._retiring.clear()
        self.mapped_bytes = 0
        lingering = sum(not s.close() for s in segs)
        with contextlib.suppress(OSError):
            self.sock.close()
        log.info("shm client disconnected: pid=%d, %d request(s), freed %d segment(s) / %d bytes%s",
                 self.pid, self.requests, len(segs), freed,
                 f" ({lingering} unmapped when their last view goes)" if lingering else "")
        self._on_closed(self)

    # ---- dispatch ---------------------------------------------------------------------------
    def _dispatch(self, msg: memoryview, fds: list[int], flags: int) -> None:
        if len(msg) < p.HEADER.size:
            self._send(p.encode_error(0x7F, 0, ErrorCode.INVALID_ARGUMENT,
                                      f"message of {len(msg)} bytes is shorter than the header"))
            return
        kind, rflags, _, rid = p.HEADER.unpack_from(msg)
        body = msg[p.HEADER.size:]
        try:
            if flags & _TRUNC:
                raise p.ProtocolError(f"message longer than {p.MAX_MESSAGE} bytes")
            if flags & _CTRUNC:
                raise p.ProtocolError(f"more than {_MAX_FDS} file descriptors in one message")
            if fds and kind != p.REGISTER:
                raise p.ProtocolError("file descriptors are accepted only with REGISTER")
            if kind == p.INFER:
                self._infer(rid, body, rflags & p.FLAG_QUEUE)
            elif kind == p.REGISTER:
                self._register(rid, body, fds)
            elif kind == p.UNREGISTER:
                self._unregister(rid, body)
            elif kind == p.METADATA:
                self._metadata(rid, body)
            elif kind == p.HELLO:
                self._hello(rid, body)
            else:
                raise p.ProtocolError(f"unknown message kind {kind}")
        except EdgedError as e:
            self._send(p.encode_error(kind & 0x7F, rid, e.code, self.scrub.text(e.message),
                                      e.context.get("needed_bytes", 0)))
        except Exception:
            log.exception("shm client pid=%d: failed to handle message kind %d", self.pid, kind)
            self._send(p.encode_error(kind & 0x7F, rid, ErrorCode.INTERNAL, "internal error"))

    def _send(self, msg: bytes) -> None:
        try:
            self.sock.send(msg, socket.MSG_DONTWAIT)
        except BlockingIOError:
            # Never block a scheduler thread on a client that stopped reading its replies.
            log.warning("shm client pid=%d does not read its replies; disconnecting it", self.pid)
            self.shutdown()
        except OSError:
            pass  # the client is gone; the connection thread is cleaning up

    # ---- control messages -------------------------------------------------------------------
    def _hello(self, rid: int, body: memoryview) -> None:
        if len(body) != p.U32.size:
            raise p.ProtocolError("HELLO body must be 4 bytes")
        (version,) = p.U32.unpack_from(body)
        if version != p.PROTOCOL_VERSION:
            raise EdgedError(f"protocol version {version} is not supported (the daemon speaks "
                             f"{p.PROTOCOL_VERSION})", code=ErrorCode.FAILED_PRECONDITION)
        lim = self.limits
        info = {"protocol": p.PROTOCOL_VERSION, "max_segments": lim.max_segments,
                "max_mapped_bytes": lim.max_mapped_bytes, "max_inflight": lim.max_inflight,
                "max_message": p.MAX_MESSAGE, "alignment": p.ALIGNMENT}
        self._send(p.header(p.HELLO | p.REPLY, rid) + orjson.dumps(info))

    def _register(self, rid: int, body: memoryview, fds: list[int]) -> None:
        if len(body) != p.U64.size:
            raise p.ProtocolError("REGISTER body must be 8 bytes (the segment size)")
        if len(fds) != 1:
            raise SegmentError(f"REGISTER must carry exactly one file descriptor, got {len(fds)}")
        (size,) = p.U64.unpack_from(body)
        lim = self.limits
        if len(self.segments) + len(self._retiring) >= lim.max_segments:
            raise ResourceExhaustedError(f"too many segments: at most {lim.max_segments} per client")
        if size > lim.max_mapped_bytes - self.mapped_bytes:
            raise ResourceExhaustedError(
                f"segment of {size} bytes exceeds this client's shared-memory budget "
                f"({self.mapped_bytes} of {lim.max_mapped_bytes} bytes in use)")
        seg = map_segment(fds[0], size, self._next_segment)
        os.close(fds[0])
        fds[0] = -1  # the mapping keeps the memory; the fd is no longer needed
        self._next_segment += 1
        with self._lock:
            self.segments[seg.id] = seg
            self.mapped_bytes += size
        self._send(p.header(p.REGISTER | p.REPLY, rid) + p.U32.pack(seg.id))

    def _unregister(self, rid: int, body: memoryview) -> None:
        if len(body) != p.U32.size:
            raise p.ProtocolError("UNREGISTER body must be 4 bytes (the segment id)")
        (seg_id,) = p.U32.unpack_from(body)
        with self._lock:
            seg = self.segments.pop(seg_id, None)
            if seg is None:
                raise InvalidInputError(f"unknown segment {seg_id}")
            self._plans.clear()  # cached plans may name this segment
            busy = seg.busy
            if busy:
                # A request cut off on the client's side may still be queued here. Refusing would leave
                # the segment registered (and counted) until disconnect, as the client has moved on:
                # the id goes now, so no new request can name it, and _finish unmaps it after the last.
                self._retiring.append(seg)
            else:
                self.mapped_bytes -= seg.size
        if not busy:
            seg.close()
        self._send(p.header(p.UNREGISTER | p.REPLY, rid))

    def _metadata(self, rid: int, body: memoryview) -> None:
        try:
            version, nlen = p.META_BODY.unpack_from(body)
        except Exception:
            raise p.ProtocolError("METADATA body is truncated") from None
        if len(body) != p.META_BODY.size + nlen:
            raise p.ProtocolError("METADATA body length does not match the model name length")
        name = bytes(body[p.META_BODY.size:]).decode("utf-8", "replace")
        if version < 0:
            raise InvalidInputError(f"model version {version} is negative")
        meta = metadata_response(self.service.describe(name, version or None))
        mv = self.service.model(name, version or None)
        meta["max_batch_size"] = mv.max_batch_size
        meta["version"] = mv.version
        self._send(p.header(p.METADATA | p.REPLY, rid) + self.scrub.data(orjson.dumps(meta)))

    # ---- inference --------------------------------------------------------------------------
    def _plan(self, body: memoryview) -> _Plan:
        """Decode and check an INFER body against this client's segments (no views made yet)."""
        d = p.decode_infer(body)
        if d.version < 0:
            raise InvalidInputError(f"model version {d.version} is negative")
        segments = self.segments
        inputs: list[tuple[str, Segment, np.dtype[Any] | None, tuple[int, ...], int, int]] = []
        seen: set[str] = set()
        for t in d.inputs:
            seg = segments.get(t.segment)
            if seg is None:
                raise InvalidInputError(f"input {t.name!r}: unknown segment {t.segment}")
            if t.name in seen:
                raise InvalidInputError(f"input {t.name!r} appears twice")
            if t.dtype == p.BYTES:  # sized by its data: the element count is checked against it when read
                datatypes.element_count(t.shape, f"input {t.name!r}")
                check_range(seg, t.offset, t.nbytes, f"input {t.name!r}")
                seen.add(t.name)
                inputs.append((t.name, seg, None, t.shape, t.offset, t.nbytes))
                continue
            if not 0 < t.dtype < len(p.NUMPY_DTYPES):
                raise InvalidInputError(f"input {t.name!r}: unknown dtype code {t.dtype}")
            dt = p.NUMPY_DTYPES[t.dtype]
            assert dt is not None
            need = dt.itemsize * datatypes.element_count(t.shape, f"input {t.name!r}")
            if need != t.nbytes:
                raise InvalidInputError(f"input {t.name!r}: shape {list(t.shape)} of {p.DTYPES[t.dtype]} is "
                                        f"{need} bytes, the descriptor says {t.nbytes}")
            check_range(seg, t.offset, t.nbytes, f"input {t.name!r}")
            if t.offset % dt.itemsize:
                raise InvalidInputError(f"input {t.name!r}: offset {t.offset} is not aligned to {dt.itemsize} bytes")
            seen.add(t.name)
            inputs.append((t.name, seg, dt, t.shape, t.offset, t.nbytes))
        oseg = segments.get(d.out_segment)
        if oseg is None:
            raise InvalidInputError(f"output slot: unknown segment {d.out_segment}")
        check_range(oseg, d.out_offset, d.out_capacity, "output slot")
        views = None
        if all(dt is not None for _, _, dt, _, _, _ in inputs):
            views = {name: seg.view(dt, shape, off) for name, seg, dt, shape, off, _ in inputs}  # type: ignore[arg-type]
        return _Plan(d, inputs, (*(i[1] for i in inputs), oseg), views=views)

    def _infer(self, rid: int, body: memoryview, queue: int) -> None:
        if self._closing:
            raise ModelNotReadyError("edged is stopping; not accepting new requests")
        # A client repeats the same descriptor (same slot, same shapes) request after request:
        # decode and check it once. The cache is cleared whenever a segment goes away.
        key = bytes(body)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plan(body)
            if len(self._plans) >= _PLAN_CACHE:
                self._plans.clear()
            self._plans[key] = plan
        d, used = plan.desc, plan.used
        memory = None
        if plan.views is not None:
            inputs = dict(plan.views)  # the request's own mapping of the views
        else:
            # BYTES inputs are copied out of the client's memory (numeric ones are views): reserved first.
            copied = sum(n + ELEMENT_COST * datatypes.element_count(shape, name)
                         for name, _, dt, shape, _, n in plan.inputs if dt is None)
            memory = self.service.budget.reserve(copied, "the request's BYTES inputs")
            try:
                inputs = {name: seg.view(dt, shape, off) if dt is not None else _bytes_input(name, seg, shape, off, n)
                          for name, seg, dt, shape, off, n in plan.inputs}
            except BaseException:
                memory.release()
                raise
        deadline = time.monotonic() + d.timeout_us / 1e6 if d.timeout_us else None
        req = InferRequest(d.model, inputs, d.version or None, d.outputs, deadline=deadline, memory=memory)
        with self._lock:
            if self.inflight >= self.limits.max_inflight:
                if memory is not None:
                    memory.release()
                raise OverloadedError(f"too many requests in flight on this connection "
                                      f"(at most {self.limits.max_inflight})")
            inline = not (self.inflight or queue)
            self.inflight += 1
            for s in used:
                s.busy += 1
        try:
            # Inline only while the model is idle: never wait here for a queued run, or the requests
            # behind this one stay unread on the socket and cannot join its batch.
            done = self.service.infer_or_submit(req, None) if inline else self.service.submit(req)
            if isinstance(done, Future):
                done.add_done_callback(lambda f: self._done(rid, plan, f))
            else:
                self._finish(rid, plan, done, None)
        except EdgedError as e:
            self._finish(rid, plan, None, e)
        except Exception as e:
            log.exception("shm client pid=%d: inference failed", self.pid)
            self._finish(rid, plan, None, InternalError(f"internal error: {type(e).__name__}"))

    def _done(self, rid: int, plan: _Plan, fut: Future[InferResponse]) -> None:
        try:
            resp = fut.result()
        except EdgedError as e:
            self._finish(rid, plan, None, e)
        except BaseException as e:
            self._finish(rid, plan, None, InternalError(f"internal error: {type(e).__name__}"))
        else:
            self._finish(rid, plan, resp, None)

    def _finish(self, rid: int, plan: _Plan, resp: InferResponse | None, err: EdgedError | None) -> None:
        try:
            if resp is not None:
                msg = self._write_outputs(rid, plan, resp)
            else:
                assert err is not None
                msg = p.encode_error(p.INFER, rid, err.code, self.scrub.text(err.message),
                                     err.context.get("needed_bytes", 0))
        except EdgedError as e:
            msg = p.encode_error(p.INFER, rid, e.code, self.scrub.text(e.message), e.context.get("needed_bytes", 0))
        except Exception:
            log.exception("shm client pid=%d: writing outputs failed", self.pid)
            msg = p.encode_error(p.INFER, rid, ErrorCode.INTERNAL, "internal error while writing outputs")
        finally:
            with self._lock:  # the condition's lock, entered directly (no Python-level wrapper per reply)
                self.inflight -= 1
                self.requests += 1
                for s in plan.used:
                    s.busy -= 1
                if self._retiring:  # some segment was unregistered while in use: maybe this was its last
                    self._unmap_retired(plan)
                if self._waiters and not self.inflight:
                    self._idle.notify_all()
        self._send(msg)

    def _unmap_retired(self, plan: _Plan) -> None:
        """Unmap the unregistered segments of ``plan`` that no request uses any more (under the lock).

        The plan is out of the cache (the UNREGISTER cleared it) and nothing in flight uses it, so its
        views go too. A view the scheduler still holds (the batch is answered from its frame) keeps
        the mapping until it goes; the budget no longer counts it, as when a segment is let go idle."""
        for s in plan.used:
            if not s.busy and s in self._retiring:
                self._retiring.remove(s)
                self.mapped_bytes -= s.size
                plan.views = None
                plan.outputs.clear()
                s.close()

    def _write_outputs(self, rid: int, plan: _Plan, resp: InferResponse) -> bytes:
        """Pack outputs into the client's output slot (one copy each) and build the completion."""
        outs = resp.outputs
        seg = plan.used[-1]
        # A layout is only ever kept for numeric outputs, so a known signature needs no other check.
        sig = tuple([(name, arr.dtype, arr.shape) for name, arr in outs.items()])
        layout = plan.outputs.get(sig)
        if layout is None:
            if any(arr.dtype == object for arr in outs.values()):
                return self._write_serialized(rid, plan, resp)
            if len(plan.outputs) >= _PLAN_CACHE:
                plan.outputs.clear()
            offsets, descs = self._layout(plan.desc, outs)
            places = [seg.view(arr.dtype, arr.shape, off) for arr, off in zip(outs.values(), offsets, strict=True)]
            layout = plan.outputs[sig] = (descs, places)
        descs, places = layout
        for arr, place in zip(outs.values(), places, strict=True):
            if arr.nbytes:
                np.copyto(place, arr, casting="no")
        return p.HEADER.pack(_INFER_REPLY, 0, len(outs), rid) + p.U32.pack(resp.version) + descs

    def _write_serialized(self, rid: int, plan: _Plan, resp: InferResponse) -> bytes:
        """Outputs with BYTES among them: sized by their contents, so serialized and laid out afresh each time."""
        outs = resp.outputs
        seg = plan.used[-1]
        blobs = {name: bytes_to_buffer(arr) for name, arr in outs.items() if arr.dtype == object}
        offsets, descs = self._layout(plan.desc, outs, blobs)
        for (name, arr), off in zip(outs.items(), offsets, strict=True):
            blob = blobs.get(name)
            if blob is not None:
                seg.mm[off:off + len(blob)] = blob
            elif arr.nbytes:
                np.copyto(seg.view(arr.dtype, arr.shape, off), arr, casting="no")
        return p.HEADER.pack(_INFER_REPLY, 0, len(outs), rid) + p.U32.pack(resp.version) + descs

    @staticmethod
    def _layout(d: p.InferDesc, outs: dict[str, np.ndarray],
                blobs: dict[str, bytes] | None = None) -> tuple[list[int], bytes]:
        """Where each output goes in the slot and its encoded descriptors; raises when the slot is too small.

        ``blobs`` holds the serialized BYTES outputs (their size is their data's)."""
        pos = d.out_offset
        plan: list[tuple[str, np.ndarray, int, int, int]] = []
        for name, arr in outs.items():
            blob = blobs.get(name) if blobs else None
            code = p.BYTES if blob is not None else p.NUMPY_CODE.get(arr.dtype)
            if code is None:
                raise InvalidInputError(f"output {name!r} of datatype {arr.dtype} cannot be returned over shared "
                                        "memory; use HTTP or MQTT for it")
            pos = p.align(pos)
            nbytes = len(blob) if blob is not None else arr.nbytes
            plan.append((name, arr, code, pos, nbytes))
            pos += nbytes
        needed = pos - d.out_offset
        if needed > d.out_capacity:
            raise ResourceExhaustedError(f"output slot of {d.out_capacity} bytes is too small; the outputs need "
                                         f"{needed} bytes", needed_bytes=needed)
        return ([off for *_, off, _ in plan],
                b"".join(p.encode_output(name, code, arr.shape, offset=off, nbytes=nbytes)
                         for name, arr, code, off, nbytes in plan))


# A BYTES element copied out becomes a bytes object (its data plus 33 bytes) in an object array (8 more).
ELEMENT_COST = 48


def _bytes_input(name: str, seg: Segment, shape: tuple[int, ...], offset: int, nbytes: int) -> np.ndarray:
    """A BYTES input's elements, copied out of the client's range (which it may change under us)."""
    where = f"input {name!r}"
    count = datatypes.element_count(shape, where)
    with memoryview(seg.mm) as whole, whole[offset:offset + nbytes] as data:
        return bytes_from_buffer(data, count, where).reshape(shape)
