"""The weight cache (ops/weight_cache.py): a weight's quantized copies made once per optimizer
step and reused by every micro-batch and by the backward.

- a hit reuses: weight quantizations counted, dense linears and MoE experts;
- training with the cache on gives the bits of training with it off (losses, gradients and
  parameters after optimizer steps), every quantized recipe, grad accumulation over two
  micro-batches, FP32 master weights under BF16 autocast and BF16 parameters;
- every way a weight changes drops the copies: fused / foreach / per-tensor optimizers (the
  fused ones do not bump the version counter), load_state_dict, an in-place edit, a recipe
  change, set_precision around optimizer steps, a dtype move, `clear_weight_cache` after a
  `.data` write;
- activation checkpointing and torch.compile give the same bits with the cache on;
- where the cache must not apply it holds nothing: a weight that arrives quantized (FSDP2's
  quantized all-gather), inference mode, a tensor-parallel weight shard, a stochastic weight
  config, an expert weight computed by an op other than a cast or a layout change;
- what it holds, in bytes, matches docs/KERNELS.md's arithmetic.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
from contextlib import nullcontext

import numpy as np
import pytest
import torch
from torch import nn

import blockscale as bs
import blockscale.nn as bsnn
from blockscale import _library, recipes
from blockscale.distributed import QuantizedWeight
from blockscale.distributed.weight import quantize_weight
from blockscale.models.moe import MoE, MoEConfig
from blockscale.ops.weight_cache import WeightCache
from blockscale.recipes import Rounding

ops_linear = importlib.import_module("blockscale.ops.linear")
ops_grouped = importlib.import_module("blockscale.ops.grouped_mm")

RECIPES = {
    "nvfp4": recipes.get("nvfp4"),
    "nvfp4-1x16": recipes.get("nvfp4", weight_2d=False, hadamard=False),
    "nvfp4_fwd_mxfp8_bwd": recipes.get("nvfp4_fwd_mxfp8_bwd"),
    "mxfp8": recipes.get("mxfp8"),
}
DIM = 64


class Dense(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 96)
        self.down = nn.Linear(96, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def dense_model() -> nn.Module:
    torch.manual_seed(0)
    return Dense()


def moe_model() -> nn.Module:
    torch.manual_seed(0)
    cfg = MoEConfig(dim=DIM, n_layers=1, n_heads=1, ffn_dim=64, seq_len=16, n_experts=4, top_k=2)
    return MoE(cfg)


MODELS = {"dense": dense_model, "moe": moe_model}


class Counter:
    """Counts the weight quantizations of linear and grouped_mm (the calls the cache saves)."""

    def __init__(self, monkeypatch) -> None:
        self.calls = 0
        for module, name in ((ops_linear, "weight_operand"), (ops_grouped, "quantize_experts")):
            monkeypatch.setattr(module, name, self.wrap(getattr(module, name)))

    def wrap(self, fn):
        def counted(*args, **kwargs):
            self.calls += 1
            return fn(*args, **kwargs)

        return counted


def build(kind: str, recipe, cache: str, params: str, scope: str = "step") -> nn.Module:
    """`scope`: the caches' (ops/weight_cache.py); most tests here are of reuse across
    micro-batches, which only the opt-in "step" scope allows."""
    model = MODELS[kind]()
    bsnn.convert(model, recipe)
    if cache == "off":
        bsnn.set_weight_cache(model, False)
    else:  # "default": copies kept once a step makes one twice; else from the first use
        bsnn.set_weight_cache(
            model, True, keep_dq=cache == "dq", from_first_use=cache != "default", scope=scope
        )
    return model.bfloat16() if params == "bf16" else model


def autocast_for(params: str):
    if params == "fp32-autocast":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return nullcontext()


def inputs(n: int, params: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    dtype = torch.bfloat16 if params == "bf16" else torch.float32
    return [torch.randn(2, 16, DIM, generator=g).to(dtype) for _ in range(n)]


def train(model, params: str, optimizer: dict, steps: int = 2, micro: int = 2):
    """Losses of every micro-batch, the gradients before each step, the parameters after."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2, **optimizer)
    xs = inputs(steps * micro, params)
    torch.manual_seed(7)  # stochastic rounding draws
    losses, grads = [], []
    for step in range(steps):
        for x in xs[step * micro : (step + 1) * micro]:
            with autocast_for(params):
                loss = model(x).float().square().mean()
            loss.backward()
            losses.append(loss.detach())
        grads += [p.grad.clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads, [p.detach().clone() for p in model.parameters()]


def assert_same(a, b) -> None:
    for what, xs, ys in zip(["losses", "gradients", "parameters"], a, b):
        assert len(xs) == len(ys)
        for i, (x, y) in enumerate(zip(xs, ys)):
            torch.testing.assert_close(x, y, atol=0, rtol=0, msg=f"{what}[{i}]")


def n_copies(recipe) -> int:
    """1 where dgrad uses the 16x16 forward copy transposed, else 2 (a copy along N)."""
    w = recipe.output.weight
    return 1 if w.block == "16x16" and recipe.grad_input.weight == w else 2


def caches(model: nn.Module) -> list[WeightCache]:
    found = [getattr(m, "weight_cache", None) for m in model.modules()]
    return [c for c in found if c is not None]


# --------------------------------------------------------------------------- reuse


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("name", list(RECIPES))
def test_a_step_quantizes_each_weight_copy_once(kind, name, monkeypatch):
    """Two micro-batches, forward and backward each: one quantization per weight copy with
    the cache (the forward's, and the copy along N where dgrad has its own)."""
    recipe = RECIPES[name]
    copies = n_copies(recipe)
    counted = {}
    for cache in ("off", "packed"):
        model = build(kind, recipe, cache, "fp32-autocast")
        counter = Counter(monkeypatch)
        for x in inputs(2, "fp32-autocast"):
            with autocast_for("fp32-autocast"):
                model(x.requires_grad_()).float().square().mean().backward()
        counted[cache] = counter.calls
    n_weights = 2  # Dense: up, down; MoE: gate_up_proj, down_proj (its router stays BF16)
    assert counted["packed"] == n_weights * copies, counted
    # Without the cache, per micro-batch: a dense layer rebuilds dgrad's copy in the backward
    # (2 quantizations); the MoE experts, cast to BF16 under autocast, save the forward's
    # copies instead (one per copy).
    per_micro_batch = 2 if kind == "dense" else copies
    assert counted["off"] == n_weights * per_micro_batch * 2, counted


def micro_batch(model, x, grad: bool = True) -> None:
    with autocast_for("fp32-autocast"), torch.set_grad_enabled(grad):
        y = model(x.detach().requires_grad_(grad)).float().square().mean()
    if grad:
        y.backward()


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("name", list(RECIPES))
def test_the_default_keeps_copies_once_a_step_makes_one_twice(kind, name, monkeypatch):
    """The default cache (from_first_use=False) holds nothing while each copy is made once a
    step, as with one micro-batch and two copies (MXFP8), and quantizes as often as no cache;
    a copy made twice under one stamp (a second micro-batch; a dense backward that rebuilds
    the 16x16 forward copy) makes it keep copies from then on, so later steps make each once."""
    recipe = RECIPES[name]
    copies = n_copies(recipe)
    x1, x2 = inputs(2, "fp32-autocast")
    off, model = (
        build(kind, recipe, "off", "fp32-autocast"),
        build(kind, recipe, "default", "fp32-autocast"),
    )
    counter, counts = Counter(monkeypatch), {}
    for what, m in (("off", off), ("default", model)):
        counter.calls = 0
        micro_batch(m, x1)
        counts[what] = counter.calls
    assert counts["default"] == counts["off"] > 0, counts
    # dense layers rebuild the shared 16x16 copy in the backward: made twice in one step
    remade = kind == "dense" and copies == 1
    for cache in caches(model):
        assert cache.reused is remade and len(cache) == (1 if remade else 0), cache
    micro_batch(model, x2)  # a second micro-batch under the same weights
    assert all(c.reused for c in caches(model))
    bsnn.clear_weight_cache(model)  # what an optimizer step does
    counter.calls = 0
    for x in (x1, x2):
        micro_batch(model, x)
    assert counter.calls == 2 * copies  # two weights, each copy made once in the step
    assert all(len(c) == copies for c in caches(model))


def test_forwards_without_grad_neither_keep_copies_nor_set_reused(monkeypatch):
    """An evaluation under no_grad between optimizer steps makes its copies at each forward
    and leaves the training step's cache as it was (nothing held across its backward)."""
    model = build("moe", RECIPES["mxfp8"], "default", "fp32-autocast")
    counter = Counter(monkeypatch)
    for x in inputs(3, "fp32-autocast"):
        micro_batch(model, x, grad=False)
    assert counter.calls == 3 * 2  # gate_up_proj and down_proj at each forward
    assert all(not c.reused and len(c) == 0 for c in caches(model))


# Fused AdamW with FP32 masters (what CUDA users get), foreach and per-tensor with both.
TRAINING = [
    ("fp32-autocast", {"fused": True}),
    ("fp32-autocast", {"foreach": True}),
    ("fp32-autocast", {"foreach": False}),
    ("bf16", {"foreach": True}),
    ("bf16", {"foreach": False}),
]


@pytest.mark.parametrize(("params", "optimizer"), TRAINING)
@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("name", list(RECIPES))
def test_training_with_the_cache_gives_the_uncached_bits(name, kind, params, optimizer):
    """Two optimizer steps of two micro-batches each: the cache must drop its copies at each
    step (a fused optimizer leaves the version counter as it was) and reuse them within it."""
    recipe = RECIPES[name]
    modes = ("off", "packed", "default")
    runs = {c: train(build(kind, recipe, c, params), params, optimizer) for c in modes}
    assert_same(runs["off"], runs["packed"])
    assert_same(runs["off"], runs["default"])  # begins keeping copies within the first step
    # the weights did move enough for stale copies to show: the second step's losses differ
    assert not torch.equal(runs["off"][0][0], runs["off"][0][2])


def test_training_with_kept_dq_operands_gives_the_uncached_bits():
    runs = {
        c: train(build("moe", RECIPES["nvfp4"], c, "fp32-autocast"), "fp32-autocast", {})
        for c in ("off", "dq")
    }
    assert_same(runs["off"], runs["dq"])


# --------------------------------------------------------------------- invalidation


def one_step(model, x, params="fp32-autocast"):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    with autocast_for(params):
        y = model(x.detach().requires_grad_())
    y.float().square().mean().backward()
    return [y.detach()] + [p.grad.clone() for p in model.parameters()]


def fresh_twin(model) -> nn.Module:
    """A copy of `model` (same parameter values) whose caches start empty."""
    for m in model.modules():
        if isinstance(m, MoE):
            m.aux_loss = None  # the last forward's, a non-leaf: deepcopy refuses it
    return copy.deepcopy(model)


def check_against_fresh(model, x, params="fp32-autocast") -> None:
    got = one_step(model, x, params)
    want = one_step(fresh_twin(model), x, params)
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=f"result {i}")


