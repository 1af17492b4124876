"""Triton-compatible system shared memory: client-owned POSIX segments registered by key.

A client creates ``/dev/shm/<key>``, registers (name, key, offset, byte_size), and
then points request inputs and outputs at ``(region, offset, byte_size)`` slices.
The client owns the segment and may shrink or remove it at any time, so the
daemon never maps it: every access is ``os.preadv``/``os.pwrite`` on the file
descriptor, which returns short or grows the file instead of raising SIGBUS.

Checks, because Triton's CVEs came from missing ones: the key is one plain file
name (no path separators, no ``.``/``..``, not the daemon's reserved ``edged``
prefix), the segment is opened without following symlinks and must be a regular
file at least ``offset + byte_size`` long (fstat), ``byte_size`` is bounded by
``[shm] max_region_mb``, and every request's (offset, byte_size) must lie inside
the registered window (Python integers cannot overflow; values beyond 2**63 are
refused before they reach a system call). Errors name the client's region name,
never the key or any path.

The daemon must never lend its own rights: a caller on a Unix socket may only register
a segment its own uid (and groups) could open, read (and write, for outputs), and over
TCP only segments named with ``[shm] system_shm_prefix`` and owned by the daemon's user
are accepted, from the management-token holder. Regions live in the registering
caller's scope: status, unregister and inference references only see their own.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import stat
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edged.errors import EdgedError, ErrorCode, InvalidInputError, PermissionDeniedError, ResourceExhaustedError

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
RESERVED_PREFIX = "edged"  # the daemon's own segments (shm transport); clients may not register them
MAX_REGIONS = 256  # per caller; each holds a file descriptor
_ALL_SCOPES = 4  # all callers together hold at most this many times MAX_REGIONS
_MAX_OFF = (1 << 63) - 1  # off_t
_KEY_RE = re.compile(r"^/?([A-Za-z0-9_][A-Za-z0-9_.\-]{0,254})$")
_NAME_RE = re.compile(r"^[^\x00-\x1f\x7f/\\]{1,256}$")
_BOUNCE_LIMIT = 1 << 20  # outputs below this are staged in a bytearray, larger ones in lazy anonymous memory


def check_key(key: object) -> str:
    """The segment's file name for a Triton-style key (``/name`` or ``name``); raises when unsafe."""
    if not isinstance(key, str):
        raise InvalidInputError("'key' must be a string")
    m = _KEY_RE.fullmatch(key)
    if m is None or m.group(1) in (".", ".."):
        raise InvalidInputError(
            "'key' must be a shared memory name: an optional leading '/', then 1-255 letters, digits, "
            "'_', '.' or '-' (no other '/')")
    fname = m.group(1)
    if fname.lower().startswith(RESERVED_PREFIX):
        raise InvalidInputError(f"'key' may not start with {RESERVED_PREFIX!r}: that prefix is reserved for "
                                "the daemon's own segments")
    return fname


def check_name(name: object) -> str:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise InvalidInputError("region name must be 1-256 printable characters without '/' or '\\'")
    return name


