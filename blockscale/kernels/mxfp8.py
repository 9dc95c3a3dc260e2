"""MXFP8 quantization kernels: 1x32 rowwise, columnwise (blocks along M, stored transposed),
or both from one read of x, with optional exact BF16 `_dq` outputs.

Per 32-value block: e = clamp(ceil(log2(block_amax * fl(1/448))), -127, 127) read off the FP32
bits (exact at powers of two), data = e4m3(clamp(x * 2^-e, +-448)). On the GPU the E4M3 cast
is the hardware's round-to-nearest-even conversion; in the interpreter (which truncates) the
same rounding is done on the integer bits. Both are tested against formats/mxfp8.py.

Bytes (BF16 input, N = M*K): one direction reads 2N and writes N + N/32 = 3.03 N; both
directions 4.06 N; each `_dq` output adds 2N. No global amax: MXFP8 scales are per block.
"""

import math

import torch
import triton
import triton.language as tl

from blockscale._registry import library_op
from blockscale.formats import _checks
from blockscale.formats.mxfp8 import MXFP8Tensor
from blockscale.kernels._common import (
    abs_bits,
    band_grid,
    band_tile,
    copy_outputs,
    dot_in_fp32,
    dq_flags,
    e4m3_byte_value,
    e4m3_code_signed,
    e4m3_round,
    empty_rows,
    exp2_int,
    interpreting,
    launch_kind,
    launch_tiles,
    max_keep_nan,
    min_keep_nan,
    relayout_16,
    row_stack,
    stack_rows,
    to_bf16_bits,
)
from blockscale.kernels._launch import launch

BLOCK = 32


@triton.jit
def _mx_tile(v, R: tl.constexpr, C: tl.constexpr, HW_FP8: tl.constexpr):
    """FP32 [R, C], blocks of 32 along C -> (E4M3 bytes uint8 [R, C], E8M0 codes uint8
    [R, C/32], dq [R, C] as int16 BF16 bits)."""
    NB: tl.constexpr = C // 32
    vb = tl.reshape(v, [R, NB, 32])
    # a NaN-propagating float max: one ALU operation a value, where |x| on the bits and an
    # integer max took two (the ALU pipe bounds this kernel, docs/KERNELS.md)
    block_amax = tl.reduce(tl.abs(vb), 2, max_keep_nan)
    p = block_amax * 0.002232142857142857
    pb = p.to(tl.int32, bitcast=True)
    expf = pb >> 23
    # ceil(log2 p) from the bits; p below 2^-126 only matters through the clamp at -127
    e_norm = expf - 127 + ((pb & 0x7FFFFF) != 0).to(tl.int32)
    e_sub = tl.where((pb & 0x7FFFFF) > 0x400000, -126, -127)
    e = tl.where(expf == 0, e_sub, e_norm)
    e = tl.where(p < float("inf"), e, 0)  # Inf block: NaN scale below, data scaled by 1
    e = tl.where(p > 0.0, e, -127)  # zero, underflow or NaN
    e = tl.minimum(tl.maximum(e, -127), 127)
    finite = block_amax < float("inf")
    ecode = tl.where(finite, e + 127, 255)
    w = vb * exp2_int(-e)[:, :, None]
    if HW_FP8:
        # No clamp: |w| <= amax * 2^-e < 448 * (1 + 2^-22) for a finite block (p is amax /
        # 448 within 2^-23, and 2^e >= p), which E4M3 rounds to 448; the conversion
        # saturates Inf to 448 as the clamp did (the dq of an Inf block is NaN either way).
        # The hardware conversion (RNE, like the integer path) for the stored bytes. The dq
        # takes its values from e4m3_round, not from these bytes: reading the converted bytes
        # back as integers gave wrong values on sm_90 with Triton 3.6 (docs/LOG.md).
        byte = w.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        w = tl.where(w < -448.0, -448.0, min_keep_nan(w, 448.0))
        byte = e4m3_code_signed(w).to(tl.uint8)
    scale = tl.where(finite, exp2_int(e), float("nan"))
    dq = to_bf16_bits(e4m3_round(w) * scale[:, :, None], HW_FP8)
    finite_tile = tl.max(tl.max(abs_bits(block_amax), axis=1), axis=0) < 0x7F800000
    return tl.reshape(byte, [R, C]), ecode.to(tl.uint8), tl.reshape(dq, [R, C]), finite_tile


