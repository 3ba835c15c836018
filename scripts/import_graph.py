#!/usr/bin/env python
"""Measure the import graph of the server's packages: edges, upward edges, cycles.

Reads the source with ``ast`` (imports nothing of the project), so it runs without
Django settings. Prints:

- package edges (a package is a module's folder, e.g. ``fleet.engine``) and how many
  of them point up the layer order in ``LAYERS`` below;
- module-level import cycles between project modules (strongly connected components);
- function-local imports of project modules, and which of them close a cycle
  (the import would form a cycle if it were at module level).

``--verbose`` lists every upward edge, every cycle's members and every local import.
The layer order is read from pyproject.toml's ``server-layers`` import-linter contract
(docs/architecture.md draws it); modules in no layer count in no upward edge.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
import tomllib
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the tree measured (--root); layers: HERE
HERE = Path(__file__).resolve().parent.parent
PACKAGES = ("cloacina_site", "fleet", "agents", "artifacts")


def _load_layers() -> list[tuple[str, tuple[str, ...]]]:
    """The layers of pyproject.toml's ``server-layers`` contract, highest first."""
    config = tomllib.loads((HERE / "pyproject.toml").read_text())
    for contract in config["tool"]["importlinter"]["contracts"]:
        if contract["id"] == "server-layers":
            return [
                (f"L{len(contract['layers']) - i}", tuple(re.split(r"\s*[|:]\s*", layer.strip())))
                for i, layer in enumerate(contract["layers"])
            ]
    raise SystemExit("no server-layers contract in pyproject.toml")


LAYERS = _load_layers()
RANK = {name: len(LAYERS) - i for i, (name, _) in enumerate(LAYERS)}


def layer_of(module: str) -> str:
    best, best_len = "?", -1
    for name, prefixes in LAYERS:
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = name, len(prefix)
    return best


def project_modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            if "migrations" in rel.parts:
                continue
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest project module that ``name`` (a module or module.attr) names."""
    while name:
        if name in modules:
            return name
        if "." not in name:
            return None
        name = name.rsplit(".", 1)[0]
    return None


class _Collector(ast.NodeVisitor):
    def __init__(self, module: str, is_pkg: bool, modules: dict[str, Path]):
        self.module, self.is_pkg, self.modules = module, is_pkg, modules
        self.depth = 0  # function nesting
        self.type_checking = 0
        self.found: list[tuple[str, bool, int]] = []  # (target, local, line)

    def _add(self, target: str | None, line: int) -> None:
        if target and target != self.module and not self.type_checking:
            self.found.append((target, self.depth > 0, line))

    def visit_FunctionDef(self, node):  # noqa: N802
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef  # noqa: N815

    def visit_If(self, node):  # noqa: N802
        test = ast.unparse(node.test)
        if "TYPE_CHECKING" in test:
            self.type_checking += 1
            for child in node.body:
                self.visit(child)
            self.type_checking -= 1
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def visit_Import(self, node):  # noqa: N802
        for alias in node.names:
            self._add(resolve(alias.name, self.modules), node.lineno)

    def visit_ImportFrom(self, node):  # noqa: N802
        if node.level:
            base = self.module.split(".")
            if not self.is_pkg:
                base = base[:-1]
            base = base[: len(base) - (node.level - 1)]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        for alias in node.names:
            target = resolve(f"{prefix}.{alias.name}", self.modules)
            self._add(target or resolve(prefix, self.modules), node.lineno)


def collect(modules: dict[str, Path]):
    edges: dict[str, set[str]] = defaultdict(set)  # module-level
    local: list[tuple[str, str, int]] = []
    for mod, path in modules.items():
        c = _Collector(mod, path.name == "__init__.py", modules)
        c.visit(ast.parse(path.read_text(), str(path)))
        for target, is_local, line in c.found:
            if is_local:
                local.append((mod, target, line))
            else:
                edges[mod].add(target)
    return edges, local


def sccs(edges: dict[str, set[str]], nodes) -> list[list[str]]:
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]
    sys.setrecursionlimit(10000)

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
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

    for v in sorted(nodes):
        if v not in index:
            strong(v)
    return out


def reachable(edges, start, goal) -> bool:
    seen, todo = {start}, [start]
    while todo:
        v = todo.pop()
        if v == goal:
            return True
        for w in edges.get(v, ()):
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return False


def package_of(module: str, modules: dict[str, Path]) -> str:
    if modules[module].name == "__init__.py":
        return module
    return module.rsplit(".", 1)[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--verbose", "-v", action="store_true")
    ap.add_argument("--root", type=Path, help="measure this tree (e.g. an older export)")
    args = ap.parse_args()
    global ROOT
    if args.root:
        ROOT = args.root.resolve()
    modules = project_modules()
    edges, local = collect(modules)

    pkg_edges: dict[tuple[str, str], int] = defaultdict(int)
    for src, targets in edges.items():
        for dst in targets:
            a, b = package_of(src, modules), package_of(dst, modules)
            if a != b:
                pkg_edges[(a, b)] += 1
    cycles = sccs(edges, modules)
    pkg_graph: dict[str, set[str]] = defaultdict(set)
    for a, b in pkg_edges:
        pkg_graph[a].add(b)
    pkg_cycles = sccs(pkg_graph, {p for e in pkg_edges for p in e})
    local = sorted(set(local))
    dodging = [(s, d, n) for s, d, n in local if reachable(edges, d, s)]
    all_edges: dict[str, set[str]] = defaultdict(set)
    for s, ts in edges.items():
        all_edges[s] |= ts
    for s, d, _ in local:
        all_edges[s].add(d)
    hidden = sccs(all_edges, modules)
    up_modules = [  # function-local imports included: import-linter counts them too
        (s, d)
        for s, ts in all_edges.items()
        for d in ts
        if layer_of(s) != "?" and RANK.get(layer_of(d), 0) > RANK[layer_of(s)]
    ]
    up_pkgs = {(package_of(s, modules), package_of(d, modules)) for s, d in up_modules}

    print(f"modules: {len(modules)}")
    print(f"package edges: {len(pkg_edges)}, pointing up a layer: {len(up_pkgs)}")
    print(
        f"module edges: {sum(len(t) for t in edges.values())} "
        f"(with function-local ones: {sum(len(t) for t in all_edges.values())}), "
        f"pointing up a layer: {len(up_modules)}"
    )
    print(f"module cycles: {len(cycles)} (sizes {sorted((len(c) for c in cycles), reverse=True)})")
    print(
        f"module cycles counting function-local imports: {len(hidden)} "
        f"(sizes {sorted((len(c) for c in hidden), reverse=True)})"
    )
    print(f"package cycles: {len(pkg_cycles)} (sizes {[len(c) for c in pkg_cycles]})")
    print(f"function-local project imports: {len(local)}, closing a cycle: {len(dodging)}")
    if args.verbose:
        print("\nupward module edges:")
        for s, d in sorted(up_modules):
            print(f"  {s} [{layer_of(s)}] -> {d} [{layer_of(d)}]")
        print("\nmodule cycles:")
        for c in cycles:
            print("  " + " ".join(c))
        print("\nmodule cycles counting function-local imports:")
        for c in hidden:
            print("  " + " ".join(c))
        print("\npackage cycles:")
        for c in pkg_cycles:
            print("  " + " ".join(c))
        print("\nfunction-local imports (* closes a cycle):")
        for s, d, n in sorted(local):
            mark = "*" if (s, d, n) in dodging else " "
            print(f" {mark} {s}:{n} -> {d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
