"""Tensor parallel of blockscale's own models (`apply_tensor_parallel`, distributed/tp.py) on 2
gloo ranks, against one process running the same model on the same tokens.

`wqkv` stacks q, k and v and `w13` gate and up; the plan gives rank r the rows [q_r; k_r; v_r]
(heads 2r, 2r+1 of tiny's 4) and [gate_r; up_r]. What must hold (stochastic rounding off):
- the quantized weight shards (amax reduced over the two ranks) are exactly the one-device
  quantization's rows: codes, block scales and amax;
- in one block, GEMMs whose contraction is not split give one device's values bit for bit:
  wqkv's and w13's output columns (column-wise), the attention output (per head, each rank's
  heads whole), wo's and w2's grad_input columns (row-wise dgrad), and all four grad_weights
  (contractions over tokens);
- GEMMs whose contraction is split (wo's and w2's outputs, the blocks' input gradients) are
  sums of two partial products, each side within gamma_{n+3} * (|A| @ |B|^T) of the exact
  product of the same quantized operands (n terms, alpha and the cast; u = 2^-24), so the two
  differ by at most 2 * gamma_{n+5} * (|A| @ |B|^T) elementwise (as in
  test_distributed_tp.py), with A, B the one-device dequantized operands;
- the whole model (tiny: bf16, nvfp4, mxfp8; moe-tiny: its attention split, the experts
  whole): loss, logits and every gradient within 1e-5 relative of one process. Not bit for
  bit: downstream of a row-wise sum a value that moved by an FP32 rounding may move the next
  quantization by a code. Observed: logits equal, gradients within 4e-7 (relative norm).
- a model that does not split raises one line naming the rule, before anything changes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard

import blockscale as bs
from blockscale.distributed import apply_tensor_parallel, check_tensor_parallel
from blockscale.distributed._collectives import all_reduce_amax
from blockscale.distributed.launch import run_local
from blockscale.distributed.tp import stacked_full_tensor
from blockscale.models import ModelConfig, build_model, model_config
from blockscale.ops import quantize_operand
from blockscale.train.build import build_optimizer
from blockscale.train.config import TrainConfig

WORLD = 2
U = 2.0**-24
NVFP4 = bs.recipes.nvfp4(stochastic_rounding=False)
RECIPES = {"bf16": None, "nvfp4": NVFP4, "mxfp8": bs.recipes.mxfp8()}


def _model(name: str, recipe) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model(model_config(name, seq_len=32))
    if recipe is not None:  # every linear, the LM head included: more operands to compare
        bs.convert(model, recipe, module_filter_fn=lambda m, fqn: True)
    return model


def _rows(rank: int, n: int, parts: int) -> torch.Tensor:
    """The rows of a [parts * n, K] stacked weight that rank `rank` holds: its n/WORLD rows of
    each part, in part order."""
    share = n // WORLD
    return torch.cat(
        [torch.arange(p * n + rank * share, p * n + (rank + 1) * share) for p in range(parts)]
    )


def _bound(n: int, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """2 * gamma_{n+5} * (|a| @ |b|^T), in FP64 (see the module docstring)."""
    gamma = (n + 5) * U / (1 - (n + 5) * U)
    return 2 * gamma * (a.double().abs() @ b.double().abs().T)


def _assert_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, what: str):
    err = (got.double() - want.double()).abs()
    assert bool((err <= bound).all()), f"{what}: error {err.max():.3g} over the FP32 bound"


def _dq(x: torch.Tensor, config, transpose: bool = False) -> torch.Tensor:
    return quantize_operand(x.detach(), config, transpose=transpose).dequantize()


def _seen(module: torch.nn.Module, store: dict, name: str) -> None:
    """Keep `module`'s input, output and the output's gradient under `name`."""

    def hook(mod, inputs, output):
        # after the style's input hook: a row-wise layer's input is a DTensor by then
        x = inputs[0]
        store[f"{name}.in"] = x.to_local() if hasattr(x, "to_local") else x
        store[f"{name}.out"] = output
        output.register_hook(lambda g: store.__setitem__(f"{name}.grad_out", g))

    module.register_forward_hook(hook)


def _block_step(block, x: torch.Tensor, grad: torch.Tensor, cos, sin) -> dict:
    """Attention and MLP of one block on x, each backpropagating `grad`; what the layers saw."""
    seen: dict = {}
    for name in ("wqkv", "wo"):
        _seen(getattr(block.attn, name), seen, name)
    for name in ("w13", "w2"):
        _seen(getattr(block.mlp, name), seen, name)
    for part, run in (("attn", lambda t: block.attn(t, cos, sin)), ("mlp", block.mlp)):
        xi = x.clone().requires_grad_()
        out = run(xi)
        out.backward(grad)
        seen[f"{part}.out"], seen[f"{part}.x_grad"] = out.detach(), xi.grad
    return seen


def _whole(p: torch.Tensor) -> torch.Tensor:
    # A stacked weight's `_StridedShard`: torch 2.11's full_tensor() refuses it on a 1-D mesh.
    if any(isinstance(x, _StridedShard) for x in getattr(p, "placements", ())):
        return stacked_full_tensor(p)
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def _check_block(rank: int, ref_model, model, x, grad) -> None:
    """One block of tiny under nvfp4, layer by layer (see the module docstring)."""
    cos, sin = ref_model.rope_cos, ref_model.rope_sin
    ref = _block_step(ref_model.layers[0], x, grad, cos, sin)
    got = _block_step(model.layers[0], x, grad, cos, sin)
    block, ref_block = model.layers[0], ref_model.layers[0]
    dim, hidden = 64, 192
    cols = {"wqkv": _rows(rank, dim, 3), "w13": _rows(rank, hidden, 2)}
    for name in cols:
        layer = getattr(block.attn if name == "wqkv" else block.mlp, name)
        ref_layer = getattr(ref_block.attn if name == "wqkv" else ref_block.mlp, name)
        # the quantized shard: the one-device quantization's rows, bit for bit
        local = layer.weight.to_local()
        amax = all_reduce_amax(local.abs().amax().reshape(1))[0]
        mine = quantize_operand(local, NVFP4.output.weight, amax=amax)
        whole = quantize_operand(ref_layer.weight.detach(), NVFP4.output.weight)
        assert torch.equal(mine.data, whole.data[cols[name]]), name
        assert torch.equal(mine.scale.view(torch.uint8), whole.scale.view(torch.uint8)[cols[name]])
        assert torch.equal(mine.amax, whole.amax), name
        # column-wise output and grad_weight: one device's, bit for bit
        assert torch.equal(got[f"{name}.out"], ref[f"{name}.out"][..., cols[name]]), name
        assert torch.equal(_whole(layer.weight.grad), ref_layer.weight.grad), name
    # each rank's heads (wo's input) and hidden features (w2's input): whole, bit for bit
    mine = slice(rank * dim // WORLD, (rank + 1) * dim // WORLD)
    assert torch.equal(got["wo.in"], ref["wo.in"][..., mine])
    assert torch.equal(got["wo.grad_out"], ref["wo.grad_out"])  # the same given gradient
    assert torch.equal(block.attn.wo.weight.grad.full_tensor(), ref_block.attn.wo.weight.grad)
    hid = slice(rank * hidden // WORLD, (rank + 1) * hidden // WORLD)
    assert torch.equal(got["w2.in"], ref["w2.in"][..., hid])
    assert torch.equal(block.mlp.w2.weight.grad.full_tensor(), ref_block.mlp.w2.weight.grad)
    # split contractions: within the FP32 bound
    for name, layer, k in (("wo", ref_block.attn.wo, dim), ("w2", ref_block.mlp.w2, hidden)):
        a = _dq(ref[f"{name}.in"].reshape(-1, k), NVFP4.output.input)
        b = _dq(layer.weight, NVFP4.output.weight)
        part = "attn" if name == "wo" else "mlp"
        bound = _bound(k, a, b).reshape(got[f"{part}.out"].shape)
        _assert_within(got[f"{part}.out"], ref[f"{part}.out"], bound, f"{name} output")
    for name, layer, n in (
        ("wqkv", ref_block.attn.wqkv, 3 * dim),
        ("w13", ref_block.mlp.w13, 2 * hidden),
    ):
        go = _dq(ref[f"{name}.grad_out"].reshape(-1, n), NVFP4.grad_input.grad_output)
        w_t = _dq(layer.weight, NVFP4.grad_input.weight, transpose=True)
        part = "attn" if name == "wqkv" else "mlp"
        bound = _bound(n, go, w_t).reshape(x.shape)
        _assert_within(got[f"{part}.x_grad"], ref[f"{part}.x_grad"], bound, f"{name} grad_input")


def _model_step(model, ids: torch.Tensor):
    logits = model(ids[:, :-1])
    loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    grads = {n: _whole(p.grad) for n, p in model.named_parameters()}
    return logits.detach(), loss.detach(), grads


def _tp_model_worker(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    g = torch.Generator().manual_seed(1)
    x, grad = torch.randn(2, 32, 64, generator=g), torch.randn(2, 32, 64, generator=g)
    ref_model, model = _model("tiny", NVFP4), _model("tiny", NVFP4)
    apply_tensor_parallel(model, mesh)
    assert model.layers[0].attn.wqkv.weight.to_local().shape == (96, 64)
    _check_block(rank, ref_model, model, x, grad)

    ids = torch.randint(0, 256, (2, 33), generator=g)
    cases = [("tiny", name) for name in RECIPES] + [("moe-tiny", "nvfp4")]
    for size, name in cases:
        logits, loss, grads = _model_step(_model(size, RECIPES[name]), ids)
        model = apply_tensor_parallel(_model(size, RECIPES[name]), mesh)
        tp_logits, tp_loss, tp_grads = _model_step(model, ids)
        assert torch.allclose(tp_loss, loss, rtol=1e-5, atol=0), (size, name, tp_loss, loss)
        assert (tp_logits - logits).abs().max() <= 1e-5 * logits.abs().max(), (size, name)
        for n, g_ref in grads.items():
            assert (tp_grads[n] - g_ref).norm() <= 1e-5 * g_ref.norm(), (size, name, n)
        if size == "moe-tiny":  # the attention split, the experts whole on every rank
            assert hasattr(model.layers[0].attn.wqkv.weight, "placements")
            assert not hasattr(model.layers[0].moe.experts.gate_up_proj, "placements")

    # CUDA's fused AdamW refuses a param group mixing DTensors and plain tensors (seen on an
    # H100 under train --tp; the CPU's fused AdamW accepts it, so the groups are checked)
    groups = build_optimizer(model, TrainConfig(), torch.device("cpu")).param_groups
    assert all(len({isinstance(p, DTensor) for p in g["params"]}) == 1 for g in groups)
    assert sorted(id(p) for g in groups for p in g["params"]) == sorted(
        id(p) for p in model.parameters()
    )
    for g in groups:
        assert all((p.dim() >= 2) == (g["weight_decay"] > 0) for p in g["params"])


def test_own_models_under_tensor_parallel_equal_one_process():
    run_local(_tp_model_worker, WORLD)


def test_a_model_that_does_not_split_is_refused_in_one_line():
    tiny = _model("tiny", None)  # n_heads=4, ffn_dim=192
    with pytest.raises(ValueError, match=r"layers.0.attn: n_heads=4 does not split over 3 tens"):
        check_tensor_parallel(tiny, 3)
    check_tensor_parallel(_model("tiny", NVFP4), 4)  # 16 rows of each part a rank: whole blocks
    with pytest.raises(
        ValueError,
        match=r"layers.0.attn.wqkv: .*3 stacked projections of N=64, colwise over 4 ranks: each "
        r"shard has N=16, not a multiple of 32",
    ):
        check_tensor_parallel(_model("tiny", bs.recipes.mxfp8()), 4)
    wide = build_model(ModelConfig(dim=128, n_layers=1, n_heads=64, ffn_dim=96, seq_len=8))
    with pytest.raises(ValueError, match=r"layers.0.mlp: hidden dim 96 does not split over 64"):
        check_tensor_parallel(wide, 64)
    for model, tp in ((tiny, 3), (wide, 64)):
        for message in (str(e) for e in _errors(model, tp)):
            assert "\n" not in message


def _errors(model, tp) -> list[ValueError]:
    try:
        check_tensor_parallel(model, tp)
    except ValueError as e:
        return [e]
    return []
