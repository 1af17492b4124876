"""Log records to the systemd journal with structured fields (MODEL=, VERSION=, REQUEST_ID=).

Uses systemd-python's ``systemd.journal.send`` when it is installed, else journald's native
protocol spoken directly: one datagram of ``KEY=value`` lines on /run/systemd/journal/socket
(binary-safe length framing for values with newlines; a sealed memfd for records too big for
a datagram). Fields let ``journalctl -u edged MODEL=mobilenet`` find one model's history.
"""

from __future__ import annotations

import array
import errno
import fcntl
import logging
import os
import socket
import struct
import sys
from collections.abc import Callable, Mapping

JOURNAL_SOCKET = "/run/systemd/journal/socket"
_PRIORITY = ((logging.DEBUG, 7), (logging.INFO, 6), (logging.WARNING, 4), (logging.ERROR, 3), (logging.CRITICAL, 2))
_MAX_MESSAGE = 256 * 1024
FIELD_NAMES = ("model", "version", "request_id")
_LEGACY_PREFIX = "model=%s version=%s"


def record_fields(record: logging.LogRecord) -> dict[str, str]:
    """model/version/request_id of a record: explicit ``extra`` first, else the legacy text form."""
    out = {}
    for name in FIELD_NAMES:
        value = getattr(record, name, None)
        if value is not None:
            out[name] = str(value)
    if "model" not in out and isinstance(record.msg, str) and record.msg.startswith(_LEGACY_PREFIX):
        args = record.args
        if isinstance(args, tuple) and len(args) >= 2:
            out["model"], out["version"] = str(args[0]), str(args[1])
    return out


def running_under_journal(environ: Mapping[str, str] | None = None, stderr_fd: int = 2) -> bool:
    """True when systemd started us with stderr connected to the journal (or as a unit at all).

    ``JOURNAL_STREAM`` names the device:inode of the stream systemd connected; it only
    counts when stderr still is that stream (a shell started from a unit inherits the
    variable but may have redirected stderr). ``INVOCATION_ID`` marks any systemd unit.
    """
    env = os.environ if environ is None else environ
    stream = env.get("JOURNAL_STREAM", "")
    if stream:
        try:
            dev, ino = (int(x) for x in stream.split(":", 1))
            st = os.fstat(stderr_fd)
            if (st.st_dev, st.st_ino) == (dev, ino):
                return True
        except (ValueError, OSError):
            pass
    return bool(env.get("INVOCATION_ID"))


def journal_available(path: str = JOURNAL_SOCKET) -> bool:
    try:
        import stat

        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


def priority(levelno: int) -> int:
    for level, prio in _PRIORITY:
        if levelno <= level:
            return prio
    return 1


def encode_native(fields: Mapping[str, str]) -> bytes:
    """journald's native wire format: ``KEY=value\\n``, or ``KEY\\n<u64le length>value\\n`` for multi-line values."""
    out = bytearray()
    for key, value in fields.items():
        data = value.encode("utf-8", "replace")
        if b"\n" in data:
            out += key.encode() + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
        else:
            out += key.encode() + b"=" + data + b"\n"
    return bytes(out)


class _NativeSender:
    def __init__(self, path: str) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    def __call__(self, fields: Mapping[str, str]) -> None:
        data = encode_native(fields)
        try:
            self.sock.sendto(data, self.path)
        except OSError as e:
            if e.errno not in (errno.EMSGSIZE, errno.ENOBUFS):
                raise
            self._send_memfd(data)

    def _send_memfd(self, data: bytes) -> None:
        # Too big for one datagram: journald accepts a sealed memfd holding the same bytes.
        fd = os.memfd_create("edged-journal", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.write(fd, data)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL)
            # sendmsg, not socket.send_fds: the latter ignores its address argument.
            self.sock.sendmsg([b""], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))], 0, self.path)
        finally:
            os.close(fd)

    def close(self) -> None:
        self.sock.close()


def _libsystemd_sender() -> Callable[[Mapping[str, str]], None] | None:
    try:
        from systemd import journal
    except ImportError:
        return None

    def send(fields: Mapping[str, str]) -> None:
        rest = dict(fields)
        message = rest.pop("MESSAGE", "")
        journal.send(message, **rest)

    return send


class JournalHandler(logging.Handler):
    """A logging handler writing one journal entry per record, with edged's structured fields."""

    def __init__(self, *, identifier: str = "edged", socket_path: str = JOURNAL_SOCKET,
                 prefer_libsystemd: bool = True) -> None:
        super().__init__()
        self.identifier = identifier
        self._native: _NativeSender | None = None
        lib = _libsystemd_sender() if prefer_libsystemd and socket_path == JOURNAL_SOCKET else None
        if lib is not None:
            self._send, self.backend = lib, "systemd-python"
        else:
            self._native = _NativeSender(socket_path)
            self._send, self.backend = self._native, "native"
        self.setFormatter(logging.Formatter("%(message)s"))

    def fields(self, record: logging.LogRecord) -> dict[str, str]:
        message = self.format(record)
        if len(message) > _MAX_MESSAGE:
            message = message[:_MAX_MESSAGE] + " [truncated]"
        out = {
            "MESSAGE": message,
            "PRIORITY": str(priority(record.levelno)),
            "SYSLOG_IDENTIFIER": self.identifier,
            "LOGGER": record.name,
            "THREAD_NAME": record.threadName or "",
            "CODE_FILE": record.pathname,
            "CODE_LINE": str(record.lineno),
            "CODE_FUNC": record.funcName,
        }
        for key, value in record_fields(record).items():
            out[key.upper()] = value
        return out

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._send(self.fields(record))
        except Exception:
            self.handleError(record)

    def close(self) -> None:
        if self._native is not None:
            self._native.close()
            self._native = None
        super().close()


def journal_handler_or_none() -> JournalHandler | None:
    """A JournalHandler when running under systemd with a reachable journal, else None (use stderr)."""
    if not running_under_journal() or not journal_available():
        return None
    try:
        return JournalHandler()
    except OSError as e:
        print(f"edged: journal unavailable ({e}); logging to stderr", file=sys.stderr)
        return None
