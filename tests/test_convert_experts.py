"""convert() on mixture-of-experts models, reached from outside through their grouped_mm calls:
an experts module with the names and call of `models/moe.py`'s (and transformers'), and tiny
random-init transformers 5.x MoE models (Qwen3-MoE, OLMoE, Mixtral) when transformers is
installed. Exact comparisons use NVFP4 without stochastic rounding.

Why the relative-error bands below hold. NVFP4 quantization of Gaussian data has a relative RMS
error of about 0.095 with 1x16 blocks and 0.11 with 16x16 weight tiles
(`test_nvfp4_operand_error_behind_the_bands` measures them), so one GEMM with both operands
quantized is off by about sqrt(0.095^2 + 0.11^2) = 0.15 (the two errors are independent). An
expert multiplies two such outputs (SiLU(gate) * up: 0.15 * sqrt(2) = 0.21), then quantizes that
product and the down weight for the second GEMM: sqrt(0.21^2 + 0.15^2) = 0.26, measured
0.23-0.26 over three seeds and three models. The band is 0.15-0.35. In the logits the experts
are one term of a residual stream that the embeddings dominate at random init (measured
0.013-0.034); an unquantized path gives exactly 0 (the set_precision test), so the band there is
1e-3 (quantization happened) to 0.1 (and nothing else did).
"""

import copy
import logging
import warnings

import pytest
import torch
import torch.nn.functional as F

# The kernel path on CPU tensors (Triton's interpreter, wrap_triton stubbed under tracing).
from test_compile import kernel_path_on_cpu  # noqa: F401
from torch import nn

import blockscale as bs
import blockscale.nn as bsnn
from blockscale import recipes
from blockscale.models import build_model, model_config
from blockscale.nn import experts as bs_experts

RECIPE = recipes.get("nvfp4", stochastic_rounding=False)
N_EXPERTS, DIM, HIDDEN = 4, 64, 64


