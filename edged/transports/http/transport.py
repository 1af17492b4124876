"""The HTTP transport: Open Inference Protocol (KServe v2) with Triton's extensions.

The routes live in :mod:`edged.transports.http.app`; they are served by the small
httptools server in :mod:`edged.transports.http.server` inside the daemon's own event
loop (no thread, no signal handlers of its own: the daemon owns SIGINT/SIGTERM and
calls :meth:`HttpTransport.stop`). The socket is bound here so that a bad or busy
address is a typed error naming it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from edged.config import Config
from edged.core.service import InferenceService
from edged.errors import EdgedError, ErrorCode
from edged.fsutil import ensure_private_dir
from edged.listen import parse_listen
from edged.transports.authority import Authority
from edged.transports.http.app import V2App
from edged.transports.http.server import HttpServer, Limits
from edged.transports.redact import Scrubber
from edged.transports.shm.sysshm import SystemShmRegions

if TYPE_CHECKING:
    from edged.telemetry.prometheus import MetricsRenderer

log = logging.getLogger(__name__)

UNIX_SOCKET_MODE = 0o660
KEEP_ALIVE_S = 60  # local clients often infer every few seconds; reconnecting costs more than an idle socket
GRACEFUL_STOP_S = 10.0


def _bind_tcp(host: str, port: int, listen: str) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise EdgedError(f"cannot listen on {listen}: {e.strerror}", code=ErrorCode.UNAVAILABLE) from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise EdgedError(f"cannot listen on {listen}: {e.strerror or e}", code=ErrorCode.UNAVAILABLE) from None
    return sock


def clear_unix_path(path: Path, listen: str, section: str = "http") -> None:
    """Make room for a Unix-socket listener in a private folder: a stale socket goes, a live one or any
    other file is an error."""
    ensure_private_dir(path.parent, f"[{section}] listen = {listen!r}")
    try:
        if path.exists() or path.is_symlink():
            if not stat.S_ISSOCK(path.lstat().st_mode):
                raise EdgedError(f"cannot listen on {listen}: a file that is not a socket is in the way",
                                 code=ErrorCode.UNAVAILABLE)
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(str(path))
            except OSError:
                path.unlink()  # stale socket left by a process that died
            else:
                raise EdgedError(f"cannot listen on {listen}: another server is listening there",
                                 code=ErrorCode.UNAVAILABLE)
            finally:
                probe.close()
    except OSError as e:
        raise EdgedError(f"cannot listen on {listen}: {e.strerror or e}", code=ErrorCode.UNAVAILABLE) from None


def remove_socket_file(path: Path | None) -> None:
    """A stopped listener's Unix socket file goes with it (already gone is fine)."""
    if path is not None:
        with contextlib.suppress(OSError):
            path.unlink()


def _bind_unix(path: Path, listen: str) -> socket.socket:
    clear_unix_path(path, listen)
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(path))
            os.chmod(path, UNIX_SOCKET_MODE)
        except BaseException:
            sock.close()
            raise
    except OSError as e:
        raise EdgedError(f"cannot listen on {listen}: {e.strerror or e}", code=ErrorCode.UNAVAILABLE) from None
    return sock


def system_shm_regions(cfg: Config) -> SystemShmRegions:
    """Triton's system shared memory regions, one registry for the daemon's v2 listeners (HTTP and gRPC)."""
    return SystemShmRegions(int(cfg.shm.max_region_mb * 1024 * 1024), tcp_prefix=cfg.shm.system_shm_prefix)


class HttpTransport:
    name = "http"

    def __init__(self, cfg: Config, service: InferenceService, *, shm: SystemShmRegions | None = None,
                 metrics: MetricsRenderer | None = None, max_connections: int | None = None,
                 backlog: int | None = None) -> None:
        """``metrics``: the daemon's ``/metrics`` renderer (others bind their families to it); without
        one, a renderer of the service's own series is made at the first scrape. ``max_connections`` and
        ``backlog``: what the descriptor budget allows (default ``[http] max_connections``, 512)."""
        self.cfg = cfg
        self.metrics = metrics
        self.service = service
        self.listen = cfg.http.listen
        self.shm = shm if shm is not None else system_shm_regions(cfg)
        scrub = Scrubber.for_config(cfg)
        self.authority = Authority(cfg.control)
        self.app = V2App(service, self.shm, max_body=int(cfg.http.max_request_mb * 1024 * 1024), scrub=scrub,
                         metrics=self._metrics, authority=self.authority)
        h = cfg.http
        self.limits = Limits(max_body=int(h.max_request_mb * 1024 * 1024), keep_alive_s=KEEP_ALIVE_S,
                             max_connections=max_connections or h.max_connections,
                             max_client_connections=h.max_client_connections, header_timeout_s=h.header_timeout_s,
                             max_busy_connections=h.max_busy_connections, body_timeout_s=h.body_timeout_s)
        self.backlog = backlog or 512
        # Half the accept burst the descriptor budget allows: newcomers under an equal share of the connections.
        self.limits.overflow_connections = self.backlog // 2
        self._server: HttpServer | None = None
        self._unix_path: Path | None = None
        self.address: str = self.listen  # the real address once listening (port 0 resolved)

    def _metrics(self) -> tuple[bytes, str]:
        if self.metrics is None:
            from edged.telemetry.prometheus import MetricsRenderer

            self.metrics = MetricsRenderer(self.service)
        return self.metrics.render(), str(self.metrics.content_type)

    @property
    def open_connections(self) -> int:
        return self._server.connections if self._server else 0

    @property
    def port(self) -> int | None:
        return None if self._unix_path else int(self.address.rpartition(":")[2])

    async def start(self) -> None:
        target = parse_listen(self.listen)
        if isinstance(target, Path):
            sock = _bind_unix(target, self.listen)
            self._unix_path = target
            self.address = f"unix:{target}"
        else:
            sock = _bind_tcp(*target, self.listen)
            host, port = sock.getsockname()[:2]
            self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        sock.setblocking(False)
        self.app.stopping = False
        server = HttpServer(self.app.handle, self.limits, self.service.budget)
        try:
            await server.start(sock, self.backlog)
        except OSError as e:
            sock.close()
            remove_socket_file(self._unix_path)
            self._unix_path = None
            raise EdgedError(f"cannot listen on {self.listen}: {e.strerror or e}", code=ErrorCode.UNAVAILABLE) from None
        self._server = server
        log.info("HTTP (KServe v2) listening on %s", self.address)

    async def stop(self) -> None:
        self.app.stopping = True
        self.app.control.stop()
        server, self._server = self._server, None
        if server is not None:
            await server.stop(GRACEFUL_STOP_S)
        remove_socket_file(self._unix_path)
        self._unix_path = None
        self.shm.unregister_all()
        log.info("HTTP transport stopped")
