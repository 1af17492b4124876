"""One memory budget for everything requests hold, across every transport and pipeline.

A request is admitted before its memory is allocated: the transport reserves what the size it
knows first implies (an HTTP ``Content-Length``, a gRPC message's length, a payload's length),
a pipeline step grows the reservation from the sizes it reads in headers (an image's width and
height, a WAV file's sample count, the padded size of a batch of clips) before decoding, and the
reservation is released when the request ends, answered or failed. When the budget is full the
newcomer is refused at once with ``overloaded`` (HTTP 503, gRPC UNAVAILABLE, an MQTT or
shm error reply): nobody waits for memory, so one client's burst never stalls another's. (A gRPC
ModelInfer, whose message is still in the client's socket, waits its turn for room: try_reserve.)

A reservation that could never fit (more than any request may hold) is ``resource_exhausted``.
Requests that hold more than SMALL_REQUEST may fill the budget only up to 7/8 of it: a flood of
large messages leaves room for everybody's small requests and health checks.

Freed request memory is handed back to the system (:func:`return_freed_memory`): glibc keeps
freed heap pages in its arenas, and after a burst of large requests that was gigabytes.
"""

from __future__ import annotations

import contextvars
import ctypes
import ctypes.util
import logging
import mmap
import threading
import time
from collections.abc import Iterable
from types import TracebackType
from typing import Any

from edged import heap
from edged.errors import EdgedError, ErrorCode, OverloadedError, ResourceExhaustedError

log = logging.getLogger(__name__)

MIB = 1 << 20
# What a request may hold while it is being decoded and computed, as a share of the device
# profile's memory budget when [limits] memory_mb is not set (the rest is the models').
DEFAULT_SHARE = 0.25
DEFAULT_MIN_MB = 64.0
# Allocations at least this big are mmapped by glibc and returned to the system when freed. glibc's
# default threshold grows after each large free (up to 32 MiB), so a burst of large requests leaves
# its buffers in the heap; a fixed threshold turns that growth off.
MMAP_THRESHOLD = 1 * MIB
# Requests holding at most SMALL_REQUEST bytes may use the last 1/SMALL_SHARE of the budget; larger ones not.
SMALL_REQUEST = 256 << 10
SMALL_SHARE = 8
# After this many bytes of reservations were released, freed heap pages are trimmed TRIM_INTERVAL_S
# later (a trim walks every arena), then again after each quiet spell of TRIM_SETTLE_S.
TRIM_AFTER = 32 * MIB
TRIM_INTERVAL_S = 0.5
TRIM_SETTLE_S = (2.0, 8.0)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def default_memory_mb(profile_budget_mb: float) -> float:
    """The budget for requests when none is configured: a share of the profile's memory budget."""
    return max(DEFAULT_MIN_MB, round(profile_budget_mb * DEFAULT_SHARE, 1))


class RequestEndedError(EdgedError):
    """Memory charged to a request that has ended (released, or its caller cancelled it): the step
    stops before allocating what nobody will read."""

    code = ErrorCode.FAILED_PRECONDITION


