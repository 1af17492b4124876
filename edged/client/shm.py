"""Python client for edged's shared-memory fast path (sync :class:`ShmClient`, asyncio :class:`AsyncShmClient`).

Why use it: tensors are written once into memory the daemon maps too, and only a
small descriptor crosses the socket, so a local program pays tens of
microseconds per request instead of milliseconds of HTTP/JSON. Example::

    from edged.client.shm import ShmClient

    with ShmClient() as c:                      # $EDGED_SHM_SOCKET or /run/edged/edged.sock
        out = c.infer("digits", {"pixels": x})  # x: float32 [batch, 64]; outputs are copies

    # zero copy: fill the shared buffer in place, read outputs as views
    with ShmClient() as c:
        img = c.input_buffer("mobilenet", "image", (1, 3, 48, 192))
        camera.read_into(img)
        out = c.infer("mobilenet", {"image": img}, copy=False)  # views, valid until the next call

    # a frame loop: the request is checked and encoded once, outputs are views made once
    with ShmClient() as c, c.prepare("mobilenet", {"image": (1, 3, 48, 192)}) as req:
        while camera.read_into(req.inputs["image"]):
            out = req.run()

    # asyncio: one prepared request per camera, all pipelined (and batched) on one connection
    async with AsyncShmClient() as c:
        async def stream(cam):
            async with await c.prepare("mobilenet", {"image": (1, 3, 48, 192)}) as req:
                while await cam.read_into(req.inputs["image"]):
                    out = await req.run()
        await asyncio.gather(*(stream(cam) for cam in cameras))

Before anything is sent, the client checks who serves the socket (SO_PEERCRED): by default
root, this user or the ``edged`` system user; ``server_uid=`` or ``$EDGED_SHM_SERVER_UID``
names the one uid to accept instead. Another user's process that took over the socket path
gets nothing: no request, no memfd.

The wire protocol is described in :mod:`edged.protocol.shm`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import socket
import threading
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, TypeVar

import numpy as np

from edged.client.inflight import Inflight
from edged.client.shm_core import (
    TRIES,
    Key,
    Op,
    ShmCore,
    answer,
    arun,
    closed_error,
    fds_message,
    grow_limit,
    link_error,
    needed_bytes,
    not_open_error,
    run,
)
from edged.client.shm_memory import (
    ClientSegment,
    ModelInfo,
    PackedInputs,
    Slot,
    Template,
    encode_request,
    find_segment,
    make_template,
    plan_inputs,
    read_outputs,
    template_key,
)
from edged.client.shm_prepared import AsyncPreparedInfer, PreparedInfer
from edged.errors import EdgedError, ErrorCode, InvalidInputError, PermissionDeniedError
from edged.protocol import shm as p
from edged.protocol.peercred import peer_credentials

__all__ = ["AsyncShmClient", "PreparedInfer", "ShmClient", "default_socket"]

T = TypeVar("T")


def default_socket(path: str | os.PathLike[str] | None = None) -> str:
    return os.fspath(path) if path is not None else os.environ.get(p.SOCKET_ENV) or p.DEFAULT_SOCKET


SERVER_UID_ENV = "EDGED_SHM_SERVER_UID"
DAEMON_USER = "edged"  # the packaged service's user


def expected_server_uids(server_uid: int | None = None) -> frozenset[int]:
    """Whom the client trusts to be the daemon: ``server_uid``, else ``$EDGED_SHM_SERVER_UID``, else
    root, this user and the ``edged`` system user (when it exists)."""
    if server_uid is not None:
        return frozenset({server_uid})
    env = os.environ.get(SERVER_UID_ENV, "").strip()
    if env:
        if not env.isdigit():
            raise EdgedError(f"${SERVER_UID_ENV} must be a numeric uid, not {env!r}", code=ErrorCode.INVALID_ARGUMENT)
        return frozenset({int(env)})
    uids = {0, os.geteuid()}
    import pwd

    with contextlib.suppress(KeyError):
        uids.add(pwd.getpwnam(DAEMON_USER).pw_uid)
    return frozenset(uids)


def verify_server(sock: socket.socket, path: str, trusted: frozenset[int]) -> None:
    """Refuse a socket served by anyone else (checked before the first byte or memfd is sent)."""
    try:
        pid, uid, _ = peer_credentials(sock)
    except OSError as e:
        raise PermissionDeniedError(f"cannot tell who serves {path}: {e.strerror or e}") from None
    if uid not in trusted:
        raise PermissionDeniedError(
            f"the shared-memory socket {path} is served by uid {uid} (pid {pid}), not by the daemon this client "
            f"trusts (uid {', '.join(map(str, sorted(trusted)))}); nothing was sent. If that is the right daemon, "
            f"pass server_uid= or set ${SERVER_UID_ENV}"
        )


def _unavailable(path: str, e: OSError) -> EdgedError:
    return EdgedError(
        f"cannot connect to edged's shared-memory socket {path}: {e.strerror or e} "
        f"(is the daemon running, and may this user use the socket?)",
        code=ErrorCode.UNAVAILABLE,
    )


class _Call:
    """One async INFER's slot, and whether a late completion owns it and the in-flight place (``cut``)."""

    __slots__ = ("cut", "slot")

    def __init__(self) -> None:
        self.slot: Slot | None = None
        self.cut = False


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class ShmClient:
    """Blocking client; one request at a time per client (use one per thread, or :class:`AsyncShmClient`)."""

    def __init__(self, socket_path: str | os.PathLike[str] | None = None, *, server_uid: int | None = None) -> None:
        self.socket_path = default_socket(socket_path)
        trusted = expected_server_uids(server_uid)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.connect(self.socket_path)
            verify_server(sock, self.socket_path, trusted)
        except OSError as e:
            sock.close()
            raise _unavailable(self.socket_path, e) from None
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._buf = bytearray(p.MAX_MESSAGE)
        self._view = memoryview(self._buf)
        self._lock = threading.RLock()
        self._core = ShmCore()
        self._slots: dict[Key, Slot] = {}
        self._orphans: list[ClientSegment] = []  # slots of interrupted infer() calls, given back with the next slot
        self._lost_registers: set[int] = set()  # ids of interrupted REGISTERs: their segments go back when answered
        self._prepared_segments: set[int] = set()  # ids of segments prepared requests own
        try:
            self.server: dict[str, Any] = self._run(self._core.hello())
        except BaseException:
            sock.close()
            raise

    # ---- plumbing: the one blocking round trip, and the core's operations run on it ------------
    def _call(self, msg: bytes | bytearray, fd: int = -1, rid: int = -1) -> tuple[int, int, memoryview]:
        """Send one request (``rid``: its id, when the caller knows it) and wait for its reply (status,
        count, body view valid until the next call)."""
        if self._core.closed:
            raise not_open_error()
        if rid < 0:
            rid = p.HEADER.unpack_from(msg)[3]
        sock = self._sock
        try:
            if fd >= 0:
                sock.sendmsg([msg], fds_message(fd))
            else:
                sock.send(msg)
            while True:
                n = sock.recv_into(self._buf)
                if n == 0:
                    raise closed_error()
                _, status, count, got = p.HEADER.unpack_from(self._buf)
                if got == rid:
                    return status, count, self._view[p.HEADER.size : n]
                if got in self._lost_registers:  # else the stale reply of an interrupted call: dropped
                    self._lost_registers.discard(got)
                    if not status:
                        sock.send(self._core.unregister_message(p.U32.unpack_from(self._buf, p.HEADER.size)[0]))
        except OSError as e:
            raise link_error(e) from None
        except BaseException:
            if fd >= 0:  # a REGISTER interrupted: the daemon maps the segment all the same; its reply names it
                self._lost_registers.add(rid)
            raise

    def _run(self, op: Op[T]) -> T:
        return run(op, self._call)

    def _unregister(self, seg: ClientSegment) -> None:
        self._run(self._core.unregister(seg))

    def _info(self, model: str, version: int | None) -> ModelInfo:
        info = self._core.models.get((model, version or 0))
        return info if info is not None else self._run(self._core.info(model, version))

    def _slot(self, key: Key, in_need: int, out_need: int) -> Slot:
        """The model's slot, replaced by a bigger one when the needs outgrow it."""
        slot = self._slots.get(key)
        if slot is not None and slot.fits(in_need, out_need):
            return slot
        if slot is not None:
            in_need, out_need = max(in_need, slot.in_cap), max(out_need, slot.out_cap)
            del self._slots[key]
            self._unregister(slot.segment)
        while self._orphans:
            self._unregister(self._orphans.pop())
        slot = self._run(self._core.area(in_need, out_need))
        self._slots[key] = slot
        return slot

    def _orphan_slot(self, key: Key) -> None:
        """An interrupted call's slot: the daemon may still write into it, so the next call gets a fresh
        one, and this one is unregistered then (the daemon unmaps it once its request is over)."""
        slot = self._slots.pop(key, None)
        if slot is not None:
            self._orphans.append(slot.segment)

    def _exchange(
        self, msg: bytes | bytearray, slot: Slot, copy: bool, grow_above: int, interrupted: Callable[[], object]
    ) -> dict[str, np.ndarray] | int:
        """One INFER round trip (:func:`~edged.client.shm_core.answer`); ``interrupted`` runs when the
        call is cut off before its answer."""
        try:
            reply = self._call(msg)
        except BaseException:
            interrupted()
            raise
        return answer(reply, slot, copy, grow_above)

    # ---- public API -------------------------------------------------------------------------
    def metadata(self, model: str, version: int | None = None) -> dict[str, Any]:
        """The daemon's v2 model metadata (plus ``max_batch_size`` and the serving ``version``)."""
        with self._lock:
            return self._run(self._core.metadata(model, version))

    def infer(
        self,
        model: str,
        inputs: Mapping[str, Any],
        version: int | None = None,
        *,
        outputs: list[str] | None = None,
        timeout: float | None = None,
        copy: bool = True,
    ) -> dict[str, np.ndarray]:
        """Run one request. Inputs already in this client's shared memory are not copied.

        ``copy=False`` returns views on the shared output area: no copy, but they are
        overwritten by the next call for the same model and version.
        ``timeout`` (seconds) is enforced by the daemon: the request is dropped if it
        has not started by then.
        """
        with self._lock:
            key = (model, version or 0)
            info = self._info(model, version)
            tkey = template_key(inputs, outputs, timeout)
            slot = self._slots.get(key)
            if slot is not None and tkey is not None and tkey in slot.templates:
                got = self._templated(key, slot, slot.templates[tkey], inputs, copy, info.output_hint)
                if not isinstance(got, int):
                    return got
                info.output_hint = got  # the output area was too small: on to a bigger slot below
            packed = plan_inputs(self._core.segments, inputs)
            for attempt in range(TRIES):
                slot = self._slot(key, packed.staged_bytes, info.output_bytes(inputs))
                views: list[np.ndarray] = []
                msg = encode_request(
                    self._core.next_id(), model, version, slot, packed, outputs=outputs, timeout=timeout, views=views
                )
                got = self._exchange(
                    msg, slot, copy, grow_limit(attempt, info.output_hint), functools.partial(self._orphan_slot, key)
                )
                if not isinstance(got, int):
                    make_template(slot, tkey, packed, msg, views)
                    return got
                info.output_hint = got  # the output area was too small: grow it and retry
            raise AssertionError("unreachable: the last try raises")

    def _templated(
        self, key: Key, slot: Slot, tpl: Template, inputs: Mapping[str, Any], copy: bool, grow_above: int
    ) -> dict[str, np.ndarray] | int:
        """A request sent like this before on ``slot``: its inputs copied in place, its message sent again
        with a new id (see :class:`~edged.client.shm_memory.Template`)."""
        for view, arr in zip(tpl.views, inputs.values(), strict=True):
            np.copyto(view, arr, casting="no")
        p.set_request_id(tpl.message, self._core.next_id())
        return self._exchange(tpl.message, slot, copy, grow_above, functools.partial(self._orphan_slot, key))

    def prepare(
        self,
        model: str,
        shapes: Mapping[str, tuple[int, ...] | list[int]],
        version: int | None = None,
        *,
        dtypes: Mapping[str, Any] | None = None,
        outputs: list[str] | None = None,
        timeout: float | None = None,
    ) -> PreparedInfer:
        """A request of fixed input shapes bound to shared buffers, for a loop that sends one after another.

        Write each request's data into ``prepared.inputs[name]`` and call ``prepared.run()``: the
        request is checked and encoded once, and outputs come back as views made once. ``shapes``
        include the batch dimension of a batching model; datatypes come from the model's metadata
        unless ``dtypes`` names them.
        """
        with self._lock:
            info = self._info(model, version)
            seg, arrays = self._run(self._core.prepared_inputs(info, shapes, dtypes))
            self._prepared_segments.add(seg.id)
            prep = PreparedInfer(self, model, version, inputs=arrays, segment=seg, outputs=outputs, timeout=timeout)
            try:
                self._bind(prep, info.output_bytes(arrays))
            except BaseException:
                self._close_prepared(prep)
                raise
            return prep

    def _bind(self, prep: PreparedInfer, out_need: int) -> None:
        """(Re)make a prepared request's output area and encode its message once."""
        packed = self._core.prepared_packed(prep)
        self._give_back(prep)
        slot = self._run(self._core.area(0, out_need))
        self._prepared_segments.add(slot.segment.id)
        self._core.encode_prepared(prep, slot, packed)

    def _give_back(self, prep: PreparedInfer) -> None:
        """Unregister the current output area and those of interrupted runs (an interrupted run may
        still be queued at the daemon: it unmaps the area once that run is over)."""
        old = [prep.slot.segment] if prep.slot is not None else []
        prep.slot = None
        for seg in old + prep.orphans:
            self._prepared_segments.discard(seg.id)
            self._unregister(seg)
        prep.orphans.clear()

    def _run_prepared(self, prep: PreparedInfer, copy: bool) -> dict[str, np.ndarray]:
        # A frame loop's every call: the round trip and the answer are taken in this one frame, the
        # message patched in place (every layer here is paid on caches the engine run has evicted).
        with self._lock:
            if prep.closed:
                raise EdgedError("the prepared request is closed", code=ErrorCode.FAILED_PRECONDITION)
            for attempt in range(TRIES):
                slot = prep.slot
                if slot is None:  # the last run was interrupted: its reply may still land in the old area
                    self._bind(prep, self._info(prep.model, prep.version).output_bytes(prep.inputs))
                    slot = prep.slot
                    assert slot is not None
                rid = self._core.next_id()
                msg = prep.message
                p.set_request_id(msg, rid)
                try:
                    status, count, body = self._call(msg, -1, rid)
                except BaseException:
                    self._orphan(prep, slot)
                    raise
                if not status:
                    return read_outputs(slot, count, body, copy)
                got = needed_bytes(status, body, grow_limit(attempt, slot.out_cap))
                info = self._info(prep.model, prep.version)
                info.output_hint = max(info.output_hint, got)
                self._bind(prep, got)  # the outputs need more room: grow the area, encode again
            raise AssertionError("unreachable: the last try raises")

    @staticmethod
    def _orphan(prep: PreparedInfer, slot: Slot) -> None:
        """The daemon may still write into an interrupted run's area: the next run gets a new one."""
        prep.orphans.append(slot.segment)
        prep.slot = None

    def _close_prepared(self, prep: PreparedInfer) -> None:
        with self._lock:
            if prep.closed:
                return
            prep.closed = True
            if self._core.closed:
                return
            self._give_back(prep)
            self._prepared_segments.discard(prep.segment.id)
            self._unregister(prep.segment)

    def tensor(self, shape: tuple[int, ...] | list[int], dtype: Any = np.float32) -> np.ndarray:
        """A new array in its own shared segment; passing it (or a contiguous part) to infer copies nothing."""
        with self._lock:
            return self._run(self._core.tensor(shape, dtype))

    def input_buffer(
        self, model: str, name: str, shape: tuple[int, ...] | list[int], dtype: Any = None, version: int | None = None
    ) -> np.ndarray:
        """A shared array for one input of one model, reused across calls (grown when a bigger shape is asked)."""
        with self._lock:
            return self._run(self._core.input_buffer(model, name, shape, dtype, version))

    def release(self, arr: np.ndarray) -> None:
        """Give back the segment of an array from :meth:`tensor` (the array stays readable locally)."""
        with self._lock:
            hit = find_segment(self._core.segments, arr)
            if hit is None:
                raise InvalidInputError("the array is not in this client's shared memory")
            if any(s.segment is hit[0] for s in self._slots.values()):
                raise InvalidInputError("the array belongs to a request slot, not to a tensor() buffer")
            if hit[0].id in self._prepared_segments:
                raise InvalidInputError("the array belongs to a prepared request: close the request instead")
            for k, seg in list(self._core.buffers.items()):
                if seg is hit[0]:
                    del self._core.buffers[k]
            self._unregister(hit[0])

    def close(self) -> None:
        """Disconnect; the daemon releases everything this client registered."""
        with self._lock:
            if self._core.closed:
                return
            self._core.closed = True
            self._sock.close()
            self._slots.clear()
            self._orphans.clear()
            self._core.drop_all()

    def __enter__(self) -> ShmClient:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


