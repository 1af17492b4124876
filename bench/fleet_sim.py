"""Fleet benchmark: one registry process under a simulated fleet, a good rollout and a broken one.

For each database (SQLite, PostgreSQL): starts a throwaway registry (``edged-registry serve``,
uvicorn with httptools) and, in a separate process, ``python -m bench.sim`` with N
devices polling every ``--poll`` seconds. Then:

1. steady state: the fleet runs release 1 and only polls (measured over ``--steady`` s);
2. a good version 2 goes out in steps 1 %, 10 %, 50 %, 100 % with two gates (failure rate
   from device reports, p99 latency against the previous version from telemetry);
   measured: time until every device committed it;
3. a broken version 3 (its live traffic fails the devices' trials) goes out the same way;
   measured: time until the registry halted it, and how many devices ever activated it
   (goal: under 2 % of the fleet) or downloaded it.

Reported per phase: registry requests per second, poll latency p50/p99 (client side,
every poll of the phase), the registry process's CPU use, and at the end the database
size. Goal: 10,000 devices every 30 s (333 polls/s) with poll p99 under 50 ms on this
2-core machine.

    .venv/bin/python bench/fleet_sim.py --devices 10000 --poll 30 --db sqlite,postgresql
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.registry_helpers import PY, Keys, PgCluster, RegistryServer, free_port, make_version  # noqa: E402

MODEL = "digits"
KIND_POLL = 0


def read_status(path: Path) -> dict[str, Any]:
    try:
        out: dict[str, Any] = json.loads(path.read_text())
        return out
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def wait(pred: Any, timeout: float, what: str, every: float = 0.5) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():
            return time.monotonic() - t0
        time.sleep(every)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


class Cpu:
    def __init__(self, pid: int) -> None:
        import psutil

        self.p = psutil.Process(pid)

    def seconds(self) -> float:
        t = self.p.cpu_times()
        return float(t.user + t.system)


def db_size(server: RegistryServer, pg_url: str | None) -> int:
    if pg_url is None:
        return sum(p.stat().st_size for p in server.data_dir.glob("registry.db*"))
    import psycopg

    with psycopg.connect(pg_url.replace("postgresql+psycopg://", "postgresql://")) as conn:
        return int(conn.execute("SELECT pg_database_size(current_database())").fetchone()[0])  # type: ignore[index]


class AdminProbe:
    """An operator's request every 2 s (``GET /models``, served from the thread pool): is the control plane there?"""

    def __init__(self, server: RegistryServer) -> None:
        import threading

        self.server = server
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {self.server.token_file.read_text().strip()}"}
        while not self._stop.wait(2.0):
            t0 = time.time()
            try:
                httpx.get(f"{self.server.url}/api/v1/models", headers=headers, timeout=300)
            except httpx.HTTPError:
                pass
            self.samples.append((t0, time.time() - t0))

    def stop(self) -> None:
        self._stop.set()

    def worst_ms(self, t0: float, t1: float) -> float | None:
        lat = [x for t, x in self.samples if t0 <= t < t1]
        return round(max(lat) * 1000, 1) if lat else None


def rollout_info(client: Any, rollout_id: int) -> Any:
    """From the rollout list (cheap), not the rollout's status (a pass over the whole fleet and its reports,
    which timed out while a 10,000-device wave saturated the registry)."""
    return next(r for r in client.rollouts(MODEL) if r.id == rollout_id)


def phase_stats(samples: dict[str, np.ndarray], t0: float, t1: float) -> dict[str, Any]:
    t, kind, status, lat = samples["t"], samples["kind"], samples["status"], samples["latency"]
    sel = (t >= t0) & (t < t1)
    polls = sel & (kind == KIND_POLL)
    pl = lat[polls] * 1000
    dur = max(1e-9, t1 - t0)
    return {"seconds": round(dur, 1), "requests_per_s": round(float(sel.sum()) / dur, 1),
            "polls_per_s": round(float(polls.sum()) / dur, 1),
            "poll_p50_ms": round(float(np.percentile(pl, 50)), 2) if pl.size else None,
            "poll_p99_ms": round(float(np.percentile(pl, 99)), 2) if pl.size else None,
            "poll_max_ms": round(float(pl.max()), 1) if pl.size else None,
            "errors": int((sel & ((status == 0) | ((status >= 500) & (status != 503)))).sum()),
            "shed": int((sel & (status == 503)).sum()),
            "poll_errors": int((polls & ((status == 0) | (status >= 500))).sum())}


