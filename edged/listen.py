"""Listen addresses (``host:port``, ``[v6]:port``, ``:port``, a Unix socket path), parsed alike by
every server: the daemon's HTTP and gRPC listeners and the registry."""

from __future__ import annotations

from pathlib import Path

from edged.errors import EdgedError, ErrorCode

__all__ = ["parse_listen"]


def parse_listen(listen: str) -> tuple[str, int] | Path:
    """``host:port`` / ``[v6]:port`` / ``:port`` -> (host, port); ``/path`` or ``unix:/path`` -> Path."""
    if listen.startswith("unix:"):
        if not listen[5:].strip():
            raise EdgedError(f"listen = {listen!r}: the Unix socket path is empty", code=ErrorCode.INVALID_ARGUMENT)
        return Path(listen[5:])
    if listen.startswith("/"):
        return Path(listen)
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise EdgedError(f"[http] listen = {listen!r}: expected host:port or a Unix socket path",
                         code=ErrorCode.INVALID_ARGUMENT)
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return host or "0.0.0.0", int(port)
