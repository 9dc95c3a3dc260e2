"""The native (Blackwell) GEMM path, tested on the CPU up to the final scaled_mm call.

The native path cannot run here, so these tests read its arguments back the way the
PyTorch documentation says `F.scaled_mm` reads them (FP4 codes in the low/high nibbles,
block scales in the cuBLAS 128x4 layout, a TensorWise global decode scale multiplied into the
result) and check that they describe exactly the emulated operands and product. Decoding here
uses its own E2M1 table and E8M0 rule, not blockscale's. Whether cuBLAS agrees is checked only
by the `gpu` test at the bottom, on compute capability >= 10.0: until that runs the native
path is unverified.
"""

import pytest
import torch
import torch.nn.functional as F

from blockscale import recipes
from blockscale.formats import mxfp8, nvfp4
from blockscale.formats.swizzle import from_blocked, to_blocked
from blockscale.gemm import Transposed, native, resolve_backend, scaled_mm
from blockscale.gemm.dispatch import Backend
from blockscale.ops import linear

E2M1_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
E2M1_TABLE = torch.tensor(E2M1_VALUES + [-v for v in E2M1_VALUES], dtype=torch.float64)


def read_fp4(mat: torch.Tensor) -> torch.Tensor:
    """float4_e2m1fn_x2 [R, C/2] (any strides) -> FP64 values [R, C]; low nibble first."""
    raw = mat.view(torch.uint8).contiguous().long()
    codes = torch.stack((raw & 0xF, raw >> 4), dim=-1).reshape(raw.shape[0], -1)
    return E2M1_TABLE[codes]


