"""What the clients and the registry server load at run time: no device package, no engine library.

tests/test_architecture.py proves it on the import graph (every import, lazy ones included); these run the
code: each client module imported in a fresh interpreter, and the registry server and its CLI answering
real requests in a process where any device package or device library is refused at import.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO_ROOT
from tests.registry_helpers import ADMIN_TOKEN, Keys, free_port, wait_for

DEVICE_PACKAGES = ("core", "backends", "transports", "sync", "pipeline", "telemetry", "hardware")
DEVICE_LIBRARIES = ("onnxruntime", "openvino", "tensorrt", "paho", "psutil", "prometheus_client")
CLIENTS = sorted(p.stem for p in (REPO_ROOT / "edged" / "client").glob("*.py") if p.stem != "__init__")

# Run before the code under test: any import of a device package or library fails as if it were not installed,
# and is written down, so that a lazy import the registry reaches only on some request is caught too.
REFUSE = f"""
import importlib.abc, sys
DEVICE = {DEVICE_PACKAGES!r}
LIBS = {DEVICE_LIBRARIES!r}
refused = []

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        parts = name.split(".")
        if parts[0] in LIBS or (parts[0] == "edged" and len(parts) > 1 and parts[1] in DEVICE + ("daemon", "config")):
            refused.append(name)
            raise ModuleNotFoundError(f"{{name}} is refused in this test", name=name)
        return None

sys.meta_path.insert(0, Refuse())
"""


def _loaded_device_modules(names: list[str]) -> list[str]:
    return [
        n
        for n in names
        if n.split(".")[0] in DEVICE_LIBRARIES
        or (n.startswith("edged.") and n.split(".")[1] in (*DEVICE_PACKAGES, "daemon", "config"))
    ]


def test_each_client_module_loads_only_protocol_and_shared_leaves() -> None:
    code = (
        "import importlib, json, sys\n"
        "out = {}\n"
        f"for m in {CLIENTS!r}:\n"
        "    before = set(sys.modules)\n"
        "    importlib.import_module('edged.client.' + m)\n"
        "    out[m] = sorted(set(sys.modules) - before)\n"
        "print(json.dumps(out))\n"
    )
    # One interpreter per module would repeat the same imports; each module's new modules are checked apart.
    r = subprocess.run(
        [sys.executable, "-c", REFUSE + code], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT
    )
    assert r.returncode == 0, r.stderr[-3000:]
    loaded = json.loads(r.stdout)
    assert set(loaded) == set(CLIENTS) and "shm" in loaded and "grpc" in loaded
    for module, names in loaded.items():
        edged = {n for n in names if n.startswith("edged.")}
        assert not _loaded_device_modules(names), (module, _loaded_device_modules(names))
        assert all(
            n.startswith(("edged.client", "edged.protocol"))
            or n in ("edged.errors", "edged.datatypes", "edged.membudget")
            for n in edged
        ), (module, sorted(edged))


def test_the_registry_and_its_dashboard_serve_with_every_device_package_refused(tmp_path: Path) -> None:
    token = tmp_path / "admin.token"
    token.write_text(ADMIN_TOKEN)
    port = free_port()
    # What each process loaded and was refused, written when it exits (SIGINT: uvicorn shuts down, then re-raises
    # the signal, and Python's KeyboardInterrupt still runs atexit; SIGTERM's default action would not).
    run = REFUSE + (
        f"import atexit, json, os\n"
        f"atexit.register(lambda: open(f'{tmp_path}/modules-{{sys.argv[1]}}.json', 'w').write(json.dumps("
        "{'loaded': sorted(sys.modules), 'refused': refused})))\n"
        "from edged.registry.cli import main\n"
        "raise SystemExit(main(sys.argv[1:]))\n"
    )
    log = (tmp_path / "registry.log").open("wb")
    serve = subprocess.Popen(
        [
            sys.executable,
            "-c",
            run,
            "serve",
            "--listen",
            f"127.0.0.1:{port}",
            "--data-dir",
            str(tmp_path / "data"),
            "--admin-token-file",
            str(token),
            "--public-key",
            Keys.make(tmp_path).public,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO_ROOT,
    )
    base = f"http://127.0.0.1:{port}"
    try:

        def up() -> bool:
            if serve.poll() is not None:
                pytest.fail((tmp_path / "registry.log").read_text()[-3000:])
            return httpx.get(f"{base}/healthz", timeout=1).status_code == 200

        wait_for(up, 60, 0.1, "the registry")
        login = httpx.get(f"{base}/ui/login", timeout=10)
        assert login.status_code == 200 and "<form" in login.text, login.text[:500]
        status = httpx.get(f"{base}/api/v1/status", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10)
        assert status.status_code == 200 and "models" in status.json(), status.text[:500]
        # The operator CLI, under the same rule, against the server.
        cli = subprocess.run(
            [sys.executable, "-c", run, "models", "--url", base, "--token-file", str(token), "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO_ROOT,
        )
        assert cli.returncode == 0 and json.loads(cli.stdout) == [], cli.stderr[-3000:]
    finally:
        serve.send_signal(signal.SIGINT)
        serve.wait(30)
        log.close()
    for command in ("serve", "models"):
        seen = json.loads((tmp_path / f"modules-{command}.json").read_text())
        assert seen["refused"] == [] and not _loaded_device_modules(seen["loaded"]), (command, seen["refused"])
    assert {"edged.registry.api", "edged.registry.web.pages"} <= set(
        seen_serve := json.loads((tmp_path / "modules-serve.json").read_text())["loaded"]
    ), sorted(seen_serve)


def test_the_daemon_without_the_device_extra_names_it(tmp_path: Path) -> None:
    """What `pip install edged` (no extras) gives the daemon: the command says what to install, not a traceback."""
    hide = "; ".join(f"sys.modules[{m!r}] = None" for m in DEVICE_LIBRARIES)  # each import now fails
    code = f"import sys; {hide}; from edged.cli import main; raise SystemExit(main(sys.argv[1:]))"
    config = tmp_path / "edged.toml"
    config.write_text(f'[http]\nlisten = "127.0.0.1:{free_port()}"\n[shm]\nenabled = false\n')
    r = subprocess.run(
        [sys.executable, "-c", code, "run", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
    )
    assert r.returncode == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "'device' extra" in r.stderr, r.stderr[-3000:]
    assert "pip install 'edged[device]'" in r.stderr


def test_a_registry_without_paho_refuses_a_nudge_url_at_start(tmp_path: Path) -> None:
    """The registry's extra leaves MQTT out; asking for the nudge without it fails at start, naming the extra."""
    code = REFUSE + "from edged.registry.cli import main\nraise SystemExit(main(sys.argv[1:]))\n"
    settings = tmp_path / "registry.toml"
    settings.write_text('[registry]\nnudge_mqtt_url = "mqtt://127.0.0.1:1883"\n')
    token = tmp_path / "admin.token"
    token.write_text(ADMIN_TOKEN)
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "serve",
            "--config",
            str(settings),
            "--admin-token-file",
            str(token),
            "--listen",
            f"127.0.0.1:{free_port()}",
            "--data-dir",
            str(tmp_path / "data"),
            "--public-key",
            Keys.make(tmp_path).public,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
    )
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "pip install 'edged[registry,mqtt]'" in r.stderr, r.stderr[-3000:]
