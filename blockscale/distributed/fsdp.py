"""FSDP2 all-gather of quantized weights: NVFP4 / MXFP8 codes and scales instead of BF16.

Usage, with the user's own `fully_shard` calls:

```python
bs.convert(model, recipe)
bs.distributed.enable_quantized_all_gather(model)  # before fully_shard
for block in model.layers:
    fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))  # optional
fully_shard(model)
```

A model built on the meta device (torchtitan's order) takes the same calls, followed by
`model.to_empty(device=...)` and an in-place init; `to_empty` may come before `fully_shard` too.
`to_empty` makes each weight with `empty_like`, which keeps the ShardedWeight as `.to` does
(`_apply` swaps it in, with or without `torch.__future__.set_swap_module_params_on_conversion`,
and FSDP2's `reset_sharded_param` takes it as the new shard), and an in-place init
(`nn.init.*`, `copy_`) writes into it. A weight that loses it all the same before its layer's
first forward (an `_apply` that swaps plain tensors in, `load_state_dict(assign=True)`) makes
that forward raise instead of gathering unquantized (`_QuantizedGatherCheck`). Not caught:
`p.data = tensor` on a ShardedWeight, which it ignores (it keeps the tensor it wraps), as it
does an `_apply` that sets `.data` (a plain result on the same device, swapping off): write
values in place instead.

Mechanism: FSDP2's tensor-subclass all-gather extension (`fsdp_pre_all_gather` /
`fsdp_post_all_gather` on the parameter's local tensor; run on torch 2.13, docs/DISTRIBUTED.md
says why 2.11-2.12 should behave the same).
`enable_quantized_all_gather` wraps the weight of every quantized `blockscale.nn.Linear` in a
`ShardedWeight`: a thin subclass around the FP32 tensor that behaves as that tensor for every
op and survives FSDP's sharding (`new_zeros`, `split`, `narrow`, `copy_` and views keep the
subclass). Its dispatch unwraps every argument, runs the op, and returns what the op's schema
returns: for an op that mutates (in place, `out=`, the optimizers' `_foreach_*_` and
`_fused_adamw_`, whose schemas return nothing) the caller's own arguments or None, so
per-tensor, foreach and fused optimizers update the FP32 shard in place with plain FP32
state, bit for bit as on a plain parameter; the state_dict holds the same values. FSDP2
looks for its all-gather hooks on the parameter's local tensor, so a subclass there is the
one place they can live. Then, at each all-gather, on every rank:

1. `fsdp_pre_all_gather` reduces the weight's amax over the shard group (a MAX all-reduce;
   none for MXFP8, which has no tensor scale) and quantizes its FP32 shard, rows
   [r*N/W, (r+1)*N/W) of the [N, K] weight, with that amax: the shard's blocks are whole
   blocks of the full weight, so its codes and scales are exactly the full quantization's
   rows. The all-gather inputs are the packed codes and the scales (16x16: one E4M3 scale per
   tile, not repeated on its 16 rows). For NVFP4 layouts the layer's weight cache
   (ops/weight_cache.py) keeps them, with the amax, until the shard changes (an optimizer
   step, a load, an in-place write: `__torch_dispatch__` bumps the shard's version counter on
   every write), so the backward's re-gather and later micro-batches skip step 1
   (`set_weight_cache(model, False)` turns that off; MXFP8 layouts are not kept by default,
   `CACHE_GATHER_INPUTS` says why). The first gather after an optimizer step all-reduces the
   amaxes of all the weights gathered in the step before in one collective (`_AmaxBatch`).
2. FSDP all-gathers them (one collective per FSDP group, as for BF16 parameters).
3. `fsdp_post_all_gather` assembles a `QuantizedWeight` (distributed/weight.py) of the dtype
   FSDP asks for (the MixedPrecisionPolicy's param_dtype, else the shard's): codes and scales
   are views of the gathered buffers, 16x16 tile scales are repeated back onto their rows, a
   columnwise copy is put in [K, N] order. `blockscale.linear` then uses these copies instead
   of quantizing, and grad_weight comes out in that dtype, reduce-scattered by FSDP as usual.

What travels, per weight [N, K], as a fraction of the BF16 all-gather (2NK bytes):

| recipe (weight operands)          | gathered                                 | bytes      | vs BF16 |
| --------------------------------- | ---------------------------------------- | ---------- | ------- |
| nvfp4 (16x16 weight)              | codes + tile scales; dgrad = transpose   | NK(1/2+1/256) | 0.252 |
| nvfp4 weight_2d=False (1x16)      | rowwise + columnwise codes and scales    | NK(1+1/8)  | 0.563   |
| nvfp4_fwd_mxfp8_bwd               | NVFP4 16x16 rowwise + MXFP8 columnwise   | NK(1.535)  | 0.767   |
| mxfp8                             | MXFP8 rowwise + columnwise               | NK(2+1/16) | 1.031   |

The columnwise copies (blocks along N) are quantized from the shard too, which is exact when
each shard holds whole blocks along N. A 16x16 NVFP4 weight needs no columnwise copy: its
transpose is exact (`gemm.dispatch.Transposed`). MXFP8 gathers two copies, a little more than
BF16; gathering only the copy each pass needs (rowwise in the forward, columnwise in the
backward re-gather) would halve it, but breaks with activation checkpointing and with
modules FSDP does not reshard after the forward, and is not done.

Shard rules (checked at the first all-gather, the same on every rank, so all ranks raise
together): FSDP must shard dim 0 evenly (N divisible by the shard group size W; the packed
all-gather has no padding), and each shard's N/W rows must hold whole blocks along N: a
multiple of 16 for a 16x16 weight or an NVFP4 columnwise copy, of 32 for an MXFP8 columnwise
copy. K must already fit the recipe (as for any converted layer).

Limits: the layout of what is gathered is fixed at the first all-gather (FSDP allocates its
buffers once), so a layer's recipe, or `quantize_enabled` (set_precision), cannot change
afterwards (a ValueError says so); `reshard_after_forward=<int>` (resharding onto a smaller group) is not supported
by FSDP's extension; weight quantization must round to nearest (stochastic rounding of a shard
would not reproduce the one-device bits).
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map_only
from torch.utils.hooks import RemovableHandle

from blockscale.distributed._collectives import all_reduce_amax
from blockscale.distributed.weight import (
    Container,
    QuantizedWeight,
    _tensors,
    copy_values,
    quantize_weight,
)
from blockscale.formats.mxfp8 import MXFP8Tensor
from blockscale.formats.nvfp4 import NVFP4Tensor
from blockscale.nn.linear import Linear
from blockscale.ops.quantize import operand_amax, quantize_rows_and_tokens
from blockscale.ops.weight_cache import WeightCache
from blockscale.recipes import Format, OperandConfig, Recipe, Rounding

# Ops whose results stay ShardedWeights: the ones FSDP uses to cut the shard out of the full
# weight and pad it, plain re-descriptions of the same values, moves (`model.to`) and the
# uninitialized copy `to_empty` materializes a meta weight with (`empty_like`). Every other op
# sees the FP32 tensor and returns plain tensors: the optimizer's state (`zeros_like`),
# arithmetic, clones.
_KEEP_SUBCLASS = {
    torch.ops.aten.detach.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.view.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.as_strided.default,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.narrow.default,
    torch.ops.aten.split.Tensor,
    torch.ops.aten.split_with_sizes.default,
    torch.ops.aten.chunk.default,
    torch.ops.aten.new_zeros.default,
    torch.ops.aten.new_empty.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten._pin_memory.default,
    torch.ops.aten.empty_like.default,
}


def _write_args(func: Any, args: tuple, kwargs: dict):
    """(alias set, value) of each argument a mutating op writes: a tensor, or a list for the
    foreach ops (whose lists have an empty alias set)."""
    for i, arg in enumerate(func._schema.arguments):
        info = arg.alias_info
        if info is not None and info.is_write:
            value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
            yield frozenset(info.before_set), value


def _mark_written(func: Any, args: tuple, kwargs: dict) -> None:
    """Bump the version counter of each wrapped tensor a mutating op wrote. The op ran on the
    wrapped tensors below autograd, where no counter moves, so without this an in-place edit
    of a sharded parameter (`p.mul_(2)` under no_grad, a checkpoint loaded in place) would
    leave the weight cache's stamp of the shard (ops/weight_cache.py) unchanged."""
    for _, value in _write_args(func, args, kwargs):
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, ShardedWeight):
                torch.autograd.graph.increment_version(t._data)


