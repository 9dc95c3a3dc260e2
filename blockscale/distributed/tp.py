"""Tensor parallel for converted linears: DTensor plans whose styles quantize local shards.

blockscale's own models, whose `wqkv` and `w13` stack projections: `apply_tensor_parallel(model,
mesh)` (end of this file). Any other model, with torch's own `parallelize_module`:

```python
bs.convert(model, recipe)
mesh = init_device_mesh("cuda", (tp,))
parallelize_module(model, mesh, {
    "fc1": bs.distributed.QuantizedColwiseParallel(),
    "fc2": bs.distributed.QuantizedRowwiseParallel(),
})
```

Torch's `ColwiseParallel` / `RowwiseParallel` hand a layer DTensors and let DTensor run
`F.linear` on them; a converted layer cannot take them (its quantizers and emulated GEMMs
are plain tensor code), and even if it could, each rank would scale its shard with the
shard's own amax. These subclasses keep everything else of torch's styles (the parameters
become DTensors, Shard(0) / Shard(1) weights, the same input and output layouts and
collectives) and make the layer compute `blockscale.linear` on the local tensors with an
`AmaxReduction` over the TP group: every NVFP4 operand that is a shard of a logically whole
tensor is scaled with the whole tensor's amax (a MAX all-reduce of the local amaxes, one
per forward and one per backward, none for MXFP8), so a shard's codes and block scales are
exactly the corresponding part of the one-device quantization. Which operands are shards:

- column-wise: the weight [N/tp, K] (its tensor amax) and grad_output [M, N/tp] (its row and
  token copies). The input is whole. Output: this rank's columns of one device's; grad_input:
  a sum of the ranks' partial products (DTensor all-reduces it).
- row-wise: the weight [N, K/tp] and the input [M, K/tp] (its row and token copies).
  grad_output is whole. Output: a sum of partial products (all-reduced, or reduce-scattered
  for a Shard(1) output layout), then the bias; grad_input: this rank's columns of one
  device's.
- grad_weight is always this rank's rows / columns of one device's (a contraction over
  tokens). A token copy's Hadamard transform runs along tokens, which TP does not cut, so
  its amax over a shard is a shard's amax and reduces like the others.

Shards must hold whole blocks: the sharded dimension divided by the group size must be a
multiple of the largest block that runs along it (checked when the plan is applied, before
anything is sharded). docs/DISTRIBUTED.md ("Tensor parallel") has the exactness statement
and the limits.

torch's own ColwiseParallel / RowwiseParallel (torchtitan's parallelize functions, plans
written for plain models) compute the same on a converted layer: its forward finds DTensors
and hands them to `forward_on_dtensors`, which reads the layout from them ("torch's own
styles" below). The quantized styles check the shards before anything is sharded rather than
at the first forward, and add a row-wise bias after a reduce-scatter to a sharded output.

Mechanism: the styles change the layer's class to a subclass whose forward converts the
DTensors to local tensors (`to_local`, with the gradient placements DTensor needs to reduce
partial gradients) and wraps the result back (`from_local`: Shard(-1), or Partial for the
row-wise sum), as FSDP2's `fully_shard` changes a module's class to add its hooks. A layer
switched to BF16 (`set_precision`) runs torch's DTensor `F.linear` instead. Layers the styles
do not quantize (`nn.Linear`, `nn.Embedding`, a bf16 recipe) are handed to torch's styles
unchanged, so one plan can cover a whole model.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from blockscale.distributed._collectives import all_reduce_amax
from blockscale.nn.linear import Linear
from blockscale.ops.linear import AmaxReduction, linear
from blockscale.recipes import Recipe

COLWISE, ROWWISE, EVERY_OPERAND = "colwise", "rowwise", "every operand"


def _blocks_along(recipe: Recipe, kind: str) -> list[tuple[int, str]]:
    """(block size, which operand and how) for each block that runs along the dimension `kind`
    shards: N for column-wise (the weight's rows), K for row-wise (its columns)."""
    if kind == COLWISE:
        go, w_t, w = recipe.grad_input.grad_output, recipe.grad_input.weight, recipe.output.weight
        blocks = [
            (go.block_size, f"grad_input.grad_output is {go.describe()}"),
            (w_t.block_size, f"grad_input.weight is {w_t.describe()}"),
        ]
        if w.block == "16x16":
            blocks.append((16, f"output.weight is {w.describe()}"))
        return blocks
    x, w = recipe.output.input, recipe.output.weight
    return [
        (x.block_size, f"output.input is {x.describe()}"),
        (w.block_size, f"output.weight is {w.describe()}"),
    ]


def largest_block(recipe: Recipe, kind: str) -> int:
    """The largest block of `recipe` that runs along the dimension a `kind`-wise split cuts
    (`_blocks_along`; EVERY_OPERAND: either's), which each shard must hold whole."""
    kinds = (COLWISE, ROWWISE) if kind == EVERY_OPERAND else (kind,)
    return max(block for k in kinds for block, _ in _blocks_along(recipe, k))


def amax_reduction(kind: str, group: torch.distributed.ProcessGroup) -> AmaxReduction:
    """The amax reduction over `group` of a layer split `kind`-wise: COLWISE (the weight's rows,
    so grad_output's columns, are shards), ROWWISE (the weight's columns and the input's), or
    EVERY_OPERAND (all three reduced: for a caller that cannot tell which; an operand that is
    whole is the same on every rank, so its reduced amax is its own). `all_reduce_amax` is
    looked up here, when the reduction is made (tests count its calls)."""
    reduce = functools.partial(all_reduce_amax, group=group)
    return AmaxReduction(reduce, input=kind != COLWISE, weight=True, grad_output=kind != ROWWISE)


def expert_reductions(group: torch.distributed.ProcessGroup) -> dict[str, AmaxReduction]:
    """The amax reductions of experts whose hidden dimension is split over `group` (torchtitan's
    `TensorParallel` of the experts; ops/grouped_mm.py, "Tensor parallel"), by weight: w1 and
    w3 ([E, hidden, dim]) column-wise, w2 ([E, dim, hidden]) row-wise. A `GroupedMM` that
    serves all three (torchtitan 0.3's `_grouped_mm` seam) takes `amax_reduction(EVERY_OPERAND,
    group)` instead: the same bits, at one more [E] collective in w2's backward."""
    column = amax_reduction(COLWISE, group)
    return {"w1": column, "w2": amax_reduction(ROWWISE, group), "w3": column}


def check_shards(module: nn.Linear, tp: int, kind: str, parts: int = 1) -> None:
    """Raise a ValueError naming the layer, the shard size and the rule unless `module`'s
    weight splits evenly over `tp` ranks into shards of whole blocks (`kind`: COLWISE shards
    N, ROWWISE shards K). `parts` > 1 (column-wise only): the weight is that many projections
    stacked along N, and each is split over the ranks (see `apply_tensor_parallel`). A layer
    that is not quantized is checked for the even split alone."""
    n, k = module.weight.shape
    dim_name, dim = ("N", n) if kind == COLWISE else ("K", k)
    recipe = getattr(module, "recipe", None)
    layer = f"{type(module).__name__} with weight [{n}, {k}]"
    if recipe is not None:
        layer += f" (recipe {recipe.name})"
    if parts > 1:
        if dim % parts:
            raise ValueError(f"{layer}: N={n} is not {parts} stacked projections of equal size")
        dim //= parts
        layer += f", {parts} stacked projections of N={dim}"
    if dim % tp:
        raise ValueError(
            f"{layer}: {dim_name}={dim} does not split evenly over {tp} ranks ({kind} tensor "
            "parallel needs every shard the same size)"
        )
    if recipe is None or not recipe.quantized:
        return
    shard = dim // tp
    for block, why in _blocks_along(module.recipe, kind):
        if shard % block:
            raise ValueError(
                f"{layer}, {kind} over {tp} ranks: each shard has {dim_name}={shard}, not a "
                f"multiple of {block} ({why}: its blocks run along {dim_name} and a shard must "
                f"hold whole blocks); {dim_name} must be a multiple of {block * tp}"
            )


@dataclass(frozen=True)
class _Layout:
    kind: str
    mesh: DeviceMesh
    output: Placement  # the style's output layout (row-wise: where the bias is added)
    amax_reduction: AmaxReduction
    parts: int = 1  # column-wise: projections stacked along N, each split over the ranks

    @classmethod
    def of(cls, kind: str, mesh: DeviceMesh, output: Placement, parts: int = 1) -> _Layout:
        # the reduction made when the plan is applied
        return cls(kind, mesh, output, amax_reduction(kind, mesh.get_group()), parts)

    def colwise_output(self, ndim: int) -> Placement:
        """Where a column-wise layer's local output columns sit in the whole output."""
        if self.parts == 1:
            return Shard(ndim - 1)
        return _StridedShard(ndim - 1, split_factor=self.parts)


def _on_local_shards(
    module: nn.Linear, input: DTensor, layout: _Layout, quantized: bool
) -> DTensor:
    """`module`'s output from its local shards, wrapped back as a DTensor (module docstring):
    `blockscale.linear` with the layout's amax reduction where `quantized`, else `F.linear`
    (column-wise only: stacked projections in BF16)."""
    weight: DTensor = module.weight  # type: ignore[assignment]
    bias: DTensor | None = module.bias  # type: ignore[assignment]
    if layout.kind == COLWISE:
        # Each rank's grad_input is its shard's part of the sum over N: Partial.
        x = input.to_local(grad_placements=(Partial(),))
        b = None if bias is None else bias.to_local()
        if quantized:
            recipe = module.recipe  # type: ignore[attr-defined]
            reduction = layout.amax_reduction
            out = linear(x, weight.to_local(), b, recipe, amax_reduction=reduction)
        else:  # stacked projections in BF16: DTensor would not place them (see below)
            out = F.linear(x, weight.to_local(), b)
        placement = layout.colwise_output(out.dim())
        return DTensor.from_local(out, layout.mesh, (placement,), run_check=False)
    recipe = module.recipe  # type: ignore[attr-defined]
    x = input.to_local()
    out = linear(x, weight.to_local(), None, recipe, amax_reduction=layout.amax_reduction)
    partial = DTensor.from_local(out, layout.mesh, (Partial(),), run_check=False)
    if bias is None:
        return partial  # the style's output hook reduces it
    # The bias once, after the reduction (DTensor reduces its gradient as for torch's TP).
    whole = partial.redistribute(placements=(layout.output,))
    return whole + bias.to(whole.dtype)


class _OnLocalShards:
    """Mixed into a tensor-parallel blockscale Linear's class: `blockscale.linear` on the
    local shards with the TP group's amax reduction (see the module docstring)."""

    _tp_layout: _Layout

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        layout = self._tp_layout
        # An nn.Linear (stacked projections only) has no quantize_enabled: not quantized.
        quantized = getattr(self, "quantize_enabled", False) and self.recipe.quantized  # type: ignore[attr-defined]
        if not quantized and layout.parts == 1:
            return super().forward(input)  # type: ignore[misc]  # DTensor F.linear
        return _on_local_shards(self, input, layout, quantized)  # type: ignore[arg-type]

    def extra_repr(self) -> str:
        base = super().extra_repr()  # type: ignore[misc]
        return f"{base}, tensor_parallel={self._tp_layout.kind}"


class TensorParallelLinear(_OnLocalShards, Linear):
    """A blockscale Linear after QuantizedColwiseParallel / QuantizedRowwiseParallel."""


class _TensorParallelTorchLinear(_OnLocalShards, nn.Linear):
    """An unconverted nn.Linear of stacked projections after `apply_tensor_parallel`."""


_PARALLEL_CLASSES: dict[type, type] = {
    Linear: TensorParallelLinear,
    nn.Linear: _TensorParallelTorchLinear,
}


def _parallel_class(cls: type) -> type:
    if issubclass(cls, _OnLocalShards):
        return cls
    if cls not in _PARALLEL_CLASSES:  # a user's subclass of blockscale's Linear
        _PARALLEL_CLASSES[cls] = type(f"TensorParallel{cls.__name__}", (_OnLocalShards, cls), {})
    return _PARALLEL_CLASSES[cls]


def _prepare(module: Linear, mesh: DeviceMesh, kind: str, parts: int = 1) -> None:
    if mesh.ndim != 1:
        raise ValueError(
            f"{kind} tensor parallel of a quantized layer takes a 1-D mesh (the TP group), got "
            f"a {mesh.ndim}-D mesh; pass mesh['tp'] or the like"
        )
    weight = module.weight
    if isinstance(weight, DTensor) or hasattr(type(weight), "quantized_copy"):
        raise ValueError(
            f"{module!r}: its weight is already a {type(weight).__name__}; apply the tensor "
            "parallel plan to the converted model first (before fully_shard; NVFP4 primary "
            "weights cannot be TP-sharded)"
        )
    if hasattr(type(weight), "fsdp_pre_all_gather"):
        raise ValueError(
            f"{module!r}: its weight was prepared for FSDP's quantized all-gather, which does "
            "not take TP-sharded weights; use plain fully_shard for FSDP + TP"
        )
    check_shards(module, mesh.size(), kind, parts)


def _parallelize(
    module: nn.Module,
    mesh: DeviceMesh,
    kind: str,
    output: Placement,
    torch_apply: Callable[[nn.Module, DeviceMesh], nn.Module],
) -> nn.Module:
    """torch's style applied to `module`; for a quantized blockscale Linear, after the shard
    checks, and with its forward switched to the local shards."""
    if not (isinstance(module, Linear) and module.recipe.quantized):
        return torch_apply(module, mesh)
    _prepare(module, mesh, kind)
    module = torch_apply(module, mesh)
    module.__class__ = _parallel_class(type(module))
    module._tp_layout = _Layout.of(kind, mesh, output)  # type: ignore[assignment]
    return module


class QuantizedColwiseParallel(ColwiseParallel):
    """torch's ColwiseParallel (same arguments and layouts) for converted blockscale Linears:
    the weight [N, K] is sharded along N and each rank computes its output columns with
    `blockscale.linear`, amaxes of the weight and grad_output reduced over the mesh. Other
    modules (nn.Linear, nn.Embedding, bf16 layers) get torch's ColwiseParallel.

    >>> import torch.distributed as dist
    >>> from torch.distributed.device_mesh import init_device_mesh
    >>> from torch.distributed.tensor.parallel import parallelize_module
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> mlp = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 64))
    >>> mlp = bs.convert(mlp, bs.recipes.get("nvfp4"))
    >>> plan = {"0": bs.distributed.QuantizedColwiseParallel(),
    ...         "1": bs.distributed.QuantizedRowwiseParallel()}
    >>> mlp = parallelize_module(mlp, init_device_mesh("cpu", (1,)), plan)
    >>> mlp(torch.randn(4, 64)).shape
    torch.Size([4, 64])
    >>> dist.destroy_process_group()
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        output = self.output_layouts[0]
        return _parallelize(module, device_mesh, COLWISE, output, super()._apply)


class QuantizedRowwiseParallel(RowwiseParallel):
    """torch's RowwiseParallel (same arguments and layouts) for converted blockscale Linears:
    the weight [N, K] is sharded along K, each rank multiplies its input columns with
    `blockscale.linear` (amaxes of the input, its token copy and the weight reduced over the
    mesh) and the partial outputs are summed (all-reduce, or reduce-scatter for a sharded
    output layout), then the bias is added. Other modules get torch's RowwiseParallel.

    >>> import torch.distributed as dist
    >>> from torch.distributed.device_mesh import init_device_mesh
    >>> from torch.distributed.tensor.parallel import parallelize_module
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> mlp = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 64))
    >>> mlp = bs.convert(mlp, bs.recipes.get("nvfp4"))
    >>> plan = {"0": bs.distributed.QuantizedColwiseParallel(),
    ...         "1": bs.distributed.QuantizedRowwiseParallel()}
    >>> mlp = parallelize_module(mlp, init_device_mesh("cpu", (1,)), plan)
    >>> mlp(torch.randn(4, 64)).shape
    torch.Size([4, 64])
    >>> dist.destroy_process_group()
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        output = self.output_layouts[0]
        return _parallelize(module, device_mesh, ROWWISE, output, super()._apply)


