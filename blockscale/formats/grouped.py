"""Per-group (mixture-of-experts) layouts, and the reference quantizers that use them.

A grouped activation holds the rows of E experts in one [M, C] tensor: expert e owns rows
offs[e-1]:offs[e] (offs int32, cumulative, offs[-1] <= M; rows past offs[-1] belong to no
expert). A grouped GEMM computes one product per expert, so every quantization a grouped
GEMM consumes is per expert too, and must equal what a loop of per-expert `linear` calls
would quantize:

- **rows** (along C, the forward input and grad_output for dgrad): each row is quantized with
  its expert's tensor amax. Blocks run along C and never cross rows, so experts never share
  a block. Rows past offs[-1] are zeros here (the kernels leave them unwritten: no GEMM
  reads them).
- **tokens** (along the rows, the wgrad operands): each expert's rows are quantized as the
  transpose of that expert's rows alone, zero-padded to a whole number of blocks, as `linear`
  pads its tokens. The layout puts expert e's tokens at the start of a segment of its own,
  padded with zero tokens to a multiple of `TOKEN_ALIGN` (64), in a [C, P] tensor. Padding to
  64 rather than to the block (16 or 32) adds only zero blocks, which change no amax, no
  Hadamard block (H is applied per 16 tokens, and 64 is a multiple of 16) and no product,
  so it is exact; and it lets a grad_weight GEMM walk each segment in 64-token steps.
  P is a static bound (`token_capacity`), M + E * 63 rounded up to 64, so the layout's shape
  never depends on the offsets' values and nothing waits for the device.
- **weights** [E, N, K]: each expert's matrix quantized as `linear` quantizes a weight, with
  the expert's own amax (16x16 tiles never cross experts: N is a multiple of 16).

NVFP4 grouped containers are plain `NVFP4Tensor`s whose `amax` holds one FP32 amax per
expert ([E]) instead of a scalar: the grouped GEMMs take expert e's decode scale from
amax[e].
MXFP8 has no tensor amax, so its grouped containers are ordinary `MXFP8Tensor`s.

Everything here is a readable reference for the CPU and the tests: it reads the offsets on
the host and loops over experts. The kernels (kernels/grouped.py) compute the same bits in
one launch per quantization, reading the layout from the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockscale.formats import hadamard as rht
from blockscale.formats import mxfp8, nvfp4
from blockscale.formats.mxfp8 import MXFP8Tensor
from blockscale.formats.nvfp4 import NVFP4Tensor

# Tokens per segment step of the token layout: a multiple of every block that runs along
# tokens (16 for NVFP4 and the Hadamard transform, 32 for MXFP8) and of the grad_weight
# kernel's contraction tile.
TOKEN_ALIGN = 64


def group_bounds(offs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(start, size) of every group as int64 device tensors; no host synchronization."""
    ends = offs.long()
    starts = torch.cat((ends.new_zeros(1), ends[:-1]))
    return starts, ends - starts


