"""kernels/: the formats/ references, fast. Triton kernels registered as torch.library ops
(torch.compile sees each as one op); the functions here take and return formats' containers
and are tested bit for bit against formats/. See docs/KERNELS.md.

Usable on CUDA tensors, and on CPU tensors when Triton's interpreter is on (TRITON_INTERPRET=1,
the CPU tests): `available(x)` says which.
"""

from blockscale.kernels._common import available
from blockscale.kernels.amax import amax, amax_fused, amax_hadamard_t
from blockscale.kernels.epilogue import gemm_epilogue
from blockscale.kernels.mxfp8 import mxfp8_dequantize_dq, mxfp8_quantize, mxfp8_quantize_both
from blockscale.kernels.nvfp4 import nvfp4_dequantize_dq, nvfp4_quantize, nvfp4_quantize_both
from blockscale.kernels.swizzle import swizzle_scales
from blockscale.kernels.transpose import nvfp4_transpose_16x16

__all__ = [
    "available",
    "amax",
    "amax_fused",
    "amax_hadamard_t",
    "gemm_epilogue",
    "nvfp4_quantize",
    "nvfp4_quantize_both",
    "nvfp4_dequantize_dq",
    "nvfp4_transpose_16x16",
    "mxfp8_quantize",
    "mxfp8_quantize_both",
    "mxfp8_dequantize_dq",
    "swizzle_scales",
]
