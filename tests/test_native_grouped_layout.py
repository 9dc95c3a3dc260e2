"""The native grouped GEMM path (gemm/native_grouped.py), tested on the CPU up to the final
F.scaled_grouped_mm call.

The grouped kernel behind scaled_grouped_mm (MSLK / FBGEMM) finds each group's scales at
offsets it computes from `offs` (native_grouped.py, fact 6). These tests place each group's
scales by that arithmetic, written out here with host loops and the 128x4 offset formula
(independently of formats/swizzle.py), and check the swizzled tensors byte for byte, padding
included. Then they read the whole argument set back the way the kernel reads it (own E2M1
table, own E8M0 rule) and check every group's operands and product against the plain
per-group meaning, and against the emulated GEMM. What stays unverified is the kernel
itself: `test_gpu_native_grouped_equals_emulated`, on compute capability 10.x.
"""

import random

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from blockscale.formats import mxfp8, nvfp4
from blockscale.formats import swizzle as ref
from blockscale.formats.mxfp8 import MXFP8Tensor
from blockscale.formats.nvfp4 import NVFP4Tensor
from blockscale.gemm import native, scaled_mm
from blockscale.gemm import native_grouped as ng
from blockscale.kernels import swizzle as fast

E2M1_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
E2M1_TABLE = torch.tensor(E2M1_VALUES + [-v for v in E2M1_VALUES], dtype=torch.float64)
BYTE_DTYPES = [torch.float8_e4m3fn, torch.float8_e8m0fnu]


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def exact_bytes(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.view(torch.uint8), want.view(torch.uint8), atol=0, rtol=0)


def bounds(sizes: list[int]) -> list[tuple[int, int]]:
    ends = [sum(sizes[: i + 1]) for i in range(len(sizes))]
    return list(zip([0, *ends[:-1]], ends))


def offs_of(sizes: list[int], scale: int = 1) -> torch.Tensor:
    return torch.tensor([end * scale for _, end in bounds(sizes)], dtype=torch.int32)


# ------------------------------------------------- the layouts, by the kernel's arithmetic


