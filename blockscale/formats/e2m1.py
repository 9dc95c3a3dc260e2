"""E2M1 (FP4) codes: rounding, decoding and nibble packing.

A code is a 4-bit integer: bit 3 is the sign, bits 0-2 index the magnitude grid
(0, 0.5, 1, 1.5, 2, 3, 4, 6). Codes travel as uint8 tensors (one code per byte) until
`pack` puts two in a byte: element 2i in the low nibble, element 2i+1 in the high one.

Rounding works on FP32 values that are already scaled into the E2M1 range; both modes
saturate at +-6. Nearest rounding is written as a sum of threshold comparisons so the
tie rules of NUMERICS.md (ties to the even code) are visible line by line. Stochastic
rounding takes its uniform random numbers as an argument, so a caller decides where the
randomness comes from (PyTorch's generator here, a seeded hash in the kernels).
"""

import torch

from blockscale.formats._checks import check_codes

GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
MAX = 6.0
SIGN_BIT = 8


def _magnitude_index_nearest(a: torch.Tensor) -> torch.Tensor:
    # Each comparison adds one grid step; ">" where a tie goes down to the even code,
    # ">=" where it goes up to it (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4).
    idx = (a > 0.25).to(torch.uint8)
    idx += a >= 0.75
    idx += a > 1.25
    idx += a >= 1.75
    idx += a > 2.5
    idx += a >= 3.5
    idx += a > 5.0
    return idx


def _magnitude_index_floor(a: torch.Tensor) -> torch.Tensor:
    """Index of the largest grid value <= a (a in [0, 6])."""
    idx = (a >= 0.5).to(torch.uint8)
    for edge in GRID[2:]:
        idx += a >= edge
    return idx


def _with_sign(idx: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # v < 0 is false for -0.0 (so an exact zero of either sign is code 0) and true for a
    # negative value that rounds to zero (code 8, negative zero), as NUMERICS.md asks.
    return idx | ((v < 0).to(torch.uint8) << 3)


def round_nearest(v: torch.Tensor) -> torch.Tensor:
    """FP32 values -> uint8 E2M1 codes, round to nearest, ties to even, saturating at 6."""
    a = v.abs().clamp(max=MAX)
    return _with_sign(_magnitude_index_nearest(a), v)


def round_stochastic(v: torch.Tensor, rand: torch.Tensor) -> torch.Tensor:
    """FP32 values -> uint8 E2M1 codes, rounding |v| up with probability (|v|-lo)/(hi-lo).

    `rand` holds uniform numbers in [0, 1) of v's shape. Values on the grid, and |v| >= 6,
    come out exact whatever `rand` holds.
    """
    if rand.shape != v.shape:
        raise ValueError(f"rand shape {tuple(rand.shape)} must equal the values' {tuple(v.shape)}")
    a = v.abs().clamp(max=MAX)
    lo_idx = _magnitude_index_floor(a)
    lo = magnitude(lo_idx)
    hi = magnitude((lo_idx + 1).clamp(max=7))
    # At the top of the grid hi == lo; the where() keeps 0/0 out of the comparison.
    step = torch.where(hi > lo, hi - lo, torch.ones_like(hi))
    frac = (a - lo) / step
    up = (rand < frac).to(torch.uint8)
    return _with_sign(lo_idx + up, v)


def magnitude(idx: torch.Tensor) -> torch.Tensor:
    """Grid index 0..7 -> FP32 magnitude, by arithmetic rather than a table so that no
    host-to-device copy happens (CUDA graph capture forbids one): index 1 is the subnormal
    0.5, indices 2..7 are (2 + mantissa bit) * 2^(exponent field) / 4."""
    idx = idx.to(torch.int32)
    normal = ((idx & 1) + 2).float() * (1 << (idx >> 1)).float() * 0.25
    return torch.where(idx < 2, idx.float() * 0.5, normal)


def decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes (0..15) -> FP32 values. Code 8 decodes to -0.0."""
    value = magnitude(codes & 7)
    return torch.where(codes >= SIGN_BIT, -value, value)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] uint8 codes (0..15) -> [..., K/2] bytes, element 2i in the low nibble."""
    check_codes(codes)
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack {codes.shape[-1]} codes: the last dim must be even")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack(data: torch.Tensor) -> torch.Tensor:
    """[..., K/2] packed bytes -> [..., K] uint8 codes."""
    codes = torch.stack((data & 0xF, data >> 4), dim=-1)
    return codes.reshape(*data.shape[:-1], 2 * data.shape[-1])  # explicit: -1 fails on empty
