"""Helpers for the registry and sync tests: a real registry server process, a throwaway PostgreSQL
cluster, signing keys, model versions made from the bundled digits model, and a device
(in-process agent, or the daemon as a subprocess)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from tests.http_client import web
from tests.polling import wait_until

REPO_ROOT = Path(__file__).resolve().parent.parent
DIGITS = REPO_ROOT / "models" / "digits" / "1"
PY = sys.executable
ADMIN_TOKEN = "admin-token-for-tests-0123456789"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(pred: Callable[[], Any], timeout: float = 30.0, interval: float = 0.05, what: str = "condition") -> Any:
    """:func:`tests.polling.wait_until` where an exception means "not up yet"."""
    return wait_until(pred, timeout, interval, what, ignore=(Exception,))


# ---- keys -----------------------------------------------------------------------------------------
@dataclass
class Keys:
    path: Path
    public: str

    @classmethod
    def make(cls, folder: Path, name: str = "operator") -> Keys:
        from edged.fsutil import atomic_write_bytes
        from edged.protocol.fleet.release import generate_private_key, private_key_pem, public_key_b64

        key = generate_private_key()
        path = folder / f"{name}.key"
        atomic_write_bytes(path, private_key_pem(key), mode=0o600)
        return cls(path, public_key_b64(key))

    def load(self) -> Any:
        from edged.protocol.fleet.release import load_private_key

        return load_private_key(self.path)


# ---- PostgreSQL -----------------------------------------------------------------------------------
def pg_bin() -> Path | None:
    base = Path("/usr/lib/postgresql")
    if base.is_dir():
        for v in sorted(base.iterdir(), key=lambda p: p.name, reverse=True):
            if (v / "bin" / "initdb").exists() and (v / "bin" / "pg_ctl").exists():
                return v / "bin"
    found = shutil.which("initdb")
    return Path(found).parent if found and shutil.which("pg_ctl") else None


class PgCluster:
    """A throwaway PostgreSQL cluster on a free port, owned by the ``postgres`` user when we are root."""

    def __init__(self) -> None:
        self.bin = pg_bin()
        if self.bin is None:
            raise RuntimeError("PostgreSQL server binaries (initdb, pg_ctl) not found; install Debian's postgresql")
        # directly under /tmp: the postgres user must be able to reach it (pytest's temp folders are 0700 root)
        self.root = Path(tempfile.mkdtemp(prefix="edged-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self.user = "postgres" if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name
        self._n = 0

    def _run(self, *argv: str) -> None:
        assert self.bin is not None
        cmd = [str(self.bin / argv[0]), *argv[1:]]
        if os.geteuid() == 0:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        r = subprocess.run(cmd, capture_output=True, timeout=120, cwd="/")
        if r.returncode != 0:
            raise RuntimeError(f"{argv[0]} failed: {r.stderr.decode(errors='replace')[-500:]}")

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            pw = pwd.getpwnam("postgres")
            os.chown(self.root, pw.pw_uid, pw.pw_gid)
            os.chmod(self.root, 0o700)
        self._run("initdb", "-D", str(self.data), "-U", self.user, "--auth=trust", "-E", "UTF8", "--no-sync")
        opts = (f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off "
                "-c max_connections=200 -c synchronous_commit=off")
        self._run("pg_ctl", "-D", str(self.data), "-o", opts, "-l", str(self.root / "log"), "-w", "start")

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.root, ignore_errors=True)

    def new_database(self) -> str:
        import psycopg

        self._n += 1
        name = f"registry_{self._n}"
        with psycopg.connect(f"host=127.0.0.1 port={self.port} user={self.user} dbname=postgres",
                             autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return f"postgresql+psycopg://{self.user}@127.0.0.1:{self.port}/{name}"


# ---- the registry server --------------------------------------------------------------------------
@dataclass
class RegistryServer:
    root: Path
    public_keys: list[str]
    database_url: str | None = None
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    extra_args: list[str] = field(default_factory=list)
    tls: tuple[Path, Path, Path] | None = None  # certificate, key, and the CA that signed them: serve HTTPS
    umask: int | None = None
    client_cert: tuple[Path, Path] | None = None  # what this helper's own requests present (certificate, key)
    blob_port: int | None = None  # serve blobs from a blob server process on this port (devices redirected)

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    @property
    def blob_url(self) -> str | None:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.blob_port}" if self.blob_port else None

    @property
    def ca_file(self) -> Path | None:
        return self.tls[2] if self.tls else None

    @property
    def data_dir(self) -> Path:
        return self.root / "registry"

    @property
    def token_file(self) -> Path:
        return self.root / "admin.token"

    def start(self) -> RegistryServer:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.token_file.write_text(ADMIN_TOKEN)
        argv = [PY, "-m", "edged.registry", "serve", "--listen", f"127.0.0.1:{self.port}", "--data-dir",
                str(self.data_dir), "--admin-token-file", str(self.token_file)]
        for k in self.public_keys:
            argv += ["--public-key", k]
        if self.database_url:
            argv += ["--database-url", self.database_url]
        if self.tls:
            argv += ["--tls-cert", str(self.tls[0]), "--tls-key", str(self.tls[1])]
        if self.blob_port:
            argv += ["--blob-listen", f"127.0.0.1:{self.blob_port}"]
        argv += self.extra_args
        log = (self.root / f"registry-{self.port}.log").open("wb")
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                     umask=-1 if self.umask is None else self.umask)
        log.close()
        verify: ssl.SSLContext | bool = True
        if self.ca_file:
            verify = ssl.create_default_context(cafile=str(self.ca_file))
            if self.client_cert:
                verify.load_cert_chain(str(self.client_cert[0]), str(self.client_cert[1]))

        def up() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError("registry exited: " + self.log()[-2000:])
            return all(httpx.get(f"{u}/healthz", timeout=1, verify=verify).status_code == 200
                       for u in (self.url, self.blob_url) if u)

        wait_for(up, 60, 0.1, "the registry server")
        return self

    def log(self) -> str:
        p = self.root / f"registry-{self.port}.log"
        return p.read_text(errors="replace") if p.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def client(self) -> Any:
        from edged.registry.admin_client import RegistryClient

        cert, key = self.client_cert or (None, None)
        return RegistryClient(self.url, ADMIN_TOKEN, ca_file=self.ca_file, client_cert=cert, client_key=key)

    def cli_env(self) -> dict[str, str]:
        """What ``edged-registry`` needs to reach this registry as its operator."""
        env = {"EDGED_REGISTRY_URL": self.url, "EDGED_REGISTRY_TOKEN": ADMIN_TOKEN}
        if self.ca_file:
            env["EDGED_REGISTRY_CA_FILE"] = str(self.ca_file)
        return env

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, **self.cli_env()}
        r = subprocess.run([PY, "-m", "edged.registry", *args], capture_output=True, text=True, env=env,
                           cwd=REPO_ROOT, timeout=120)
        if check and r.returncode != 0:
            raise AssertionError(f"edged-registry {' '.join(args)} failed ({r.returncode}): {r.stderr}")
        return r


# ---- model versions -------------------------------------------------------------------------------
def write_evaluation_set(dst: Path, samples: int = 300) -> str:
    """The digits model's held-out split (true labels) as ``[evaluation]`` files; returns the TOML section."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    _, x_test, _, y_test = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    (dst / "eval").mkdir(exist_ok=True)
    np.savez(dst / "eval" / "inputs.npz", pixels=x_test[:samples].astype(np.float32))
    np.save(dst / "eval" / "labels.npy", y_test[:samples].astype(np.int64))
    return '\n[evaluation]\ninputs = "eval/inputs.npz"\nlabels = "eval/labels.npy"\n'


