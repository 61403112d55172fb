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
    assert {"imggen.decode", "imggen.decode.native", "imggen.decode.panels", "imggen.model"} <= set(graph)
    assert cycles(graph) == []


def test_decode_path_reads_in_one_direction():
    """model -> decode (caches, plans) -> CPU step kernels: the kernels import none of their callers."""
    graph = import_graph()
    assert graph["imggen.decode.native"] <= {"imggen.errors", "imggen.attention", "imggen.cbuild"}
    assert "imggen.model" not in graph["imggen.decode"] | graph["imggen.decode.plans"] | graph["imggen.decode.panels"]
    assert not graph["imggen.decode.plans"] & {"imggen.decode", "imggen.decode.native", "imggen.decode.panels"}


@pytest.mark.parametrize("folder", sorted(f for f in PACKAGES.values() if f.split(os.sep)[0] == "imggen"))
def test_library_modules_stay_readable(folder):
    long = {f: n for f in os.listdir(os.path.join(ROOT, folder)) if f.endswith(".py")
            and (n := sum(1 for _ in open(os.path.join(ROOT, folder, f)))) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


# The layers of the package, bottom first: a module imports only modules of its own layer or of
# the layers below it (function-level imports count; the cycle test above keeps a layer's own
# modules from going round). Each subpackage's docstring says the same in words.
LAYERS = [
    ("base", ["imggen", "imggen.errors", "imggen.storage", "imggen.threads", "imggen.memory", "imggen.precision", "imggen.mixture",
              "imggen.cbuild", "imggen.cpu_ops", "imggen.fused", "imggen.tokens", "imggen.images", "imggen.augment",
              "imggen.classic"]),
    ("patterns, datasets", ["imggen.patterns", "imggen.datasets"]),
    ("attention and its triton kernels", ["imggen.attention", "imggen.kernels"]),
    ("decode", ["imggen.decode"]),
    ("inpainting", ["imggen.inpainting"]),
    ("config", ["imggen.config"]),
    ("model", ["imggen.model"]),
    ("checkpoint", ["imggen.checkpoint"]),
    ("sampling", ["imggen.sampling", "imggen.graphs"]),
    ("volumes, eval", ["imggen.volumes", "imggen.volume_fill", "imggen.eval"]),
    ("training", ["imggen.training"]),
    ("cli", ["imggen.cli"]),
    ("the eval command", ["imggen.eval.__main__"]),
]


def layer_of(module: str) -> int:
    """The layer of a module: that of the longest name in LAYERS it is or lies under."""
    best = None
    for i, (_, names) in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and (best is None or len(name) > len(best[1])):
                best = (i, name)
    assert best is not None, f"{module} is in no layer of LAYERS: add it"
    return best[0]


def test_layer_of_picks_the_longest_name():
    assert layer_of("imggen.eval.__main__") == len(LAYERS) - 1
    assert layer_of("imggen.eval.bpd") == layer_of("imggen.volumes")
    assert layer_of("imggen.decode.plans") > layer_of("imggen.attention.blocked") > layer_of("imggen.errors")


def test_every_module_imports_only_its_layer_or_those_below():
    upward = [f"{m} ({LAYERS[layer_of(m)][0]}) imports {d} ({LAYERS[layer_of(d)][0]})"
              for m, deps in import_graph().items() for d in sorted(deps) if layer_of(d) > layer_of(m)]
    assert not upward, "imports running upward:\n" + "\n".join(upward)


def test_every_subpackage_says_what_it_owns_and_may_import():
    for pkg in ("imggen.attention", "imggen.decode", "imggen.inpainting", "imggen.training"):
        doc = ast.get_docstring(ast.parse(open(modules()[pkg]).read())) or ""
        assert "May import" in doc, f"{pkg}'s docstring does not say what it may import"


def test_no_subpackage_shadows_a_public_name():
    """`imggen.inpaint` is a function: a subpackage of that name would replace it once imported."""
    import importlib

    import imggen

    for name in modules():
        if name.startswith("imggen.") and not name.endswith("__main__"):
            importlib.import_module(name)
    assert all(callable(getattr(imggen, name)) for name in imggen.__all__)
    assert not {name.split(".")[1] for name in modules() if name.count(".") >= 1} & set(imggen.__all__)