# ------------------------------------------------------------------------ torch's own styles
#
# torchtitan's parallelize functions (and any plan written for plain models) apply torch's
# ColwiseParallel / RowwiseParallel to layers a converter has already swapped: the layer keeps
# its class and receives DTensors. blockscale.nn.Linear then calls `forward_on_dtensors`
# (through the hook blockscale.distributed registers; nn/ cannot import this module), which
# reads the layout from the DTensors and computes what the quantized styles compute.

_TORCH_STYLES = (
    "a quantized layer takes the DTensors of torch's ColwiseParallel (weight and bias Shard(0), "
    "input Replicate) or RowwiseParallel (weight Shard(1), bias Replicate, input Shard(-1)) on "
    "a 1-D mesh, as the style's input hook leaves them (or those of blockscale.distributed."
    "QuantizedColwiseParallel / QuantizedRowwiseParallel); leave other layers unconverted"
)


def _placed(t: torch.Tensor | None) -> str:
    if t is None:
        return "none"
    if not isinstance(t, DTensor):
        return f"a {type(t).__name__} (not a DTensor)"
    return f"{t.placements} on a {t.device_mesh.ndim}-D mesh"


def _is_placed(t: torch.Tensor | None, mesh: DeviceMesh, want: Placement) -> bool:
    """`t` is a DTensor on `mesh` laid out as `want` alone: not a _StridedShard, which torch
    2.11 makes a Shard subclass that compares equal to a Shard. (An isinstance test, not
    `type(p) is type(want)`, which torch 2.11's Dynamo evaluates False for equal types.)"""
    if not isinstance(t, DTensor) or t.device_mesh != mesh or len(t.placements) != 1:
        return False
    (placement,) = t.placements
    return (
        isinstance(placement, type(want))
        and not isinstance(placement, _StridedShard)
        and placement == want
    )


