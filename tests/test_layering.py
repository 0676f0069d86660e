"""The layer rules of docs/architecture.md, checked on the source with `ast`: which package may import
which, no import cycles between modules, and no torch in the core.

Every import counts, wherever it stands (module level, inside a function, under TYPE_CHECKING): a
deferred import is still a dependency a reader has to follow.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The installed layers, lowest first: a module may import its own layer and the ones below it.
LAYERS = ("core", "backends", "drafters", "training", "frontends")
# Subpackages a sibling may not import (within one layer): (importer prefix, forbidden prefix, why).
INNER_RULES: tuple[tuple[str, str, str], ...] = (
    ("core.", "core.engine", "the round (core/engine) is the top of the core: nothing else in core imports it"),
    ("frontends.schema", "frontends.http", "the request schema is shared by every frontend"),
    ("frontends.schema", "frontends.cli", "the request schema is shared by every frontend"),
    ("frontends.rpc", "frontends.http", "the socket frontend does not depend on the HTTP one"),
    ("frontends.http", "frontends.cli", "servers are started by the CLI, never the reverse"),
    ("frontends.rpc", "frontends.cli", "servers are started by the CLI, never the reverse"),
    ("frontends.tui", "frontends.cli", "the TUI is started by the CLI, never the reverse"),
)
# Ray Serve's application builder is an entry point of its own (`serve run spekula.frontends.ray.app:app`)
# that takes `spekula serve`'s options, so it may read the CLI's option definitions.
ENTRY_POINTS = frozenset({"frontends.ray.app"})


@dataclass(frozen=True)
class Import:
    importer: str  # dotted name below `spekula.`, e.g. "core.engine.scheduler"
    target: str
    line: int


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    found = {}
    for top in (*LAYERS, "fixtures"):
        for path in sorted((ROOT / top).rglob("*.py")):
            found[module_name(path)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> Iterator[Import]:
    """The spekula modules `name` imports (a `from pkg import mod` names the module itself)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
                base = "spekula." + base
            else:
                base = node.module or ""
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            if not target.startswith("spekula."):
                continue
            short = target.removeprefix("spekula.")
            if short in known and short != name:
                yield Import(name, short, node.lineno)


@cache
def import_graph() -> dict[str, list[Import]]:
    known = modules()
    return {name: list(imports(name, path, known)) for name, path in known.items()}


def layer(name: str) -> int | None:
    top = name.split(".")[0]
    return LAYERS.index(top) if top in LAYERS else None


def layer_violations(graph: dict[str, list[Import]]) -> list[str]:
    bad = []
    for name, edges in graph.items():
        own = layer(name)
        for edge in edges:
            other = layer(edge.target)
            if own is not None and edge.target.split(".")[0] == "fixtures":
                bad.append(f"{name}:{edge.line} imports {edge.target}: test fixtures are not installed")
            elif own is not None and other is not None and other > own:
                bad.append(f"{name}:{edge.line} imports {edge.target}: {LAYERS[own]} is below {LAYERS[other]}")
            for importer, forbidden, why in INNER_RULES:
                inside = name.startswith(importer) and not name.startswith(forbidden)
                if inside and edge.target.startswith(forbidden) and name not in ENTRY_POINTS:
                    bad.append(f"{name}:{edge.line} imports {edge.target}: {why}")
    return bad


def cycles(graph: dict[str, list[Import]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iteratively)."""
    succ = {name: sorted({e.target for e in edges}) for name, edges in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in succ:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = counter
                counter += 1
                stack.append(node)
                on_stack.add(node)
            for j in range(i, len(succ[node])):
                nxt = succ[node][j]
                if nxt not in index:
                    work.append((node, j + 1))
                    work.append((nxt, 0))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
    return found


def test_no_layer_imports_a_higher_one() -> None:
    assert layer_violations(import_graph()) == []


def test_no_import_cycles_between_modules() -> None:
    assert cycles(import_graph()) == []


def test_the_core_never_imports_torch_or_onnx() -> None:
    heavy = {"torch", "onnx", "onnxruntime"}
    bad = []
    for path in sorted((ROOT / "core").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            bad += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n.split(".")[0] in heavy]
    assert bad == []


# The checks themselves, on small made-up graphs: each rule must be able to fail.
def _graph(**edges: list[str]) -> dict[str, list[Import]]:
    names = {k.replace("__", ".") for k in edges}
    return {name: [Import(name, t, 1) for t in edges[name.replace(".", "__")]] for name in names}


@pytest.mark.parametrize(("edges", "expected"), [
    ({"core__verify__sampling": ["backends.native.backend"], "backends__native__backend": []}, "core is below backends"),
    ({"backends__torch__model": ["frontends.cli.main"], "frontends__cli__main": []}, "backends is below frontends"),
    ({"core__policy__tails": ["core.engine.slot"], "core__engine__slot": []}, "the round"),
    ({"frontends__schema__completion": ["frontends.http.errors"], "frontends__http__errors": []}, "request schema"),
    ({"drafters__model__eagle3": ["fixtures.tiny_gguf"], "fixtures__tiny_gguf": []}, "not installed"),
])
def test_a_forbidden_import_is_named(edges: dict[str, list[str]], expected: str) -> None:
    (message,) = layer_violations(_graph(**edges))
    assert expected in message


def test_allowed_imports_pass() -> None:
    graph = _graph(frontends__cli__main=["core.engine.engine", "backends.gguf.weights"],
                   core__engine__engine=["core.policy.cost_model"], core__policy__cost_model=[],
                   backends__gguf__weights=["core.modelfile.gguf_file"], core__modelfile__gguf_file=[],
                   frontends__ray__app=["frontends.cli.serve_options"], frontends__cli__serve_options=[])
    assert layer_violations(graph) == []


def test_a_cycle_is_found() -> None:
    graph = _graph(a__x=["a.y"], a__y=["a.z"], a__z=["a.x"], a__w=["a.x"])
    assert cycles(graph) == [["a.x", "a.y", "a.z"]]
    assert cycles(_graph(a__x=["a.y"], a__y=[])) == []
