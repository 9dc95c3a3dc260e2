"""convert(), the layer policy and the precision schedule on a small Llama-like model."""

import logging
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import blockscale.nn as bsnn
from blockscale import recipes
from blockscale.models import Transformer, model_config

N_LAYERS = 8  # 15% of 8 blocks rounds to 1: layers.7 stays in BF16
LINEARS_PER_BLOCK = 4  # wqkv, wo, w13, w2


def tiny_model(seed=0, **overrides):
    torch.manual_seed(seed)
    return Transformer(model_config("tiny", n_layers=N_LAYERS, seq_len=32, **overrides))


def converted_names(model):
    return {name for name, m in model.named_modules() if isinstance(m, bsnn.Linear)}


def test_convert_all_counts_and_logs(caplog):
    model = tiny_model()
    params_before = {n: p for n, p in model.named_parameters()}
    with caplog.at_level(logging.INFO, logger="blockscale"):
        out = bsnn.convert(model, recipes.get("nvfp4"))
    assert out is model
    total = N_LAYERS * LINEARS_PER_BLOCK + 1  # + lm_head
    assert len(converted_names(model)) == total
    assert f"converted {total} of {total} linears to recipe nvfp4" in caplog.text
    # The Parameters are shared, not copied: optimizers built before convert still work.
    assert all(p is params_before[n] for n, p in model.named_parameters())


def test_layer_policy_keeps_tail_head_and_embeddings_bf16(caplog):
    model = tiny_model()
    with caplog.at_level(logging.INFO, logger="blockscale"):
        policy = bsnn.layer_policy(model)
        bsnn.convert(model, recipes.get("nvfp4"), module_filter_fn=policy)
    names = converted_names(model)
    assert len(names) == (N_LAYERS - 1) * LINEARS_PER_BLOCK
    assert not any(n.startswith("layers.7.") for n in names)
    assert "lm_head" not in names and "layers.0.attn.wqkv" in names
    assert isinstance(model.tok_embeddings, nn.Embedding)
    total = N_LAYERS * LINEARS_PER_BLOCK + 1
    assert f"converted {len(names)} of {total} linears" in caplog.text
    assert "kept in BF16: [7]" in caplog.text


def test_layer_policy_is_configurable():
    model = tiny_model()
    policy = bsnn.layer_policy(model, bf16_tail_fraction=0.25, bf16_head_blocks=1, bf16_names=())
    bsnn.convert(model, recipes.get("mxfp8"), module_filter_fn=policy)
    blocks = {int(n.split(".")[1]) for n in converted_names(model) if n.startswith("layers.")}
    assert blocks == {1, 2, 3, 4, 5}
    # With no name rules the head is still recognised by its vocabulary-sized output.
    assert "lm_head" not in converted_names(model)
    nothing_kept = bsnn.layer_policy(tiny_model(), bf16_tail_fraction=0.0, bf16_names=())
    assert nothing_kept(nn.Linear(64, 64), "layers.7.mlp.w2")
    with pytest.raises(ValueError, match="bf16_tail_fraction=1.5 is not in"):
        bsnn.layer_policy(model, bf16_tail_fraction=1.5)


def test_layer_policy_converts_a_block_linear_as_wide_as_the_vocabulary():
    """The LM head is recognised by a vocabulary-sized output only outside the blocks: an MLP
    whose width happens to equal the vocabulary (w13: 2 x ffn_dim = 256 = vocab) is converted."""
    model = tiny_model(ffn_dim=128)
    bsnn.convert(model, recipes.get("nvfp4"), module_filter_fn=bsnn.layer_policy(model))
    names = converted_names(model)
    assert "layers.0.mlp.w13" in names and "layers.0.mlp.w2" in names
    assert "lm_head" not in names


