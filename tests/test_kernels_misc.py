"""Global amax, 16x16 nibble transpose and the 128x4 scale swizzle kernels, exact against
their references in formats/."""

import importlib

import pytest
import torch

from blockscale import kernels
from blockscale.formats import hadamard, nvfp4, swizzle

ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (large shapes)")


def randn(*shape, seed=0, dtype=torch.bfloat16, outliers=0.0) -> torch.Tensor:
    """randn; with `outliers`, about that fraction of values scaled by 50-500 (activations)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(*shape, generator=g, device=DEV)
    if outliers:
        hit = torch.rand(*shape, generator=g, device=DEV) < outliers
        x = torch.where(hit, x * (50 + 450 * torch.rand(*shape, generator=g, device=DEV)), x)
    return x.to(dtype)


def exact(a, b):
    torch.testing.assert_close(a, b, atol=0, rtol=0, equal_nan=True)


# The module (blockscale.kernels.amax is the function of that name).
amax_module = importlib.import_module("blockscale.kernels.amax")


def hadamard_t_amax(x: torch.Tensor) -> torch.Tensor:
    return hadamard.transform(x.reshape(-1, x.shape[-1]).t()).float().abs().amax()


def assert_fused_exact(x: torch.Tensor) -> None:
    plain, had = kernels.amax_fused(x)
    exact(plain, x.float().abs().amax())
    exact(had, hadamard_t_amax(x))


@pytest.mark.parametrize("shape", [(16, 16), (48, 96), (80, 48), (17, 33), (2, 16, 40)], ids=str)
def test_amax(shape):
    x = randn(*shape, seed=shape[-1])
    x.view(-1)[5] = -7.5  # the largest magnitude is negative
    exact(kernels.amax(x), x.float().abs().amax())
    exact(kernels.amax(x.float()), x.float().abs().amax())


@pytest.mark.parametrize("where", [0, -1], ids=["first", "last"])
def test_amax_over_several_tiles_per_program(where):
    """3 x 3 tiles (the last row and column of tiles partial), two to a program, so the last
    program's second tile lies past the end: the largest magnitude is found in the first and
    in the last tile. (Tiles follow kernels.amax's TILES["plain"], 32 x 256 with 2 a program.)"""
    x = randn(80, 600, seed=3)
    x.view(-1)[where] = -9.25
    exact(kernels.amax(x), torch.tensor(9.25, device=DEV))
    exact(kernels.amax(x.float()), torch.tensor(9.25, device=DEV))


@pytest.mark.parametrize("shape", [(16, 16), (48, 96), (80, 48), (2, 16, 40)], ids=str)
def test_fused_amax_plain_and_hadamard_columnwise(shape):
    x = randn(*shape, seed=shape[-1] + 1)
    plain, had = kernels.amax_fused(x)
    exact(plain, x.float().abs().amax())
    exact(had, hadamard_t_amax(x))
    exact(kernels.amax_hadamard_t(x), had)
    exact(had, nvfp4.quantize(x, hadamard=True, transpose=True).amax)


def test_amax_non_finite_and_zero():
    x = torch.zeros(32, 32, device=DEV)
    exact(kernels.amax(x), torch.tensor(0.0, device=DEV))
    x[3, 4] = -float("inf")
    exact(kernels.amax(x), torch.tensor(float("inf"), device=DEV))
    x[5, 6] = float("nan")
    assert kernels.amax(x).isnan()
    assert kernels.amax_fused(x)[1].isnan()


def test_fused_amax_of_single_blocks():
    """Each 16-value block alone, so that a wrong sign anywhere in the butterfly shows (the
    max over many blocks could hide it)."""
    x = randn(16 * 6, 4, seed=3, outliers=0.02)
    x[:16, 0] = torch.arange(1, 17)  # every output of H applied to 1..16 is distinct
    for b in range(6):
        for j in range(4):
            block = x[16 * b : 16 * (b + 1), j : j + 1]
            exact(kernels.amax_hadamard_t(block), hadamard_t_amax(block))


@pytest.mark.parametrize("tiles", [None, (16, 64, 4, 2), (32, 32, 2, 1), (16, 128, 4, 16)], ids=str)
@pytest.mark.parametrize("shape", [(176, 1100), (32, 1024), (64, 96)], ids=str)
def test_fused_amax_strips_and_column_tails(tiles, shape, monkeypatch):
    """Several programs along both axes, the last strip re-reading its last group (176 rows
    are 11 groups), K a multiple of the tile (no mask) or not."""
    if tiles is not None:
        monkeypatch.setitem(amax_module.TILES, "hadamard", tiles)
    assert_fused_exact(randn(*shape, seed=shape[1], outliers=0.02))


def test_fused_amax_all_zero():
    plain, had = kernels.amax_fused(torch.zeros(48, 80, dtype=torch.bfloat16, device=DEV))
    exact(plain, torch.tensor(0.0, device=DEV))
    exact(had, torch.tensor(0.0, device=DEV))


BIG = 2.0**123  # from here on a strip takes the exact butterfly


@pytest.mark.parametrize(
    "case",
    [
        "inf",
        "-inf",
        "two-infs-one-block",
        "two-infs-last-stage",
        "infs-two-blocks",
        "nan",
        "huge",
        "at-threshold",
        "below-threshold",
    ],
)
def test_fused_amax_non_finite_and_huge(case):
    """Inf alone in a block gives Inf, two in one block NaN (Inf - Inf in some output), NaN
    gives NaN, as in the reference; values from 2^123 up take the exact path, just below the
    fast one. The strip with the special value sits among ordinary ones. (The interpreter's
    max propagates NaN either way; that the GPU keeps NaN is checked on the GPU.)"""
    x = randn(96, 600, seed=7, outliers=0.02)
    r, c = 37, 530
    if case in ("inf", "-inf"):
        x[r, c] = float(case)
    elif case == "two-infs-one-block":
        x[r, c], x[r + 2, c] = float("inf"), float("inf")
    elif case == "two-infs-last-stage":  # rows 8 apart meet only in the last butterfly stage
        x[r, c], x[r + 8, c] = float("inf"), -float("inf")
    elif case == "infs-two-blocks":
        x[r, c], x[r + 16, c] = float("inf"), -float("inf")
    elif case == "nan":
        x[r, c] = float("nan")
    elif case == "huge":
        x[r, c], x[r + 1, c + 1] = 2.0**126, -3e38
    elif case == "at-threshold":
        x[32:48, c] = -BIG  # a whole block: partial sums up to 16 * 2^123
    else:
        x[32:48, c] = BIG - 2.0**115  # the BF16 value below 2^123, a whole block
    assert_fused_exact(x)
    exact(kernels.amax_hadamard_t(x), hadamard_t_amax(x))
    if case.startswith("two-infs"):
        assert kernels.amax_fused(x)[1].isnan()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_hadamard_amax_other_dtypes(dtype):
    # FP32 with BF16-representable values, so that the reference's partial sums are exact
    x = randn(64, 200, seed=11, outliers=0.02).to(dtype)
    exact(kernels.amax_hadamard_t(x), hadamard_t_amax(x))
    exact(kernels.amax_fused(x)[0], x.float().abs().amax())


def test_amax_rejects_hadamard_rows():
    with pytest.raises(ValueError, match="multiple of 16"):
        kernels.amax_hadamard_t(torch.zeros(20, 32, device=DEV))


@pytest.mark.parametrize("shape", [(16, 16), (32, 96), (80, 48), (128, 32)], ids=str)
def test_transpose_16x16_is_exact(shape):
    x = randn(*shape, seed=shape[0])
    q = nvfp4.quantize(x, block="16x16")
    t = kernels.nvfp4_transpose_16x16(q)
    r = q.t()
    assert t.shape == r.shape and t.block == "16x16"
    exact(t.data, r.data)
    exact(t.scale.view(torch.uint8), r.scale.view(torch.uint8))
    # and it is the quantization of the transposed tensor
    qt = nvfp4.quantize(x.t().contiguous(), block="16x16", amax=q.amax)
    exact(t.data, qt.data)
    exact(t.scale.view(torch.uint8), qt.scale.view(torch.uint8))


def test_transpose_rejects_1x16():
    with pytest.raises(ValueError, match="16x16"):
        kernels.nvfp4_transpose_16x16(nvfp4.quantize(randn(16, 32)))


@pytest.mark.parametrize(
    "shape", [(1, 1), (5, 3), (128, 4), (130, 9), (256, 8), (300, 70)], ids=str
)
def test_swizzle_matches_to_blocked(shape):
    g = torch.Generator(device=DEV).manual_seed(shape[0])
    raw = torch.randint(0, 255, shape, generator=g, device=DEV, dtype=torch.uint8)
    for dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu):
        s = raw.view(dtype)
        out = kernels.swizzle_scales(s)
        assert out.dtype == dtype
        exact(out.view(torch.uint8), swizzle.to_blocked(s).view(torch.uint8))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape", [(8192, 5120), (14336, 16384)], ids=str)