def rel_error(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


class Experts(nn.Module):
    """The parameters and call of models/moe.py's Experts and transformers' experts classes."""

    def __init__(self, n_experts=N_EXPERTS, dim=DIM, hidden_dim=HIDDEN, dtype=None, cast=None):
        super().__init__()
        gate_up_proj = torch.randn(n_experts, 2 * hidden_dim, dim, dtype=dtype) * dim**-0.5
        self.gate_up_proj = nn.Parameter(gate_up_proj)
        self.down_proj = nn.Parameter(torch.randn(n_experts, dim, hidden_dim, dtype=dtype) * 0.1)
        self.cast = cast  # models/moe.py casts the weight views to BF16 on CUDA

    def forward(self, x_sorted, offs):
        gate_up_t = self.gate_up_proj.transpose(-2, -1)
        down_t = self.down_proj.transpose(-2, -1)
        if self.cast is not None:
            gate_up_t, down_t = gate_up_t.to(self.cast), down_t.to(self.cast)
        gate, up = F.grouped_mm(x_sorted, gate_up_t, offs=offs).chunk(2, dim=-1)
        return F.grouped_mm(F.silu(gate) * up, down_t, offs=offs)


class MoE(nn.Module):
    """A linear router beside the experts, top-1 routing sorted on the device."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(DIM, N_EXPERTS, bias=False)
        self.experts = Experts()
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x):
        expert_ids, order = self.router(x).argmax(dim=-1).sort(stable=True)
        ids = torch.arange(N_EXPERTS, dtype=expert_ids.dtype, device=x.device)
        offs = torch.searchsorted(expert_ids, ids, right=True, out_int32=True)
        out = self.experts(self.proj(x)[order], offs)
        return torch.zeros_like(out).index_copy(0, order, out)


def sorted_tokens(m=80, seed=0):
    """Tokens grouped by expert: an empty group, groups not a multiple of 16, and rows past
    offs[-1] (which must come out as zeros)."""
    torch.manual_seed(seed)
    return torch.randn(m, DIM), torch.tensor([0, 30, 47, 70], dtype=torch.int32)


def expert_mlp_by_hand(x, offs, gate_up_proj, down_proj, recipe=RECIPE):
    gate, up = bs.grouped_mm(x, gate_up_proj.transpose(-2, -1), offs, recipe).chunk(2, dim=-1)
    return bs.grouped_mm(F.silu(gate) * up, down_proj.transpose(-2, -1), offs, recipe)


def test_nvfp4_operand_error_behind_the_bands():
    x = torch.randn(4096, 64, generator=torch.Generator().manual_seed(0))
    for block, expected in (("1x16", 0.095), ("16x16", 0.11)):
        x_dq = bs.nvfp4.quantize(x, block=block).dequantize(torch.float32)
        assert rel_error(x_dq, x) == pytest.approx(expected, abs=0.01)


def test_convert_routes_experts_and_leaves_parameters_alone(caplog):
    torch.manual_seed(0)
    model = MoE()
    params = dict(model.named_parameters())
    keys = model.state_dict().keys()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # built before convert
    with caplog.at_level(logging.INFO, logger="blockscale"):
        assert bsnn.convert(model, RECIPE) is model
    experts = model.experts
    assert type(experts).__name__ == "BlockscaleExperts" and isinstance(experts, Experts)
    assert list(experts.grouped_mms) == ["gate_up_proj", "down_proj"]
    assert all(
        isinstance(g, bsnn.GroupedMM) and g.recipe is RECIPE for g in experts.grouped_mms.values()
    )
    assert dict(model.named_parameters()) == params and model.state_dict().keys() == keys
    # The router stays an nn.Linear without any filter: it feeds as many outputs as experts.
    assert type(model.router) is nn.Linear and isinstance(model.proj, bsnn.Linear)
    assert "router stays in high precision: router of the 4 experts beside it" in caplog.text
    assert "converted 1 of 2 linears and 2 of 2 expert weights to recipe nvfp4" in caplog.text
    x = torch.randn(64, DIM)
    model(x).square().sum().backward()
    optimizer.step()  # the optimizer still holds the live parameters
    assert experts.gate_up_proj.grad.abs().sum() > 0


def test_converted_experts_equal_blockscale_grouped_mm_by_hand():
    torch.manual_seed(0)
    experts = Experts()
    reference = copy.deepcopy(experts)
    bsnn.convert(experts, RECIPE)
    seen = []
    for name, g in experts.grouped_mms.items():
        g.register_forward_hook(lambda m, args, out, name=name: seen.append((name, args)))
    x, offs = sorted_tokens()
    x_by_hand = x.clone().requires_grad_(True)
    x = x.requires_grad_(True)
    out = experts(x, offs)
    by_hand = expert_mlp_by_hand(x_by_hand, offs, reference.gate_up_proj, reference.down_proj)
    assert torch.equal(out, by_hand)
    assert (out[70:] == 0).all()
    grad_output = torch.randn_like(out)
    out.backward(grad_output)
    by_hand.backward(grad_output)
    assert torch.equal(x.grad, x_by_hand.grad)
    assert torch.equal(experts.gate_up_proj.grad, reference.gate_up_proj.grad)
    assert torch.equal(experts.down_proj.grad, reference.down_proj.grad)
    # Telemetry's view: the hooks see (input, weight_t, offs), weight_t a view of the parameter.
    assert [name for name, _ in seen] == ["gate_up_proj", "down_proj"]
    assert seen[0][1][1]._base is experts.gate_up_proj and seen[0][1][2] is offs
    # Against the high-precision experts: quantized, by the amount the module docstring derives.
    # (torch._grouped_mm leaves the rows past offs[-1] unwritten.)
    assert 0.15 < rel_error(out[:70], reference(x, offs)[:70]) < 0.35


def test_weights_cast_before_the_grouped_mm_are_routed():
    """models/moe.py casts FP32 weight views to BF16 before F.grouped_mm (on CUDA): the cast
    copy is traced back to its parameter, and the FP32 parameter gets the gradient."""
    torch.manual_seed(0)
    experts = Experts(cast=torch.bfloat16)
    reference = copy.deepcopy(experts)
    bsnn.convert(experts, RECIPE)
    x, offs = sorted_tokens()
    x = x.bfloat16()
    out = experts(x, offs)
    gate_up_t = reference.gate_up_proj.transpose(-2, -1).to(torch.bfloat16)
    down_t = reference.down_proj.transpose(-2, -1).to(torch.bfloat16)
    gate, up = bs.grouped_mm(x, gate_up_t, offs, RECIPE).chunk(2, dim=-1)
    assert torch.equal(out, bs.grouped_mm(F.silu(gate) * up, down_t, offs, RECIPE))
    out.float().sum().backward()
    assert experts.down_proj.grad.dtype == torch.float32 and experts.down_proj.grad.abs().sum() > 0


def test_set_precision_gives_the_unconverted_experts_and_reconvert_sets_the_recipe():
    torch.manual_seed(0)
    model = MoE()
    reference = copy.deepcopy(model)
    bsnn.convert(model, RECIPE)
    x = torch.randn(64, DIM)
    assert not torch.equal(model(x), reference(x))
    assert bsnn.set_precision(model, False) == 1 + 2  # proj, and one GroupedMM per weight
    assert torch.equal(model(x), reference(x))
    assert "quantize_enabled=False" in repr(model.experts.grouped_mms["down_proj"])
    bf16 = bsnn.convert(copy.deepcopy(reference), recipes.get("bf16"))
    assert list(bf16.experts.grouped_mms) == ["gate_up_proj", "down_proj"]
    assert torch.equal(bf16(x), reference(x))
    bsnn.set_precision(model, True)
    mxfp8 = recipes.get("mxfp8")
    bsnn.convert(model, mxfp8)
    assert type(model.experts).__name__ == "BlockscaleExperts"  # not wrapped twice
    assert all(g.recipe is mxfp8 for g in model.experts.grouped_mms.values())
    x_sorted, offs = sorted_tokens()
    by_hand = expert_mlp_by_hand(
        x_sorted, offs, model.experts.gate_up_proj, model.experts.down_proj, mxfp8
    )
    assert torch.equal(model.experts(x_sorted, offs), by_hand)


def test_expert_weights_that_do_not_fit_the_blocks_stay_high_precision(caplog):
    experts = Experts(hidden_dim=40)  # down_proj [E, 64, 40]: K=40 is not a multiple of 16
    with caplog.at_level(logging.INFO, logger="blockscale"):
        bsnn.convert(experts, RECIPE)
    recipes = {name: m.recipe.name for name, m in experts.grouped_mms.items()}
    assert recipes == {"gate_up_proj": RECIPE.name, "down_proj": "bf16"}  # routed unquantized
    assert (
        "down_proj stays in high precision: in_features=40 is not a multiple of 16" in caplog.text
    )
    assert "converted 0 of 0 linears and 1 of 2 expert weights" in caplog.text
    x, offs = sorted_tokens()
    out = experts(x, offs)  # down_proj runs through torch._grouped_mm as the model wrote it
    gate, up = bs.grouped_mm(x, experts.gate_up_proj.transpose(-2, -1), offs, RECIPE).chunk(2, -1)
    expected = torch._grouped_mm(F.silu(gate) * up, experts.down_proj.transpose(-2, -1), offs=offs)
    assert torch.equal(out[:70], expected[:70])  # torch._grouped_mm leaves rows past offs[-1]


def test_what_is_not_an_experts_module():
    assert bs_experts.experts_weights(nn.Conv1d(16, 16, 3)) == {}
    vit_embeddings = nn.Module()
    vit_embeddings.position_embeddings = nn.Parameter(torch.zeros(1, 256, 64))
    assert bs_experts.experts_weights(vit_embeddings) == {}
    model = nn.Sequential(nn.Conv1d(16, 16, 3), vit_embeddings)
    bsnn.convert(model, RECIPE)
    assert type(model[0]) is nn.Conv1d and not hasattr(vit_embeddings, "grouped_mms")


def test_unrouted_weights_warn_and_unsupported_calls_raise():
    class LoopedDown(Experts):
        """down_proj through a per-expert loop, not grouped_mm: it cannot be routed."""

        def forward(self, x_sorted, offs):
            h = F.grouped_mm(x_sorted, self.gate_up_proj.transpose(-2, -1), offs=offs)
            h = F.silu(h[:, :HIDDEN]) * h[:, HIDDEN:]
            ends = offs.tolist()
            starts = [0, *ends[:-1]]
            return torch.cat(
                [h[s:e] @ self.down_proj[i].T for i, (s, e) in enumerate(zip(starts, ends))]
            )

    experts = bsnn.convert(LoopedDown(), RECIPE)
    x, offs = sorted_tokens()
    with pytest.warns(
        UserWarning, match=r"converted expert weights \['down_proj'\] were not consumed"
    ):
        experts(x[:70], offs)

    class WithBias(Experts):
        def forward(self, x_sorted, offs):
            bias = torch.zeros(2 * HIDDEN)
            return torch._grouped_mm(x_sorted, self.gate_up_proj.transpose(-2, -1), offs, bias)

    with pytest.raises(ValueError, match="'gate_up_proj' must be input .* no bias; .*bias=given"):
        bsnn.convert(WithBias(), RECIPE)(x, offs)
    with pytest.raises(ValueError, match=r"has no 3D expert parameters \['up_proj'\]"):
        bs_experts.route_grouped_mm(Experts(), RECIPE, ["up_proj"])


def test_module_filter_sees_experts_and_deepcopy_routes_the_copy():
    model = MoE()
    seen = []
    bsnn.convert(model, RECIPE, module_filter_fn=lambda m, fqn: seen.append(fqn) or fqn != "proj")
    assert seen == ["experts", "proj"]  # the router is decided before the filter
    copied = copy.deepcopy(model)
    calls = []
    copied.experts.grouped_mms["gate_up_proj"].register_forward_hook(lambda *a: calls.append(1))
    model.experts.grouped_mms["gate_up_proj"].register_forward_hook(lambda *a: calls.append(0))
    copied(torch.randn(64, DIM))
    assert calls == [1]
    assert copied.experts.gate_up_proj is not model.experts.gate_up_proj


def test_a_shared_experts_module_is_routed_once_and_the_filter_must_agree_at_its_names(caplog):
    """One experts module in two MoE blocks: the filter was asked at its first name only, so
    False at the second was overruled and the experts quantized there too (issue 60, case 4)."""
    net = nn.Module()
    net.a, net.b = MoE(), MoE()
    net.b.experts = net.a.experts
    with pytest.raises(ValueError, match=r"Experts, registered under 2 names, at a.experts but"):
        bsnn.convert(net, RECIPE, module_filter_fn=lambda m, fqn: fqn != "b.experts")
    assert type(net.a.experts) is Experts and not hasattr(net.a.experts, "grouped_mms")
    assert type(net.a.proj) is nn.Linear  # the model is unchanged
    with caplog.at_level(logging.INFO, logger="blockscale"):
        bsnn.convert(net, RECIPE, module_filter_fn=lambda m, fqn: True)
    assert net.b.experts is net.a.experts and type(net.a.experts).__name__ == "BlockscaleExperts"
    assert "converted 2 of 4 linears and 2 of 2 expert weights" in caplog.text  # counted once
    assert bsnn.set_precision(net, False) == 2 + 2  # the two proj, one GroupedMM per weight


def test_layer_policy_keeps_the_tail_blocks_experts_bf16(caplog):
    net = nn.Module()
    net.layers = nn.ModuleList(MoE() for _ in range(7))  # 15% of 7 rounds to 1 block
    with caplog.at_level(logging.INFO, logger="blockscale"):
        bsnn.convert(net, RECIPE, module_filter_fn=bsnn.layer_policy(net))
    recipes = [{m.recipe.name for m in block.experts.grouped_mms.values()} for block in net.layers]
    # the tail block's experts are routed unquantized (nn/convert.py, "Experts kept in high
    # precision"): the model's own values, through an op that compiles
    assert recipes == [{RECIPE.name}] * 6 + [{"bf16"}]
    assert "converted 6 of 14 linears and 12 of 14 expert weights" in caplog.text


@pytest.mark.parametrize("recipe", [RECIPE, recipes.get("nvfp4"), recipes.get("mxfp8")])
def test_compiled_quantized_experts_equal_eager(recipe):
    """The real grouped_mm on the CPU, compiled with fullgraph=True (torchtitan compiles each
    block so): its per-group loops read the offsets on the host, which no trace can follow,
    so a trace holds them as opaque ops (ops/quantize.py, gemm/grouped.py) and the compiled
    forward and backward give eager's bits; stochastic rounding too, from the same seed."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = bsnn.convert(MoE().bfloat16(), recipe)
    x = torch.randn(64, DIM, dtype=torch.bfloat16)
    compiled_model = torch.compile(model, fullgraph=True, backend="aot_eager")
    trained = [p for name, p in model.named_parameters() if "router" not in name]  # (argmax)
    results = []
    for run in (model, compiled_model):
        torch.manual_seed(1)
        out = run(x)
        grads = torch.autograd.grad(out.float().square().sum(), trained)
        results.append((out, grads))
    (eager, eager_grads), (compiled, compiled_grads) = results
    assert torch.equal(compiled, eager)
    assert all(torch.equal(c, e) for c, e in zip(compiled_grads, eager_grads, strict=True))


@pytest.mark.usefixtures("kernel_path_on_cpu")
def test_compiled_experts_are_freed_with_their_model():
    """A compiled converted model, deleted, frees its experts' parameters once Dynamo's caches
    are reset. Dynamo (torch 2.13) keeps each constant a nonstrict_trace call was guarded on
    alive past `torch._dynamo.reset()`, through a reference the garbage collector cannot see;
    an `_ExpertsForward` that held its module strongly thereby kept every compiled experts
    module's FP32 weights, so one process that compiled several models (bench_moe_model.py's
    --memory inline) counted each earlier model's experts in the next one's peak."""
    import gc
    import weakref

    def run() -> weakref.ref:
        model = bsnn.convert(MoE(), RECIPE)
        torch.compile(model, fullgraph=True, backend="eager")(torch.randn(32, DIM))
        return weakref.ref(model.experts.gate_up_proj)

    weight = run()
    torch._dynamo.reset()
    gc.collect()
    assert weight() is None


def test_experts_frame_traced_as_plain_code_keeps_blockscale_numerics():
    """When the nonstrict call fails to trace, Dynamo breaks the graph and then traces the
    routed forward as ordinary code, where torch._grouped_mm bypasses the router: on torch
    2.11 that compiled the experts in BF16, forward and backward, without an error. Compiling
    that frame directly (what the fallback does) must give eager's quantized bits."""
    torch._dynamo.reset()
    experts = bsnn.convert(Experts(), RECIPE)
    x, offs = sorted_tokens()
    tensors = dict(experts.named_parameters())

    def run(x):
        return bs_experts._run_routed(experts._blockscale_experts, (), tensors, (x, offs), {})

    eager = run(x)
    compiled = torch.compile(run, backend="eager")(x)
    assert torch.equal(compiled, eager)
    unquantized = Experts.forward(experts, x, offs)
    assert not torch.equal(eager, unquantized)  # the check above can tell the two apart
    torch._dynamo.reset()


@pytest.mark.usefixtures("kernel_path_on_cpu")
def test_kernel_path_compiled_experts_equal_eager():
    """The CUDA code path (grouped kernels reading offs on the device), run on the CPU in
    Triton's interpreter: the converted experts trace with fullgraph=True through their
    nonstrict_trace call, and forward and backward give eager's bits. (torch 2.13 reports
    is_compiling() inside that call and torch 2.11 does not; the 2.11 failure is covered by
    test_compile.py's fake-trace test.)"""
    torch.manual_seed(0)
    model = bsnn.convert(MoE(), RECIPE)
    x = torch.randn(32, DIM)
    results = []
    for run in (model, torch.compile(model, fullgraph=True, backend="aot_eager")):
        model.zero_grad(set_to_none=True)
        out = run(x)
        out.square().sum().backward()
        results.append((out, model.experts.gate_up_proj.grad, model.experts.down_proj.grad))
    for name, eager, compiled in zip(("output", "gate_up grad", "down grad"), *results):
        assert torch.equal(compiled, eager), name


@pytest.mark.usefixtures("kernel_path_on_cpu")
def test_kernel_path_compiled_mxfp8_experts_make_both_weight_copies_in_one_launch(monkeypatch):
    """What users compile: FP32 master experts under BF16 autocast, MXFP8. The traced forward
    keeps grad_input's copy along N, so it makes both expert copies from one read
    (ops/grouped_mm.py, `quantize_experts_pair`); eager rebuilds the copy along N in the
    backward from the parameter. Same bits: output and both gradients. The compiled run's
    launches are those its traces record (the compiled graph calls the op directly)."""
    import importlib

    kg = importlib.import_module("blockscale.kernels.grouped")
    launch = kg._mxfp8_quantize_grouped_2d
    expert_launches: list[tuple[bool, bool]] = []

    def spy(x, source, row, col, dq_row, dq_col, *codes):
        if source is None:  # the expert weights' rows (activations walk a layout)
            expert_launches.append((row, col))
        return launch(x, source, row, col, dq_row, dq_col, *codes)

    monkeypatch.setattr(kg, "_mxfp8_quantize_grouped_2d", spy)
    torch.manual_seed(0)
    model = bsnn.convert(MoE(), recipes.get("mxfp8"))
    x = torch.randn(32, DIM)
    runs = []
    for run in (model, torch.compile(model, fullgraph=True, backend="aot_eager")):
        model.zero_grad(set_to_none=True)
        expert_launches.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = run(x)
        out.float().square().sum().backward()
        grads = (model.experts.gate_up_proj.grad, model.experts.down_proj.grad)
        runs.append(((out, *grads), list(expert_launches)))
    (eager, eager_launches), (compiled, compiled_launches) = runs
    assert eager[1].dtype == torch.float32  # FP32 masters, FP32 gradients
    assert eager_launches == [(True, False)] * 2 + [(False, True)] * 2, eager_launches
    # each trace of the experts (Dynamo's fake run, AOTAutograd's) makes only pairs
    assert compiled_launches and set(compiled_launches) == {(True, True)}, compiled_launches
    for name, e, c in zip(("output", "gate_up grad", "down grad"), eager, compiled):
        assert torch.equal(c, e), name


def test_blockscale_moe_model_converts():
    """models/moe.py's MoETransformer (moe-tiny: 2 blocks, 4 experts, a shared expert)."""
    torch.manual_seed(0)
    model = build_model(model_config("moe-tiny", seq_len=32))
    reference = copy.deepcopy(model)
    bsnn.convert(model, RECIPE, module_filter_fn=bsnn.layer_policy(model))
    head, tail = (layer.moe for layer in model.layers)
    assert list(head.experts.grouped_mms) == ["gate_up_proj", "down_proj"]
    # the BF16 tail block's experts: routed unquantized (nn/convert.py)
    assert {m.recipe.name for m in tail.experts.grouped_mms.values()} == {"bf16"}
    assert type(head.router) is nn.Linear and isinstance(head.shared_expert.w13, bsnn.Linear)
    captured = []
    for g in head.experts.grouped_mms.values():
        g.register_forward_hook(lambda m, args, out: captured.append((args, out)))
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    logits = model(tokens)
    assert captured[0][0][1]._base is head.experts.gate_up_proj
    assert captured[1][0][1]._base is head.experts.down_proj
    for (input, weight_t, offs), out in captured:
        assert torch.equal(out, bs.grouped_mm(input, weight_t, offs, RECIPE))
    assert 1e-3 < rel_error(logits, reference(tokens)) < 0.3
    bsnn.set_precision(model, False)
    assert torch.equal(model(tokens), reference(tokens))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_compiled_quantized_experts_equal_eager():
    """On CUDA ops.grouped_mm reads offs on the device, so the experts' compiled call traces
    with fullgraph=True. (It failed on torch 2.11 with 'Unsupported output type for
    nonstrict_trace-ed function' until library ops took the op route under any trace mode:
    test_compile.py's fake-trace test.)"""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = bsnn.convert(MoE().cuda(), RECIPE)
    x = torch.randn(256, DIM, device="cuda")
    results = []
    for run in (model, torch.compile(model, fullgraph=True, backend="aot_eager")):
        model.zero_grad(set_to_none=True)
        out = run(x)
        out.float().square().sum().backward()
        results.append((out, model.experts.gate_up_proj.grad, model.experts.down_proj.grad))
    for eager, compiled in zip(*results):
        assert torch.equal(compiled, eager)
    torch._dynamo.reset()


# transformers 5.x models. Each test imports transformers itself, so the tests above run
# without it.

HF_KINDS = ("qwen3_moe", "olmoe", "mixtral", "deepseek_v3", "qwen2_moe", "gpt_oss")


def hf_model(kind, n_layers=2, implementation="grouped_mm", seed=0):
    transformers = pytest.importorskip("transformers")
    common = dict(
        vocab_size=256,
        hidden_size=DIM,
        num_hidden_layers=n_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        num_experts_per_tok=2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        experts_implementation=implementation,
    )
    if kind == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            intermediate_size=128, moe_intermediate_size=HIDDEN, num_experts=N_EXPERTS, **common
        )
    elif kind == "olmoe":
        config = transformers.OlmoeConfig(intermediate_size=HIDDEN, num_experts=N_EXPERTS, **common)
    elif kind == "qwen2_moe":  # with its gated shared expert (plain linears)
        config = transformers.Qwen2MoeConfig(
            intermediate_size=128, moe_intermediate_size=HIDDEN,
            shared_expert_intermediate_size=HIDDEN, num_experts=N_EXPERTS, **common,
        )  # fmt: skip
    elif kind == "gpt_oss":  # expert biases, a clamped gated activation, attention sinks
        config = transformers.GptOssConfig(
            intermediate_size=HIDDEN, num_local_experts=N_EXPERTS, head_dim=16, **common
        )
    elif kind == "deepseek_v3":
        # every block an MoE (no leading dense blocks), one shared expert (plain linears), the
        # sigmoid router with its correction bias, multi-head latent attention at small ranks
        common["num_key_value_heads"] = common["num_attention_heads"]
        config = transformers.DeepseekV3Config(
            intermediate_size=128, moe_intermediate_size=HIDDEN, n_routed_experts=N_EXPERTS,
            n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=0,
            q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
            v_head_dim=16, **common,
        )  # fmt: skip
    else:
        config = transformers.MixtralConfig(
            intermediate_size=HIDDEN, num_local_experts=N_EXPERTS, **common
        )
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config)


