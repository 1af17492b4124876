"""``python -m bench.sim``: a fleet of lightweight simulated devices against a real registry.

Every device runs the real sync decisions and checks (see :mod:`bench.sim.device`)
on one asyncio loop, sharing a pool of keep-alive connections; the process is meant to run
apart from the registry so that the registry is what gets measured. It enrolls the
devices, then polls like the daemon's agent (every ``--poll`` seconds +-20 %), follows
rollouts, and writes a status file every second (devices per committed release, updates
in progress, activations, request counts) and, when stopped (SIGINT/SIGTERM or
``--duration``), every request's latency to ``--samples`` (``.npz``) for the benchmark.

    python -m bench.sim --url http://127.0.0.1:8700 --enroll-token edge_... --public-key KEY \\
        --devices 10000 --poll 30 --start digits:1:1 --behave 3:trial_fail=1 --status-file fleet.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from edged.fsutil import atomic_write_text

DEFAULT_FACTS = {"profile": "sim-x86-64", "cpu.arch": "x86_64"}


def _kv(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: expected key=value")
    return key, value


def _behaviour(text: str) -> tuple[int, dict[str, float]]:
    """``VERSION:key=value[,key=value]`` with keys prepare_fail, trial_fail, error_rate, p99_ms."""
    head, _, rest = text.partition(":")
    if not head.isdigit() or not rest:
        raise argparse.ArgumentTypeError(f"{text!r}: expected VERSION:key=value[,key=value]")
    out = {}
    for item in rest.split(","):
        k, v = _kv(item)
        if k not in ("prepare_fail", "trial_fail", "error_rate", "p99_ms"):
            raise argparse.ArgumentTypeError(f"{k!r}: one of prepare_fail, trial_fail, error_rate, p99_ms")
        out[k] = float(v)
    return int(head), out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.sim",
                                description="run N simulated devices against a registry (load and rollout tests)")
    p.add_argument("--url", default=os.environ.get("EDGED_REGISTRY_URL", "http://127.0.0.1:8700"))
    p.add_argument("--enroll-token", required=True, help="an enrollment token with enough uses")
    p.add_argument("--public-key", action="append", required=True, dest="public_keys",
                   help="release-signing key the devices trust; repeatable")
    p.add_argument("--devices", type=int, default=1000)
    p.add_argument("--poll", type=float, default=30.0, help="poll interval in seconds (default 30)")
    p.add_argument("--id-prefix", default="sim-")
    p.add_argument("--label", type=_kv, action="append", default=[],
                   help="label of every device, asked for at enrollment: the enrollment token must carry it "
                        "(enroll-token --label), devices cannot label themselves")
    p.add_argument("--fact", type=_kv, action="append", default=[], help="reported fact of every device")
    p.add_argument("--start", default=None, metavar="MODEL:VERSION:RELEASE",
                   help="the devices already run this release (a fleet before a rollout)")
    p.add_argument("--behave", type=_behaviour, action="append", default=[], metavar="VERSION:key=value,...",
                   help="prepare_fail, trial_fail (shares of devices), error_rate, p99_ms of a version")
    p.add_argument("--trial", type=float, default=5.0, help="trial seconds on a device (default 5)")
    p.add_argument("--prepare", type=float, default=0.5, help="seconds to load and check a version (default 0.5)")
    p.add_argument("--telemetry", type=float, default=0.0, help="upload telemetry every N seconds (0: never)")
    p.add_argument("--facts-interval", type=float, default=300.0)
    p.add_argument("--no-download", action="store_true", help="do not fetch release files (faster, less real)")
    p.add_argument("--connections", type=int, default=4096,
                   help="at most this many connections (real devices each have their own; keep it high so "
                        "the simulator never queues requests itself)")
    p.add_argument("--enroll-concurrency", type=int, default=16)
    p.add_argument("--duration", type=float, default=0.0, help="stop after this many seconds (0: on a signal)")
    p.add_argument("--status-file", type=Path, default=None)
    p.add_argument("--samples", type=Path, default=None, help=".npz of every request: t, kind, status, latency")
    p.add_argument("--seed", type=int, default=0)
    return p


class Fleet:
    def __init__(self, args: argparse.Namespace) -> None:
        from bench.sim.device import Behaviour, FleetContext, SimDevice, Stats, sim_settings
        from bench.sim.http_pool import HttpPool

        self.args = args
        self.stats = Stats()
        self.samples_saved = False
        self.http = HttpPool(args.url, limit=args.connections)
        behaviours = {v: Behaviour(**kw) for v, kw in args.behave}
        self.ctx = FleetContext(http=self.http, public_keys=list(args.public_keys), poll_s=args.poll,
                                behaviours=behaviours, stats=self.stats, settings=sim_settings(args.trial),
                                trial_s=args.trial, prepare_s=args.prepare, facts_s=args.facts_interval,
                                telemetry_s=args.telemetry, download=not args.no_download)
        facts = {**DEFAULT_FACTS, **dict(args.fact)}
        rng = random.Random(args.seed)
        width = len(str(args.devices))
        self.devices = [SimDevice(self.ctx, f"{args.id_prefix}{i:0{width}d}", labels=dict(args.label), facts=facts,
                                  seed=rng.getrandbits(64)) for i in range(args.devices)]
        self.model: str | None = None
        if args.start:
            model, version, release = args.start.split(":")
            self.model = model
            for d in self.devices:
                d.adopt(model, int(version), int(release))
        self.enrolled = 0
        self.phase = "enrolling"
        self.loop_lag_max = 0.0

    async def enroll_all(self) -> None:
        sem = asyncio.Semaphore(self.args.enroll_concurrency)

        async def one(d: Any) -> None:
            async with sem:
                await d.enroll(self.args.enroll_token)
                self.enrolled += 1

        await asyncio.gather(*(one(d) for d in self.devices))

    def status(self) -> dict[str, Any]:
        current: Counter[str] = Counter()
        pending: Counter[str] = Counter()
        model = self.model or next((m for d in self.devices for m in d.state.models), None)
        for d in self.devices:
            if model is None:
                break
            rel, step = d.where(model)
            current[str(rel)] += 1
            if step is not None:
                pending[step] += 1
        s = self.stats
        return {"t": time.time(), "elapsed_s": time.monotonic() - s.started, "phase": self.phase,
                "devices": len(self.devices), "enrolled": self.enrolled, "model": model,
                "current": dict(current), "pending": dict(pending), "activated": dict(s.activated),
                "downloads": dict(s.downloads), "reverted": dict(s.reverted), "steps": dict(s.steps),
                "requests": dict(s.requests), "errors": dict(s.errors), "cycle_failures": s.cycle_failures,
                "loop_lag_max_ms": self.loop_lag_max * 1000}

    async def _status_writer(self) -> None:
        path = self.args.status_file
        while True:
            if path is not None:
                await asyncio.to_thread(atomic_write_text, path, json.dumps(self.status()))
            await asyncio.sleep(1.0)

    def dump_tasks(self) -> None:
        """SIGUSR1: where every device task is waiting, counted (to find what holds a fleet up)."""
        where: Counter[str] = Counter()
        for task in asyncio.all_tasks():
            frames = task.get_stack(limit=20)
            where[" <- ".join(f"{f.f_code.co_name}:{f.f_lineno}" for f in reversed(frames[-4:]))] += 1
        for k, n in where.most_common(15):
            print(f"{n:6d} {k}", file=sys.stderr, flush=True)

    async def _lag_monitor(self) -> None:
        """How late the loop wakes up: if this grows, the simulator (not the registry) is the bottleneck."""
        while True:
            t0 = time.monotonic()
            await asyncio.sleep(0.1)
            self.loop_lag_max = max(self.loop_lag_max, time.monotonic() - t0 - 0.1)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGUSR1, self.dump_tasks)
        writer = loop.create_task(self._status_writer())
        await self.enroll_all()
        self.phase = "polling"
        monitor = loop.create_task(self._lag_monitor())
        rng = random.Random(self.args.seed + 1)
        tasks = [loop.create_task(d.run_forever(rng.uniform(0, self.args.poll))) for d in self.devices]
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), self.args.duration or None)
        self.phase = "stopped"
        if self.args.samples is not None:  # first: what the benchmark needs, however the rest goes
            self.save_samples(self.args.samples)
        for t in [*tasks, monitor]:
            t.cancel()
        await asyncio.wait([*tasks, monitor], timeout=60)
        writer.cancel()
        if self.args.status_file is not None:
            atomic_write_text(self.args.status_file, json.dumps(self.status()))
        self.ctx.close()

    def save_samples(self, path: Path) -> None:
        import numpy as np

        if self.samples_saved:
            return
        self.samples_saved = True
        a = self.stats.samples
        np.savez(path, t=np.array([x[0] for x in a], dtype=np.float64),
                 kind=np.array([x[1] for x in a], dtype=np.int8), status=np.array([x[2] for x in a], dtype=np.int16),
                 latency=np.array([x[3] for x in a], dtype=np.float32))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    fleet = Fleet(args)
    try:
        asyncio.run(fleet.run())
    finally:
        if args.samples is not None:
            fleet.save_samples(args.samples)
    st = fleet.status()
    print(json.dumps({k: st[k] for k in ("devices", "enrolled", "current", "activated", "requests", "errors",
                                         "loop_lag_max_ms")}), file=sys.stderr)
    return 0
