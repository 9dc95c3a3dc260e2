"""NVFP4 quantization kernels: rowwise and columnwise (optionally Hadamard), nearest or
stochastic, 1x16 or 16x16, from one read of x; optional exact BF16 `_dq` outputs; and the
dequantize kernel for saved tensors.

One kernel does every direction. A program loads one [BM, BK] tile of x. The rowwise copy
quantizes the tile along K as it is; the columnwise copy quantizes tl.trans(tile) along M, so
both read the same registers and x is read once. Work per tile, in NUMERICS.md order:
block amax (integer max of |x| bits, NaN-propagating) -> E4M3 scale (RNE from bits) ->
encode multiplier 1 / (scale * S_dec) (IEEE division) -> codes -> packed bytes.

Bytes (the roofline argument, BF16 input [M, K], N = M*K):
  one direction:        read 2N, write N/2 codes + N/16 scales            = 2.5625 N
  both directions:      read 2N, write 2 * (N/2 + N/16)                   = 3.125 N
  each `_dq` output adds 2N written. The global amax is a separate pass (read 2N) unless
  the caller passes `amax`; see amax.py for the fused rowwise + Hadamard-columnwise amax.

Stochastic rounding takes 8 random bits per value from a counter-based hash of each value's
position, keyed by one seed a launch drawn from PyTorch's generator into a device tensor
(the stream is defined above `mix32`).
"""

import torch
import triton
import triton.language as tl
from triton.language import core

from blockscale._registry import library_op, tracing
from blockscale.formats import _checks
from blockscale.formats.nvfp4 import BLOCKS, ROUNDINGS, NVFP4Tensor
from blockscale.kernels._common import (
    FLT_MAX,
    abs_bits,
    band_grid,
    band_tile,
    bf16_bits,
    copy_outputs,
    dot_in_fp32,
    dq_flags,
    e4m3_byte_value,
    e4m3_code_value,
    e4m3_decode,
    empty_rows,
    hadamard_16,
    hadamard_matrix,
    interpreting,
    launch_kind,
    launch_tiles,
    max_keep_nan,
    min_keep_nan,
    nvfp4_global,
    relayout_16,
    row_stack,
    sr_seed,
    stack_rows,
    with_sign,
)
from blockscale.kernels._launch import launch
from blockscale.kernels.amax import amax_fused, amax_of_copy

BLOCK = 16

# The block scales' encode multipliers 1 / (scale * S_dec) from a table of the 128 E4M3
# codes' multipliers that a program builds once (one IEEE division a thread), where S_dec is
# one scalar for the tile, instead of one division for each block a thread holds part of
# (docs/KERNELS.md). A module value read at launch, so a benchmark can turn it off.
ENC_TABLE = True


# Stochastic rounding's random bits. Value j of 16-value block c of a copy rounds with
# u = byte / 256, the byte taken from word q of that block:
#     rowwise copy:     q = j // 4,           byte j % 4
#     columnwise copy:  q = (j // 2) % 4,     byte 2 * (j // 8) + j % 2
# and word q of block c is
#     mix32(((4 c + q) mod 2^32) XOR mix32(seed)),
# with c = base + row * (cols / 16) + block (base: 0 for the rowwise copy, past the rowwise
# counters for the columnwise one) and seed one draw from PyTorch's generator per launch.
# The two byte orders follow where a copy's values sit: rowwise a thread holds 8 consecutive
# values of a block (two words), columnwise (the MMA layout of the Hadamard or identity
# product) values 2t, 2t + 1, 2t + 8, 2t + 9 (one word in this order).
# mix32 is a bijective two-round xorshift-multiply hash of 32 bits. It replaced a Philox4x32-7
# draw per block (docs/LOG.md, 2026-11-25 evening): every thread that holds part of a block
# computed the whole draw (two to four times a block), while each word here depends on its
# own counter alone, so a thread computes only the words of the values it holds, with two
# 32-bit multiplies a word instead of fourteen 64-bit ones a block. `sr_uniforms` below is
# the same stream in PyTorch (tests compare the kernels with it bit for bit).
MIX32 = (0x21F0AAAD, 0x735A2D97)
_MIX32_A = tl.constexpr(MIX32[0])
_MIX32_B = tl.constexpr(MIX32[1])


@triton.jit
def mix32(x):
    """The bijective 32-bit hash of uint32 x: two xorshift-multiply rounds."""
    x = x ^ (x >> 16)
    x = x * _MIX32_A
    x = x ^ (x >> 15)
    x = x * _MIX32_B
    return x ^ (x >> 15)


@triton.jit
def _sr_uniforms(seed, block_offsets, R: tl.constexpr, NB: tl.constexpr, COLUMNWISE: tl.constexpr):
    """The uniforms' numerators k (u = k / 256; FP32 0..255) for an [R, NB, 16] tile from the
    block counters [R, NB]: four hashed words a block, 8 bits a value, in the copy's byte
    order (_e2m1 takes k, which spares a multiply a value). The words are laid out
    [R, NB, 4] and their bytes [R, NB, 4, 4], so a thread hashes only the words its values
    need."""
    key = mix32(seed.to(tl.uint32))
    q = tl.arange(0, 4).to(tl.uint32)[None, None, :]
    w = mix32(((block_offsets.to(tl.uint32) * 4)[:, :, None] + q) ^ key)
    b = (tl.arange(0, 4) * 8).to(tl.uint32)[None, None, None, :]
    byte = (w[:, :, :, None] >> b) & 0xFF  # [R, NB, word, byte]
    if COLUMNWISE:  # value 8 * (byte // 2) + 2 * word + byte % 2
        byte = tl.permute(tl.reshape(byte, [R, NB, 4, 2, 2]), [0, 1, 3, 2, 4])
    return tl.reshape(byte, [R, NB, 16]).to(tl.float32)