class AsyncShmClient:
    """asyncio client: many concurrent ``await infer(...)`` calls are pipelined on one connection.

    Each call in flight uses its own slot (segments are pooled and reused); outputs
    are always returned as copies, since slots are shared between calls.
    """

    def __init__(self, socket_path: str | os.PathLike[str] | None = None, *, server_uid: int | None = None) -> None:
        self.socket_path = default_socket(socket_path)
        self._trusted = expected_server_uids(server_uid)
        self.server: dict[str, Any] = {}
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: dict[int, asyncio.Future[tuple[int, int, bytes]]] = {}
        self._buf = bytearray(p.MAX_MESSAGE)
        self._core = ShmCore()
        self._free: dict[Key, list[Slot]] = {}
        # what becomes of a cancelled request's memory once its late completion arrives, by request id; each
        # also holds the request's in-flight place until then (the daemon counts the request until it answers)
        self._late: dict[int, Callable[[], None]] = {}
        self._chores: set[asyncio.Task[None]] = set()  # messages sent in the background, no reply awaited
        self._inflight: Inflight | None = None
        self._info_locks: dict[Key, asyncio.Lock] = {}
        self._room: asyncio.Future[None] | None = None  # set when the full socket has room again

    async def connect(self) -> AsyncShmClient:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, self.socket_path)
            verify_server(sock, self.socket_path, self._trusted)
        except OSError as e:
            sock.close()
            raise _unavailable(self.socket_path, e) from None
        except BaseException:
            sock.close()
            raise
        self._sock, self._loop = sock, loop
        loop.add_reader(sock.fileno(), self._on_readable)
        try:
            self.server = await self._run(self._core.hello())
        except BaseException:
            await self.close()
            raise
        self._inflight = Inflight(int(self.server.get("max_inflight", 64)))
        return self

    async def __aenter__(self) -> AsyncShmClient:
        return await self.connect()

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # ---- plumbing: replies matched to requests by id, and the core's operations run on them ----
    def _on_readable(self) -> None:
        sock = self._sock
        assert sock is not None
        while True:
            try:
                n = sock.recv_into(self._buf)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                n = 0
            if n == 0:
                self._fail_all(closed_error())
                return
            if n < p.HEADER.size:
                continue
            _, status, count, rid = p.HEADER.unpack_from(self._buf)
            fut = self._pending.pop(rid, None)
            if fut is not None and not fut.done():
                fut.set_result((status, count, bytes(self._buf[p.HEADER.size : n])))
            elif (late := self._late.pop(rid, None)) is not None:
                late()
                if self._inflight is not None:
                    self._inflight.give()

    def _fail_all(self, err: EdgedError) -> None:
        if self._sock is not None and self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self._sock.fileno())
            with contextlib.suppress(Exception):
                self._loop.remove_writer(self._sock.fileno())
        if self._room is not None:
            _wake(self._room)  # its waiters find the client closed
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(err)
        late, self._late = self._late, {}
        if self._inflight is not None:
            for _ in late:  # no late completion comes now: their places go to the waiters, who find it closed
                self._inflight.give()
        self._core.closed = True

    async def _call(self, msg: bytes | bytearray, fd: int = -1) -> tuple[int, int, bytes]:
        if self._core.closed or self._sock is None or self._loop is None:
            raise not_open_error()
        rid = p.HEADER.unpack_from(msg)[3]
        return await (self._exchange(rid, msg) if fd < 0 else self._register_exchange(rid, msg, fd))

    async def _register_exchange(self, rid: int, msg: bytes | bytearray, fd: int) -> tuple[int, int, bytes]:
        """A REGISTER (the one message with an fd). Once sent, the daemon maps the segment whatever
        becomes of the caller: cut off after that, its reply (in already, or still to come) names the
        segment, which is given back then; else each cancelled call would cost the client a segment."""
        assert self._loop is not None
        fut: asyncio.Future[tuple[int, int, bytes]] = self._loop.create_future()
        self._pending[rid] = fut
        try:
            if not self._send_now(msg, fd):
                await self._send_when_room(msg, fd)
        except BaseException:
            self._pending.pop(rid, None)
            raise
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            fut.add_done_callback(self._registered_late)
            raise

    def _registered_late(self, fut: asyncio.Future[tuple[int, int, bytes]]) -> None:
        if fut.cancelled() or fut.exception() is not None:
            return  # the connection is gone, and with it the segment
        status, _, body = fut.result()
        if not status:
            self._send_unanswered(self._core.unregister_message(p.U32.unpack_from(body)[0]))

    def _send_unanswered(self, msg: bytes | bytearray) -> None:
        """Send a message whose reply no one awaits (``_on_readable`` drops a reply of an unknown id),
        in the background when the socket is full. Closed: the connection's end releases everything."""
        if self._core.closed or self._loop is None:
            return
        with contextlib.suppress(EdgedError):
            if self._send_now(msg, -1):
                return
            task = self._loop.create_task(self._send_when_room(msg, -1))
            self._chores.add(task)
            task.add_done_callback(self._chore_done)

    def _chore_done(self, task: asyncio.Task[None]) -> None:
        self._chores.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a closed client's message needs sending no more

    async def _run(self, op: Op[T]) -> T:
        return await arun(op, self._call)

    def _send_now(self, msg: bytes | bytearray, fd: int) -> bool:
        """Send without waiting: False when the socket's buffer is full (then ``await _send_when_room``)."""
        sock = self._sock
        if sock is None:  # closed while the caller waited (for a place, for room)
            raise not_open_error()
        try:
            if fd >= 0:
                sock.sendmsg([msg], fds_message(fd))
            else:
                sock.send(msg)
            return True
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as e:
            raise link_error(e) from None

    async def _send_when_room(self, msg: bytes | bytearray, fd: int) -> None:
        """After ``_send_now`` found the socket's buffer full: wait for room, send, again while it is full.

        Every sender that found it full waits on one future: the loop keeps one writer callback per
        socket, so a callback each would leave all but the last registered waiting for ever."""
        while True:
            await asyncio.shield(self._room_again())  # one waiter cancelled: the others still wait
            if self._core.closed:
                raise not_open_error()
            if self._send_now(msg, fd):
                return

    def _room_again(self) -> asyncio.Future[None]:
        """The future set when the socket can take a message again (one, shared by every waiting sender)."""
        room = self._room
        if room is None or room.done():
            sock, loop = self._sock, self._loop
            assert sock is not None and loop is not None
            room = self._room = loop.create_future()
            fileno = sock.fileno()

            def writable() -> None:
                loop.remove_writer(fileno)
                _wake(room)
            loop.add_writer(fileno, writable)
        return room

    async def _unregister(self, seg: ClientSegment) -> None:
        await self._run(self._core.unregister(seg))

    async def _info(self, model: str, version: int | None) -> ModelInfo:
        key = (model, version or 0)
        info = self._core.models.get(key)
        if info is not None:
            return info
        async with self._info_locks.setdefault(key, asyncio.Lock()):  # one METADATA per model, not per caller
            return await self._run(self._core.info(model, version))

    async def _take_slot(self, key: Key, in_need: int, out_need: int) -> Slot:
        """A pooled slot of the model that fits (unfit ones are given back), else a new one."""
        free = self._free.setdefault(key, [])
        while free:
            slot = free.pop()
            if slot.fits(in_need, out_need):
                return slot
            in_need, out_need = max(in_need, slot.in_cap), max(out_need, slot.out_cap)
            await self._unregister(slot.segment)
        return await self._run(self._core.area(in_need, out_need))

    # ---- public API -------------------------------------------------------------------------
    async def metadata(self, model: str, version: int | None = None) -> dict[str, Any]:
        return await self._run(self._core.metadata(model, version))

    async def infer(
        self,
        model: str,
        inputs: Mapping[str, Any],
        version: int | None = None,
        *,
        outputs: list[str] | None = None,
        timeout: float | None = None,
    ) -> dict[str, np.ndarray]:
        """Run one request; call it concurrently (gather, tasks) to pipeline. Outputs are copies."""
        inflight = self._inflight
        assert inflight is not None, "call connect() (or use 'async with') first"
        if not inflight.take_now():
            await self._take_place(inflight)
        call = _Call()
        try:
            key = (model, version or 0)
            info = await self._info(model, version)
            tkey = template_key(inputs, outputs, timeout)
            free = self._free.get(key)
            try:
                if tkey is not None and free and tkey in free[-1].templates:
                    # A pooled slot that carried this very request before: its message goes again (Template).
                    call.slot = slot = free.pop()
                    tpl = slot.templates[tkey]
                    for view, arr in zip(tpl.views, inputs.values(), strict=True):
                        np.copyto(view, arr, casting="no")
                    got = await self._send_infer(call, key, tpl.message, info.output_hint)
                    if not isinstance(got, int):
                        return got
                    info.output_hint = got  # the output area was too small: packed again below
                return await self._packed_infer(call, info, model, version, inputs, outputs=outputs, timeout=timeout,
                                                tkey=tkey)
            finally:
                if call.slot is not None and not self._core.closed:
                    self._free.setdefault(key, []).append(call.slot)
        finally:
            if not call.cut:
                inflight.give()

    async def _packed_infer(  # noqa: PLR0913  infer()'s request, passed on whole
        self, call: _Call, info: ModelInfo, model: str, version: int | None, inputs: Mapping[str, Any], *,
        outputs: list[str] | None, timeout: float | None, tkey: tuple[object, ...] | None,
    ) -> dict[str, np.ndarray]:
        """The request packed and encoded, on ``call.slot`` or a pooled slot that fits (grown on "needs N
        bytes"); kept as the slot's template when it may be one."""
        key = (model, version or 0)
        packed: PackedInputs = plan_inputs(self._core.segments, inputs)
        for attempt in range(TRIES):
            slot = call.slot
            if slot is None or not slot.fits(packed.staged_bytes, info.output_bytes(inputs)):
                call.slot = None
                if slot is not None:
                    await self._unregister(slot.segment)
                call.slot = slot = await self._take_slot(key, packed.staged_bytes, info.output_bytes(inputs))
            views: list[np.ndarray] = []
            msg = encode_request(0, model, version, slot, packed, outputs=outputs, timeout=timeout, views=views)
            got = await self._send_infer(call, key, msg, grow_limit(attempt, info.output_hint))
            if not isinstance(got, int):
                make_template(slot, tkey, packed, msg, views)
                return got
            info.output_hint = got  # the output area was too small: grow it and retry
        raise AssertionError("unreachable: the last try raises")

    async def _send_infer(
        self, call: _Call, key: Key, msg: bytes | bytearray, grow_above: int
    ) -> dict[str, np.ndarray] | int:
        """One INFER on ``call.slot`` with a fresh id, and the queue flag when others of ours are in flight
        (the daemon batches them); its outputs, copied, or the bytes they need. Cancelled after it was
        sent: the slot and the in-flight place are the late completion's (``call.cut``)."""
        slot = call.slot
        assert slot is not None
        rid = self._core.next_id()
        msg = msg if isinstance(msg, bytearray) else bytearray(msg)
        p.set_request_id(msg, rid)
        p.set_request_flags(msg, p.FLAG_QUEUE if self._pending else 0)
        try:
            reply = await self._exchange(rid, msg, late=functools.partial(self._pool_slot, key, slot))
        except asyncio.CancelledError:
            if rid in self._late:  # the slot is pooled when the late completion arrives
                call.slot, call.cut = None, True
            raise
        return answer(reply, slot, True, grow_above)

    async def _take_place(self, inflight: Inflight) -> None:
        """Wait for an in-flight place; closed meanwhile, the place goes on and the client's error is raised."""
        await inflight.take()
        if self._core.closed:
            inflight.give()
            raise not_open_error()

    async def prepare(
        self,
        model: str,
        shapes: Mapping[str, tuple[int, ...] | list[int]],
        version: int | None = None,
        *,
        dtypes: Mapping[str, Any] | None = None,
        outputs: list[str] | None = None,
        timeout: float | None = None,
    ) -> AsyncPreparedInfer:
        """:meth:`ShmClient.prepare` for asyncio: ``await prepared.run()`` per request, nothing encoded,
        copied or allocated per run. Make one per concurrent loop; they are pipelined like ``infer``."""
        assert self._inflight is not None, "call connect() (or use 'async with') first"
        info = await self._info(model, version)
        seg, arrays = await self._run(self._core.prepared_inputs(info, shapes, dtypes))
        prep = AsyncPreparedInfer(self, model, version, inputs=arrays, segment=seg, outputs=outputs, timeout=timeout)
        try:
            await self._bind(prep, info.output_bytes(arrays))
        except BaseException:
            await self._close_prepared(prep)
            raise
        return prep

    async def _bind(self, prep: AsyncPreparedInfer, out_need: int) -> None:
        """(Re)make a prepared request's output area (a spare one when it fits) and encode its message once."""
        packed = self._core.prepared_packed(prep)
        old, prep.slot = prep.slot, None
        spares, prep.spares = prep.spares, []
        slot = next((s for s in spares if s.out_cap >= out_need), None)
        for s in ([old] if old is not None else []) + [s for s in spares if s is not slot]:
            await self._unregister(s.segment)
        if slot is None:
            slot = await self._run(self._core.area(0, out_need))
        self._core.encode_prepared(prep, slot, packed)

    async def _run_prepared(self, prep: AsyncPreparedInfer, copy: bool) -> dict[str, np.ndarray]:
        if prep.closed or self._core.closed:
            raise EdgedError("the prepared request is closed", code=ErrorCode.FAILED_PRECONDITION)
        if prep.running:
            raise EdgedError(
                "this prepared request is already running: make one per concurrent loop",
                code=ErrorCode.FAILED_PRECONDITION,
            )
        inflight = self._inflight
        assert inflight is not None and self._loop is not None
        prep.running = True  # from here a close() leaves the buffers to this run's end, waiting included
        try:
            if not inflight.take_now():
                await self._take_place(inflight)
            cut = False  # cut off after it was sent: the place is the late reply's to give back
            try:
                for attempt in range(TRIES):
                    slot = prep.slot
                    if slot is None:  # the last run was cancelled: its reply may still land in the old area
                        await self._bind(prep, (await self._info(prep.model, prep.version)).output_bytes(prep.inputs))
                        slot = prep.slot
                        assert slot is not None
                    rid = self._core.next_id()
                    msg = prep.message
                    p.set_request_id(msg, rid)
                    p.set_request_flags(msg, p.FLAG_QUEUE if self._pending else 0)  # batch it with others in flight
                    try:
                        reply = await self._exchange(
                            rid, msg, late=functools.partial(self._spare, prep, slot)
                        )
                    except asyncio.CancelledError:
                        if rid in self._late:  # cut off: the next run gets another area
                            prep.slot, cut = None, True
                        raise
                    got = answer(reply, slot, copy, grow_limit(attempt, slot.out_cap))
                    if not isinstance(got, int):
                        return got
                    info = await self._info(prep.model, prep.version)
                    info.output_hint = max(info.output_hint, got)
                    await self._bind(prep, got)  # the outputs need more room: grow the area, encode again
                raise AssertionError("unreachable: the last try raises")
            finally:
                if not cut:
                    inflight.give()
        finally:
            prep.running = False
            if prep.closed:  # closed while this run was in flight: give its buffers back now
                await self._release_prepared(prep)

    def _pool_slot(self, key: Key, slot: Slot) -> None:
        self._free.setdefault(key, []).append(slot)

    def _spare(self, prep: AsyncPreparedInfer, slot: Slot) -> None:
        """A cut-off prepared run's area, its late completion in: a later area of that request reuses it
        (closed meanwhile: given back, or a loop that closes and prepares again would pile them up)."""
        if prep.closed:
            self._core.segments.pop(slot.segment.id, None)
            slot.segment.close()
            self._send_unanswered(self._core.unregister_message(slot.segment.id))
        else:
            prep.spares.append(slot)

    async def _exchange(
        self, rid: int, msg: bytes | bytearray, *, late: Callable[[], None] | None = None
    ) -> tuple[int, int, bytes]:
        """Send one message and await its reply. Cancelled before the reply arrived, ``late`` (an
        INFER's) is kept for it (``rid in self._late``): the daemon may still read the request's inputs
        and write its outputs, so that memory must not be used again until then, and it still counts
        the request against max_inflight, so the caller's in-flight place is given back only then.
        Cancelled after: nothing to do."""
        assert self._loop is not None
        fut: asyncio.Future[tuple[int, int, bytes]] = self._loop.create_future()
        self._pending[rid] = fut
        try:
            if not self._send_now(msg, -1):
                await self._send_when_room(msg, -1)
        except BaseException as e:
            self._pending.pop(rid, None)
            if isinstance(e, asyncio.CancelledError) and msg[0] == p.UNREGISTER:
                self._send_unanswered(msg)  # the core has forgotten the segment: the daemon must too
            raise
        try:
            return await fut
        except asyncio.CancelledError:
            if not (fut.done() and not fut.cancelled()):
                self._pending.pop(rid, None)
                if late is not None:
                    self._late[rid] = late
            raise

    async def _close_prepared(self, prep: AsyncPreparedInfer) -> None:
        if prep.closed:
            return
        prep.closed = True
        if not prep.running:  # else its run gives the buffers back when it ends
            await self._release_prepared(prep)

    async def _release_prepared(self, prep: AsyncPreparedInfer) -> None:
        if self._core.closed:
            return
        old = [prep.slot] if prep.slot is not None else []
        prep.slot = None
        spares, prep.spares = prep.spares, []
        for s in old + spares:
            await self._unregister(s.segment)
        await self._unregister(prep.segment)

    async def tensor(self, shape: tuple[int, ...] | list[int], dtype: Any = np.float32) -> np.ndarray:
        """A new array in its own shared segment; passing it to infer copies nothing."""
        return await self._run(self._core.tensor(shape, dtype))

    async def close(self) -> None:
        if self._core.closed and self._sock is None:
            return
        self._fail_all(closed_error())
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._free.clear()
        self._late.clear()
        self._core.drop_all()
