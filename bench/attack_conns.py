"""Issue 36, attacks 6 and 7, measured: a well-behaved client's rate and /v2/health/live p99 under attack.

One real ``edged run`` (HTTP, gRPC and shm on, the bundled ``digits``). A victim infers back to
back over HTTP, a new connection per request (the slot the attacks compete for), while a probe
asks ``/v2/health/live`` 20 times a second, also on new connections. Three phases, same run:

* alone;
* attack 6: ``--slow`` connections (default 1,200) over 20 loopback addresses 127.0.0.10-29, each
  announcing a 10 MB body and sending a byte every 0.5 s, reopened as soon as they are cut off;
* attack 7: ``--idle`` idle TCP connections (default 20,200) to the gRPC port, held by child
  processes.

Printed: the victim's requests/s and its ratio to the unattacked rate measured in the same run
(the issue's goal: >= 0.9), failures, and the health probe's p50/p99 (goal: p99 <= 50 ms); a last
unattacked phase shows how far the host itself drifted meanwhile. The attackers run on the same
machine, so they also take CPU from the victim and the daemon.

    .venv/bin/python bench/attack_conns.py [--seconds 10] [--slow 1200] [--idle 20200]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.transports.test_attack_conns import edged_daemon, idle_connections, one_request  # noqa: E402

# The slow-body attacker in a process of its own, so that it does not take the victim's interpreter.
SLOW = """
import sys, time
sys.path.insert(0, sys.argv[3])
from tests.transports.test_attack_conns import SlowBodies, _raise_own_limit
_raise_own_limit()
with SlowBodies(int(sys.argv[1]), int(sys.argv[2])) as attack:
    print("started", flush=True)
    sys.stdin.read()
    opened = attack.opened
print(opened, flush=True)
"""


def host() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        name = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")
        cpus = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("CPU(s)")), "?")
    except OSError:
        name, cpus = platform.processor() or "?", "?"
    return f"{name}, {cpus} CPUs, {platform.system()} {platform.release()}"


class Probe:
    """GET /v2/health/live on a new connection every 50 ms; latencies in ms (a failure counts 10 s)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.lat: list[float] = []
        self.failed = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            status = one_request(self.port, "/v2/health/live", None, timeout=10)
            ms = (time.perf_counter() - t0) * 1000
            if status != 200:
                self.failed += 1
                ms = max(ms, 10_000.0)
            self.lat.append(ms)
            self._stop.wait(max(0.0, 0.05 - ms / 1000))

    def __enter__(self) -> Probe:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(15)


def phase(port: int, seconds: float) -> tuple[float, int, list[float]]:
    ok = failed = 0
    with Probe(port) as probe:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            if one_request(port) == 200:
                ok += 1
            else:
                failed += 1
        elapsed = time.perf_counter() - t0
    return ok / elapsed, failed, probe.lat


def p(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def report(name: str, rate: float, failed: int, lat: list[float], base: float) -> None:
    print(f"{name:<34} victim {rate:7.1f} req/s ({rate / base:4.2f}x alone, goal >= 0.90), {failed} failed; "
          f"health p50 {statistics.median(lat) if lat else float('nan'):6.1f} ms, p99 {p(lat, 0.99):7.1f} ms "
          f"(goal <= 50), {len(lat)} probes")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--slow", type=int, default=1200, help="slow-body connections (attack 6)")
    ap.add_argument("--idle", type=int, default=20_200, help="idle gRPC connections (attack 7)")
    args = ap.parse_args()
    print(f"host: {host()}")
    with tempfile.TemporaryDirectory() as tmp, edged_daemon(Path(tmp)) as d:
        plan = [ln.split("edged.descriptors: ", 1)[-1] for ln in d.log.read_text().splitlines()
                if "descriptors: limit" in ln]
        print(f"daemon: {plan[0] if plan else '(no descriptor plan logged)'}")
        one_request(d.http_port)  # warm
        base, failed, lat = phase(d.http_port, args.seconds)
        report("alone", base, failed, lat, base)
        attacker = subprocess.Popen([sys.executable, "-c", SLOW, str(d.http_port), str(args.slow), str(ROOT)],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert attacker.stdin is not None and attacker.stdout is not None
        attacker.stdout.readline()
        time.sleep(2.0)
        rate, failed, lat = phase(d.http_port, args.seconds)
        attacker.stdin.close()
        opened = int(attacker.stdout.readline() or 0)
        attacker.wait(30)
        report(f"attack 6: {args.slow} slow bodies / 20 addr", rate, failed, lat, base)
        print(f"{'':<34} ({opened} attack connections opened, i.e. {opened - args.slow} reopened after a cut)")
        with idle_connections(d.grpc_port, args.idle) as held:
            time.sleep(1.0)
            fds = d.fds()
            rate, failed, lat = phase(d.http_port, args.seconds)
        report(f"attack 7: {held} idle gRPC conns", rate, failed, lat, base)
        print(f"{'':<34} (the daemon held {fds} descriptors during attack 7)")
        again, failed, lat = phase(d.http_port, args.seconds)
        report("alone again (the host's drift)", again, failed, lat, base)


if __name__ == "__main__":
    main()
