"""Block scales to and from the cuBLAS 128x4 blocked layout used by the native GEMMs.

A row-major scale matrix [R, C] (R rows of the operand, C scale columns along K) is padded
with zeros to [ceil(R/128)*128, ceil(C/4)*4] and tiled into 128x4 blocks; inside a block
row r and column c land at (r % 32) * 16 + (r // 32) * 4 + c. Blocks follow each other
row-block-major. The result is a flat tensor of the padded size.

Grouped GEMMs (mixture of experts) swizzle per group, so that no 128x4 block mixes two
experts. The layouts are the ones the grouped kernels behind
`torch.nn.functional.scaled_grouped_mm` (MSLK / FBGEMM `set_grouped_gemm_args_kernel`) read;
gemm/native_grouped.py lists the sources:

- row groups (`to_blocked_row_groups`, the 2D operand of a 2D x 3D GEMM, groups along M):
  each group's rows start on a fresh 128-row block. Group g's blocks begin at padded row
  sum_{i<g} round_up(m_i, 128), i.e. at flat offset that times round_up(C, 4); inside, its
  [m_g, C] scales in the plain blocked layout. Empty groups take no rows.
- column groups (`to_blocked_col_groups`, both operands of a 2D x 2D GEMM, groups along the
  contraction): group g's [R, c_g] scales, blocked on their own (columns padded to 4), one
  group after the other: group g starts at flat offset round_up(R, 128) * sum_{i<g}
  round_up(c_i, 4).
- experts (`to_blocked_experts`, a 3D operand [E, R, C]): each expert blocked on its own,
  stacked to [E, round_up(R, 128) * round_up(C, 4)].

The group sizes are on the device (offsets), so every grouped function here sizes its output
from static bounds (`rows_bound`, `cols_bound`: every group padded by at most a block) and
never reads the offsets on the host. The space past the last group is zeros.
"""

import torch


