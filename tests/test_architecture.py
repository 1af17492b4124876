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
    assert any("edged.core.model_versions imports edged.daemon (only edged.__main__, edged.cli may)" in v
               for v in found)
    assert any("cycle" in v and "hardware" in v and "profiles" in v for v in found)
    # Modules inside one package may not import each other either (the diagram cannot show it).
    inner = ag.violations({"edged.telemetry.agent": {"edged.telemetry.prometheus"},
                           "edged.telemetry.prometheus": {"edged.telemetry.agent"}})
    assert inner == ["module import cycle: edged.telemetry.agent <-> edged.telemetry.prometheus"]
    # Two top-level packages importing each other through modules the diagram draws apart (protocol's
    # wire formats are boxes of their own): core.stats -> protocol.fleet, protocol.v2 -> core.types.
    split = ag.violations({"edged.core.stats": {"edged.protocol.fleet.telemetry"},
                           "edged.protocol.v2": {"edged.core.types"},
                           "edged.protocol.fleet.telemetry": set(), "edged.core.types": set()})
    assert split == ["top-level packages import each other: core <-> protocol"], split
    # A loop through several packages, none of them importing another both ways (the six-package loop of
    # issue 38: backends -> protocol -> core -> ... -> backends), each edge lazy or for types only in life.
    loop = ag.violations({"edged.backends.trt_worker.supervisor": {"edged.protocol.shm"},
                          "edged.protocol.v2": {"edged.core.types"},
                          "edged.core.scheduler": {"edged.backends.base"},
                          "edged.protocol.shm": set(), "edged.core.types": set(), "edged.backends.base": set()})
    assert loop == ["top-level packages caught in an import loop: backends -> core -> protocol"], loop
    # daemon.py is imported by the two entry points and nothing else: not by a second runner beside them
    # (edged/sync_runner.py did, issue 38), nor the CLI by anything but ``python -m edged``.
    top = ag.violations({"edged.sync_runner": {"edged.daemon"}, "edged.cli": {"edged.daemon"},
                         "edged.__main__": {"edged.cli"}, "edged.perf.command": {"edged.cli"},
                         "edged.daemon": set()})
    assert top == ["edged.perf.command imports edged.cli (only edged.__main__ may)",
                   "edged.sync_runner imports edged.daemon (only edged.__main__, edged.cli may)"], top
    # The clients import the wire formats and shared leaves only: not the daemon's transports (the gRPC stubs
    # and MQTT helpers lived there, issue 38), nor its config.
    client = ag.violations({"edged.client.grpc": {"edged.protocol.grpc", "edged.errors", "edged.transports.grpc"},
                            "edged.client.oneshot": {"edged.config", "edged.client.http"},
                            "edged.protocol.grpc": set(), "edged.errors": set(), "edged.transports.grpc": set(),
                            "edged.config": set(), "edged.client.http": set()})
    assert client == [
        "client module edged.client.grpc imports edged.transports.grpc (a client imports only edged.protocol and "
        "shared leaves)",
        "client module edged.client.oneshot imports edged.config (a client imports only edged.protocol and "
        "shared leaves)"], client
    # The registry server's CLI may not reach device code, not even lazily for one command (the simulator
    # did, issue 38: registry.cli -> registry.sim -> sync.trial -> core.service).
    assert ag.violations({"edged.registry.cli": {"edged.registry.sim.device"},
                          "edged.registry.sim.device": {"edged.sync.trial"}, "edged.sync.trial": set()}) == [
        "registry module edged.registry.sim.device imports device code: edged.sync.trial"]


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
