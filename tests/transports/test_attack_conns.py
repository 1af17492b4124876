"""Issue 36, attacks 6 and 7, against a real ``edged run``: connections as the scarce resource.

6. Slow-body connections spread over 20 loopback addresses (127.0.0.x): a per-address budget
   does not see them, so the server's fairness must judge connections, not addresses.
7. Idle gRPC connections by the hundred: without a cap they took every descriptor, and HTTP
   health checks and shared-memory clients could no longer be accepted.

The default run scales the attacks down with the caps configured small to match (a few seconds
each); the full-size variants (``-m slow``) use the defaults. Rates and latencies are measured in
``bench/attack_conns.py``, not asserted here: the assertions count answered requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import os
import resource
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import orjson
import pytest

from edged.client.grpc import GrpcClient
from edged.errors import EdgedError, ErrorCode
from tests.edged_process import edged_run, http_ok
from tests.http_helpers import copy_models
from tests.mqtt_helpers import DIGIT
from tests.netutil import free_port
from tests.polling import wait_until, wait_until_async

pytestmark = pytest.mark.timeout(240)

BODY = orjson.dumps({"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1, 64], "data": DIGIT}]})


@dataclass
class Daemon:
    proc: subprocess.Popen[bytes]
    http_port: int
    grpc_port: int
    shm_socket: Path
    log: Path

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))


def _raise_own_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


@contextlib.contextmanager
def edged_daemon(tmp: Path, extra: str = "", *, http_lines: str = "", nofile: int | None = None) -> Iterator[Daemon]:
    """``edged run`` with HTTP, gRPC and shm on; ``http_lines``: more [http] lines, ``extra``: more sections;
    ``nofile``: its RLIMIT_NOFILE (soft and hard)."""
    http_port, grpc_port = free_port(), free_port()
    models = copy_models(tmp / "models", "digits")
    shm_socket = tmp / "run" / "edged.sock"
    cfg = tmp / "edged.toml"
    cfg.write_text(f"""
[device]
id = "attack-conns"
state_dir = "{tmp / 'state'}"
runtime_dir = "{tmp / 'run'}"
model_repository = "{models}"
profile = "generic"
[mqtt]
enabled = false
[telemetry]
enabled = false
[http]
listen = "127.0.0.1:{http_port}"
{http_lines}
[grpc]
listen = "127.0.0.1:{grpc_port}"
""" + extra)
    log = tmp / "edged.log"
    limit = [] if nofile is None else ["prlimit", f"--nofile={nofile}:{nofile}", "--"]
    with edged_run(cfg, log, lambda: http_ok(http_port, "/v2/models/digits/ready"), timeout=90,
                   transient=(OSError,), prefix=limit) as proc:
        yield Daemon(proc, http_port, grpc_port, shm_socket, log)


REFUSALS: list[bytes] = []  # what refused requests were told (the first few, for the failure message)


def one_request(port: int, path: str = "/v2/models/digits/infer", body: bytes | None = BODY,
                timeout: float = 5) -> int:
    """A well-behaved client's request on a new connection: the status, or 0 when it got none."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("POST" if body is not None else "GET", path, body=body,
                  headers={"Content-Type": "application/json", "Connection": "close"})
        r = c.getresponse()
        text = r.read()
        if r.status != 200 and len(REFUSALS) < 5:
            REFUSALS.append(text[:200])
        return r.status
    except OSError:
        return 0
    finally:
        c.close()


