"""The daemon's end of an engine worker process: an Engine that starts, checks and restarts it.

One worker process per engine instance, on a private ``socketpair`` (no path on disk, so nobody
else can connect). Two memfd segments are registered once: inputs are copied into one (the only copy
on the way in), the worker has its engine's outputs written into the other, and the reply names where
they lie (the wire: :mod:`edged.protocol.shm_wire`). Each reply must echo its request's kind and id (a
late answer to a health check that timed out is skipped) and describe outputs that lie inside the
output segment. A worker that dies, hangs past ``request_timeout_s`` or answers off the wire fails
only the request in flight, with a typed error; it is started again at
once (then with back-off if it keeps dying), and the next request is served by the new one. The
worker ends when the daemon does: EOF on its socket, and systemd stops the whole service cgroup
(``PR_SET_PDEATHSIG`` is not used: it fires when the *thread* that started the worker ends, and
restarts run on short-lived threads).

Subclasses: :class:`edged.backends.trt_worker.supervisor.WorkerEngine` (TensorRT under JetPack 5's
Python 3.8) and :class:`edged.backends.engine_procs.pool.ProcessWorker` (CPU engines under the
daemon's own Python, [limits] engine_processes).
"""

from __future__ import annotations

import abc
import contextlib
import fcntl
import json
import logging
import math
import mmap
import os
import select
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from edged.backends.base import Engine, EngineTensor
from edged.backoff import Backoff
from edged.errors import EdgedError, InternalError, InvalidInputError, ModelLoadError
from edged.protocol import shm as p

log = logging.getLogger(__name__)

DEFAULT_START_TIMEOUT_S = 120.0  # deserializing a large plan on a Jetson takes a while
DEFAULT_REQUEST_TIMEOUT_S = 60.0
_MIN_SEGMENT = 1 << 16


class _NotDeliveredError(Exception):
    """The worker's socket refused a request: the worker was gone before it was sent, so nothing ran."""


class _BadReplyError(ValueError):
    """The worker's reply does not follow the wire (a wrong kind, a corrupt description): it is not
    trusted again, and what it described is never read."""


class WorkerDiedError(InternalError):
    """The engine worker exited or hung during a request; it is being restarted."""


