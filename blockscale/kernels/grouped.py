"""Per-group quantization kernels for grouped (mixture-of-experts) GEMMs: every expert's
amaxes and both copies of an activation in one launch each, reading the group layout from the
device, so a grouped GEMM's forward and backward never wait for the host.

The layout is formats/grouped.py's: a grouped activation x [M, C] is walked in the token
layout's order, P positions where position p holds row `source[p]` of x (or a zero padding
token, source -1) and belongs to group `group[p]`. Each expert's tokens fill a segment of
its own, padded to 64 positions, so no 16-token block, Hadamard block or 32-token MXFP8 block
spans two experts. A program loads one [BM, BK] tile of positions (a row gather from x) and
quantizes it exactly as the dense kernels of nvfp4.py / mxfp8.py do, with their jit helpers:

- the **row copy** (along C, blocks of 16 or 32 values of a row): each row with its group's
  amax, scattered back to row `source[p]` of a [M, C] output (padding positions store
  nothing; rows past offs[-1] are never visited and stay unwritten: no GEMM reads them);
- the **token copy** (along the positions, optionally Hadamard-transformed): each 16-token
  block with its group's amax, stored at its position in a [C, P] output.

`group_amax` finds every group's max |x| and max |Hadamard token copy| in one read, with one
integer atomic max per 16-token block and result (the amax kernel's trick: the bits of |x|
order like the values, NaN above Inf, so the result is exact and order-independent).

Expert weights [E, N, K] are the same kernel without the gather: rows are the E*N weight rows,
each with its expert's amax (16x16 tiles never cross experts since N % 16 == 0).

Bytes: as the dense kernels, plus 8 bytes a position for the layout (source and group).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from blockscale._registry import library_op
from blockscale.formats.grouped import TOKEN_ALIGN, TokenLayout
from blockscale.formats.mxfp8 import MXFP8Tensor
from blockscale.formats.nvfp4 import NVFP4Tensor
from blockscale.kernels import mxfp8 as mx
from blockscale.kernels import nvfp4 as nv
from blockscale.kernels._common import (
    abs_bits,
    band_grid,
    band_tile,
    cdiv,
    copy_outputs,
    dot_in_fp32,
    hadamard_matrix,
    interpreting,
    launch_kind,
    launch_tiles,
    max_keep_nan,
    nvfp4_global,
    round_to_bf16,
    sr_seed,
)
from blockscale.kernels._launch import launch
from blockscale.kernels.amax import (
    _FAST_BELOW,
    _FLIPS,
    _SIGN_MASK,
    _load_16_rows,
    _max_abs_16,
    _rht16,
    _rht16_max_abs_x4,
)
from blockscale.kernels.mxfp8 import _mx_tile, quantize_columns_mx, store_mx_rows
from blockscale.kernels.nvfp4 import _quantize_tile, _uniforms, quantize_columns, store_rows

# (BK, num_warps, 16-position blocks a program) for the amax pass: amax.py's fused kernel's
# (512 columns, 4 warps, 4 blocks), which runs at 95% of copy on the H100 dense.
AMAX_TILE = (512, 4, 4)
# The quantize passes use the dense kernels' TILES unless an entry here ("nvfp4:both_dq",
# "mxfp8:both_dq", ...) overrides one: (BM, BK, num_warps[, maxnreg]), _common.launch_tiles.
# NVFP4's both-direction `_dq` launches keep 32x64/4 (the 2026-11-25 late sweep; the dense
# nearest launch moved to 64x64/4 since), and the stochastic one, the backward, caps its
# registers at 96 for a fifth program an SM, no spills: on the H100 (2026-11-26, later
# session) 1163 -> 1068 us at 32768 x 7168 and 2277 -> 2076 us at 65536 x 7168, where the
# same cap slowed the forward (792 -> 855 us). Since its rounding is one `add_rp` (nvfp4.py;
# 2026-11-26, last session) the cap is 80, a sixth program an SM, still no spills: 1047 ->
# 1012 us and 2062 -> 1978 us (H100, 8 experts). bench_grouped_mm.py --kernel-tiles sweeps these.
# The expert weights' own launches (FP32 masters, [E*N, K] rows; the transformers MoE models'
# shapes, one H200, 2026-11-28, bench_moe_kernels.py): MXFP8's copy along N at the dense
# table's old 64x64/8 ran at 21% of copy, at 32x64/2 at 65% (3.07 -> 0.97 ms for 256 experts
# of 1024 x 2048; the dense table took 32x64/2 too); NVFP4's 16x16 copy at 32x64/4 87%
# against 83% at 32x128/8 (docs/KERNELS.md, "The MoE models' own launches").
TILES: dict[str, tuple] = {
    "nvfp4:both_dq": (32, 64, 4),
    "nvfp4:both_sr_dq": (32, 64, 4, 80),
    "nvfp4:row_dq": (32, 64, 4),
}


@triton.jit
def _load_positions(x_ptr, stride_m, stride_k, src_ptr, p0, k0, P, K,
                    BM: tl.constexpr, BK: tl.constexpr, GATHER: tl.constexpr):  # fmt: skip
    """The [BM, BK] tile of positions p0.. (rows of x through `source`, zeros for padding),
    with each position's source row (int64) and whether it holds a row of x."""
    p = p0 + tl.arange(0, BM)
    if GATHER:
        src = tl.load(src_ptr + p, mask=p < P, other=-1).to(tl.int64)
    else:
        src = tl.where(p < P, p, -1).to(tl.int64)
    valid = src >= 0
    offs_k = k0 + tl.arange(0, BK)
    x = tl.load(
        x_ptr + src[:, None] * stride_m + offs_k[None, :] * stride_k,
        mask=valid[:, None] & (offs_k < K)[None, :],
        other=0.0,
    )
    return x, src, valid


