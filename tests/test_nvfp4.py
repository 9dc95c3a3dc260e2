"""NVFP4 quantize/dequantize, bit for bit against hand-computed values and the scalar model."""

import math

import numpy as np
import pytest
import torch

from blockscale import nvfp4
from blockscale.formats import e2m1
from tests import reference_scalar as ref


def exact(a: torch.Tensor, b, **kw) -> None:
    torch.testing.assert_close(a, torch.as_tensor(b).to(a.dtype), atol=0, rtol=0, **kw)


def above(x: float) -> float:
    return float(np.nextafter(np.float32(x), np.float32(np.inf)))


def below(x: float) -> float:
    return float(np.nextafter(np.float32(x), np.float32(-np.inf)))


def assert_matches_model(q, x2d: torch.Tensor, block: str = "1x16", amax=None) -> ref.NVFP4Ref:
    """q's codes, scales, amax and dequantization equal the scalar model's for the 2-D x."""
    m = ref.nvfp4_quantize(x2d.float().numpy(), block, amax)
    rows, cols = x2d.shape
    exact(q.codes().reshape(rows, cols), torch.tensor(m.codes, dtype=torch.uint8))
    exact(q.scale.float().reshape(rows, cols // 16), torch.tensor(m.scales, dtype=torch.float32))
    exact(q.amax, torch.tensor(m.amax, dtype=torch.float32))
    exact(q.dequantize().reshape(rows, cols), torch.from_numpy(m.deq), equal_nan=True)
    return m


def randn(*shape, seed=0, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ---------------------------------------------------------------- hand-computed cases


def test_hand_computed_two_blocks():
    # amax = 6: S_enc = 2688/6 = 448, block scale e4m3(6 * 448/6) = 448, enc = 1, so block 0
    # keeps its values. Block 1 has amax 3: scale 224, enc = 2, so its scaled values land on
    # the rounding ties 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 and go to the even code.
    grid = [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    ties = [0.125, 0.375, 0.625, 0.875, 1.25, 1.75, 2.5, 3.0]
    x = torch.tensor([grid + [-v for v in grid] + ties + [-v for v in ties]])
    x[0, 8] = -0.0
    q = nvfp4.quantize(x)
    codes_0 = list(range(8)) + [0] + list(range(9, 16))
    codes_1 = [0, 2, 2, 4, 4, 6, 6, 7, 8, 10, 10, 12, 12, 14, 14, 15]
    exact(q.codes(), torch.tensor([codes_0 + codes_1], dtype=torch.uint8))
    exact(q.scale.float(), [[448.0, 224.0]])
    exact(q.amax, 6.0)
    # Packed bytes: element 2i in the low nibble.
    assert q.data[0, :4].tolist() == [0x10, 0x32, 0x54, 0x76]
    # Dequantized: code * scale * S_dec, S_dec = fl(1/448) (so not always the exact input).
    s_dec = np.float32(1) / np.float32(448)
    code_values = grid + [-v for v in grid] + [0, 1, 1, 2, 2, 4, 4, 6]
    code_values += [-v for v in code_values[-8:]]
    scales = [448.0] * 16 + [224.0] * 16
    expected = [np.float32(c * s) * s_dec for c, s in zip(code_values, scales)]
    exact(q.dequantize(), torch.tensor([expected]))
    exact(q.global_decode_scale(), s_dec)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_rounding_edges_through_quantize(sign):
    # Each row holds a 6 (so S_enc = 448, scale 448 and enc = 1 exactly: values are rounded
    # as they are) and the values just below, at and above each E2M1 rounding edge.
    edges = [
        (0.25, 0, 0, 1),
        (0.75, 1, 2, 2),
        (1.25, 2, 2, 3),
        (1.75, 3, 4, 4),
        (2.5, 4, 4, 5),
        (3.5, 5, 6, 6),
        (5.0, 6, 6, 7),
    ]
    values, codes = [], []
    for edge, lo, at, hi in edges:
        values += [below(edge), edge, above(edge)]
        codes += [lo, at, hi]
    values += [0.0] * (30 - len(values))
    codes += [0] * (30 - len(codes))
    x = torch.tensor([[6.0] + values[:15], [6.0] + values[15:]]) * sign
    expected = torch.tensor([[7] + codes[:15], [7] + codes[15:]], dtype=torch.uint8)
    if sign < 0:
        expected = torch.where(x != 0, expected | 8, expected)
    q = nvfp4.quantize(x)
    exact(q.scale.float(), [[448.0], [448.0]])
    exact(q.codes(), expected)
    assert_matches_model(q, x)


# With amax = 448, S_enc = 6 and mult = 6 * fl(1/6) = 1 exactly, so a block's scale is
# e4m3(block_amax): these rows put each block amax on an E4M3 edge.
SCALE_EDGES = [
    (448.0, 448.0),  # the maximum
    (432.0, 448.0),  # tie 416 (odd code 0x7D) / 448 (even 0x7E) -> 448
    (below(432.0), 416.0),
    (248.0, 256.0),  # tie 240 (0x77) / 256 (0x78) -> 256
    (2.0**-6, 2.0**-6),  # smallest normal
    (7 * 2.0**-9, 7 * 2.0**-9),  # largest subnormal
    (2.0**-9, 2.0**-9),  # smallest subnormal
    (3 * 2.0**-10, 2.0**-8),  # tie 2^-9 (code 1) / 2^-8 (code 2) -> 2^-8
    (above(2.0**-10), 2.0**-9),
    (2.0**-10, 0.0),  # tie 0 / 2^-9 -> 0: the scale underflows
    (1e-6, 0.0),
]


def test_e4m3_scale_edges():
    x = torch.zeros(len(SCALE_EDGES), 16)
    for r, (block_amax, _) in enumerate(SCALE_EDGES):
        x[r, 0] = block_amax
        x[r, 1] = -block_amax / 3
        x[r, 2] = block_amax / 7
    q = nvfp4.quantize(x)
    exact(q.scale.float()[:, 0], torch.tensor([s for _, s in SCALE_EDGES]))
    assert_matches_model(q, x)
    underflowed = q.scale.float()[:, 0] == 0
    assert underflowed.sum() == 2
    # A zero scale decodes the whole block to zero. Its encode multiplier is FLT_MAX, so the
    # nonzero values saturate to code 6 (as TE does); zeros stay code 0.
    exact(q.dequantize()[underflowed], torch.zeros(2, 16))
    exact(q.codes()[underflowed][:, :4], [[7, 15, 7, 0], [7, 15, 7, 0]])


def test_scale_saturates_at_448_with_a_smaller_amax():
    # A caller-provided amax below the true max (e.g. a stale one) makes b exceed 448: the
    # scale must saturate to 448, where a plain cast to float8_e4m3fn would give NaN.
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 16] = 200.0, 50.0
    q = nvfp4.quantize(x, amax=torch.tensor(100.0))
    exact(q.amax, 100.0)
    assert q.scale.float()[0, 0] == 448.0
    assert_matches_model(q, x, amax=100.0)


@pytest.mark.parametrize("amax", [1e-30, 1e-37, 1e-40, 1e-44, 2.0**-149])
def test_tiny_tensor_amax(amax):
    # Below 2688/FLT_MAX ~ 7.9e-36 the global encode scale S_enc = 2688/amax is capped at
    # FLT_MAX; down at FP32's subnormals the block scales then underflow to zero.
    x = randn(4, 32, seed=3)
    x = (x / x.abs().max() * amax).float()
    x[0, 0] = amax
    q = nvfp4.quantize(x)
    m = assert_matches_model(q, x)
    assert math.isfinite(m.s_dec) and torch.isfinite(q.dequantize()).all()


def test_huge_finite_values():
    x = randn(4, 32, seed=4) * 1e37
    x[1, 3] = 3.4e38
    q = nvfp4.quantize(x)
    assert_matches_model(q, x)
    assert torch.isfinite(q.dequantize()).all()


def test_all_zero_tensor():
    for x in (torch.zeros(32, 32), -torch.zeros(32, 32)):
        for block in nvfp4.BLOCKS:
            q = nvfp4.quantize(x, block=block)
            exact(q.data, torch.zeros(32, 16, dtype=torch.uint8))
            exact(q.scale.float(), torch.zeros(32, 2))
            exact(q.amax, 0.0)
            exact(q.global_decode_scale(), 1.0)
            exact(q.dequantize(), torch.zeros(32, 32))


def test_zero_block_in_nonzero_tensor():
    x = randn(2, 48, seed=5)
    x[1, 16:32] = 0
    q = nvfp4.quantize(x)
    exact(q.scale.float()[1, 1], 0.0)
    exact(q.codes()[1, 16:32], torch.zeros(16, dtype=torch.uint8))
    assert_matches_model(q, x)


def test_one_huge_outlier_per_block():
    x = randn(8, 64, seed=6) * 0.01
    for r in range(8):
        for b in range(4):
            x[r, 16 * b + (r + b) % 16] = 1e4 * (-1) ** (r + b)
    q = nvfp4.quantize(x)
    # Every block amax equals the tensor amax: scale 448 everywhere, the outlier is +-6.
    exact(q.scale.float(), torch.full((8, 4), 448.0))
    outliers = x.abs() == 1e4
    codes = q.codes()
    assert (codes[outliers] == torch.where(x[outliers] > 0, 7, 15).to(torch.uint8)).all()
    assert_matches_model(q, x)


def test_negative_zero_and_negative_values_rounding_to_zero():
    x = torch.zeros(1, 16)
    x[0, 0] = 6.0
    x[0, 1] = -0.0
    x[0, 2] = -0.2  # scaled by enc = 1: rounds to zero, keeps its sign -> code 8
    x[0, 3] = 0.2
    q = nvfp4.quantize(x)
    exact(q.codes()[0, :4], torch.tensor([7, 0, 8, 0], dtype=torch.uint8))
    exact(q.dequantize()[0, 1:4], torch.zeros(3))


# ---------------------------------------------------------------- block shapes and layouts


def varied_rows(rows: int, cols: int, seed: int) -> torch.Tensor:
    # Rows of very different magnitudes so that 1x16 and 16x16 scales differ.
    x = randn(rows, cols, seed=seed)
    return x * torch.pow(2.0, torch.arange(rows) % 7 - 3.0)[:, None]


@pytest.mark.parametrize("block", nvfp4.BLOCKS)
def test_random_matches_model(block):
    x = varied_rows(32, 48, seed=7)
    assert_matches_model(nvfp4.quantize(x, block=block), x, block)


def test_1x16_and_16x16_differ_where_tiles_differ():
    x = varied_rows(32, 32, seed=8)
    q1 = nvfp4.quantize(x, block="1x16")
    q2 = nvfp4.quantize(x, block="16x16")
    # 16x16: one scale per tile, repeated on the tile's 16 rows; it is the 1x16 scales' max.
    tiles = q2.scale.float().reshape(2, 16, 2)
    exact(tiles, tiles[:, :1].expand(2, 16, 2))
    exact(tiles[:, 0], q1.scale.float().reshape(2, 16, 2).amax(1))
    assert not torch.equal(q1.scale.float(), q2.scale.float())


def test_1x16_equals_16x16_when_every_row_holds_the_tile_max():
    x = randn(16, 32, seed=9).clamp(-2, 2)
    x[:, 5] = 3.0
    x[:, 20] = -2.5
    q1, q2 = nvfp4.quantize(x, block="1x16"), nvfp4.quantize(x, block="16x16")
    exact(q2.data, q1.data)
    exact(q2.scale.float(), q1.scale.float())


def test_single_row_single_block():
    x = randn(1, 16, seed=10)
    q = nvfp4.quantize(x)
    assert q.data.shape == (1, 8) and q.scale.shape == (1, 1)
    assert_matches_model(q, x)
    q1d = nvfp4.quantize(x[0])
    assert q1d.data.shape == (8,) and q1d.scale.shape == (1,) and q1d.shape == (16,)
    exact(q1d.data, q.data[0])


@pytest.mark.parametrize("block", nvfp4.BLOCKS)
def test_columnwise_equals_quantizing_the_transpose(block):
    x = varied_rows(48, 32, seed=11)
    q = nvfp4.quantize(x, block=block, transpose=True)
    assert q.shape == (32, 48) and q.data.shape == (32, 24)
    assert_matches_model(q, x.t(), block)


def test_16x16_columnwise_is_the_exact_transpose_of_rowwise():
    x = varied_rows(32, 64, seed=12)
    row = nvfp4.quantize(x, block="16x16")
    col = nvfp4.quantize(x, block="16x16", transpose=True)
    exact(col.codes(), row.codes().t())
    exact(col.scale.float()[::16], row.scale.float()[::16].t())
    exact(col.amax, row.amax)
    t = row.t()
    assert t.shape == col.shape
    exact(t.data, col.data)
    exact(t.scale.float(), col.scale.float())


def test_t_refuses_1x16_and_3d():
    with pytest.raises(ValueError, match="16x16"):
        nvfp4.quantize(randn(16, 16)).t()
    with pytest.raises(ValueError, match="dims=3"):
        nvfp4.quantize(randn(2, 16, 16), block="16x16").t()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_input_dtypes(dtype):
    x = varied_rows(16, 64, seed=13).to(dtype)
    for block in nvfp4.BLOCKS:
        q = nvfp4.quantize(x, block=block)
        assert_matches_model(q, x.float(), block)
        exact(q.dequantize(dtype), q.dequantize().to(dtype))


def test_3d_input_keeps_leading_dims():
    x = varied_rows(48, 32, seed=14).reshape(2, 24, 32)
    q = nvfp4.quantize(x)
    assert q.shape == (2, 24, 32) and q.data.shape == (2, 24, 16) and q.scale.shape == (2, 24, 2)
    assert q.dequantize().shape == (2, 24, 32)
    assert_matches_model(q, x.reshape(48, 32))
    # transpose=True flattens the leading dims: the [K, B*T] columnwise copy.
    qt = nvfp4.quantize(x, transpose=True)
    assert qt.shape == (32, 48) and qt.data.shape == (32, 24)
    assert_matches_model(qt, x.reshape(48, 32).t())


def test_4d_16x16_tiles_span_flattened_rows():
    x = varied_rows(64, 32, seed=15).reshape(2, 2, 16, 32)
    q = nvfp4.quantize(x, block="16x16")
    assert q.scale.shape == (2, 2, 16, 2)
    assert_matches_model(q, x.reshape(64, 32), "16x16")


@pytest.mark.parametrize("transpose", [False, True])
def test_non_contiguous_inputs(transpose):
    base = varied_rows(64, 64, seed=16)
    views = [base[:, ::2], base.t(), base[::2].t()[:, :16]]
    for x in views:
        assert not x.is_contiguous()
        q = nvfp4.quantize(x, transpose=transpose)
        x2 = x.contiguous()
        assert_matches_model(q, x2.t() if transpose else x2)


@pytest.mark.parametrize("transpose", [False, True])
def test_hadamard_then_quantize(transpose):
    x = varied_rows(32, 32, seed=17)
    q = nvfp4.quantize(x, hadamard=True, transpose=transpose)
    assert q.hadamard
    x2 = x.t() if transpose else x
    transformed = ref.hadamard(x2.contiguous().numpy())
    assert_matches_model(q, torch.from_numpy(transformed))


def test_amax_argument_is_used():
    x = randn(2, 32, seed=18)
    amax = float(x.abs().max()) * 4
    q = nvfp4.quantize(x, amax=torch.tensor(amax))
    exact(q.amax, amax)
    assert_matches_model(q, x, amax=amax)


# ---------------------------------------------------------------- non-finite and bad input


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"block": "16x16"},
        {"hadamard": True},
        {"transpose": True},
        {"rounding": "stochastic"},
    ],
)
def test_non_finite_input_dequantizes_to_nan(bad, kw):
    x = randn(32, 32, seed=19)
    x[3, 5] = bad
    q = nvfp4.quantize(x, **kw)
    assert not torch.isfinite(q.amax)
    assert torch.isnan(q.dequantize()).all()
    assert torch.isnan(q.dequantize(torch.bfloat16)).all()


