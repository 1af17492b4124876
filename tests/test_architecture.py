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
    a, b = "edged.sync.example", "edged.core.manager"
    allowed = {(a, b): "why it may, said in place"}
    assert ag.violations({a: {b}, b: set()}, allowed) == []
    assert ag.violations({a: {b}, b: set()}) == [
        f"{a} reaches into core: {b} (outside core use edged.core.service or edged.core.public)"]
    assert ag.violations({a: set()}, allowed) == [f"façade exception no longer used: {a} -> {b}"]


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


def test_every_hop_of_the_documented_data_paths_holds_and_the_doc_draws_them() -> None:
    ag = _archgraph()
    graph = ag.imports()
    broken = ag.datapaths().problems(graph, ag.modules())
    assert broken == [], "stale data path (fix the hop in tools/datapaths.py, then run python tools/archgraph.py " \
                         "--write):\n" + "\n".join(broken)
    text = (ROOT / "docs" / "architecture.md").read_text()
    assert ag.datapaths().BEGIN in text and ag.datapaths().END in text
    assert text == ag.render_all(text, graph), "run: python tools/archgraph.py --write"


def test_a_stale_hop_is_named_with_what_broke(tmp_path: Path) -> None:
    ag = _archgraph()
    dp = ag.datapaths()
    pkg = tmp_path / "edged"
    pkg.mkdir()
    for name, text in {
        "__init__": "",
        "front": "from edged import service\nclass Front:\n    def handle(self, req):\n"
                 "        return self._go(req)\n    def _go(self, req):\n        return service.submit(req)\n",
        "service": "def submit(req):\n    return req\ndef lonely(req):\n    return req\n",
        "server": "class Conn:\n    def serve(self):\n        return self.handler(1)\n",
        "wiring": "from edged import front, server\n",
        "stranger": "def submit(req):\n    return req\n",
    }.items():
        (pkg / f"{name}.py").write_text(text)
    graph, files = ag.imports(tmp_path), ag.modules(tmp_path)

    def check(*hops: object) -> list[str]:
        return dp.problems(graph, files, {"p": list(hops)})

    serve = dp.Hop("edged.server", "Conn.serve", "")
    handle = dp.Hop("edged.front", "Front.handle", "", call="handler", via="edged.wiring")
    submit = dp.Hop("edged.service", "submit", "")
    # A path that holds: a callback wired by a named module, then a call through a helper of the module.
    assert check(serve, handle, submit) == []
    # The function moved or renamed; the module gone.
    assert check(serve, handle, dp.Hop("edged.service", "submit_now", "")) == [
        "data path 'p', hop 3 (edged.service:submit_now): edged.service has no function submit_now"]
    assert check(serve, handle, dp.Hop("edged.core.service", "submit", "")) == [
        "data path 'p', hop 3 (edged.core.service:submit): module edged.core.service does not exist"]
    # The caller no longer imports the hop's module, and no wiring module is named.
    assert check(serve, handle, dp.Hop("edged.stranger", "submit", "")) == [
        "data path 'p', hop 3 (edged.stranger:submit): edged.front (caller, Front.handle) does not import "
        "edged.stranger"]
    assert check(serve, dp.Hop("edged.front", "Front.handle", "", call="handler")) == [
        "data path 'p', hop 2 (edged.front:Front.handle): edged.server (caller, Conn.serve) does not import "
        "edged.front"]
    # The caller imports it but does not call it.
    assert check(serve, handle, dp.Hop("edged.service", "lonely", "")) == [
        "data path 'p', hop 3 (edged.service:lonely): edged.front:Front.handle never calls 'lonely' (not even "
        "through a helper of its module)"]
    # Whoever calls a later hop must be an earlier one.
    assert check(serve, handle, dp.Hop("edged.service", "submit", "", by="edged.front:Front.gone")) == [
        "data path 'p', hop 3 (edged.service:submit): its caller edged.front:Front.gone is not an earlier hop "
        "of the path"]
