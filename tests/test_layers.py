"""The shape of the code, kept: the core's modules import each other without a circle, ``interfaces``
is the ground floor, the data layer knows nothing of the runtime, the runtime names no plugin, the
kernels stand alone, and no module holds a boolean switch. Read from the source with ``ast``: every
import counts, at module level, inside a function or under ``TYPE_CHECKING``."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "compresskit"
KERNELS = ROOT / "plugins" / "wide" / "compresskit_wide" / "kernels"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, root: Path) -> set[str]:
    """Every module name ``path`` imports, absolute (relative imports resolved), at any depth of its
    code; ``from a import b`` counts ``a`` and ``a.b`` (``b`` may be a module)."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return found


def graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package tree it imports."""
    files = {module_name(p, root): p for p in root.rglob("*.py")}
    return {m: {i for i in imported(p, root) if i in files and i != m} for m, p in files.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_circle():
    """(The check below can fail: a made-up graph with a circle is found.)"""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_core_imports_without_a_circle():
    edges = graph(CORE)
    assert len(edges) > 20  # (the tree was found)
    assert cycles(edges) == []


def test_interfaces_is_the_ground_floor():
    assert graph(CORE)["compresskit.interfaces"] == set()


def test_the_data_layer_does_not_import_the_runtime():
    edges = graph(CORE)
    assert not {m for m in edges["compresskit.data"] if m.startswith("compresskit.runtime")}
    assert not {m for m in edges["compresskit.tasks"] if m in ("compresskit.data", "compresskit.recipe")}


@pytest.mark.parametrize("path", sorted(KERNELS.glob("*.py")), ids=lambda p: p.name)
def test_the_kernels_import_nothing_of_compresskit(path):
    core = {m for m in imported(path, KERNELS.parent) if m == "compresskit" or m.startswith("compresskit.")}
    assert core == set()


# concepts of one plugin that the core must not know (WIDE's shared routing and its kernels' tiles)
PLUGIN_CONCEPTS = ("consensus", "quorum", "voters", "tile", "tiles")


def plugin_names() -> set[str]:
    """The names under which a plugin outside the core is registered (entry points not in ``compresskit``)."""
    from importlib.metadata import entry_points

    groups = ("compresskit.pruners", "compresskit.trainers", "compresskit.executors")
    return {ep.name for group in groups for ep in entry_points(group=group) if not ep.value.startswith("compresskit.")}


def core_mentions(words) -> list[str]:
    """``path:line: word`` for each of ``words`` (case-insensitive, whole words; a hyphenated name whole) in a
    module of the core: code, strings, docstrings and comments alike."""
    pattern = re.compile(
        r"(?<![\w-])(" + "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True)) + r")(?![\w-])", re.I
    )
    found = []
    for path in sorted(CORE.rglob("*.py")):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            found += [f"{path.relative_to(ROOT)}:{i}: {m.group(1)}" for m in pattern.finditer(line)]
    return found


def test_the_mention_finder_finds_a_name(tmp_path):
    """(The check below can fail: a plugin's name in a line is found, whole words only.)"""
    names = plugin_names()
    assert {"wide", "wide-triton", "static-depth", "dynamic-depth"} <= names and "lora" not in names
    assert re.search(r"(?<![\w-])(wide)(?![\w-])", "pruner: {name: wide}")
    assert not re.search(r"(?<![\w-])(wide)(?![\w-])", "widest, wide-triton, wider")


def test_no_module_of_the_core_names_a_plugin_or_its_concepts():
    """A plugin's blocks, options and rules come through its plugin class (found in the registry by name):
    no module of ``compresskit/`` names a plugin registered outside it, or one plugin's concepts. (A product
    default that names the flagship lives as data, ``compresskit/resources/defaults.json``.)"""
    assert core_mentions(plugin_names() | set(PLUGIN_CONCEPTS)) == []


def test_only_the_ops_consult_the_kernel_policy():
    """One decision per op: a block asks ``kernels.ops`` which operation runs (the op itself, or one of its
    questions, e.g. ``ops.handoff_backend``) and gets it; only the ops (and the kernels' own launch settings)
    read ``kernels.policy``."""
    wide = ROOT / "plugins" / "wide" / "compresskit_wide"
    readers = {
        module_name(p, wide)
        for p in wide.rglob("*.py")
        if any(m.startswith("compresskit_wide.kernels.policy") for m in imported(p, wide))
    }
    outside = {m for m in readers if not m.startswith("compresskit_wide.kernels.")}
    assert outside == set() and "compresskit_wide.kernels.ops" in readers


@pytest.mark.parametrize("root", [CORE, ROOT / "plugins"], ids=["core", "plugins"])
def test_no_module_holds_a_boolean_switch(root):
    """A choice a user makes is a validated config field; a choice the code made is code, not a constant."""
    switches = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in root.rglob("*.py")
        for node in ast.parse(path.read_text()).body
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, bool)
    ]
    assert switches == []


def test_no_function_of_the_core_is_over_100_lines():
    """A function a reader can hold: none of the core's is longer than 100 lines (a phase too long for that gets
    a state object and a function a phase, as ``api._Run`` and ``trainers._Loop`` do)."""
    long = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in CORE.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 100
    ]
    assert long == []
