"""dgrad's weight operand rebuilt in the backward (ops/linear.py, "Memory").

`linear` and `grouped_mm` save the weight itself (a reference) and, for NVFP4, the forward's
amax, and quantize the weight again in the backward instead of saving a packed copy. Checked
against the old behaviour (`RECOMPUTE_WEIGHT = False`, which saves the packed copy):

- outputs and gradients bit for bit, every quantized recipe, on the formats/ reference path
  and on the kernel path (Triton's interpreter), with the dgrad GEMM's `_dq` operand in the
  same memory layout (a GPU GEMM may sum in another order for another layout);
- the saved bytes: no new storage for the weight, only its FP32 amax (exact figures);
- an in-place change of the weight between forward and backward raises autograd's error;
- the packed copy is still saved where rebuilding would give other bits or cost memory: a
  stochastic weight config, a weight that arrives quantized (blockscale.distributed), and a
  weight computed in the forward (a BF16 cast, which the save would keep alive);
- under tensor parallel the backward reuses the forward's reduced amax: no collective.
"""

from __future__ import annotations

import dataclasses
import importlib
import math

import pytest
import torch

import blockscale as bs
from blockscale import _library, recipes
from blockscale.distributed import QuantizedWeight
from blockscale.distributed.weight import quantize_weight
from blockscale.recipes import Rounding

# blockscale.ops re-exports the functions, which shadow the modules of the same name.
ops_linear = importlib.import_module("blockscale.ops.linear")
ops_grouped = importlib.import_module("blockscale.ops.grouped_mm")

RECIPES = {
    "nvfp4": recipes.get("nvfp4"),  # stochastic grad_output: the same draws either way
    "nvfp4-nearest": recipes.get("nvfp4", stochastic_rounding=False),
    "nvfp4-1x16": recipes.get("nvfp4", weight_2d=False, hadamard=False),
    "nvfp4_fwd_mxfp8_bwd": recipes.get("nvfp4_fwd_mxfp8_bwd"),
    "mxfp8": recipes.get("mxfp8"),
}


def kernels_on(monkeypatch) -> None:
    """The Triton kernel path for CPU tensors (Triton's interpreter)."""
    pytest.importorskip("triton")
    monkeypatch.setattr(_library, "use_kernels", lambda t: True)


def storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class Saved:
    """The tensors autograd saves while it is entered, by distinct (storage, view)."""

    def __init__(self) -> None:
        self.tensors: dict[tuple, torch.Tensor] = {}
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.tensors[(storage(t), t.storage_offset(), t.shape, t.dtype)] = t
        return t

    def __enter__(self) -> Saved:
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.hooks.__exit__(*exc)

    def storages(self) -> set[int]:
        return {key[0] for key in self.tensors}

    def new_bytes(self, *held: torch.Tensor) -> int:
        """Bytes saved in storages other than those of `held` (the caller's tensors)."""
        skip = {storage(t) for t in held}
        return sum(
            t.numel() * t.element_size() for key, t in self.tensors.items() if key[0] not in skip
        )


def packed_bytes(values: int, fmt: str, amax: int = 4) -> int:
    """NVFP4: 4-bit codes + an E4M3 scale per 16 (+ the FP32 amax); MXFP8: 8-bit codes + an
    E8M0 scale per 32."""
    if fmt == "nvfp4":
        return values // 2 + values // 16 + amax
    return values + values // 32


# ------------------------------------------------------------------------------ linear


def linear_inputs(lead=(2, 21), k=64, n=96, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*lead, k, generator=g)
    x.view(-1)[::97] *= 30.0  # outliers: block scales differ within the tensor
    w = torch.randn(n, k, generator=g) / math.sqrt(k)
    b = torch.randn(n, generator=g)
    go = torch.randn(*lead, n, generator=g)
    return x.to(dtype), w, b, go.to(dtype)


