"""Global amax kernels: max |x|, max |RHT(x) along tokens|, or both from one read of x.

NUMERICS.md needs the tensor amax before any block scale, so quantizing a tensor whose amax
is not known is two passes over it: this one (read 2N bytes for BF16, write 4 bytes) and the
quantize kernel. The fused variant reads x once for both amaxes the default recipe needs in
forward: the rowwise copy's (max |x|) and the Hadamard columnwise copy's.

The reduction runs on the integer bits of |x| (FP32): they order like the values, with NaN
above Inf, so a NaN anywhere gives a NaN amax as torch.amax does. Each program reduces its
tiles in registers and does one atomic max per result into an int32 device scalar: no host
synchronization, and the result is exact and order-independent.
"""

import itertools

import torch
import triton
import triton.language as tl

from blockscale._registry import in_eager_call, library_op
from blockscale.formats import hadamard as rht
from blockscale.kernels._common import abs_bits, cdiv, max_keep_nan, round_to_bf16
from blockscale.kernels._launch import launch

# (BM, BK, num_warps, tiles per program): a program reduces BM * tiles rows by BK columns
# (the plain kernel as [BM, BK] tiles, the Hadamard one 16 rows at a time, BM a multiple of 16).
# The plain kernel's 2 tiles a program keep the grid at >= 4 programs an SM for a model's
# weights: 16 tiles a program left a 4096x4096 FP32 weight 128 programs and took 55 us against
# 28 us (H100, 2026-11-25, docs/KERNELS.md); a 16384x8192 BF16 tensor is not slower (91 us).
TILES = {"plain": (32, 256, 8, 2), "hadamard": (16, 512, 4, 4)}

# Bit i set where the RHT's sign vector has s_i = -1 (folded into the butterfly's constants).
_SIGN_MASK = sum(1 << i for i, s in enumerate(rht.DEFAULT_SIGNS) if s < 0)


def _butterfly_flips(signs: tuple[int, ...]) -> int:
    """Which of the first three butterfly stages' pairs subtract, with the sign vector folded
    in. Position i carries a sign f_i (initially s_i); f_i p + f_j q = f_i (p + f_i f_j q), so
    a pair (i, j = i + 2^stage) stores p +- q with the sign f_i for both outputs, and q's sign
    only decides add or subtract. No negation is ever computed (Triton's -x is 0 - x, one
    more instruction); the outputs come out as +-y, and only |y| is needed. Bit
    16 * stage + i is set where leader i subtracts."""
    f = list(signs)
    flips = 0
    for stage in range(3):
        h = 1 << stage
        for i in range(16):
            if not i & h:
                if f[i] != f[i + h]:
                    flips |= 1 << (16 * stage + i)
                f[i + h] = f[i]
    return flips


_FLIPS = _butterfly_flips(rht.DEFAULT_SIGNS)
# |x| below 2^123 bounds every partial sum of 16 values by 2^127 < FLT_MAX (bits of 2^123).
_FAST_BELOW = 250 << 23


@triton.jit
def _amax_kernel(
    x_ptr, stride_m, stride_k, M, K, out_ptr, n_tiles_k, n_tiles,
    BM: tl.constexpr, BK: tl.constexpr, TILES: tl.constexpr,
):  # fmt: skip
    """out[0] = max |x| bits."""
    acc = tl.zeros([BM, BK], dtype=tl.int32)
    for i in range(TILES):
        t = tl.program_id(0) * TILES + i
        offs_m = (t // n_tiles_k) * BM + tl.arange(0, BM)
        offs_k = (t % n_tiles_k) * BK + tl.arange(0, BK)
        mask = ((offs_m < M) & (t < n_tiles))[:, None] & (offs_k < K)[None, :]
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_m + offs_k[None, :] * stride_k, mask=mask, other=0.0
        )
        acc = tl.maximum(acc, abs_bits(x))
    tl.atomic_max(out_ptr, tl.max(tl.max(acc, axis=1), axis=0))


