"""The linear layer gives the same bits whether the Triton kernels or the formats/ references
quantize its operands.

On the GPU the kernels are chosen for every CUDA tensor. Here, on the CPU,
`blockscale._library.use_kernels` is switched on so the kernels run in Triton's interpreter
(tests/conftest.py turns it on), the GEMM epilogue kernel included, and
each recipe's forward output, grad_input and grad_weight must equal the reference path's
exactly: the kernels are bit-exact to formats/ for nearest rounding, the `_dq` operands they
write are the same exact values, and the GEMM that consumes them is the same call (the fused
GEMM kernel is switched off for this: its FP32 sums may be ordered differently). A second test
runs the fused GEMM kernel in the step and checks it against the same reference within that
reordering. Stochastic rounding is off (the kernels hash their own bits, not torch.rand's).
"""

import pytest
import torch

from blockscale import _library, recipes
from blockscale.gemm import dispatch
from blockscale.ops import linear

pytest.importorskip("triton")

RECIPES = {
    "nvfp4": recipes.get("nvfp4", stochastic_rounding=False),
    "nvfp4-1x16-weights": recipes.get("nvfp4", stochastic_rounding=False, weight_2d=False),
    "nvfp4_fwd_mxfp8_bwd": recipes.get("nvfp4_fwd_mxfp8_bwd"),
    "mxfp8": recipes.get("mxfp8"),
}


def _step(x, w, b, recipe):
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    out = linear(x, w, b, recipe)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    out.backward(grad)
    return out.detach(), x.grad, w.grad


def _reference_and_kernel_steps(name, tokens, monkeypatch, x_dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, tokens // 2, 64, generator=g).to(x_dtype)
    x[0, 3, 5] = 40.0  # an outlier, so the blocks' scales differ
    w = torch.randn(96, 64, generator=g)
    b = torch.randn(96, generator=g)
    reference = _step(x, w, b, RECIPES[name])

    calls = []
    real = _library.use_kernels

    def on_cpu_too(t):
        calls.append(t.shape)
        return True

    monkeypatch.setattr(_library, "use_kernels", on_cpu_too)
    kernel = _step(x, w, b, RECIPES[name])
    monkeypatch.setattr(_library, "use_kernels", real)
    assert calls, "the kernel path was never taken"
    return reference, kernel


@pytest.mark.parametrize("tokens", [64, 40], ids=["one-read", "padded-tokens"])
@pytest.mark.parametrize("name", list(RECIPES))
def test_kernel_path_equals_reference_path(name, tokens, monkeypatch):
    monkeypatch.setattr(dispatch, "FUSED_GEMM", False)
    reference, kernel = _reference_and_kernel_steps(name, tokens, monkeypatch)
    for got, want, what in zip(kernel, reference, ("output", "grad_input", "grad_weight")):
        torch.testing.assert_close(got, want, atol=0, rtol=0, msg=f"{name}: {what} differs")


@pytest.mark.parametrize("fused_fp32", [False, True], ids=["fp32-cublas", "fp32-fused"])
@pytest.mark.parametrize("name", ["nvfp4", "mxfp8"])
def test_fused_gemm_in_the_step_matches_the_reference_path(name, fused_fp32, monkeypatch):
    """The step's BF16-output GEMMs run the fused kernel; its FP32 grad_weight (FP32 weights)
    runs it only where it has an alpha (NVFP4) and its contraction (the tokens) is at most
    FUSED_FP32_MAX_K, and cuBLAS's product (scaled in place) otherwise."""
    from blockscale.kernels import gemm

    monkeypatch.setattr(dispatch, "FUSED_FP32_MAX_K", 64 if fused_fp32 else 32)

    shapes = []
    real = gemm._launch_gemm

    def counted(a, b, *args):
        shapes.append((tuple(a.shape), tuple(b.shape)))
        return real(a, b, *args)

    monkeypatch.setattr(gemm, "_launch_gemm", counted)
    reference, kernel = _reference_and_kernel_steps(name, 40, monkeypatch)
    # output, grad_input, grad_weight (40 tokens padded to the block for grad_weight's operands)
    t = {"nvfp4": 48, "mxfp8": 64}[name]
    fused = [((40, 64), (96, 64)), ((40, 96), (64, 96))]
    # (MXFP8's FP32 output has no epilogue for the fused kernel to save: cuBLAS's is final)
    assert shapes == fused + ([((96, t), (64, t))] if fused_fp32 and name == "nvfp4" else [])
    # the same products; only the FP32 summation order may differ (one BF16 step at most)
    for got, want, what in zip(kernel, reference, ("output", "grad_input", "grad_weight")):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=2**-7, msg=f"{name}: {what}")