def _torch_style_layout(module: Linear, input: torch.Tensor) -> _Layout:
    """The tensor-parallel layout of a quantized Linear that torch's own ColwiseParallel or
    RowwiseParallel parallelized, read from its DTensors: weight Shard(0) with a Replicate
    input is column-wise, weight Shard(1) with a Shard(-1) input row-wise, on the weight's
    1-D mesh. Raises a ValueError naming the layouts for anything else (a 2-D mesh, a
    replicated weight, a plain input beside a DTensor weight), and `check_shards`' error
    for shards that cut blocks. A row-wise output is reduced whole before the bias is added:
    the layer cannot see the style's output layout, which its output hook then makes."""
    weight, bias = module.weight, module.bias
    mesh = weight.device_mesh if isinstance(weight, DTensor) else None
    kind = None
    if mesh is not None and mesh.ndim == 1:
        colwise = _is_placed(weight, mesh, Shard(0)) and _is_placed(input, mesh, Replicate())
        rowwise = _is_placed(weight, mesh, Shard(1)) and _is_placed(
            input, mesh, Shard(input.dim() - 1)
        )
        kind = COLWISE if colwise else ROWWISE if rowwise else None
        if kind is not None and bias is not None:
            want_bias = Shard(0) if kind == COLWISE else Replicate()
            kind = kind if _is_placed(bias, mesh, want_bias) else None
    if kind is None:
        raise ValueError(
            f"{type(module).__name__} with weight {list(weight.shape)} (recipe "
            f"{module.recipe.name}) got weight {_placed(weight)}, bias {_placed(bias)}, input "
            f"{_placed(input)}: {_TORCH_STYLES}"
        )
    check_shards(module, mesh.size(), kind)
    return _Layout.of(kind, mesh, Replicate())


