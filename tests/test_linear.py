"""blockscale.linear against an independent step-by-step implementation of each recipe.

The reference below is written from the recipe table and `formats/` only (not from ops/):
it quantizes each operand with `formats.nvfp4.quantize` / `formats.mxfp8.quantize`, and
multiplies the exact `_dq` operands in FP64, then applies alpha. linear() must

- produce every quantized operand bit for bit (recorded by wrapping ops' quantize_operand), and
- land within the FP32 rounding bound of the FP64 product for each GEMM.

Tolerance. Each GEMM in linear sums K exact products (the `_dq` operands are exact and their
products fit FP32) with FP32 accumulation, then multiplies by alpha and adds the bias in FP32,
and casts once. The standard bound for a recursive sum of n terms is
|fl(sum) - sum| <= gamma_n * sum|terms|, gamma_n = n*u / (1 - n*u), u = 2^-24; the alpha
product, bias addition and the final cast add three more roundings, so
|out - ref| <= gamma_{K+3} * (alpha * |A| @ |B|^T + |bias|), elementwise. The reference
rounds nothing before its final comparison (FP64 products and sums of these operands are
exact up to 2^-53 relative, far below u).
"""

import dataclasses
import importlib
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

# The kernel path on CPU tensors (Triton's interpreter, wrap_triton stubbed under tracing).
from test_compile import kernel_path_on_cpu  # noqa: F401

import blockscale
from blockscale import recipes
from blockscale.formats import hadamard, mxfp8, nvfp4
from blockscale.ops import linear, quantize_operand
from blockscale.ops.quantize import HighPrecisionTensor

# blockscale.ops re-exports the function `linear`, which shadows the module of the same name.
ops_linear = importlib.import_module("blockscale.ops.linear")
ops_quantize = importlib.import_module("blockscale.ops.quantize")
U32 = 2.0**-24
QUANTIZED = ["nvfp4", "nvfp4_fwd_mxfp8_bwd", "mxfp8"]
VARIANTS = [
    ("nvfp4", {}),
    ("nvfp4", {"stochastic_rounding": False}),
    ("nvfp4", {"weight_2d": False, "hadamard": False}),
    ("nvfp4_fwd_mxfp8_bwd", {}),
    ("mxfp8", {}),
]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# ---------------------------------------------------------------- the independent reference


def ref_quantize(x, cfg, transpose=False):
    if cfg.format == "nvfp4":
        return nvfp4.quantize(
            x, block=cfg.block, rounding=cfg.rounding.value, hadamard=cfg.hadamard,
            transpose=transpose,
        )  # fmt: skip
    if cfg.format == "mxfp8":
        return mxfp8.quantize(x, transpose=transpose)
    raise AssertionError(f"the reference covers quantized recipes only, got {cfg.format}")


def ref_alpha(a, b):
    if isinstance(a, nvfp4.NVFP4Tensor):
        return (a.global_decode_scale() * b.global_decode_scale()).double().cpu()
    return torch.ones((), dtype=torch.float64)


def ref_gemm(a_dq, b_dq, alpha, bias=None):
    """(exact FP64 product, its error bound for an FP32-accumulated GEMM of contraction K)."""
    a, b = a_dq.double().cpu(), b_dq.double().cpu()
    k = a.shape[1]
    exact = a @ b.t() * alpha
    magnitude = a.abs() @ b.abs().t() * alpha
    if bias is not None:
        exact = exact + bias.double().cpu()
        magnitude = magnitude + bias.double().cpu().abs()
    gamma = (k + 3) * U32 / (1 - (k + 3) * U32)
    return exact, gamma * magnitude


def pad_rows(x, multiple):
    return F.pad(x, (0, 0, 0, -x.shape[0] % multiple))


