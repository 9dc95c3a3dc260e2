"""Property tests (hypothesis) over random shapes, magnitudes, dtypes and layouts.

Each property is checked from the spec's own arithmetic (numpy FP32 scalars), not from
blockscale's helpers: the error bounds of nearest rounding, the neighbours of stochastic
rounding, and bit-exact agreement with the scalar model on small shapes.
"""

import numpy as np
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from blockscale import hadamard, mxfp8, nvfp4
from blockscale.formats import e2m1, swizzle
from tests import reference_scalar as ref

F32 = np.float32
SETTINGS = settings(max_examples=50, deadline=None)
DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.float16])


@st.composite
def tensors(draw, max_rows=24, max_blocks=3, block=16, row_multiple=1, dtypes=DTYPES):
    rows = draw(st.integers(1, max_rows // row_multiple)) * row_multiple
    cols = draw(st.integers(1, max_blocks)) * block
    dtype = draw(dtypes)
    # FP16 normals span 2^-14..2^15; the outliers and row factors below add up to 2^13.
    lo, hi = (-6, 1) if dtype == torch.float16 else (-40, 40)
    log_scale = draw(st.integers(lo, hi))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    if draw(st.booleans()):  # heavy tails: one outlier per row, or rows of mixed magnitude
        x[:, 0] *= 100
    else:
        x *= torch.pow(2.0, torch.randint(-6, 7, (rows, 1), generator=g).float())
    return (x * 2.0**log_scale).to(dtype)


def encode_multipliers(scale: np.ndarray, amax: float) -> tuple[np.ndarray, F32]:
    """Per block enc = min(1 / (scale * S_dec), FLT_MAX), and S_dec, from NUMERICS.md."""
    with np.errstate(all="ignore"):
        amax = F32(amax)
        s_enc = F32(2688) / amax if amax != 0 else F32(1)
        s_enc = min(s_enc, ref.FLT_MAX)
        if amax == 0 or s_enc == 0:
            s_enc = F32(1)
        s_dec = F32(1) / s_enc
        enc = np.minimum(F32(1) / (scale.astype(np.float32) * s_dec), ref.FLT_MAX)
    return enc.astype(np.float32), s_dec


@SETTINGS
@given(
    x=tensors(max_rows=48, row_multiple=16),
    block=st.sampled_from(nvfp4.BLOCKS),
    transpose=st.booleans(),
)
def test_nvfp4_nearest_is_within_half_a_grid_step(x, block, transpose):
    x2 = x.t() if transpose else x
    rows, cols = x2.shape
    q = nvfp4.quantize(x, block=block, transpose=transpose)
    xf = x2.float().numpy()
    scale = q.scale.float().numpy()
    enc, s_dec = encode_multipliers(scale, float(q.amax))
    v = (xf.reshape(rows, -1, 16) * enc[..., None]).astype(np.float32).reshape(rows, cols)
    got = e2m1.decode(q.codes()).numpy()
    vc = np.clip(v, -6, 6)
    grid = np.array(ref.E2M1_GRID + tuple(-g for g in ref.E2M1_GRID[1:]))
    nearest = np.abs(vc[..., None] - grid).min(-1)
    # Nearest: no grid value is closer, and so the error is at most half the local step.
    assert (np.abs(got - vc) == nearest).all()
    half_step = np.vectorize(lambda a: (lambda lo, hi: (hi - lo) / 2)(*ref.e2m1_neighbours(a)))(vc)
    assert (np.abs(got - vc) <= half_step).all()
    # Dequantized: |deq - x| <= (half step + what the clamp at 6 removed) * scale * S_dec, up to
    # the FP32 roundings of v, of code*scale*S_dec and of enc (a few u of |x| and |deq|).
    deq = q.dequantize().numpy()
    unit = np.repeat(scale, 16, axis=1) * float(s_dec)
    excess = np.maximum(np.abs(v) - 6, 0)
    bound = (half_step + excess) * unit + 2.0**-21 * (np.abs(xf) + np.abs(deq))
    assert (np.abs(deq - xf) <= bound).all()


@SETTINGS
@given(x=tensors(max_rows=32, max_blocks=2), block=st.sampled_from(nvfp4.BLOCKS))
def test_nvfp4_matches_model(x, block):
    assume(block == "1x16" or x.shape[0] % 16 == 0)
    q = nvfp4.quantize(x, block=block)
    m = ref.nvfp4_quantize(x.float().numpy(), block)
    assert np.array_equal(q.codes().numpy(), m.codes)
    assert np.array_equal(q.scale.float().numpy(), m.scales.astype(np.float32))
    assert np.array_equal(q.dequantize().numpy(), m.deq, equal_nan=True)


@SETTINGS
@given(x=tensors(), seed=st.integers(0, 2**31 - 1))
def test_nvfp4_stochastic_is_one_of_the_two_neighbours(x, seed):
    q = nvfp4.quantize(x, rounding="stochastic", generator=torch.Generator().manual_seed(seed))
    rows, cols = x.shape
    enc, _ = encode_multipliers(q.scale.float().numpy(), float(q.amax))
    v = (x.float().numpy().reshape(rows, -1, 16) * enc[..., None]).astype(np.float32).ravel()
    codes = q.codes().numpy().ravel()
    for vi, c in zip(v, codes):
        lo, hi = ref.e2m1_neighbours(vi)
        assert abs(ref.e2m1_value(int(c))) in (lo, hi) and bool(c & 8) == (vi < 0)


@SETTINGS
@given(x=tensors(max_rows=48, max_blocks=2, row_multiple=16), block=st.sampled_from(nvfp4.BLOCKS))
def test_nvfp4_columnwise_equals_quantizing_the_transpose(x, block):
    col = nvfp4.quantize(x, block=block, transpose=True)
    row_of_t = nvfp4.quantize(x.t().contiguous(), block=block)
    assert torch.equal(col.data, row_of_t.data)
    assert torch.equal(col.scale.view(torch.uint8), row_of_t.scale.view(torch.uint8))


def e4m3_half_ulp(y: np.ndarray) -> np.ndarray:
    a = np.minimum(np.abs(y), 448.0)
    exponent = np.floor(np.log2(np.maximum(a, 2.0**-6)))  # subnormals share 2^-6's spacing
    return 2.0 ** (exponent - 3) / 2


@SETTINGS
@given(x=tensors(max_blocks=2, block=32))
def test_mxfp8_within_half_an_e4m3_step(x):
    m = mxfp8.quantize(x)
    r = ref.mxfp8_quantize(x.float().numpy())
    assert np.array_equal(m.scale.view(torch.uint8).numpy(), (r.exponents + 127).astype(np.uint8))
    assert np.array_equal(m.data.float().numpy(), r.data.astype(np.float32))
    xf = x.float().numpy().astype(np.float64)
    two_e = np.repeat(2.0**r.exponents, 32, axis=1)
    y = xf / two_e  # exact: a power-of-two scaling
    # The exponent rounds up, so |y| <= 448 up to fl(1/448)'s rounding (then clamped).
    bound = (e4m3_half_ulp(y) + np.maximum(np.abs(y) - 448, 0)) * two_e
    assert (np.abs(m.dequantize().numpy() - xf) <= bound).all()


@SETTINGS
@given(x=tensors(max_blocks=2, dtypes=st.just(torch.float32)))
def test_hadamard_matches_exact_model(x):
    assert np.array_equal(hadamard.transform(x).float().numpy(), ref.hadamard(x.numpy()))


@SETTINGS
@given(
    rows=st.integers(0, 300),
    cols=st.integers(0, 12),
    seed=st.integers(0, 2**31 - 1),
)
def test_swizzle_round_trip(rows, cols, seed):
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(0, 256, (rows, cols), generator=g, dtype=torch.uint8).view(
        torch.float8_e4m3fn
    )
    b = swizzle.to_blocked(s)
    rp, cp = swizzle.padded_shape(rows, cols)
    assert b.numel() == rp * cp
    # Padding is zero: the nonzero bytes are exactly the input's.
    assert int((b.view(torch.uint8) != 0).sum()) == int((s.view(torch.uint8) != 0).sum())
    assert torch.equal(swizzle.from_blocked(b, rows, cols).view(torch.uint8), s.view(torch.uint8))


@SETTINGS
@given(shape=st.lists(st.integers(0, 6), min_size=0, max_size=2), k=st.integers(0, 8))
def test_pack_round_trip(shape, k):
    codes = torch.randint(0, 16, (*shape, 2 * k), dtype=torch.uint8)
    assert torch.equal(e2m1.unpack(e2m1.pack(codes)), codes)
