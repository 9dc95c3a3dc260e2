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
`convert`.

Expert parallelism needs nothing more: 0.3's experts forward takes the weights' local shards
(`to_local()` of the DTensors EP makes, `Shard(0)` on "ep") and calls the `_grouped_mm` seam,
so each rank's experts run blockscale's grouped GEMM, on the token groups EP's all-to-all
dispatch lays out (unpadded: one process's group of each local expert, row for row; tested
bit for bit against one process in tests/test_titan_expert_parallel.py).

Not done in 0.3: FSDP2's quantized all-gather (`enable_quantized_all_gather`, which the 0.2.2
converter turns on). A 0.3 converter sees the model config only, before the build: never the
built model nor the parallel dims, and nothing of torchtitan calls it after the build. Wrapping
the weight in `BlockscaleLinear`'s constructor would not know whether FSDP2 follows, nor how:
0.3's default `spmd_backend` ("spmd_types") makes every parameter a local tensor with SPMD type
annotations and hands those to `fully_shard` with the mesh's data-parallel dims (which torch
2.13's `fully_shard` refuses: docs/TORCHTITAN.md), a path the quantized all-gather was never
run on. So under 0.3 FSDP2 gathers the converted linears' weights in torchtitan's
mixed-precision dtype, and each layer quantizes its gathered weight, as without FSDP (the
`convert` log says so).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from typing import Any

from torchtitan.components.quantization import QuantizationConverter
from torchtitan.config.override import override
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.moe import GroupedExperts
from torchtitan.protocols.model import BaseModel
from torchtitan.protocols.module import Module

import blockscale.nn as bsnn
from blockscale.integrations.titan import (
    DEFAULT_BF16_TAIL_FRACTION,
    DEFAULT_RECIPE,
    TitanPolicy,
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

        def _grouped_mm(self, *, A: Any, B_t: Any, offs: Any) -> Any:
            return self.grouped_mm(A, B_t, offs)

    BlockscaleExperts.__name__ = BlockscaleExperts.__qualname__ = f"Blockscale{parent.__name__}"
    _EXPERTS_CLASSES[parent] = BlockscaleExperts
    return BlockscaleExperts


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
            reason = unsupported_reason(cfg.in_features, cfg.out_features, self.recipe)
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
                "blockscale: under FSDP2 the converted linears' weights are all-gathered in "
                "high precision (torchtitan 0.3: no quantized all-gather; docs/TORCHTITAN.md)"
            )
        return model_config


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
