"""ops/: autograd Functions whose GEMMs follow a recipe (linear, grouped_mm), and the operand quantizer they share."""

from blockscale.ops.grouped_mm import grouped_mm
from blockscale.ops.linear import EXACT_INDUCTOR_OPTIONS, linear, unsupported_reason
from blockscale.ops.quantize import HighPrecisionTensor, quantize_operand, quantize_rows_and_tokens

__all__ = [
    "EXACT_INDUCTOR_OPTIONS",
    "HighPrecisionTensor",
    "grouped_mm",
    "linear",
    "quantize_operand",
    "quantize_rows_and_tokens",
    "unsupported_reason",
]