def test_float16_overflow_dequantizes_to_nan():
    x = (randn(16, 16, seed=20) * 1e5).to(torch.float16)  # overflows to +-inf in FP16
    assert torch.isinf(x).any()
    assert torch.isnan(nvfp4.quantize(x).dequantize()).all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.float8_e4m3fn])
def test_wrong_dtype_raises(dtype):
    with pytest.raises(ValueError, match=f"dtype {dtype} is not supported"):
        nvfp4.quantize(torch.zeros(16, 16).to(dtype))


def test_not_a_tensor_raises():
    with pytest.raises(TypeError, match="list"):
        nvfp4.quantize([[0.0] * 16])


@pytest.mark.parametrize("shape,transpose", [((4, 24), False), ((24, 4), True), ((40,), False)])
def test_k_not_a_multiple_of_16_raises(shape, transpose):
    k = shape[0] if transpose else shape[-1]
    with pytest.raises(ValueError, match=f"K={k} is not a multiple of 16"):
        nvfp4.quantize(torch.zeros(shape), transpose=transpose)


def test_16x16_rows_not_a_multiple_of_16_raises():
    with pytest.raises(ValueError, match="rows=8 is not a multiple of 16"):
        nvfp4.quantize(torch.zeros(8, 32), block="16x16")
    with pytest.raises(ValueError, match="rows=24 is not a multiple of 16"):
        nvfp4.quantize(torch.zeros(32, 24), block="16x16", transpose=True)