@pytest.fixture
def warm():
    """A converted MoE model whose caches hold copies, and its input."""
    model = build("moe", RECIPES["mxfp8"], "packed", "fp32-autocast")
    x = inputs(1, "fp32-autocast")[0]
    one_step(model, x)
    assert all(len(c) == 2 for c in caches(model))  # forward's copy and the copy along N
    return model, x


def test_deepcopy_starts_with_empty_caches(warm):
    model, _ = warm
    twin = fresh_twin(model)
    assert caches(twin) and all(len(c) == 0 for c in caches(twin))


@pytest.mark.parametrize("optimizer", [{"fused": True}, {"foreach": True}, {"foreach": False}])
def test_an_optimizer_step_clears_the_caches(warm, optimizer):
    model, x = warm
    torch.optim.SGD(model.parameters(), lr=0.5, **optimizer).step()
    assert all(len(c) == 0 for c in caches(model))
    check_against_fresh(model, x)


def test_load_state_dict_clears_the_caches(warm):
    model, x = warm
    other = moe_model().state_dict()
    other = {k: v * 3 for k, v in other.items()}
    model.load_state_dict(other)
    assert all(len(c) == 0 for c in caches(model))
    check_against_fresh(model, x)


def test_an_in_place_edit_is_seen_by_the_version_counter(warm):
    model, x = warm
    with torch.no_grad():
        model.experts.down_proj.mul_(-2)
    check_against_fresh(model, x)


