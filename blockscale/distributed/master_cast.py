"""NVFP4 primary weights cast from ZeRO-sharded FP32 masters.

In ZeRO-style training (a distributed optimizer) the model's parameters are flattened into one
buffer and every rank owns one contiguous slice of it: the FP32 master values and their
optimizer state. Here the model computes with NVFP4 weights only (`to_nvfp4_primary_weights`
turns the weights of quantized layers into `QuantizedWeight`s holding one 16x16 NVFP4 copy,
which serves the forward and, transposed, grad_input), and after each optimizer step

    cast_master_weights_to_nvfp4(model_weights, master_weight_shards, start_offsets, group)

rebuilds them: `master_weight_shards[i]` is this rank's slice of weight i, flattened row-major
(empty or None where the rank owns none of it), `start_offsets[i]` the index of its first
element in the flattened weight. A slice may start and end anywhere: inside a 16x16 tile,
inside a byte (an odd offset puts its first code in a byte's high nibble), or hold fewer
elements than a tile. The result is bit-identical to quantizing each whole FP32 weight on one
rank (`formats.nvfp4.quantize(w, block="16x16")`).

Why this needs care: a code depends on its tile's scale, the scale on the tile amax and the
tensor amax, and a slice boundary cuts through tiles (and bytes). So, for all weights at once:

1. Each rank computes the amaxes of the tiles its slices touch, over its own elements, into
   one FP32 buffer holding every tile of every weight (zeros elsewhere).
2. One all-reduce (MAX) of that buffer gives every tile's amax; each weight's tensor amax is
   the max of its tiles' (both on the FP32 bits as int32, which keeps NaN: _collectives.py).
3. Every rank computes every tile's E4M3 scale (the same bits everywhere) and the codes of its
   own elements, into a zeroed byte buffer of all weights' codes. One all-reduce (SUM) of the
   bytes then assembles the codes: each nibble has exactly one writer, so the sum is the
   bitwise OR, and a byte shared by two ranks (odd boundary) gets both nibbles.

Two collectives per step whatever the number of weights. Cost: the tile-amax all-reduce moves
4 bytes per 256 weight values; the code all-reduce moves the NVFP4 codes (an all-reduce moves
about twice what an all-gather of each rank's bytes would, but needs no agreement on the
slices' sizes; a distributed optimizer that all-gathers its own parameter buffer can do that
part itself).

Two implementations of the rank's own work (steps 1 and 3), with the same bits:

- CUDA weights with Triton installed (`_library.use_kernels`): kernels/master_cast.py, one
  launch for step 1 and one for step 3 over all weights (a program per 16-row band and block
  of tiles of each slice, found by a binary search), reading the shards in place when they
  are consecutive views of one buffer, and one launch that lays the tile scales out on their
  rows. With step 2's batched PyTorch ops over all tiles and three batched copies into the
  weights (`torch._foreach_copy_`: codes, scales, amaxes), a call is a fixed set of launches
  whatever the number of weights: 3 Triton kernels, 2 collectives, one copy of the kernels'
  small tables (from pinned memory: no host synchronization) and 42 PyTorch ops (counted with
  a dispatch mode, views left out; most are step 2's elementwise ops on the tile buffer).
- Otherwise (the CPU) the PyTorch reference here: each slice padded with zeros to whole bands
  of 16 rows (zeros change no amax), so that a weight's tile amaxes are one reshape and one
  amax, and its codes formats/' arithmetic on the padded bands; a few ops per weight, not per
  tile or per element.

`rank_slices`, `partial_tile_amax`, `scales_and_multipliers` and `owned_codes` are those steps
on one rank, without a process group (the tests compare the two implementations with them).

The slices must partition each weight: every element owned by exactly one rank (not checked:
an element owned twice would sum its codes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from blockscale import _library
from blockscale.distributed._collectives import all_reduce_amax
from blockscale.distributed.weight import QuantizedWeight, quantize_weight
from blockscale.formats import e2m1, nvfp4
from blockscale.formats.nvfp4 import NVFP4Tensor
from blockscale.nn.linear import Linear
from blockscale.recipes import Format, OperandConfig, Rounding

if TYPE_CHECKING:
    from blockscale.kernels.master_cast import SliceTable

TILE = 16


def primary_weight_config(module: Linear) -> OperandConfig | None:
    """The weight config when one 16x16 NVFP4 copy serves the layer's forward and grad_input
    (the nvfp4 recipe), else None."""
    fwd, dgrad = module.recipe.output.weight, module.recipe.grad_input.weight
    one_copy = fwd.format is Format.NVFP4 and fwd.block == "16x16" and dgrad == fwd
    return fwd if one_copy and fwd.rounding is Rounding.NEAREST else None


def to_nvfp4_primary_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Replace the weight of every quantized Linear whose recipe needs one 16x16 NVFP4 copy
    (forward and grad_input) by a `QuantizedWeight` Parameter holding that copy, quantized
    from the current weight; returns {parameter name: the high-precision weight} (the values
    to build FP32 masters from). The new weights keep the old dtype, so grad_weight comes out
    in it. Layers of other recipes keep their weights (their name is not in the result).

    >>> model = bs.convert(torch.nn.Sequential(torch.nn.Linear(64, 32)), bs.recipes.get("nvfp4"))
    >>> masters = bs.distributed.to_nvfp4_primary_weights(model)
    >>> list(masters), masters["0.weight"].shape
    (['0.weight'], torch.Size([32, 64]))
    """
    masters: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if not (isinstance(module, Linear) and module.quantize_enabled):
            continue
        config = primary_weight_config(module)
        if config is None or isinstance(module.weight, QuantizedWeight):
            continue
        weight = module.weight.detach()
        q = quantize_weight(weight, config, transpose=False, amax=None)
        primary = QuantizedWeight(weight.shape, weight.dtype, (config, q))
        module.weight = nn.Parameter(primary, requires_grad=module.weight.requires_grad)
        masters[f"{name}.weight" if name else "weight"] = weight
    return masters