def test_bad_block_rounding_and_scalar_raise():
    with pytest.raises(ValueError, match="block='32x32'"):
        nvfp4.quantize(torch.zeros(16, 16), block="32x32")
    with pytest.raises(ValueError, match="rounding='up'"):
        nvfp4.quantize(torch.zeros(16, 16), rounding="up")
    with pytest.raises(ValueError, match="at least 1 dim"):
        nvfp4.quantize(torch.tensor(1.0))


@pytest.mark.parametrize(
    "shape,block,transpose,data_shape,scale_shape",
    [
        ((0, 32), "1x16", False, (0, 16), (0, 2)),
        ((0, 32), "16x16", False, (0, 16), (0, 2)),
        ((4, 0), "1x16", False, (4, 0), (4, 0)),
        ((0, 32), "1x16", True, (32, 0), (32, 0)),
        ((2, 0, 16), "1x16", False, (2, 0, 8), (2, 0, 1)),
    ],
)
def test_empty_tensors(shape, block, transpose, data_shape, scale_shape):
    q = nvfp4.quantize(torch.zeros(shape), block=block, transpose=transpose)
    assert q.data.shape == data_shape and q.scale.shape == scale_shape
    exact(q.amax, 0.0)
    expected_shape = (shape[-1], 0) if transpose else shape
    assert q.dequantize().shape == expected_shape


