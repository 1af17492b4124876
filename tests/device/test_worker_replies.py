"""The daemon's end of an engine worker (edged.backends.worker_client) against a small scripted worker:
replies matched to their requests, a hostile reply refused before it is read, a failed segment growth
or a worker killed while growing one leaving nothing closed behind, and no memfd left after unload."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import numpy as np
import pytest

from edged.backends.worker_client import EngineWorkerClient, WorkerDiedError
from edged.errors import EdgedError, InternalError
from tests.polling import wait_until

# The engine doubles its input "x" into "y". argv: mode, marker file, fd. A hostile mode misbehaves on
# the first INFER only (the marker file says it did), so that its replacement serves normally.
FAKE_WORKER = r"""
import os, socket, sys
from edged.backends.base import EngineTensor
from edged.backends.engine_procs.worker import Worker
from edged.protocol import shm_wire as wire
from edged.protocol.shm_worker import serve_engine

mode, marker, fd = sys.argv[1], sys.argv[2], int(sys.argv[3])

class Double:
    backend, device, precision = "fake", "CPU", "fp32"
    inputs = [EngineTensor("x", "FP32", (-1,))]
    outputs = [EngineTensor("y", "FP32", (-1,))]
    def infer(self, inputs, outputs=None):
        return {"y": inputs["x"] * 2}

worker = Worker(Double())
if mode == "small-segments":
    worker.table.max_bytes = 1 << 17
if mode == "die-on-big-register":
    register = worker.table.register
    def big_register(body, fds):
        if wire.U64.unpack(body)[0] > 1 << 16 and not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(1)
        return register(body, fds)
    worker.table.register = big_register

def infer(body):
    count, reply = worker.infer(body)
    if os.path.exists(marker) or mode not in HOSTILE:
        return count, reply
    open(marker, "w").close()
    return HOSTILE[mode](count, reply)

def output(ndim, shape, nbytes, offset=0, dtype=11):
    desc = wire.OUTPUT.pack(1, dtype, ndim, offset, nbytes) + wire.DIMS[len(shape)].pack(*shape)
    return wire.U32.pack(0) + desc + b"y"

HOSTILE = {
    "many-dims": lambda count, reply: (1, output(200, (), 4)),
    "truncated": lambda count, reply: (3, reply),
    "size-mismatch": lambda count, reply: (1, output(1, (1 << 20,), 4)),
    "negative-dims": lambda count, reply: (1, output(2, (-2, -2), 16)),
    "bytes-dtype": lambda count, reply: (1, output(1, (4,), 16, dtype=13)),
}
serve_engine(socket.socket(fileno=fd), wire, worker.table, infer, worker.describe)
"""


class ScriptedWorker(EngineWorkerClient):
    def __init__(self, mode: str, marker: Path) -> None:
        self.mode, self.marker = mode, marker
        super().__init__("fake model", device="CPU", precision="fp32", start_timeout_s=30.0, request_timeout_s=30.0)

    def _command(self, fd: int) -> list[str]:
        return [sys.executable, "-c", FAKE_WORKER, self.mode, str(self.marker), str(fd)]


def _memfds() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += "edged-engine-worker" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return n


def _check(w: ScriptedWorker, n: int = 4, k: int = 0) -> None:
    x = np.arange(n, dtype=np.float32) + k
    np.testing.assert_array_equal(w.infer({"x": x})["y"], x * 2)


def test_a_late_reply_to_a_health_check_is_not_taken_for_the_next_requests_answer(tmp_path: Path) -> None:
    w = ScriptedWorker("double", tmp_path / "marker")
    try:
        pid = w.pid
        assert pid is not None
        w.health_timeout_s = 0.05
        os.kill(pid, signal.SIGSTOP)  # it cannot answer the health check in time ...
        try:
            assert w.health()["alive"] is False
        finally:
            os.kill(pid, signal.SIGCONT)  # ... and answers it once it runs again, before the next request
        for k in range(3):
            _check(w, k=k)
        assert w.restarts == 0 and w.pid == pid
        assert w.health()["alive"] is True
    finally:
        w.unload()


@pytest.mark.parametrize("mode", ["many-dims", "truncated", "size-mismatch", "negative-dims", "bytes-dtype"])
def test_a_malformed_reply_fails_the_request_typed_and_the_worker_is_replaced(tmp_path: Path, mode: str) -> None:
    w = ScriptedWorker(mode, tmp_path / "marker")
    try:
        old = w.pid
        with pytest.raises(WorkerDiedError, match="fake model"):
            _check(w)
        assert (tmp_path / "marker").exists()
        for k in range(3):  # the replacement serves
            _check(w, k=k)
        assert w.restarts == 1 and w.pid != old
    finally:
        w.unload()


def test_a_refused_segment_growth_leaves_the_engine_serving(tmp_path: Path) -> None:
    w = ScriptedWorker("small-segments", tmp_path / "marker")
    try:
        _check(w)
        with pytest.raises(EdgedError):  # 50,000 floats need a 256 KiB segment; the worker takes 128 KiB
            _check(w, n=50_000)
        for k in range(3):
            _check(w, k=k)
    finally:
        w.unload()


def test_a_worker_killed_while_a_segment_grows_is_replaced_and_no_memfd_is_left(tmp_path: Path) -> None:
    before = _memfds()
    w = ScriptedWorker("die-on-big-register", tmp_path / "marker")
    try:
        _check(w)
        serving = _memfds()  # its two segments (each an fd and the map's own duplicate)
        old = w.pid
        with pytest.raises(WorkerDiedError, match="being restarted") as died:
            _check(w, n=50_000)
        assert isinstance(died.value, InternalError)
        wait_until(lambda: w.pid not in (None, old), 30, what="the worker to be restarted")
        _check(w, n=50_000)
        for k in range(3):
            _check(w, k=k)
        assert w.restarts == 1
        assert _memfds() == serving  # the new worker's two segments; the old ones are closed
    finally:
        w.unload()
    assert _memfds() == before