@triton.jit
def _store_mx(
    byte, ecode, dq, data_ptr, scale_ptr, dq_ptr, r0, c0, n_rows, n_cols,
    R: tl.constexpr, C: tl.constexpr, DQ: tl.constexpr, CODES: tl.constexpr = True,
):  # fmt: skip
    rows = (r0 + tl.arange(0, R)).to(tl.int64)  # (a stack of expert weights: > 2^31 values)
    store_mx_rows(byte, ecode, dq, data_ptr, scale_ptr, dq_ptr, rows, rows < n_rows, c0, n_cols,
                  C, DQ, CODES)  # fmt: skip


@triton.jit
def store_mx_rows(
    byte, ecode, dq, data_ptr, scale_ptr, dq_ptr, rows, rmask, c0, n_cols,
    C: tl.constexpr, DQ: tl.constexpr, CODES: tl.constexpr = True,
):  # fmt: skip
    """Store an MXFP8 tile's rows at the row indices `rows` (where `rmask`). CODES False: the
    `_dq` only (its caller reads nothing else)."""
    cols = c0 + tl.arange(0, C)
    m = rmask[:, None] & (cols < n_cols)[None, :]
    if CODES:
        tl.store(data_ptr + rows[:, None] * n_cols + cols[None, :], byte, mask=m)
        sc = c0 // 32 + tl.arange(0, C // 32)
        tl.store(
            scale_ptr + rows[:, None] * (n_cols // 32) + sc[None, :],
            ecode,
            mask=rmask[:, None] & (sc < n_cols // 32)[None, :],
        )
    if DQ:
        tl.store(dq_ptr + rows[:, None] * n_cols + cols[None, :], dq, mask=m)


@triton.jit
def _mxfp8_quantize_kernel(
    x_ptr, stride_m, stride_k, M, K,
    data_ptr, scale_ptr, dq_ptr, data_t_ptr, scale_t_ptr, dq_t_ptr,
    ROW: tl.constexpr, COL: tl.constexpr, DQ_ROW: tl.constexpr, DQ_COL: tl.constexpr,
    HW_FP8: tl.constexpr,
    band, DOT_F32: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr, ROW_CODES: tl.constexpr = True,
    COL_CODES: tl.constexpr = True,
):  # fmt: skip
    tile_m, tile_k = band_tile(band)
    m0 = tile_m * BM
    k0 = tile_k * BK
    offs_m = m0 + tl.arange(0, BM)
    offs_k = k0 + tl.arange(0, BK)
    mask = (offs_m < M)[:, None] & (offs_k < K)[None, :]
    x = tl.load(
        x_ptr + offs_m[:, None] * stride_m + offs_k[None, :] * stride_k, mask=mask, other=0.0
    )
    if ROW:
        byte, ecode, dq, _ = _mx_tile(x.to(tl.float32), BM, BK, HW_FP8)
        _store_mx(byte, ecode, dq, data_ptr, scale_ptr, dq_ptr, m0, k0, M, K, BM, BK, DQ_ROW,
                  ROW_CODES)  # fmt: skip
    if COL:
        quantize_columns_mx(x, data_t_ptr, scale_t_ptr, dq_t_ptr, k0, m0, K, M, BK, BM, DQ_COL,
                            HW_FP8, DOT_F32, COL_CODES)  # fmt: skip


@triton.jit
def quantize_columns_mx(
    x, data_t_ptr, scale_t_ptr, dq_t_ptr, k0, m0, K, M,
    BK: tl.constexpr, BM: tl.constexpr, DQ_COL: tl.constexpr, HW_FP8: tl.constexpr,
    DOT_F32: tl.constexpr, CODES: tl.constexpr = True,
):  # fmt: skip
    """The columnwise MXFP8 copy of a loaded [BM, BK] tile x, stored at (k0, m0) of the [K, M]
    outputs (CODES False: its `_dq` only). Shared by the dense and the grouped kernels."""
    # The identity product moves each 32-block into one thread (docs/LOG.md); Inf * 0
    # in it makes NaN, so a tile with Inf or NaN is redone from the plain transpose.
    xt = tl.trans(x)
    byte_t, ecode_t, dq_t, finite = _mx_tile(relayout_16(xt, BK, BM, DOT_F32), BK, BM, HW_FP8)
    if finite:
        _store_mx(
            byte_t, ecode_t, dq_t, data_t_ptr, scale_t_ptr, dq_t_ptr,
            k0, m0, K, M, BK, BM, DQ_COL, CODES,
        )  # fmt: skip
    else:
        byte_t, ecode_t, dq_t, _ = _mx_tile(xt.to(tl.float32), BK, BM, HW_FP8)
        _store_mx(
            byte_t, ecode_t, dq_t, data_t_ptr, scale_t_ptr, dq_t_ptr,
            k0, m0, K, M, BK, BM, DQ_COL, CODES,
        )  # fmt: skip


@triton.jit
def _mxfp8_dequantize_kernel(
    data_ptr, scale_ptr, out_ptr, R, C, rows_per, sd_b, sd_r, ss_b, ss_r, band,
    BR: tl.constexpr, BC: tl.constexpr, HW: tl.constexpr,
):  # fmt: skip
    """E4M3 bytes + E8M0 scales -> BF16 data * 2^e (the `_dq` operand): the FP32 product is
    exact (a 4-bit significand times a power of two, down to 2^-136), then rounded to BF16
    as the reference's cast does (only values below 2^-133 round). Codes and scales are read
    where they lie, a [B, R/B, C] stack with strides (sd_b, sd_r, 1) and (ss_b, ss_r, 1)
    (`stack_rows`); the output is the contiguous [R, C]."""
    tile_r, tile_c = band_tile(band)
    r0 = tile_r * BR
    c0 = tile_c * BC
    rows = (r0 + tl.arange(0, BR)).to(tl.int64)
    cols = c0 + tl.arange(0, BC)
    m = (rows < R)[:, None] & (cols < C)[None, :]
    d_row = stack_rows(rows, rows_per, sd_b, sd_r)
    byte = tl.load(data_ptr + d_row[:, None] + cols[None, :], mask=m, other=0).to(tl.int32)
    sc = c0 // 32 + tl.arange(0, BC // 32)
    ecode = tl.load(
        scale_ptr + stack_rows(rows, rows_per, ss_b, ss_r)[:, None] + sc[None, :],
        mask=(rows < R)[:, None] & (sc < C // 32)[None, :],
        other=127,
    ).to(tl.int32)
    scale = tl.where(ecode == 255, float("nan"), exp2_int(ecode - 127))
    v = tl.reshape(e4m3_byte_value(byte), [BR, BC // 32, 32]) * scale[:, :, None]
    dq = to_bf16_bits(tl.reshape(v, [BR, BC]), HW)
    tl.store(out_ptr + rows[:, None] * C + cols[None, :], dq, mask=m)


# (BM, BK, num_warps[, maxnreg]) per kind of launch (_common.launch_tiles, docs/KERNELS.md);
# the benchmark may sweep these. col, both and both_dq are the 2026-11-25 late sweep's winners
# (3%, 6% and 14% faster on the H100; both's 128-register cap gives 4 programs an SM, not 3).
# col and col_dq, the launches of a weight's copy along N, moved to 32x64/2 on 2026-11-28 (one
# H200, bench_moe_kernels.py --dense, Llama's weight shapes): FP32 masters 18-25% of copy at
# 64x64/8, 49-72% at 32x64/2 (8B's [14336, 4096] with `_dq`: 382 -> 135 us); BF16 weights
# 41-55% -> 45-67%.
TILES = {
    "row": (64, 128, 8),
    "row_dq": (32, 128, 8),
    "col": (32, 64, 2),
    "col_dq": (32, 64, 2),
    "both": (64, 64, 4, 128),
    "both_dq": (32, 128, 4),
}


def _outputs(rows: int, cols: int, device, dq: bool, codes: bool = True):
    return (
        empty_rows(rows if codes else 0, cols, torch.uint8, device),
        empty_rows(rows if codes else 0, cols // BLOCK, torch.uint8, device),
        empty_rows(rows if dq else 0, cols if dq else 0, torch.bfloat16, device),
    )


@library_op("blockscale::mxfp8_quantize_2d", mutates_args=(), triton=True)
def _mxfp8_quantize_2d(
    x: torch.Tensor,
    row: bool,
    col: bool,
    dq_row: bool,
    dq_col: bool,
    row_codes: bool = True,
    col_codes: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] -> rowwise (E4M3 bytes [M, K], E8M0 bytes [M, K/32], dq [M, K]) and columnwise
    ([K, M], [K, M/32], [K, M]) outputs; unused ones (and a `_dq` not asked for) are empty.
    `row_codes` / `col_codes` False with that copy's `_dq`: the `_dq` alone, bytes and scales
    empty (an emulated GEMM's operand, read once and not kept)."""
    M, K = x.shape
    outs, (dq_row, dq_col, row_codes, col_codes) = copy_outputs(
        _outputs, M, K, M, x.device, row, col, dq_row, dq_col, row_codes, col_codes
    )
    data, scale, dq_r, data_t, scale_t, dq_c = outs
    if M and K and (row or col):
        bm, bk, options = launch_tiles(TILES[launch_kind(row, col, dq_row or dq_col)])
        grid, band = band_grid(M, K, bm, bk)
        launch(_mxfp8_quantize_kernel, grid,
            x, x.stride(0), x.stride(1), M, K, data, scale, dq_r.view(torch.int16), data_t, scale_t,
            dq_c.view(torch.int16),
            ROW=row, COL=col, DQ_ROW=dq_row, DQ_COL=dq_col, HW_FP8=not interpreting(), band=band,
            DOT_F32=dot_in_fp32(x),
            BM=bm, BK=bk, ROW_CODES=row_codes, COL_CODES=col_codes, **options,
        )  # fmt: skip
    return data, scale, dq_r, data_t, scale_t, dq_c


@library_op("blockscale::mxfp8_dequantize_3d", mutates_args=(), triton=True)
def _mxfp8_dequantize_3d(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """data uint8 (E4M3 bytes) [B, R, C], scale uint8 (E8M0 bytes) [B, R, C/32], any strides
    along B and R, unit stride along C -> BF16 [B, R, C], contiguous."""
    B, R, C = data.shape
    out = torch.empty(B, R, C, dtype=torch.bfloat16, device=data.device)
    if B and R and C:
        grid, band = band_grid(B * R, C, 32, 128)
        launch(_mxfp8_dequantize_kernel, grid,
            data, scale, out.view(torch.int16), B * R, C, R, *data.stride()[:2],
            *scale.stride()[:2], band, BR=32, BC=128, HW=not interpreting(), num_warps=4,
        )  # fmt: skip
    return out


def _container(data, scale, shape) -> MXFP8Tensor:
    """(A copy written without its codes keeps its empty [0, C] and [0, C/32].)"""
    lead = shape[:-1] if data.numel() or not math.prod(shape) else (0,)
    return MXFP8Tensor(
        data=data.view(torch.float8_e4m3fn).reshape(*lead, shape[-1]),
        scale=scale.view(torch.float8_e8m0fnu).reshape(*lead, shape[-1] // BLOCK),
        shape=torch.Size(shape),
    )


def mxfp8_quantize(x: torch.Tensor, transpose: bool = False, return_dq: bool = False):
    """formats.mxfp8.quantize, fast; with return_dq also the exact BF16 data * 2^e operand."""
    x2 = _checks.as_2d(x, "MXFP8", False)
    M, K = x2.shape
    if transpose:
        _checks.check_blocks(K, M, "MXFP8", 1, BLOCK)
        shape = torch.Size((K, M))
    else:
        _checks.check_blocks(M, K, "MXFP8", 1, BLOCK)
        shape = x.shape
    out = _mxfp8_quantize_2d(x2, not transpose, transpose, return_dq, return_dq)
    data, scale, dq = out[3:] if transpose else out[:3]
    q = _container(data, scale, shape)
    return (q, dq.reshape(shape)) if return_dq else q


def mxfp8_quantize_both(
    x: torch.Tensor, return_dq: bool | tuple[bool, bool] = False, codes: bool = True
):
    """(rowwise, columnwise) MXFP8 copies from one read of x; with return_dq,
    ((q_row, dq_row), (q_col, dq_col)). return_dq is True for both `_dq` operands or a pair
    (row, col) of flags; a copy whose flag is False gets None (its `_dq` is not written).
    `codes=False`: a copy with its `_dq` is written as the `_dq` alone (data, scale empty)."""
    want_row, want_col = dq_flags(return_dq)
    x2 = _checks.as_2d(x, "MXFP8", False)
    M, K = x2.shape
    _checks.check_blocks(M, K, "MXFP8", 1, BLOCK)
    _checks.check_blocks(K, M, "MXFP8", 1, BLOCK)
    data, scale, dq, data_t, scale_t, dq_t = _mxfp8_quantize_2d(
        x2, True, True, want_row, want_col, codes, codes
    )
    q_row = _container(data, scale, x.shape)
    q_col = _container(data_t, scale_t, torch.Size((K, M)))
    if return_dq is not False:
        return (
            (q_row, dq.reshape(x.shape) if want_row else None),
            (q_col, dq_t if want_col else None),
        )
    return q_row, q_col


def quantize_2d(
    x2: torch.Tensor, transpose: bool, dq: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The launch of `mxfp8_quantize`, for callers that checked their arguments
    (ops/quantize.py: x2 [M, K] of a float dtype, with K, or M for `transpose`, a multiple of
    32), which then skip its checks and container. Returns (E4M3 bytes, E8M0 scale bytes, dq
    or an empty tensor) of the copy along K, or along M ([K, M]) with `transpose`."""
    out = _mxfp8_quantize_2d(x2, not transpose, transpose, dq, dq)
    return out[3:] if transpose else out[:3]


def quantize_both_2d(
    x2: torch.Tensor, dq_row: bool, dq_col: bool, codes: bool = True
) -> tuple[torch.Tensor, ...]:
    """The launch of `mxfp8_quantize_both`, for callers that checked their arguments
    (ops/quantize.py: x2 [M, K] of a float dtype, M and K multiples of 32), which then skip its
    checks and containers: (data, scale, dq, data_t, scale_t, dq_t) as bytes, a `_dq` not
    asked for empty; `codes=False`: a copy with its `_dq` is its `_dq` alone."""
    return _mxfp8_quantize_2d(x2, True, True, dq_row, dq_col, codes, codes)


def mxfp8_dequantize_dq(q: MXFP8Tensor) -> torch.Tensor:
    """The BF16 `_dq` operand (data * 2^e) of a saved MXFP8Tensor; equals q.dq(). Contiguous;
    the codes are read in place, also a stack of strided views (the expert copies along N)."""
    data, scale = q.data.view(torch.uint8), q.scale.view(torch.uint8)
    if len(q.shape) != 2 or data.dim() != 2:  # (a 2-D operand's are [R, C] and [R, C/32])
        lead, cols = q.shape[:-1], q.shape[-1]
        data, scale = data.reshape(*lead, cols), scale.reshape(*lead, cols // BLOCK)
    return _mxfp8_dequantize_3d(row_stack(data), row_stack(scale)).reshape(q.shape)
