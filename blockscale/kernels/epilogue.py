"""The emulated GEMM's epilogue in one pass: out = cast(acc * alpha + bias).

The emulated block-scaled GEMM (gemm/dispatch.py) leaves an FP32 accumulator; the reference
then runs `acc.mul_(alpha)`, `acc.add_(bias)` and `acc.to(out_dtype)`: three passes over the
FP32 tensor (read + write, read + write, read + narrow write). This kernel reads it once and
writes the output once, with the same roundings in the same order: the product rounded to
FP32, then the sum rounded to FP32, then round-to-nearest-even to BF16.

alpha = S_dec_a * S_dec_b is computed in the kernel from the two NVFP4 tensor amaxes, in the
reference's operation order (formats/nvfp4.py decode_scale: IEEE divisions, NaN for a
non-finite amax). Computing it here rather than with PyTorch ops keeps it out of Inductor's
reach: compiled, `1 / S_enc` was lowered to a reciprocal that differs in the last bit.

The product is written as PTX `mul.rn.f32` on the GPU so that the compiler cannot contract
`acc * alpha + bias` into one FMA (which would skip the product's rounding and change the
bits); Triton's interpreter evaluates the two operations separately anyway. BF16 is stored
through an int16 view of its bits (the interpreter's BF16 cast truncates).

Bytes: read 4 per element, write 2 (BF16) or 4 (FP32), plus the [N] bias.
"""

import torch
import triton
import triton.language as tl

from blockscale._registry import library_op
from blockscale.kernels._common import (
    abs_bits,
    cdiv,
    interpreting,
    nvfp4_global,
    to_bf16_bits,
)
from blockscale.kernels._launch import launch

OUT_DTYPES = (torch.bfloat16, torch.float32)
# The GEMM epilogues' rounding of FP32 to a BF16 output (this kernel's, kernels/gemm.py's and
# kernels/grouped_gemm.py's, all read it at launch): on the GPU the hardware conversion
# (`to_bf16_bits`, one instruction for two values) rather than the integer rounding, about six
# operations a value; the same bits but a NaN's payload (docs/KERNELS.md, "The GEMM
# epilogues' BF16 rounding"). The interpreter always takes the integer rounding (its BF16 cast
# truncates).
HW_BF16 = True


def hw_bf16() -> bool:
    """The HW_BF16 constexpr a GEMM launch passes: the switch, and never in the interpreter."""
    return HW_BF16 and not interpreting()


@triton.jit
def _mul_rn(a, b, ASM: tl.constexpr):
    """a * b rounded to FP32 on its own (never fused into a following add)."""
    if ASM:
        return tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return a * b


@triton.jit
def _decode_scale(amax):
    """S_dec of an FP32 tensor amax; NaN when amax is Inf or NaN (formats' decode_scale)."""
    s_dec, _ = nvfp4_global(amax)
    return tl.where(abs_bits(amax) < 0x7F800000, s_dec, float("nan"))


@triton.jit
def _epilogue_kernel(
    acc_ptr, amax_a_ptr, amax_b_ptr, bias_ptr, out_ptr, M, N, stride_acc, stride_out,
    HAS_ALPHA: tl.constexpr, HAS_BIAS: tl.constexpr, OUT_BF16: tl.constexpr, ASM: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, HW_BF16: tl.constexpr = False,
):  # fmt: skip
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    v = tl.load(acc_ptr + rows[:, None] * stride_acc + cols[None, :], mask=mask, other=0.0)
    if HAS_ALPHA:
        alpha = _decode_scale(tl.load(amax_a_ptr)) * _decode_scale(tl.load(amax_b_ptr))
        v = _mul_rn(v, tl.broadcast_to(alpha, [BM, BN]), ASM)
    if HAS_BIAS:
        b = tl.load(bias_ptr + cols, mask=cols < N, other=0.0)
        v = v + b[None, :]
    dst = out_ptr + rows[:, None] * stride_out + cols[None, :]
    if OUT_BF16:
        tl.store(dst, to_bf16_bits(v, HW_BF16), mask=mask)
    else:
        tl.store(dst, v, mask=mask)


@library_op("blockscale::gemm_epilogue", mutates_args=("out",), triton=True)
def _gemm_epilogue(
    acc: torch.Tensor,
    amax_a: torch.Tensor | None,
    amax_b: torch.Tensor | None,
    bias: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    M, N = acc.shape
    if M == 0 or N == 0:
        return
    bm, bn = 16, 256
    grid = (cdiv(M, bm), cdiv(N, bn))
    bf16 = out.dtype == torch.bfloat16
    dst = out.view(torch.int16) if bf16 else out
    launch(_epilogue_kernel, grid,
        acc, amax_a if amax_a is not None else acc, amax_b if amax_b is not None else acc,
        bias if bias is not None else acc, dst,
        M, N, acc.stride(0), out.stride(0),
        HAS_ALPHA=amax_a is not None, HAS_BIAS=bias is not None, OUT_BF16=bf16,
        ASM=not interpreting(), BM=bm, BN=bn, HW_BF16=hw_bf16(), num_warps=4,
    )  # fmt: skip


def gemm_epilogue(
    acc: torch.Tensor,
    amax: tuple[torch.Tensor, torch.Tensor] | torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """cast(acc * alpha + bias) for an FP32 accumulator [M, N], with alpha = S_dec_a * S_dec_b
    from `amax` = the two NVFP4 operands' FP32 tensor amaxes (a pair of scalars, or one
    tensor of 2; None for alpha = 1) and an optional bias [N] (added in FP32), into `out` (a
    [M, N] tensor with unit column stride, e.g. a row slice of a larger output, or `acc`
    itself) or a new `out_dtype` tensor (BF16 or FP32)."""
    if acc.dtype != torch.float32 or acc.dim() != 2 or acc.stride(1) != 1:
        raise ValueError(
            f"acc must be a 2-D FP32 tensor with unit column stride, got {acc.dtype} "
            f"{tuple(acc.shape)} strides {acc.stride()}"
        )
    if out is None:
        out = torch.empty(acc.shape, dtype=out_dtype, device=acc.device)
    if out.dtype not in OUT_DTYPES or out.shape != acc.shape or out.stride(1) != 1:
        raise ValueError(
            f"out must be {tuple(acc.shape)} BF16 or FP32 with unit column stride, got "
            f"{out.dtype} {tuple(out.shape)} strides {out.stride()}"
        )
    amax_a = amax_b = None
    if amax is not None:
        pair = tuple(amax) if isinstance(amax, tuple | list) else tuple(amax.reshape(-1))
        if len(pair) != 2 or any(a.numel() != 1 for a in pair):
            raise ValueError(f"amax must hold the two operands' amaxes, got {len(pair)}")
        amax_a, amax_b = (a.to(device=acc.device, dtype=torch.float32) for a in pair)
    if bias is not None:
        if bias.shape != (acc.shape[1],):
            raise ValueError(f"bias must be [{acc.shape[1]}], got {tuple(bias.shape)}")
        bias = bias.to(device=acc.device, dtype=torch.float32).contiguous()
    _gemm_epilogue(acc, amax_a, amax_b, bias, out)
    return out
