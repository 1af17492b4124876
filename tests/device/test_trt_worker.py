"""The TensorRT engine worker (JetPack 5): a real worker process under Python 3.8, the TensorRT stand-in,
served through a real daemon path (model manager, scheduler, shared-memory transport and client)."""

from __future__ import annotations

import ast
import contextlib
import hashlib
import json
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from edged.backends.trt_worker import supervisor
from edged.client.shm import ShmClient
from edged.config import ModelsSection, parse_config
from edged.core.manager import ModelManager
from edged.core.service import InferenceService
from edged.errors import EdgedError, ErrorCode, ModelLoadError
from edged.profiles import BackendPreference
from edged.transports.shm.transport import ShmTransport
from tests.registry_helpers import wait_for
from tests.trt_worker_env import STANDIN, default_worker_python
from tests.wheel_cache import UnavailableError

REPO = Path(__file__).resolve().parents[2]
PY38_SOURCES = [REPO / "edged/backends/trt_worker/worker.py", REPO / "edged/backends/trt_worker/__init__.py",
                REPO / "edged/protocol/shm_wire.py", REPO / "edged/protocol/shm_worker.py",
                STANDIN / "tensorrt/__init__.py"]
STALL = -12345.5
WEIGHT = np.arange(12, dtype=np.float32).reshape(4, 3) / 10
BIAS = np.array([0.5, -1.0, 2.0], dtype=np.float32)


@pytest.fixture(scope="module")
def worker_py() -> tuple[Path, bool]:
    try:
        return default_worker_python()
    except UnavailableError as e:
        pytest.skip(f"no Python for the engine worker: {e}")


def _plan(path: Path) -> Path:
    path.write_text(json.dumps({
        "edged_standin": 1, "stall_value": STALL, "weight": WEIGHT.tolist(), "bias": BIAS.tolist(),
        "inputs": [{"name": "x", "dtype": "float32", "shape": [-1, 4]}],
        "outputs": [{"name": "y", "dtype": "float32", "shape": [-1, 3]}]}))
    return path


def _repo(root: Path) -> Path:
    version = root / "affine" / "1"
    version.mkdir(parents=True)
    plan = _plan(version / "model.plan")
    (root / "affine" / "1" / "model.toml").write_text(f"""
max_batch_size = 8
[[inputs]]
name = "x"
datatype = "FP32"
shape = [4]
[[outputs]]
name = "y"
datatype = "FP32"
shape = [3]
[[variants]]
file = "model.plan"
format = "tensorrt"
precision = "fp32"
sha256 = "{hashlib.sha256(plan.read_bytes()).hexdigest()}"
""")
    return root


