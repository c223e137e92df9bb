"""The file-level import graph inside one package, and its circles.

    python tools/import_graph.py relax_slurm/launch          # edges, then cycles
    python tools/import_graph.py relax_slurm/launch --private  # also private names imported

Counts every import of a sibling module of the package: module-level and function-level
(lazy) alike, `import a.b` and `from a import b` and `from a.b import c`. An edge a -> b
means a.py imports b.py. A cycle is a strongly connected component of more than one file (or
a file importing itself). `--private` lists `from sibling import _name` across files. Exit
status 1 when there is a cycle.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from pathlib import Path


def module_name(path: Path, root: Path) -> str:
    """Dotted name of `path` (a .py file under the package directory `root`)."""
    top = root
    while (top.parent / "__init__.py").exists():  # up to the top package
        top = top.parent
    rel = path.relative_to(top.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, package: str) -> Iterator[tuple[str, str, int, bool]]:
    """(module imported, name imported or "", line, lazy) for every import in `path`."""
    tree = ast.parse(path.read_text(), str(path))
    lazy_nodes: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lazy_nodes |= {id(n) for n in ast.walk(node) if n is not node}
    for node in ast.walk(tree):
        lazy = id(node) in lazy_nodes
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, "", node.lineno, lazy
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the package
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            for alias in node.names:
                yield mod, alias.name, node.lineno, lazy


def graph(root: Path) -> tuple[dict[str, dict[str, list[str]]], list[str]]:
    """{file: {imported file: ["line N (lazy)", ...]}} over the package's files, and the
    private names imported across them."""
    package = module_name(root / "__init__.py", root)
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    edges: dict[str, dict[str, list[str]]] = {m: {} for m in files}
    private: list[str] = []
    for mod, path in files.items():
        for target, name, line, lazy in imports_of(path, package):
            dest = None
            if name and f"{target}.{name}" in files:  # from package import module
                dest = f"{target}.{name}"
            elif target in files and target != package:
                dest = target
            if dest is None or dest == mod:
                continue
            where = edges[mod].setdefault(dest, [])
            if (at := f"{line}{' lazy' if lazy else ''}") not in where:
                where.append(at)
            if name.startswith("_") and not name.startswith("__") and dest == target:
                private.append(f"{short(mod)} imports {short(dest)}.{name} (line {line})")
    return edges, private


def cycles(edges: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """Strongly connected components of more than one file (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
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

    sys.setrecursionlimit(10000)
    for v in edges:
        if v not in index:
            visit(v)
    return out


def short(mod: str) -> str:
    return mod.rsplit(".", 1)[-1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("package", type=Path, help="a package directory, e.g. relax_slurm/launch")
    ap.add_argument("--private", action="store_true", help="list private names imported")
    args = ap.parse_args()
    edges, private = graph(args.package.resolve())
    for mod, dests in edges.items():
        for dest, where in sorted(dests.items()):
            print(f"{short(mod)} -> {short(dest)}  ({', '.join(where)})")
    found = cycles(edges)
    print(f"\n{len(found)} cycle(s)")
    for comp in found:
        print("  " + " <-> ".join(short(m) for m in comp))
    if args.private:
        print(f"\n{len(private)} private name(s) imported across files")
        for p in private:
            print("  " + p)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
