"""Converted layers under selective activation checkpointing (`torch.utils.checkpoint` with a
policy), as torchtitan's default activation checkpointing runs every block: its policy saves
the outputs of some ops (`aten.mm` among them) and recomputes the rest, and refuses a saved
tensor that is later modified in place. The emulated GEMM on the CPU scaled its `torch.mm`
product in place, so a converted block failed at its first forward there ("Tensor cached during
selective activation checkpoint has been mutated"). The gradients must equal those of the same
block without checkpointing, bit for bit.
"""

import functools

import pytest
import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import blockscale as bs
import blockscale.nn as bsnn
from blockscale import recipes

SAVED = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


def policy(ctx, op, *args, **kwargs):
    """Save the GEMMs' outputs, recompute the rest (torchtitan's selective policy in kind)."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED else CheckpointPolicy.PREFER_RECOMPUTE


def exact(name: str) -> recipes.Recipe:
    return recipes.get(name, **({"stochastic_rounding": False} if name == "nvfp4" else {}))


def grads(fn, params, x, selective: bool):
    for p in params:
        p.grad = None
    x = x.detach().requires_grad_()
    if selective:
        context = functools.partial(create_selective_checkpoint_contexts, policy)
        out = checkpoint(fn, x, use_reentrant=False, context_fn=context)
    else:
        out = fn(x)
    out.float().square().mean().backward()
    return [out.detach(), x.grad] + [p.grad for p in params]


@pytest.mark.parametrize("name", ["nvfp4", "mxfp8"])
def test_converted_linears_under_selective_checkpointing(name):
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
    bsnn.convert(block, exact(name))
    x = torch.randn(32, 64)
    params = list(block.parameters())
    for got, expected in zip(grads(block, params, x, True), grads(block, params, x, False)):
        torch.testing.assert_close(got, expected, atol=0, rtol=0)


@pytest.mark.parametrize("name", ["nvfp4", "mxfp8"])
def test_grouped_gemm_under_selective_checkpointing(name):
    torch.manual_seed(0)
    weight = torch.randn(4, 64, 32, requires_grad=True)  # [experts, n, k]
    offs = torch.tensor([8, 8, 40, 64], dtype=torch.int32)

    def fn(x):
        return bs.grouped_mm(x, weight.transpose(-2, -1), offs, exact(name))

    x = torch.randn(64, 32)
    for got, expected in zip(grads(fn, [weight], x, True), grads(fn, [weight], x, False)):
        torch.testing.assert_close(got, expected, atol=0, rtol=0)
