"""The cross-process floor (bench/floor_procs.py) does correct work and leaves no process behind.

Its figures are the floor issue 41's multi-process design is measured against, so each answer must be
the one the engine gives in-process for that very input, whichever worker and batch row it went through.
"""

from __future__ import annotations

import threading

import numpy as np
import psutil

from bench.floor_engine import session
from bench.floor_procs import MODEL, ProcBatcher


def test_every_answer_is_the_engines_and_the_workers_are_gone_after() -> None:
    engine = session(MODEL)
    inp = engine.get_inputs()[0]
    row = [int(d) for d in inp.shape[1:]]
    rng = np.random.default_rng(7)
    xs = [rng.random((1, *row), dtype=np.float32) for _ in range(48)]  # a different input per request
    want = [engine.run(None, {inp.name: x})[0] for x in xs]
    pb = ProcBatcher(MODEL, workers=2, threads=1)
    pids = [w.proc.pid for w in pb.workers]
    got: list[object] = [None] * len(xs)

    def caller(k: int) -> None:
        for i in range(k, len(xs), 8):  # 8 callers at once: batches of several rows, both workers busy
            got[i] = pb.infer(xs[i])

    try:
        threads = [threading.Thread(target=caller, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        pb.close()
    for i, g in enumerate(got):
        assert isinstance(g, dict), f"request {i} got no answer"
        out = g["probabilities"]
        assert out.shape == want[i].shape
        assert np.allclose(out, want[i], atol=1e-5), f"request {i} got another input's answer"
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
