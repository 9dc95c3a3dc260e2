"""Native block-scaled GEMMs on Blackwell (compute capability >= 10.0) through
`torch.nn.functional.scaled_mm`.

Grouped GEMMs (`scaled_grouped_mm`, `grouped_supported`) are in gemm/native_grouped.py and
re-exported here.

STATUS: UNVERIFIED. No Blackwell GPU has run this file yet. Everything up to the final call is
tested on the CPU (tests/test_native_layout.py): the arguments built here, read back through
the documented semantics of scaled_mm (codes times unswizzled block scales times the tensor
scales), reproduce the emulated operands bit for bit and the emulated product exactly. What is
not verified is that cuBLAS reads those arguments the way the PyTorch documentation and tests
say it does.

The call, per format (a: [M, K] and b: [N, K], both quantized along K, out = a @ b.T):

- NVFP4: mat_a = a's packed codes viewed as float4_e2m1fn_x2 [M, K/2] (row-major),
  mat_b = b's codes viewed the same way and transposed to [K/2, N] (column-major, no copy).
  Each operand has two scales: its E4M3 block scales in the cuBLAS 128x4 blocked layout
  (`ScalingType.BlockWise1x16`, `SwizzleType.SWIZZLE_32_4_4`) and its FP32 global decode scale
  S_dec (`ScalingType.TensorWise`, not swizzled). The kernel multiplies the accumulator by
  S_dec_a * S_dec_b, which is the emulated path's alpha.
- MXFP8: mat_a = a's E4M3 data [M, K], mat_b = b's data transposed to [K, N]; the E8M0 block
  scales go blocked (`ScalingType.BlockWise1x32`, `SwizzleType.SWIZZLE_32_4_4`). No global scale.

Bias is added by the caller in FP32 after the GEMM, the same way the emulated path does it, so
both backends round the output once and identically; scaled_mm's own bias argument is not used
because its support for block-scaled inputs differs across PyTorch and cuBLAS versions.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from blockscale.formats.mxfp8 import MXFP8Tensor
from blockscale.formats.nvfp4 import NVFP4Tensor
from blockscale.formats.swizzle import to_blocked
from blockscale.gemm.emulated import check_hadamard_pairing

# The grouped (mixture-of-experts) GEMMs live in their own module; dispatch reaches them here.
from blockscale.gemm.native_grouped import (  # noqa: F401 (re-exported)
    check_grouped_supported,
    grouped_supported,
    scaled_grouped_mm,
)

MIN_CAPABILITY = (10, 0)


def torch_supports_native() -> bool:
    """Whether this PyTorch build exposes the scaled_mm API and dtypes the native path calls."""
    return (
        hasattr(F, "scaled_mm")
        and hasattr(F, "ScalingType")
        and hasattr(F, "SwizzleType")
        and hasattr(torch, "float4_e2m1fn_x2")
        and hasattr(torch, "float8_e8m0fnu")
    )


def device_supports_native(device: torch.device) -> bool:
    """Compute capability >= 10.0 (Blackwell) and a PyTorch that has the API."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    props = torch.cuda.get_device_properties(device)
    return (props.major, props.minor) >= MIN_CAPABILITY and torch_supports_native()


def _check_pair(a: NVFP4Tensor | MXFP8Tensor, b: NVFP4Tensor | MXFP8Tensor) -> None:
    if type(a) is not type(b):
        raise ValueError(
            f"native scaled_mm needs both operands in one format, got {type(a).__name__} "
            f"and {type(b).__name__}"
        )
    if a.data.dim() != 2 or b.data.dim() != 2:
        raise ValueError(
            f"native scaled_mm takes 2-D operands, got data shapes {tuple(a.data.shape)} and "
            f"{tuple(b.data.shape)}"
        )
    if a.shape[1] != b.shape[1]:
        raise ValueError(
            f"contraction dims differ: a is {tuple(a.shape)}, b is {tuple(b.shape)} (both [*, K])"
        )


def nvfp4_args(a: NVFP4Tensor, b: NVFP4Tensor) -> dict[str, Any]:
    """Keyword arguments of F.scaled_mm for out = a @ b.T (all but output_dtype)."""
    _check_pair(a, b)
    st, sw = F.ScalingType, F.SwizzleType
    return {
        "mat_a": a.data.view(torch.float4_e2m1fn_x2),
        "mat_b": b.data.view(torch.float4_e2m1fn_x2).t(),
        "scale_a": [to_blocked(a.scale), a.global_decode_scale()],
        "scale_recipe_a": [st.BlockWise1x16, st.TensorWise],
        "scale_b": [to_blocked(b.scale), b.global_decode_scale()],
        "scale_recipe_b": [st.BlockWise1x16, st.TensorWise],
        "swizzle_a": [sw.SWIZZLE_32_4_4, sw.NO_SWIZZLE],
        "swizzle_b": [sw.SWIZZLE_32_4_4, sw.NO_SWIZZLE],
    }


def mxfp8_args(a: MXFP8Tensor, b: MXFP8Tensor) -> dict[str, Any]:
    """Keyword arguments of F.scaled_mm for out = a @ b.T (all but output_dtype)."""
    _check_pair(a, b)
    st, sw = F.ScalingType, F.SwizzleType
    return {
        "mat_a": a.data,
        "mat_b": b.data.t(),
        "scale_a": to_blocked(a.scale),
        "scale_recipe_a": st.BlockWise1x32,
        "scale_b": to_blocked(b.scale),
        "scale_recipe_b": st.BlockWise1x32,
        "swizzle_a": sw.SWIZZLE_32_4_4,
        "swizzle_b": sw.SWIZZLE_32_4_4,
    }


def scaled_mm_args(a: NVFP4Tensor | MXFP8Tensor, b: NVFP4Tensor | MXFP8Tensor) -> dict[str, Any]:
    # also when native.scaled_mm is called directly, not through the dispatch
    check_hadamard_pairing(getattr(a, "hadamard", False), getattr(b, "hadamard", False))
    if isinstance(a, NVFP4Tensor):
        return nvfp4_args(a, b)  # type: ignore[arg-type]
    if isinstance(a, MXFP8Tensor):
        return mxfp8_args(a, b)  # type: ignore[arg-type]
    raise TypeError(f"native scaled_mm takes NVFP4Tensor or MXFP8Tensor, got {type(a).__name__}")


def scaled_mm(
    a: NVFP4Tensor | MXFP8Tensor,
    b: NVFP4Tensor | MXFP8Tensor,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """a @ b.T on Blackwell tensor cores, global scales applied in the epilogue. UNVERIFIED."""
    return F.scaled_mm(**scaled_mm_args(a, b), output_dtype=out_dtype)
