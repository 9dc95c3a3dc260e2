"""The emulated grouped GEMMs with their per-group epilogue: one launch per grouped GEMM, the
group layout read from the device (no host synchronization), the FP32 accumulator scaled by
each group's alpha and rounded to the output dtype in registers.

Two shapes, as a mixture-of-experts layer needs them (see ops/grouped_mm.py):

- **rows** (output and grad_input): out[rows of group e] = a[rows of e] @ b[e].T * alpha_e,
  a [M, K] K-major with rows grouped by `offs`, b [E, N, K] with unit stride along K or
  along N (the transposed 16x16 weight of grad_input is a strided view, read as it is).
  Output tiles are laid out group by group: group e has ceil(size_e / BM) row tiles, whose
  prefix sums (`tile_ends`, computed on the device) the program searches for its group. Rows
  past offs[-1] form one more group whose tiles store zeros, so the output is fully written
  (PyTorch's grouped GEMM leaves those rows uninitialized).
- **tokens** (grad_weight): out[e] = a[:, segment e] @ b[:, segment e].T * alpha_e, a [N, P]
  and b [K, P] in formats/grouped.py's token layout, whose segments start at multiples of 64
  (the contraction tile), so a segment is walked in whole tiles; out [E, N, K]. An empty
  segment gives a zero gradient.

Packed weights (`grouped_gemm_rows_packed`, the rows kernel with B_FORMAT set): the expert
weight is read as its packed copy (NVFP4 codes and E4M3 scales, or MXFP8 codes and E8M0
scales, plain loads) and each tile decoded in registers to exactly the `_dq` values before the
product, so no `_dq` of the weight is written or read; the same tiles, order and epilogue, so
the bits of the `_dq` kernel up to the MMA's own order (docs/KERNELS.md, "Rows GEMMs that read
the expert weights packed": bit-equal on an H200 but slower than the `_dq` path, so off).

alpha_e = S_dec(amax_a[e]) * S_dec(amax_b[e]) for NVFP4 (as epilogue.py computes it), none for
MXFP8; the product is rounded on its own (mul.rn), then round-to-nearest-even to BF16. Each
group's result equals the dense emulated GEMM's up to the order of the FP32 additions.

Reads go through TMA descriptors (2-D for the activations, 3-D for expert weights and the
grad_weight output, so no tile crosses an expert); row tiles are stored with a masked store,
since a tile's rows may end inside it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from blockscale._registry import library_op
from blockscale.kernels import epilogue
from blockscale.kernels._common import (
    cdiv,
    e4m3_byte_value,
    exp2_int,
    interpreting,
    round_to_bf16,
    to_bf16_bits,
    with_sign,
)
from blockscale.kernels._launch import direct, scratch
from blockscale.kernels.epilogue import _decode_scale, _mul_rn
from blockscale.kernels.gemm import _programs, _tile

# (BM, BN, BK, num_warps, num_stages). BK must divide formats.grouped.TOKEN_ALIGN (64).
# Measured on an H100 (`bench_grouped_mm.py --gemms`, docs/KERNELS.md): 128x256 tiles ran
# 10-25% faster than 128x128 on the DeepSeek-V3-like and Llama-4-like expert shapes; 4 stages
# suit the grad_weight kernel, 3 the row kernels.
ROWS_CONFIG = (128, 256, 64, 8, 3)
TOKENS_CONFIG = (128, 256, 64, 8, 4)
# Persistent launches (one program per SM walking the tiles) and the order of the tiles,
# measured on an H100 (docs/KERNELS.md, "Tile order", 2026-11-26): walking GROUP_M row tiles
# at a time down each column tile (kernels/gemm.py's `_tile`) keeps the operand tiles that
# the programs running at once share in L2. grad_weight (tokens) took 3945 -> 2711 us
# (DeepSeek-V3-like, 65536 tokens, 8 experts; CUTLASS 2829) and 9607 -> 7797 us
# (Llama-4-like) persistent with 8 row tiles a band, against row by row one program a tile;
# row by row it had run persistent only with segments of at most 1024 tokens, and slower
# above. The output GEMM (K-major expert weight) runs persistent (5-17% faster than one
# program a tile, 2026-11-25, when its loops, asked to flatten, in fact stayed nested:
# ROWS_FUSED_LOOPS below) with bands of 8 (Llama-4-like 9281 -> 7910 us, CUTLASS 8793);
# grad_input (the N-major transposed 16x16 weight) ran one program a tile with bands of 16
# (DeepSeek-V3-like 3146 -> 2855 us) until its loops fused (2026-12-01), and persistent since
# then (0-16% faster than one program a tile at 128-256 experts). 4 stages do not fit the
# persistent grad_weight kernel's shared memory; it runs 3. Only BF16 outputs run persistent
# with one TMA store of the tile: an FP32 output tile (grad_weight of FP32 master weights)
# stored that way with 3 stages is past Hopper's 227 KiB, so an FP32 output stores its tile
# another way (TOKENS_FP32_LAUNCH below).
ROWS_PERSISTENT_KMAJOR = True
ROWS_PERSISTENT_NMAJOR = True  # (since its loops fuse, ROWS_FUSED_LOOPS below)
ROWS_GROUP_M_KMAJOR = 8
ROWS_GROUP_M_NMAJOR = 16
TOKENS_PERSISTENT = True
TOKENS_GROUP_M = 8
TOKENS_PERSISTENT_STAGES = 3
# How grad_weight runs with an FP32 output (FP32 master weights, what users train with):
# "per_tile", one program a tile storing the FP32 tile through TMA in one piece;
# "halves", persistent, the tile stored through TMA as two [BM, BN/2] halves, so the epilogue
# needs the BF16 tile's shared memory; "pointers", persistent, the tile stored from registers
# as the rows kernel stores its output, so the epilogue needs none and the pipeline keeps
# TOKENS_CONFIG's stages. Compiled for sm_90 on the CPU (Triton 3.6, 128x256x64, 8 warps):
# one persistent TMA store of the FP32 tile with 3 stages needs 278,552 bytes of shared
# memory (past Hopper's 232,448); "halves" 213,016 (the BF16 persistent launch's figure);
# "pointers" with 4 stages 196,640, no spills; "per_tile" with 4 stages 196,640. Every choice
# gives the same bits (tests/test_grouped_mm.py). "pointers" by measurement (one H200, torch
# 2.11, 2026-11-29, `bench_grouped_mm.py --gemms`, docs/KERNELS.md "grad_weight with FP32
# outputs"): at the Qwen3-30B-A3B-like and DeepSeek-V3-like experts (128 and 256, 131072 rows)
# it ran 8-9% faster than "halves" and 1-11% faster than "per_tile"; at the Mixtral-like up
# projection (8 experts) 2% behind "halves" (12.13 against 11.88 ms) and 13% ahead of
# "per_tile"; the compiled Mixtral-like step was level with "halves" (0.949x / 0.970x BF16,
# nvfp4 / mxfp8, against 0.950x / 0.964x; per_tile 0.927x / 0.936x).
TOKENS_FP32_LAUNCH = "pointers"
TOKENS_FP32_LAUNCHES = ("per_tile", "halves", "pointers")
# The rows kernel (output and grad_input, BF16 outputs, the weight's `_dq`) persistent and
# warp-specialized: Triton 3.6 splits it for sm_90 into a producer warpgroup (the TMA loads)
# and two consumer warpgroups (wgmma, epilogue), registers rebalanced with setmaxnreg, only
# with 4 warps a config (12 warps run; compiled on the CPU, docs/KERNELS.md, "Warp
# specialization on Hopper"). With 8 warps the flag compiles to the same PTX as without.
# Aimed at the down projection's output GEMM, whose short contraction (K 512-768) leaves
# each tile's epilogue exposed (CUTLASS at 0.80x of its time). Off: on an H200 (2026-11-29)
# its first launch at the Qwen3-like down projection had not finished 150 s later, with A
# through the host-made descriptor, whose 128-row box the split copies (64 rows a consumer)
# did not match. With A's descriptor made in the kernel (A_DEVICE_DESC; a 64-row box in the
# compiled code) it finishes, but wrongly (2026-12-01, H200: NaN and 58-70% of the elements
# unequal to the same tiles without it, different from run to run, in both halves of every
# tile: benchmarks/research/ws_rows_check.py). ROWS_WS_CONFIG is its tile (BM, BN, BK,
# num_warps, num_stages).
ROWS_WARP_SPECIALIZE = False
ROWS_WS_CONFIG = (128, 256, 64, 4, 3)
# The persistent rows launch's tile loop fused with its K loop (Triton's FuseNestedLoops, what
# `flatten=True` asks for): it fuses only a K loop whose trip count does not depend on the tile,
# and the tiles past offs[-1] used to skip theirs (a trip count of 0), so `flatten` was
# silently not applied and each tile's first loads waited for the tile before to finish.
# Compiled for sm_90 on the CPU: one loop instead of two, the next tile's TMA loads inside the
# K loop. The tiles past offs[-1] now run the contraction on expert E - 1's weight and store
# zeros (rare: transformers' MoE has no rows past offs[-1]). Timed on an H200 (2026-12-01,
# `bench_grouped_mm.py --gemms`, 131072 rows; docs/KERNELS.md, "The rows launch's loops,
# fused"): the output GEMM 2-6% faster at 128-256 experts, and grad_input, persistent with
# it, 0-16% faster than one program a tile; so both are on, grad_input persistent.
ROWS_FUSED_LOOPS = True
# _tokens_tile's STORE: the output tile in one TMA store, in two halves, or from registers
STORE_HALVES = tl.constexpr(1)
STORE_POINTERS = tl.constexpr(2)
_STORES = {"halves": STORE_HALVES.value, "pointers": STORE_POINTERS.value}  # else 0: one store
OPERAND_DTYPES = (torch.bfloat16, torch.float32)
# The rows kernel with the expert weight read packed (`grouped_gemm_rows_packed`): its own
# tiles, since each program also decodes its weight tile in registers. The rows kernel's: on
# an H200 (docs/KERNELS.md, "Rows GEMMs that read the expert weights packed") no config of
# `bench_grouped_mm.py --packed`'s sweep came near the `_dq` path, 128x256 and 128x128 the
# fastest (8 and 7 of 16 GEMMs).
ROWS_PACKED_CONFIG = ROWS_CONFIG
# What the rows kernel's B_FORMAT says about the expert weight it reads: the BF16 (or FP32)
# `_dq` tensor through TMA, or packed NVFP4 / MXFP8 codes and scales through plain loads.
B_DQ = tl.constexpr(0)
B_NVFP4 = tl.constexpr(1)
B_MXFP8 = tl.constexpr(2)
PACKED_FORMATS = {"nvfp4": 1, "mxfp8": 2}


@triton.jit
def _dot(a, b, acc, DOT_F32: tl.constexpr):
    if DOT_F32:  # Triton's interpreter (numpy) has no BF16 product
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _alpha(amax_a_ptr, amax_b_ptr, g, E, HAS_ALPHA: tl.constexpr):
    if HAS_ALPHA:
        ok = g < E
        a = _decode_scale(tl.load(amax_a_ptr + g, mask=ok, other=1.0))
        b = _decode_scale(tl.load(amax_b_ptr + g, mask=ok, other=1.0))
        return tl.where(ok, a * b, 1.0)
    else:
        return 1.0


@triton.jit
def _find_group(tile_ends_ptr, t, E, SEARCH_STEPS: tl.constexpr):
    """The smallest g in [0, E] with tile_ends[g] > t (binary search over E + 1 entries)."""
    lo = t * 0
    hi = lo + E
    for _ in tl.static_range(SEARCH_STEPS):
        active = lo < hi
        mid = (lo + hi) // 2
        right = tl.load(tile_ends_ptr + mid) <= t
        lo, hi = tl.where(active & right, mid + 1, lo), tl.where(active & ~right, mid, hi)
    return lo


@triton.jit
def e2m1_value(codes):
    """int32 E2M1 codes (0..15) -> FP32 values; code 8 is -0.0, as formats/e2m1.decode."""
    idx = codes & 7
    big = idx >= 2
    mag = tl.where(big, ((idx + 252) << 22).to(tl.float32, bitcast=True), idx.to(tl.float32) * 0.5)
    return with_sign(mag, (codes & 8) != 0)


@triton.jit
def _packed_tile(q_ptr, s_ptr, strides, g, r0, c0, R, C, B_FORMAT: tl.constexpr,
                 DOT_F32: tl.constexpr, HW: tl.constexpr, TR: tl.constexpr,
                 TC: tl.constexpr):  # fmt: skip
    """Rows r0.. and columns c0.. ([TR, TC]) of expert g's `_dq` operand, decoded from the
    packed copy [E, R, C] (quantized along C; `strides`: the codes' and the scales' strides
    along E and R, unit along C): code value times
    decoded block scale in FP32, as the dequantize kernels form it, then BF16 (FP32 under
    DOT_F32, holding the BF16 value). Out-of-range rows and columns read as zero, as TMA's
    padding gives them to the `_dq` path."""
    stride_qe, stride_qr, stride_se, stride_sr = strides
    rows = (r0 + tl.arange(0, TR))[:, None]
    rmask = rows < R
    g64 = g.to(tl.int64)  # (a stack of expert weights passes 2^31 bytes)
    q_rows = q_ptr + g64 * stride_qe + rows.to(tl.int64) * stride_qr
    s_rows = s_ptr + g64 * stride_se + rows.to(tl.int64) * stride_sr
    if B_FORMAT == B_NVFP4:
        half = c0 // 2 + tl.arange(0, TC // 2)
        packed = tl.load(q_rows + half[None, :],
                         mask=rmask & (half < C // 2)[None, :], other=0).to(tl.int32)  # fmt: skip
        codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), [TR, TC])
        sc = c0 // 16 + tl.arange(0, TC // 16)
        scode = tl.load(s_rows + sc[None, :],
                        mask=rmask & (sc < C // 16)[None, :], other=0).to(tl.int32)  # fmt: skip
        v = tl.reshape(e2m1_value(codes), [TR, TC // 16, 16]) * e4m3_byte_value(scode)[:, :, None]
    else:
        cols = c0 + tl.arange(0, TC)
        byte = tl.load(q_rows + cols[None, :],
                       mask=rmask & (cols < C)[None, :], other=0).to(tl.int32)  # fmt: skip
        sc = c0 // 32 + tl.arange(0, TC // 32)
        ecode = tl.load(s_rows + sc[None, :],
                        mask=rmask & (sc < C // 32)[None, :], other=127).to(tl.int32)  # fmt: skip
        scale = tl.where(ecode == 255, float("nan"), exp2_int(ecode - 127))
        v = tl.reshape(e4m3_byte_value(byte), [TR, TC // 32, 32]) * scale[:, :, None]
    # NVFP4's products are exact in BF16; an MXFP8 product below 2^-133 rounds, as in `_dq`
    v = tl.reshape(v, [TR, TC])
    if DOT_F32:
        return round_to_bf16(v, HW)
    else:
        return v.to(tl.bfloat16)


@triton.jit
def _rows_k_step(a_desc, b_desc, bq_ptr, bs_ptr, b_strides, r0, n0, g, ki, N, K, acc,
                 B_KMAJOR: tl.constexpr, B_FORMAT: tl.constexpr, DOT_F32: tl.constexpr,
                 HW: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    """acc + one BK step of the contraction: rows r0.. of a against expert g's weight tile n0..
    The weight comes from its `_dq` (b_desc) or, with B_FORMAT, packed (bq_ptr, bs_ptr and
    their strides along E and R, `b_strides`: the
    copy along K [E, N, K] when B_KMAJOR, else the 16x16 copy [E, K, N] read transposed)."""
    a = a_desc.load([r0, ki * BK])
    if B_FORMAT == B_DQ:
        if B_KMAJOR:
            b = tl.reshape(b_desc.load([g, n0, ki * BK]), [BN, BK]).T
        else:
            b = tl.reshape(b_desc.load([g, ki * BK, n0]), [BK, BN])
    elif B_KMAJOR:
        b = _packed_tile(bq_ptr, bs_ptr, b_strides, g, n0, ki * BK, N, K, B_FORMAT, DOT_F32,
                         HW, BN, BK).T  # fmt: skip
    else:
        b = _packed_tile(bq_ptr, bs_ptr, b_strides, g, ki * BK, n0, K, N, B_FORMAT, DOT_F32,
                         HW, BK, BN)  # fmt: skip
    return _dot(a, b, acc, DOT_F32)


@triton.jit
def _rows_tile(
    a_desc, b_desc, bq_ptr, bs_ptr, b_strides, out_ptr, stride_om, offs_ptr, tile_ends_ptr, amax_a_ptr,
    amax_b_ptr, t, pid_n, M, N, K, E,
    HAS_ALPHA: tl.constexpr, OUT_BF16: tl.constexpr, ASM: tl.constexpr, B_KMAJOR: tl.constexpr,
    B_FORMAT: tl.constexpr, DOT_F32: tl.constexpr, INTERPRET: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FUSED: tl.constexpr = False,
    HW_BF16: tl.constexpr = False,
):  # fmt: skip
    """Output tile (row tile t of the group layout, column tile pid_n). FUSED: every tile runs
    the whole contraction, so the K loop's trip count does not depend on the tile and Triton can
    fuse it with the persistent tile loop (the next tile's loads issued during this tile's
    last steps and epilogue); the tiles past offs[-1] read expert E - 1's weight and store
    zeros."""
    g = _find_group(tile_ends_ptr, t, E, SEARCH_STEPS)
    first_tile = tl.load(tile_ends_ptr + g - 1, mask=g > 0, other=0)
    start = tl.load(offs_ptr + g - 1, mask=g > 0, other=0)
    end = tl.load(offs_ptr + g, mask=g < E, other=M)
    r0 = start + (t - first_tile) * BM
    n0 = pid_n * BN
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    # the group past offs[-1] (g == E) only stores zeros
    if FUSED:
        k_tiles = tl.cdiv(K, BK)
        g_read = tl.minimum(g, E - 1)
    else:
        k_tiles = tl.where(g < E, tl.cdiv(K, BK), 0)
        g_read = g
    if INTERPRET:
        ki = 0
        while ki < k_tiles:
            acc = _rows_k_step(a_desc, b_desc, bq_ptr, bs_ptr, b_strides, r0, n0, g_read, ki, N, K,
                               acc, B_KMAJOR, B_FORMAT, DOT_F32, ASM, BN, BK)  # fmt: skip
            ki += 1
    else:
        for ki in range(k_tiles):
            acc = _rows_k_step(a_desc, b_desc, bq_ptr, bs_ptr, b_strides, r0, n0, g_read, ki, N, K,
                               acc, B_KMAJOR, B_FORMAT, DOT_F32, ASM, BN, BK)  # fmt: skip
    if FUSED:
        acc = tl.where(g < E, acc, 0.0)
    alpha = _alpha(amax_a_ptr, amax_b_ptr, g, E, HAS_ALPHA)
    acc = _mul_rn(acc, tl.broadcast_to(alpha, [BM, BN]), ASM)
    rows = r0 + tl.arange(0, BM)
    cols = n0 + tl.arange(0, BN)
    mask = (rows < end)[:, None] & (cols < N)[None, :]
    dst = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    if OUT_BF16:
        tl.store(dst, to_bf16_bits(acc, HW_BF16), mask=mask)
    else:
        tl.store(dst, acc, mask=mask)


@triton.jit
def _rows_kernel(
    a_desc, b_desc, bq_ptr, bs_ptr, stride_qe, stride_qr, stride_se, stride_sr, out_ptr,
    stride_om, offs_ptr, tile_ends_ptr, amax_a_ptr, amax_b_ptr, M, N, K, E, num_pid_n,
    HAS_ALPHA: tl.constexpr, OUT_BF16: tl.constexpr, ASM: tl.constexpr, B_KMAJOR: tl.constexpr,
    B_FORMAT: tl.constexpr, DOT_F32: tl.constexpr, INTERPRET: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    PERSISTENT: tl.constexpr, PROGRAMS: tl.constexpr, FLATTEN: tl.constexpr,
    GROUP_M: tl.constexpr, WARP_SPECIALIZE: tl.constexpr = False,
    A_DEVICE_DESC: tl.constexpr = False, a_ptr=None, stride_am=None,
    FUSED: tl.constexpr = False, HW_BF16: tl.constexpr = False,
):  # fmt: skip
    if A_DEVICE_DESC:
        # a descriptor made here, whose box the compiler may shape: warp-specialized, each
        # consumer's half of the row tile is copied with a box of that half (a host-made
        # descriptor keeps the host's BM rows; docs/KERNELS.md, "Warp specialization on Hopper")
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_am, 1],
                                           block_shape=[BM, BK])  # fmt: skip
    b_strides = (stride_qe, stride_qr, stride_se, stride_sr)  # (of a packed weight)
    # tile_ends[E]: the row tiles of all groups, the one past offs[-1] included
    num_row_tiles = tl.load(tile_ends_ptr + E)
    num_tiles = num_row_tiles * num_pid_n
    if PERSISTENT:
        # one program per SM walks the tiles; with FLATTEN the next tile's loads overlap this
        # tile's epilogue (the interpreter cannot iterate a runtime range under numpy 2)
        if INTERPRET:
            tile_id = tl.program_id(0)
            while tile_id < num_tiles:
                t, pid_n = _tile(tile_id, num_row_tiles, num_pid_n, GROUP_M)
                _rows_tile(a_desc, b_desc, bq_ptr, bs_ptr, b_strides, out_ptr, stride_om, offs_ptr,
                           tile_ends_ptr, amax_a_ptr, amax_b_ptr, t, pid_n, M, N, K, E,
                           HAS_ALPHA, OUT_BF16, ASM, B_KMAJOR, B_FORMAT, DOT_F32, INTERPRET,
                           SEARCH_STEPS, BM, BN, BK, FUSED, HW_BF16)  # fmt: skip
                tile_id += PROGRAMS
        else:
            for tile_id in tl.range(tl.program_id(0), num_tiles, PROGRAMS, flatten=FLATTEN,
                                    warp_specialize=WARP_SPECIALIZE):  # fmt: skip
                t, pid_n = _tile(tile_id, num_row_tiles, num_pid_n, GROUP_M)
                _rows_tile(a_desc, b_desc, bq_ptr, bs_ptr, b_strides, out_ptr, stride_om, offs_ptr,
                           tile_ends_ptr, amax_a_ptr, amax_b_ptr, t, pid_n, M, N, K, E,
                           HAS_ALPHA, OUT_BF16, ASM, B_KMAJOR, B_FORMAT, DOT_F32, INTERPRET,
                           SEARCH_STEPS, BM, BN, BK, FUSED, HW_BF16)  # fmt: skip
    else:
        # one program per tile of an upper bound on the tile count
        pid = tl.program_id(0)
        if pid < num_tiles:
            t, pid_n = _tile(pid, num_row_tiles, num_pid_n, GROUP_M)
            _rows_tile(a_desc, b_desc, bq_ptr, bs_ptr, b_strides, out_ptr, stride_om, offs_ptr,
                       tile_ends_ptr, amax_a_ptr, amax_b_ptr, t, pid_n, M, N, K, E,
                       HAS_ALPHA, OUT_BF16, ASM, B_KMAJOR, B_FORMAT, DOT_F32, INTERPRET,
                       SEARCH_STEPS, BM, BN, BK, FUSED, HW_BF16)  # fmt: skip


@triton.jit
def _tokens_tile(
    a_desc, b_desc, out_desc, out_ptr, N, K, stride_oe, stride_on, seg_ends_ptr, amax_a_ptr,
    amax_b_ptr, tile_id, E, num_pid_m, num_pid_n, HAS_ALPHA: tl.constexpr, OUT_BF16: tl.constexpr,
    ASM: tl.constexpr,
    DOT_F32: tl.constexpr, INTERPRET: tl.constexpr, GROUP_M: tl.constexpr, BM: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, STORE: tl.constexpr, HW_BF16: tl.constexpr = False,
):  # fmt: skip
    per_group = num_pid_m * num_pid_n
    g = tile_id // per_group
    pid_m, pid_n = _tile(tile_id % per_group, num_pid_m, num_pid_n, GROUP_M)
    m0 = pid_m * BM
    n0 = pid_n * BN
    s0 = tl.load(seg_ends_ptr + g - 1, mask=g > 0, other=0)
    s1 = tl.load(seg_ends_ptr + g)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    if INTERPRET:
        k = s0
        while k < s1:
            acc = _dot(a_desc.load([m0, k]), b_desc.load([n0, k]).T, acc, DOT_F32)
            k += BK
    else:
        for k in range(s0, s1, BK):
            acc = _dot(a_desc.load([m0, k]), b_desc.load([n0, k]).T, acc, DOT_F32)
    alpha = _alpha(amax_a_ptr, amax_b_ptr, g, E, HAS_ALPHA)
    acc = _mul_rn(acc, tl.broadcast_to(alpha, [BM, BN]), ASM)
    if OUT_BF16:
        out_desc.store([g, m0, n0], tl.reshape(to_bf16_bits(acc, HW_BF16), [1, BM, BN]))
    elif STORE == STORE_HALVES:  # two [BM, BN/2] halves: half the epilogue's shared memory
        left, right = tl.split(tl.permute(tl.reshape(acc, [BM, 2, BN // 2]), [0, 2, 1]))
        out_desc.store([g, m0, n0], tl.reshape(left, [1, BM, BN // 2]))
        out_desc.store([g, m0, n0 + BN // 2], tl.reshape(right, [1, BM, BN // 2]))
    elif STORE == STORE_POINTERS:  # from registers: no shared memory for the epilogue
        rows = m0 + tl.arange(0, BM)
        cols = n0 + tl.arange(0, BN)
        dst = out_ptr + g.to(tl.int64) * stride_oe + rows[:, None].to(tl.int64) * stride_on
        dst += cols[None, :]
        tl.store(dst, acc, mask=(rows < N)[:, None] & (cols < K)[None, :])
    else:
        out_desc.store([g, m0, n0], tl.reshape(acc, [1, BM, BN]))


@triton.jit
def _tokens_kernel(
    a_desc, b_desc, out_desc, out_ptr, N, K, stride_oe, stride_on, seg_ends_ptr, amax_a_ptr,
    amax_b_ptr, E, num_pid_m, num_pid_n, HAS_ALPHA: tl.constexpr, OUT_BF16: tl.constexpr,
    ASM: tl.constexpr, DOT_F32: tl.constexpr, INTERPRET: tl.constexpr, GROUP_M: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PERSISTENT: tl.constexpr,
    PROGRAMS: tl.constexpr, STORE: tl.constexpr, HW_BF16: tl.constexpr = False,
):  # fmt: skip
    if PERSISTENT:
        num_tiles = E * num_pid_m * num_pid_n
        if INTERPRET:
            tile_id = tl.program_id(0)
            while tile_id < num_tiles:
                _tokens_tile(a_desc, b_desc, out_desc, out_ptr, N, K, stride_oe, stride_on,
                             seg_ends_ptr, amax_a_ptr, amax_b_ptr, tile_id, E, num_pid_m, num_pid_n,
                             HAS_ALPHA, OUT_BF16, ASM, DOT_F32, INTERPRET, GROUP_M, BM, BN, BK,
                             STORE, HW_BF16)  # fmt: skip
                tile_id += PROGRAMS
        else:
            for tile_id in tl.range(tl.program_id(0), num_tiles, PROGRAMS):
                _tokens_tile(a_desc, b_desc, out_desc, out_ptr, N, K, stride_oe, stride_on,
                             seg_ends_ptr, amax_a_ptr, amax_b_ptr, tile_id, E, num_pid_m, num_pid_n,
                             HAS_ALPHA, OUT_BF16, ASM, DOT_F32, INTERPRET, GROUP_M, BM, BN, BK,
                             STORE, HW_BF16)  # fmt: skip
    else:
        _tokens_tile(a_desc, b_desc, out_desc, out_ptr, N, K, stride_oe, stride_on,
                     seg_ends_ptr, amax_a_ptr, amax_b_ptr, tl.program_id(0), E, num_pid_m,
                     num_pid_n, HAS_ALPHA, OUT_BF16, ASM, DOT_F32, INTERPRET, GROUP_M, BM, BN,
                     BK, STORE, HW_BF16)  # fmt: skip


def _descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    return TensorDescriptor.from_tensor(t, block)


def _check_tma(name: str, t: torch.Tensor) -> None:
    """TMA reads a tensor with unit stride in its last dim, 16-byte aligned base and strides."""
    size = t.element_size()
    ok = (
        t.stride(-1) == 1
        and t.data_ptr() % 16 == 0
        and all((s * size) % 16 == 0 for s in t.stride()[:-1])
    )
    if not ok:
        raise ValueError(
            f"{name} {tuple(t.shape)} with strides {t.stride()} cannot be read by TMA: need unit "
            "stride in the last dim and 16-byte aligned base and strides"
        )


@library_op("blockscale::grouped_gemm_rows", mutates_args=("out",))
def _grouped_gemm_rows(
    a: torch.Tensor,
    b: torch.Tensor,
    offs: torch.Tensor,
    amax_a: torch.Tensor | None,
    amax_b: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    M, K = a.shape
    E, N, _ = b.shape
    if not (M and N and K):  # no rows (an expert-parallel rank sent no tokens) or nothing
        out.zero_()  # to add: TMA descriptors take no empty dim
        return
    config = ROWS_WS_CONFIG if _warp_specialized(out, B_DQ.value) else ROWS_CONFIG
    bn, bk = config[1:3]
    b_kmajor = b.stride(2) == 1
    b_read = b if b_kmajor else b.transpose(1, 2)
    for name, t in (("a", a), ("b", b_read)):
        _check_tma(name, t)
    b_desc = _descriptor(b_read, [1, bn, bk] if b_kmajor else [1, bk, bn])
    _launch_rows(a, b_desc, offs, offs, offs, amax_a, amax_b, out, E, N, b_kmajor, B_DQ.value,
                 config)  # fmt: skip


def _launch_rows(a, b_desc, bq, bs, offs, amax_a, amax_b, out, E: int, N: int, b_kmajor: bool,
                 b_format: int, config: tuple) -> None:  # fmt: skip
    """One launch of the rows kernel; the weight through `b_desc` (its `_dq`) or, with
    `b_format`, packed (`bq` codes, `bs` scales); an unused slot gets a placeholder (a's
    descriptor, the offsets), which the kernel never reads."""
    M, K = a.shape
    bm, bn, bk, warps, stages = config
    q_strides, s_strides = (bq.stride()[:2], bs.stride()[:2]) if b_format else ((0, 0), (0, 0))
    sizes = torch.diff(offs, prepend=offs.new_zeros(1)).long()
    tail = M - offs[-1:].long()
    tile_ends = torch.cat(((sizes + bm - 1) // bm, (tail + bm - 1) // bm)).cumsum(0)
    tile_ends = tile_ends.to(torch.int32)
    num_pid_n = cdiv(N, bn)
    tiles = (cdiv(M, bm) + E + 1) * num_pid_n
    bf16 = out.dtype == torch.bfloat16
    dst = out.view(torch.int16) if bf16 else out
    ws = _warp_specialized(out, b_format)
    a_desc = None if ws else _descriptor(a, [bm, bk])  # (warp-specialized: made in the kernel)
    has_alpha = amax_a is not None
    persistent = bf16 and (ws or (ROWS_PERSISTENT_KMAJOR if b_kmajor else ROWS_PERSISTENT_NMAJOR))
    programs, programs_key = _grid(a.device, tiles, persistent)
    if ws:
        # the device-made descriptor's 128 bytes a program come from Triton's allocator, which
        # is per thread (a ContextVar): set here, where the backward's thread launches too
        triton.set_allocator(scratch)
    direct(_rows_kernel, (programs,),
        a_desc, a_desc if b_desc is None else b_desc, bq, bs, *q_strides, *s_strides, dst, out.stride(0), offs, tile_ends,
        amax_a if has_alpha else offs, amax_b if has_alpha else offs, M, N, K, E, num_pid_n,
        HAS_ALPHA=has_alpha, OUT_BF16=bf16, ASM=not interpreting(), B_KMAJOR=b_kmajor,
        B_FORMAT=b_format, DOT_F32=interpreting() or a.dtype == torch.float32,
        INTERPRET=interpreting(), SEARCH_STEPS=(E + 1).bit_length(),
        BM=bm, BN=bn, BK=bk, PERSISTENT=persistent, PROGRAMS=programs_key,
        FLATTEN=persistent and not ws, WARP_SPECIALIZE=ws,
        GROUP_M=ROWS_GROUP_M_KMAJOR if b_kmajor else ROWS_GROUP_M_NMAJOR,
        A_DEVICE_DESC=ws, a_ptr=a if ws else None, stride_am=a.stride(0) if ws else None,
        FUSED=persistent and not ws and ROWS_FUSED_LOOPS,
        HW_BF16=epilogue.hw_bf16(), num_warps=warps, num_stages=stages,
    )  # fmt: skip


@library_op("blockscale::grouped_gemm_rows_packed", mutates_args=("out",))
def _grouped_gemm_rows_packed(
    a: torch.Tensor,
    b_data: torch.Tensor,
    b_scale: torch.Tensor,
    offs: torch.Tensor,
    amax_a: torch.Tensor | None,
    amax_b: torch.Tensor | None,
    out: torch.Tensor,
    b_format: int,
    b_kmajor: bool,
) -> None:
    M, K = a.shape
    E = b_data.shape[0]
    N = out.shape[1]
    if not (M and N and K):
        out.zero_()
        return
    _check_tma("a", a)
    _launch_rows(a, None, b_data, b_scale, offs, amax_a, amax_b, out, E, N,
                 b_kmajor, b_format, ROWS_PACKED_CONFIG)  # fmt: skip


@_grouped_gemm_rows_packed.op.register_fake
def _(a, b_data, b_scale, offs, amax_a, amax_b, out, b_format, b_kmajor) -> None:
    return None


def _warp_specialized(out: torch.Tensor, b_format: int) -> bool:
    """Whether a rows launch runs warp-specialized (ROWS_WARP_SPECIALIZE): BF16 outputs
    with the weight's `_dq` only; the one place that decides, for its tiles and its launch."""
    return ROWS_WARP_SPECIALIZE and out.dtype == torch.bfloat16 and b_format == B_DQ.value


