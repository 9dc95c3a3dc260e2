"""kernels/: the formats/ references, fast. Triton kernels registered as torch.library ops
(torch.compile sees each as one op); the functions here take and return formats' containers
and are tested bit for bit against formats/. See docs/KERNELS.md.

Usable on CUDA tensors, and on CPU tensors when Triton's interpreter is on (TRITON_INTERPRET=1,
the CPU tests): `available(x)` says which.
"""

from blockscale.kernels._common import available
from blockscale.kernels.amax import amax, amax_fused, amax_hadamard_t
from blockscale.kernels.epilogue import gemm_epilogue
from blockscale.kernels.gemm import gemm_into
from blockscale.kernels.grouped import (
    experts_amax,
    group_amax,
    mxfp8_quantize_experts,
    mxfp8_quantize_experts_pair,
    mxfp8_quantize_grouped,
    nvfp4_quantize_experts,
    nvfp4_quantize_experts_t,
    nvfp4_quantize_grouped,
)
from blockscale.kernels.grouped_gemm import (
    grouped_gemm_rows,
    grouped_gemm_rows_packed,
    grouped_gemm_tokens,
)
from blockscale.kernels.mxfp8 import (
    mxfp8_dequantize_dq,
    mxfp8_quantize,
    mxfp8_quantize_both,
)
from blockscale.kernels.mxfp8 import quantize_2d as mxfp8_quantize_checked
from blockscale.kernels.mxfp8 import quantize_both_2d as mxfp8_quantize_both_checked
from blockscale.kernels.nvfp4 import (
    nvfp4_dequantize_dq,
    nvfp4_quantize,
    nvfp4_quantize_both,
    quantize_2d,
    quantize_both_2d,
)
from blockscale.kernels.swizzle import swizzle_scales
from blockscale.kernels.transpose import nvfp4_transpose_16x16

__all__ = [
    "available",
    "amax",
    "amax_fused",
    "amax_hadamard_t",
    "gemm_epilogue",
    "gemm_into",
    "experts_amax",
    "group_amax",
    "grouped_gemm_rows",
    "grouped_gemm_rows_packed",
    "grouped_gemm_tokens",
    "mxfp8_quantize_experts",
    "mxfp8_quantize_experts_pair",
    "mxfp8_quantize_grouped",
    "nvfp4_quantize_experts",
    "nvfp4_quantize_experts_t",
    "nvfp4_quantize_grouped",
    "nvfp4_quantize",
    "nvfp4_quantize_both",
    "quantize_2d",
    "quantize_both_2d",
    "nvfp4_dequantize_dq",
    "nvfp4_transpose_16x16",
    "mxfp8_quantize",
    "mxfp8_quantize_both",
    "mxfp8_quantize_checked",
    "mxfp8_quantize_both_checked",
    "mxfp8_dequantize_dq",
    "swizzle_scales",
]