def test_layer_policy_router_and_named_blocks():
    class MoEBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.router = nn.Linear(64, 8, bias=False)
            self.gate = nn.Linear(64, 8, bias=False)
            self.up = nn.Linear(64, 128)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.decoder = nn.ModuleList(MoEBlock() for _ in range(10))
            self.extras = nn.ModuleList([nn.Linear(64, 64), nn.ReLU()])

    net = Net()
    policy = bsnn.layer_policy(net)
    assert policy.blocks == "decoder" and policy.bf16_blocks == {8, 9}
    assert not policy(net.decoder[0].router, "decoder.0.router")
    assert not policy(net.decoder[0].gate, "decoder.0.gate")
    assert policy(net.decoder[0].up, "decoder.0.up")
    assert not policy(net.decoder[9].up, "decoder.9.up")
    with pytest.raises(ValueError, match="blocks='nope' names no nn.ModuleList"):
        bsnn.layer_policy(net, blocks="nope")


class ConfiguredLinear(nn.Linear):
    """A subclass that adds only construction (as torchtitan's `Linear` adds a config)."""

    def __init__(self, in_features, out_features):
        super().__init__(in_features, out_features, bias=False)


class ScaledBiasLinear(nn.Linear):
    """A subclass with a forward of its own: not a plain linear."""

    def forward(self, input):
        return F.linear(input, self.weight, self.bias / 2)


def test_convert_swaps_subclasses_that_keep_linears_forward_and_only_those(caplog):
    """A subclass that keeps nn.Linear's forward computes F.linear: it is swapped (sharing its
    Parameters) and computes what a converted nn.Linear computes on the same weights. One with
    its own forward, and MultiheadAttention's out_proj (read by weight, never called), stay."""
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {
            "plain": ConfiguredLinear(64, 64),
            "own_forward": ScaledBiasLinear(64, 64),
            "attention": nn.MultiheadAttention(64, 4, batch_first=True),
        }
    )
    weight = model["plain"].weight
    reference = nn.Linear(64, 64, bias=False)
    reference.weight = weight
    with caplog.at_level(logging.INFO, logger="blockscale"):
        bsnn.convert(model, recipes.get("nvfp4"))
    assert isinstance(model["plain"], bsnn.Linear) and model["plain"].weight is weight
    assert type(model["own_forward"]) is ScaledBiasLinear
    out_proj = model["attention"].out_proj
    assert type(out_proj) is nn.modules.linear.NonDynamicallyQuantizableLinear
    assert "converted 1 of 1 linears" in caplog.text
    x = torch.randn(8, 64)
    expected = bsnn.convert(nn.Sequential(reference), recipes.get("nvfp4"))(x)
    assert torch.equal(model["plain"](x), expected)


@pytest.mark.parametrize("first", [0, 4])
def test_layer_policy_finds_blocks_in_a_module_dict(first):
    """torchtitan keeps its blocks in an nn.ModuleDict keyed "0", "1", ... (a pipeline stage's
    keys start past 0): found as the block list, by default and by `blocks="layers"`, and its
    tail kept in BF16 by key."""
    keys = [str(first + i) for i in range(8)]
    model = nn.ModuleDict(
        {
            "tok_embeddings": nn.Embedding(256, 64),
            "layers": nn.ModuleDict({k: nn.Sequential(nn.Linear(64, 64)) for k in keys}),
            "output": nn.Linear(64, 256),
        }
    )
    last = keys[-1]
    for policy in (bsnn.layer_policy(model), bsnn.layer_policy(model, blocks="layers")):
        assert policy.blocks == "layers" and policy.bf16_blocks == {int(last)}
        assert policy(model["layers"][keys[0]][0], f"layers.{keys[0]}.0")
        assert not policy(model["layers"][last][0], f"layers.{last}.0")
        assert not policy(model["output"], "output")
    bsnn.convert(model, recipes.get("nvfp4"), bsnn.layer_policy(model))
    assert converted_names(model) == {f"layers.{k}.0" for k in keys[:-1]}
    with pytest.raises(ValueError, match="blocks='output' names no nn.ModuleList"):
        bsnn.layer_policy(model, blocks="output")


def test_convert_skips_layers_that_do_not_fit_and_says_so(caplog):
    model = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 40), nn.Linear(40, 64))
    with caplog.at_level(logging.INFO, logger="blockscale"):
        bsnn.convert(model, recipes.get("nvfp4"))
    assert [type(m) for m in model] == [bsnn.Linear, nn.ReLU, nn.Linear, nn.Linear]
    assert "2 stays in high precision: out_features=40 is not a multiple of 16" in caplog.text
    assert "3 stays in high precision: in_features=40 is not a multiple of 16" in caplog.text
    assert "converted 1 of 3 linears" in caplog.text


