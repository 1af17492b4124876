"""What one open dashboard costs a registry serving a simulated fleet (default 10,000 devices).

One registry process (``edged-registry serve``) and, in a separate process, ``python -m
bench.sim`` with N devices polling every ``--poll`` seconds and uploading telemetry. Then
windows of ``--phase`` seconds alternate: without a dashboard (the fleet only: device polls,
reports, telemetry), and with one open dashboard page (a client that does what the page's
script does: ``GET <page>?part=live`` with ``If-None-Match`` every ``--dashboard-poll``),
``without, with, without, with, without`` for two ``--rounds``, so that the drift of a shared
machine hits both kinds alike.

Reported per kind of window: device polls per second and their p50/p99 (client side, every poll of
the windows, as the simulator times them inside its own busy event loop), the same for one extra
device polling ``--probe-rate`` times a second from a process of its own (``bench/poll_probe.py``:
the registry's answer without the simulator's loop lag), the registry process's CPU use and that of
its children (the dashboard's page process, edged/registry/web/worker.py); for the dashboard:
its requests per second, how many were 304 (unchanged), bytes, and the server-side time of each
(``Server-Timing``).
Then each page once more with a full load (fleet twice: a fresh read of the fleet and one
from the shared cache) and the SQL statements each page's read makes, counted in this
process against the registry's database. Goals: the fleet page under 1 s server-side,
device poll p99 under 50 ms with a dashboard open.

    .venv/bin/python bench/dashboard_cost.py --devices 10000 --poll 30
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.fleet_sim import KIND_POLL, MODEL, Cpu, phase_stats, read_status, wait  # noqa: E402
from tests.registry_helpers import ADMIN_TOKEN, PY, Keys, PgCluster, RegistryServer, make_version  # noqa: E402


def server_ms(r: httpx.Response) -> float | None:
    for part in r.headers.get("server-timing", "").split(","):
        name, _, rest = part.strip().partition(";")
        if name == "app" and rest.startswith("dur="):
            return float(rest[4:])
    return None


class ChildrenCpu:
    """CPU seconds of the registry's child processes (the dashboard's page process), alive ones included."""

    def __init__(self, pid: int) -> None:
        import psutil

        self.p = psutil.Process(pid)

    def seconds(self) -> dict[int, float]:
        out = {}
        for c in self.p.children(recursive=True):
            try:
                t = c.cpu_times()
                out[c.pid] = float(t.user + t.system)
            except Exception:  # ended meanwhile
                continue
        return out

    def rss_mb(self) -> float:
        total = 0
        for c in self.p.children(recursive=True):
            try:
                total += c.memory_info().rss
            except Exception:
                continue
        return round(total / 2**20, 1)

    @staticmethod
    def spent(before: dict[int, float], after: dict[int, float]) -> float:
        return sum(v - before.get(pid, 0.0) for pid, v in after.items())


def login(url: str) -> httpx.Client:
    h = httpx.Client(base_url=url, timeout=600, follow_redirects=False)
    r = h.post("/ui/login", data={"token": ADMIN_TOKEN})
    if r.status_code != 303:
        raise RuntimeError(f"dashboard login: HTTP {r.status_code}")
    return h


class OpenPage(threading.Thread):
    """One open dashboard page: its live region asked for every ``every_s`` with the last ETag (as dash.js does)."""

    def __init__(self, url: str, path: str, every_s: float) -> None:
        super().__init__(daemon=True)
        self.h, self.path, self.every_s = login(url), path, every_s
        self.stop = threading.Event()
        self.log: list[tuple[float, int, float, float | None, int]] = []  # t, status, client ms, server ms, bytes

    def run(self) -> None:
        etag = ""
        nxt = time.monotonic()
        while not self.stop.is_set():
            t0 = time.perf_counter()
            r = self.h.get(self.path, params={"part": "live"}, headers={"If-None-Match": etag})
            self.log.append((time.time(), r.status_code, (time.perf_counter() - t0) * 1e3, server_ms(r),
                             len(r.content)))
            if r.status_code == 200:
                etag = r.headers.get("etag", "")
            nxt += self.every_s
            self.stop.wait(max(0.0, nxt - time.monotonic()))
        self.h.close()

    def stats(self, seconds: float) -> dict[str, Any]:
        srv = np.array([x[3] for x in self.log if x[3] is not None] or [np.nan])
        return {"page": self.path, "requests": len(self.log), "requests_per_s": round(len(self.log) / seconds, 3),
                "not_modified": sum(1 for x in self.log if x[1] == 304),
                "other_status": sorted({x[1] for x in self.log} - {200, 304}),
                "bytes_per_s": round(sum(x[4] for x in self.log) / seconds),
                "server_ms_p50": round(float(np.nanpercentile(srv, 50)), 1),
                "server_ms_max": round(float(np.nanmax(srv)), 1),
                "client_ms_max": round(max((x[2] for x in self.log), default=0.0), 1)}


def full_loads(url: str, pages: list[str], fleet_period_s: float) -> list[dict[str, Any]]:
    """Each page loaded whole; the fleet first after its cache expired (a fresh read), then at once (cached)."""
    out: list[dict[str, Any]] = []
    h = login(url)
    try:
        time.sleep(fleet_period_s)
        for path in ["/ui/fleet", "/ui/fleet", *pages]:
            t0 = time.perf_counter()
            r = h.get(path)
            out.append({"page": path, "status": r.status_code, "server_ms": server_ms(r),
                        "client_ms": round((time.perf_counter() - t0) * 1e3, 1), "bytes": len(r.content)})
    finally:
        h.close()
    out[0]["page"] += " (fresh read)"
    out[1]["page"] += " (shared read)"
    return out


def sql_counts(database_url: str, device_id: str) -> dict[str, dict[str, Any]]:
    """Statements and in-process time of each page's read, against the registry's own database."""
    from sqlalchemy import event

    from edged.registry import desired
    from edged.registry.db import make_engine, make_sessionmaker
    from edged.registry.web import views

    engine = make_engine(database_url)
    seen: list[str] = []
    event.listen(engine, "before_cursor_execute", lambda *a: seen.append(a[2]))
    sessions = make_sessionmaker(engine)
    cache = desired.SnapshotCache()
    since = time.time() - views.WINDOWS["15m"]
    reads: dict[str, Callable[[Any], Any]] = {
        "fleet": lambda s: views.fleet_rows(s, cache.get(s.connection()), online_s=180),
        "device": lambda s: views.device(s, cache.get(s.connection()), device_id, online_s=180, since=since),
        "models": lambda s: views.models(s, since, bucket_s=10.0),
        "rollouts": lambda s: (views.rollout_list(s), views.releasable(s))}
    out = {}
    for name, read in reads.items():
        with sessions() as s, s.begin():
            cache.get(s.connection())
            seen.clear()
            t0 = time.perf_counter()
            read(s)
            out[name] = {"statements": len(seen), "in_process_ms": round((time.perf_counter() - t0) * 1e3, 1)}
    engine.dispose()
    return out


def run(args: argparse.Namespace, tmp: Path, pg_url: str | None) -> dict[str, Any]:
    keys = Keys.make(tmp)
    conf = tmp / "registry.toml"
    conf.write_text(f"[registry]\ndashboard_poll_s = {args.dashboard_poll}\n")
    server = RegistryServer(tmp, [keys.public], database_url=pg_url,
                            extra_args=["--config", str(conf), "--log-level", "warning"]).start()
    sim: subprocess.Popen[bytes] | None = None
    probe: subprocess.Popen[bytes] | None = None
    probe_file = tmp / "probe.npz"
    windows: list[tuple[str, float, float, float, float]] = []  # kind, t0, t1, registry CPU s, load average
    child_cpu: dict[str, float] = {}  # kind -> CPU s of the registry's children (the page process)
    result: dict[str, Any] = {"devices": args.devices, "poll_s": args.poll, "telemetry_s": args.telemetry,
                              "sim_nice": args.sim_nice,
                              "dashboard_poll_s": args.dashboard_poll, "phase_s": args.phase,
                              "db": "postgresql" if pg_url else "sqlite"}
    try:
        cpu = Cpu(server.proc.pid)  # type: ignore[union-attr]
        kids = ChildrenCpu(server.proc.pid)  # type: ignore[union-attr]
        client = server.client()
        client.push_folder(make_version(tmp / "pub" / "1", salt="dash-1"), MODEL, 1)
        r1 = client.release(keys.load(), MODEL, 1, expires_in_s=86400).release
        token = client.enrollment_token(uses=args.devices, ttl_s=86400, labels={"site": "sim"}).token
        probe_token = client.enrollment_token(uses=1, ttl_s=86400, labels={"site": "sim"}).token
        client.close()
        status_file, samples_file = tmp / "fleet.json", tmp / "samples.npz"
        argv = [PY, "-m", "bench.sim", "--url", server.url, "--enroll-token", token,
                "--public-key", keys.public, "--devices", str(args.devices), "--poll", str(args.poll),
                "--start", f"{MODEL}:1:{r1}", "--telemetry", str(args.telemetry), "--label", "site=sim",
                "--status-file", str(status_file), "--samples", str(samples_file)]
        if args.sim_nice:
            argv = ["nice", "-n", str(args.sim_nice), *argv]
        sim = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=(tmp / "sim.log").open("wb"))
        t = time.time()
        wait(lambda: read_status(status_file).get("enrolled") == args.devices, 1800, "enrollment", 1.0)
        print(f"{args.devices} devices enrolled in {time.time() - t:.0f}s", flush=True)
        if args.probe_rate > 0:
            probe = subprocess.Popen([PY, str(ROOT / "bench" / "poll_probe.py"), "--url", server.url, "--token",
                                      probe_token, "--rate", str(args.probe_rate), "--out", str(probe_file)],
                                     cwd=ROOT, stderr=(tmp / "probe.log").open("wb"))
        # the first rounds of polls fetch full answers and send facts
        time.sleep(args.warmup if args.warmup is not None else args.poll * 2 + 10)
        # windows alternate without and with an open page, so that a shared machine's drift hits both alike
        pages: list[OpenPage] = []
        open_log: list[tuple[float, int, float, float | None, int]] = []
        kinds = ["without"] + ["with", "without"] * args.rounds
        for i, kind in enumerate(kinds):
            if kind == "with":
                pages = [OpenPage(server.url, p, args.dashboard_poll) for p in args.pages.split(",")]
                for pg in pages:
                    pg.start()
            t0, c0, k0, load = time.time(), cpu.seconds(), kids.seconds(), os.getloadavg()[0]
            time.sleep(args.phase)
            windows.append((kind, t0, time.time(), cpu.seconds() - c0, load))
            child_cpu[kind] = child_cpu.get(kind, 0.0) + kids.spent(k0, kids.seconds())
            for pg in pages:
                pg.stop.set()
            for pg in pages:
                pg.join()
                open_log += pg.log
            if kind == "with":
                result.setdefault("open_pages", []).extend(pg.stats(args.phase) for pg in pages)
            pages = []
            print(f"window {i + 1}/{len(kinds)} ({kind} a dashboard) measured for {args.phase:.0f}s, "
                  f"load average {load:.1f}", flush=True)
        device_id = "sim-" + "0" * len(str(args.devices))
        result["children_rss_mb"] = kids.rss_mb()
        result["full_loads"] = full_loads(server.url, [f"/ui/devices/{device_id}", "/ui/models", "/ui/rollouts"],
                                          args.fleet_period)
        db_url = pg_url or f"sqlite:///{server.data_dir / 'registry.db'}"
        result["reads"] = sql_counts(db_url, device_id)
        result["sim_loop_lag_max_ms"] = round(float(read_status(status_file).get("loop_lag_max_ms", 0.0)), 1)
    finally:
        if probe is not None and probe.poll() is None:
            probe.send_signal(signal.SIGINT)
            probe.wait(60)
        if sim is not None and sim.poll() is None:
            sim.send_signal(signal.SIGINT)
            sim.wait(120)
        server.stop()
    samples = dict(np.load(samples_file))
    probe_samples = dict(np.load(probe_file)) if probe is not None and probe_file.exists() else None
    result["phases"] = {}
    for kind in ("without", "with"):
        mine = [w for w in windows if w[0] == kind]
        if not mine:  # --rounds 0: no window with a dashboard
            continue
        sel = np.zeros(len(samples["t"]), dtype=bool)
        for _, a, b, _, _ in mine:
            sel |= (samples["t"] >= a) & (samples["t"] < b)
        part = {k: v[sel] for k, v in samples.items()}
        seconds = sum(b - a for _, a, b, _, _ in mine)
        ph = phase_stats(part, 0.0, float("inf"))
        ph["seconds"] = round(seconds, 1)
        ph["polls_per_s"] = round(float((part["kind"] == KIND_POLL).sum()) / seconds, 1)
        ph["requests_per_s"] = round(float(len(part["t"])) / seconds, 1)
        ph["registry_cpu_pct"] = round(100 * sum(w[3] for w in mine) / seconds, 1)
        ph["page_process_cpu_pct"] = round(100 * child_cpu.get(kind, 0.0) / seconds, 1)
        ph["windows"] = len(mine)
        ph["load_average"] = [round(w[4], 1) for w in mine]
        per = []
        for _, a, b, _, _ in mine:
            w = phase_stats(samples, a, b)
            per.append(w["poll_p99_ms"])
        ph["poll_p99_ms_per_window"] = per
        if probe_samples is not None:
            ph["probe"] = probe_stats(probe_samples, [(a, b) for _, a, b, _, _ in mine])
        result["phases"][kind] = ph
    return result


def probe_stats(samples: dict[str, Any], windows: list[tuple[float, float]]) -> dict[str, Any]:
    """The probe's polls in these windows: p50/p99/max over all of them, p99 per window, failures."""
    def pick(a: float, b: float) -> Any:
        return (samples["t"] >= a) & (samples["t"] < b)

    sel = np.zeros(len(samples["t"]), dtype=bool)
    for a, b in windows:
        sel |= pick(a, b)
    ms = samples["latency_s"][sel] * 1e3
    if len(ms) == 0:
        return {"polls": 0}
    return {"polls": len(ms), "failed": int((samples["status"][sel] == 0).sum()),
            "p50_ms": round(float(np.percentile(ms, 50)), 2), "p99_ms": round(float(np.percentile(ms, 99)), 1),
            "max_ms": round(float(ms.max()), 1),
            "p99_ms_per_window": [round(float(np.percentile(samples["latency_s"][pick(a, b)] * 1e3, 99)), 1)
                                  for a, b in windows if pick(a, b).any()]}


