"""The `edged` command end to end, as a user runs it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import EDGED, MODELS

NO_TRANSPORTS = "[http]\nenabled = false\n[mqtt]\nenabled = false\n[shm]\nenabled = false\n"


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*EDGED, *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def digits_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled digits model and a state folder shared by the ``edged infer`` tests: the first run measures
    the engines and remembers its choice (state/cache/select), the others load it as a user's next run does
    (measuring took ~3.5 s of each run; the remembering is test_models_list_remeasure_*'s subject)."""
    tmp = tmp_path_factory.mktemp("cli-digits")
    shutil.copytree(MODELS / "digits", tmp / "models" / "digits")
    cfg = tmp / "edged.toml"
    state, run, repo = tmp / "state", tmp / "run", tmp / "models"
    cfg.write_text(f'[device]\nid = "test-device"\nstate_dir = "{state}"\nruntime_dir = "{run}"\n'
                   f'model_repository = "{repo}"\n')
    return cfg


def test_version() -> None:
    r = _run("--version")
    assert r.returncode == 0 and r.stdout.startswith("edged ")


def test_infer_classifies_held_out_digits(tmp_path: Path, digits_config: Path,
                                          digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    x, y = digits_holdout
    cfg = digits_config
    np.save(tmp_path / "x.npy", x[:20])
    r = _run("infer", "digits", "--input", str(tmp_path / "x.npy"), "--config", str(cfg))
    assert r.returncode == 0, r.stderr
    classes = [int(line.split("class ")[1].split()[0]) for line in r.stdout.splitlines() if "class " in line]
    assert len(classes) == 20
    assert np.mean(np.array(classes) == y[:20]) >= 0.9


def test_infer_json_prints_exactly_the_v2_response(tmp_path: Path, digits_config: Path,
                                                   digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    x, y = digits_holdout
    cfg = digits_config
    np.save(tmp_path / "one.npy", x[3])  # a single sample: the batch dimension is added
    r = _run("infer", "digits", "--input", str(tmp_path / "one.npy"), "--json", "--config", str(cfg))
    assert r.returncode == 0, r.stderr
    resp = json.loads(r.stdout)
    assert set(resp) == {"model_name", "model_version", "outputs"}
    assert resp["model_name"] == "digits" and resp["model_version"] == "1"
    (out,) = resp["outputs"]
    assert set(out) == {"name", "datatype", "shape", "data"}
    assert out["name"] == "probabilities" and out["datatype"] == "FP32" and out["shape"] == [1, 10]
    assert int(np.argmax(out["data"])) == int(y[3])


def test_infer_bad_input_is_a_clear_error(tmp_path: Path, digits_config: Path) -> None:
    cfg = digits_config
    np.save(tmp_path / "bad.npy", np.zeros((2, 63), np.float32))
    r = _run("infer", "digits", "--input", str(tmp_path / "bad.npy"), "--config", str(cfg))
    assert r.returncode == 1
    assert "input 'pixels'" in r.stderr and "63" in r.stderr


def test_models_list_shows_the_broken_model_and_why(model_repo: Callable[..., Path],
                                                    write_config: Callable[..., Path]) -> None:
    repo = model_repo("digits", "mobilenet")
    # Break mobilenet two ways: an unknown manifest key, and (in a copy) a bad digest.
    m = repo / "mobilenet" / "1" / "model.toml"
    m.write_text(m.read_text().replace("max_batch_size = 32", "max_batch_size = 32\nmax_batch = 8"))
    import shutil

    shutil.copytree(repo / "digits", repo / "digits_bad")
    (repo / "digits_bad" / "1" / "model.onnx").write_bytes(b"tampered")
    (repo / "digits_bad" / "1" / "model.int8.onnx").write_bytes(b"tampered")
    (repo / "digits_bad" / "1" / "openvino" / "model.xml").write_bytes(b"tampered")
    cfg = write_config(repo)
    r = _run("models", "list", "--json", "--config", str(cfg))
    assert r.returncode == 0, r.stderr
    models = {m["name"]: m for m in json.loads(r.stdout)["models"]}
    assert models["digits"]["state"] == "ready"
    assert models["digits"]["backend"] in ("onnxruntime", "openvino")
    assert models["mobilenet"]["state"] == "unavailable"
    assert "max_batch: unknown key" in models["mobilenet"]["reason"]
    assert models["digits_bad"]["state"] == "unavailable"
    assert "sha256 mismatch" in models["digits_bad"]["reason"]
    text = _run("models", "list", "--config", str(cfg))
    assert text.returncode == 0
    assert "max_batch: unknown key" in text.stdout and "ready" in text.stdout


def test_models_list_remeasure_forgets_the_remembered_engine_choices(
        model_repo: Callable[..., Path], write_config: Callable[..., Path], tmp_path: Path) -> None:
    cfg = write_config(model_repo("digits"))
    select = tmp_path / "state" / "cache" / "select"
    select.mkdir(parents=True)
    remembered = [select / "digits-1-0123456789abcdef.json", select / "mobilenet-1-fedcba9876543210.json"]
    for f in remembered:
        f.write_text('{"winner": "onnxruntime/CPU/fp32"}')
    (select / "notes.txt").write_text("not a remembered choice")
    r = _run("models", "list", "--json", "--remeasure", "--config", str(cfg))
    assert r.returncode == 0, r.stderr
    assert "forgot 2 remembered engine choice(s); measuring again" in r.stderr  # no daemon runs: measured now
    assert not any(f.exists() for f in remembered) and (select / "notes.txt").exists()
    assert {m["name"]: m["state"] for m in json.loads(r.stdout)["models"]} == {"digits": "ready"}


def test_run_serves_until_sigterm(model_repo: Callable[..., Path], write_config: Callable[..., Path]) -> None:
    cfg = write_config(model_repo("digits", "mobilenet"), NO_TRANSPORTS)
    proc = subprocess.Popen([*EDGED, "run", "--config", str(cfg)], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 120
        assert proc.stderr is not None
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            if "edged ready" in line:
                break
        log = "".join(lines)
        assert "edged ready" in log, log
        assert "model=digits version=1 ready" in log and "model=mobilenet version=1 ready" in log
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_config_problems_name_their_file_in_both_commands(tmp_path: Path) -> None:
    """Each problem on its own ``config:`` line after the file it is in, for the daemon's and the registry's
    command alike (exit 2), so a user with several files knows which to open."""
    bad = tmp_path / "edged.toml"
    bad.write_text('[device]\nid = "d"\nno_such_key = 1\n')
    r = _run("run", "--config", str(bad))
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("config: ")]
    assert r.returncode == 2 and lines and all(ln.startswith(f"config: {bad}: ") for ln in lines), r.stderr
    assert any("no_such_key" in ln for ln in lines), r.stderr

    reg = tmp_path / "registry.toml"
    reg.write_text("listen = 5\n")
    r = subprocess.run([sys.executable, "-c", "import sys; from edged.registry.cli import main; sys.exit(main())",
                        "serve", "--config", str(reg)], capture_output=True, text=True, timeout=60)
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("config: ")]
    assert r.returncode == 2 and lines and all(ln.startswith(f"config: {reg}: ") for ln in lines), r.stderr