@triton.jit
def _max_abs_16(vs):
    """max |v| over a 16-tuple of vectors, NaN-propagating; a tree, so the maxes of one
    level are independent instructions."""
    level = ()
    for i in tl.static_range(8):
        level = level + (max_keep_nan(tl.abs(vs[2 * i]), tl.abs(vs[2 * i + 1])),)
    for n in tl.static_range(3):
        nxt = ()
        for i in tl.static_range(4 >> n):
            nxt = nxt + (max_keep_nan(level[2 * i], level[2 * i + 1]),)
        level = nxt
    return level[0]


@triton.jit
def _rht16(xs, SIGN_MASK: tl.constexpr):
    """y = x16 @ H elementwise across a 16-tuple of FP32 vectors (xs[i] holds row i of the
    block), FP32, unrounded: the exact path, for Inf, NaN and huge values. Each x_i * (+-1/4)
    is exact (BF16/FP16 input), so the sums match the reference whenever its partial sums do
    (Inf - Inf makes NaN here as there). The 1/4 goes on first: scaled afterwards, a partial
    sum of large values could overflow where the reference's does not."""
    ys = ()
    for j in tl.static_range(8):
        t = xs[2 * j + 1] * (-0.25 if (SIGN_MASK >> (2 * j + 1)) & 1 else 0.25)
        a = xs[2 * j] * (-0.25 if (SIGN_MASK >> (2 * j)) & 1 else 0.25)
        ys = ys + (a + t, a - t)
    for stage in tl.static_range(1, 4):
        nxt = ()
        for i in tl.static_range(16):
            if (i >> stage) & 1 == 0:
                nxt = nxt + (ys[i] + ys[i + (1 << stage)],)
            else:
                nxt = nxt + (ys[i - (1 << stage)] - ys[i],)
        ys = nxt
    return ys


@triton.jit
def _rht16_max_abs_x4(xs, FLIPS: tl.constexpr):
    """4 * max |x16 @ H| elementwise across a 16-tuple of FP32 vectors, for finite x with
    |x| < 2^123 (no partial sum can overflow, so the unscaled sums are exact whenever the
    reference's are, and * 1/4 later is exact). Signs are folded into add/subtract choices
    (_butterfly_flips). The last stage's pair p +- q enters only through
    max(|p + q|, |p - q|) = |p| + |q|, exactly also after rounding (rounding is monotonic
    and odd): 8 adds instead of 16 and 8 maxes instead of 16. Not for Inf: Inf - Inf is NaN
    where |p| + |q| gives Inf."""
    ys = xs
    for stage in tl.static_range(3):
        nxt = ()
        for i in tl.static_range(16):
            if (i >> stage) & 1 == 0:
                if (FLIPS >> (16 * stage + i)) & 1:
                    nxt = nxt + (ys[i] - ys[i + (1 << stage)],)
                else:
                    nxt = nxt + (ys[i] + ys[i + (1 << stage)],)
            else:
                if (FLIPS >> (16 * stage + i - (1 << stage))) & 1:
                    nxt = nxt + (ys[i - (1 << stage)] + ys[i],)
                else:
                    nxt = nxt + (ys[i - (1 << stage)] - ys[i],)
        ys = nxt
    level = ()
    for i in tl.static_range(4):
        level = level + (
            tl.maximum(tl.abs(ys[2 * i]) + tl.abs(ys[2 * i + 8]),
                       tl.abs(ys[2 * i + 1]) + tl.abs(ys[2 * i + 9])),
        )  # fmt: skip
    return tl.maximum(tl.maximum(level[0], level[1]), tl.maximum(level[2], level[3]))


@triton.jit
def _load_16_rows(block, stride_m, kmask, EVEN_K: tl.constexpr):
    """16 consecutive rows from `block` (pointers to row 0's columns) as FP32 vectors."""
    xs = ()
    for r in tl.static_range(16):
        if EVEN_K:
            v = tl.load(block + r * stride_m)
        else:
            v = tl.load(block + r * stride_m, mask=kmask, other=0.0)
        xs = xs + (v.to(tl.float32),)
    return xs


