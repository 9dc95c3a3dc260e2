"""The partial NVFP4 cast of ZeRO-sharded FP32 masters (distributed/master_cast.py, which holds
the algorithm and the PyTorch reference), for every weight of a call in one launch per step.

A rank owns one contiguous slice ("segment") of some weights, flattened row-major. Its
segments' values are read from one flat FP32 buffer: the shards themselves when they are
consecutive views of one storage (a distributed optimizer's own buffer), else their
concatenation (one copy). A small int64 table, column-major [FIELDS, segments], describes each
segment (see `slice_table`). A program owns one (segment, 16-row band, block of TILES 16x16
tiles along the row) region of one weight: the regions of all segments are numbered one after
another, and a program finds its segment by a binary search over the prefix sums of their
program counts (`_find_group`, shared with the grouped GEMMs). It loads its [16, 16 * TILES]
values with a mask for the elements the rank owns (zero elsewhere, which changes no amax), so:

- `partial_tile_amax`: each program reduces its tiles' amaxes in registers (integer max of the
  |x| bits, NaN above Inf) and stores them into the buffer of every tile of every weight.
  A tile belongs to one region of one segment, so there are no atomics; tiles outside every
  region stay zero (the buffer is zeroed).
- `owned_codes`: each program scales its values by their tile's encode multiplier, rounds them
  with the dense NVFP4 kernels' E2M1 helper (`_e2m1`, so the bits are theirs and the
  reference's), packs column pairs into bytes (cols are multiples of 16: a byte never crosses
  a row) and stores the bytes that hold at least one owned nibble into a zeroed buffer of all
  weights' codes. A byte shared with another rank gets only this rank's nibble; the all-reduce
  (SUM) that follows ORs the two.
- `expand_tile_scales`: the write-back of the tile scales, each repeated on its tile's 16 rows,
  for all weights into one buffer (one program per band and block of tiles), which the caller
  then copies into the weights with one batched copy.

Bytes (N owned elements of FP32 masters, T tiles of all weights): the amax pass reads 4N and
writes 4T; the code pass reads 4N + 4 bytes per touched tile and writes N/2; the expansion
reads T and writes 16T. Zero-padding regions at the slice ends read nothing (masked).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from blockscale._registry import library_op
from blockscale.kernels._common import abs_bits, cdiv
from blockscale.kernels._launch import launch
from blockscale.kernels.grouped_gemm import _find_group
from blockscale.kernels.nvfp4 import _e2m1

TILE = 16
TILES = 8  # 16x16 tiles per program along a band: [16, 128] values, 2048 per program
SCALE_BLOCK = 128  # tile scales per program of the expansion: [16, 128] bytes
# Rows of the segment table, in this order: the inclusive prefix sum of program counts, the
# first owned element (index in the flattened weight), the element count, the weight's cols,
# its first tile and first code byte in the all-weights buffers, the segment's position in the
# flat values, its first band of 16 rows, and its programs per band.
FIELDS = 9
# the NaN pattern distributed/_collectives.py gives every NaN amax (a kernel does not import
# upward into distributed/)
_NAN_BITS = tl.constexpr(0x7FC00000)


@triton.jit
def _owned_region(flat_ptr, table_ptr, S, TILES: tl.constexpr, SEARCH_STEPS: tl.constexpr):
    """This program's region: the owned values (FP32 [16, 16 * TILES], zero where not owned),
    the flattened-weight index of each column pair's first element, the segment's first and
    end index, the region's tile indices in the all-weights tile buffer, which of those are
    tiles of the weight, and the segment's first byte in the all-weights code buffer."""
    pid = tl.program_id(0)
    g = _find_group(table_ptr, pid, S - 1, SEARCH_STEPS)
    prog0 = tl.load(table_ptr + g - 1, mask=g > 0, other=0)
    start = tl.load(table_ptr + 1 * S + g)
    end = start + tl.load(table_ptr + 2 * S + g)
    cols = tl.load(table_ptr + 3 * S + g)
    tile_base = tl.load(table_ptr + 4 * S + g)
    byte_base = tl.load(table_ptr + 5 * S + g)
    flat_pos = tl.load(table_ptr + 6 * S + g)
    band0 = tl.load(table_ptr + 7 * S + g)
    col_blocks = tl.load(table_ptr + 8 * S + g)
    local = pid - prog0
    band = band0 + local // col_blocks
    c0 = (local % col_blocks) * (16 * TILES)
    rows = band * 16 + tl.arange(0, 16)
    cs = c0 + tl.arange(0, 16 * TILES)
    elem = rows[:, None] * cols + cs[None, :]  # int64: a weight may pass 2^31 values
    owned = (elem >= start) & (elem < end) & (cs < cols)[None, :]
    x = tl.load(flat_ptr + flat_pos + (elem - start), mask=owned, other=0.0).to(tl.float32)
    tcol = c0 // 16 + tl.arange(0, TILES)
    tiles = tile_base + band * (cols // 16) + tcol
    pairs = rows[:, None] * cols + (c0 + 2 * tl.arange(0, 8 * TILES))[None, :]
    pair_ok = (pairs + 1 >= start) & (pairs < end)
    pair_ok = pair_ok & (c0 + 2 * tl.arange(0, 8 * TILES) < cols)[None, :]
    return x, tiles, tcol < cols // 16, byte_base + pairs // 2, pair_ok


@triton.jit
def _tile_amax_kernel(
    flat_ptr, table_ptr, out_ptr, S, TILES: tl.constexpr, SEARCH_STEPS: tl.constexpr
):
    """out (int32 bits of FP32 amaxes) [tiles of the region] = max |owned x| bits."""
    x, tiles, tile_ok, _, _ = _owned_region(flat_ptr, table_ptr, S, TILES, SEARCH_STEPS)
    bits = tl.max(tl.reshape(abs_bits(x), [16, TILES, 16]), axis=2)
    bits = tl.max(bits, axis=0)
    # one NaN pattern, the one _collectives.amax_bits gives the reference's amaxes
    bits = tl.where(bits > 0x7F800000, _NAN_BITS, bits)
    tl.store(out_ptr + tiles, bits, mask=tile_ok)


@triton.jit
def _codes_kernel(
    flat_ptr, table_ptr, enc_ptr, out_ptr, S, TILES: tl.constexpr, SEARCH_STEPS: tl.constexpr
):
    """Packed E2M1 codes of the owned values, round to nearest even, into the bytes that hold
    at least one owned nibble (the other nibble of such a byte stays zero)."""
    x, tiles, tile_ok, byte, byte_ok = _owned_region(flat_ptr, table_ptr, S, TILES, SEARCH_STEPS)
    enc = tl.load(enc_ptr + tiles, mask=tile_ok, other=0.0)
    w = tl.reshape(x, [16, TILES, 16]) * enc[None, :, None]
    idx, _ = _e2m1(w, 0.0, False, False)  # the index is in its low three bits
    # NaN scaled values (a NaN weight: its multipliers are NaN) give code 0, as the reference
    code = tl.where(w == w, (idx & 7) | ((w < 0.0).to(tl.int32) << 3), 0)
    lo, hi = tl.split(tl.reshape(code, [16, 8 * TILES, 2]))
    tl.store(out_ptr + byte, (lo | (hi << 4)).to(tl.uint8), mask=byte_ok)


@triton.jit
def _expand_scales_kernel(
    tiles_ptr, table_ptr, out_ptr, W, BLOCK: tl.constexpr, SEARCH_STEPS: tl.constexpr
):
    """out[16 * tile_base + (16 * band + r) * ct + c] = tiles[tile_base + band * ct + c] for
    r < 16: a weight's tile scales on the 16 rows of their tiles (the 16x16 scale layout)."""
    pid = tl.program_id(0)
    g = _find_group(table_ptr, pid, W - 1, SEARCH_STEPS)
    prog0 = tl.load(table_ptr + g - 1, mask=g > 0, other=0)
    ct = tl.load(table_ptr + W + g)
    tile_base = tl.load(table_ptr + 2 * W + g)
    col_blocks = tl.load(table_ptr + 3 * W + g)
    local = pid - prog0
    band = local // col_blocks
    c = (local % col_blocks) * BLOCK + tl.arange(0, BLOCK)
    s = tl.load(tiles_ptr + tile_base + band * ct + c, mask=c < ct, other=0)
    r = tl.arange(0, 16)
    dst = 16 * tile_base + (16 * band + r)[:, None] * ct + c[None, :]
    tl.store(out_ptr + dst, tl.broadcast_to(s[None, :], [16, BLOCK]), mask=(c < ct)[None, :])


# ----------------------------------------------------------------------------- launchers


@library_op("blockscale::master_cast_tile_amax", triton=True)
def _tile_amax(flat: torch.Tensor, table: torch.Tensor, tiles: int, programs: int) -> torch.Tensor:
    out = torch.zeros(tiles, dtype=torch.float32, device=table.device)
    segments = table.shape[1]
    if programs:
        launch(_tile_amax_kernel, (programs,),
            flat, table, out.view(torch.int32), segments,
            TILES=TILES, SEARCH_STEPS=segments.bit_length(), num_warps=4,
        )  # fmt: skip
    return out


@library_op("blockscale::master_cast_codes", triton=True)
def _codes(
    flat: torch.Tensor, table: torch.Tensor, enc: torch.Tensor, n_bytes: int, programs: int
) -> torch.Tensor:
    out = torch.zeros(n_bytes, dtype=torch.uint8, device=table.device)
    segments = table.shape[1]
    if programs:
        launch(_codes_kernel, (programs,),
            flat, table, enc, out, segments,
            TILES=TILES, SEARCH_STEPS=segments.bit_length(), num_warps=4,
        )  # fmt: skip
    return out


@library_op("blockscale::expand_tile_scales", triton=True)
def _expand(tiles: torch.Tensor, table: torch.Tensor, programs: int) -> torch.Tensor:
    out = torch.empty(16 * tiles.numel(), dtype=torch.uint8, device=tiles.device)
    weights = table.shape[1]
    if programs:
        launch(_expand_scales_kernel, (programs,),
            tiles, table, out, weights,
            BLOCK=SCALE_BLOCK, SEARCH_STEPS=weights.bit_length(), num_warps=4,
        )  # fmt: skip
    return out


# ----------------------------------------------------------------------------- Python API


@dataclass(frozen=True)
class SliceTable:
    """A rank's part of one cast, ready for the kernels. flat: its owned values, FP32, segment
    after segment; segments: int64 [FIELDS, segments]; scale_table: int64 [4, weights] (the
    expansion's program ends, tiles per row, first tile, programs per band); tiles_per: int64
    [weights], tiles of each weight. The tables reach the device in one copy, without a host
    synchronization."""

    flat: torch.Tensor
    segments: torch.Tensor
    scale_table: torch.Tensor
    tiles_per: torch.Tensor
    programs: int
    scale_programs: int
    tiles: int
    n_bytes: int


def _flat_values(shards: list[torch.Tensor]) -> torch.Tensor:
    """The shards' values one after another, in place when they are consecutive contiguous
    FP32 views of one storage (no copy), else concatenated as FP32."""
    first = shards[0]
    storage = first.untyped_storage().data_ptr()
    at, in_place = first.storage_offset(), True
    for s in shards:
        if not (
            s.dtype == torch.float32
            and s.is_contiguous()
            and s.storage_offset() == at
            and s.untyped_storage().data_ptr() == storage
        ):
            in_place = False
            break
        at += s.numel()
    if in_place:
        return first.as_strided((at - first.storage_offset(),), (1,))
    return torch.cat([s.reshape(-1) for s in shards]).float()


def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """int64 values on `device`; to a GPU from pinned memory, asynchronously: a plain copy
    from pageable memory would wait for the GPU to finish its queued work."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=torch.int64, device=device)
    host = torch.tensor(values, dtype=torch.int64, pin_memory=True)
    return host.to(device, non_blocking=True)


def slice_table(
    shapes: Sequence[tuple[int, int]],
    owned: Sequence[tuple[int, torch.Tensor, int]],
    tile_base: Sequence[int],
    byte_base: Sequence[int],
    device: torch.device,
) -> SliceTable:
    """The kernels' description of a cast: `shapes` the weights' [rows, cols], `owned` the
    rank's non-empty slices as (weight index, shard, start offset), at most one per weight,
    `tile_base` / `byte_base` each weight's first tile and byte in the all-weights buffers
    (totals last)."""
    segments: list[list[int]] = [[] for _ in range(FIELDS)]
    programs = pos = 0
    for i, shard, start in owned:
        cols = shapes[i][1]
        count = shard.numel()
        band0, band1 = start // (TILE * cols), -(-(start + count) // (TILE * cols))
        col_blocks = cdiv(cols // TILE, TILES)
        programs += (band1 - band0) * col_blocks
        row = (programs, start, count, cols, tile_base[i], byte_base[i], pos, band0, col_blocks)
        for f, v in zip(segments, row, strict=True):
            f.append(v)
        pos += count
    scales: list[list[int]] = [[], [], [], []]
    tiles_per = []
    scale_programs = 0
    for (rows, cols), base in zip(shapes, tile_base, strict=False):
        col_blocks = cdiv(cols // TILE, SCALE_BLOCK)
        scale_programs += (rows // TILE) * col_blocks
        for f, v in zip(scales, (scale_programs, cols // TILE, base, col_blocks), strict=True):
            f.append(v)
        tiles_per.append((rows // TILE) * (cols // TILE))
    n_seg, n_w = len(owned), len(shapes)
    table = _to_device([v for f in segments for v in f] + [v for f in scales for v in f]
                       + tiles_per, device)  # fmt: skip
    if owned:
        flat = _flat_values([shard for _, shard, _ in owned])
    else:
        flat = torch.zeros(1, dtype=torch.float32, device=device)
    return SliceTable(
        flat,
        table[: FIELDS * n_seg].view(FIELDS, n_seg),
        table[FIELDS * n_seg : FIELDS * n_seg + 4 * n_w].view(4, n_w),
        table[FIELDS * n_seg + 4 * n_w :],
        programs,
        scale_programs,
        tile_base[-1],
        byte_base[-1],
    )


def partial_tile_amax(t: SliceTable) -> torch.Tensor:
    """FP32 [tiles]: the amax of each tile of every weight over this rank's elements (0 for a
    tile it owns none of; NaN as 0x7FC00000)."""
    return _tile_amax(t.flat, t.segments, t.tiles, t.programs)


def owned_codes(t: SliceTable, enc: torch.Tensor) -> torch.Tensor:
    """uint8 [bytes of all weights]: the packed codes of this rank's elements of every weight,
    with the tiles' FP32 encode multipliers `enc` (every tile of every weight); zero elsewhere."""
    return _codes(t.flat, t.segments, enc.float().contiguous(), t.n_bytes, t.programs)


def expand_tile_scales(t: SliceTable, scale: torch.Tensor) -> torch.Tensor:
    """E4M3 tile scales of every weight (row of tiles after row, weight after weight) -> the
    bytes of their [rows, cols / 16] scale tensors, weight after weight (each tile's scale on
    its 16 rows)."""
    return _expand(scale.view(torch.uint8).contiguous(), t.scale_table, t.scale_programs)