def reference_step(x, w, b, go, recipe, seed):
    """The recipe written out with formats/: operands (by name) and the three GEMM results."""
    k, n = x.shape[-1], w.shape[0]
    x2, go2 = x.reshape(-1, k), go.reshape(-1, n)
    r = recipe
    q = {}
    q["output.input"] = ref_quantize(x2, r.output.input)
    q["output.weight"] = ref_quantize(w, r.output.weight)
    out = ref_gemm(q["output.input"].dq(), q["output.weight"].dq(),
                   ref_alpha(q["output.input"], q["output.weight"]), b)  # fmt: skip

    if r.grad_input.weight.block == "16x16":
        w_t = q["output.weight"].t()  # the 16x16 copy's exact transpose
    else:
        w_t = ref_quantize(w, r.grad_input.weight, transpose=True)
    q["grad_input.weight"] = w_t
    bs_x = r.grad_weight.input_t.block_size
    q["grad_weight.input_t"] = ref_quantize(pad_rows(x2, bs_x), r.grad_weight.input_t, True)

    torch.manual_seed(seed)  # the backward's draws: grad_output, then grad_output_t
    q["grad_input.grad_output"] = ref_quantize(go2, r.grad_input.grad_output)
    bs_g = r.grad_weight.grad_output_t.block_size
    q["grad_weight.grad_output_t"] = ref_quantize(
        pad_rows(go2, bs_g), r.grad_weight.grad_output_t, transpose=True
    )
    grad_input = ref_gemm(q["grad_input.grad_output"].dq(), w_t.dq(),
                          ref_alpha(q["grad_input.grad_output"], w_t))  # fmt: skip
    gw_a, gw_b = q["grad_weight.grad_output_t"], q["grad_weight.input_t"]
    grad_weight = ref_gemm(gw_a.dq(), gw_b.dq(), ref_alpha(gw_a, gw_b))
    grad_bias = go2.double().sum(0).cpu()
    return q, out, grad_input, grad_weight, grad_bias


# ------------------------------------------------------------------------------ helpers


def make_inputs(lead, k, n, device="cpu", dtype=torch.float32, seed=0, outliers=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, k, generator=g)
    if outliers:  # a few large values, so block scales differ a lot within the tensor
        x.view(-1)[:: max(1, x.numel() // 7)] *= 40.0
    w = torch.randn(n, k, generator=g) / math.sqrt(k)
    b = torch.randn(n, generator=g)
    go = torch.randn(*lead, n, generator=g)
    return [t.to(device=device, dtype=dtype) for t in (x, w, b, go)]


def run_linear(x, w, b, go, recipe, seed):
    x = x.detach().requires_grad_(True)
    w = w.detach().requires_grad_(True)
    b = b.detach().requires_grad_(True)
    y = linear(x, w, b, recipe)
    torch.manual_seed(seed)
    y.backward(go)
    return y, x.grad, w.grad, b.grad


class Recorder:
    """Wraps ops' quantize_operand and keeps every operand it produces, in order."""

    def __init__(self, monkeypatch):
        self.calls = []
        monkeypatch.setattr(ops_linear, "quantize_operand", self)
        monkeypatch.setattr(ops_quantize, "quantize_operand", self)

    def __call__(self, x, config, transpose=False, generator=None, dq=False, amax=None, *,
                 codes=True):  # fmt: skip
        result = quantize_operand(x, config, transpose, generator, dq, amax, codes=codes)
        self.calls.append((config, transpose, result))
        return result


def assert_same_operand(got, want, name):
    assert type(got) is type(want), name
    assert got.shape == want.shape, name
    assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8)), f"{name} codes"
    assert torch.equal(got.scale.view(torch.uint8), want.scale.view(torch.uint8)), f"{name} scales"
    if isinstance(want, nvfp4.NVFP4Tensor):
        assert torch.equal(got.amax, want.amax), f"{name} amax"


def assert_within(got, ref, name):
    exact, bound = ref
    err = (got.double().cpu() - exact).abs()
    worst = (err - bound).max().item()
    assert worst <= 0, f"{name}: error exceeds the FP32 bound by {worst:.3g}"


def check_against_reference(recipe, lead, k, n, device, seed=1234):
    x, w, b, go = make_inputs(lead, k, n, device)
    q, out, grad_input, grad_weight, grad_bias = reference_step(x, w, b, go, recipe, seed)
    y, gx, gw, gb = run_linear(x, w, b, go, recipe, seed)
    assert_within(y.reshape(-1, n), out, "output")
    assert_within(gx.reshape(-1, k), grad_input, "grad_input")
    assert_within(gw, grad_weight, "grad_weight")
    torch.testing.assert_close(gb.double().cpu(), grad_bias, rtol=1e-6, atol=1e-5)
    return q


# -------------------------------------------------------------------------------- tests


