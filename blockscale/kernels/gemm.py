"""The emulated GEMM and its epilogue in one persistent TMA kernel (Hopper and later).

out[M, N] = cast(a[M, K] @ b[N, K].T * alpha + bias): BF16 (exact `_dq`) operands, FP32
accumulation in the tensor cores, and the epilogue of epilogue.py applied to the accumulator in
registers (alpha from the two NVFP4 amaxes, the product rounded on its own, the FP32 bias,
round-to-nearest-even to BF16). Against cuBLAS with an FP32 output plus epilogue.py it skips the
FP32 accumulator's write and read (8 bytes per output value) and the accumulator's memory.

The result differs from the cuBLAS path only in the order of the FP32 additions, which the
emulated GEMM leaves unspecified (NUMERICS.md, "GEMMs"); the epilogue's roundings are the same.

Layouts: `a` K-major ([M, K], unit stride along K); `b` either K-major ([N, K]) or N-major (a
[N, K] view of a [K, N] tensor with unit stride along N, e.g. the transposed 16x16 weight of
dgrad), read through a TMA descriptor of whichever layout it has. TMA needs 16-byte aligned
bases and row strides: `supported()` says whether a call qualifies (gemm/dispatch.py runs
cuBLAS + the epilogue kernel when it does not).

Persistent: one program per SM walks the output tiles (grouped along M for L2 reuse); the tile
loop and the K loop are flattened so the next tile's loads overlap this tile's epilogue.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from blockscale._registry import library_op
from blockscale.kernels import epilogue
from blockscale.kernels._common import cdiv, interpreting, to_bf16_bits
from blockscale.kernels._launch import direct, scratch
from blockscale.kernels.epilogue import _decode_scale, _mul_rn

# (BM, BN, BK, GROUP_M, num_warps, num_stages, flatten, warp_specialize); `config_for` picks
# one per call. benchmarks/bench_gemm.py measures the choices (docs/KERNELS.md).
DEFAULT_CONFIG = (128, 256, 64, 8, 8, 3, 1, 0)
# The same with bands of 16 row tiles, for an N-major b (grad_input's transposed 16x16 weight)
# and a BF16 output: on an H100 (2026-11-26, `bench_gemm.py --configs`, bands of 4 / 8 / 16 /
# 32), 8192 x 4096 <- 4096 took 415 against 465 us and 8192 x 14336 <- 4096 1306 against
# 1412 (the 8B o and down projections' grad_input), the 1B shapes within 2% either way; the
# grouped grad_input kernel prefers 16 too (kernels/grouped_gemm.py). K-major outputs and FP32
# outputs keep 8 (mixed or worse with 16).
NMAJOR_CONFIG = (128, 256, 64, 16, 8, 3, 1, 0)
# "Warp-specialized": at 8 warps Triton 3.6 compiles warp_specialize=True for sm_90 to the same
# code as without it (docs/KERNELS.md, "Warp specialization on Hopper"), so what this config
# changes is the unflattened tile loop.
# Faster where the contraction is long and there are many output tiles (measured on an H100: 16384 x 14336 -> 4096 output and
# grad_input GEMMs, 2624 / 2632 us against 2691 / 2876 us with DEFAULT_CONFIG), slower on the
# step's grad_weight GEMMs (long contraction, fewer tiles).
LONG_K_CONFIG = (128, 256, 64, 8, 8, 3, 0, 1)
# An FP32 output tile is twice the shared memory of a BF16 one: 128 x 256 with 3 stages would
# need 272 KiB, past Hopper's 227 KiB per block. The fused kernel writes FP32 outputs whose
# contraction is short (gemm/dispatch.py, FUSED_FP32_MAX_K: grad_input of an FP32 input); four
# warps were the fastest of six configs at contractions of 1024-4096 on an H100 (16384 x 2048
# <- 2048: 223 against 243 us with eight; 8192 x 4096 <- 4096: 426 against 452 us). At a
# contraction of 512 eight warps had been chosen from timings that held the host's launch time
# (an H200 had four warps at 162 against 99 us); on the device alone four are faster there too
# (one H200, 2026-12-02, `bench_gemm.py --device-time --fp32-grad-input`: 16384 x 2048 <- 512
# 84.5 against 89.1 us; <- 2048 215 against 236), so every FP32 output takes these tiles.
FP32_OUT_CONFIG = (128, 128, 64, 8, 4, 4, 1, 0)
# Narrow GEMMs (the key and value projections of a Llama with 8 KV heads of 64: N = 512
# forward, K = 512 in grad_input) take the default tiles. They had their own, 128 x 128 with
# the tile loop unflattened, chosen on 2026-11-25 from timings that held the host's launch
# time (bench_gemm.py timed each call between two events, and a 50 us GEMM waits for the
# launcher). Timed on the device alone (one H200, 2026-12-02, `bench_gemm.py --device-time`,
# docs/KERNELS.md "Narrow GEMMs"): 16384 x 2048 -> 512 took 53.4 us with DEFAULT_CONFIG
# against 62.2 with those tiles (cuBLAS BF16 48.0), and 16384 x 512 -> 2048 with the N-major
# weight 71.9 us with NMAJOR_CONFIG against 87.9 (cuBLAS 56.1).
# Where the default tiles would make fewer than FEW_TILES output tiles (a grad_weight of a BF16
# weight with few rows: the 1B key and value projections' 512 x 2048, 32 tiles of 128 x 256 on
# an H200's 132 SMs), 128 x 128 tiles with four warps: on the device alone (one H200,
# 2026-12-02, `bench_gemm.py --device-time`) 512 x 16384 -> 2048 took 89.2 us against 154.3
# with DEFAULT_CONFIG, while at 2048 x 16384 -> 2048 (128 default tiles) the default was faster
# (173 against 191 us). FP32 outputs (FP32 master weights) take FP32_OUT_CONFIG anyway.
FEW_TILES = 64
FEW_TILES_CONFIG = (128, 128, 64, 8, 4, 4, 1, 0)
# The last field of a config: 0, the tile loop as `flatten` says; 1, Triton's warp_specialize
# flag on that kernel (at 8 warps the same code as 0, above); WS_DEVICE_DESCRIPTORS, the
# kernel split for real (`_gemm_ws_kernel`: descriptors made on the device, the tile loop
# unflattened, 4 warps a consumer).
WS_DEVICE_DESCRIPTORS = 2
# A BF16 output tile stored in two halves (`_epilogue_store`): half the shared memory the TMA
# store stages (docs/KERNELS.md, "The GEMM epilogues' BF16 rounding"). The rounding itself
# follows epilogue.HW_BF16.
EPILOGUE_HALVES = True
SHARED_MEMORY_BYTES = 227 * 1024  # per thread block on H100 (and B200)
# BF16 `_dq` operands on the GPU; FP32 ones (exact products in IEEE FP32) are what the CPU
# path builds, and what the interpreter runs in the tests.
OPERAND_DTYPES = (torch.bfloat16, torch.float32)


@triton.jit
def _tile(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    group = GROUP_M * num_pid_n
    first_m = (tile_id // group) * GROUP_M
    size_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile_id % group) % size_m
    pid_n = (tile_id % group) // size_m
    return pid_m, pid_n


@triton.jit
def _mma_tile(a_desc, b_desc, om, on, ki, acc, B_KMAJOR: tl.constexpr, BK: tl.constexpr,
              DOT_F32: tl.constexpr):  # fmt: skip
    a = a_desc.load([om, ki * BK])
    if B_KMAJOR:
        b = b_desc.load([on, ki * BK]).T
    else:
        b = b_desc.load([ki * BK, on])
    if DOT_F32:  # Triton's interpreter (numpy) has no BF16 product
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _epilogue_store(acc, out_desc, amax_a_ptr, amax_b_ptr, bias_ptr, om, on, N,
                    HAS_ALPHA: tl.constexpr, HAS_BIAS: tl.constexpr, OUT_BF16: tl.constexpr,
                    ASM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    HALVES: tl.constexpr = False, HW_BF16: tl.constexpr = False):  # fmt: skip
    """alpha, bias and the rounding to the output dtype on the accumulator, then the TMA store:
    the whole tile, or with HALVES (BF16 outputs) its two [BM, BN/2] halves, each through a
    descriptor of that box, so the store stages half the tile in shared memory (EPILOGUE_HALVES).
    HW_BF16: the GPU's conversion to BF16 (`to_bf16_bits`; the same bits but a NaN's payload)."""
    if HAS_ALPHA:
        alpha = _decode_scale(tl.load(amax_a_ptr)) * _decode_scale(tl.load(amax_b_ptr))
        acc = _mul_rn(acc, tl.broadcast_to(alpha, [BM, BN]), ASM)
    if HAS_BIAS:
        rn = on + tl.arange(0, BN)
        acc = acc + tl.load(bias_ptr + rn, mask=rn < N, other=0.0)[None, :]
    if OUT_BF16:
        if HALVES:
            left, right = tl.split(tl.permute(tl.reshape(acc, [BM, 2, BN // 2]), [0, 2, 1]))
            out_desc.store([om, on], to_bf16_bits(left, HW_BF16))
            out_desc.store([om, on + BN // 2], to_bf16_bits(right, HW_BF16))
        else:
            out_desc.store([om, on], to_bf16_bits(acc, HW_BF16))
    else:
        out_desc.store([om, on], acc)


@triton.jit
def _interpreted_tiles(
    a_desc, b_desc, out_desc, amax_a_ptr, amax_b_ptr, bias_ptr, N, num_pid_m, num_pid_n,
    k_tiles, num_tiles, HAS_ALPHA: tl.constexpr, HAS_BIAS: tl.constexpr, OUT_BF16: tl.constexpr,
    ASM: tl.constexpr, B_KMAJOR: tl.constexpr, DOT_F32: tl.constexpr, BM: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, PROGRAMS: tl.constexpr,
    HALVES: tl.constexpr, HW_BF16: tl.constexpr,
):  # fmt: skip
    """The persistent tile walk in Triton's interpreter, for both GEMM kernels (it cannot
    iterate a range with a runtime bound under numpy 2)."""
    tile_id = tl.program_id(0)
    while tile_id < num_tiles:
        pid_m, pid_n = _tile(tile_id, num_pid_m, num_pid_n, GROUP_M)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        ki = 0
        while ki < k_tiles:
            acc = _mma_tile(a_desc, b_desc, pid_m * BM, pid_n * BN, ki, acc, B_KMAJOR, BK,
                            DOT_F32)  # fmt: skip
            ki += 1
        _epilogue_store(acc, out_desc, amax_a_ptr, amax_b_ptr, bias_ptr, pid_m * BM, pid_n * BN,
                        N, HAS_ALPHA, HAS_BIAS, OUT_BF16, ASM, BM, BN, HALVES,
                        HW_BF16)  # fmt: skip
        tile_id += PROGRAMS


@triton.jit
def _gemm_kernel(
    a_desc, b_desc, out_desc, amax_a_ptr, amax_b_ptr, bias_ptr, M, N, K,
    HAS_ALPHA: tl.constexpr, HAS_BIAS: tl.constexpr, OUT_BF16: tl.constexpr, ASM: tl.constexpr,
    B_KMAJOR: tl.constexpr, DOT_F32: tl.constexpr, INTERPRET: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    PROGRAMS: tl.constexpr, FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
    HALVES: tl.constexpr = False, HW_BF16: tl.constexpr = False,
):  # fmt: skip
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    num_tiles = num_pid_m * num_pid_n
    if INTERPRET:
        _interpreted_tiles(a_desc, b_desc, out_desc, amax_a_ptr, amax_b_ptr, bias_ptr, N,
                           num_pid_m, num_pid_n, k_tiles, num_tiles, HAS_ALPHA, HAS_BIAS,
                           OUT_BF16, ASM, B_KMAJOR, DOT_F32, BM, BN, BK, GROUP_M, PROGRAMS,
                           HALVES, HW_BF16)  # fmt: skip
    else:
        for tile_id in tl.range(
            tl.program_id(0), num_tiles, PROGRAMS, flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE
        ):
            pid_m, pid_n = _tile(tile_id, num_pid_m, num_pid_n, GROUP_M)
            acc = tl.zeros([BM, BN], dtype=tl.float32)
            for ki in range(k_tiles):
                acc = _mma_tile(a_desc, b_desc, pid_m * BM, pid_n * BN, ki, acc, B_KMAJOR, BK,
                                DOT_F32)  # fmt: skip
            _epilogue_store(acc, out_desc, amax_a_ptr, amax_b_ptr, bias_ptr, pid_m * BM,
                            pid_n * BN, N, HAS_ALPHA, HAS_BIAS, OUT_BF16, ASM, BM, BN, HALVES,
                            HW_BF16)  # fmt: skip


@triton.jit
def _gemm_ws_kernel(
    a_ptr, b_ptr, out_ptr, stride_a, stride_b, stride_out, amax_a_ptr, amax_b_ptr, bias_ptr,
    M, N, K,
    HAS_ALPHA: tl.constexpr, HAS_BIAS: tl.constexpr, OUT_BF16: tl.constexpr, ASM: tl.constexpr,
    B_KMAJOR: tl.constexpr, DOT_F32: tl.constexpr, INTERPRET: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    PROGRAMS: tl.constexpr, HW_BF16: tl.constexpr = False,
):  # fmt: skip
    """`_gemm_kernel` warp-specialized (a config's last field 2): the same tiles, sums and
    epilogue, with the three TMA descriptors made in the kernel and the tile loop not
    flattened, the two things Triton 3.6's Hopper warp specialization needs to split the
    program (a producer warpgroup issuing the TMA loads, two consumer warpgroups each
    multiplying and storing half the tile's rows; docs/KERNELS.md, "The dense GEMM
    warp-specialized"). With host descriptors the pass fails on the store, and with the loop
    flattened it silently leaves the program whole. The epilogue finds its tile from its own
    counter (`tile_c`), so that it does not hold the loads' tile index across the split."""
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_a, 1],
                                       block_shape=[BM, BK])  # fmt: skip
    if B_KMAJOR:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[stride_b, 1],
                                           block_shape=[BN, BK])  # fmt: skip
    else:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[stride_b, 1],
                                           block_shape=[BK, BN])  # fmt: skip
    out_desc = tl.make_tensor_descriptor(out_ptr, shape=[M, N], strides=[stride_out, 1],
                                         block_shape=[BM, BN])  # fmt: skip
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    num_tiles = num_pid_m * num_pid_n
    if INTERPRET:  # (one program at a time: the epilogue's counter is the loads')
        _interpreted_tiles(a_desc, b_desc, out_desc, amax_a_ptr, amax_b_ptr, bias_ptr, N,
                           num_pid_m, num_pid_n, k_tiles, num_tiles, HAS_ALPHA, HAS_BIAS,
                           OUT_BF16, ASM, B_KMAJOR, DOT_F32, BM, BN, BK, GROUP_M, PROGRAMS,
                           False, HW_BF16)  # fmt: skip
    else:
        tile_c = tl.program_id(0)
        for tile_id in tl.range(tl.program_id(0), num_tiles, PROGRAMS, warp_specialize=True):
            pid_m, pid_n = _tile(tile_id, num_pid_m, num_pid_n, GROUP_M)
            acc = tl.zeros([BM, BN], dtype=tl.float32)
            for ki in range(k_tiles):
                acc = _mma_tile(a_desc, b_desc, pid_m * BM, pid_n * BN, ki, acc, B_KMAJOR, BK,
                                DOT_F32)  # fmt: skip
            pm, pn = _tile(tile_c, num_pid_m, num_pid_n, GROUP_M)
            _epilogue_store(acc, out_desc, amax_a_ptr, amax_b_ptr, bias_ptr, pm * BM, pn * BN,
                            N, HAS_ALPHA, HAS_BIAS, OUT_BF16, ASM, BM, BN, False,
                            HW_BF16)  # fmt: skip
            tile_c += PROGRAMS