def hf_pair(kind, **kwargs):
    model = hf_model(kind, **kwargs)
    reference = copy.deepcopy(model)
    return model, reference


def moe_blocks(model):
    return [layer.mlp for layer in model.model.layers]


def router_of(block):
    return block.router if hasattr(block, "router") else block.gate  # GPT-OSS: router


def test_transformers_fallback_op_is_routed_with_the_input_cast():
    """transformers' experts call their own op `transformers::grouped_mm_fallback` instead of
    grouped_mm under torch.compile for non-BF16 weights, and some releases pass it the input
    uncast (BF16 under autocast, with FP32 masters). Called eagerly here, through the op packet
    and an overload: the router sends it to GroupedMM with the bits transformers' grouped_mm
    path would give, which casts the input to the weight's dtype (a quantized GroupedMM takes
    the BF16 input itself, the same values: nn/experts.py, "Widened inputs")."""
    pytest.importorskip("transformers")
    import transformers.integrations.moe  # noqa: F401 (registers the op)

    class FallbackExperts(Experts):
        def forward(self, x_sorted, offs):
            fallback = torch.ops.transformers.grouped_mm_fallback
            h = fallback(x_sorted, self.gate_up_proj.transpose(-2, -1), offs=offs)
            gate, up = h.chunk(2, dim=-1)
            return fallback.default(F.silu(gate) * up, self.down_proj.transpose(-2, -1), offs)

    torch.manual_seed(0)
    experts = bsnn.convert(FallbackExperts(), RECIPE)
    seen = []
    for g in experts.grouped_mms.values():
        g.register_forward_hook(lambda m, args, out: seen.append(args[0].dtype))
    x, offs = sorted_tokens()
    x = x.bfloat16()
    by_hand = expert_mlp_by_hand(x.float(), offs, experts.gate_up_proj, experts.down_proj)
    assert torch.equal(experts(x, offs), by_hand)
    # The BF16 input reaches the quantized GEMM uncast (the same values: "Widened inputs");
    # the second call's input is an FP32 product and goes as it is.
    assert seen == [torch.bfloat16, torch.float32]