class MemoryBudget:
    """A thread-safe byte counter with a ceiling: reservations succeed whole or are refused at once."""

    def __init__(self, limit_bytes: int, *, name: str = "[limits] memory_mb") -> None:
        self.limit = int(limit_bytes)
        self.name = name
        # What requests holding more than SMALL_REQUEST may fill together: the rest is the small ones' share.
        self.large_limit = self.limit - self.limit // SMALL_SHARE
        self._lock = threading.Lock()
        self.used = 0
        self.peak = 0
        self.refused = 0
        self._released_since_trim = 0

    @classmethod
    def unlimited(cls) -> MemoryBudget:
        return cls(1 << 62, name="(no budget)")

    def reserve(self, nbytes: int, what: str, *args: object) -> Reservation:
        """Hold ``nbytes`` for one request; OverloadedError when the budget is full now. ``what`` names
        them in the error (``what % args`` when args are given: formatted only for a refusal, as every
        request of every transport reserves)."""
        res = Reservation(self)
        res.grow(nbytes, what, *args)
        return res

    def try_reserve(self, nbytes: int) -> Reservation | None:
        """Hold ``nbytes`` if they fit now, else None, counted as no refusal: for a caller that waits for
        room (and calls :meth:`reserve` for its refusal if it gives up)."""
        res = Reservation(self)
        return res if res.try_grow(nbytes) else None

    def ceiling(self, total: int) -> int:
        """What the budget may hold in all once a request holds ``total``: large requests may fill it only
        up to the small requests' share, so a flood of large messages leaves room for everybody else's
        ordinary requests (health, small tensors)."""
        return self.limit if total <= SMALL_REQUEST else self.large_limit

    def _refuse(self, nbytes: int, what: str, args: tuple[object, ...], total: int, ceiling: int, used: int) -> None:
        if args:
            what = what % args
        if total > ceiling:
            raise ResourceExhaustedError(f"{what} needs {total / MIB:.1f} MiB, more than any request may hold "
                                         f"({ceiling / MIB:.0f} MiB of the {self.limit / MIB:.0f} MiB request "
                                         f"memory budget, {self.name})")
        raise OverloadedError(f"{what} needs {nbytes / MIB:.1f} MiB and the request memory budget is full "
                              f"({used / MIB:.0f} of {self.limit / MIB:.0f} MiB held by requests in progress); "
                              "retry later")


class _Trimmer:
    """Trims in a thread of its own (never on the releasing thread: that may be an event loop), at most
    every TRIM_INTERVAL_S, and once more after the last request of a burst: nothing is left held."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def request(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="edged-trim", daemon=True)
                self._thread.start()
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            time.sleep(TRIM_INTERVAL_S)  # let the burst's other requests finish and free theirs too
            return_freed_memory()
            # Again when the burst is over, after a garbage collection (a failed request's traceback keeps
            # its frames, and the message they hold, in a reference cycle until the collector runs), and
            # once the transports have freed the connections' buffers too; a new burst starts over.
            for quiet in TRIM_SETTLE_S:
                if self._wake.is_set() or self._wake.wait(quiet):
                    break
                heap.collect()
                return_freed_memory()


_TRIMMER = _Trimmer()


class Reservation:
    """What one request holds; grows as its sizes become known, released once (idempotent).

    Its count is kept under the budget's one lock, taken once per change: every request makes at least
    three of them (reserve, shrink to what it holds, release), on the transports' hot paths."""

    __slots__ = ("budget", "ended", "held")

    def __init__(self, budget: MemoryBudget) -> None:
        self.budget = budget
        self.held = 0
        # Why it may not grow any more (it was released, or its request cancelled); None: it may. A step
        # still running in a worker thread then stops at its next charge instead of allocating for
        # nobody, and never grows a released reservation, which nothing would release again.
        self.ended: str | None = None

    def end(self, why: str) -> None:
        """Refuse every later growth (``why`` completes "the request ...")."""
        with self.budget._lock:
            if self.ended is None:
                self.ended = why

    def grow(self, nbytes: int, what: str, *args: object) -> None:
        """Add ``nbytes``, before allocating them; raises (holding what it held) when they do not fit
        (``what % args`` names them then), RequestEndedError once it has ended."""
        try:
            fits = self.try_grow(nbytes)
        except RequestEndedError as e:
            raise RequestEndedError(f"{what % args if args else what}: {e}") from None
        if fits:
            return
        b = self.budget
        with b._lock:
            b.refused += 1
            total = self.held + int(nbytes)
            ceiling, used = b.ceiling(total), b.used
        b._refuse(int(nbytes), what, args, total, ceiling, used)

    def try_grow(self, nbytes: int) -> bool:
        """Add ``nbytes`` if they fit now; False (nothing held or counted) if they do not;
        RequestEndedError once it has ended."""
        nbytes = int(nbytes)
        if nbytes <= 0:
            return True
        b = self.budget
        with b._lock:
            if self.ended is not None:
                raise RequestEndedError(f"the request {self.ended}")
            total = self.held + nbytes
            used = b.used + nbytes
            if used > b.ceiling(total):
                return False
            b.used = used
            b.peak = max(b.peak, used)
            self.held = total
            return True

    def shrink(self, nbytes: int) -> None:
        """Keep at most ``nbytes`` (a worst case reserved before a size was known, now that it is): what is
        given back was never allocated, so it counts nothing towards a trim."""
        b = self.budget
        with b._lock:
            extra = self.held - max(0, int(nbytes))
            if extra > 0:
                self.held -= extra
                b.used -= extra

    def release(self) -> None:
        b = self.budget
        with b._lock:
            if self.ended is None:
                self.ended = "has ended"
            held, self.held = self.held, 0
            if held <= 0:
                return
            b.used -= held
            b._released_since_trim += held
            due = b._released_since_trim >= TRIM_AFTER
            if due:
                b._released_since_trim = 0
        if due:
            _TRIMMER.request()

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.release()


