"""The 16x16 random Hadamard transform: the matrix, its orthogonality, BF16 rounding."""

import numpy as np
import pytest
import torch

from blockscale import hadamard, nvfp4
from blockscale.formats.hadamard import sylvester
from tests import reference_scalar as ref

U32 = 2.0**-24  # FP32 unit roundoff


def exact(a: torch.Tensor, b, **kw) -> None:
    torch.testing.assert_close(a, torch.as_tensor(b).to(a.dtype), atol=0, rtol=0, **kw)


def randn(*shape, seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_sylvester_entries():
    # Sylvester's H16[i, j] = (-1)^popcount(i & j).
    expected = [[(-1) ** bin(i & j).count("1") for j in range(16)] for i in range(16)]
    exact(sylvester(16), expected)
    exact(sylvester(2), [[1, 1], [1, -1]])


def test_matrix_is_quarter_signed_sylvester():
    s = hadamard.DEFAULT_SIGNS
    assert s == (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
    expected = [[0.25 * s[i] * (-1) ** bin(i & j).count("1") for j in range(16)] for i in range(16)]
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        exact(hadamard.matrix(dtype=dtype), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_h_times_h_transpose_is_identity(dtype):
    # Entries +-1/4: every product is +-1/16 and every sum of 16 is exact.
    h = hadamard.matrix(dtype=dtype)
    exact(h @ h.t(), torch.eye(16, dtype=dtype))
    exact(h.t() @ h, torch.eye(16, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_transform_matches_exact_sum_rounded_to_fp32_then_bf16(dtype):
    x = (randn(6, 64, seed=1) * torch.pow(2.0, torch.arange(6) * 3 - 8.0)[:, None]).to(dtype)
    y = hadamard.transform(x)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    exact(y.float(), torch.from_numpy(ref.hadamard(x.float().numpy())))


def test_transform_keeps_leading_dims_and_custom_signs():
    signs = tuple(1 if i % 3 else -1 for i in range(16))
    x = randn(2, 3, 32, seed=2)
    y = hadamard.transform(x, signs)
    assert y.shape == (2, 3, 32)
    exact(y.reshape(6, 32).float(), torch.from_numpy(ref.hadamard(x.reshape(6, 32).numpy(), signs)))


def test_wgrad_product_unchanged_exactly_on_small_integers():
    # Small integers: x16 @ H is a multiple of 1/4 below 2^5, exact in BF16, so the transformed
    # product is computed without any rounding and must equal A @ B.T exactly.
    g = torch.Generator().manual_seed(3)
    a = torch.randint(-3, 4, (24, 64), generator=g).float()
    b = torch.randint(-3, 4, (40, 64), generator=g).float()
    ah, bh = hadamard.transform(a).float(), hadamard.transform(b).float()
    exact(ah @ bh.t(), a @ b.t())


def test_wgrad_product_unchanged_within_fp32_rounding():
    # (A Hb)(B Hb)^T with Hb = blockdiag(H) in FP32 against A B^T in FP64. Each FP32 matmul of
    # length n errs by at most gamma_n = n u / (1 - n u) times |.| @ |.| (u = 2^-24): here
    # n = 16 for each transform and T for the product. |Hb| |Hb|^T = J (ones on each 16x16
    # diagonal block), so the total error is below (T + 32 + 1) u * (|A| J |B|^T) (first order,
    # the +1 for the FP64 reference's own rounding).
    t = 96
    a, b = randn(24, t, seed=4), randn(40, t, seed=5)
    hb = torch.block_diag(*[hadamard.matrix()] * (t // 16))
    got = ((a @ hb) @ (b @ hb).t()).double()
    expected = a.double() @ b.double().t()
    j = torch.block_diag(*[torch.ones(16, 16, dtype=torch.float64)] * (t // 16))
    bound = (t + 33) * U32 * (a.double().abs() @ j @ b.double().abs().t())
    assert ((got - expected).abs() <= bound).all()
    assert not torch.equal(got, expected)  # the check is not vacuous: rounding did happen


def test_rht_output_is_rounded_to_bf16_before_quantization():
    # y (the transformed block) holds 6 and 2.5 + 2^-10. In FP32, 2.5 + 2^-10 rounds up to 3
    # (code 5); rounded to BF16 first it is the tie 2.5, which goes to the even code 2 (4).
    # x = y @ H^T is exact in FP32, and x @ H = y exactly since H H^T = I.
    y = torch.zeros(1, 16, dtype=torch.float64)
    y[0, 0], y[0, 1] = 6.0, 2.5 + 2.0**-10
    x = (y @ hadamard.matrix(dtype=torch.float64).t()).float()
    exact(x.double() @ hadamard.matrix(dtype=torch.float64), y)
    q = nvfp4.quantize(x, hadamard=True)
    exact(q.amax, 6.0)
    assert q.codes()[0, :2].tolist() == [7, 4]
    exact(q.dequantize()[0, 1], 2.0)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="not a power of two"):
        sylvester(12)
    with pytest.raises(ValueError, match="signs must be 16 values"):
        hadamard.matrix(signs=(1,) * 15)
    with pytest.raises(ValueError, match="signs must be 16 values"):
        hadamard.matrix(signs=(1,) * 15 + (2,))
    with pytest.raises(ValueError, match=r"last dim \(24,\) is not a multiple of 16"):
        hadamard.transform(torch.zeros(2, 24))


def test_non_finite_input_propagates():
    x = randn(2, 32, seed=6)
    x[0, 3] = float("inf")
    y = hadamard.transform(x).float()
    assert not torch.isfinite(y[0, :16]).any()
    assert torch.isfinite(y[0, 16:]).all() and torch.isfinite(y[1]).all()
    np.testing.assert_array_equal(
        y[1].numpy(), ref.hadamard(x[1:].numpy())[0]
    )  # other blocks untouched


def _fp32_bit_patterns() -> torch.Tensor:
    """2^16 random FP32 bit patterns and the edges of BF16 rounding: ties to even either
    way, the largest finite value (rounds to Inf), +-Inf, NaNs (one that a carry would turn
    into Inf), signed zeros, subnormals."""
    g = torch.Generator().manual_seed(7)
    bits = torch.randint(-(2**31), 2**31, (1 << 16,), dtype=torch.int64, generator=g)
    edges = [0x3F808000, 0x3F818000, 0x3F808001, 0x7F7FFFFF, 0x7F800000, 0xFF800000,
             0x7FC00000, 0x7F800001, 0xFFFFFFFF, 0x00000000, 0x80000000, 0x00008000,
             0x00018000, 0x807FFFFF]  # fmt: skip
    edges = torch.tensor(edges, dtype=torch.int64)
    signed = torch.where(edges >= 2**31, edges - 2**32, edges)
    return torch.cat([bits, signed]).to(torch.int32).view(torch.float32)


def _assert_same_bf16(got: torch.Tensor, want: torch.Tensor) -> None:
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_bf16_values_equal_the_bfloat16_cast(compiled):
    # hadamard.transform rounds through integer ops (bf16_values) because torch 2.11's CPU
    # Inductor drops a BF16 round trip inside a fused kernel; the values must be the cast's.
    from blockscale.formats.hadamard import bf16_values
    from blockscale.ops.linear import EXACT_INDUCTOR_OPTIONS

    y = _fp32_bit_patterns()
    fn = torch.compile(bf16_values, options=EXACT_INDUCTOR_OPTIONS) if compiled else bf16_values
    got = fn(y)
    assert got.dtype == torch.float32
    _assert_same_bf16(got.to(torch.bfloat16), y.to(torch.bfloat16))


def test_compiled_hadamard_quantization_equals_eager():
    # Under torch 2.11 on the CPU this differed in 94% of the codes before bf16_values: the
    # compiled reference took its amax and codes from the transform before BF16 rounding.
    from blockscale.ops.linear import EXACT_INDUCTOR_OPTIONS

    x = randn(64, 256, seed=8) * torch.rand(64, 256, generator=torch.Generator().manual_seed(9))

    def quantized(x):
        q = nvfp4.quantize(x * 10, hadamard=True)
        return q.data, q.scale.view(torch.uint8), q.amax

    want = quantized(x)
    got = torch.compile(quantized, options=EXACT_INDUCTOR_OPTIONS)(x)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