def spy_strides(monkeypatch, module, name: str) -> list:
    """Record the `_dq` operands' strides of each call of the GEMM `module.name` (undone at
    the test's end)."""
    strides: list = []
    gemm = getattr(module, name)

    def spy(a, b_op, *args, **kwargs):
        strides.append((a.dq().stride(), b_op.dq().stride()))
        return gemm(a, b_op, *args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return strides


def linear_step(x, w, b, go, recipe, monkeypatch):
    """(output, grad_input, grad_weight, grad_bias), the `_dq` operands' strides of the three
    GEMMs, and the storages saved for backward."""
    x, w, b = (t.detach().clone().requires_grad_(True) for t in (x, w, b))
    with monkeypatch.context() as m:
        strides = spy_strides(m, ops_linear, "_mm")
        with Saved() as saved:
            y = bs.linear(x, w, b, recipe)
        torch.manual_seed(7)
        y.backward(go)
    return [y, x.grad, w.grad, b.grad], strides, storage(w) in saved.storages()


@pytest.mark.parametrize("path", ["reference", "kernels"])
@pytest.mark.parametrize("name", list(RECIPES))
def test_linear_gives_the_saved_copys_bits(name, path, monkeypatch):
    if path == "kernels":
        kernels_on(monkeypatch)
    dtype = torch.bfloat16 if path == "kernels" else torch.float32
    x, w, b, go = linear_inputs(dtype=dtype)
    runs = {}
    for recompute in (True, False):
        monkeypatch.setattr(ops_linear, "RECOMPUTE_WEIGHT", recompute)
        runs[recompute] = linear_step(x, w, b, go, RECIPES[name], monkeypatch)
    (new, new_strides, new_saves_w), (old, old_strides, old_saves_w) = runs[True], runs[False]
    assert new_saves_w and not old_saves_w, "the two runs took the same path"
    for what, a, b_ in zip(["output", "grad_input", "grad_weight", "grad_bias"], new, old):
        torch.testing.assert_close(a, b_, atol=0, rtol=0, msg=what)
    assert new_strides == old_strides  # forward, dgrad, wgrad operand layouts


@pytest.mark.parametrize("name", ["nvfp4", "nvfp4_fwd_mxfp8_bwd", "mxfp8"])
def test_linear_saves_no_new_storage_for_the_weight(name, monkeypatch):
    """Saved beside the weight itself: the packed token copy of the input and, for an NVFP4
    dgrad weight, its FP32 amax; before, the packed weight copy too. Exact bytes."""
    m, k, n = 96, 64, 128
    recipe = RECIPES[name]
    x = torch.randn(m, k, requires_grad=True)
    w = torch.randn(n, k, requires_grad=True)
    input_t = packed_bytes(m * k, recipe.grad_weight.input_t.format.value)
    weight_fmt = recipe.grad_input.weight.format.value
    got = {}
    for recompute in (True, False):
        monkeypatch.setattr(ops_linear, "RECOMPUTE_WEIGHT", recompute)
        with Saved() as saved:
            bs.linear(x, w, None, recipe)
        assert (storage(w) in saved.storages()) == recompute
        got[recompute] = saved.new_bytes(w)
    amax = 4 if weight_fmt == "nvfp4" else 0
    assert got[True] == input_t + amax, got
    assert got[False] == input_t + packed_bytes(n * k, weight_fmt), got


@pytest.mark.parametrize("name", ["nvfp4", "mxfp8"])
def test_linear_in_place_change_of_the_weight_raises(name):
    x = torch.randn(32, 64, requires_grad=True)
    w = torch.randn(64, 64, requires_grad=True)
    y = bs.linear(x, w, None, RECIPES[name])
    with torch.no_grad():
        w.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def _stochastic_weight(recipe):
    w = dataclasses.replace(recipe.output.weight, rounding=Rounding.STOCHASTIC)
    return dataclasses.replace(
        recipe,
        output=dataclasses.replace(recipe.output, weight=w),
        grad_input=dataclasses.replace(recipe.grad_input, weight=w),
    )


def test_linear_keeps_the_packed_copy_of_a_stochastic_weight():
    """Rebuilding would draw other bits than the forward's copy, which dgrad must use."""
    recipe = _stochastic_weight(RECIPES["nvfp4"])
    x = torch.randn(32, 64, requires_grad=True)
    w = torch.randn(64, 64, requires_grad=True)
    with Saved() as saved:
        bs.linear(x, w, None, recipe)
    assert storage(w) not in saved.storages()
    assert saved.new_bytes() == packed_bytes(32 * 64, "nvfp4") + packed_bytes(64 * 64, "nvfp4")


def test_linear_keeps_the_packed_copy_of_a_weight_computed_in_the_forward():
    """A cast copy would stay alive through the save: 2 bytes a value against 0.56."""
    x = torch.randn(32, 64, requires_grad=True)
    w = torch.randn(64, 64, requires_grad=True)
    with Saved() as saved:
        w_bf16 = w.to(torch.bfloat16)
        bs.linear(x, w_bf16, None, RECIPES["nvfp4"])
    assert not saved.storages() & {storage(w), storage(w_bf16)}
    assert saved.new_bytes() == packed_bytes(32 * 64, "nvfp4") + packed_bytes(64 * 64, "nvfp4")


@pytest.mark.parametrize("name", ["nvfp4-nearest", "mxfp8"])
def test_linear_keeps_the_copy_a_quantized_weight_holds(name):
    """A weight that arrives quantized (FSDP2's quantized all-gather, NVFP4 primary weights)
    has no values to rebuild from: dgrad saves the copy it holds, as before, and the step has
    the bits of the plain weight's."""
    recipe = RECIPES[name]
    x, w, _, go = linear_inputs(lead=(32,), k=64, n=64)
    rows = (recipe.output.weight, quantize_weight(w, recipe.output.weight, False, None))
    cols = None
    if recipe.grad_input.weight.block != "16x16":
        cols = (recipe.grad_input.weight, quantize_weight(w, recipe.grad_input.weight, True, None))
    qw = QuantizedWeight(w.shape, w.dtype, rows, cols, requires_grad=True)
    xq = x.clone().requires_grad_(True)
    with Saved() as saved:
        yq = bs.linear(xq, qw, None, recipe)
    yq.backward(go)
    held = (cols or rows)[1]  # dgrad's copy
    assert {storage(held.data), storage(held.scale)} <= saved.storages()
    xp, wp = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    yp = bs.linear(xp, wp, None, recipe)
    yp.backward(go)
    for a, b_ in zip((yq, xq.grad, qw.grad), (yp, xp.grad, wp.grad)):
        torch.testing.assert_close(a, b_, atol=0, rtol=0)


def test_tensor_parallel_backward_reuses_the_reduced_amax(monkeypatch):
    """A weight shard scales with the whole weight's amax (reduced in the forward); the
    backward rebuilds dgrad's copy with that amax, so it needs no collective of its own."""
    calls = []

    def reduce(t):  # another rank holds a larger |w|
        calls.append(t.numel())
        return torch.maximum(t, torch.full_like(t, 4.0))

    sharded = bs.ops.AmaxReduction(reduce, weight=True)
    x, w, b, go = linear_inputs(lead=(32,), k=64, n=64)
    runs = []
    for recompute in (True, False):
        monkeypatch.setattr(ops_linear, "RECOMPUTE_WEIGHT", recompute)
        calls.clear()
        xi, wi = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        y = bs.linear(xi, wi, None, RECIPES["nvfp4-nearest"], amax_reduction=sharded)
        y.backward(go)
        assert calls == [1], calls  # the forward's weight amax only
        runs.append((y, xi.grad, wi.grad))
    for a, b_ in zip(*runs):
        torch.testing.assert_close(a, b_, atol=0, rtol=0)


# -------------------------------------------------------------------------- grouped_mm


def grouped_inputs(sizes=(44, 0, 1, 37), tail=5, k=64, n=64):
    g = torch.Generator().manual_seed(0)
    m = sum(sizes) + tail
    x = torch.randn(m, k, generator=g)
    x[3, 5] = 30.0
    w = torch.randn(len(sizes), n, k, generator=g) * 0.1
    go = torch.randn(m, n, generator=g)
    offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32)
    return x, w, go, offs