def test_a_write_through_data_needs_clear_weight_cache(warm):
    model, x = warm
    model.experts.down_proj.data.mul_(-2)  # invisible to the version counter
    assert bsnn.clear_weight_cache(model) == len(caches(model))
    check_against_fresh(model, x)


def test_a_new_recipe_clears_the_cache(warm):
    model, x = warm
    for module in model.modules():
        if isinstance(module, (bsnn.Linear, bsnn.GroupedMM)):
            module.recipe = RECIPES["nvfp4"]
    assert all(len(c) == 0 for c in caches(model))
    check_against_fresh(model, x)


def test_set_precision_around_optimizer_steps(warm):
    model, x = warm
    bsnn.set_precision(model, False)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    one_step(model, x)
    opt.step()
    bsnn.set_precision(model, True)
    check_against_fresh(model, x)


def test_a_dtype_move_is_seen(warm):
    model, x = warm
    model.bfloat16()
    check_against_fresh(model, x.bfloat16(), params="bf16")


def test_a_cast_expert_weight_is_cached_by_its_parameter(monkeypatch):
    """models/moe.py casts FP32 experts to BF16 under autocast: a new tensor each forward,
    followed to its parameter by the router (a cast, a transpose), so it is cached."""
    model = build("moe", RECIPES["nvfp4"], "packed", "fp32-autocast")
    x = inputs(1, "fp32-autocast")[0]
    counter = Counter(monkeypatch)
    for _ in range(3):
        one_step(model, x)
    assert counter.calls == 2  # gate_up_proj and down_proj, once each