def config_for(
    m: int, n: int, k: int, out_dtype: torch.dtype = torch.bfloat16, b_kmajor: bool = True
) -> tuple[int, ...]:
    """The tile config for out [m, n] contracting k, b K-major or not (measured choices, see
    the constants)."""
    if out_dtype == torch.float32:
        return FP32_OUT_CONFIG
    if cdiv(m, DEFAULT_CONFIG[0]) * cdiv(n, DEFAULT_CONFIG[1]) < FEW_TILES:
        return FEW_TILES_CONFIG
    if k >= 8192 and m >= 16384:
        return LONG_K_CONFIG
    return DEFAULT_CONFIG if b_kmajor else NMAJOR_CONFIG


def shared_memory_bytes(config: tuple[int, ...], out_dtype: torch.dtype) -> int:
    """Shared memory a config needs: its pipeline stages of both operand tiles (BF16) and the
    output tile the TMA store is staged through (an estimate of Triton's allocation)."""
    bm, bn, bk, _, _, stages = config[:6]
    out_size = torch.empty((), dtype=out_dtype).element_size()
    halves = EPILOGUE_HALVES and out_dtype == torch.bfloat16 and config[7] != WS_DEVICE_DESCRIPTORS
    return stages * (bm + bn) * bk * 2 + bm * bn * out_size // (2 if halves else 1)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _programs(device: torch.device, tiles: int) -> int:
    if device.type != "cuda":
        return min(tiles, 4)
    return min(tiles, _sm_count(device.index if device.index is not None else 0))


