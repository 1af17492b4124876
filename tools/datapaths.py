"""The data paths of docs/architecture.md: each a straight line of (module, function) hops, checked against the code.

PATHS below is the one place the paths are declared. :func:`problems` checks every hop with an AST scan:
its module exists, its function or method exists, and the hop that hands it the data can reach it: that
module imports it, or a named module (``via``) wires the two together (imports both, as the transport
wires its app into the server) or is the façade between them (the caller imports it, and it imports the
callee itself or through its own imports: what it hands out leads there), and the caller's code names it
(directly, or through a helper or a table of its own module), unless the
data crosses a queue inside one module (``queued``). :func:`mermaid` draws them; tools/archgraph.py puts
the drawing into docs/architecture.md and tests/test_architecture.py fails when a hop no longer holds.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

BEGIN, END = "<!-- datapaths:begin -->", "<!-- datapaths:end -->"


@dataclass(frozen=True)
class Hop:
    module: str  # edged.core.service
    function: str  # a function, Class.method, or outer.inner for a function defined in another
    does: str  # what happens to the data here, for the drawing
    by: str | None = None  # "module:function" of the earlier hop that calls this one (default: the previous hop)
    call: str | None = None  # the name the caller uses for it when not its own (a callback: ``handler``)
    via: str | None = None  # the module that wires this hop into its caller, or the façade between them
    queued: bool = False  # handed over through a queue inside one module (a worker thread or task), not a call

    @property
    def ref(self) -> str:
        return f"{self.module}:{self.function}"


PATHS: dict[str, list[Hop]] = {
    "HTTP infer": [
        Hop(
            "edged.transports.http.server",
            "HttpConnection.on_message_complete",
            "a whole request parsed off the connection",
        ),
        Hop(
            "edged.transports.http.server", "HttpConnection._serve", "requests of one connection in order", queued=True
        ),
        Hop(
            "edged.transports.http.app",
            "V2App.handle",
            "routes POST /v2/models/M/infer",
            call="handler",
            via="edged.transports.http.transport",
        ),
        Hop("edged.protocol.v2", "decode_request", "v2 JSON/binary body to an InferRequest"),
        Hop(
            "edged.core.service",
            "InferenceService.submit",
            "looks the model up, validates",
            by="edged.transports.http.app:V2App.handle",
        ),
        Hop("edged.core.scheduler", "Scheduler.submit", "queues for the model's instances"),
        Hop("edged.core.scheduler", "Scheduler._work", "a worker batches what waits", queued=True),
        Hop("edged.backends.base", "Engine.infer", "the engine runs the batch"),
        Hop(
            "edged.protocol.v2_plans",
            "encode_answer",
            "outputs to the v2 answer",
            by="edged.transports.http.app:V2App.handle",
        ),
        Hop(
            "edged.transports.http.server",
            "HttpConnection._write",
            "the answer written back",
            by="edged.transports.http.server:HttpConnection._serve",
        ),
    ],
    "model update": [
        Hop("edged.sync.agent", "SyncAgent._run", "the sync loop: poll rounds, trials between them"),
        Hop("edged.sync.agent", "SyncAgent._cycle", "one poll round, in a worker thread"),
        Hop("edged.sync.desired", "DesiredStatePoller.poll", "registry poll: the desired state",
            via="edged.sync.registry_client"),
        Hop("edged.sync.updater", "Updater.process", "one model's desired release, one step at a time",
            by="edged.sync.agent:SyncAgent._cycle"),
        Hop("edged.sync.verify", "check_release", "verify: signature, release number, expiry, size"),
        Hop("edged.sync.update.fetch", "run", "step download", by="edged.sync.updater:Updater.process"),
        Hop("edged.sync.download", "fetch_release", "resumable, capped, hashed into staging"),
        Hop("edged.sync.update.prepare", "run", "step prepare", by="edged.sync.updater:Updater.process"),
        Hop("edged.repository.store", "load_version", "the staged folder read as a version"),
        Hop("edged.sync.engine_port", "ServiceEngine.rehearse", "loaded aside through the port",
            by="edged.sync.update.prepare:run", call="rehearse", via="edged.sync.update.context"),
        Hop("edged.core.service", "InferenceService.try_load", "the façade: engine chosen, warmed up, let go"),
        Hop("edged.sync.update.install", "run", "step install", by="edged.sync.updater:Updater.process"),
        Hop("edged.sync.repo", "DeviceRepo.install", "renamed into the repository", call="install",
            via="edged.sync.update.context"),
        Hop("edged.sync.update.activate", "run", "step activate", by="edged.sync.updater:Updater.process"),
        Hop("edged.sync.engine_port", "ServiceEngine.load", "the version pinned and loaded", call="load",
            via="edged.sync.update.context"),
        Hop("edged.core.service", "InferenceService.load", "the façade: the new version serves"),
        Hop("edged.sync.updater", "Updater.tick", "later turns of the loop: the trials due a look",
            by="edged.sync.agent:SyncAgent._run"),
        Hop("edged.sync.update.trial", "visit", "trial: one look, never a wait"),
        Hop("edged.sync.trial", "judge", "errors and latency against the replaced version"),
        Hop("edged.sync.update.commit", "run", "committed (a failed trial rolls back instead)",
            by="edged.sync.update.trial:visit"),
        Hop("edged.sync.outbox", "ReportOutbox.report", "told the registry, in order, from the outbox",
            call="report", via="edged.sync.update.context"),
    ],
    "pipeline fan-out": [
        Hop("edged.core.service", "InferenceService.submit", "a request for a pipeline"),
        Hop("edged.core.pipelines", "start_pipeline_request", "checked, then run on the pipeline loop"),
        Hop("edged.pipeline.graph", "Pipeline.run", "every step a task, each awaiting its inputs"),
        Hop("edged.pipeline.graph", "_model_node.run", "a model step: rows in chunks, gathered", call="runner"),
        Hop(
            "edged.core.service",
            "InferenceService.call_model",
            "back into the one service, queued with the request's deadline",
            via="edged.core.service",
        ),
        Hop("edged.core.service", "InferenceService.submit", "validated like any request"),
        Hop("edged.core.scheduler", "Scheduler.submit", "queued beside other callers' requests"),
        Hop("edged.core.scheduler", "Scheduler._work", "batched with them", queued=True),
        Hop("edged.backends.base", "Engine.infer", "the engine runs the batch"),
    ],
}


def _find(tree: ast.Module, qualname: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The def named by ``qualname`` (``f``, ``Class.method``, ``outer.inner``), else None."""
    scope: ast.AST = tree
    for name in qualname.split("."):
        if isinstance(scope, (ast.Module, ast.ClassDef)):
            candidates: Iterable[ast.AST] = scope.body
        else:
            candidates = ast.walk(scope)
        found = [
            n
            for n in candidates
            if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.name == name
            and n is not scope
        ]
        if not found:
            return None
        scope = found[0]
    return scope if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


