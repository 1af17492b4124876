"""The bare floor of a local round trip on this machine: two Python processes ping-pong 64 bytes
over an AF_UNIX SOCK_SEQPACKET pair (the shm transport's doorbell), no edged code at all.

    .venv/bin/python -m bench.ipc_floor

The shm path's per-request overhead cannot go below this; on a VM whose idle vCPUs are slow to
wake it is far above the ~10 us of bare metal. The suite (bench/run_suite.py) measures it in
the same run as the shm rows through :class:`Pinger`.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

from bench.common import stop_process

_PAYLOAD = b"x" * 64
_WORK = struct.Struct("=d")  # a round trip with work: how long the responder spins before answering
_ENGINE = b"engine"  # a round trip with one engine run (a responder started with a model)
_SERVICE = b"service"  # the same run through the least service (bench/floor_service.py)


class Pinger:
    """A responder process (a fresh interpreter, not a fork of a threaded one) and our end of the pair."""

    def __init__(self, model: Path | None = None) -> None:
        """With ``model`` the responder also answers :meth:`round_trip_engine` after one run of it."""
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        extra = ["--model", str(model)] if model is not None else []
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.ipc_floor", "--respond", str(theirs.fileno()),
                                      *extra], pass_fds=(theirs.fileno(),), cwd=Path(__file__).resolve().parent.parent)
        theirs.close()
        self.round_trip()

    def round_trip(self) -> None:
        self.sock.send(_PAYLOAD)
        self.sock.recv(256)

    def round_trip_around(self, busy_s: float) -> float:
        """One round trip in which the responder works (spins) ``busy_s`` before answering, as a
        daemon computes; returns the round trip minus that work. Meanwhile this side sleeps in
        ``recv`` as a client does, so the wake-up after an idle stretch is counted: on a VM whose
        idle vCPUs halt it costs several times what a back-to-back ping-pong shows."""
        t0 = time.perf_counter()
        self.sock.send(_WORK.pack(busy_s))
        self.sock.recv(256)
        return time.perf_counter() - t0 - busy_s

    def round_trip_engine(self) -> None:
        """One round trip in which the responder runs the model once (as edged's generic profile sets it
        up) before answering: the engine's threads and the two processes share the cores as with shm."""
        self.sock.send(_ENGINE)
        self.sock.recv(256)

    def round_trip_service(self) -> None:
        """As :meth:`round_trip_engine`, the run going through :class:`bench.floor_service.LeastService`."""
        self.sock.send(_SERVICE)
        self.sock.recv(256)

    def close(self) -> None:
        self.sock.close()  # the responder sees end of file and exits
        stop_process(self.proc, 5)


def respond(fd: int, model: Path | None) -> None:
    s = socket.socket(fileno=fd)
    pc = time.perf_counter
    run = None
    if model is not None:
        from bench.floor_engine import engine_run
        from bench.floor_service import LeastService

        run = engine_run(model)
        least = LeastService("model", lambda _: run())
    while msg := s.recv(256):
        if msg == _ENGINE and run is not None:
            run()
        elif msg == _SERVICE and run is not None:
            least.infer("model", {})
        elif len(msg) == _WORK.size:
            end = pc() + _WORK.unpack(msg)[0]
            while pc() < end:
                pass
        s.send(msg)


def round_trips(rounds: int = 20000, warmup: int = 2000) -> list[float]:
    """Sorted round-trip times in seconds (the first ``warmup`` dropped)."""
    p = Pinger()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        p.round_trip()
        times.append(time.perf_counter() - t0)
    p.close()
    return sorted(times[warmup:])


def main(rounds: int = 20000, warmup: int = 2000) -> None:
    times = round_trips(rounds, warmup)
    print(f"process-to-process round trip over a Unix socket: median {statistics.median(times) * 1e6:.1f} us, "
          f"p10 {times[len(times) // 10] * 1e6:.1f} us")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--respond", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.respond is not None:
        respond(args.respond, args.model)
    else:
        main()
