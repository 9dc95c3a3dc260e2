"""MXFP8 kernels, bit for bit against formats/mxfp8.py (interpreter on CPU, large on GPU).

In the interpreter the E4M3 data cast is the kernel's integer-bit rounding; on the GPU it is
the hardware conversion. Both must equal torch's cast of the clamped value.
"""

import pytest
import torch
import triton
import triton.language as tl

from blockscale import kernels
from blockscale.formats import mxfp8
from blockscale.kernels._common import e4m3_round, to_bf16_bits

ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (large shapes)")


def randn(*shape, seed=0, dtype=torch.bfloat16, outliers=False) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(*shape, generator=g, device=DEV)
    if outliers:
        hit = torch.rand(*shape, generator=g, device=DEV) < 1e-3
        x = torch.where(hit, x * 300, x)
    return x.to(dtype)


def assert_same(q: mxfp8.MXFP8Tensor, r: mxfp8.MXFP8Tensor) -> None:
    assert q.shape == r.shape and q.data.dtype == torch.float8_e4m3fn
    assert q.scale.dtype == torch.float8_e8m0fnu
    torch.testing.assert_close(q.data.view(torch.uint8), r.data.view(torch.uint8), atol=0, rtol=0)
    torch.testing.assert_close(q.scale.view(torch.uint8), r.scale.view(torch.uint8), atol=0, rtol=0)


def assert_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype == torch.bfloat16 and a.shape == b.shape
    nan = a.isnan()
    assert torch.equal(nan, b.isnan())
    torch.testing.assert_close(a.view(torch.int16)[~nan], b.view(torch.int16)[~nan], atol=0, rtol=0)


