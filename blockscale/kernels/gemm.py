"""Experimental: the emulated GEMM and its epilogue in one Triton kernel.

out[M, N] = cast(a[M, K] @ b[N, K].T * alpha + bias), with BF16 (exact `_dq`) operands, FP32
accumulation in the tensor cores, and the epilogue of epilogue.py applied to the accumulator
in registers: alpha from the two NVFP4 amaxes (rounded product, never fused into the add),
the FP32 bias, round-to-nearest-even to BF16. Compared with cuBLAS + epilogue.py it skips
the FP32 accumulator's write and read (8 bytes per output value) and its memory.

The operands may have any strides (a K-major [M, K] and b as a [N, K] view, which covers
the transposed 16x16 weight of dgrad). Not wired into the dispatch: benchmarks/bench_gemm.py
compares it with cuBLAS first (docs/KERNELS.md).
"""

import torch
import triton
import triton.language as tl

from blockscale._library import library_op
from blockscale.kernels._common import bf16_bits, cdiv, dot_in_fp32, interpreting, round_to_bf16
from blockscale.kernels.epilogue import _decode_scale, _mul_rn

# (BM, BN, BK, GROUP_M, num_warps, num_stages)
DEFAULT_CONFIG = (128, 256, 64, 8, 8, 3)


@triton.jit
def _mma(
    a_ptr, b_ptr, rm, rn, rk, k0, M, N, K, stride_am, stride_ak, stride_bn, stride_bk, acc,
    DOT_F32: tl.constexpr,
):  # fmt: skip
    """acc += a[rm, k0 + rk] @ b[rn, k0 + rk].T for one K tile."""
    ka = k0 + rk
    a = tl.load(
        a_ptr + rm[:, None] * stride_am + ka[None, :] * stride_ak,
        mask=(rm < M)[:, None] & (ka < K)[None, :],
        other=0.0,
    )
    b = tl.load(
        b_ptr + rn[None, :] * stride_bn + ka[:, None] * stride_bk,
        mask=(rn < N)[None, :] & (ka < K)[:, None],
        other=0.0,
    )
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _gemm_kernel(
    a_ptr, b_ptr, amax_ptr, bias_ptr, out_ptr, M, N, K,
    stride_am, stride_ak, stride_bn, stride_bk, stride_om,
    HAS_ALPHA: tl.constexpr, HAS_BIAS: tl.constexpr, OUT_BF16: tl.constexpr, ASM: tl.constexpr,
    DOT_F32: tl.constexpr, INTERPRET: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    n_m = tl.cdiv(M, BM)
    n_n = tl.cdiv(N, BN)
    group = GROUP_M * n_n
    first_m = (pid // group) * GROUP_M
    size_m = min(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    if INTERPRET:
        # (the interpreter cannot iterate a range with a runtime bound under numpy 2)
        k0 = 0
        while k0 < K:
            acc = _mma(a_ptr, b_ptr, rm, rn, rk, k0, M, N, K, stride_am, stride_ak, stride_bn,
                       stride_bk, acc, DOT_F32)  # fmt: skip
            k0 += BK
    else:
        # a `for` over range() is what Triton software-pipelines (num_stages); the while
        # loop is not, and ran at ~165 TFLOP/s on an H100 (docs/LOG.md)
        for k0 in range(0, K, BK):
            acc = _mma(a_ptr, b_ptr, rm, rn, rk, k0, M, N, K, stride_am, stride_ak, stride_bn,
                       stride_bk, acc, DOT_F32)  # fmt: skip
    if HAS_ALPHA:
        alpha = _decode_scale(tl.load(amax_ptr)) * _decode_scale(tl.load(amax_ptr + 1))
        acc = _mul_rn(acc, tl.broadcast_to(alpha, [BM, BN]), ASM)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + rn, mask=rn < N, other=0.0)[None, :]
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    dst = out_ptr + rm[:, None] * stride_om + rn[None, :]
    if OUT_BF16:
        tl.store(dst, bf16_bits(round_to_bf16(acc)), mask=mask)
    else:
        tl.store(dst, acc, mask=mask)


@library_op("blockscale::gemm_fused", triton=True)
def _gemm_fused(
    a: torch.Tensor,
    b: torch.Tensor,
    amax: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_bf16: bool,
    config: list[int],
) -> torch.Tensor:
    M, K = a.shape
    N = b.shape[0]
    out = torch.empty(M, N, dtype=torch.bfloat16 if out_bf16 else torch.float32, device=a.device)
    if M == 0 or N == 0:
        return out
    bm, bn, bk, group_m, warps, stages = config
    dst = out.view(torch.int16) if out_bf16 else out
    grid = (cdiv(M, bm) * cdiv(N, bn),)
    torch.library.wrap_triton(_gemm_kernel)[grid](
        a, b, amax if amax is not None else a, bias if bias is not None else a, dst, M, N, K,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0),
        HAS_ALPHA=amax is not None, HAS_BIAS=bias is not None, OUT_BF16=out_bf16,
        ASM=not interpreting(), DOT_F32=dot_in_fp32(a), INTERPRET=interpreting(),
        BM=bm, BN=bn, BK=bk, GROUP_M=group_m, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def gemm_fused(
    a: torch.Tensor,
    b: torch.Tensor,
    amax: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    config: tuple[int, ...] = DEFAULT_CONFIG,
) -> torch.Tensor:
    """cast(a @ b.T * alpha + bias) for BF16 (or, in tests, FP32) a [M, K] and b [N, K], alpha
    from the two NVFP4 amaxes (`amax` [2]; None: 1), bias [N] FP32 or None."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"need a [M, K] and b [N, K], got {tuple(a.shape)} and {tuple(b.shape)}")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"out_dtype must be BF16 or FP32, got {out_dtype}")
    if amax is not None:
        amax = amax.to(device=a.device, dtype=torch.float32).reshape(2)
    if bias is not None:
        bias = bias.to(device=a.device, dtype=torch.float32).contiguous()
    return _gemm_fused(a, b, amax, bias, out_dtype == torch.bfloat16, list(config))
