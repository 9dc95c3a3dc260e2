"""ops/: autograd Functions whose GEMMs follow a recipe, and the operand quantizer they share."""

from blockscale.ops.linear import linear, unsupported_reason
from blockscale.ops.quantize import HighPrecisionTensor, quantize_operand

__all__ = ["HighPrecisionTensor", "linear", "quantize_operand", "unsupported_reason"]
