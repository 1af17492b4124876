"""The daemon's threads sized from the CPUs it may really use: affinity and cgroup CPU quota."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from edged.backends.base import LoadRequest
from edged.backends.onnxruntime import OnnxRuntimeBackend
from edged.backends.openvino import OpenVinoBackend
from edged.cpus import cgroup_cpu_quota, usable_cpus
from edged.repository.manifest import parse_manifest
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
                 {"cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "300000", "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000"})
    assert cgroup_cpu_quota(v1) == 3
    v1_off = _cgroup(tmp_path / "v1off", "5:cpu,cpuacct:/x",
                     {"cpu,cpuacct/x/cpu.cfs_quota_us": "-1", "cpu,cpuacct/x/cpu.cfs_period_us": "100000"})
    assert cgroup_cpu_quota(v1_off) is None
    assert cgroup_cpu_quota(tmp_path / "nothing") is None  # no cgroup files at all: unknown, not zero


@pytest.fixture
def one_cpu() -> Iterator[None]:
    """This thread (and the engine threads it starts) pinned to one CPU, as ``taskset -c`` would."""
    before = os.sched_getaffinity(0)
    if len(before) < 2:
        pytest.skip("needs a machine with at least 2 CPUs to pin the test to fewer")
    os.sched_setaffinity(0, {min(before)})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _request(variant_file: str) -> LoadRequest:
    manifest = parse_manifest(DIGITS / "model.toml")
    variant = next(v for v in manifest.variants if v.file == variant_file)
    return LoadRequest(model="digits", version=1, version_dir=DIGITS, variant=variant,
                       max_batch_size=manifest.max_batch_size)


def test_engine_pools_follow_the_cpus_the_process_may_use(
        one_cpu: None, digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    """On a machine with more CPUs than the process may use, the engines' default pools (a thread per
    physical core) would oversubscribe the one it has; they get one thread each, and still answer."""
    x, _ = digits_holdout
    ort = OnnxRuntimeBackend().load(_request("model.onnx"))
    assert ort.describe()["intra_op_threads"] == 1
    ov = OpenVinoBackend().load(_request("openvino/model.xml"))
    assert ov.describe()["threads"] == 1
    np.testing.assert_allclose(ort.infer({"pixels": x[:4]})["probabilities"],
                               ov.infer({"pixels": x[:4]})["probabilities"], rtol=1e-4, atol=1e-5)


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
    assert "threads: 1 usable CPU(s) (affinity mask); each engine's pool 1 thread(s); " \
           "3 decode worker(s) + 2 for control calls" in text, text[-3000:]