@pytest.mark.parametrize(("name", "switches"), VARIANTS)
@pytest.mark.parametrize(
    "lead", [(2, 21), (64,), (1,)], ids=["3d-padded-tokens", "2d", "one-token"]
)
@pytest.mark.parametrize("recompute", [True, False], ids=["weight-recomputed", "weight-saved"])
def test_matches_step_by_step_reference(name, switches, lead, recompute, monkeypatch):
    recipe = recipes.get(name, **switches)
    monkeypatch.setattr(ops_linear, "RECOMPUTE_WEIGHT", recompute)
    recorder = Recorder(monkeypatch)
    q = check_against_reference(recipe, lead, k=64, n=96, device="cpu")
    # Forward: input, input_t, weight, [dgrad's weight copy, saved]; backward: grad_output,
    # grad_output_t, [dgrad's weight copy, rebuilt: the 16x16 forward copy again, or along N].
    shared = recipe.grad_input.weight.block == "16x16"
    dgrad = "output.weight" if shared else "grad_input.weight"
    names = ["output.input", "grad_weight.input_t", "output.weight"]
    if not recompute and not shared:
        names.append(dgrad)
    names += ["grad_input.grad_output", "grad_weight.grad_output_t"]
    if recompute:
        names.append(dgrad)
    assert len(recorder.calls) == len(names)
    for role, (_, _, result) in zip(names, recorder.calls):
        assert_same_operand(result, q[role], role)


@pytest.mark.parametrize("recompute", [True, False], ids=["weight-recomputed", "weight-saved"])
def test_sixteen_by_sixteen_weight_is_never_quantized_along_n(recompute, monkeypatch):
    """The forward's 16x16 copy serves dgrad transposed: saved, or quantized again the same
    way in the backward (RECOMPUTE_WEIGHT), never a second copy along N."""
    monkeypatch.setattr(ops_linear, "RECOMPUTE_WEIGHT", recompute)
    recorder = Recorder(monkeypatch)
    x, w, b, go = make_inputs((32,), 64, 32)
    run_linear(x, w, b, go, recipes.get("nvfp4"), seed=0)
    transposed = [c[1] for c in recorder.calls if c[0].block == "16x16"]
    assert transposed == ([False, False] if recompute else [False])


@pytest.mark.parametrize("name", QUANTIZED)
def test_sqnr_against_high_precision(name):
    """SQNR (dB) of each GEMM result against the unquantized linear on the same data."""
    x, w, b, go = make_inputs((256,), 256, 256, outliers=False)
    y, gx, gw, _ = run_linear(x, w, b, go, recipes.get(name), seed=0)
    y_ref, gx_ref, gw_ref, _ = run_linear(x, w, b, go, recipes.get("bf16"), seed=0)

    def sqnr(got, ref):
        return (10 * torch.log10(ref.pow(2).sum() / (got - ref).pow(2).sum())).item()

    got = {
        "output": sqnr(y, y_ref),
        "grad_input": sqnr(gx, gx_ref),
        "grad_weight": sqnr(gw, gw_ref),
    }
    # Measured on this data (3 seeds): nvfp4 output 19.7-20.1 dB (two operands at nearest,
    # the exact bias adds signal), gradients 15.0-15.6 dB (stochastic rounding's error variance
    # is larger than nearest's); MXFP8 (3 mantissa bits, 2 more than E2M1: ~12 dB) 28.4-31.9 dB.
    # Floors sit ~2 dB under the lowest measurement, so only a real loss of precision trips them.
    floors = {
        "nvfp4": {"output": 17.5, "grad_input": 13.0, "grad_weight": 13.0},
        "nvfp4_fwd_mxfp8_bwd": {"output": 17.5, "grad_input": 26.0, "grad_weight": 26.0},
        "mxfp8": {"output": 29.0, "grad_input": 26.0, "grad_weight": 26.0},
    }[name]
    for gemm, value in got.items():
        assert value > floors[gemm], f"{name} {gemm}: SQNR {value:.1f} dB <= {floors[gemm]}"
    assert all(v < 40 for v in got.values()), f"{name}: SQNR {got} too high to be quantized"