def _int(value: object, what: str, *, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidInputError(f"{what!r} must be an integer")
    if value < minimum or value > _MAX_OFF:
        raise InvalidInputError(f"{what!r} must be between {minimum} and {_MAX_OFF}")
    return value


@dataclass(frozen=True)
class ShmCaller:
    """Who registers or uses regions: its scope, and on a Unix socket its kernel-reported uid and gid."""

    scope: str
    uid: int | None = None
    gid: int | None = None


def _groups(uid: int, gid: int) -> set[int]:
    import pwd

    try:
        return set(os.getgrouplist(pwd.getpwuid(uid).pw_name, gid))
    except (KeyError, OSError):
        return {gid}


def _may(st: os.stat_result, uid: int, gid: int, want: int) -> bool:
    """Would ``uid`` (primary group ``gid``) get ``want`` (R_OK|W_OK bits: 4, 2) on this file by its mode?"""
    if uid == 0:
        return True
    if st.st_uid == uid:
        bits = (st.st_mode >> 6) & 7
    elif st.st_gid in _groups(uid, gid):
        bits = (st.st_mode >> 3) & 7
    else:
        bits = st.st_mode & 7
    return bits & want == want


def _unknown(scope: str, name: str) -> str:
    """Why a request's region is unknown, and what to send: regions are scoped to their registrant, so a
    region registered with the token and used without it is unknown to that request (said without
    telling whether anyone else has a region of that name)."""
    if not scope:
        return (f"shared memory region {name!r} is not registered for this caller: regions are scoped to "
                "whoever registered them, and a request over TCP without the management credential has "
                "none; send 'Authorization: Bearer <[control] token>' (gRPC: 'authorization' metadata) with "
                "every request that uses a region registered with it")
    who = "the management token" if scope == "token" else scope.replace("uid:", "uid ")
    return (f"shared memory region {name!r} is not registered for this caller ({who}): regions are scoped to "
            "whoever registered them; register it with the same credential, or on the same uid, as the requests "
            "that use it")


@dataclass
class Region:
    name: str
    key: str  # as the client gave it (status only; never in errors)
    offset: int  # where the registered window starts in the segment
    byte_size: int
    fd: int
    writable: bool = True
    users: int = 0
    closed: bool = False

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}


