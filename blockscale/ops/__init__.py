"""ops/: autograd Functions whose GEMMs follow a recipe (linear, grouped_mm), and the operand quantizer they share."""

from blockscale.ops.grouped_mm import grouped_mm
from blockscale.ops.linear import (
    EXACT_INDUCTOR_OPTIONS,
    AmaxReduction,
    linear,
    unsupported_reason,
)
from blockscale.ops.quantize import (
    HighPrecisionTensor,
    operand_amax,
    quantize_operand,
    quantize_rows_and_tokens,
    rows_and_tokens_amax,
)

__all__ = [
    "EXACT_INDUCTOR_OPTIONS",
    "AmaxReduction",
    "HighPrecisionTensor",
    "grouped_mm",
    "linear",
    "operand_amax",
    "quantize_operand",
    "quantize_rows_and_tokens",
    "rows_and_tokens_amax",
    "unsupported_reason",
]
