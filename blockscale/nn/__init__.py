"""nn/: the recipe-driven Linear module, convert(), the layer policy and the precision schedule."""

from blockscale.nn.convert import (
    DEFAULT_BF16_NAMES,
    LayerPolicy,
    PrecisionSchedule,
    convert,
    layer_policy,
    set_precision,
)
from blockscale.nn.linear import Linear

__all__ = [
    "DEFAULT_BF16_NAMES",
    "LayerPolicy",
    "Linear",
    "PrecisionSchedule",
    "convert",
    "layer_policy",
    "set_precision",
]
