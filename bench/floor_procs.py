"""The least batcher across processes: the floor under serving with engine instances in worker processes.

    .venv/bin/python -m bench.floor_procs [--seconds 2] [--rounds 4] [--workers 1,2]

Issue 41: on one interpreter every request's batching, futures and wake-ups share one lock, so the
least in-process batching service (bench/floor_service.py) stops at half of what the engine does on
16 cores. The design measured here moves the engine out of the front process: caller threads in the
front, batches assembled where the requests arrive (whatever waits, up to 8), each batch written
straight into the shared memory (a memfd) of one of K engine worker processes, a four-byte control
message over a SOCK_SEQPACKET pair per batch, the answer rows copied back to the callers. Each worker
is a fresh interpreter with its own ONNX Runtime session of the same model, intra-op threads = usable
CPUs / K. No pickling, no statistics, no version lookup: what is left is what any such design pays.

It prints, in alternating rounds on the bundled mobilenet: raw engine b1 and b8 and the in-process
least batcher (this process; also with its engine split into K sessions of CPUs / K threads, one
worker thread each, so that what the processes add beyond the split shows), and the cross-process
one for K = 1, 2 (and usable CPUs // 4 when that is more), at 1, 8 and 32 callers, each against the
better raw reference and the in-process least batcher at the same concurrency in the same round;
and the host (CPU, cores, load average).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import socket
import struct
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import stop_process
from bench.floor_service import LeastBatcher

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "mobilenet" / "1" / "model.onnx"
_BATCH = struct.Struct("=I")  # the control message: rows in the input area
_OK = b"\0"
_ALIGN = 64
_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
           "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(uint8)": np.uint8}


def usable_cpus() -> int:
    """The CPUs this process may run on (affinity; a cgroup quota is not read here)."""
    return len(os.sched_getaffinity(0))


Area = tuple[str, list[int], str, int]  # name, row shape, dtype, offset


def _areas(specs: list[tuple[str, list[int], str]], max_batch: int) -> tuple[list[Area], int]:
    """Offsets of each tensor's area (``max_batch`` rows) in the shared memory, and its size."""
    out: list[Area] = []
    offset = 0
    for name, row, dtype in specs:
        out.append((name, row, dtype, offset))
        size = max_batch * int(np.prod(row, dtype=np.int64)) * np.dtype(dtype).itemsize
        offset += -(-size // _ALIGN) * _ALIGN
    return out, offset


def _views(buf: mmap.mmap, areas: list[Area], max_batch: int) -> dict[str, np.ndarray]:
    return {name: np.ndarray((max_batch, *row), dtype=dtype, buffer=buf, offset=off) for name, row, dtype, off in areas}


# ---- the worker process -------------------------------------------------------------------------
def serve(fd: int, model: Path, threads: int, max_batch: int) -> None:
    """The engine worker: makes its shared memory, hands its descriptor and layout to the front, then
    runs one batch per control message until the front closes the socket."""
    from bench.floor_engine import session

    sock = socket.socket(fileno=fd)
    sess = session(model, threads)
    spec = sess.get_inputs()[0]
    row = [int(d) for d in spec.shape[1:]]
    dtype = np.dtype(_DTYPES[spec.type]).str
    probe = sess.run(None, {spec.name: np.zeros((1, *row), dtype=dtype)})  # allocates; learns the outputs
    outs = [(o.name, list(v.shape[1:]), v.dtype.str) for o, v in zip(sess.get_outputs(), probe, strict=True)]
    areas, size = _areas([(spec.name, row, dtype), *outs], max_batch)
    memfd = os.memfd_create("edged-floor-procs", os.MFD_CLOEXEC)
    os.ftruncate(memfd, size)
    buf = mmap.mmap(memfd, size)
    socket.send_fds(sock, [json.dumps({"areas": areas, "size": size, "input": spec.name}).encode()], [memfd])
    os.close(memfd)
    views = _views(buf, areas, max_batch)
    x, names = views[spec.name], [o[0] for o in outs]
    while msg := sock.recv(64):
        n = _BATCH.unpack(msg)[0]
        try:
            for name, v in zip(names, sess.run(names, {spec.name: x[:n]}), strict=True):
                views[name][:n] = v
        except Exception as e:  # the front's callers hear of it; the worker stays
            sock.send(b"E" + str(e).encode()[:4000])
            continue
        sock.send(_OK)


# ---- the front ----------------------------------------------------------------------------------
class Worker:
    """One engine worker process (a fresh interpreter, not a fork of a threaded one) and its shared memory."""

    def __init__(self, model: Path, threads: int, max_batch: int = 8) -> None:
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.floor_procs", "--serve", str(theirs.fileno()), "--model", str(model),
             "--threads", str(threads), "--max-batch", str(max_batch)],
            pass_fds=(theirs.fileno(),), cwd=ROOT)
        theirs.close()
        try:
            msg, fds, _, _ = socket.recv_fds(self.sock, 65536, 1)
            if not fds:
                raise RuntimeError(f"the engine worker did not start (exit {self.proc.wait(10)})")
        except BaseException:
            self.close()
            raise
        layout = json.loads(msg)
        self._buf = mmap.mmap(fds[0], layout["size"])
        os.close(fds[0])
        views = _views(self._buf, [(a[0], a[1], a[2], a[3]) for a in layout["areas"]], max_batch)
        self._x = views.pop(layout["input"])
        self._outs = views

    def run(self, xs: list[np.ndarray]) -> Mapping[str, np.ndarray]:
        """The batch written into the worker's input area, run there; the output rows copied out."""
        n = sum(len(x) for x in xs)
        np.concatenate(xs, out=self._x[:n])
        self.sock.send(_BATCH.pack(n))
        reply = self.sock.recv(4096)
        if reply != _OK:
            raise RuntimeError(reply[1:].decode(errors="replace") if reply else "the engine worker exited")
        return {name: v[:n].copy() for name, v in self._outs.items()}

    def close(self) -> None:
        self.sock.close()  # the worker sees end of file and exits
        stop_process(self.proc, 10)
        buf = getattr(self, "_buf", None)
        if buf is not None:
            self.__dict__.pop("_x", None)
            self.__dict__.pop("_outs", None)
            buf.close()


