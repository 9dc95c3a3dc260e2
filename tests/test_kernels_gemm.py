"""The fused GEMM + epilogue kernel (kernels/gemm.py, experimental, not yet in the dispatch)
against the emulated backend's GEMM and epilogue.

Operands hold small integers times powers of two, so every FP32 partial sum is exact and the
GEMM's summation order cannot matter: the fused kernel must then equal cuBLAS / CPU matmul +
gemm_epilogue bit for bit, which checks its epilogue's roundings (alpha product, bias add,
BF16 rounding) and its tiling, masking and strides. CPU: Triton's interpreter, small and
odd shapes; GPU (marker gpu): the step's layouts at a larger shape.
"""

import pytest
import torch

from blockscale import kernels
from blockscale.gemm import emulated
from blockscale.kernels.gemm import gemm_fused

ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"
SMALL = (32, 32, 32, 4, 4, 1)


def exact_operand(rows, cols, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    ints = torch.randint(-7, 8, (rows, cols), generator=g, device=DEV).float()
    # dtype of the GEMM operands: BF16 on the GPU; FP32 in the interpreter (dot_in_fp32)
    return (ints * 0.25).to(torch.bfloat16 if ON_GPU else torch.float32)


def reference(a, b, amax, bias, out_dtype):
    acc = emulated.mm_fp32_accumulate(a, b)
    return kernels.gemm_epilogue(acc, amax, bias, out_dtype=out_dtype)


@pytest.mark.parametrize("shape", [(40, 96, 72), (64, 32, 33), (1, 48, 16)], ids=str)
@pytest.mark.parametrize("transposed_b", [False, True], ids=["b-k-major", "b-transposed-view"])
def test_fused_gemm_equals_gemm_then_epilogue(shape, transposed_b):
    m, k, n = shape
    a = exact_operand(m, k, 0)
    b = exact_operand(k, n, 1).t() if transposed_b else exact_operand(n, k, 1)
    amax = torch.tensor([3.5, 0.04], device=DEV)
    bias = torch.randn(n, generator=torch.Generator(device=DEV).manual_seed(2), device=DEV)
    for am, bi in ((amax, bias), (None, None), (amax, None)):
        for out_dtype in (torch.bfloat16, torch.float32):
            got = gemm_fused(a, b, am, bi, out_dtype=out_dtype, config=SMALL)
            want = reference(a, b, am, bi, out_dtype)
            assert got.dtype == out_dtype
            torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_fused_gemm_rejects_bad_shapes():
    with pytest.raises(ValueError, match="need a"):
        gemm_fused(torch.zeros(4, 8, device=DEV), torch.zeros(4, 16, device=DEV))
    with pytest.raises(ValueError, match="out_dtype"):
        gemm_fused(torch.zeros(4, 8, device=DEV), torch.zeros(4, 8, device=DEV),
                   out_dtype=torch.float16)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (default tile config, large shape)")
@pytest.mark.parametrize("transposed_b", [False, True], ids=["b-k-major", "b-transposed-view"])
def test_gpu_fused_gemm_default_config(transposed_b):
    m, k, n = 1000, 1024, 768
    a = exact_operand(m, k, 3)
    b = exact_operand(k, n, 4).t() if transposed_b else exact_operand(n, k, 4)
    amax = torch.tensor([2.0, 9.0], device=DEV)
    bias = torch.randn(n, device=DEV)
    torch.testing.assert_close(
        gemm_fused(a, b, amax, bias), reference(a, b, amax, bias, torch.bfloat16), atol=0, rtol=0
    )
