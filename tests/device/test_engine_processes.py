"""CPU engines in worker processes ([limits] engine_processes, issue 41): same answers, N batches at once,
a dead worker replaced, nothing left behind."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import psutil
import pytest

from edged.backends.engine_procs.pool import EngineProcesses
from edged.cli import _processes_line
from edged.config import LimitsSection, ModelsSection
from edged.core.manager import ModelManager
from edged.core.service import InferenceService
from edged.profiles import BackendPreference
from edged.protocol.types import InferRequest
from edged.threadplan import engine_processes
from tests.edged_process import edged_run
from tests.polling import wait_until

ORT_CPU = [BackendPreference(backend="onnxruntime", device="CPU", precisions=["fp32"])]
MODEL = "mobilenet"


def _reference(repo: Path, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(repo / MODEL / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    return np.asarray(sess.run(None, {"image": x})[0])


def _pool(manager: ModelManager) -> EngineProcesses:
    mv = manager.table.find(MODEL, None)
    assert mv is not None and mv.engine is not None
    engine = getattr(mv.engine, "current", mv.engine)  # behind the engine-choice proxy when there is one
    assert isinstance(engine, EngineProcesses)
    return engine


def test_engine_processes_answer_as_the_engine_does_and_run_batches_at_once(
        model_repo: Callable[..., Path]) -> None:
    repo = model_repo(MODEL)
    manager = ModelManager(repo, ModelsSection(), ORT_CPU, threads=2, processes=2)
    manager.load_model(MODEL)
    try:
        pool = _pool(manager)
        assert not pool.workers and not pool.ready  # started when calls first overlap
        pool.start_workers()
        pids = [w.pid for w in pool.workers]
        assert len(set(pids)) == 2 and os.getpid() not in pids
        assert all(psutil.Process(p).ppid() == os.getpid() for p in pids if p is not None)
        assert pool.threads_per_process == 1
        mv = manager.table.find(MODEL, None)
        assert mv is not None and mv.scheduler is not None and mv.scheduler.instances == 2
        assert mv.memory_mb > 0

        service = InferenceService(manager)
        rng = np.random.default_rng(7)
        xs = [rng.random((1, 3, 48, 192), dtype=np.float32) for _ in range(16)]
        want = [_reference(repo, x) for x in xs]
        got: dict[int, np.ndarray] = {}

        def client(k: int) -> None:
            for i in range(k, len(xs), 4):
                got[i] = service.infer_blocking(InferRequest(MODEL, {"image": xs[i]})).outputs["probabilities"]
        threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i, w in enumerate(want):
            np.testing.assert_allclose(got[i], w, atol=1e-5)
        # Batches of 8 on both workers at once (a third call, if any, runs on the daemon's own copy) equal
        # the same samples run one by one.
        batch = np.concatenate(xs[:8])
        before = [int(h["served"] or 0) for h in pool.health()]
        answers: list[np.ndarray] = []

        def batches() -> None:
            for _ in range(6):
                answers.append(pool._on_worker({"image": batch}, None)["probabilities"])
        threads = [threading.Thread(target=batches) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(answers) == 18
        for a in answers:
            np.testing.assert_allclose(a, np.concatenate(want[:8]), atol=1e-5)
        served = [int(h["served"] or 0) - b for h, b in zip(pool.health(), before, strict=True)]
        assert sum(served) == 18 and all(s > 0 for s in served), f"every worker serves: {served}"
    finally:
        manager.shutdown()
    wait_until(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                               for p in pids if p is not None), 10, what="the engine processes to end")


def test_a_lone_request_runs_on_the_daemons_own_copy_without_a_hop(model_repo: Callable[..., Path]) -> None:
    """One request at a time never waits for another process: no hand-off, no wake-ups (issue 41's c1 floor)."""
    repo = model_repo(MODEL)
    manager = ModelManager(repo, ModelsSection(), ORT_CPU, threads=2, processes=2)
    manager.load_model(MODEL)
    try:
        pool = _pool(manager)
        service = InferenceService(manager)
        x = np.random.default_rng(4).random((1, 3, 48, 192), dtype=np.float32)
        want = _reference(repo, x)
        before_local = pool.local_calls
        before = sum(int(h["served"] or 0) for h in pool.health())
        for _ in range(20):
            np.testing.assert_allclose(
                service.infer_blocking(InferRequest(MODEL, {"image": x})).outputs["probabilities"], want, atol=1e-5)
        assert pool.local_calls - before_local == 20
        assert sum(int(h["served"] or 0) for h in pool.health()) == before
        assert not pool.workers, "lone calls never start the workers"
        mv = manager.table.find(MODEL, None)
        assert mv is not None
        assert (f"2 engine process(es) of 1 thread(s) start when requests overlap; {pool.local_calls} lone call(s)"
                in _processes_line(mv.status()["engine_processes"]))
        # Overlapping calls start them in the background, and later overlapping calls run there.
        errors: list[BaseException] = []

        def overlap(stop: threading.Event) -> None:
            try:
                while not stop.is_set():
                    got = service.infer_blocking(InferRequest(MODEL, {"image": x})).outputs["probabilities"]
                    np.testing.assert_allclose(got, want, atol=1e-5)
            except BaseException as e:
                errors.append(e)
        stop = threading.Event()
        threads = [threading.Thread(target=overlap, args=(stop,)) for _ in range(4)]
        for t in threads:
            t.start()
        try:
            wait_until(lambda: pool.ready and sum(int(h["served"] or 0) for h in pool.health()) > 0, 30,
                       what="the workers to start and serve")
        finally:
            stop.set()
            for t in threads:
                t.join()
        assert not errors, errors
        line = _processes_line(mv.status()["engine_processes"])  # what `edged models list` prints
        assert line.startswith("in 2 engine process(es) of 1 thread(s) (pids "), line
    finally:
        manager.shutdown()


def test_a_killed_engine_process_is_replaced_and_serving_goes_on(model_repo: Callable[..., Path]) -> None:
    repo = model_repo(MODEL)
    manager = ModelManager(repo, ModelsSection(), ORT_CPU, threads=2, processes=2)
    manager.load_model(MODEL)
    try:
        pool = _pool(manager)
        pool.start_workers()
        victim = pool.workers[0]
        old = victim.pid
        assert old is not None
        os.kill(old, signal.SIGKILL)
        # Dead as a whole, not only its main thread: a killed process with threads (ONNX Runtime's) shows
        # "zombie" while the others still exit and its socket is still open; waitid without reaping waits for
        # the moment the daemon's poll() sees it, so that this is a death between calls, not during one.
        wait_until(lambda: os.waitid(os.P_PID, old, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None, 10,
                   what="the worker to die")
        x = np.random.default_rng(3).random((1, 3, 48, 192), dtype=np.float32)
        want = _reference(repo, x)
        for _ in range(4):  # both workers get calls; the dead one is replaced before its next
            np.testing.assert_allclose(pool._on_worker({"image": x}, None)["probabilities"], want, atol=1e-5)
        assert victim.restarts == 1 and victim.pid not in (None, old)
        assert "killed by SIGKILL" in (victim.last_exit or "")
    finally:
        manager.shutdown()


def test_only_cpu_engines_with_numeric_tensors_go_to_engine_processes(model_repo: Callable[..., Path]) -> None:
    """BYTES tensors do not cross the engine wire, and a GPU engine keeps its device: both stay in-process."""
    repo = model_repo("digits")
    manager = ModelManager(repo, ModelsSection(), ORT_CPU, processes=2)
    manager.load_model("digits")
    try:
        mv = manager.table.find("digits", None)
        assert mv is not None and mv.candidate is not None
        assert isinstance(getattr(mv.engine, "current", mv.engine), EngineProcesses)
        loader, cand = manager.loader, mv.candidate
        assert loader._in_processes(mv, cand)
        text = mv.manifest.model_copy(update={"inputs": [
            t.model_copy(update={"datatype": "BYTES"}) for t in mv.manifest.inputs or []]})
        assert not loader._in_processes(dataclasses.replace(mv, entry=dataclasses.replace(mv.entry, manifest=text)),
                                        cand)
        assert not loader._in_processes(mv, dataclasses.replace(cand, device="GPU"))
        loader.processes = 0
        assert not loader._in_processes(mv, cand)
    finally:
        manager.shutdown()


def test_auto_runs_engine_processes_from_twelve_cpus() -> None:
    assert engine_processes(LimitsSection(), cpus=2) == 0
    assert engine_processes(LimitsSection(), cpus=8) == 0
    assert engine_processes(LimitsSection(), cpus=12) == 3
    assert engine_processes(LimitsSection(), cpus=16) == 4
    assert engine_processes(LimitsSection(engine_processes=2), cpus=2) == 2
    assert engine_processes(LimitsSection(engine_processes=0), cpus=64) == 0
    with pytest.raises(ValueError, match="between 0 and 64"):
        LimitsSection(engine_processes=65)
    with pytest.raises(ValueError):
        LimitsSection.model_validate({"engine_processes": "many"})


def test_the_daemon_serves_through_engine_processes_and_leaves_none_behind(
        tmp_path: Path, model_repo: Callable[..., Path], write_config: Callable[..., Path]) -> None:
    from edged.client.shm import ShmClient
    from tests.netutil import free_port

    repo = model_repo(MODEL)
    port = free_port()
    cfg = write_config(repo, f"""
        [http]
        listen = "127.0.0.1:{port}"
        [mqtt]
        enabled = false
        [limits]
        engine_processes = 2
        engine_threads = 2
        """)
    sock = tmp_path / "run" / "edged.sock"
    x = np.random.default_rng(5).random((1, 3, 48, 192), dtype=np.float32)
    log = tmp_path / "edged.log"
    want = _reference(repo, x)

    def workers(proc_pid: int) -> list[psutil.Process]:
        return [c for c in psutil.Process(proc_pid).children()
                if "edged.backends.engine_procs.worker" in " ".join(c.cmdline())]

    def two_workers(proc_pid: int) -> list[psutil.Process] | None:
        found = workers(proc_pid)
        return found if len(found) >= 2 else None
    with edged_run(cfg, log, sock.exists, timeout=60) as proc:
        with ShmClient(sock) as c:
            np.testing.assert_allclose(c.infer(MODEL, {"image": x})["probabilities"], want, atol=1e-5)
        assert not workers(proc.pid), "a lone request starts no engine process"
        stop = threading.Event()
        errors: list[BaseException] = []

        def client() -> None:
            try:
                with ShmClient(sock) as c:
                    while not stop.is_set():
                        np.testing.assert_allclose(c.infer(MODEL, {"image": x})["probabilities"], want, atol=1e-5)
            except BaseException as e:
                errors.append(e)
        threads = [threading.Thread(target=client) for _ in range(4)]
        for t in threads:
            t.start()
        try:
            started = wait_until(lambda: two_workers(proc.pid), 30, what="the engine processes")
        finally:
            stop.set()
            for t in threads:
                t.join()
        assert not errors, errors
        assert started is not None
        pids = [w.pid for w in started]
    assert "split over 2 engine worker process(es) of 1 thread(s)" in log.read_text()
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
