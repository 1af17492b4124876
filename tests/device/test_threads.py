"""The daemon's threads sized from the CPUs it may really use: affinity and cgroup CPU quota."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from edged.client.http import HttpClient
from edged.cpus import cgroup_cpu_quota, usable_cpus
from tests.conftest import MODELS
from tests.edged_process import edged_run, http_ok
from tests.netutil import free_port

DIGITS = MODELS / "digits" / "1"


def _cgroup(root: Path, proc_line: str, files: dict[str, str]) -> Path:
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text(proc_line + "\n")
    for rel, text in files.items():
        f = root / "sys/fs/cgroup" / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text + "\n")
    return root


def test_cgroup_quota_v2_v1_and_unlimited(tmp_path: Path) -> None:
    v2 = _cgroup(tmp_path / "v2", "0::/system.slice/edged.service",
                 {"system.slice/edged.service/cpu.max": "150000 100000"})
    assert cgroup_cpu_quota(v2) == 2  # 1.5 CPUs' worth of time: two threads can use it
    assert usable_cpus(v2) == min(2, len(os.sched_getaffinity(0)))
    container = _cgroup(tmp_path / "ct", "0::/", {"cpu.max": "50000 100000"})  # a container's own namespace
    assert cgroup_cpu_quota(container) == 1 and usable_cpus(container) == 1
    unlimited = _cgroup(tmp_path / "max", "0::/a", {"a/cpu.max": "max 100000"})
    assert cgroup_cpu_quota(unlimited) is None
    assert usable_cpus(unlimited) == len(os.sched_getaffinity(0))
    v1 = _cgroup(tmp_path / "v1", "5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc",
                 {"cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "300000",
                  "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000"})
    assert cgroup_cpu_quota(v1) == 3
    v1_off = _cgroup(tmp_path / "v1off", "5:cpu,cpuacct:/x",
                     {"cpu,cpuacct/x/cpu.cfs_quota_us": "-1", "cpu,cpuacct/x/cpu.cfs_period_us": "100000"})
    assert cgroup_cpu_quota(v1_off) is None
    assert cgroup_cpu_quota(tmp_path / "nothing") is None  # no cgroup files at all: unknown, not zero


_PINNED = """
import sys
import numpy as np
from edged.backends.base import LoadRequest
from edged.backends.onnxruntime import OnnxRuntimeBackend
from edged.backends.openvino import OpenVinoBackend
from edged.repository.manifest import parse_manifest
from pathlib import Path
d = Path(sys.argv[1])
m = parse_manifest(d / "model.toml")
def req(f):
    v = next(v for v in m.variants if v.file == f)
    return LoadRequest(model="digits", version=1, version_dir=d, variant=v, max_batch_size=m.max_batch_size)
ort = OnnxRuntimeBackend().load(req("model.onnx"))
ov = OpenVinoBackend().load(req("openvino/model.xml"))
x = np.load(sys.argv[2])
np.testing.assert_allclose(ort.infer({"pixels": x})["probabilities"], ov.infer({"pixels": x})["probabilities"],
                           rtol=1e-4, atol=1e-5)
print(ort.describe()["intra_op_threads"], ov.describe()["threads"])
"""


def test_engine_pools_follow_the_cpus_the_process_may_use(
        tmp_path: Path, digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    """On a machine with more CPUs than the process may use, the engines' default pools (a thread per
    physical core) would oversubscribe the one it has; they get one thread each, and still answer.
    In a process of its own: engine libraries remember the CPUs they saw when first loaded."""
    cpus = os.sched_getaffinity(0)
    if len(cpus) < 2:
        pytest.skip("needs a machine with at least 2 CPUs to pin the process to fewer")
    np.save(tmp_path / "x.npy", digits_holdout[0][:4])
    r = subprocess.run(["taskset", "-c", str(min(cpus)), sys.executable, "-c", _PINNED, str(DIGITS),
                        str(tmp_path / "x.npy")], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["1", "1"], r.stdout


def test_daemon_pinned_to_one_cpu_sizes_its_pools_to_it(
        tmp_path: Path, model_repo: Callable[..., Path], write_config: Callable[..., Path]) -> None:
    port = free_port()
    cfg = write_config(model_repo("digits"), f'[http]\nlisten = "127.0.0.1:{port}"\n[mqtt]\nenabled = false\n'
                                   '[limits]\ndecode_threads = 3\n')
    log = tmp_path / "edged.log"
    first = min(os.sched_getaffinity(0))
    with edged_run(cfg, log, lambda: http_ok(port, "/v2/health/ready"), timeout=60,
                   prefix=["taskset", "-c", str(first)]):
        text = log.read_text()
    assert "threads: 1 usable CPU(s) (affinity mask); each engine's pool 1 thread(s), idle after a spin of " \
           "2000 us; 3 decode worker(s) + 2 for control calls" in text, text[-3000:]


_IDLE = """
import resource, sys, time
import numpy as np
from pathlib import Path
from edged.backends.base import LoadRequest
from edged.backends.onnxruntime import OnnxRuntimeBackend
from edged.repository.manifest import parse_manifest
d = Path(sys.argv[1])
m = parse_manifest(d / "model.toml")
v = next(v for v in m.variants if v.file == "model.onnx")
eng = OnnxRuntimeBackend().load(LoadRequest(model="mobilenet", version=1, version_dir=d, variant=v,
                                            max_batch_size=m.max_batch_size, threads=2))
