"""The device package for real: build the .deb, lint it, install it offline into a fresh Debian 12
root, run edged there, purge it and check nothing is left; the same for ./install.sh.

The Debian root comes from mmdebstrap (Debian's archive, once per session); everything that
runs inside it runs in a new network namespace (no network at all) with chroot.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import REPO_ROOT

# Building a Debian root and installing into it: 3-5 minutes on a quiet 2-core VM, twice that under load.
pytestmark = pytest.mark.timeout(900)

SUITE = "bookworm"
# dpkg/apt bookkeeping and logs change by design; shadow's tools leave *- backups of what they edit.
IGNORED = ("proc", "sys", "dev", "tmp", "var/lib/dpkg", "var/lib/apt", "var/log", "var/cache/apt",
           "var/cache/debconf", "etc/passwd-", "etc/group-", "etc/shadow-", "etc/gshadow-")
CLEAN_ENV = ["env", "-i", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8",
             "DEBIAN_FRONTEND=noninteractive"]
# edged run by hand writes engine caches (ONNX Runtime, OpenVINO) into the caller's home, which
# is the user's, not the package's: those runs get a home under /tmp. Package scripts keep /root,
# so anything they leave in root's home shows up.
USER_HOME = "/tmp/home"
TIMINGS: dict[str, float] = {}


def _need_tools() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: chroot, mounts and a throwaway Debian root")
    for tool in ("dpkg-deb", "unshare", "chroot"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    missing = [tool for tool in ("mmdebstrap", "lintian") if shutil.which(tool) is None]  # same package names
    if missing and shutil.which("apt-get"):
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing], env=env,
                       capture_output=True, timeout=600)
    for tool in ("mmdebstrap", "lintian"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed and apt-get could not install it (./install.sh --dev does)")


@dataclass
class Built:
    debs: dict[str, Path]
    wheelhouse: Path
    seconds: float


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, debian_builds: dict[str, Bootstrap]) -> Built:
    """The .debs; the Debian roots the selected tests need are bootstrapped meanwhile (``debian_builds``)."""
    _need_tools()
    out = tmp_path_factory.mktemp("dist")
    t0 = time.monotonic()
    r = subprocess.run(["sh", str(REPO_ROOT / "packaging/build-deb.sh"), "--out", str(out / "debs"),
                        "--wheelhouse", str(out / "wheelhouse")], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    TIMINGS["build"] = time.monotonic() - t0
    debs = {p.name.split("_")[0]: p for p in (out / "debs").glob("*.deb")}
    assert set(debs) == {"edged", "edged-openvino"}, debs
    for p in debs.values():
        print(f"{p.name}: {p.stat().st_size / 1e6:.1f} MB")
    return Built(debs, out / "wheelhouse", TIMINGS["build"])


ROOTS = {  # name -> packages beyond minbase
    "plain": "python3",  # no systemd: the package's fallbacks (useradd, install -d) run
    "systemd": "python3,systemd,systemd-sysv,dbus",  # boots under systemd-nspawn
}


def _root_users(request: pytest.FixtureRequest) -> dict[str, int]:
    """How many of this module's selected tests use each root: ``plain`` by the ``root`` fixture, ``systemd`` by
    the tests that take ``debian_tars`` themselves (the default run has no test of the plain root: none is built
    there)."""
    names = [set(getattr(item, "fixturenames", ())) for item in request.session.items if item.path == request.path]
    users = {"plain": sum("root" in n for n in names),
             "systemd": sum("debian_tars" in n and "root" not in n for n in names)}
    return {name: n for name, n in users.items() if n}


@dataclass
class Bootstrap:
    """One root being built by mmdebstrap: a tarball, or the root itself when only one test uses it."""

    proc: subprocess.Popen[bytes]
    out: Path
    log: Path
    started: float


@pytest.fixture(scope="module")
def debian_builds(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[dict[str, Bootstrap]]:
    """mmdebstrap for the roots the selected tests use, started with the module (it runs while the package
    builds, about a CPU each on a 2-core machine); a root one test uses is written as a folder, with no tarball
    to write and unpack, and handed to that test."""
    _need_tools()
    d = tmp_path_factory.mktemp("debian")
    users = _root_users(request)
    wanted = {name: pkgs for name, pkgs in ROOTS.items() if name in users
              and (name != "systemd" or shutil.which("systemd-nspawn"))}
    builds = {}
    for name, pkgs in wanted.items():
        out, log = d / (name if users[name] == 1 else f"{name}.tar"), d / f"{name}.log"
        with log.open("wb") as f:  # a file, not a pipe: nobody reads its output until a test needs the root
            proc = subprocess.Popen(["mmdebstrap", "--quiet", "--variant=minbase", f"--include={pkgs}", SUITE,
                                     str(out)], stdout=f, stderr=subprocess.STDOUT)
        builds[name] = Bootstrap(proc, out, log, time.monotonic())
    try:
        yield builds
    finally:
        for b in builds.values():
            if b.proc.poll() is None:  # the module ended (or failed) before a test waited for it
                b.proc.terminate()
                b.proc.wait(60)


@pytest.fixture(scope="module")
def debian_tars(debian_builds: dict[str, Bootstrap]) -> dict[str, Path]:
    """The throwaway roots the selected tests use, fetched from Debian's archive side by side: tarballs, or a
    root's folder where one test uses it (:func:`_fresh_root` takes either)."""
    tars = {}
    for name, b in debian_builds.items():
        if b.proc.wait(timeout=900) != 0:
            pytest.skip(f"mmdebstrap could not build a {SUITE} root (is Debian's archive reachable?): "
                        f"{b.log.read_text(errors='replace')[-800:]}")
        tars[name] = b.out
        TIMINGS["mmdebstrap"] = time.monotonic() - b.started
    return tars


