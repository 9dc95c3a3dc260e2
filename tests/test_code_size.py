"""House rules on size that a refactor keeps (issue 36): no function in blockscale/ over 150
lines, and the training loop's body (`Trainer.run`) on one screen."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "blockscale"


def function_lengths(source: str) -> dict[str, int]:
    """Lines of every function and method (decorators excluded) by qualified name."""
    lengths = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    lengths[name] = child.end_lineno - child.lineno + 1
                visit(child, name + ".")

    visit(ast.parse(source), "")
    return lengths


def test_the_measure_counts_nested_functions_and_methods():
    source = "class A:\n    def f(self):\n        def g():\n            pass\n        return 1\n"
    assert function_lengths(source) == {"A.f": 4, "A.f.g": 2}


def test_no_function_over_150_lines():
    long = {
        f"{path.relative_to(PACKAGE.parent)}:{name}": n
        for path in sorted(PACKAGE.rglob("*.py"))
        for name, n in function_lengths(path.read_text()).items()
        if n > 150
    }
    assert long == {}


def test_the_training_loop_fits_on_a_screen():
    lengths = function_lengths((PACKAGE / "train" / "loop.py").read_text())
    assert lengths["Trainer.run"] <= 60, lengths["Trainer.run"]
    assert lengths["train"] <= 60, lengths["train"]