# ---------------------------------------------------------------- stochastic rounding


def midpoint_rows(rows: int) -> torch.Tensor:
    # A 6 fixes enc = 1; the other 15 values sit exactly between two grid points (p = 1/2).
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5]
    return torch.tensor([6.0] + mids + [0.3]).repeat(rows, 1)


def test_stochastic_gives_only_the_two_neighbours():
    x = varied_rows(64, 64, seed=21)
    q = nvfp4.quantize(x, rounding="stochastic", generator=torch.Generator().manual_seed(0))
    m = ref.nvfp4_quantize(x.numpy())
    # Scales do not depend on the rounding mode.
    exact(q.scale.float(), torch.tensor(m.scales, dtype=torch.float32))
    codes = q.codes().numpy()
    for (r, k), v in np.ndenumerate(m.scaled):
        lo, hi = ref.e2m1_neighbours(v)
        assert abs(ref.e2m1_value(int(codes[r, k]))) in (lo, hi), (r, k, v)
        assert bool(codes[r, k] & 8) == (v < 0), (r, k, v)


def test_stochastic_mean_converges_to_the_input():
    # N independent draws of the same row (rows share amax and scales). Each draw of element k
    # is lo_k or hi_k, so by Hoeffding P(|mean - E| >= t) <= 2 exp(-2 N t^2 / (hi-lo)^2).
    # With t = (hi-lo) * sqrt(ln(2/d) / (2N)), d = 1e-9: each of the 64 checks fails falsely
    # with probability <= 1e-9 (6.4e-8 for the test). E = |v| exactly, up to torch.rand's 2^-24
    # granularity (bias <= 2^-24 (hi-lo), far below t).
    n = 4096
    row = varied_rows(1, 64, seed=22)
    q = nvfp4.quantize(
        row.repeat(n, 1), rounding="stochastic", generator=torch.Generator().manual_seed(1)
    )
    m = ref.nvfp4_quantize(row.numpy())
    values = e2m1.decode(q.codes()).double().mean(0).numpy()
    t_unit = math.sqrt(math.log(2 / 1e-9) / (2 * n))
    for k, v in enumerate(m.scaled[0]):
        lo, hi = ref.e2m1_neighbours(v)
        target = math.copysign(min(abs(float(v)), 6.0), v)
        assert abs(values[k] - target) <= (hi - lo) * t_unit, (k, v, values[k])
    # Dequantized, the mean is the input times enc * scale * S_dec (1 within a few FP32 ulps),
    # except where the scaled value passed 6 and was clamped (the scale rounded down).
    deq_mean = q.dequantize().double().mean(0)
    clamped = torch.from_numpy(m.scaled[0]).double().clamp(-6, 6)
    unit = torch.tensor(m.scales[0]).repeat_interleave(16) * m.s_dec
    steps = [hi - lo for lo, hi in map(ref.e2m1_neighbours, m.scaled[0])]
    bound = torch.tensor(steps) * unit * t_unit + 1e-6 * row[0].double().abs()
    assert ((deq_mean - clamped * unit).abs() <= bound).all()
    assert ((clamped * unit - row[0].double()).abs() <= 1e-6 * row[0].double().abs()).sum() >= 60


