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
