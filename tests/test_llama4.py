"""transformers' Llama 4 (`Llama4ForCausalLM`, and the text model of the multimodal
`Llama4ForConditionalGeneration`) under the README's call,
`convert(model, recipe, module_filter_fn=layer_policy(model))` (issue 61).

Two things stood in the way. `Llama4TextMoe.forward` adds the routed experts into the shared
expert's output in place, which autograd refused on a converted linear's output (a view made
inside its autograd Function): the first step raised. And `Llama4TextExperts` multiplies its
3D parameters, stored [E, K, N], with `torch.bmm` (every expert sees every token, scaled at the
input: [E, T, K] @ [E, K, N]), which the grouped_mm router did not see, so `convert` left them
BF16. The router now takes that bmm as a grouped GEMM of E groups of T tokens
(nn/experts.py, "Batched matmuls"), whose bits are `blockscale.grouped_mm`'s.

A tiny random-init config on the CPU: 2 blocks, both MoE (the policy keeps the second in
BF16), 4 experts, top-1. Exact comparisons use NVFP4 without stochastic rounding; training
uses the default recipe.
"""

import copy
import logging
import warnings

import pytest
import torch
import torch.nn.functional as F

# The kernel path on CPU tensors (Triton's interpreter, wrap_triton stubbed under tracing).
from test_compile import kernel_path_on_cpu  # noqa: F401

# A stand-in for blockscale's grouped GEMM that a CPU trace takes (test_convert_experts.py).
from test_convert_experts import STAND_IN, eager_and_compiled_steps

import blockscale as bs
import blockscale.nn as bsnn
from blockscale import recipes
from blockscale.nn import experts as bs_experts

transformers = pytest.importorskip("transformers")

RECIPE = recipes.get("nvfp4", stochastic_rounding=False)
N_EXPERTS, DIM, HIDDEN = 4, 64, 64

# What users run (DESIGN.md): FP32 masters with and without BF16 autocast, and BF16 parameters.
PARAMETERS = {
    "fp32": (torch.float32, False),
    "fp32_autocast": (torch.float32, True),
    "bf16": (torch.bfloat16, False),
}