def grouped_step(x, w, go, offs, recipe, monkeypatch):
    x, w = (t.detach().clone().requires_grad_(True) for t in (x, w))
    with monkeypatch.context() as m:
        strides = spy_strides(m, ops_grouped, "grouped_mm_rows")
        with Saved() as saved:
            out = bs.grouped_mm(x, w.transpose(-2, -1), offs, recipe)
        torch.manual_seed(7)
        out.backward(go)
    return [out, x.grad, w.grad], strides, storage(w) in saved.storages()


# The interpreted grouped kernels are slow: their 16x16 expert weights run once, under nvfp4.
GROUPED_CASES = [(name, "reference") for name in RECIPES] + [
    (name, "kernels") for name in RECIPES if name != "nvfp4-nearest"
]


@pytest.mark.parametrize(("name", "path"), GROUPED_CASES)
def test_grouped_mm_gives_the_saved_copys_bits(name, path, monkeypatch):
    if path == "kernels":
        kernels_on(monkeypatch)
    x, w, go, offs = grouped_inputs()
    if path == "kernels":
        x, go = x.bfloat16(), go.bfloat16()
    runs = {}
    for recompute in (True, False):
        monkeypatch.setattr(ops_linear, "RECOMPUTE_WEIGHT", recompute)
        runs[recompute] = grouped_step(x, w, go, offs, RECIPES[name], monkeypatch)
    (new, new_strides, new_saves_w), (old, old_strides, old_saves_w) = runs[True], runs[False]
    assert new_saves_w and not old_saves_w, "the two runs took the same path"
    for what, a, b_ in zip(["output", "grad_input", "grad_weight"], new, old):
        torch.testing.assert_close(a, b_, atol=0, rtol=0, msg=what)
    # The grouped GEMM kernel branches on which dim of an operand has unit stride (its TMA
    # descriptor reads any 16-byte aligned strides the same tiles): the rebuilt copy along N
    # is a per-expert view of the kernel's [K, E*N] output rather than a contiguous [E, K, N].
    unit = [tuple(s.index(1) for s in pair) for pair in new_strides]
    assert unit == [tuple(s.index(1) for s in pair) for pair in old_strides]


