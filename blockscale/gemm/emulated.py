"""Exact emulation of block-scaled GEMMs on any device.

out = a @ b.T * alpha, with a [M, K] and b [N, K] both quantized along K (every GEMM operand
is K-major). The `_dq` operands (code * block scale) are exact in BF16, so a BF16 tensor-core
GEMM with FP32 accumulation equals the Blackwell block-scaled GEMM up to the order of the
FP32 additions. alpha carries the NVFP4 global scales (S_dec_a * S_dec_b; 1 for MXFP8) and is
applied to the FP32 accumulator before the cast to the output dtype.

On CUDA the product is torch.mm with out_dtype=float32 (BF16 inputs, FP32 accumulate and
output). CPUs have no such kernel, so there the exact BF16 operands are widened to FP32 and
multiplied in FP32: the same products, still exact, with FP32 accumulation.
"""

import torch

from blockscale._registry import library_op
from blockscale.formats.mxfp8 import MXFP8Tensor
from blockscale.formats.nvfp4 import NVFP4Tensor

QuantizedTensor = NVFP4Tensor | MXFP8Tensor
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_hadamard_pairing(a_hadamard: bool, b_hadamard: bool) -> None:
    """Both operands of a GEMM carry the Hadamard transform along K, or neither does: the
    transform cancels, (A H)(B H)^T = A B^T, only in pairs; one alone gives A H B^T, a
    different product with no error to show for it. Reads flags only (no device sync)."""
    if a_hadamard != b_hadamard:
        raise ValueError(
            f"a Hadamard-transformed operand pairs only with another one: a has "
            f"hadamard={a_hadamard}, b has hadamard={b_hadamard} (the transform cancels in "
            "a @ b.T only when both carry it)"
        )


def _check_operands(a: QuantizedTensor, b: QuantizedTensor) -> None:
    if type(a) is not type(b):
        raise ValueError(
            f"both operands must share a format, got {type(a).__name__} and {type(b).__name__}"
        )
    check_hadamard_pairing(getattr(a, "hadamard", False), getattr(b, "hadamard", False))
    if len(a.shape) != 2 or len(b.shape) != 2:
        raise ValueError(
            f"scaled_mm takes 2-D operands, got shapes {tuple(a.shape)} and {tuple(b.shape)}"
        )
    if a.shape[1] != b.shape[1]:
        raise ValueError(
            f"contraction dims differ: a is {tuple(a.shape)}, b is {tuple(b.shape)} (both [*, K])"
        )


def alpha(a: QuantizedTensor, b: QuantizedTensor) -> torch.Tensor:
    """The FP32 scalar the accumulator is multiplied by: S_dec_a * S_dec_b, or 1 for MXFP8."""
    if isinstance(a, NVFP4Tensor):
        return a.global_decode_scale() * b.global_decode_scale()
    return torch.ones((), dtype=torch.float32, device=a.data.device)


@library_op("blockscale::mm_fp32_accumulate")
def _mm_fp32_accumulate(a_dq: torch.Tensor, b_dq: torch.Tensor) -> torch.Tensor:
    if a_dq.is_cuda:
        return torch.mm(a_dq, b_dq.t(), out_dtype=torch.float32)
    return a_dq.float() @ b_dq.float().t()


@_mm_fp32_accumulate.op.register_fake
def _(a_dq: torch.Tensor, b_dq: torch.Tensor) -> torch.Tensor:
    return a_dq.new_empty((a_dq.shape[0], b_dq.shape[0]), dtype=torch.float32)


def mm_fp32_accumulate(a_dq: torch.Tensor, b_dq: torch.Tensor) -> torch.Tensor:
    """a_dq @ b_dq.T of exact BF16 operands with FP32 accumulation, FP32 result.

    A torch.library op under torch.compile, so that Inductor keeps this exact call instead of
    lowering it to a GEMM of its own with another summation order (compiled == eager)."""
    return _mm_fp32_accumulate(a_dq, b_dq)


def scaled_mm(
    a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """a @ b.T * alpha for two NVFP4 (or two MXFP8) operands; FP32, BF16 or FP16 output."""
    _check_operands(a, b)
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype {out_dtype} is not one of {OUT_DTYPES}")
    acc = mm_fp32_accumulate(a.dq(), b.dq())
    return (acc * alpha(a, b)).to(out_dtype)
