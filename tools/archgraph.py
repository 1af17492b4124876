"""Import structure of ``edged/``: the package diagram in docs/architecture.md and the rules CI checks.

``python tools/archgraph.py`` prints the Mermaid diagram; ``--write`` puts it, and the data paths of
tools/datapaths.py, into docs/architecture.md between their markers; ``--check`` exits 1 when either
checked-in drawing differs from the code, or a data path's hop no longer holds.
tests/test_architecture.py applies :func:`violations` (a plain AST scan, every import counted:
module level, inside functions and under ``TYPE_CHECKING`` alike, since each is a dependency).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
BEGIN, END = "<!-- archgraph:begin -->", "<!-- archgraph:end -->"

# The registry server (its fleet simulator lives with the benchmarks, bench/sim/, as it runs device code).
REGISTRY = "edged.registry"
# The Python clients: a library for programs beside the daemon, so the wire formats and shared leaves only.
CLIENT = "edged.client"
# What both wings may import: the contract (protocol/), the error root and small leaves with no
# knowledge of either wing. A shared module may import only shared modules (checked).
SHARED = ("edged", "edged.errors", "edged.fsutil", "edged.backoff", "edged.datatypes", "edged.logs",
          "edged.journal", "edged.listen", "edged.latency_buckets", "edged.repository.manifest", "edged.protocol.fleet",
          "edged.protocol.names")
CONTRACT = "edged.protocol.fleet"
# The top of the device: the daemon that wires everything and the entry points that start it. Each may be
# imported by the modules named here and by nothing else (``python -m edged`` -> cli -> daemon).
TOP = {"edged.daemon": ("edged.__main__", "edged.cli"), "edged.cli": ("edged.__main__",), "edged.__main__": ()}
SKIP = ("edged/protocol/grpc/gen", "edged/registry/migrations")
# The one façade of core: outside it (and the TOP wiring), code reaches core only through the service
# and the names the service hands out; the manager, loader, table and schedulers stay inside.
CORE = "edged.core"
FACADE = ("edged.core.service", "edged.core.public")
# Imports of core's insides from outside it that are allowed for now, each with why; a line no longer
# used is reported too, so the list only shrinks.
FACADE_EXCEPTIONS: dict[tuple[str, str], str] = {}  # (importer, core module): why it may


def modules(root: Path = ROOT) -> dict[str, Path]:
    out: dict[str, Path] = {}
    for path in sorted((root / "edged").rglob("*.py")):
        rel = path.relative_to(root)
        if any(rel.as_posix().startswith(s) for s in SKIP):
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the edged modules it imports (a package import counts as its ``__init__``)."""
    mods = modules(root)
    out: dict[str, set[str]] = {}
    for name, path in mods.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in mods]
                found = found or [node.module]
            else:
                continue
            for imported in found:
                target = imported
                while target not in mods and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in mods and target != name and target.startswith("edged"):
                    targets.add(target)
        out[name] = targets
    return out


def under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def part(module: str) -> str:
    """The package a module belongs to in the diagram: ``edged.X``."""
    if under(module, "edged.protocol") and module != "edged.protocol":
        return ".".join(module.split(".")[1:3])  # each wire format is a box of its own (fleet: a package)
    if module in SHARED and module.count(".") > 1:  # a shared leaf inside a device package stands apart
        return module.split(".", 1)[1]
    bits = module.split(".")
    return bits[1] if len(bits) > 1 else "edged"


def wing(module: str) -> str:
    if any(under(module, s) for s in SHARED if s != "edged") or module == "edged":
        return "shared"
    return "registry" if under(module, REGISTRY) else "device"


