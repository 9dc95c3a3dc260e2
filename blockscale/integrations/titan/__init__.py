"""blockscale's recipes in torchtitan, through the converters each torchtitan version takes.

torchtitan builds its models itself, so blockscale meets them where each version lets outside
code change a model, and imports torchtitan only there:

- 0.3.x (`titan.v0_3`) converts the model's *config* before a meta build: `BlockscaleConverter`
  (a `ModelConfigConverter`, as torchtitan's own quantization converters are) replaces each
  chosen `Linear.Config` by a `BlockscaleLinear.Config` and each chosen `GroupedExperts.Config`
  by a config of a subclass whose `_grouped_mm` (torchtitan's seam for low-precision experts)
  runs blockscale's grouped GEMM. It is listed in a config's `converters`, or applied to any
  model from the command line with `--override.imports
  blockscale.integrations.titan.v0_3.blockscale`.
- 0.2.2 (`titan.v0_2`) converts the built (meta) model: `BlockscaleConverter` (a
  `ModelConverter`, registered as "blockscale") runs `blockscale.nn.convert`, chosen with
  `--experimental.custom_import blockscale.integrations.titan.v0_2 --model.converters
  blockscale`.

Both compute what `blockscale.nn.convert` computes on the same weights (the same
`blockscale.nn.Linear` forward, the same grouped GEMM), and both choose layers with
`TitanPolicy` below: the paper's layer policy (arXiv 2509.25149) for torchtitan's names. Its
blocks are `layers.<n>` (an nn.ModuleDict in the model, a list in the config); the last ~15%
of them stay in BF16 (their experts included), and so do the output head (`output` in 0.2.2,
`lm_head` in 0.3), the router gates (`moe.router.gate`) and the embeddings (never linears).
As torchtitan's own converters, it takes fqn lists: `fqns` (convert only layers whose name
contains one; it replaces the tail rule) and `bf16_fqns` (keep those in BF16 whatever else
says). Token groups are not padded: blockscale's grouped GEMM takes any group size, so the
converters leave torchtitan's token dispatch as it is (its own MXFP8 converter swaps in a
padding dispatcher).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

import blockscale.nn as bsnn
from blockscale.distributed.fsdp import enable_quantized_all_gather
from blockscale.nn import DEFAULT_BF16_NAMES, LayerPolicy, block_policy

DEFAULT_RECIPE = "nvfp4"
DEFAULT_BF16_TAIL_FRACTION = 0.15


@dataclass(frozen=True)
class TitanPolicy:
    """A `module_filter_fn` (module, fqn) -> bool for torchtitan's module names: True converts.

    >>> policy = titan_policy([str(i) for i in range(8)])
    >>> policy(None, "layers.0.attention.wq"), policy(None, "layers.7.attention.wq")
    (True, False)
    >>> policy(None, "layers.3.moe.router.gate"), policy(None, "lm_head")
    (False, False)
    """

    layers: LayerPolicy
    fqns: tuple[str, ...] = ()
    bf16_fqns: tuple[str, ...] = ()

    def __call__(self, module: nn.Module | None, fqn: str) -> bool:
        if any(part in fqn for part in self.bf16_fqns):
            return False
        if not self.fqns:
            return self.layers(module, fqn)
        # an explicit list replaces the tail rule, not the head, router and embedding names
        kept_by_name = LayerPolicy(None, frozenset(), self.layers.bf16_names)
        return any(part in fqn for part in self.fqns) and kept_by_name(None, fqn)


def titan_policy(
    block_names: Iterable[str],
    bf16_tail_fraction: float = DEFAULT_BF16_TAIL_FRACTION,
    fqns: Iterable[str] = (),
    bf16_fqns: Iterable[str] = (),
    bf16_names: Iterable[str] = DEFAULT_BF16_NAMES,
) -> TitanPolicy:
    """The layer policy for a torchtitan model whose blocks `layers.<name>` are `block_names`
    in order (module docstring)."""
    layers = block_policy("layers", block_names, bf16_tail_fraction, bf16_names=bf16_names)
    return TitanPolicy(layers, tuple(fqns), tuple(bf16_fqns))


def gather_quantized_unless(model: nn.Module, reason: str | None, logger: logging.Logger) -> int:
    """FSDP2's quantized all-gather of the converted (meta) `model`'s linears
    (`enable_quantized_all_gather`) where `reason` is None, else `logger` says why they are
    gathered in high precision; a model whose only converted layers are experts is left
    alone. Each version's converter says when FSDP2 follows (its `quantized_all_gather_reason`).
    Returns the number of weights prepared."""
    if not any(isinstance(m, bsnn.Linear) and m.recipe.quantized for m in model.modules()):
        return 0
    if reason is not None:
        logger.info("blockscale: linear weights all-gathered in high precision: %s", reason)
        return 0
    count = enable_quantized_all_gather(model)
    logger.info("blockscale: FSDP2 all-gathers %d linear weights quantized", count)
    return count
