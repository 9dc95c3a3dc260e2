"""The dequantize kernels on the expert weights' copies, as the rows GEMMs get them
(`NVFP4Operand.dq` / `MXFP8Operand.dq` of a cached or saved packed copy), bit for bit.

The copies along N (MXFP8's dgrad copy, a 1x16 NVFP4 recipe's) are one [K, E*N] array seen as
[E, K, N]: each expert a strided view. The kernels read the codes and scales there, in place
(the launcher gets the copy's own storage, no contiguous copy of it), and write the `_dq`
contiguous [E, K, N], the layout the rows GEMM had read before. Each `_dq` must equal, with
atol=0 and rtol=0, the formats/ dequantize of the same codes (the containers' own `dq`) and the
`_dq` the quantize pass writes alongside the codes (what an uncached step's GEMM reads).

Shapes: rows per expert not a multiple of the kernels' 32-row tile (a tile holds rows of two
experts) and columns short of the 128-column tile; an outlier and a tile of small values so
block scales differ; for MXFP8 an Inf (its block's scale is the NaN code) and a NaN.
"""

import importlib

import pytest
import torch

from blockscale import kernels
from blockscale.formats.mxfp8 import MXFP8Tensor
from blockscale.formats.nvfp4 import NVFP4Tensor

pytest.importorskip("triton")

kmx = importlib.import_module("blockscale.kernels.mxfp8")
knv = importlib.import_module("blockscale.kernels.nvfp4")

ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"

# name: (the kernels' quantizer of w [E, N, K], returning (copy, its `_dq`); the format, "mx"
# or "nv"; whether the copy is along N)
COPIES = {
    "mxfp8-along-k": (lambda w: kernels.mxfp8_quantize_experts(w, return_dq=True), "mx", False),
    "mxfp8-along-n": (
        lambda w: kernels.mxfp8_quantize_experts(w, transpose=True, return_dq=True),
        "mx",
        True,
    ),
    "nvfp4-1x16-along-k": (
        lambda w: kernels.nvfp4_quantize_experts(w, "1x16", return_dq=True),
        "nv",
        False,
    ),
    "nvfp4-16x16-along-k": (
        lambda w: kernels.nvfp4_quantize_experts(w, "16x16", return_dq=True),
        "nv",
        False,
    ),
    "nvfp4-1x16-along-n": (
        lambda w: kernels.nvfp4_quantize_experts_t(w, return_dq=True),
        "nv",
        True,
    ),
}


def _weights(e, n, k, seed, non_finite=False):
    g = torch.Generator(device=DEV).manual_seed(seed)
    w = torch.randn(e, n, k, generator=g, device=DEV)
    w[1, 3, 7] = 40.0  # an outlier: block scales differ within an expert
    w[2, :16, :16] *= 1e-3  # a tile of small values: small block scales
    if non_finite:
        w[3, 5, 9] = float("inf")
        w[0, 40, 2] = float("nan")
    return w.bfloat16()


def _assert_bits(a, b):
    """Equal BF16 bits, NaN matching NaN (whatever its payload)."""
    assert a.dtype == b.dtype == torch.bfloat16 and a.shape == b.shape
    nan = a.isnan()
    assert torch.equal(nan, b.isnan())
    a, b = a.contiguous().view(torch.int16), b.contiguous().view(torch.int16)
    torch.testing.assert_close(a[~nan], b[~nan], atol=0, rtol=0)


def _dequantize_watched(name, q, monkeypatch):
    """The `_dq` by the kernels' entry, with the codes array the launcher got."""
    fmt = COPIES[name][1]
    module, op = (kmx, "_mxfp8_dequantize_3d") if fmt == "mx" else (knv, "_nvfp4_dequantize_3d")
    seen = []
    original = getattr(module, op)

    def watched(data, scale):
        seen.append((data, scale))
        return original(data, scale)

    monkeypatch.setattr(module, op, watched)
    dq = (kernels.mxfp8_dequantize_dq if fmt == "mx" else kernels.nvfp4_dequantize_dq)(q)
    return dq, seen


def _check(name, w, monkeypatch):
    quantize, fmt, along_n = COPIES[name]
    q, dq_pass = quantize(w)
    e, n, k = w.shape
    assert q.data.is_contiguous() != along_n  # (the copies along N are strided views)
    dq, seen = _dequantize_watched(name, q, monkeypatch)
    want = (MXFP8Tensor if fmt == "mx" else NVFP4Tensor).dq(q)  # formats/ on the same codes
    assert dq.shape == want.shape == ((e, k, n) if along_n else (e, n, k))
    assert dq.is_contiguous()
    _assert_bits(dq, want)
    _assert_bits(dq, dq_pass)
    # read in place: the launcher got the copy's own codes and scales, not a copy of them
    ((data, scale),) = seen
    assert data.data_ptr() == q.data.data_ptr() and scale.data_ptr() == q.scale.data_ptr()
    assert data.shape[:2] == scale.shape[:2] == ((e, k) if along_n else (e, n))


@pytest.mark.parametrize("name", list(COPIES))
def test_dequantize_of_expert_copies_reads_them_in_place(name, monkeypatch):
    # along N: 80 rows (K) an expert, so the 32-row tiles straddle experts; 64 columns (N)
    # along K: 80 rows (N) an expert, 96 columns (K): one partial column tile
    shape = (5, 64, 80) if COPIES[name][2] else (5, 80, 96)
    _check(name, _weights(*shape, seed=1), monkeypatch)


@pytest.mark.parametrize("name", ["mxfp8-along-n", "mxfp8-along-k"])
def test_dequantize_of_mxfp8_expert_copies_with_inf_and_nan(name, monkeypatch):
    shape = (4, 64, 96)
    _check(name, _weights(*shape, seed=2, non_finite=True), monkeypatch)


def test_dequantize_of_a_2d_copy_with_a_strided_last_dim():
    """A copy whose codes are not unit-stride along the row (a transposed view) is made
    contiguous first: the kernels read rows of unit stride."""
    q = kernels.mxfp8_quantize(_weights(3, 64, 96, seed=3)[1])
    tq = MXFP8Tensor(q.data.t().contiguous().t(), q.scale.t().contiguous().t(), q.shape)
    assert tq.data.stride(-1) != 1
    _assert_bits(kernels.mxfp8_dequantize_dq(tq), MXFP8Tensor.dq(q))


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(COPIES))
@pytest.mark.parametrize("shape", [(128, 768, 2048), (256, 2048, 512)], ids=str)
def test_gpu_dequantize_of_expert_copies_at_the_issue_shapes(name, shape, monkeypatch):
    """Qwen3-30B-A3B-like and DeepSeek-V3-like experts [E, N, K], both orientations."""
    non_finite = name.startswith("mxfp8")  # (an Inf makes a whole NVFP4 expert NaN)
    _check(name, _weights(*shape, seed=4, non_finite=non_finite), monkeypatch)