def part_edges(graph: Mapping[str, Iterable[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for a, targets in graph.items():
        out.setdefault(part(a), set())
        for b in targets:
            if part(a) != part(b):
                out[part(a)].add(part(b))
    return out


def top_edges(graph: Mapping[str, Iterable[str]]) -> dict[str, set[str]]:
    """Imports between top-level packages and modules (``edged.X``)."""
    def top(module: str) -> str:
        return module.split(".")[1] if "." in module else "edged"

    out: dict[str, set[str]] = {}
    for a, targets in graph.items():
        out.setdefault(top(a), set()).update(top(b) for b in targets if top(b) != top(a))
    return out


def cycles(edges: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(edges.get(nxt, ())))))
                elif nxt in on:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def reaches_into_core(a: str, b: str, exceptions: Mapping[tuple[str, str], str] = FACADE_EXCEPTIONS) -> bool:
    """``a``, outside core and below the wiring, imports a core module that is not the façade."""
    return (under(b, CORE) and not under(a, CORE) and a not in TOP and b not in FACADE
            and (a, b) not in exceptions)


def violations(graph: Mapping[str, Iterable[str]],
               exceptions: Mapping[tuple[str, str], str] = FACADE_EXCEPTIONS) -> list[str]:
    """Every broken rule, one line each (empty when the structure holds); ``exceptions``: imports into
    core allowed in place of the façade, each with its reason."""
    out: list[str] = []
    for a in sorted(graph):
        for b in sorted(graph[a]):
            wa, wb = wing(a), wing(b)
            if wa == "shared" and wb != "shared":
                out.append(f"shared module {a} imports {wb} module {b}")
            elif wa == "device" and wb == "registry":
                out.append(f"device module {a} imports the registry server: {b}")
            elif wa == "registry" and wb == "device":
                out.append(f"registry module {a} imports device code: {b}")
            if under(a, CLIENT) and not (under(b, CLIENT) or under(b, "edged.protocol") or wb == "shared"):
                out.append(f"client module {a} imports {b} (a client imports only edged.protocol and shared leaves)")
            if b in TOP and a not in TOP[b]:
                out.append(f"{a} imports {b} (only {', '.join(TOP[b]) or 'nothing'} may)")
            if reaches_into_core(a, b, exceptions):
                out.append(f"{a} reaches into core: {b} (outside core use {' or '.join(FACADE)})")
    out += [f"façade exception no longer used: {a} -> {b}" for a, b in sorted(exceptions)
            if a in graph and b not in graph[a]]
    out += [f"package import cycle: {' <-> '.join(c)}" for c in cycles(part_edges(graph))]
    # The diagram draws protocol's wire formats and shared leaves as boxes of their own; two plain
    # top-level packages (edged.X) must not import each other both ways either.
    top = top_edges(graph)
    out += [f"top-level packages import each other: {a} <-> {b}"
            for a in sorted(top) for b in sorted(top[a]) if a < b and a in top.get(b, ())]
    # ...nor go round a loop of any length (a pair is said just above).
    out += [f"top-level packages caught in an import loop: {' -> '.join(c)}" for c in cycles(top) if len(c) > 2]
    # Inside a package too: two modules that import each other (even lazily or for types) are one module
    # in two files; move what both need into a third or pass it in.
    out += [f"module import cycle: {' <-> '.join(c)}" for c in cycles(graph)]
    return out


# Leaves every box may use; their arrows would only clutter the picture, so the diagram leaves them out.
LEAVES = ("edged", "errors", "datatypes", "fsutil", "backoff", "logs", "journal", "listen", "latency_buckets")


def mermaid(graph: Mapping[str, Iterable[str]]) -> str:
    edges = {a: {b for b in bs if b not in LEAVES} for a, bs in part_edges(graph).items() if a not in LEAVES}
    used = set(edges) & ({a for a, bs in edges.items() if bs} | {b for bs in edges.values() for b in bs})
    edges = {a: bs for a, bs in edges.items() if a in used}
    groups = {"device": [], "registry": [], "shared": []}  # type: dict[str, list[str]]
    for p in sorted(edges):
        groups[wing(p if p == "edged" else "edged." + p)].append(p)
    lines = ["```mermaid", "flowchart TB"]
    titles = {"device": "device", "registry": "registry server", "shared": "shared: contract and leaves"}
    for g, members in groups.items():
        if members:
            lines.append(f"  subgraph {g}[{titles[g]}]")
            lines += [f"    {_node(p)}[{p}]" for p in members]
            lines.append("  end")
    lines += [f"  {_node(a)} --> {_node(b)}" for a in sorted(edges) for b in sorted(edges[a])]
    lines.append("```")
    return "\n".join(lines) + "\n"


def _node(p: str) -> str:
    return "n_" + p.replace(".", "_")


def render_doc(text: str, diagram: str, begin: str = BEGIN, end: str = END) -> str:
    head, _, rest = text.partition(begin)
    _, _, tail = rest.partition(end)
    return f"{head}{begin}\n{diagram}{end}{tail}"


def datapaths() -> ModuleType:
    """tools/datapaths.py (loaded by path: tools/ is no package)."""
    name = "edged_tools_datapaths"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent / "datapaths.py")
        assert spec is not None and spec.loader is not None
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def render_all(text: str, graph: Mapping[str, Iterable[str]] | None = None) -> str:
    """docs/architecture.md with both generated parts redrawn: the package diagram and the data paths."""
    dp = datapaths()
    return render_doc(render_doc(text, mermaid(imports() if graph is None else graph)), dp.mermaid(), dp.BEGIN,
                      dp.END)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="update docs/architecture.md")
    mode.add_argument("--check", action="store_true", help="exit 1 when docs/architecture.md is stale")
    args = p.parse_args(argv)
    if not (args.write or args.check):
        sys.stdout.write(mermaid(imports()))
        return 0
    graph = imports()
    broken = datapaths().problems(graph, modules())
    for line in broken:
        print(line, file=sys.stderr)
    current = DOC.read_text()
    wanted = render_all(current, graph)
    if args.write:
        DOC.write_text(wanted)
        return 1 if broken else 0
    if current != wanted:
        print("docs/architecture.md: a drawing is stale; run python tools/archgraph.py --write", file=sys.stderr)
        return 1
    return 1 if broken else 0


if __name__ == "__main__":
    raise SystemExit(main())