def _unpack(tar: Path, where: Path) -> Path:
    where.mkdir()
    subprocess.run(["tar", "-C", str(where), "--numeric-owner", "-xf", str(tar)], check=True, timeout=300)
    return where


def _fresh_root(built_root: Path, where: Path) -> Path:
    """A root of its own at ``where``: unpacked from a tarball, or the one test's folder moved there."""
    if built_root.suffix == ".tar":
        return _unpack(built_root, where)
    assert built_root.is_dir(), f"{built_root} was built for one test and another one took it"
    built_root.rename(where)
    return where


@pytest.fixture
def root(debian_tars: dict[str, Path], tmp_path: Path) -> Iterator[Path]:
    r = _fresh_root(debian_tars["plain"], tmp_path / "root")
    yield r
    shutil.rmtree(r, ignore_errors=True)


def chroot(root: Path, *argv: str, check: bool = True, timeout: float = 600,
           home: str = "/root") -> subprocess.CompletedProcess[str]:
    """Run argv inside root: own mount namespace with /proc, and no network at all."""
    script = f'mount -t proc proc "{root}/proc" && exec chroot "{root}" "$@"'
    r = subprocess.run(["unshare", "--net", "--mount", "--fork", "sh", "-c", script, "sh", *CLEAN_ENV,
                        f"HOME={home}", *argv],
                       capture_output=True, text=True, timeout=timeout)
    if check:
        assert r.returncode == 0, f"{argv}: rc={r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def snapshot(root: Path, ignore: tuple[str, ...] = IGNORED) -> dict[str, tuple[object, ...]]:
    """Every path with its type, mode, owner and content (hash or link target) - mtimes left out."""
    out: dict[str, tuple[object, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        rel_dir = "" if rel_dir == "." else rel_dir
        dirnames[:] = [d for d in dirnames if os.path.join(rel_dir, d) not in ignore]
        for name in dirnames + filenames:
            rel = os.path.join(rel_dir, name)
            if rel in ignore:
                continue
            st = os.lstat(os.path.join(dirpath, name))
            what: object
            if stat.S_ISREG(st.st_mode):
                what = hashlib.sha256(Path(dirpath, name).read_bytes()).hexdigest()
            elif stat.S_ISLNK(st.st_mode):
                what = os.readlink(os.path.join(dirpath, name))
            else:
                what = None
            out[rel] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, what)
    return out


def diff(before: dict[str, tuple[object, ...]], after: dict[str, tuple[object, ...]]) -> list[str]:
    added = sorted(set(after) - set(before))
    removed = sorted(set(before) - set(after))
    changed = sorted(k for k in set(before) & set(after) if before[k] != after[k])
    return [f"+ {p}" for p in added] + [f"- {p}" for p in removed] + [f"~ {p}" for p in changed]


def config_owner(root: Path) -> tuple[int, str, str]:
    """Mode, owner and group of the installed config, names as the root's own passwd/group say."""
    st = (root / "etc/edged/edged.toml").stat()
    users = {int(f[2]): f[0] for f in (ln.split(":") for ln in (root / "etc/passwd").read_text().splitlines()) if f}
    groups = {int(f[2]): f[0] for f in (ln.split(":") for ln in (root / "etc/group").read_text().splitlines()) if f}
    return st.st_mode & 0o777, users.get(st.st_uid, str(st.st_uid)), groups.get(st.st_gid, str(st.st_gid))


def _digits_input(root: Path, digits_holdout: tuple[np.ndarray, np.ndarray], n: int = 20) -> np.ndarray:
    x, y = digits_holdout
    np.save(root / "tmp" / "x.npy", x[:n])
    return y[:n]


# ---- the package ------------------------------------------------------------------------------

SHELL_SCRIPTS = ("install.sh", "packaging/build-deb.sh", "packaging/edged-setup", "packaging/bin/edged",
                 "packaging/debian/postinst", "packaging/debian/prerm", "packaging/debian/postrm",
                 "packaging/debian/openvino-postinst", "packaging/debian/openvino-postrm")


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed (./install.sh --dev)")
def test_shell_scripts_pass_shellcheck() -> None:
    r = subprocess.run(["shellcheck", *SHELL_SCRIPTS], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout



def test_lintian_reports_no_errors(built: Built) -> None:
    r = subprocess.run(["lintian", "--tag-display-limit", "0", *map(str, built.debs.values())],
                       capture_output=True, text=True, timeout=300)
    print(r.stdout)
    errors = [line for line in r.stdout.splitlines() if line.startswith("E:")]
    assert not errors, r.stdout


def test_package_contents_and_metadata(built: Built) -> None:
    deb = built.debs["edged"]
    fields = subprocess.run(["dpkg-deb", "-f", str(deb)], capture_output=True, text=True, check=True).stdout
    assert "Depends: python3 (>= 3." in fields and "python3 (<< 3." in fields
    listing = subprocess.run(["dpkg-deb", "-c", str(deb)], capture_output=True, text=True, check=True).stdout
    paths = {line.split()[-1].lstrip(".") for line in listing.splitlines()}
    for p in ("/etc/edged/edged.toml", "/lib/systemd/system/edged.service", "/usr/lib/sysusers.d/edged.conf",
              "/usr/lib/tmpfiles.d/edged.conf", "/usr/bin/edged", "/usr/lib/edged/edged-setup",
              "/usr/share/edged/models/digits/1/model.toml", "/usr/share/edged/device_profiles/generic.toml",
              "/usr/share/edged/systemd/dropins/jetson.conf", "/usr/share/doc/edged/copyright",
              "/etc/mosquitto/conf.d/edged-nodelay.conf"):
        assert p in paths, p
    wheels = [p for p in paths if p.startswith("/usr/lib/edged/wheels/") and p.endswith(".whl")]
    assert any("/onnxruntime-" in w for w in wheels) and any("/edged-" in w for w in wheels)
    assert not any("/openvino-" in w for w in wheels)  # that is edged-openvino's
    assert not any(p.startswith("/opt") for p in paths)  # /opt/edged is built by postinst, not shipped
    conffiles = subprocess.run(["dpkg-deb", "-I", str(deb), "conffiles"], capture_output=True, text=True,
                               check=True).stdout.split()
    assert conffiles == ["/etc/edged/edged.toml", "/etc/mosquitto/conf.d/edged-nodelay.conf"]


@pytest.mark.slow  # the unit test below installs the same .deb into a systemd root in the default run
def test_deb_installs_offline_runs_and_purges_without_a_trace(
        built: Built, root: Path, digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    before = snapshot(root)
    shutil.copy(built.debs["edged"], root / "tmp")
    shutil.copy(built.debs["edged-openvino"], root / "tmp")
    t0 = time.monotonic()
    r = chroot(root, "apt-get", "install", "-y", "--no-install-recommends", f"/tmp/{built.debs['edged'].name}")
    TIMINGS["apt install"] = time.monotonic() - t0
    assert "edged: hardware probe" in r.stdout and "profile:" in r.stdout

    assert chroot(root, "edged", "--version", home=USER_HOME).stdout.strip().startswith("edged ")
    detect = json.loads(chroot(root, "edged", "detect", "--json", home=USER_HOME).stdout)
    assert detect["profile"] and detect["source"].startswith("/usr/share/edged/device_profiles/")
    labels = _digits_input(root, digits_holdout)
    resp = json.loads(chroot(root, "edged", "infer", "digits", "--input", "/tmp/x.npy", "--json",
                             home=USER_HOME).stdout)
    (out,) = resp["outputs"]
    predicted = np.argmax(np.asarray(out["data"]).reshape(out["shape"]), axis=1)
    assert np.mean(predicted == labels) >= 0.9

    # What postinst set up: user, venv seeing system site packages (JetPack's TensorRT), enabled unit.
    assert "edged:" in (root / "etc/passwd").read_text()
    cfg = (root / "opt/edged/pyvenv.cfg").read_text()
    assert "include-system-site-packages = true" in cfg
    assert (root / "etc/systemd/system/multi-user.target.wants/edged.service").is_symlink()
    assert (root / "var/lib/edged").stat().st_mode & 0o777 == 0o750
    assert config_owner(root) == (0o640, "root", "edged")  # it holds secrets (issue #20 item 11)
    # The broker drop-in, where Debian's mosquitto.conf includes it (tests/transports/test_mqtt.py shows its effect).
    dropin = (root / "etc/mosquitto/conf.d/edged-nodelay.conf").read_text()
    assert "\nset_tcp_nodelay true\n" in dropin

    # The OpenVINO add-on joins the same environment, offline; removing it takes it out again.
    chroot(root, "apt-get", "install", "-y", f"/tmp/{built.debs['edged-openvino'].name}")
    chroot(root, "/opt/edged/bin/python", "-c", "import openvino", home=USER_HOME)
    chroot(root, "apt-get", "purge", "-y", "edged-openvino")
    gone = chroot(root, "/opt/edged/bin/python", "-c", "import openvino", check=False, home=USER_HOME)
    assert gone.returncode != 0

    # Reinstalling the same version keeps the environment (the stamp matches).
    r = chroot(root, "apt-get", "install", "-y", "--reinstall", f"/tmp/{built.debs['edged'].name}")
    assert "/opt/edged is up to date" in r.stdout + r.stderr

    chroot(root, "apt-get", "purge", "-y", "edged")
    left = diff(before, snapshot(root))
    assert not left, "purge left changes behind:\n" + "\n".join(left[:50])
    print(f"timings: {TIMINGS}")


# ---- install.sh -------------------------------------------------------------------------------

SOURCES = ("install.sh", "pyproject.toml", "README.md", "edged", "models", "device_profiles", "packaging")


@pytest.mark.slow  # the unit test below installs the same .deb into a systemd root in the default run
def test_install_sh_offline_is_idempotent_and_uninstalls(built: Built, root: Path) -> None:
    before = snapshot(root)
    src = root / "src"
    src.mkdir()
    for name in SOURCES:
        p = REPO_ROOT / name
        if p.is_dir():
            shutil.copytree(p, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(p, src / name)
    shutil.copytree(built.wheelhouse, root / "wheelhouse")
    ignore = (*IGNORED, "src", "wheelhouse")

    t0 = time.monotonic()
    chroot(root, "bash", "/src/install.sh", "--wheelhouse", "/wheelhouse")
    TIMINGS["install.sh"] = time.monotonic() - t0
    assert chroot(root, "edged", "--version", home=USER_HOME).stdout.startswith("edged ")
    chroot(root, "/opt/edged/bin/python", "-c", "import openvino", home=USER_HOME)  # the wheelhouse had it
    first = snapshot(root, ignore)
    assert "etc/edged/edged.toml" in first and "etc/systemd/system/edged.service" in first
    assert config_owner(root) == (0o640, "root", "edged")  # it holds secrets (issue #20 item 11)

    # The second run changes nothing; the config, once edited, is never overwritten.
    r = chroot(root, "bash", "/src/install.sh", "--wheelhouse", "/wheelhouse")
    assert "up to date" in r.stderr
    assert not diff(first, snapshot(root, ignore))
    with (root / "etc/edged/edged.toml").open("a") as f:
        f.write("\n# changed by the admin\n")
    chroot(root, "bash", "/src/install.sh", "--wheelhouse", "/wheelhouse")
    assert (root / "etc/edged/edged.toml").read_text().endswith("# changed by the admin\n")

    chroot(root, "bash", "/src/install.sh", "--uninstall")
    kept = diff(before, snapshot(root, ignore))
    assert not (root / "opt/edged").exists() and not (root / "usr/local/bin/edged").is_symlink()
    assert all(p.split()[1].startswith(("etc/edged", "var/lib/edged", "etc/passwd", "etc/group", "etc/shadow",
                                        "etc/gshadow", "run/edged")) for p in kept), kept

    chroot(root, "bash", "/src/install.sh", "--uninstall", "--purge")
    left = diff(before, snapshot(root, ignore))
    assert not left, "install.sh --uninstall --purge left changes behind:\n" + "\n".join(left[:50])
    print(f"timings: {TIMINGS}")


# ---- the service under a real systemd -----------------------------------------------------------

class Container:
    """A booted systemd-nspawn container (no network, not registered with a machined)."""

    def __init__(self, root: Path, log: Path) -> None:
        self.root = root
        self._log = log.open("wb")
        self.proc = subprocess.Popen(
            ["systemd-nspawn", "-D", str(root), "--boot", "--register=no", "--keep-unit", "--private-network",
             "--console=pipe", f"--machine=edged-test-{os.getpid()}"],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        self.init_pid = 0

    def wait_booted(self, timeout: float = 120) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end and self.proc.poll() is None:
            kids = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout.split()
            if kids:
                self.init_pid = int(kids[0])
                r = self.run("systemctl", "is-system-running", check=False)
                if r.stdout.strip() in ("running", "degraded"):
                    return True
            time.sleep(0.2)
        return False

    def run(self, *argv: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        r = subprocess.run(["nsenter", "-t", str(self.init_pid), "-a", *CLEAN_ENV, "HOME=/root", *argv],
                           capture_output=True, text=True, timeout=timeout)
        if check:
            assert r.returncode == 0, f"{argv}: rc={r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        return r

    def prop(self, name: str) -> str:
        return self.run("systemctl", "show", "edged", "-p", name, "--value").stdout.strip()

    def host_pid(self, container_pid: int) -> int:
        """The host's pid of a process of this container, from its NSpid line."""
        ns = os.readlink(f"/proc/{self.init_pid}/ns/pid")
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                if os.readlink(f"/proc/{entry}/ns/pid") != ns:
                    continue
                status = Path(f"/proc/{entry}/status").read_text()
            except OSError:
                continue
            nspid = next(line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:"))
            if int(nspid[-1]) == container_pid:
                return int(entry)
        raise AssertionError(f"no host pid for container pid {container_pid}")

    def wait_for(self, what: Callable[[], bool], timeout: float = 90) -> None:
        end = time.monotonic() + timeout
        while not what():
            assert time.monotonic() < end, "timed out"
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # nspawn asks the container's systemd to power off
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait(10)
        self._log.close()


def _systemd_root_with_package(built: Built, debian_tars: dict[str, Path], tmp_path: Path) -> Path:
    """A Debian root with systemd and the edged package installed (offline), ready to boot."""
    if "systemd" not in debian_tars:
        pytest.skip("systemd-nspawn is not installed (Debian: systemd-container; ./install.sh --dev)")
    root = _fresh_root(debian_tars["systemd"], tmp_path / "root")
    shutil.copy(built.debs["edged"], root / "root")  # /tmp is a fresh tmpfs once the container boots
    chroot(root, "apt-get", "install", "-y", f"/root/{built.debs['edged'].name}")
    (root / "root" / built.debs["edged"].name).unlink()
    return root


def _boot_with_edged_active(root: Path, tmp_path: Path) -> Container:
    """Boot ``root``; edged must come up active (the caller stops the container)."""
    box = Container(root, tmp_path / "nspawn.log")
    try:
        if not box.wait_booted():
            pytest.skip("this host cannot boot a systemd-nspawn container: "
                        + (tmp_path / "nspawn.log").read_text(errors="replace")[-600:])
        box.wait_for(lambda: box.prop("ActiveState") in ("active", "failed"))
        assert box.prop("ActiveState") == "active", box.run("journalctl", "-u", "edged", "--no-pager").stdout
    except BaseException:
        box.stop()
        raise
    return box


def _infer_digits_in(box: Container) -> dict[str, Any]:
    """One KServe v2 request to the daemon in the container, from inside it (it has no other network)."""
    answer = box.run("python3", "-c", (
        "import json, urllib.request\n"
        "body = json.dumps({'inputs': [{'name': 'pixels', 'datatype': 'FP32', 'shape': [1, 64],"
        " 'data': [0.0] * 64}]}).encode()\n"
        "req = urllib.request.Request('http://127.0.0.1:8000/v2/models/digits/infer', data=body,"
        " headers={'Content-Type': 'application/json'})\n"
        "print(urllib.request.urlopen(req).read().decode())")).stdout
    doc: dict[str, Any] = json.loads(answer)
    return doc


def test_the_unit_under_systemd_notify_watchdog_reload_and_stop(
        built: Built, debian_tars: dict[str, Path], tmp_path: Path) -> None:
    root = _systemd_root_with_package(built, debian_tars, tmp_path)
    # A short watchdog and restart delay keep the test short; everything else is the packaged unit as is.
    dropin = root / "etc/systemd/system/edged.service.d"
    dropin.mkdir(parents=True, exist_ok=True)
    (dropin / "90-test.conf").write_text("[Service]\nWatchdogSec=4\nRestartSec=0.2\n")

    box = _boot_with_edged_active(root, tmp_path)
    try:
        assert box.prop("StatusText").startswith("serving 2 model version(s)")
        assert box.prop("NotifyAccess") == "main" and box.prop("WatchdogUSec") == "4s"

        # Hardening as systemd applies it, and the daemon works inside it.
        security = box.run("systemd-analyze", "security", "edged", "--no-pager").stdout
        score = float(next(x for x in security.splitlines() if "Overall exposure" in x).split(":")[1].split()[0])
        assert score <= 2.0
        assert _infer_digits_in(box)["outputs"][0]["shape"] == [1, 10]

        # The journal has the structured fields.
        entries = [json.loads(line) for line in box.run("journalctl", "-u", "edged", "-o", "json", "--no-pager",
                                                         "MODEL=digits").stdout.splitlines()]
        assert any(e.get("VERSION") == "1" and "self-test passed" in e.get("MESSAGE", "") for e in entries)

        # systemctl reload: RELOADING=1 ... READY=1, the service stays up.
        box.run("systemctl", "reload", "edged")
        # "reloading" from RELOADING=1 until the daemon's READY=1: it must come back to "active".
        box.wait_for(lambda: box.prop("ActiveState") == "active", timeout=60)
        assert box.prop("MainPID") != "0" and box.prop("NRestarts") == "0"
        assert "SIGHUP: reloading" in box.run("journalctl", "-u", "edged", "--no-pager").stdout

        # A hung daemon stops pinging: systemd kills it and starts it again.
        os.kill(box.host_pid(int(box.prop("MainPID"))), 19)  # SIGSTOP
        box.wait_for(lambda: box.prop("NRestarts") == "1" and box.prop("ActiveState") == "active")
        assert "Watchdog timeout" in box.run("journalctl", "-u", "edged", "--no-pager").stdout

        # systemctl stop: STOPPING=1, clean exit 0.
        box.run("systemctl", "stop", "edged")
        assert (box.prop("Result"), box.prop("ExecMainStatus")) == ("success", "0")
        assert "edged stopped" in box.run("journalctl", "-u", "edged", "--no-pager").stdout
    finally:
        box.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
def test_the_packaged_unit_applies_a_signed_update_from_a_registry(
        built: Built, debian_tars: dict[str, Path], tmp_path: Path) -> None:
    """Issue 17 item 2: the packaged unit as shipped (ProtectSystem=strict) with [registry] enabled takes a
    signed release from a registry on the host: the bundled models are served from the state dir, the new
    version is downloaded, verified, activated and committed there. The registry is a host process put in
    the container's network namespace (the container has no other network)."""
    from tests.registry_helpers import ADMIN_TOKEN, make_version

    registry_exe = REPO_ROOT / ".venv" / "bin" / "edged-registry"
    if not registry_exe.exists():
        pytest.skip("the registry runs from the development venv (./install.sh --dev)")
    root = _systemd_root_with_package(built, debian_tars, tmp_path)
    work = tmp_path / "registry"
    work.mkdir()
    (work / "admin.token").write_text(ADMIN_TOKEN)
    pub = subprocess.run([str(registry_exe), "keygen", "--out", str(work / "operator.key")], capture_output=True,
                         text=True, check=True, timeout=60).stdout.strip()
    version2 = make_version(work / "pub" / "digits" / "2", salt="nspawn")
    port = 8700

    box = _boot_with_edged_active(root, tmp_path)
    registry: subprocess.Popen[bytes] | None = None
    try:
        # The first start made the writable repository from the package's models.
        assert (root / "var/lib/edged/models/digits/1/model.toml").is_file()

        in_box = ["nsenter", "-t", str(box.init_pid), "-n"]
        url = f"http://127.0.0.1:{port}"
        registry = subprocess.Popen([*in_box, str(registry_exe), "serve", "--listen", f"127.0.0.1:{port}",
                                     "--data-dir", str(work / "data"), "--admin-token-file",
                                     str(work / "admin.token"), "--public-key", pub],
                                    stdout=(work / "registry.log").open("wb"), stderr=subprocess.STDOUT)

        def cli(*args: str) -> str:
            r = subprocess.run([*in_box, str(registry_exe), *args, "--url", url, "--token-file",
                                str(work / "admin.token")], capture_output=True, text=True, timeout=120)
            assert r.returncode == 0, f"{args}: {r.stderr[-2000:]}\n{(work / 'registry.log').read_text()[-2000:]}"
            return r.stdout

        def registry_up() -> bool:
            assert registry is not None and registry.poll() is None, (work / "registry.log").read_text()[-2000:]
            probe = "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)"
            return subprocess.run([*in_box, sys.executable, "-c", probe, f"{url}/healthz"],
                                  capture_output=True).returncode == 0

        box.wait_for(registry_up, timeout=120)
        token = json.loads(cli("enroll-token", "--json"))["token"]
        cfg = root / "etc/edged/edged.toml"
        text = cfg.read_text()
        assert "[registry]\nenabled = false\n" in text
        cfg.write_text(text.replace("[device]\n", '[device]\nid = "nspawn-dev"\n', 1).replace(
            "[registry]\nenabled = false\n",
            f'[registry]\nenabled = true\nurl = "{url}"\nenrollment_token = "{token}"\npublic_keys = ["{pub}"]\n'
            # a short trial: what is tested is the sandboxed unit's writes, not the trial's length
            "poll_interval_s = 1\ntrial_s = 2\n"))
        box.run("systemctl", "restart", "edged")
        box.wait_for(lambda: box.prop("ActiveState") == "active")

        cli("push", str(version2), "--model", "digits", "--model-version", "2")
        cli("release", "digits", "2", "--key", str(work / "operator.key"), "--device", "nspawn-dev")

        def committed() -> bool:
            state = root / "var/lib/edged/sync/state.json"
            if not state.exists():
                return False
            ms = json.loads(state.read_text())["models"].get("digits") or {}
            return bool(ms.get("pending") is None and (ms.get("current") or {}).get("version") == 2)

        box.wait_for(committed, timeout=240)
        assert (root / "var/lib/edged/models/digits/2/model.toml").is_file()
        assert not (root / "usr/share/edged/models/digits/2").exists()
        assert _infer_digits_in(box)["model_version"] == "2"
        devices = json.loads(cli("devices", "--json"))
        assert "committed" in json.dumps(devices)
        journal = box.run("journalctl", "-u", "edged", "--no-pager").stdout
        assert "Read-only file system" not in journal and "Traceback" not in journal
    finally:
        if registry is not None:
            registry.terminate()
            registry.wait(30)
        box.stop()
        shutil.rmtree(root, ignore_errors=True)
