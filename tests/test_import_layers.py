"""Imports go one way (docs/DESIGN.md, "Layers"): no import circle between blockscale's parts.

Read from the sources, not from `sys.modules`: an import inside a function (the lazy ones, e.g.
`_library.kernels()` importing blockscale.kernels) counts as much as one at the top, since it
binds the two modules all the same. A part is a subpackage (kernels/, gemm/, ...) or a
top-level module (_library.py, recipes.py, ...); imports within a part are its own business.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "blockscale"

# Bottom up: a part may import only the parts before it in this list (DESIGN.md's layers).
# The public top-level modules (nvfp4, mxfp8, hadamard) are views of formats/ for users.
LAYERS = [
    "_registry",
    "formats",
    "nvfp4",
    "mxfp8",
    "hadamard",
    "demo",
    "kernels",
    "_library",
    "gemm",
    "recipes",
    "ops",
    "nn",
    "distributed",
    "models",
    "integrations",  # adapters to other trainers: nothing imports them (test below)
    "blockscale",  # __init__.py: the public API
    "train",
    "cli",
    "__main__",
]


def part_of(module: str) -> str:
    """`blockscale.kernels.amax` -> `kernels`; `blockscale` (its __init__) -> `blockscale`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def imported(tree: ast.AST) -> set[str]:
    """Every blockscale module a source imports, anywhere in it (function bodies included)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "blockscale":  # `from blockscale import kernels`: a module each
                found.update(f"blockscale.{alias.name}" for alias in node.names)
            else:
                found.add(node.module)
    return {name for name in found if name == "blockscale" or name.startswith("blockscale.")}


def part_imports() -> dict[str, set[str]]:
    """For each part, the other parts its modules import."""
    edges: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        source = part_of(module.removesuffix(".__init__"))
        targets = {part_of(name) for name in imported(ast.parse(path.read_text()))}
        edges.setdefault(source, set()).update(targets - {source})
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle (a path back to its start), found by depth-first search."""
    found, done = [], set()

    def visit(part: str, path: list[str]) -> None:
        if part in path:
            found.append(path[path.index(part) :] + [part])
            return
        if part in done:
            return
        for target in sorted(edges.get(part, ())):
            visit(target, path + [part])
        done.add(part)

    for part in sorted(edges):
        visit(part, [])
    return found


def test_the_finder_sees_a_circle_and_a_lazy_import():
    """The checks below can fail: a circle is found, and an import in a function counts."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert circles({"a": {"b"}, "b": set()}) == []
    lazy = ast.parse("def f():\n    from blockscale import kernels\n")
    assert imported(lazy) == {"blockscale.kernels"}


def test_no_import_circle_between_parts():
    assert circles(part_imports()) == []


def test_the_registry_imports_nothing_of_blockscale():
    """kernels/ registers its ops with _registry, and _library looks kernels/ up: the circle
    `_library` -> `kernels` -> `_library` that registration and lookup in one module made."""
    edges = part_imports()
    assert edges["_registry"] == set()
    assert "_library" not in edges["kernels"]
    assert "kernels" in edges["_library"]  # the lookup, lazily: still counted


def test_every_part_imports_only_parts_below_it():
    edges = part_imports()
    assert set(edges) <= set(LAYERS), set(edges) - set(LAYERS)  # a new part: place it above
    upward = {
        f"{source} -> {target}"
        for source, targets in edges.items()
        for target in targets
        if LAYERS.index(target) > LAYERS.index(source)
    }
    assert upward == set()


def test_integrations_are_built_from_nn_and_distributed_only():
    """DESIGN.md: an adapter to another trainer uses nn/ and distributed/ (and the recipe
    registry), and nothing in blockscale imports it (it is optional: its trainer may be
    missing)."""
    edges = part_imports()
    assert edges["integrations"] <= {"nn", "distributed", "recipes"}, edges["integrations"]
    assert not [part for part, targets in edges.items() if "integrations" in targets]
