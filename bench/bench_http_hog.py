"""One client hogging HTTP connections while another infers: the victim's latency and errors.

The attack of issue #20 item 8: one process (from 127.0.0.2) opens ``--hog`` connections, half
idle and half with a request line and headers it never finishes, and keeps reconnecting the
ones the server refuses; another client (127.0.0.1) infers digits back to back. One run, one
in-process server (the real HTTP transport on its event loop), printed as the victim's median
and p99 latency and failures before and during the attack, and their ratio.

    .venv/bin/python bench/bench_http_hog.py [--seconds 3] [--hog 1000]
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edged.client.http import HttpClient  # noqa: E402
from edged.errors import EdgedError  # noqa: E402
from tests.http_helpers import copy_models, served  # noqa: E402


def victim(url: str, seconds: float) -> tuple[list[float], int]:
    x = {"pixels": np.ones((1, 64), np.float32)}
    lat: list[float] = []
    failed = 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter_ns()
        try:
            with HttpClient(url) as c:  # a new connection each time: the hog competes for exactly that
                c.infer("digits", x)
            lat.append((time.perf_counter_ns() - t0) / 1e6)
        except EdgedError:
            failed += 1
    return lat, failed


def hog(url: str, n: int, stop: threading.Event, held: list[socket.socket]) -> None:
    host, port = url.rsplit(":", 1)
    while not stop.is_set():
        alive = []
        for s in held:
            try:
                if s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                    s.close()
                    continue
                s.close()  # refused: it got an answer
                continue
            except BlockingIOError:
                alive.append(s)
            except OSError:
                s.close()
        held[:] = alive
        while len(held) < n and not stop.is_set():
            s = socket.socket()
            s.bind(("127.0.0.2", 0))
            try:
                s.connect((host, int(port)))
                if len(held) % 2:
                    s.sendall(b"POST /v2/models/digits/infer HTTP/1.1\r\nHost: x\r\n")
            except OSError:
                s.close()
                continue
            held.append(s)
        stop.wait(0.05)


def summary(name: str, lat: list[float], failed: int) -> tuple[float, float]:
    med = statistics.median(lat) if lat else float("nan")
    p99 = sorted(lat)[int(len(lat) * 0.99) - 1] if len(lat) >= 100 else max(lat, default=float("nan"))
    print(f"{name:<16} {len(lat):>6} ok {failed:>5} failed   median {med:7.2f} ms   p99 {p99:7.2f} ms")
    return med, p99


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--hog", type=int, default=1000)
    a = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4 * a.hog + 256)), hard))
    print(f"load: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} (1, 5 min)")
    with tempfile.TemporaryDirectory() as tmp, served(copy_models(Path(tmp) / "models", "digits"), Path(tmp)) as s:
        base = summary("alone", *victim(s.url, a.seconds))
        stop = threading.Event()
        held: list[socket.socket] = []
        t = threading.Thread(target=hog, args=(s.url, a.hog, stop, held), daemon=True)
        t.start()
        time.sleep(1.0)
        during = summary(f"with {a.hog} hog", *victim(s.url, a.seconds))
        print(f"server holds {s.transport.open_connections} connections "
              f"(per-client limit {s.cfg.http.max_client_connections})")
        stop.set()
        t.join(10)
        for sock in held:
            sock.close()
        print(f"ratio during/alone: median {during[0] / base[0]:.2f}x, p99 {during[1] / base[1]:.2f}x")


if __name__ == "__main__":
    main()
