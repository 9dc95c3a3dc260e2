"""`blockscale.mxfp8`: the public name of the MXFP8 format (see formats/mxfp8.py)."""

from blockscale.formats.mxfp8 import MXFP8Tensor, quantize

__all__ = ["MXFP8Tensor", "quantize"]