def test_convert_module_filter_fn_sees_module_and_fqn():
    model = tiny_model()
    seen = []

    def only_mlp(module, fqn):
        seen.append((type(module), fqn))
        return ".mlp." in fqn

    bsnn.convert(model, recipes.get("nvfp4"), module_filter_fn=only_mlp)
    assert all(t is nn.Linear for t, _ in seen) and len(seen) == N_LAYERS * 4 + 1
    assert converted_names(model) == {
        f"layers.{i}.mlp.{w}" for i in range(N_LAYERS) for w in ("w13", "w2")
    }


def test_convert_is_post_order_and_handles_a_bare_linear():
    lin = nn.Linear(32, 32)
    out = bsnn.convert(lin, recipes.get("mxfp8"))
    assert isinstance(out, bsnn.Linear) and out.weight is lin.weight
    shared = nn.Linear(32, 32)
    seq = nn.Sequential(shared, nn.Sequential(shared))  # one module registered twice
    bsnn.convert(seq, recipes.get("mxfp8"))
    assert seq[0] is seq[1][0] and isinstance(seq[0], bsnn.Linear)


def test_a_linear_twice_in_one_parent_is_one_converted_linear_at_both_names(caplog):
    """nn.Sequential(l, act, l) left index 2 a plain nn.Linear (issue 60, case 4):
    named_children() yields a module registered twice in one parent only once."""
    torch.manual_seed(0)
    shared = nn.Linear(32, 32)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    x = torch.randn(4, 32)
    with caplog.at_level(logging.INFO, logger="blockscale"):
        bsnn.convert(model, recipes.get("nvfp4"))
    assert isinstance(model[0], bsnn.Linear) and model[2] is model[0]
    assert model[0].weight is shared.weight and model[0].bias is shared.bias
    assert "converted 1 of 1 linears" in caplog.text  # one module, counted once
    assert bsnn.set_precision(model, False) == 1
    assert torch.equal(model(x), shared(F.relu(shared(x))))


def test_a_filter_must_answer_the_same_at_every_name_of_a_shared_linear():
    """The filter was asked at the first name only: False at the second name was overruled
    without a word (and before case 4's fix, index 2 stayed plain whatever it said)."""
    shared = nn.Linear(32, 32)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    with pytest.raises(ValueError, match=r"registered under 2 names, at 0 but keeps it in high "):
        bsnn.convert(model, recipes.get("nvfp4"), lambda module, fqn: fqn != "2")
    assert type(model[0]) is nn.Linear and model[2] is model[0]  # unchanged
    bsnn.convert(model, recipes.get("nvfp4"), lambda module, fqn: False)
    assert type(model[0]) is nn.Linear and model[2] is model[0]
    bsnn.convert(model, recipes.get("nvfp4"), lambda module, fqn: True)
    assert isinstance(model[0], bsnn.Linear) and model[2] is model[0]


def test_layer_policy_with_a_linear_shared_by_every_block_refuses_to_half_convert():
    """layer_policy keeps the last block in BF16 and quantizes the others: one linear in all
    of them cannot be both, so convert names the disagreement instead of picking."""
    shared = nn.Linear(32, 32)
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), shared) for _ in range(4))
    model = nn.ModuleDict({"layers": blocks})
    with pytest.raises(ValueError, match=r"at layers.0.1, layers.1.1, layers.2.1 but keeps it"):
        bsnn.convert(model, recipes.get("nvfp4"), bsnn.layer_policy(model))
    assert not converted_names(model)


def test_a_shared_linear_that_is_an_lm_head_at_its_second_name_gets_the_notice(caplog):
    """The LM-head notice read the first name only: inside a block, a vocabulary-wide output
    is no head, so a head that is also registered in a block was quantized without a word."""
    vocab = 64
    head = nn.Linear(32, vocab)
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32)) for _ in range(2))
    blocks[1].append(head)
    model = nn.ModuleDict({"embed": nn.Embedding(vocab, 32), "layers": blocks, "lm_head": head})
    with caplog.at_level(logging.WARNING, logger="blockscale"):
        bsnn.convert(model, recipes.get("nvfp4"))
    assert model["lm_head"] is model["layers"][1][1] and isinstance(model["lm_head"], bsnn.Linear)
    assert "lm_head is quantized to nvfp4: it looks like an LM head" in caplog.text


