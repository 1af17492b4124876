"""The import rules of docs/architecture.md, checked on every run by an AST scan of edged/ (tools/archgraph.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def _archgraph() -> ModuleType:
    spec = importlib.util.spec_from_file_location("archgraph", ROOT / "tools" / "archgraph.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("archgraph", mod)
    spec.loader.exec_module(mod)
    return mod


def test_the_import_rules_hold() -> None:
    ag = _archgraph()
    assert ag.violations(ag.imports()) == []


def test_the_rules_catch_each_kind_of_breach() -> None:
    ag = _archgraph()
    graph = {
        "edged.sync.registry_client": {"edged.registry.service"},  # device -> registry server
        "edged.registry.gates": {"edged.core.stats"},  # registry -> device
        "edged.errors": {"edged.config"},  # a shared leaf reaching into the device
        "edged.core.model_versions": {"edged.daemon"},  # from below the daemon
        "edged.hardware.facts": {"edged.profiles"},  # hardware <-> profiles
        "edged.profiles": {"edged.hardware.facts"},
        "edged.daemon": {"edged.core.model_versions"},
        "edged.config": set(), "edged.core.stats": set(), "edged.registry.service": set(),
    }
    found = ag.violations(graph)
    assert any("edged.sync.registry_client imports the registry server" in v for v in found)
    assert any("edged.registry.gates imports device code" in v for v in found)
    assert any("shared module edged.errors imports device module edged.config" in v for v in found)
    assert any("edged.core.model_versions imports edged.daemon from below" in v for v in found)
    assert any("cycle" in v and "hardware" in v and "profiles" in v for v in found)
    # Modules inside one package may not import each other either (the diagram cannot show it).
    inner = ag.violations({"edged.telemetry.agent": {"edged.telemetry.prometheus"},
                           "edged.telemetry.prometheus": {"edged.telemetry.agent"}})
    assert inner == ["module import cycle: edged.telemetry.agent <-> edged.telemetry.prometheus"]
    # Two top-level packages importing each other through modules the diagram draws apart (protocol's
    # wire formats are boxes of their own): core.stats -> protocol.fleet, protocol.v2 -> core.service.
    split = ag.violations({"edged.core.stats": {"edged.protocol.fleet.telemetry"},
                           "edged.protocol.v2": {"edged.core.service"},
                           "edged.protocol.fleet.telemetry": set(), "edged.core.service": set()})
    assert split == ["top-level packages import each other: core <-> protocol"], split
    # A loop through several packages, none of them importing another both ways (the six-package loop of
    # issue 38: backends -> protocol -> core -> ... -> backends), each edge lazy or for types only in life.
    loop = ag.violations({"edged.backends.trt_worker.supervisor": {"edged.protocol.shm"},
                          "edged.protocol.v2": {"edged.core.service"},
                          "edged.core.scheduler": {"edged.backends.base"},
                          "edged.protocol.shm": set(), "edged.core.service": set(), "edged.backends.base": set()})
    assert loop == ["top-level packages caught in an import loop: backends -> core -> protocol"], loop
    # The simulator is a part of its own that may use both wings' code.
    assert ag.violations({"edged.registry.sim.device": {"edged.sync.plan", "edged.registry.service"},
                          "edged.sync.plan": set(), "edged.registry.service": set()}) == []


def test_outside_core_only_the_facade_is_imported() -> None:
    """Transports, telemetry, health and the rest reach core through the service (and the types it hands
    out); the wiring at the top and core itself may import any of it; an unused exception is reported."""
    ag = _archgraph()
    graph = {
        "edged.transports.v2_ops": {"edged.core.service", "edged.core.public"},
        "edged.telemetry.model_metrics": {"edged.core.stats"},
        "edged.systemd.health": {"edged.core.manager"},
        "edged.daemon": {"edged.core.manager"},
        "edged.core.service": {"edged.core.manager", "edged.core.stats"},
        "edged.core.manager": set(), "edged.core.stats": set(), "edged.core.public": set(),
    }
    assert ag.violations(graph) == [
        "edged.systemd.health reaches into core: edged.core.manager "
        "(outside core use edged.core.service or edged.core.public)",
        "edged.telemetry.model_metrics reaches into core: edged.core.stats "
        "(outside core use edged.core.service or edged.core.public)"]
    (a, b), *_ = sorted(ag.FACADE_EXCEPTIONS)
    assert ag.violations({a: {b}, b: set()}) == []
    assert ag.violations({a: set()}) == [f"façade exception no longer used: {a} -> {b}"]


def test_the_scan_sees_lazy_and_type_checking_imports(tmp_path: Path) -> None:
    ag = _archgraph()
    pkg = tmp_path / "edged"
    (pkg / "sync").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "daemon.py").write_text("")
    (pkg / "sync" / "__init__.py").write_text("")
    (pkg / "sync" / "agent.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from edged import daemon\n"
        "def f():\n    import edged.sync\n")
    assert ag.imports(tmp_path)["edged.sync.agent"] == {"edged.daemon", "edged.sync"}


def test_the_checked_in_diagram_matches_the_imports() -> None:
    ag = _archgraph()
    text = (ROOT / "docs" / "architecture.md").read_text()
    assert ag.BEGIN in text and ag.END in text
    assert text == ag.render_doc(text, ag.mermaid(ag.imports())), "run: python tools/archgraph.py --write"
