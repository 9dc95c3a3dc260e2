"""An independent, slow, per-element model of docs NUMERICS.md, for expected values in tests.

Written from the spec alone: it never imports blockscale. Every FP32 operation of the spec
is a numpy float32 operation on one scalar (IEEE, correctly rounded, same as torch), and every
rounding to a narrow format is done by searching the format's list of values rather than by a
cast, so a wrong cast or a wrong threshold in the library cannot hide behind the same mistake
here. Inputs are 2-D numpy float32 arrays, blocks along the last dim.
"""

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

F32 = np.float32
FLT_MAX = F32(np.finfo(np.float32).max)
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _e4m3_positive_values() -> list[float]:
    """All finite non-negative float8_e4m3fn values, index = code (0x00..0x7E)."""
    values = []
    for code in range(0x7F):  # 0x7F is NaN in the fn variant
        exp, man = code >> 3, code & 7
        values.append(man * 2.0**-9 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7))
    return values


E4M3_VALUES = _e4m3_positive_values()
E4M3_MAX = E4M3_VALUES[-1]  # 448


def e2m1_index_nearest(a: float) -> int:
    """Grid index nearest to a in [0, 6]; ties go to the even index (mantissa bit 0)."""
    return min(range(8), key=lambda i: (abs(a - E2M1_GRID[i]), i % 2))


def e2m1_code_nearest(v: float) -> int:
    """Code of a scaled value v: |v| clamped to 6, nearest-even, sign bit 8 for v < 0 (so -0.0
    gives code 0 and a negative value that rounds to zero gives code 8)."""
    idx = e2m1_index_nearest(min(abs(float(v)), 6.0))
    return idx | (8 if v < 0 else 0)


def e2m1_neighbours(v: float) -> tuple[float, float]:
    """(lo, hi): the largest grid value <= min(|v|, 6) and the next one up (hi == lo at 6)."""
    a = min(abs(float(v)), 6.0)
    lo = max(g for g in E2M1_GRID if g <= a)
    hi = min((g for g in E2M1_GRID if g > a), default=lo)
    return lo, hi


def e2m1_code_stochastic(v: float, r: float) -> int:
    """Round |v| up to hi when r < (|v| - lo) / (hi - lo) (r uniform in [0, 1)), else to lo."""
    lo, hi = e2m1_neighbours(v)
    a = min(abs(float(v)), 6.0)
    up = hi > lo and Fraction(r) < (Fraction(a) - Fraction(lo)) / (Fraction(hi) - Fraction(lo))
    idx = E2M1_GRID.index(hi if up else lo)
    return idx | (8 if v < 0 else 0)


def e2m1_value(code: int) -> float:
    mag = E2M1_GRID[code & 7]
    return -mag if code & 8 else mag


def e4m3_round(x: float) -> float:
    """Saturating E4M3: clamp to [-448, 448], then the nearest value, ties to the even code."""
    x = float(x)
    if math.isnan(x):
        return math.nan
    a = min(abs(x), E4M3_MAX)
    code = min(range(len(E4M3_VALUES)), key=lambda c: (abs(a - E4M3_VALUES[c]), c % 2))
    return math.copysign(E4M3_VALUES[code], x)


def ceil_log2(p: float) -> int:
    """Exact ceil(log2(p)) for p > 0, from the binary exponent (no floating log)."""
    m, e = math.frexp(p)  # p = m * 2**e, m in [0.5, 1)
    return e - 1 if m == 0.5 else e


def f32_from_fraction(q: Fraction) -> float:
    """Round an exact rational to FP32 once (nearest, ties to even), as a Python float."""
    if q == 0:
        return 0.0
    sign = -1.0 if q < 0 else 1.0
    q = abs(q)
    e = q.numerator.bit_length() - q.denominator.bit_length()
    if Fraction(2) ** e > q:
        e -= 1
    quantum = Fraction(2) ** (max(e, -126) - 23)  # FP32: 24 bits; subnormals below 2^-126
    n = q / quantum
    whole = n.numerator // n.denominator
    rest = n - whole
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and whole % 2):
        whole += 1
    value = whole * quantum
    return sign * (math.inf if value > Fraction(float(FLT_MAX)) else float(value))


def bf16_round(x: float) -> float:
    """FP32 value -> nearest BF16 (ties to even), by integer arithmetic on the FP32 bits."""
    bits = int(np.array(F32(x)).view(np.uint32))
    if math.isnan(float(x)):
        return math.nan
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return float(np.array(bits, dtype=np.uint32).view(np.float32))


def sylvester16() -> list[list[int]]:
    h = [[1]]
    while len(h) < 16:
        h = [row + row for row in h] + [row + [-v for v in row] for row in h]
    return h


DEFAULT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def hadamard(x: np.ndarray, signs: tuple[int, ...] = DEFAULT_SIGNS) -> np.ndarray:
    """y = x16 @ H per run of 16 along the last dim, H = diag(s) H16 / 4: the exact sum
    rounded to FP32, then to BF16. Returns float32 values that are BF16-representable."""
    h = sylvester16()
    x = np.asarray(x, dtype=np.float32)
    out = np.empty(x.shape, dtype=np.float32)
    for r in range(x.shape[0]):
        for b0 in range(0, x.shape[1], 16):
            xs = [Fraction(float(v)) for v in x[r, b0 : b0 + 16]]
            for j in range(16):
                s = sum(xs[i] * signs[i] * h[i][j] for i in range(16)) / 4
                out[r, b0 + j] = bf16_round(f32_from_fraction(s))
    return out


