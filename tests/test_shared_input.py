"""Layers that read the same input tensor quantize it once (ops/linear.py, "Shared input"):
the q/k/v projections and gate/up of a transformer block. Sharing must give the bits of
separate quantizations, forward and backward, keep one saved copy instead of three, and
never share what it must not: a modified input, another config, stochastic rounding."""

from __future__ import annotations

import dataclasses
import importlib

import numpy as np
import pytest
import torch
from torch import nn

import blockscale as bs
import blockscale.nn as bsnn
from blockscale import recipes
from blockscale.recipes import Rounding

ops_linear = importlib.import_module("blockscale.ops.linear")  # the module, not ops.linear()

RECIPE = recipes.get("nvfp4", stochastic_rounding=False)
DIM = 64


class QKV(nn.Module):
    """Three projections of one input, as an attention block calls them."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(DIM, DIM, bias=False) for _ in range(3))

    def forward(self, x):
        return self.q(x) * self.k(x) + self.v(x)


@pytest.fixture
def count(monkeypatch):
    """The input quantizations of forwards (calls of quantize_rows_and_tokens from _Linear's
    forward path; the backward's grad_output quantizations are not counted)."""
    calls = []
    original = ops_linear.quantize_rows_and_tokens

    def counted(x, row, tokens, *args, **kwargs):
        if not kwargs.get("tokens_dq"):  # the backward asks for the token copy's `_dq`
            calls.append(tuple(x.shape))
        return original(x, row, tokens, *args, **kwargs)

    monkeypatch.setattr(ops_linear, "quantize_rows_and_tokens", counted)
    return calls


def step(model, x):
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    out = model(x)
    out.square().sum().backward()
    return out, x.grad, [p.grad for p in model.parameters()]


def converted(recipe=RECIPE):
    torch.manual_seed(0)
    return bsnn.convert(QKV(), recipe)


def test_three_projections_quantize_their_input_once_with_the_same_bits(count, monkeypatch):
    x = torch.randn(48, DIM)
    model = converted()
    shared = step(model, x)
    assert len(count) == 1
    count.clear()
    monkeypatch.setattr(ops_linear, "SHARE_INPUT_QUANTIZATION", False)
    separate = step(model, x)
    assert len(count) == 3
    for name, a, b in zip(("output", "grad_input"), shared[:2], separate[:2], strict=True):
        assert torch.equal(a, b), name
    for a, b in zip(shared[2], separate[2], strict=True):
        assert torch.equal(a, b)


def saved_storages(model, x) -> int:
    storages = set()

    def pack(t):
        storages.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x.detach().requires_grad_(True))
    return len(storages)


def test_the_three_layers_save_one_copy_of_the_input(monkeypatch):
    x = torch.randn(48, DIM)
    model = converted()
    shared = saved_storages(model, x)
    monkeypatch.setattr(ops_linear, "SHARE_INPUT_QUANTIZATION", False)
    separate = saved_storages(model, x)
    # each layer saves its weight's copy and the input's token copy (codes, scales, amax);
    # sharing saves the input's once
    assert separate - shared >= 2 * 2, (shared, separate)


class Probe(QKV):
    """Within one forward: q and k on x, an in-place change of x, v on it, q on a copy."""

    def forward(self, x):
        self.q(x)
        self.k(x)
        x.mul_(2)  # in place: a new version of the same tensor
        self.v(x)
        return self.q(x.clone())  # equal values, another tensor


def test_a_modified_input_or_another_tensor_is_quantized_again(count):
    torch.manual_seed(0)
    model = bsnn.convert(Probe(), RECIPE)
    with torch.no_grad():
        model(torch.randn(48, DIM))
    assert len(count) == 3


