"""The rows grouped GEMM that reads the expert weight packed (kernels/grouped_gemm.py,
`grouped_gemm_rows_packed`) against the rows kernel fed the weight's `_dq`.

Both kernels walk the same tiles in the same order and hand `tl.dot` the same values (the
packed kernel decodes code value x block scale, which is exactly the `_dq` value), so every
output tile is the same sum in the same order: in Triton's interpreter both are one numpy
product per K step of FP32 arrays of equal values and equal memory order. The comparison is
therefore bit for bit (`atol=0, rtol=0`), not within an accumulation-order bound.

Weight copies: NVFP4 16x16 along K (the forward's, K-major), the same 16x16 copy read
transposed (grad_input's shared copy, N-major), NVFP4 1x16 along K (forward) and along N (a
1x16 recipe's grad_input copy, a strided view per expert), MXFP8 along K and along N.
Groups: empty experts, one row, several row tiles, uneven sizes and rows past offs[-1].
Then the op: `grouped_mm` with `gemm.grouped.PACKED_WEIGHT` on gives the bits it gives off,
forward and both gradients, and no `_dq` of an expert weight is made.
"""

import importlib

import pytest
import torch

import blockscale as bs
from blockscale import _library, recipes
from blockscale.formats import grouped as G
from blockscale.gemm import grouped as gemm_grouped
from blockscale.ops.weight_cache import WeightCache

pytest.importorskip("triton")

gg = importlib.import_module("blockscale.kernels.grouped_gemm")

SIZES = [0, 40, 17, 1, 33]  # an empty expert, one row, several 16-row tiles
TAIL = 5  # rows past offs[-1]
# Small tiles so that K and N span several tiles, the last one partial (K = 160 and N = 96, or
# the other way round, with 64-wide tiles) and row tiles end inside groups:
# (BM, BN, BK, warps, stages).
SMALL = (16, 64, 64, 4, 2)


def _offs(sizes):
    return torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32)