def test_stochastic_same_seed_same_bits_different_seed_differs():
    # 15 of every 16 values have p = 1/2 (the other is 6, exact): two different seeds give the
    # same 15 * 256 bits with probability 2^-3840.
    x = midpoint_rows(256)

    def draw(seed: int, use_generator: bool):
        if use_generator:
            return nvfp4.quantize(
                x, rounding="stochastic", generator=torch.Generator().manual_seed(seed)
            ).data
        torch.manual_seed(seed)
        return nvfp4.quantize(x, rounding="stochastic").data

    for use_generator in (False, True):
        exact(draw(7, use_generator), draw(7, use_generator))
        assert not torch.equal(draw(7, use_generator), draw(8, use_generator))


def test_stochastic_exact_values_do_not_move():
    grid = [6.0, 0, 0.5, 1, 1.5, 2, 3, 4, -0.5, -1, -1.5, -2, -3, -4, -6, -0.0]
    x = torch.tensor(grid).repeat(64, 1)
    nearest = nvfp4.quantize(x)
    for seed in range(3):
        q = nvfp4.quantize(x, rounding="stochastic", generator=torch.Generator().manual_seed(seed))
        exact(q.data, nearest.data)


def test_transpose_refuses_hadamard_copy():
    q = nvfp4.quantize(torch.randn(32, 32), block="16x16", hadamard=True)
    with pytest.raises(ValueError, match="Hadamard"):
        q.t()
