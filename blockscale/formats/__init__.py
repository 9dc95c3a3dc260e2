"""formats/: what a number is. Pure PyTorch references for every quantization blockscale
does; each fast kernel in kernels/ must reproduce these bit for bit."""

from blockscale.formats import e2m1, hadamard, mxfp8, nvfp4, scales, swizzle
from blockscale.formats.mxfp8 import MXFP8Tensor
from blockscale.formats.nvfp4 import NVFP4Tensor

__all__ = ["e2m1", "hadamard", "mxfp8", "nvfp4", "scales", "swizzle", "MXFP8Tensor", "NVFP4Tensor"]