def run_one(db: str, args: argparse.Namespace, tmp: Path, keys: Keys, cluster: PgCluster | None) -> dict[str, Any]:
    pg_url = cluster.new_database() if cluster is not None else None
    root = tmp / db
    root.mkdir()
    config = root / "registry.toml"
    config.write_text(f"[registry]\nshed_loop_lag_s = {args.shed_lag}\n"
                      + (f"rollout_admit_per_minute = {args.admit_per_minute}\n"
                         if args.admit_per_minute is not None else ""))
    server = RegistryServer(root, [keys.public], database_url=pg_url,
                            blob_port=None if args.inline_blobs else free_port(),
                            extra_args=["--rollout-tick", "1s", "--log-level", "warning", "--config",
                                        str(config)]).start()
    sim: subprocess.Popen[bytes] | None = None
    probe: AdminProbe | None = None
    result: dict[str, Any] = {"db": db, "devices": args.devices, "poll_s": args.poll,
                              "blobs": "registry API" if args.inline_blobs else "blob server",
                              "admit_per_minute": args.admit_per_minute}
    try:
        cpu = Cpu(server.proc.pid)  # type: ignore[union-attr]
        probe = AdminProbe(server)
        client = server.client()
        key = keys.load()
        for v in (1, 2, 3):
            client.push_folder(make_version(root / "pub" / str(v), salt=f"bench-{v}"), MODEL, v)
        r1 = client.release(key, MODEL, 1, expires_in_s=86400).release
        token = client.enrollment_token(uses=args.devices, ttl_s=86400).token
        status_file, samples_file = root / "fleet.json", root / "samples.npz"
        argv = [PY, "-m", "bench.sim", "--url", server.url, "--enroll-token", token,
                "--public-key", keys.public, "--devices", str(args.devices), "--poll", str(args.poll),
                "--start", f"{MODEL}:1:{r1}", "--trial", str(args.trial), "--telemetry", str(args.telemetry),
                "--behave", "1:p99_ms=8", "--behave", "2:p99_ms=8", "--behave", "3:trial_fail=1,p99_ms=40",
                "--status-file", str(status_file), "--samples", str(samples_file)]
        sim = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=(root / "sim.log").open("wb"))
        t_enroll = time.time()
        wait(lambda: read_status(status_file).get("enrolled") == args.devices, 1800, "enrollment", 1.0)
        result["enroll_s"] = round(time.time() - t_enroll, 1)
        print(f"[{db}] {args.devices} devices enrolled in {result['enroll_s']}s", flush=True)
        # the first round of polls fetches full answers and sends facts (10,000 writes): let it pass, and the
        # backlog it leaves, before measuring (an operator's request answering within a second says it has)
        t_first = time.time()
        time.sleep(args.poll * 1.2 + 5)
        wait(lambda: read_status(status_file).get("requests", {}).get("facts", 0) >= args.devices, 1800,
             "every device's first facts", 1.0)
        wait(lambda: bool(probe.samples) and probe.samples[-1][0] > time.time() - 10 and probe.samples[-1][1] < 1.0,
             1800, "the first round's backlog to drain", 1.0)
        result["first_round_s"] = round(time.time() - t_first, 1)
        print(f"[{db}] first round (full answers, facts) absorbed after {result['first_round_s']}s", flush=True)
        phases: dict[str, tuple[float, float, float]] = {}  # name -> wall t0, t1, registry CPU seconds

        t0, c0 = time.time(), cpu.seconds()
        time.sleep(args.steady)
        phases["steady"] = (t0, time.time(), cpu.seconds() - c0)
        print(f"[{db}] steady state measured for {args.steady:.0f}s", flush=True)

        from edged.registry.rollout_wire import Gates, RolloutCreate, StepSpec

        spec = RolloutCreate(model=MODEL, release=0,
                             steps=[StepSpec(percent=p, soak_s=args.soak, min_devices=10) for p in (1, 10, 50, 100)],
                             gates=Gates(max_failure_rate=0.05, max_p99_ratio=2.0, min_reporting=10,
                                         min_requests=200))
        t0, c0 = time.time(), cpu.seconds()
        good = client.release_with_rollout(key, MODEL, 2, spec, expires_in_s=86400)

        last_step: list[float] = []  # when the 100 % step began: the full download wave

        admission: list[bool] = []  # per check while a step was letting devices in: held?

        def converged() -> bool:
            # the rollout list is cheap (no per-device work), unlike a rollout's status
            ro = next(r for r in client.rollouts(MODEL) if r.id == good.id)
            if ro.admission is not None:
                admission.append(ro.admission.held)
            if not last_step and ro.step == len(spec.steps) - 1:
                last_step.append(time.time())
            st = read_status(status_file)
            return bool(int(st.get("current", {}).get(str(good.release), 0)) == args.devices)

        wait(converged, args.timeout, "the good release on every device", 1.0)
        result["good_converge_s"] = round(time.time() - t0, 1)
        result["admission_held_pct"] = round(100.0 * sum(admission) / max(1, len(admission)), 1)
        if last_step:
            phases["100% wave"] = (last_step[0], time.time(), float("nan"))
        info = rollout_info(client, good.id)
        wait(lambda: rollout_info(client, good.id).state == "completed", 120, "the rollout to complete", 1.0)
        phases["good rollout"] = (t0, time.time(), cpu.seconds() - c0)
        result["good_state"] = info.state
        print(f"[{db}] good release on all {args.devices} devices after {result['good_converge_s']}s", flush=True)

        t0, c0 = time.time(), cpu.seconds()
        bad = client.release_with_rollout(key, MODEL, 3, spec, expires_in_s=86400)
        wait(lambda: rollout_info(client, bad.id).state == "halted", args.timeout, "the broken rollout to halt")
        result["bad_halt_s"] = round(time.time() - t0, 1)
        bad_info = rollout_info(client, bad.id)
        result["bad_reason"] = bad_info.reason
        result["bad_step"] = bad_info.step + 1
        result["bad_members"] = bad_info.members

        def settled() -> bool:
            s = read_status(status_file)
            return int(s.get("current", {}).get(str(bad.release), 0)) == 0 and not s.get("pending")

        wait(settled, args.poll * 3 + 60, "no device running the broken release")
        time.sleep(2)
        s = read_status(status_file)
        phases["broken rollout"] = (t0, time.time(), cpu.seconds() - c0)
        result["bad_activated"] = int(s.get("activated", {}).get(str(bad.release), 0))
        result["bad_downloaded"] = int(s.get("downloads", {}).get(str(bad.release), 0))
        result["bad_activated_pct"] = round(100.0 * result["bad_activated"] / args.devices, 2)
        print(f"[{db}] broken release halted after {result['bad_halt_s']}s: {result['bad_activated']} device(s) "
              f"activated it ({result['bad_activated_pct']}%)", flush=True)
        result["loop_lag_max_ms"] = round(float(s.get("loop_lag_max_ms", 0.0)), 1)
        result["db_bytes"] = db_size(server, pg_url)
        client.close()
    except BaseException:
        if server.proc is not None and server.proc.poll() is None:
            server.proc.send_signal(signal.SIGUSR1)  # the registry prints where its threads are
            time.sleep(2)
        worst = max(probe.samples, key=lambda x: x[1]) if probe is not None and probe.samples else None
        print(f"[{db}] failed; slowest operator probe {worst}; the registry's log ends with:\n{server.log()[-12000:]}",
              flush=True)
        raise
    finally:
        if probe is not None:
            probe.stop()
        try:
            if sim is not None and sim.poll() is None:
                sim.send_signal(signal.SIGINT)  # it writes its samples, then exits
                try:
                    sim.wait(300)
                except subprocess.TimeoutExpired:
                    sim.kill()
                    sim.wait()
        finally:
            server.stop()
    samples = dict(np.load(root / "samples.npz"))
    result["phases"] = {}
    for name, (a, b, cpu_s) in phases.items():
        ph = phase_stats(samples, a, b)
        ph["registry_cpu_pct"] = None if math.isnan(cpu_s) else round(100 * cpu_s / max(1e-9, b - a), 1)
        ph["admin_max_ms"] = probe.worst_ms(a, b) if probe is not None else None
        result["phases"][name] = ph
    return result