@dataclass
class SlowBodies:
    """Connections that send headers announcing a large body, then a byte every ``interval`` s, from
    ``addresses`` loopback addresses; a connection that is closed is opened again at once."""

    port: int
    count: int
    addresses: int = 20
    interval: float = 0.5
    opened: int = 0
    cut: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> SlowBodies:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="slow-bodies", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(30)

    async def _main(self) -> None:
        tasks = [asyncio.create_task(self._one(i)) for i in range(self.count)]
        await asyncio.to_thread(self._stop.wait)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _one(self, i: int) -> None:
        source = f"127.0.0.{10 + i % self.addresses}"
        head = (b"POST /v2/models/digits/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 10000000\r\n\r\n{")
        while not self._stop.is_set():
            writer = None
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", self.port, local_addr=(source, 0))
                self.opened += 1
                writer.write(head)
                while not self._stop.is_set():
                    await asyncio.sleep(self.interval)  # sleep-ok: a slow body, one byte per interval
                    if reader.at_eof() or writer.is_closing() or writer.transport.is_closing():
                        break  # the server closed it (connection_lost closes our transport)
                    writer.write(b" ")
                    await writer.drain()
            except (OSError, asyncio.IncompleteReadError):
                pass
            finally:
                if writer is not None:
                    writer.close()
            self.cut += 1
            await asyncio.sleep(0.05)  # sleep-ok: the attacker's pause before it reconnects


def _victim(port: int, seconds: float) -> tuple[int, int, list[int]]:
    ok = tried = 0
    statuses = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        status = one_request(port)
        tried += 1
        ok += status == 200
        if status != 200:
            statuses.append(status)
    return ok, tried, statuses[:10]


def _slow_body_attack(tmp: Path, http_lines: str, count: int, seconds: float, ramp: float = 2.0) -> None:
    _raise_own_limit()
    with edged_daemon(tmp, http_lines=http_lines) as d:
        base_ok, base_tried, _ = _victim(d.http_port, 1.0)
        assert base_ok == base_tried > 0
        with SlowBodies(d.http_port, count) as attack:
            wait_until(lambda: attack.opened >= count, ramp + 30, what=f"{count} attacker connections opened")
            ok, tried, bad = _victim(d.http_port, seconds)
            health = one_request(d.http_port, "/v2/health/live", None)
            opened = attack.opened
        print(f"victim alone {base_tried} requests in 1 s; under {count} slow bodies over 20 addresses "
              f"({opened} connections opened): {ok}/{tried} answered; statuses {bad}; said {REFUSALS}")
        assert opened >= count, "the attack did not get going"
        assert health == 200
        assert tried > 0 and ok >= 0.9 * tried, f"victim answered {ok}/{tried}, e.g. {bad}"


def test_slow_bodies_over_many_addresses_do_not_starve_a_client(tmp_path: Path) -> None:
    """Attack 6, scaled: 300 slow-body connections over 20 addresses against 100 connection slots."""
    _slow_body_attack(tmp_path, "max_connections = 100\nmax_busy_connections = 50", 300, 2.5, ramp=1.5)


@pytest.mark.slow
def test_slow_bodies_full_size(tmp_path: Path) -> None:
    """Attack 6 as reported: 1,200 slow-body connections over 20 addresses, default caps."""
    _slow_body_attack(tmp_path, "", 1200, 15.0)


