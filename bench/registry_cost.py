"""What each kind of device request costs the registry: CPU milliseconds per request, and requests/s.

Starts a throwaway registry (``edged-registry serve``, SQLite unless ``--database-url``), enrolls
``--devices`` devices, releases one version, then drives each request kind a device sends for
``--seconds`` with ``--concurrency`` requests in flight from this process (the simulator's HTTP
client), and divides the registry process's CPU time by the requests it answered. A fleet's
download wave is a mix of these; the cheapest kind bounds how many devices one core can carry.

    .venv/bin/python -m bench.registry_cost --seconds 4
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.registry_helpers import Keys, PgCluster, RegistryServer, free_port, make_version  # noqa: E402

MODEL = "digits"


async def enroll(pool: Any, token: str, n: int) -> list[str]:
    from edged.protocol.fleet.messages import API_PREFIX

    async def one(i: int) -> str:
        body = orjson.dumps({"token": token, "device_id": f"cost-{i}", "labels": {},
                             "facts": {"profile": "sim-x86-64", "cpu.arch": "x86_64"}})
        a = await pool.request("POST", f"{API_PREFIX}/enroll", body=body)
        if a.status != 200:
            raise RuntimeError(f"enroll: {a.status} {a.body[:200]!r}")
        return str(orjson.loads(a.body)["credential"])

    return list(await asyncio.gather(*(one(i) for i in range(n))))


def kinds(creds: list[str], blob_sha: str, release: int) -> dict[str, Any]:
    """Each kind: a function (device index, counter) -> (method, path, body, headers)."""
    from edged.protocol.fleet.messages import API_PREFIX
    from edged.protocol.fleet.telemetry import INGEST_PATH

    etags: dict[int, str] = {}
    seqs = itertools.count(1)

    def auth(i: int) -> dict[str, str]:
        return {"Authorization": f"Bearer {creds[i]}"}

    def poll304(i: int) -> tuple[str, str, bytes | None, dict[str, str]]:
        h = auth(i)
        if i in etags:
            h["If-None-Match"] = etags[i]
        return "GET", f"{API_PREFIX}/device/desired-state", None, h

    def poll200(i: int) -> tuple[str, str, bytes | None, dict[str, str]]:
        return "GET", f"{API_PREFIX}/device/desired-state", None, auth(i)

    def report(i: int) -> tuple[str, str, bytes | None, dict[str, str]]:
        ev = {"seq": next(seqs), "model": MODEL, "step": "downloading", "version": 1, "release": release,
              "reason": None, "detail": {"bytes": 1, "files": 1}, "at": time.time()}
        return "POST", f"{API_PREFIX}/device/reports", orjson.dumps({"events": [ev]}), auth(i)

    def facts(i: int) -> tuple[str, str, bytes | None, dict[str, str]]:
        body = {"facts": {"profile": "sim-x86-64", "cpu.arch": "x86_64"},
                "serving": [{"model": MODEL, "version": 1, "release": release, "state": "committed"}]}
        return "PUT", f"{API_PREFIX}/device/facts", orjson.dumps(body), auth(i)

    def blob(i: int) -> tuple[str, str, bytes | None, dict[str, str]]:
        return "GET", f"{API_PREFIX}/blobs/{blob_sha}", None, auth(i)

    tseq = itertools.count(1)

    def telemetry(i: int) -> tuple[str, str, bytes | None, dict[str, str]]:
        sample = {"device": f"cost-{i}", "seq": next(tseq), "run": "bench", "t": time.time(), "window_s": 60.0,
                  "uptime_s": 100.0, "profile": "sim-x86-64",
                  "models": [{"model": MODEL, "version": 1, "backend": "sim", "success": 100, "failures": {},
                              "latency": {"counts": [100] + [0] * 20, "sum_s": 0.1}}]}
        return "POST", INGEST_PATH, orjson.dumps({"buffer_id": f"bench-{i}", "items": [sample]}), auth(i)

    return {"poll (304)": (poll304, etags), "poll (200)": (poll200, None), "report": (report, None),
            "facts (unchanged)": (facts, None), "blob (redirect)": (blob, None), "telemetry": (telemetry, None)}


async def drive(pool: Any, make: Any, etags: dict[int, str] | None, n_dev: int, *, seconds: float,
                concurrency: int) -> tuple[int, dict[int, int]]:
    done = 0
    statuses: dict[int, int] = {}
    end = time.monotonic() + seconds
    counter = itertools.count()

    async def worker() -> None:
        nonlocal done
        while time.monotonic() < end:
            i = next(counter) % n_dev
            method, path, body, headers = make(i)
            a = await pool.request(method, path, body=body, headers=headers)
            statuses[a.status] = statuses.get(a.status, 0) + 1
            if etags is not None and "etag" in a.headers:
                etags[i] = a.headers["etag"]
            done += 1

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done, statuses


async def measure(server: RegistryServer, token: str, blob_sha: str, release: int, args: argparse.Namespace
                  ) -> list[tuple[str, float, float, dict[int, int]]]:
    import psutil

    from bench.sim.http_pool import HttpPool

    proc = psutil.Process(server.proc.pid)  # type: ignore[union-attr]
    pool = HttpPool(server.url, limit=args.concurrency, timeout=120)
    creds = await enroll(pool, token, args.devices)
    rows = []
    print(f"registry pid {proc.pid}", flush=True)
    for name, (make, etags) in kinds(creds, blob_sha, release).items():
        if args.only and not name.startswith(args.only):
            continue
        if etags is not None:  # learn every device's ETag first
            await drive(pool, make, etags, args.devices, seconds=1.0, concurrency=args.concurrency)
        ct0, t0 = proc.cpu_times(), time.monotonic()
        n, statuses = await drive(pool, make, etags, args.devices, seconds=args.seconds,
                                     concurrency=args.concurrency)
        ct1, wall = proc.cpu_times(), time.monotonic() - t0
        user, system = ct1.user - ct0.user, ct1.system - ct0.system
        rows.append((name, n / wall, 1000 * (user + system) / max(1, n), statuses))
        print(f"{name:<18} {n / wall:8.0f}/s  {1000 * (user + system) / max(1, n):6.3f} CPU ms/request "
              f"({100 * system / max(1e-9, user + system):.0f}% in the kernel)  {statuses}", flush=True)
    pool.close()
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=500)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--db", default="sqlite", help="sqlite or postgresql")
    p.add_argument("--only", default="", help="only the kinds whose name starts with this (e.g. report)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="edged-cost-") as d:
        tmp = Path(d)
        keys = Keys.make(tmp)
        cluster = None
        if args.db == "postgresql":
            cluster = PgCluster()
            cluster.start()
        try:
            server = RegistryServer(tmp, [keys.public], blob_port=free_port(),
                                    database_url=cluster.new_database() if cluster else None,
                                    extra_args=["--log-level", "warning"]).start()
            try:
                client = server.client()
                info = client.push_folder(make_version(tmp / "v1", salt="cost"), MODEL, 1)
                rel = client.release(keys.load(), MODEL, 1, expires_in_s=86400).release
                token = client.enrollment_token(uses=args.devices, ttl_s=86400).token
                sha = info.files[0].sha256
                client.close()
                asyncio.run(measure(server, token, sha, rel, args))
            finally:
                server.stop()
        finally:
            if cluster is not None:
                cluster.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
