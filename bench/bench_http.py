"""HTTP (KServe v2) overhead over the raw in-process engine, on the bundled CNN (mobilenet, batch 1).

One run measures, on the same machine and in this order:
  1. raw: the engine edged loads for mobilenet (same device profile, same threads), called in-process;
  2. a real ``edged run`` daemon (HTTP only) spawned as a subprocess, which is what users talk to:
     binary tensors at concurrency 1 and 8, and JSON at concurrency 1, with edged's own HTTP client;
  3. optionally (``--tritonclient``) the same binary request through ``tritonclient.http``.
It prints median / p99 latency, throughput, the overhead over raw and the ratio to each goal
(binary: median overhead <= 0.3 ms; JSON with the 110 KB input: <= 2 ms).

    .venv/bin/python bench/bench_http.py [--seconds 4] [--tritonclient] [--inprocess]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edged.client.http import HttpClient  # noqa: E402
from edged.config import parse_config  # noqa: E402

GOAL_BINARY_MS = 0.3
GOAL_JSON_MS = 2.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def measure(fn: Callable[[], object], seconds: float, max_n: int = 20000, warmup: int = 20) -> list[float]:
    """Latencies in ms of calling fn back to back for about ``seconds`` (after a short warm-up)."""
    for _ in range(warmup):
        fn()
    out: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end and len(out) < max_n:
        t0 = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t0) / 1e6)
    return out


def concurrent(make: Callable[[], Callable[[], object]], threads: int, seconds: float) -> tuple[list[float], float]:
    """(latencies ms, requests/s) with ``threads`` callers, each with its own client."""
    fns = [make() for _ in range(threads)]
    for fn in fns:
        fn()
    lats: list[list[float]] = [[] for _ in range(threads)]
    start = threading.Barrier(threads + 1)
    stop_at = [0.0]

    def run(i: int) -> None:
        start.wait()
        while time.perf_counter() < stop_at[0]:
            t0 = time.perf_counter_ns()
            fns[i]()
            lats[i].append((time.perf_counter_ns() - t0) / 1e6)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    stop_at[0] = time.perf_counter() + seconds
    t0 = time.perf_counter()
    start.wait()
    for t in ts:
        t.join()
    elapsed = time.perf_counter() - t0
    flat = [x for lst in lats for x in lst]
    return flat, len(flat) / elapsed


def summary(lat: list[float]) -> tuple[float, float]:
    s = sorted(lat)
    return statistics.median(s), s[min(len(s) - 1, int(0.99 * len(s)))]


class RawEngine:
    """The engine edged itself picks for mobilenet (same profile, same threads), kept loaded in-process."""

    def __init__(self, cfg_path: Path) -> None:
        from edged.config import load_config
        from edged.daemon import build_runtime

        self.rt = build_runtime(load_config(cfg_path))
        mv = self.rt.manager.table.find("mobilenet")
        dv = self.rt.manager.table.find("digits")
        assert mv is not None and mv.engine is not None, "mobilenet did not load"
        assert dv is not None and dv.engine is not None, "digits did not load"
        self.engine, self.digits = mv.engine, dv.engine
        self.label = mv.candidate.label if mv.candidate else "?"

    def infer(self, x: np.ndarray) -> object:
        return self.engine.infer({"image": x})

    def infer_digits(self, x: np.ndarray) -> object:
        return self.digits.infer({"pixels": x})

    def close(self) -> None:
        self.rt.manager.shutdown()


EngineClock = Callable[[], tuple[int, int]]  # cumulative (engine ns, engine runs) of a model in the daemon


def interleaved(cases: dict[str, Callable[[], object]], seconds: float, clocks: dict[str, EngineClock],
                rounds: int = 8) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Alternate short blocks of every case so that drifting machine load hits all of them alike.

    Returns the latencies per case and, for cases with an engine clock, the mean time the daemon's
    own engine spent per request during exactly those requests (from its statistics, in ms).
    """
    out: dict[str, list[float]] = {k: [] for k in cases}
    engine: dict[str, list[int]] = {k: [0, 0] for k in clocks}
    for _ in range(rounds):
        for name, fn in cases.items():
            time.sleep(0.02)  # let the previous case's spinning engine threads go idle
            for _ in range(5):
                fn()
            before = clocks[name]() if name in clocks else (0, 0)
            out[name] += measure(fn, seconds / rounds, warmup=0)
            if name in clocks:
                after = clocks[name]()
                engine[name][0] += after[0] - before[0]
                engine[name][1] += after[1] - before[1]
    return out, {k: ns / n / 1e6 for k, (ns, n) in engine.items() if n}