def randomize_weights(dst: Path, seed: int = 0) -> None:
    """Random weights, and a golden file regenerated from them: wrong answers that pass the golden check."""
    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper

    m = onnx.load(str(dst / "model.onnx"))
    rng = np.random.default_rng(seed)
    for init in m.graph.initializer:
        w = numpy_helper.to_array(init)
        if w.dtype.kind == "f":
            init.CopyFrom(numpy_helper.from_array(rng.normal(0, float(w.std()) or 0.1, w.shape).astype(w.dtype),
                                                  init.name))
    onnx.save(m, str(dst / "model.onnx"))
    sess = ort.InferenceSession(str(dst / "model.onnx"), providers=["CPUExecutionProvider"])
    with np.load(dst / "warmup.npz") as w:
        feeds = {k: w[k] for k in w.files}
    names = [o.name for o in sess.get_outputs()]
    np.savez(dst / "expected.npz", **dict(zip(names, sess.run(names, feeds), strict=True)))


def make_version(dst: Path, *, golden_fail: bool = False, fixed_batch: bool = False, pad_mb: float = 0,
                 salt: str = "", evaluation: bool = False, random_weights: bool = False) -> Path:
    """A copy of the bundled digits version, optionally broken in a realistic way.

    ``golden_fail``: the expected output shipped with it is wrong (the golden check fails).
    ``fixed_batch``: the ONNX graph accepts batch 1 only, while the manifest promises 64, so it
    loads and warms up fine but fails on batched live traffic.
    ``salt`` changes the labels file so otherwise equal versions differ in content.
    """
    shutil.copytree(DIGITS, dst)
    # keep only the FP32 ONNX variant: small and quick to load
    for extra in ("model.int8.onnx", "openvino", "accuracy.json"):
        p = dst / extra
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    toml = (dst / "model.toml").read_text()
    head, _, rest = toml.partition("[[variants]]")
    variants = rest.split("[[variants]]")[0]
    tail = rest[rest.index("[batching]"):]
    model_file = "model.onnx"
    if fixed_batch:
        import onnx

        m = onnx.load(str(dst / "model.onnx"))
        for t in list(m.graph.input) + list(m.graph.output):
            t.type.tensor_type.shape.dim[0].ClearField("dim_param")
            t.type.tensor_type.shape.dim[0].dim_value = 1
        onnx.save(m, str(dst / "model.onnx"))
        for name in ("warmup.npz", "expected.npz"):  # the golden check runs batch 1, which still works
            with np.load(dst / name) as d:
                one = {k: d[k][:1] for k in d.files}
            np.savez(dst / name, **one)
    if golden_fail:
        with np.load(dst / "expected.npz") as e:
            bad = {k: np.roll(e[k], 3, axis=-1) for k in e.files}
        np.savez(dst / "expected.npz", **bad)
    if random_weights:
        randomize_weights(dst)
    if salt:
        with (dst / "labels.txt").open("a") as f:
            f.write(f"\n# {salt}\n")
    from edged.fsutil import sha256_file

    digest = sha256_file(dst / model_file)
    variants = "\n".join(
        (f'sha256 = "{digest}"' if line.startswith("sha256") else line) for line in variants.splitlines())
    (dst / "model.toml").write_text(head + "[[variants]]" + variants + "\n" + tail
                                    + (write_evaluation_set(dst) if evaluation else ""))
    if pad_mb:
        (dst / "padding.bin").write_bytes(os.urandom(int(pad_mb * (1 << 20))))
    return dst