def saved_bytes(fn, held=()):
    """Bytes of distinct tensors an autograd graph saves for backward while `fn` runs, leaving
    out those that share storage with a tensor of `held` (the caller's, alive anyway)."""
    seen = {}
    held_storages = {t.untyped_storage().data_ptr() for t in held}

    def pack(t):
        if t.untyped_storage().data_ptr() not in held_storages:
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.dtype)
            seen[key] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def test_saved_for_backward_memory_is_below_a_third_of_bf16():
    """Beside the weight, which both keep a reference to, BF16 saves the input (2 bytes a
    value) and NVFP4 its packed token copy and two amaxes (0.5625 bytes a value)."""
    m, k, n = 512, 256, 256
    x = torch.randn(m, k, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(n, k, dtype=torch.bfloat16, requires_grad=True)
    bf16_bytes, _ = saved_bytes(lambda: F.linear(x, w), held=[w])
    nvfp4_bytes, _ = saved_bytes(lambda: linear(x, w, None, recipes.get("nvfp4")), held=[w])
    assert bf16_bytes == m * k * 2  # F.linear keeps the input (and the weight)
    assert nvfp4_bytes < 0.3 * bf16_bytes, (nvfp4_bytes, bf16_bytes)


@pytest.mark.parametrize("name", QUANTIZED)
def test_never_saves_the_high_precision_input(name):
    x = torch.randn(64, 64, requires_grad=True)
    w = torch.randn(64, 64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        linear(x, w, None, recipes.get(name))
    # the weight itself is saved (a reference: dgrad's operand is rebuilt from it)
    others = [t for t in saved if t.untyped_storage().data_ptr() != w.untyped_storage().data_ptr()]
    assert others and all(t.dtype not in (torch.float32, torch.bfloat16) or t.numel() == 1
                          for t in others)  # fmt: skip


def test_no_grad_and_partial_grads():
    x, w, b, go = make_inputs((32,), 64, 32)
    r = recipes.get("nvfp4")
    with torch.no_grad():
        y0 = linear(x, w, b, r)
    w_ = w.clone().requires_grad_(True)
    y = linear(x, w_, None, r)  # input needs no grad: dgrad and its weight copy are skipped
    y.backward(go)
    assert x.grad is None and w_.grad is not None
    torch.testing.assert_close(y + b, y0, rtol=1e-6, atol=1e-5)


def test_output_dtypes_follow_input_and_autocast():
    x, w, b, go = make_inputs((32,), 64, 32)
    r = recipes.get("nvfp4")
    xb = x.bfloat16().requires_grad_(True)
    wf = w.clone().requires_grad_(True)
    y = linear(xb, wf, None, r)
    y.backward(go.bfloat16())
    assert y.dtype == torch.bfloat16 and xb.grad.dtype == torch.bfloat16
    assert wf.grad.dtype == torch.float32
    xf = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = linear(xf, wf, b, r)
    assert y.dtype == torch.bfloat16
    y.float().backward(go)
    assert xf.grad.dtype == torch.float32


@pytest.mark.parametrize("name", ["nvfp4", "mxfp8", "nvfp4_fwd_mxfp8_bwd"])
def test_fp32_input_under_autocast_is_quantized_from_its_autocast_cast(name, monkeypatch):
    """Under BF16 autocast an FP32 input gives the bits of its BF16 cast, as autocast's
    F.linear computes on that cast: output, grad_weight, and grad_input (the BF16 one widened).
    With CAST_INPUT_UNDER_AUTOCAST off the FP32 values are quantized and the bits differ."""
    ops_linear = importlib.import_module("blockscale.ops.linear")  # the module, not linear()
    x, w, b, go = make_inputs((4, 8), 64, 32)
    r = recipes.get(name, stochastic_rounding=False) if name == "nvfp4" else recipes.get(name)

    def step(inp):
        inp = inp.clone().requires_grad_(True)
        wt = w.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = linear(inp, wt, b, r)
        y.backward(go.bfloat16())
        return y, inp.grad, wt.grad

    y32, gx32, gw32 = step(x)
    y16, gx16, gw16 = step(x.bfloat16())
    assert y32.dtype == torch.bfloat16 and gx32.dtype == torch.float32
    assert torch.equal(y32, y16) and torch.equal(gw32, gw16)
    assert torch.equal(gx32, gx16.float())
    monkeypatch.setattr(ops_linear, "CAST_INPUT_UNDER_AUTOCAST", False)
    y_own, gx_own, gw_own = step(x)
    assert gx_own.dtype == torch.float32
    assert not torch.equal(y_own, y32) and not torch.equal(gw_own, gw32)


def test_bf16_input_matches_reference_after_one_rounding():
    # BF16 in and out: the GEMM result is the FP32 result rounded once to BF16, so it lies
    # within the BF16 unit roundoff (2^-8 relative) of the reference plus the FP32 bound.
    x, w, b, go = make_inputs((64,), 64, 32, dtype=torch.bfloat16)
    r = recipes.get("nvfp4", stochastic_rounding=False)
    _, out, _, _, _ = reference_step(x, w, b, go, r, seed=0)
    y, *_ = run_linear(x, w, b, go, r, seed=0)
    exact, bound = out
    err = (y.double() - exact).abs()
    assert (err <= bound + exact.abs() * 2.0**-8).all()


def test_stochastic_rounding_is_reproducible_under_a_seed():
    x, w, b, go = make_inputs((64,), 64, 32)
    r = recipes.get("nvfp4")
    _, gx1, gw1, _ = run_linear(x, w, b, go, r, seed=7)
    _, gx2, gw2, _ = run_linear(x, w, b, go, r, seed=7)
    _, gx3, gw3, _ = run_linear(x, w, b, go, r, seed=8)
    assert torch.equal(gx1, gx2) and torch.equal(gw1, gw2)
    assert not torch.equal(gx1, gx3) and not torch.equal(gw1, gw3)


def test_bf16_recipe_is_f_linear():
    x, w, b, go = make_inputs((2, 8), 24, 40)  # dims that fit no block: bf16 does not care
    y, gx, gw, gb = run_linear(x, w, b, go, recipes.get("bf16"), seed=0)
    xr, wr, br = (t.clone().requires_grad_(True) for t in (x, w, b))
    y_ref = F.linear(xr, wr, br)
    y_ref.backward(go)
    assert torch.equal(y, y_ref)
    assert torch.equal(gx, xr.grad) and torch.equal(gw, wr.grad) and torch.equal(gb, br.grad)


def test_custom_recipe_with_high_precision_backward():
    nv = recipes.OperandConfig("nvfp4")
    fwd_only = recipes.Recipe(
        "fwd_only", recipes.OutputGemm(nv, recipes.OperandConfig("nvfp4", "16x16"))
    )
    x, w, b, go = make_inputs((2, 16), 64, 32)
    y, gx, gw, gb = run_linear(x, w, b, go, fwd_only, seed=0)
    y_q, *_ = run_linear(x, w, b, go, recipes.get("nvfp4"), seed=0)
    assert torch.equal(y, y_q)  # the same forward as nvfp4
    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    F.linear(xr, wr).backward(go)  # backward GEMMs in FP32, as an unquantized layer's
    torch.testing.assert_close(gx, xr.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gw, wr.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("k", "n", "name", "message"),
    [
        (40, 32, "nvfp4", "in_features=40 is not a multiple of 16"),
        (64, 40, "nvfp4", "out_features=40 is not a multiple of 16"),
        (48, 64, "mxfp8", "in_features=48 is not a multiple of 32"),
    ],
)
def test_dims_that_do_not_fit_raise(k, n, name, message):
    with pytest.raises(ValueError, match=message):
        linear(torch.randn(4, k), torch.randn(n, k), None, recipes.get(name))


def test_native_backend_refused_off_blackwell():
    r = recipes.get("nvfp4").with_backend("native")
    with pytest.raises(ValueError, match=r"compute capability >= 10.0"):
        linear(torch.randn(16, 64), torch.randn(32, 64), None, r)


def test_quantize_operand_bf16_passthrough():
    x = torch.randn(3, 5, 8)
    hp = quantize_operand(x, recipes.OperandConfig(), transpose=True)
    assert isinstance(hp, HighPrecisionTensor) and hp.shape == (8, 15)
    assert torch.equal(hp.dequantize(), x.reshape(15, 8).t())


def test_bench_linear_quick_smoke(tmp_path):
    """The benchmark script runs end to end on the CPU and writes its JSON record."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_linear.py"
    spec = importlib.util.spec_from_file_location("bench_linear", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    argv = ["--quick", "--shapes", "64,64,64", "--reps", "2", "--warmup", "0", "--json", str(out)]
    assert bench.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["recipe"] for r in rows] == ["bf16", "nvfp4", "nvfp4_fwd_mxfp8_bwd", "mxfp8"]
    assert rows[0]["time_vs_bf16"] == 1.0 and all(r["ms"] > 0 for r in rows)


# ------------------------------------------------------------------ second derivatives
#
# A backward under create_graph=True is differentiable, with the quantizers straight-through
# (ops/linear.py, "Second derivatives"). The reference below is plain torch autograd in FP64
# on the dequantized operands the GEMMs read (grad_output's copies recorded from the step,
# the weight's and the input's rebuilt with formats/), each passing its gradient straight to
# the tensor it approximates (`StraightThrough`).
#
# Tolerance. linear's second derivatives are FP32 GEMMs on those exact FP32 values, chained
# (e.g. dW2 = G2.T @ (relu_mask * (seed @ W1q))): a chain of products with contraction
# lengths n1, n2, ... computed in FP32 in any order is within gamma_{n1+n2+...} of the exact
# chain times the same chain on absolute values (|A||B|...; masks and the exact factor 2 of
# the seed change nothing), u = 2^-24. The magnitude is that chain: the reference run again
# on absolute values. FP64's own rounding (2^-53 relative) is far below the bound.


class StraightThrough(torch.autograd.Function):
    """`value` forward; the gradient passes unchanged to `source` (what value approximates)."""

    @staticmethod
    def forward(ctx, value, source):
        return value.clone()

    @staticmethod
    def backward(ctx, grad):
        return None, grad


def gamma(n):
    return n * U32 / (1 - n * U32)


def dgrad_weight_values(w, recipe):
    """[N, K] FP32 values of grad_input's weight operand: the 16x16 copy, or the copy along N."""
    cfg = recipe.grad_input.weight
    if cfg.block == "16x16":
        return ref_quantize(w.detach(), cfg).dequantize(torch.float32)
    return ref_quantize(w.detach(), cfg, transpose=True).dequantize(torch.float32).t()


def grad_output_rows(recorder, recipe):
    """The values of the grad_output copies quantized for grad_input, in backward order."""
    cfg = recipe.grad_input.grad_output
    return [r.dequantize(torch.float32) for c, t, r in recorder.calls if c == cfg and not t]


def two_layer_model(name):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 32))
    blockscale.convert(model, recipes.get(name))
    x = torch.randn(2, 12, 64)  # 24 tokens: the token copies are zero-padded
    return model, x


