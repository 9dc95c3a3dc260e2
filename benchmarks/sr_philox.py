"""The stochastic-rounding bits the NVFP4 kernels drew until 2026-11-25, for A/B timing only.

Until then each 16-value block took one Philox4x32-7 draw (`tl.randint4x`, 128 bits, 8 a
value), which every thread holding part of the block computed in full; the kernels now hash
each 32-bit word from its own counter (blockscale/kernels/nvfp4.py, `_sr_uniforms`).
`use_philox()` puts the old generator back in the kernels' module before anything compiles,
so a benchmark run with `--rng philox` times the old bits with today's kernels around them.
Triton resolves a kernel's callees when it first compiles it, so call this before the first
launch, in its own process (bench_quantize.py and bench_model.py take `--rng`).
"""

from __future__ import annotations

import triton
import triton.language as tl


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


def use_philox() -> None:
    """Make the NVFP4 kernels (dense and grouped) draw Philox bits in this process."""
    from blockscale.kernels import nvfp4

    nvfp4._sr_uniforms = _philox_uniforms


def add_rng_arg(parser) -> None:
    parser.add_argument(
        "--rng", choices=("hash", "philox"), default="hash",
        help="stochastic rounding's bits: today's hash, or the Philox draw it replaced (A/B)",
    )  # fmt: skip


def apply(args) -> None:
    if args.rng == "philox":
        use_philox()
