"""The arm64 (Jetson) package: its contents in every run; installed and run in an arm64 Debian root
under qemu-user emulation in the slow run (``-m slow``), where binfmt_misc can be used.

What emulation exercises: dpkg/apt, postinst building /opt/edged from the bundled aarch64
wheels, ``edged detect`` (on the emulated root and on the Jetson fixture sysroots) and an
ONNX Runtime inference, all as aarch64 code. What it cannot: JetPack itself (L4T, CUDA,
TensorRT, the GPU device nodes the Jetson drop-in opens), so the Jetson paths stop at the
probe, the JetPack matrix and the profile choice.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import REPO_ROOT
from tests.test_packaging import SUITE, USER_HOME, _digits_input, _need_tools, _unpack, chroot
from tests.wheel_cache import cache_root

SYSROOTS = REPO_ROOT / "tests" / "fixtures" / "sysroots"
BINFMT = Path("/proc/sys/fs/binfmt_misc")
QEMU_RULE = Path("/usr/lib/binfmt.d/qemu-aarch64.conf")


@pytest.fixture(scope="module")
def arm64_deb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    _need_tools()
    out = tmp_path_factory.mktemp("dist-arm64")
    # Python 3.11: the arm64 root below is Debian 12, like a Jetson image rebuilt on it; the wheels are aarch64.
    r = subprocess.run(["sh", str(REPO_ROOT / "packaging/build-deb.sh"), "--arch", "arm64", "--python", "3.11",
                        "--no-openvino", "--out", str(out)], capture_output=True, text=True, timeout=900)
    if r.returncode != 0 and "pip" in r.stderr and ("resolve" in r.stderr or "connection" in r.stderr.lower()):
        pytest.skip(f"the aarch64 wheels could not be fetched: {r.stderr[-500:]}")
    assert r.returncode == 0, r.stderr[-4000:]
    (deb,) = out.glob("edged_*_arm64.deb")
    return deb


def test_arm64_package_contents(arm64_deb: Path) -> None:
    fields = subprocess.run(["dpkg-deb", "-f", str(arm64_deb)], capture_output=True, text=True, check=True).stdout
    assert "Architecture: arm64" in fields and "Depends: python3 (>= 3.11), python3 (<< 3.12)" in fields
    listing = subprocess.run(["dpkg-deb", "-c", str(arm64_deb)], capture_output=True, text=True, check=True).stdout
    paths = {line.split()[-1].lstrip(".") for line in listing.splitlines()}
    profiles = "/usr/share/edged/device_profiles"
    for p in ("/usr/share/edged/systemd/dropins/jetson.conf", f"{profiles}/jetson-orin.toml",
              f"{profiles}/jetson-xavier.toml", f"{profiles}/jetson-nano.toml", "/usr/bin/edged",
              "/lib/systemd/system/edged.service"):
        assert p in paths, p
    wheels = sorted(p for p in paths if p.startswith("/usr/lib/edged/wheels/") and p.endswith(".whl"))
    binary = [w for w in wheels if not w.endswith("-none-any.whl")]
    assert binary and all("aarch64" in w for w in binary), binary  # nothing built for the wrong machine
    assert any("/onnxruntime-" in w for w in binary) and any("/numpy-" in w for w in binary)
    # The engine worker and the wire format it imports ship in edged's wheel.
    work = arm64_deb.parent / "x"
    subprocess.run(["dpkg-deb", "-x", str(arm64_deb), str(work)], check=True)
    (edged_whl,) = (work / "usr/lib/edged/wheels").glob("edged-*.whl")
    names = set(zipfile.ZipFile(edged_whl).namelist())
    assert {"edged/backends/trt_worker/worker.py", "edged/backends/trt_worker/supervisor.py",
            "edged/protocol/shm_wire.py", "edged/hardware/jetpack.py"} <= names


def _emulation_or_skip() -> None:
    """qemu-user-static registered for aarch64 with binfmt_misc, setting it up when it is missing."""
    if subprocess.run(["uname", "-m"], capture_output=True, text=True).stdout.strip() == "aarch64":
        return
    missing = [pkg for pkg, tool in (("qemu-user-static", "qemu-aarch64-static"), ("arch-test", "arch-test"))
               if shutil.which(tool) is None]
    if missing and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing],
                       capture_output=True, timeout=600, env={"DEBIAN_FRONTEND": "noninteractive",
                                                              "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
    if shutil.which("qemu-aarch64-static") is None or shutil.which("arch-test") is None:
        pytest.skip("qemu-user-static and arch-test are not installed and apt-get could not install them")
    if not (BINFMT / "register").exists():
        subprocess.run(["mount", "-t", "binfmt_misc", "binfmt_misc", str(BINFMT)], capture_output=True)
    if not (BINFMT / "register").exists():
        pytest.skip("binfmt_misc cannot be mounted here, so aarch64 programs cannot run under emulation")
    if not (BINFMT / "qemu-aarch64").exists() and QEMU_RULE.exists():
        # No systemd-binfmt in a container: register Debian's own rule (F: the interpreter works in a chroot).
        try:
            (BINFMT / "register").write_text(QEMU_RULE.read_text().strip())
        except OSError as e:
            pytest.skip(f"cannot register qemu-aarch64 with binfmt_misc: {e}")
    r = subprocess.run(["arch-test", "arm64"], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"arm64 programs do not run here under emulation: {r.stdout.strip()} {r.stderr.strip()}")


@pytest.fixture(scope="module")
def arm64_root(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    markexpr = str(request.config.getoption("markexpr") or "")
    if "slow" not in markexpr or "not slow" in markexpr:
        pytest.skip("the emulated arm64 install takes minutes: run it with -m slow")
    _need_tools()
    _emulation_or_skip()
    d = tmp_path_factory.mktemp("debian-arm64")
    # mmdebstrap runs dpkg under emulation: 10+ minutes, so the base root is kept for a week in the test cache.
    tar = cache_root() / f"debian-{SUITE}-arm64-minbase.tar"
    if not tar.exists() or time.time() - tar.stat().st_mtime > 7 * 86400:
        tar.parent.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(["mmdebstrap", "--quiet", "--variant=minbase", "--architectures=arm64",
                            "--include=python3", SUITE, str(d / "root.tar")], capture_output=True, text=True,
                           timeout=2400)
        if r.returncode != 0:
            pytest.skip(f"mmdebstrap could not build an arm64 {SUITE} root: {r.stderr[-800:]}")
        os.replace(d / "root.tar", tar)
    root = _unpack(tar, d / "root")
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(3600)  # mmdebstrap and pip under emulation: 5 to 20 minutes on 2 busy cores
def test_arm64_package_installs_and_runs_under_emulation(
        arm64_root: Path, arm64_deb: Path,
        digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    root = arm64_root
    assert chroot(root, "uname", "-m").stdout.strip() == "aarch64"
    shutil.copy(arm64_deb, root / "tmp")
    t0 = time.monotonic()
    r = chroot(root, "apt-get", "install", "-y", "--no-install-recommends", f"/tmp/{arm64_deb.name}", timeout=1800)
    print(f"apt install under emulation: {time.monotonic() - t0:.0f} s")
    assert "edged-setup: device profile" in r.stdout + r.stderr
    assert chroot(root, "edged", "--version", home=USER_HOME).stdout.strip().startswith("edged ")
    assert "include-system-site-packages = true" in (root / "opt/edged/pyvenv.cfg").read_text()
    assert (root / "usr/share/edged/systemd/dropins/jetson.conf").is_file()

    # qemu-user shows the host's /proc/cpuinfo, so the probe describes the host's CPU here, not an Arm one.
    own = json.loads(chroot(root, "edged", "detect", "--json", home=USER_HOME).stdout)
    assert own["profile"] and own["jetpack"] is None
    shutil.copytree(SYSROOTS, root / "tmp" / "sysroots")
    for fixture, jetpack, first in (("jetson-nano", "4.x", "onnxruntime"), ("jetson-agx-orin", "5.x", "tensorrt"),
                                    ("jetson-orin-nano", "6.x", "tensorrt")):
        doc = json.loads(chroot(root, "edged", "detect", "--json", "--root", f"/tmp/sysroots/{fixture}",
                                home=USER_HOME).stdout)
        assert doc["jetpack"]["jetpack"] == jetpack and doc["backends"][0]["backend"] == first, fixture
    labels = _digits_input(root, digits_holdout)
    resp = json.loads(chroot(root, "edged", "infer", "digits", "--input", "/tmp/x.npy", "--json",
                             home=USER_HOME, timeout=900).stdout)
    (out,) = resp["outputs"]
    predicted = np.argmax(np.asarray(out["data"]).reshape(out["shape"]), axis=1)
    assert np.mean(predicted == labels) >= 0.9
