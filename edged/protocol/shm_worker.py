"""The engine worker's side of the engine wire: the daemon's segments, and the answer loop.

Shared by every engine worker process: the TensorRT worker (JetPack 5's Python 3.8, where nothing of
edged is importable: it loads this file and ``shm_wire.py`` from their folder, named by ``--wire``) and
the CPU engine workers (:mod:`edged.backends.engine_procs.worker`). So this module is Python 3.8
compatible and imports nothing from edged: the wire format module is passed in.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: Python 3.8 cannot subscribe collections.abc.Callable at run time
    from collections.abc import Callable

    # A handler: (message body, file descriptors it came with) -> (count for the header, reply body). A
    # handler that keeps a descriptor takes it out of the list; the loop closes the rest.
    Handler = Callable[[bytes, list[int]], tuple[int, bytes]]
    Infer = Callable[[bytes], tuple[int, bytes]]  # an INFER body -> (outputs, their descriptors)
    Describe = Callable[[], dict[str, Any]]  # the worker's HELLO: protocol, pid, served, the tensors


class RequestError(Exception):
    """A request the worker refuses or cannot run; its status byte goes back to the daemon."""

    def __init__(self, status: int, message: str, needed: int = 0) -> None:
        Exception.__init__(self, message)
        self.status, self.needed = status, needed


class SegmentTable:
    """The memfd segments the daemon registered, by id; ``open_segment(fd, size)`` maps one."""

    def __init__(self, wire: Any, open_segment: Callable[[int, int], Any], *, max_segments: int,
                 max_bytes: int) -> None:
        self.wire = wire
        self.open_segment = open_segment
        self.max_segments, self.max_bytes = max_segments, max_bytes
        self.segments: dict[int, Any] = {}
        self.next_id = 1

    def register(self, body: bytes, fds: list[int]) -> tuple[int, bytes]:
        """REGISTER: map the one descriptor sent (it is closed here, mapped or not) and name it."""
        wire = self.wire
        if len(fds) != 1:
            raise RequestError(wire.INVALID_ARGUMENT, f"REGISTER needs exactly one fd, got {len(fds)}")
        fd = fds.pop()
        try:
            if len(body) != wire.U64.size:
                raise RequestError(wire.INVALID_ARGUMENT, "REGISTER body is not one u64 size")
            (size,) = wire.U64.unpack(body)
            if len(self.segments) >= self.max_segments:
                raise RequestError(wire.INVALID_ARGUMENT, f"at most {self.max_segments} segments")
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != size or not 0 < size <= self.max_bytes:
                raise RequestError(wire.INVALID_ARGUMENT, f"segment size {size} does not match the fd ({st.st_size})")
            seg = self.open_segment(fd, size)
        finally:
            os.close(fd)  # the mapping keeps the memory
        sid = self.next_id
        self.next_id += 1
        self.segments[sid] = seg
        return 0, wire.U32.pack(sid)

    def unregister(self, body: bytes, fds: list[int]) -> tuple[int, bytes]:
        (sid,) = self.wire.U32.unpack(body)
        seg = self.segments.pop(sid, None)
        if seg is None:
            raise RequestError(self.wire.NOT_FOUND, f"no segment {sid}")
        seg.close()
        return 0, b""

    def range(self, sid: int, offset: int, nbytes: int, what: str) -> Any:
        """The segment holding ``nbytes`` at ``offset``, or a refusal naming ``what``."""
        seg = self.segments.get(sid)
        if seg is None:
            raise RequestError(self.wire.NOT_FOUND, f"{what}: no segment {sid}")
        if offset > seg.size or nbytes > seg.size - offset:
            raise RequestError(self.wire.INVALID_ARGUMENT, f"{what}: range {offset}+{nbytes} is outside segment {sid}")
        return seg


def receive(sock: socket.socket, size: int) -> tuple[bytes, list[int]]:
    """One message and the descriptors sent with it (at most four)."""
    fds: list[int] = []
    msg, anc, _, _ = sock.recvmsg(size, socket.CMSG_SPACE(4 * 4))
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.extend(int.from_bytes(data[i:i + 4], sys.byteorder) for i in range(0, len(data) - 3, 4))
    return msg, fds


def serve_engine(sock: socket.socket, wire: Any, table: SegmentTable, infer: Infer, describe: Describe) -> None:
    """What every engine worker does once its engine is loaded: say HELLO with ``describe()``, then answer
    INFER, REGISTER, UNREGISTER and HELLO (the daemon's health check) until the daemon closes its end."""
    sock.send(wire.header(wire.HELLO | wire.REPLY, 0) + json.dumps(describe()).encode())
    serve(sock, wire, {wire.INFER: lambda body, fds: infer(body), wire.REGISTER: table.register,
                       wire.UNREGISTER: table.unregister,
                       wire.HELLO: lambda body, fds: (0, json.dumps(describe()).encode())})


def serve(sock: socket.socket, wire: Any, handlers: dict[int, Handler]) -> None:
    """Answer requests by kind until the daemon closes its end; a refusal or an engine failure is
    answered with its status, and the worker serves on."""
    while True:
        msg, fds = receive(sock, wire.MAX_MESSAGE)
        if not msg:
            return
        try:
            if len(msg) < wire.HEADER.size:
                sock.send(wire.encode_status_error(0x7F, 0, wire.INVALID_ARGUMENT, "message shorter than a header"))
                continue
            kind, _, _, rid = wire.HEADER.unpack_from(msg, 0)
            handler = handlers.get(kind)
            try:
                if handler is None:
                    raise RequestError(wire.INVALID_ARGUMENT, f"unknown request kind {kind}")
                count, reply = handler(msg[wire.HEADER.size:], fds)
            except RequestError as e:
                sock.send(wire.encode_status_error(kind, rid, e.status, str(e), e.needed))
            except Exception as e:  # the engine's own failure: report it, keep serving
                sock.send(wire.encode_status_error(kind, rid, wire.INTERNAL, f"{type(e).__name__}: {e}"))
            else:
                sock.send(wire.header(kind | wire.REPLY, rid, 0, count) + reply)
        finally:
            for fd in fds:
                os.close(fd)
