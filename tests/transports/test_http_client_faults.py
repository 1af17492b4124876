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
from typing import Any

import numpy as np
import orjson
import pytest

from edged.client.http import HttpClient, decode_response
from edged.errors import EdgedError, ErrorCode
from tests.polling import wait_until

pytestmark = pytest.mark.timeout(60)

OK_EMPTY = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"


def ok(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


def read_request(conn: socket.socket, buf: bytearray, whole: list[bytes] | None = None) -> bytes | None:
    """One request's head line (and its body consumed; the request whole appended to ``whole``), or None
    when the client closed."""
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
    if whole is not None:
        whole.append(head + b"\r\n\r\n" + rest[:length])
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


def _binary_answer(header: dict[str, object], tail: bytes) -> bytes:
    h = orjson.dumps(header)
    return (b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nInference-Header-Content-Length: %d\r\n\r\n"
            % (len(h) + len(tail), len(h))) + h + tail


def test_a_repeated_request_reuses_its_head_yet_each_call_sends_and_reads_its_own_tensors(
    scripted: Callable[..., Scripted],
) -> None:
    """infer() keeps the head and JSON header of a request it sent, and the layout of an answer it read:
    the next such call sends the very same head with its own tensor bytes, and reads its own answer's
    bytes; an answer whose tail is shorter than its (known) header says is refused, typed."""
    header = {"model_name": "m", "model_version": "1",
              "outputs": [{"name": "y", "datatype": "FP32", "shape": [1, 4], "parameters": {"binary_data_size": 16}}]}
    answers = [np.arange(4, dtype=np.float32).reshape(1, 4) * k for k in (1, 2, 3)]
    seen: list[bytes] = []

    def script(conn: socket.socket, n: int, srv: Scripted) -> None:
        buf = bytearray()
        for a in answers:
            if read_request(conn, buf, seen) is None:
                return
            conn.sendall(_binary_answer(header, a.tobytes()))
        if read_request(conn, buf, seen) is not None:
            conn.sendall(_binary_answer(header, answers[0].tobytes()[:8]))  # the header's 16 bytes, 8 sent

    srv = scripted(script)
    xs = [np.full((1, 3), k, dtype=np.float32) for k in (7, 8, 9)]
    with HttpClient(srv.url, timeout=10) as c:
        for x, a in zip(xs, answers, strict=True):
            np.testing.assert_array_equal(c.infer("m", {"x": x})["y"], a)
        with pytest.raises(EdgedError) as e:
            c.infer("m", {"x": xs[0]})
    assert e.value.code is ErrorCode.INTERNAL
    heads = {r[:-12] for r in seen}
    assert len(heads) == 1, heads  # one head and JSON header for all four
    assert [r[-12:] for r in seen] == [x.tobytes() for x in [*xs, xs[0]]]


def _json_header(request: bytes) -> dict[str, Any]:
    head, _, body = request.partition(b"\r\n\r\n")
    (hlen,) = [int(v) for k, _, v in (ln.partition(b":") for ln in head.split(b"\r\n")[1:])
               if k.lower() == b"inference-header-content-length"]
    out: dict[str, Any] = orjson.loads(body[:hlen])
    return out


def test_requests_of_other_shapes_or_objects_are_encoded_for_what_they_are(scripted: Callable[..., Scripted]) -> None:
    """A kept head is for its shapes, dtypes and outputs only: another shape gets its own, and BYTES inputs
    (whose length depends on their contents) are never kept."""
    header = {"model_name": "m", "outputs": []}
    seen: list[bytes] = []

    def script(conn: socket.socket, n: int, srv: Scripted) -> None:
        buf = bytearray()
        while read_request(conn, buf, seen) is not None:
            conn.sendall(_binary_answer(header, b""))

    srv = scripted(script)
    with HttpClient(srv.url, timeout=10) as c:
        c.infer("m", {"x": np.zeros((1, 3), np.float32)})
        c.infer("m", {"x": np.zeros((2, 3), np.float32)})
        c.infer("m", {"x": np.zeros((2, 3), np.float32)}, outputs=["y"])
        c.infer("m", {"s": np.array([b"ab"], dtype=object)})
        c.infer("m", {"s": np.array([b"abcd"], dtype=object)})
    bodies = [_json_header(r) for r in seen]
    assert [b["inputs"][0]["shape"] for b in bodies] == [[1, 3], [2, 3], [2, 3], [1], [1]]
    assert [b["inputs"][0]["parameters"]["binary_data_size"] for b in bodies] == [12, 24, 24, 6, 8]
    assert b'"outputs"' in seen[2] and b'"outputs"' not in seen[1]