def test_a_paused_body_is_cut_off(tmp_path: Path) -> None:
    """Body read timeout: a body that stops arriving gets 408 after [http] body_timeout_s, not 60 s."""
    with edged_daemon(tmp_path, http_lines="body_timeout_s = 1") as d:
        s = socket.create_connection(("127.0.0.1", d.http_port), timeout=10)
        s.sendall(b"POST /v2/models/digits/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"in")
        t0 = time.monotonic()
        data = s.recv(4096)
        waited = time.monotonic() - t0
        s.close()
        assert data.startswith(b"HTTP/1.1 408"), data[:200]
        assert b"paused" in data
        assert waited < 8, f"cut off after {waited:.1f} s"


def test_a_body_over_its_clients_share_waits_and_is_then_read(tmp_path: Path) -> None:
    """A client holding its share of busy slots: its next body is parked (not read, not refused) and
    read once a slot frees; every request is answered."""
    from tests.http_helpers import served

    repo = copy_models(tmp_path / "models", "digits")
    with served(repo, tmp_path, extra="max_busy_connections = 2\n") as srv:
        port = int(srv.url.rsplit(":", 1)[1])
        head = b"POST /v2/models/digits/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(BODY)
        half = len(BODY) // 2
        socks = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(3)]
        state = srv.transport._server._state  # type: ignore[union-attr]
        for i, s in enumerate(socks):  # one at a time, in this order
            s.sendall(head + BODY[:half])
            wait_until(lambda n=i + 1: len(state.busy) + len(state.parked) == n, 10, 0.01, f"body {i + 1} taken in")
        assert (len(state.busy), len(state.parked)) == (2, 1)
        socks[2].sendall(BODY[half:])  # waits unread in the kernel
        time.sleep(0.2)  # sleep-ok: time the server must not use to read the parked body
        assert len(state.parked) == 1
        for s in socks[:2]:
            s.sendall(BODY[half:])
        answers = [s.recv(65536) for s in socks]
        assert all(a.startswith(b"HTTP/1.1 200") for a in answers), [a[:60] for a in answers]
        for s in socks:
            s.close()