def text_config(n_experts=N_EXPERTS):
    return dict(
        vocab_size=256, hidden_size=DIM, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, num_experts_per_tok=1,
        intermediate_size=HIDDEN, intermediate_size_mlp=128, num_local_experts=n_experts,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip


def llama4(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    model = transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(**text_config()))
    return model.to(dtype)


def experts_of(model):
    return [layer.feed_forward.experts for layer in model.model.layers]


def token_ids(batch=2, seq=32):
    return torch.randint(3, 256, (batch, seq), generator=torch.Generator().manual_seed(0))


def counted_grouped_mm(monkeypatch):
    """The weights of the calls that reach blockscale's grouped_mm, in order."""
    calls = []
    real = bs_experts.grouped_mm

    def counting(input, weight_t, offs, recipe, *args, **kwargs):
        calls.append(weight_t)
        return real(input, weight_t, offs, recipe, *args, **kwargs)

    monkeypatch.setattr(bs_experts, "grouped_mm", counting)
    return calls


def experts_by_hand(x, gate_up_proj, down_proj, autocast):
    """Llama4TextExperts.forward with each bmm written as blockscale.grouped_mm on the same
    operands: E groups of T tokens, the weights as stored ([E, K, N] is grouped_mm's weight_t),
    the input in the autocast dtype under autocast (the values autocast's bmm reads)."""
    tokens = x.shape[0] // N_EXPERTS
    offs = torch.arange(1, N_EXPERTS + 1, dtype=torch.int32) * tokens
    if autocast:
        x = x.to(torch.bfloat16)
    gate, up = bs.grouped_mm(x, gate_up_proj, offs, RECIPE).chunk(2, dim=-1)
    return bs.grouped_mm(up * F.silu(gate), down_proj, offs, RECIPE)


@pytest.mark.parametrize("parameters", list(PARAMETERS))
def test_experts_bmm_is_blockscale_grouped_mm(parameters):
    """A converted Llama4TextExperts computes, forward and backward, the bits of
    blockscale.grouped_mm on the same operands, and not the unquantized bmm."""
    dtype, autocast = PARAMETERS[parameters]
    model = llama4(dtype)
    bsnn.convert(model, RECIPE, module_filter_fn=lambda m, fqn: fqn.endswith(".experts"))
    experts = experts_of(model)[0]
    assert list(experts.grouped_mms) == ["gate_up_proj", "down_proj"]
    torch.manual_seed(1)
    x = torch.randn(N_EXPERTS * 24, DIM, dtype=dtype)  # 24 tokens each: not a multiple of 16
    grad = torch.randn(N_EXPERTS * 24, DIM, dtype=dtype)
    results = []
    for run in (experts, lambda x: experts_by_hand(x, *experts.parameters(), autocast)):
        experts.zero_grad(set_to_none=True)
        x_ = x.clone().requires_grad_(True)
        with (
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast),
            warnings.catch_warnings(),
        ):
            warnings.simplefilter("error")  # "... ran unquantized"
            out = run(x_)
        out.backward(grad.to(out.dtype))
        results.append((out, x_.grad, experts.gate_up_proj.grad, experts.down_proj.grad))
    names = ("output", "grad_input", "gate_up_proj grad", "down_proj grad")
    for name, got, want in zip(names, *results):
        assert got.dtype == want.dtype and torch.equal(got, want), name
    assert results[0][0].dtype == (torch.bfloat16 if autocast else dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        unquantized = transformers.models.llama4.modeling_llama4.Llama4TextExperts.forward(
            experts, x
        )
    assert not torch.equal(results[0][0], unquantized)


def test_readme_call_quantizes_the_experts_of_the_quantized_blocks(caplog, monkeypatch):
    """convert with layer_policy routes every block's experts: the quantized block's to
    GroupedMM(nvfp4), the BF16 tail's unquantized (their own bmm). Only the first block's two
    GEMMs reach blockscale's grouped_mm, each on the parameter as stored, E groups of T =
    every token, and gives blockscale.grouped_mm's bits on the operands it got."""
    model = llama4()
    params = dict(model.named_parameters())
    with caplog.at_level(logging.INFO, logger="blockscale"):
        bsnn.convert(model, RECIPE, module_filter_fn=bsnn.layer_policy(model))
    assert "and 2 of 4 expert weights to recipe nvfp4" in caplog.text
    assert "takes no experts_implementation" not in caplog.text
    head, tail = experts_of(model)
    assert type(head).__name__ == "BlockscaleLlama4TextExperts"
    assert {name: g.recipe.name for name, g in head.grouped_mms.items()} == {
        "gate_up_proj": "nvfp4",
        "down_proj": "nvfp4",
    }
    assert {g.recipe.name for g in tail.grouped_mms.values()} == {"bf16"}
    assert dict(model.named_parameters()) == params
    calls = counted_grouped_mm(monkeypatch)
    captured = []
    for g in head.grouped_mms.values():
        g.register_forward_hook(lambda m, args, out: captured.append((args, out)))
    ids = token_ids()
    model(ids)
    assert [w is p for w, p in zip(calls, (head.gate_up_proj, head.down_proj))] == [True, True]
    assert len(captured) == 2
    tokens = ids.numel()
    for (input, weight_t, offs), out in captured:
        assert input.shape[0] == N_EXPERTS * tokens
        assert torch.equal(offs, torch.arange(1, N_EXPERTS + 1, dtype=torch.int32) * tokens)
        assert torch.equal(out, bs.grouped_mm(input, weight_t, offs, RECIPE))


@pytest.mark.parametrize("parameters", list(PARAMETERS))
def test_readme_call_trains_with_adamw(parameters, monkeypatch):
    """The README's call, then AdamW steps: the first one used to raise (the shared expert's
    output changed in place). Each step's forward sends the quantized block's two expert
    GEMMs to blockscale, and the loss falls."""
    dtype, autocast = PARAMETERS[parameters]
    model = llama4(dtype)
    bsnn.convert(model, recipes.get("nvfp4"), module_filter_fn=bsnn.layer_policy(model))
    calls = counted_grouped_mm(monkeypatch)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = token_ids(4)
    losses = []
    for _ in range(6):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert len(calls) == 12  # gate_up and down of block 0, each step
    head = experts_of(model)[0]
    assert head.gate_up_proj.grad.abs().sum() > 0 and head.down_proj.grad.abs().sum() > 0
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0] - 0.05, losses