def _workers() -> list[int]:
    """Pids of this process's children running the engine worker."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            if ppid == os.getpid() and b"trt_worker/worker.py" in cmd:
                found.append(int(pid))
    return found


@contextlib.contextmanager
def _daemon(tmp: Path, python: Path) -> Iterator[Path]:
    prefs = [BackendPreference(backend="tensorrt", device="GPU", precisions=["fp32"],
                               options={"engine_worker": str(python), "worker_timeout_s": 20})]
    manager = ModelManager(_repo(tmp / "models"), ModelsSection(), prefs)
    manager.load_all()
    service = InferenceService(manager)
    cfg = parse_config(f'[device]\nstate_dir = "{tmp}/state"\nruntime_dir = "{tmp}/run"\n')
    transport = ShmTransport(cfg, service)
    transport.start_blocking()
    try:
        yield transport.path
    finally:
        transport.stop_blocking()
        manager.shutdown()


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _expected(x: np.ndarray) -> np.ndarray:
    return np.asarray(x @ WEIGHT + BIAS, dtype=np.float32)


@pytest.mark.parametrize("source", PY38_SOURCES, ids=lambda p: p.name if p.name != "__init__.py" else p.parent.name)
def test_worker_sources_parse_as_python_3_8(source: Path) -> None:
    # The grammar check alone; running under a real 3.8 (below) also catches 3.9+ library calls.
    ast.parse(source.read_text(), filename=str(source), feature_version=(3, 8))


def test_worker_runs_under_python_3_8(worker_py: tuple[Path, bool], tmp_path: Path) -> None:
    python, is_38 = worker_py
    if not is_38:
        pytest.skip("no CPython 3.8 on this machine (EDGED_TEST_PY38, python3.8, pyenv): the worker ran under "
                    "the current interpreter instead; the 3.8 grammar check still ran")
    engine = supervisor.WorkerEngine(str(python), _plan(tmp_path / "p.plan"), "py38")
    try:
        assert engine.health()["python"].startswith("3.8.")
        x = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
        np.testing.assert_allclose(engine.infer({"x": x})["y"], _expected(x), rtol=1e-5, atol=1e-5)
    finally:
        engine.unload()


def test_serves_through_the_daemon_and_survives_a_kill_mid_request(worker_py: tuple[Path, bool], tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    python, _ = worker_py
    # The worker inherits the daemon's environment (-E drops only PYTHON*): the stall says when it has begun.
    stalled = tmp_path / "stalled"
    monkeypatch.setenv("EDGED_STANDIN_STALL_MARKER", str(stalled))
    rng = np.random.default_rng(7)
    with _daemon(tmp_path, python) as sock, ShmClient(sock) as client:
        x = rng.standard_normal((5, 4)).astype(np.float32)
        np.testing.assert_allclose(client.infer("affine", {"x": x})["y"], _expected(x), rtol=1e-5, atol=1e-5)
        (first,) = _workers()

        # A request the engine hangs on; the worker is killed while it runs.
        stuck = x.copy()
        stuck[0, 0] = STALL
        failure: list[BaseException] = []

        def send() -> None:
            try:
                client.infer("affine", {"x": stuck})
            except BaseException as e:
                failure.append(e)

        t = threading.Thread(target=send)
        t.start()
        wait_for(lambda: stalled.read_text() == str(first), timeout=60, what="the request to hang in the worker")
        assert t.is_alive(), "the stalled request returned before the worker was killed"
        os.kill(first, signal.SIGKILL)
        t.join(30)
        assert not t.is_alive()
        (err,) = failure
        assert isinstance(err, EdgedError) and err.code is ErrorCode.INTERNAL
        assert "engine worker" in str(err) and "SIGKILL" in str(err) and "restarted" in str(err)

        # A new worker, and the next request is served by it.
        wait_for(lambda: len(_workers()) == 1 and _workers()[0] != first, what="the restarted worker")
        y = rng.standard_normal((2, 4)).astype(np.float32)
        np.testing.assert_allclose(client.infer("affine", {"x": y})["y"], _expected(y), rtol=1e-5, atol=1e-5)
    assert _workers() == []  # unloading the model stops the worker


def test_a_plan_the_worker_cannot_load_fails_the_load_with_its_reason(worker_py: tuple[Path, bool],
                                                                      tmp_path: Path) -> None:
    python, _ = worker_py
    bad = tmp_path / "bad.plan"
    bad.write_bytes(b"\x00not a plan")
    with pytest.raises(ModelLoadError, match="cannot load the plan: RuntimeError: TensorRT could not deserialize"):
        supervisor.WorkerEngine(str(python), bad, "bad")
    assert _workers() == []


def test_outputs_larger_than_the_segment_and_a_hung_worker(worker_py: tuple[Path, bool], tmp_path: Path) -> None:
    python, _ = worker_py
    engine = supervisor.WorkerEngine(str(python), _plan(tmp_path / "p.plan"), "grow", request_timeout_s=1.0)
    try:
        big = np.random.default_rng(3).standard_normal((20000, 4)).astype(np.float32)  # 320 KB in, 240 KB out
        np.testing.assert_allclose(engine.infer({"x": big})["y"], _expected(big), rtol=1e-5, atol=1e-5)
        stuck = big[:2].copy()
        stuck[0, 0] = STALL
        with pytest.raises(supervisor.WorkerDiedError, match="hung during this request"):
            engine.infer({"x": stuck})
        np.testing.assert_allclose(engine.infer({"x": big[:3]})["y"], _expected(big[:3]), rtol=1e-5, atol=1e-5)
        assert engine.health()["restarts"] == 1
    finally:
        engine.unload()
    assert _workers() == []


def test_a_worker_that_dies_while_idle_is_replaced_before_the_next_request(worker_py: tuple[Path, bool],
                                                                           tmp_path: Path) -> None:
    python, _ = worker_py
    engine = supervisor.WorkerEngine(str(python), _plan(tmp_path / "p.plan"), "idle")
    try:
        (pid,) = _workers()
        os.kill(pid, signal.SIGKILL)
        # Dead and waitable: the leader a zombie and no thread (numpy's BLAS pool) still exiting.
        wait_for(lambda: _state(pid) == "Z" and len(os.listdir(f"/proc/{pid}/task")) == 1, what="the worker's exit")
        x = np.ones((1, 4), np.float32)
        np.testing.assert_allclose(engine.infer({"x": x})["y"], _expected(x), rtol=1e-5, atol=1e-5)  # no failed request
        health = engine.health()
        assert health["alive"] and health["restarts"] == 1 and health["last_exit"] == "killed by SIGKILL"
    finally:
        engine.unload()
