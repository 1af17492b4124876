"""The registry's own install path (issue 17 item 7): the unit's hardening, the message without the
'registry' extra, and ./install.sh --registry building a venv that serves."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO_ROOT
from tests.registry_helpers import free_port, wait_for

UNIT = REPO_ROOT / "packaging" / "systemd" / "edged-registry.service"
EXTRA = ("fastapi", "starlette", "uvicorn", "sqlalchemy", "alembic", "httpx", "psycopg", "jinja2")


def _exposure(unit: Path) -> float:
    r = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--no-pager", str(unit)],
                       capture_output=True, text=True, timeout=60)
    line = next((x for x in r.stdout.splitlines() if "Overall exposure" in x), None)
    if line is None:
        pytest.skip(f"systemd-analyze security --offline is not available here: {r.stderr[-300:]}")
    return float(line.split(":")[1].split()[0])


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_the_registry_unit_is_hardened_like_the_daemons(tmp_path: Path) -> None:
    copy = tmp_path / UNIT.name  # --offline reads the file as it is: no installed unit needed
    shutil.copy(UNIT, copy)
    assert _exposure(copy) <= 2.0
    text = UNIT.read_text()
    assert "DynamicUser=yes" in text and "LoadCredential=admin-token:/etc/edged-registry/admin-token" in text
    assert "--admin-token-file %d/admin-token" in text and "ProtectSystem=strict" in text


def test_serve_without_the_registry_extra_names_the_extra(tmp_path: Path) -> None:
    """What `pip install edged` (no extras) gives: the command says what to install instead of a traceback."""
    hide = "; ".join(f"sys.modules[{m!r}] = None" for m in EXTRA)  # import of each now fails: ModuleNotFoundError
    code = f"import sys; {hide}; from edged.registry.cli import main; raise SystemExit(main(sys.argv[1:]))"
    r = subprocess.run([sys.executable, "-c", code, "serve", "--data-dir", str(tmp_path)], capture_output=True,
                       text=True, timeout=60, cwd=REPO_ROOT)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr and "ModuleNotFoundError" not in r.stderr
    assert "'registry' extra" in r.stderr and "pip install 'edged[registry]'" in r.stderr
    assert "./install.sh --registry" in r.stderr


@pytest.mark.slow
def test_install_sh_registry_builds_a_venv_that_serves(tmp_path: Path) -> None:
    """./install.sh --registry under a scratch root (pip from PyPI): venv, settings, a private token, the
    unit; the installed edged-registry serves; a second run changes nothing; --uninstall --purge cleans up."""
    root = tmp_path / "root"
    run = subprocess.run(["bash", str(REPO_ROOT / "install.sh"), "--registry", "--root", str(root)],
                         capture_output=True, text=True, timeout=900)
    if run.returncode != 0 and "pip" in run.stderr and "connection" in run.stderr.lower():
        pytest.skip(f"PyPI is not reachable: {run.stderr[-300:]}")
    assert run.returncode == 0, run.stderr[-3000:]
    exe = root / "opt/edged-registry/bin/edged-registry"
    token = root / "etc/edged-registry/admin-token"
    assert exe.is_file() and (root / "usr/local/bin/edged-registry").is_symlink()
    assert (root / "etc/systemd/system/edged-registry.service").read_text() == UNIT.read_text()
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and len(token.read_text().strip()) >= 32
    key = root / "etc/edged-registry/operator.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    pub = (root / "etc/edged-registry/operator.key.pub").read_text().strip()
    assert f'public_keys = ["{pub}"]' in (root / "etc/edged-registry/registry.toml").read_text()
    port = free_port()
    serve = subprocess.Popen([str(exe), "serve", "--config", str(root / "etc/edged-registry/registry.toml"),
                              "--admin-token-file", str(token), "--data-dir", str(tmp_path / "data"),
                              "--listen", f"127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                             stderr=(tmp_path / "serve.log").open("wb"),
                             env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})

    def up() -> bool:
        assert serve.poll() is None, (tmp_path / "serve.log").read_text()[-2000:]
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200

    try:
        wait_for(up, 120, 0.2, "the installed registry")
        models = subprocess.run([str(exe), "models", "--url", f"http://127.0.0.1:{port}", "--token-file",
                                 str(token), "--json"], capture_output=True, text=True, timeout=60)
        assert models.returncode == 0, models.stderr
    finally:
        serve.terminate()
        serve.wait(30)
    again = subprocess.run(["bash", str(REPO_ROOT / "install.sh"), "--registry", "--root", str(root)],
                           capture_output=True, text=True, timeout=900)
    assert again.returncode == 0 and "up to date" in again.stderr, again.stderr[-2000:]
    subprocess.run(["bash", str(REPO_ROOT / "install.sh"), "--registry", "--root", str(root), "--uninstall",
                    "--purge"], check=True, capture_output=True, timeout=300)
    assert not [p for p in root.rglob("*") if p.is_file()]
