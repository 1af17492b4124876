"""The gRPC listener: grpcio's asyncio server in the daemon's own loop, on TCP or a Unix socket, TLS optional.

grpcio is imported when the transport is built, so a configured ``[grpc]`` without
the ``grpc`` extra fails at start with a typed error that says what to install.
Message size limits are grpcio's own (a larger message is refused with
RESOURCE_EXHAUSTED before it is handed to us); SO_REUSEPORT is off so a busy port
is an error, not a second server sharing it. Connections are capped (grpcio closes one
over ``max_connections`` as soon as it is accepted, so it holds no descriptor), and so are
RPCs at once, streams per connection, idle connections and unfinished handshakes: the
daemon's descriptors are a budget the listeners share (edged/descriptors.py).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from edged.config import Config, GrpcSection, GrpcTlsSection
from edged.core.service import InferenceService
from edged.errors import ConfigError, EdgedError, ErrorCode
from edged.listen import parse_listen
from edged.protocol.grpc import require_grpc
from edged.transports.authority import Authority
from edged.transports.http.transport import (
    UNIX_SOCKET_MODE,
    clear_unix_path,
    remove_socket_file,
    system_shm_regions,
)
from edged.transports.redact import Scrubber
from edged.transports.shm.sysshm import SystemShmRegions

log = logging.getLogger(__name__)

GRACEFUL_STOP_S = 10.0


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise ConfigError(f"[grpc.tls] {what}: cannot read it ({e.strerror or e})", file=str(path)) from None


def server_credentials(grpc: Any, tls: GrpcTlsSection) -> Any:
    ca = _read(tls.client_ca_file, "client_ca_file") if tls.client_ca_file else None
    pair = (_read(tls.key_file, "key_file"), _read(tls.cert_file, "cert_file"))
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


def check_config(cfg: Config) -> list[str]:
    """What would stop the gRPC listener from starting, for ``edged config check`` (nothing is bound)."""
    g = cfg.grpc
    if g is None or not g.enabled:
        return []
    problems = []
    try:
        require_grpc()
        parse_listen(g.listen)
        if g.tls is not None:
            for what, path in (("cert_file", g.tls.cert_file), ("key_file", g.tls.key_file),
                               ("client_ca_file", g.tls.client_ca_file)):
                if path is not None:
                    _read(path, what)
    except EdgedError as e:
        problems.append(f"grpc: {e}")
    return problems


WINDOW_MIN = 64 << 10  # grpcio's own fixed window
WINDOW_MAX = 4 << 20


def stream_window(cfg: GrpcSection, budget_bytes: int) -> int:
    """One RPC's HTTP/2 flow-control window: what grpcio takes in before the daemon reads it.

    Messages arrive before their memory is reserved only up to this window, so all RPCs at once may
    buffer up to max_concurrent_rpcs times it outside the budget; auto keeps that within the request
    memory budget (never below grpcio's 64 KiB). A message larger than the window waits for the
    daemon's window update, a round trip of thread wake-ups (+0.17 ms for a 110 KB tensor on a
    2-core VM), so a budget that allows it takes typical tensors in one go."""
    if cfg.stream_window_kb:
        return cfg.stream_window_kb << 10
    return max(WINDOW_MIN, min(WINDOW_MAX, budget_bytes // cfg.max_concurrent_rpcs))


class GrpcTransport:
    name = "grpc"

    def __init__(self, cfg: Config, service: InferenceService, *, shm: SystemShmRegions | None = None,
                 max_connections: int | None = None) -> None:
        """``max_connections``: the cap the descriptor budget allows (default ``[grpc] max_connections``)."""
        self._grpc = require_grpc()
        from edged.transports.grpc.app import CONCURRENT_LARGEST, MESSAGE_COPIES, GrpcApp

        assert cfg.grpc is not None
        self.cfg = cfg.grpc
        self.listen = self.cfg.listen
        self.max_message = int(self.cfg.max_message_mb * 1024 * 1024)
        self.max_connections = max_connections or self.cfg.max_connections
        # A message the request memory budget could never admit is refused by grpcio before it is read whole.
        # Sized against what large requests may fill (7/8 of the budget), not the whole budget, so that eight
        # of the largest fit at once (in a budget of 37 MiB or more: below, the 1 MiB floor lets fewer fit).
        self.max_receive = max(1 << 20, min(self.max_message,
                                            service.budget.large_limit // (MESSAGE_COPIES * CONCURRENT_LARGEST)))
        self.stream_window = stream_window(self.cfg, service.budget.limit)
        self.shm = shm if shm is not None else system_shm_regions(cfg)  # shared with HTTP in the daemon
        self.app = GrpcApp(service=service, shm=self.shm, scrub=Scrubber.for_config(cfg),
                           authority=Authority(cfg.control), stream_inflight=self.cfg.max_stream_inflight,
                           max_receive=self.max_receive, message_timeout_s=self.cfg.message_timeout_s)
        self._server: Any = None
        self._unix_path: Path | None = None
        self.address: str = self.listen  # the real address once listening (port 0 resolved)

    @property
    def port(self) -> int | None:
        return None if self._unix_path else int(self.address.rpartition(":")[2])

    async def start(self) -> None:
        grpc = self._grpc
        target = parse_listen(self.listen)
        options = [("grpc.max_receive_message_length", self.max_receive),
                   ("grpc.max_send_message_length", self.max_message),
                   # A fixed window, not one grown by bandwidth probes: grpcio buffers at most this much
                   # of an RPC's messages before its memory is reserved (see stream_window).
                   ("grpc.so_reuseport", 0), ("grpc.http2.bdp_probe", 0),
                   ("grpc.http2.lookahead_bytes", self.stream_window),
                   ("grpc.max_allowed_incoming_connections", self.max_connections),
                   ("grpc.max_concurrent_streams", self.cfg.max_streams_per_connection),
                   ("grpc.max_connection_idle_ms", int(self.cfg.idle_timeout_s * 1000)),
                   ("grpc.server_handshake_timeout_ms", int(self.cfg.handshake_timeout_s * 1000))]
        server = grpc.aio.server(options=options, maximum_concurrent_rpcs=self.cfg.max_concurrent_rpcs)
        server.add_generic_rpc_handlers((self.app.handler(),))
        if isinstance(target, Path):
            clear_unix_path(target, self.listen, "grpc")
            address = f"unix:{target}"
        else:
            host, port = target
            address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        creds = server_credentials(grpc, self.cfg.tls) if self.cfg.tls else None
        try:
            port = server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
        except RuntimeError as e:  # grpcio raises on a failed bind (older versions return 0)
            raise EdgedError(f"cannot listen on {self.listen}: {e}", code=ErrorCode.UNAVAILABLE) from None
        if not port and not isinstance(target, Path):
            raise EdgedError(f"cannot listen on {self.listen}: the address is not available",
                             code=ErrorCode.UNAVAILABLE)
        if isinstance(target, Path):
            self._unix_path = target
            self.address = address
        else:
            self.address = address.rpartition(":")[0] + f":{port}"
        self.app.stopping = False
        await server.start()
        if self._unix_path is not None:
            os.chmod(self._unix_path, UNIX_SOCKET_MODE)
        self._server = server
        log.info("gRPC (KServe v2) listening on %s%s (at most %d connections, %d RPCs at once, %d KiB window "
                 "per RPC)", self.address, " with TLS" if creds else "", self.max_connections,
                 self.cfg.max_concurrent_rpcs, self.stream_window >> 10)

    async def stop(self) -> None:
        self.app.stopping = True
        self.app.control.stop()
        if self._server is not None:
            await self._server.stop(GRACEFUL_STOP_S)  # new RPCs refused at once; running ones may finish
            self._server = None
        self.app.reads.close()
        remove_socket_file(self._unix_path)
        self._unix_path = None
        self.shm.close()
        log.info("gRPC transport stopped")