@pytest.mark.parametrize("parameters", list(PARAMETERS))
def test_compiled_readme_call_equals_eager(parameters, monkeypatch):
    """torch.compile(fullgraph=True, aot_eager) of the converted model gives eager's losses
    and parameters over two SGD steps, bit for bit, with the experts' GEMMs sent to blockscale
    in the trace as eagerly. A stand-in op takes blockscale's grouped GEMM's place (the CPU
    reference cannot be traced; test_convert_experts.py's `_stand_in_op`), counting the calls
    that run; the converted linears are blockscale's, compiled (the shared expert's in-place
    add included). Attention is transformers' eager one (test_convert_experts.py says why)."""
    dtype, autocast = PARAMETERS[parameters]

    def stand_in(input, weight_t, offs, recipe, out_dtype=None, **weight_cache):
        assert out_dtype is None
        # under autocast the router hands over the BF16 input beside the FP32 master, which
        # blockscale quantizes each from its own dtype; the stand-in's GEMM takes one dtype
        return STAND_IN(input, weight_t.to(input.dtype), offs)

    monkeypatch.setattr(bs_experts, "grouped_mm", stand_in)
    torch._dynamo.reset()
    model = llama4(dtype)
    model.config._attn_implementation = "eager"
    unconverted = copy.deepcopy(model)
    bsnn.convert(model, RECIPE, module_filter_fn=bsnn.layer_policy(model))
    twin = copy.deepcopy(model)
    ids = token_ids()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")

    def loss_of(run):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return run(ids, labels=ids).loss

    losses, calls = eager_and_compiled_steps(model, twin, compiled, loss_of)
    assert calls["eager"] == {"forward": 2, "backward": 2}  # gate_up and down of block 0
    assert calls["compiled"] == calls["eager"]
    assert all(map(torch.equal, losses["compiled"], losses["eager"])), losses
    differ = [
        n for (n, p), q in zip(model.named_parameters(), twin.parameters()) if not torch.equal(p, q)
    ]
    assert not differ, differ
    assert not torch.equal(losses["eager"][0], loss_of(unconverted).detach())
    torch._dynamo.reset()


@pytest.mark.usefixtures("kernel_path_on_cpu")
def test_kernel_path_compiled_experts_equal_eager():
    """blockscale's own grouped GEMM on the bmm route, compiled: the CUDA code path (kernels
    that read offs on the device), run in Triton's interpreter. A converted MoE block
    (experts only: the interpreter takes seconds a launch) with fullgraph=True gives eager's
    output and gradients bit for bit."""
    torch.manual_seed(0)
    config = transformers.Llama4TextConfig(**text_config(n_experts=2))
    block = transformers.models.llama4.modeling_llama4.Llama4TextMoe(config)
    for weight in (block.experts.gate_up_proj, block.experts.down_proj):
        torch.nn.init.normal_(weight, std=0.1)
    unconverted = copy.deepcopy(block)
    bsnn.convert(block, RECIPE, module_filter_fn=lambda m, fqn: fqn == "experts")
    assert list(block.experts.grouped_mms) == ["gate_up_proj", "down_proj"]
    x = torch.randn(1, 16, DIM)
    results = []
    for run in (block, torch.compile(block, fullgraph=True, backend="aot_eager")):
        block.zero_grad(set_to_none=True)
        out, _ = run(x)
        out.square().sum().backward()
        results.append([out, *(p.grad for p in block.parameters())])
    names = ["output", *(name for name, _ in block.named_parameters())]
    for name, eager, compiled in zip(names, *results):
        assert torch.equal(compiled, eager), name
    assert not torch.equal(unconverted(x)[0], results[0][0])


def test_multimodal_text_model_converts_and_trains():
    """The text model of Llama4ForConditionalGeneration is Llama4ForCausalLM's: the README's
    call routes its quantized block's experts, and AdamW steps on text run."""
    vision = dict(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        image_size=32, patch_size=16, vision_output_dim=64, projector_input_dim=64,
        projector_output_dim=64,
    )  # fmt: skip
    config = transformers.Llama4Config(
        text_config=text_config(), vision_config=vision, image_token_index=255
    )
    torch.manual_seed(0)
    model = transformers.Llama4ForConditionalGeneration(config)
    bsnn.convert(model, recipes.get("nvfp4"), module_filter_fn=bsnn.layer_policy(model))
    head, tail = (layer.feed_forward.experts for layer in model.language_model.model.layers)
    assert {g.recipe.name for g in head.grouped_mms.values()} == {"nvfp4"}
    assert {g.recipe.name for g in tail.grouped_mms.values()} == {"bf16"}
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = token_ids()
    losses = []
    for _ in range(4):
        optimizer.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert head.gate_up_proj.grad.abs().sum() > 0
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
