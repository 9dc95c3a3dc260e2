"""nn/: the recipe-driven Linear and GroupedMM modules, convert(), the layer policy and the precision
schedule."""

from blockscale.nn.convert import (
    DEFAULT_BF16_NAMES,
    LayerPolicy,
    PrecisionSchedule,
    block_policy,
    convert,
    layer_policy,
    set_precision,
)
from blockscale.nn.experts import GroupedMM
from blockscale.nn.linear import Linear, clear_weight_cache, set_weight_cache

__all__ = [
    "DEFAULT_BF16_NAMES",
    "GroupedMM",
    "LayerPolicy",
    "Linear",
    "PrecisionSchedule",
    "block_policy",
    "clear_weight_cache",
    "convert",
    "layer_policy",
    "set_precision",
    "set_weight_cache",
]
