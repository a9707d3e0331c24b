"""The source layout (the design card's house): one ``kvroute`` package whose parts live in
top-level folders, an import graph with no cycle, and data flowing one way between the parts.

Imports are read from the source (every ``import`` statement, deferred ones and type-only
ones included), so a cycle hidden behind an import inside a function still fails here."""

from __future__ import annotations

import ast
import re
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
PACKAGE_DIR: dict[str, str] = SETUPTOOLS["package-dir"]
PACKAGES: list[str] = SETUPTOOLS["packages"]

# What each part may import besides itself. The core imports none of the services; the
# router and the agent know each other only through the contract (kvroute.v1); the simulator
# drives the router's own decision path over the core's policies.
ALLOWED = {
    "v1": set(),
    "envoy_api": set(),  # Envoy's ext_proc stubs (vendored protos): kvroute epp speaks them
    "core": {"v1"},
    "router": {"core", "v1", "envoy_api"},
    "worker_agent": {"core", "v1"},
    "simulations": {"core", "router"},
    "demo": {"core", "v1"},
    "cli": {"core", "router", "worker_agent", "simulations", "demo", "top"},
}


def folder(package: str) -> Path:
    """The folder setuptools takes ``package`` from (the longest package-dir prefix)."""
    base = max((k for k in PACKAGE_DIR if package == k or package.startswith(k + ".")), key=len)
    rest = package[len(base):].lstrip(".")
    return ROOT / PACKAGE_DIR[base] / Path(*rest.split(".")) if rest else ROOT / PACKAGE_DIR[base]


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for f in folder(package).glob("*.py"):
            found[package if f.stem == "__init__" else f"{package}.{f.stem}"] = f
    return found


def imported(name: str, path: Path) -> Iterator[str]:
    """Every module name an import statement in ``path`` may load (``from a import b`` is
    ``a`` and ``a.b``: b may be a submodule)."""
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            yield base
            yield from (f"{base}.{a.name}" for a in node.names)


def graph() -> dict[str, set[str]]:
    mods = modules()
    edges: dict[str, set[str]] = {}
    for name, path in mods.items():
        targets = set()
        for target in imported(name, path):
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target and target != name:
                targets.add(target)
        edges[name] = targets
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def part(module: str) -> str:
    rest = module.split(".")[1:]
    if not rest:
        return "top"
    return "cli" if rest[0] in ("cli", "__main__") else rest[0]


def test_every_package_folder_is_installed() -> None:
    listed = set(PACKAGES)
    for base, where in PACKAGE_DIR.items():
        for init in (ROOT / where).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / where)
            name = ".".join([base, *rel.parts]) if rel.parts else base
            if any(name.startswith(other + ".") or name == other
                   for other in PACKAGE_DIR if other != base and len(other) > len(base)):
                continue  # a folder mapped on its own (kvroute.v1 is not kvroute/v1)
            assert name in listed, f"{init.parent} is not in pyproject's packages"
    for package in PACKAGES:
        assert (folder(package) / "__init__.py").exists(), package


def test_the_import_graph_has_no_cycle() -> None:
    edges = graph()
    assert len(edges) > 60
    assert cycles(edges) == []


def test_a_cycle_is_found() -> None:
    # The check itself, on a graph with one: a -> b -> c -> a, and d outside it.
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}) == [["a", "b", "c"]]


def test_each_part_imports_only_what_it_may() -> None:
    wrong = sorted(f"{m} -> {t}" for m, targets in graph().items() for t in targets
                   if part(t) != part(m) and part(t) not in ALLOWED[part(m)])
    assert wrong == []


def test_no_module_imports_a_part_by_its_folder_name() -> None:
    # `import simulations` works from the repo root (the folder is on sys.path there) and
    # nowhere else: every import names the installed package.
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    folders = "|".join(re.escape(f) for f in PACKAGE_DIR.values() if "/" not in f
                       and f != "kvroute")
    bad = re.compile(rf"^\s*(from|import)\s+({folders})(\.|\s)", re.M)
    offenders = [f for f in tracked if (ROOT / f).exists() and bad.search((ROOT / f).read_text())]
    assert offenders == []