def test_calls_outside_one_forward_do_not_share(count):
    """Issue 60, case 2: only the layers of one forward of the converted model share an input
    (ops/linear.py, "Shared input"). Separate calls do not, whatever happened to the tensor's
    memory between them, which no version counter shows: a numpy buffer refilled with the next
    batch, a write through `.data`. On the old code the second call returned the first's
    output."""
    torch.manual_seed(0)
    layer = bsnn.convert(nn.Linear(DIM, DIM), RECIPE)  # a bare layer: the converted one
    buffer = np.random.default_rng(0).standard_normal((48, DIM)).astype(np.float32)
    x = torch.from_numpy(buffer)
    with torch.no_grad():
        layer(x)
        buffer[:] = np.random.default_rng(1).standard_normal((48, DIM))  # the next batch
        assert torch.equal(layer(x), layer(x.clone()))
        x.data.mul_(-2)
        assert torch.equal(layer(x), layer(x.clone()))
        # the functional form, and a converted model's layers called one by one
        w = torch.randn(DIM, DIM)
        first = bs.linear(x, w, None, RECIPE)
        x.data.mul_(-2)
        assert not torch.equal(bs.linear(x, w, None, RECIPE), first)
        assert torch.equal(bs.linear(x, w, None, RECIPE), bs.linear(x.clone(), w, None, RECIPE))
        model = converted()
        count.clear()
        model.q(x), model.k(x)
    assert len(count) == 2


def test_inference_then_training_on_one_input():
    """Issue 60, case 8: a forward under inference_mode, then a training forward on the same
    input. Its copies are inference tensors, which the training forward cannot save for its
    backward; on the old code the training forward reused them and raised. Now it runs, with
    the bits of a fresh input."""
    model, fresh = converted(), converted()
    x = torch.randn(48, DIM)
    with torch.inference_mode():
        model(x)
    for m, input in ((model, x), (fresh, x.clone())):
        out = m(input)  # the very same tensor, as a user passes it
        out.square().sum().backward()
    assert torch.equal(out, model(x))
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


def test_inference_mode_runs_and_does_not_share(count):
    """Inference tensors have no version counter, so an in-place change could not be told."""
    model = converted()
    with torch.inference_mode():
        x = torch.randn(48, DIM)
        first = model.q(x)
        x.mul_(2)
        second = model.k(x)
    assert len(count) == 2
    with torch.no_grad():
        assert torch.equal(second, model.k(x.clone()))
        assert torch.equal(first, model.q(x.clone() / 2))


def test_another_recipe_or_stochastic_rounding_is_not_shared(count):
    x = torch.randn(48, DIM)
    with torch.no_grad():
        torch.manual_seed(0)
        a, b = (
            bsnn.convert(nn.Linear(DIM, DIM), RECIPE),
            bsnn.convert(nn.Linear(DIM, DIM), recipes.get("mxfp8")),
        )
        a(x), b(x)
        assert len(count) == 2
        rec = RECIPE
        sr_input = dataclasses.replace(rec.output.input, rounding=Rounding.STOCHASTIC)
        sr = dataclasses.replace(rec, output=dataclasses.replace(rec.output, input=sr_input))
        c, d = bsnn.convert(nn.Linear(DIM, DIM), sr), bsnn.convert(nn.Linear(DIM, DIM), sr)
        c(x), d(x)
    assert len(count) == 4


def test_backward_releases_the_kept_copies():
    model = converted()
    x = torch.randn(48, DIM, requires_grad=True)
    model(x).sum().backward()
    assert ops_linear._SHARED.value is None


def test_hf_llama_block_quantizes_four_inputs_per_layer(count, monkeypatch):
    """A converted transformers Llama: q/k/v share one quantization and gate/up another, so a
    forward quantizes 4 inputs per layer (attention input, o_proj's, MLP input, down_proj's)
    instead of 7; a training step gives the same losses and gradients bit for bit."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=DIM, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    bsnn.convert(model, RECIPE, module_filter_fn=lambda m, fqn: "layers" in fqn)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))

    def train_step():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    loss, grads = train_step()
    assert len(count) == 4 * cfg.num_hidden_layers
    monkeypatch.setattr(ops_linear, "SHARE_INPUT_QUANTIZATION", False)
    count.clear()
    loss_separate, grads_separate = train_step()
    assert len(count) == 7 * cfg.num_hidden_layers
    assert torch.equal(loss, loss_separate)
    for a, b in zip(grads, grads_separate, strict=True):
        assert torch.equal(a, b)
