"""The daemon probes the hardware once per start and hands the facts down (issue 19).

The engine benchmark's key, the TensorRT plan key and the sync agent's facts used to probe
again on their own; the count here is of real probes (the wrapper calls the real one).
"""

from __future__ import annotations

import importlib
import shutil
from pathlib import Path
from typing import Any

import pytest

from edged.config import parse_config
from edged.daemon import build_runtime
from edged.hardware.facts import HardwareFacts
from edged.sync.agent import device_facts

REPO_ROOT = Path(__file__).resolve().parents[2]

PROFILE = '''name = "bench-cpu"
priority = 1
select = "benchmark"
[match]
[[backends]]
backend = "onnxruntime"
device = "CPU"
precisions = ["fp32", "int8"]
'''


def test_a_daemon_start_probes_the_hardware_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    probe_module = importlib.import_module("edged.hardware.probe")  # the package re-exports the function
    real = probe_module.probe
    calls: list[Path] = []

    def counted(root: Path, **kw: Any) -> HardwareFacts:
        calls.append(root)
        return real(root, **kw)

    monkeypatch.setattr(probe_module, "probe", counted)
    monkeypatch.setattr("edged.daemon.probe", counted)
    repo = tmp_path / "models"
    shutil.copytree(REPO_ROOT / "models" / "digits", repo / "digits")
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "bench-cpu.toml").write_text(PROFILE)
    cfg = parse_config(f'[device]\nstate_dir = "{tmp_path / "state"}"\nmodel_repository = "{repo}"\n'
                       f'profiles_dir = "{tmp_path / "profiles"}"\nprofile = "bench-cpu"\n')
    rt = build_runtime(cfg)  # loads digits by benchmarking its fp32 and int8 variants (a selection key per load)
    try:
        assert rt.profile.select == "benchmark"
        assert [mv.version for mv in rt.manager.table.all() if mv.name == "digits"]
        facts = device_facts(rt.facts, rt.profile.name)  # what the daemon hands the sync agent
        assert facts["profile"] == "bench-cpu" and "cpu.arch" in facts
    finally:
        rt.manager.shutdown()
    assert calls == [Path("/")]
