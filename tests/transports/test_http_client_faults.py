"""edged's HTTP client against scripted servers: what a daemon that closes, stalls or answers badly must
not make it do (send a request twice, wait past its timeout, hand one request's answer to the next)."""

from __future__ import annotations

import select
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType

import orjson
import pytest

from edged.client.http import HttpClient, decode_response
from edged.errors import EdgedError, ErrorCode
from tests.polling import wait_until

pytestmark = pytest.mark.timeout(60)

OK_EMPTY = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"


def ok(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


def read_request(conn: socket.socket, buf: bytearray) -> bytes | None:
    """One request's head line (and its body consumed), or None when the client closed."""
    while b"\r\n\r\n" not in buf:
        data = conn.recv(65536)
        if not data:
            return None
        buf += data
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(rest) < length:
        data = conn.recv(65536)
        if not data:
            return None
        rest += data
    buf[:] = rest[length:]
    return head.split(b"\r\n")[0]


class Scripted:
    """A TCP server running ``script(conn, n)`` for its n-th connection; it records the request lines seen."""

    def __init__(self, script: Callable[[socket.socket, int, Scripted], None]) -> None:
        self.script = script
        self.requests: list[bytes] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def read(self, conn: socket.socket, buf: bytearray) -> bytes | None:
        line = read_request(conn, buf)
        if line is not None:
            self.requests.append(line)
        return line

    def _serve(self) -> None:
        n = 0
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                try:
                    self.script(conn, n, self)
                except OSError:
                    pass
            n += 1

    def close(self) -> None:
        self.listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
        self.listener.close()
        self.thread.join(10)


@pytest.fixture
def scripted() -> Iterator[Callable[[Callable[[socket.socket, int, Scripted], None]], Scripted]]:
    made: list[Scripted] = []

    def make(script: Callable[[socket.socket, int, Scripted], None]) -> Scripted:
        made.append(Scripted(script))
        return made[-1]
    yield make
    for s in made:
        s.close()


def second_taken_unanswered(answer: bytes) -> Callable[[socket.socket, int, Scripted], None]:
    """A script: the first connection answers one request (keep-alive, so the client reuses it), reads the
    next one whole and closes unanswered; every later connection answers each request with ``answer``."""
    def script(conn: socket.socket, n: int, srv: Scripted) -> None:
        buf = bytearray()
        if n == 0:
            srv.read(conn, buf)
            conn.sendall(OK_EMPTY)
            srv.read(conn, buf)
            return
        while srv.read(conn, buf) is not None:
            conn.sendall(answer)
    return script


def test_a_post_the_server_took_is_not_sent_again(scripted: Callable[..., Scripted]) -> None:
    """The daemon read the whole POST and closed without answering (it crashed, or stopped): the client
    cannot know whether it acted, so it must not send it again on a fresh connection."""
    srv = scripted(second_taken_unanswered(OK_EMPTY))
    with HttpClient(srv.url, timeout=10) as c:
        assert c.live()
        with pytest.raises(EdgedError) as e:
            c.request("POST", "/v2/repository/models/m/load")
    assert e.value.code is ErrorCode.UNAVAILABLE
    assert srv.requests.count(b"POST /v2/repository/models/m/load HTTP/1.1") == 1, srv.requests


def test_a_get_on_a_connection_closed_unanswered_is_sent_again(scripted: Callable[..., Scripted]) -> None:
    srv = scripted(second_taken_unanswered(ok(b'{"name":"edged"}')))
    with HttpClient(srv.url, timeout=10) as c:
        assert c.live()
        assert c.server_metadata() == {"name": "edged"}
    assert srv.requests.count(b"GET /v2 HTTP/1.1") == 2


def test_an_idle_connection_the_server_closed_is_replaced_before_a_post(scripted: Callable[..., Scripted]) -> None:
    """The daemon closes idle connections: a POST after that goes out on a fresh connection, once."""
    closed = threading.Event()

    def script(conn: socket.socket, n: int, srv: Scripted) -> None:
        buf = bytearray()
        if n == 0:
            srv.read(conn, buf)
            conn.sendall(OK_EMPTY)
            conn.shutdown(socket.SHUT_RDWR)
            closed.set()
            return
        while srv.read(conn, buf) is not None:
            conn.sendall(OK_EMPTY)

    srv = scripted(script)
    with HttpClient(srv.url, timeout=10) as c:
        assert c.live()
        assert closed.wait(10)
        sock = c._sock
        assert sock is not None
        wait_until(lambda: select.select([sock], [], [], 0)[0], 10, what="the server's FIN to arrive")
        assert c.request("POST", "/v2/repository/models/m/load").status == 200
    assert srv.requests.count(b"POST /v2/repository/models/m/load HTTP/1.1") == 1


def test_a_server_that_trickles_its_answer_does_not_outlast_the_timeout(scripted: Callable[..., Scripted]) -> None:
    """``timeout`` bounds the whole answer, not each read: a byte every 0.1 s must not keep a client
    with a 0.5 s timeout waiting (here: 12 s) for its answer."""
    answer = ok(b"").replace(b"\r\n\r\n", b"\r\nX-Pad: " + b"a" * 120 + b"\r\n\r\n")

    def script(conn: socket.socket, n: int, srv: Scripted) -> None:
        srv.read(conn, bytearray())
        for i in range(len(answer)):
            conn.sendall(answer[i:i + 1])
            time.sleep(0.1)  # sleep-ok: a server that answers slowly is the behaviour under test

    srv = scripted(script)
    with HttpClient(srv.url, timeout=0.5) as c, pytest.raises(EdgedError) as e:
        c.live()
    assert e.value.code is ErrorCode.DEADLINE_EXCEEDED


class InterruptedByTestError(Exception):
    pass


def test_an_interrupted_request_does_not_leave_its_answer_to_the_next(scripted: Callable[..., Scripted]) -> None:
    """A signal (Ctrl-C, an alarm) interrupts a request while it waits for its answer: the next request on
    the same client must get its own answer, not the one the first request left behind."""
    main = threading.get_ident()

    def script(conn: socket.socket, n: int, srv: Scripted) -> None:
        buf = bytearray()
        if n == 0:
            srv.read(conn, buf)
            signal.pthread_kill(main, signal.SIGUSR1)  # the client is interrupted while it waits
            if srv.read(conn, buf) is None:  # (the client closed this connection: nothing to answer)
                return
            conn.sendall(ok(b'{"name":"first"}'))  # the late answer to the interrupted request
        while srv.read(conn, buf) is not None:
            conn.sendall(ok(b'{"name":"second"}'))

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise InterruptedByTestError

    previous = signal.signal(signal.SIGUSR1, interrupt)
    try:
        srv = scripted(script)
        with HttpClient(srv.url, timeout=10) as c:
            with pytest.raises(InterruptedByTestError):
                c.server_metadata()
            assert c.server_metadata() == {"name": "second"}
    finally:
        signal.signal(signal.SIGUSR1, previous)


@pytest.mark.parametrize("output", [
    {"name": "s", "datatype": "BYTES", "shape": [2], "parameters": {"binary_data_size": 6}},  # ends early
    {"name": "s", "datatype": "BF17", "shape": [1], "parameters": {"binary_data_size": 2}},  # unknown type
], ids=["truncated-bytes", "unknown-datatype"])
def test_a_malformed_answer_is_the_servers_fault_not_the_callers(output: dict[str, object]) -> None:
    """An answer the client cannot decode is INTERNAL (the server's fault), never INVALID_ARGUMENT,
    which says the caller's request was wrong."""
    header = orjson.dumps({"outputs": [output]})
    body = header + b"\x05\x00\x00\x00ab"
    with pytest.raises(EdgedError) as e:
        decode_response(body, str(len(header)))
    assert e.value.code is ErrorCode.INTERNAL