class WideningExperts(Experts):
    """transformers' call with FP32 masters: each activation cast to the weight's dtype."""

    def forward(self, x_sorted, offs):
        gate_up_t = self.gate_up_proj.transpose(-2, -1)
        down_t = self.down_proj.transpose(-2, -1)
        h = F.grouped_mm(x_sorted.to(gate_up_t.dtype), gate_up_t, offs=offs)
        gate, up = h.chunk(2, dim=-1)
        return F.grouped_mm((F.silu(gate) * up).to(down_t.dtype), down_t, offs=offs)


@pytest.mark.parametrize(
    "recipe",
    [RECIPE, recipes.get("nvfp4"), recipes.get("mxfp8"), recipes.get("nvfp4_fwd_mxfp8_bwd")],
    ids=["nvfp4-rtn", "nvfp4", "mxfp8", "nvfp4_fwd_mxfp8_bwd"],
)
def test_widened_activations_are_quantized_from_bf16_with_the_fp32_calls_bits(recipe):
    """FP32 masters under BF16 autocast, activations cast to FP32 before each grouped_mm (as
    transformers' experts do): the converted experts quantize the BF16 activations themselves,
    and the output, the input's gradient and the weights' gradients equal, bit for bit,
    blockscale.grouped_mm called on the FP32 casts (stochastic rounding included: the same
    values draw the same noise)."""
    torch.manual_seed(0)
    experts = WideningExperts()
    reference = copy.deepcopy(experts)
    bsnn.convert(experts, recipe)
    seen = []
    for g in experts.grouped_mms.values():
        g.register_forward_hook(lambda m, args, out: seen.append(args[0].dtype))
    x, offs = sorted_tokens()
    x = x.bfloat16()
    results = []
    for model, by_hand in ((experts, False), (reference, True)):
        torch.manual_seed(1)
        xin = x.clone().requires_grad_()
        with torch.autocast("cpu", torch.bfloat16):
            if by_hand:
                wide = xin.to(torch.float32)
                out = expert_mlp_widened(wide, offs, model.gate_up_proj, model.down_proj, recipe)
            else:
                out = model(xin, offs)
        out.backward(torch.ones_like(out))
        results.append((out, xin.grad, model.gate_up_proj.grad, model.down_proj.grad))
    assert seen == [torch.bfloat16, torch.bfloat16]
    assert results[0][0].dtype == torch.bfloat16 and results[0][1].dtype == torch.bfloat16
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.usefixtures("kernel_path_on_cpu")
@pytest.mark.parametrize("name", ["nvfp4", "mxfp8"])
def test_kernel_path_widened_activations_keep_the_fp32_calls_bits(name):
    """The same on the Triton kernels (interpreter), where the quantize kernels read the BF16
    activation instead of the FP32 one."""
    test_widened_activations_are_quantized_from_bf16_with_the_fp32_calls_bits(recipes.get(name))


