#!/usr/bin/env python3
"""dfo's import graph: the modules of orchestrator/ and remote/, who imports whom, its circles
and its arrows that point up a layer (stdlib only: ``ast``).

    python3 scripts/importgraph.py                      # a text summary: counts, circles, upward arrows
    python3 scripts/importgraph.py --check              # the same; exit 1 if there is a circle or an upward arrow
    python3 scripts/importgraph.py --dot > graph.dot    # Graphviz (dot -Tsvg graph.dot > graph.svg)
    python3 scripts/importgraph.py --dot --packages     # one box per subpackage, not per module
    python3 scripts/importgraph.py --root OTHER_CHECKOUT

Every import counts: at module level, inside a function (a lazy import) and under
``if TYPE_CHECKING:`` (they are marked in the dot output). A circle is a strongly connected group
of two or more modules. Layers, lowest first (an arrow may point down or sideways, never up):

    0 node     remote.*                       runs on the node; imports nothing of orchestrator
    1 base     orchestrator (package), errors, config.*, localenv, terminal, nodepath
    2 reach    transport.*, agent, hosts, facts.*, diagnosis
    3 steps    steps.*, demo.*, testbed.*     idempotent operations; the demo's and tests' parts
    4 commands commands.*, cli_common, console  load models, call a step, render
    5 cli      cli                            the click group; finds each command by name

A module no rule names is reported (layer unknown), so a new top-level module gets a place.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOP = ("orchestrator", "remote")
SKIP = ("remote._vendor",)

# (layer, name, dotted prefixes): the first rule whose prefix matches a module wins
LAYERS: list[tuple[int, str, tuple[str, ...]]] = [
    (5, "cli", ("orchestrator.cli", "orchestrator.entry", "orchestrator.__main__")),
    (4, "commands", ("orchestrator.commands", "orchestrator.cli_common", "orchestrator.console")),
    (3, "steps", ("orchestrator.steps", "orchestrator.demo", "orchestrator.testbed",
                  # the old layout's names (before scripts/relayout.py), so that an old tree can be drawn too
                  "orchestrator.demo_data", "orchestrator.testbed_")),
    (2, "reach", ("orchestrator.transport", "orchestrator.agent", "orchestrator.hosts", "orchestrator.facts",
                  "orchestrator.diagnosis",
                  "orchestrator.connection", "orchestrator.localconn", "orchestrator.hostkeys",
                  "orchestrator.known_hosts", "orchestrator.liveness", "orchestrator.openssh")),
    (1, "base", ("orchestrator.errors", "orchestrator.config", "orchestrator.localenv", "orchestrator.terminal",
                 "orchestrator.nodepath", "orchestrator.jobrules", "orchestrator.yamlpos")),
    (0, "node", ("remote",)),
]


def layer_of(mod: str) -> tuple[int, str] | None:
    if mod == "orchestrator":
        return 1, "base"
    for n, name, prefixes in LAYERS:
        for p in prefixes:
            if mod == p or mod.startswith(p + ".") or (p.endswith("_") and mod.startswith(p)):
                return n, name
    return None


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    kind: str  # "top", "lazy" (inside a function) or "typing" (under if TYPE_CHECKING)
    line: int


@dataclass
class Graph:
    modules: dict[str, Path] = field(default_factory=dict)
    edges: list[Edge] = field(default_factory=list)

    def adjacency(self, kinds: Iterable[str] = ("top", "lazy", "typing")) -> dict[str, set[str]]:
        want = set(kinds)
        adj: dict[str, set[str]] = {m: set() for m in self.modules}
        for e in self.edges:
            if e.kind in want:
                adj[e.src].add(e.dst)
        return adj


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def find_modules(root: Path) -> dict[str, Path]:
    """Every .py in a package folder (one with __init__.py) under orchestrator/ and remote/."""
    mods: dict[str, Path] = {}
    for top in TOP:
        for p in sorted((root / top).rglob("*.py")):
            if "__pycache__" in p.parts or not (p.parent / "__init__.py").is_file():
                continue
            name = module_name(p, root)
            if not name.startswith(SKIP):
                mods[name] = p
    return mods


class _Imports(ast.NodeVisitor):
    """(absolute target, kind, line) of each import in a module."""

    def __init__(self, module: str, is_package: bool) -> None:
        self.package = module if is_package else module.rpartition(".")[0]
        self.found: list[tuple[str, list[str], str, int]] = []
        self.depth = 0
        self.typing = 0

    def _kind(self) -> str:
        return "typing" if self.typing else "lazy" if self.depth else "top"

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_If(self, node: ast.If) -> None:
        t = node.test
        is_tc = (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
            isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")
        if is_tc:
            self.typing += 1
            for n in node.body:
                self.visit(n)
            self.typing -= 1
            for n in node.orelse:
                self.visit(n)
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            self.found.append((a.name, [], self._kind(), node.lineno))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            parts = self.package.split(".")
            base = parts[: len(parts) - (node.level - 1)]
            mod = ".".join(base + ([node.module] if node.module else []))
        else:
            mod = node.module or ""
        self.found.append((mod, [a.name for a in node.names], self._kind(), node.lineno))


def build(root: Path) -> Graph:
    g = Graph(find_modules(root))
    for mod, path in g.modules.items():
        v = _Imports(mod, path.name == "__init__.py")
        v.visit(ast.parse(path.read_text(), str(path)))
        seen: set[tuple[str, str]] = set()
        for target, names, kind, line in v.found:
            if target.split(".")[0] not in TOP or target.startswith(SKIP):
                continue
            dsts = [f"{target}.{n}" for n in names if f"{target}.{n}" in g.modules] if names else []
            if not dsts or len(dsts) < len(names):
                t = target
                while t and t not in g.modules:
                    t = t.rpartition(".")[0]
                if t:
                    dsts.append(t)
            for d in dsts:
                if d != mod and (d, kind) not in seen:
                    seen.add((d, kind))
                    g.edges.append(Edge(mod, d, kind, line))
    return g


def circles(adj: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of two or more modules (Tarjan, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in sorted(adj):
        if start in index:
            continue
        work = [(start, iter(sorted(adj[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(adj[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return sorted(out)


def upward(g: Graph) -> list[Edge]:
    """Arrows from a lower layer to a higher one."""
    out, seen = [], set()
    for e in g.edges:
        a, b = layer_of(e.src), layer_of(e.dst)
        if a is not None and b is not None and b[0] > a[0] and (e.src, e.dst) not in seen:
            seen.add((e.src, e.dst))
            out.append(e)
    return sorted(out, key=lambda e: (e.src, e.dst))


def unplaced(g: Graph) -> list[str]:
    return sorted(m for m in g.modules if layer_of(m) is None)


def collapse(mod: str) -> str:
    """A module's box in the package view: its subpackage (orchestrator.steps, remote.s3), or itself
    when it sits directly in orchestrator/ or remote/."""
    parts = mod.split(".")
    return ".".join(parts[:2])


def summary(g: Graph) -> dict[str, object]:
    adj = g.adjacency()
    circ = circles(adj)
    return {
        "modules": len(g.modules),
        "edges": len({(e.src, e.dst) for e in g.edges}),
        "lazy_edges": len({(e.src, e.dst) for e in g.edges if e.kind == "lazy"}),
        "circles": circ,
        "modules_in_circles": sum(len(c) for c in circ),
        "upward": [f"{e.src} -> {e.dst} (line {e.line}, {e.kind})" for e in upward(g)],
        "unplaced": unplaced(g),
    }


def text(g: Graph) -> str:
    s = summary(g)
    lines = [f"{s['modules']} modules, {s['edges']} import arrows ({s['lazy_edges']} of them inside a function), "
             f"{len(s['circles'])} circles ({s['modules_in_circles']} modules in them), "  # type: ignore[arg-type]
             f"{len(s['upward'])} upward arrows"]  # type: ignore[arg-type]
    adj = g.adjacency()
    for c in s["circles"]:  # type: ignore[attr-defined]
        inside = [f"{a} -> {b}" for a in c for b in sorted(adj[a]) if b in c]
        lines.append("circle: " + ", ".join(c))
        lines += [f"    {x}" for x in inside]
    lines += [f"upward: {u}" for u in s["upward"]]  # type: ignore[attr-defined]
    lines += [f"no layer: {m}" for m in s["unplaced"]]  # type: ignore[attr-defined]
    return "\n".join(lines)


def dot(g: Graph, packages: bool) -> str:
    adj = g.adjacency()
    circle_of = {m: i for i, c in enumerate(circles(adj)) for m in c}
    up = {(e.src, e.dst) for e in upward(g)}
    node = collapse if packages else (lambda m: m)
    edges: dict[tuple[str, str], set[str]] = {}
    for e in g.edges:
        a, b = node(e.src), node(e.dst)
        if a != b:
            same = e.src in circle_of and circle_of[e.src] == circle_of.get(e.dst)
            edges.setdefault((a, b), set()).add("up" if (e.src, e.dst) in up else "circle" if same else e.kind)
    names = sorted({node(m) for m in g.modules})
    out = ["digraph dfo {", '  rankdir=TB; ranksep=0.5; nodesep=0.2;',
           '  node [shape=box, fontname="Helvetica", fontsize=10];', '  edge [color="#777777", arrowsize=0.6];']
    by_layer: dict[str, list[str]] = {}
    for n in sorted(names, key=lambda m: -(layer_of(m) or (9, ""))[0]):  # the top layer first, drawn on top
        lay = layer_of(n)
        by_layer.setdefault(lay[1] if lay else "?", []).append(n)
    for lay, members in by_layer.items():
        out.append(f'  subgraph "cluster_{lay}" {{ label="{lay}"; style=rounded; color="#bbbbbb";')
        for n in members:
            circ = any(m in circle_of for m in g.modules if node(m) == n)
            out.append(f'    "{n}"' + (' [color=red, fontcolor=red]' if circ else "") + ";")
        out.append("  }")
    for (a, b), kinds in sorted(edges.items()):
        attrs = []
        if "up" in kinds:
            attrs.append('color=red, penwidth=2, label="up"')
        elif "circle" in kinds:
            attrs.append('color=red, penwidth=1.5')
        if kinds <= {"lazy", "typing"}:
            attrs.append("style=dashed")
        out.append(f'  "{a}" -> "{b}"' + (f" [{', '.join(attrs)}]" if attrs else "") + ";")
    out.append("}")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout to read (default: this one)")
    ap.add_argument("--dot", action="store_true", help="print Graphviz dot instead of the summary")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    ap.add_argument("--packages", action="store_true", help="with --dot: one box per subpackage")
    ap.add_argument("--check", action="store_true", help="exit 1 when there is a circle or an upward arrow")
    args = ap.parse_args(argv)
    g = build(args.root.resolve())
    if args.dot:
        sys.stdout.write(dot(g, args.packages))
    elif args.json:
        print(json.dumps(summary(g), indent=1))
    else:
        print(text(g))
    if args.check:
        s = summary(g)
        return 1 if s["circles"] or s["upward"] else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
