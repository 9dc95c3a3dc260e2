"""blockscale's converter for torchtitan 0.3.x, which converts a model's config before it builds
the model on the meta device (package docstring).

`BlockscaleConverter.Config(recipe="nvfp4", ...)` goes where torchtitan's quantization
converters go (a `model_registry(..., converters=[...])` of one's own config registry, chosen
with `--module`), and `--override.imports blockscale.integrations.titan.v0_3.blockscale` applies
the same conversion to any config from the command line (with options as JSON:
`'blockscale.integrations.titan.v0_3.blockscale={"recipe": "mxfp8"}'`).

What it builds are torchtitan `Module`s, as the trainer requires of every submodule:

- `BlockscaleLinear` is a `blockscale.nn.Linear` (so `set_precision`, the weight cache and
  `blockscale.nn.convert` know it) and a torchtitan `Module`: its config is a `Linear.Config`
  with a `recipe`, so parameter init and sharding configs carry over unchanged.
- experts: a subclass of the experts class (`GroupedExperts` or another with its `_grouped_mm`
  seam), made once per class, whose `_grouped_mm` runs a `blockscale.nn.GroupedMM` child.
  torchtitan casts the expert weights to BF16 before each grouped GEMM, and the three weights
  go through one seam that cannot tell them apart, so that child keeps no weight cache (each
  call quantizes its weight: the same bits; a cache keyed by a fresh cast could not be
  trusted).

Layers whose dims do not fit the recipe's blocks stay as they are, with a warning, as in
`convert`; so do `Linear` subclasses with a forward of their own (`own_forward_reason`:
gpt-oss's attention output, whose bias a TP degree divides), which `convert` leaves alone.

Expert parallelism needs nothing more: 0.3's experts forward takes the weights' local shards
(`to_local()` of the DTensors EP makes, `Shard(0)` on "ep") and calls the `_grouped_mm` seam,
so each rank's experts run blockscale's grouped GEMM, on the token groups EP's all-to-all
dispatch lays out (unpadded: one process's group of each local expert, row for row; tested
bit for bit against one process in tests/test_titan_expert_parallel.py).

Tensor parallel of the experts (TP on, EP off): 0.3's sharding configs split every routed
expert's hidden dimension over the "tp" mesh dim (`moe_sharding.expert_param_placement_dense`:
w1_EFD, w3_EFD `Shard(1)`, w2_EDF `Shard(2)`), and the experts forward multiplies the local
shards through the seam, every token on each rank. Left there, each rank quantized its shards
with their own per-expert amaxes, not one process's, and nothing said so (before 2026-12-05).
So the converted class's forward finds the mesh dim that splits its weights
(`hidden_split_group`: DTensors sharded on a dim other than the experts') and gives its
`GroupedMM`, for that forward, `tp.amax_reduction(EVERY_OPERAND, group)` over it: each call's
per-expert NVFP4 amaxes MAX-reduced over the TP ranks, every operand (one collective a
call in the forward and one in the backward; the reduction travels with autograd to the
backward). The seam cannot tell w1, w3 and w2 apart, and need not: the operands that are not
shards (w1's and w3's input, w2's grad_output) are the same on every TP rank, so reducing them
changes nothing, and every quantized operand is that part of one process's, bit for bit (the
weight gradients are one process's slices: tests/test_titan_experts_tp_v0_3.py). The shards
must hold whole blocks (16 for NVFP4, 32 for MXFP8; `check_hidden_split` raises otherwise).
torchtitan compiles each block with `fullgraph=True`, its experts included: Dynamo traces the
attribute set and reset around the call and puts the collectives in the forward and backward
graphs as functional all-reduces, and the compiled block gives eager's bits (tested with
AOTAutograd on the CPU, not with Inductor). On 0.3's default `spmd_types` backend the shards
are plain tensors and no mesh is in sight of the module: there the converted experts raise a
ValueError (`--parallelism.spmd_backend partial_dtensor` runs them) rather than quantize each
shard alone.

FSDP2's quantized all-gather (`enable_quantized_all_gather`, which the 0.2.2 converter turns
on): not by the converter. A 0.3 converter sees the model config only, before the build, never
the built model nor the parallel dims, and the override path cannot reach further: torchtitan
applies overrides after the model config's `update_from_config` (the one call that sees the
trainer's parallelism config) and builds the config object it held before them (trainer.py
lines 345-367: a replaced root config would not be built); `override` refuses `ModelSpec` as a
target (config/override.py line 223), and on `partial_dtensor` a model's modules see the
parallel dims only under TP or EP (`Module.parallelize`, called by
models/deepseek_v3/parallelize.py line 48 and its siblings), not under FSDP alone. What sees
both the built meta model and the parallel dims before `fully_shard` is the model spec's
`parallelize_fn` (trainer.py line 491; under PP, each stage's, distributed/pipeline_parallel.py
line 111). So `with_quantized_all_gather(model_spec)` gives a spec whose `parallelize_fn`
(`QuantizedAllGatherParallelize`) first calls `prepare_quantized_all_gather`: where the model
holds converted linears and FSDP shards (dp_shard or cp above 1), on `partial_dtensor` (which
applies FSDP2 as 0.2.2 does; `spmd_types` does not run FSDP2 on torch 2.13, `full_dtensor` is
not tried), without tensor or pipeline parallelism (`quantized_all_gather_reason`; the log
says which), it makes their weights `ShardedWeight`s, then torchtitan's parallelize runs. A
config registry (`--module`) puts it on its spec; the `train_v0_3` configs do. Under
torchtitan's own registries (`--module deepseek_v3`) FSDP2 gathers the converted linears in
the mixed-precision dtype, as before (the converter's log says so). The `ShardedWeight`s
survive `to_empty` and `init_weights` (their initializers write in place). torchtitan's DCP
checkpointer compares the storages of the model's state-dict tensors from one save to the next
(`components/checkpointer/base.py`, `_shares_storage`), which a wrapper subclass has none of, so
the prepared model's state dict gives each `ShardedWeight` as the FP32 tensor it wraps
(`_sharded_weights_as_their_data`, the same storage); a load writes those in place and then
`load_state_dict`s them into the weights, which counts as a write (the gather-input cache is
dropped). Tested on 2 gloo ranks (tests/test_titan_fsdp_v0_3.py, tests/test_titan_trainer.py).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torchtitan.components.quantization import QuantizationConverter
from torchtitan.config.override import override
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.moe import GroupedExperts
from torchtitan.protocols.model import BaseModel
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.protocols.module import Module

import blockscale.nn as bsnn
from blockscale.distributed.fsdp import ShardedWeight
from blockscale.distributed.tp import EVERY_OPERAND, amax_reduction, largest_block
from blockscale.integrations.titan import (
    DEFAULT_BF16_TAIL_FRACTION,
    DEFAULT_RECIPE,
    TitanPolicy,
    gather_quantized_unless,
    titan_policy,
)
from blockscale.nn.convert import experts_unsupported_reason, unsupported_reason
from blockscale.recipes import get as get_recipe

logger = logging.getLogger(__name__)


class BlockscaleLinear(bsnn.Linear, Module):
    """torchtitan's `Linear` running a blockscale recipe (module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Linear.Config):
        recipe: str = DEFAULT_RECIPE

    def __init__(self, config: Config) -> None:
        bsnn.Linear.__init__(
            self,
            config.in_features,
            config.out_features,
            bias=config.bias,
            recipe=get_recipe(config.recipe),
        )