def expert_mlp_widened(x32, offs, gate_up_proj, down_proj, recipe):
    """The FP32 calls the widening experts make, by hand."""
    h = bs.grouped_mm(x32, gate_up_proj.transpose(-2, -1), offs, recipe)
    gate, up = h.chunk(2, dim=-1)
    act = (F.silu(gate) * up).to(torch.float32)
    return bs.grouped_mm(act, down_proj.transpose(-2, -1), offs, recipe)


@pytest.mark.parametrize("kind", HF_KINDS)
def test_hf_experts_are_quantized_and_routers_untouched(kind, caplog):
    model, reference = hf_pair(kind)
    assert model.config._experts_implementation == "grouped_mm"
    params = dict(model.named_parameters())
    routers = [(r, type(r), r.weight) for r in map(router_of, moe_blocks(model))]
    policy = bsnn.layer_policy(model)
    with caplog.at_level(logging.INFO, logger="blockscale"):
        # Routed experts only (not DeepSeek-V3's shared expert, plain linears), so that the
        # logits' error is theirs (the band in the module docstring).
        bsnn.convert(
            model,
            RECIPE,
            module_filter_fn=lambda m, fqn: policy(m, fqn) and fqn.endswith(".experts"),
        )
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert (
        f"converted 0 of {linears} linears and 2 of 4 expert weights to recipe nvfp4" in caplog.text
    )
    head, tail = (block.experts for block in moe_blocks(model))
    assert type(head).__name__.startswith("Blockscale") and list(head.grouped_mms) == [
        "gate_up_proj",
        "down_proj",
    ]
    # layers.1 is the BF16 tail: routed unquantized (nn/convert.py)
    assert {m.recipe.name for m in tail.grouped_mms.values()} == {"bf16"}
    assert dict(model.named_parameters()) == params
    for block, (router, router_type, weight) in zip(moe_blocks(model), routers):
        assert router_of(block) is router and type(router) is router_type
        assert router.weight is weight

    captured = []
    for g in head.grouped_mms.values():
        g.register_forward_hook(lambda m, args, out: captured.append((args, out)))
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    logits = model(ids).logits
    assert len(captured) == 2
    # weight_t is the parameter's transposed view, or (GPT-OSS, whose experts are stored
    # [E, K, N]) the parameter itself
    weights = (head.gate_up_proj, head.down_proj)
    for ((_, weight_t, _), _), weight in zip(captured, weights, strict=True):
        assert (weight_t if weight_t._base is None else weight_t._base) is weight
    for (input, weight_t, offs), out in captured:
        assert torch.equal(out, bs.grouped_mm(input, weight_t, offs, RECIPE))
    assert 1e-3 < rel_error(logits, reference(ids).logits) < 0.1


