"""Block scales to the cuBLAS 128x4 blocked layout (formats/swizzle.py's to_blocked), as one
gather kernel over the padded output: each output byte finds its (row, col) source, and the
padding is written as zeros. Bytes: read R*C, write the padded size.
"""

import torch
import triton
import triton.language as tl

from blockscale._library import library_op
from blockscale.formats.swizzle import padded_shape
from blockscale.kernels._common import cdiv


@triton.jit
def _swizzle_kernel(src_ptr, out_ptr, R, C, n_col_blocks, total, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    blk = o // 512
    within = o % 512
    r = (blk // n_col_blocks) * 128 + ((within // 4) % 4) * 32 + within // 16
    c = (blk % n_col_blocks) * 4 + within % 4
    v = tl.load(src_ptr + r * C + c, mask=(o < total) & (r < R) & (c < C), other=0)
    tl.store(out_ptr + o, v, mask=o < total)


@library_op("blockscale::swizzle_scales_2d", mutates_args=(), triton=True)
def _swizzle_2d(scale: torch.Tensor) -> torch.Tensor:
    """uint8 [R, C] row-major scales -> flat uint8 of the padded 128x4-blocked layout."""
    R, C = scale.shape
    rp, cp = padded_shape(R, C)
    out = torch.empty(rp * cp, dtype=torch.uint8, device=scale.device)
    if rp * cp:
        grid = (cdiv(rp * cp, 1024),)
        torch.library.wrap_triton(_swizzle_kernel)[grid](
            scale, out, R, C, cp // 4, rp * cp, BLOCK=1024, num_warps=4
        )
    return out


def swizzle_scales(scale: torch.Tensor) -> torch.Tensor:
    """formats.swizzle.to_blocked for 1-byte scales (E4M3 or E8M0), fast; same dtype out."""
    if scale.dim() != 2:
        raise ValueError(f"scale must be 2-D [rows, cols], got shape {tuple(scale.shape)}")
    if scale.element_size() != 1:
        raise ValueError(f"swizzle_scales takes 1-byte scales, got {scale.dtype}")
    return _swizzle_2d(scale.view(torch.uint8).contiguous()).view(scale.dtype)