# ---- devices --------------------------------------------------------------------------------------
def device_toml(  # noqa: PLR0913  one keyword per line of the device's edged.toml
        tmp: Path, repo: Path, registry_url: str, public_keys: list[str], *, token: str | None,
                device_id: str = "dev-1", http_port: int | None = None, poll_s: float = 0.2,
                labels: dict[str, str] | None = None, mqtt_url: str | None = None) -> Path:
    keys = ", ".join(f'"{k}"' for k in public_keys)
    labels_toml = ", ".join(f'{k} = "{v}"' for k, v in (labels or {}).items())
    text = textwrap.dedent(f"""
        [device]
        id = "{device_id}"
        state_dir = "{tmp / 'state'}"
        runtime_dir = "{tmp / 'run'}"
        model_repository = "{repo}"
        profile = "x86-64-cpu"

        [http]
        enabled = {"true" if http_port else "false"}
        listen = "127.0.0.1:{http_port or 0}"

        [mqtt]
        enabled = {"true" if mqtt_url else "false"}
        url = "{mqtt_url or 'mqtt://127.0.0.1:1883'}"

        [shm]
        enabled = false

        [telemetry]
        enabled = false

        [registry]
        enabled = true
        url = "{registry_url}"
        {f'enrollment_token = "{token}"' if token else ""}
        public_keys = [{keys}]
        poll_interval_s = {poll_s}
        labels = {{ {labels_toml} }}
        """)
    path = tmp / f"{device_id}.toml"
    path.write_text(text)
    return path