class ScaledExperts(nn.Module):
    """Experts whose weight reaches grouped_mm through a multiplication: not a cast or a
    layout change, so its value cannot be known from the parameter alone."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, 32, 32) * 0.1)
        self.scale = 1.0

    def forward(self, x, offs):
        return torch._grouped_mm(x, (self.w * self.scale).transpose(-2, -1), offs=offs)


def test_an_expert_weight_computed_by_another_op_is_not_cached(monkeypatch):
    model = bsnn.convert(ScaledExperts(), RECIPES["nvfp4"])
    assert isinstance(model.grouped_mms["w"], bsnn.GroupedMM)
    x = torch.randn(40, 32)
    offs = torch.tensor([15, 40], dtype=torch.int32)
    counter = Counter(monkeypatch)
    outs = []
    for scale in (1.0, 2.0):
        model.scale = scale
        outs.append(model(x, offs))
    assert counter.calls == 2 and len(model.grouped_mms["w"].weight_cache) == 0
    assert not torch.equal(outs[0], outs[1])


# ------------------------------------------------------- checkpointing and compile


@pytest.mark.parametrize("kind", list(MODELS))
def test_activation_checkpointing(kind, monkeypatch):
    """The recomputed forward finds the copies the first forward made: the same bits as
    without the cache, and no extra quantization."""
    from torch.utils.checkpoint import checkpoint

    recipe = RECIPES["nvfp4"]
    runs, calls = {}, {}
    for cache in ("off", "packed"):
        model = build(kind, recipe, cache, "fp32-autocast")
        counter = Counter(monkeypatch)
        x = inputs(1, "fp32-autocast")[0].requires_grad_()
        torch.manual_seed(7)
        with autocast_for("fp32-autocast"):
            y = checkpoint(model, x, use_reentrant=False)
        y.float().square().mean().backward()
        runs[cache] = [y] + [p.grad for p in model.parameters()]
        calls[cache] = counter.calls
    for a, b in zip(runs["off"], runs["packed"]):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    # Without the cache each weight is quantized in the forward and in its recomputation, and
    # a dense layer's dgrad copy once more in the backward (the cast experts save theirs).
    assert calls["packed"] == 2 and calls["off"] == (6 if kind == "dense" else 4), calls


@pytest.mark.parametrize("kind", list(MODELS))
def test_compiled_model_with_the_cache_gives_eager_bits(kind):
    """Plain torch.compile of a converted model with the cache on: compiled graphs quantize
    in the graph (the cache holds nothing for them), eager reuses: the same bits, across an
    optimizer step. The MoE experts cannot be traced on the CPU's reference path
    (test_convert_experts.py's xfail), so Dynamo runs them eagerly there, with the cache,
    between compiled graphs: the composition is what is checked for them."""
    torch._dynamo.reset()
    recipe = recipes.get("nvfp4", stochastic_rounding=False)  # Inductor draws other bits
    runs = []
    for compiled in (False, True):
        model = build(kind, recipe, "packed", "fp32-autocast")
        fn = torch.compile(
            model, fullgraph=kind == "dense", options=ops_linear.EXACT_INDUCTOR_OPTIONS
        )
        opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
        results = []
        for x in inputs(2, "fp32-autocast"):
            with autocast_for("fp32-autocast"):
                y = (fn if compiled else model)(x)
            y.float().square().mean().backward()
            results += [y.detach().float()] + [p.grad.clone() for p in model.parameters()]
            if kind == "dense":  # the compiled graph quantizes in it; eager keeps 2 copies
                held = sum(len(c) for c in caches(model))
                assert held == (0 if compiled else 2), held
            opt.step()
            opt.zero_grad(set_to_none=True)
        runs.append(results)
    for i, (a, b) in enumerate(zip(*runs)):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=f"result {i}")


# ------------------------------------------------------------- where it stays out


def test_a_quantized_weight_is_not_cached():
    """FSDP2's quantized all-gather hands the layer a weight that is already quantized: the
    cache stays empty and the step has the plain weight's bits."""
    recipe = recipes.get("nvfp4", stochastic_rounding=False)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(32, 64, generator=g), torch.randn(64, 64, generator=g) / 8
    rows = (recipe.output.weight, quantize_weight(w, recipe.output.weight, False, None))
    qw = QuantizedWeight(w.shape, w.dtype, rows, None, requires_grad=True)
    cache = WeightCache(from_first_use=True)
    y = bs.linear(x, qw, None, recipe, weight_cache=cache)
    y.sum().backward()
    assert len(cache) == 0
    wp = w.clone().requires_grad_()
    yp = bs.linear(x, wp, None, recipe)
    yp.sum().backward()
    torch.testing.assert_close(y, yp, atol=0, rtol=0)
    torch.testing.assert_close(qw.grad, wp.grad, atol=0, rtol=0)


def test_inference_mode_does_not_fill_the_cache():
    cache = WeightCache(from_first_use=True)
    w = torch.randn(64, 64)
    with torch.inference_mode():
        bs.linear(torch.randn(16, 64), w, None, RECIPES["nvfp4"], weight_cache=cache)
    assert len(cache) == 0
    with torch.no_grad():  # eval without inference mode does use it
        bs.linear(torch.randn(16, 64), w, None, RECIPES["nvfp4"], weight_cache=cache)
    assert len(cache) == 1


def test_a_tensor_parallel_weight_shard_is_not_cached():
    sharded = bs.ops.AmaxReduction(lambda t: torch.maximum(t, torch.full_like(t, 4.0)), weight=True)
    cache = WeightCache(from_first_use=True)
    bs.linear(torch.randn(16, 64), torch.randn(64, 64), None, RECIPES["nvfp4"],
              amax_reduction=sharded, weight_cache=cache)  # fmt: skip
    assert len(cache) == 0


def test_a_stochastic_weight_config_is_not_cached():
    recipe = RECIPES["nvfp4"]
    w_cfg = dataclasses.replace(recipe.output.weight, rounding=Rounding.STOCHASTIC)
    recipe = dataclasses.replace(
        recipe,
        output=dataclasses.replace(recipe.output, weight=w_cfg),
        grad_input=dataclasses.replace(recipe.grad_input, weight=w_cfg),
    )
    cache = WeightCache(from_first_use=True)
    w = torch.randn(64, 64, requires_grad=True)
    bs.linear(torch.randn(16, 64), w, None, recipe, weight_cache=cache).sum().backward()
    assert len(cache) == 0


def test_a_weight_computed_in_the_forward_is_not_cached():
    cache = WeightCache(from_first_use=True)
    w = torch.randn(64, 64, requires_grad=True)
    bs.linear(torch.randn(16, 64), w * 2, None, RECIPES["nvfp4"], weight_cache=cache)
    assert len(cache) == 0


# ------------------------------------------------------------------------- memory


def packed_bytes(values: int, fmt: str) -> int:
    if fmt == "nvfp4":
        return values // 2 + values // 16 + 4  # codes, E4M3 scales, FP32 amax
    return values + values // 32  # codes, E8M0 scales


@pytest.mark.parametrize("name", list(RECIPES))
def test_held_bytes_are_the_packed_copies(name):
    """docs/KERNELS.md, "Weight cache": packed codes and scales of each copy the step uses."""
    recipe = RECIPES[name]
    n, k = 96, 64
    w = torch.randn(n, k, requires_grad=True)
    cache = WeightCache(from_first_use=True)
    x = torch.randn(32, k, requires_grad=True)
    bs.linear(x, w, None, recipe, weight_cache=cache).sum().backward()
    want = packed_bytes(n * k, recipe.output.weight.format.value)
    if n_copies(recipe) == 2:
        fmt = recipe.grad_input.weight.format.value
        want += packed_bytes(n * k, fmt)
        if fmt == recipe.output.weight.format.value == "nvfp4":
            want -= 4  # the copy along N is scaled with the forward copy's amax, the same tensor
    assert cache.held_bytes() == want


def kernels_on(monkeypatch) -> None:
    pytest.importorskip("triton")
    monkeypatch.setattr(_library, "use_kernels", lambda t: True)


@pytest.mark.parametrize("name", ["nvfp4", "mxfp8"])
def test_kernel_path_keep_dq_holds_the_dq_operands_and_gives_the_same_bits(name, monkeypatch):
    """On the kernel path (Triton's interpreter) the copies come with their BF16 `_dq`
    operand: `keep_dq=True` keeps it (2 more bytes a value and copy), the default drops it and
    the next use dequantizes the packed copy. Both give the uncached bits over two
    micro-batches."""
    kernels_on(monkeypatch)
    recipe = RECIPES[name]
    n, k = 64, 64
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(n, k, generator=g) / 8
    xs = [torch.randn(32, k, generator=g).bfloat16() for _ in range(2)]
    runs = {}
    for mode in ("off", "packed", "dq"):
        cache = None if mode == "off" else WeightCache(keep_dq=mode == "dq", from_first_use=True)
        w = w0.clone().requires_grad_()
        outs = []
        for x in xs:
            x = x.clone().requires_grad_()
            torch.manual_seed(7)
            y = bs.linear(x, w, None, recipe, weight_cache=cache)
            y.float().square().sum().backward()
            outs += [y, x.grad]
        runs[mode] = outs + [w.grad]
        if cache is not None:
            copies = n_copies(recipe)
            packed = copies * packed_bytes(n * k, recipe.output.weight.format.value)
            dq = copies * 2 * n * k if mode == "dq" else 0
            assert cache.held_bytes() == packed + dq, (mode, cache.held_bytes())
    for mode in ("packed", "dq"):
        for i, (a, b) in enumerate(zip(runs["off"], runs[mode])):
            torch.testing.assert_close(a, b, atol=0, rtol=0, msg=f"{mode} result {i}")


# ---------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("name", ["nvfp4", "mxfp8"])
def test_gpu_training_with_the_cache_gives_the_uncached_bits(name, kind):
    """The kernel path on CUDA: FP32 masters under BF16 autocast, fused AdamW (CUDA's
    default), two steps of two micro-batches; packed and `keep_dq` caches against none."""
    runs = {}
    for cache in ("off", "packed", "dq"):
        model = build(kind, RECIPES[name], cache, "fp32").cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-2, fused=True)
        xs = [x.cuda() for x in inputs(4, "fp32")]
        torch.manual_seed(7)
        out = []
        for step in range(2):
            for x in xs[2 * step : 2 * step + 2]:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(x).float().square().mean()
                loss.backward()
                out.append(loss.detach())
            out += [p.grad.clone() for p in model.parameters()]
            opt.step()
            opt.zero_grad(set_to_none=True)
        runs[cache] = out + [p.detach().clone() for p in model.parameters()]
    for cache in ("packed", "dq"):
        for i, (a, b) in enumerate(zip(runs["off"], runs[cache])):
            torch.testing.assert_close(a, b, atol=0, rtol=0, msg=f"{cache} result {i}")