@pytest.mark.parametrize("name", ["nvfp4-nearest", "nvfp4-1x16", "mxfp8"])
def test_grouped_mm_saves_no_new_storage_for_the_weights(name, monkeypatch):
    """What recomputing leaves out is exactly the packed expert-weight copy (codes and
    scales); both save the NVFP4 experts' E amaxes (the backward scales with the forward's)."""
    recipe = RECIPES[name]
    x, w, _, offs = grouped_inputs()
    e, n, k = w.shape
    x.requires_grad_()
    w.requires_grad_()
    got = {}
    for recompute in (True, False):
        monkeypatch.setattr(ops_linear, "RECOMPUTE_WEIGHT", recompute)
        with Saved() as saved:
            bs.grouped_mm(x, w.transpose(-2, -1), offs, recipe)
        assert (storage(w) in saved.storages()) == recompute
        got[recompute] = saved.new_bytes(w, offs)
    fmt = recipe.grad_input.weight.format.value
    assert got[False] - got[True] == packed_bytes(e * n * k, fmt, amax=0), got


def test_grouped_mm_in_place_change_of_the_weights_raises():
    x, w, go, offs = grouped_inputs()
    w.requires_grad_()
    out = bs.grouped_mm(x.requires_grad_(), w.transpose(-2, -1), offs, RECIPES["nvfp4-nearest"])
    with torch.no_grad():
        w.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward(go)


