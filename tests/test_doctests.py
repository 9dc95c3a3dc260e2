"""The examples in the docstrings of what `blockscale` exports: every exported function and
class has one, and each runs (on the CPU, in well under a second).

Exported: the functions and classes of `blockscale.__all__` and of the `__all__` of each public
submodule listed there (nvfp4, mxfp8, hadamard, recipes, gemm, ops, nn, distributed); constants
carry no example. The examples assume `import torch` and `import blockscale as bs`, as numpy's
assume `np`. The distributed ones start a one-rank gloo group and destroy it at their end.
"""

from __future__ import annotations

import doctest
import inspect

import pytest
import torch
import torch.distributed as dist

import blockscale as bs


def exported() -> dict[str, object]:
    """Every exported function and class by its shortest public name (`convert`, not
    `nn.convert`: the top-level names come first)."""
    found: dict[str, object] = {}
    for name in bs.__all__:
        obj = getattr(bs, name)
        members = (
            [(f"{name}.{sub}", getattr(obj, sub)) for sub in obj.__all__]
            if inspect.ismodule(obj)
            else [(name, obj)]
        )
        for qualified, member in members:
            public = inspect.isfunction(member) or inspect.isclass(member)
            if public and all(member is not seen for seen in found.values()):
                found[qualified] = member
    return found


EXPORTED = exported()


def own_docstring(obj: object) -> str:
    """The object's own docstring (a class's is not inherited from its base here)."""
    return (obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__) or ""


def run_examples(name: str, docstring: str) -> doctest.TestResults:
    test = doctest.DocTestParser().get_doctest(docstring, {"torch": torch, "bs": bs}, name, None, 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    try:
        runner.run(test)
    finally:
        if dist.is_initialized():  # an example that failed before destroying its group
            dist.destroy_process_group()
    return runner.summarize(verbose=False)


def test_the_public_api_is_all_listed():
    """The entry points DESIGN.md names are among what is checked."""
    for name in ("convert", "linear", "grouped_mm", "nvfp4.quantize", "mxfp8.quantize"):
        assert name in EXPORTED
    assert "recipes.get" in EXPORTED and "distributed.enable_quantized_all_gather" in EXPORTED
    assert len(EXPORTED) >= 50, len(EXPORTED)


def test_every_exported_function_and_class_has_an_example():
    missing = [name for name, obj in EXPORTED.items() if ">>>" not in own_docstring(obj)]
    assert missing == []


def test_a_wrong_example_fails():
    """The runner below reports a failure (the parametrized test can fail)."""
    assert run_examples("wrong", ">>> 1 + 1\n3\n").failed == 1
    assert run_examples("right", ">>> bs.recipes.get('bf16').quantized\nFalse\n").failed == 0


@pytest.mark.parametrize("name", sorted(EXPORTED))
def test_example_runs(name):
    result = run_examples(name, own_docstring(EXPORTED[name]))
    assert result.attempted > 0 and result.failed == 0, result