@pytest.mark.parametrize("max_k", [0, 64, 96])
def test_fp32_outputs_take_the_fused_kernel_up_to_fused_fp32_max_k(max_k, monkeypatch):
    """An FP32 input gives FP32 outputs to all three GEMMs (output: contraction 64, the input
    features; grad_input: 96, the output features; grad_weight: the 48 padded tokens). Each
    runs the fused kernel exactly when its contraction is at most FUSED_FP32_MAX_K, and the
    results match the reference path either way."""
    from blockscale.kernels import gemm

    monkeypatch.setattr(dispatch, "FUSED_FP32_MAX_K", max_k)
    contractions = []
    real = gemm._launch_gemm

    def counted(a, b, *args):
        contractions.append(a.shape[1])
        return real(a, b, *args)

    monkeypatch.setattr(gemm, "_launch_gemm", counted)
    reference, kernel = _reference_and_kernel_steps("nvfp4", 40, monkeypatch, torch.float32)
    assert all(t.dtype == torch.float32 for t in kernel)
    assert contractions == [k for k in (64, 96, 48) if k <= max_k]
    for got, want, what in zip(kernel, reference, ("output", "grad_input", "grad_weight")):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5, msg=f"{what}")


@pytest.mark.parametrize("name", ["nvfp4", "nvfp4_fwd_mxfp8_bwd", "mxfp8"])
def test_dq_only_activations_give_the_same_step(name, monkeypatch):
    """gemm/dispatch.py's DQ_ONLY_ACTIVATIONS in a linear: an emulated GEMM reads only an activation copy's
    `_dq`, so writing the forward's input copy along K and both grad_output copies without
    their codes gives the same output, grad_input and grad_weight bit for bit (stochastic
    rounding on, one seed); and the switch reaches the launches that make both copies of an
    activation from one read (NVFP4 and MXFP8; every recipe makes at least one)."""
    from blockscale import kernels as bk

    recipe = recipes.get(name)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 32, 64, generator=g).bfloat16()
    w = torch.randn(96, 64, generator=g)
    monkeypatch.setattr(_library, "use_kernels", lambda t: True)
    asked: list[bool] = []

    def spy(fn, codes_of):
        def call(*args, **kwargs):
            asked.append(codes_of(args, kwargs))
            return fn(*args, **kwargs)

        return call

    launchers = {  # (ops/quantize.py passes quantize_both_2d's codes as its 12th argument,
        # mxfp8_quantize_both_checked's as its 4th)
        "quantize_both_2d": lambda a, kw: a[11] if len(a) > 11 else kw.get("codes", True),
        "mxfp8_quantize_both": lambda a, kw: kw.get("codes", True),
        "mxfp8_quantize_both_checked": lambda a, kw: a[3] if len(a) > 3 else kw.get("codes", True),
    }
    for attr, codes_of in launchers.items():
        monkeypatch.setattr(bk, attr, spy(getattr(bk, attr), codes_of))
    steps = {}
    for dq_only in (False, True):
        monkeypatch.setattr(dispatch, "DQ_ONLY_ACTIVATIONS", dq_only)
        asked.clear()
        torch.manual_seed(5)
        steps[dq_only] = _step(x, w, None, recipe)
        assert asked and all(codes == (not dq_only) for codes in asked), asked
    for got, want in zip(steps[True], steps[False]):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_both_copies_without_codes_give_the_same_dq():
    """The launches that make both copies of an activation from one read, `codes=False`: each
    copy with its `_dq` is written as the `_dq` alone (data and scale empty), the `_dq` bits
    those of the full launch; a copy without its `_dq` keeps its codes."""
    from blockscale import kernels as bk

    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(2)).bfloat16()
    x[3, 5] = 40.0
    args = (x, False, True, False, True, True, None, None)
    for dq_col in (True, False):
        full = bk.quantize_both_2d(*args, True, dq_col, torch.Generator().manual_seed(4))
        bare = bk.quantize_both_2d(*args, True, dq_col, torch.Generator().manual_seed(4), False)
        assert bare[0].shape[0] == bare[1].shape[0] == 0 and full[0].shape[0] == 64
        torch.testing.assert_close(bare[2], full[2], atol=0, rtol=0)
        if dq_col:
            assert bare[4].shape[0] == bare[5].shape[0] == 0 and full[4].shape[0] == 96
            torch.testing.assert_close(bare[6], full[6], atol=0, rtol=0)
        else:
            torch.testing.assert_close(bare[4], full[4], atol=0, rtol=0)
    for dq in ((True, True), (True, False)):
        full = bk.mxfp8_quantize_both(x, return_dq=dq)
        bare = bk.mxfp8_quantize_both(x, return_dq=dq, codes=False)
        for (q_full, dq_full), (q_bare, dq_bare), want_dq in zip(full, bare, dq):
            assert q_bare.shape == q_full.shape
            if want_dq:
                assert q_bare.data.shape[0] == q_bare.scale.shape[0] == 0
                torch.testing.assert_close(dq_bare, dq_full, atol=0, rtol=0)
            else:
                assert torch.equal(q_bare.data.view(torch.uint8), q_full.data.view(torch.uint8))
