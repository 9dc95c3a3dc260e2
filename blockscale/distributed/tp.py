"""Tensor parallel for converted linears: DTensor plans whose styles quantize local shards.

Usage, with torch's own `parallelize_module`:

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
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.placement_types import Placement

from blockscale.distributed._collectives import all_reduce_amax
from blockscale.nn.linear import Linear
from blockscale.ops.linear import AmaxReduction, linear
from blockscale.recipes import Recipe

COLWISE, ROWWISE = "colwise", "rowwise"


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


def check_shards(module: Linear, tp: int, kind: str) -> None:
    """Raise a ValueError naming the layer, the shard size and the rule unless `module`'s
    weight splits evenly over `tp` ranks into shards of whole blocks (`kind`: COLWISE shards
    N, ROWWISE shards K)."""
    n, k = module.weight.shape
    dim_name, dim = ("N", n) if kind == COLWISE else ("K", k)
    layer = f"{type(module).__name__} with weight [{n}, {k}] (recipe {module.recipe.name})"
    if dim % tp:
        raise ValueError(
            f"{layer}: {dim_name}={dim} does not split evenly over {tp} ranks ({kind} tensor "
            "parallel needs every shard the same size)"
        )
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

    @classmethod
    def of(cls, kind: str, mesh: DeviceMesh, output: Placement) -> _Layout:
        # all_reduce_amax looked up here, when the plan is applied (tests count its calls)
        reduce = functools.partial(all_reduce_amax, group=mesh.get_group())
        if kind == COLWISE:
            return cls(kind, mesh, output, AmaxReduction(reduce, weight=True, grad_output=True))
        return cls(kind, mesh, output, AmaxReduction(reduce, input=True, weight=True))


class _OnLocalShards:
    """Mixed into a tensor-parallel blockscale Linear's class: `blockscale.linear` on the
    local shards with the TP group's amax reduction (see the module docstring)."""

    _tp_layout: _Layout

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not (self.quantize_enabled and self.recipe.quantized):  # type: ignore[attr-defined]
            return super().forward(input)  # type: ignore[misc]  # DTensor F.linear
        layout = self._tp_layout
        weight: DTensor = self.weight  # type: ignore[attr-defined]
        bias: DTensor | None = self.bias  # type: ignore[attr-defined]
        recipe = self.recipe  # type: ignore[attr-defined]
        if layout.kind == COLWISE:
            # Each rank's grad_input is its shard's part of the sum over N: Partial.
            x = input.to_local(grad_placements=(Partial(),))  # type: ignore[attr-defined]
            b = None if bias is None else bias.to_local()
            out = linear(x, weight.to_local(), b, recipe, amax_reduction=layout.amax_reduction)
            return DTensor.from_local(out, layout.mesh, (Shard(out.dim() - 1),), run_check=False)
        x = input.to_local()  # type: ignore[attr-defined]
        out = linear(x, weight.to_local(), None, recipe, amax_reduction=layout.amax_reduction)
        partial = DTensor.from_local(out, layout.mesh, (Partial(),), run_check=False)
        if bias is None:
            return partial  # the style's output hook reduces it
        # The bias once, after the reduction (DTensor reduces its gradient as for torch's TP).
        whole = partial.redistribute(placements=(layout.output,))
        return whole + bias.to(whole.dtype)

    def extra_repr(self) -> str:
        base = super().extra_repr()  # type: ignore[misc]
        return f"{base}, tensor_parallel={self._tp_layout.kind}"


class TensorParallelLinear(_OnLocalShards, Linear):
    """A blockscale Linear after QuantizedColwiseParallel / QuantizedRowwiseParallel."""


_PARALLEL_CLASSES: dict[type, type] = {Linear: TensorParallelLinear}


def _parallel_class(cls: type) -> type:
    if issubclass(cls, _OnLocalShards):
        return cls
    if cls not in _PARALLEL_CLASSES:  # a user's subclass of blockscale's Linear
        _PARALLEL_CLASSES[cls] = type(f"TensorParallel{cls.__name__}", (_OnLocalShards, cls), {})
    return _PARALLEL_CLASSES[cls]


def _prepare(module: Linear, mesh: DeviceMesh, kind: str) -> None:
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
    check_shards(module, mesh.size(), kind)


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
    modules (nn.Linear, nn.Embedding, bf16 layers) get torch's ColwiseParallel."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        output = self.output_layouts[0]
        return _parallelize(module, device_mesh, COLWISE, output, super()._apply)


class QuantizedRowwiseParallel(RowwiseParallel):
    """torch's RowwiseParallel (same arguments and layouts) for converted blockscale Linears:
    the weight [N, K] is sharded along K, each rank multiplies its input columns with
    `blockscale.linear` (amaxes of the input, its token copy and the weight reduced over the
    mesh) and the partial outputs are summed (all-reduce, or reduce-scatter for a sharded
    output layout), then the bias is added. Other modules get torch's RowwiseParallel."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        output = self.output_layouts[0]
        return _parallelize(module, device_mesh, ROWWISE, output, super()._apply)
