"""Block scales to and from the cuBLAS 128x4 blocked layout used by the native GEMMs.

A row-major scale matrix [R, C] (R rows of the operand, C scale columns along K) is padded
with zeros to [ceil(R/128)*128, ceil(C/4)*4] and tiled into 128x4 blocks; inside a block
row r and column c land at (r % 32) * 16 + (r // 32) * 4 + c. Blocks follow each other
row-block-major. The result is a flat tensor of the padded size.
"""

import torch


def padded_shape(rows: int, cols: int) -> tuple[int, int]:
    return -(-rows // 128) * 128, -(-cols // 4) * 4


def to_blocked(scale: torch.Tensor) -> torch.Tensor:
    """[R, C] scales -> flat swizzled tensor of padded_shape(R, C) elements, same dtype."""
    if scale.dim() != 2:
        raise ValueError(f"scale must be 2-D [rows, cols], got shape {tuple(scale.shape)}")
    rows, cols = scale.shape
    rp, cp = padded_shape(rows, cols)
    raw = scale.view(torch.uint8) if scale.element_size() == 1 else scale
    padded = raw.new_zeros(rp, cp)
    padded[:rows, :cols] = raw
    blocked = padded.view(rp // 128, 4, 32, cp // 4, 4).permute(0, 3, 2, 1, 4).reshape(-1)
    return blocked.view(scale.dtype) if raw is not scale else blocked


def from_blocked(blocked: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of to_blocked: the flat swizzled tensor -> the [rows, cols] scales."""
    rp, cp = padded_shape(rows, cols)
    if blocked.numel() != rp * cp:
        raise ValueError(
            f"blocked scale has {blocked.numel()} elements, expected {rp * cp} for "
            f"[{rows}, {cols}] padded to [{rp}, {cp}]"
        )
    raw = blocked.view(torch.uint8) if blocked.element_size() == 1 else blocked
    padded = raw.reshape(rp // 128, cp // 4, 32, 4, 4).permute(0, 3, 2, 1, 4).reshape(rp, cp)
    out = padded[:rows, :cols].contiguous()
    return out.view(blocked.dtype) if raw is not blocked else out