class TitanGroupedMM(bsnn.GroupedMM, Module):
    """`blockscale.nn.GroupedMM` as a torchtitan `Module` (no parameters, no weight cache)."""

    def __init__(self, recipe_name: str) -> None:
        bsnn.GroupedMM.__init__(self, get_recipe(recipe_name))
        self.weight_cache = None


_EXPERTS_CLASSES: dict[type, type] = {}


def experts_class(parent: type) -> type:
    """The subclass of the experts class `parent` whose `_grouped_mm` runs blockscale's grouped
    GEMM, made once per class."""
    if parent in _EXPERTS_CLASSES:
        return _EXPERTS_CLASSES[parent]

    class BlockscaleExperts(parent):  # type: ignore[valid-type,misc]
        @dataclass(kw_only=True, slots=True)
        class Config(parent.Config):  # type: ignore[name-defined,misc]
            recipe: str = DEFAULT_RECIPE

        def __init__(self, config: Any) -> None:
            parent.__init__(self, config)
            self.grouped_mm = TitanGroupedMM(config.recipe)
            # built whole (on the meta device, before torchtitan parallelizes it)
            self.blockscale_whole_shapes = {
                name: tuple(p.shape) for name, p in self.named_parameters(recurse=False)
            }

        # torchtitan maps a forward's inputs to its sharding config by the signature's names
        @functools.wraps(parent.forward)
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            group = hidden_split_group(self)
            if group is None:
                return parent.forward(self, *args, **kwargs)
            self.grouped_mm.amax_reduction = amax_reduction(EVERY_OPERAND, group)
            try:
                return parent.forward(self, *args, **kwargs)
            finally:
                self.grouped_mm.amax_reduction = None

        def _grouped_mm(self, *, A: Any, B_t: Any, offs: Any) -> Any:
            return self.grouped_mm(A, B_t, offs)

    BlockscaleExperts.__name__ = BlockscaleExperts.__qualname__ = f"Blockscale{parent.__name__}"
    _EXPERTS_CLASSES[parent] = BlockscaleExperts
    return BlockscaleExperts


