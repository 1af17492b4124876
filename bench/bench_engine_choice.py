"""Serve first, choose after: boot time to READY and the background choice under load, with real models.

    .venv/bin/python -m bench.bench_engine_choice [--models nudenet ocr_det ...] [--seconds 60]

Writes the public corpus (bench/real_corpus.py: ten models shipped in PyPI wheels, real shapes
declared) into a repository and starts a real daemon (``edged run``) with the host's device profile twice: first
with an empty state dir (nothing remembered), then again (the remembered choices). For each boot it
prints the seconds from start to ``/v2/health/ready``; during the first run it keeps one client per
model sending requests at the declared shape over HTTP (binary-free JSON) while the background
choice measures and swaps, and prints failed requests (goal 0) and every model's choice and when it
was made. Goals (issue 37): first boot <= 5 s, second <= 2 s, 0 failed requests, every choice made.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench import real_corpus
from bench.bench_real_models import raw_latency
from bench.real_corpus import Model
from edged.backends.benchmark import shape_label
from edged.client.http import HttpClient
from edged.errors import EdgedError
from tests.netutil import free_port

ROOT = Path(__file__).resolve().parent.parent


def boot(repo: Path, state: Path, port: int, log: Path) -> tuple[subprocess.Popen[bytes], float]:
    cfg = state.parent / "edged.toml"
    cfg.write_text(textwrap.dedent(f"""
        [device]
        id = "bench-choice"
        state_dir = "{state}"
        runtime_dir = "{state.parent / 'run'}"
        model_repository = "{repo}"
        [http]
        listen = "127.0.0.1:{port}"
        [mqtt]
        enabled = false
        """))
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "edged", "run", "--config", str(cfg)], cwd=ROOT,
                            stdout=log.open("ab"), stderr=subprocess.STDOUT)
    with httpx.Client() as c:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"daemon exited: {log.read_text()[-2000:]}")
            try:
                if c.get(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2).status_code == 200:
                    return proc, time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.02)


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


class Load:
    """One client per model (binary tensors over HTTP) at its declared shape, or at ``shapes``;
    counts answers and failures."""

    def __init__(self, url: str, models: list[Model], shapes: dict[str, tuple[int, ...]] | None = None,
                 pause_s: float = 0.05) -> None:
        self.ok = 0
        self.failed: list[str] = []
        self.shapes, self.pause_s = shapes, pause_s
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(url, m), daemon=True) for m in models]
        for t in self._threads:
            t.start()

    def _run(self, url: str, m: Model) -> None:
        x = m.sample(1, self.shapes)
        with HttpClient(url.removeprefix("http://"), timeout=120) as c:
            while not self._stop.is_set():
                try:
                    c.infer(m.name, x)
                    self.ok += 1
                except EdgedError as e:
                    self.failed.append(f"{m.name}: {e}")
                time.sleep(self.pause_s)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)


def choices(url: str, names: list[str]) -> dict[str, dict[str, Any]]:
    out = {}
    with httpx.Client() as c:
        for n in names:
            out[n] = c.get(f"{url}/v2/models/{n}", timeout=10).json()["parameters"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=[m.name for m in real_corpus.MODELS])
    ap.add_argument("--seconds", type=float, default=90.0, help="longest wait for every background choice")
    ap.add_argument("--converge", nargs="*", default=["ocr_det", "ocr_rec", "nudenet", "vad", "ddddocr"],
                    help="models whose traffic then moves to another shape (real_corpus.Model.other)")
    ap.add_argument("--skip-boot", action="store_true", help="only the convergence runs")
    ap.add_argument("--pause", type=float, default=0.2, help="each client's pause between requests (s)")
    args = ap.parse_args()
    if not args.skip_boot:
        boots(args)
    for name in args.converge:
        converge(next(m for m in real_corpus.MODELS if m.name == name))


def converge(m: Model, limit_s: float = 60.0) -> None:
    """Traffic at a shape unlike the warm-up: does the daemon end on the faster engine there, within
    ``limit_s``, without a failed request?"""
    files = real_corpus.fetch([m])
    raw = raw_latency(files[m.name], m.sample(1, m.other), 3.0, 6)
    if len(raw) < 2:
        print(f"converge {m.name}: only {list(raw)} runs {m.other}; nothing to converge to")
        return
    faster = min(raw, key=lambda k: raw[k])
    gap = max(raw.values()) / min(raw.values())
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "models"
        real_corpus.write_version(repo, m, files[m.name])
        state = Path(tmp) / "state"
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc, _ = boot(repo, state, port, Path(tmp) / "edged.log")
        try:
            t0 = time.monotonic()
            while (choices(url, [m.name])[m.name].get("choice") or {}).get("state") not in ("chosen", "single"):
                if time.monotonic() - t0 > 120:
                    break
                time.sleep(0.2)
            before = choices(url, [m.name])[m.name]
            want = shape_label(m.sample(1, m.other), 1, m.batched).partition("@")[0]
            load = Load(url, [m], m.other, pause_s=0.0)
            t0 = time.monotonic()
            took = None
            try:
                while time.monotonic() - t0 < limit_s:
                    now = choices(url, [m.name])[m.name]
                    measured_on = (now.get("choice") or {}).get("measured_on") or {}
                    on_traffic = any(k.partition("@")[0] == want for k in measured_on)
                    if now["backend"] == faster and on_traffic:
                        took = time.monotonic() - t0
                        break
                    time.sleep(0.25)
                time.sleep(1.0)
            finally:
                load.stop()
            now = choices(url, [m.name])[m.name]
        finally:
            stop(proc)
    shapes = {n: list(s) for n, s in m.other.items()}
    print(f"converge {m.name}: warm-up {before['backend']} -> traffic {shapes}: raw there "
          + ", ".join(f"{k} {v:.2f} ms" for k, v in raw.items()) + f" (gap {gap:.2f}x, faster {faster}); "
          f"daemon on {now['backend']} "
          + (f"after {took:.1f} s" if took is not None else f"NOT within {limit_s:.0f} s")
          + f"; {load.ok} answered, {len(load.failed)} failed (goal 0)  {now.get('chosen_how') or ''}")
    for f in load.failed[:3]:
        print("   ", f)


def boots(args: argparse.Namespace) -> None:
    models = [m for m in real_corpus.MODELS if m.name in args.models]
    files = real_corpus.fetch(models)
    one, five, _ = os.getloadavg()
    print(f"{len(models)} models; load average {one:.2f} / {five:.2f} on {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "models"
        for m in models:
            real_corpus.write_version(repo, m, files[m.name])
        state = Path(tmp) / "state"
        log = Path(tmp) / "edged.log"
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc, first = boot(repo, state, port, log)
        print(f"first boot (nothing remembered) to READY: {first:.2f} s   (goal <= 5 s)")
        load = Load(url, models, pause_s=args.pause)
        t0 = time.monotonic()
        try:
            while True:
                now = choices(url, [m.name for m in models])
                done = {n: p for n, p in now.items() if (p.get("choice") or {}).get("measurements", 0) >= 1
                        or p.get("choice") is None}
                if len(done) == len(models) or time.monotonic() - t0 > args.seconds:
                    break
                time.sleep(0.5)
            took = time.monotonic() - t0
            time.sleep(1.0)
        finally:
            load.stop()
        print(f"background choice of {len(done)}/{len(models)} models done {took:.1f} s after READY, "
              f"under load: {load.ok} requests answered, {len(load.failed)} failed   (goal 0)")
        for f in load.failed[:5]:
            print("   ", f)
        for n, p in now.items():
            sw = (p.get("choice") or {}).get("switches") or []
            print(f"  {n:<12} {p['backend']:<12} {p.get('chosen_how') or '-'}"
                  + (f"  [switched {sw[-1]['from']} -> {sw[-1]['to']}]" if sw else ""))
        first_choice = {n: p["backend"] for n, p in now.items()}
        stop(proc)
        proc, second = boot(repo, state, port, log)
        print(f"second boot (choices remembered) to READY: {second:.2f} s   (goal <= 2 s)")
        again = {n: p["backend"] for n, p in choices(url, [m.name for m in models]).items()}
        stop(proc)
        for line in log.read_text().splitlines():
            if " ready on " in line or "edged ready in" in line:
                print("   log:", line[-160:])
        same = sum(first_choice[n] == again[n] for n in again)
        print(f"second boot serves the remembered engine on {same}/{len(again)} models")


if __name__ == "__main__":
    main()