def token_capacity(rows: int, groups: int) -> int:
    """P, the static length of the token layout: enough for any offsets of `groups` groups
    over `rows` rows (each group pads at most TOKEN_ALIGN - 1 tokens)."""
    need = rows + groups * (TOKEN_ALIGN - 1)
    return -(-need // TOKEN_ALIGN) * TOKEN_ALIGN


@dataclass
class TokenLayout:
    """Where each group's tokens sit in the [C, P] token layout.

    seg_ends: int32 [E], cumulative end of each group's segment (multiples of TOKEN_ALIGN)
    source:   int32 [P], the row of the grouped tensor at each position, -1 for padding
    group:    int32 [P], the group of each position (its segment's, padding included; E past
              the last segment)
    """

    seg_ends: torch.Tensor
    source: torch.Tensor
    group: torch.Tensor

    @property
    def capacity(self) -> int:
        return self.source.shape[0]


def token_layout(offs: torch.Tensor, rows: int) -> TokenLayout:
    """The token layout of `rows` grouped rows, from the device offsets (no host sync)."""
    starts, sizes = group_bounds(offs)
    padded = (sizes + TOKEN_ALIGN - 1) // TOKEN_ALIGN * TOKEN_ALIGN
    seg_ends = padded.cumsum(0)
    seg_starts = seg_ends - padded
    p = torch.arange(token_capacity(rows, offs.shape[0]), device=offs.device)
    group = torch.searchsorted(seg_ends, p, right=True)
    g = group.clamp(max=offs.shape[0] - 1)
    within = p - seg_starts[g]
    real = (group < offs.shape[0]) & (within < sizes[g])
    source = torch.where(real, starts[g] + within, -1)
    return TokenLayout(seg_ends.to(torch.int32), source.to(torch.int32), group.to(torch.int32))


def _host_bounds(offs: torch.Tensor) -> list[tuple[int, int]]:
    ends = offs.tolist()
    return list(zip([0, *ends[:-1]], ends))


def _segment(x: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Rows start:end of x, zero-padded to a multiple of TOKEN_ALIGN."""
    rows = x[start:end]
    pad = -rows.shape[0] % TOKEN_ALIGN
    return torch.cat((rows, rows.new_zeros(pad, x.shape[1])))


def _stack(parts: list[torch.Tensor]) -> torch.Tensor:
    """Stack per-expert tensors keeping their memory order: formats' transposed containers
    are transposed views, and a CPU GEMM sums in another order for another layout."""
    if parts[0].is_contiguous():
        return torch.stack(parts)
    return torch.stack([p.mT for p in parts]).mT


def _empty_like_nvfp4(rows: int, cols: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.zeros(rows, cols // 2, dtype=torch.uint8, device=device)
    scale = torch.zeros(rows, cols // nvfp4.BLOCK, dtype=torch.float8_e4m3fn, device=device)
    return data, scale


def group_amax(x: torch.Tensor, offs: torch.Tensor, hadamard_tokens: bool = False) -> torch.Tensor:
    """FP32 [E]: max |x| over each group's rows, or (hadamard_tokens) over the Hadamard
    transform of each group's token segment; 0 for an empty group. NaN propagates."""
    out = []
    for start, end in _host_bounds(offs):
        rows = _segment(x, start, end).t() if hadamard_tokens else x[start:end]
        if hadamard_tokens:
            rows = rht.transform(rows)
        out.append(
            rows.float().abs().amax() if rows.numel() else x.new_zeros((), dtype=torch.float32)
        )
    return torch.stack(out) if out else x.new_zeros(0, dtype=torch.float32)


def experts_amax(w: torch.Tensor) -> torch.Tensor:
    """FP32 [E]: max |w[e]| of expert weights w [E, N, K], the amax each expert's NVFP4 copy
    takes when none is given (0 for an expert with no values). NaN propagates."""
    if w.numel() == 0:
        return w.new_zeros(w.shape[0], dtype=torch.float32)
    return w.float().abs().amax(dim=(1, 2))


def nvfp4_quantize_rows(
    x: torch.Tensor, offs: torch.Tensor, rounding: str = "nearest", amax: torch.Tensor | None = None
) -> NVFP4Tensor:
    """x [M, C] quantized along C in 1x16 blocks, each row with its group's amax (`amax` [E]
    given, or max |x| of the group's rows). amax [E]; rows past offs[-1] are zero."""
    amax = group_amax(x, offs) if amax is None else amax.float()
    data, scale = _empty_like_nvfp4(x.shape[0], x.shape[1], x.device)
    for e, (start, end) in enumerate(_host_bounds(offs)):
        if end > start:
            q = nvfp4.quantize(x[start:end], rounding=rounding, amax=amax[e])
            data[start:end], scale[start:end] = q.data, q.scale
    return NVFP4Tensor(data, scale, amax, x.shape, "1x16", False)


def nvfp4_quantize_tokens(
    x: torch.Tensor,
    offs: torch.Tensor,
    rounding: str = "nearest",
    hadamard: bool = False,
    amax: torch.Tensor | None = None,
) -> NVFP4Tensor:
    """x [M, C] quantized along the tokens, group by group, into the token layout [C, P]
    (blocks of 16 tokens, optionally Hadamard-transformed); amax [E] is per group (of the
    transformed segment with hadamard)."""
    amax = group_amax(x, offs, hadamard_tokens=hadamard) if amax is None else amax.float()
    cap = token_capacity(x.shape[0], offs.shape[0])
    data, scale = _empty_like_nvfp4(x.shape[1], cap, x.device)
    p = 0
    for e, (start, end) in enumerate(_host_bounds(offs)):
        seg = _segment(x, start, end)
        q = nvfp4.quantize(seg, rounding=rounding, hadamard=hadamard, transpose=True, amax=amax[e])
        n = seg.shape[0]
        data[:, p // 2 : (p + n) // 2] = q.data
        scale[:, p // nvfp4.BLOCK : (p + n) // nvfp4.BLOCK] = q.scale
        p += n
    return NVFP4Tensor(data, scale, amax, torch.Size((x.shape[1], cap)), "1x16", hadamard)


def nvfp4_quantize_experts(
    w: torch.Tensor,
    block: str = "16x16",
    transpose: bool = False,
    amax: torch.Tensor | None = None,
) -> NVFP4Tensor:
    """Expert weights w [E, N, K] quantized expert by expert along K (transpose=True: along N,
    giving [E, K, N]), each with its own amax (`amax` [E] as given, or max |w[e]|); amax [E]."""
    qs = [
        nvfp4.quantize(
            w[e], block=block, transpose=transpose, amax=None if amax is None else amax[e]
        )
        for e in range(w.shape[0])
    ]
    rows, cols = (w.shape[2], w.shape[1]) if transpose else (w.shape[1], w.shape[2])
    if not qs:
        data, scale = _empty_like_nvfp4(0, cols, w.device)
        return NVFP4Tensor(data.reshape(0, 0, cols // 2), scale.reshape(0, 0, cols // 16),
                           w.new_zeros(0, dtype=torch.float32), torch.Size((0, rows, cols)), block)  # fmt: skip
    return NVFP4Tensor(
        _stack([q.data for q in qs]),
        _stack([q.scale for q in qs]),
        torch.stack([q.amax for q in qs]),
        torch.Size((w.shape[0], rows, cols)),
        block,
    )


def mxfp8_quantize_tokens(x: torch.Tensor, offs: torch.Tensor) -> MXFP8Tensor:
    """x [M, C] quantized along the tokens (blocks of 32), group by group, into [C, P]."""
    cap = token_capacity(x.shape[0], offs.shape[0])
    data = torch.zeros(x.shape[1], cap, dtype=torch.float8_e4m3fn, device=x.device)
    # (E8M0 code 0 is 2^-127; a zero block's scale, as formats/mxfp8.py gives it)
    scale = torch.zeros(x.shape[1], cap // mxfp8.BLOCK, dtype=torch.uint8, device=x.device)
    scale = scale.view(torch.float8_e8m0fnu)
    p = 0
    for start, end in _host_bounds(offs):
        seg = _segment(x, start, end)
        q = mxfp8.quantize(seg, transpose=True)
        n = seg.shape[0]
        data[:, p : p + n] = q.data
        scale[:, p // mxfp8.BLOCK : (p + n) // mxfp8.BLOCK] = q.scale
        p += n
    return MXFP8Tensor(data, scale, torch.Size((x.shape[1], cap)))


def mxfp8_quantize_experts(w: torch.Tensor, transpose: bool = False) -> MXFP8Tensor:
    """Expert weights w [E, N, K] quantized along K (transpose=True: along N, [E, K, N])."""
    qs = [mxfp8.quantize(w[e], transpose=transpose) for e in range(w.shape[0])]
    rows, cols = (w.shape[2], w.shape[1]) if transpose else (w.shape[1], w.shape[2])
    shape = torch.Size((w.shape[0], rows, cols))
    if not qs:
        scale = w.new_zeros(*shape[:2], cols // mxfp8.BLOCK, dtype=torch.uint8)
        return MXFP8Tensor(
            w.new_zeros(shape, dtype=torch.float8_e4m3fn), scale.view(torch.float8_e8m0fnu), shape
        )
    return MXFP8Tensor(_stack([q.data for q in qs]), _stack([q.scale for q in qs]), shape)