def _weights(e, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(e, n, k, generator=g)
    w[1, 3, 7] = 40.0  # an outlier: block scales differ within an expert
    w[2, :16, :16] *= 1e-3  # a tile of small values: small block scales
    return w


def _copy(w, fmt, block, along_n):
    """(packed copy, its `_dq` as the rows GEMM's b [E, N_out, K_contract], kmajor flag). The
    `_dq` of a copy along K is made K-major, as the kernels make it (formats/ stacks the
    copies along N in the memory order of their transposes; the `_dq` kernel would then read
    it N-major, and numpy sums an N-major tile's product in another order)."""
    if fmt == "mxfp8":
        q = G.mxfp8_quantize_experts(w, transpose=along_n)
        return q, q.dq(torch.float32).contiguous(), True
    if block == "16x16" and along_n:  # the forward copy, read transposed (TransposedExperts)
        q = G.nvfp4_quantize_experts(w, "16x16")
        return q, q.dq(torch.float32).transpose(1, 2), False
    q = G.nvfp4_quantize_experts(w, block, transpose=along_n)
    return q, q.dq(torch.float32).contiguous(), True


# (format, NVFP4 block, copy along N: the grad_input GEMM)
COPIES = {
    "nvfp4-16x16-output": ("nvfp4", "16x16", False),
    "nvfp4-16x16-grad_input": ("nvfp4", "16x16", True),
    "nvfp4-1x16-output": ("nvfp4", "1x16", False),
    "nvfp4-1x16-grad_input": ("nvfp4", "1x16", True),
    "mxfp8-output": ("mxfp8", None, False),
    "mxfp8-grad_input": ("mxfp8", None, True),
}


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("copy", list(COPIES))
def test_packed_rows_equal_the_dq_rows_kernel(copy, out_dtype, monkeypatch):
    fmt, block, along_n = COPIES[copy]
    monkeypatch.setattr(gg, "ROWS_CONFIG", SMALL)
    monkeypatch.setattr(gg, "ROWS_PACKED_CONFIG", SMALL)
    e, n, k = len(SIZES), 96, 160
    w = _weights(e, n, k, seed=1)
    q, b_dq, kmajor = _copy(w, fmt, block, along_n)
    out_cols, contract = b_dq.shape[1], b_dq.shape[2]
    offs = _offs(SIZES)
    g = torch.Generator().manual_seed(2)
    a = torch.randn(sum(SIZES) + TAIL, contract, generator=g)
    amax = (torch.rand(e, generator=g) + 1, q.amax) if fmt == "nvfp4" else None
    want = gg.grouped_gemm_rows(a, b_dq, offs, amax, out_dtype)
    got = gg.grouped_gemm_rows_packed(a, q.data, q.scale, offs, fmt, kmajor, amax, out_dtype)
    assert got.shape == (a.shape[0], out_cols)
    end = sum(SIZES)
    assert (want[end:] == 0).all() and (want[:end].abs().sum(1) > 0).all()
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_packed_rows_read_other_nibbles_and_scales_differently():
    """The comparison above can fail: a weight copy whose nibbles are swapped within each
    byte, or whose scales are one E4M3 step apart, gives other products."""
    e, n, k = 3, 32, 32
    w = _weights(e, n, k, seed=3)
    q = G.nvfp4_quantize_experts(w, "16x16")
    offs = _offs([20, 0, 12])
    a = torch.randn(32, k, generator=torch.Generator().manual_seed(4))
    right = gg.grouped_gemm_rows_packed(a, q.data, q.scale, offs, "nvfp4")
    swapped = (q.data >> 4) | (q.data << 4)
    bumped = (q.scale.view(torch.uint8) + 1).view(torch.float8_e4m3fn)
    assert not torch.equal(right, gg.grouped_gemm_rows_packed(a, swapped, q.scale, offs, "nvfp4"))
    assert not torch.equal(right, gg.grouped_gemm_rows_packed(a, q.data, bumped, offs, "nvfp4"))
    torch.testing.assert_close(right, gg.grouped_gemm_rows(a, q.dq(torch.float32), offs),
                               atol=0, rtol=0)  # fmt: skip


def test_packed_rows_propagate_a_non_finite_mxfp8_block():
    """An MXFP8 block of a non-finite weight has the E8M0 NaN scale: its `_dq` is NaN, and so
    is every output of its expert's rows (the other experts stay finite), in both kernels."""
    w = _weights(3, 32, 64, seed=5)
    w[1, 4, 9] = float("inf")
    q = G.mxfp8_quantize_experts(w)
    offs = _offs([8, 9, 7])
    a = torch.randn(24, 64, generator=torch.Generator().manual_seed(6))
    got = gg.grouped_gemm_rows_packed(a, q.data, q.scale, offs, "mxfp8")
    want = gg.grouped_gemm_rows(a, q.dq(torch.float32), offs)
    assert got[8:17, 4].isnan().all() and got[:8].isfinite().all()
    torch.testing.assert_close(got, want, atol=0, rtol=0, equal_nan=True)


def test_packed_rows_refuse_mismatched_shapes():
    q = G.nvfp4_quantize_experts(torch.randn(2, 32, 64))
    offs = _offs([3, 4])
    with pytest.raises(ValueError, match="scales"):
        gg.grouped_gemm_rows_packed(torch.randn(7, 32), q.data, q.scale, offs, "nvfp4")
    with pytest.raises(ValueError, match="fmt"):
        gg.grouped_gemm_rows_packed(torch.randn(7, 64), q.data, q.scale, offs, "fp4")


# ----------------------------------------------------------------------------- the op

RECIPES = {
    "nvfp4": recipes.get("nvfp4", stochastic_rounding=False),
    "nvfp4-1x16": recipes.get("nvfp4", stochastic_rounding=False, weight_2d=False),
    "nvfp4_fwd_mxfp8_bwd": recipes.get("nvfp4_fwd_mxfp8_bwd"),
    "mxfp8": recipes.get("mxfp8"),
}


def _watch_weight_dq(monkeypatch):
    """Kernels on for CPU tensors (Triton's interpreter), and a record of every `_dq` an
    expert weight gets: a weight quantization asked for one (`return_dq`), or a dequantize of
    a 3-D (stacked experts) copy. Activations' copies are 2-D."""
    kernels = _library.kernels()
    made = []
    monkeypatch.setattr(_library, "use_kernels", lambda t: True)

    def watch_quantize(name):
        original = getattr(kernels, name)

        def quantize(w, *args, **kwargs):
            if kwargs.get("return_dq"):
                made.append(f"{name}(return_dq=True)")
            return original(w, *args, **kwargs)

        monkeypatch.setattr(kernels, name, quantize)

    def watch_dequantize(name):
        original = getattr(kernels, name)

        def dequantize(q):
            if q.data.dim() == 3:
                made.append(f"{name} of {tuple(q.shape)}")
            return original(q)

        monkeypatch.setattr(kernels, name, dequantize)

    for name in ("nvfp4_quantize_experts", "nvfp4_quantize_experts_t", "mxfp8_quantize_experts"):
        watch_quantize(name)
    for name in ("nvfp4_dequantize_dq", "mxfp8_dequantize_dq"):
        watch_dequantize(name)
    return made


def _step(x, w, grad, offs, recipe, cache):
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    results = []
    for _ in range(2 if cache is not None else 1):  # a second use finds the cached copies
        x.grad = w.grad = None
        out = bs.grouped_mm(x, w.transpose(-2, -1), offs, recipe, weight_cache=cache)
        out.backward(grad)
        results.append((out.detach(), x.grad, w.grad))
    return results


@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.parametrize("name", list(RECIPES))
def test_grouped_mm_with_packed_weights_gives_the_same_bits(name, cached, monkeypatch):
    sizes = [44, 0, 1, 19]
    g = torch.Generator().manual_seed(7)
    m, k, n = sum(sizes) + 3, 64, 64
    x = torch.randn(m, k, generator=g)
    w = torch.randn(len(sizes), n, k, generator=g) * 0.1
    grad = torch.randn(m, n, generator=g)
    offs = _offs(sizes)
    made = _watch_weight_dq(monkeypatch)
    runs = {}
    for packed in (False, True):
        monkeypatch.setattr(gemm_grouped, "PACKED_WEIGHT", packed)
        made.clear()
        cache = WeightCache(from_first_use=True) if cached else None
        runs[packed] = _step(x, w, grad, offs, RECIPES[name], cache), list(made)
    (want, made_off), (got, made_on) = runs[False], runs[True]
    assert made_off, "the `_dq` path made no weight `_dq`: the watch sees nothing"
    assert made_on == [], f"the packed path made weight `_dq`s: {made_on}"
    for want_use, got_use in zip(want, got, strict=True):
        for a, b in zip(want_use, got_use, strict=True):
            torch.testing.assert_close(b, a, atol=0, rtol=0)
    assert want[0][0][: sum(sizes)].abs().sum() > 0


def test_packed_weights_are_off_by_default():
    assert gemm_grouped.PACKED_WEIGHT is False
    assert not gemm_grouped.packed_weight_rule(torch.randn(2, 16, 16))


# ----------------------------------------------------------------------------- GPU

# (experts, hidden, width): Qwen3-30B-A3B-like and DeepSeek-V3-like fine-grained experts
GPU_SHAPES = {"qwen3-30b-a3b": (128, 2048, 768), "deepseek-v3": (256, 2048, 512)}


def _gpu_split(m, e, seed=0):
    g = torch.Generator().manual_seed(seed)
    sizes = (torch.rand(e, generator=g) ** 3 + 0.05) * (torch.rand(e, generator=g) > 0.05)
    sizes = (sizes / sizes.sum() * m).floor().long()
    sizes[0] += m - int(sizes.sum())
    return sizes


@pytest.mark.gpu
@pytest.mark.parametrize("copy", list(COPIES))
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
def test_gpu_packed_rows_equal_the_dq_rows_kernel(shape, copy):
    """At the issue's shapes (16384 tokens top-8: 131072 rows, uneven, some experts empty),
    the up projection's GEMMs (K = hidden, N = width): the same tiles and the same BF16
    operands into the same MMA instructions, so the same bits (checked, not assumed: the
    order of additions inside an MMA is the hardware's)."""
    fmt, block, along_n = COPIES[copy]
    e, hidden, width = GPU_SHAPES[shape]
    dev = torch.device("cuda")
    kernels = _library.kernels()
    w = torch.randn(e, width, hidden, device=dev, dtype=torch.bfloat16) / hidden**0.5
    if fmt == "mxfp8":
        q, b_dq = kernels.mxfp8_quantize_experts(w, transpose=along_n, return_dq=True)
        kmajor = True
    elif block == "16x16":
        q, b_dq = kernels.nvfp4_quantize_experts(w, "16x16", return_dq=True)
        kmajor = not along_n
        b_dq = b_dq.transpose(1, 2) if along_n else b_dq
    elif along_n:
        q, b_dq = kernels.nvfp4_quantize_experts_t(w, return_dq=True)
        kmajor = True
    else:
        q, b_dq = kernels.nvfp4_quantize_experts(w, "1x16", return_dq=True)
        kmajor = True
    sizes = _gpu_split(131072, e)
    offs = sizes.cumsum(0).to(torch.int32).to(dev)
    a = torch.randn(131072, b_dq.shape[2], device=dev, dtype=torch.bfloat16)
    amax = (torch.rand(e, device=dev) + 1, q.amax) if fmt == "nvfp4" else None
    want = gg.grouped_gemm_rows(a, b_dq, offs, amax)
    got = gg.grouped_gemm_rows_packed(a, q.data, q.scale, offs, fmt, kmajor, amax)
    assert (sizes == 0).any() and want.abs().sum() > 0
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(RECIPES))
def test_gpu_grouped_mm_with_packed_weights_gives_the_same_bits(name, monkeypatch):
    e, hidden, width = GPU_SHAPES["qwen3-30b-a3b"]
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(8)
    m = 16384
    x = torch.randn(m, hidden, device=dev, dtype=torch.bfloat16, generator=g)
    w = torch.randn(e, width, hidden, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
    grad = torch.randn(m, width, device=dev, dtype=torch.bfloat16, generator=g)
    offs = _gpu_split(m, e).cumsum(0).to(torch.int32).to(dev)
    runs = []
    for packed in (False, True):
        monkeypatch.setattr(gemm_grouped, "PACKED_WEIGHT", packed)
        runs.append(_step(x, w, grad, offs, RECIPES[name], WeightCache(from_first_use=True)))
    for want_use, got_use in zip(*runs, strict=True):
        for a, b in zip(want_use, got_use, strict=True):
            torch.testing.assert_close(b, a, atol=0, rtol=0)