def _container(w: QuantizedWeight | NVFP4Tensor) -> NVFP4Tensor:
    q = w.rowwise if isinstance(w, QuantizedWeight) else w
    if not isinstance(q, NVFP4Tensor) or q.block != "16x16" or q.data.dim() != 2:
        raise ValueError(
            "cast_master_weights_to_nvfp4 writes 2-D 16x16 NVFP4 weights, got "
            f"{type(q).__name__} {getattr(q, 'block', '')} of shape {tuple(q.shape)}"
        )
    return q


def _bands(shard: torch.Tensor, start: int, cols: int) -> tuple[int, torch.Tensor]:
    """The slice padded with zeros to whole bands of 16 rows: (first band, [bands, 16, K])."""
    band = TILE * cols
    end = start + shard.numel()
    first, last = start // band, -(-end // band)
    padded = shard.new_zeros((last - first) * band, dtype=torch.float32)
    padded[start - first * band : end - first * band] = shard.reshape(-1)
    return first, padded.view(last - first, TILE, cols)


def _write_codes(out: torch.Tensor, codes: torch.Tensor, start: int) -> None:
    """OR the codes of elements [start, start + len) into a zeroed packed-byte buffer."""
    lo, hi = start, start + codes.numel()
    if lo % 2 and lo < hi:  # the first element is the high nibble of a byte
        out[lo // 2] |= codes[0] << 4
        codes, lo = codes[1:], lo + 1
    if hi % 2 and lo < hi:  # the last element is the low nibble of a byte
        out[hi // 2] |= codes[-1]
        codes, hi = codes[:-1], hi - 1
    if lo < hi:
        out[lo // 2 : hi // 2] |= e2m1.pack(codes)


@dataclass
class RankSlices:
    """One rank's part of a cast: the weights' shapes and their places in the all-weights
    buffers (first tile and first code byte of weight i, totals last), and the rank's
    non-empty slices as (weight index, shard, start offset). With `kernels`, the kernels'
    table of those slices (built once, used by both local steps); None runs the reference."""

    shapes: list[tuple[int, int]]
    tile_base: list[int]
    byte_base: list[int]
    owned: list[tuple[int, torch.Tensor, int]]
    kernels: SliceTable | None = None


def rank_slices(
    shapes: Sequence[tuple[int, int]],
    master_weight_shards: Sequence[torch.Tensor | None],
    start_offsets: Sequence[int],
    device: torch.device,
    use_kernels: bool,
) -> RankSlices:
    """Check this rank's slices against the [rows, cols] weight shapes and lay them out."""
    tile_base, byte_base, owned = [0], [0], []
    for i, ((rows, cols), shard, start) in enumerate(
        zip(shapes, master_weight_shards, start_offsets, strict=True)
    ):
        tile_base.append(tile_base[-1] + (rows // TILE) * (cols // TILE))
        byte_base.append(byte_base[-1] + rows * cols // 2)
        if shard is None or shard.numel() == 0:
            continue
        if start < 0 or start + shard.numel() > rows * cols:
            raise ValueError(
                f"weight {i} {(rows, cols)}: master slice [{start}, {start + shard.numel()}) "
                f"is outside its {rows * cols} elements"
            )
        owned.append((i, shard, start))
    slices = RankSlices(list(shapes), tile_base, byte_base, owned)
    if use_kernels:
        from blockscale.kernels import master_cast as kernels  # noqa: PLC0415 (needs Triton)

        slices.kernels = kernels.slice_table(slices.shapes, owned, tile_base, byte_base, device)
    return slices


def partial_tile_amax(slices: RankSlices, device: torch.device) -> torch.Tensor:
    """Step 1: FP32 amax of every tile of every weight over this rank's elements (0 for a tile
    it owns none of)."""
    if slices.kernels is not None:
        from blockscale.kernels import master_cast as kernels  # noqa: PLC0415 (needs Triton)

        return kernels.partial_tile_amax(slices.kernels)
    tile_amax = torch.zeros(slices.tile_base[-1], dtype=torch.float32, device=device)
    for i, shard, start in slices.owned:
        cols = slices.shapes[i][1]
        first, bands = _bands(shard, start, cols)
        amax = bands.abs().view(bands.shape[0], TILE, cols // TILE, TILE).amax(dim=(1, 3))
        at = slices.tile_base[i] + first * (cols // TILE)
        tile_amax[at : at + amax.numel()] = amax.reshape(-1)
    return tile_amax


def owned_codes(slices: RankSlices, enc: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Step 3: the packed codes of this rank's elements of every weight, from every tile's
    FP32 encode multiplier `enc`, in a buffer of all weights' codes that is zero elsewhere (a
    byte shared with another rank holds only this rank's nibble)."""
    if slices.kernels is not None:
        from blockscale.kernels import master_cast as kernels  # noqa: PLC0415 (needs Triton)

        return kernels.owned_codes(slices.kernels, enc)
    codes_out = torch.zeros(slices.byte_base[-1], dtype=torch.uint8, device=device)
    for i, shard, start in slices.owned:
        cols = slices.shapes[i][1]
        # padded again rather than kept from step 1: one weight's padded copy at a time
        first, bands = _bands(shard, start, cols)
        at = slices.tile_base[i] + first * (cols // TILE)
        e = enc[at : at + bands.shape[0] * (cols // TILE)].view(-1, 1, cols // TILE, 1)
        v = (bands.view(bands.shape[0], TILE, cols // TILE, TILE) * e).clamp(-e2m1.MAX, e2m1.MAX)
        codes = e2m1.round_nearest(v).reshape(-1)
        skip = start - first * TILE * cols
        out = codes_out[slices.byte_base[i] : slices.byte_base[i + 1]]
        _write_codes(out, codes[skip : skip + shard.numel()], start)
    return codes_out


def scales_and_multipliers(
    slices: RankSlices, bits: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 2, after the all-reduce: from every tile's amax (as int32 bits, NaN-propagating
    order) the weights' tensor amaxes (max of their tiles'), every tile's E4M3 scale and FP32
    encode multiplier. Batched over all tiles of all weights."""
    weights = len(slices.shapes)
    if slices.kernels is not None:
        tiles_per = slices.kernels.tiles_per  # already on the device
    else:
        tiles_per = torch.tensor(
            [b - a for a, b in zip(slices.tile_base, slices.tile_base[1:])], device=device
        )
    # output_size: without it the size would be read back from the device (a synchronization)
    weight_of_tile = torch.repeat_interleave(
        torch.arange(weights, device=device), tiles_per, output_size=slices.tile_base[-1]
    )
    weight_bits = torch.zeros(weights, dtype=torch.int32, device=device).scatter_reduce(
        0, weight_of_tile, bits, "amax", include_self=False
    )
    tile_amax, amax = bits.view(torch.float32), weight_bits.view(torch.float32)
    amax_of_tile = amax[weight_of_tile]
    scale = nvfp4.block_scales(tile_amax, amax_of_tile)
    return amax, scale, nvfp4.encode_multipliers(scale, amax_of_tile)


def _write_back(
    targets: list[NVFP4Tensor],
    slices: RankSlices,
    amax: torch.Tensor,
    scale: torch.Tensor,
    codes: torch.Tensor,
) -> None:
    """Copy every weight's codes, scales (each tile's on its 16 rows) and amax into its
    container: one batched copy per kind, not a Python loop of copies (byte copies: exact)."""
    tiles_per = [b - a for a, b in zip(slices.tile_base, slices.tile_base[1:])]
    bytes_per = [b - a for a, b in zip(slices.byte_base, slices.byte_base[1:])]
    scale_bytes = scale.view(torch.uint8)  # float8 moved as bytes
    if slices.kernels is not None:
        from blockscale.kernels import master_cast as kernels  # noqa: PLC0415 (needs Triton)

        rows = kernels.expand_tile_scales(slices.kernels, scale_bytes)
        scale_src = list(rows.split([16 * n for n in tiles_per]))
        scale_dst = [q.scale.view(torch.uint8).view(-1) for q in targets]
    else:
        scale_src = [
            t.view(r // TILE, 1, c // TILE).expand(r // TILE, TILE, c // TILE)
            for t, (r, c) in zip(scale_bytes.split(tiles_per), slices.shapes, strict=True)
        ]
        scale_dst = [
            q.scale.view(torch.uint8).view(r // TILE, TILE, c // TILE)
            for q, (r, c) in zip(targets, slices.shapes, strict=True)
        ]
    with torch.no_grad():
        torch._foreach_copy_(scale_dst, scale_src)
        torch._foreach_copy_([q.data.view(-1) for q in targets], list(codes.split(bytes_per)))
        torch._foreach_copy_([q.amax for q in targets], list(amax.unbind(0)))


def cast_master_weights_to_nvfp4(
    model_weights: Sequence[QuantizedWeight | NVFP4Tensor],
    master_weight_shards: Sequence[torch.Tensor | None],
    start_offsets: Sequence[int],
    group: dist.ProcessGroup | None = None,
) -> None:
    """Write every rank's slices of the flat FP32 masters into the shared NVFP4 weights, in
    place, bit-identical to quantizing each whole weight on one rank (see the module
    docstring). Collective: every rank of `group` calls it with the same `model_weights`.
    CUDA weights run the Triton kernels when Triton is installed, others the PyTorch
    reference (`_library.use_kernels`); both give the same bits.

    >>> import torch.distributed as dist
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> model = bs.convert(torch.nn.Sequential(torch.nn.Linear(64, 32)), bs.recipes.get("nvfp4"))
    >>> master = bs.distributed.to_nvfp4_primary_weights(model)["0.weight"].float().flatten()
    >>> master += 0.01  # an optimizer step on this rank's slice (here: the whole weight)
    >>> bs.distributed.cast_master_weights_to_nvfp4([model[0].weight], [master], [0])
    >>> want = bs.nvfp4.quantize(master.view(32, 64), block="16x16")
    >>> torch.equal(model[0].weight.rowwise.data, want.data)  # as if quantized whole
    True
    >>> dist.destroy_process_group()
    """
    if not len(model_weights) == len(master_weight_shards) == len(start_offsets):
        raise ValueError(
            f"{len(model_weights)} weights, {len(master_weight_shards)} master shards and "
            f"{len(start_offsets)} offsets: need one of each per weight"
        )
    targets = [_container(w) for w in model_weights]
    if not targets:
        return
    device = targets[0].data.device
    shapes = [(q.shape[0], q.shape[1]) for q in targets]
    slices = rank_slices(
        shapes, master_weight_shards, start_offsets, device, _library.use_kernels(targets[0].data)
    )

    # 1. this rank's partial tile amaxes, every weight in one buffer
    tile_amax = partial_tile_amax(slices, device)
    # 2. one all-reduce for every tile amax; tensor amaxes are the max of their tiles'
    bits = all_reduce_amax(tile_amax, group).view(torch.int32)
    amax, scale, enc = scales_and_multipliers(slices, bits, device)
    # 3. codes of owned elements into one zeroed byte buffer; one all-reduce assembles them
    codes = owned_codes(slices, enc, device)
    dist.all_reduce(codes, op=dist.ReduceOp.SUM, group=group)
    _write_back(targets, slices, amax, scale, codes)