@pytest.mark.parametrize("kind", HF_KINDS[:2])
def test_hf_set_precision_false_is_the_unconverted_model(kind):
    model, reference = hf_pair(kind)
    bsnn.convert(model, RECIPE)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    assert bsnn.set_precision(model, False) > 0
    assert torch.equal(model(ids).logits, reference(ids).logits)


@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3"])
def test_hf_trains_with_adamw(kind):
    model = hf_model(kind)
    bsnn.convert(model, RECIPE, module_filter_fn=bsnn.layer_policy(model))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(6):
        optimizer.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    experts = moe_blocks(model)[0].experts
    assert experts.gate_up_proj.grad.abs().sum() > 0
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0] - 0.05, losses


def test_hf_other_experts_implementations_are_left_alone(caplog):
    model = hf_model("olmoe", implementation="eager")
    with caplog.at_level(logging.INFO, logger="blockscale"):
        bsnn.convert(model, RECIPE)
    assert not any(hasattr(block.experts, "grouped_mms") for block in moe_blocks(model))
    assert "runs experts_implementation='eager' and only grouped_mm calls are routed" in caplog.text
    assert "and 0 of 4 expert weights" in caplog.text


def test_hf_llama4_experts_multiply_with_bmm_and_are_routed(caplog):
    """transformers' Llama 4 experts take no experts_implementation and multiply with bmm on
    their [E, K, N] parameters: the router takes that bmm as a grouped GEMM (nn/experts.py,
    "Batched matmuls"), so convert routes them and counts them (tests/test_llama4.py checks
    the bits). Before issue 61 they were left alone, BF16, with a log line."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Llama4TextConfig(
        vocab_size=256, hidden_size=DIM, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, num_experts_per_tok=1,
        intermediate_size=HIDDEN, intermediate_size_mlp=128, num_local_experts=N_EXPERTS,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    reference = copy.deepcopy(model)
    with caplog.at_level(logging.INFO, logger="blockscale"):
        bsnn.convert(model, RECIPE, module_filter_fn=lambda m, fqn: fqn.endswith(".experts"))
    assert "takes no experts_implementation" not in caplog.text
    assert "and 4 of 4 expert weights" in caplog.text
    experts = [layer.feed_forward.experts for layer in model.model.layers]
    assert all(list(e.grouped_mms) == ["gate_up_proj", "down_proj"] for e in experts)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logits = model(ids).logits
    assert not [w for w in caught if "unquantized" in str(w.message)]  # both bmm were routed
    assert 1e-3 < rel_error(logits, reference(ids).logits) < 0.1


class LoopedExperts(Experts):
    """A transformers experts class (by its module) with no experts_implementation that loops
    over its experts with plain matmuls: no grouped_mm or bmm for the router to take."""

    __module__ = "transformers.models.looped.modeling_looped"

    def forward(self, x_sorted, offs):
        out, start = torch.zeros_like(x_sorted), 0
        for e, end in enumerate(offs.tolist()):
            gate, up = (x_sorted[start:end] @ self.gate_up_proj[e].t()).chunk(2, dim=-1)
            out[start:end] = (F.silu(gate) * up) @ self.down_proj[e].t()
            start = end
        return out


def test_hf_experts_without_an_experts_implementation_are_left_alone(caplog):
    """Other transformers experts classes outside its experts-implementation registry make no
    call the router takes: convert must say so and leave them alone, not count them converted
    and let them run unquantized (the forward's warning would come only at the first step)."""
    model = nn.Sequential(LoopedExperts())
    x, offs = sorted_tokens()
    reference = model[0](x, offs)
    with caplog.at_level(logging.INFO, logger="blockscale"):
        bsnn.convert(model, RECIPE)
    assert "transformers' LoopedExperts takes no experts_implementation" in caplog.text
    assert "and 0 of 2 expert weights" in caplog.text
    assert not hasattr(model[0], "grouped_mms") and type(model[0]) is LoopedExperts
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch.equal(model[0](x, offs), reference)
    assert not [w for w in caught if "unquantized" in str(w.message)]  # nothing was wrapped


# What users run (DESIGN.md): FP32 masters with and without BF16 autocast, and BF16 parameters.
# transformers' experts take another path per weight dtype under torch.compile (nn/experts.py).
PARAMETERS = {
    "fp32": (torch.float32, False),
    "fp32_autocast": (torch.float32, True),
    "bf16": (torch.bfloat16, False),
}


def _doubled_grouped_mm(
    input: torch.Tensor, weight_t: torch.Tensor, offs: torch.Tensor
) -> torch.Tensor:
    STAND_IN_CALLS["forward"] += 1
    return 2 * torch._grouped_mm(input, weight_t, offs=offs)


def _doubled_grouped_mm_backward(
    input: torch.Tensor, weight_t: torch.Tensor, offs: torch.Tensor, grad_output: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    STAND_IN_CALLS["backward"] += 1
    grad_input = 2 * torch._grouped_mm(grad_output, weight_t.transpose(-2, -1), offs=offs)
    return grad_input, 2 * torch._grouped_mm(input.t(), grad_output, offs=offs)


def _stand_in_op():
    """A stand-in for blockscale's grouped GEMM that a trace takes in any dtype (the real one
    compiles on the CPU too: test_compiled_quantized_experts_equal_eager), whereas a plain
    Python stand-in meets torch._grouped_mm's BF16-only fake impl with FP32 masters. An opaque
    op, as blockscale's own kernels are on CUDA, computing the grouped GEMM doubled (which no
    unrouted path computes, so a call that bypassed the router shows), and counting the calls
    that run, eager or compiled."""
    lib = "blockscale_tests::doubled_grouped_mm"
    op = torch.library.custom_op(lib, _doubled_grouped_mm, mutates_args=())
    op.register_fake(
        lambda input, weight_t, offs: input.new_empty(input.shape[0], weight_t.shape[-1])
    )
    backward = torch.library.custom_op(
        f"{lib}_backward", _doubled_grouped_mm_backward, mutates_args=()
    )
    backward.register_fake(
        lambda input, weight_t, offs, g: (torch.empty_like(input), torch.empty_like(weight_t))
    )

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def grads(ctx, grad_output):
        input, weight_t, offs = ctx.saved_tensors
        return *backward(input, weight_t, offs, grad_output), None

    op.register_autograd(grads, setup_context=setup_context)
    return op


def eager_and_compiled_steps(model, twin, compiled, loss_of):
    """Two SGD steps of the eager `twin` and of `compiled` (over `model`): each run's losses,
    and the stand-in's calls in its second step (the first one compiles)."""
    losses, calls = {}, {}
    for name, run, params in (("eager", twin, twin), ("compiled", compiled, model)):
        optimizer = torch.optim.SGD(params.parameters(), lr=0.1)
        losses[name] = []
        for step in range(2):
            if step == 1:  # the compile happened in step 0: count a step's calls
                STAND_IN_CALLS.update(forward=0, backward=0)
            optimizer.zero_grad()
            loss = loss_of(run)
            loss.backward()
            optimizer.step()
            losses[name].append(loss.detach())
        calls[name] = dict(STAND_IN_CALLS)
    return losses, calls


STAND_IN_CALLS = {"forward": 0, "backward": 0}
STAND_IN = _stand_in_op()


@pytest.mark.parametrize(
    ("kind", "parameters"),
    [(kind, p) for kind in ("qwen3_moe", "deepseek_v3") for p in PARAMETERS]
    + [(kind, "fp32_autocast") for kind in ("mixtral", "olmoe")],
)
def test_hf_compiled_routing_equals_eager(kind, parameters, monkeypatch):
    """torch.compile(fullgraph=True) of a converted transformers model sends every experts'
    grouped GEMM to blockscale, as eager does, and gives eager's losses and parameters over two
    optimizer steps, bit for bit; set_precision afterwards recompiles (the switch is read where
    Dynamo guards it) and gives eager's unquantized losses.

    With FP32 weights, transformers' experts call their own `transformers::grouped_mm_fallback`
    under torch.compile where torch.compiler.is_compiling() reports True inside the experts'
    traced call (torch 2.13), and grouped_mm where it does not (2.11): both must reach
    blockscale (before the router knew the fallback op, 0 calls did on 2.13). A stand-in takes
    blockscale's place (`_stand_in_op`). aot_eager is Dynamo and AOTAutograd, where the routing
    happens; Inductor's numerics are test_compile.py's subject. Attention is transformers'
    eager one: torch 2.11's aot_eager SDPA backward in BF16 differs from eager's in the last
    bits (k/v_proj gradients, measured on the unconverted model)."""
    dtype, autocast = PARAMETERS[parameters]

    def stand_in(input, weight_t, offs, recipe, out_dtype=None, **weight_cache):
        assert out_dtype is None  # transformers passes none
        return STAND_IN(input, weight_t, offs)

    monkeypatch.setattr(bs_experts, "grouped_mm", stand_in)
    torch._dynamo.reset()
    model, unconverted = hf_pair(kind, n_layers=1)
    model, unconverted = model.to(dtype), unconverted.to(dtype)
    for m in (model, unconverted):
        m.config._attn_implementation = "eager"
    bsnn.convert(model, RECIPE, module_filter_fn=lambda m, fqn: fqn.endswith(".experts"))
    twin = copy.deepcopy(model)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")

    def loss_of(run):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return run(ids, labels=ids).loss

    losses, calls = eager_and_compiled_steps(model, twin, compiled, loss_of)
    assert calls["eager"] == {"forward": 2, "backward": 2}  # gate_up and down of one layer
    assert calls["compiled"] == calls["eager"]
    assert all(map(torch.equal, losses["compiled"], losses["eager"])), losses
    differ = [
        n for (n, p), q in zip(model.named_parameters(), twin.parameters()) if not torch.equal(p, q)
    ]
    assert not differ, differ
    assert not torch.equal(losses["eager"][0], loss_of(unconverted).detach())
    bsnn.set_precision(model, False)
    bsnn.set_precision(twin, False)
    STAND_IN_CALLS.update(forward=0, backward=0)
    assert torch.equal(loss_of(compiled), loss_of(twin))
    assert STAND_IN_CALLS["forward"] == 0
    torch._dynamo.reset()


def test_high_precision_grouped_mm_is_torch_grouped_mm():
    """The op an unquantized FP32 grouped GEMM takes under a trace (nn/experts.py) gives
    torch._grouped_mm's output and gradients, bit for bit, eager and compiled."""
    torch.manual_seed(0)
    x, offs = sorted_tokens()
    x = x[:70]  # torch._grouped_mm leaves rows past offs[-1] unspecified
    weight = torch.randn(N_EXPERTS, 48, DIM)
    grad_output = torch.randn(70, 48)
    results = []
    for fn in (
        lambda x, w: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs),
        lambda x, w: bs_experts._high_precision_grouped_mm(x, w.transpose(-2, -1), offs),
        torch.compile(
            lambda x, w: bs_experts._high_precision_grouped_mm(x, w.transpose(-2, -1), offs),
            fullgraph=True,
            backend="aot_eager",
        ),
    ):
        x_, w_ = x.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        out = fn(x_, w_)
        out.backward(grad_output)
        results.append((out, x_.grad, w_.grad))
    for got in results[1:]:
        for name, a, b in zip(("output", "grad_input", "grad_weight"), got, results[0]):
            assert torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_gpu_hf_compiled_with_fp32_masters_under_autocast_tracks_eager(backend, monkeypatch):
    """A tiny transformers Qwen3-MoE with FP32 masters, converted (every block, experts and
    linears) and trained three AdamW steps under BF16 autocast on CUDA, compiled with
    fullgraph=True: its grouped GEMMs reach blockscale in the trace (transformers sends FP32
    experts to its fallback op under compile; before the router took that op, none did and the
    H200 run failed with DataDependentOutputException) and the losses follow eager's.
    aot_eager runs the traced graph op for op: the losses must be eager's bits. Inductor also
    fuses the model's own BF16 ops with other roundings than eager, so there the losses must
    follow eager's as closely as the same model's unquantized losses do (set_precision off:
    the experts' FP32 GEMMs then run through the router's high-precision op), x10 or 2e-3
    relative, the larger."""
    calls = []
    routed = bs_experts.grouped_mm

    def counted(input, weight_t, offs, recipe, out_dtype=None, **weight_cache):
        calls.append((input.dtype, weight_t.dtype))
        return routed(input, weight_t, offs, recipe, out_dtype=out_dtype, **weight_cache)

    monkeypatch.setattr(bs_experts, "grouped_mm", counted)

    def run(compiled: bool, quantized: bool = True):
        torch._dynamo.reset()
        model = hf_model("qwen3_moe").cuda()
        model.config._attn_implementation = "eager"  # see test_hf_compiled_routing_equals_eager
        bsnn.convert(model, RECIPE, module_filter_fn=bsnn.layer_policy(model, 0.0))
        bsnn.set_precision(model, quantized)
        fn = torch.compile(model, fullgraph=True, backend=backend) if compiled else model
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses, counts = [], []
        for step in range(3):
            ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(step))
            calls.clear()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = fn(ids.cuda(), labels=ids.cuda()).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.detach().float())
            counts.append(list(calls))
        torch._dynamo.reset()
        return torch.stack(losses), counts

    eager, eager_calls = run(compiled=False)
    compiled, compiled_calls = run(compiled=True)
    # gate_up's input is the FP32 residual stream; down's is the BF16 activation that
    # transformers casts to FP32, handed over uncast ("Widened inputs" in nn/experts.py)
    gate_up, down = (torch.float32, torch.float32), (torch.bfloat16, torch.float32)
    assert eager_calls == [[gate_up, down] * 2] * 3  # 2 blocks x (gate_up, down) every step
    # traced into the compiled graph: the same dtypes, at least one call per GEMM (a trace may
    # run the router's Python more than once: the GPU's compile ran it three times a GEMM)
    assert set(compiled_calls[0]) == {gate_up, down} and len(compiled_calls[0]) % 4 == 0
    rel = lambda a, b: ((a - b).abs() / b.abs()).max().item()  # noqa: E731
    if backend == "aot_eager":
        assert torch.equal(compiled, eager), (compiled, eager)
    else:
        noise = rel(run(compiled=True, quantized=False)[0], run(compiled=False, quantized=False)[0])
        assert rel(compiled, eager) <= max(10 * noise, 2e-3), (compiled, eager, noise)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3", "mixtral"])