@triton.jit
def _amax_rht_kernel(
    x_ptr, stride_m, stride_k, M, K, out_ptr,
    PLAIN: tl.constexpr, SIGN_MASK: tl.constexpr, FLIPS: tl.constexpr,
    FAST_BELOW: tl.constexpr, EVEN_K: tl.constexpr, BK: tl.constexpr, GROUPS: tl.constexpr,
):  # fmt: skip
    """out[0] = max |x| bits (if PLAIN), out[1] = max |RHT along M of x| bits, BF16-rounded.

    A program reads a strip of 16 * GROUPS rows by BK columns, 16 rows at a time, each row
    as one [BK] vector (coalesced along K): the 16 values a transform mixes sit in one
    thread's registers, so the RHT is a butterfly of adds across the vectors, with no
    transpose, shared memory or barrier (the tensor-core dot version ran at 44% of the copy).
    Rounding to BF16 is monotonic in |y|, so the running max stays unrounded and only the
    program's final max is rounded: max |bf16(y)| = bf16(max |y|), NaN and Inf included.
    Since a max does not mind duplicates, the last strip re-reads the last group instead of
    masking rows (M is a multiple of 16 here). One group of 16 rows per loop iteration:
    unrolling several as tuples made the JIT compile take minutes (docs/LOG.md).

    The loop takes the fast butterfly, valid while every |x| < 2^123; max |x| comes from the
    same loop, and a strip that holds a larger value, Inf or NaN is read again through the
    exact butterfly (a branch taken only for such strips)."""
    offs_k = tl.program_id(0) * BK + tl.arange(0, BK)
    kmask = offs_k < K
    cols = x_ptr + offs_k * stride_k
    last = M // 16 - 1
    first = tl.program_id(1) * GROUPS
    acc = tl.zeros([BK], dtype=tl.float32)
    acc_t = tl.zeros([BK], dtype=tl.float32)
    for i in range(GROUPS):
        block = cols + (tl.minimum(first + i, last) * 16).to(tl.int64) * stride_m
        xs = _load_16_rows(block, stride_m, kmask, EVEN_K)
        acc = max_keep_nan(acc, _max_abs_16(xs))
        acc_t = tl.maximum(acc_t, _rht16_max_abs_x4(xs, FLIPS))
    big = tl.max(abs_bits(acc), axis=0)
    if big >= FAST_BELOW:
        acc_t = tl.zeros([BK], dtype=tl.float32)
        for i in range(GROUPS):
            block = cols + (tl.minimum(first + i, last) * 16).to(tl.int64) * stride_m
            xs = _load_16_rows(block, stride_m, kmask, EVEN_K)
            acc_t = max_keep_nan(acc_t, _max_abs_16(_rht16(xs, SIGN_MASK)))
    else:
        acc_t = acc_t * 0.25
    if PLAIN:
        tl.atomic_max(out_ptr, big)
    tl.atomic_max(out_ptr + 1, tl.max(abs_bits(round_to_bf16(acc_t)), axis=0))