def padded_shape(rows: int, cols: int) -> tuple[int, int]:
    return -(-rows // 128) * 128, -(-cols // 4) * 4


def _as_raw(scale: torch.Tensor) -> torch.Tensor:
    """1-byte scales (E4M3, E8M0) as uint8, which every indexing op takes; others as they are."""
    return scale.view(torch.uint8) if scale.element_size() == 1 else scale


def _tiles(padded: torch.Tensor) -> torch.Tensor:
    """[..., Rp, Cp] (multiples of 128 and 4) -> [..., Rp/128, Cp/4, 512]: each 128x4 block
    in its internal order, blocks row-block-major."""
    *lead, rp, cp = padded.shape
    n = len(lead)
    tiles = padded.view(*lead, rp // 128, 4, 32, cp // 4, 4)
    return tiles.permute(*range(n), n, n + 3, n + 2, n + 1, n + 4).reshape(
        *lead, rp // 128, cp // 4, 512
    )


def to_blocked(scale: torch.Tensor) -> torch.Tensor:
    """[R, C] scales -> flat swizzled tensor of padded_shape(R, C) elements, same dtype."""
    if scale.dim() != 2:
        raise ValueError(f"scale must be 2-D [rows, cols], got shape {tuple(scale.shape)}")
    rows, cols = scale.shape
    rp, cp = padded_shape(rows, cols)
    raw = _as_raw(scale)
    padded = raw.new_zeros(rp, cp)
    padded[:rows, :cols] = raw
    return _tiles(padded).reshape(-1).view(scale.dtype)


def from_blocked(blocked: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of to_blocked: the flat swizzled tensor -> the [rows, cols] scales."""
    rp, cp = padded_shape(rows, cols)
    if blocked.numel() != rp * cp:
        raise ValueError(
            f"blocked scale has {blocked.numel()} elements, expected {rp * cp} for "
            f"[{rows}, {cols}] padded to [{rp}, {cp}]"
        )
    raw = _as_raw(blocked)
    padded = raw.reshape(rp // 128, cp // 4, 32, 4, 4).permute(0, 3, 2, 1, 4).reshape(rp, cp)
    return padded[:rows, :cols].contiguous().view(blocked.dtype)


# ------------------------------------------------------------------- grouped layouts


def rows_bound(rows: int, groups: int) -> int:
    """Padded rows enough for any `groups` groups over `rows` rows, each group's rows rounded
    up to 128: sum ceil(m_g / 128) <= rows // 128 + groups."""
    return (rows // 128 + groups) * 128


def cols_bound(cols: int, groups: int) -> int:
    """Padded scale columns enough for any `groups` column groups over `cols` columns, each
    rounded up to 4."""
    return (cols // 4 + groups) * 4


def _check_offs(offs: torch.Tensor) -> None:
    if offs.dim() != 1 or offs.shape[0] == 0:
        raise ValueError(
            f"offs must be 1-D with one cumulative end per group (at least one group), "
            f"got shape {tuple(offs.shape)}"
        )


def padded_group_starts(offs: torch.Tensor, multiple: int) -> torch.Tensor:
    """int64 [E]: where each group starts once every group's size (from the cumulative ends
    `offs`) is rounded up to `multiple`. Device ops only."""
    ends = offs.long()
    sizes = ends - torch.cat((ends.new_zeros(1), ends[:-1]))
    padded = (sizes + multiple - 1) // multiple * multiple
    return padded.cumsum(0) - padded


def group_sources(offs: torch.Tensor, multiple: int, bound: int) -> torch.Tensor:
    """int64 [bound]: for each position of the padded layout (every group rounded up to
    `multiple`, groups back to back), the unpadded position it holds, or -1 for padding and
    for the space past the last group."""
    _check_offs(offs)
    ends = offs.long()
    starts = torch.cat((ends.new_zeros(1), ends[:-1]))
    sizes = ends - starts
    padded = (sizes + multiple - 1) // multiple * multiple
    padded_ends = padded.cumsum(0)
    position = torch.arange(bound, device=offs.device)
    # the group whose padded range holds each position (empty groups hold none); E past the end
    group = torch.searchsorted(padded_ends, position, right=True)
    g = group.clamp(max=offs.shape[0] - 1)
    within = position - (padded_ends[g] - padded[g])
    real = (group < offs.shape[0]) & (within < sizes[g])
    return torch.where(real, starts[g] + within, -1)


def _gather(raw: torch.Tensor, index: torch.Tensor, dim: int) -> torch.Tensor:
    """raw's slices at `index` along `dim`, zeros where index is -1."""
    if raw.shape[dim] == 0:
        shape = list(raw.shape)
        shape[dim] = index.shape[0]
        return raw.new_zeros(shape)
    picked = raw.index_select(dim, index.clamp(min=0))
    keep = (index >= 0).view([-1 if d == dim else 1 for d in range(raw.dim())])
    return torch.where(keep, picked, torch.zeros((), dtype=raw.dtype, device=raw.device))


def to_blocked_row_groups(scale: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """[M, C] scales of a row-grouped operand (group g: rows offs[g-1]:offs[g]) -> flat
    [rows_bound(M, E) * round_up(C, 4)], each group's rows starting a fresh 128-row block.
    Rows past offs[-1] are dropped. No host synchronization."""
    if scale.dim() != 2:
        raise ValueError(f"scale must be 2-D [rows, cols], got shape {tuple(scale.shape)}")
    rows, cols = scale.shape
    source = group_sources(offs, 128, rows_bound(rows, offs.shape[0]))
    raw = _as_raw(scale)
    padded = raw.new_zeros(source.shape[0], padded_shape(0, cols)[1])
    padded[:, :cols] = _gather(raw, source, 0)
    return _tiles(padded).reshape(-1).view(scale.dtype)


def col_group_tile_sources(col_offs: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """int64 [T]: for each 512-element tile of `to_blocked_col_groups`' output, in output
    order, the index rb * CB + cb of the tile it holds in the row-block-major tiling of the
    [round_up(rows, 128), cols_bound(cols, E)] matrix whose group g owns padded column
    blocks [b_g, e_g). Output order: group by group, and within a group row block by row
    block. The tiles past the last group (all zeros) form one more pseudo-group at the end."""
    _check_offs(col_offs)
    row_blocks = padded_shape(rows, 0)[0] // 128
    col_blocks = cols_bound(cols, col_offs.shape[0]) // 4
    block_starts = padded_group_starts(col_offs, 4) // 4
    ends = col_offs.long()
    sizes = ends - torch.cat((ends.new_zeros(1), ends[:-1]))
    block_ends = block_starts + (sizes + 3) // 4
    used = block_ends[-1:]
    begin = torch.cat((block_starts, used))  # [E + 1]: the pseudo-group starts at `used`
    end = torch.cat((block_ends, used.new_full((1,), col_blocks)))
    tile = torch.arange(row_blocks * col_blocks, device=col_offs.device)
    group = torch.searchsorted(end * row_blocks, tile, right=True).clamp(max=begin.shape[0] - 1)
    width = (end - begin)[group]
    local = tile - begin[group] * row_blocks
    row_block = local // width.clamp(min=1)
    col_block = begin[group] + local % width.clamp(min=1)
    return row_block * col_blocks + col_block


def to_blocked_col_groups(scale: torch.Tensor, col_offs: torch.Tensor) -> torch.Tensor:
    """[R, C] scales of a column-grouped operand (group g: scale columns
    col_offs[g-1]:col_offs[g]) -> flat [round_up(R, 128) * cols_bound(C, E)]: group g's
    [R, c_g] scales blocked on their own, groups back to back. Columns past col_offs[-1] are
    dropped. No host synchronization."""
    if scale.dim() != 2:
        raise ValueError(f"scale must be 2-D [rows, cols], got shape {tuple(scale.shape)}")
    rows, cols = scale.shape
    source = group_sources(col_offs, 4, cols_bound(cols, col_offs.shape[0]))
    raw = _as_raw(scale)
    padded = raw.new_zeros(padded_shape(rows, 0)[0], source.shape[0])
    padded[:rows] = _gather(raw, source, 1)
    tiles = _tiles(padded).reshape(-1, 512)
    order = col_group_tile_sources(col_offs, rows, cols)
    return tiles[order].reshape(-1).view(scale.dtype)


def to_blocked_experts(scale: torch.Tensor) -> torch.Tensor:
    """[E, R, C] scales of a 3D operand -> [E, round_up(R, 128) * round_up(C, 4)]: each
    expert's scales blocked on their own."""
    if scale.dim() != 3:
        raise ValueError(f"scale must be 3-D [experts, rows, cols], got {tuple(scale.shape)}")
    experts, rows, cols = scale.shape
    rp, cp = padded_shape(rows, cols)
    raw = _as_raw(scale)
    padded = raw.new_zeros(experts, rp, cp)
    padded[:, :rows, :cols] = raw
    return _tiles(padded).reshape(experts, -1).view(scale.dtype)
