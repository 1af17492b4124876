"""The shared-memory transport: a Unix SOCK_SEQPACKET socket plus client-owned memfd segments.

Local programs (a camera app, a robot controller) connect to ``cfg.shm_socket``,
pass sealed memfd segments once and then exchange only small descriptors; see
:mod:`edged.protocol.shm` for the wire format and
:mod:`edged.transports.shm.conn` for how one client is served. Clients are known
by their socket peer credentials (SO_PEERCRED); access is governed by the socket
file's mode (``[shm] socket_mode``, default 0660: the daemon's user and group).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import socket
import stat
import threading
import time
from pathlib import Path
from typing import Any

from edged.config import Config
from edged.core.service import InferenceService
from edged.errors import EdgedError, ErrorCode
from edged.fsutil import ensure_private_dir
from edged.protocol.peercred import peer_credentials
from edged.transports.redact import Scrubber
from edged.transports.shm.conn import REPLY_COST, Connection, Limits, fit_send_buffer, reply_room
from edged.transports.shm.segments import clean_stale_shm, fds_needed

log = logging.getLogger(__name__)

_MAX_PATH = 107  # sun_path holds 108 bytes including the terminating NUL


class ShmTransport:
    name = "shm"

    def __init__(self, cfg: Config, service: InferenceService, *, max_clients: int = 128,
                 limits: Limits | None = None, stop_grace_s: float = 2.0) -> None:
        self.service = service
        self.path: Path = cfg.shm_socket
        self.mode = cfg.shm.socket_mode
        self.max_clients = max_clients
        self.stop_grace_s = stop_grace_s
        self.scrub = Scrubber.for_config(cfg)
        shm = cfg.shm
        self.limits = limits or Limits(max_segments=shm.max_segments, max_mapped_bytes=int(shm.max_region_mb * 2**20),
                                       max_inflight=shm.max_inflight)
        # each client's send buffer holds its max_inflight unread replies (see conn.fit_send_buffer)
        self._reply_room = reply_room(self.limits.max_inflight)
        self._listener: socket.socket | None = None
        self._inode: tuple[int, int] | None = None
        self._wake_r = self._wake_w = -1
        self._accept_thread: threading.Thread | None = None
        self._conns: dict[Connection, None] = {}
        self._lock = threading.Lock()
        self._stopping = False

    # ---- introspection ----------------------------------------------------------------------
    def clients(self) -> list[dict[str, Any]]:
        """Connected clients and what each holds (pid, uid, gid, segments, mapped_bytes, inflight, requests)."""
        with self._lock:
            return [c.info() for c in self._conns]

    # ---- start / stop -----------------------------------------------------------------------
    async def start(self) -> None:
        await asyncio.to_thread(self.start_blocking)

    async def stop(self) -> None:
        await asyncio.to_thread(self.stop_blocking)

    def start_blocking(self) -> None:
        path = self.path
        if len(os.fsencode(path)) > _MAX_PATH:
            raise EdgedError(f"[shm] socket path is longer than {_MAX_PATH} bytes: {path}",
                             code=ErrorCode.FAILED_PRECONDITION)
        clean_stale_shm()
        _raise_fd_limit(fds_needed(self.max_clients, self.limits.max_segments))
        ensure_private_dir(path.parent, "[shm] socket folder")
        self._remove_stale_socket(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # Bind under a temporary name, set the mode, then rename into place, so the socket is
        # never reachable with the default (umask-derived) permissions.
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        try:
            sock.bind(str(tmp))
            os.chmod(tmp, self.mode)
            os.rename(tmp, path)
            sock.listen(128)
        except OSError as e:
            sock.close()
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise EdgedError(f"cannot listen on the shared-memory socket {path}: {e.strerror}",
                             code=ErrorCode.UNAVAILABLE) from None
        st = os.stat(path)
        self._inode = (st.st_dev, st.st_ino)
        self._check_reply_room()
        self._listener = sock
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._stopping = False
        self._accept_thread = threading.Thread(target=self._accept_loop, name="edged-shm-accept", daemon=True)
        self._accept_thread.start()
        log.info("shm transport listening on %s (mode %o; per client: %d segments, %d MiB, %d in flight)",
                 path, self.mode, self.limits.max_segments, self.limits.max_mapped_bytes >> 20,
                 self.limits.max_inflight)

    def stop_blocking(self) -> None:
        if self._listener is None:
            return
        self._stopping = True
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        if self._accept_thread is not None:
            self._accept_thread.join()
        self._listener.close()
        self._listener = None
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._unlink_own_socket()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            c.begin_close()
        for c in conns:
            c.wait_idle(self.stop_grace_s)
        for c in conns:
            c.shutdown()
        for c in conns:
            c.thread.join(5.0)
        log.info("shm transport stopped (%d client(s) disconnected)", len(conns))

    def _check_reply_room(self) -> None:
        """Say at start when the kernel caps a client's send buffer below its max_inflight replies:
        a client that reads its replies late, yet within the limit, would then be disconnected."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as probe:
            have = fit_send_buffer(probe, self._reply_room)
        if have < self._reply_room:
            log.warning("shm: [shm] max_inflight = %d needs %d bytes of socket send buffer per client for "
                        "replies read late, but the kernel allows %d (net.core.wmem_max): a client with more "
                        "than about %d replies unread is disconnected; raise net.core.wmem_max or lower "
                        "max_inflight", self.limits.max_inflight, self._reply_room, have, have // REPLY_COST)

    def _remove_stale_socket(self, path: Path) -> None:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise EdgedError(f"[shm] socket path {path} exists and is not a socket; refusing to replace it",
                             code=ErrorCode.FAILED_PRECONDITION)
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except OSError:
            # Nobody listens: a leftover of a daemon that crashed.
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            log.info("removed stale shared-memory socket %s", path)
            return
        finally:
            probe.close()
        raise EdgedError(f"another edged is already serving shared memory on {path}", code=ErrorCode.UNAVAILABLE)

    def _unlink_own_socket(self) -> None:
        # Only remove the socket we created: a newer daemon may have replaced it.
        try:
            st = os.lstat(self.path)
        except OSError:
            return
        if (st.st_dev, st.st_ino) == self._inode:
            with contextlib.suppress(OSError):
                self.path.unlink()

    # ---- accepting --------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        listener = self._listener
        assert listener is not None
        poller = select.poll()
        poller.register(listener.fileno(), select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        while not self._stopping:
            events = poller.poll()
            if self._stopping or any(fd == self._wake_r for fd, _ in events):
                return
            try:
                conn, _ = listener.accept()
            except OSError as e:
                # EMFILE/ENFILE would make poll() report the pending client forever: back off.
                log.warning("shm: accept failed: %s", e.strerror or e)
                time.sleep(0.1)
                continue
            try:
                self._admit(conn)
            except Exception:
                log.exception("shm: could not admit a client")
                conn.close()

    def _admit(self, conn: socket.socket) -> None:
        pid, uid, gid = peer_credentials(conn)
        with self._lock:
            if len(self._conns) >= self.max_clients:
                log.warning("shm: refusing client pid=%d uid=%d: %d clients connected (the maximum)",
                            pid, uid, len(self._conns))
                conn.close()
                return
            c = Connection(conn, (pid, uid, gid), service=self.service, limits=self.limits, on_closed=self._closed,
                           scrub=self.scrub)
            self._conns[c] = None
        log.info("shm client connected: pid=%d uid=%d gid=%d (%s)", pid, uid, gid, _comm(pid))
        fit_send_buffer(conn, self._reply_room)  # once per client, before its first reply
        c.start()

    def _closed(self, conn: Connection) -> None:
        with self._lock:
            self._conns.pop(conn, None)


def _raise_fd_limit(needed: int) -> None:
    """Lift the soft descriptor limit towards what the transport may hold (never above the hard limit)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if target > soft:
        with contextlib.suppress(OSError, ValueError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    if soft < needed:
        log.warning("shm: the descriptor limit (%d) is below what %s may need at its limits (%d); "
                    "raise LimitNOFILE", soft, "the shared-memory transport", needed)


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"