# ---- attack 7: idle gRPC connections ------------------------------------------------------------------
HOLDER = """
import resource, socket, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
port, n = int(sys.argv[1]), int(sys.argv[2])
held = []
for _ in range(n):
    try:
        held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
    except OSError:
        pass
print(len(held), flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def idle_connections(port: int, count: int, per_process: int = 9_000) -> Iterator[int]:
    """``count`` idle TCP connections to ``port``, held by child processes (each within its own
    descriptor limit) until the block ends; yields how many were opened."""
    procs = []
    try:
        for start in range(0, count, per_process):
            procs.append(subprocess.Popen([sys.executable, "-I", "-c", HOLDER, str(port),
                                           str(min(per_process, count - start))],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        opened = 0
        for p in procs:
            assert p.stdout is not None
            opened += int(p.stdout.readline() or 0)
        yield opened
    finally:
        for p in procs:
            with contextlib.suppress(OSError):
                assert p.stdin is not None
                p.stdin.close()
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _shm_infer(sock: Path) -> bool:
    from edged.client.shm import ShmClient

    try:
        with ShmClient(sock) as c:
            out = c.infer("digits", {"pixels": np.asarray([DIGIT], np.float32)}, timeout=5)
            return next(iter(out.values())).shape[-1] == 10
    except Exception:
        return False


def _idle_grpc_attack(tmp: Path, count: int, nofile: int | None, extra: str) -> None:
    with edged_daemon(tmp, extra, nofile=nofile) as d:
        with idle_connections(d.grpc_port, count) as opened:
            counts: list[int] = []

            def settled() -> bool:  # grpcio accepts and closes those over its cap: the count stops moving
                counts.append(d.fds())
                return len(counts) >= 3 and len(set(counts[-3:])) == 1

            wait_until(settled, 30, 0.2, "the daemon's descriptor count to settle")
            held = counts[-1]
            health = [one_request(d.http_port, "/v2/health/live", None, timeout=3) for _ in range(5)]
            infer = [one_request(d.http_port, timeout=3) for _ in range(5)]
            shm = _shm_infer(d.shm_socket)
            chosen = [line for line in d.log.read_text().splitlines() if "descriptors: limit" in line]
            print(f"{opened} idle gRPC connections: daemon holds {held} descriptors; health {health}, "
                  f"infer {infer}, shm {shm}; {chosen}")
            assert health == [200] * 5, health
            assert infer == [200] * 5, infer
            assert shm, "a shared-memory client was not served"
            if nofile is not None:
                assert held < nofile, f"the daemon holds {held} of {nofile} descriptors"
            assert chosen, "the daemon did not say how it sized its connection caps"
        # The attacker gone, gRPC serves again.
        from edged.client.grpc import GrpcClient

        deadline = time.monotonic() + 20
        while True:
            try:
                with GrpcClient(f"127.0.0.1:{d.grpc_port}", timeout=5) as g:
                    out = g.infer("digits", {"pixels": np.asarray([DIGIT], np.float32)})
                assert next(iter(out.values())).shape[-1] == 10
                break
            except Exception:
                assert time.monotonic() < deadline, "gRPC did not serve again after the attack"
                time.sleep(0.2)


@pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs prlimit (util-linux)")
def test_idle_grpc_connections_leave_health_and_shm_served(tmp_path: Path) -> None:
    """Attack 7, scaled: 800 idle gRPC connections against a daemon limited to 600 descriptors."""
    _idle_grpc_attack(tmp_path, 800, 600, "[descriptors]\nreserve = 64\n")


@pytest.mark.slow
def test_idle_grpc_connections_full_size(tmp_path: Path) -> None:
    """Attack 7 as reported: 20,200 idle gRPC connections, the daemon with the limit it inherits."""
    _idle_grpc_attack(tmp_path, 20_200, None, "")


def test_grpc_rpcs_at_once_are_capped(tmp_path: Path) -> None:
    """[grpc] max_concurrent_rpcs: open streams count; one more RPC gets RESOURCE_EXHAUSTED, and is
    served once a stream ends."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    from tests.http_helpers import served

    repo = copy_models(tmp_path / "models", "digits")
    with served(repo, tmp_path, grpc="max_concurrent_rpcs = 2\n") as srv:
        ch = grpc.insecure_channel(srv.grpc_url)
        stub = service_pb2_grpc.GRPCInferenceServiceStub(ch)
        stops = [threading.Event() for _ in range(2)]

        def requests(stop: threading.Event) -> Iterator[service_pb2.ModelInferRequest]:
            stop.wait(30)
            return
            yield  # a generator that sends nothing until told to end

        streams = [stub.ModelStreamInfer(requests(s)) for s in stops]
        try:
            deadline = time.monotonic() + 10
            while True:  # the streams are open once the server counts them
                for i, st in enumerate(streams):
                    if st.done():  # refused: it started while one of these probes held the second slot
                        stops[i] = threading.Event()
                        streams[i] = stub.ModelStreamInfer(requests(stops[i]))
                try:
                    stub.ServerLive(service_pb2.ServerLiveRequest(), timeout=5)
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
                    break
                assert time.monotonic() < deadline, "a third RPC was served beside two open streams"
                time.sleep(0.05)
            # edged's own client reads grpcio's refusal as "the server is full, try again", not as a request
            # too large for it (the other RESOURCE_EXHAUSTED, which carries no code either).
            with GrpcClient(srv.grpc_url) as client, pytest.raises(EdgedError) as refused:
                client.metadata("digits")
            assert refused.value.code is ErrorCode.OVERLOADED, refused.value
        finally:
            for s in stops:
                s.set()
            for st in streams:
                list(st)
        assert stub.ServerLive(service_pb2.ServerLiveRequest(), timeout=5).live
        ch.close()


def test_an_answer_the_client_does_not_read_is_dropped_after_the_request_timeout() -> None:
    """A client that sends requests and never reads the answers does not hold its connection (and the
    answer's memory) for ever: once writing has waited longer than the request timeout it is dropped."""
    from edged.transports.http.server import HttpServer, Limits, Request, Response

    async def big(req: Request) -> Response:
        return 200, [(b"content-type", b"application/octet-stream")], b"x" * (32 << 20)

    async def main() -> tuple[int, int]:
        server = HttpServer(big, Limits(request_timeout_s=1.0, write_high_water=64 * 1024))
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.setblocking(False)
        await server.start(sock)
        port = sock.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        held = await wait_until_async(lambda: server.connections, 10, what="the server to take the connection")
        deadline = time.monotonic() + 10
        while server.connections and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        left = server.connections
        client.close()
        await server.stop(1)
        return held, left

    held, left = asyncio.run(main())
    assert (held, left) == (1, 0)