class InProcessDevice:
    """A real ModelManager + InferenceService + SyncAgent in this process, the agent on its own event loop."""

    def __init__(self, config_path: Path, **overrides: Any) -> None:
        from edged.config import load_config
        from edged.sync.settings import SyncSettings

        self.cfg = load_config(config_path)
        self.settings = SyncSettings.from_config(self.cfg, overrides)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.agent: Any = None
        self.manager: Any = None
        self.service: Any = None

    def start(self) -> InProcessDevice:
        from edged.core.manager import ModelManager
        from edged.core.service import InferenceService
        from edged.daemon import choose_profile
        from edged.hardware.probe import probe
        from edged.profiles import BackendPreference
        from edged.sync.agent import SyncAgent, device_facts
        from edged.sync.boot import prepare_boot

        prepare_boot(self.cfg, self.settings)
        self.cfg.device.model_repository.mkdir(parents=True, exist_ok=True)
        self.manager = ModelManager(self.cfg.device.model_repository, self.cfg.models,
                                    [BackendPreference(backend="onnxruntime", device="CPU", precisions=["fp32"])])
        self.manager.load_all()
        self.service = InferenceService(self.manager)
        facts = probe(Path("/"), engines=False)  # as the daemon does once at start, then hands to sync
        self.agent = SyncAgent(self.cfg, self.service, settings=self.settings,
                               facts=device_facts(facts, choose_profile(self.cfg, facts).profile.name))
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.agent.start(), self.loop).result(30)
        return self

    def stop(self) -> None:
        if self.agent is not None:
            asyncio.run_coroutine_threadsafe(self.agent.stop(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        if self.manager is not None:
            self.manager.shutdown()

    def serving(self, model: str = "digits") -> list[int]:
        from edged.core.model_versions import ModelState

        return [mv.version for mv in self.manager.table.versions(model) if mv.state is ModelState.READY]

    def state(self) -> Any:
        from edged.sync.state import StateStore

        return StateStore(self.settings.sync_dir).load()

    def infer(self, x: np.ndarray, model: str = "digits") -> Any:
        from edged.protocol.types import InferRequest

        return self.service.infer(InferRequest(model=model, inputs={"pixels": x}), timeout=30)


class DaemonProcess:
    """``python -m edged run`` (the daemon with its sync agent, ``--set`` sync settings) as a real process, HTTP on."""

    def __init__(self, config_path: Path, http_port: int, log_path: Path, *, sets: dict[str, Any] | None = None,
                 env: dict[str, str] | None = None, prefix: list[str] | None = None) -> None:
        """``prefix``: argv the daemon runs under (e.g. unshare with a mount set up first)."""
        self.config_path, self.http_port, self.log_path = config_path, http_port, log_path
        self.prefix = prefix or []
        self.sets = sets or {}
        self.env = env or {}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, extra_env: dict[str, str] | None = None) -> DaemonProcess:
        argv = [*self.prefix, PY, "-m", "edged", "run", "--config", str(self.config_path)]
        for k, v in self.sets.items():
            argv += ["--set", f"{k}={v}"]
        env = {**os.environ, **self.env, **(extra_env or {})}
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)
        return self

    def wait_http(self, timeout: float = 60) -> None:
        def up() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited with {self.proc.returncode}")
            return web().get(f"{self.base}/v2/health/live", timeout=1).status_code == 200

        wait_for(up, timeout, 0.05, "the daemon's HTTP endpoint")

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def versions(self, model: str = "digits") -> list[int]:
        """READY versions of ``model`` as the daemon's repository index reports them."""
        r = web().post(f"{self.base}/v2/repository/index", json={}, timeout=5)
        r.raise_for_status()
        return sorted(int(m["version"]) for m in r.json() if m["name"] == model and m.get("state") == "READY")

    def infer(self, x: np.ndarray, model: str = "digits") -> httpx.Response:
        body = {"inputs": [{"name": "pixels", "datatype": "FP32", "shape": list(x.shape),
                            "data": x.ravel().tolist()}]}
        return web().post(f"{self.base}/v2/models/{model}/infer", json=body, timeout=10)


class EdgedRun(DaemonProcess):
    """The daemon exactly as installed: ``edged run --config``."""

    def start(self, extra_env: dict[str, str] | None = None) -> EdgedRun:
        from tests.conftest import EDGED

        env = {**os.environ, **self.env, **(extra_env or {})}
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen([*EDGED, "run", "--config", str(self.config_path)], stdout=log,
                                         stderr=subprocess.STDOUT, env=env)
        return self


def release_files(client: Any, model: str) -> dict[int, dict[str, str]]:
    """version -> {path: sha256} for every release the registry holds for ``model``."""
    out: dict[int, dict[str, str]] = {}
    for r in client.releases(model):
        out[r.version] = {f.path: f.sha256 for f in client.version(model, r.version).files}
    return out