def forward_on_dtensors(module: Linear, input: torch.Tensor) -> torch.Tensor:
    """A quantized blockscale Linear's forward when its weight or input is a DTensor: the
    layout from `_torch_style_layout`, then the same local compute, amax reductions and
    output placements as QuantizedColwiseParallel / QuantizedRowwiseParallel (for a layer
    without a bias, the same collectives too; a row-wise bias: `_torch_style_layout`)."""
    return _on_local_shards(module, input, _torch_style_layout(module, input), quantized=True)


# --------------------------------------------------------------------------- blockscale's models
#
# blockscale's models (models/llama.py, the attention of models/moe.py) stack projections in
# one linear: `wqkv` is [q; k; v] ([3*dim, dim]) and `w13` is [gate; up] ([2*hidden, dim]).
# A plain Shard(0) of either would give rank 0 all of q and part of k (or gate alone). Here
# each of the stacked parts is split over the ranks: rank r holds [q_r; k_r; v_r] (the
# rows of heads r*H/tp .. (r+1)*H/tp - 1 of each) and [gate_r; up_r], which is DTensor's
# `_StridedShard(0, split_factor=parts)`: the tensor cut into `parts`, each cut into tp, rank
# r taking the r-th piece of every part. The DTensor's whole value stays the one-device
# weight (full_tensor(), checkpoints), and the model's own forward splits the local output
# as it splits the whole one: it counts heads from the output's width (n_heads/tp here).


