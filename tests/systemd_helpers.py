"""Test models and a notify-socket listener for the systemd integration tests.

``spin``: one INT64 input ``n``; the graph loops ``n`` times over a 192x192 MatMul, so a
request's compute time is chosen by its input: the warm-up (n = 1) is instant, a client
asking for a few thousand iterations keeps the single engine instance really busy.
``nan``: loads and warms up fine but answers NaN, which only the daemon's self-test catches.
"""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SPIN_DIM = 192


def _write_model(version_dir: Path, model: object, manifest: str) -> None:
    import onnx

    version_dir.mkdir(parents=True)
    onnx.save(model, str(version_dir / "model.onnx"))  # type: ignore[arg-type]
    digest = hashlib.sha256((version_dir / "model.onnx").read_bytes()).hexdigest()
    (version_dir / "model.toml").write_text(manifest.replace("@SHA@", digest))


def make_spin_model(repo: Path, name: str = "spin", version: int = 1) -> Path:
    import onnx
    from onnx import TensorProto, helper

    rng = np.random.default_rng(1)
    # Gain 3: tanh keeps the state at O(1) values (a decaying state would go denormal, then zero, and
    # the iterations would change cost as it does).
    w = (3.0 * rng.standard_normal((SPIN_DIM, SPIN_DIM)) / np.sqrt(SPIN_DIM)).astype(np.float32)
    body = helper.make_graph(
        [helper.make_node("MatMul", ["x_in", "w"], ["xw"]), helper.make_node("Tanh", ["xw"], ["x_out"]),
         helper.make_node("Identity", ["cond_in"], ["cond_out"])],
        "spin_body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("x_in", TensorProto.FLOAT, [SPIN_DIM, SPIN_DIM])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("x_out", TensorProto.FLOAT, [SPIN_DIM, SPIN_DIM])],
        initializer=[helper.make_tensor("w", TensorProto.FLOAT, w.shape, w.ravel())],
    )
    x0 = np.eye(SPIN_DIM, dtype=np.float32)
    graph = helper.make_graph(
        [helper.make_node("Squeeze", ["n", "axes"], ["trips"]),
         helper.make_node("Loop", ["trips", "true", "x0"], ["x_final"], body=body),
         helper.make_node("ReduceMean", ["x_final"], ["y"], keepdims=0)],
        "spin",
        [helper.make_tensor_value_info("n", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])],
        initializer=[helper.make_tensor("axes", TensorProto.INT64, [1], [0]),
                     helper.make_tensor("true", TensorProto.BOOL, [], [True]),
                     helper.make_tensor("x0", TensorProto.FLOAT, x0.shape, x0.ravel())],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    d = repo / name / str(version)
    _write_model(d, model, """
max_batch_size = 0
[[inputs]]
name = "n"
datatype = "INT64"
shape = [1]
[[variants]]
file = "model.onnx"
format = "onnx"
precision = "fp32"
sha256 = "@SHA@"
[instances]
count = 1
""")
    np.savez(d / "warmup.npz", n=np.array([1], dtype=np.int64))
    with (d / "model.toml").open("a") as f:
        f.write('[warmup]\nfile = "warmup.npz"\n')
    return d