def print_table(results: list[dict[str, Any]]) -> None:
    print("\nDB          PHASE            SECONDS  REQ/S   POLLS/S  POLL P50  POLL P99  POLL MAX  CPU %  ERRORS"
          "    SHED  ADMIN MAX")
    for r in results:
        for name, ph in r["phases"].items():
            print(f"{r['db']:<11} {name:<16} {ph['seconds']:>7}  {ph['requests_per_s']:>6}  {ph['polls_per_s']:>7}  "
                  f"{ph['poll_p50_ms']:>6} ms {ph['poll_p99_ms']:>6} ms {ph['poll_max_ms']:>6} ms "
                  f"{ph['registry_cpu_pct'] if ph['registry_cpu_pct'] is not None else '-':>5}  {ph['errors']:>6}  "
                  f"{ph['shed']:>6}  "
                  f"{ph['admin_max_ms']} ms")
    for r in results:
        print(f"\n{r['db']}: {r['devices']} devices polling every {r['poll_s']:g}s, blobs from the {r['blobs']}; "
              f"enrolled in {r['enroll_s']}s; "
              f"good release on every device {r['good_converge_s']}s after the rollout began; broken release halted "
              f"in step {r['bad_step']} after {r['bad_halt_s']}s, activated by {r['bad_activated']} device(s) "
              f"({r['bad_activated_pct']}% of the fleet), downloaded by {r['bad_downloaded']}; database "
              f"{r['db_bytes'] / 1e6:.1f} MB; simulator loop lag max {r['loop_lag_max_ms']} ms; steps admitting "
              f"at {r['admit_per_minute'] or 'the registry default'}/min, held {r['admission_held_pct']}% of the time")
        print(f"  halt reason: {r['bad_reason']}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=10000)
    p.add_argument("--poll", type=float, default=30.0)
    p.add_argument("--db", default="sqlite,postgresql")
    p.add_argument("--steady", type=float, default=60.0)
    p.add_argument("--soak", type=float, default=20.0, help="soak seconds per step")
    p.add_argument("--trial", type=float, default=5.0, help="trial seconds on the devices")
    p.add_argument("--telemetry", type=float, default=300.0, help="telemetry upload interval of every device")
    p.add_argument("--timeout", type=float, default=1200.0)
    p.add_argument("--json", type=Path, default=None, help="write the results here too")
    p.add_argument("--admit-per-minute", type=float, default=None,
                   help="the registry's rollout_admit_per_minute (default: the registry's own; 0: a step's "
                        "devices all at once)")
    p.add_argument("--shed-lag", type=float, default=0.1,
                   help="the registry's shed_loop_lag_s (0: never shed device writes; for comparison)")
    p.add_argument("--inline-blobs", action="store_true",
                   help="serve blobs from the registry API process (before the blob server; for comparison)")
    args = p.parse_args()
    dbs = [d.strip() for d in args.db.split(",") if d.strip()]
    results = []
    tmp = Path(tempfile.mkdtemp(prefix="edged-fleet-"))  # kept when a run fails: its logs say why
    os.chmod(tmp, 0o755)
    keys = Keys.make(tmp)
    cluster = None
    try:
        for db in dbs:
            if db == "postgresql" and cluster is None:
                cluster = PgCluster()
                cluster.start()
            results.append(run_one(db, args, tmp, keys, cluster if db == "postgresql" else None))
    except BaseException:
        print(f"the run's files (registry and simulator logs, status file) are kept in {tmp}", flush=True)
        raise
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    finally:
        if cluster is not None:
            cluster.stop()
    print_table(results)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