@dataclass
class NVFP4Ref:
    codes: np.ndarray  # int [rows, cols]
    scales: np.ndarray  # float64 values of the E4M3 scales [rows, cols/16]
    amax: float
    s_dec: float  # NaN for non-finite amax
    scaled: np.ndarray  # float32 x * enc before the clamp [rows, cols]
    deq: np.ndarray  # float32 dequantized values


def nvfp4_quantize(
    x: np.ndarray, block: str = "1x16", amax: float | None = None, rand: np.ndarray | None = None
) -> NVFP4Ref:
    """NUMERICS.md NVFP4, scalar by scalar. `rand` (uniforms, x's shape) selects stochastic
    rounding; otherwise nearest."""
    x = np.asarray(x, dtype=np.float32)
    rows, cols = x.shape
    with np.errstate(all="ignore"):
        if amax is None:
            amax = F32(np.max(np.abs(x))) if x.size else F32(0)
        amax = F32(amax)
        s_enc = F32(448 * 6) / amax if amax != 0 else F32(1)
        s_enc = min(s_enc, FLT_MAX)
        if amax == 0 or s_enc == 0:
            s_enc = F32(1)
        s_dec = F32(1) / s_enc
        mult = s_enc * (F32(1) / F32(6))

        codes = np.zeros((rows, cols), dtype=np.int64)
        scales = np.zeros((rows, cols // 16))
        scaled = np.zeros((rows, cols), dtype=np.float32)
        deq = np.zeros((rows, cols), dtype=np.float32)
        tile_rows = 16 if block == "16x16" else 1
        for r in range(rows):
            for kb in range(cols // 16):
                r0 = r - r % tile_rows
                tile = x[r0 : r0 + tile_rows, kb * 16 : kb * 16 + 16]
                block_amax = F32(np.max(np.abs(tile)))
                b = min(F32(block_amax * mult), FLT_MAX)
                scale = e4m3_round(b)
                scales[r, kb] = scale
                enc = min(F32(1) / (F32(scale) * s_dec), FLT_MAX)
                for k in range(kb * 16, kb * 16 + 16):
                    v = F32(x[r, k] * enc)
                    scaled[r, k] = v
                    vc = max(min(v, F32(6)), F32(-6))
                    if rand is None:
                        code = e2m1_code_nearest(vc)
                    else:
                        code = e2m1_code_stochastic(vc, float(rand[r, k]))
                    codes[r, k] = code
                    deq[r, k] = F32(F32(e2m1_value(code) * F32(scale)) * s_dec)
        if not np.isfinite(amax):
            s_dec = F32(np.nan)
            deq[:] = np.nan
    return NVFP4Ref(codes, scales, float(amax), float(s_dec), scaled, deq)


@dataclass
class MXFP8Ref:
    data: np.ndarray  # float64 values of the E4M3 elements [rows, cols]
    exponents: np.ndarray  # int [rows, cols/32]; NaN blocks hold 128 (the E8M0 NaN code 255)
    deq: np.ndarray  # float32


def mxfp8_quantize(x: np.ndarray) -> MXFP8Ref:
    x = np.asarray(x, dtype=np.float32)
    rows, cols = x.shape
    data = np.zeros((rows, cols))
    exps = np.zeros((rows, cols // 32), dtype=np.int64)
    deq = np.zeros((rows, cols), dtype=np.float32)
    with np.errstate(all="ignore"):
        for r in range(rows):
            for kb in range(cols // 32):
                sl = slice(kb * 32, kb * 32 + 32)
                block_amax = F32(np.max(np.abs(x[r, sl])))
                if not np.isfinite(block_amax):
                    exps[r, kb] = 128
                    data[r, sl] = np.nan
                    deq[r, sl] = np.nan
                    continue
                p = F32(block_amax * (F32(1) / F32(448)))
                e = -127 if p == 0 else min(max(ceil_log2(float(p)), -127), 127)
                exps[r, kb] = e
                for k in range(kb * 32, kb * 32 + 32):
                    v = F32(x[r, k] * F32(2.0**-e))
                    data[r, k] = e4m3_round(max(min(v, F32(448)), F32(-448)))
                    deq[r, k] = F32(data[r, k] * 2.0**e)
    return MXFP8Ref(data, exps, deq)


def gemm_fp64_blocked(
    a_dq: np.ndarray, b_dq: np.ndarray, alpha: float, block: int = 16
) -> tuple[np.ndarray, np.ndarray]:
    """FP64 reference of a_dq @ b_dq.T * alpha, accumulated per `block`-wide K block.

    Returns (out, magnitude) where magnitude = alpha * |a_dq| @ |b_dq|.T, the scale against
    which FP32 accumulation error is measured."""
    a = np.asarray(a_dq, dtype=np.float64)
    b = np.asarray(b_dq, dtype=np.float64)
    k = a.shape[1]
    out = np.zeros((a.shape[0], b.shape[0]))
    for k0 in range(0, k, block):
        out += a[:, k0 : k0 + block] @ b[:, k0 : k0 + block].T
    return out * alpha, np.abs(a) @ np.abs(b).T * abs(alpha)
