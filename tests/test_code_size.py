"""Code size limits (issue 34): no function in spear.kernels over 120 lines, no module in spear over 600 lines
unless its docstring says why ("Long module: ..."). Triton inlines @triton.jit helpers, so a long kernel splits
into helpers with the same compiled code (bench/sass_compare.py checks that)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "spear"
MAX_FUNCTION_LINES = 120
MAX_MODULE_LINES = 600


def _functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.end_lineno - node.lineno + 1


def test_no_kernel_function_over_the_limit():
    long = {f"{path.relative_to(SRC)}:{name}": lines for path in sorted((SRC / "kernels").rglob("*.py"))
            for name, lines in _functions(ast.parse(path.read_text())) if lines > MAX_FUNCTION_LINES}
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_no_module_over_the_limit_without_a_reason():
    long = {}
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        doc = ast.get_docstring(ast.parse(text)) or ""
        if len(text.splitlines()) > MAX_MODULE_LINES and "Long module:" not in doc:
            long[str(path.relative_to(SRC))] = len(text.splitlines())
    assert not long, f"modules over {MAX_MODULE_LINES} lines with no 'Long module:' reason in the docstring: {long}"
