"""Exact transpose of a 16x16-block NVFP4 tensor: nibbles and tile scales, no requantization.

A 16x16 tile's scale and the tensor's global scale do not depend on orientation, so the
transpose of the codes is the quantization of the transposed tensor, bit for bit (what
formats' NVFP4Tensor.t() states). One weight copy then serves forward and dgrad, and FSDP
gathers one orientation and rebuilds the other locally. Bytes: read N/2 + N/16, write the
same (N = rows * cols codes).
"""

import torch
import triton
import triton.language as tl

from blockscale._registry import library_op
from blockscale.formats.nvfp4 import NVFP4Tensor
from blockscale.kernels._common import cdiv
from blockscale.kernels._launch import launch

BLOCK = 16


@triton.jit
def _nvfp4_transpose_kernel(
    data_ptr, scale_ptr, data_t_ptr, scale_t_ptr, R, C, BR: tl.constexpr, BC: tl.constexpr
):
    """codes [R, C] packed along C -> codes [C, R] packed along R; tile scales transposed and
    repeated on the 16 rows of each tile."""
    r0 = tl.program_id(0) * BR
    c0 = tl.program_id(1) * BC
    rows = r0 + tl.arange(0, BR)
    half = c0 // 2 + tl.arange(0, BC // 2)
    packed = tl.load(
        data_ptr + rows[:, None] * (C // 2) + half[None, :],
        mask=(rows < R)[:, None] & (half < C // 2)[None, :],
        other=0,
    )
    codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), [BR, BC])
    lo, hi = tl.split(tl.reshape(tl.trans(codes), [BC, BR // 2, 2]))
    cols = c0 + tl.arange(0, BC)
    half_t = r0 // 2 + tl.arange(0, BR // 2)
    tl.store(
        data_t_ptr + cols[:, None] * (R // 2) + half_t[None, :],
        lo | (hi << 4),
        mask=(cols < C)[:, None] & (half_t < R // 2)[None, :],
    )
    tr = r0 // 16 + tl.arange(0, BR // 16)
    tc = c0 // 16 + tl.arange(0, BC // 16)
    tmask = (tr < R // 16)[:, None] & (tc < C // 16)[None, :]
    tiles = tl.load(scale_ptr + (tr * 16)[:, None] * (C // 16) + tc[None, :], mask=tmask, other=0)
    tiles_t = tl.trans(tiles)  # [BC/16, BR/16]
    rep = tl.reshape(tl.broadcast_to(tiles_t[:, None, :], [BC // 16, 16, BR // 16]), [BC, BR // 16])
    tl.store(
        scale_t_ptr + cols[:, None] * (R // 16) + tr[None, :],
        rep,
        mask=(cols < C)[:, None] & (tr < R // 16)[None, :],
    )


@library_op("blockscale::nvfp4_transpose_16x16_2d", mutates_args=(), triton=True)
def _nvfp4_transpose_2d(
    data: torch.Tensor, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """data uint8 [R, C/2], scale uint8 [R, C/16] -> ([C, R/2], [C, R/16])."""
    R, half = data.shape
    C = 2 * half
    data_t = torch.empty(C, R // 2, dtype=torch.uint8, device=data.device)
    scale_t = torch.empty(C, R // BLOCK, dtype=torch.uint8, device=data.device)
    if R and C:
        grid = (cdiv(R, 64), cdiv(C, 64))
        launch(_nvfp4_transpose_kernel, grid,
            data, scale, data_t, scale_t, R, C, BR=64, BC=64, num_warps=4,
        )  # fmt: skip
    return data_t, scale_t


def nvfp4_transpose_16x16(q: NVFP4Tensor) -> NVFP4Tensor:
    """q.t() for a 2-D 16x16 NVFP4 tensor, as one kernel."""
    if q.block != "16x16" or q.data.dim() != 2:
        raise ValueError(
            f"only 2-D 16x16 tensors transpose exactly (block={q.block}, dims={q.data.dim()}); "
            "requantize with transpose=True instead"
        )
    rows, cols = q.shape
    data_t, scale_t = _nvfp4_transpose_2d(
        q.data.contiguous(), q.scale.view(torch.uint8).contiguous()
    )
    return NVFP4Tensor(
        data_t,
        scale_t.view(q.scale.dtype),
        q.amax,
        torch.Size((cols, rows)),
        "16x16",
        q.hadamard,
    )