def hidden_split_group(module: Any) -> torch.distributed.ProcessGroup | None:
    """The process group over whose ranks the quantized experts `module` split their hidden
    dimension (module docstring, "Tensor parallel"), or None where its weights are whole along
    it. Its parameters are DTensors sharded on a dim other than the experts' (dim 0) over one
    mesh dim; their shards must hold whole blocks (`check_hidden_split`). A ValueError for a
    split over several mesh dims, or for shards that are no DTensors (spmd_types), whose
    ranks blockscale cannot see."""
    gmm = module.grouped_mm
    if not (gmm.quantize_enabled and gmm.recipe.quantized):
        return None
    split: dict[str, int] = {}  # parameter -> its whole size along the split dim
    where = set()  # (mesh, mesh dim)
    for name, p in module.named_parameters(recurse=False):
        if not isinstance(p, DTensor):
            continue
        for mesh_dim, placement in enumerate(p.placements):
            if placement.is_shard() and placement.dim != 0:
                split[name] = p.shape[placement.dim]
                where.add((p.device_mesh, mesh_dim))
    if len(where) > 1:
        dims = sorted(f"{m.mesh_dim_names}[{d}]" for m, d in where)
        raise ValueError(
            f"{type(module).__name__}: the experts' hidden dimension is split over several mesh "
            f"dims ({', '.join(dims)}); blockscale reduces the NVFP4 amaxes over one"
        )
    if not where:
        _refuse_plain_shards(module)
        return None
    ((mesh, mesh_dim),) = where
    ranks = mesh.size(mesh_dim)
    check_hidden_split(module, split, ranks)
    return mesh.get_group(mesh_dim)


def check_hidden_split(module: Any, split: dict[str, int], ranks: int) -> None:
    """Raise a ValueError naming the rule unless every rank's part of each split dimension
    (`split`: parameter name -> its whole size along the dim split over `ranks` ranks) is the
    same size and holds whole blocks of every quantized copy that can run along it. One
    `GroupedMM` serves w1, w3 (the hidden dimension is their N: grad_output's and the dgrad
    weight's blocks, and a 16x16 weight block, run along it) and w2 (their K: the input's and
    the weight's blocks), so the largest of those blocks."""
    recipe = module.grouped_mm.recipe
    block = largest_block(recipe, EVERY_OPERAND)
    for name, size in split.items():
        if size % (ranks * block):
            raise ValueError(
                f"{type(module).__name__} under tensor parallel over {ranks} ranks: {name} "
                f"splits a dimension of {size} (the experts' hidden dimension), and each rank's "
                f"part must hold whole blocks of {block} (recipe {recipe.name}: its blocks run "
                f"along it); it must be a multiple of {ranks * block}"
            )


def _refuse_plain_shards(module: Any) -> None:
    """Raise where the experts' weights are plain tensors holding part of a dimension other
    than the experts' (torchtitan's default `spmd_types` backend under tensor parallel): each
    rank would scale its shard with its own amaxes, silently unlike one process."""
    for name, p in module.named_parameters(recurse=False):
        whole = module.blockscale_whole_shapes.get(name)
        if whole is not None and len(whole) == p.dim() and tuple(p.shape[1:]) != whole[1:]:
            raise ValueError(
                f"{type(module).__name__}: {name} is a plain tensor of shape "
                f"{tuple(p.shape)}, part of {whole} beyond the experts' dim (tensor parallel "
                "on torchtitan's spmd_types backend); blockscale reduces the shards' NVFP4 "
                "amaxes over the ranks only for DTensor weights: run with "
                "--parallelism.spmd_backend partial_dtensor, or keep these experts in BF16"
            )


