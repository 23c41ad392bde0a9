"""Import direction: api -> engine (protocol/outputs/config) -> scheduler; neither api nor
scheduler may load torch or transformers."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import importlib, pkgutil, sys
import api, scheduler
names = []
for pkg in (api, scheduler):
    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        names.append(m.name)
        importlib.import_module(m.name)
heavy = sorted(m for m in ("torch", "transformers") if m in sys.modules)
print(len(names), ",".join(heavy))
"""


def test_api_and_scheduler_do_not_load_torch() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         cwd=ROOT, timeout=120, check=True).stdout.split()
    assert int(out[0]) >= 10, out  # the walk found the modules
    assert len(out) == 1, f"loaded: {out[1]}"


# --------------------------------------------------------------- the import graph, statically

PACKAGES = ("api", "engine", "scheduler", "configs")
# What api/ may import from engine/ outside its composition roots: the engine's contract
# (torch-free), including the replica messages, board and loopback helpers the ingress uses,
# and the stream table every client (the replica client too) routes its deltas with.
ENGINE_CONTRACT = {"engine.protocol", "engine.outputs", "engine.config", "engine.snapshot",
                   "engine.replicas.messages", "engine.replicas.board",
                   "engine.replicas.loopback", "engine.client.stream_table"}
# The modules that assemble the whole server and so may import any part of it.
COMPOSITION_ROOTS = {"api.cli", "api.__main__", "api.replicas.launch", "api.replicas.rayservice"}


def our_modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = path
    return modules


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imported(path: Path, known: set[str]) -> set[str]:
    """Every module this file imports, at top level or inside functions (a lazy import is a
    dependency too), except under `if TYPE_CHECKING:`; `from a import b` counts as a.b when
    that is a module."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if _type_checking_only(node):
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in known else node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return found


def import_graph() -> dict[str, set[str]]:
    modules = our_modules()
    known = set(modules)
    return {name: imported(path, known) for name, path in modules.items()}


def test_the_layers_hold() -> None:
    """docs/architecture.md's layering: scheduler imports nothing of ours and no torch; the
    engine never imports the API; the API reaches the engine through its contract only,
    except in the modules that assemble the server."""
    bad = []
    for module, deps in sorted(import_graph().items()):
        top = module.split(".")[0]
        for dep in sorted(deps):
            root = dep.split(".")[0]
            if _crosses(module, top, dep, root):
                bad.append(f"{module} -> {dep}")
    assert not bad, bad


def _crosses(module: str, top: str, dep: str, root: str) -> bool:
    if top == "scheduler":
        return root in ("api", "engine", "torch", "transformers")
    if top == "engine":
        return root == "api"
    return (top == "api" and root == "engine" and module not in COMPOSITION_ROOTS
            and dep not in ENGINE_CONTRACT)


def test_no_import_circles() -> None:
    graph = import_graph()
    ours = {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}
    circles = [c for c in _strongly_connected(ours) if len(c) > 1]
    assert not circles, circles


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative enough for a few hundred modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out
