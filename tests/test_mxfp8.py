"""MXFP8: power-of-two scale edges, E4M3 data rounding, layouts, non-finite and bad input."""

import numpy as np
import pytest
import torch

from blockscale import mxfp8
from tests import reference_scalar as ref


def exact(a: torch.Tensor, b, **kw) -> None:
    torch.testing.assert_close(a, torch.as_tensor(b).to(a.dtype), atol=0, rtol=0, **kw)


def randn(*shape, seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def nudge(x: float, up: bool) -> float:
    return float(np.nextafter(np.float32(x), np.float32(np.inf if up else -np.inf)))


def assert_matches_model(m: mxfp8.MXFP8Tensor, x2d: torch.Tensor) -> None:
    r = ref.mxfp8_quantize(x2d.float().numpy())
    rows, cols = x2d.shape
    codes = torch.from_numpy(np.where(r.exponents == 128, 255, r.exponents + 127))
    exact(m.scale.view(torch.uint8).reshape(rows, cols // 32), codes.to(torch.uint8))
    # The data of a NaN-scaled block is unspecified (it decodes to NaN whatever it holds).
    finite = torch.from_numpy(np.isfinite(r.data))
    exact(m.data.float().reshape(rows, cols)[finite], torch.from_numpy(r.data).float()[finite])
    exact(m.dequantize().reshape(rows, cols), torch.from_numpy(r.deq), equal_nan=True)


def test_power_of_two_amax_gives_exact_exponent():
    # block_amax = 448 * 2^k must give e = k (E8M0 code k + 127) and the max element 448.
    ks = list(range(-20, 21))
    x = torch.zeros(len(ks), 32)
    for r, k in enumerate(ks):
        x[r, r % 32] = 448.0 * 2.0**k
        x[r, (r + 1) % 32] = -(2.0**k)
    m = mxfp8.quantize(x)
    exact(m.scale.view(torch.uint8)[:, 0], torch.tensor([k + 127 for k in ks], dtype=torch.uint8))
    exact(
        m.data.float()[torch.arange(len(ks)), torch.arange(len(ks)) % 32], torch.full((41,), 448.0)
    )
    exact(m.dequantize(), x)
    assert_matches_model(m, x)


@pytest.mark.parametrize("k", [-20, -1, 0, 1, 7, 20])
def test_just_above_and_below_a_power_of_two(k):
    # Just above 448 * 2^k the scale must round up to 2^(k+1) (never saturate); just below
    # it stays 2^k.
    x = torch.zeros(2, 32)
    x[0, 3] = nudge(448.0 * 2.0**k, up=True)
    x[1, 3] = nudge(448.0 * 2.0**k, up=False)
    m = mxfp8.quantize(x)
    exact(m.scale.view(torch.uint8)[:, 0], torch.tensor([k + 128, k + 127], dtype=torch.uint8))
    assert_matches_model(m, x)


def test_zero_and_tiny_blocks():
    x = torch.zeros(4, 64)
    x[1, 32:] = 1e-39  # subnormal FP32: e = ceil(log2(1e-39/448)) = -138, clamped to -127
    x[2, 5] = 1e-45  # the product with fl(1/448) underflows to 0: e = -127
    x[3, 40] = -0.0
    m = mxfp8.quantize(x)
    exact(m.scale.view(torch.uint8), torch.zeros(4, 2, dtype=torch.uint8))  # all 2^-127
    exact(m.data.float()[0], torch.zeros(64))
    # 1e-39 * 2^127 = 0.17014... -> E4M3 11 * 2^-6 (spacing 2^-6 in [0.125, 0.25))
    exact(m.data.float()[1, 32], 0.171875)
    assert_matches_model(m, x)


def test_huge_values():
    x = randn(2, 64, seed=1) * 1e37
    x[0, 0] = 3.4e38  # e = ceil(log2(3.4e38 / 448)) = 120
    m = mxfp8.quantize(x)
    assert m.scale.view(torch.uint8)[0, 0] == 120 + 127
    assert_matches_model(m, x)


def test_e4m3_data_rounding_and_subnormals():
    # With amax 448 (e = 0) the data is e4m3(x) itself: ties and subnormals by hand.
    vals = [448.0, 432.0, 248.0, 3 * 2.0**-10, 2.0**-10, nudge(2.0**-10, True), 2.0**-9, 1e-6]
    expected = [448.0, 448.0, 256.0, 2.0**-8, 0.0, 2.0**-9, 2.0**-9, 0.0]
    x = torch.zeros(1, 32)
    x[0, : len(vals)] = torch.tensor(vals)
    x[0, 16 : 16 + len(vals)] = -torch.tensor(vals)
    m = mxfp8.quantize(x)
    assert m.scale.view(torch.uint8)[0, 0] == 127
    exact(m.data.float()[0, : len(vals)], expected)
    exact(m.data.float()[0, 16 : 16 + len(vals)], [-v for v in expected])
    assert_matches_model(m, x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_random_matches_model(dtype):
    x = randn(24, 96, seed=2) * torch.pow(2.0, torch.arange(24) % 9 - 4.0)[:, None]
    x = x.to(dtype)
    m = mxfp8.quantize(x)
    assert m.data.dtype == torch.float8_e4m3fn and m.scale.dtype == torch.float8_e8m0fnu
    assert_matches_model(m, x.float())


def test_layouts_3d_transpose_non_contiguous():
    x = randn(2, 32, 64, seed=3)
    m = mxfp8.quantize(x)
    assert m.shape == (2, 32, 64) and m.data.shape == (2, 32, 64) and m.scale.shape == (2, 32, 2)
    assert_matches_model(m, x.reshape(64, 64))
    mt = mxfp8.quantize(x, transpose=True)
    assert mt.shape == (64, 64) and mt.scale.shape == (64, 2)
    assert_matches_model(mt, x.reshape(64, 64).t())
    base = randn(64, 128, seed=4)
    for view in (base[:, ::2], base.t()):
        assert not view.is_contiguous()
        assert_matches_model(mxfp8.quantize(view), view.contiguous())
        assert_matches_model(mxfp8.quantize(view, transpose=True), view.t().contiguous())


def test_dq_is_exact_in_bfloat16():
    x = randn(8, 64, seed=5) * 1e-3
    m = mxfp8.quantize(x)
    exact(m.dq(torch.bfloat16).float(), m.dequantize())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_block_dequantizes_to_nan(bad):
    # MXFP8 has no tensor scale: the block holding the Inf/NaN gets the E8M0 NaN code (255)
    # and decodes to NaN; the other blocks are unaffected.
    x = randn(2, 64, seed=6)
    x[1, 40] = bad
    m = mxfp8.quantize(x)
    assert m.scale.view(torch.uint8)[1, 1] == 255
    assert torch.isnan(m.dequantize()[1, 32:]).all()
    assert torch.isfinite(m.dequantize()[:, :32]).all() and torch.isfinite(m.dequantize()[0]).all()
    assert_matches_model(m, x)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64])
def test_wrong_dtype_raises(dtype):
    with pytest.raises(ValueError, match=f"dtype {dtype} is not supported: MXFP8"):
        mxfp8.quantize(torch.zeros(4, 32, dtype=dtype))


def test_k_not_a_multiple_of_32_raises():
    with pytest.raises(ValueError, match="K=48 is not a multiple of 32"):
        mxfp8.quantize(torch.zeros(4, 48))
    with pytest.raises(ValueError, match="K=16 is not a multiple of 32"):
        mxfp8.quantize(torch.zeros(16, 64), transpose=True)


@pytest.mark.parametrize("shape", [(0, 32), (3, 0), (2, 0, 64)])
def test_empty_tensors(shape):
    m = mxfp8.quantize(torch.zeros(shape))
    assert m.data.shape == shape and m.scale.shape == (*shape[:-1], shape[-1] // 32)
    assert m.dequantize().shape == shape