def own_forward_reason(config: Any) -> str | None:
    """Why the linear a `Linear.Config` subclass builds is no plain linear, or None: its class
    has a forward of its own (gpt-oss's attention output, `ScaledBiasRowwiseLinear`, divides
    its bias by the TP degree), which a `BlockscaleLinear` would drop. `blockscale.nn.convert`
    leaves such a linear alone, and so does the converter."""
    owner = type(config)._owner
    if owner is None or owner.forward is nn.Linear.forward:
        return None
    return (
        f"{owner.__name__} has a forward of its own, not a plain linear's "
        "(blockscale.nn.convert leaves it alone too)"
    )


def _replace(root: Any, parent: Any, attr: Any, new: Any) -> Any:
    """Put `new` where the traversal found a config; returns the (possibly new) root."""
    if parent is None:
        return new
    if isinstance(parent, list):
        parent[attr] = new
    else:
        setattr(parent, attr, new)
    return root


def _policy(model_config: Any, config: BlockscaleConverter.Config) -> TitanPolicy:
    layers = getattr(model_config, "layers", None) or []
    names = [str(i) for i in range(len(layers))]
    return titan_policy(names, config.bf16_tail_fraction, config.fqns, config.bf16_fqns)


class BlockscaleConverter(QuantizationConverter):
    """Replace the chosen `Linear.Config`s and `GroupedExperts.Config`s of a torchtitan model
    config by blockscale's (module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(QuantizationConverter.Config):
        recipe: str = DEFAULT_RECIPE
        """blockscale recipe: nvfp4, mxfp8, nvfp4_fwd_mxfp8_bwd (bf16 converts nothing)."""
        bf16_tail_fraction: float = DEFAULT_BF16_TAIL_FRACTION
        """Fraction of the blocks, counted from the last, kept in BF16 (experts included)."""
        fqns: list[str] = field(default_factory=list)
        """Convert only layers whose fqn contains one of these (replaces the tail rule)."""
        bf16_fqns: list[str] = field(default_factory=list)
        """Keep layers whose fqn contains one of these in BF16."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.recipe = get_recipe(config.recipe)  # an unknown name fails here, before a build

    def convert(self, model_config: Any) -> Any:
        if not self.recipe.quantized:
            return model_config
        policy = _policy(model_config, self.config)
        counts = [0, 0, 0, 0]  # linears converted, linears, expert modules converted, experts
        for fqn, cfg, parent, attr in list(model_config.traverse(Linear.Config)):
            counts[1] += 1
            if isinstance(cfg, BlockscaleLinear.Config) or not policy(cfg, fqn):
                continue
            reason = own_forward_reason(cfg) or unsupported_reason(
                cfg.in_features, cfg.out_features, self.recipe
            )
            if reason is not None:
                logger.warning("%s stays in high precision: %s", fqn, reason)
                continue
            fields_of = {f.name: getattr(cfg, f.name) for f in fields(Linear.Config)}
            new = BlockscaleLinear.Config(**fields_of, recipe=self.config.recipe)
            model_config = _replace(model_config, parent, attr, new)
            counts[0] += 1
        for fqn, cfg, parent, attr in list(model_config.traverse(GroupedExperts.Config)):
            counts[3] += 1
            if not policy(cfg, fqn):
                continue
            sizes = ((cfg.dim, cfg.hidden_dim), (cfg.hidden_dim, cfg.dim))
            reason = next(
                (r for k, n in sizes if (r := experts_unsupported_reason(k, n, self.recipe))),
                None,
            )
            if reason is not None:
                logger.warning("%s stays in high precision: %s", fqn, reason)
                continue
            quantized = experts_class(type(cfg)._owner)
            values = {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.init}
            new = quantized.Config(**values, recipe=self.config.recipe)
            model_config = _replace(model_config, parent, attr, new)
            counts[2] += 1
        logger.info(
            "blockscale: %d of %d linears and %d of %d experts modules to recipe %s",
            *counts,
            self.recipe.name,
        )
        if counts[0]:
            logger.info(
                "blockscale: FSDP2 gathers the converted linears quantized only under a model "
                "spec from with_quantized_all_gather (the train_v0_3 configs'), else in high "
                "precision (docs/TORCHTITAN.md)"
            )
        return model_config