def test_gpu_large(shape):
    x = randn(*shape, seed=1)
    plain, had = kernels.amax_fused(x)
    exact(plain, x.float().abs().amax())
    exact(had, hadamard_t_amax(x))
    q = nvfp4.quantize(x, block="16x16")
    t = kernels.nvfp4_transpose_16x16(q)
    exact(t.data, q.t().data)
    exact(t.scale.view(torch.uint8), q.t().scale.view(torch.uint8))
    s = q.scale
    exact(kernels.swizzle_scales(s).view(torch.uint8), swizzle.to_blocked(s).view(torch.uint8))


@pytest.mark.gpu
@needs_gpu
def test_gpu_amax_pairs_from_zeroed_blocks(monkeypatch):
    """The amax kernels' zeroed pairs (`_ZeroedPairs`): across more than a block's pairs, on
    two streams, with a NaN tensor between them (its pair holds the NaN bits afterwards), every
    amax equals the reference, each pair is 16-byte aligned and none is handed out twice."""
    monkeypatch.setattr(amax_module, "POOL_PAIRS", 8)
    monkeypatch.setattr(amax_module, "_ZEROED", amax_module._ZeroedPairs())
    xs = [randn(64, 128, seed=i) * (i + 1) for i in range(20)]
    xs[5][3, 7] = float("nan")
    side = torch.cuda.Stream()
    seen, got = set(), []
    for i, x in enumerate(xs):
        stream = side if i % 3 == 0 else torch.cuda.current_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            plain, had = kernels.amax_fused(x)
        torch.cuda.current_stream().wait_stream(stream)
        assert plain.data_ptr() % 16 == 0 and plain.data_ptr() not in seen
        seen.add(plain.data_ptr())
        got.append((plain, had))
    torch.cuda.synchronize()
    for x, (plain, had) in zip(xs, got, strict=True):
        exact(plain, x.float().abs().amax())
        exact(had, hadamard_t_amax(x))