class SystemShmRegions:
    """Registered regions, safe to use from the event loop and worker threads at once.

    A region being read or written holds a use count; unregister removes it at once
    but closes its descriptor only when the last user is done, so a descriptor is
    never closed (and its number reused) under a concurrent pread.
    """

    def __init__(self, max_region_bytes: int, *, shm_dir: Path = SHM_DIR, max_regions: int = MAX_REGIONS,
                 tcp_prefix: str | None = None, daemon_uid: int | None = None) -> None:
        self.max_region_bytes = max_region_bytes
        self.shm_dir = shm_dir
        self.max_regions = max_regions
        self.tcp_prefix = tcp_prefix
        self.daemon_uid = os.geteuid() if daemon_uid is None else daemon_uid
        self._lock = threading.Lock()
        self._regions: dict[tuple[str, str], Region] = {}  # (caller scope, region name)

    # ---- registration -----------------------------------------------------------------------
    def register(self, caller: ShmCaller, name: object, key: object, offset: object, byte_size: object) -> None:
        name = check_name(name)
        fname = check_key(key)
        assert isinstance(key, str)
        if caller.uid is None and (self.tcp_prefix is None or not fname.startswith(self.tcp_prefix)):
            raise PermissionDeniedError(
                f"region {name!r}: over TCP only segments named with [shm] system_shm_prefix may be registered"
                + ("" if self.tcp_prefix else " (unset: system shared memory over TCP is off)"))
        off = _int(offset, "offset", minimum=0)
        size = _int(byte_size, "byte_size", minimum=1)
        if size > self.max_region_bytes:
            raise InvalidInputError(f"region {name!r}: byte_size {size} is larger than the {self.max_region_bytes} "
                                    "bytes allowed ([shm] max_region_mb)")
        ident = (caller.scope, name)
        with self._lock:
            if ident in self._regions:
                raise InvalidInputError(f"shared memory region {name!r} is already registered")
            mine = sum(1 for s, _ in self._regions if s == caller.scope)
            if mine >= self.max_regions or len(self._regions) >= self.max_regions * _ALL_SCOPES:
                raise ResourceExhaustedError(f"cannot register region {name!r}: {mine} regions are "
                                             "already registered")
        fd = self._open(name, fname)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise InvalidInputError(f"region {name!r}: the key does not name a shared memory segment")
            writable = self._allowed(caller, name, st)
            if st.st_size < off + size:
                raise InvalidInputError(f"region {name!r}: offset {off} + byte_size {size} is larger than the "
                                        f"segment ({st.st_size} bytes)")
            with self._lock:
                if ident in self._regions:
                    raise InvalidInputError(f"shared memory region {name!r} is already registered")
                self._regions[ident] = Region(name, key, off, size, fd, writable)
        except BaseException:
            os.close(fd)
            raise
        log.info("system shared memory region %r registered (%d bytes)", name, size)

    def _allowed(self, caller: ShmCaller, name: str, st: os.stat_result) -> bool:
        """Refuse what the caller could not open itself; True when it may also be written (outputs)."""
        if caller.uid is None:  # TCP: only the daemon user's own segments (never lend root's rights)
            if st.st_uid != self.daemon_uid:
                raise PermissionDeniedError(f"region {name!r}: over TCP only segments owned by the daemon's "
                                            "user may be registered")
            return True
        gid = caller.gid if caller.gid is not None else -1
        if not _may(st, caller.uid, gid, 4):
            raise PermissionDeniedError(f"region {name!r}: uid {caller.uid} may not read that segment itself")
        return _may(st, caller.uid, gid, 2)

    def _open(self, name: str, fname: str) -> int:
        flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0)
        try:
            return os.open(self.shm_dir / fname, flags)
        except FileNotFoundError:
            raise InvalidInputError(f"region {name!r}: no shared memory segment with that key") from None
        except PermissionError:
            raise InvalidInputError(f"region {name!r}: the daemon may not open that segment") from None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise InvalidInputError(f"region {name!r}: the key does not name a shared memory segment") from None
            if e.errno in (errno.EMFILE, errno.ENFILE):
                raise ResourceExhaustedError(f"region {name!r}: out of file descriptors") from None
            raise InvalidInputError(f"region {name!r}: cannot open the segment ({os.strerror(e.errno or 0)})") from None

    def unregister(self, scope: str, name: str) -> bool:
        """Forget one of the caller's regions; unknown names are not an error (Triton's clients unregister blindly)."""
        with self._lock:
            region = self._regions.pop((scope, name), None)
            if region is None:
                return False
            self._retire(region)
        log.info("system shared memory region %r unregistered", name)
        return True

    def unregister_all(self, scope: str | None = None) -> None:
        """Forget the caller's regions (``scope``), or everyone's (None: the transport stops)."""
        with self._lock:
            idents = [i for i in self._regions if scope is None or i[0] == scope]
            for i in idents:
                self._retire(self._regions.pop(i))

    def close(self) -> None:
        self.unregister_all()

    def _retire(self, region: Region) -> None:  # lock held
        region.closed = True
        if region.users == 0:
            os.close(region.fd)

    def status(self, scope: str, name: str | None = None) -> list[dict[str, Any]]:
        with self._lock:
            if name is None:
                return [r.status() for (s, _), r in self._regions.items() if s == scope]
            region = self._regions.get((scope, name))
            if region is None:
                raise EdgedError(f"shared memory region {name!r} is not registered", code=ErrorCode.NOT_FOUND)
            return [region.status()]

    def __len__(self) -> int:
        return len(self._regions)

    # ---- access -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def _use(self, scope: str, name: object, offset: object, byte_size: object, *,
             write: bool = False) -> Iterator[tuple[int, int, int]]:
        """Yield (fd, absolute offset, size) for a checked slice, keeping the descriptor open."""
        if not isinstance(name, str):
            raise InvalidInputError("'shared_memory_region' must be a string")
        off = _int(offset, "shared_memory_offset", minimum=0)
        size = _int(byte_size, "shared_memory_byte_size", minimum=0)
        with self._lock:
            region = self._regions.get((scope, name))
            if region is None:
                raise InvalidInputError(_unknown(scope, name))
            if write and not region.writable:
                raise InvalidInputError(f"shared memory region {name!r}: its registrant may not write the segment")
            if off > region.byte_size or size > region.byte_size - off:
                raise InvalidInputError(f"shared memory region {name!r}: offset {off} + byte_size {size} is "
                                        f"outside the region ({region.byte_size} bytes)")
            region.users += 1
        try:
            yield region.fd, region.offset + off, size
        finally:
            with self._lock:
                region.users -= 1
                if region.closed and region.users == 0:
                    os.close(region.fd)

    def read(self, scope: str, name: object, offset: object, byte_size: object) -> memoryview:
        """A private copy of the slice (never a live mapping: the owner may truncate it any time)."""
        with self._use(scope, name, offset, byte_size) as (fd, pos, size):
            buf = bytearray(size)
            view = memoryview(buf)
            done = 0
            while done < size:
                try:
                    n = os.preadv(fd, [view[done:]], pos + done)
                except OSError as e:
                    raise InvalidInputError(f"shared memory region {name!r} cannot be read "
                                            f"({os.strerror(e.errno or 0)})") from None
                if n <= 0:
                    raise InvalidInputError(f"shared memory region {name!r} is shorter than registered: "
                                            "its owner truncated it")
                done += n
            return view

    def write(self, scope: str, name: object, offset: object, data: bytes | bytearray | memoryview) -> None:
        """Write ``data`` at ``offset``; refused when the owner shrank the segment below the slice."""
        data = memoryview(data).cast("B")
        with self._use(scope, name, offset, len(data), write=True) as (fd, pos, size):
            try:
                if os.fstat(fd).st_size < pos + size:
                    raise InvalidInputError(f"shared memory region {name!r} is shorter than registered: "
                                            "its owner truncated it")
                done = 0
                while done < size:
                    n = os.pwrite(fd, data[done:], pos + done)
                    if n <= 0:
                        raise InvalidInputError(f"shared memory region {name!r} cannot be written")
                    done += n
            except OSError as e:
                raise InvalidInputError(f"shared memory region {name!r} cannot be written "
                                        f"({os.strerror(e.errno or 0)})") from None

    def check(self, scope: str, name: object, offset: object, byte_size: object, *, write: bool = False) -> None:
        """Validate a slice without touching it (outputs are checked before inference)."""
        with self._use(scope, name, offset, byte_size, write=write):
            pass

    def view(self, scope: str) -> ShmView:
        return ShmView(self, scope)