def make_nan_model(repo: Path, name: str = "nan") -> Path:
    import onnx  # noqa: F401
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "nan"], ["y"])],
        "nan",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 4])],
        initializer=[helper.make_tensor("nan", TensorProto.FLOAT, [], [float("nan")])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    d = repo / name / "1"
    _write_model(d, model, """
max_batch_size = 8
[[inputs]]
name = "x"
datatype = "FP32"
shape = [4]
[[variants]]
file = "model.onnx"
format = "onnx"
precision = "fp32"
sha256 = "@SHA@"
""")
    return d


def spin_seconds_per_iteration(model_dir: Path) -> float:
    """Measured here and now: the cost of one loop iteration in ONNX Runtime on this machine.

    The fastest of a few short runs: a host stall only makes a run slower, and one caught in
    a single timed run would shrink every busy-loop sized from it (a "12 s" warm-up to 2 s).
    """
    import onnxruntime as ort

    sess = ort.InferenceSession(str(model_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    sess.run(None, {"n": np.array([20], dtype=np.int64)})
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        sess.run(None, {"n": np.array([200], dtype=np.int64)})
        best = min(best, time.perf_counter() - t0)
    return best / 200


# A profile that loads ONNX Runtime on the CPU and takes the first candidate (no benchmarking).
TEST_PROFILE = """
name = "test-cpu"
priority = 1
description = "tests: ONNX Runtime on the CPU, first candidate wins"
select = "first"
[match]
[[backends]]
backend = "onnxruntime"
device = "CPU"
precisions = ["fp32"]
"""


def write_test_profile(root: Path) -> Path:
    d = root / "profiles"
    d.mkdir(exist_ok=True)
    (d / "test-cpu.toml").write_text(TEST_PROFILE)
    return d


@dataclass
class Message:
    at: float  # time.monotonic() when received
    fields: dict[str, str]

    @property
    def text(self) -> str:
        return "\n".join(f"{k}={v}" for k, v in self.fields.items())


@dataclass
class NotifyListener:
    """The service manager's side of sd_notify: a bound datagram socket and what arrived on it."""

    path: Path
    messages: list[Message] = field(default_factory=list)
    _sock: socket.socket | None = None
    _thread: threading.Thread | None = None
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _closed: bool = False

    def __post_init__(self) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(str(self.path))
        self._sock.settimeout(0.1)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        assert self._sock is not None
        while not self._closed:
            try:
                data = self._sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            now = time.monotonic()
            fields = dict(line.split("=", 1) for line in data.decode().split("\n") if "=" in line)
            with self._cond:
                self.messages.append(Message(now, fields))
                self._cond.notify_all()

    def wait_for(self, key: str, value: str | None = None, *, after: int = 0, timeout: float = 60) -> int:
        """Index of the first message from ``after`` on that sets ``key`` (to ``value``)."""
        end = time.monotonic() + timeout
        with self._cond:
            while True:
                for i in range(after, len(self.messages)):
                    got = self.messages[i].fields.get(key)
                    if got is not None and (value is None or got == value):
                        return i
                left = end - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no {key}={value or '*'} within {timeout}s; got "
                                         f"{[m.text for m in self.messages[after:]]}")
                self._cond.wait(left)

    def snapshot(self) -> list[Message]:
        with self._cond:
            return list(self.messages)

    def close(self) -> None:
        self._closed = True
        if self._thread is not None:
            self._thread.join(1)
        if self._sock is not None:
            self._sock.close()


NO_TRANSPORTS = "[http]\nenabled = false\n[mqtt]\nenabled = false\n[shm]\nenabled = false\n"


def service_config(tmp_path: Path, repo: Path, extra: str = "") -> Path:
    """An edged.toml for a daemon under a test service manager: the test profile, state and runtime
    dirs in ``tmp_path``, ``extra`` TOML appended."""
    profiles = write_test_profile(tmp_path)
    cfg = tmp_path / "edged.toml"
    cfg.write_text(f"""
[device]
id = "test-device"
state_dir = "{tmp_path / 'state'}"
runtime_dir = "{tmp_path / 'run'}"
model_repository = "{repo}"
profiles_dir = "{profiles}"
profile = "test-cpu"
{extra}
""")
    return cfg


def start_edged(argv: list[str], notify: Path, *, watchdog_usec: int | None = None,
                log: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k not in ("WATCHDOG_USEC", "WATCHDOG_PID", "JOURNAL_STREAM",
                                                                 "INVOCATION_ID")}
    env["NOTIFY_SOCKET"] = str(notify)
    if watchdog_usec is not None:
        env["WATCHDOG_USEC"] = str(watchdog_usec)
    with log.open("wb") as out:
        return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