def _names(node: ast.AST) -> set[str]:
    """Every name a piece of code uses: plain names and attributes (``self.x``, ``Scheduler.submit``)."""
    return {
        n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node) if isinstance(n, (ast.Name, ast.Attribute))
    }


def _reaches(tree: ast.Module, func: ast.AST, name: str) -> bool:
    """``func`` names ``name`` itself or through functions or module-level tables (``STEPS = {...}``) of
    its own module that it names."""
    defs: dict[str, list[ast.AST]] = {}
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            defs.setdefault(n.name, []).append(n)
    for st in tree.body:
        targets = st.targets if isinstance(st, ast.Assign) else [st.target] if isinstance(st, ast.AnnAssign) else []
        value = st.value if isinstance(st, (ast.Assign, ast.AnnAssign)) else None
        for t in targets:
            if isinstance(t, ast.Name) and value is not None:
                defs.setdefault(t.id, []).append(value)
    seen: set[str] = set()
    todo = [func]
    while todo:
        used = _names(todo.pop())
        if name in used:
            return True
        for helper in used - seen:
            seen.add(helper)
            todo += defs.get(helper, [])
    return False


def _linked(graph: Mapping[str, Iterable[str]], caller: str, callee: str, via: str | None) -> bool:
    def reaches(a: str, b: str) -> bool:
        return a == b or b in graph.get(a, ())

    if reaches(caller, callee):
        return True
    if via is None:
        return False
    def imports_in_time(a: str, b: str) -> bool:
        """``a`` imports ``b``, or one of its imports does, and so on (the objects it hands out lead there)."""
        seen, todo = {a}, [a]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt == b:
                    return True
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return False

    wires = reaches(via, caller) and reaches(via, callee)
    facade = via in graph.get(caller, ()) and imports_in_time(via, callee)
    return wires or facade