def test_gpu_readme_moe_call_compiles_and_trains(kind):
    """The README's MoE call exactly: FP32 masters, `convert(model, recipe,
    module_filter_fn=layer_policy(model))` with the default policy (its BF16 tail block's
    experts included), plain `torch.compile(model)` (Inductor), BF16 autocast, fused AdamW.
    Before the tail block's experts were routed unquantized (nn/convert.py, "Experts kept in
    high precision"), the first compiled step raised DataDependentOutputException in the
    backward of transformers' fallback op on an H200 (torch 2.11, transformers 5.17). The
    compiled losses follow eager's within 2e-2 relative (Inductor fuses the model's BF16 ops
    with other roundings), and both blocks' expert weights get gradients."""
    torch._dynamo.reset()
    losses = {}
    for compiled in (False, True):
        model = hf_model(kind, n_layers=2).cuda()
        bsnn.convert(model, RECIPE, module_filter_fn=bsnn.layer_policy(model))
        head, tail = (block.experts for block in moe_blocks(model))
        assert {m.recipe.name for m in head.grouped_mms.values()} == {RECIPE.name}
        assert {m.recipe.name for m in tail.grouped_mms.values()} == {"bf16"}
        forward = torch.compile(model) if compiled else model
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
        run = []
        for step in range(3):
            ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(step))
            ids = ids.cuda()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = forward(ids, labels=ids).loss
            loss.backward()
            for experts in (head, tail):
                assert experts.gate_up_proj.grad.abs().sum() > 0
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            run.append(loss.item())
        losses[compiled] = torch.tensor(run)
        torch._dynamo.reset()
    assert torch.isfinite(losses[True]).all(), losses
    torch.testing.assert_close(losses[True], losses[False], rtol=2e-2, atol=0)


def test_experts_kept_in_bf16_multiply_in_bf16_under_autocast():
    """An unquantized GroupedMM (a BF16 tail block's experts, or set_precision off) under
    autocast multiplies BF16 casts of its operands, as autocast runs a matmul: with FP32
    masters the model's own grouped_mm ran in FP32 (0.44x BF16's speed compiled, H200).
    Outside autocast it is torch._grouped_mm on the operands as they come."""
    gmm = bsnn.GroupedMM(recipes.get("bf16"))
    x, offs = sorted_tokens()
    weight_t = torch.randn(N_EXPERTS, DIM, HIDDEN)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = gmm(x, weight_t, offs, torch.float32)
    expected = torch._grouped_mm(x.bfloat16(), weight_t.bfloat16(), offs=offs).float()
    rows = int(offs[-1])
    assert out.dtype == torch.float32 and torch.equal(out[:rows], expected[:rows])
    plain = torch._grouped_mm(x, weight_t, offs=offs)
    assert torch.equal(gmm(x, weight_t, offs)[:rows], plain[:rows])
