"""The package import graph of src/spear, built from the sources with ast, and the layering it must keep.

Every import counts, function-level ones included (they run too); imports under `if TYPE_CHECKING:` do not.
`python tests/test_layering.py` prints the graph between packages (spear.kernels, spear.layer, ...) and its cycles.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.AST) -> list[str | tuple[str, str]]:
    """Every module an import statement names, outside TYPE_CHECKING blocks: `import m` as m, `from m import n` as
    (m, n)."""
    found = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.extend((node.module, alias.name) for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph(packages: bool = True) -> dict[str, set[str]]:
    """{importer: imported} between spear's modules, or (`packages`) their top-level units: spear.kernels.w4.decode
    counts as spear.kernels, spear.layer as itself."""
    modules = {_module_name(p): p for p in (SRC / "spear").rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        for target in _imports(ast.parse(path.read_text())):
            if isinstance(target, tuple):  # from m import n: the submodule m.n where n is one, else m
                target = f"{target[0]}.{target[1]}" if f"{target[0]}.{target[1]}" in modules else target[0]
            if target not in modules:
                continue
            a, b = (".".join(m.split(".")[:2]) if packages else m for m in (name, target))
            if a != b:
                graph.setdefault(a, set()).add(b)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(sorted([v, *component]))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_record_imports_nothing_of_ours_but_the_errors():
    assert import_graph()["spear.record"] <= {"spear.errors"}


def test_layer_sits_below_everything_but_the_record_and_the_kernels():
    assert import_graph()["spear.layer"] <= {"spear.errors", "spear.record", "spear.kernels"}


def test_kernels_import_no_package_above_them():
    assert import_graph()["spear.kernels"] <= {"spear.errors", "spear.record"}


def test_no_package_cycle():
    assert cycles(import_graph()) == []


def test_no_module_cycle_through_the_layer_kernels_or_runtime():
    ours = ("spear.layer", "spear.kernels", "spear.runtime")
    assert [c for c in cycles(import_graph(packages=False)) if any(m.startswith(ours) for m in c)] == []


def test_cycles_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


if __name__ == "__main__":
    graph = import_graph(packages="--modules" not in sys.argv)
    for node in sorted(graph):
        print(f"{node} -> {', '.join(sorted(graph[node]))}")
    print("cycles:", cycles(graph) or "none")
