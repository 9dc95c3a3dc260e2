"""Kernel code paths replaced on 2026-11-25, put back for A/B timing only.

- `sr-philox`: stochastic rounding's bits as one Philox4x32-7 draw per 16-value block
  (`tl.randint4x`), which every thread holding part of the block computed in full; the NVFP4
  kernels now hash each 32-bit word from its own counter (kernels/nvfp4.py, `_sr_uniforms`).
- `mx-dq-integer`: the MXFP8 `_dq` values through the E4M3 code on integer bits and back
  (`e4m3_byte_value(e4m3_code_signed(w))`); the kernels now round in FP32 directly
  (`_common.e4m3_round`, the same values).

`use(names)` puts the old functions back into the kernels' modules. Triton resolves a kernel's
callees when it first compiles it, so call it before the first launch, in its own process:
bench_quantize.py, bench_grouped_mm.py, bench_model.py and sass_cpu.py take `--replaced
NAME[,NAME]`, so one device call can time both versions in two processes.
"""

from __future__ import annotations

import triton
import triton.language as tl

from blockscale.kernels._common import e4m3_byte_value, e4m3_code_signed


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


def _sr_philox() -> None:
    from blockscale.kernels import nvfp4

    nvfp4._sr_uniforms = _philox_uniforms


def _mx_dq_integer() -> None:
    from blockscale.kernels import mxfp8

    mxfp8.e4m3_round = _e4m3_round_through_code


REPLACED = {"sr-philox": _sr_philox, "mx-dq-integer": _mx_dq_integer}


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
