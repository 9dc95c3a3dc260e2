"""Native grouped (mixture-of-experts) block-scaled GEMMs on Blackwell through
`torch.nn.functional.scaled_grouped_mm`.

STATUS: UNVERIFIED. No Blackwell GPU has run this file. tests/test_native_grouped_layout.py
checks on the CPU everything up to the call: the arguments built here, read back the way the
grouped kernel's argument setup reads them (below), give each group's emulated operands bit
for bit and the per-group emulated product. Whether the kernel does what its source says is
checked only by the `gpu` test there, on compute capability 10.x.

Two cases, both out = per group a @ b.T:

- groups along M (forward and grad_input, `b_data.dim() == 3`): a [M, K] with group e on rows
  offs[e-1]:offs[e], b [E, N, K]; out [M, N]. Rows past offs[-1] come out zero.
- groups along the contraction (grad_weight, `b_data.dim() == 2`): a [N, P] and b [K, P]
  quantized along the token dim P, group e's tokens in the segment seg_offs[e-1]:seg_offs[e]
  (zero-padded, multiples of 64 tokens); out [E, N, K]. An empty group's slice is zero.

NVFP4 operands are uint8 packed codes (element 2i in the low nibble) with E4M3 block scales
per 16 and one FP32 amax per group ([E]); alpha for group e is S_dec(a_amax[e]) *
S_dec(b_amax[e]). MXFP8 operands are E4M3 data with E8M0 scales per 32 and no alpha.

What PyTorch accepts, as read in its source (facts; the file and commit named each time):

1. `F.scaled_grouped_mm(mat_a, mat_b, scale_a, scale_recipe_a, scale_b, scale_recipe_b,
   swizzle_a, swizzle_b, bias, offs, output_dtype, contraction_dim, use_fast_accum)` forwards
   to `torch._scaled_grouped_mm_v2` (torch/nn/functional.py of the 2.13.0 wheel, commit
   cf30153c). It came with pytorch/pytorch PR #165154 (Oct 2025); NVFP4 support with PR
   #166308 (Oct 2025). Releases 2.11 and 2.12 were not inspected file by file.
2. The older `torch._scaled_grouped_mm` takes only FP32 or E8M0 scales, so no NVFP4
   (aten/src/ATen/native/cuda/GroupedBlas.cpp `check_scale`, pytorch commit 00d4eaf9;
   pytorch issue #187095).
3. NVFP4 is recognised when both operands are float4_e2m1fn_x2 and each has the scale list
   [E4M3 block scales with `BlockWise1x16`, FP32 global scale with `TensorWise`]
   (`check_nvfp4_recipe`, aten/src/ATen/native/ScaledBlasUtils.cpp, pytorch commit
   dc6e7695: it checks dtypes and recipes, not the global scale's shape). GroupedBlas.cpp
   multiplies the two global scales elementwise and hands the product to the FBGEMM / MSLK
   kernel `f4f4bf16_grouped_mm`, whose argument setup points group g at `global_scale +
   group_index` (include/mslk/gemm/cutlass/grouped_common.cuh, meta-pytorch/MSLK commit
   14968d07; the same in FBGEMM fbgemm_gpu/experimental/gen_ai/src/quantize/
   cutlass_extensions/include/grouped_common.cuh, commit 10d70885): the global scale is one
   FP32 per group, shape [E]. (A newer pytorch main also broadcasts a 1-element one.)
   MXFP8: one E8M0 scale tensor per operand, `BlockWise1x32`.
4. Swizzle: the block scales must be `SWIZZLE_32_4_4` on CUDA, the global scales
   `NO_SWIZZLE` (pytorch main's grouped dispatch table checks both lists; the 2.13 source
   checks the swizzle only for MXFP8). We pass both lists in full.
5. Scale shapes (GroupedBlas.cpp `_check_scales_blocked`): a 2D operand's scale must be 2-D
   with size(0) >= the operand's row count (mat_a.size(0), or mat_b.size(1) for the right
   operand): the exact size depends on the offsets and is not checked. A 3D operand
   [G, K, N] needs scale shape (G, round_up(K/block, 4) * round_up(N, 128)).
6. Where the kernel reads each group's scales (grouped_common.cuh above,
   `set_grouped_gemm_args_kernel`, block 16 with a global scale, else 32):
   2D x 3D: group g's A scales start at (sum_{i<g} round_up(m_i, 128)) * round_up(K/block, 4)
   elements, its B scales at g * round_up(N, 128) * round_up(K/block, 4); the data is not
   padded (A rows start at offs[g-1]). 2D x 2D: group g's scales start at round_up(M, 128)
   (resp. round_up(N, 128)) * sum_{i<g} round_up(k_i/block, 4), each group blocked on its
   own; group sizes along K must be multiples of 128 bits of data (a device assert).
   Groups of size 0 get an empty problem: the kernel writes nothing for them.
7. The output is BF16 only ("Only bf16 ... for grouped gemm", GroupedBlas.cpp; MSLK
   "requires BFloat16 output") and is allocated with `at::empty_strided`
   (ATen/native/GroupedMMUtils.h `create_grouped_gemm_output_tensor`, in the 2.13 wheel's
   headers): rows past offs[-1] (2D x 3D) and empty groups' slices (2D x 2D) hold whatever
   memory held. We zero them (one masked pass over the output, on the device).
8. Layouts: mat_a row-major, mat_b "transposed" (column-major in its last two dims), and
   mat_a.size(-1), mat_b.size(-2), mat_b.size(-1) multiples of 16 (GroupedBlas.cpp): with
   packed FP4 that means K a multiple of 32, N a multiple of 16. Supported cases: 2D x 3D and
   2D x 2D only ("MXFP4/NVFP4 grouped GEMM currently only supports 2D-2D and 2D-3D inputs",
   MSLK f4f4bf16_grouped_common.cuh).
9. Hardware: the 2.13 test suite runs these only on builds with USE_MSLK and compute
   capability exactly 10.0 (torch/testing/_internal/common_cuda.py,
   `evaluate_platform_supports_mxfp8_grouped_gemm`); pytorch main's MSLK path requires SM
   10.x. `_scaled_grouped_mm_v2` has no meta kernel in 2.13 (calling it on meta tensors
   raises), so this module registers its call as a custom op with a fake implementation,
   which torch.compile can trace.
10. Not covered: pytorch main after 2.13 adds a cuBLASLt grouped path (CUDA >= 13.4, taken
   for MXFP8 only when `preferCublasltGroupedGemm` is set, for NVFP4 only with one global
   scale per operand, never with our per-group ones); its jagged scale layout was not
   checked here (aten/src/ATen/native/cuda/GroupedBlas.cpp on main,
   `should_use_cublaslt_scaled_grouped_gemm`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from blockscale import _library, _registry
from blockscale.formats import mxfp8, nvfp4
from blockscale.formats import swizzle as ref

GROUPED_CAPABILITY_MAJOR = 10
_BUILD_FLAGS = ("USE_MSLK", "USE_FBGEMM_GENAI")  # the grouped kernels' library, by its names


def torch_supports_grouped() -> bool:
    """Whether this PyTorch has the grouped block-scaled API and dtypes used here."""
    return (
        hasattr(F, "scaled_grouped_mm")
        and hasattr(F, "ScalingType")
        and hasattr(F, "SwizzleType")
        and hasattr(torch, "float4_e2m1fn_x2")
        and hasattr(torch, "float8_e8m0fnu")
    )


@functools.cache
def grouped_unsupported_reason(device: torch.device) -> str | None:
    """Why the native grouped GEMM cannot run on `device`, or None when it can (cached per
    device: it reads the device properties and the build configuration)."""
    if not torch_supports_grouped():
        return (
            f"torch {torch.__version__} lacks torch.nn.functional.scaled_grouped_mm "
            "(present in PyTorch 2.13) or the float4_e2m1fn_x2 / float8_e8m0fnu dtypes"
        )
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"the native grouped GEMM needs a CUDA device, got {device}"
    props = torch.cuda.get_device_properties(device)
    if props.major != GROUPED_CAPABILITY_MAJOR:
        return (
            f"the grouped NVFP4/MXFP8 kernels run on compute capability 10.x, got "
            f"{props.major}.{props.minor} ({props.name})"
        )
    config = torch.__config__.show()
    if not any(flag in config for flag in _BUILD_FLAGS):
        return (
            f"this PyTorch build has no grouped block-scaled kernels (neither of "
            f"{_BUILD_FLAGS} in torch.__config__.show())"
        )
    return None


def grouped_supported(device: torch.device) -> bool:
    """Whether native.scaled_grouped_mm can run on `device`."""
    return grouped_unsupported_reason(device) is None


def check_grouped_supported(device: torch.device) -> None:
    """Raise RuntimeError saying why, where the native grouped GEMM cannot run."""
    reason = grouped_unsupported_reason(device)
    if reason is not None:
        raise RuntimeError(f"native grouped GEMM unavailable: {reason}")


def _fmt(a_data: torch.Tensor) -> str:
    if a_data.dtype == torch.uint8:
        return "nvfp4"
    if a_data.dtype == torch.float8_e4m3fn:
        return "mxfp8"
    raise TypeError(
        f"a_data must be uint8 (NVFP4 packed codes) or float8_e4m3fn (MXFP8), got {a_data.dtype}"
    )


def _check(a_data, a_scale, b_data, b_scale, offs, a_amax, b_amax) -> tuple[str, int, int]:
    """Static checks (shapes and dtypes only, nothing read from the device). Returns
    (format, logical contraction length, experts)."""
    fmt = _fmt(a_data)
    pack = 2 if fmt == "nvfp4" else 1
    block = nvfp4.BLOCK if fmt == "nvfp4" else mxfp8.BLOCK
    scale_dtype = torch.float8_e4m3fn if fmt == "nvfp4" else torch.float8_e8m0fnu
    if b_data.dtype != a_data.dtype or a_scale.dtype != scale_dtype or b_scale.dtype != scale_dtype:
        raise TypeError(
            f"{fmt} needs both data as {a_data.dtype} and both scales as {scale_dtype}, got "
            f"b_data {b_data.dtype}, a_scale {a_scale.dtype}, b_scale {b_scale.dtype}"
        )
    if offs.dtype != torch.int32 or offs.dim() != 1 or offs.shape[0] == 0:
        raise ValueError(
            f"offs must be 1-D int32 with one cumulative end per group, got {offs.dtype} "
            f"{tuple(offs.shape)}"
        )
    if a_data.dim() != 2 or b_data.dim() not in (2, 3):
        raise ValueError(
            f"need a_data 2-D and b_data 3-D (groups along M) or 2-D (groups along the "
            f"contraction), got {tuple(a_data.shape)} and {tuple(b_data.shape)}"
        )
    experts = b_data.shape[0] if b_data.dim() == 3 else offs.shape[0]
    if offs.shape[0] != experts:
        raise ValueError(f"offs has {offs.shape[0]} groups, b_data has {experts} experts")
    k = a_data.shape[1] * pack
    if b_data.shape[-1] != a_data.shape[1]:
        raise ValueError(
            f"contraction dims differ: a_data {tuple(a_data.shape)}, b_data "
            f"{tuple(b_data.shape)} (both [..., K{'/2' if pack == 2 else ''}])"
        )
    if k % (16 * pack) or b_data.shape[-2] % 16:
        raise ValueError(
            f"the grouped kernels need K % {16 * pack} == 0 and b's rows % 16 == 0 (16-byte "
            f"rows), got K={k}, rows={b_data.shape[-2]}"
        )
    for name, data, scale in (("a", a_data, a_scale), ("b", b_data, b_scale)):
        want = (*data.shape[:-1], k // block)
        if tuple(scale.shape) != want:
            raise ValueError(
                f"{name}_scale must be {want} (one per {block} values), got {tuple(scale.shape)}"
            )
    if fmt == "nvfp4":
        for name, amax in (("a_amax", a_amax), ("b_amax", b_amax)):
            if amax is None or amax.shape != (experts,) or amax.dtype != torch.float32:
                shape = None if amax is None else (amax.dtype, tuple(amax.shape))
                raise ValueError(f"NVFP4 needs {name} float32 [{experts}], got {shape}")
    elif a_amax is not None or b_amax is not None:
        raise ValueError("MXFP8 has no tensor amax: pass a_amax=b_amax=None")
    return fmt, k, experts


def _swizzle_impl(x: torch.Tensor):
    """The Triton kernels where they run (CUDA, or the interpreter in tests), else formats'."""
    if _library.use_kernels(x):
        from blockscale.kernels import swizzle as fast  # noqa: PLC0415 (Triton is optional)

        return (
            fast.swizzle_scales_row_groups,
            fast.swizzle_scales_col_groups,
            fast.swizzle_scales_experts,
        )
    return ref.to_blocked_row_groups, ref.to_blocked_col_groups, ref.to_blocked_experts