# The reservation of the request being computed here: pipeline steps charge what they decode to it.
# Set by the pipeline runner for each request; worker threads see it (asyncio.to_thread copies it).
_current: contextvars.ContextVar[Reservation | None] = contextvars.ContextVar("edged_request_memory", default=None)


def set_current(res: Reservation | None) -> contextvars.Token[Reservation | None]:
    return _current.set(res)


def charge(nbytes: int, what: str) -> None:
    """Grow the current request's reservation before allocating ``nbytes`` (no-op outside a request)."""
    res = _current.get()
    if res is not None:
        res.grow(nbytes, what)


def owned_bytes(arrays: Iterable[Any]) -> int:
    """Bytes of the arrays that own their memory, or whose memory a decoder made for them (a JSON parser's
    buffer under a memoryview). Views of a request's body (bytes) or of a shared-memory region (mmap) are
    not new: they were reserved with the body, or are the client's."""
    seen: set[int] = set()
    total = 0
    for arr in arrays:
        root = arr
        while getattr(root, "base", None) is not None and hasattr(root.base, "nbytes") and hasattr(root.base, "flags"):
            root = root.base
        base = getattr(root, "base", None)
        if base is None:
            owner, nbytes = root, int(getattr(root, "nbytes", 0))
        elif isinstance(base, memoryview) and not isinstance(base.obj, (bytes, bytearray, mmap.mmap)):
            owner, nbytes = base.obj, base.nbytes  # e.g. simdjson's ArrayBuffer: the parser's new memory
        else:
            continue
        if id(owner) not in seen:
            seen.add(id(owner))
            total += nbytes
    return total


# ---- returning memory to the system ------------------------------------------------------------
_libc: ctypes.CDLL | bool | None = False


def _glibc() -> ctypes.CDLL | None:
    global _libc
    if _libc is False:
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            lib.malloc_trim.argtypes = [ctypes.c_size_t]
            lib.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
            _libc = lib
        except (OSError, AttributeError):  # musl, macOS: no malloc_trim/mallopt; nothing to tune
            _libc = None
    return _libc if isinstance(_libc, ctypes.CDLL) else None


def tune_allocator() -> bool:
    """Fix glibc's mmap and trim thresholds so large request buffers go back to the system when freed.

    Called once at daemon start, before requests arrive. False where the C library is not glibc."""
    lib = _glibc()
    if lib is None:
        return False
    ok = bool(lib.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(lib.mallopt(_M_TRIM_THRESHOLD, 4 * MIB))
    if not ok:
        log.warning("mallopt refused the allocator thresholds; freed request memory may stay with the process")
    return ok


def return_freed_memory() -> None:
    """``malloc_trim(0)``: give free pages of every glibc arena back to the system."""
    lib = _glibc()
    if lib is not None:
        lib.malloc_trim(0)
