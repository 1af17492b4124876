"""The sd_notify protocol: tell the service manager when edged is ready, reloading, stopping, alive.

systemd-python's ``systemd.daemon.notify`` (libsystemd's sd_notify) is used when it is
installed; otherwise one AF_UNIX datagram per message to ``$NOTIFY_SOCKET``, which is all
the protocol is. Outside systemd (no ``NOTIFY_SOCKET``) every call is a cheap no-op, so
callers never need to check.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)

Sender = Callable[[str], bool]


def watchdog_interval(environ: Mapping[str, str] | None = None, pid: int | None = None) -> float | None:
    """The watchdog timeout in seconds that the manager set for this process, or None.

    Same rules as sd_watchdog_enabled(): ``WATCHDOG_USEC`` > 0, and when ``WATCHDOG_PID``
    is set it must be this process (a child must not ping on its parent's behalf).
    """
    env = os.environ if environ is None else environ
    raw = env.get("WATCHDOG_USEC")
    if not raw:
        return None
    try:
        usec = int(raw)
    except ValueError:
        log.warning("ignoring WATCHDOG_USEC=%r: not an integer", raw)
        return None
    if usec <= 0:
        return None
    owner = env.get("WATCHDOG_PID")
    if owner and owner.strip() != str(os.getpid() if pid is None else pid):
        return None
    return usec / 1e6


def _socket_address(value: str) -> str | bytes | None:
    if value.startswith("@"):
        return b"\0" + value[1:].encode()  # abstract namespace
    if value.startswith("/"):
        return value
    return None  # vsock: and other transports are not supported by the fallback


class _DatagramSender:
    """The plain-socket fallback: one datagram per message, never blocking the caller."""

    def __init__(self, address: str | bytes) -> None:
        self.address = address
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self.sock.setblocking(False)

    def __call__(self, message: str) -> bool:
        try:
            self.sock.sendto(message.encode(), self.address)
            return True
        except OSError as e:  # the manager went away or its queue is full: nothing to do but say so
            log.debug("sd_notify %r failed: %s", message.split("\n", 1)[0], e)
            return False

    def close(self) -> None:
        self.sock.close()


def _libsystemd_sender() -> Sender | None:
    try:
        from systemd import daemon
    except ImportError:
        return None

    def send(message: str) -> bool:
        # systemd-python raises where sd_notify(3) returns an error (the manager's socket gone or
        # full): a notification that cannot be delivered must never stop the daemon, as in _DatagramSender.
        try:
            return bool(daemon.notify(message))
        except OSError as e:
            log.debug("sd_notify %r failed: %s", message.split("\n", 1)[0], e)
            return False

    return send


class Notifier:
    """Sends state changes to the service manager; a no-op when not started by one."""

    def __init__(self, environ: Mapping[str, str] | None = None, *, prefer_libsystemd: bool = True) -> None:
        env = os.environ if environ is None else environ
        self._fallback: _DatagramSender | None = None
        self._send: Sender | None = None
        self.backend = "none"
        target = env.get("NOTIFY_SOCKET", "")
        if not target:
            return
        lib = _libsystemd_sender() if prefer_libsystemd and environ is None else None
        if lib is not None:
            self._send, self.backend = lib, "systemd-python"
            return
        address = _socket_address(target)
        if address is None:
            log.warning("NOTIFY_SOCKET=%s is not a Unix socket path; service notifications are off", target)
            return
        self._fallback = _DatagramSender(address)
        self._send, self.backend = self._fallback, "socket"

    @property
    def enabled(self) -> bool:
        return self._send is not None

    def notify(self, **fields: str | int) -> bool:
        """Send ``KEY=value`` lines in one message (keys in upper case, as the protocol wants)."""
        if self._send is None:
            return False
        message = "\n".join(f"{k.upper()}={_one_line(str(v))}" for k, v in fields.items())
        return self._send(message)

    def ready(self, status: str | None = None) -> bool:
        return self.notify(READY=1, **_status(status))

    def status(self, text: str) -> bool:
        return self.notify(STATUS=text)

    def reloading(self, status: str | None = None) -> bool:
        # MONOTONIC_USEC lets systemd >= 253 tell this reload from an older one; older versions ignore it.
        return self.notify(RELOADING=1, MONOTONIC_USEC=time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000,
                           **_status(status))

    def stopping(self, status: str | None = None) -> bool:
        return self.notify(STOPPING=1, **_status(status))

    def watchdog(self) -> bool:
        return self.notify(WATCHDOG=1)

    def extend_timeout(self, seconds: float) -> bool:
        return self.notify(EXTEND_TIMEOUT_USEC=int(seconds * 1e6))

    def close(self) -> None:
        if self._fallback is not None:
            self._fallback.close()
            self._fallback = None
        self._send = None


def _status(text: str | None) -> dict[str, str]:
    return {} if text is None else {"STATUS": text}


def _one_line(value: str) -> str:
    # A newline would start a new assignment in the datagram: a status text must not inject READY=1.
    return value.replace("\n", " ")
