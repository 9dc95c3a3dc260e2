"""Kernel code paths replaced on 2026-11-25 and later, put back for A/B timing only.

- `sr-philox`: stochastic rounding's bits as one Philox4x32-7 draw per 16-value block
  (`tl.randint4x`), which every thread holding part of the block computed in full; the NVFP4
  kernels now hash each 32-bit word from its own counter (kernels/nvfp4.py, `_sr_uniforms`).
- `mx-dq-integer`: the MXFP8 `_dq` values through the E4M3 code on integer bits and back
  (`e4m3_byte_value(e4m3_code_signed(w))`); the kernels now round in FP32 directly
  (`_common.e4m3_round`, the same values).
- `dq-copy-first` (replaced 2026-11-28): the `_dq` of a saved or cached copy reshaped the codes
  and scales to contiguous rows first, which for the expert copies along N (each expert a
  strided view of one [K, E*N] array) is a torch copy of every code before the dequantize
  kernel; the kernels now read the copy in place (`_common.row_stack`). A Python-level swap,
  so unlike the others it may be switched within one process: bench_grouped_mm.py
  `--dequantize` times both side by side with `old_dequantize_dq`.
- `e4m3-integer` (replaced 2026-12-02): the NVFP4 block scales' E4M3 code and value by the
  integer codec on the GPU too; the kernels now use the hardware conversions there
  (`_common.e4m3_code_value`, `e4m3_decode` with HW).
- `enc-division` (replaced 2026-12-02): each block's encode multiplier by its own IEEE
  division, one a thread for each block it holds part of, instead of the per-program table of
  the 128 codes' multipliers (kernels/nvfp4.py `ENC_TABLE`, a module value: this sets it off
  before anything launches; a benchmark may also flip it between timed calls).

`use(names)` puts the old functions back into the kernels' modules. Triton resolves a kernel's
callees when it first compiles it, so call it before the first launch, in its own process:
bench_quantize.py, bench_grouped_mm.py, bench_model.py and sass_cpu.py take `--replaced
NAME[,NAME]`, so one device call can time both versions in two processes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from blockscale.kernels._common import (
    e4m3_byte_value,
    e4m3_code_signed,
    e4m3_code_value,
    e4m3_decode,
)


@triton.jit
def _philox_uniforms(
    seed, block_offsets, R: tl.constexpr, NB: tl.constexpr, COLUMNWISE: tl.constexpr
):
    """FP32 uniforms k/256 for an [R, NB, 16] tile: one Philox4x32-7 draw per block, the
    same byte order for both copies (COLUMNWISE is the hash's switch, unused here)."""
    r0, r1, r2, r3 = tl.randint4x(seed, block_offsets, n_rounds=7)
    j = tl.arange(0, 16)[None, None, :]
    w = tl.where(
        j < 8,
        tl.where(j < 4, r0[:, :, None], r1[:, :, None]),
        tl.where(j < 12, r2[:, :, None], r3[:, :, None]),
    )
    byte = (w >> ((j % 4) * 8).to(tl.uint32)) & 0xFF
    return byte.to(tl.float32) * 0.00390625


@triton.jit
def _e4m3_round_through_code(w):
    """The E4M3 rounding of w by way of its integer code (the path e4m3_round replaced)."""
    return e4m3_byte_value(e4m3_code_signed(w))


@triton.jit
def _e4m3_code_value_integer(b, HW: tl.constexpr):
    """The block scale's (code, value) by the integer codec, whatever HW says."""
    return e4m3_code_value(b, False)


@triton.jit
def _e4m3_decode_integer(code, HW: tl.constexpr):
    return e4m3_decode(code, False)


def _e4m3_integer() -> None:
    from blockscale.kernels import nvfp4

    nvfp4.e4m3_code_value = _e4m3_code_value_integer
    nvfp4.e4m3_decode = _e4m3_decode_integer


def _enc_division() -> None:
    from blockscale.kernels import nvfp4

    nvfp4.ENC_TABLE = False


def _sr_philox() -> None:
    from blockscale.kernels import nvfp4

    nvfp4._sr_uniforms = _philox_uniforms


def _mx_dq_integer() -> None:
    from blockscale.kernels import mxfp8

    mxfp8.e4m3_round = _e4m3_round_through_code


def contiguous_rows(q) -> tuple[torch.Tensor, torch.Tensor]:
    """A copy's codes and scales as contiguous [rows, cols] (what `dq-copy-first` did first:
    a copy of both for a strided copy, views otherwise)."""
    cols, rows = q.shape[-1], q.shape[:-1].numel()
    nvfp4 = q.data.dtype == torch.uint8  # (NVFP4 packs two codes a byte; MXFP8 is float8)
    data = q.data.view(torch.uint8).reshape(rows, cols // 2 if nvfp4 else cols).contiguous()
    scale = q.scale.view(torch.uint8).reshape(rows, cols // (16 if nvfp4 else 32)).contiguous()
    return data, scale


def old_dequantize_dq(q) -> torch.Tensor:
    """The `_dq` of an NVFP4 or MXFP8 container as it was made before 2026-11-28: its codes
    and scales copied to contiguous rows, then the dequantize kernel (today's, given one
    stack: the old one differed only in not mapping its rows through `stack_rows`, an integer
    division a row)."""
    from blockscale.kernels import mxfp8, nvfp4

    data, scale = contiguous_rows(q)
    nvfp4_copy = q.data.dtype == torch.uint8
    op = nvfp4._nvfp4_dequantize_3d if nvfp4_copy else mxfp8._mxfp8_dequantize_3d
    return op(data[None], scale[None]).reshape(q.shape)


def _dq_copy_first() -> None:
    import blockscale.kernels as kernels

    kernels.nvfp4_dequantize_dq = old_dequantize_dq
    kernels.mxfp8_dequantize_dq = old_dequantize_dq


REPLACED = {
    "sr-philox": _sr_philox,
    "mx-dq-integer": _mx_dq_integer,
    "dq-copy-first": _dq_copy_first,
    "e4m3-integer": _e4m3_integer,
    "enc-division": _enc_division,
}


def use(names: list[str]) -> None:
    for name in names:
        REPLACED[name]()


def add_arg(parser) -> None:
    parser.add_argument(
        "--replaced", default="", metavar="NAME[,NAME]",
        help=f"put back replaced kernel code for A/B timing: {', '.join(REPLACED)}",
    )  # fmt: skip


def apply(args) -> list[str]:
    names = [n for n in args.replaced.split(",") if n]
    unknown = sorted(set(names) - set(REPLACED))
    if unknown:
        raise SystemExit(f"unknown --replaced {unknown}; choose from {', '.join(REPLACED)}")
    use(names)
    return names
