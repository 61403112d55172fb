"""The package's shape: imports in one direction (no circle between project modules, function-level
imports included) and modules a reader can take in one sitting."""
import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# installed name -> folder: setup.py's roots (kernels/, datasets/, eval/ install inside imggen) and
# every package folder below them, as setup.py finds them
ROOTS = {"imggen": "imggen", "imggen.kernels": "kernels", "imggen.datasets": "datasets", "imggen.eval": "eval"}


def _packages() -> dict[str, str]:
    found = {}
    for name, folder in ROOTS.items():
        for dirpath, dirnames, files in os.walk(os.path.join(ROOT, folder)):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            if "__init__.py" in files:
                rel = os.path.relpath(dirpath, os.path.join(ROOT, folder))
                found[name if rel == "." else f"{name}.{rel.replace(os.sep, '.')}"] = os.path.relpath(dirpath, ROOT)
    return found


PACKAGES = _packages()
MAX_LINES = 400


def modules() -> dict[str, str]:
    found = {}
    for pkg, folder in PACKAGES.items():
        for f in sorted(os.listdir(os.path.join(ROOT, folder))):
            if f.endswith(".py"):
                found[pkg if f == "__init__.py" else f"{pkg}.{f[:-3]}"] = os.path.join(ROOT, folder, f)
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere in its file (`from P import m` counts as
    importing P.m when that is a module, else P)."""
    mods = modules()
    graph = {}
    for name, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    deps.add(sub if sub in mods else node.module)
            elif isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names)
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
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

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_between_project_modules():
    graph = import_graph()
    assert {"imggen.decode", "imggen.native", "imggen.panels", "imggen.model"} <= set(graph)
    assert cycles(graph) == []


def test_decode_path_reads_in_one_direction():
    """model -> decode (caches, plans) -> CPU step kernels: the kernels import none of their callers."""
    graph = import_graph()
    assert graph["imggen.native"] <= {"imggen.errors", "imggen.attention"}
    assert "imggen.model" not in graph["imggen.decode"] | graph["imggen.plans"] | graph["imggen.panels"]
    assert not graph["imggen.plans"] & {"imggen.decode", "imggen.native", "imggen.panels"}


@pytest.mark.parametrize("folder", ["imggen", "imggen/patterns"])
def test_library_modules_stay_readable(folder):
    long = {f: n for f in os.listdir(os.path.join(ROOT, folder)) if f.endswith(".py")
            and (n := sum(1 for _ in open(os.path.join(ROOT, folder, f)))) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"
