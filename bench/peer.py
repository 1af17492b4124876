"""The peer row: the same model behind a stock MLServer (a KServe v2 Python server), in a throwaway
venv outside the repo that the suite makes on request (``--peer-venv DIR``).

Anything that keeps it from running (no venv given, the install fails, the server does not come
up) is returned as the reason the row is skipped; the rest of the suite never depends on it.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import time
import venv
from collections.abc import Iterator
from pathlib import Path

from bench.common import stop_process
from edged.client.http import HttpClient
from tests.netutil import free_port

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["mlserver", "onnxruntime", "numpy"]


def ensure_venv(path: Path) -> str | None:
    """Make the peer's venv if it has no mlserver yet; None when ready, else why not."""
    if (path / "bin" / "mlserver").exists():
        return None
    if ROOT in path.resolve().parents or path.resolve() == ROOT:
        return f"the peer venv must live outside the repo, not at {path}"
    try:
        venv.create(path, with_pip=True)
        r = subprocess.run([str(path / "bin" / "pip"), "install", "-q", *PACKAGES], capture_output=True, text=True,
                           timeout=900)
    except (OSError, subprocess.SubprocessError) as e:
        return f"could not make the peer venv: {e}"
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        return f"pip install {' '.join(PACKAGES)} failed: {last}"
    return None


def peer_version(path: Path) -> str:
    r = subprocess.run([str(path / "bin" / "python"), "-c", "import mlserver, onnxruntime; "
                        "print(mlserver.__version__, onnxruntime.__version__)"], capture_output=True, text=True)
    parts = r.stdout.split()
    return f"MLServer {parts[0]}, ONNX Runtime {parts[1]}" if len(parts) == 2 else "MLServer ?"


@contextlib.contextmanager
def mlserver(path: Path, workdir: Path, model: str, onnx_file: Path) -> Iterator[str]:
    """Serve ``onnx_file`` as ``model`` with MLServer's defaults but parallel_workers 0; yields host:port."""
    workdir.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "bench" / "peer_runtime.py", workdir / "peer_runtime.py")
    port = free_port()
    (workdir / "settings.json").write_text(json.dumps({
        "host": "127.0.0.1", "http_port": port, "grpc_port": free_port(), "metrics_port": free_port(),
        # MLServer 1.7's worker processes die at start here ("no current event loop"): infer in-process.
        "parallel_workers": 0}))
    (workdir / "model-settings.json").write_text(json.dumps({
        "name": model, "implementation": "peer_runtime.OnnxModel", "parameters": {"uri": str(onnx_file)}}))
    log = (workdir / "mlserver.log").open("wb")
    proc = subprocess.Popen([str(path / "bin" / "mlserver"), "start", str(workdir)], cwd=workdir, stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"127.0.0.1:{port}"
    try:
        client = HttpClient(url, timeout=2)
        end = time.monotonic() + 120
        while True:
            with contextlib.suppress(Exception):
                if client.ready(model):
                    break
            if proc.poll() is not None or time.monotonic() > end:
                tail = (workdir / "mlserver.log").read_text(errors="replace").strip().splitlines()[-3:]
                raise RuntimeError(f"MLServer did not become ready: {' | '.join(tail)}")
            time.sleep(0.5)
        client.close()
        yield url
    finally:
        stop_process(proc)
        log.close()


if __name__ == "__main__":
    print(ensure_venv(Path(sys.argv[1])) or "ready")
