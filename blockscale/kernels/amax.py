"""Global amax kernels: max |x|, max |RHT(x) along tokens|, or both from one read of x.

NUMERICS.md needs the tensor amax before any block scale, so quantizing a tensor whose amax
is not known is two passes over it: this one (read 2N bytes for BF16, write 4 bytes) and the
quantize kernel. The fused variant reads x once for both amaxes the default recipe needs in
forward: the rowwise copy's (max |x|) and the Hadamard columnwise copy's.

The reduction runs on the integer bits of |x| (FP32): they order like the values, with NaN
above Inf, so a NaN anywhere gives a NaN amax as torch.amax does. Each program reduces its
tiles in registers and does one atomic max per result into an int32 device scalar: no host
synchronization, and the result is exact and order-independent.
"""

import torch
import triton
import triton.language as tl

from blockscale._library import library_op
from blockscale.kernels._common import (
    abs_bits,
    cdiv,
    dot_in_fp32,
    hadamard_16,
    hadamard_matrix,
)

# (BM, BK, num_warps, tiles per program) for the plain and the Hadamard amax: each program
# reduces its tiles in registers, then does one atomic per result.
TILES = {"plain": (32, 128, 4, 16), "hadamard": (32, 128, 4, 16)}


@triton.jit
def _amax_kernel(
    x_ptr, stride_m, stride_k, M, K, h_ptr, out_ptr, n_tiles_k, n_tiles,
    PLAIN: tl.constexpr, HAD_T: tl.constexpr, DOT_F32: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr, TILES: tl.constexpr,
):  # fmt: skip
    """out[0] = max |x| bits, out[1] = max |RHT along M of x| bits (BF16-rounded)."""
    acc = tl.zeros([BM, BK], dtype=tl.int32)
    acc_t = tl.zeros([BK, BM], dtype=tl.int32)
    for i in range(TILES):
        t = tl.program_id(0) * TILES + i
        offs_m = (t // n_tiles_k) * BM + tl.arange(0, BM)
        offs_k = (t % n_tiles_k) * BK + tl.arange(0, BK)
        mask = ((offs_m < M) & (t < n_tiles))[:, None] & (offs_k < K)[None, :]
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_m + offs_k[None, :] * stride_k, mask=mask, other=0.0
        )
        if PLAIN:
            acc = tl.maximum(acc, abs_bits(x))
        if HAD_T:
            acc_t = tl.maximum(acc_t, abs_bits(hadamard_16(tl.trans(x), h_ptr, BK, BM, DOT_F32)))
    if PLAIN:
        tl.atomic_max(out_ptr, tl.max(tl.max(acc, axis=1), axis=0))
    if HAD_T:
        tl.atomic_max(out_ptr + 1, tl.max(tl.max(acc_t, axis=1), axis=0))


@library_op("blockscale::amax_2d", mutates_args=(), triton=True)
def _amax_2d(x: torch.Tensor, plain: bool, hadamard_t: bool) -> torch.Tensor:
    """FP32 [2]: (max |x|, max |Hadamard transform of x along dim 0|); unrequested ones 0."""
    M, K = x.shape
    out = torch.zeros(2, dtype=torch.int32, device=x.device)
    if M and K:
        bm, bk, warps, per_program = TILES["hadamard" if hadamard_t else "plain"]
        n_k = cdiv(K, bk)
        n_tiles = cdiv(M, bm) * n_k
        torch.library.wrap_triton(_amax_kernel)[(cdiv(n_tiles, per_program),)](
            x, x.stride(0), x.stride(1), M, K, hadamard_matrix(x.device), out, n_k, n_tiles,
            PLAIN=plain, HAD_T=hadamard_t, DOT_F32=dot_in_fp32(x),
            BM=bm, BK=bk, TILES=per_program, num_warps=warps,
        )  # fmt: skip
    return out.view(torch.float32)


def _check_hadamard(x2: torch.Tensor) -> None:
    if x2.shape[0] % 16:
        raise ValueError(
            f"{x2.shape[0]} rows is not a multiple of 16 (the Hadamard transform runs along them)"
        )


def amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| over the whole tensor, FP32 scalar on x's device (NaN if any NaN)."""
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    return _amax_2d(x2, True, False)[0]


def amax_hadamard_t(x: torch.Tensor) -> torch.Tensor:
    """max |y| of the columnwise Hadamard copy: y = RHT of x.T along its last dim (x's
    tokens), rounded to BF16, the amax of nvfp4 quantize(x, hadamard=True, transpose=True)."""
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    _check_hadamard(x2)
    return _amax_2d(x2, False, True)[1]


def amax_fused(
    x: torch.Tensor, hadamard_t: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(max |x|, max |Hadamard columnwise copy| or None) from one read of x."""
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    if hadamard_t:
        _check_hadamard(x2)
    out = _amax_2d(x2, True, hadamard_t)
    return out[0], (out[1] if hadamard_t else None)


def amax_of_copy(x2: torch.Tensor, hadamard_t: bool) -> torch.Tensor:
    """The amax of the copy the quantize kernel makes from the 2-D x2 (internal)."""
    return amax_hadamard_t(x2) if hadamard_t else amax(x2)