def problems(
    graph: Mapping[str, Iterable[str]], files: Mapping[str, Path], paths: Mapping[str, list[Hop]] = PATHS
) -> list[str]:
    """One line per hop that no longer holds, naming the path, the hop and what broke (empty: all hold)."""
    trees: dict[str, ast.Module] = {}
    out: list[str] = []
    for title, hops in paths.items():
        for i, hop in enumerate(hops):
            where = f"data path {title!r}, hop {i + 1} ({hop.ref})"
            if hop.module not in files:
                out.append(f"{where}: module {hop.module} does not exist")
                continue
            tree = trees.setdefault(hop.module, ast.parse(files[hop.module].read_text(), str(files[hop.module])))
            if _find(tree, hop.function) is None:
                out.append(f"{where}: {hop.module} has no function {hop.function}")
                continue
            if i == 0:
                continue
            earlier = {h.ref: h for h in hops[:i]}
            caller = earlier.get(hop.by) if hop.by else hops[i - 1]
            if caller is None:
                out.append(f"{where}: its caller {hop.by} is not an earlier hop of the path")
                continue
            if hop.queued and caller.module != hop.module:
                out.append(f"{where}: a queue hand-over stays inside one module, but the caller is {caller.module}")
            if not _linked(graph, caller.module, hop.module, hop.via):
                how = f" and {hop.via} neither wires them nor stands between them" if hop.via else ""
                out.append(f"{where}: {caller.module} (caller, {caller.function}) does not import {hop.module}{how}")
            caller_def = _find(trees[caller.module], caller.function) if caller.module in trees else None
            name = hop.call or hop.function.rsplit(".", 1)[-1]
            if caller_def is not None and not hop.queued and not _reaches(trees[caller.module], caller_def, name):
                out.append(f"{where}: {caller.ref} never calls {name!r} (not even through a helper of its module)")
    return out


def _node(title: str, i: int) -> str:
    return "p_" + "".join(c if c.isalnum() else "_" for c in title) + f"_{i}"


def mermaid(paths: Mapping[str, list[Hop]] = PATHS) -> str:
    """One Mermaid flowchart per path, a straight line in the order the data goes."""
    out: list[str] = []
    for title, hops in paths.items():
        out += [f"### {title[0].upper()}{title[1:]}", "", "```mermaid", "flowchart TB"]
        for i, hop in enumerate(hops):
            text = f"{hop.module.removeprefix('edged.')}<br/><code>{hop.function}</code><br/><i>{hop.does}</i>"
            out.append(f'  {_node(title, i)}["{text}"]')
        for i, hop in enumerate(hops[1:], 1):
            notes = []
            if hop.by and hop.by != hops[i - 1].ref:
                notes.append(f"called by {hop.by.split(':')[1]}")
            if hop.queued:
                notes.append("queued")
            if hop.via:
                notes.append(f"via {hop.via.removeprefix('edged.')}")
            label = f'|"{"; ".join(notes)}"|' if notes else ""
            out.append(f"  {_node(title, i - 1)} -->{label} {_node(title, i)}")
        out += ["```", ""]
    return "\n".join(out)
