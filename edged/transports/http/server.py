"""A small HTTP/1.1 server on asyncio + httptools, made for one job: request in, whole response out.

Why not uvicorn: measured on the bundled models, an ASGI server writes the status
line and headers and then the body as two ``send`` calls and wraps every request in
ASGI dictionaries; together that was most of the transport's latency budget. This
server hands a complete request (method, raw path, headers, body) to one handler
coroutine and writes ``head + body`` in one call.

What it still does for robustness: keep-alive and pipelining (responses in request
order, reading paused while too many requests wait), ``Expect: 100-continue``,
header and body size limits (431 / 413 and close, before the body is read),
per-request read timeouts, a shorter deadline for the request line and headers
(slowloris), keep-alive idle timeouts (slow or idle clients cannot hold a connection
forever), a connection limit per client (peer address, or uid on a Unix socket) under the
global one, and when the server is full a newcomer takes an idle connection of the client
holding the most (else the longest-idle one, else the slowest body sender's) rather than being
refused; a global cap on connections receiving a body, whatever their addresses, that cuts
off the slowest sender, and a pause limit between body parts; write back-pressure and a limit
on how long an answer may wait for a client that does not read; requests on half-closed
connections (the client sent its request, then shut down its sending side) are answered;
and a graceful stop that finishes in-flight requests before closing.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from email.utils import formatdate
from http import HTTPStatus

import httptools
import orjson

from edged.errors import EdgedError, ErrorCode
from edged.membudget import MemoryBudget, Reservation
from edged.transports.authority import Peer, socket_peer

log = logging.getLogger(__name__)

Headers = list[tuple[bytes, bytes]]
Response = tuple[int, Headers, bytes]


@dataclass
class Load:
    """Requests parsed and not yet answered, on every connection of one server: a handler that
    sees only its own may use the event loop for a short computation without delaying anyone."""

    pending: int = 0


@dataclass
class Request:
    method: str
    path: bytes  # raw target, query string included, not percent-decoded
    headers: Headers  # names lower-cased
    body: bytes
    keep_alive: bool = True
    peer: Peer = field(default_factory=Peer)  # who is connected (kernel credentials on a Unix socket)
    load: Load | None = None  # the server's; None for a request built outside a server
    hold: Reservation | None = None  # its share of the request memory budget, released once it is answered


Handler = Callable[[Request], Awaitable[Response]]


@dataclass
class Limits:
    max_body: int = 64 * 1024 * 1024
    max_header_bytes: int = 64 * 1024
    keep_alive_s: float = 60.0  # idle connection lifetime between requests
    request_timeout_s: float = 60.0  # from the first byte of a request to its last
    header_timeout_s: float = 10.0  # from connecting / the first byte of a request to its last header byte
    max_pipelined: int = 32  # queued requests per connection before reading pauses
    max_connections: int = 1000
    max_client_connections: int = 64  # per peer address (TCP) or uid (Unix socket); the idlest gives way
    max_busy_connections: int = 256  # receiving a body, all clients together; the slowest sender gives way
    overflow_connections: int = 0  # beyond max_connections, for clients under an equal share (see room_beyond)
    body_timeout_s: float = 10.0  # longest pause between two parts of a body
    body_credit: int = 16 * 1024  # bytes a body is assumed to have sent already when its rate is judged
    write_high_water: int = 4 * 1024 * 1024


_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
SLOW_CANDIDATES = 32  # bodies judged when one must be cut off: the longest-running ones
_ONE_WRITE = 256 * 1024  # bodies up to this are copied into one buffer with the head: one send, not two


class _Date:
    """The Date header, formatted once a second (RFC 9110 asks servers with a clock to send it)."""

    def __init__(self) -> None:
        self._second = -1
        self._value = b""

    def get(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second = now
            self._value = formatdate(now, usegmt=True).encode()
        return self._value


_DATE = _Date()


def render_head(status: int, headers: Headers, length: int, close: bool, keep_alive: bool = False) -> bytes:
    """``keep_alive``: say so (an HTTP/1.0 client closes after the answer unless told otherwise)."""
    parts = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown"))]
    for k, v in headers:
        parts += (k, b": ", v, b"\r\n")
    parts.append(b"content-length: %d\r\ndate: %s\r\n" % (length, _DATE.get()))
    if close:
        parts.append(b"connection: close\r\n")
    elif keep_alive:
        parts.append(b"connection: keep-alive\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)


def error_response(status: int, message: str) -> Response:
    return status, [(b"content-type", b"application/json")], orjson.dumps({"error": message})


# A body is held twice while it arrives in pieces and is joined into one buffer.
BODY_COPIES = 2
LINGER_S = 5.0  # a refused body is read and dropped for at most this long after the answer
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


@dataclass
class _State:
    budget: MemoryBudget = field(default_factory=MemoryBudget.unlimited)
    connections: set[HttpConnection] = field(default_factory=set)
    clients: dict[object, set[HttpConnection]] = field(default_factory=dict)  # by client key
    # Headers received, body still arriving; insertion-ordered, so the longest-running bodies come first.
    busy: dict[HttpConnection, None] = field(default_factory=dict)
    busy_by_client: collections.Counter[object] = field(default_factory=collections.Counter)
    # Bodies of clients holding their share of busy slots already: not read (no CPU spent, no cut, no
    # reconnect) until a slot frees; oldest first.
    parked: dict[HttpConnection, None] = field(default_factory=dict)
    cut_off: int = 0  # slow body senders closed to make room (for tests and logs)
    stopping: bool = False
    load: Load = field(default_factory=Load)

    def add(self, conn: HttpConnection) -> None:
        self.connections.add(conn)
        self.clients.setdefault(conn.client, set()).add(conn)

    def discard(self, conn: HttpConnection) -> None:
        self.connections.discard(conn)
        self.unbusy(conn)
        mine = self.clients.get(conn.client)
        if mine is not None:
            mine.discard(conn)
            if not mine:
                del self.clients[conn.client]

    def unbusy(self, conn: HttpConnection) -> None:
        """``conn`` no longer receives a body (or waits to)."""
        self.parked.pop(conn, None)
        if self.busy.pop(conn, 0) is None:
            n = self.busy_by_client[conn.client] - 1
            if n > 0:
                self.busy_by_client[conn.client] = n
            else:
                del self.busy_by_client[conn.client]

    def make_busy(self, conn: HttpConnection) -> None:
        self.busy[conn] = None
        self.busy_by_client[conn.client] += 1

    def over_share(self, conn: HttpConnection) -> bool:
        """Whether ``conn``'s client holds at least an equal share of the busy slots already."""
        holders = len(self.busy_by_client) + (conn.client not in self.busy_by_client)
        return self.busy_by_client.get(conn.client, 0) >= max(1, conn.limits.max_busy_connections // holders)

    def unpark(self, max_busy: int) -> None:
        """A busy slot freed: the longest-waiting parked body is read again."""
        while self.parked and len(self.busy) < max_busy:
            conn = next(iter(self.parked))
            del self.parked[conn]
            if conn.transport is not None and not conn._discard:
                conn.resume_body()

    def drop(self, victim: HttpConnection, status: int = 0, why: str = "") -> None:
        """Take ``victim`` off the books to make room: told ``status`` (0: nothing, an idle connection) and
        closed. A socket off the books must not stay open: one whose close would wait (an answer still being
        computed or written, a client that does not read) is aborted."""
        if status:
            victim._refuse(status, why)
        transport = victim.transport
        if transport is not None:
            if victim.task is not None or transport.get_write_buffer_size():
                transport.abort()
            else:
                transport.close()
        self.discard(victim)

    def room_beyond(self, conn: HttpConnection) -> bool:
        """Server full: a client holding less than an equal share of the connections may still come in,
        within ``overflow_connections`` (descriptors the budget keeps for accept bursts), rather than
        make another client's connection close (which a hostile client would reopen at once)."""
        limits = conn.limits
        if len(self.connections) > limits.max_connections + limits.overflow_connections:
            return False
        return len(self.clients.get(conn.client, ())) <= max(1, limits.max_connections // len(self.clients))

    def make_room_within(self, conn: HttpConnection, why: str) -> bool:
        """A client at its own limit: its longest-idle (or still header-less) connection gives way to the
        new one, so a process hoarding idle connections cannot lock out other processes behind the same
        address (every local TCP client is 127.0.0.1); refused only when all of them are busy."""
        victim = min((c for c in self.clients.get(conn.client, ()) if c is not conn and c.evictable),
                     key=lambda c: c.since, default=None)
        if victim is None or victim.transport is None:
            return False
        self.drop(victim, 503, why)
        return True

    def evict_for(self, conn: HttpConnection) -> bool:
        """Server full: close an idle (or still header-less) connection of the biggest other holder."""
        have = len(self.clients.get(conn.client, ()))
        key, biggest = max(((k, v) for k, v in self.clients.items() if k != conn.client),
                           key=lambda kv: len(kv[1]), default=(None, set()))
        if key is None or len(biggest) <= have:
            return False
        victim = min((c for c in biggest if c.evictable), key=lambda c: c.since, default=None)
        if victim is None:
            victim = next((c for c in self.parked if c.client == key), None)
        if victim is None:
            # Addresses are cheap (all of 127.0.0.0/8 is this machine): judge connections, not keys.
            # The slowest body sender anywhere gives way, else the longest-idle (or header-less) connection.
            if self.cut_slowest(conn, "the server is full"):
                return True
            victim = min((c for c in self.connections if c is not conn and c.evictable),
                         key=lambda c: c.since, default=None)
            if victim is None:
                victim = next(iter(self.parked), None)
        if victim is None or victim.transport is None:
            return False
        self.drop(victim)
        return True

    def cut_slowest(self, conn: HttpConnection, why: str) -> bool:
        """Close the connection sending its body the slowest; False when no other is receiving a body.

        The rate credits every body with ``body_credit`` bytes, so a body that has just begun (a client
        that sent its headers and is sending the rest now) counts as fast, and the one that trickled the
        least over the longest time is the slowest."""
        now = time.monotonic()
        victim = None
        slowest = float("inf")
        # Only the bodies that have taken longest are judged (a slow sender is among them; fast ones have
        # finished): a cut costs the same whether the server holds 50 bodies or 5,000.
        for c in itertools.islice(self.busy, SLOW_CANDIDATES + 1):
            if c is not conn and c.transport is not None:
                rate = c.body_rate(now)
                if rate < slowest:
                    victim, slowest = c, rate
        if victim is None:
            return False
        self.cut_off += 1
        self.drop(victim, 408, f"request body arriving too slowly ({victim.body_rate(now):.0f} bytes/s) while {why}")
        return True


class HttpConnection(asyncio.Protocol):
    def __init__(self, handler: Handler, limits: Limits, state: _State) -> None:
        self.handler = handler
        self.limits = limits
        self.state = state
        self.loop = asyncio.get_running_loop()
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.peer = Peer()
        self.client: object = None  # whose connection this is, for the per-client limit
        self.served = 0  # requests received whole on this connection
        self._headers_done = False
        self.queue: collections.deque[Request] = collections.deque()
        self.task: asyncio.Task[None] | None = None
        self.since = time.monotonic()  # start of the current request, or of idleness (for the sweep)
        self.body_since = 0.0  # when the headers were complete (the body's start), or it was read again
        self._rate_base = 0  # body bytes before body_since
        self.last_body = 0.0  # when body bytes last arrived
        self.closing = False  # no new requests: answer what is queued, then close
        self._finish_current = False
        self._final: Response | None = None  # a protocol-level refusal to send after the queued answers
        self._linger = False  # the refusal's client may still be sending: read and drop it a while (_end)
        self._discard = False  # refused (or cut off mid-request): every later byte is ignored, then it closes
        self._echo_keep_alive = False  # an HTTP/1.0 client asked to keep the connection: tell it it is kept
        self.paused = False  # reading paused by the server: too many requests queued here
        self._hold: Reservation | None = None  # the request memory reserved for the body being received
        self._writable = asyncio.Event()
        self._writable.set()
        self._write_blocked = 0.0  # when writing paused (client not reading), 0 while writable
        self._reset_message()

    def _reset_message(self) -> None:
        self._url: list[bytes] = []
        self._headers: Headers = []
        self._header_bytes = 0  # the target and the headers parsed so far
        self._head_raw = 0  # bytes received while this request's headers were incomplete (see data_received)
        self._continue = False  # 100 Continue owed once the answers before this request are written
        self._body: list[bytes] = []
        self._body_size = 0
        self._allowed = 0  # body bytes the reservation covers
        self._release_hold()
        self._keep_alive = True
        self._in_message = False

    # ---- connection lifecycle ---------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        sock = transport.get_extra_info("socket")
        self.peer = socket_peer(sock)
        self.client = ("uid", self.peer.uid) if self.peer.unix else ("addr", self.peer.address)
        st = self.state
        st.add(self)
        if st.stopping:
            self._refuse(503, "server is stopping")
            return
        if len(st.clients[self.client]) > self.limits.max_client_connections:
            why = f"too many connections from this client (at most {self.limits.max_client_connections})"
            if not st.make_room_within(self, why):
                self._refuse(503, why)
                return
        if len(st.connections) > self.limits.max_connections and not st.room_beyond(self) \
                and not st.evict_for(self):
            self._refuse(503, "too many connections")
            return
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:  # pragma: no cover
                pass

    @property
    def evictable(self) -> bool:
        """Nothing to lose by closing it: no request being answered, none queued, no body under way."""
        return self.task is None and not self.queue and (not self._in_message or not self._headers_done)

    def body_rate(self, now: float) -> float:
        """Body bytes per second since the headers were complete (``body_credit`` included)."""
        return (self._body_size - self._rate_base + self.limits.body_credit) / max(now - self.body_since, 1e-3)

    def resume_body(self) -> None:
        """A parked body is read again, judged from now on."""
        assert self.transport is not None
        self.body_since = self.last_body = time.monotonic()
        self._rate_base = self._body_size
        self.state.make_busy(self)
        self.transport.resume_reading()
        self.paused = False  # reading again, whatever paused it

    def connection_lost(self, exc: Exception | None) -> None:
        self.state.discard(self)
        self.state.unpark(self.limits.max_busy_connections)
        self.closing = True
        self.state.load.pending -= len(self.queue)
        for req in self.queue:
            if req.hold is not None:
                req.hold.release()
        self.queue.clear()
        self._body = []
        self._release_hold()
        self._writable.set()
        self.transport = None

    def pause_writing(self) -> None:
        self._writable.clear()
        self._write_blocked = time.monotonic()

    def resume_writing(self) -> None:
        self._writable.set()
        self._write_blocked = 0.0

    def check_timeouts(self, now: float) -> None:
        """Called by the server's once-a-second sweep (cheaper than a timer per request)."""
        transport = self.transport
        if transport is None:
            return
        limits = self.limits
        if self._write_blocked and now - self._write_blocked > limits.request_timeout_s:
            # An answer waiting for a client that does not read: the connection is held, not used
            # (whatever else it is doing: a next request half sent, a refusal queued, a close under way).
            transport.abort()
        elif self._discard:
            # Refused: it closes once its answers are out (_serve, _end). Should that close never
            # complete (a linger, a write the kernel does not take), it is cut here.
            if self.task is None and now - self.since > max(limits.request_timeout_s, LINGER_S):
                transport.abort()
        elif self._in_message:
            if self.paused or self._continue:
                return  # reading paused, or 100 Continue not yet sent, by the server: the wait is not the client's
            if now - self.since > limits.request_timeout_s:
                self._refuse(408, "request not received in time")
            elif not self._headers_done and now - self.since > limits.header_timeout_s:
                self._refuse(408, "request headers not received in time")
            elif self._headers_done and self not in self.state.parked and \
                    now - self.last_body > limits.body_timeout_s:
                self._refuse(408, f"request body paused for more than {limits.body_timeout_s:g} s")
        elif self.task is None and not self.queue:
            # A connection that never sent a request gets the header deadline, not the keep-alive one.
            idle = limits.keep_alive_s if self.served else limits.header_timeout_s
            if now - self.since > idle:
                transport.close()

    def shutdown(self) -> None:
        """Graceful stop: close now when idle, else after the request in progress is answered."""
        self._finish_current = self._in_message  # a request half received still gets its answer
        self.closing = True
        if self.task is None and (not self._in_message or self._discard) and self.transport is not None:
            self.transport.close()

    def eof_received(self) -> bool | None:
        """The client shut down its sending side: answer what it sent whole, then close."""
        self.closing = True
        if self._in_message:  # cut off mid-request: it can never complete
            self._in_message = False
            self._discard = True
            self.state.unbusy(self)
        if self.task is None and not self.queue:
            return None  # nothing left to answer: let the transport close
        return True  # keep the sending side open; _serve closes after the last answer

    # ---- parsing ----------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self._discard or (self.closing and not self._in_message):
            return
        # httptools keeps a header's value to itself until it is complete: its size is judged here. A chunk
        # that comes while the headers are incomplete and leaves them so is all header bytes (a request that
        # begins in this one resets the count: its first chunk is bounded by the read size).
        head = self._in_message and not self._headers_done
        if head:
            self._head_raw += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # No protocol upgrades here: answer the request as plain HTTP, then close.
            self.closing = True
        except httptools.HttpParserError as e:
            # Bytes after the last request (it said Connection: close) are not read, nor answered.
            if not (self.closing and not self._in_message):
                self._refuse(400, f"malformed HTTP request: {e}")
        if self._in_message and not self._discard:
            if not self._headers_done:
                if head and self._head_raw > self.limits.max_header_bytes:
                    self._refuse(431, "request headers are too large", linger=True)
            elif self not in self.state.busy and self not in self.state.parked:
                self._body_pending()

    def _body_pending(self) -> None:
        """Headers in, body still to come: one more connection holding a slot while a sender takes its time.
        (A request whose body came with its headers never counts.) With every slot taken, a client that
        holds its equal share already waits (parked: not read, until a slot frees); any other takes the
        place of the slowest sender (see :meth:`_State.cut_slowest`)."""
        st = self.state
        if len(st.busy) >= self.limits.max_busy_connections:
            if st.over_share(self):
                if self.transport is not None:
                    self.transport.pause_reading()
                    st.parked[self] = None
                return
            if not st.cut_slowest(self, f"{len(st.busy)} other requests are receiving their bodies"):
                self._refuse(503, f"too many requests are receiving their bodies "
                             f"({self.limits.max_busy_connections}, [http] max_busy_connections); retry")
                return
        st.make_busy(self)

    def on_message_begin(self) -> None:
        if self._discard:
            return  # refused: a request pipelined behind the refusal is not read
        self._reset_message()
        self._in_message = True
        self._headers_done = False
        self.since = time.monotonic()

    def on_url(self, url: bytes) -> None:  # called for each piece of the target as it arrives
        if self._discard:
            return
        self._url.append(url)
        self._header_bytes += len(url)
        if self._header_bytes > self.limits.max_header_bytes:
            self._refuse(414, f"request target is longer than {self.limits.max_header_bytes} bytes", linger=True)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._discard:
            return
        self._headers.append((name.lower(), value))
        self._header_bytes += len(name) + len(value) + 4
        if self._header_bytes > self.limits.max_header_bytes:
            self._refuse(431, "request headers are too large", linger=True)

    def on_headers_complete(self) -> None:
        self._headers_done = True
        if self._discard:
            return
        self._keep_alive = self.parser.should_keep_alive()
        expect = False
        for k, v in self._headers:
            if k == b"content-length":
                try:
                    declared = int(v)
                except ValueError:
                    declared = 0
                if declared > self.limits.max_body:
                    self._too_large()
                    return
                if not self._admit(declared):
                    return
            elif k == b"expect" and v.lower() == b"100-continue":
                expect = True
            elif k == b"connection" and self._keep_alive and self.parser.get_http_version() == "1.0":
                self._echo_keep_alive = True  # asked for with Connection: keep-alive
        if expect and self.transport is not None:
            if self.task is None:
                self.transport.write(_CONTINUE)
            else:
                self._continue = True  # not before the answers to the requests before it (_serve)
        self.body_since = self.last_body = time.monotonic()

    def on_body(self, body: bytes) -> None:
        if self._discard:
            return
        self.last_body = time.monotonic()
        self._body_size += len(body)
        if self._body_size > self.limits.max_body:
            self._too_large()
            return
        if self._body_size > self._allowed and not self._admit(self._body_size):  # no (or a wrong) length
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._in_message = False
        if self in self.state.busy or self in self.state.parked:
            self.state.unbusy(self)
            self.state.unpark(self.limits.max_busy_connections)
        if self._discard or (self.closing and not self._finish_current):
            return
        self._finish_current = False
        self.served += 1
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        method = self.parser.get_method().decode("ascii", "replace")
        load = self.state.load
        self.queue.append(Request(method, b"".join(self._url), self._headers, body, self._keep_alive, self.peer,
                                  load, self._hold))
        load.pending += 1
        self._hold = None  # the request's now: released once it is answered
        self._body = []
        if not self._keep_alive:
            self.closing = True  # read nothing more; this is the last request
        if len(self.queue) >= self.limits.max_pipelined and self.transport is not None and not self.paused:
            self.transport.pause_reading()
            self.paused = True
        if self.task is None:
            self.task = self.loop.create_task(self._serve())

    def _admit(self, size: int) -> bool:
        """Reserve what a body of ``size`` bytes will hold, before it is read; refuse (and close) when it
        does not fit the request memory budget now: the client may retry, nobody else waits."""
        grow = BODY_COPIES * size - BODY_COPIES * self._allowed
        if grow <= 0:
            return True
        try:
            if self._hold is None:
                self._hold = self.state.budget.reserve(grow, "a %d-byte request body", size)
            else:
                self._hold.grow(grow, "a %d-byte request body", size)
        except EdgedError as e:
            self._release_hold()
            overloaded = e.code is ErrorCode.OVERLOADED
            self._refuse(503 if overloaded else 507, str(e), [(b"retry-after", b"1")] if overloaded else [],
                         linger=True)
            return False
        self._allowed = size
        return True

    def _release_hold(self) -> None:
        hold, self._hold = self._hold, None
        if hold is not None:
            hold.release()

    def _too_large(self) -> None:
        self._refuse(413, f"request body is larger than {self.limits.max_body} bytes ([http] max_request_mb)")

    def _refuse(self, status: int, message: str, extra: Headers | None = None, *, linger: bool = False) -> None:
        """Answer an error at the protocol level (after what is already queued) and close.

        ``linger``: the client may still be sending (a body it was told may come, headers past the limit);
        the rest is read and dropped for up to LINGER_S after the answer, so that closing with unread data
        (a TCP reset) does not destroy the answer before the client reads it."""
        if self._discard:
            return  # refused already: that answer was the last
        self._discard = True
        self.closing = True
        self._linger = linger
        self.state.unbusy(self)
        self._body = []
        self._release_hold()
        if self.transport is None:
            return
        st, headers, body = error_response(status, message)
        headers = headers + (extra or [])
        if self.task is None:
            self._write(st, headers, body, close=True)
            self._end()
        else:
            # Requests already queued are answered first; the refusal is the last response here.
            self.transport.pause_reading()
            self._final = (st, headers, body)

    def _end(self) -> None:
        """Close after the last answer; a refusal that lingers shuts down its sending side first and reads
        (and drops) what the client still sends for up to LINGER_S."""
        transport = self.transport
        assert transport is not None
        self.since = time.monotonic()  # closing since: check_timeouts cuts a close that never completes
        if self._linger and transport.can_write_eof():
            self._linger = False
            transport.write_eof()
            transport.resume_reading()
            self.loop.call_later(LINGER_S, transport.close)
        else:
            transport.close()

    # ---- serving ----------------------------------------------------------------------------
    async def _serve(self) -> None:
        try:
            while self.queue:
                req = self.queue.popleft()
                if self.paused and len(self.queue) < self.limits.max_pipelined // 2 and self.transport is not None \
                        and not self.closing and self not in self.state.parked:
                    self.transport.resume_reading()
                    self.paused = False
                    if self._in_message:
                        self._restart_clock()
                try:
                    status, headers, body = await self.handler(req)
                except Exception:  # the handler answers its own errors; this is a last resort
                    log.exception("HTTP handler failed")
                    status, headers, body = error_response(500, "internal error")
                finally:
                    self.state.load.pending -= 1
                    if req.hold is not None:  # the body and what was decoded from it are garbage now
                        req.hold.release()
                if self.transport is None:
                    return
                last = self.closing and not self.queue and self._final is None
                self._write(status, headers, body, close=last, head_only=req.method == "HEAD")
                if not self._writable.is_set():
                    await self._writable.wait()
            if self.transport is not None and (self._final is not None or self._continue):
                self._answers_written()
        finally:
            self.task = None
            # A refused request (_discard) is never completed: the connection closes without it.
            if self.transport is not None and (not self._in_message or self._discard):
                if self.closing:
                    self._end()
                else:
                    self.since = time.monotonic()

    def _answers_written(self) -> None:
        """Every queued request is answered: a refusal held back goes out now, or the 100 Continue of the
        request in progress (its turn now)."""
        assert self.transport is not None
        if self._final is not None:
            final, self._final = self._final, None
            self._write(*final, close=True)
        elif self._continue and self._in_message:
            self._continue = False
            self.transport.write(_CONTINUE)
            self._restart_clock()

    def _restart_clock(self) -> None:
        """The request in progress waited for the server (reading paused, 100 Continue held back): it is
        timed, and its body's rate judged, from now."""
        self.since = self.last_body = self.body_since = time.monotonic()
        self._rate_base = self._body_size

    def _write(self, status: int, headers: Headers, body: bytes, *, close: bool, head_only: bool = False) -> None:
        assert self.transport is not None
        head = render_head(status, headers, len(body), close, self._echo_keep_alive)
        if head_only or not body:
            self.transport.write(head)
        elif len(body) <= _ONE_WRITE:
            self.transport.write(head + body)
        else:
            self.transport.write(head)
            self.transport.write(body)


class HttpServer:
    """Serves ``handler`` on an already bound, listening socket."""

    def __init__(self, handler: Handler, limits: Limits | None = None, budget: MemoryBudget | None = None) -> None:
        """``budget``: the daemon's request memory budget; bodies are admitted against it as they are announced."""
        self.handler = handler
        self.limits = limits or Limits()
        self._state = _State(budget or MemoryBudget.unlimited())
        self._server: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.TimerHandle | None = None

    async def start(self, sock: socket.socket, backlog: int = 512) -> None:
        loop = asyncio.get_running_loop()
        self._state.stopping = False
        self._server = await loop.create_server(
            lambda: HttpConnection(self.handler, self.limits, self._state), sock=sock, backlog=backlog)
        self._sweep()

    def _sweep(self) -> None:
        now = time.monotonic()
        for conn in list(self._state.connections):
            conn.check_timeouts(now)
        interval = min(1.0, self.limits.keep_alive_s / 2, self.limits.request_timeout_s / 2,
                       self.limits.header_timeout_s / 2, self.limits.body_timeout_s / 2)
        self._sweeper = asyncio.get_running_loop().call_later(interval, self._sweep)

    @property
    def connections(self) -> int:
        return len(self._state.connections)

    async def stop(self, timeout: float) -> None:
        """Stop accepting, let in-flight requests finish (up to ``timeout``), then close everything."""
        self._state.stopping = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        if self._server is not None:
            self._server.close()
        for conn in list(self._state.connections):
            conn.shutdown()
        deadline = time.monotonic() + timeout
        while self._state.connections and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for conn in list(self._state.connections):
            if conn.transport is not None:
                conn.transport.abort()
            if conn.task is not None:
                conn.task.cancel()
        self._state.connections.clear()
        self._state.clients.clear()
        self._state.busy.clear()
        self._state.busy_by_client.clear()
        self._state.parked.clear()
        self._server = None