class _StackedColwiseParallel(QuantizedColwiseParallel):
    """Column-wise for a linear whose weight stacks `parts` projections along N: each rank
    holds its rows of every part, in part order, and computes those output columns (quantized
    with the amaxes of the whole weight and grad_output, as QuantizedColwiseParallel does).
    An unconverted or BF16 layer computes the same local columns with F.linear: DTensor has
    no sharding rule that keeps a matmul's output in this strided layout. The output is
    handed on as the local tensor (use_local_output), which the model splits by parts."""

    def __init__(self, parts: int) -> None:
        super().__init__()
        self.parts = parts

    def _partition_linear_fn(self, name, module, device_mesh):
        placement = _StridedShard(0, split_factor=self.parts)
        for param_name, param in module.named_parameters():
            whole = distribute_tensor(
                param, device_mesh, [placement], src_data_rank=self.src_data_rank
            )
            module.register_parameter(
                param_name, nn.Parameter(whole, requires_grad=param.requires_grad)
            )

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        return outputs.to_local()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise TypeError(f"stacked column-wise tensor parallel takes a Linear, not {module!r}")
        if isinstance(module, Linear) and module.recipe.quantized:
            _prepare(module, device_mesh, COLWISE, self.parts)
        else:
            check_shards(module, device_mesh.size(), COLWISE, self.parts)
        module = ColwiseParallel._apply(self, module, device_mesh)
        module.__class__ = _parallel_class(type(module))
        layout = _Layout.of(COLWISE, device_mesh, Shard(-1), self.parts)
        module._tp_layout = layout  # type: ignore[assignment]
        return module