def report(r: dict[str, Any]) -> None:
    print(f"\n{r['devices']} devices polling every {r['poll_s']:g} s, telemetry every {r['telemetry_s']:g} s, "
          f"{r['db']}; dashboard polling every {r['dashboard_poll_s']:g} s; simulator at nice {r['sim_nice']}")
    print("PHASE           POLLS/S  POLL P50  POLL P99  POLL MAX  REGISTRY CPU %  ERRORS")
    for name, ph in r["phases"].items():
        print(f"{name:<15} {ph['polls_per_s']:>7}  {ph['poll_p50_ms']:>5} ms  {ph['poll_p99_ms']:>5} ms "
              f"{ph['poll_max_ms']:>6} ms  {ph['registry_cpu_pct']:>14}  {ph['errors']:>6}")
        print(f"  {ph['windows']} window(s) of {r['phase_s']:g} s: poll p99 per window "
              f"{ph['poll_p99_ms_per_window']} ms, load average at their start {ph['load_average']}")
        pr = ph.get("probe")
        if pr and pr.get("polls"):
            print(f"  probe (one device polling from its own process): {pr['polls']} polls, p50 {pr['p50_ms']} ms, "
                  f"p99 {pr['p99_ms']} ms (per window {pr['p99_ms_per_window']}), max {pr['max_ms']} ms, "
                  f"{pr['failed']} failed")
    print("registry's child processes (the page process): CPU % per kind of window "
          f"{ {k: ph.get('page_process_cpu_pct') for k, ph in r['phases'].items()} }, RSS at the end "
          f"{r.get('children_rss_mb')} MB")
    print(f"simulator event-loop lag max {r['sim_loop_lag_max_ms']} ms (client-side latencies include it)")
    for pg in r.get("open_pages", []):
        print(f"open page {pg['page']}: {pg['requests_per_s']} requests/s ({pg['requests']}, {pg['not_modified']} "
              f"unchanged 304), {pg['bytes_per_s']} B/s, server time p50 {pg['server_ms_p50']} ms max "
              f"{pg['server_ms_max']} ms, other statuses {pg['other_status']}")
    for fl in r["full_loads"]:
        print(f"full load {fl['page']}: HTTP {fl['status']}, server {fl['server_ms']} ms, client {fl['client_ms']} ms, "
              f"{fl['bytes']} bytes")
    for name, rd in r["reads"].items():
        print(f"read of the {name} page: {rd['statements']} SQL statements, {rd['in_process_ms']} ms in this process")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=10000)
    p.add_argument("--poll", type=float, default=30.0)
    p.add_argument("--telemetry", type=float, default=300.0, help="telemetry upload interval of every device")
    p.add_argument("--phase", type=float, default=45.0, help="seconds per window")
    p.add_argument("--warmup", type=float, default=None, help="seconds after enrollment (default 2 polls + 10)")
    p.add_argument("--rounds", type=int, default=2, help="windows with a dashboard open (between windows without)")
    p.add_argument("--dashboard-poll", type=float, default=5.0, help="the registry's dashboard_poll_s")
    p.add_argument("--pages", default="/ui/fleet", help="open pages, comma-separated (default: the fleet page)")
    p.add_argument("--fleet-period", type=float, default=15.0,
                   help="seconds to wait before the fresh full load of the fleet page (its cache expires)")
    p.add_argument("--probe-rate", type=float, default=10.0,
                   help="polls per second of the probe device in its own process (0: no probe)")
    p.add_argument("--sim-nice", type=int, default=0,
                   help="run the simulator at this nice level (the registry and the probe stay at 0), as devices on "
                        "their own machines would not take the registry's cores")
    p.add_argument("--db", choices=("sqlite", "postgresql"), default="sqlite")
    p.add_argument("--json", type=Path, default=None, help="write the results here too")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="edged-dash-") as d:
        os.chmod(d, 0o755)  # the PostgreSQL cluster runs as another user
        cluster = None
        try:
            if args.db == "postgresql":
                cluster = PgCluster()
                cluster.start()
            result = run(args, Path(d), cluster.new_database() if cluster else None)
        finally:
            if cluster is not None:
                cluster.stop()
    report(result)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
