"""The README's code runs as a reader pastes it.

Python: the README's python blocks, in order, run as one script on the CPU. The quickstart loads
a pretrained model by `from_pretrained`; here that model is a tiny random-init transformers Llama
that the test saves to a temporary folder first, and the one string naming the Hub model is
replaced by that folder's path (the only edit: the test checks the string occurs once). The run
must train (the parameters change, the losses are finite), and the save/load block's claims
must hold: the plain and the converted reload hold the trained parameters bit for bit under
the same names, the converted reload computes the trained model's logits bit for bit, and the
plain reload's layers are plain nn.Linear again. `torch.compile` runs with
`backend="aot_eager"`: Dynamo and AOTAutograd trace the converted model as under Inductor (where
a converted model would break), while Inductor's C++ code generation, which took 230 s for this
snippet on a loaded 2-core machine, is tested on the same model in tests/test_hf_llama.py.

Shell: every `blockscale ...` and `torchrun ... -m blockscale ...` line parses with the CLI's
own parser (flags and values checked, nothing run), and the README's test command is the one
`.ci/run` runs.
"""

import re
import shlex
from pathlib import Path

import pytest
import torch
from torch import nn

import blockscale.nn as bsnn
from blockscale.cli import parser

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
HUB_MODEL = '"HuggingFaceTB/SmolLM2-135M"'


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), re.S)


def save_tiny_llama(path: Path) -> None:
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)


@pytest.mark.usefixtures("one_cpu_thread")
def test_the_readme_python_runs_and_its_checkpoints_interchange(tmp_path, monkeypatch, capsys):
    script = "\n".join(blocks("python"))
    assert script.count(HUB_MODEL) == 1, f"the quickstart names {HUB_MODEL} once"
    save_tiny_llama(tmp_path / "tiny-llama")
    script = script.replace(HUB_MODEL, repr(str(tmp_path / "tiny-llama")))
    monkeypatch.chdir(tmp_path)  # save_pretrained("llama-nvfp4") writes here
    compiles = []

    def aot_eager_compile(model, **kwargs):
        compiles.append(kwargs)
        return torch_compile(model, **kwargs, backend="aot_eager")

    torch_compile = torch.compile
    monkeypatch.setattr(torch, "compile", aot_eager_compile)
    torch._dynamo.reset()
    namespace: dict = {}
    exec(compile(script, str(README), "exec"), namespace)
    torch._dynamo.reset()
    assert compiles == [{}], compiles  # plain torch.compile(model), once

    losses = re.findall(r"^(eager|compiled) loss (\S+)$", capsys.readouterr().out, re.M)
    assert [name for name, _ in losses] == ["eager", "compiled"], losses
    assert all(torch.isfinite(torch.tensor(float(value))) for _, value in losses)

    model, plain, again = namespace["model"], namespace["plain"], namespace["again"]
    initial = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "tiny-llama")
    trained = model.state_dict()
    assert any(not torch.equal(trained[k], v) for k, v in initial.state_dict().items())
    for reloaded in (plain, again):
        state = reloaded.state_dict()
        assert state.keys() == trained.keys()
        assert all(torch.equal(state[k], trained[k]) for k in trained)
        assert all(state[k].dtype == trained[k].dtype for k in trained)

    down = [type(m.model.layers[0].mlp.down_proj) for m in (model, plain, again)]
    assert down == [bsnn.Linear, nn.Linear, bsnn.Linear]
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)
        assert not torch.equal(plain(ids).logits, model(ids).logits)  # plain is not quantized


def command_lines() -> list[list[str]]:
    """Each README shell line that runs blockscale, as the argv the CLI would get."""
    found = []
    for block in blocks("bash"):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            if words[:1] == ["blockscale"]:
                found.append(words[1:])
            elif words[:1] == ["torchrun"]:
                found.append(words[words.index("blockscale") + 1 :])
    return found


def test_the_readme_commands_parse():
    lines = command_lines()
    assert {argv[0] for argv in lines} == {"train", "compare", "eval"}, lines
    for argv in lines:
        parser().parse_args(argv)  # exits with status 2 on an unknown flag or a bad value


def test_the_readme_test_command_is_what_ci_runs():
    """.ci/run runs the README's test command as written (the fast tier), then the rest tier in
    the same environment, then (README, "Tests") the torch 2.11 tests in a second one."""
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    readme_commands = [b for b in blocks("bash") if "pytest" in b]
    assert len(readme_commands) == 1, readme_commands
    assert readme_commands[0].strip() in lines, readme_commands[0]
    after = lines[lines.index(readme_commands[0].strip()) + 1]
    assert after == ".venv/bin/python -m pytest -q --tier rest", after


def test_the_readme_is_a_page_a_user_reads():
    """At most 150 lines (issue 63: it had grown to 184, 70 of them dated measurement tables,
    which live in docs/MODELS.md and docs/DISTRIBUTED.md), its Hub model ungated."""
    assert len(README.read_text().splitlines()) <= 150
    assert "meta-llama" not in HUB_MODEL