def _mix32_torch(x: torch.Tensor) -> torch.Tensor:
    """mix32 on int64 tensors holding uint32 values (each product stays below 2^63)."""
    x = x ^ (x >> 16)
    x = (x * MIX32[0]) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * MIX32[1]) & 0xFFFFFFFF
    return x ^ (x >> 15)


def sr_uniforms(
    seed: int, rows: int, cols: int, base: int = 0, columnwise: bool = False
) -> torch.Tensor:
    """The kernels' stochastic-rounding uniforms for a [rows, cols] copy, FP32 [rows,
    cols / 16, 16] on the CPU: what `rand` must be for the given-uniform path to reproduce a
    launch whose seed was `seed` (`base`: that copy's first block counter; `columnwise`: the
    columnwise copy's byte order)."""
    key = _mix32_torch(torch.tensor(seed & 0xFFFFFFFF, dtype=torch.int64))
    c = base + torch.arange(rows * (cols // 16), dtype=torch.int64).reshape(rows, cols // 16)
    counters = (c[:, :, None] * 4 + torch.arange(4)) & 0xFFFFFFFF
    words = _mix32_torch(counters ^ key)
    byte = (words[:, :, :, None] >> (torch.arange(4) * 8)) & 0xFF  # [rows, blocks, word, byte]
    if columnwise:
        byte = byte.reshape(rows, cols // 16, 4, 2, 2).permute(0, 1, 3, 2, 4)
    return byte.reshape(rows, cols // 16, 16).to(torch.float32) / 256


def columnwise_base(rows: int, cols: int) -> int:
    """The first block counter of the columnwise copy of an x of [rows, cols] (its rowwise
    copy's counters end below it)."""
    return -(-rows // 16) * 16 * (cols // 16)


@core.extern
def add_rp(a, b, _semantic=None):
    """FP32 a + b rounded up (toward +inf), subnormal operands kept: PTX `add.rp.f32`, called
    as LLVM's NVPTX intrinsic. libdevice's `add_ru` would be `add.rp.ftz.f32` (Triton builds
    with FTZ reflection), and inline assembly would fence the scheduler (docs/KERNELS.md)."""
    return core.extern_elementwise(
        "", "", [a, b],
        {(core.float32, core.float32): ("llvm.nvvm.add.rp.f", core.float32)},
        is_pure=True, _semantic=_semantic,
    )  # fmt: skip


@triton.jit
def add_up(a, b, HW: tl.constexpr):
    """a + b rounded toward +inf, for a sum that is positive and finite. HW: `add_rp`. The
    interpreter (numpy has no directed rounding): the nearest sum, one step up where its
    exact error (TwoSum, exact in any round-to-nearest arithmetic) is positive, so the CPU
    tests run the GPU's arithmetic rather than another formula for it."""
    if HW:
        return add_rp(a, b)
    else:
        s = a + b
        b_part = s - a
        err = (a - (s - b_part)) + (b - b_part)
        up = (s.to(tl.int32, bitcast=True) + 1).to(tl.float32, bitcast=True)
        return tl.where(err > 0.0, up, s)


@triton.jit
def _e2m1(
    w, u, SR: tl.constexpr, DQ: tl.constexpr, HW: tl.constexpr = False, step=0, scale_bits=0
):  # fmt: skip
    """Scaled FP32 values -> (int32 whose low three bits are the magnitude index 0..7, and
    when DQ the FP32 `_dq` value: the grid magnitude times the signed block scale that `step`
    and `scale_bits` encode, _dq_scale_bits), nearest-even or stochastic (u: 256 times the
    uniforms, so integers 0..255 from the hash), of a = min(|w|, 6). NaN gives garbage here;
    the caller zeroes NaN blocks.

    The grid has step 0.5 on [0, 2), 1 on [2, 4), 2 on [4, 6]: with 2^j the binade of max(a, 1)
    (j = 0, 1, 2; e = 127 + j the exponent field), y = a * 2^(1-j) puts the step at 1 (exact),
    so rounding y to an integer r is rounding a to the grid, and index = r + 2j.
    Nearest: adding 1.5 * 2^23 (+ 2) rounds y to an integer with ties to even, and the low bits
    of the sum are r + 2. Stochastic: ceil(y - u) = floor(y) + [u < frac(y)], the reference's
    rule, and y - u is exact wherever it decides the ceiling (docs/KERNELS.md). It runs 256
    times larger: 256 * (ceil(y - u) + 1.5 * 2^23 + 2) is one add rounded up (`add_up`; on the
    GPU `add_rp`) of 256 y - 256 u (exact: the hash's integer k; no multiply by 1/256) and
    256 * (1.5 * 2^23 + 2); the sum lies in [2^31, 2^32), where the FP32 step is 256, and its
    bits are the unscaled sum's plus 8 in the exponent, so the low bits are r + 2 as below.
    It was `tl.ceil(y - u)` + an add until 2026-11-26: `tl.ceil` is `cvt.rpi.ftz` on the GPU,
    which flushed a subnormal y - u (u = 0 and a below 2^-127) to 0 and so coded it 0 where
    the reference rounds it up to 0.5 (test_stochastic_rounds_subnormal_scaled_values_up).
    Written for the GPU's pipes (the ALU pipe bounds these kernels, docs/KERNELS.md): e is the
    high word of bits * 2^9 and 2^(1-j), 2^(j-1), 2j come from e by integer multiply-adds, on
    the FMA pipe; the clamp to 6 and the integer max are the ALU operations here."""
    a = min_keep_nan(tl.abs(w), 6.0)
    e = tl.maximum(tl.umulhi(a.to(tl.int32, bitcast=True), 512), 127)
    if SR:  # 256 y = a * 2^(9-j); t = 256 (r + 1.5 * 2^23 + 2), bits(t) = 0x4F400002 + r
        c = 3221225984.0
        t = add_up(a * ((263 - e) * 0x800000).to(tl.float32, bitcast=True) - u, c, HW)
        # r = (t - c) / 256, so the magnitude is (t - c) * 2^(j-9)
    else:  # t = r + 1.5 * 2^23 + 2, bits(t) = 0x4B400002 + r
        c = 12582914.0
        t = a * (0x7F800000 - e * 0x800000).to(tl.float32, bitcast=True) + c
        # the magnitude is (t - c) * 2^(j-1)
    # bits(t) + 2e = 0x4B400100 + index (0x4F400100 + index): the low three bits
    idx = t.to(tl.int32, bitcast=True) + e * 2
    if DQ:  # t - c times the signed scale * 2^(j-9) (or 2^(j-1)): the magnitude times the scale
        dq = (t - c) * (e * step + scale_bits).to(tl.float32, bitcast=True)
    else:
        dq = 0.0
    return idx, dq


@triton.jit
def _dq_scale_bits(sval, neg, SR: tl.constexpr):
    """(step, bits) per value such that bits(e * step + bits), for _e2m1's binade field e, is
    the value's signed scale times _e2m1's 2^(j - 9) (stochastic) or 2^(j - 1) (nearest), so
    the `_dq` value is one multiply of t - c: the magnitude's power of two goes into the
    scale's exponent field by one integer multiply-add a value (exact: scale * 2^(j - 9) >=
    2^-18 stays normal), where the magnitude took an add, a multiply-add and a multiply and
    the `_dq` another multiply. A zero or NaN scale has step 0 and keeps its bits, so the
    product is a signed zero or NaN as the magnitude times the scale is. The sign bit is
    flipped where w < 0 (as the code's: -0.0 gives +0.0). The same bits as the magnitude
    times the signed scale, one operation a value fewer (docs/KERNELS.md)."""
    valid = sval > 0.0
    sbits = sval.to(tl.int32, bitcast=True)
    if SR:
        shift: tl.constexpr = (127 + 9) << 23
    else:
        shift: tl.constexpr = (127 + 1) << 23
    step = tl.where(valid, 0x800000, 0)[:, :, None]
    base = tl.where(valid, sbits - shift, sbits)[:, :, None]
    return step, tl.where(neg, base ^ -2147483648, base)


@triton.jit
def _encode_multiplier(sval, s_dec):
    """A block's encode multiplier from its scale value: 1 / (scale * S_dec), IEEE division,
    capped at FLT_MAX (a zero scale gives FLT_MAX, a NaN one NaN)."""
    return min_keep_nan(tl.math.div_rn(tl.full(sval.shape, 1.0, tl.float32), sval * s_dec), FLT_MAX)


@triton.jit
def _quantize_tile(
    v, s_dec, mult, u, R: tl.constexpr, C: tl.constexpr, TWO_D: tl.constexpr, SR: tl.constexpr,
    DQ: tl.constexpr, HW: tl.constexpr = False, TABLE: tl.constexpr = False,
):  # fmt: skip
    """An FP32 [R, C] tile, blocks of 16 along C -> (packed uint8 [R, C/2], E4M3 scale codes
    uint8 [R, C/16], FP32 dq [R, C] = code value * scale, whether every value was finite)."""
    NB: tl.constexpr = C // 16
    vb = tl.reshape(v, [R, NB, 16])
    block_amax = tl.reduce(tl.abs(vb), 2, max_keep_nan)
    if TWO_D:
        tile = tl.reduce(tl.reshape(block_amax, [R // 16, 16, NB]), 1, max_keep_nan)
        block_amax = tl.reshape(tl.broadcast_to(tile[:, None, :], [R // 16, 16, NB]), [R, NB])
    b = min_keep_nan(block_amax * mult, 448.0)
    scode, sval = e4m3_code_value(b, HW)
    if TABLE:  # (s_dec one scalar: the block scales' 128 reciprocals, one a thread)
        table = _encode_multiplier(e4m3_decode(tl.arange(0, 128), HW), s_dec)
        enc = tl.reshape(tl.gather(table, tl.reshape(scode, [R * NB]), 0), [R, NB])
    else:
        enc = _encode_multiplier(sval, s_dec)
    w = vb * enc[:, :, None]
    neg = w < 0.0
    if DQ:
        step, scale_bits = _dq_scale_bits(sval, neg, SR)
    else:
        step, scale_bits = 0, 0
    idx, dq = _e2m1(w, u, SR, DQ, HW, step, scale_bits)
    # A NaN block (NaN input or NaN amax) has NaN scaled values: codes 0, as the reference.
    # Per block, the index mask is 7, or 0 in a NaN block (whose w < 0 is false throughout),
    # so a code is one three-input bit operation: (idx & mask) | sign.
    mask = tl.where(sval == sval, 7, 0)
    code = (idx & mask[:, :, None]) | tl.where(neg, 8, 0)
    if DQ:
        dq = tl.reshape(dq, [R, C])
    lo, hi = tl.split(tl.reshape(code, [R, C // 2, 2]))
    packed = (lo + hi * 16).to(tl.uint8)  # (disjoint bits: a multiply-add, not a shift and or)
    # on the bits: tl.max over floats drops NaN (GPU and interpreter alike)
    finite = tl.max(tl.max(abs_bits(block_amax), axis=1), axis=0) < 0x7F800000
    return packed, scode.to(tl.uint8), dq, finite


@triton.jit
def _store_quantized(
    packed, scode, dq, data_ptr, scale_ptr, dq_ptr, r0, c0, n_rows, n_cols,
    R: tl.constexpr, C: tl.constexpr, DQ: tl.constexpr, CODES: tl.constexpr = True,
):  # fmt: skip
    """Store one quantized [R, C] tile at (r0, c0) of an [n_rows, n_cols] logical tensor.
    (64-bit row offsets: a stack of expert weights passes 2^31 values.)"""
    rows = (r0 + tl.arange(0, R)).to(tl.int64)
    store_rows(
        packed, scode, dq, data_ptr, scale_ptr, dq_ptr, rows, rows < n_rows, c0, n_cols, C, DQ,
        CODES,
    )  # fmt: skip


@triton.jit
def store_rows(
    packed, scode, dq, data_ptr, scale_ptr, dq_ptr, rows, rmask, c0, n_cols,
    C: tl.constexpr, DQ: tl.constexpr, CODES: tl.constexpr = True,
):  # fmt: skip
    """Store a quantized tile's rows at the row indices `rows` (where `rmask`), columns
    c0:c0+C of an n_cols-wide tensor (the grouped kernels scatter rows this way). CODES
    False: the `_dq` only (its caller reads nothing else)."""
    if CODES:
        half = c0 // 2 + tl.arange(0, C // 2)
        tl.store(
            data_ptr + rows[:, None] * (n_cols // 2) + half[None, :],
            packed,
            mask=rmask[:, None] & (half < n_cols // 2)[None, :],
        )
        sc = c0 // 16 + tl.arange(0, C // 16)
        tl.store(
            scale_ptr + rows[:, None] * (n_cols // 16) + sc[None, :],
            scode,
            mask=rmask[:, None] & (sc < n_cols // 16)[None, :],
        )
    if DQ:
        cols = c0 + tl.arange(0, C)
        tl.store(
            dq_ptr + rows[:, None] * n_cols + cols[None, :],
            bf16_bits(dq),
            mask=rmask[:, None] & (cols < n_cols)[None, :],
        )


@triton.jit
def _uniforms(
    seed_ptr, rand_ptr, r0, c0, n_rows, n_cols, base,
    R: tl.constexpr, C: tl.constexpr, SR: tl.constexpr, RAND_GIVEN: tl.constexpr,
    COLUMNWISE: tl.constexpr,
):  # fmt: skip
    """256 * the uniforms for an [R, C] output tile (what _e2m1 takes): given as a tensor of
    uniforms (tests), or hashed from one counter per 16-value block (`base` keeps the rowwise
    and columnwise copies apart)."""
    if SR:
        if RAND_GIVEN:
            rows = r0 + tl.arange(0, R)
            cols = c0 + tl.arange(0, C)
            m = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
            u = tl.load(rand_ptr + rows[:, None] * n_cols + cols[None, :], mask=m, other=0.0)
            return tl.reshape(u * 256.0, [R, C // 16, 16])
        else:
            rows = r0 + tl.arange(0, R)
            blocks = c0 // 16 + tl.arange(0, C // 16)
            offs = base + rows[:, None] * (n_cols // 16) + blocks[None, :]
            return _sr_uniforms(tl.load(seed_ptr), offs, R, C // 16, COLUMNWISE)
    else:
        return 0.0


@triton.jit
def _nvfp4_quantize_kernel(
    x_ptr, stride_m, stride_k, M, K,
    amax_row_ptr, amax_col_ptr, h_ptr, seed_ptr, rand_row_ptr, rand_col_ptr,
    data_ptr, scale_ptr, dq_ptr, data_t_ptr, scale_t_ptr, dq_t_ptr,
    ROW: tl.constexpr, COL: tl.constexpr, ROW_2D: tl.constexpr, COL_2D: tl.constexpr,
    ROW_SR: tl.constexpr, COL_SR: tl.constexpr, COL_HAD: tl.constexpr,
    RAND_GIVEN: tl.constexpr, DQ_ROW: tl.constexpr, DQ_COL: tl.constexpr,
    band, DOT_F32: tl.constexpr, HW: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
    ROW_CODES: tl.constexpr = True, COL_CODES: tl.constexpr = True,
    ENC_TABLE: tl.constexpr = False,
):  # fmt: skip
    tile_m, tile_k = band_tile(band)
    m0 = tile_m * BM
    k0 = tile_k * BK
    offs_m = m0 + tl.arange(0, BM)
    offs_k = k0 + tl.arange(0, BK)
    mask = (offs_m < M)[:, None] & (offs_k < K)[None, :]
    x = tl.load(
        x_ptr + offs_m[:, None] * stride_m + offs_k[None, :] * stride_k, mask=mask, other=0.0
    )
    if ROW:
        s_dec, mult = nvfp4_global(tl.load(amax_row_ptr))
        u = _uniforms(seed_ptr, rand_row_ptr, m0, k0, M, K, 0, BM, BK, ROW_SR, RAND_GIVEN, False)
        packed, scode, dq, _ = _quantize_tile(
            x.to(tl.float32), s_dec, mult, u, BM, BK, ROW_2D, ROW_SR, DQ_ROW, HW, ENC_TABLE
        )
        _store_quantized(
            packed, scode, dq, data_ptr, scale_ptr, dq_ptr, m0, k0, M, K, BM, BK, DQ_ROW,
            ROW_CODES,
        )  # fmt: skip
    if COL:
        s_dec_t, mult_t = nvfp4_global(tl.load(amax_col_ptr))
        # counters past the rowwise ones (columnwise_base), so the copies draw different bits
        base = ((M + 15) // 16) * 16 * (K // 16)
        u_t = _uniforms(
            seed_ptr, rand_col_ptr, k0, m0, K, M, base, BK, BM, COL_SR, RAND_GIVEN, True
        )
        quantize_columns(x, s_dec_t, mult_t, u_t, h_ptr, data_t_ptr, scale_t_ptr, dq_t_ptr,
                         k0, m0, K, M, BK, BM, COL_2D, COL_SR, COL_HAD, DQ_COL, DOT_F32,
                         HW, COL_CODES, ENC_TABLE)  # fmt: skip


@triton.jit
def quantize_columns(
    x, s_dec_t, mult_t, u_t, h_ptr, data_t_ptr, scale_t_ptr, dq_t_ptr, k0, m0, K, M,
    BK: tl.constexpr, BM: tl.constexpr, COL_2D: tl.constexpr, COL_SR: tl.constexpr,
    COL_HAD: tl.constexpr, DQ_COL: tl.constexpr, DOT_F32: tl.constexpr, HW: tl.constexpr,
    CODES: tl.constexpr = True, TABLE: tl.constexpr = False,
):  # fmt: skip
    """The columnwise copy of a loaded [BM, BK] tile x (blocks along its BM rows, optionally
    Hadamard-transformed) stored at (k0, m0) of the [K, M] outputs (CODES False: its `_dq`
    only). Shared by the dense and the grouped kernels. HW: the GPU (not the interpreter)
    rounds the transform to BF16."""
    xt = tl.trans(x)
    if COL_HAD:
        vt = hadamard_16(xt, h_ptr, BK, BM, DOT_F32, HW)
    else:
        vt = relayout_16(xt, BK, BM, DOT_F32)
    packed_t, scode_t, dq_t, finite = _quantize_tile(
        vt, s_dec_t, mult_t, u_t, BK, BM, COL_2D, COL_SR, DQ_COL, HW, TABLE
    )
    if COL_HAD or finite:
        _store_quantized(
            packed_t, scode_t, dq_t, data_t_ptr, scale_t_ptr, dq_t_ptr,
            k0, m0, K, M, BK, BM, DQ_COL, CODES,
        )  # fmt: skip
    else:
        # Inf * 0 in the identity product made NaN: redo this tile from the plain transpose.
        packed_t, scode_t, dq_t, _ = _quantize_tile(
            xt.to(tl.float32), s_dec_t, mult_t, u_t, BK, BM, COL_2D, COL_SR, DQ_COL, HW, TABLE
        )
        _store_quantized(
            packed_t, scode_t, dq_t, data_t_ptr, scale_t_ptr, dq_t_ptr,
            k0, m0, K, M, BK, BM, DQ_COL, CODES,
        )  # fmt: skip


@triton.jit
def _nvfp4_dequantize_kernel(
    data_ptr, scale_ptr, out_ptr, R, C, rows_per, sd_b, sd_r, ss_b, ss_r, band,
    BR: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    """Packed codes + E4M3 scales -> BF16 code * scale (the `_dq` operand). Codes and scales
    are read where they lie, a [B, R/B, C/2] stack with strides (sd_b, sd_r, 1) and
    (ss_b, ss_r, 1) (`stack_rows`); the output is the contiguous [R, C]."""
    tile_r, tile_c = band_tile(band)
    r0 = tile_r * BR
    c0 = tile_c * BC
    rows = (r0 + tl.arange(0, BR)).to(tl.int64)  # (a stack of expert weights: > 2^31 values)
    half = c0 // 2 + tl.arange(0, BC // 2)
    rmask = rows < R
    packed = tl.load(
        data_ptr + stack_rows(rows, rows_per, sd_b, sd_r)[:, None] + half[None, :],
        mask=rmask[:, None] & (half < C // 2)[None, :],
        other=0,
    ).to(tl.int32)
    codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), [BR, BC])
    sc = c0 // 16 + tl.arange(0, BC // 16)
    scode = tl.load(
        scale_ptr + stack_rows(rows, rows_per, ss_b, ss_r)[:, None] + sc[None, :],
        mask=rmask[:, None] & (sc < C // 16)[None, :],
        other=0,
    ).to(tl.int32)
    sval = e4m3_byte_value(scode)
    idx = codes & 7
    big = idx >= 2
    mag = tl.where(big, ((idx + 252) << 22).to(tl.float32, bitcast=True), idx.to(tl.float32) * 0.5)
    val = with_sign(mag, (codes & 8) != 0)
    dq = tl.reshape(tl.reshape(val, [BR, BC // 16, 16]) * sval[:, :, None], [BR, BC])
    cols = c0 + tl.arange(0, BC)
    tl.store(
        out_ptr + rows[:, None] * C + cols[None, :],
        bf16_bits(dq),
        mask=rmask[:, None] & (cols < C)[None, :],
    )


# ----------------------------------------------------------------------------- launchers

# (BM, BK, num_warps[, maxnreg]) per kind of launch (_common.launch_tiles); measured on an
# H100 (docs/KERNELS.md). The benchmark may override these to sweep tile shapes.
# A `_dq` launch keeps twice the values live: tiles of 16 values per thread keep it under
# ~100 registers (occupancy), where 32 per thread suit the launches without dq. Since the ALU
# rewrite of 2026-11-26 the both-direction `_dq` launches want different tiles with and
# without stochastic rounding (H100 sweep, docs/KERNELS.md): nearest 64x64/4 (516 us against
# 546 at 32x64/4; 501 with a 128-register cap, which spills), stochastic 32x64/4 (580 against
# 737 at 64x64/4). The nearest one takes a 128-register cap since 2026-11-26 (later session):
# 48 bytes of spill for a fourth program an SM, and the forward's input kernel (row `_dq`
# only) 422 -> 404 us at 16384 x 8192 and 113 -> 108 us at 16384 x 2048 on the H100.
# The stochastic one takes an 80-register cap since the rounding became one `add_rp`
# (2026-11-26, last session): without it the kernel took 105 registers (4 programs an SM)
# and 596 against 554 us at 16384 x 8192; with it (6 programs an SM, no spill) 543, 377 and
# 147 us against 550-554, 385 and 153 at 16384 x 8192, 5632 and 2048, and 1854 against 1895
# at 65536 x 7168 (H100, bench_quantize); a 96 cap tied the old kernel. Since the encode
# table and the hardware E4M3 codec (2026-12-02) grad_output's launch as the emulated GEMMs
# take it (both copies their `_dq` alone) runs faster with 32 values a thread, 32x128/4 at
# 128 registers (4 programs an SM, 1.88 warp instructions a value against 2.25):
# "both_sr_dq_only", 257 against 273 us at [16384, 5632] and 103 against 108 at [16384, 2048]
# on the H200, but not below WIDE_COLS columns (k / v's [16384, 512]: 44.6 against 38.1 us;
# docs/KERNELS.md). The launch that also writes codes was not timed at it and keeps its tile.
WIDE_COLS = 2048
TILES = {
    "row": (64, 128, 8),
    "row_dq": (32, 128, 8),
    "col": (64, 64, 4),
    "col_dq": (64, 64, 8),
    "both": (64, 64, 4),
    "both_dq": (64, 64, 4, 128),
    "both_sr_dq": (32, 64, 4, 80),
    "both_sr_dq_only": (32, 128, 4, 128),
}


def _empty_like_spec(rows: int, cols: int, device, dq: bool, codes: bool = True):
    data = empty_rows(rows if codes else 0, cols // 2, torch.uint8, device)
    scale = empty_rows(rows if codes else 0, cols // BLOCK, torch.uint8, device)
    dq_t = empty_rows(rows if dq else 0, cols if dq else 0, torch.bfloat16, device)
    return data, scale, dq_t


@library_op("blockscale::nvfp4_quantize_2d", mutates_args=(), triton=True, any_strides=True)
def _nvfp4_quantize_2d(
    x: torch.Tensor,
    amax_row: torch.Tensor,
    amax_col: torch.Tensor,
    seed: torch.Tensor | None,
    rand_row: torch.Tensor | None,
    rand_col: torch.Tensor | None,
    row: bool,
    col: bool,
    row_2d: bool,
    col_2d: bool,
    row_sr: bool,
    col_sr: bool,
    col_hadamard: bool,
    dq_row: bool,
    dq_col: bool,
    row_codes: bool = True,
    col_codes: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] -> rowwise (data [M, K/2], scale [M, K/16], dq [M, K]) and columnwise
    (data_t [K, M/2], scale_t [K, M/16], dq_t [K, M]) outputs; unused ones (and a `_dq` not
    asked for) are empty. Scales are raw E4M3 bytes (uint8). amax_* are FP32 device scalars.
    `row_codes=False` with `dq_row`: the rowwise copy's `_dq` only, its codes and scales
    empty ([0, K/2], [0, K/16]): for a caller that feeds an emulated GEMM and keeps nothing;
    `col_codes=False` with `dq_col` the same for the columnwise copy ([0, M/2], [0, M/16]).
    It is also a call a compiled graph cannot merge with the same copy's full call (a
    compiled backward's rebuild of the forward's weight copy: ops/linear.py, "Memory")."""
    M, K = x.shape
    dev = x.device
    outs, (dq_row, dq_col, row_codes, col_codes) = copy_outputs(
        _empty_like_spec, M, K, M, dev, row, col, dq_row, dq_col, row_codes, col_codes
    )
    data, scale, dq_r, data_t, scale_t, dq_c = outs
    if M == 0 or K == 0 or not (row or col):
        return data, scale, dq_r, data_t, scale_t, dq_c
    rand_given = rand_row is not None or rand_col is not None
    dummy = amax_row
    kind = launch_kind(row, col, dq_row or dq_col, (row and row_sr) or (col and col_sr))
    if kind == "both_sr_dq" and K >= WIDE_COLS and not (row_codes or col_codes):
        kind = "both_sr_dq_only"
    bm, bk, options = launch_tiles(TILES[kind])
    grid, band = band_grid(M, K, bm, bk)
    launch(_nvfp4_quantize_kernel, grid,
        x, x.stride(0), x.stride(1), M, K,
        amax_row, amax_col, hadamard_matrix(dev),
        seed if seed is not None else dummy,
        rand_row if rand_row is not None else dummy,
        rand_col if rand_col is not None else dummy,
        data, scale, dq_r.view(torch.int16), data_t, scale_t, dq_c.view(torch.int16),
        ROW=row, COL=col, ROW_2D=row_2d, COL_2D=col_2d, ROW_SR=row_sr, COL_SR=col_sr,
        COL_HAD=col_hadamard, RAND_GIVEN=rand_given, DQ_ROW=dq_row, DQ_COL=dq_col,
        band=band, DOT_F32=dot_in_fp32(x), HW=not interpreting(), ENC_TABLE=ENC_TABLE,
        BM=bm, BK=bk, ROW_CODES=row_codes, COL_CODES=col_codes, **options,
    )  # fmt: skip
    return data, scale, dq_r, data_t, scale_t, dq_c


@library_op("blockscale::nvfp4_dequantize_3d", mutates_args=(), triton=True)
def _nvfp4_dequantize_3d(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """data uint8 [B, R, C/2], scale uint8 (E4M3 bytes) [B, R, C/16], any strides along B and
    R, unit stride along C -> BF16 [B, R, C], contiguous."""
    B, R, half = data.shape
    C = half * 2
    out = torch.empty(B, R, C, dtype=torch.bfloat16, device=data.device)
    if B and R and C:
        grid, band = band_grid(B * R, C, 32, 128)
        launch(_nvfp4_dequantize_kernel, grid,
            data, scale, out.view(torch.int16), B * R, C, R, *data.stride()[:2],
            *scale.stride()[:2], band, BR=32, BC=128, num_warps=4,
        )  # fmt: skip
    return out


# ----------------------------------------------------------------------------- Python API


def _check(block: str, rounding: str) -> None:
    if block not in BLOCKS:
        raise ValueError(f"block={block!r} is not one of {BLOCKS}")
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding={rounding!r} is not one of {ROUNDINGS}")


def _as_amax(amax: torch.Tensor, device) -> torch.Tensor:
    return amax.detach().to(device=device, dtype=torch.float32).reshape(1)


def _container(data, scale, amax, shape, block, hadamard) -> NVFP4Tensor:
    lead = shape[:-1]
    return NVFP4Tensor(
        data=data.reshape(*lead, shape[-1] // 2),
        scale=scale.view(torch.float8_e4m3fn).reshape(*lead, shape[-1] // BLOCK),
        amax=amax.reshape(()),
        shape=torch.Size(shape),
        block=block,
        hadamard=hadamard,
    )


def nvfp4_quantize(
    x: torch.Tensor,
    block: str = "1x16",
    rounding: str = "nearest",
    hadamard: bool = False,
    transpose: bool = False,
    generator: torch.Generator | None = None,
    amax: torch.Tensor | None = None,
    return_dq: bool = False,
    rand: torch.Tensor | None = None,
):
    """formats.nvfp4.quantize, fast. With return_dq, also the exact BF16 code * scale operand
    (same layout as the container's .dq()). `rand` (tests only): FP32 uniforms shaped like the
    quantized [rows, cols] tensor, used instead of the hashed bits for stochastic rounding."""
    _check(block, rounding)
    x2 = _checks.as_2d(x, "NVFP4", False)
    M, K = x2.shape
    if transpose:
        _checks.check_blocks(K, M, "NVFP4", BLOCK if block == "16x16" else 1, BLOCK)
        shape = torch.Size((K, M))
    else:
        _checks.check_blocks(M, K, "NVFP4", BLOCK if block == "16x16" else 1, BLOCK)
        shape = x.shape
    rand2 = None if rand is None else rand.reshape(-1, shape[-1]).float().contiguous()
    data, scale, dq, amax = quantize_2d(
        x2, block == "16x16", rounding == "stochastic", hadamard, transpose, amax, return_dq,
        generator, rand2,
    )  # fmt: skip
    q = _container(data, scale, amax, shape, block, hadamard)
    if return_dq:
        return q, dq.reshape(shape)
    return q


def nvfp4_quantize_both(
    x: torch.Tensor,
    rowwise: dict | None = None,
    columnwise: dict | None = None,
    return_dq: bool = False,
    generator: torch.Generator | None = None,
):
    """The rowwise copy of x and the columnwise copy (the quantization of x.T, optionally
    Hadamard) from one read of x. Each dict takes block, rounding, amax (and, for the
    columnwise copy, hadamard). Returns (q_row, q_col), or ((q_row, dq_row), (q_col, dq_col))
    with return_dq: True for both `_dq` operands, or a pair (row, col) of flags, where a copy
    whose flag is False gets None (its `_dq` is not written). The global amaxes, when not
    given, come from one fused amax pass."""
    want_row, want_col = dq_flags(return_dq)
    r = {"block": "1x16", "rounding": "nearest", "amax": None, **(rowwise or {})}
    c = {
        "block": "1x16",
        "rounding": "nearest",
        "hadamard": False,
        "amax": None,
        **(columnwise or {}),
    }
    if r.pop("hadamard", False):
        raise ValueError("the rowwise copy of nvfp4_quantize_both takes no Hadamard transform")
    unknown = (set(r) - {"block", "rounding", "amax"}) | (
        set(c) - {"block", "rounding", "hadamard", "amax"}
    )
    if unknown:
        raise ValueError(f"unknown options {sorted(unknown)}")
    _check(r["block"], r["rounding"])
    _check(c["block"], c["rounding"])
    x2 = _checks.as_2d(x, "NVFP4", False)
    M, K = x2.shape
    _checks.check_blocks(M, K, "NVFP4", BLOCK if r["block"] == "16x16" else 1, BLOCK)
    _checks.check_blocks(K, M, "NVFP4", BLOCK if c["block"] == "16x16" else 1, BLOCK)
    data, scale, dq, amax_r, data_t, scale_t, dq_t, amax_c = quantize_both_2d(
        x2, r["block"] == "16x16", r["rounding"] == "stochastic", c["block"] == "16x16",
        c["rounding"] == "stochastic", c["hadamard"], r["amax"], c["amax"], want_row, want_col,
        generator,
    )  # fmt: skip
    q_row = _container(data, scale, amax_r, x.shape, r["block"], False)
    q_col = _container(data_t, scale_t, amax_c, torch.Size((K, M)), c["block"], c["hadamard"])
    if return_dq is not False:
        return (
            (q_row, dq.reshape(x.shape) if want_row else None),
            (q_col, dq_t if want_col else None),
        )
    return q_row, q_col


def _no_grad(t: torch.Tensor, traced: bool | None = None) -> torch.Tensor:
    """t detached where autograd tracks it, and always under a trace (eager calls save the
    op; `traced`: `tracing()`, where the caller asked already). Traced, the detach is kept:
    without it AOTAutograd's partitioner saved 22% more for the backward of a compiled nvfp4
    Llama (tests/test_saved_activations.py)."""
    if t.requires_grad:
        return t.detach()
    return t.detach() if (tracing() if traced is None else traced) else t


def quantize_2d(
    x2: torch.Tensor,
    block_2d: bool,
    sr: bool,
    hadamard: bool,
    transpose: bool,
    amax: torch.Tensor | None,
    dq: bool,
    generator: torch.Generator | None = None,
    rand: torch.Tensor | None = None,
    codes: bool = True,
) -> tuple[torch.Tensor, ...]:
    """The launch of `nvfp4_quantize`, for it and for callers that checked their arguments
    (ops/quantize.py: the blocks fit, options from a validated OperandConfig), which then
    skip its checks and containers. Returns (data, scale bytes, dq or an empty tensor, amax
    as an FP32 scalar). `rand`: `nvfp4_quantize`'s, as FP32 [rows, cols] of the copy.
    `codes=False` with `dq`: a rowwise copy's `_dq` alone (`_nvfp4_quantize_2d`'s
    `row_codes`); a columnwise one is written whole."""
    # The kernel applies the Hadamard transform only on its columnwise path, so a rowwise
    # Hadamard copy is the columnwise copy of x's transpose view.
    src, col = (x2.t(), True) if (hadamard and not transpose) else (x2, transpose)
    if amax is None:
        amax = amax_of_copy(src, hadamard_t=hadamard)
    elif amax.dtype != torch.float32 or amax.dim() or amax.device != x2.device:
        amax = _as_amax(amax, x2.device).reshape(())
    seed = sr_seed(x2.device, generator) if sr and rand is None else None
    out = _nvfp4_quantize_2d(
        src, amax, amax, seed, None if col else rand, rand if col else None,
        row=not col, col=col, row_2d=block_2d, col_2d=block_2d, row_sr=sr, col_sr=sr,
        col_hadamard=hadamard, dq_row=dq, dq_col=dq, row_codes=codes,
    )  # fmt: skip
    data, scale, dq_t = out[3:] if col else out[:3]
    return data, scale, dq_t, _no_grad(amax)


def quantize_both_2d(
    x2: torch.Tensor,
    row_2d: bool,
    row_sr: bool,
    col_2d: bool,
    col_sr: bool,
    col_hadamard: bool,
    amax_row: torch.Tensor | None,
    amax_col: torch.Tensor | None,
    dq_row: bool,
    dq_col: bool,
    generator: torch.Generator | None = None,
    codes: bool = True,
) -> tuple[torch.Tensor, ...]:
    """The launch of `nvfp4_quantize_both`, for it and for callers that checked their
    arguments (ops/quantize.py: x2 [M, K] with M and K multiples of 16, options from a
    validated OperandConfig), which then skip its option dicts, checks and containers.
    The global amaxes, when not given, come from one fused amax pass. Returns (data,
    scale bytes, dq or an empty tensor, row amax, data_t, scale_t bytes, dq_t, column amax),
    each amax an FP32 scalar tensor (given ones converted as `nvfp4_quantize_both` does).
    `codes=False`: a copy with its `_dq` is written as the `_dq` alone (data, scale empty)."""
    # (amaxes this call finds are FP32 scalars on x2's device already: only given ones convert)
    if amax_row is None or amax_col is None:
        plain, had = amax_fused(x2, hadamard_t=col_hadamard)
    if amax_row is None:
        amax_row = plain
    elif amax_row.dtype != torch.float32 or amax_row.dim() or amax_row.device != x2.device:
        amax_row = _as_amax(amax_row, x2.device).reshape(())
    if amax_col is None:
        amax_col = had if col_hadamard else plain
    elif amax_col.dtype != torch.float32 or amax_col.dim() or amax_col.device != x2.device:
        amax_col = _as_amax(amax_col, x2.device).reshape(())
    seed = sr_seed(x2.device, generator) if row_sr or col_sr else None
    data, scale, dq, data_t, scale_t, dq_t = _nvfp4_quantize_2d(
        x2, amax_row, amax_col, seed, None, None,
        row=True, col=True, row_2d=row_2d, col_2d=col_2d, row_sr=row_sr, col_sr=col_sr,
        col_hadamard=col_hadamard, dq_row=dq_row, dq_col=dq_col, row_codes=codes,
        col_codes=codes,
    )  # fmt: skip
    traced = tracing()
    return (data, scale, dq, _no_grad(amax_row, traced), data_t, scale_t, dq_t,
            _no_grad(amax_col, traced))  # fmt: skip


def nvfp4_dequantize_dq(q: NVFP4Tensor) -> torch.Tensor:
    """The BF16 `_dq` operand (code * block scale, no global scale) of a saved NVFP4Tensor;
    equals q.dq(). Contiguous; the codes are read in place, also a stack of strided views (a
    1x16 recipe's expert copies along N)."""
    data, scale = q.data, q.scale.view(torch.uint8)
    if len(q.shape) != 2 or data.dim() != 2:  # (a 2-D operand's are [R, C/2] and [R, C/16])
        lead, cols = q.shape[:-1], q.shape[-1]
        data, scale = data.reshape(*lead, cols // 2), scale.reshape(*lead, cols // BLOCK)
    return _nvfp4_dequantize_3d(row_stack(data), row_stack(scale)).reshape(q.shape)
