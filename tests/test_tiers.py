"""The two tiers (tests/conftest.py): every name that puts a test in the fast tier names one
that exists, so a renamed test cannot leave the fast tier without notice (it would still run,
in the rest tier), and the tiers split the suite: each test runs in exactly one of them."""

import ast
import subprocess
import sys
from pathlib import Path

import conftest

TESTS = Path(__file__).resolve().parent


def module_functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


def test_every_fast_tier_name_names_a_test():
    missing = sorted(
        f for f in conftest.FAST_FILES | set(conftest.FAST_TESTS) if not (TESTS / f).is_file()
    )
    assert not missing, f"tests/conftest.py names files that do not exist: {missing}"
    for file, names in conftest.FAST_TESTS.items():
        gone = sorted(names - module_functions(TESTS / file))
        assert not gone, f"tests/conftest.py FAST_TESTS[{file!r}] names no test {gone}"
        assert file not in conftest.FAST_FILES, f"{file} is both whole and by function"


def collected(*args: str) -> set[str]:
    """The node ids `python -m pytest --collect-only -q ARGS` collects from the repository
    root, as the README and .ci/run call it."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        cwd=TESTS.parent, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {line for line in done.stdout.splitlines() if "::" in line}


def test_the_fast_and_the_rest_tier_split_the_suite():
    fast, rest, every = collected(), collected("--tier", "rest"), collected("--tier", "all")
    assert fast and rest and not fast & rest
    assert fast | rest == every
    assert all(line.split("::")[0] != "tests/test_compile.py" for line in fast)
    # A named path runs whole, whatever its tier.
    assert collected("tests/test_compile.py") == {
        line for line in every if line.startswith("tests/test_compile.py::")
    }