# ------------------------------------------------------------------- GEMM epilogue


def epilogue_inputs(m=40, n=300, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    acc = torch.randn(m, n, generator=g, device=DEV) * 3
    # BF16 rounding ties (halfway between two BF16 values, both parities), subnormals,
    # non-finite values and values that overflow after the product
    acc[0, :4] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-130], device=DEV)
    acc[1, :4] = torch.tensor([float("inf"), float("nan"), -0.0, 3e38], device=DEV)
    bias = torch.randn(n, generator=g, device=DEV)
    return acc, bias


AMAXES = {
    "no-alpha": None,
    "alpha": (3.5, 0.0390625),
    "zero-amax": (0.0, 7.0),
    "inf-amax": (float("inf"), 2.0),
    "nan-amax": (1.0, float("nan")),
}


@pytest.mark.parametrize("amax", list(AMAXES.values()), ids=list(AMAXES))
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_gemm_epilogue_rounds_like_the_reference(amax, with_bias):
    acc, bias = epilogue_inputs()
    bias = bias if with_bias else None
    a = None if amax is None else torch.tensor(amax, device=DEV)
    ref = acc.clone()
    if a is not None:  # the reference epilogue: alpha from formats' decode scales
        ref.mul_(nvfp4.decode_scale(a[0]) * nvfp4.decode_scale(a[1]))
    if bias is not None:
        ref.add_(bias)
    got = kernels.gemm_epilogue(acc, a, bias)
    want = ref.to(torch.bfloat16)
    assert got.dtype == torch.bfloat16
    # bit patterns (so -0.0 != 0.0), NaN where the reference is NaN (any payload)
    assert torch.equal(got.isnan(), want.isnan())
    finite = ~want.isnan()
    exact(got.view(torch.int16)[finite], want.view(torch.int16)[finite])
    in_place = kernels.gemm_epilogue(acc.clone(), a, bias, out_dtype=torch.float32)
    exact(in_place, ref)


def test_gemm_epilogue_writes_into_a_row_slice():
    acc, bias = epilogue_inputs(m=24, n=64, seed=1)
    acc[1, :4] = 1.0  # finite everywhere here
    amax = torch.tensor([2688.0, 1344.0], device=DEV)  # S_dec = 1 and 0.5: alpha = 0.5
    out = torch.full((40, 64), 7.0, dtype=torch.bfloat16, device=DEV)
    kernels.gemm_epilogue(acc, amax, bias, out=out[8:32])
    exact(out[8:32], (acc * 0.5 + bias).to(torch.bfloat16))
    assert (out[:8] == 7).all() and (out[32:] == 7).all()


