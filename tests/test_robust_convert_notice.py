"""convert without a module_filter_fn quantizes the LM head, which the paper keeps in BF16;
it did so without a word (issue 18). Now one WARNING line names the layer and the way to keep
it in BF16, found as layer_policy finds the head; with a filter, the choice is the caller's
and nothing is said."""

import logging

import pytest
import torch
from torch import nn

import blockscale.nn as bsnn
from blockscale import recipes
from blockscale.models import build_model, model_config

LOGGER = "blockscale.nn.convert"


def tiny(**overrides):
    torch.manual_seed(0)
    return build_model(model_config("tiny", seq_len=32, **overrides))


def warnings_logged(caplog, convert):
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        convert()
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("name", ["nvfp4", "mxfp8"])
def test_convert_without_a_filter_says_the_lm_head_is_quantized(caplog, name):
    model = tiny()
    messages = warnings_logged(caplog, lambda: bsnn.convert(model, recipes.get(name)))
    assert messages == [
        f"lm_head is quantized to {name}: it looks like an LM head (256 outputs, an embedding's "
        "vocabulary); convert(model, recipe, module_filter_fn=layer_policy(model)) keeps it "
        "in BF16"
    ]
    assert isinstance(model.lm_head, bsnn.Linear)


def test_the_head_is_found_by_its_vocabulary_not_its_name_and_only_outside_the_blocks(caplog):
    """w13 (2 x ffn_dim = 256) is as wide as the vocabulary inside a block: not a head; the
    head itself is found under another name, as layer_policy finds it."""
    model = tiny(ffn_dim=128)
    model.out_proj = model.lm_head
    del model.lm_head
    messages = warnings_logged(caplog, lambda: bsnn.convert(model, recipes.get("nvfp4")))
    assert len(messages) == 1 and messages[0].startswith("out_proj is quantized to nvfp4")
    assert isinstance(model.layers[0].mlp.w13, bsnn.Linear)


@pytest.mark.parametrize(
    "module_filter_fn",
    [bsnn.layer_policy, lambda model: lambda module, fqn: True],
    ids=["layer_policy", "convert_everything"],
)
def test_no_notice_with_a_filter(caplog, module_filter_fn):
    model = tiny()
    policy = module_filter_fn(model)
    messages = warnings_logged(
        caplog, lambda: bsnn.convert(model, recipes.get("nvfp4"), module_filter_fn=policy)
    )
    assert messages == []


def test_no_notice_when_nothing_is_quantized_or_there_is_no_vocabulary(caplog):
    messages = warnings_logged(caplog, lambda: bsnn.convert(tiny(), recipes.get("bf16")))
    assert messages == []
    mlp = nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 64))  # no embedding: no head
    assert warnings_logged(caplog, lambda: bsnn.convert(mlp, recipes.get("nvfp4"))) == []
