"""The kernel's word on who is at the other end of a Unix socket (SO_PEERCRED).

Unlike anything a peer sends, these cannot be forged: for an accepted socket they are
the client's, for a connected client socket they are those of the process that called
``listen()`` (the server). Both sides of every local transport decide on them.
"""

from __future__ import annotations

import socket
import struct
from typing import Protocol

_CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid


class _UnixSocket(Protocol):
    def getsockopt(self, level: int, option: int, buflen: int) -> bytes: ...


def peer_credentials(sock: _UnixSocket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the peer; OSError when the socket has none (not AF_UNIX, not connected)."""
    pid, uid, gid = _CREDS.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDS.size))
    return pid, uid, gid