def test_grouped_mm_keeps_the_packed_copy_of_cast_weights():
    """models/moe.py casts FP32 experts to BF16 for F.grouped_mm: saving that cast would keep
    it alive, so the packed copy is saved, as before."""
    x, w, _, offs = grouped_inputs()
    w.requires_grad_()
    with Saved() as saved:
        w_t = w.to(torch.bfloat16).transpose(-2, -1)
        bs.grouped_mm(x.bfloat16().requires_grad_(), w_t, offs, RECIPES["nvfp4-nearest"])
    assert not saved.storages() & {storage(w), storage(w_t)}
    e, n, k = w.shape
    assert [t for t in saved.tensors.values() if t.shape == (e, n, k // 2)]  # its 16x16 codes


@pytest.mark.parametrize("name", ["nvfp4-1x16"])
def test_grouped_mm_backward_scales_with_the_forwards_expert_amaxes(name, monkeypatch):
    """The backward's rebuilt expert copy takes the forward copy's per-expert amaxes instead
    of reading every expert weight again for them (kernel path: one group-amax pass over the
    experts in the forward, none in the backward)."""
    kernels_on(monkeypatch)
    kg = importlib.import_module("blockscale.kernels.grouped")
    expert_rows = kg._expert_rows
    given: list[torch.Tensor | None] = []

    def spy(w, amax=None):
        given.append(amax)
        return expert_rows(w, amax)

    monkeypatch.setattr(kg, "_expert_rows", spy)
    x, w, go, offs = grouped_inputs()
    x, go = x.bfloat16().requires_grad_(), go.bfloat16()
    w.requires_grad_()
    out = bs.grouped_mm(x, w.transpose(-2, -1), offs, RECIPES[name])
    assert given == [None], "the forward finds the experts' amaxes itself"
    out.backward(go)
    assert len(given) == 2 and given[1] is not None, "the backward found them again"
    torch.testing.assert_close(given[1], w.detach().abs().amax(dim=(1, 2)), atol=0, rtol=0)


def test_grouped_mm_under_a_trace_keeps_the_packed_copy(monkeypatch):
    """Under a trace grouped_mm saves the packed expert copy: compiled, the experts' weights
    are usually a cast made in the forward, and a backward rebuilding from it kept that BF16
    cast alive (ops/grouped_mm.py; measured on an H100, the compiled MoE layer's nvfp4 peak
    went from 0.93x to 1.41x BF16's). linear recomputes under a trace, grouped_mm does not."""
    x, w, _, offs = grouped_inputs()
    w.requires_grad_()
    monkeypatch.setattr(ops_linear, "tracing", lambda: True)  # recomputes_weight reads it
    with Saved() as saved:
        bs.grouped_mm(x.requires_grad_(), w.transpose(-2, -1), offs, RECIPES["nvfp4-nearest"])
    assert storage(w) not in saved.storages()
    assert saved.new_bytes(w, offs) > packed_bytes(w.numel(), "nvfp4", amax=0)


def test_grouped_mm_makes_both_mxfp8_expert_copies_from_one_read(monkeypatch):
    """A forward that keeps grad_input's copy along N (a weight cast in the forward, or any
    traced step) makes both MXFP8 expert copies in one launch, one read of the weights
    (`quantize_experts_pair`): the bits of two launches, outputs and gradients alike, and with
    a weight cache both copies are kept, so a second micro-batch launches nothing for them."""
    kernels_on(monkeypatch)
    kg = importlib.import_module("blockscale.kernels.grouped")
    launch = kg._mxfp8_quantize_grouped_2d
    expert_launches: list[tuple[bool, bool]] = []

    def spy(x, source, row, col, dq_row, dq_col, *codes):
        if source is None:  # the expert weights' rows (activations walk a layout)
            expert_launches.append((row, col))
        return launch(x, source, row, col, dq_row, dq_col, *codes)

    monkeypatch.setattr(kg, "_mxfp8_quantize_grouped_2d", spy)
    x, w, go, offs = grouped_inputs()
    x, go = x.bfloat16(), go.bfloat16()

    def step(cache=None, micro_batches=1):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        for _ in range(micro_batches):
            w_t = wr.to(torch.bfloat16).transpose(-2, -1)  # computed in the forward
            out = bs.grouped_mm(xr, w_t, offs, RECIPES["mxfp8"], weight_cache=cache,
                                weight_source=wr)  # fmt: skip
            out.backward(go)
        return [out, xr.grad, wr.grad]

    new = step()
    assert expert_launches == [(True, True)], expert_launches
    expert_launches.clear()
    with monkeypatch.context() as m:
        m.setattr(ops_grouped, "quantize_experts_pair", lambda *a, **k: None)
        old = step()
    assert expert_launches == [(True, False), (False, True)], expert_launches
    for what, a, b_ in zip(["output", "grad_input", "grad_weight"], new, old):
        torch.testing.assert_close(a, b_, atol=0, rtol=0, msg=what)
    expert_launches.clear()
    cache = ops_grouped.WeightCache(from_first_use=True, scope="step")  # across micro-batches
    cached = step(cache, micro_batches=2)
    assert expert_launches == [(True, True)], expert_launches
    assert len(cache) == 2
    old2 = [t * 2 if i else t for i, t in enumerate(old)]  # two micro-batches: twice (exact)
    for what, a, b_ in zip(["output", "grad_input", "grad_weight"], cached, old2):
        torch.testing.assert_close(a, b_, atol=0, rtol=0, msg=what)