def _aligned(t: torch.Tensor, major: int) -> bool:
    """Whether a 2-D tensor can back a TMA descriptor with unit stride along dim `major`."""
    other = 1 - major
    size = t.element_size()
    return (
        t.stride(major) == 1
        and t.data_ptr() % 16 == 0
        and (t.stride(other) * size) % 16 == 0
        and t.shape[major] * size >= 16
    )


def supported(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the kernel can read a [M, K], b [N, K] (view) and write out [M, N] as laid out
    (reads data pointers: call it on real tensors, not under tracing)."""
    if a.dim() != 2 or b.dim() != 2 or out.dim() != 2 or min(a.shape + b.shape) == 0:
        return False
    if a.dtype not in OPERAND_DTYPES or b.dtype != a.dtype:
        return False
    return _aligned(a, 1) and (_aligned(b, 1) or _aligned(b, 0)) and _aligned(out, 1)


# A plain library op (opaque to Inductor) launching the kernel directly, not a Triton-backed one:
# Inductor has nothing to fuse into a GEMM, and this keeps the TMA descriptors out of its
# tracing of user kernels.
@library_op("blockscale::gemm_fused", mutates_args=("out",))
def _gemm_fused(
    a: torch.Tensor,
    b: torch.Tensor,
    amax_a: torch.Tensor | None,
    amax_b: torch.Tensor | None,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    config: list[int],
) -> None:
    if not supported(a, b, out):  # (data pointers: checked here, where tensors are real)
        raise ValueError(
            "gemm_fused needs 16-byte aligned TMA layouts: a K-major, b K- or N-major, out "
            f"with unit column stride; got strides {a.stride()}, {b.stride()}, {out.stride()}"
        )
    _launch_gemm(a, b, amax_a, amax_b, bias, out, config)


def _descriptor(t: torch.Tensor, block_shape: list[int]) -> TensorDescriptor:
    """`TensorDescriptor.from_tensor(t, block_shape)` without its checks, which `supported`
    has made already for the three layouts (alignment, unit stride, nonzero sizes); the
    tile shapes are the configs' powers of two. What Triton's launcher reads is the same."""
    desc = object.__new__(TensorDescriptor)
    desc.base, desc.shape, desc.strides = t, t.shape, t.stride()
    desc.block_shape, desc.padding = block_shape, "zero"
    return desc


def _launch_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    amax_a: torch.Tensor | None,
    amax_b: torch.Tensor | None,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    config: tuple[int, ...] | list[int],
) -> None:
    """The kernel's launch on layouts `supported` accepted."""
    M, K = a.shape
    N = b.shape[0]
    bm, bn, bk, group_m, warps, stages, flatten, ws = config
    b_kmajor = b.stride(1) == 1
    bf16 = out.dtype == torch.bfloat16
    dst = out.view(torch.int16) if bf16 else out
    tiles = cdiv(M, bm) * cdiv(N, bn)
    programs = _programs(a.device, tiles)
    unused = out
    interpret = interpreting()
    if ws == WS_DEVICE_DESCRIPTORS:
        b_t = b if b_kmajor else b.t()
        triton.set_allocator(scratch)  # (per thread: the backward launches from autograd's)
        direct(_gemm_ws_kernel, (programs,),
            a, b_t, dst, a.stride(0), b_t.stride(0), dst.stride(0),
            amax_a if amax_a is not None else unused, amax_b if amax_b is not None else unused,
            bias if bias is not None else unused, M, N, K,
            HAS_ALPHA=amax_a is not None, HAS_BIAS=bias is not None, OUT_BF16=bf16,
            ASM=not interpret, B_KMAJOR=b_kmajor,
            DOT_F32=interpret or a.dtype == torch.float32, INTERPRET=interpret,
            BM=bm, BN=bn, BK=bk, GROUP_M=group_m, PROGRAMS=programs,
            HW_BF16=epilogue.hw_bf16(), num_warps=warps, num_stages=stages,
        )  # fmt: skip
        return
    a_desc = _descriptor(a, [bm, bk])
    b_desc = _descriptor(b, [bn, bk]) if b_kmajor else _descriptor(b.t(), [bk, bn])
    halves = EPILOGUE_HALVES and bf16
    out_desc = _descriptor(dst, [bm, bn // 2 if halves else bn])
    direct(_gemm_kernel, (programs,),
        a_desc, b_desc, out_desc, amax_a if amax_a is not None else unused,
        amax_b if amax_b is not None else unused, bias if bias is not None else unused,
        M, N, K,
        HAS_ALPHA=amax_a is not None, HAS_BIAS=bias is not None, OUT_BF16=bf16,
        ASM=not interpret, B_KMAJOR=b_kmajor,
        DOT_F32=interpret or a.dtype == torch.float32, INTERPRET=interpret,
        BM=bm, BN=bn, BK=bk, GROUP_M=group_m, PROGRAMS=programs, FLATTEN=bool(flatten),
        WARP_SPECIALIZE=bool(ws), HALVES=halves, HW_BF16=epilogue.hw_bf16(),
        num_warps=warps, num_stages=stages,
    )  # fmt: skip


def gemm_into(
    a: torch.Tensor,
    b: torch.Tensor,
    amax_a: torch.Tensor | None,
    amax_b: torch.Tensor | None,
    bias: torch.Tensor | None,
    out: torch.Tensor,
) -> bool:
    """`gemm_fused` for callers that hold checked operands (gemm/dispatch.py, on real tensors
    only): a [M, K], b [N, K] of one dtype, out [M, N], amaxes and bias on a's device.
    Launches the kernel and returns True where `supported` accepts the layouts; False
    (nothing written) where not. The same launch as gemm_fused's, without its shape checks
    or the op's dispatch: a linear layer makes three of these per step."""
    if not supported(a, b, out):
        return False
    if amax_a is not None and (amax_a.dtype != torch.float32 or amax_b.dtype != torch.float32):
        amax_a, amax_b = amax_a.float(), amax_b.float()
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        bias = bias.float().contiguous()
    m, n = out.shape
    _launch_gemm(
        a, b, amax_a, amax_b, bias, out, config_for(m, n, a.shape[1], out.dtype, b.stride(1) == 1)
    )
    return True


@_gemm_fused.op.register_fake
def _(a, b, amax_a, amax_b, bias, out, config) -> None:
    return None


def gemm_fused(
    a: torch.Tensor,
    b: torch.Tensor,
    amax: tuple[torch.Tensor, torch.Tensor] | None = None,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    config: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """cast(a @ b.T * alpha + bias) for BF16 a [M, K] (K-major) and b [N, K] (K- or N-major
    view), alpha = S_dec_a * S_dec_b from `amax` (the two NVFP4 tensor amaxes; None: 1), an
    optional FP32 bias [N], into `out` (a [M, N] BF16/FP32 tensor with unit column stride, e.g.
    a row slice of a larger output) or a new `out_dtype` tensor. `config`: the tiles (8 ints,
    see DEFAULT_CONFIG; None: `config_for` the shape). Layouts TMA cannot read (`supported`)
    raise ValueError (when the op runs: the check reads data pointers)."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"need a [M, K] and b [N, K], got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype not in OPERAND_DTYPES or b.dtype != a.dtype:
        raise ValueError(f"operands must be both BF16 (or both FP32), got {a.dtype} and {b.dtype}")
    if out is None:
        out = torch.empty(a.shape[0], b.shape[0], dtype=out_dtype, device=a.device)
    if out.dtype not in (torch.bfloat16, torch.float32) or out.shape != (a.shape[0], b.shape[0]):
        raise ValueError(
            f"out must be [{a.shape[0]}, {b.shape[0]}] BF16 or FP32, got {out.dtype} "
            f"{tuple(out.shape)}"
        )
    if config is None:
        config = config_for(a.shape[0], b.shape[0], a.shape[1], out.dtype, b.stride(1) == 1)
    if len(config) != len(DEFAULT_CONFIG):
        raise ValueError(
            f"config takes {len(DEFAULT_CONFIG)} ints (see DEFAULT_CONFIG), got {config}"
        )
    amax_a = amax_b = None
    if amax is not None:
        amax_a, amax_b = (v.to(device=a.device, dtype=torch.float32).reshape(()) for v in amax)
    if bias is not None:
        if bias.shape != (b.shape[0],):
            raise ValueError(f"bias must be [{b.shape[0]}], got {tuple(bias.shape)}")
        bias = bias.to(device=a.device, dtype=torch.float32).contiguous()
    _gemm_fused(a, b, amax_a, amax_b, bias, out, list(config))
    return out
