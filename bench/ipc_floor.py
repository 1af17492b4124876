"""The bare floor of a local round trip on this machine: two Python processes ping-pong 64 bytes
over an AF_UNIX SOCK_SEQPACKET pair (the shm transport's doorbell), no edged code at all.

    .venv/bin/python -m bench.ipc_floor

The shm path's per-request overhead cannot go below this; on a VM whose idle vCPUs are slow to
wake it is far above the ~10 us of bare metal.
"""

from __future__ import annotations

import os
import socket
import statistics
import time


def round_trips(rounds: int = 20000, warmup: int = 2000) -> list[float]:
    """Sorted round-trip times in seconds (the first ``warmup`` dropped)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        a.close()
        while msg := b.recv(256):
            b.send(msg)
        os._exit(0)
    b.close()
    times = []
    payload = b"x" * 64
    for _ in range(rounds):
        t0 = time.perf_counter()
        a.send(payload)
        a.recv(256)
        times.append(time.perf_counter() - t0)
    a.close()
    os.waitpid(pid, 0)
    return sorted(times[warmup:])


def main(rounds: int = 20000, warmup: int = 2000) -> None:
    times = round_trips(rounds, warmup)
    print(f"process-to-process round trip over a Unix socket: median {statistics.median(times) * 1e6:.1f} us, "
          f"p10 {times[len(times) // 10] * 1e6:.1f} us")


if __name__ == "__main__":
    main()
