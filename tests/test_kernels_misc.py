"""Global amax, 16x16 nibble transpose and the 128x4 scale swizzle kernels, exact against
their references in formats/."""

import pytest
import torch

from blockscale import kernels
from blockscale.formats import hadamard, nvfp4, swizzle

ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (large shapes)")


def randn(*shape, seed=0, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=DEV).to(dtype)


def exact(a, b):
    torch.testing.assert_close(a, b, atol=0, rtol=0, equal_nan=True)


def hadamard_t_amax(x: torch.Tensor) -> torch.Tensor:
    return hadamard.transform(x.reshape(-1, x.shape[-1]).t()).float().abs().amax()


@pytest.mark.parametrize("shape", [(16, 16), (48, 96), (80, 48), (17, 33), (2, 16, 40)], ids=str)
def test_amax(shape):
    x = randn(*shape, seed=shape[-1])
    x.view(-1)[5] = -7.5  # the largest magnitude is negative
    exact(kernels.amax(x), x.float().abs().amax())
    exact(kernels.amax(x.float()), x.float().abs().amax())


@pytest.mark.parametrize("shape", [(16, 16), (48, 96), (80, 48), (2, 16, 40)], ids=str)
def test_fused_amax_plain_and_hadamard_columnwise(shape):
    x = randn(*shape, seed=shape[-1] + 1)
    plain, had = kernels.amax_fused(x)
    exact(plain, x.float().abs().amax())
    exact(had, hadamard_t_amax(x))
    exact(kernels.amax_hadamard_t(x), had)
    exact(had, nvfp4.quantize(x, hadamard=True, transpose=True).amax)


def test_amax_non_finite_and_zero():
    x = torch.zeros(32, 32, device=DEV)
    exact(kernels.amax(x), torch.tensor(0.0, device=DEV))
    x[3, 4] = -float("inf")
    exact(kernels.amax(x), torch.tensor(float("inf"), device=DEV))
    x[5, 6] = float("nan")
    assert kernels.amax(x).isnan()
    assert kernels.amax_fused(x)[1].isnan()


def test_amax_rejects_hadamard_rows():
    with pytest.raises(ValueError, match="multiple of 16"):
        kernels.amax_hadamard_t(torch.zeros(20, 32, device=DEV))


@pytest.mark.parametrize("shape", [(16, 16), (32, 96), (80, 48), (128, 32)], ids=str)
def test_transpose_16x16_is_exact(shape):
    x = randn(*shape, seed=shape[0])
    q = nvfp4.quantize(x, block="16x16")
    t = kernels.nvfp4_transpose_16x16(q)
    r = q.t()
    assert t.shape == r.shape and t.block == "16x16"
    exact(t.data, r.data)
    exact(t.scale.view(torch.uint8), r.scale.view(torch.uint8))
    # and it is the quantization of the transposed tensor
    qt = nvfp4.quantize(x.t().contiguous(), block="16x16", amax=q.amax)
    exact(t.data, qt.data)
    exact(t.scale.view(torch.uint8), qt.scale.view(torch.uint8))


def test_transpose_rejects_1x16():
    with pytest.raises(ValueError, match="16x16"):
        kernels.nvfp4_transpose_16x16(nvfp4.quantize(randn(16, 32)))


@pytest.mark.parametrize(
    "shape", [(1, 1), (5, 3), (128, 4), (130, 9), (256, 8), (300, 70)], ids=str
)
def test_swizzle_matches_to_blocked(shape):
    g = torch.Generator(device=DEV).manual_seed(shape[0])
    raw = torch.randint(0, 255, shape, generator=g, device=DEV, dtype=torch.uint8)
    for dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu):
        s = raw.view(dtype)
        out = kernels.swizzle_scales(s)
        assert out.dtype == dtype
        exact(out.view(torch.uint8), swizzle.to_blocked(s).view(torch.uint8))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape", [(8192, 5120), (14336, 16384)], ids=str)
