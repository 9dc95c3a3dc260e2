"""Device helpers shared by the kernel families: exact scalar codecs written with integer bit
operations, so the same code is exact on the GPU and in Triton's interpreter.

Why bits and not casts: the interpreter rounds FP32 -> BF16 and FP32 -> FP8 by truncation (or
half-away), and Triton's `/` lowers to an approximate division on the GPU. Every rounding
NUMERICS.md asks for is therefore spelled out here: RNE to BF16, RNE to E4M3 (normal and
subnormal), IEEE division through `div_rn`, clamps written with `where` so NaN goes through
them as it does through `torch.clamp`. No helper forms `a * b + c` where the reference rounds
the product first (FMA contraction would change the bits).
"""

import functools
import os

import torch
import triton
import triton.language as tl
from torch.utils._python_dispatch import _disable_current_modes

from blockscale._registry import in_eager_call
from blockscale.formats import hadamard as rht

FLT_MAX = tl.constexpr(3.4028234663852886e38)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for launch grids. (triton.cdiv is a jit function: calling it from Python
    costs ~9 us a call, measured; a step computes a dozen grids.)"""
    return -(-a // b)


# The order programs walk a [rows, cols] tensor in tiles (docs/KERNELS.md, "2026-11-26 (late):
# the order of the grid"): a band of row tiles down the rows, then the next column tile, band
# after band. The plain 2-D grid walked every row tile of a column before the next column, so
# each program's row segments (and the row copy's code, scale and `_dq` rows) met their
# neighbours along the row only num_m programs later. Measured on the H100 (2026-11-26): bands
# of 4-16 row tiles were up to 8% faster at 16384 x 8192 and 15-29% faster at 65536 x 7168;
# walking whole rows first (one tile a band) was slower for the stochastic both-direction
# kernel at 8192-16384 rows. BAND is a module value so a benchmark can put the old order back
# (a band of 2^30 tiles is the old grid).
BAND = 8


def band_grid(rows: int, cols: int, bm: int, bk: int) -> tuple[tuple[int, int, int], int]:
    """(grid, band) for a kernel that finds its tile with `band_tile`: cdiv(num_m, BAND) bands
    of equal size (at most BAND row tiles, so the last band wastes fewer than one program a
    band; larger if the bands would pass the grid's 65535 limit on its third axis)."""
    num_m, num_k = -(-rows // bm), -(-cols // bk)  # (cdiv, inline: five calls a launch)
    bands = max(1, min(-(-num_m // BAND), 65535))
    band = max(1, -(-num_m // bands))
    return (band, num_k, -(-num_m // band)), band


@triton.jit
def band_tile(band):
    """(row tile, column tile) of this program on a `band_grid` grid. The last band may reach
    past the rows: its extra programs find every row masked off."""
    return tl.program_id(2) * band + tl.program_id(0), tl.program_id(1)


def row_stack(t: torch.Tensor) -> torch.Tensor:
    """t [..., R, C] as [B, R, C] for the dequantize kernels, which read any strides along B
    and R (`stack_rows`): no copy for a stack of expert copies along N, each expert a strided
    view of one [K, E*N] array (reshaping those to rows had copied every code, docs/KERNELS.md,
    "Dequantizing the expert copies along N"). A copy only for a last dim of stride > 1."""
    if t.dim() == 2:
        t = t.unsqueeze(0)  # (the usual operand: no reshape to pay for on the host)
    elif t.dim() != 3:
        t = t.reshape(1, -1) if t.dim() < 2 else t
        lead = 1
        for size in t.shape[:-2]:
            lead *= size
        t = t.reshape(lead, t.shape[-2], t.shape[-1])
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


@triton.jit
def stack_rows(rows, rows_per, stride_b, stride_r):
    """Offsets of rows `rows` (int64) of a [B, R, C] stack with these strides (R = rows_per):
    row i is row i % R of item i // R."""
    item = rows // rows_per
    return item * stride_b + (rows - item * rows_per) * stride_r


# Read once, at import: Triton decides at `triton.jit` time (also an import) whether a kernel is
# interpreted, so a later change of the variable could not switch the kernels anyway; a launch
# asks several times, and reading os.environ costs microseconds each.
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreting() -> bool:
    return _INTERPRETING


def available(x: torch.Tensor) -> bool:
    """True when the Triton kernels can run on x: a CUDA tensor, or a CPU tensor while
    Triton's interpreter is on (tests)."""
    if not isinstance(x, torch.Tensor):
        return False
    if x.is_cuda:
        return True
    return x.device.type == "cpu" and interpreting()


@functools.cache
def hadamard_matrix(device: torch.device) -> torch.Tensor:
    """The default RHT matrix as FP32 [16, 16] on `device` (cast to the input dtype in-kernel;
    its +-1/4 entries are exact in every float dtype). Cached per device.

    Always a real tensor, built outside any dispatch mode: under torch.compile the first call
    can come from inside a trace (the op's fake impl under Dynamo's FakeTensorMode, or AOT's
    functional trace), where it would otherwise build, and cache, a fake tensor that a later
    trace then captures as a constant ("Unexpected fake buffer _tensor_constant0"). Built
    here, the graph captures the real matrix, as after an eager call."""
    with _disable_current_modes():
        return rht.matrix(rht.DEFAULT_SIGNS, torch.float32, device).contiguous()


def dot_in_fp32(x: torch.Tensor) -> bool:
    """The interpreter multiplies BF16 as raw uint16, and FP32 inputs need an IEEE dot: both
    take the FP32 path. BF16/FP16 on the GPU use the tensor cores (products exact, FP32
    accumulation)."""
    return interpreting() or x.dtype == torch.float32


def dq_flags(return_dq: bool | tuple[bool, bool]) -> tuple[bool, bool]:
    """(row, col) `_dq` flags of a `return_dq` argument: one bool for both copies, or a pair."""
    if isinstance(return_dq, bool):
        return return_dq, return_dq
    row, col = return_dq
    return bool(row), bool(col)


def copy_outputs(
    empty, rows: int, cols: int, t_cols: int, device, row: bool, col: bool,
    dq_row: bool, dq_col: bool, row_codes: bool = True, col_codes: bool = True,
):  # fmt: skip
    """The six outputs of a quantize launch that makes a row copy of [rows, cols] and a
    column copy [cols, t_cols] (data, scale, dq each, from `empty(rows, cols, device, dq,
    codes)`; a copy not made is empty), and the launch's flags (dq_row, dq_col, row_codes,
    col_codes): a `_dq` only for a copy made; codes always, unless the copy has its `_dq`."""
    dq_row, dq_col = dq_row and row, dq_col and col
    row_codes, col_codes = row_codes or not dq_row, col_codes or not dq_col
    none = (0, 0, device, False, True)  # (made twice: a custom op's outputs may not alias)
    made_row = (rows, cols, device, dq_row, row_codes) if row else none
    made_col = (cols, t_cols, device, dq_col, col_codes) if col else none
    return (*empty(*made_row), *empty(*made_col)), (dq_row, dq_col, row_codes, col_codes)


# The empty outputs eager calls hand out (`empty_rows`), one per shape, dtype and device.
_EMPTY: dict[tuple, torch.Tensor] = {}


def empty_rows(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.empty(rows, cols)` for a quantize launch's output. One with no rows (a copy, or
    its codes or `_dq`, not made: three to six of a launch's six outputs) is, in an eager call
    (`_registry.in_eager_call`), one tensor made once and handed out again: an empty tensor
    is never read or written, and only a registered op's outputs must not alias (a compiled
    graph's calls get new ones). Each torch.empty is host time on a launch-bound step (issue
    62)."""
    if rows or not in_eager_call():
        return torch.empty(rows, cols, dtype=dtype, device=device)
    key = (cols, dtype, device)
    found = _EMPTY.get(key)
    if found is None:
        found = _EMPTY[key] = torch.empty(0, cols, dtype=dtype, device=device)
    return found


def launch_tiles(cfg: tuple) -> tuple[int, int, dict]:
    """A quantize launcher's tile entry (BM, BK, num_warps[, maxnreg]) -> (BM, BK, launch
    options). maxnreg caps a thread's registers (ptxas spills to stay under it), so that more
    programs fit on an SM (MXFP8 both's default sets 128; benchmarks sweep it, docs/KERNELS.md)."""
    bm, bk, warps, *cap = cfg
    if len(cap) > 1:
        raise ValueError(f"a tile entry is (BM, BK, num_warps[, maxnreg]), got {cfg}")
    return bm, bk, {"num_warps": warps, **({"maxnreg": cap[0]} if cap else {})}


def launch_kind(row: bool, col: bool, dq: bool, sr: bool = False) -> str:
    """The TILES key of a quantize launch: "row", "col" or "both", then "_dq" when it writes a
    `_dq` operand. NVFP4's both-direction `_dq` launches with stochastic rounding have their own
    key, "both_sr_dq" (their best tile differs, docs/KERNELS.md), dense and grouped alike; the
    MXFP8 launchers pass sr=False."""
    kind = "both" if row and col else ("col" if col else "row")
    if kind == "both" and dq and sr:
        return "both_sr_dq"
    return kind + ("_dq" if dq else "")


def sr_seed(device: torch.device, generator: torch.Generator | None) -> torch.Tensor:
    """One int64 seed on `device` drawn from PyTorch's generator: torch.manual_seed reproduces
    it, and a CUDA graph records the draw, so replays get fresh noise without a host sync."""
    return torch.randint(2**31 - 1, (1,), device=device, generator=generator, dtype=torch.int64)


@triton.jit
def abs_bits(x):
    """|x| as int32 bits of x in FP32: ordered like |x|, with NaN above Inf, so an integer
    max is an amax that propagates NaN (tl.max on floats would drop it)."""
    return x.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def round_to_bf16(x, HW: tl.constexpr = False):
    """FP32 -> the FP32 value of its BF16 rounding (nearest, ties to even). NaN stays NaN
    (the GPU's canonical NaN 0x7FFFFFFF would carry into the sign bit).
    HW (on the GPU only: the interpreter's BF16 cast truncates): the hardware conversion, one
    ALU operation for two values where the integer rounding takes about six a value, on the
    pipe that bounds the quantize kernels (docs/KERNELS.md). The two differ only in a NaN's
    payload."""
    if HW:
        return x.to(tl.bfloat16).to(tl.float32)
    else:
        b = x.to(tl.int32, bitcast=True)
        r = ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        return tl.where(x != x, x, r)


@triton.jit
def bf16_bits(x):
    """int16 bit pattern of an FP32 value already on the BF16 grid (kernels store `_dq`
    through an int16 view: the interpreter's BF16 cast mangles subnormals)."""
    return (x.to(tl.int32, bitcast=True) >> 16).to(tl.int16)


@triton.jit
def to_bf16_bits(x, HW: tl.constexpr):
    """int16 bits of FP32 x rounded to BF16, nearest even (round_to_bf16, HW as there). The
    hardware path converts straight to the bits: through round_to_bf16's FP32 result the
    compiler keeps the widening and the shift (240 more SASS instructions in MXFP8 both + dq)."""
    if HW:
        return x.to(tl.bfloat16).to(tl.int16, bitcast=True)
    else:
        return bf16_bits(round_to_bf16(x))


@triton.jit
def max_keep_nan(a, b):
    """Combine function for a NaN-propagating max (tl.max would drop NaN on the GPU)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def min_keep_nan(x, hi):
    """min(x, hi) that leaves NaN as NaN (torch.clamp(max=hi) semantics)."""
    return tl.where(x > hi, hi, x)


@triton.jit
def e4m3_code(b):
    """Non-negative FP32 (<= 448, or NaN) -> int32 E4M3 code, round to nearest even.

    Normal results round the 23-bit mantissa to 3 bits on the integer bits. Below 2^-6 the
    quantum is 2^-9: b * 2^9 + 1.5 * 2^23 lands in a binade whose ulp is 1, so the FP32 add
    rounds b * 2^9 to an integer (nearest even) and the low bits of the sum are the code.
    (b * 2^9 is exact, so a fused multiply-add gives the same sum.)"""
    bits = b.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - 960
    sub = (b * 512.0 + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000
    code = tl.where(b < 0.015625, sub, normal)
    return tl.where(b != b, 0x7F, code)


@triton.jit
def e4m3_value(code):
    """int32 E4M3 code (0..127, non-negative) -> FP32 value; 0x7F is NaN."""
    normal = ((code + 960) << 20).to(tl.float32, bitcast=True)
    sub = code.to(tl.float32) * 0.001953125
    v = tl.where(code < 8, sub, normal)
    return tl.where(code == 0x7F, float("nan"), v)


@triton.jit
def e4m3_code_value(b, HW: tl.constexpr):
    """Non-negative FP32 b (<= 448, or NaN) -> (int32 E4M3 code, nearest even; its FP32
    value). HW (the GPU): the hardware conversions, `cvt.rn.satfinite.e4m3x2.f32` one way and
    e4m3x2 -> f16x2 -> f32 back, a few instructions for two values where the integer codec
    takes about twenty a value (the interpreter's FP8 cast is not RNE: e4m3_code there)."""
    if HW:
        code = b.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
    else:
        code = e4m3_code(b)
    return code, e4m3_decode(code, HW)


@triton.jit
def e4m3_decode(code, HW: tl.constexpr):
    """int32 E4M3 code (0..127) -> its FP32 value (0x7F: NaN). HW: the hardware conversion."""
    if HW:
        return code.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        return e4m3_value(code)


@triton.jit
def e4m3_code_signed(x):
    """FP32 in [-448, 448] (or NaN) -> int32 E4M3 byte with sign, nearest even."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    return e4m3_code(tl.abs(x)) | sign


@triton.jit
def e4m3_round(w):
    """FP32 w in [-448, 448] (or NaN) -> the FP32 value of its E4M3 rounding (nearest even),
    sign kept (-0.0 stays -0.0): e4m3_byte_value(e4m3_code_signed(w)) without the code.
    |w| + c, with c = 1.5 * 2^(e + 20) and e the binade of |w| (at least -6, where E4M3's
    quantum stops shrinking at 2^-9), lands in a binade whose ulp is the E4M3 step 2^(e - 3),
    so the FP32 add rounds |w| to the grid, ties to the even grid point; subtracting c again is
    exact. c is 2^e (the exponent bits of w) times 1.5 * 2^20: two bit operations and a
    multiply, where shifting the exponent field took five bit operations."""
    bits = w.to(tl.int32, bitcast=True)
    binade = tl.maximum(bits & 0x7F800000, 121 << 23).to(tl.float32, bitcast=True)
    c = binade * 1572864.0
    return with_sign((tl.abs(w) + c) - c, bits < 0)


@triton.jit
def e4m3_byte_value(byte):
    """int32 E4M3 byte (sign in bit 7) -> FP32 value."""
    mag = e4m3_value(byte & 0x7F)
    return with_sign(mag, (byte & 0x80) != 0)


@triton.jit
def with_sign(v, neg):
    """v with its sign bit set where `neg` (Triton's -x is 0 - x, which loses -0.0)."""
    bits = v.to(tl.int32, bitcast=True) | (neg.to(tl.int32) << 31)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def exp2_int(e):
    """2^e as FP32 for int32 e in [-127, 127], from its bits."""
    bits = tl.where(e >= -126, (tl.maximum(e, -126) + 127) << 23, 0x00400000)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _dot16(v, h, R: tl.constexpr, C: tl.constexpr, DOT_F32: tl.constexpr):
    """v16 @ h for every run of 16 values along the last dim of the [R, C] tile, FP32."""
    blocks = tl.reshape(v, [R * C // 16, 16])
    if DOT_F32:
        y = tl.dot(blocks.to(tl.float32), h, input_precision="ieee", out_dtype=tl.float32)
    else:
        y = tl.dot(blocks, h.to(v.dtype), out_dtype=tl.float32)
    return tl.reshape(y, [R, C])


@triton.jit
def hadamard_16(
    v, h_ptr, R: tl.constexpr, C: tl.constexpr, DOT_F32: tl.constexpr, HW: tl.constexpr = False
):
    """y = v16 @ H on every run of 16 values along the last dim of the [R, C] tile, then
    rounded to BF16 (returned as FP32). Products are exact; the FP32 accumulation equals the
    FP64 reference whenever the partial sums are exact (see docs/KERNELS.md). HW: the
    rounding is the GPU's conversion (round_to_bf16)."""
    i = tl.arange(0, 16)
    h = tl.load(h_ptr + i[:, None] * 16 + i[None, :])
    return round_to_bf16(_dot16(v, h, R, C, DOT_F32), HW)


@triton.jit
def relayout_16(v, R: tl.constexpr, C: tl.constexpr, DOT_F32: tl.constexpr):
    """v as FP32, unchanged in value (a product with the identity is exact), but in the
    layout a dot produces. After tl.trans the values of a 16-block sit in different threads;
    this moves them through shared memory into one thread's registers, which measured far
    cheaper than the shuffles Triton otherwise emits for the block reductions (docs/LOG.md)."""
    i = tl.arange(0, 16)
    eye = (i[:, None] == i[None, :]).to(tl.float32)
    return _dot16(v, eye, R, C, DOT_F32)


@triton.jit
def nvfp4_global(amax):
    """(S_dec, mult) from the FP32 tensor amax, in the reference's operation order:
    S_enc = 2688 / amax (one IEEE division), capped at FLT_MAX, 1 when amax == 0 or
    S_enc == 0; S_dec = 1 / S_enc; mult = S_enc * fl(1/6)."""
    one = tl.full(amax.shape, 1.0, tl.float32)
    s_enc = tl.math.div_rn(tl.full(amax.shape, 2688.0, tl.float32), amax)
    s_enc = min_keep_nan(s_enc, FLT_MAX)
    s_enc = tl.where((amax == 0.0) | (s_enc == 0.0), 1.0, s_enc)
    s_dec = tl.math.div_rn(one, s_enc)
    mult = s_enc * 0.16666666666666666
    return s_dec, mult