def http_only_config(tmp: Path, repo: Path, port: int, device_extra: str = "") -> Path:
    """An edged.toml serving ``repo`` over HTTP only (no shm, MQTT, telemetry), its state under ``tmp``."""
    cfg_path = tmp / "edged.toml"
    cfg_path.write_text(f"""
[device]
id = "bench"
state_dir = "{tmp / 'state'}"
runtime_dir = "{tmp / 'run'}"
model_repository = "{repo}"
{device_extra}
[http]
listen = "127.0.0.1:{port}"
[shm]
enabled = false
[mqtt]
enabled = false
[telemetry]
enabled = false
[logging]
level = "warning"
""")
    return cfg_path


def start_daemon(cfg_path: Path, url: str, inprocess: bool, model: str = "mobilenet") -> subprocess.Popen[bytes]:
    """``edged run`` on ``cfg_path``, returned once ``model`` is ready."""
    if inprocess:  # the transport alone, without the daemon's CLI (for when `edged run` is unavailable)
        code = ("import asyncio,sys; from edged.config import load_config; from edged.daemon import Daemon; "
                "asyncio.run(Daemon(load_config(__import__('pathlib').Path(sys.argv[1]))).serve())")
        argv = [sys.executable, "-c", code, str(cfg_path)]
    else:
        exe = ROOT / ".venv" / "bin" / "edged"
        argv = [str(exe)] if exe.exists() else [sys.executable, "-m", "edged"]
        argv += ["run", "--config", str(cfg_path)]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    client = HttpClient(url, timeout=2)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode() if proc.stderr else ""
            raise SystemExit(f"edged run exited with {proc.returncode}:\n{err[-3000:]}")
        try:
            if client.ready(model):
                client.close()
                return proc
        except Exception:
            pass
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("edged run did not become ready within 60 s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=4.0, help="measuring time per case")
    ap.add_argument("--tritonclient", action="store_true", help="also time tritonclient.http (binary)")
    ap.add_argument("--inprocess", action="store_true", help="run the daemon via python -c, not `edged run`")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="edged-bench-http-"))
    try:
        for name in ("mobilenet", "digits"):
            shutil.copytree(ROOT / "models" / name, tmp / "models" / name)
        port = free_port()
        cfg_path = http_only_config(tmp, tmp / "models", port)
        parse_config(cfg_path.read_text(), source=cfg_path)
        rng = np.random.default_rng(0)
        x = rng.random((1, 3, 48, 192), dtype=np.float32)
        xd = rng.random((1, 64), dtype=np.float32) * 16
        print(f"input: image FP32 {list(x.shape)} = {x.nbytes} bytes; {args.seconds:.0f} s per case")

        raw = RawEngine(cfg_path)
        print(f"in-process engine: {raw.label}")
        url = f"127.0.0.1:{port}"
        proc = start_daemon(cfg_path, url, args.inprocess)
        rows: list[tuple[str, list[float], float]] = []
        engine_ms: dict[str, float] = {}
        try:
            with HttpClient(url) as c:
                p = c.metadata("mobilenet")["parameters"]
                served_by = f"{p['backend']}/{p['device']}/{p['precision']}"
                print(f"daemon engine: {served_by}")
                if not raw.label.startswith(served_by):
                    print("WARNING: the daemon picked another engine than the in-process run; ratios compare "
                          "different engines")
                got = c.infer("mobilenet", {"image": x})["probabilities"]
                want = raw.infer(x)["probabilities"]  # type: ignore[index]
                assert np.allclose(got, want, atol=1e-5), "HTTP and in-process results differ"
                cases: dict[str, Callable[[], object]] = {
                    "raw engine, in-process": lambda: raw.infer(x),
                    "HTTP binary, c=1": lambda: c.infer("mobilenet", {"image": x}),
                    "HTTP JSON, c=1": lambda: c.infer("mobilenet", {"image": x}, binary=False),
                    # the transport's floor: a model that computes in microseconds, 256-byte input
                    "digits raw engine": lambda: raw.infer_digits(xd),
                    "digits HTTP binary, c=1": lambda: c.infer("digits", {"pixels": xd}),
                }
                if args.tritonclient:
                    import tritonclient.http as th  # type: ignore[import-untyped]

                    tc = th.InferenceServerClient(url)
                    inp = th.InferInput("image", list(x.shape), "FP32")
                    inp.set_data_from_numpy(x, binary_data=True)
                    outs = [th.InferRequestedOutput("probabilities", binary_data=True)]
                    cases["tritonclient binary, c=1"] = lambda: tc.infer("mobilenet", [inp], outputs=outs)
                stats_client = HttpClient(url)

                def clock(model: str) -> EngineClock:
                    def read() -> tuple[int, int]:
                        st = stats_client.statistics(model)[0]["inference_stats"]["compute_infer"]
                        return int(st["ns"]), int(st["count"])
                    return read

                clocks = {k: clock("digits" if k.startswith("digits") else "mobilenet")
                          for k in cases if "HTTP" in k or "tritonclient" in k}
                res, engine_ms = interleaved(cases, args.seconds, clocks)
                stats_client.close()
                for name, lat in res.items():
                    rows.append((name, lat, 1000 / statistics.median(lat)))
            x8 = np.repeat(x, 8, axis=0)
            lat8 = measure(lambda: raw.infer(x8), args.seconds / 2)
            rows.append(("raw engine, batch 8", lat8, 8000 / statistics.median(lat8)))
            raw.close()

            def make_caller() -> Callable[[], object]:
                cli = HttpClient(url)
                return lambda: cli.infer("mobilenet", {"image": x})

            lat, rps = concurrent(make_caller, 8, args.seconds)
            rows.append(("HTTP binary, c=8", lat, rps))
        finally:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()

        raw_med = summary(rows[0][1])[0]
        print("\noverhead = median latency - median raw in-process latency; 'vs daemon engine' = mean latency - "
              "mean time\nthe daemon's engine spent on those same requests (from its statistics; immune to the raw "
              "run's noise)")
        print(f"\n{'case':28} {'n':>6} {'median ms':>10} {'p99 ms':>8} {'req/s':>8} {'overhead ms':>12} "
              f"{'vs daemon engine':>17}")
        for name, lat, rps in rows:
            med, p99 = summary(lat)
            if name.startswith("digits HTTP"):
                over = f"{med - summary(next(r[1] for r in rows if r[0] == 'digits raw engine'))[0]:12.3f}"
            elif name.startswith(("raw", "HTTP binary, c=8", "digits raw")):
                over = ""
            else:
                over = f"{med - raw_med:12.3f}"
            direct = f"{statistics.fmean(lat) - engine_ms[name]:17.3f}" if name in engine_ms else ""
            print(f"{name:28} {len(lat):6d} {med:10.3f} {p99:8.3f} {rps:8.0f} {over:>12} {direct:>17}")
        by = {name: summary(lat)[0] for name, lat, _ in rows}
        ob = by["HTTP binary, c=1"] - raw_med
        oj = by["HTTP JSON, c=1"] - raw_med
        od = by["digits HTTP binary, c=1"] - by["digits raw engine"]
        print(f"\ntransport floor (digits, binary, c=1): {od:.3f} ms over its raw engine")
        print(f"binary c=1 overhead {ob:.3f} ms vs goal {GOAL_BINARY_MS} ms: ratio {ob / GOAL_BINARY_MS:.2f} "
              f"({'met' if ob <= GOAL_BINARY_MS else 'MISSED'}); latency ratio http/raw "
              f"{by['HTTP binary, c=1'] / raw_med:.2f}")
        print(f"JSON   c=1 overhead {oj:.3f} ms vs goal {GOAL_JSON_MS} ms: ratio {oj / GOAL_JSON_MS:.2f} "
              f"({'met' if oj <= GOAL_JSON_MS else 'MISSED'}); latency ratio http/raw "
              f"{by['HTTP JSON, c=1'] / raw_med:.2f}")
        c8 = next(rps for name, _, rps in rows if name == "HTTP binary, c=8")
        b8 = next(rps for name, _, rps in rows if name == "raw engine, batch 8")
        print(f"binary c=8 throughput {c8:.0f} req/s = {c8 * raw_med / 1000:.2f}x raw batch-1 throughput, "
              f"{c8 / b8:.2f}x raw batch-8 throughput (client threads share these cores)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
