"""The emulated block-scaled GEMM against an FP64 reference built from the scalar model.

Tolerances. The `_dq` products are exact in FP32 (at most 6 significant bits per operand),
so the only roundings are the FP32 accumulation, alpha = fl(S_dec_a * S_dec_b) and the final
acc * alpha. Any summation order of K terms errs by at most gamma_K ~ K u (u = 2^-24) times
sum |a||b|, so |out - ref| <= (K + 3) u * alpha * (|a_dq| @ |b_dq|.T) holds whatever the order
(first order in u). In practice the partial sums are mostly exact too (the products have <= 12
significant bits), so the normwise relative error max|out - ref| / max|ref| stays near a few u:
NUMERICS.md's "within ~1e-6 relative" is asserted as that.
"""

import numpy as np
import pytest
import torch

from blockscale import mxfp8, nvfp4
from blockscale.gemm import emulated
from tests import reference_scalar as ref

U32 = 2.0**-24
SHAPES = [(1, 1, 16), (7, 5, 32), (33, 17, 64), (3, 129, 128), (64, 48, 256), (65, 31, 512)]


def exact(a: torch.Tensor, b, **kw) -> None:
    torch.testing.assert_close(a, torch.as_tensor(b).to(a.dtype), atol=0, rtol=0, **kw)


def randn(*shape, seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def nvfp4_dq(m: ref.NVFP4Ref) -> np.ndarray:
    return np.vectorize(ref.e2m1_value)(m.codes) * np.repeat(m.scales, 16, axis=1)


def nvfp4_reference(a: torch.Tensor, b: torch.Tensor, block_a="1x16", block_b="1x16"):
    ma, mb = ref.nvfp4_quantize(a.numpy(), block_a), ref.nvfp4_quantize(b.numpy(), block_b)
    return ref.gemm_fp64_blocked(nvfp4_dq(ma), nvfp4_dq(mb), ma.s_dec * mb.s_dec)


def assert_within_fp32_accumulation(out: torch.Tensor, expected, magnitude, k: int) -> None:
    err = np.abs(out.double().numpy() - expected)
    assert (err <= (k + 3) * U32 * magnitude).all(), err.max()
    assert err.max() <= 1e-6 * np.abs(expected).max(), err.max() / np.abs(expected).max()


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_nvfp4_fp32_output_vs_fp64_reference(m, n, k):
    a = randn(m, k, seed=m * 7 + k) * 3
    b = randn(n, k, seed=n * 11 + k) * 0.01
    out = emulated.scaled_mm(nvfp4.quantize(a), nvfp4.quantize(b))
    assert out.dtype == torch.float32 and out.shape == (m, n)
    expected, magnitude = nvfp4_reference(a, b)
    assert_within_fp32_accumulation(out, expected, magnitude, k)


@pytest.mark.parametrize("m,n,k", [(5, 3, 32), (31, 65, 128), (64, 48, 256)])
def test_mxfp8_fp32_output_vs_fp64_reference(m, n, k):
    a = randn(m, k, seed=m + k) * torch.pow(2.0, torch.arange(k) % 11 - 5.0)
    b = randn(n, k, seed=n + 2 * k) * 1e-3
    out = emulated.scaled_mm(mxfp8.quantize(a), mxfp8.quantize(b))
    ma, mb = ref.mxfp8_quantize(a.numpy()), ref.mxfp8_quantize(b.numpy())
    a_dq = ma.data * np.repeat(2.0**ma.exponents, 32, axis=1)
    b_dq = mb.data * np.repeat(2.0**mb.exponents, 32, axis=1)
    expected, magnitude = ref.gemm_fp64_blocked(a_dq, b_dq, 1.0, block=32)
    assert_within_fp32_accumulation(out, expected, magnitude, k)


def test_exact_when_no_sum_rounds():
    # Grid values with a 6 in every block: S_enc = 448, scales 448, codes are the values.
    # The products are multiples of 448^2 / 4 and the sums stay far below 2^24 such steps,
    # so the FP32 accumulator is exact and out = fl(acc * fl(S_dec_a * S_dec_b)) bit for bit.
    g = torch.Generator().manual_seed(1)
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -1, -1.5, -2, -3, -4, -6])
    a = grid[torch.randint(0, 15, (9, 64), generator=g)]
    b = grid[torch.randint(0, 15, (11, 64), generator=g)]
    a[:, ::16], b[:, ::16] = 6.0, -6.0
    out = emulated.scaled_mm(nvfp4.quantize(a), nvfp4.quantize(b))
    acc = (a.double() @ b.double().t()) * 448.0**2
    s_dec = np.float32(1) / np.float32(448)
    alpha = np.float32(s_dec * s_dec)
    expected = (acc.numpy().astype(np.float32) * alpha).astype(np.float32)
    assert np.array_equal(acc.numpy().astype(np.float32).astype(np.float64), acc.numpy())
    exact(out, torch.from_numpy(expected))
    exact(emulated.alpha(nvfp4.quantize(a), nvfp4.quantize(b)), alpha)