def repo_versions_are_whole(repo: Path, model: str, signed: dict[int, dict[str, str]]) -> list[int]:
    """Every version folder of ``model`` in the repository equals a signed version, file for file."""
    from edged.fsutil import sha256_file

    found = []
    model_dir = repo / model
    for d in sorted(model_dir.iterdir()) if model_dir.is_dir() else []:
        assert d.name.isdigit(), f"unexpected entry {d.name} in {model_dir}"
        v = int(d.name)
        assert v in signed, f"version {v} in the repository was never released"
        files = {p.relative_to(d).as_posix(): sha256_file(p) for p in d.rglob("*") if p.is_file()}
        assert files == signed[v], f"version {v} in the repository differs from its signed release"
        found.append(v)
    return found


@contextlib.contextmanager
def started(obj: Any) -> Iterator[Any]:
    obj.start()
    try:
        yield obj
    finally:
        obj.stop()


CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")


@contextlib.contextmanager
def headless_chromium(width: int = 1280, height: int = 900) -> Iterator[Any]:
    """A selenium driver for Debian's headless Chromium at this window size; skips the test without them."""
    import pytest

    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.skip("Debian's chromium and chromium-driver are not installed (install.sh installs them)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is in the dev extra")
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    opts.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={width},{height}"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=opts)
    try:
        yield driver
    finally:
        driver.quit()


# ---- fault injection ------------------------------------------------------------------------------
GOOD_POINTS: tuple[str, ...] = (
    "download.start", "download.chunk:3", "download.file", "verify.done", "prepare.done", "install.renamed",
    "activate.before", "activate.loaded", "trial.start", "trial.tick", "commit.before", "commit.saved")
BAD_POINTS: tuple[str, ...] = ("download.chunk:2", "verify.done", "rollback.before", "rollback.loaded")


@dataclass
class FaultRun:
    point: str
    release: int
    version: int
    killed: bool
    outcome: str  # committed | rolled-back
    seconds: float