def test_gemm_epilogue_rejects_bad_arguments():
    acc = torch.zeros(4, 8, device=DEV)
    with pytest.raises(ValueError, match="FP32"):
        kernels.gemm_epilogue(acc.bfloat16())
    with pytest.raises(ValueError, match="bias must be"):
        kernels.gemm_epilogue(acc, bias=torch.zeros(3, device=DEV))
    with pytest.raises(ValueError, match="two operands"):
        kernels.gemm_epilogue(acc, amax=torch.ones(1, device=DEV))
    with pytest.raises(ValueError, match="out must be"):
        kernels.gemm_epilogue(acc, out=torch.zeros(4, 8, dtype=torch.float16, device=DEV))


def test_gemm_epilogue_op_schema():
    acc, bias = epilogue_inputs(m=16, n=32, seed=2)
    out = torch.empty(16, 32, dtype=torch.bfloat16, device=DEV)
    one = torch.ones((), device=DEV)
    args = (acc, one, one, bias, out)
    utils = ("test_schema", "test_faketensor") if ON_GPU else ("test_schema",)
    torch.library.opcheck(torch.ops.blockscale.gemm_epilogue, args, test_utils=utils)


# ----------------------------------------------------------------------------- grid order


def _band_outputs(band: int, monkeypatch) -> list[torch.Tensor]:
    """Every banded launch's outputs with `_common.BAND = band`, on shapes with more row
    tiles than one band holds (the last band partly past the rows)."""
    from blockscale.formats import grouped as G
    from blockscale.kernels import _common
    from blockscale.kernels import grouped as KG

    monkeypatch.setattr(_common, "BAND", band)
    x = randn(96, 32, seed=3, outliers=0.01)  # 3 row tiles of 32: bands of 2 end past the rows
    amax, amax_t = kernels.amax(x), kernels.amax_hadamard_t(x)
    torch.manual_seed(0)
    (r, dr), (c, dc) = kernels.nvfp4_quantize_both(
        x,
        {"amax": amax, "rounding": "stochastic"},
        {"hadamard": True, "amax": amax_t, "rounding": "stochastic"},
        return_dq=True,
    )
    (m, dm), (mt, dmt) = kernels.mxfp8_quantize_both(x, return_dq=True)
    offs = torch.tensor([20, 20, 60, x.shape[0]], dtype=torch.int32, device=DEV)
    layout = G.token_layout(offs, x.shape[0])
    g_amax, g_amax_t = KG.group_amax(x, layout, plain=True, hadamard=True)
    (gr, gdr), (gt, gdt) = KG.nvfp4_quantize_grouped(
        x, layout, rows="stochastic", tokens="stochastic", hadamard=True, return_dq=(True, True)
    )
    (xr, xdr), (xt, xdt) = KG.mxfp8_quantize_grouped(x, layout, True, True, (True, True))
    out = [r.data, r.scale, dr, c.data, c.scale, dc, kernels.nvfp4_dequantize_dq(c)]
    out += [m.data, m.scale, dm, mt.data, mt.scale, dmt, kernels.mxfp8_dequantize_dq(mt)]
    out += [g_amax, g_amax_t, gr.data, gr.scale, gdr, gt.data, gt.scale, gdt]
    out += [xr.data, xr.scale, xdr, xt.data, xt.scale, xdt]
    return [t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for t in out]


def test_band_order_gives_the_one_band_grids_bits(monkeypatch):
    """The banded grid (kernels/_common.py) only reorders the programs: with bands of 2 row
    tiles (the last band partly past the rows) every banded kernel writes exactly what the
    old grid (one band of every row tile) wrote, stochastic rounding included."""
    banded = _band_outputs(2, monkeypatch)
    whole = _band_outputs(1 << 30, monkeypatch)
    assert len(banded) == len(whole) == 28
    for a, b in zip(banded, whole, strict=True):
        exact(a, b)


def test_band_grid_stays_within_the_grid_limits():
    from blockscale.kernels._common import BAND, band_grid

    assert band_grid(16384, 8192, 32, 64) == ((BAND, 128, 16384 // 32 // BAND), BAND)
    assert band_grid(64, 64, 32, 64) == ((2, 1, 1), 2)  # fewer row tiles than a band
    # 10 row tiles: two bands of 5, no program past the rows
    assert band_grid(320, 64, 32, 64) == ((5, 1, 2), 5)
    assert band_grid(0, 64, 32, 64)[0][0] >= 1
    grid, band = band_grid(2**31, 16, 16, 16)  # 2^27 row tiles: bands grow past BAND
    assert grid[2] <= 65535 and grid[0] * grid[2] >= 2**27 and band == grid[0]