def test_gpu_large(shape):
    x = randn(*shape, seed=1)
    plain, had = kernels.amax_fused(x)
    exact(plain, x.float().abs().amax())
    exact(had, hadamard_t_amax(x))
    q = nvfp4.quantize(x, block="16x16")
    t = kernels.nvfp4_transpose_16x16(q)
    exact(t.data, q.t().data)
    exact(t.scale.view(torch.uint8), q.t().scale.view(torch.uint8))
    s = q.scale
    exact(kernels.swizzle_scales(s).view(torch.uint8), swizzle.to_blocked(s).view(torch.uint8))


# ------------------------------------------------------------------- GEMM epilogue


def epilogue_inputs(m=40, n=300, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    acc = torch.randn(m, n, generator=g, device=DEV) * 3
    # BF16 rounding ties (halfway between two BF16 values, both parities), subnormals,
    # non-finite values and values that overflow after the product
    acc[0, :4] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-130], device=DEV)
    acc[1, :4] = torch.tensor([float("inf"), float("nan"), -0.0, 3e38], device=DEV)
    bias = torch.randn(n, generator=g, device=DEV)
    return acc, bias


AMAXES = {
    "no-alpha": None,
    "alpha": (3.5, 0.0390625),
    "zero-amax": (0.0, 7.0),
    "inf-amax": (float("inf"), 2.0),
    "nan-amax": (1.0, float("nan")),
}


@pytest.mark.parametrize("amax", list(AMAXES.values()), ids=list(AMAXES))
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_gemm_epilogue_rounds_like_the_reference(amax, with_bias):
    acc, bias = epilogue_inputs()
    bias = bias if with_bias else None
    a = None if amax is None else torch.tensor(amax, device=DEV)
    ref = acc.clone()
    if a is not None:  # the reference epilogue: alpha from formats' decode scales
        ref.mul_(nvfp4.decode_scale(a[0]) * nvfp4.decode_scale(a[1]))
    if bias is not None:
        ref.add_(bias)
    got = kernels.gemm_epilogue(acc, a, bias)
    want = ref.to(torch.bfloat16)
    assert got.dtype == torch.bfloat16
    # bit patterns (so -0.0 != 0.0), NaN where the reference is NaN (any payload)
    assert torch.equal(got.isnan(), want.isnan())
    finite = ~want.isnan()
    exact(got.view(torch.int16)[finite], want.view(torch.int16)[finite])
    in_place = kernels.gemm_epilogue(acc.clone(), a, bias, out_dtype=torch.float32)
    exact(in_place, ref)


def test_gemm_epilogue_writes_into_a_row_slice():
    acc, bias = epilogue_inputs(m=24, n=64, seed=1)
    acc[1, :4] = 1.0  # finite everywhere here
    amax = torch.tensor([2688.0, 1344.0], device=DEV)  # S_dec = 1 and 0.5: alpha = 0.5
    out = torch.full((40, 64), 7.0, dtype=torch.bfloat16, device=DEV)
    kernels.gemm_epilogue(acc, amax, bias, out=out[8:32])
    exact(out[8:32], (acc * 0.5 + bias).to(torch.bfloat16))
    assert (out[:8] == 7).all() and (out[32:] == 7).all()


def test_gemm_epilogue_rejects_bad_arguments():
    acc = torch.zeros(4, 8, device=DEV)
    with pytest.raises(ValueError, match="FP32"):
        kernels.gemm_epilogue(acc.bfloat16())
    with pytest.raises(ValueError, match="bias must be"):
        kernels.gemm_epilogue(acc, bias=torch.zeros(3, device=DEV))
    with pytest.raises(ValueError, match="two operands"):
        kernels.gemm_epilogue(acc, amax=torch.ones(1, device=DEV))
    with pytest.raises(ValueError, match="out must be"):
        kernels.gemm_epilogue(acc, out=torch.zeros(4, 8, dtype=torch.float16, device=DEV))


def test_gemm_epilogue_op_schema():
    acc, bias = epilogue_inputs(m=16, n=32, seed=2)
    out = torch.empty(16, 32, dtype=torch.bfloat16, device=DEV)
    one = torch.ones((), device=DEV)
    args = (acc, one, one, bias, out)
    utils = ("test_schema", "test_faketensor") if ON_GPU else ("test_schema",)
    torch.library.opcheck(torch.ops.blockscale.gemm_epilogue, args, test_utils=utils)
