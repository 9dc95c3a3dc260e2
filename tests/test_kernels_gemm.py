"""The fused GEMM + epilogue kernel (kernels/gemm.py) against cuBLAS-or-CPU GEMM + the reference
epilogue.

A GEMM's FP32 summation order is unspecified (NUMERICS.md, "GEMMs"), so the exact tests use
operands whose every partial sum is exact in FP32 (small integers times powers of two): every
order then gives the same accumulator, and the kernel's epilogue (alpha, bias, cast) must
match the reference epilogue bit for bit. On random data the output is compared with the
cuBLAS path within the reassociation of FP32 sums (GPU, the step's shapes).
"""

import pytest
import torch

from blockscale.formats import nvfp4
from blockscale.kernels import gemm
from tests.test_kernels_misc import AMAXES  # the epilogue kernel's alpha cases

ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"
# Operands are BF16 on the GPU; the CPU path (and so the interpreter) multiplies FP32 ones.
OPERAND = torch.bfloat16 if ON_GPU else torch.float32
SMALL = (32, 64, 32, 4, 4, 2, 1, 0)  # tiles the interpreter runs quickly; edges in every dim


def exact(a, b):
    torch.testing.assert_close(a, b, atol=0, rtol=0, equal_nan=True)


def dyadic(*shape, seed):
    """Integers in [-8, 8] times 1/8: products and sums stay exact in FP32 for K < 2^14."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randint(-8, 9, shape, generator=g, device=DEV) / 8).to(OPERAND)


def operands(m, k, n, b_layout, seed=0):
    a = dyadic(m, k, seed=seed)
    if b_layout == "k-major":
        b = dyadic(n, k, seed=seed + 1)
    else:  # a [N, K] view of a [K, N] tensor: the transposed 16x16 weight of dgrad
        b = dyadic(k, n, seed=seed + 1).t()
    return a, b


def reference(a, b, amax, bias, out_dtype):
    acc = (a.double() @ b.double().t()).float()  # exact: see dyadic
    if amax is not None:
        acc.mul_(nvfp4.decode_scale(amax[0]) * nvfp4.decode_scale(amax[1]))
    if bias is not None:
        acc.add_(bias)
    return acc.to(out_dtype)


def same_bits(got, want):
    assert got.dtype == want.dtype
    assert torch.equal(got.isnan(), want.isnan())
    finite = ~want.isnan()
    ints = torch.int16 if got.dtype == torch.bfloat16 else torch.int32
    exact(got.view(ints)[finite], want.view(ints)[finite])


@pytest.mark.parametrize("amax", list(AMAXES.values()), ids=list(AMAXES))
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("b_layout", ["k-major", "n-major"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_fused_gemm_epilogue_is_exact(amax, with_bias, b_layout, out_dtype):
    m, k, n = 40, 96, 72  # edges in M and N, and a K tail of half a tile
    a, b = operands(m, k, n, b_layout)
    g = torch.Generator(device=DEV).manual_seed(3)
    bias = torch.randn(n, generator=g, device=DEV) if with_bias else None
    amax_t = None if amax is None else tuple(torch.tensor(v, device=DEV) for v in amax)
    got = gemm.gemm_fused(a, b, amax_t, bias, out_dtype=out_dtype, config=SMALL)
    same_bits(got, reference(a, b, amax_t, bias, out_dtype))


WS_SMALL = (*SMALL[:6], 0, gemm.WS_DEVICE_DESCRIPTORS)  # the warp-specialized kernel's tiles


@pytest.mark.parametrize("variant", ["whole-tile store", "warp-specialized"])
@pytest.mark.parametrize("b_layout", ["k-major", "n-major"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_fused_gemm_variants_are_exact(variant, b_layout, out_dtype, monkeypatch):
    """The same exact epilogue from the other launches of kernels/gemm.py: a BF16 output tile
    stored whole (EPILOGUE_HALVES off; on, the default, is the test above), and the
    warp-specialized kernel (a config's last field WS_DEVICE_DESCRIPTORS: descriptors made in
    the kernel, its own tile walk)."""
    config = SMALL
    if variant == "whole-tile store":
        monkeypatch.setattr(gemm, "EPILOGUE_HALVES", False)
    else:
        config = WS_SMALL
    a, b = operands(40, 96, 72, b_layout, seed=7)
    g = torch.Generator(device=DEV).manual_seed(4)
    bias = torch.randn(72, generator=g, device=DEV)
    amax = (torch.tensor(37.0, device=DEV), torch.tensor(11.0, device=DEV))
    got = gemm.gemm_fused(a, b, amax, bias, out_dtype=out_dtype, config=config)
    same_bits(got, reference(a, b, amax, bias, out_dtype))


def test_fused_gemm_writes_into_a_row_slice_and_nowhere_else():
    a, b = operands(24, 64, 64, "k-major", seed=5)
    amax = (torch.tensor(2688.0, device=DEV), torch.tensor(1344.0, device=DEV))  # alpha = 0.5
    out = torch.full((40, 64), 7.0, dtype=torch.bfloat16, device=DEV)
    gemm.gemm_fused(a, b, amax, out=out[8:32], config=SMALL)
    same_bits(out[8:32], reference(a, b, amax, None, torch.bfloat16))
    assert (out[:8] == 7).all() and (out[32:] == 7).all()


def test_fused_gemm_default_config_and_one_tile_shapes():
    for m, k, n in [(16, 16, 16), (130, 200, 8)]:
        a, b = operands(m, k, n, "k-major", seed=m)
        same_bits(gemm.gemm_fused(a, b), reference(a, b, None, None, torch.bfloat16))


def test_config_for_picks_the_measured_tiles_per_shape():
    assert gemm.config_for(16384, 4096, 4096) == gemm.DEFAULT_CONFIG
    assert gemm.config_for(16384, 4096, 14336) == gemm.LONG_K_CONFIG
    assert gemm.config_for(4096, 4096, 16384) == gemm.DEFAULT_CONFIG  # grad_weight
    assert gemm.config_for(4096, 4096, 16384, torch.float32) == gemm.FP32_OUT_CONFIG
    # FP32 grad_input of the key / value projections (contraction 512): the same FP32 tiles
    assert gemm.config_for(16384, 2048, 512, torch.float32) == gemm.FP32_OUT_CONFIG
    assert gemm.config_for(16384, 2048, 2048, torch.float32) == gemm.FP32_OUT_CONFIG
    # the key / value projections of a Llama with 8 KV heads of 64 (N or K of 512): the
    # default tiles, by the layout of b
    assert gemm.config_for(16384, 512, 2048) == gemm.DEFAULT_CONFIG
    assert gemm.config_for(16384, 2048, 512) == gemm.DEFAULT_CONFIG
    assert gemm.config_for(16384, 2048, 512, b_kmajor=False) == gemm.NMAJOR_CONFIG
    # few output tiles (a BF16 grad_weight of 512 rows: 32 default tiles): 128 x 128 tiles;
    # with 128 default tiles, the default
    assert gemm.config_for(512, 2048, 16384) == gemm.FEW_TILES_CONFIG
    assert gemm.config_for(512, 2048, 16384, b_kmajor=False) == gemm.FEW_TILES_CONFIG
    assert gemm.config_for(2048, 2048, 16384) == gemm.DEFAULT_CONFIG
    assert gemm.config_for(16384, 1024, 4096) == gemm.DEFAULT_CONFIG
    # an N-major b (grad_input's transposed weight): bands of 16 row tiles, BF16 outputs only
    assert gemm.config_for(8192, 14336, 4096, b_kmajor=False) == gemm.NMAJOR_CONFIG
    assert gemm.config_for(8192, 4096, 4096, torch.float32, False) == gemm.FP32_OUT_CONFIG
    assert gemm.config_for(16384, 4096, 14336, b_kmajor=False) == gemm.LONG_K_CONFIG


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_chosen_configs_fit_in_shared_memory(out_dtype):
    # (an FP32 output tile of DEFAULT_CONFIG's size did not fit: OutOfResources on an H100)
    for mnk in [(16384, 4096, 4096), (16384, 4096, 14336), (4096, 4096, 16384), (16384, 2048, 512),
                (512, 2048, 16384), (64, 64, 64)]:  # fmt: skip
        config = gemm.config_for(*mnk, out_dtype)
        assert gemm.shared_memory_bytes(config, out_dtype) <= gemm.SHARED_MEMORY_BYTES
    assert gemm.shared_memory_bytes(gemm.DEFAULT_CONFIG, torch.float32) > gemm.SHARED_MEMORY_BYTES


def test_dispatch_falls_back_for_layouts_tma_cannot_read():
    from blockscale.gemm import dispatch

    a, b = operands(32, 64, 48, "k-major", seed=7)
    a_mn = a.t().contiguous().t()  # not K-major
    amax = (torch.tensor(3.5, device=DEV), torch.tensor(0.0390625, device=DEV))
    bias = torch.randn(48, generator=torch.Generator(device=DEV).manual_seed(1), device=DEV)
    assert not gemm.supported(a_mn, b, torch.empty(32, 48, device=DEV))
    got = torch.empty(32, 48, dtype=torch.bfloat16, device=DEV)
    dispatch._gemm_into(a_mn, b, *amax, bias, got)  # cuBLAS (FP32 out) + the epilogue kernel
    same_bits(got, reference(a, b, amax, bias, torch.bfloat16))


def test_fused_gemm_rejects_what_it_cannot_read():
    a, b = operands(32, 64, 32, "k-major")
    with pytest.raises(ValueError, match="TMA"):
        gemm.gemm_fused(a.t().contiguous().t(), b)  # a not K-major
    with pytest.raises(ValueError, match="both BF16"):
        gemm.gemm_fused(a.half(), b.half())
    with pytest.raises(ValueError, match="8 ints"):
        gemm.gemm_fused(a, b, config=(32, 64, 32))
    with pytest.raises(ValueError, match="bias must be"):
        gemm.gemm_fused(a, b, bias=torch.zeros(3, device=DEV))
    with pytest.raises(ValueError, match=r"need a \[M, K\]"):
        gemm.gemm_fused(a, b[:, :16])
    assert not gemm.supported(a[:, 1:], b[:, 1:], torch.empty(32, 32, device=DEV))  # misaligned


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (TMA, large shapes)")
@pytest.mark.parametrize(
    "m, k, n, b_layout",
    [
        (16384, 4096, 4096, "k-major"),  # output
        (16384, 4096, 4096, "n-major"),  # grad_input (transposed 16x16 weight)
        (4096, 16384, 4096, "k-major"),  # grad_weight
        (16384, 14336, 4096, "n-major"),  # the warp-specialized config
        (8192, 5120, 11328, "k-major"),
    ],
)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_fused_gemm_matches_cublas_on_random_data(m, k, n, b_layout, out_dtype):
    from blockscale.gemm import emulated
    from blockscale.kernels import gemm_epilogue

    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(m, k, generator=g, device="cuda").bfloat16()
    b = torch.randn(n, k, generator=g, device="cuda").bfloat16()
    if b_layout == "n-major":
        b = b.t().contiguous().t()
    amax = (torch.tensor(3.0, device="cuda"), torch.tensor(5.0, device="cuda"))
    got = gemm.gemm_fused(a, b, amax, out_dtype=out_dtype).float()
    want = gemm_epilogue(emulated.mm_fp32_accumulate(a, b), amax, out_dtype=out_dtype).float()
    # Only the FP32 summation order may differ: BF16 outputs a BF16 step apart at most, and
    # rarely; FP32 ones by the reassociation error of K-long sums.
    if out_dtype == torch.bfloat16:
        torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-30)
        assert (got != want).float().mean().item() < 1e-3
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (TMA, large shapes)")
def test_gpu_few_tiles_config_gives_the_default_tiles_bits():
    """A grad_weight of few output tiles (the 1B key / value projections' 512 x 16384 -> 2048)
    takes FEW_TILES_CONFIG for a BF16 output: its bits must be the default tiles' (both sum
    the contraction in the same 64-wide steps), and near the FP64 product. Not against cuBLAS,
    as the test above: cuBLAS splits this contraction, so its FP32 sums differ from any
    sequential order by more than that test allows (on an H200, 0.7% of the BF16 outputs a
    BF16 step apart, 2026-12-02), as far from FP64 as ours."""
    m, k, n = 512, 16384, 2048
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(m, k, generator=g, device="cuda").bfloat16()
    b = torch.randn(n, k, generator=g, device="cuda").bfloat16()
    amax = (torch.tensor(3.0, device="cuda"), torch.tensor(5.0, device="cuda"))
    assert gemm.config_for(m, n, k, torch.bfloat16, True) == gemm.FEW_TILES_CONFIG
    got = gemm.gemm_fused(a, b, amax)
    default = gemm.gemm_fused(a, b, amax, config=gemm.DEFAULT_CONFIG)
    assert torch.equal(got, default)
    alpha = 3.0 * 5.0 / (6 * 6 * 448 * 448)
    exact = (a.double() @ b.double().T) * alpha
    # FP32 sums of 16384 unit products err by ~2^-24 * k; a tile that lost or doubled one
    # 64-wide step would be off by ~8 (sqrt(64)) times alpha
    torch.testing.assert_close(got.double(), exact, rtol=2**-7, atol=2**-10 * k**0.5 * alpha)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (cuBLAS)")
@pytest.mark.parametrize(
    "m, k, n",
    [
        (16384, 2048, 512),  # the 1B key / value projections
        (16384, 512, 2048),  # their grad_input
        (256, 16384, 256),  # a long contraction with few output tiles: cuBLAS may split K
        (64, 12288, 96),
    ],
)
def test_gpu_cublas_bf16_route_rounds_once(m, k, n, monkeypatch):
    """CUBLAS_BF16_OUT: an MXFP8 GEMM (no alpha, no bias) with a BF16 output from cuBLAS must
    be cast(acc) rounded once. With dyadic operands every FP32 partial sum is exact, so a
    split-K reduction in BF16 (a second rounding) would show as a difference."""
    from blockscale.gemm import dispatch, emulated

    a, b = operands(m, k, n, "k-major", seed=3)
    monkeypatch.setattr(dispatch, "CUBLAS_BF16_OUT", True)
    fused_calls = []
    monkeypatch.setattr(gemm, "gemm_fused", lambda *a, **k: fused_calls.append(1))
    reduced = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    got = dispatch._gemm(a, b, None, None, None, torch.bfloat16)
    assert not fused_calls
    assert torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction == reduced
    exact(got, emulated.mm_fp32_accumulate(a, b).bfloat16())


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (Hopper warp specialization)")
@pytest.mark.parametrize("b_layout", ["k-major", "n-major"])
def test_gpu_warp_specialized_kernel_gives_the_default_tiles_bits(b_layout):
    """The warp-specialized launch (a producer warpgroup, two consumers each summing half the
    rows of a tile) sums each output in the default tiles' order: the same bits, on random data
    with partial tiles in M and N, run twice (a race would show as a difference)."""
    m, k, n = 4160, 2048, 2304
    g = torch.Generator(device="cuda").manual_seed(1)
    a = torch.randn(m, k, generator=g, device="cuda").bfloat16()
    if b_layout == "k-major":
        b = torch.randn(n, k, generator=g, device="cuda").bfloat16()
    else:
        b = torch.randn(k, n, generator=g, device="cuda").bfloat16().t()
    amax = (torch.tensor(37.0, device="cuda"), torch.tensor(11.0, device="cuda"))
    default = (*gemm.DEFAULT_CONFIG[:7], 0)
    ws = (128, 256, 64, 8, 4, 3, 0, gemm.WS_DEVICE_DESCRIPTORS)
    want = gemm.gemm_fused(a, b, amax, config=default)
    for _ in range(2):
        assert torch.equal(gemm.gemm_fused(a, b, amax, config=ws), want)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (the hardware BF16 conversion)")
@pytest.mark.parametrize("halves", [False, True], ids=["whole", "halves"])
def test_gpu_hardware_bf16_rounding_gives_the_integer_roundings_bits(halves, monkeypatch):
    """epilogue.HW_BF16 (the GPU's conversion in the GEMM epilogues) against the integer
    rounding: the same bits for every finite output, ties and subnormals among them, and NaN
    where the integer rounding has NaN (Inf * 0 in a row of a)."""
    from blockscale.kernels import epilogue  # noqa: PLC0415

    monkeypatch.setattr(gemm, "EPILOGUE_HALVES", halves)
    m, k, n = 1024, 512, 768
    g = torch.Generator(device="cuda").manual_seed(2)
    a = torch.randn(m, k, generator=g, device="cuda").bfloat16()
    b = torch.randn(n, k, generator=g, device="cuda").bfloat16()
    a[5, :] = 0
    a[5, 3] = float("inf")
    b[:, 3] = 0  # row 5 of the output: Inf * 0 = NaN
    a[9] *= 2.0**-120  # row 9: subnormal BF16 outputs
    outs = {}
    for hw in (False, True):
        monkeypatch.setattr(epilogue, "HW_BF16", hw)
        outs[hw] = gemm.gemm_fused(a, b, (torch.tensor(5.0, device="cuda"),) * 2)
    assert outs[False][5].isnan().all()
    assert outs[False][9].abs().max() < 2.0**-126
    same_bits(outs[True], outs[False])