# ------------------------------------------------------- the default scope: one forward


def sequential() -> nn.Module:
    torch.manual_seed(0)
    return bsnn.convert(
        nn.Sequential(nn.Linear(DIM, 96), nn.ReLU(), nn.Linear(96, DIM)),
        recipes.get("nvfp4", stochastic_rounding=False),
    )


def hand_written_training(model: nn.Module, steps: int = 30) -> list[torch.Tensor]:
    """The update loop of many tutorials and of optimizers that are not torch.optim's."""
    g = torch.Generator().manual_seed(0)
    x, target = torch.randn(32, DIM, generator=g), torch.randn(32, DIM, generator=g)
    losses = []
    for _ in range(steps):
        loss = (model(x) - target).square().mean()
        model.zero_grad(set_to_none=True)
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p.data.add_(-0.05 * p.grad)
        losses.append(loss.detach())
    return losses


def test_a_hand_written_update_loop_trains_on_fresh_weights():
    """Issue 60, case 1: a `p.data` update, invisible to the version counter and to every
    optimizer hook, between steps. The default cache reuses a copy only within the forward
    that made it and its backward, so the losses are those of no cache; on the old code the
    copies of the first step served every later one (loss 0.0663 against 0.0565 after 30)."""
    cached, uncached = sequential(), sequential()
    bsnn.set_weight_cache(uncached, False)
    got, want = hand_written_training(cached), hand_written_training(uncached)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=f"loss {i}")
    # the second layer's backward (the first has no grad_input to make) reused its forward's copy
    assert [c.reused for c in caches(cached)] == [False, True]