def _strided_placement(mesh: DeviceMesh, placements) -> _StridedShard:
    placements = tuple(placements)
    if mesh.ndim != 1 or len(placements) != 1 or not isinstance(placements[0], _StridedShard):
        raise ValueError(
            f"placements {placements} on a {mesh.ndim}-D mesh: stacked tensor-parallel weights "
            "are one _StridedShard on a 1-D mesh"
        )
    return placements[0]


def stacked_full_tensor(value: DTensor) -> torch.Tensor:
    """The whole tensor of a stacked weight (a `_StridedShard` DTensor made by
    `apply_tensor_parallel`, or its optimizer state), from one all-gather of the local pieces.
    DTensor's own `full_tensor()` / `redistribute` cannot be used: torch 2.11 reads a
    `_StridedShard` as a shard order over several mesh dims and refuses it on a 1-D mesh
    ("unable to be interpreted into a corresponding shard_order"); 2.13 accepts it."""
    mesh = value.device_mesh
    placement = _strided_placement(mesh, value.placements)
    dim, parts, w = placement.dim, placement.split_factor, mesh.size()
    local = value.to_local().contiguous()
    pieces = [torch.empty_like(local) for _ in range(w)]
    torch.distributed.all_gather(pieces, local, group=mesh.get_group())
    # Rank r holds piece r of every part, in part order: put part p's W pieces side by side.
    return torch.cat([pieces[r].chunk(parts, dim)[p] for p in range(parts) for r in range(w)], dim)