def _mutated_result(func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
    """What a mutating op returns when its plain twin returned `out`: None for the ops whose
    schema returns nothing (`_foreach_add_`, `_fused_adamw_`: their dispatch must return
    None), and for each returned alias of a written argument (`add_`'s self, `add.out`'s out)
    that argument as the caller passed it, a ShardedWeight stays one."""
    schema = func._schema
    if not schema.returns:
        return None
    written = {key: value for key, value in _write_args(func, args, kwargs) if key}
    outs = out if isinstance(out, tuple) else (out,)
    results = []
    for ret, value in zip(schema.returns, outs, strict=True):
        info = ret.alias_info
        key = frozenset(info.before_set) if info is not None and info.is_write else None
        results.append(written.get(key, value) if key is not None else value)
    return tuple(results) if isinstance(out, tuple) else results[0]


# Which formats' all-gather inputs the weight cache keeps from a weight's first gather of a
# step to its later ones (the backward's re-gather, further micro-batches), by measurement
# (docs/DISTRIBUTED.md, "Two-GPU measurements", fourth round; transformers Llama 8B shape,
# 8 layers, two H200s, eager): NVFP4 holds 0.5 bytes a shard value and its step ran 26%
# faster with it (0.626x against 0.497x BF16's tok/s, peak 0.99x against 0.98x); MXFP8
# holds 2.06 bytes, ran 5% faster (0.642x against 0.613x) and put the peak above BF16's
# (1.04x against 0.99x). A layout with any uncached format is not kept.
CACHE_GATHER_INPUTS = {Format.NVFP4: True, Format.MXFP8: False}

# Any plain NVFP4 config: what `operand_amax` reads of it is the format (no Hadamard: a
# weight's copies are never transformed).
_NVFP4_WEIGHT = OperandConfig(Format.NVFP4)


def _shards_amax(shards: list[torch.Tensor], group: dist.ProcessGroup) -> list[torch.Tensor]:
    """max |w| over each whole weight from its shards, all in one all-reduce (none on a
    one-rank group). `operand_amax`: the amax kernel where the kernels run (one launch, no
    |w| temporary), else formats'; a maximum is exact either way."""
    local = [
        (operand_amax(s, _NVFP4_WEIGHT) if s.numel() else s.new_zeros(())).float().reshape(())
        for s in shards
    ]
    if dist.get_world_size(group) == 1:
        return local
    whole = all_reduce_amax(local[0] if len(local) == 1 else torch.stack(local), group)
    return [whole] if len(local) == 1 else list(whole.unbind(0))


_AMAX_KEY = ("fsdp_all_gather_amax",)


class _AmaxBatch:
    """The NVFP4 weights of one shard group whose amaxes one all-reduce makes after each
    optimizer step, instead of one all-reduce per weight (a collective costs tens of
    microseconds of host time, and the step is host-bound under FSDP2).

    Which weights: those whose pre-all-gather hook quantized their shard since the batch
    before the last one, in the order it did (older ones are dropped, so a model that is gone
    drops out). The first gather that finds no amax in its layer's cache while others it
    holds lack one too (after an optimizer step cleared the caches, every weight) makes the
    batch: the amax of itself and of each such weight whose cache lacks one under its
    current stamp, stored in each layer's weight cache, where the later gathers of the step
    find theirs. Every rank runs the same hooks in the same order and the same optimizer
    steps, loads and edits, so every rank makes the same batch, of the same length, at the
    same gather. The first step, and a weight new to the batch, all-reduce their own amax
    as before. The bits are the same: each weight's amax is the maximum over the same
    shards either way, and a maximum is exact."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.round = 0  # batches made
        # id(layer) -> (weak reference to the layer, its shard, the round it was seen in); the
        # layer is held weakly, so the holder on it makes no reference cycle and a deleted
        # model is freed at once (a live model's layers are alive on every rank alike)
        self.seen: dict[int, tuple[weakref.ref, torch.Tensor, int]] = {}

    def saw(self, module: nn.Module, shard: torch.Tensor) -> None:
        self.seen[id(module)] = (weakref.ref(module), shard, self.round)

    def amax(self, module: nn.Module, shard: torch.Tensor, cache: WeightCache, stamp: Any):
        """`module`'s weight amax: from the cache, else made with the batch's other missing
        ones."""
        held = cache.get(stamp, _AMAX_KEY)
        if held is not None:
            return held
        missing = []
        for ref, other_shard, _ in self.seen.values():
            other = ref()
            other_cache = getattr(other, "weight_cache", None)
            if other is module or not isinstance(other_cache, WeightCache):
                continue
            other_stamp = other_cache.stamp(other_shard)
            if other_stamp is not None and other_cache.get(other_stamp, _AMAX_KEY) is None:
                missing.append((other_cache, other_stamp, other_shard))
        amaxes = _shards_amax([shard] + [m[2] for m in missing], self.group)
        for (other_cache, other_stamp, _), value in zip(missing, amaxes[1:], strict=True):
            other_cache.put(other_stamp, _AMAX_KEY, value)
        cache.put(stamp, _AMAX_KEY, amaxes[0])
        if missing:  # a batch: forget the weights not seen since the one before
            self.round += 1
            self.seen = {k: v for k, v in self.seen.items() if v[2] >= self.round - 2}
        return amaxes[0]


class _AmaxBatches:
    """One `_AmaxBatch` per shard group, shared by the converted layers of one model
    (`enable_quantized_all_gather` puts it on each): it lives and dies with the model, so
    what a batch holds of the model never outlives it."""

    def __init__(self) -> None:
        self.by_group: dict[int, _AmaxBatch] = {}

    def __deepcopy__(self, memo: dict) -> _AmaxBatches:
        return _AmaxBatches()  # a copied model has other weights

    def get(self, group: dist.ProcessGroup) -> _AmaxBatch:
        batch = self.by_group.get(id(group))
        if batch is None or batch.group is not group:
            batch = self.by_group[id(group)] = _AmaxBatch(group)
        return batch


def _as_bytes(t: torch.Tensor, move: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`move` (a copy that only rearranges) applied to t's bytes: float8 codes and scales are
    moved as uint8, which every device's copy and index kernels support."""
    return move(t.view(torch.uint8)).view(t.dtype) if t.element_size() == 1 else move(t)


@dataclass(frozen=True)
class GatherLayout:
    """What one weight all-gathers: the rowwise copy and, unless the weight is 16x16 NVFP4, a
    columnwise copy. It must not change after the first all-gather (FSDP sized its buffers).
    """

    shape: torch.Size
    world_size: int
    rowwise: OperandConfig
    columnwise: OperandConfig | None

    @classmethod
    def for_layer(cls, module: nn.Module, shape: torch.Size, world_size: int) -> GatherLayout:
        if not isinstance(module, Linear) or not module.quantize_enabled:
            raise ValueError(
                f"{module!r} holds a ShardedWeight but is not a quantized blockscale Linear "
                "(quantize_enabled=False?): its weight would need the high-precision all-gather; "
                "a quantized all-gather's layout cannot change after the first one"
            )
        recipe: Recipe = module.recipe
        fwd, dgrad = recipe.output.weight, recipe.grad_input.weight
        for name, op in (("output.weight", fwd), ("grad_input.weight", dgrad)):
            if not op.quantized:
                raise ValueError(
                    f"recipe {recipe.name}: {name} is bf16, which a quantized all-gather cannot "
                    "serve; keep this layer out of enable_quantized_all_gather"
                )
            if op.rounding is not Rounding.NEAREST:
                raise ValueError(
                    f"recipe {recipe.name}: {name} rounds stochastically; a sharded quantization "
                    "reproduces the one-device bits only with nearest rounding"
                )
        columnwise = None if (dgrad.block == "16x16" and dgrad == fwd) else dgrad
        layout = cls(torch.Size(shape), world_size, fwd, columnwise)
        layout.check()
        return layout

    def check(self) -> None:
        n, k = self.shape
        w = self.world_size
        if n % w:
            raise ValueError(
                f"weight {tuple(self.shape)}: N={n} rows do not split evenly over {w} ranks; "
                "a quantized all-gather needs every shard the same size (no padding)"
            )
        rows = n // w
        need = [16 if self.rowwise.block == "16x16" else 1]
        if self.columnwise is not None:
            need.append(self.columnwise.block_size)
        block = max(need)
        if rows % block:
            raise ValueError(
                f"weight {tuple(self.shape)} over {w} ranks: each shard has {rows} rows, not a "
                f"multiple of {block} ({self.describe()} needs whole blocks along N in a shard); "
                f"N must be a multiple of {block * w}"
            )

    def describe(self) -> str:
        cols = "" if self.columnwise is None else f" + columnwise {self.columnwise.describe()}"
        return f"rowwise {self.rowwise.describe()}{cols}"

    @functools.cached_property
    def needs_amax(self) -> bool:
        return any(
            c is not None and c.format is Format.NVFP4 for c in (self.rowwise, self.columnwise)
        )

    @functools.cached_property
    def cached(self) -> bool:
        """Whether the layer's weight cache keeps this layout's all-gather inputs between
        gathers (`CACHE_GATHER_INPUTS`, by the formats it holds)."""
        formats = {c.format for c in (self.rowwise, self.columnwise) if c is not None}
        return all(CACHE_GATHER_INPUTS[f] for f in formats)

    # ------------------------------------------------------------------ before the gather

    def inputs(self, shard: torch.Tensor, amax: torch.Tensor | None) -> list[torch.Tensor]:
        """The shard's all-gather inputs: codes and scales per copy, each with rows first."""
        row, col = self._quantize(shard, amax)
        scale = row.scale[::16] if self.rowwise.block == "16x16" else row.scale
        out = [row.data, scale]
        if col is not None:
            out += [col.data, col.scale]
        return [t if t.is_contiguous() else _as_bytes(t, torch.Tensor.contiguous) for t in out]

    def _quantize(
        self, shard: torch.Tensor, amax: torch.Tensor | None
    ) -> tuple[Container, Container | None]:
        """The rowwise and columnwise copies of the shard, packed only. Both copies come
        through `ops.quantize_rows_and_tokens`, which makes them from one kernel launch where
        their formats allow (the same bits as two launches; a launch costs tens of
        microseconds of host time, and an all-gather makes one per weight)."""
        if self.columnwise is None:
            return quantize_weight(shard, self.rowwise, False, amax), None
        row_amax, col_amax = (
            amax if c.format is Format.NVFP4 else None for c in (self.rowwise, self.columnwise)
        )
        return quantize_rows_and_tokens(
            shard, self.rowwise, self.columnwise, row_amax=row_amax, tokens_amax=col_amax,
            row_dq=False,
        )  # fmt: skip

    # ------------------------------------------------------------------- after the gather

    def assemble(
        self, outputs: tuple[torch.Tensor, ...], amax: torch.Tensor | None, dtype: torch.dtype
    ) -> tuple[QuantizedWeight, list[torch.Tensor]]:
        """The QuantizedWeight made of the gathered buffers, and the tensors built here (not
        views of FSDP's buffers), which FSDP frees and re-allocates with the weight."""
        n, k = self.shape
        built: list[torch.Tensor] = []
        data, scale = outputs[0], outputs[1]
        if self.rowwise.block == "16x16":
            scale = _as_bytes(scale, lambda b: b.repeat_interleave(16, dim=0))
            built.append(scale)
        rowwise = self._container(self.rowwise, data, scale, amax, torch.Size((n, k)))
        columnwise = None
        if self.columnwise is not None:
            w = self.world_size
            if w == 1:
                # One rank: its own [K, N] inputs, as views. Not handed to FSDP as built
                # tensors, since FSDP frees those at the reshard, and the inputs may be held
                # by the layer's weight cache for the next all-gather.
                data_t, scale_t = (_as_bytes(t, lambda b: b.view(k, -1)) for t in outputs[2:4])
            else:
                # Each rank sent [K, N/W]-shaped blocks; put the W column blocks side by side.
                data_t, scale_t = (
                    _as_bytes(t, lambda b: b.view(w, k, -1).permute(1, 0, 2).reshape(k, -1))
                    for t in outputs[2:4]
                )
                built += [data_t, scale_t]
            columnwise = (
                self.columnwise,
                self._container(self.columnwise, data_t, scale_t, amax, torch.Size((k, n))),
            )
        weight = QuantizedWeight(self.shape, dtype, (self.rowwise, rowwise), columnwise)
        return weight, built

    def assemble_into(
        self, weight: QuantizedWeight, outputs: tuple[torch.Tensor, ...], amax: torch.Tensor | None
    ) -> None:
        """`assemble`'s values written into the QuantizedWeight an earlier `assemble` made
        (FSDP2 hands it back at every later all-gather): the gathered buffers it views are
        FSDP's own, re-filled in place, and what `assemble` built from them is rebuilt in
        place here, one copy each, with no new tensors. Version counters are left alone, as
        `QuantizedWeight.update_` leaves them (autograd may hold these tensors)."""
        n, k = self.shape
        row, col = weight.rowwise, weight.columnwise
        targets = _tensors(row) + ([] if col is None else _tensors(col))
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(targets)):
            copy_values(row.data, outputs[0])
            if self.rowwise.block == "16x16":
                scale = outputs[1].view(torch.uint8)
                repeated = scale.view(n // 16, 1, -1).expand(-1, 16, -1)
                row.scale.view(torch.uint8).view(n // 16, 16, -1).copy_(repeated)
            else:
                copy_values(row.scale, outputs[1])
            # The amax of a cached gather is the same tensor at each re-gather of the step.
            new_amax = amax is not None and amax is not getattr(weight, "_gathered_amax", None)
            if new_amax and isinstance(row, NVFP4Tensor):
                row.amax.copy_(amax.reshape(row.amax.shape))
            weight._gathered_amax = amax
            if col is None:
                return
            w = self.world_size
            for dst, src in ((col.data, outputs[2]), (col.scale, outputs[3])):
                if w == 1:
                    copy_values(dst, src)
                elif dst.data_ptr() != src.data_ptr():  # (`assemble` views one column)
                    # the W column blocks side by side, as `assemble` puts them
                    blocks = src.view(torch.uint8).view(w, k, -1).permute(1, 0, 2)
                    dst.view(torch.uint8).view(k, w, -1).copy_(blocks)
            if new_amax and isinstance(col, NVFP4Tensor):
                col.amax.copy_(amax.reshape(col.amax.shape))

    @staticmethod
    def _container(
        config: OperandConfig,
        data: torch.Tensor,
        scale: torch.Tensor,
        amax: torch.Tensor | None,
        shape: torch.Size,
    ) -> Container:
        if config.format is Format.NVFP4:
            assert amax is not None
            return NVFP4Tensor(data, scale, amax.clone(), shape, config.block)
        return MXFP8Tensor(data, scale, shape)


@dataclass(frozen=True)
class _GatherInputs:
    """What a weight cache keeps of one shard's all-gather: the inputs and the amax."""

    inputs: tuple[torch.Tensor, ...]
    amax: torch.Tensor | None


def _used_on_current_stream(tensors: list[torch.Tensor | None]) -> None:
    """Tell CUDA's caching allocator that `tensors`, allocated on another stream, are read on
    the current one: without it, a block freed here can be handed to that other stream's next
    allocation and overwritten before this stream has read it. Seen on two GPUs: without this,
    nvfp4 losses under quantized all-gather moved from run to run once the allocator had
    freed blocks to hand out (a second model in the process), and differed from plain FSDP2's;
    with it they equal them bit for bit (docs/DISTRIBUTED.md, "Two-GPU measurements")."""
    for t in tensors:
        if t is not None and t.is_cuda:
            t.record_stream(torch.cuda.current_stream(t.device))


class ShardedWeight(torch.Tensor):
    """The FP32 (master) weight of a quantized layer, as FSDP2 shards it: every op sees the
    wrapped tensor, and FSDP's all-gather sends it quantized (see the module docstring).

    >>> model = bs.convert(torch.nn.Sequential(torch.nn.Linear(64, 64)), bs.recipes.get("nvfp4"))
    >>> _ = bs.distributed.enable_quantized_all_gather(model)
    >>> isinstance(model[0].weight, bs.distributed.ShardedWeight)
    True
    """

    _data: torch.Tensor
    _layout: GatherLayout | None = None  # what the first all-gather sent
    _layout_key: tuple = ()  # what `_layout` was worked out from

    @staticmethod
    def __new__(cls, data: torch.Tensor) -> ShardedWeight:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls,
            data.shape,
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=data.dtype,
            device=data.device,
            requires_grad=data.requires_grad,
        )

    def __init__(self, data: torch.Tensor) -> None:
        if isinstance(data, ShardedWeight):
            data = data._data
        self._data = data

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: Any, outer_size: Any, outer_stride: Any):
        return ShardedWeight(inner["_data"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        plain_args, plain_kwargs = tree_map_only(ShardedWeight, lambda t: t._data, (args, kwargs))
        out = func(*plain_args, **plain_kwargs)
        if func._schema.is_mutable:
            _mark_written(func, args, kwargs)
            # In place, out= and the optimizers' foreach / fused ops wrote the wrapped tensors;
            # the caller gets what the op's schema returns, in terms of its own arguments.
            return _mutated_result(func, args, kwargs, out)
        if func in _KEEP_SUBCLASS:
            return tree_map_only(torch.Tensor, ShardedWeight, out)
        return out

    def __repr__(self) -> str:  # type: ignore[override]
        return f"ShardedWeight({self._data!r})"

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Saved (torch.save, torch.distributed.checkpoint) as the plain tensor it wraps: a
        # checkpoint holds values, loads with weights_only=True, and copies back into a
        # ShardedWeight in place.
        return self._data.__reduce_ex__(protocol)

    def fsdp_pre_all_gather(
        self,
        mesh: Any,
        outer_size: torch.Size,
        outer_stride: tuple[int, ...],
        module: nn.Module,
        mp_policy: Any,
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        world_size = mesh.size()
        # The layout follows from these alone; worked out again only when one changes.
        key = (id(module), module.recipe, module.quantize_enabled, tuple(outer_size), world_size)
        if self._layout is not None and key == self._layout_key:
            layout = self._layout
        else:
            layout = GatherLayout.for_layer(module, outer_size, world_size)
        if self._layout is not None and layout != self._layout:
            raise ValueError(
                f"{module!r}: its weight was all-gathered as {self._layout.describe()}, now "
                f"the recipe asks for {layout.describe()}; FSDP's buffers are fixed at the "
                "first all-gather, so a layer's recipe cannot change under quantized all-gather"
            )
        self._layout, self._layout_key = layout, key
        shard = self._data
        if tuple(shard.shape) != (outer_size[0] // world_size, outer_size[1]):
            raise ValueError(
                f"weight {tuple(outer_size)}: local shard {tuple(shard.shape)} is not dim-0 "
                f"rows of {world_size} equal shards; a quantized all-gather needs FSDP's "
                "default Shard(0) placement"
            )
        inputs, amax = self._quantized_shard(shard, layout, module, mesh)
        # On a one-rank mesh FSDP2 runs no collective and hands the post hook only the first
        # input (torch 2.13); a one-rank gather is the input itself, so keep them all here.
        return inputs, (layout, amax, inputs if world_size == 1 else None)

    @staticmethod
    def _quantized_shard(
        shard: torch.Tensor, layout: GatherLayout, module: nn.Module, mesh: Any
    ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None]:
        """The shard's all-gather inputs and its weight's amax: made at the first all-gather
        after the weight changed, then taken from the layer's weight cache
        (ops/weight_cache.py) by every later one until the next optimizer step, so the
        backward's re-gather and further micro-batches neither quantize the shard again nor
        all-reduce its amax. The same bits: the same call on the same unchanged shard. Every
        rank decides alike (the same optimizer steps, loads and edits on every rank), so the
        amax all-reduce is skipped by all ranks together or by none."""
        cache = getattr(module, "weight_cache", None)
        if not layout.cached:
            cache = None
        stamp = cache.stamp(shard) if isinstance(cache, WeightCache) else None
        key = ("fsdp_all_gather", layout)
        held = None if stamp is None else cache.get(stamp, key)
        if held is not None:
            return held.inputs, held.amax
        amax = None
        if layout.needs_amax:
            group = mesh.get_group()
            batches = getattr(module, "_amax_batches", None)
            if stamp is None or not isinstance(batches, _AmaxBatches):
                amax = _shards_amax([shard], group)[0]
            else:  # the amaxes of the step's weights in one all-reduce (_AmaxBatch)
                batch = batches.get(group)
                amax = batch.amax(module, shard, cache, stamp)
                batch.saw(module, shard)
        inputs = tuple(layout.inputs(shard, amax))
        if stamp is not None:
            cache.put(stamp, key, _GatherInputs(inputs, amax))
        return inputs, amax

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[QuantizedWeight, tuple[torch.Tensor, ...]] | None:
        layout, amax, local = metadata
        outputs = all_gather_outputs if local is None else local
        # The amax (and, on one rank, the inputs) were made in fsdp_pre_all_gather, which FSDP
        # runs on its all-gather copy-in stream; they are read here on the compute stream.
        _used_on_current_stream([amax, *(local or ())])
        if out is not None:
            if not isinstance(out, QuantizedWeight):
                raise TypeError(f"FSDP handed back a {type(out).__name__}, not a QuantizedWeight")
            layout.assemble_into(out, outputs, amax)
            return None
        weight, built = layout.assemble(outputs, amax, param_dtype)
        return weight, tuple(built)


# FSDP2 reads the hook's signature at every all-gather of every weight (`inspect.signature`,
# ~15-20 us of host time each time); a function's `__signature__` is what inspect returns
# first, so it is worked out once, here.
ShardedWeight.fsdp_pre_all_gather.__signature__ = inspect.signature(  # type: ignore[attr-defined]
    ShardedWeight.fsdp_pre_all_gather
)


class _QuantizedGatherCheck:
    """A forward pre-hook on each layer `enable_quantized_all_gather` prepared: at the layer's
    first forward it raises if the weight is no longer a ShardedWeight, nor the QuantizedWeight
    FSDP2 assembles from one, so that nothing that replaced it (an `_apply` that swaps plain
    tensors in, `load_state_dict(assign=True)`, a new Parameter) leaves FSDP2
    all-gathering the weight unquantized without a word. FSDP2's own pre-forward hook runs
    first (it is prepended), so a layer under FSDP2 shows its gathered weight here. The first
    QuantizedWeight seen removes the hook (eager; under torch.compile it is traced, and costs
    nothing at run time); a weight that is still a ShardedWeight (not sharded yet, or on the
    meta device) keeps it, as a later `to_empty` or `fully_shard` may follow."""

    def __init__(self, weight_name: str) -> None:
        self.weight_name = weight_name
        self.handle: RemovableHandle | None = None

    def remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()

    def __call__(self, module: nn.Module, args: Any) -> None:
        weight = module.weight
        if isinstance(weight, QuantizedWeight):
            if not torch.compiler.is_compiling():
                self.remove()
            return
        if isinstance(weight, ShardedWeight):
            return
        raise RuntimeError(
            f"{self.weight_name} was prepared by enable_quantized_all_gather but is now a "
            f"{type(weight).__name__} of {weight.dtype}, not a ShardedWeight: something "
            "replaced it (an _apply that swapped plain tensors in, "
            "load_state_dict(assign=True), a new Parameter), and FSDP2 would all-gather it "
            "unquantized. Call enable_quantized_all_gather after that change (and before "
            "fully_shard)"
        )


def enable_quantized_all_gather(model: nn.Module) -> int:
    """Make FSDP2 all-gather the weights of `model`'s quantized blockscale Linears as NVFP4 /
    MXFP8 (see this module's docstring). Call after `convert` and before `fully_shard`, on a
    model built on the meta device too; returns the number of weights changed. A Parameter
    shared by several layers is wrapped once. A model with no quantized blockscale Linear
    raises a ValueError (called before `convert`, or with a bf16 recipe, it would otherwise
    gather every weight unquantized). Each prepared layer's first forward checks that its
    weight still takes the quantized all-gather (`_QuantizedGatherCheck`).

    >>> model = bs.convert(torch.nn.Sequential(torch.nn.Linear(64, 64)), bs.recipes.get("nvfp4"))
    >>> bs.distributed.enable_quantized_all_gather(model)  # then fully_shard(model) as usual
    1
    """
    from torch.distributed.tensor import DTensor  # noqa: PLC0415 (not needed before)

    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if not any(m.recipe.quantized for m in linears):
        found = (
            f"{len(linears)} blockscale Linear layers, none with a quantized recipe"
            if linears
            else "no blockscale Linear layer"
        )
        raise ValueError(
            f"enable_quantized_all_gather: {type(model).__name__} has {found}, so nothing "
            "would be gathered quantized; call bs.convert(model, recipe) with an NVFP4 or "
            "MXFP8 recipe first"
        )
    done: dict[int, nn.Parameter] = {}
    batches = _AmaxBatches()
    for name, module in model.named_modules():
        if not (isinstance(module, Linear) and module.recipe.quantized):
            continue
        module._amax_batches = batches
        weight = module.weight
        if isinstance(weight, DTensor):
            raise ValueError(
                f"{name}.weight is already a DTensor: call enable_quantized_all_gather "
                "before fully_shard (or any other parallelization)"
            )
        if id(weight) not in done:
            if isinstance(weight, ShardedWeight):
                done[id(weight)] = weight
            else:
                wrapped = ShardedWeight(weight.data)
                done[id(weight)] = nn.Parameter(wrapped, requires_grad=weight.requires_grad)
        module.weight = done[id(weight)]
        previous = getattr(module, "_quantized_gather_check", None)
        if isinstance(previous, _QuantizedGatherCheck):
            previous.remove()  # called again: one check a layer
        check = _QuantizedGatherCheck(f"{name}.weight" if name else "weight")
        module._quantized_gather_check = check
        check.handle = module.register_forward_pre_hook(check)
    return len(done)
