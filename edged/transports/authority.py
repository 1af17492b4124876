"""Who may change the daemon's state: the one check every transport makes before acting.

Inference and reads are open to whoever can reach a listener. Actions that change
what the daemon serves or what it touches on a client's behalf (repository
load/unload, system shared memory registration) need the *management authority*:

* a bearer credential, ``[control] token``, sent as ``Authorization: Bearer <token>``
  (HTTP) or the same metadata key (gRPC), compared in constant time; or
* a Unix-socket peer whose kernel-reported uid (SO_PEERCRED) is root, the daemon's own
  user or one listed in ``[control] unix_uids``.

Anchored on Triton's model-control modes: ``[control] model_control = "none"`` refuses
load/unload for everyone (the repository and the registry decide what is served),
``"explicit"`` (default) allows them with the authority. With no token configured (the
default) a TCP client has no way to get it: out of the box only trusted local users on a
Unix-socket listener can load or unload.

Transports build a :class:`Peer` per request (connection credentials plus the presented
credential) and call :meth:`Authority.require`; :meth:`Authority.scope` names the caller
for per-client state such as system shared memory regions.
"""

from __future__ import annotations

import hmac
import os
import socket
from dataclasses import dataclass

from edged.config import ControlSection
from edged.errors import PermissionDeniedError, UnauthenticatedError
from edged.protocol.peercred import peer_credentials

LOAD = "load a model"
UNLOAD = "unload a model"
MODEL_CONTROL = frozenset({LOAD, UNLOAD})


@dataclass(frozen=True)
class Peer:
    """The other end of one request: kernel credentials on a Unix socket, else an address; plus its token."""

    uid: int | None = None  # SO_PEERCRED (Unix sockets only): cannot be forged by the client
    gid: int | None = None
    pid: int | None = None
    address: str | None = None  # TCP peer host, for logs
    credential: str | None = None  # bearer token presented with this request

    @property
    def unix(self) -> bool:
        return self.uid is not None

    def describe(self) -> str:
        return f"uid {self.uid} (pid {self.pid})" if self.unix else f"{self.address or 'unknown'} over TCP"


def socket_peer(sock: socket.socket | None) -> Peer:
    """The connection part of a :class:`Peer` for an accepted socket."""
    if sock is None:
        return Peer()
    if sock.family == socket.AF_UNIX:
        try:
            pid, uid, gid = peer_credentials(sock)
        except OSError:
            return Peer()
        return Peer(uid=uid, gid=gid, pid=pid)
    try:
        name = sock.getpeername()
    except OSError:
        return Peer()
    return Peer(address=str(name[0]) if isinstance(name, tuple) else None)


def bearer(value: bytes | str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header value (None when absent or another scheme)."""
    if value is None:
        return None
    text = value.decode("latin-1") if isinstance(value, bytes) else value
    scheme, _, token = text.strip().partition(" ")
    return (token.strip() or None) if scheme.lower() == "bearer" else None


class Authority:
    def __init__(self, control: ControlSection, *, daemon_uid: int | None = None) -> None:
        self.mode = control.model_control
        self._token = control.token.encode() if control.token else None
        self.daemon_uid = os.geteuid() if daemon_uid is None else daemon_uid
        self.trusted_uids = frozenset({0, self.daemon_uid, *control.unix_uids})

    def principal(self, peer: Peer) -> str | None:
        """``"token"`` or ``"uid:N"`` for a caller holding the authority, else None."""
        if peer.credential is not None and self._token is not None and \
                hmac.compare_digest(peer.credential.encode("utf-8", "replace"), self._token):
            return "token"
        if peer.uid is not None and peer.uid in self.trusted_uids:
            return f"uid:{peer.uid}"
        return None

    def require(self, peer: Peer, action: str) -> str:
        """The caller's principal, or a typed refusal saying what would be needed."""
        if action in MODEL_CONTROL and self.mode == "none":
            raise PermissionDeniedError(f"cannot {action}: model control is disabled "
                                        "([control] model_control = \"none\")")
        who = self.principal(peer)
        if who is not None:
            return who
        if peer.credential is not None:
            raise PermissionDeniedError(f"cannot {action}: the management credential is not valid")
        if peer.unix:
            raise PermissionDeniedError(f"cannot {action}: uid {peer.uid} is not trusted on this socket "
                                        "([control] unix_uids), and no management credential was sent")
        how = "send 'Authorization: Bearer <[control] token>'" if self._token is not None else \
            "no [control] token is configured, so use a Unix-socket listener as a trusted user"
        raise UnauthenticatedError(f"cannot {action}: this needs the management authority ({how})")

    def known_scope(self, peer: Peer) -> str | None:
        """Whose per-client state a request sees: its own uid on a Unix socket, the token holder over TCP."""
        return f"uid:{peer.uid}" if peer.uid is not None else self.principal(peer)

    def scope(self, peer: Peer, action: str) -> str:
        """:meth:`known_scope`, or the refusal :meth:`require` gives a TCP caller without the credential."""
        known = self.known_scope(peer)
        return known if known is not None else self.require(peer, action)
