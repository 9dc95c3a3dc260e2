"""`blockscale.nvfp4`: the public name of the NVFP4 format (see formats/nvfp4.py)."""

from blockscale.formats.nvfp4 import BLOCKS, ROUNDINGS, NVFP4Tensor, quantize

__all__ = ["BLOCKS", "ROUNDINGS", "NVFP4Tensor", "quantize"]