class _ZeroedPairs:
    """Zeroed int32 pairs for the amax kernels' atomic maxima, handed out from blocks zeroed
    POOL_PAIRS at a time: a `torch.zeros` is an allocation and a fill launch (about 55 us of
    host time on an H100 host, once or twice in a quantized layer's forward and backward),
    a pair from a block one slice. A pair is never handed out twice, and a block is freed when
    the last amax viewing it is. Pairs start 16 bytes apart, so every amax keeps the
    alignment (and Triton specialization) of a tensor of its own. One block per device and
    stream, used only on the stream that zeroed it, so no kernel reads a pair before the fill
    has run. Eager calls only (`_registry.in_eager_call`): a trace holds its own zeros, and a
    compiled graph's op may run where memory is a CUDA-graph pool's (torch.compile's
    reduce-overhead mode warms up and replays from one, which would overwrite a block kept
    here); nor while a CUDA graph is captured (a replay would reuse the pair unzeroed)."""

    def __init__(self) -> None:
        self.blocks: dict[tuple, list] = {}

    def take(self, device: torch.device) -> torch.Tensor:
        if (
            device.type != "cuda"
            or not in_eager_call()
            or torch._C._cuda_isCurrentStreamCapturing()
        ):
            return torch.zeros(2, dtype=torch.int32, device=device)
        key = (device.index, torch._C._cuda_getCurrentRawStream(device.index))
        block = self.blocks.get(key)
        index = POOL_PAIRS if block is None else next(block[1])  # (atomic: no pair twice)
        if index >= POOL_PAIRS:
            zeros = torch.zeros(POOL_PAIRS, 4, dtype=torch.int32, device=device)
            block = self.blocks[key] = (zeros, itertools.count(1))
            index = 0
        return block[0][index, :2]


POOL_PAIRS = 512
_ZEROED = _ZeroedPairs()


@library_op("blockscale::amax_2d", mutates_args=(), triton=True, any_strides=True)
def _amax_2d(x: torch.Tensor, plain: bool, hadamard_t: bool) -> torch.Tensor:
    """FP32 [2]: (max |x|, max |Hadamard transform of x along dim 0|); unrequested ones 0."""
    M, K = x.shape
    if hadamard_t:
        _check_hadamard(x)
    out = _ZEROED.take(x.device)  # zeroed int32 [2]
    if M and K:
        bm, bk, warps, per_program = TILES["hadamard" if hadamard_t else "plain"]
        if hadamard_t:
            # grid axis 1 is capped at 65535 strips
            groups = max(bm * per_program // 16, cdiv(M // 16, 65535))
            grid = (cdiv(K, bk), cdiv(M // 16, groups))
            launch(_amax_rht_kernel, grid,
                x, x.stride(0), x.stride(1), M, K, out,
                PLAIN=plain, SIGN_MASK=_SIGN_MASK, FLIPS=_FLIPS, FAST_BELOW=_FAST_BELOW,
                EVEN_K=K % bk == 0, BK=bk, GROUPS=groups, num_warps=warps,
            )  # fmt: skip
        else:
            n_k = cdiv(K, bk)
            n_tiles = cdiv(M, bm) * n_k
            launch(_amax_kernel, (cdiv(n_tiles, per_program),),
                x, x.stride(0), x.stride(1), M, K, out, n_k, n_tiles,
                BM=bm, BK=bk, TILES=per_program, num_warps=warps,
            )  # fmt: skip
    return out.view(torch.float32)


def _check_hadamard(x2: torch.Tensor) -> None:
    if x2.shape[0] % 16:
        raise ValueError(
            f"{x2.shape[0]} rows is not a multiple of 16 (the Hadamard transform runs along them)"
        )


def amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| over the whole tensor, FP32 scalar on x's device (NaN if any NaN)."""
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    return _amax_2d(x2, True, False)[0]


def amax_hadamard_t(x: torch.Tensor) -> torch.Tensor:
    """max |y| of the columnwise Hadamard copy: y = RHT of x.T along its last dim (x's
    tokens), rounded to BF16, the amax of nvfp4 quantize(x, hadamard=True, transpose=True)."""
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    _check_hadamard(x2)
    return _amax_2d(x2, False, True)[1]


def amax_fused(
    x: torch.Tensor, hadamard_t: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(max |x|, max |Hadamard columnwise copy| or None) from one read of x."""
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    if hadamard_t:
        _check_hadamard(x2)
    out = _amax_2d(x2, True, hadamard_t)
    return out[0], (out[1] if hadamard_t else None)


def amax_of_copy(x2: torch.Tensor, hadamard_t: bool) -> torch.Tensor:
    """The amax of the copy the quantize kernel makes from the 2-D x2 (internal)."""
    return amax_hadamard_t(x2) if hadamard_t else amax(x2)