@pytest.mark.parametrize(
    ("shape", "transpose"),
    [((32, 64), False), ((32, 64), True), ((17, 96), False), ((96, 32), True), ((3, 5, 64), False),
     ((64, 160), True)],
    ids=str,
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_quantize_matches_reference(shape, transpose, dtype):
    x = randn(*shape, seed=shape[-1], dtype=dtype, outliers=True)
    q, dq = kernels.mxfp8_quantize(x, transpose=transpose, return_dq=True)
    r = mxfp8.quantize(x, transpose=transpose)
    assert_same(q, r)
    assert_bits(dq, r.dq())


def test_power_of_two_edges_subnormals_and_non_finite():
    # block_amax = 448 * 2^k must give e = k exactly; blocks of tiny values exercise E4M3
    # subnormals and the clamp at e = -127; Inf and NaN blocks get the NaN scale.
    rows = []
    for k in range(-20, 21, 4):
        row = torch.linspace(-1, 1, 32) * 448 * 2.0**k
        row[0] = 448 * 2.0**k
        rows.append(row)
    rows.append(torch.linspace(-1, 1, 32) * 1e-38)
    rows.append(torch.full((32,), 3e-45))
    rows.append(torch.zeros(32))
    rows.append(torch.tensor([1.0, 2**-12, 2**-10, 2**-9 * 3, 2**-9 * 5] + [1e-3] * 27))
    inf_row = torch.randn(32)
    inf_row[4] = float("inf")
    nan_row = torch.randn(32)
    nan_row[7] = float("nan")
    rows += [inf_row, nan_row]
    x = torch.stack(rows).to(DEV)
    x = torch.cat((x, torch.zeros(32 - x.shape[0], 32, device=DEV))) if x.shape[0] < 32 else x
    for transpose in (False, True):
        xt = x.t().contiguous() if transpose else x
        q, dq = kernels.mxfp8_quantize(xt, transpose=transpose, return_dq=True)
        r = mxfp8.quantize(xt, transpose=transpose)
        assert_same(q, r)
        assert_bits(dq, r.dq())


@triton.jit
def _e4m3_round_kernel(x_ptr, out_ptr, n, B: tl.constexpr):
    i = tl.program_id(0) * B + tl.arange(0, B)
    tl.store(out_ptr + i, e4m3_round(tl.load(x_ptr + i, mask=i < n)), mask=i < n)


def test_e4m3_round_equals_torchs_cast_at_every_grid_point_tie_and_neighbour():
    """The dq's E4M3 rounding (an FP32 add in a binade whose ulp is the E4M3 step) against
    torch's cast: every finite E4M3 value, every midpoint between neighbours (a tie: to the
    even code) and the FP32 numbers on either side of it, both signs, signed zeros, tiny and
    FP32-subnormal values, the +-448 saturation bound and NaN."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite() & (grid >= 0)].unique()  # 0 .. 448, sorted
    mid = (grid[1:] + grid[:-1]) / 2
    up, down = torch.full_like(mid, float("inf")), torch.full_like(mid, -float("inf"))
    special = torch.tensor([0.0, 2.0**-10, 2.0**-12, 1e-30, 1e-40, 3e-45, 2.0**-6, 448.0])
    mags = torch.cat((grid, mid, mid.nextafter(up), mid.nextafter(down), special))
    x = torch.cat((mags, -mags, torch.tensor([-0.0, float("nan")]))).to(DEV)
    out = torch.empty_like(x)
    _e4m3_round_kernel[(triton.cdiv(x.numel(), 256),)](x, out, x.numel(), B=256)
    want = x.to(torch.float8_e4m3fn).float()
    nan = want.isnan()
    assert torch.equal(out.isnan(), nan)
    torch.testing.assert_close(out[~nan].view(torch.int32), want[~nan].view(torch.int32),
                               atol=0, rtol=0)  # fmt: skip


def test_both_directions_from_one_read():
    x = randn(64, 96, seed=4, outliers=True)
    (qr, dqr), (qc, dqc) = kernels.mxfp8_quantize_both(x, return_dq=True)
    rr, rc = mxfp8.quantize(x), mxfp8.quantize(x, transpose=True)
    assert_same(qr, rr)
    assert_same(qc, rc)
    assert_bits(dqr, rr.dq())
    assert_bits(dqc, rc.dq())
    qr2, qc2 = kernels.mxfp8_quantize_both(x)
    assert_same(qr2, rr)
    assert_same(qc2, rc)


def test_both_directions_write_only_the_dq_asked_for():
    x = randn(64, 96, seed=5, outliers=True)
    rr, rc = mxfp8.quantize(x), mxfp8.quantize(x, transpose=True)
    for flags in ((True, False), (False, True)):
        (qr, dqr), (qc, dqc) = kernels.mxfp8_quantize_both(x, return_dq=flags)
        assert_same(qr, rr)
        assert_same(qc, rc)
        assert (dqr is not None, dqc is not None) == flags
        for dq, r in ((dqr, rr), (dqc, rc)):
            if dq is not None:
                assert_bits(dq, r.dq())


@pytest.mark.parametrize("shape", [(64, 96), (17, 64), (3, 5, 32)], ids=str)
def test_dequantize_dq_kernel(shape):
    x = randn(*shape, seed=6, outliers=True)
    x.view(-1)[:4] = torch.tensor([1e-38, -3e-39, 0.0, -0.0])  # BF16 subnormals, signed zero
    r = mxfp8.quantize(x)
    assert_bits(kernels.mxfp8_dequantize_dq(r), r.dq())
    rt = mxfp8.quantize(x.reshape(-1, shape[-1]), transpose=True) if shape[0] % 32 == 0 else r
    assert_bits(kernels.mxfp8_dequantize_dq(rt), rt.dq())


def test_dequantize_dq_kernel_non_finite_and_extreme_scales():
    x = randn(32, 96, seed=7)
    x[0, 0] = float("nan")  # block 0 of row 0: NaN scale
    x[1, 40] = float("inf")
    x[2, 64:96] = 2.0**-140  # the smallest scales: products below 2^-133 round in BF16
    x[3, 32:64] = 3e38  # the largest
    r = mxfp8.quantize(x.float())
    assert_bits(kernels.mxfp8_dequantize_dq(r), r.dq())


def test_shape_rules():
    with pytest.raises(ValueError, match="K=48"):
        kernels.mxfp8_quantize(torch.zeros(4, 48, device=DEV))
    with pytest.raises(ValueError, match="K=48"):
        kernels.mxfp8_quantize_both(torch.zeros(48, 64, device=DEV))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape", [(8192, 5120), (8192, 11328), (14336, 16384)], ids=str)
def test_gpu_large_shapes(shape):
    x = randn(*shape, seed=shape[1], outliers=True)
    (qr, dqr), (qc, dqc) = kernels.mxfp8_quantize_both(x, return_dq=True)
    rr = mxfp8.quantize(x)
    assert_same(qr, rr)
    assert_bits(dqr, rr.dq())
    del qr, dqr, rr
    rc = mxfp8.quantize(x, transpose=True)
    assert_same(qc, rc)
    assert_bits(dqc, rc.dq())
    assert_bits(kernels.mxfp8_dequantize_dq(qc), dqc)


@triton.jit
def _to_bf16_bits_kernel(x_ptr, hw_ptr, int_ptr, n, B: tl.constexpr):
    i = tl.program_id(0) * B + tl.arange(0, B)
    x = tl.load(x_ptr + i, mask=i < n)
    tl.store(hw_ptr + i, to_bf16_bits(x, True), mask=i < n)
    tl.store(int_ptr + i, to_bf16_bits(x, False), mask=i < n)


@pytest.mark.gpu
@needs_gpu
def test_gpu_hardware_bf16_conversion_equals_the_integer_rounding():
    """The dq's BF16 conversion on the GPU (to_bf16_bits with HW) against the integer rounding
    the interpreter runs: every tie and its neighbours in a few binades, BF16-subnormal and
    FP32-subnormal values (where BF16's quantum 2^-133 rounds), signed zeros, the overflow
    edge and Inf; NaN only by class (the hardware's NaN has its own payload)."""
    base = torch.tensor([1.0, 1.5, 3.0, 2.0**-126, 2.0**-130, 2.0**-133, 2.0**-140, 2.0**127])
    ties = torch.cat([(base.view(torch.int32) + k).view(torch.float32) for k in
                      (0x7FFF, 0x8000, 0x8001, 0x17FFF, 0x18000, 0x18001, 1, 0xFFFF)])  # fmt: skip
    special = torch.tensor([0.0, 3.4028234663852886e38, float("inf"), 1e-45, 5e-41, float("nan")])
    mags = torch.cat((ties, special, torch.rand(4096, generator=torch.Generator().manual_seed(0))))
    x = torch.cat((mags, -mags)).to(DEV)
    hw = torch.empty(x.shape, dtype=torch.int16, device=DEV)
    ref = torch.empty_like(hw)
    _to_bf16_bits_kernel[(triton.cdiv(x.numel(), 256),)](x, hw, ref, x.numel(), B=256)
    nan = x.isnan()
    assert torch.equal(hw[~nan], ref[~nan])
    assert torch.equal(hw[~nan], x[~nan].to(torch.bfloat16).view(torch.int16))
    assert bool(hw[nan].view(torch.bfloat16).isnan().all())