def unswizzle(blocked: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The cuBLAS 128x4 layout undone from its documented formula, independently of
    formats/swizzle.py: tiles of 128 rows x 4 columns follow each other row-tile-major, each
    512 bytes, and inside a tile (r, c) sits at (r % 32) * 16 + (r // 32) * 4 + c."""
    cp = -(-cols // 4) * 4
    r = torch.arange(rows)[:, None]
    c = torch.arange(cols)[None, :]
    tile = (r // 128) * (cp // 4) + c // 4
    offset = tile * 512 + (r % 128 % 32) * 16 + (r % 128 // 32) * 4 + c % 4
    return blocked.view(torch.uint8)[offset].view(blocked.dtype)


def scales_per_value(scale: torch.Tensor, block: int) -> torch.Tensor:
    if scale.dtype == torch.float8_e8m0fnu:
        values = torch.pow(2.0, scale.view(torch.uint8).double() - 127)
    else:
        values = scale.double()
    return values.repeat_interleave(block, dim=-1)


def simulate_scaled_mm(args: dict, m: int, n: int, k: int) -> tuple[torch.Tensor, ...]:
    """What F.scaled_mm computes from `args`, per its documentation: (A, B, alpha, out), FP64."""
    fp4 = args["mat_a"].dtype == torch.float4_e2m1fn_x2
    block = 16 if fp4 else 32
    read = read_fp4 if fp4 else (lambda t: t.double())
    sa = args["scale_a"][0] if fp4 else args["scale_a"]
    sb = args["scale_b"][0] if fp4 else args["scale_b"]
    a = read(args["mat_a"]) * scales_per_value(unswizzle(sa, m, k // block), block)
    b_t = read(args["mat_b"].t())  # mat_b is [K, N] column-major: its transpose is [N, K]
    b = b_t * scales_per_value(unswizzle(sb, n, k // block), block)
    alpha = args["scale_a"][1].double() * args["scale_b"][1].double() if fp4 else 1.0
    return a, b, alpha, a @ b.t() * alpha


def assert_fp32_gemm_close(got, a, b, alpha, out):
    """|got - out| <= gamma_{K+2} * |A| @ |B|^T * alpha: FP32 accumulation of K exact products,
    then alpha and the cast (see tests/test_linear.py for the derivation)."""
    k = a.shape[1]
    gamma = (k + 2) * 2.0**-24 / (1 - (k + 2) * 2.0**-24)
    bound = gamma * (a.abs() @ b.abs().t()) * alpha
    assert ((got.double() - out).abs() <= bound).all()


@pytest.mark.parametrize(("rows", "cols"), [(128, 4), (256, 8), (200, 5), (1, 1), (130, 12)])
def test_swizzle_follows_the_documented_layout(rows, cols):
    scale = torch.randint(0, 255, (rows, cols), dtype=torch.uint8).view(torch.float8_e4m3fn)
    blocked = to_blocked(scale)
    assert blocked.numel() == -(-rows // 128) * 128 * (-(-cols // 4) * 4)
    assert torch.equal(unswizzle(blocked, rows, cols).view(torch.uint8), scale.view(torch.uint8))
    back = from_blocked(blocked, rows, cols)
    assert torch.equal(back.view(torch.uint8), scale.view(torch.uint8))


def operands(fmt, m, n, k, weight_block="1x16"):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 3, k)  # scales span the range
    w = torch.randn(n, k, generator=g)
    if fmt == "nvfp4":
        return nvfp4.quantize(x), nvfp4.quantize(w, block=weight_block)
    return mxfp8.quantize(x), mxfp8.quantize(w)


@pytest.mark.parametrize(("fmt", "m", "n", "k"), [("nvfp4", 200, 96, 64), ("nvfp4", 128, 256, 128),
                                                  ("mxfp8", 200, 96, 64), ("mxfp8", 64, 128, 256)])  # fmt: skip
def test_native_arguments_describe_the_emulated_operands(fmt, m, n, k):
    a, b = operands(fmt, m, n, k)
    args = native.scaled_mm_args(a, b)
    want_dtype = torch.float4_e2m1fn_x2 if fmt == "nvfp4" else torch.float8_e4m3fn
    k_cols = k // 2 if fmt == "nvfp4" else k
    assert args["mat_a"].dtype == args["mat_b"].dtype == want_dtype
    assert args["mat_a"].shape == (m, k_cols) and args["mat_a"].stride() == (k_cols, 1)
    assert args["mat_b"].shape == (k_cols, n) and args["mat_b"].stride() == (1, k_cols)
    a_sim, b_sim, alpha, out_sim = simulate_scaled_mm(args, m, n, k)
    assert torch.equal(a_sim, a.dq(torch.float32).double())
    assert torch.equal(b_sim, b.dq(torch.float32).double())
    emulated = scaled_mm(a, b, out_dtype=torch.float32, backend="emulated")
    assert_fp32_gemm_close(emulated, a_sim, b_sim, alpha, out_sim)


def test_native_recipes_and_global_scales():
    a, b = operands("nvfp4", 32, 32, 64)
    args = native.nvfp4_args(a, b)
    st, sw = F.ScalingType, F.SwizzleType
    assert args["scale_recipe_a"] == [st.BlockWise1x16, st.TensorWise]
    assert args["swizzle_b"] == [sw.SWIZZLE_32_4_4, sw.NO_SWIZZLE]
    assert args["scale_a"][1].dtype == torch.float32 and args["scale_a"][1].numel() == 1
    assert torch.equal(args["scale_a"][1], a.global_decode_scale())
    assert args["scale_a"][0].dtype == torch.float8_e4m3fn
    mx_args = native.mxfp8_args(*operands("mxfp8", 32, 32, 64))
    assert mx_args["scale_recipe_a"] == st.BlockWise1x32
    assert mx_args["scale_a"].dtype == torch.float8_e8m0fnu


def test_transposed_16x16_weight_for_dgrad():
    # dgrad: grad_input = grad_output @ weight; the weight's 16x16 copy serves transposed.
    m, n, k = 64, 96, 128
    g = torch.Generator().manual_seed(1)
    go = nvfp4.quantize(torch.randn(m, n, generator=g))
    w = nvfp4.quantize(torch.randn(n, k, generator=g), block="16x16")
    wt = Transposed(w)
    assert wt.shape == (k, n)
    assert torch.equal(wt.dq(), wt.materialize().dq())
    args = native.nvfp4_args(go, wt.materialize())
    a_sim, b_sim, alpha, out_sim = simulate_scaled_mm(args, m, k, n)
    assert torch.equal(b_sim, w.dq(torch.float32).double().t())
    emulated = scaled_mm(go, wt, backend="emulated")
    assert_fp32_gemm_close(emulated, a_sim, b_sim, alpha, out_sim)
    with pytest.raises(ValueError, match="only a 2-D 16x16 NVFP4 tensor transposes exactly"):
        Transposed(go)


def test_backend_resolution_on_cpu():
    cpu = torch.device("cpu")
    assert native.torch_supports_native()
    assert not native.device_supports_native(cpu)
    assert resolve_backend("auto", cpu) is Backend.EMULATED
    assert resolve_backend(Backend.EMULATED, cpu) is Backend.EMULATED
    with pytest.raises(ValueError, match="backend='native' needs a CUDA device"):
        resolve_backend("native", cpu)
    a, b = operands("nvfp4", 16, 16, 32)
    with pytest.raises(ValueError, match="both operands must share a format"):
        scaled_mm(a, mxfp8.quantize(torch.randn(16, 32)))
    with pytest.raises(ValueError, match="contraction dims differ|scaled_mm needs a"):
        scaled_mm(a, nvfp4.quantize(torch.randn(16, 64)))


def blackwell() -> bool:
    return torch.cuda.is_available() and native.device_supports_native(torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not blackwell(), reason="native scaled_mm needs compute capability >= 10.0")
@pytest.mark.parametrize("name", ["nvfp4", "nvfp4_fwd_mxfp8_bwd", "mxfp8"])
def test_gpu_native_linear_equals_emulated(name):
    """The verification the native path still lacks: native vs emulated on Blackwell."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(256, 512, device="cuda", generator=g, requires_grad=True)
    w = torch.randn(384, 512, device="cuda", generator=g, requires_grad=True)
    go = torch.randn(256, 384, device="cuda", generator=g)
    results = {}
    for backend in ("emulated", "native"):
        switches = {"stochastic_rounding": False} if name == "nvfp4" else {}
        r = recipes.get(name, **switches).with_backend(backend)
        x.grad = w.grad = None
        y = linear(x, w, None, r)
        y.backward(go)
        results[backend] = (y, x.grad.clone(), w.grad.clone())
    for got, want in zip(results["native"], results["emulated"]):
        # Only the FP32 accumulation order differs. Outputs are sums of <= 512 products of
        # size ~1 (|out| ~ 20); FP32 reordering moves them by ~sqrt(512) * 2^-24 * 20 ~ 3e-5
        # typically and K * 2^-24 * sum|a*b| ~ 1e-2 at worst: atol 1e-3 is far from either
        # a wrong scale layout (errors of order |out|) and from the typical rounding noise.
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-3)