@triton.jit
def _block_groups(group_ptr, p0, P, E, BM: tl.constexpr):
    """The group of each 16-position block of the tile (E past the end)."""
    first = p0 + 16 * tl.arange(0, BM // 16)
    return tl.load(group_ptr + first, mask=first < P, other=E)


@triton.jit
def _load_16_positions(x_ptr, cols, kmask, stride_m, src_ptr, p,
                       GATHER: tl.constexpr, EVEN_K: tl.constexpr):  # fmt: skip
    """Positions p .. p + 15 as a 16-tuple of FP32 row vectors (their columns `cols`): rows of
    x through `source` (a padding position, source -1, reads zeros), or row p itself."""
    if GATHER:
        xs = ()
        for r in tl.static_range(16):
            s = tl.load(src_ptr + p + r).to(tl.int64)
            v = tl.load(x_ptr + s * stride_m + cols, mask=kmask & (s >= 0), other=0.0)
            xs = xs + (v.to(tl.float32),)
        return xs
    else:
        return _load_16_rows(x_ptr + p.to(tl.int64) * stride_m + cols, stride_m, kmask, EVEN_K)


@triton.jit
def _group_amax_blocks(
    x_ptr, cols, kmask, stride_m, src_ptr, p0, p_last, g, E, amax_ptr, amax_h_ptr,
    PLAIN: tl.constexpr, HAD: tl.constexpr, GATHER: tl.constexpr, EVEN_K: tl.constexpr,
    SIGN_MASK: tl.constexpr, FLIPS: tl.constexpr, FAST_BELOW: tl.constexpr, BK: tl.constexpr,
    COUNT: tl.constexpr,
):  # fmt: skip
    """The COUNT 16-position blocks from p0 (past p_last: block p_last again; a max does not
    mind duplicates), all of group g: their max |x| and max |Hadamard token copy|
    atomically maxed into amax[g] (amax.py's butterfly and its exact re-read for values
    past 2^123, Inf or NaN; the rounding to BF16 once, on the maximum)."""
    acc = tl.zeros([BK], dtype=tl.float32)
    acc_t = tl.zeros([BK], dtype=tl.float32)
    for i in range(COUNT):
        p = tl.minimum(p0 + 16 * i, p_last)
        xs = _load_16_positions(x_ptr, cols, kmask, stride_m, src_ptr, p, GATHER, EVEN_K)
        acc = max_keep_nan(acc, _max_abs_16(xs))
        if HAD:
            acc_t = tl.maximum(acc_t, _rht16_max_abs_x4(xs, FLIPS))
    big = tl.max(abs_bits(acc), axis=0)
    if PLAIN:
        tl.atomic_max(amax_ptr + g, big, mask=g < E)
    if HAD:
        if big >= FAST_BELOW:
            acc_t = tl.zeros([BK], dtype=tl.float32)
            for i in range(COUNT):
                p = tl.minimum(p0 + 16 * i, p_last)
                xs = _load_16_positions(x_ptr, cols, kmask, stride_m, src_ptr, p, GATHER, EVEN_K)
                acc_t = max_keep_nan(acc_t, _max_abs_16(_rht16(xs, SIGN_MASK)))
        else:
            acc_t = acc_t * 0.25
        tl.atomic_max(amax_h_ptr + g, tl.max(abs_bits(round_to_bf16(acc_t)), axis=0),
                      mask=g < E)  # fmt: skip


@triton.jit
def _group_amax_kernel(
    x_ptr, stride_m, stride_k, src_ptr, group_ptr, P, K, E, amax_ptr, amax_h_ptr,
    PLAIN: tl.constexpr, HAD: tl.constexpr, GATHER: tl.constexpr, EVEN_K: tl.constexpr,
    SIGN_MASK: tl.constexpr, FLIPS: tl.constexpr, FAST_BELOW: tl.constexpr, BK: tl.constexpr,
    BLOCKS: tl.constexpr,
):  # fmt: skip
    """Each group's max |x| and max |Hadamard token copy| over a strip of BLOCKS 16-position
    blocks by BK columns, each position's row one [BK] vector, so the 16 values a transform
    mixes sit in one thread (amax.py's fused kernel, with the rows gathered). A strip inside
    one group (always so for activations, whose segments are 64-aligned) takes one atomic
    max per result; a strip across groups (expert weight rows with N < 64) one per block."""
    cols = tl.program_id(0) * BK + tl.arange(0, BK)
    kmask = cols < K
    cols = cols * stride_k
    p0 = tl.program_id(1) * (16 * BLOCKS)
    p_last = tl.minimum(p0 + 16 * (BLOCKS - 1), P - 16)  # the strip's last block
    g_first = tl.load(group_ptr + p0)
    g_last = tl.load(group_ptr + p_last)
    if g_first == g_last:
        _group_amax_blocks(x_ptr, cols, kmask, stride_m, src_ptr, p0, p_last, g_first, E,
                           amax_ptr, amax_h_ptr, PLAIN, HAD, GATHER, EVEN_K, SIGN_MASK, FLIPS,
                           FAST_BELOW, BK, BLOCKS)  # fmt: skip
    else:
        for i in range(BLOCKS):
            p = tl.minimum(p0 + 16 * i, p_last)
            g = tl.load(group_ptr + p)
            _group_amax_blocks(x_ptr, cols, kmask, stride_m, src_ptr, p, p, g, E, amax_ptr,
                               amax_h_ptr, PLAIN, HAD, GATHER, EVEN_K, SIGN_MASK, FLIPS,
                               FAST_BELOW, BK, 1)  # fmt: skip


@triton.jit
def _nvfp4_grouped_kernel(
    x_ptr, stride_m, stride_k, src_ptr, group_ptr, P, K, E,
    amax_row_ptr, amax_col_ptr, h_ptr, seed_ptr,
    data_ptr, scale_ptr, dq_ptr, data_t_ptr, scale_t_ptr, dq_t_ptr,
    ROW: tl.constexpr, COL: tl.constexpr, ROW_2D: tl.constexpr, ROW_SR: tl.constexpr,
    COL_SR: tl.constexpr, COL_HAD: tl.constexpr, DQ_ROW: tl.constexpr, DQ_COL: tl.constexpr,
    GATHER: tl.constexpr, band, DOT_F32: tl.constexpr, HW: tl.constexpr, BM: tl.constexpr,
    BK: tl.constexpr, ONE_GROUP: tl.constexpr = False, ROW_CODES: tl.constexpr = True,
    COL_CODES: tl.constexpr = True, ENC_TABLE: tl.constexpr = False,
):  # fmt: skip
    """ONE_GROUP: every tile's BM positions lie in one group (the launcher's `_one_group`),
    so each global scale is computed once a program, as in the dense kernel, instead of once
    per row and per 16-position block (two IEEE divisions each). ROW_CODES / COL_CODES False
    (with that copy's DQ): the copy's `_dq` alone, its codes and scales not stored."""
    tile_p, tile_k = band_tile(band)
    p0 = tile_p * BM
    k0 = tile_k * BK
    x, src, valid = _load_positions(
        x_ptr, stride_m, stride_k, src_ptr, p0, k0, P, K, BM, BK, GATHER
    )
    if ONE_GROUP:
        # (the last band's extra tiles start past P: group E there, every row masked off)
        g0 = tl.load(group_ptr + p0, mask=p0 < P, other=E)
    if ROW:
        if ONE_GROUP:
            s_dec, mult = nvfp4_global(tl.load(amax_row_ptr + g0, mask=g0 < E, other=0.0))
        else:
            p = p0 + tl.arange(0, BM)
            g = tl.load(group_ptr + p, mask=p < P, other=E)
            s_dec, mult = nvfp4_global(tl.load(amax_row_ptr + g, mask=g < E, other=0.0))
            s_dec = s_dec[:, None]
            mult = mult[:, None]
        u = _uniforms(seed_ptr, seed_ptr, p0, k0, P, K, 0, BM, BK, ROW_SR, False, False)
        packed, scode, dq, _ = _quantize_tile(
            x.to(tl.float32), s_dec, mult, u, BM, BK, ROW_2D, ROW_SR, DQ_ROW, HW,
            ENC_TABLE and ONE_GROUP,
        )  # fmt: skip
        store_rows(packed, scode, dq, data_ptr, scale_ptr, dq_ptr, src, valid, k0, K, BK,
                      DQ_ROW, ROW_CODES)  # fmt: skip
    if COL:
        if ONE_GROUP:
            s_dec_t, mult_t = nvfp4_global(tl.load(amax_col_ptr + g0, mask=g0 < E, other=0.0))
        else:
            g_t = _block_groups(group_ptr, p0, P, E, BM)
            s_dec_t, mult_t = nvfp4_global(tl.load(amax_col_ptr + g_t, mask=g_t < E, other=0.0))
            s_dec_t = s_dec_t[None, :]
            mult_t = mult_t[None, :]
        # block counters past the row copy's, as in the dense kernel
        base = ((P + 15) // 16) * 16 * (K // 16)
        u_t = _uniforms(seed_ptr, seed_ptr, k0, p0, K, P, base, BK, BM, COL_SR, False, True)
        quantize_columns(x, s_dec_t, mult_t, u_t, h_ptr, data_t_ptr, scale_t_ptr, dq_t_ptr,
                         k0, p0, K, P, BK, BM, False, COL_SR, COL_HAD, DQ_COL, DOT_F32,
                         HW, COL_CODES, ENC_TABLE and ONE_GROUP)  # fmt: skip


@triton.jit
def _mxfp8_grouped_kernel(
    x_ptr, stride_m, stride_k, src_ptr, P, K,
    data_ptr, scale_ptr, dq_ptr, data_t_ptr, scale_t_ptr, dq_t_ptr,
    ROW: tl.constexpr, COL: tl.constexpr, DQ_ROW: tl.constexpr, DQ_COL: tl.constexpr,
    HW_FP8: tl.constexpr, GATHER: tl.constexpr, band, DOT_F32: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr, ROW_CODES: tl.constexpr = True,
    COL_CODES: tl.constexpr = True,
):  # fmt: skip
    """ROW_CODES / COL_CODES False (with that copy's DQ): the copy's `_dq` alone."""
    tile_p, tile_k = band_tile(band)
    p0 = tile_p * BM
    k0 = tile_k * BK
    x, src, valid = _load_positions(
        x_ptr, stride_m, stride_k, src_ptr, p0, k0, P, K, BM, BK, GATHER
    )
    if ROW:
        byte, ecode, dq, _ = _mx_tile(x.to(tl.float32), BM, BK, HW_FP8)
        store_mx_rows(byte, ecode, dq, data_ptr, scale_ptr, dq_ptr, src, valid, k0, K, BK,
                         DQ_ROW, ROW_CODES)  # fmt: skip
    if COL:
        quantize_columns_mx(x, data_t_ptr, scale_t_ptr, dq_t_ptr, k0, p0, K, P, BK, BM, DQ_COL,
                            HW_FP8, DOT_F32, COL_CODES)  # fmt: skip


# ----------------------------------------------------------------------------- launchers


@library_op("blockscale::group_amax_2d", mutates_args=(), triton=True, any_strides=True)
def _group_amax_2d(
    x: torch.Tensor,
    source: torch.Tensor | None,
    group: torch.Tensor,
    groups: int,
    plain: bool,
    hadamard: bool,
) -> torch.Tensor:
    """FP32 [2, E]: each group's max |x| and max |Hadamard token copy| (unrequested: 0)."""
    M, K = x.shape
    P = source.shape[0] if source is not None else M
    out = torch.zeros(2, groups, dtype=torch.int32, device=x.device)
    if P % 16:
        raise ValueError(f"{P} positions is not a multiple of 16 (the group amax reads blocks)")
    if P and K and groups:
        bk, warps, blocks = AMAX_TILE
        blocks = max(blocks, cdiv(P // 16, 65535))  # grid axis 1 is capped at 65535 strips
        grid = (cdiv(K, bk), cdiv(P // 16, blocks))
        launch(_group_amax_kernel, grid,
            x, x.stride(0), x.stride(1), source if source is not None else group, group, P, K,
            groups, out[0], out[1],
            PLAIN=plain, HAD=hadamard, GATHER=source is not None, EVEN_K=K % bk == 0,
            SIGN_MASK=_SIGN_MASK, FLIPS=_FLIPS, FAST_BELOW=_FAST_BELOW, BK=bk, BLOCKS=blocks,
            num_warps=warps,
        )  # fmt: skip
    return out.view(torch.float32)


@library_op("blockscale::nvfp4_quantize_grouped_2d", mutates_args=(), triton=True, any_strides=True)
def _nvfp4_quantize_grouped_2d(
    x: torch.Tensor,
    source: torch.Tensor | None,
    group: torch.Tensor,
    amax_row: torch.Tensor,
    amax_col: torch.Tensor,
    seed: torch.Tensor | None,
    row: bool,
    col: bool,
    row_2d: bool,
    row_sr: bool,
    col_sr: bool,
    col_hadamard: bool,
    dq_row: bool,
    dq_col: bool,
    row_codes: bool = True,
    col_codes: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] walked through `source` (None: its own rows) -> the row copy (data [M, K/2],
    scale [M, K/16], dq [M, K]) and the token copy ([K, P/2], [K, P/16], [K, P]); amax_* [E]
    per group, `group` [P] int32. Unused outputs are empty; scales are raw E4M3 bytes.
    `row_codes` / `col_codes` False with that copy's `_dq`: the `_dq` alone, its codes and
    scales empty ([0, K/2], [0, K/16]; an emulated GEMM's operand, read once and not kept)."""
    M, K = x.shape
    P = source.shape[0] if source is not None else M
    E = amax_row.shape[0] if row else amax_col.shape[0]
    dev = x.device
    outs, (dq_row, dq_col, row_codes, col_codes) = copy_outputs(
        nv._empty_like_spec, M, K, P, dev, row, col, dq_row, dq_col, row_codes, col_codes
    )
    data, scale, dq_r, data_t, scale_t, dq_c = outs
    if P == 0 or K == 0 or not (row or col):
        return data, scale, dq_r, data_t, scale_t, dq_c
    kind = launch_kind(row, col, dq_row or dq_col, (row and row_sr) or (col and col_sr))
    bm, bk, options = launch_tiles(TILES.get(f"nvfp4:{kind}", nv.TILES[kind]))
    grid, band = band_grid(P, K, bm, bk)
    launch(_nvfp4_grouped_kernel, grid,
        x, x.stride(0), x.stride(1), source if source is not None else group, group, P, K, E,
        amax_row, amax_col, hadamard_matrix(dev), seed if seed is not None else amax_row,
        data, scale, dq_r.view(torch.int16), data_t, scale_t, dq_c.view(torch.int16),
        ROW=row, COL=col, ROW_2D=row_2d, ROW_SR=row_sr, COL_SR=col_sr, COL_HAD=col_hadamard,
        DQ_ROW=dq_row, DQ_COL=dq_col, GATHER=source is not None, band=band,
        DOT_F32=dot_in_fp32(x), HW=not interpreting(), ENC_TABLE=nv.ENC_TABLE,
        BM=bm, BK=bk, ONE_GROUP=kind in ONE_GROUP_KINDS and _one_group(source is not None, P, E, bm),
        ROW_CODES=row_codes, COL_CODES=col_codes, **options,
    )  # fmt: skip
    return data, scale, dq_r, data_t, scale_t, dq_c


# The NVFP4 launch kinds that compute a tile's global scales once where the tile lies in one
# group (`_nvfp4_grouped_kernel`'s ONE_GROUP). Measured on one H200 (2026-11-29,
# bench_moe_kernels.py, DeepSeek-V3-like and Mixtral-like shapes, against the per-row code of
# 2026-11-28 at the same tiles): the backward's stochastic both-direction launches 3-4% faster
# (1277 -> 1223 us, 3963 -> 3809 us), the expert weights' 16x16 copies 3-6% (957 -> 924 us,
# 844 -> 797 us); but the forward's both-direction launch 15% slower (1129 -> 1298 us: 88
# registers, a program an SM fewer; 1210 us under an 80-register cap), so it keeps the
# per-row code. Other kinds were not measured and keep it too.
ONE_GROUP_KINDS = ("row_dq", "both_sr_dq")


def _one_group(gathered: bool, positions: int, groups: int, bm: int) -> bool:
    """Whether every BM-position tile lies in one group (or wholly past the last segment, group
    E): a token layout's segments and its length are multiples of TOKEN_ALIGN positions
    (formats/grouped.py), so any BM dividing it; expert weight rows ([E*N, K], source None)
    when BM divides N."""
    if gathered:
        return TOKEN_ALIGN % bm == 0
    return positions % groups == 0 and (positions // groups) % bm == 0


@library_op("blockscale::mxfp8_quantize_grouped_2d", mutates_args=(), triton=True)
def _mxfp8_quantize_grouped_2d(
    x: torch.Tensor,
    source: torch.Tensor | None,
    row: bool,
    col: bool,
    dq_row: bool,
    dq_col: bool,
    row_codes: bool = True,
    col_codes: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] walked through `source` (None: its own rows) -> the row copy ([M, K] E4M3
    bytes, [M, K/32] E8M0 bytes, dq) and the token copy ([K, P], [K, P/32], dq); unused
    outputs are empty. `row_codes` / `col_codes` False with that copy's `_dq`: the `_dq`
    alone, its bytes and scales empty ([0, K], [0, K/32])."""
    M, K = x.shape
    P = source.shape[0] if source is not None else M
    dev = x.device
    outs, (dq_row, dq_col, row_codes, col_codes) = copy_outputs(
        mx._outputs, M, K, P, dev, row, col, dq_row, dq_col, row_codes, col_codes
    )
    data, scale, dq_r, data_t, scale_t, dq_c = outs
    if P and K and (row or col):
        kind = launch_kind(row, col, dq_row or dq_col)
        bm, bk, options = launch_tiles(TILES.get(f"mxfp8:{kind}", mx.TILES[kind]))
        grid, band = band_grid(P, K, bm, bk)
        launch(_mxfp8_grouped_kernel, grid,
            x, x.stride(0), x.stride(1), source if source is not None else data, P, K,
            data, scale, dq_r.view(torch.int16), data_t, scale_t, dq_c.view(torch.int16),
            ROW=row, COL=col, DQ_ROW=dq_row, DQ_COL=dq_col, HW_FP8=not interpreting(),
            GATHER=source is not None, band=band, DOT_F32=dot_in_fp32(x), BM=bm, BK=bk,
            ROW_CODES=row_codes, COL_CODES=col_codes, **options,
        )  # fmt: skip
    return data, scale, dq_r, data_t, scale_t, dq_c


# ----------------------------------------------------------------------------- Python API


def group_amax(
    x: torch.Tensor, layout: TokenLayout, plain: bool = True, hadamard: bool = False
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(each group's max |x|, each group's max |Hadamard token copy|) as FP32 [E] tensors
    from one read of x; None for the one not asked for. formats.grouped.group_amax, fast."""
    E = layout.seg_ends.shape[0]
    out = _group_amax_2d(x, layout.source, layout.group, E, plain, hadamard)
    return (out[0] if plain else None), (out[1] if hadamard else None)


def _expert_rows(
    w: torch.Tensor, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w as [E*N, K] rows, each row's expert as int32, each expert's max |w| as FP32 [E]):
    the amaxes from one read (the group amax kernel over the rows, no |w| temporary), or
    `amax` as given (the backward's copy reuses the forward's)."""
    E, N, K = w.shape
    rows = w.reshape(E * N, K)
    group = torch.arange(E * N, device=w.device, dtype=torch.int32) // max(N, 1)
    if amax is None:
        amax = _group_amax_2d(rows, None, group, E, True, False)[0]
    return rows, group, amax.float().contiguous()


def experts_amax(w: torch.Tensor) -> torch.Tensor:
    """FP32 [E]: each expert's max |w[e]| of w [E, N, K], the amax its NVFP4 copy takes, from
    one read. formats.grouped.experts_amax, fast."""
    return _expert_rows(w)[2]


def _nvfp4_grouped(data, scale, amax, shape, block, hadamard) -> NVFP4Tensor:
    """(A copy written without its codes keeps its empty [0, C/2] and [0, C/16].)"""
    lead = shape[:-1] if data.numel() or not math.prod(shape) else (0,)
    return NVFP4Tensor(
        data.reshape(*lead, shape[-1] // 2),
        scale.view(torch.float8_e4m3fn).reshape(*lead, shape[-1] // 16),
        amax,
        torch.Size(shape),
        block,
        hadamard,
    )


def nvfp4_quantize_grouped(
    x: torch.Tensor,
    layout: TokenLayout,
    rows: str | None = "nearest",
    tokens: str | None = None,
    hadamard: bool = False,
    return_dq: tuple[bool, bool] = (True, False),
    amax: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    generator: torch.Generator | None = None,
    codes: tuple[bool, bool] = (True, True),
):
    """The row copy of grouped x [M, C] (1x16 along C, rounding `rows`) and its token copy
    ([C, P] in `layout`, rounding `tokens`, optionally Hadamard) from one read of x; a None
    rounding skips that copy. Returns ((q_row, dq_row), (q_tok, dq_tok)) with None for what
    was skipped or not asked for in `return_dq`. Group amaxes are computed in one fused pass
    unless given in `amax` (row, tokens). Equals formats.grouped's nvfp4_quantize_rows /
    nvfp4_quantize_tokens bit for bit (nearest rounding). `codes` (row, tokens) False for a
    copy whose `_dq` is asked for: that `_dq` alone, the container's data and scale empty
    (for a caller that reads only the `_dq`)."""
    want_row, want_tok = rows is not None, tokens is not None
    amax_r, amax_t = amax
    find_row = want_row and amax_r is None
    find_tok = want_tok and amax_t is None
    if find_row or find_tok:
        plain, had = group_amax(
            x, layout, plain=find_row or (find_tok and not hadamard), hadamard=find_tok and hadamard
        )
        amax_r = plain if find_row else amax_r
        amax_t = (had if hadamard else plain) if find_tok else amax_t
    E = layout.seg_ends.shape[0]
    dummy = x.new_zeros(E, dtype=torch.float32)
    sr_row, sr_tok = rows == "stochastic", tokens == "stochastic"
    seed = sr_seed(x.device, generator) if sr_row or sr_tok else None
    data, scale, dq, data_t, scale_t, dq_t = _nvfp4_quantize_grouped_2d(
        x, layout.source, layout.group,
        amax_r if want_row else dummy, amax_t if want_tok else dummy, seed,
        row=want_row, col=want_tok, row_2d=False, row_sr=sr_row, col_sr=sr_tok,
        col_hadamard=hadamard, dq_row=return_dq[0], dq_col=return_dq[1],
        row_codes=codes[0], col_codes=codes[1],
    )  # fmt: skip
    row_out = tok_out = None
    if want_row:
        q = _nvfp4_grouped(data, scale, amax_r, x.shape, "1x16", False)
        row_out = (q, dq if return_dq[0] else None)
    if want_tok:
        shape = torch.Size((x.shape[1], layout.capacity))
        q = _nvfp4_grouped(data_t, scale_t, amax_t, shape, "1x16", hadamard)
        tok_out = (q, dq_t if return_dq[1] else None)
    return row_out, tok_out


def nvfp4_quantize_experts(
    w: torch.Tensor,
    block: str = "16x16",
    return_dq: bool = False,
    amax: torch.Tensor | None = None,
    codes: bool = True,
):
    """Expert weights w [E, N, K] quantized along K, each expert with its own amax (one pass
    for the amaxes unless `amax` [E] is given, one for the codes).
    formats.grouped.nvfp4_quantize_experts, fast. `codes=False` with `return_dq`: the `_dq`
    alone, the container's data and scale empty (a copy that feeds only emulated GEMMs and
    is kept by nothing)."""
    w2, group, amax = _expert_rows(w, amax)
    data, scale, dq, *_ = _nvfp4_quantize_grouped_2d(
        w2, None, group, amax, amax, None, row=True, col=False, row_2d=block == "16x16",
        row_sr=False, col_sr=False, col_hadamard=False, dq_row=return_dq, dq_col=False,
        row_codes=codes,
    )  # fmt: skip
    q = _nvfp4_grouped(data, scale, amax, w.shape, block, False)
    return (q, dq.reshape(w.shape)) if return_dq else q


def nvfp4_quantize_experts_t(
    w: torch.Tensor, return_dq: bool = False, amax: torch.Tensor | None = None
):
    """Expert weights w [E, N, K] quantized along N in 1x16 blocks, each expert with its own
    amax (`amax` [E] if given): the dgrad copy of a 1x16 recipe, as [E, K, N] (a strided view
    per expert)."""
    E, N, K = w.shape
    w2, group, amax = _expert_rows(w, amax)
    *_, data_t, scale_t, dq_t = _nvfp4_quantize_grouped_2d(
        w2, None, group, amax, amax, None, row=False, col=True, row_2d=False,
        row_sr=False, col_sr=False, col_hadamard=False, dq_row=False, dq_col=return_dq,
    )  # fmt: skip
    # [K, E*N] -> [E, K, N] views: each expert's block of columns
    data = data_t.view(K, E, N // 2).permute(1, 0, 2)
    scale = scale_t.view(torch.float8_e4m3fn).view(K, E, N // 16).permute(1, 0, 2)
    q = NVFP4Tensor(data, scale, amax, torch.Size((E, K, N)), "1x16", False)
    return (q, dq_t.view(K, E, N).permute(1, 0, 2)) if return_dq else q


def mxfp8_quantize_grouped(
    x: torch.Tensor,
    layout: TokenLayout,
    rows: bool = True,
    tokens: bool = False,
    return_dq: tuple[bool, bool] = (True, False),
    codes: tuple[bool, bool] = (True, True),
):
    """MXFP8 row copy of grouped x [M, C] and its token copy ([C, P] in `layout`) from one
    read of x; ((q_row, dq_row) | None, (q_tok, dq_tok) | None). `codes` as in
    `nvfp4_quantize_grouped`: False for a copy with its `_dq`, that `_dq` alone."""
    data, scale, dq, data_t, scale_t, dq_t = _mxfp8_quantize_grouped_2d(
        x, layout.source, rows, tokens, return_dq[0], return_dq[1], codes[0], codes[1]
    )
    row_out = tok_out = None
    if rows:
        row_out = (mx._container(data, scale, x.shape), dq if return_dq[0] else None)
    if tokens:
        shape = torch.Size((x.shape[1], layout.capacity))
        tok_out = (mx._container(data_t, scale_t, shape), dq_t if return_dq[1] else None)
    return row_out, tok_out


def _mxfp8_experts(
    w: torch.Tensor, row: bool, col: bool, dq_row: bool, dq_col: bool, row_codes: bool = True
):
    """Expert weights w [E, N, K] in MXFP8 along K ([E, N, K]) and/or along N ([E, K, N], a
    strided view per expert), both from one read of w: the [E*N, K] rows in one launch (blocks
    of 32 along N never cross experts, N % 32 == 0; 64-bit offsets, since a stack of experts
    passes 2^31 values). Returns (copy along K | None, copy along N | None), each `(q, dq)`
    where its `_dq` was asked for, else q. `row_codes=False`: the copy along K, made with its
    `_dq`, is that `_dq` alone (the copy along N keeps its codes: its views need them)."""
    E, N, K = w.shape
    data, scale, dq, data_t, scale_t, dq_t = _mxfp8_quantize_grouped_2d(
        w.reshape(E * N, K), None, row, col, dq_row, dq_col, row_codes, True
    )
    along_k = along_n = None
    if row:
        along_k = mx._container(data, scale, w.shape)
        along_k = (along_k, dq.reshape(E, N, K)) if dq_row else along_k
    if col:
        q = mx._container(data_t, scale_t, torch.Size((K, E * N)))
        along_n = MXFP8Tensor(
            q.data.view(K, E, N).permute(1, 0, 2),
            q.scale.view(K, E, N // 32).permute(1, 0, 2),
            torch.Size((E, K, N)),
        )
        along_n = (along_n, dq_t.view(K, E, N).permute(1, 0, 2)) if dq_col else along_n
    return along_k, along_n


def mxfp8_quantize_experts(
    w: torch.Tensor, transpose: bool = False, return_dq: bool = False, codes: bool = True
):
    """Expert weights w [E, N, K] in MXFP8 along K ([E, N, K]) or along N ([E, K, N], a
    strided view per expert), with its `_dq` if `return_dq`; `codes=False` (along K, with the
    `_dq`): the `_dq` alone."""
    if transpose and not codes:
        raise ValueError("a copy along N keeps its codes (codes=False is for the copy along K)")
    along_k, along_n = _mxfp8_experts(w, not transpose, transpose, return_dq, return_dq, codes)
    return along_n if transpose else along_k


def mxfp8_quantize_experts_pair(w: torch.Tensor, return_dq: bool = False, codes: bool = True):
    """Both MXFP8 copies of expert weights w [E, N, K] from one read (a forward that keeps the
    copy along N for grad_input): (copy along K, with its `_dq` if `return_dq`; copy along N,
    packed). The bits of two `mxfp8_quantize_experts` calls; one FP32 read of the weights
    instead of two (docs/KERNELS.md, "The MoE models' own launches"). `codes=False` with
    `return_dq`: the copy along K as its `_dq` alone."""
    return _mxfp8_experts(w, True, True, return_dq, False, codes)