x = np.zeros((1, 3, 48, 192), dtype=np.float32)
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
busy = []
for _ in range(5):
    eng.infer({"image": x})
    c0 = cpu()
    time.sleep(0.2)  # nothing to do: what the engine's threads burn now is spinning
    busy.append(cpu() - c0)
print(sorted(busy)[2], eng.describe().get("spin_us"))
"""


def test_an_idle_engine_gives_its_cores_back_soon_after_a_run(tmp_path: Path) -> None:
    """ONNX Runtime's pool threads spin for work after every run (about 24 ms on this project's VMs: a
    30 fps stream kept 0.75 of a core busy for 0.6 ms runs of the CNN). With [limits] engine_spin_us (2 ms
    by default) an engine idle for 200 ms after a run used at most a few milliseconds of CPU in that time."""
    r = subprocess.run([sys.executable, "-c", _IDLE, str(MODELS / "mobilenet" / "1")],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    cpu_s, spin = r.stdout.split()
    assert spin == "2000" and float(cpu_s) <= 0.008, r.stdout


_SHARED = """
import os, sys
import numpy as np
from pathlib import Path
from edged.backends import onnxruntime as ortb
from edged.backends.base import LoadRequest
from edged.backends.options import OnnxRuntimeOptions
from edged.repository.manifest import parse_manifest
mode, models = sys.argv[1], Path(sys.argv[2])
def threads():
    return len(os.listdir("/proc/self/task"))
def load(name, **kw):
    d = models / name / "1"
    m = parse_manifest(d / "model.toml")
    v = next(v for v in m.variants if v.file == "model.onnx")
    return ortb.OnnxRuntimeBackend().load(LoadRequest(model=name, version=1, version_dir=d, variant=v,
                                                      max_batch_size=m.max_batch_size, threads=2, **kw))
if mode == "shared":
    assert ortb.share_one_pool(2)
first = load("digits")
before = threads()  # the library's own threads exist now; what each further model adds is its pool
engines = [load("mobilenet"), load("orientation"), load("ocr_cls", options=OnnxRuntimeOptions(intra_op_threads=1))]
added = threads() - before
x = np.load(models / "mobilenet" / "1" / "expected.npz")
got = engines[0].infer({"image": np.load(models / "mobilenet" / "1" / "warmup.npz")["image"]})
np.testing.assert_allclose(got["probabilities"], x["probabilities"], rtol=1e-4, atol=1e-5)
print(added, first.describe()["pool"], first.describe()["intra_op_threads"], first.describe()["spin_us"])
"""


@pytest.mark.parametrize("mode", ["per_model", "shared"])
def test_models_share_one_engine_pool_when_told(mode: str) -> None:
    """[limits] engine_pool = "shared": models loaded after the first add no threads (one pool for the
    process, none spinning beside another's run), answer as before, and say so; per model, each adds its
    pool. In a process of its own: ONNX Runtime makes the choice for the whole process and for good."""
    r = subprocess.run([sys.executable, "-c", _SHARED, mode, str(MODELS)],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    added, pool = r.stdout.split(maxsplit=1)
    if mode == "shared":
        assert added == "0" and pool.strip() == "shared by the process 2 -1", r.stdout
        assert "intra_op_threads = 1 not applied" in r.stderr, r.stderr[-2000:]
    else:
        assert int(added) >= 2 and pool.strip() == "per session 2 2000", r.stdout


def test_a_daemon_told_to_share_one_pool_serves_its_models_on_it(
        tmp_path: Path, model_repo: Callable[..., Path], write_config: Callable[..., Path],
        digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    """The generic profile (ONNX Runtime on the CPU, as OpenVINO would otherwise serve both here): the
    daemon makes the pool before its first session, says so, and serves both models on it."""
    port = free_port()
    cfg = write_config(model_repo("digits", "mobilenet"),
                       f'profile = "generic"\n[http]\nlisten = "127.0.0.1:{port}"\n[mqtt]\nenabled = false\n'
                       '[limits]\nengine_pool = "shared"\nengine_threads = 2\n')
    log = tmp_path / "edged.log"
    x, y = digits_holdout
    with edged_run(cfg, log, lambda: http_ok(port, "/v2/health/ready"), timeout=60):
        with HttpClient(f"http://127.0.0.1:{port}") as c:
            configs = {m: c.config(m) for m in ("digits", "mobilenet")}
            got = c.infer("digits", {"pixels": x[:50]})["probabilities"]
            image = np.load(MODELS / "mobilenet" / "1" / "warmup.npz")["image"]
            cnn = c.infer("mobilenet", {"image": image})["probabilities"]
        text = log.read_text()
    for m, conf in configs.items():  # served by ONNX Runtime, each on the process's one pool
        pool = conf["parameters"].get("edged_engine_pool", {}).get("string_value")
        assert (conf["backend"], pool) == ("onnxruntime", "shared by the process"), (m, conf["parameters"])
    assert (got.argmax(axis=1) == y[:50]).mean() > 0.9
    np.testing.assert_allclose(cnn, np.load(MODELS / "mobilenet" / "1" / "expected.npz")["probabilities"],
                               rtol=1e-4, atol=1e-5)
    made, plan = text.find("ONNX Runtime: one pool of 2 thread(s) for every session"), text.find("threads: ")
    assert 0 <= made < text.find("model=digits version=1 loading"), text[-3000:]  # before the first session
    assert "(but ONNX Runtime in the daemon's process: one pool of 2 thread(s) for every model" in text[plan:], \
        text[-3000:]
    assert " ERROR " not in text, text[-3000:]
