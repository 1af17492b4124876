"""Soak the device's update path: many SIGKILLed updates, then updates under inference load.

Part 1 (fault injection): one registry process and one daemon process (``python -m
edged run --set ...``); each run releases a new version (a broken one a quarter of the time),
kills the daemon at a named step of the update (through ``EDGED_SYNC_FAULT_FILE``) or after
a random delay, checks the repository on disk, restarts the daemon, checks what it serves,
and waits for the update to be committed (good versions) or rolled back (broken ones).
Any invariant violated stops the soak with the daemon log's tail.

Part 2 (load): ``--load-updates`` clean updates while ``--clients`` threads send HTTP
inference requests to the daemon without pause; prints how many failed (goal: 0) and how
many each version answered.

    .venv/bin/python bench/soak_sync.py [--runs 200] [--load-updates 10] [--clients 4] [--seed 0]
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.registry_helpers import BAD_POINTS, GOOD_POINTS, FaultHarness  # noqa: E402


def fault_soak(h: FaultHarness, runs: int) -> bool:
    cycle = len(GOOD_POINTS) + len(BAD_POINTS)
    cycles = max(1, (runs * 3 // 4) // cycle)
    plan = h.plan(cycles=cycles, random_runs=max(0, runs - cycles * cycle))
    t0 = time.monotonic()
    for i, (point, delay, bad) in enumerate(plan, 1):
        try:
            r = h.run(point, delay=delay, bad=bad)
        except AssertionError as e:
            print(f"\nRUN {i} FAILED ({point or f'random {delay:.2f}s'}, bad={bad}): {e}")
            print(Path(h.daemon.log_path).read_text(errors="replace")[-5000:])
            return False
        if i % 10 == 0 or i == len(plan):
            print(f"  {i:4d}/{len(plan)} runs, {time.monotonic() - t0:6.1f}s, last: {r.point} -> {r.outcome}",
                  flush=True)
    elapsed = time.monotonic() - t0
    by_point: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for r in h.runs:
        key = "random delay" if r.point.startswith("random") else r.point
        by_point[key][r.outcome] += 1
        by_point[key]["killed" if r.killed else "not killed"] += 1
    print(f"\nfault injection: {len(h.runs)} runs in {elapsed:.1f}s ({elapsed / len(h.runs):.2f}s per run), "
          f"{sum(r.killed for r in h.runs)} SIGKILLs, 0 invariant violations")
    for point, c in sorted(by_point.items()):
        print(f"  {point:<18} " + ", ".join(f"{k} {v}" for k, v in sorted(c.items())))
    print(f"  downloads resumed after a kill mid-file: {h.resumed_downloads()}")
    return True


def load_soak(h: FaultHarness, updates: int, clients: int, trial_s: float) -> bool:
    import httpx

    h.daemon.stop()  # an orderly restart with a trial long enough to judge latency under load
    h.daemon.sets["trial_s"] = trial_s
    h.daemon.start()
    h.daemon.wait_http()
    stop = threading.Event()
    lock = threading.Lock()
    ok: collections.Counter[str] = collections.Counter()
    failures: list[str] = []
    x = np.random.default_rng(0).random((1, 64), dtype=np.float32) * 16
    body = {"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1, 64], "data": x.ravel().tolist()}]}
    url = f"{h.daemon.base}/v2/models/{h.MODEL}/infer"

    def client() -> None:
        with httpx.Client(timeout=30) as c:
            while not stop.is_set():
                try:
                    r = c.post(url, json=body)
                    good = r.status_code == 200
                    with lock:
                        if good:
                            ok[r.json()["model_version"]] += 1
                        else:
                            failures.append(f"{r.status_code} {r.text[:200]}")
                except httpx.HTTPError as e:
                    with lock:
                        failures.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    try:
        for _ in range(updates):
            _clean_update(h)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    total = sum(ok.values()) + len(failures)
    print(f"\nunder load: {updates} updates ({trial_s:g}s trials) in {time.monotonic() - t0:.1f}s with {clients} "
          f"HTTP clients: "
          f"{total} requests, {len(failures)} failed (goal 0); answered per version: "
          + ", ".join(f"v{k} {v}" for k, v in sorted(ok.items())))
    for f in failures[:5]:
        print("  failure:", f)
    return not failures


def _clean_update(h: FaultHarness) -> None:
    version = h.next_version(False)
    release = h._release(version)
    h._wait_settled(release)
    ms = h.state()
    if ms.current.release != release:
        raise AssertionError(f"release {release} was rolled back under load: {ms.rejected.get(release)}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=200, help="fault-injection runs (0: skip)")
    p.add_argument("--load-updates", type=int, default=10, help="clean updates under load (0: skip)")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--trial-s", type=float, default=0.2, help="trial length during fault injection")
    p.add_argument("--load-trial-s", type=float, default=3.0, help="trial length for the updates under load")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="edged-soak-") as tmp:
        h = FaultHarness(Path(tmp), trial_s=args.trial_s, seed=args.seed)
        try:
            good = True
            if args.runs:
                good = fault_soak(h, args.runs)
            if good and args.load_updates:
                good = load_soak(h, args.load_updates, args.clients, args.load_trial_s)
        finally:
            h.close()
    print("\nRESULT:", "PASS" if good else "FAIL")
    return 0 if good else 1


if __name__ == "__main__":
    raise SystemExit(main())
