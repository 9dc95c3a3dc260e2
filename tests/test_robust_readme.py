"""The README's usage snippet runs as pasted (it used `x` and `model` without defining them)."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def usage_snippet() -> str:
    """The first python block after the README's '## Use' heading."""
    text = README.read_text()
    use = text.index("\n## Use\n")
    found = re.search(r"```python\n(.*?)```", text[use:], re.S)
    assert found, "README.md has no python block under '## Use'"
    return found.group(1)


@pytest.mark.usefixtures("one_cpu_thread")
def test_the_readme_usage_snippet_runs_as_pasted():
    namespace: dict = {}
    exec(compile(usage_snippet(), str(README), "exec"), namespace)
    out, q, model = namespace["out"], namespace["q"], namespace["model"]
    assert out.shape == (161, 96) and q.data.shape == (128, 128)
    assert any(p.grad is not None for p in model.parameters())