class FaultHarness:
    """One registry, one daemon process, many updates each interrupted by SIGKILL.

    The daemon is armed through ``EDGED_SYNC_FAULT_FILE``: it dies at the named point of the
    next update; or the harness kills it after a random delay. After every kill it checks what
    is on disk, restarts the daemon, checks what it serves, and waits for the update to be
    committed or rolled back.
    """

    MODEL = "digits"

    def __init__(self, tmp: Path, *, trial_s: float = 0.2, poll_s: float = 0.05, seed: int = 0) -> None:
        import random

        from edged.sync.faults import FAULT_FILE_ENV

        self.tmp = tmp
        self.rng = random.Random(seed)
        self.keys = Keys.make(tmp)
        self.server = RegistryServer(tmp, [self.keys.public]).start()
        self.client = self.server.client()
        self.key = self.keys.load()
        for v in (1, 2, 3, 4):
            self.client.push_folder(make_version(tmp / "pub" / str(v), salt=f"v{v}"), self.MODEL, v)
        self.client.push_folder(make_version(tmp / "pub" / "9", golden_fail=True, salt="bad"), self.MODEL, 9)
        self.repo = tmp / "repo"
        self.repo.mkdir()
        self.fault_file = tmp / "fault"
        port = free_port()
        token = self.client.enrollment_token().token
        cfg = device_toml(tmp, self.repo, self.server.url, [self.keys.public], token=token, device_id="fault-dev",
                          http_port=port, poll_s=poll_s)
        self.daemon = DaemonProcess(cfg, port, tmp / "daemon.log",
                                    sets={"trial_s": trial_s, "download_chunk_kb": 4, "retry_max_s": 0.5},
                                    env={FAULT_FILE_ENV: str(self.fault_file)})
        self.state_path = tmp / "state" / "sync" / "state.json"
        self.signed: dict[int, dict[str, str]] = {}
        self.runs: list[FaultRun] = []
        r1 = self._release(1)
        self.daemon.start()
        self.daemon.wait_http()
        self._wait_settled(r1)

    def close(self) -> None:
        self.daemon.stop()
        self.client.close()
        self.server.stop()

    # ---- state ------------------------------------------------------------------------------
    def state(self) -> Any:
        from edged.sync.state import SyncState

        try:
            return SyncState.model_validate_json(self.state_path.read_bytes()).models.get(self.MODEL)
        except FileNotFoundError:
            return None

    def _release(self, version: int) -> int:
        info = self.client.release(self.key, self.MODEL, version, expires_in_s=3600)
        self.signed[version] = {f.path: f.sha256 for f in self.client.version(self.MODEL, version).files}
        return int(info.release)

    def _settled(self, release: int) -> bool:
        ms = self.state()
        return bool(ms is not None and ms.pending is None and (
            (ms.current is not None and ms.current.release == release) or release in ms.rejected))

    def _wait_settled(self, release: int) -> None:
        wait_for(lambda: self._settled(release), 60, 0.05, f"release {release} committed or rolled back")

    @staticmethod
    def allowed(ms: Any) -> set[int]:
        """Versions that may be served: the committed one, and one being activated, on trial or rolled back."""
        out = {ms.current.version} if ms is not None and ms.current is not None else set()
        if ms is not None and ms.pending is not None and ms.pending.step in ("activate", "trial", "rollback"):
            out.add(ms.pending.version)
        return out

    # ---- checks -----------------------------------------------------------------------------
    def check_disk(self) -> None:
        """With the daemon dead: only whole, signed versions in the repository; the next start pins one."""
        from edged.sync.boot import pinned_version
        from edged.sync.state import SyncState

        repo_versions_are_whole(self.repo, self.MODEL, self.signed)
        state = SyncState.model_validate_json(self.state_path.read_bytes())
        pin = pinned_version(state, self.MODEL)
        assert isinstance(pin, int) and not isinstance(pin, bool), f"no version to serve after the crash: {pin}"
        assert (self.repo / self.MODEL / str(pin)).is_dir(), f"pinned version {pin} is not in the repository"

    def check_serving(self) -> list[int]:
        before = self.state()
        served = self.daemon.versions(self.MODEL)
        after = self.state()
        ok = self.allowed(before) | self.allowed(after)
        assert served, "nothing served"
        assert set(served) <= ok, f"serving {served}, allowed {sorted(ok)}"
        assert all(v in self.signed for v in served)
        return served

    # ---- one run ----------------------------------------------------------------------------
    def next_version(self, bad: bool) -> int:
        if bad:
            return 9
        ms = self.state()
        current = ms.current.version if ms is not None and ms.current is not None else 1
        lkg = ms.lkg.version if ms is not None and ms.lkg is not None else None
        # prefer a version not on disk, so the update downloads
        choices = [v for v in (2, 3, 4, 1) if v not in (current, lkg)]
        return choices[0]

    def run(self, point: str | None, *, delay: float | None = None, bad: bool = False) -> FaultRun:
        t0 = time.monotonic()
        version = self.next_version(bad)
        if point is not None:
            self.fault_file.write_text(point)
        release = self._release(version)
        killed = False
        if point is not None:
            try:
                assert self.daemon.proc is not None
                self.daemon.proc.wait(30)
                killed = True
            except subprocess.TimeoutExpired:
                pass
        else:
            time.sleep(delay or 0.0)  # sleep-ok: the fault lands this long into the update, as asked
            killed = self.daemon.alive()
            self.daemon.kill()
        with contextlib.suppress(FileNotFoundError):
            self.fault_file.unlink()
        if not self.daemon.alive():
            self.daemon.kill()
            self.check_disk()
            self.daemon.start()
            self.daemon.wait_http()
        self.check_serving()
        self._wait_settled(release)
        served = self.check_serving()
        ms = self.state()
        assert served == [ms.current.version], f"settled but serving {served}, committed {ms.current.version}"
        repo_versions_are_whole(self.repo, self.MODEL, self.signed)
        r = self.daemon.infer(np.zeros((1, 64), dtype=np.float32), self.MODEL)
        assert r.status_code == 200 and int(r.json()["model_version"]) == ms.current.version
        outcome = "committed" if ms.current.release == release else "rolled-back"
        assert outcome == ("rolled-back" if bad else "committed"), f"{point}: {outcome}"
        run = FaultRun(point or f"random {delay:.2f}s", release, version, killed, outcome, time.monotonic() - t0)
        self.runs.append(run)
        return run

    def plan(self, cycles: int, random_runs: int) -> list[tuple[str | None, float | None, bool]]:
        out: list[tuple[str | None, float | None, bool]] = []
        for _ in range(cycles):
            out += [(p, None, False) for p in GOOD_POINTS] + [(p, None, True) for p in BAD_POINTS]
        out += [(None, self.rng.uniform(0.0, 1.2), self.rng.random() < 0.25) for _ in range(random_runs)]
        self.rng.shuffle(out)
        return out

    def resumed_downloads(self) -> int:
        events = self.client.device("fault-dev", events=1000).events
        return sum(1 for e in events if e.step == "verifying" and e.detail.get("resumed_files", 0) > 0)
