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
   one FP32 buffer holding every tile of every weight (zeros elsewhere). Its slice is padded
   with zeros to whole bands of 16 rows (zeros change no amax) so that this is one reshape
   and one amax per weight, whatever the offsets.
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
part itself). The per-weight work is a few PyTorch ops per weight (not per tile or per
element); a fused kernel over all weights would cut the launches further and is not written.

The slices must partition each weight: every element owned by exactly one rank (not checked:
an element owned twice would sum its codes).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from blockscale.distributed._collectives import all_reduce_amax
from blockscale.distributed.weight import QuantizedWeight, quantize_weight
from blockscale.formats import e2m1, nvfp4
from blockscale.formats.nvfp4 import NVFP4Tensor
from blockscale.nn.linear import Linear
from blockscale.recipes import Format, OperandConfig, Rounding

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
    in it. Layers of other recipes keep their weights (their name is not in the result)."""
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


def cast_master_weights_to_nvfp4(
    model_weights: Sequence[QuantizedWeight | NVFP4Tensor],
    master_weight_shards: Sequence[torch.Tensor | None],
    start_offsets: Sequence[int],
    group: dist.ProcessGroup | None = None,
) -> None:
    """Write every rank's slices of the flat FP32 masters into the shared NVFP4 weights, in
    place, bit-identical to quantizing each whole weight on one rank (see the module
    docstring). Collective: every rank of `group` calls it with the same `model_weights`."""
    if not len(model_weights) == len(master_weight_shards) == len(start_offsets):
        raise ValueError(
            f"{len(model_weights)} weights, {len(master_weight_shards)} master shards and "
            f"{len(start_offsets)} offsets: need one of each per weight"
        )
    targets = [_container(w) for w in model_weights]
    if not targets:
        return
    device = targets[0].data.device
    tiles_per = [(q.shape[0] // TILE) * (q.shape[1] // TILE) for q in targets]
    bytes_per = [q.data.numel() for q in targets]
    tile_base = [0, *torch.tensor(tiles_per).cumsum(0).tolist()]
    byte_base = [0, *torch.tensor(bytes_per).cumsum(0).tolist()]

    # 1. this rank's partial tile amaxes, every weight in one buffer
    tile_amax = torch.zeros(tile_base[-1], dtype=torch.float32, device=device)
    owned = []
    for i, (q, shard, start) in enumerate(
        zip(targets, master_weight_shards, start_offsets, strict=True)
    ):
        if shard is None or shard.numel() == 0:
            continue
        rows, cols = q.shape
        if start < 0 or start + shard.numel() > rows * cols:
            raise ValueError(
                f"weight {i} {tuple(q.shape)}: master slice [{start}, {start + shard.numel()}) "
                f"is outside its {rows * cols} elements"
            )
        first, bands = _bands(shard, start, cols)
        amax = bands.abs().view(bands.shape[0], TILE, cols // TILE, TILE).amax(dim=(1, 3))
        at = tile_base[i] + first * (cols // TILE)
        tile_amax[at : at + amax.numel()] = amax.reshape(-1)
        owned.append((i, shard, start))

    # 2. one all-reduce for every tile amax; tensor amaxes are the max of their tiles'
    bits = all_reduce_amax(tile_amax, group).view(torch.int32)
    weight_of_tile = torch.repeat_interleave(
        torch.arange(len(targets), device=device), torch.tensor(tiles_per, device=device)
    )
    weight_bits = torch.zeros(len(targets), dtype=torch.int32, device=device).scatter_reduce(
        0, weight_of_tile, bits, "amax", include_self=False
    )
    tile_amax, amax = bits.view(torch.float32), weight_bits.view(torch.float32)
    amax_of_tile = amax[weight_of_tile]
    scale = nvfp4.block_scales(tile_amax, amax_of_tile)
    enc = nvfp4.encode_multipliers(scale, amax_of_tile)

    # 3. codes of owned elements into one zeroed byte buffer; one all-reduce assembles them
    codes_out = torch.zeros(byte_base[-1], dtype=torch.uint8, device=device)
    for i, shard, start in owned:
        cols = targets[i].shape[1]
        # padded again rather than kept from step 1: one weight's padded copy at a time
        first, bands = _bands(shard, start, cols)
        at = tile_base[i] + first * (cols // TILE)
        e = enc[at : at + bands.shape[0] * (cols // TILE)].view(-1, 1, cols // TILE, 1)
        v = (bands.view(bands.shape[0], TILE, cols // TILE, TILE) * e).clamp(-e2m1.MAX, e2m1.MAX)
        codes = e2m1.round_nearest(v).reshape(-1)
        skip = start - first * TILE * cols
        out = codes_out[byte_base[i] : byte_base[i + 1]]
        _write_codes(out, codes[skip : skip + shard.numel()], start)
    dist.all_reduce(codes_out, op=dist.ReduceOp.SUM, group=group)

    with torch.no_grad():
        for i, q in enumerate(targets):
            rows, cols = q.shape
            tiles = scale[tile_base[i] : tile_base[i + 1]].view(rows // TILE, cols // TILE)
            rows_of_tiles = tiles.view(torch.uint8).repeat_interleave(TILE, dim=0)
            q.scale.view(torch.uint8).copy_(rows_of_tiles)  # float8 moved as bytes
            q.data.view(-1).copy_(codes_out[byte_base[i] : byte_base[i + 1]])
            q.amax.copy_(amax[i])