class _Segment:
    """A sealed memfd both processes map; grown by replacing it."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.fd = os.memfd_create("edged-engine-worker", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
            self.map = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            os.close(self.fd)
            raise
        self.view = np.frombuffer(self.map, dtype=np.uint8)
        self.id = 0

    def close(self) -> None:
        """Unmap and close; a second call does nothing (the fd number may be another file's by then)."""
        if self.fd < 0:
            return
        self.view = np.empty(0, dtype=np.uint8)  # drops the export of the map
        with contextlib.suppress(BufferError):
            self.map.close()
        fd, self.fd, self.id = self.fd, -1, 0
        os.close(fd)


def _tensors(items: list[dict[str, Any]]) -> list[EngineTensor]:
    return [EngineTensor(str(t["name"]), str(t["datatype"]), tuple(int(d) for d in t["shape"])) for t in items]


class EngineWorkerClient(Engine):
    """The daemon's end of one engine worker process: start, check, restart, and INFER over memfds.

    Subclasses say which program to run (``_command``) and what to send it first (``_greeting``)."""

    what: ClassVar[str] = "engine worker"
    health_timeout_s: float = 2.0
    loads: ClassVar[str] = "model"  # what it loads, in messages

    def __init__(self, label: str, *, device: str, precision: str, start_timeout_s: float,
                 request_timeout_s: float) -> None:
        self.label = label
        self.device, self.precision = device, precision
        self.start_timeout_s, self.request_timeout_s = start_timeout_s, request_timeout_s
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._in: _Segment | None = None
        self._out: _Segment | None = None
        self._rid = 0
        self._closed = False
        self._backoff = Backoff(0.2, 10.0)
        self._not_before = 0.0
        self.restarts = 0
        self.last_exit: str | None = None
        self.info: dict[str, Any] = {}
        with self._lock:
            self._start()  # a model that cannot load fails the load here, with the worker's reason
        self.inputs = _tensors(self.info["inputs"])
        self.outputs = _tensors(self.info["outputs"])

    @abc.abstractmethod
    def _command(self, fd: int) -> list[str]:
        """The worker's command line; ``fd`` is its end of the socketpair, passed to it open."""

    def _greeting(self) -> bytes | None:
        """A first message for the worker (what to load), or None when its command line says it all."""
        return None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    # ---- process ------------------------------------------------------------------------------
    def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        command = self._command(theirs.fileno())
        try:
            self._proc = subprocess.Popen(command, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                          close_fds=True)
        except OSError as e:
            ours.close()
            raise ModelLoadError(f"{self.label}: cannot start the {self.what} {command[0]}: {e.strerror}") from None
        finally:
            theirs.close()
        self._sock = ours
        try:
            greeting = self._greeting()
            if greeting is not None:
                ours.send(greeting)
            kind, status, _, body = self._reply(self.start_timeout_s, "starting", p.HELLO, 0)
            if status:
                _, why = p.decode_error(body)
                raise ModelLoadError(f"{self.label}: the {self.what} cannot load the {self.loads}: {why}")
            if kind != p.HELLO | p.REPLY:
                raise ModelLoadError(f"{self.label}: the engine worker said kind {kind} instead of hello")
            self.info = json.loads(bytes(body))
            for old in (self._in, self._out):  # a restart: the old worker's segments go with it
                if old is not None:
                    old.close()
            self._in = self._out = None
            self._in = self._register(_MIN_SEGMENT)
            self._out = self._register(_MIN_SEGMENT)
        except EdgedError:
            self._stop()
            raise
        except (OSError, TimeoutError, ValueError, KeyError, TypeError, _NotDeliveredError) as e:
            self._stop()
            raise ModelLoadError(f"{self.label}: the {self.what} failed while starting: {e}") from None
        self._started()

    def _started(self) -> None:
        log.info("%s: %s pid %s ready", self.label, self.what, self.pid)

    def _stop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.wait()
            rc = proc.returncode
            self.last_exit = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit status {rc}"
        for seg in (self._in, self._out):
            if seg is not None:
                seg.id = 0

    def _died(self, why: str) -> WorkerDiedError:
        pid = self._proc.pid if self._proc else 0
        self._stop()
        self.restarts += 1
        self._not_before = time.monotonic() + self._backoff.next_delay()
        msg = (f"{self.label}: the {self.what} (pid {pid}) {why} during this request "
               f"({self.last_exit}); it is being restarted")
        log.error("%s", msg)
        threading.Thread(target=self._restart, name="edged-worker-restart", daemon=True).start()
        return WorkerDiedError(msg)

    def _restart(self) -> None:
        with self._lock:
            if self._closed or self._sock is not None:  # unloaded meanwhile, or a request already restarted it
                return
            try:
                self._ensure_started()
            except EdgedError as e:  # the next request tries again, after the back-off
                self._not_before = time.monotonic() + self._backoff.next_delay()
                log.error("%s: restarting the engine worker failed: %s", self.label, e)

    def _replace_idle(self) -> None:
        """It died between requests (nothing was in flight): replace it before this request, not after."""
        self._stop()
        self.restarts += 1
        log.error("%s: the %s died while idle (%s); restarting it", self.label, self.what, self.last_exit)

    def _ensure_started(self) -> None:
        if self._closed:
            raise InternalError(f"{self.label}: the engine is unloaded")
        if self._sock is not None and self._proc is not None and self._proc.poll() is not None:
            self._replace_idle()
        if self._sock is not None:
            return
        delay = self._not_before - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        self._start()
        self._backoff.reset()

    # ---- messages ------------------------------------------------------------------------------
    def _reply(self, timeout_s: float, what: str, kind: int, rid: int) -> tuple[int, int, int, memoryview]:
        """The reply to request ``rid`` of ``kind``. A reply to an earlier request (a health check that
        timed out, answered late) is skipped; any other reply is a worker off the wire."""
        assert self._sock is not None
        deadline = time.monotonic() + timeout_s
        while True:
            ready, _, _ = select.select([self._sock], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(f"no answer in {timeout_s:g} s while {what}")
            msg = self._sock.recv(p.MAX_MESSAGE)
            if len(msg) < p.HEADER.size:
                raise ConnectionResetError("the engine worker closed its socket")
            got_kind, status, count, got_rid = p.HEADER.unpack_from(msg, 0)
            if got_rid < rid and got_kind & p.REPLY:
                log.warning("%s: skipped a late reply to request %d while %s", self.label, got_rid, what)
                continue
            if got_rid != rid or got_kind != kind | p.REPLY:
                raise _BadReplyError(f"the {self.what} answered request {got_rid} kind {got_kind & 0x7F} "
                                     f"to request {rid} kind {kind} while {what}")
            return got_kind, status, count, memoryview(msg)[p.HEADER.size:]

    def _call(self, message: bytes, fds: Sequence[int] = ()) -> tuple[int, memoryview]:
        assert self._sock is not None
        kind, _, _, rid = p.HEADER.unpack_from(message, 0)
        try:
            if fds:
                socket.send_fds(self._sock, [message], list(fds))
            else:
                self._sock.send(message)
        except OSError as e:  # EPIPE, ECONNRESET: the worker's end is closed
            raise _NotDeliveredError(str(e)) from None
        _, status, count, body = self._reply(self.request_timeout_s, "waiting for the engine", kind, rid)
        if status:
            needed, why = p.decode_error(body)
            err = p.error_from_status(status, f"{self.label}: {why}", needed)
            raise err
        return count, body

    def _register(self, size: int) -> _Segment:
        seg = _Segment(size)
        self._rid += 1
        try:
            _, body = self._call(p.header(p.REGISTER, self._rid) + p.U64.pack(size), [seg.fd])
            (seg.id,) = p.U32.unpack_from(body, 0)
        except BaseException:
            seg.close()
            raise
        return seg

    def _grow(self, old: _Segment | None, need: int) -> _Segment:
        """A registered segment of at least ``need`` bytes in place of ``old``, which is closed whatever
        happens: the caller has already let go of it (a failed REGISTER must not leave it in use)."""
        try:
            if old is not None and old.id:
                self._rid += 1
                self._call(p.header(p.UNREGISTER, self._rid) + p.U32.pack(old.id))
        finally:
            if old is not None:
                old.close()
        return self._register(max(_MIN_SEGMENT, 1 << (need - 1).bit_length()))

    # ---- Engine ---------------------------------------------------------------------------------
    def infer(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        with self._lock:
            for attempt in (1, 2):
                self._ensure_started()
                try:
                    return self._infer(inputs, outputs)
                except _NotDeliveredError:
                    if attempt == 2:
                        raise self._died("was gone") from None
                    self._replace_idle()  # it never saw this request: start a new one and send it again
                except _BadReplyError as e:  # off the wire: nothing it says is trusted again
                    raise self._died(f"answered wrongly ({e})") from None
                except (OSError, TimeoutError) as e:  # EOF or reset while the request ran: the worker is gone
                    raise self._died("hung" if isinstance(e, TimeoutError) else "died") from None
            raise AssertionError("unreachable")

    def _infer(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None) -> dict[str, np.ndarray]:
        layout: list[tuple[str, np.ndarray, int]] = []
        pos = 0
        for name, arr in inputs.items():
            a = np.require(arr, requirements="C")  # a scalar stays 0-d
            if a.dtype not in p.NUMPY_CODE:
                raise InvalidInputError(f"{self.label}: input {name!r}: dtype {a.dtype} cannot go to the engine")
            layout.append((name, a, pos))
            pos = p.align(pos + a.nbytes)
        if self._in is None or pos > self._in.size:
            old, self._in = self._in, None
            self._in = self._grow(old, pos)
        if self._out is None:  # an earlier growth of it failed
            self._out = self._register(_MIN_SEGMENT)
        seg = self._in
        descs = []
        for name, a, at in layout:
            seg.view[at:at + a.nbytes] = a.reshape(-1).view(np.uint8)
            descs.append(p.encode_tensor(name, p.NUMPY_CODE[a.dtype], a.shape, segment=seg.id, offset=at,
                                         nbytes=a.nbytes))
        for _ in range(2):  # a second round only when the outputs outgrew the output segment
            assert self._out is not None
            self._rid += 1
            msg = p.encode_infer(self._rid, "", 0, descs, out_segment=self._out.id, out_offset=0,
                                 out_capacity=self._out.size, outputs=list(outputs) if outputs else None)
            try:
                count, body = self._call(msg)
            except EdgedError as e:
                needed = int(e.context.get("needed_bytes", 0))
                if not needed:
                    raise
                old, self._out = self._out, None
                self._out = self._grow(old, needed)
                continue
            return self._outputs(self._out, body, count)
        raise InternalError(f"{self.label}: the {self.what}'s outputs kept outgrowing the output segment")

    def _outputs(self, seg: _Segment, body: memoryview, count: int) -> dict[str, np.ndarray]:
        """The outputs an INFER reply describes, each checked against the segment before it is read."""
        try:
            _, outs = p.decode_outputs(body, count)
        except (ValueError, IndexError, struct.error) as e:  # UnicodeDecodeError is a ValueError
            raise _BadReplyError(f"a malformed INFER reply: {e}") from None
        result: dict[str, np.ndarray] = {}
        for o in outs:
            dtype = p.NUMPY_DTYPES[o.dtype] if 0 < o.dtype < len(p.NUMPY_DTYPES) else None
            if dtype is None or any(d < 0 for d in o.shape) or math.prod(o.shape) * dtype.itemsize != o.nbytes \
                    or o.nbytes > seg.size or o.offset > seg.size - o.nbytes:
                raise _BadReplyError(f"output {o.name!r} described wrongly (dtype code {o.dtype}, shape "
                                     f"{list(o.shape)}, {o.nbytes} bytes at {o.offset})")
            # A copy the caller owns: the segment is reused by the next request.
            result[o.name] = seg.view[o.offset:o.offset + o.nbytes].view(dtype).reshape(o.shape).copy()
        return result

    def health(self) -> dict[str, Any]:
        """Ping the worker (short timeout); what ``describe`` and status pages show."""
        with self._lock:
            alive = False
            if self._sock is not None:
                self._rid += 1
                try:
                    self._sock.send(p.header(p.HELLO, self._rid))
                    _, status, _, body = self._reply(self.health_timeout_s, "answering a health check", p.HELLO,
                                                     self._rid)
                    alive = status == 0
                    self.info.update(json.loads(bytes(body)) if alive else {})
                except (OSError, TimeoutError, ValueError):
                    alive = False
            return {"alive": alive, "pid": self.pid, "restarts": self.restarts, "last_exit": self.last_exit,
                    "served": self.info.get("served")}

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "engine_worker": {"pid": self.pid, "restarts": self.restarts}}

    def unload(self) -> None:
        with self._lock:
            self._closed = True
            self._stop()
            for seg in (self._in, self._out):
                if seg is not None:
                    seg.close()
            self._in = self._out = None