def test_forward_backward_and_state_dict_round_trip():
    model = tiny_model()
    reference = tiny_model()
    reference.load_state_dict(model.state_dict())
    bsnn.convert(model, recipes.get("nvfp4"), module_filter_fn=bsnn.layer_policy(model))
    assert model.state_dict().keys() == reference.state_dict().keys()
    tokens = torch.randint(0, 256, (2, 32))
    logits = model(tokens)
    loss = F.cross_entropy(logits.flatten(0, 1), tokens.flatten())
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    ref_logits = reference(tokens)
    rel = (logits - ref_logits).norm() / ref_logits.norm()
    assert 0 < rel < 0.3, rel  # quantized, but close to the high-precision model

    # Round trip: converted -> plain, plain -> converted, bit for bit.
    fresh = tiny_model(seed=1)
    fresh.load_state_dict(model.state_dict())
    assert torch.equal(fresh.lm_head.weight, model.lm_head.weight)
    back = tiny_model(seed=2)
    bsnn.convert(back, recipes.get("nvfp4"), module_filter_fn=bsnn.layer_policy(back))
    back.load_state_dict(fresh.state_dict())
    assert torch.equal(back(tokens), model(tokens))


def test_set_precision_and_schedule():
    model = tiny_model()
    bsnn.convert(model, recipes.get("nvfp4"))
    reference = tiny_model()
    tokens = torch.randint(0, 256, (2, 32))
    assert not torch.equal(model(tokens), reference(tokens))
    assert bsnn.set_precision(model, False) == N_LAYERS * LINEARS_PER_BLOCK + 1
    assert torch.equal(model(tokens), reference(tokens))
    assert "quantize_enabled=False" in repr(model.lm_head)

    schedule = bsnn.PrecisionSchedule(total_steps=100, bf16_final_fraction=0.18)
    assert schedule.switch_step == 82
    assert schedule.apply(model, 81) and model.layers[0].mlp.w2.quantize_enabled
    assert not schedule.apply(model, 82) and not model.layers[0].mlp.w2.quantize_enabled
    with pytest.raises(ValueError, match="bf16_final_fraction=2 is not in"):
        bsnn.PrecisionSchedule(10, 2)


@pytest.mark.parametrize("enabled", ["False", None, 0, torch.tensor(False)])
def test_set_precision_takes_only_a_bool(enabled):
    """set_precision(model, "False") turned quantization on (issue 60, case 5)."""
    model = bsnn.convert(nn.Sequential(nn.Linear(32, 32)), recipes.get("nvfp4"))
    bsnn.set_precision(model, False)
    message = f"enabled={enabled!r} is a {type(enabled).__name__}, not a bool"
    with pytest.raises(TypeError, match=re.escape(message)):
        bsnn.set_precision(model, enabled)
    assert model[0].quantize_enabled is False  # nothing switched
    np = pytest.importorskip("numpy")
    assert bsnn.set_precision(model, np.True_) == 1 and model[0].quantize_enabled is True


def test_a_linear_bias_switch_must_be_a_bool():
    """`bs.nn.Linear(..., bias="False")` made a bias (issue 60, case 5)."""
    with pytest.raises(TypeError, match="bias='False' is a str, not a bool"):
        bsnn.Linear(64, 32, bias="False", recipe=recipes.get("nvfp4"))


def test_linear_module_basics():
    lin = bsnn.Linear(64, 32, recipe=recipes.get("nvfp4"))
    assert isinstance(lin, nn.Linear) and lin.weight.shape == (32, 64)
    assert "recipe=nvfp4" in repr(lin)
    y = lin(torch.randn(3, 5, 64))
    assert y.shape == (3, 5, 32)
    with pytest.raises(TypeError, match="recipe must be a blockscale Recipe"):
        bsnn.Linear(64, 32, recipe="nvfp4")
