"""Block scales to the cuBLAS 128x4 blocked layout (formats/swizzle.py), as gather kernels
over the padded output: each output byte finds its (row, col) source, and the padding is
written as zeros. Bytes: read the scales once, write the padded size.

- `swizzle_scales`: one matrix, or a stack of experts (`swizzle_scales_experts`, one program
  row per expert), to_blocked / to_blocked_experts.
- `swizzle_scales_row_groups` / `swizzle_scales_col_groups`: the grouped layouts of
  to_blocked_row_groups / to_blocked_col_groups. Where a group's rows or columns land depends
  on the device offsets; the index maps (formats/swizzle.py's `group_sources` and
  `col_group_tile_sources`, a few PyTorch ops over [rows_bound] or [tiles] integers) say it,
  and the kernel reads them, so nothing waits for the host.
"""

import torch
import triton
import triton.language as tl

from blockscale._registry import library_op
from blockscale.formats import swizzle as ref
from blockscale.kernels._common import cdiv
from blockscale.kernels._launch import launch

BLOCK = 1024


@triton.jit
def _swizzle_kernel(
    src_ptr, out_ptr, R, C, n_col_blocks, total, src_batch, out_batch, BLOCK: tl.constexpr
):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    src_ptr += tl.program_id(1) * src_batch
    out_ptr += tl.program_id(1) * out_batch
    blk = o // 512
    within = o % 512
    r = (blk // n_col_blocks) * 128 + ((within // 4) % 4) * 32 + within // 16
    c = (blk % n_col_blocks) * 4 + within % 4
    v = tl.load(src_ptr + r * C + c, mask=(o < total) & (r < R) & (c < C), other=0)
    tl.store(out_ptr + o, v, mask=o < total)


@triton.jit
def _swizzle_row_groups_kernel(
    src_ptr, row_source_ptr, out_ptr, C, n_col_blocks, total, BLOCK: tl.constexpr
):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    blk = o // 512
    within = o % 512
    padded_row = (blk // n_col_blocks) * 128 + ((within // 4) % 4) * 32 + within // 16
    c = (blk % n_col_blocks) * 4 + within % 4
    r = tl.load(row_source_ptr + padded_row, mask=o < total, other=-1)
    v = tl.load(src_ptr + r.to(tl.int64) * C + c, mask=(o < total) & (r >= 0) & (c < C), other=0)
    tl.store(out_ptr + o, v, mask=o < total)


@triton.jit
def _swizzle_col_groups_kernel(
    src_ptr, col_source_ptr, tile_source_ptr, out_ptr, R, C, n_col_blocks, total,
    BLOCK: tl.constexpr,
):  # fmt: skip
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    within = o % 512
    tile = tl.load(tile_source_ptr + o // 512, mask=o < total, other=0)
    r = (tile // n_col_blocks) * 128 + ((within // 4) % 4) * 32 + within // 16
    padded_col = (tile % n_col_blocks) * 4 + within % 4
    c = tl.load(col_source_ptr + padded_col, mask=o < total, other=-1)
    v = tl.load(src_ptr + r.to(tl.int64) * C + c, mask=(o < total) & (r < R) & (c >= 0), other=0)
    tl.store(out_ptr + o, v, mask=o < total)


@library_op("blockscale::swizzle_scales_2d", mutates_args=(), triton=True)
def _swizzle_2d(scale: torch.Tensor) -> torch.Tensor:
    """uint8 [R, C] row-major scales -> flat uint8 of the padded 128x4-blocked layout."""
    R, C = scale.shape
    rp, cp = ref.padded_shape(R, C)
    out = torch.empty(rp * cp, dtype=torch.uint8, device=scale.device)
    if rp * cp:
        grid = (cdiv(rp * cp, BLOCK), 1)
        launch(_swizzle_kernel, grid,
            scale, out, R, C, cp // 4, rp * cp, 0, 0, BLOCK=BLOCK, num_warps=4,
        )  # fmt: skip
    return out


@library_op("blockscale::swizzle_scales_experts", mutates_args=(), triton=True)
def _swizzle_experts(scale: torch.Tensor) -> torch.Tensor:
    """uint8 [E, R, C] contiguous scales -> uint8 [E, padded size], each expert blocked."""
    E, R, C = scale.shape
    rp, cp = ref.padded_shape(R, C)
    out = torch.empty(E, rp * cp, dtype=torch.uint8, device=scale.device)
    if E * rp * cp:
        grid = (cdiv(rp * cp, BLOCK), E)
        launch(_swizzle_kernel, grid,
            scale, out, R, C, cp // 4, rp * cp, R * C, rp * cp, BLOCK=BLOCK, num_warps=4,
        )  # fmt: skip
    return out


@library_op("blockscale::swizzle_scales_row_groups", mutates_args=(), triton=True)
def _swizzle_row_groups(scale: torch.Tensor, row_source: torch.Tensor) -> torch.Tensor:
    """uint8 [M, C] scales and int32 row_source [Rb] -> flat uint8 [Rb * round_up(C, 4)]."""
    C = scale.shape[1]
    cp = ref.padded_shape(0, C)[1]
    total = row_source.shape[0] * cp
    out = torch.empty(total, dtype=torch.uint8, device=scale.device)
    if total:
        launch(_swizzle_row_groups_kernel, (cdiv(total, BLOCK),),
            scale, row_source, out, C, cp // 4, total, BLOCK=BLOCK, num_warps=4,
        )  # fmt: skip
    return out


@library_op("blockscale::swizzle_scales_col_groups", mutates_args=(), triton=True)
def _swizzle_col_groups(
    scale: torch.Tensor, col_source: torch.Tensor, tile_source: torch.Tensor
) -> torch.Tensor:
    """uint8 [R, C] scales, int32 col_source [Cb] and tile_source [T] -> flat uint8 [T * 512]."""
    R, C = scale.shape
    total = tile_source.shape[0] * 512
    out = torch.empty(total, dtype=torch.uint8, device=scale.device)
    if total:
        n_col_blocks = col_source.shape[0] // 4
        launch(_swizzle_col_groups_kernel, (cdiv(total, BLOCK),),
            scale, col_source, tile_source, out, R, C, n_col_blocks, total,
            BLOCK=BLOCK, num_warps=4,
        )  # fmt: skip
    return out


def _check_1byte(scale: torch.Tensor, dims: int) -> None:
    if scale.dim() != dims:
        raise ValueError(f"scale must be {dims}-D, got shape {tuple(scale.shape)}")
    if scale.element_size() != 1:
        raise ValueError(f"the swizzle kernels take 1-byte scales, got {scale.dtype}")


def swizzle_scales(scale: torch.Tensor) -> torch.Tensor:
    """formats.swizzle.to_blocked for 1-byte scales (E4M3 or E8M0), fast; same dtype out."""
    _check_1byte(scale, 2)
    return _swizzle_2d(scale.view(torch.uint8).contiguous()).view(scale.dtype)


def swizzle_scales_experts(scale: torch.Tensor) -> torch.Tensor:
    """formats.swizzle.to_blocked_experts for 1-byte scales [E, R, C]; same dtype out."""
    _check_1byte(scale, 3)
    return _swizzle_experts(scale.view(torch.uint8).contiguous()).view(scale.dtype)


def swizzle_scales_row_groups(scale: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """formats.swizzle.to_blocked_row_groups for 1-byte scales; same dtype out."""
    _check_1byte(scale, 2)
    rows = scale.shape[0]
    row_source = ref.group_sources(offs, 128, ref.rows_bound(rows, offs.shape[0]))
    raw = scale.view(torch.uint8).contiguous()
    return _swizzle_row_groups(raw, row_source.to(torch.int32)).view(scale.dtype)


def swizzle_scales_col_groups(scale: torch.Tensor, col_offs: torch.Tensor) -> torch.Tensor:
    """formats.swizzle.to_blocked_col_groups for 1-byte scales; same dtype out."""
    _check_1byte(scale, 2)
    rows, cols = scale.shape
    col_source = ref.group_sources(col_offs, 4, ref.cols_bound(cols, col_offs.shape[0]))
    tile_source = ref.col_group_tile_sources(col_offs, rows, cols)
    raw = scale.view(torch.uint8).contiguous()
    out = _swizzle_col_groups(raw, col_source.to(torch.int32), tile_source.to(torch.int32))
    return out.view(scale.dtype)