def stacked_from_full(whole: torch.Tensor, mesh: DeviceMesh, placements) -> DTensor:
    """`whole` (the same on every rank) as a stacked weight of `placements` (one
    `_StridedShard`): this rank's piece of every part, cut here, not by DTensor (see
    `stacked_full_tensor`)."""
    placement = _strided_placement(mesh, placements)
    dim, parts, w = placement.dim, placement.split_factor, mesh.size()
    if whole.shape[dim] % (parts * w):
        raise ValueError(
            f"shape {tuple(whole.shape)}: dim {dim} is not {parts} parts split over {w} ranks"
        )
    rank = mesh.get_local_rank()
    local = torch.cat([part.chunk(w, dim)[rank] for part in whole.chunk(parts, dim)], dim)
    return DTensor.from_local(
        local, mesh, (placement,), run_check=False, shape=whole.shape, stride=whole.stride()
    )


def _stacked_layers(model: nn.Module) -> list[tuple[str, nn.Module, nn.Module | None]]:
    """(block name, its attention, its dense MLP or None) for each block of a model built like
    blockscale's: `layers`, each with `attn` (`wqkv`, `wo`, `n_heads`) and `mlp`; an `mlp`
    without `w13` / `w2` (an MoE layer) stays whole."""
    layers = getattr(model, "layers", None)
    if layers is None:
        raise ValueError(
            f"{type(model).__name__} has no `layers`: apply_tensor_parallel takes blockscale's "
            "own models (models/); give other models a plan of QuantizedColwiseParallel / "
            "QuantizedRowwiseParallel styles"
        )
    found = []
    for i, block in enumerate(layers):
        attn = getattr(block, "attn", None)
        if not all(hasattr(attn, name) for name in ("wqkv", "wo", "n_heads")):
            raise ValueError(f"layers.{i} has no attention with wqkv, wo and n_heads")
        mlp = getattr(block, "mlp", None)
        dense = mlp if all(hasattr(mlp, name) for name in ("w13", "w2")) else None
        found.append((f"layers.{i}", attn, dense))
    return found


