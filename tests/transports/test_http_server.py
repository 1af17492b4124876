"""The HTTP/1.1 server (edged/transports/http/server.py) on raw sockets: refusals that end a connection,
pipelining, header limits, and connections that must not outlive the server's books.

Each test runs a real HttpServer on an event loop in a background thread with a small handler; where a
request must still be "in progress", the handler waits on a gate the test opens. Every loop error (a
protocol callback that raised) fails the test.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import pytest

from edged.membudget import MemoryBudget
from edged.transports.http.server import HttpConnection, HttpServer, Limits, Request, Response
from tests.polling import wait_until

pytestmark = pytest.mark.timeout(60)
T = TypeVar("T")


class Gate:
    """An asyncio.Event on the server's loop that a test thread opens."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.event = asyncio.Event()

    async def wait(self) -> None:
        await self.event.wait()

    def open(self) -> None:
        self.loop.call_soon_threadsafe(self.event.set)


class Bg:
    """An HttpServer serving ``handler`` on its own loop in a thread; ``errors``: what the loop's exception
    handler was given (a protocol callback that raised, for one)."""

    def __init__(self, handler: Callable[[Request], Any], limits: Limits | None = None,
                 budget: MemoryBudget | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        self.errors: list[dict[str, Any]] = []
        self.loop.set_exception_handler(lambda _loop, ctx: self.errors.append(ctx))
        self.thread = threading.Thread(target=self.loop.run_forever, name="http-server-test", daemon=True)
        self.thread.start()
        self.gate = Gate(self.loop)
        self.server = HttpServer(handler, limits or Limits(), budget)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.setblocking(False)
        self.port = sock.getsockname()[1]
        self.run(self.server.start(sock))

    def run(self, coro: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the server's loop (its state is only consistent there)."""
        async def on_loop() -> T:
            return fn()
        result: T = self.run(on_loop())
        return result

    def conns(self) -> list[HttpConnection]:
        return self.call(lambda: list(self.server._state.connections))

    def connect(self, source: str = "127.0.0.1") -> socket.socket:
        s = socket.socket()
        s.settimeout(10)
        s.bind((source, 0))
        s.connect(("127.0.0.1", self.port))
        return s

    def close(self) -> None:
        try:
            self.run(self.server.stop(1))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


@contextmanager
def server(handler: Callable[[Request], Any], limits: Limits | None = None,
           budget: MemoryBudget | None = None) -> Iterator[Bg]:
    bg = Bg(handler, limits, budget)
    try:
        yield bg
    finally:
        bg.close()
    assert not bg.errors, bg.errors


def read_to_eof(s: socket.socket) -> bytes:
    """Everything until the server closes (EOF or reset); a socket still open after its timeout fails."""
    data = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return data
        except TimeoutError:
            raise AssertionError(f"the server did not close the connection; got {data[:600]!r}") from None
        if not chunk:
            return data
        data += chunk


def responses(data: bytes) -> list[tuple[int, dict[bytes, bytes], bytes]]:
    """The complete responses at the start of ``data`` (interim 100 Continue included), in order; every
    answer of this server has a Content-Length."""
    out: list[tuple[int, dict[bytes, bytes], bytes]] = []
    while (end := data.find(b"\r\n\r\n")) >= 0:
        lines = data[:end].split(b"\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(b":") for line in lines[1:])}
        length = int(headers.get(b"content-length", b"0"))
        if len(data) < end + 4 + length:
            break
        out.append((int(lines[0].split()[1]), headers, data[end + 4:end + 4 + length]))
        data = data[end + 4 + length:]
    return out


def read_responses(s: socket.socket, count: int) -> list[tuple[int, dict[bytes, bytes], bytes]]:
    data = b""
    while len(got := responses(data)) < count:
        chunk = s.recv(65536)
        assert chunk, f"closed after {got}"
        data += chunk
    return got


def answered(s: socket.socket) -> bool:
    """Whether the server said something (or closed), without waiting."""
    timeout = s.gettimeout()
    s.setblocking(False)  # with a timeout set, recv waits for data whatever its flags
    try:
        s.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return False
    except OSError:
        return True  # reset
    finally:
        s.settimeout(timeout)
    return True


async def echo(req: Request) -> Response:
    return 200, [(b"content-type", b"text/plain")], b"ok " + req.path


@contextmanager
def held_echo(path: bytes, limits: Limits | None = None) -> Iterator[Bg]:
    """A server answering as :func:`echo`, except that a request for ``path`` waits for ``bg.gate``."""
    async def handler(req: Request) -> Response:
        if req.path == path:
            await bg.gate.wait()
        return await echo(req)

    with server(handler, limits) as bg:
        yield bg


# ---- a refusal after queued answers ends the connection ---------------------------------------------
def test_a_refusal_behind_an_answer_in_progress_closes_the_connection_after_it() -> None:
    """A pipelined request refused (413) while the one before it is being answered: the answer, then the
    refusal with 'connection: close', then the server closes (it used to keep the socket for ever)."""
    with held_echo(b"/slow", Limits(max_body=1000)) as bg:
        s = bg.connect()
        s.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n"
                  b"POST /big HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n" + b"x" * 100)
        wait_until(lambda: any(c._discard for c in bg.conns()), 10, what="the 413 to be decided")
        bg.gate.open()
        got = responses(read_to_eof(s))
        s.close()
        assert [g[0] for g in got] == [200, 413]
        assert got[1][1][b"connection"] == b"close" and b"connection" not in got[0][1]
        wait_until(lambda: bg.server.connections == 0, 10, what="the server to forget the connection")


def test_a_client_that_does_not_read_is_dropped_with_a_request_half_sent() -> None:
    """The non-reader defence holds while the next request is half received (it skipped the check)."""
    answered: list[bytes] = []

    async def big(req: Request) -> Response:
        answered.append(req.path)
        return 200, [(b"content-type", b"application/octet-stream")], b"x" * (32 << 20)

    with server(big, Limits(request_timeout_s=0.5, write_high_water=64 * 1024)) as bg:
        s = bg.connect()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\nGET /next HTT")
        wait_until(lambda: answered, 10, what="the first request to be answered")
        wait_until(lambda: bg.server.connections == 0, 15, what="the non-reading client to be dropped")
        s.close()


def test_a_cut_off_slow_sender_with_an_answer_in_progress_is_closed() -> None:
    """Cut off to make room for another client's body while its earlier request is still being answered:
    the socket is closed, not left open off the server's books (and out of stop()'s reach)."""
    with held_echo(b"/held", Limits(max_busy_connections=1)) as bg:
        a = bg.connect()
        a.sendall(b"GET /held HTTP/1.1\r\nHost: x\r\n\r\nPOST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nx")
        wait_until(lambda: len(bg.call(lambda: bg.server._state.busy)) == 1, 10, what="A's body to take the slot")
        b = bg.connect("127.0.0.2")  # another client: it takes the slot of the slowest sender
        b.sendall(b"POST /b HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n12345")
        wait_until(lambda: bg.server._state.cut_off == 1, 10, what="A to be cut off")
        read_to_eof(a)  # closed while its answer was still being computed
        a.close()
        b.sendall(b"67890")
        (status, _, body), = read_responses(b, 1)
        assert (status, body) == (200, b"ok /b")
        assert bg.server.connections == 1
        bg.gate.open()
        b.close()


# ---- pipelining: the server's own waits are not the client's ----------------------------------------
def test_a_request_cut_by_the_pipelining_pause_is_not_timed_out() -> None:
    """Reading paused because requests queued up: the request whose headers the pause cut is not refused
    408 by the sweep, and is answered once reading resumes."""
    with held_echo(b"/1", Limits(max_pipelined=2)) as bg:
        s = bg.connect()
        third = b"GET /3 HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * 200 + b"\r\n\r\n"
        s.sendall(b"GET /1 HTTP/1.1\r\nHost: x\r\n\r\nGET /2 HTTP/1.1\r\nHost: x\r\n\r\n" + third[:20])
        (conn,) = wait_until(lambda: [c for c in bg.conns() if c.paused and c._in_message], 10,
                             what="reading to pause with request 3 begun")
        s.sendall(third[20:])  # waits in the kernel while reading is paused
        # The sweep, long after every deadline (called directly: no waiting for the clock).
        bg.call(lambda: conn.check_timeouts(time.monotonic() + 1000))
        assert not conn._discard
        bg.gate.open()
        got = read_responses(s, 3)
        assert [(g[0], g[2]) for g in got] == [(200, b"ok /1"), (200, b"ok /2"), (200, b"ok /3")]
        s.close()


def test_100_continue_waits_for_the_answers_before_it() -> None:
    """Expect: 100-continue on a pipelined request: the interim answer comes after the final answer of the
    request before it (a client reads the first answer on the wire as the first request's)."""
    with held_echo(b"/slow") as bg:
        s = bg.connect()
        s.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n"
                  b"POST /second HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 4\r\n\r\n")
        wait_until(lambda: any(c._in_message and c._headers_done for c in bg.conns()), 10,
                   what="the second request's headers to be parsed")
        assert not answered(s)  # nothing yet: the first request is still being answered
        bg.gate.open()
        got = read_responses(s, 2)
        s.sendall(b"body")
        got += read_responses(s, 1)
        assert [(g[0], g[2]) for g in got] == [(200, b"ok /slow"), (100, b""), (200, b"ok /second")]
        s.close()


# ---- header limits while the headers arrive ------------------------------------------------------------
@pytest.mark.parametrize(("start", "status"), [(b"GET /", 414), (b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: ", 431)],
                         ids=["target", "header-value"])
def test_an_endless_target_or_header_value_is_refused_while_it_arrives(start: bytes, status: int) -> None:
    """The header limit holds for a target or one header value still arriving (httptools keeps a value to
    itself until it ends): refused once past it, not read into memory without bound."""
    with server(echo, Limits(max_header_bytes=4096)) as bg:
        s = bg.connect()
        s.sendall(start)
        sent = 0
        try:
            while sent < 4 << 20 and not answered(s):
                s.sendall(b"a" * 16384)
                sent += 16384
        except OSError:
            pass  # the server stopped reading; its answer is read below
        data = read_to_eof(s)
        s.close()
        assert data.startswith(b"HTTP/1.1 %d" % status), (sent, data[:200])
        assert sent < 4 << 20, "the server read 4 MiB of a single header"


def test_headers_split_across_reads_with_a_body_behind_them_are_not_too_large() -> None:
    """The bytes of a read that completes the headers are not all header bytes: a body in the same read
    does not count against the header limit."""
    async def size(req: Request) -> Response:
        return 200, [], str(len(req.body)).encode()

    with server(size, Limits(max_header_bytes=4096)) as bg:
        s = bg.connect()
        s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Le")
        wait_until(lambda: any(c._in_message for c in bg.conns()), 10, what="the request to begin")
        s.sendall(b"ngth: 200000\r\n\r\n" + b"b" * 200000)
        (status, _, body), = read_responses(s, 1)
        assert (status, body) == (200, b"200000")
        s.close()


# ---- refusals and what follows them ----------------------------------------------------------------------
@pytest.mark.parametrize("second", [b"Content-Length: 10000\r\n\r\n",
                                    b"Expect: 100-continue\r\nContent-Length: 1\r\n\r\n"],
                         ids=["body", "expect-continue"])
def test_a_request_behind_a_budget_refusal_is_not_read(second: bytes) -> None:
    """Refused for the memory budget (answered, sending side shut): a request pipelined behind it in the
    same read is ignored, not parsed as live (it wrote after write_eof and broke data_received)."""
    with server(echo, budget=MemoryBudget(4096)) as bg:
        s = bg.connect()
        s.sendall(b"POST /1 HTTP/1.1\r\nHost: x\r\nContent-Length: 10000\r\n\r\n" + b"x" * 10000
                  + b"POST /2 HTTP/1.1\r\nHost: x\r\n" + second)
        got = responses(read_to_eof(s))
        s.close()
        assert [g[0] for g in got] == [507]
        wait_until(lambda: bg.server.connections == 0, 10, what="the refused connection to close")
        assert bg.server._state.budget.used == 0


def test_bytes_after_a_connection_close_request_are_ignored() -> None:
    """'Connection: close' makes a request the last: what follows it is neither read nor answered (no 400),
    and its answer says the connection closes."""
    with server(echo) as bg:
        for extra in (b"GET /2 HTTP/1.1\r\nHost: x\r\n\r\n", b"GET /2 HTT"):
            s = bg.connect()
            s.sendall(b"GET /1 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" + extra)
            got = responses(read_to_eof(s))
            s.close()
            assert [(g[0], g[2]) for g in got] == [(200, b"ok /1")], got
            assert got[0][1][b"connection"] == b"close"


def test_http10_keep_alive_is_confirmed() -> None:
    """An HTTP/1.0 client keeps its connection only when the answer says 'Connection: keep-alive'."""
    with server(echo) as bg:
        s = bg.connect()
        for path in (b"/1", b"/2"):
            s.sendall(b"GET %s HTTP/1.0\r\nConnection: keep-alive\r\n\r\n" % path)
            (status, headers, body), = read_responses(s, 1)
            assert (status, body, headers.get(b"connection")) == (200, b"ok " + path, b"keep-alive")
        s.sendall(b"GET /3 HTTP/1.0\r\n\r\n")
        (status, headers, _), = responses(read_to_eof(s))
        assert (status, headers[b"connection"]) == (200, b"close")
        s.close()