def _grid(device: torch.device, tiles: int, persistent: bool) -> tuple[int, int]:
    """(programs to launch, the PROGRAMS constexpr). A constexpr is part of Triton's
    specialization key, so it must not follow the problem's size: under expert parallelism
    a rank's row count changes at every step, and a PROGRAMS that followed it (the tile
    count, or min(tiles, SMs)) compiled the kernel again at every new size, a second or so
    each (`--ep` at 0.07x of one GPU on two H200s). Persistent: one program per SM whatever
    the tile count (those past the last tile exit at once); otherwise one per tile, with
    PROGRAMS unused and fixed."""
    if not persistent:
        return tiles, 1
    programs = _programs(device, 1 << 30)  # every SM (4 programs in the interpreter)
    return programs, programs


@_grouped_gemm_rows.op.register_fake
def _(a, b, offs, amax_a, amax_b, out) -> None:
    return None


@library_op("blockscale::grouped_gemm_tokens", mutates_args=("out",))
def _grouped_gemm_tokens(
    a: torch.Tensor,
    b: torch.Tensor,
    seg_ends: torch.Tensor,
    amax_a: torch.Tensor | None,
    amax_b: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    N, P = a.shape
    K = b.shape[0]
    E = seg_ends.shape[0]
    if not (N and K and P):  # no tokens at all: every segment is empty, its gradient zero
        out.zero_()
        return
    bm, bn, bk, warps, stages = TOKENS_CONFIG
    for name, t in (("a", a), ("b", b), ("out", out)):
        _check_tma(name, t)
    bf16 = out.dtype == torch.bfloat16
    dst = out.view(torch.int16) if bf16 else out
    num_pid_m, num_pid_n = cdiv(N, bm), cdiv(K, bn)
    has_alpha = amax_a is not None
    tiles = E * num_pid_m * num_pid_n
    if TOKENS_FP32_LAUNCH not in TOKENS_FP32_LAUNCHES:
        raise ValueError(
            f"TOKENS_FP32_LAUNCH {TOKENS_FP32_LAUNCH!r}: expected one of {TOKENS_FP32_LAUNCHES}"
        )
    fp32_launch = None if bf16 else TOKENS_FP32_LAUNCH  # (a BF16 tile: one TMA store)
    persistent = TOKENS_PERSISTENT and fp32_launch != "per_tile"
    store = _STORES.get(fp32_launch, 0)
    programs, programs_key = _grid(a.device, tiles, persistent)
    if persistent and fp32_launch != "pointers":  # (a TMA store's tile: shared memory)
        stages = min(stages, TOKENS_PERSISTENT_STAGES)
    if E:
        direct(_tokens_kernel, (programs,),
            _descriptor(a, [bm, bk]), _descriptor(b, [bn, bk]),
            _descriptor(dst, [1, bm, bn // 2 if fp32_launch == "halves" else bn]),
            dst, N, K, dst.stride(0), dst.stride(1),
            seg_ends, amax_a if has_alpha else seg_ends, amax_b if has_alpha else seg_ends, E,
            num_pid_m, num_pid_n, HAS_ALPHA=has_alpha, OUT_BF16=bf16, ASM=not interpreting(),
            DOT_F32=interpreting() or a.dtype == torch.float32, INTERPRET=interpreting(),
            GROUP_M=TOKENS_GROUP_M, BM=bm, BN=bn, BK=bk, PERSISTENT=persistent,
            PROGRAMS=programs_key, STORE=store, HW_BF16=epilogue.hw_bf16(),
            num_warps=warps, num_stages=stages,
        )  # fmt: skip


@_grouped_gemm_tokens.op.register_fake
def _(a, b, seg_ends, amax_a, amax_b, out) -> None:
    return None


def _check_operands(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dtype not in OPERAND_DTYPES or b.dtype != a.dtype:
        raise ValueError(f"operands must be both BF16 (or both FP32), got {a.dtype} and {b.dtype}")


def grouped_gemm_rows(
    a: torch.Tensor,
    b: torch.Tensor,
    offs: torch.Tensor,
    amax: tuple[torch.Tensor, torch.Tensor] | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """out [M, N]: rows of group e = a[rows of e] @ b[e].T * alpha_e (alpha from the two
    per-group NVFP4 amax vectors in `amax`, None: 1); rows past offs[-1] are zero.
    a [M, K] K-major, b [E, N, K] with unit stride along K or along N."""
    _check_operands(a, b)
    if a.dim() != 2 or b.dim() != 3 or a.shape[1] != b.shape[2] or offs.shape != (b.shape[0],):
        raise ValueError(
            f"need a [M, K], b [E, N, K] and offs [E], got {tuple(a.shape)}, {tuple(b.shape)}, "
            f"{tuple(offs.shape)}"
        )
    out = torch.empty(a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)
    amax_a, amax_b = (None, None) if amax is None else amax
    _grouped_gemm_rows(a, b, offs, amax_a, amax_b, out)
    return out


def grouped_gemm_rows_packed(
    a: torch.Tensor,
    b_data: torch.Tensor,
    b_scale: torch.Tensor,
    offs: torch.Tensor,
    fmt: str,
    b_kmajor: bool = True,
    amax: tuple[torch.Tensor, torch.Tensor] | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """`grouped_gemm_rows` with the expert weight read packed: each program decodes its weight
    tile (code value times block scale, exactly the `_dq` operand's values) in registers right
    before the product, so no `_dq` of the weight is written or read.

    b_data / b_scale: the weight's packed copy [E, R, C] quantized along C, as the experts'
    quantizers store it (any strides along E and R, the copies along N are views): NVFP4 (`fmt="nvfp4"`) bytes of two E2M1 codes [E, R, C/2] and E4M3
    scales [E, R, C/16] (1x16 or 16x16); MXFP8 (`fmt="mxfp8"`) E4M3 codes [E, R, C] and E8M0
    scales [E, R, C/32]. `b_kmajor`: the copy is b [E, N, K] along K (R = N; the output GEMM,
    and grad_input's copy along N); False: it is the 16x16 copy of b's transpose [E, K, N]
    (R = K; grad_input reading the forward's 16x16 weight). a [M, K] as for
    `grouped_gemm_rows`, BF16 on the GPU (FP32 in the interpreter)."""
    if a.dtype not in OPERAND_DTYPES:
        raise ValueError(f"a must be BF16 (or FP32), got {a.dtype}")
    if fmt not in PACKED_FORMATS:
        raise ValueError(f"fmt={fmt!r} is not one of {tuple(PACKED_FORMATS)}")
    per_byte, block = (2, 16) if fmt == "nvfp4" else (1, 32)
    E, R, packed_cols = b_data.shape
    C = packed_cols * per_byte
    K, N = (C, R) if b_kmajor else (R, C)
    ok = (
        a.dim() == 2
        and a.shape[1] == K
        and b_scale.shape == (E, R, C // block)
        and offs.shape == (E,)
        and C % block == 0
    )
    if not ok:
        raise ValueError(
            f"need a [M, K], a {fmt} weight copy [E, R, C/{per_byte}] with scales "
            f"[E, R, C/{block}] and offs [E] (K = {'C' if b_kmajor else 'R'}), got "
            f"{tuple(a.shape)}, {tuple(b_data.shape)}, {tuple(b_scale.shape)}, {tuple(offs.shape)}"
        )
    data, scale = b_data.view(torch.uint8), b_scale.view(torch.uint8)
    if data.stride(-1) != 1 or scale.stride(-1) != 1:  # (the quantizers' copies never are)
        data, scale = data.contiguous(), scale.contiguous()
    out = torch.empty(a.shape[0], N, dtype=out_dtype, device=a.device)
    amax_a, amax_b = (None, None) if amax is None else amax
    _grouped_gemm_rows_packed(a, data, scale, offs, amax_a, amax_b, out, PACKED_FORMATS[fmt],
                              b_kmajor)  # fmt: skip
    return out


def grouped_gemm_tokens(
    a: torch.Tensor,
    b: torch.Tensor,
    seg_ends: torch.Tensor,
    amax: tuple[torch.Tensor, torch.Tensor] | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """out [E, N, K]: out[e] = a[:, segment e] @ b[:, segment e].T * alpha_e, with a [N, P]
    and b [K, P] in the token layout (segments end at `seg_ends`, multiples of 64)."""
    _check_operands(a, b)
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"need a [N, P] and b [K, P], got {tuple(a.shape)} and {tuple(b.shape)}")
    out = torch.empty(seg_ends.shape[0], a.shape[0], b.shape[0], dtype=out_dtype, device=a.device)
    amax_a, amax_b = (None, None) if amax is None else amax
    _grouped_gemm_tokens(a, b, seg_ends, amax_a, amax_b, out)
    return out