def check_tensor_parallel(model: nn.Module, tp: int) -> None:
    """Raise a one-line ValueError naming the rule unless `apply_tensor_parallel` can split
    `model` over `tp` ranks: whole heads per rank (n_heads divisible by tp), an even split of
    the MLP's hidden features, and shards of whole blocks in every quantized layer (for
    `nvfp4` each part's rows and each row-wise K a multiple of 16·tp; 32·tp for MXFP8
    operands). Touches nothing; needs no process group.

    >>> from blockscale.models import build_model, model_config
    >>> model = build_model(model_config("tiny"))
    >>> bs.distributed.check_tensor_parallel(model, 3)
    Traceback (most recent call last):
        ...
    ValueError: layers.0.attn: n_heads=4 does not split over 3 tensor-parallel ranks ...
    """
    if tp < 1:
        raise ValueError(f"tensor-parallel degree {tp} is not a positive number of ranks")
    for name, attn, mlp in _stacked_layers(model):
        if attn.n_heads % tp:
            raise ValueError(
                f"{name}.attn: n_heads={attn.n_heads} does not split over {tp} tensor-parallel "
                f"ranks (each rank computes whole heads: n_heads must be a multiple of {tp})"
            )
        hidden = mlp.w2.in_features if mlp is not None else 0
        if hidden % tp:
            raise ValueError(
                f"{name}.mlp: hidden dim {hidden} does not split over {tp} tensor-parallel "
                f"ranks (each rank keeps hidden/{tp} of the gate and up rows and of w2's columns)"
            )
        layers = [("attn.wqkv", attn.wqkv, COLWISE, 3), ("attn.wo", attn.wo, ROWWISE, 1)]
        if mlp is not None:
            layers += [("mlp.w13", mlp.w13, COLWISE, 2), ("mlp.w2", mlp.w2, ROWWISE, 1)]
        for suffix, layer, kind, parts in layers:
            try:
                check_shards(layer, tp, kind, parts)
            except ValueError as e:
                raise ValueError(f"{name}.{suffix}: {e}") from None


def tensor_parallel_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """The `parallelize_module` plan of blockscale's own models (by module name): `wqkv`
    column-wise with q, k and v each split by heads, `wo` row-wise; a dense MLP's `w13`
    column-wise with gate and up each split, `w2` row-wise. Embeddings, norms, `lm_head` and
    MoE layers are not in it (replicated).

    >>> from blockscale.models import build_model, model_config
    >>> plan = bs.distributed.tensor_parallel_plan(build_model(model_config("tiny")))
    >>> sorted(plan)[:4]
    ['layers.0.attn.wo', 'layers.0.attn.wqkv', 'layers.0.mlp.w13', 'layers.0.mlp.w2']
    """
    plan: dict[str, ParallelStyle] = {}
    for name, _, mlp in _stacked_layers(model):
        plan[f"{name}.attn.wqkv"] = _StackedColwiseParallel(parts=3)
        plan[f"{name}.attn.wo"] = QuantizedRowwiseParallel()
        if mlp is not None:
            plan[f"{name}.mlp.w13"] = _StackedColwiseParallel(parts=2)
            plan[f"{name}.mlp.w2"] = QuantizedRowwiseParallel()
    return plan


def apply_tensor_parallel(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Split a (converted) blockscale model over the 1-D mesh `mesh` (the TP group) with
    `tensor_parallel_plan`, after `check_tensor_parallel` (a ValueError before anything
    changes). Every rank must hold the same weights (build from the same seed) and feed the
    same tokens; the logits come out whole on every rank. Call it after `convert` and before
    the optimizer (the parameters become DTensors).

    >>> import torch.distributed as dist
    >>> from torch.distributed.device_mesh import init_device_mesh
    >>> from blockscale.models import build_model, model_config
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> model = build_model(model_config("tiny"))
    >>> model = bs.convert(model, bs.recipes.get("nvfp4"), bs.nn.layer_policy(model))
    >>> model = bs.distributed.apply_tensor_parallel(model, init_device_mesh("cpu", (1,)))
    >>> model(torch.randint(0, 256, (1, 32))).shape  # whole logits on every rank
    torch.Size([1, 32, 256])
    >>> dist.destroy_process_group()
    """
    if mesh.ndim != 1:
        raise ValueError(
            f"apply_tensor_parallel takes a 1-D mesh (the TP group), not {mesh.ndim}-D"
        )
    check_tensor_parallel(model, mesh.size())
    return parallelize_module(model, mesh, tensor_parallel_plan(model))