@dataclass(frozen=True)
class ShmView:
    """One caller's regions: what a request may read and write (the codec's resolver)."""

    registry: SystemShmRegions
    scope: str

    def read(self, name: object, offset: object, byte_size: object) -> memoryview:
        return self.registry.read(self.scope, name, offset, byte_size)

    def write(self, name: object, offset: object, data: bytes | bytearray | memoryview) -> None:
        self.registry.write(self.scope, name, offset, data)

    def check(self, name: object, offset: object, byte_size: object, *, write: bool = False) -> None:
        self.registry.check(self.scope, name, offset, byte_size, write=write)


class OutputStaging:
    """Collects output bytes for shm slices so they are written with pwrite after encoding.

    The v2 codec writes an output into the buffer a resolver returns; this resolver
    hands out private buffers of exactly the bytes used and :meth:`flush` copies them
    into the client's segment.
    """

    def __init__(self, registry: ShmView) -> None:
        self.registry = registry
        self.buffers: dict[tuple[str, int], memoryview] = {}

    def __call__(self, region: str, offset: int, byte_size: int, used: int) -> memoryview:
        self.registry.check(region, offset, byte_size, write=True)
        if used < _BOUNCE_LIMIT:
            view = memoryview(bytearray(used))
        else:
            import mmap  # anonymous memory: pages only exist once written

            view = memoryview(mmap.mmap(-1, max(used, 1)))[:used]
        self.buffers[(region, offset)] = view
        return view

    def flush(self) -> None:
        for (region, offset), view in self.buffers.items():
            self.registry.write(region, offset, view)