def rewrite_data(layer: nn.Linear) -> None:
    layer.weight.data.mul_(-2)


def rewrite_numpy(layer: nn.Linear) -> None:
    layer.weight.detach().numpy()[:] = np.random.default_rng(3).standard_normal((96, DIM))


def round_trip(layer: nn.Linear) -> None:
    layer.half().float()


@pytest.mark.parametrize("change", [rewrite_data, rewrite_numpy, round_trip])
def test_a_weight_change_between_calls_is_never_served_stale(change):
    """Every change a user can make between two calls, the ones no version counter or hook
    shows included (a `.data` write, numpy memory shared with the weight, a dtype round trip
    that may give the storage back at its old address): the next call's output is a fresh
    quantization's (issue 60, case 1: on the old code off by up to 86)."""
    model = sequential()
    bsnn.set_weight_cache(model, True, from_first_use=True)
    x = torch.randn(8, DIM)
    with torch.no_grad():
        model(x)
        assert len(caches(model)[0]) == 1  # the first layer's copy is held
        change(model[0])
        fresh = copy.deepcopy(model)
        bsnn.set_weight_cache(fresh, False)
        assert torch.equal(model(x), fresh(x))


def test_a_layer_called_twice_in_one_forward_quantizes_its_weight_once(monkeypatch):
    """Within one forward of the converted model a copy is reused: a layer registered twice
    (`Sequential(l, act, l)`) quantizes its weight once, and the backward of a 16x16 NVFP4
    weight reuses the forward's copy."""
    torch.manual_seed(0)
    shared = nn.Linear(DIM, DIM)
    model = bsnn.convert(nn.Sequential(shared, nn.ReLU(), shared), recipes.get("nvfp4"))
    layer = model[0]
    bsnn.set_weight_cache(model, True, from_first_use=True)
    counter = Counter(monkeypatch)
    x = torch.randn(8, DIM)
    model(x).square().sum().backward()
    assert counter.calls == 1
    counter.calls = 0
    layer(x)  # a call of its own: a new scope, a new copy
    assert counter.calls == 1


@pytest.mark.parametrize("name", ["nvfp4", "mxfp8"])
def test_grad_accumulation_under_the_default_scope_gives_the_uncached_bits(name, monkeypatch):
    """Micro-batches are separate forwards: under the default scope each makes its copies
    again (the "step" scope reuses them), with the bits of no cache."""
    recipe = RECIPES[name]
    runs = {}
    for cache in ("off", "packed"):
        runs[cache] = train(
            build("dense", recipe, cache, "fp32-autocast", scope="forward"), "fp32-autocast", {}
        )
    assert_same(runs["off"], runs["packed"])


def test_the_scope_is_checked():
    with pytest.raises(ValueError, match="scope='steps' is not one of"):
        bsnn.set_weight_cache(sequential(), True, scope="steps")
    with pytest.raises(TypeError, match="enabled='False' is a str, not a bool"):
        bsnn.set_weight_cache(sequential(), "False")