def grouped_mm_args(
    a_data: torch.Tensor,
    a_scale: torch.Tensor,
    b_data: torch.Tensor,
    b_scale: torch.Tensor,
    offs: torch.Tensor,
    a_amax: torch.Tensor | None = None,
    b_amax: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Keyword arguments of F.scaled_grouped_mm (all of them) for the grouped product; see
    the module docstring for the operands. No host synchronization."""
    fmt, k, _ = _check(a_data, a_scale, b_data, b_scale, offs, a_amax, b_amax)
    row_groups, col_groups, per_expert = _swizzle_impl(a_scale)
    block = nvfp4.BLOCK if fmt == "nvfp4" else mxfp8.BLOCK
    if b_data.dim() == 3:
        # the scale rows of each group start a fresh 128-row block (fact 6); shape (fact 5)
        cols = ref.padded_shape(0, k // block)[1]
        scale_a = row_groups(a_scale, offs).view(-1, cols)
        scale_b = per_expert(b_scale)
    else:
        col_offs = offs // block
        scale_a = col_groups(a_scale, col_offs).view(ref.padded_shape(a_scale.shape[0], 0)[0], -1)
        scale_b = col_groups(b_scale, col_offs).view(ref.padded_shape(b_scale.shape[0], 0)[0], -1)
    st, sw = F.ScalingType, F.SwizzleType
    if fmt == "nvfp4":
        mat_a = a_data.view(torch.float4_e2m1fn_x2)
        mat_b = b_data.view(torch.float4_e2m1fn_x2)
        scales = {
            "scale_a": [scale_a, nvfp4.decode_scale(a_amax)],
            "scale_b": [scale_b, nvfp4.decode_scale(b_amax)],
            "scale_recipe_a": [st.BlockWise1x16, st.TensorWise],
            "scale_recipe_b": [st.BlockWise1x16, st.TensorWise],
            "swizzle_a": [sw.SWIZZLE_32_4_4, sw.NO_SWIZZLE],
            "swizzle_b": [sw.SWIZZLE_32_4_4, sw.NO_SWIZZLE],
        }
    else:
        mat_a, mat_b = a_data, b_data
        scales = {
            "scale_a": [scale_a],
            "scale_b": [scale_b],
            "scale_recipe_a": [st.BlockWise1x32],
            "scale_recipe_b": [st.BlockWise1x32],
            "swizzle_a": [sw.SWIZZLE_32_4_4],
            "swizzle_b": [sw.SWIZZLE_32_4_4],
        }
    return {
        "mat_a": mat_a,
        "mat_b": mat_b.transpose(-2, -1),  # column-major view, no copy (fact 8)
        **scales,
        "offs": offs,
        "output_dtype": torch.bfloat16,
    }


def zero_unwritten(out: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Zero, in place, what the grouped kernel leaves unwritten (fact 7): rows past offs[-1]
    of a [M, N] output, the slices of empty groups of an [E, N, K] output. Device ops only."""
    if out.dim() == 2:
        rows = torch.arange(out.shape[0], device=out.device)
        return out.masked_fill_((rows >= offs[-1]).unsqueeze(1), 0)
    ends = offs.long()
    empty = ends == torch.cat((ends.new_zeros(1), ends[:-1]))
    return out.masked_fill_(empty.view(-1, 1, 1), 0)


@_registry.library_op("blockscale::native_scaled_grouped_mm")
def _scaled_grouped_mm(
    a_data: torch.Tensor,
    a_scale: torch.Tensor,
    b_data: torch.Tensor,
    b_scale: torch.Tensor,
    offs: torch.Tensor,
    a_amax: torch.Tensor | None,
    b_amax: torch.Tensor | None,
) -> torch.Tensor:
    """The call, as one op (fact 9: torch 2.13 has no fake kernel for it)."""
    args = grouped_mm_args(a_data, a_scale, b_data, b_scale, offs, a_amax, b_amax)
    return zero_unwritten(F.scaled_grouped_mm(**args), offs)


@_scaled_grouped_mm.op.register_fake
def _(a_data, a_scale, b_data, b_scale, offs, a_amax, b_amax) -> torch.Tensor:
    if b_data.dim() == 3:
        shape = (a_data.shape[0], b_data.shape[1])
    else:
        shape = (offs.shape[0], a_data.shape[0], b_data.shape[0])
    return a_data.new_empty(shape, dtype=torch.bfloat16)


def scaled_grouped_mm(
    a_data: torch.Tensor,
    a_scale: torch.Tensor,
    b_data: torch.Tensor,
    b_scale: torch.Tensor,
    offs: torch.Tensor,
    a_amax: torch.Tensor | None = None,
    b_amax: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Per group, a @ b.T * alpha on Blackwell tensor cores, BF16 out. UNVERIFIED.

    b_data 3-D: groups along M (offs: cumulative end rows), out [M, N], rows past offs[-1]
    zero. b_data 2-D: groups along the contraction (offs: segment ends in tokens), out
    [E, N, K], empty groups zero. The kernels write BF16 only (fact 7): any other
    out_dtype raises, so that a caller never gets a silently different rounding.
    """
    if out_dtype != torch.bfloat16:
        raise ValueError(
            f"the native grouped GEMM writes BF16 only (MSLK/FBGEMM kernels), got "
            f"out_dtype={out_dtype}; use the emulated backend for other output dtypes"
        )
    if not torch.compiler.is_compiling():  # (host-side; the dispatch resolved the backend)
        check_grouped_supported(a_data.device)
    return _scaled_grouped_mm(a_data, a_scale, b_data, b_scale, offs, a_amax, b_amax)