class ProcBatcher:
    """The least batcher across processes: callers' requests batched here, run by ``workers`` engine
    processes of ``usable_cpus() // workers`` intra-op threads each (at least one)."""

    def __init__(self, model: Path, workers: int, max_batch: int = 8, threads: int | None = None) -> None:
        threads = threads or max(1, usable_cpus() // workers)
        self.workers: list[Worker] = []
        try:
            for _ in range(workers):
                self.workers.append(Worker(model, threads, max_batch))
        except BaseException:
            self.close()
            raise
        self._batcher = LeastBatcher(max_batch=max_batch, lanes=[w.run for w in self.workers])

    def infer(self, x: np.ndarray) -> Any:
        return self._batcher.infer(x)

    def close(self) -> None:
        if hasattr(self, "_batcher"):
            self._batcher.close()
        for w in self.workers:
            w.close()


# ---- the measurement ----------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=2.0, help="measured seconds per case, over all rounds")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--workers", default=None, help="K values, comma-separated (default 1,2 and usable CPUs // 4)")
    ap.add_argument("--callers", default="1,8,32")
    ap.add_argument("--model", type=Path, default=MODEL)
    args = ap.parse_args()
    from bench.floor_engine import session
    from bench.run_suite import Case, machine, run_rounds, serial, threaded

    cpus = usable_cpus()
    ks = [int(k) for k in args.workers.split(",")] if args.workers else [1, 2, *([cpus // 4] if cpus // 4 > 2 else [])]
    callers = [int(c) for c in args.callers.split(",")]
    load_before = os.getloadavg()
    print(f"machine: {machine()}; usable CPUs {cpus}; load average {load_before[0]:.2f}", flush=True)
    engine = session(args.model)  # in this process, the library's default threads: the raw references
    name = engine.get_inputs()[0].name
    row = [int(d) for d in engine.get_inputs()[0].shape[1:]]
    x1 = np.random.default_rng(0).random((1, *row), dtype=np.float32)
    x8 = np.repeat(x1, 8, axis=0)
    want = engine.run(None, {name: x1})
    outputs = [o.name for o in engine.get_outputs()]

    def lane(sess: Any) -> Any:
        return lambda xs: dict(zip(outputs, sess.run(None, {name: np.concatenate(xs)}), strict=True))

    least = LeastBatcher(lanes=[lane(engine)])
    # The same split of the cores in this process (k sessions of cpus // k threads, one lane each):
    # what the processes win beyond splitting the engine's threads is theirs.
    split = {k: LeastBatcher(lanes=[lane(session(args.model, max(1, cpus // k))) for _ in range(k)])
             for k in ks if k > 1}
    procs = {k: ProcBatcher(args.model, k) for k in ks}
    try:
        for pb in procs.values():  # the floor's numbers are for correct work
            assert np.allclose(next(iter(pb.infer(x1).values())), want[0], atol=1e-5)
        cases = [Case("raw1", "raw engine b1", lambda s: serial(lambda: engine.run(None, {name: x1}), s)),
                 Case("raw8", "raw engine b8", lambda s: serial(lambda: engine.run(None, {name: x8}), s, 8))]
        for c in callers:
            cases.append(Case(f"least{c}", f"least batcher in-process, c{c}",
                              lambda s, c=c: threaded(lambda: least.infer(x1), c, s)))
            for k, sb in split.items():
                threads = max(1, cpus // k)
                cases.append(Case(f"split{k}_{c}", f"least batcher in-process, {k} sessions of {threads} "
                                  f"thread{'s' * (threads > 1)}, c{c}",
                                  lambda s, c=c, sb=sb: threaded(lambda: sb.infer(x1), c, s)))
            for k, pb in procs.items():
                threads = max(1, cpus // k)
                cases.append(Case(f"procs{k}_{c}", f"least batcher across {k} process{'es' * (k > 1)} "
                                  f"({threads} thread{'s' * (threads > 1)} each), c{c}",
                                  lambda s, c=c, pb=pb: threaded(lambda: pb.infer(x1), c, s)))
        run_rounds(cases, args.rounds, args.seconds / args.rounds)
    finally:
        for b in [least, *split.values()]:
            b.close()
        for pb in procs.values():
            pb.close()
    load_after = os.getloadavg()
    print(table({c.key: c for c in cases}, callers, ks))
    print(f"\n{args.rounds} rounds x {args.seconds / args.rounds:.2f} s per case, cases alternating; value = median "
          f"over rounds; ratio = median of per-round ratios to the reference in the same round; raw b1/b8 = "
          f"samples per call / median latency, batchers = samples / wall time; /raw wall: both by wall time."
          f"\nhost: {machine()}, usable CPUs {cpus}; load average "
          f"{load_before[0]:.2f} before, {load_after[0]:.2f} after")
    return 0


def table(c: dict[str, Any], callers: list[int], ks: list[int]) -> str:
    import statistics

    raw1, raw8 = c["raw1"], c["raw8"]
    best = [max(a.throughput, b.throughput) for a, b in zip(raw1.blocks, raw8.blocks, strict=True)]
    # Like for like: the raw references by wall time too, which counts other tenants' stalls as the batchers' does.
    best_wall = [max(a.wall_throughput, b.wall_throughput) for a, b in zip(raw1.blocks, raw8.blocks, strict=True)]

    def per_round(case: Any, ref: list[float], attr: str = "throughput") -> float:
        return statistics.median(getattr(b, attr) / r for b, r in zip(case.blocks, ref, strict=True))

    lines = [f"{'case':<58} {'samples/s':>10} {'p50 ms':>8} {'p99 ms':>8} {'/better raw':>11} {'/least':>7} "
             f"{'p50/least':>9} {'/raw wall':>9}"]

    def line(case: Any, least: Any | None) -> str:
        r_least = per_round(case, [b.throughput for b in least.blocks]) if least else 1.0
        p_least = per_round(case, [b.p50 for b in least.blocks], "p50") if least else 1.0
        return (f"{case.label:<58} {case.throughput():>10.1f} {case.p50() * 1e3:>8.3f} {case.p99() * 1e3:>8.3f} "
                f"{per_round(case, best):>11.3f} {r_least:>7.3f} {p_least:>9.3f} "
                f"{per_round(case, best_wall, 'wall_throughput'):>9.3f}")
    lines += [line(raw1, None), line(raw8, None)]
    for n in callers:
        least = c[f"least{n}"]
        lines.append(line(least, None))
        lines += [line(c[f"split{k}_{n}"], least) for k in ks if k > 1]
        lines += [line(c[f"procs{k}_{n}"], least) for k in ks]
    return "\n".join(lines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--serve", type=int, default=None)
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--max-batch", type=int, default=8)
    known, _ = ap.parse_known_args()
    if known.serve is not None:
        serve(known.serve, known.model, known.threads, known.max_batch)
    else:
        sys.exit(main())