def tile_offset(r: torch.Tensor, c: torch.Tensor, cols: int) -> torch.Tensor:
    """Where scale [r, c] of an [*, cols] block sits in its own 128x4 layout: 128x4 tiles
    row-tile-major, 512 bytes each, inside a tile (r % 32) * 16 + (r % 128) // 32 * 4 + c % 4."""
    tile = (r // 128) * (round_up(cols, 4) // 4) + c // 4
    return tile * 512 + (r % 32) * 16 + (r % 128) // 32 * 4 + c % 4


def grid(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(rows)[:, None], torch.arange(cols)[None, :]


def place(flat: torch.Tensor, base: int, block: torch.Tensor) -> None:
    r, c = grid(*block.shape)
    flat[base + tile_offset(r, c, block.shape[1])] = block.view(torch.uint8)


def read_block(flat: torch.Tensor, base: int, rows: int, cols: int) -> torch.Tensor:
    r, c = grid(rows, cols)
    return flat.view(torch.uint8).reshape(-1)[base + tile_offset(r, c, cols)].view(flat.dtype)


def expected_row_groups(scale: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """2D x 3D, operand A: group g's [m_g, C] scales at (sum_{i<g} round_up(m_i, 128)) *
    round_up(C, 4), each group in its own blocked layout; zeros elsewhere."""
    rows, cols = scale.shape
    flat = torch.zeros((rows // 128 + len(sizes)) * 128 * round_up(cols, 4), dtype=torch.uint8)
    scale_row = 0
    for start, end in bounds(sizes):
        place(flat, scale_row * round_up(cols, 4), scale[start:end])
        scale_row += round_up(end - start, 128)
    return flat.view(scale.dtype)


def expected_col_groups(scale: torch.Tensor, col_sizes: list[int]) -> torch.Tensor:
    """2D x 2D: group g's [R, c_g] scales at round_up(R, 128) * sum_{i<g} round_up(c_i, 4),
    each group in its own blocked layout; zeros elsewhere."""
    rows, cols = scale.shape
    bound = (cols // 4 + len(col_sizes)) * 4
    flat = torch.zeros(round_up(rows, 128) * bound, dtype=torch.uint8)
    scale_col = 0
    for start, end in bounds(col_sizes):
        place(flat, round_up(rows, 128) * scale_col, scale[:, start:end])
        scale_col += round_up(end - start, 4)
    return flat.view(scale.dtype)


def random_scales(rows: int, cols: int, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 255, (rows, cols), generator=g, dtype=torch.uint8).view(dtype)


def many(groups: int, high: int, multiple: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice([0, rng.randrange(0, high + 1, multiple)]) for _ in range(groups)]


# (group sizes in rows, rows past the last group)
ROW_CASES = [
    ([0, 1, 44, 117, 128, 300], 37),
    ([300], 0),
    ([128, 0, 0, 256, 1], 5),
    ([0, 0, 0], 7),
    ([0, 0, 5], 0),
    (many(64, 150, 1, seed=3), 100),
]
# (group sizes in scale columns, columns past the last group): NVFP4 segments of 64 tokens
# give multiples of 4, MXFP8 multiples of 2
COL_CASES = [
    ([4, 0, 8, 20], 12),
    ([2, 6, 0, 4, 2], 2),
    ([1, 3, 0, 5], 0),
    ([0, 0], 4),
    (many(40, 12, 2, seed=4), 6),
]


@pytest.mark.parametrize("cols", [1, 2, 5, 8])
@pytest.mark.parametrize(("sizes", "extra"), ROW_CASES, ids=range(len(ROW_CASES)))
def test_row_groups_follow_the_kernel_offsets(sizes, extra, cols):
    rows = sum(sizes) + extra
    for seed, dtype in enumerate(BYTE_DTYPES):
        scale = random_scales(rows, cols, dtype, seed)
        got = ref.to_blocked_row_groups(scale, offs_of(sizes))
        exact_bytes(got, expected_row_groups(scale, sizes))
        assert got.numel() // round_up(cols, 4) >= rows  # torch: scale.size(0) >= M
        assert got.numel() // round_up(cols, 4) <= rows + 128 * len(sizes)
        # and group by group, read back where the kernel reads
        scale_row = 0
        for start, end in bounds(sizes):
            back = read_block(got, scale_row * round_up(cols, 4), end - start, cols)
            exact_bytes(back, scale[start:end])
            scale_row += round_up(end - start, 128)


@pytest.mark.parametrize("rows", [1, 100, 128, 200, 300])
@pytest.mark.parametrize(("col_sizes", "extra"), COL_CASES, ids=range(len(COL_CASES)))
def test_col_groups_follow_the_kernel_offsets(col_sizes, extra, rows):
    cols = sum(col_sizes) + extra
    for seed, dtype in enumerate(BYTE_DTYPES):
        scale = random_scales(rows, cols, dtype, seed + rows)
        got = ref.to_blocked_col_groups(scale, offs_of(col_sizes))
        exact_bytes(got, expected_col_groups(scale, col_sizes))
        scale_col = 0
        for start, end in bounds(col_sizes):
            back = read_block(got, round_up(rows, 128) * scale_col, rows, end - start)
            exact_bytes(back, scale[:, start:end])
            scale_col += round_up(end - start, 4)


@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 130, 5), (4, 128, 8), (2, 16, 2)], ids=str)
def test_experts_blocked_one_by_one(shape):
    scale = torch.stack(
        [random_scales(*shape[1:], torch.float8_e4m3fn, e) for e in range(shape[0])]
    )
    got = ref.to_blocked_experts(scale)
    rp, cp = round_up(shape[1], 128), round_up(shape[2], 4)
    assert got.shape == (shape[0], rp * cp)  # torch: (G, round_up(K/block, 4) * round_up(N, 128))
    for e in range(shape[0]):
        want = torch.zeros(rp * cp, dtype=torch.uint8)
        place(want, 0, scale[e])
        exact_bytes(got[e], want.view(scale.dtype))


def test_grouped_layouts_never_read_the_offsets_on_the_host():
    """On meta tensors any .item() / .tolist() / data-dependent shape would raise."""
    offs = torch.empty(6, dtype=torch.int32, device="meta")
    scale = torch.empty(700, 8, dtype=torch.uint8, device="meta")
    assert ref.to_blocked_row_groups(scale, offs).shape == (ref.rows_bound(700, 6) * 8,)
    assert ref.to_blocked_col_groups(scale, offs).shape == (768 * ref.cols_bound(8, 6),)
    assert ref.to_blocked_experts(scale.view(7, 100, 8)).shape == (7, 128 * 8)
    case = rows_case("nvfp4", [5, 0, 7], extra=3, k=64, n=32, device="meta")
    args = ng.grouped_mm_args(*case.operands())
    assert args["scale_a"][0].shape == (ref.rows_bound(15, 3), 4)


# ------------------------------------------------ the kernels, bit for bit against formats/


@pytest.mark.parametrize(("sizes", "extra"), ROW_CASES, ids=range(len(ROW_CASES)))
def test_row_groups_kernel_matches_reference(sizes, extra):
    rows = sum(sizes) + extra
    for cols, dtype in ((5, torch.float8_e4m3fn), (8, torch.float8_e8m0fnu)):
        scale = random_scales(rows, cols, dtype, rows)
        offs = offs_of(sizes)
        exact_bytes(fast.swizzle_scales_row_groups(scale, offs), ref.to_blocked_row_groups(scale, offs))  # fmt: skip


@pytest.mark.parametrize(("col_sizes", "extra"), COL_CASES, ids=range(len(COL_CASES)))
def test_col_groups_kernel_matches_reference(col_sizes, extra):
    cols = sum(col_sizes) + extra
    for rows, dtype in ((1, torch.float8_e4m3fn), (200, torch.float8_e8m0fnu)):
        scale = random_scales(rows, cols, dtype, cols)
        offs = offs_of(col_sizes)
        exact_bytes(fast.swizzle_scales_col_groups(scale, offs), ref.to_blocked_col_groups(scale, offs))  # fmt: skip


def test_experts_kernel_matches_reference():
    scale = random_scales(3 * 130, 5, torch.float8_e4m3fn, 9).view(3, 130, 5)
    exact_bytes(fast.swizzle_scales_experts(scale), ref.to_blocked_experts(scale))


# ------------------------------------------------------------- operands of the two cases


class Case:
    """Plain per-group operands as the emulated grouped backend holds them."""

    def __init__(self, fmt, a_data, a_scale, b_data, b_scale, offs, a_amax, b_amax, sizes):
        self.fmt, self.sizes, self.offs = fmt, sizes, offs
        self.a_data, self.a_scale, self.a_amax = a_data, a_scale, a_amax
        self.b_data, self.b_scale, self.b_amax = b_data, b_scale, b_amax

    def operands(self):
        return (self.a_data, self.a_scale, self.b_data, self.b_scale, self.offs, self.a_amax, self.b_amax)  # fmt: skip


def quantize(fmt: str, x: torch.Tensor, transpose: bool = False):
    if fmt == "nvfp4":
        return nvfp4.quantize(x, transpose=transpose)
    return mxfp8.quantize(x, transpose=transpose)


def empty_operand(fmt: str, rows: int, cols: int, device):
    if fmt == "nvfp4":
        data = torch.zeros(rows, cols // 2, dtype=torch.uint8, device=device)
        return data, torch.zeros(rows, cols // 16, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)  # fmt: skip
    data = torch.zeros(rows, cols, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
    return data, torch.zeros(rows, cols // 32, dtype=torch.uint8, device=device).view(torch.float8_e8m0fnu)  # fmt: skip


def rows_case(fmt, sizes, extra, k, n, device="cpu", seed=0) -> Case:
    """Groups along M: input [M, K] quantized row by row with its group's amax, weights
    [E, N, K] expert by expert; rows past offs[-1] zero."""
    if device == "meta":  # shapes only
        a = empty_operand(fmt, sum(sizes) + extra, k, device)
        b = empty_operand(fmt, len(sizes) * n, k, device)
        b = (b[0].view(len(sizes), n, -1), b[1].view(len(sizes), n, -1))
        amax = torch.empty(len(sizes), device=device) if fmt == "nvfp4" else None
        return Case(fmt, *a, *b, offs_of(sizes).to(device), amax, amax, sizes)
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(sum(sizes) + extra, k, generator=g, device=device) * torch.logspace(-2, 2, k, device=device)  # fmt: skip
    w = torch.randn(len(sizes), n, k, generator=g, device=device)
    a_data, a_scale = empty_operand(fmt, x.shape[0], k, device)
    a_amax = torch.zeros(len(sizes), device=device)
    for e, (start, end) in enumerate(bounds(sizes)):
        if end > start:
            q = quantize(fmt, x[start:end])
            a_data[start:end], a_scale[start:end] = q.data, q.scale
            if fmt == "nvfp4":
                a_amax[e] = q.amax
    qs = [quantize(fmt, w[e]) for e in range(len(sizes))]
    b_data, b_scale = torch.stack([q.data for q in qs]), torch.stack([q.scale for q in qs])
    b_amax = torch.stack([q.amax for q in qs]) if fmt == "nvfp4" else None
    offs = offs_of(sizes).to(device)
    return Case(fmt, a_data, a_scale, b_data, b_scale, offs, a_amax if fmt == "nvfp4" else None, b_amax, sizes)  # fmt: skip


def tokens_case(fmt, sizes, n, k, device="cpu", seed=0) -> Case:
    """Groups along the contraction (grad_weight): grad_output [M, N] and input [M, K]
    quantized along the tokens group by group, each group in a zero-padded segment of a
    multiple of 64 tokens; a [N, P], b [K, P]; offs are the segment ends."""
    g = torch.Generator(device=device).manual_seed(seed)
    go = torch.randn(sum(sizes), n, generator=g, device=device)
    x = torch.randn(sum(sizes), k, generator=g, device=device) * 3
    segments = [round_up(m, 64) for m in sizes]
    cap = round_up(sum(sizes) + 63 * len(sizes), 64)
    a_data, a_scale = empty_operand(fmt, n, cap, device)
    b_data, b_scale = empty_operand(fmt, k, cap, device)
    pack, block = (2, 16) if fmt == "nvfp4" else (1, 32)
    amaxes = torch.zeros(2, len(sizes), device=device)
    p = 0
    for e, ((start, end), seg) in enumerate(zip(bounds(sizes), segments)):
        for i, (src, data, scale) in enumerate(((go, a_data, a_scale), (x, b_data, b_scale))):
            rows = torch.cat((src[start:end], src.new_zeros(seg - (end - start), src.shape[1])))
            if seg:
                q = quantize(fmt, rows, transpose=True)
                data[:, p // pack : (p + seg) // pack] = q.data
                scale[:, p // block : (p + seg) // block] = q.scale
                if fmt == "nvfp4":
                    amaxes[i, e] = q.amax
        p += seg
    seg_offs = offs_of(segments).to(device)
    a_amax, b_amax = (amaxes[0], amaxes[1]) if fmt == "nvfp4" else (None, None)
    return Case(fmt, a_data, a_scale, b_data, b_scale, seg_offs, a_amax, b_amax, segments)


# ------------------------------------------ what the kernel computes from our arguments


def read_fp4(mat: torch.Tensor) -> torch.Tensor:
    """float4_e2m1fn_x2 [R, C/2] (any strides) -> FP64 [R, C]; low nibble first."""
    raw = mat.view(torch.uint8).contiguous().long()
    return E2M1_TABLE[torch.stack((raw & 0xF, raw >> 4), dim=-1).reshape(raw.shape[0], -1)]


def read_values(mat: torch.Tensor) -> torch.Tensor:
    return read_fp4(mat) if mat.dtype == torch.float4_e2m1fn_x2 else mat.double()


def per_value(scale: torch.Tensor, block: int) -> torch.Tensor:
    if scale.dtype == torch.float8_e8m0fnu:
        values = torch.pow(2.0, scale.view(torch.uint8).double() - 127)
    else:
        values = scale.double()
    return values.repeat_interleave(block, dim=-1)


def simulate_grouped_mm(args: dict) -> torch.Tensor:
    """F.scaled_grouped_mm's result from `args`, FP64, as the kernel's argument setup reads
    them (native_grouped.py, facts 3 and 6); NaN where the kernel writes nothing."""
    fp4 = args["mat_a"].dtype == torch.float4_e2m1fn_x2
    block = 16 if fp4 else 32
    sa, sb = args["scale_a"][0].reshape(-1), args["scale_b"][0].reshape(-1)
    # GroupedBlas.cpp multiplies the two FP32 global scales; the kernel reads one per group
    alpha = (args["scale_a"][1] * args["scale_b"][1]).double() if fp4 else None
    ends = args["offs"].tolist()
    a = read_values(args["mat_a"])
    mat_b = args["mat_b"]
    if mat_b.dim() == 3:  # 2D x 3D: groups along M
        m, k = a.shape
        n = mat_b.shape[-1]
        kp, np_ = round_up(k // block, 4), round_up(n, 128)
        out = torch.full((m, n), float("nan"), dtype=torch.float64)
        scale_row = start = 0
        for g, end in enumerate(ends):
            if end > start:
                a_g = a[start:end] * per_value(read_block(sa, scale_row * kp, end - start, k // block), block)  # fmt: skip
                b_g = read_values(mat_b[g].t()) * per_value(read_block(sb, g * np_ * kp, n, k // block), block)  # fmt: skip
                out[start:end] = a_g @ b_g.t() * (alpha[g] if fp4 else 1.0)
            scale_row += round_up(end - start, 128)
            start = end
        return out
    b = read_values(mat_b.t())  # 2D x 2D: groups along the contraction; mat_b is [P, K]
    rows_a, rows_b = a.shape[0], b.shape[0]
    out = torch.full((len(ends), rows_a, rows_b), float("nan"), dtype=torch.float64)
    scale_col = start = 0
    for g, end in enumerate(ends):
        cols = (end - start) // block
        if end > start:
            a_s = read_block(sa, round_up(rows_a, 128) * scale_col, rows_a, cols)
            b_s = read_block(sb, round_up(rows_b, 128) * scale_col, rows_b, cols)
            a_g = a[:, start:end] * per_value(a_s, block)
            b_g = b[:, start:end] * per_value(b_s, block)
            out[g] = a_g @ b_g.t() * (alpha[g] if fp4 else 1.0)
        scale_col += round_up(cols, 4)
        start = end
    return out


def reference_grouped_mm(case: Case, absolute: bool = False) -> torch.Tensor:
    """The per-group meaning from the plain operands, FP64: zero outside the groups.
    absolute: the same product of |a| and |b| (for error bounds)."""
    block = 16 if case.fmt == "nvfp4" else 32
    fp4 = case.fmt == "nvfp4"

    def read(data, scale):
        values = read_fp4(data.view(torch.float4_e2m1fn_x2)) if fp4 else read_values(data)
        values = values * per_value(scale, block)
        return values.abs() if absolute else values

    a = read(case.a_data.cpu(), case.a_scale.cpu())
    if fp4:
        alpha = (nvfp4.decode_scale(case.a_amax) * nvfp4.decode_scale(case.b_amax)).double().cpu()
    ends = case.offs.tolist()
    if case.b_data.dim() == 3:
        out = torch.zeros(a.shape[0], case.b_data.shape[1], dtype=torch.float64)
        for g, (start, end) in enumerate(zip([0, *ends[:-1]], ends)):
            b = read(case.b_data[g].cpu(), case.b_scale[g].cpu())
            out[start:end] = a[start:end] @ b.t() * (alpha[g] if fp4 else 1.0)
        return out
    b = read(case.b_data.cpu(), case.b_scale.cpu())
    out = torch.zeros(len(ends), a.shape[0], b.shape[0], dtype=torch.float64)
    for g, (start, end) in enumerate(zip([0, *ends[:-1]], ends)):
        out[g] = a[:, start:end] @ b[:, start:end].t() * (alpha[g] if fp4 else 1.0)  # fmt: skip
    return out


def emulated_group(case: Case, g: int, start: int, end: int) -> torch.Tensor:
    """Group g's product through blockscale's emulated dense GEMM, FP32."""
    pack, block = (2, 16) if case.fmt == "nvfp4" else (1, 32)
    if case.b_data.dim() == 3:
        a = (case.a_data[start:end], case.a_scale[start:end])
        b = (case.b_data[g], case.b_scale[g])
    else:
        a = (case.a_data[:, start // pack : end // pack], case.a_scale[:, start // block : end // block])  # fmt: skip
        b = (case.b_data[:, start // pack : end // pack], case.b_scale[:, start // block : end // block])  # fmt: skip

    def operand(data, scale, amax):
        shape = torch.Size((data.shape[0], data.shape[1] * pack))
        if case.fmt == "nvfp4":
            return NVFP4Tensor(data, scale, amax[g], shape)
        return MXFP8Tensor(data, scale, shape)

    return scaled_mm(operand(*a, case.a_amax), operand(*b, case.b_amax), backend="emulated")


def assert_fp32_close(got: torch.Tensor, want: torch.Tensor, magnitude: torch.Tensor, k: int):
    """|got - want| <= gamma_{k+2} * (|A| @ |B|^T * alpha) (`magnitude`): FP32 accumulation
    of k products exact in FP32, then alpha and the cast, each a relative 2^-24 (see
    tests/test_linear.py for the derivation)."""
    gamma = (k + 2) * 2.0**-24 / (1 - (k + 2) * 2.0**-24)
    assert ((got.double() - want).abs() <= gamma * magnitude).all()


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
@pytest.mark.parametrize(
    ("sizes", "extra"), [([0, 1, 44, 117, 128, 300], 37), ([3, 0, 129], 0), ([0, 0], 9)], ids=str
)
def test_rows_arguments_compute_the_per_group_product(fmt, sizes, extra):
    k, n = 64, 48
    case = rows_case(fmt, sizes, extra, k, n)
    args = ng.grouped_mm_args(*case.operands())
    m = sum(sizes) + extra
    fp4 = fmt == "nvfp4"
    assert args["mat_a"].dtype == (torch.float4_e2m1fn_x2 if fp4 else torch.float8_e4m3fn)
    kk = k // 2 if fp4 else k
    assert args["mat_a"].shape == (m, kk) and args["mat_a"].stride() == (kk, 1)
    assert args["mat_b"].shape == (len(sizes), kk, n)
    assert args["mat_b"].stride() == (n * kk, 1, kk)  # column-major per expert
    scale_a, scale_b = args["scale_a"][0], args["scale_b"][0]
    block = 16 if fp4 else 32
    # the shape rules of GroupedBlas.cpp `_check_scales_blocked`
    assert scale_a.dim() == 2 and scale_a.shape[0] >= m and scale_a.is_contiguous()
    assert scale_b.shape == (len(sizes), round_up(k // block, 4) * round_up(n, 128))
    assert args["output_dtype"] == torch.bfloat16 and args["offs"] is case.offs
    out = simulate_grouped_mm(args)
    ng.zero_unwritten(out, case.offs)
    assert torch.equal(out, reference_grouped_mm(case))
    magnitude = reference_grouped_mm(case, absolute=True)
    for g, (start, end) in enumerate(bounds(sizes)):
        if end > start:
            got = emulated_group(case, g, start, end)
            assert_fp32_close(got, out[start:end], magnitude[start:end], k)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
@pytest.mark.parametrize("sizes", [[5, 0, 70, 128, 1], [0, 200], [64]], ids=str)
def test_tokens_arguments_compute_the_per_group_product(fmt, sizes):
    n, k = 48, 32
    case = tokens_case(fmt, sizes, n, k)
    args = ng.grouped_mm_args(*case.operands())
    fp4 = fmt == "nvfp4"
    p = case.a_data.shape[1]
    assert args["mat_a"].shape == (n, p) and args["mat_b"].shape == (p, k)
    assert args["mat_b"].stride() == (1, p)
    assert args["scale_a"][0].dim() == 2 and args["scale_a"][0].shape[0] >= n
    assert args["scale_b"][0].dim() == 2 and args["scale_b"][0].shape[0] >= k
    if fp4:
        assert args["scale_a"][1].shape == (len(sizes),) == args["scale_b"][1].shape
    out = simulate_grouped_mm(args)
    ng.zero_unwritten(out, case.offs)
    assert torch.equal(out, reference_grouped_mm(case))
    magnitude = reference_grouped_mm(case, absolute=True)
    for g, (start, end) in enumerate(bounds(case.sizes)):
        if end > start:
            got = emulated_group(case, g, start, end)
            assert_fp32_close(got, out[g], magnitude[g], end - start)
    assert (out[[m == 0 for m in case.sizes]] == 0).all()


def test_recipes_swizzles_and_global_scales():
    st, sw = F.ScalingType, F.SwizzleType
    case = rows_case("nvfp4", [3, 5], 0, 32, 16)
    args = ng.grouped_mm_args(*case.operands())
    assert args["scale_recipe_a"] == [st.BlockWise1x16, st.TensorWise]
    assert args["swizzle_b"] == [sw.SWIZZLE_32_4_4, sw.NO_SWIZZLE]
    assert args["scale_a"][0].dtype == torch.float8_e4m3fn
    assert args["scale_a"][1].dtype == torch.float32 and args["scale_a"][1].shape == (2,)
    assert torch.equal(args["scale_b"][1], nvfp4.decode_scale(case.b_amax))
    mx = ng.grouped_mm_args(*rows_case("mxfp8", [3, 5], 0, 32, 16).operands())
    assert mx["scale_recipe_a"] == [st.BlockWise1x32] and mx["swizzle_a"] == [sw.SWIZZLE_32_4_4]
    assert mx["scale_a"][0].dtype == torch.float8_e8m0fnu and len(mx["scale_b"]) == 1


def test_unwritten_output_is_zeroed_on_the_device():
    out = torch.full((10, 4), float("nan"))
    ng.zero_unwritten(out, torch.tensor([0, 3, 7], dtype=torch.int32))
    assert out[7:].eq(0).all() and out[:7].isnan().all()
    out3 = torch.full((3, 2, 2), float("nan"))
    ng.zero_unwritten(out3, torch.tensor([64, 64, 128], dtype=torch.int32))
    assert out3[1].eq(0).all() and out3[[0, 2]].isnan().all()


def test_fake_implementation_gives_the_output_shape():
    rows = rows_case("nvfp4", [5, 0, 7], 3, 64, 32, device="meta")
    with FakeTensorMode() as mode:
        ops = [mode.from_tensor(t) if t is not None else None for t in rows.operands()]
        out = torch.ops.blockscale.native_scaled_grouped_mm(*ops)
    assert out.shape == (15, 32) and out.dtype == torch.bfloat16
    tokens = tokens_case("mxfp8", [5, 70], 48, 32)
    with FakeTensorMode() as mode:
        ops = [mode.from_tensor(t) if t is not None else None for t in tokens.operands()]
        out = torch.ops.blockscale.native_scaled_grouped_mm(*ops)
    assert out.shape == (2, 48, 32)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_entry_point_end_to_end_with_the_kernel_simulated(monkeypatch, compiled):
    """native.scaled_grouped_mm through its op, with F.scaled_grouped_mm replaced by the CPU
    simulation above (BF16 out, garbage where the kernel writes nothing): the output is the
    per-group product rounded once to BF16, zeros outside the groups. Compiled, Dynamo traces
    the op through its fake implementation and runs the real one."""

    def kernel(**args):
        return simulate_grouped_mm(args).to(torch.bfloat16)

    monkeypatch.setattr(F, "scaled_grouped_mm", kernel)
    monkeypatch.setattr(ng, "check_grouped_supported", lambda device: None)
    entry = torch.compile(native.scaled_grouped_mm, backend="eager", fullgraph=True) if compiled else native.scaled_grouped_mm  # fmt: skip
    for case in (rows_case("nvfp4", [0, 44, 117, 0], 9, 64, 32), tokens_case("mxfp8", [5, 0, 70], 32, 16)):  # fmt: skip
        out = entry(*case.operands())
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, reference_grouped_mm(case).to(torch.bfloat16))


def test_support_checks_and_input_errors_on_cpu():
    cpu = torch.device("cpu")
    assert ng.torch_supports_grouped()
    assert not native.grouped_supported(cpu)
    case = rows_case("nvfp4", [3, 5], 0, 32, 16)
    with pytest.raises(RuntimeError, match="native grouped GEMM unavailable: .* needs a CUDA"):
        native.scaled_grouped_mm(*case.operands())
    with pytest.raises(ValueError, match="writes BF16 only"):
        native.scaled_grouped_mm(*case.operands(), out_dtype=torch.float32)
    with pytest.raises(ValueError, match="NVFP4 needs a_amax float32 \\[2\\]"):
        ng.grouped_mm_args(*case.operands()[:5], None, case.b_amax)
    with pytest.raises(ValueError, match="offs has 3 groups, b_data has 2 experts"):
        ng.grouped_mm_args(*case.operands()[:4], offs_of([1, 2, 5]), case.a_amax, case.b_amax)
    with pytest.raises(ValueError, match="K % 32 == 0"):
        bad = rows_case("nvfp4", [3, 5], 0, 48, 16)
        ng.grouped_mm_args(*bad.operands())
    with pytest.raises(TypeError, match="a_data must be uint8"):
        ng.grouped_mm_args(case.a_data.float(), *case.operands()[1:])
    mx = rows_case("mxfp8", [3, 5], 0, 32, 16)
    with pytest.raises(ValueError, match="MXFP8 has no tensor amax"):
        ng.grouped_mm_args(*mx.operands()[:5], case.a_amax, None)


def blackwell() -> bool:
    return torch.cuda.is_available() and native.grouped_supported(torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not blackwell(), reason="native grouped GEMM needs compute capability 10.x")
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
def test_gpu_native_grouped_equals_emulated(fmt):
    """The verification the native grouped path still lacks: native against the per-group
    emulated product. The native output is BF16 (relative error <= 2^-9 from its rounding);
    FP32 accumulation order differs by at most K * 2^-24 * sum|a*b|, under 1e-3 of the
    largest output here: rtol 2^-8 with atol 1e-3 * max is far below a misplaced scale, which
    errs by the whole value."""
    cases = [
        rows_case(fmt, [0, 1, 44, 117, 128, 300, 0, 1000], 37, 256, 128, device="cuda"),
        tokens_case(fmt, [5, 0, 70, 128, 1, 600], 128, 96, device="cuda"),
    ]
    for case in cases:
        out = native.scaled_grouped_mm(*case.operands())
        want = torch.zeros_like(out, dtype=torch.float32)
        for g, (start, end) in enumerate(bounds(case.sizes)):
            if end > start:
                got_g = emulated_group(case, g, start, end)
                if case.b_data.dim() == 3:
                    want[start:end] = got_g
                else:
                    want[g] = got_g
        torch.testing.assert_close(out.float(), want, rtol=2**-8, atol=1e-3 * want.abs().max().item())  # fmt: skip
        if case.b_data.dim() == 3:
            assert out[sum(case.sizes) :].eq(0).all()