def test_alpha_is_the_product_of_decode_scales():
    a, b = randn(2, 32, seed=2) * 5, randn(3, 32, seed=3) * 1e-4
    ma, mb = ref.nvfp4_quantize(a.numpy()), ref.nvfp4_quantize(b.numpy())
    expected = np.float32(np.float32(ma.s_dec) * np.float32(mb.s_dec))
    exact(emulated.alpha(nvfp4.quantize(a), nvfp4.quantize(b)), expected)
    exact(emulated.alpha(mxfp8.quantize(a), mxfp8.quantize(b)), 1.0)


def test_16x16_weight_serves_forward_and_dgrad():
    # output = input @ weight.T with weight 16x16; grad_input = grad_output @ weight uses the
    # exact transpose of the same quantized weight.
    x, w, go = randn(17, 64, seed=4), randn(48, 64, seed=5) * 0.1, randn(17, 48, seed=6)
    qw = nvfp4.quantize(w, block="16x16")
    out = emulated.scaled_mm(nvfp4.quantize(x), qw)
    expected, magnitude = nvfp4_reference(x, w, block_b="16x16")
    assert_within_fp32_accumulation(out, expected, magnitude, 64)

    grad_input = emulated.scaled_mm(nvfp4.quantize(go), qw.t())
    mg, mw = ref.nvfp4_quantize(go.numpy()), ref.nvfp4_quantize(w.numpy(), "16x16")
    expected, magnitude = ref.gemm_fp64_blocked(nvfp4_dq(mg), nvfp4_dq(mw).T, mg.s_dec * mw.s_dec)
    assert_within_fp32_accumulation(grad_input, expected, magnitude, 48)


@pytest.mark.parametrize("dtype,u", [(torch.bfloat16, 2.0**-8), (torch.float16, 2.0**-11)])
def test_low_precision_output(dtype, u):
    # One more rounding, to the output format: relative error <= u (2^-8 for BF16's 8
    # significant bits, 2^-11 for FP16's 11; values here are FP16 normals), plus the FP32 bound.
    a, b = randn(13, 64, seed=7), randn(9, 64, seed=8)
    out = emulated.scaled_mm(nvfp4.quantize(a), nvfp4.quantize(b), out_dtype=dtype)
    assert out.dtype == dtype
    expected, magnitude = nvfp4_reference(a, b)
    err = np.abs(out.double().numpy() - expected)
    assert (err <= u * np.abs(expected) * (1 + 1e-6) + 67 * U32 * magnitude).all()


def test_zero_operand_gives_zeros():
    out = emulated.scaled_mm(nvfp4.quantize(torch.zeros(4, 32)), nvfp4.quantize(randn(5, 32)))
    exact(out, torch.zeros(4, 5))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("side", ["a", "b"])
def test_nvfp4_non_finite_operand_gives_all_nan(bad, side):
    a, b = randn(6, 32, seed=9), randn(5, 32, seed=10)
    (a if side == "a" else b)[2, 7] = bad
    out = emulated.scaled_mm(nvfp4.quantize(a), nvfp4.quantize(b), out_dtype=torch.bfloat16)
    assert torch.isnan(out).all()


def test_mxfp8_non_finite_block_gives_nan_rows():
    a, b = randn(6, 64, seed=11), randn(5, 64, seed=12)
    a[2, 40] = float("inf")
    out = emulated.scaled_mm(mxfp8.quantize(a), mxfp8.quantize(b))
    assert torch.isnan(out[2]).all()
    keep = torch.arange(6) != 2
    assert torch.isfinite(out[keep]).all()


def test_bad_operands_raise():
    qa, qb = nvfp4.quantize(randn(4, 32)), nvfp4.quantize(randn(5, 64))
    with pytest.raises(ValueError, match="share a format"):
        emulated.scaled_mm(qa, mxfp8.quantize(randn(5, 32)))
    with pytest.raises(ValueError, match=r"contraction dims differ: a is \(4, 32\)"):
        emulated.scaled_mm(qa, qb)
    with pytest.raises(ValueError, match="2-D operands"):
        emulated.scaled_mm(nvfp4.quantize(randn(2, 4, 32)), qa)
    with pytest.raises(ValueError, match="out_dtype torch.float64"):
        emulated.scaled_mm(qa, qa, out_dtype=torch.float64)
