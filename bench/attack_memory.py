"""Issue #36 attacks 3-5 at full size: what each costs a real ``edged run``, and what its neighbours see.

For each attack, against one daemon (``--memory-mb`` for its [limits] memory_mb; ``0`` leaves the
section out, so the daemon sizes it from the device profile; ``--old`` runs another checkout's edged,
whose config has no [limits]): the daemon's idle RSS, its peak RSS during the attack (sampled every
3 ms, and the kernel's high-water mark reset first), its RSS 10 s after, how the attack's requests
were answered, and a well-behaved client's digits rate and ``/v2/health/live`` p99 during the attack
as a ratio to the same client's rate measured just before it, in the same run.

    .venv/bin/python bench/attack_memory.py [--memory-mb 256] [--only audio,images,grpc,http] [--old PATH]

The attacks (as filed): an audio request of one 30 s clip and 400 one-sample clips; 12 requests at
once of two flat 5600x5600 PNGs; 16 gRPC ModelInfer messages of 60 MiB at once (of --grpc-mb when the
budget caps the message size lower); 16 HTTP bodies of 60 MiB at once.
"""

from __future__ import annotations

import argparse
import multiprocessing
import platform
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests import memory_attacks as ma  # noqa: E402


def host() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        model = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")
        cpus = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("CPU(s)")), "?")
    except OSError:
        model, cpus = platform.processor() or "?", "?"
    return f"{model}, {cpus} CPU(s), {platform.machine()}, Python {platform.python_version()}"


def in_child(fn: Callable[[], list[object]]) -> list[object]:
    """Run an attack in a forked process: its threads must not take the victim's interpreter lock."""
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)

    def run() -> None:
        child.send(fn())

    proc = ctx.Process(target=run)
    proc.start()
    out: list[object] = parent.recv()
    proc.join()
    return out


def baseline(d: ma.MemDaemon, seconds: float) -> ma.Victim:
    with ma.Victim(d.port) as v:
        time.sleep(seconds)
    return v


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--memory-mb", type=float, default=256, help="[limits] memory_mb (0: leave it out)")
    ap.add_argument("--only", default="audio,images,grpc,http")
    ap.add_argument("--grpc-mb", type=float, default=60, help="size of each gRPC message")
    ap.add_argument("--http-mb", type=float, default=60, help="size of each HTTP body")
    ap.add_argument("--image-side", type=int, default=5600, help="width and height of each flat PNG")
    ap.add_argument("--baseline-s", type=float, default=3.0)
    ap.add_argument("--old", type=Path, help="a checkout of the code before [limits] (its edged runs the daemon)")
    args = ap.parse_args()
    if args.old:
        ma.REPO_ROOT = args.old.resolve()
    attacks: dict[str, Callable[[ma.MemDaemon], list[object]]] = {
        "audio": lambda d: list(ma.audio_bomb(d, 400)),
        "images": lambda d: list(ma.image_flood(d, args.image_side, 2, 12)),
        "grpc": lambda d: list(ma.grpc_flood(d, args.grpc_mb, 16)),
        "http": lambda d: list(ma.http_flood(d, args.http_mb, 16)),
    }
    memory = None if args.old or not args.memory_mb else args.memory_mb
    print(f"host: {host()}")
    print(f"code: {'old checkout ' + str(args.old) if args.old else 'this checkout'}; "
          f"[limits] memory_mb = {memory if memory is not None else '(not set)'}")
    with tempfile.TemporaryDirectory() as tmp, ma.daemon(Path(tmp), memory, grpc_max_mb=max(64, args.grpc_mb + 1)) as d:
        for name in args.only.split(","):
            idle = ma.idle_rss(d)
            before = baseline(d, args.baseline_s)
            with ma.RssMonitor(d.proc.pid) as mon, ma.Victim(d.port) as during:
                t0 = time.monotonic()
                answers = Counter(in_child(partial(attacks[name], d)))
                took = time.monotonic() - t0
            time.sleep(10)
            after = d.rss
            ratio = during.rate / before.rate if before.rate else float("nan")
            print(f"{name:7s} answers {dict(answers)} in {took:.1f} s | RSS idle {idle / ma.MIB:.0f} MiB, "
                  f"peak +{(mon.peak - idle) / ma.MIB:.0f} MiB, 10 s after +{(after - idle) / ma.MIB:.0f} MiB | "
                  f"victim {during.rate:.0f}/s = {ratio:.2f}x its rate before ({before.rate:.0f}/s), "
                  f"{len(during.failed)} failed | health p99 {during.health_p99_ms:.1f} ms "
                  f"(before {before.health_p99_ms:.1f} ms)", flush=True)
            if d.proc.poll() is not None:
                print("the daemon died:", d.log.read_text()[-2000:])
                return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