def quantized_all_gather_reason(parallel_dims: Any) -> str | None:
    """Why torchtitan's parallelization under `parallel_dims` (its `ParallelDims`) leaves the
    converted linears' FSDP2 all-gather in high precision, or None when they are gathered
    quantized (module docstring, "FSDP2's quantized all-gather")."""
    if not parallel_dims.fsdp_enabled:
        return "no FSDP sharding (dp_shard and cp are 1)"
    if parallel_dims.spmd_backend != "partial_dtensor":
        return (
            f"spmd_backend {parallel_dims.spmd_backend}: the quantized all-gather runs on "
            "partial_dtensor, which applies FSDP2 as torchtitan 0.2.2 does"
        )
    if parallel_dims.tp_enabled:
        return "tensor parallelism shards the weights before FSDP"
    if parallel_dims.pp_enabled:
        return "pipeline parallelism (not tried with the quantized all-gather)"
    return None


def prepare_quantized_all_gather(model: nn.Module, parallel_dims: Any) -> int:
    """Before torchtitan parallelizes the meta `model` with `parallel_dims`: turn on FSDP2's
    quantized all-gather of its converted linears (`enable_quantized_all_gather`) unless
    `quantized_all_gather_reason` gives a reason, which the log then names. Returns the number
    of weights prepared (0 also for a model with no converted linear, which is left alone)."""
    count = gather_quantized_unless(model, quantized_all_gather_reason(parallel_dims), logger)
    if count:
        model.register_state_dict_post_hook(_sharded_weights_as_their_data)
    return count


def _sharded_weights_as_their_data(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    """State-dict post-hook of a model `prepare_quantized_all_gather` prepared: each
    `ShardedWeight` (the local tensor of FSDP2's DTensor) given as the FP32 tensor it wraps,
    the same storage. torchtitan 0.3's checkpointer compares the storages of the state dict's
    local tensors (`components/checkpointer/base.py`, `_shares_storage`), which a wrapper
    subclass has none of (module docstring)."""
    for key, value in state_dict.items():
        local = value._local_tensor if isinstance(value, DTensor) else value
        if not isinstance(local, ShardedWeight):
            continue
        data = local._data.detach()
        if isinstance(value, DTensor):
            data = DTensor.from_local(
                data, value.device_mesh, value.placements, run_check=False,
                shape=value.shape, stride=value.stride(),
            )  # fmt: skip
        state_dict[key] = data


class QuantizedAllGatherParallelize:
    """A model spec's `parallelize_fn` that calls `prepare_quantized_all_gather` on the model,
    then the parallelize function it wraps (module docstring, "FSDP2's quantized all-gather")."""

    def __init__(self, parallelize_fn: Any) -> None:
        self.parallelize_fn = parallelize_fn
        functools.update_wrapper(self, parallelize_fn)

    def __call__(self, model: nn.Module, *, parallel_dims: Any, **kwargs: Any) -> nn.Module:
        prepare_quantized_all_gather(model, parallel_dims)
        return self.parallelize_fn(model, parallel_dims=parallel_dims, **kwargs)


def with_quantized_all_gather(model_spec: ModelSpec) -> ModelSpec:
    """`model_spec` with its `parallelize_fn` wrapped in `QuantizedAllGatherParallelize`, so
    that FSDP2 all-gathers the converted linears' weights quantized where it can (module
    docstring); a spec already wrapped is returned as it is."""
    if isinstance(model_spec.parallelize_fn, QuantizedAllGatherParallelize):
        return model_spec
    return replace(
        model_spec, parallelize_fn=QuantizedAllGatherParallelize(model_spec.parallelize_fn)
    )


@override(target=BaseModel.Config, description="blockscale recipe on linears and experts")
def blockscale(
    model_config: Any,
    recipe: str = DEFAULT_RECIPE,
    bf16_tail_fraction: float = DEFAULT_BF16_TAIL_FRACTION,
    fqns: list[str] | None = None,
    bf16_fqns: list[str] | None = None,
) -> Any:
    """`--override.imports blockscale.integrations.titan.v0_3.blockscale`: the converter,
    applied to the model config of any torchtitan config (module docstring)."""
    config = BlockscaleConverter.Config(
        recipe=recipe,
        bf16_tail_fraction=bf16_tail_fraction,
        fqns=list(fqns or ()),
        bf16_fqns=list(bf16_fqns or ()),
    )
    return BlockscaleConverter(config).convert(model_config)