def assert_within_chain(got, exact, magnitude, n, name):
    err = (got.double() - exact).abs()
    worst = (err - gamma(n) * magnitude).max().item()
    assert worst <= 0, f"{name}: error exceeds gamma_{n} by {worst:.3g}"
    assert got.abs().max() > 0, f"{name} is zero"


@pytest.mark.parametrize("name", QUANTIZED)
def test_gradient_penalty_reaches_the_weights(name, monkeypatch):
    """g = d out.sum() / dx with create_graph, then |g|^2 backward: both weights get the
    straight-through second derivative (before: exactly zero, or g needed no grad)."""
    model, x = two_layer_model(name)
    recipe = recipes.get(name)
    x.requires_grad_(True)
    h1 = model[0](x)
    out = model[2](model[1](h1))
    recorder = Recorder(monkeypatch)
    (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    g2, g1 = grad_output_rows(recorder, recipe)  # layer 2's backward runs first
    g.pow(2).sum().backward()
    w1, w2 = model[0].weight, model[2].weight
    mask = (h1 > 0).reshape(-1, 96).double()
    seed = 2 * g.detach().reshape(-1, 64).double()  # the gradient of |g|^2 with respect to g

    def reference(f):
        leaves = [w.detach().double().requires_grad_(True) for w in (w1, w2)]
        w1q, w2q = (
            StraightThrough.apply(f(dgrad_weight_values(w, recipe).double()), leaf)
            for w, leaf in zip((w1, w2), leaves)
        )
        go1 = (f(g2.double()) @ w2q) * mask  # layer 2's grad_input, through ReLU's backward
        g_ref = StraightThrough.apply(f(g1.double()), go1) @ w1q
        return torch.autograd.grad(g_ref, leaves, grad_outputs=f(seed))

    exact, magnitude = reference(lambda t: t), reference(torch.abs)
    m, k = 24, 64
    assert_within_chain(w1.grad, exact[0], magnitude[0], m + k, "layer 1 weight")
    assert_within_chain(w2.grad, exact[1], magnitude[1], m + k, "layer 2 weight")


@pytest.mark.parametrize("name", QUANTIZED)
def test_weight_gradient_penalty_without_input_grad(name, monkeypatch):
    """|d out.sum() / d W1|^2 for an input that needs no grad reaches W2 through grad_weight's
    derivative with respect to grad_output (the token copies, Hadamard-transformed in nvfp4:
    the transform's backward is applied)."""
    model, x = two_layer_model(name)
    recipe = recipes.get(name)
    h1 = model[0](x)
    out = model[2](model[1](h1))
    recorder = Recorder(monkeypatch)
    (gw1,) = torch.autograd.grad(out.sum(), model[0].weight, create_graph=True)
    (g2,) = grad_output_rows(recorder, recipe)  # layer 1 makes no grad_input
    gw1.pow(2).sum().backward()
    w2 = model[2].weight
    mask = (h1 > 0).reshape(-1, 96).double()
    cfg_x, cfg_g = recipe.grad_weight.input_t, recipe.grad_weight.grad_output_t
    x2 = pad_rows(x.reshape(-1, 64), cfg_x.block_size)
    x_t = ref_quantize(x2, cfg_x, transpose=True).dequantize(torch.float32).double()  # [K, M']
    h = hadamard.matrix(dtype=torch.float64)
    seed = 2 * gw1.detach().double()

    def reference(f):
        leaf = w2.detach().double().requires_grad_(True)
        w2q = StraightThrough.apply(f(dgrad_weight_values(w2, recipe).double()), leaf)
        go1 = (f(g2.double()) @ w2q) * mask
        go1_t = pad_rows(go1, cfg_g.block_size).t()  # [N, M']
        if cfg_g.hadamard:  # the token copy approximates the transform of go1_t
            go1_t = (go1_t.unflatten(-1, (-1, 16)) @ f(h)).flatten(-2)
        return torch.autograd.grad(go1_t @ f(x_t).t(), leaf, grad_outputs=f(seed))[0]

    # chain: seed @ x_t (K), the transform's backward (16), then G2.T @ (M)
    assert_within_chain(w2.grad, reference(lambda t: t), reference(torch.abs), 64 + 16 + 24, "W2")


@pytest.mark.parametrize("name", QUANTIZED)
def test_create_graph_keeps_the_first_derivatives_bit_for_bit(name):
    model, x = two_layer_model(name)
    x.requires_grad_(True)
    results = []
    for create_graph in (False, True):
        for p in [x, *model.parameters()]:
            p.grad = None
        torch.manual_seed(5)  # the stochastic rounding draws of the backward
        model(x).sum().backward(create_graph=create_graph)
        results.append([p.grad for p in [x, *model.parameters()]])
    plain, graphed = results
    assert all(torch.equal(a, b) for a, b in zip(plain, graphed))
    assert graphed[0].requires_grad  # and the create_graph ones are differentiable


def _stochastic_weight_recipe():
    r = recipes.get("nvfp4", weight_2d=False)
    sr = recipes.OperandConfig("nvfp4", rounding="stochastic")
    return dataclasses.replace(r, grad_input=dataclasses.replace(r.grad_input, weight=sr))


@pytest.mark.parametrize("case", ["stochastic-weight", "recompute-off", "computed-weight"])
def test_second_derivative_through_a_packed_weight_raises(case, monkeypatch):
    """Where the backward has only the weight's packed copy, d grad_input / d weight cannot be
    given: an error, not a zero (or a result that needs no grad)."""
    recipe = _stochastic_weight_recipe() if case == "stochastic-weight" else recipes.get("nvfp4")
    monkeypatch.setattr(ops_linear, "RECOMPUTE_WEIGHT", case != "recompute-off")
    x, w, _, _ = make_inputs((24,), 64, 32)
    x.requires_grad_(True)
    w.requires_grad_(True)
    weight = w * 1.0 if case == "computed-weight" else w
    (g,) = torch.autograd.grad(linear(x, weight, None, recipe).sum(), x, create_graph=True)
    with pytest.raises(NotImplementedError, match="saved only the weight's quantized copy"):
        g.pow(2).sum().backward()


def test_second_derivative_of_grad_weight_with_respect_to_the_input_raises():
    x, w, _, _ = make_inputs((24,), 64, 32)
    x.requires_grad_(True)
    w.requires_grad_(True)
    out = linear(x, w, None, recipes.get("nvfp4"))
    (gw,) = torch.autograd.grad(out.sum(), w, create_graph=True)
    with pytest.raises(NotImplementedError, match=r"input \[24, 64\], weight \[32, 64\], nvfp4"):
        gw.pow(2).sum().backward()


# ------------------------------------------------------------------ outputs changed in place
#
# transformers' Llama 4 adds its routed experts into the shared expert's output in place
# (issue 61). A converted layer's output must take that as F.linear's does: it was a view made
# inside the autograd Function (a reshape of the GEMM's [M, N], even to the same shape), which
# autograd refuses to change in place.

DETERMINISTIC = recipes.get("nvfp4", stochastic_rounding=False)


def _changed_in_place(out, y):
    out.add_(y)
    out[..., :8].mul_(2)  # and a view of it
    return out


def _changed_out_of_place(out, y):
    out = out + y
    return torch.cat([out[..., :8] * 2, out[..., 8:]], dim=-1)


def _in_and_out_of_place(forward, tensors, y, compiled):
    """[output, then each of `tensors`' gradients] of `forward()` changed in place (compiled
    with aot_eager, Dynamo then AOTAutograd, if `compiled`), and of the same change made out of
    place, eagerly."""
    results = []
    for change, compile_it in ((_changed_in_place, compiled), (_changed_out_of_place, False)):

        def step(change=change):
            return change(forward(), y)

        run = torch.compile(step, backend="aot_eager", fullgraph=True) if compile_it else step
        for t in tensors:
            t.grad = None
        out = run()
        out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape))
        results.append([out.detach(), *(t.grad for t in tensors)])
    return results


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("call", ["module", "function"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("lead", [(24,), (2, 12)], ids=["2d", "3d"])
def test_output_can_be_changed_in_place(lead, bias, call, compiled):
    """The gradients are those of the same change made out of place, bit for bit. "module": a
    converted `blockscale.nn.Linear` (compiled: `compiled_linear`, traced by AOTAutograd);
    "function": `blockscale.linear` (compiled: traced by Dynamo)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = blockscale.nn.Linear(64, 32, bias=bias, recipe=DETERMINISTIC)
    x = torch.randn(*lead, 64, requires_grad=True)
    y = torch.randn(*lead, 32)
    if call == "module":
        forward = lambda: layer(x)  # noqa: E731
    else:
        forward = lambda: linear(x, layer.weight, layer.bias, DETERMINISTIC)  # noqa: E731
    tensors = [x, *layer.parameters()]
    in_place, out_of_place = _in_and_out_of_place(forward, tensors, y, compiled)
    for name, got, want in zip(["output", "x", "weight", "bias"], in_place, out_of_place):
        assert torch.equal(got, want), name
    torch._dynamo.reset()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_grouped_mm_output_can_be_changed_in_place(compiled, request):
    """The same for `blockscale.grouped_mm`. Compiled on the kernel path (Triton's interpreter):
    the CPU reference reads offs on the host, which a trace cannot."""
    if compiled:
        request.getfixturevalue("kernel_path_on_cpu")
    torch._dynamo.reset()
    torch.manual_seed(0)
    x = torch.randn(40, 64, requires_grad=True)
    weight_t = torch.randn(2, 64, 32, requires_grad=True)
    offs = torch.tensor([16, 40], dtype=torch.int32)
    y = torch.randn(40, 32)

    def forward():
        return blockscale.grouped_mm(x, weight_t, offs, DETERMINISTIC)

    in_place, out_of_place = _in_and_out_of_place(forward, [x, weight_t], y, compiled)
    for name, got, want in zip(["output", "x", "weight_t"], in_place, out_of_place):
        assert torch.equal(got, want), name
    torch._dynamo.reset()


# --------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize(("name", "switches"), VARIANTS)
def test_gpu_matches_step_by_step_reference(name, switches):
    # On CUDA the kernels draw stochastic rounding from their hash, the reference from torch.rand:
    # the same recipe with nearest rounding is compared bit for bit (the kernels' SR draws
    # are tested statistically in test_kernels_nvfp4.py).
    if name == "nvfp4":
        switches = {**switches, "stochastic_rounding": False}
    recipe = recipes.get(name, **switches).with_backend("emulated")
    check_against_reference(recipe, (4, 96), k=256, n=512, device="cuda")


@pytest.mark.gpu
@cuda
def test_gpu_reproducible_under_a_seed():
    x, w, b, go = make_inputs((4, 128), 256, 256, device="cuda", dtype=torch.bfloat16)
    r = recipes.get("nvfp4")
    first = run_linear(x, w, b, go, r, seed=3)
    second = run_linear(x, w, b, go, r, seed=3)
    third = run_linear(x, w, b, go, r, seed=4)
    assert all(torch.equal(a, c) for a, c in zip(first, second))
    assert not torch.equal(first[2], third[2])


@pytest.mark.gpu
@cuda
def test_gpu_cuda_graph_replays_draw_fresh_noise():
    x = torch.randn(256, 256, device="cuda")
    cfg = recipes.get("nvfp4").grad_input.grad_output
    assert cfg.rounding == "stochastic"
    static = {}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        quantize_operand(x, cfg)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static["codes"] = quantize_operand(x, cfg).data
    graph.replay()
    first = static["codes"].clone()
    graph.replay()
    assert not torch.equal(first, static["codes"])


@pytest.mark.gpu
@cuda
def test_gpu_compiled_cuda_graph_replays_draw_fresh_noise():
    # mode="reduce-overhead" replays a captured CUDA graph on every call after warm-up.
    cfg = recipes.get("nvfp4").grad_input.grad_output
    quantize = torch.compile(lambda t: quantize_operand(t, cfg).data, mode="reduce-overhead")
    x = torch.randn(256, 256, device="cuda")
    codes = [quantize(x).clone() for _ in range(4)]
    assert not torch.equal(codes[2], codes[3])


@pytest.mark.gpu
@cuda
def test_gpu_autocast_bf16_training_step():
    x, w, b, go = make_inputs((4, 64), 256, 256, device="cuda")
    w.requires_grad_(True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = linear(x, w, b, recipes.get("nvfp4"))
    assert y.dtype == torch.bfloat16
    y.backward(go.bfloat16())
    assert w.grad.dtype == torch.float32 and torch.isfinite(w.grad).all()
