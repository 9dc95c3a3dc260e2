"""GPU check of NVFP4 stochastic rounding (Philox drawn in x's load layout), then its timings.

Checks, each printed as ok/FAIL; the script exits 1 if any fails:

- at 16384 x 8192 BF16, for rowwise SR + dq, columnwise RHT SR and both SR + dq: every code is
  one of the two grid neighbours of its value (the codes for uniforms 0 and ~1) with the
  nearest-rounding scales; a seed reproduces the bits and another seed changes them; the
  Philox path equals the reference fed the bytes of a model of the kernel's generator (bit for
  bit, except blocks whose FP32 RHT sum may round differently, docs/KERNELS.md); the mean of
  the dequantized draws over repeated rows is within 6 sigma of the value; the rowwise and
  columnwise copies of one launch round independently.
- the explicit-uniforms path (`rand=`) bit for bit against formats/ at 8192 x 5120 and
  14336 x 16384: rowwise, 16x16, columnwise, columnwise RHT and both directions, with `_dq`.

Then the SR launch kinds (and their nearest counterparts) are timed as CUDA-graph replays
against a device-to-device copy measured in the same run (benchmarks/bench_quantize.py's
cases and byte counts); the table is printed last.

    python benchmarks/check_sr_gpu.py
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import torch

# this checkout's blockscale, not an installed one; and the benchmark helpers beside this file
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_quantize  # noqa: E402
import harness  # noqa: E402

from blockscale import kernels  # noqa: E402
from blockscale.formats import hadamard, nvfp4  # noqa: E402
from blockscale.kernels import _common  # noqa: E402
from blockscale.kernels import nvfp4 as knv  # noqa: E402

# Without a GPU (bench_quantize switched Triton's interpreter on) the same checks run on small
# shapes, a smoke test of this script before it costs device time.
SMOKE = not torch.cuda.is_available()
DEV = torch.device("cpu" if SMOKE else "cuda")
STATS_SHAPE = (256, 128) if SMOKE else (16384, 8192)
GIVEN_SHAPES = [(128, 96)] if SMOKE else [(8192, 5120), (14336, 16384)]
FAILED: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name}{'  ' + detail if detail else ''}", flush=True)
    if not ok:
        FAILED.append(name)


def same(a: nvfp4.NVFP4Tensor, b: nvfp4.NVFP4Tensor) -> bool:
    return (
        torch.equal(a.data, b.data)
        and torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8))
        and torch.equal(a.amax, b.amax)
    )


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def inexact_hadamard_blocks(x: torch.Tensor) -> torch.Tensor:
    """[K, M/16]: 16-token blocks of x.T whose FP32 RHT partial sums can round (magnitudes
    spanning more than 2^12), where the tensor-core sum may differ from the reference's."""
    a = x.t().float().abs().reshape(x.shape[1], -1, 16)
    e = torch.where(a > 0, torch.floor(torch.log2(a)), torch.full_like(a, float("inf")))
    e_max = torch.where(a > 0, e, torch.full_like(a, -float("inf"))).amax(-1)
    return (e_max - e.amin(-1)) > 12


def same_hadamard(q: nvfp4.NVFP4Tensor, r: nvfp4.NVFP4Tensor, x: torch.Tensor) -> bool:
    """Bit-exact except in blocks where the FP32 RHT sum may round (rare; docs/KERNELS.md)."""
    rows = q.shape[0]
    bad = (q.data != r.data).reshape(rows, -1, 8).any(-1)
    bad |= q.scale.view(torch.uint8) != r.scale.view(torch.uint8)
    return (
        torch.equal(q.amax, r.amax)
        and not (bad & ~inexact_hadamard_blocks(x)).any()
        and bad.float().mean() < 1e-5
    )


def make(shape, seed, outliers=False) -> torch.Tensor:
    g = torch.Generator(DEV).manual_seed(seed)
    x = torch.randn(shape, generator=g, device=DEV)
    if outliers:
        hit = torch.rand(shape, generator=g, device=DEV) < 1e-3
        x = torch.where(hit, x * (50 + 450 * torch.rand(shape, generator=g, device=DEV)), x)
    return x.to(torch.bfloat16)


# ------------------------------------------------- a model of the kernel's Philox draws


def philox4x32_7(seed: int, c0, c1, c2, c3):
    """Philox4x32-7 as triton.language.philox computes it, on int64 tensors of uint32 words
    (the same model as tests/test_kernels_nvfp4.py)."""
    mask = 0xFFFFFFFF
    k0, k1 = seed & mask, (seed >> 32) & mask

    def mul(a: int, b):
        lo = a * (b & 0xFFFF)
        mid = a * (b >> 16) + (lo >> 16)
        return mid >> 16, ((mid & 0xFFFF) << 16) | (lo & 0xFFFF)

    for _ in range(7):
        hi_b, lo_b = mul(0xCD9E8D57, c2)
        hi_a, lo_a = mul(0xD2511F53, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + 0x9E3779B9) & mask, (k1 + 0xBB67AE85) & mask
    return c0, c1, c2, c3


def model_uniforms(seed: int, rows: int, cols: int, bm: int, stream: int) -> torch.Tensor:
    """The kernel's uniforms for x [rows, cols] with row tiles of bm (see _philox_bytes)."""
    m = torch.arange(rows, device=DEV)[:, None]
    k = torch.arange(cols, device=DEV)[None, :]
    i = m % bm
    half = i // (bm // 2)
    first_row = m - i + i % (bm // 2)
    zero = torch.zeros_like(k)
    words = philox4x32_7(seed, k // 8, zero + stream, first_row, zero)
    j = k % 8
    pick = 2 * half + j // 4
    word = torch.where(pick == 0, words[0], words[1])
    word = torch.where(pick == 2, words[2], word)
    word = torch.where(pick == 3, words[3], word)
    del words
    return ((word >> (8 * (j % 4))) & 0xFF).float() / 256


def reference_with(u: torch.Tensor, x: torch.Tensor, **mode) -> nvfp4.NVFP4Tensor:
    """formats/ quantize with stochastic rounding fed the uniforms u (shaped like the copy)."""
    rand = torch.rand
    torch.rand = lambda shape, **kw: u.reshape(shape)
    try:
        return nvfp4.quantize(x, rounding="stochastic", **mode)
    finally:
        torch.rand = rand


# ------------------------------------------------------------------------ the checks


def check_statistics() -> None:
    shape = STATS_SHAPE
    x = make(shape, 0, outliers=True)
    amax, amax_t = kernels.amax(x), kernels.amax_hadamard_t(x)
    sr_r = {"amax": amax, "rounding": "stochastic"}
    sr_c = {"amax": amax_t, "rounding": "stochastic", "hadamard": True}
    gen = lambda s: torch.Generator(DEV).manual_seed(s)  # noqa: E731
    kinds = {
        "rowwise SR + dq": lambda g: (
            kernels.nvfp4_quantize(
                x, amax=amax, rounding="stochastic", generator=g, return_dq=True
            )[0],
            None,
        ),
        "columnwise RHT SR": lambda g: (
            None,
            kernels.nvfp4_quantize(
                x, transpose=True, hadamard=True, amax=amax_t, rounding="stochastic", generator=g
            ),
        ),
        "both SR + dq": lambda g: tuple(
            q for q, _ in kernels.nvfp4_quantize_both(x, sr_r, sr_c, return_dq=True, generator=g)
        ),
    }
    # grid neighbours: the codes for uniforms ~1 (never up) and 0 (up whenever off the grid)
    n_row = (shape[0], shape[1] // 16, 16)
    n_col = (shape[1], shape[0] // 16, 16)
    bounds = {}
    for name, n, mode in (
        ("row", n_row, dict(amax=amax)),
        ("col", n_col, dict(amax=amax_t, transpose=True, hadamard=True)),
    ):
        lo = kernels.nvfp4_quantize(
            x, rounding="stochastic", rand=torch.full(n, 1 - 2**-24, device=DEV), **mode
        )
        hi = kernels.nvfp4_quantize(
            x, rounding="stochastic", rand=torch.zeros(n, device=DEV), **mode
        )
        near = kernels.nvfp4_quantize(x, **mode)
        bounds[name] = (lo.codes(), hi.codes(), near.scale.view(torch.uint8))
    seed = lambda s: int(_common.philox_seed(DEV, gen(s)))  # noqa: E731
    tiles = {"rowwise SR + dq": "row_dq", "columnwise RHT SR": "col", "both SR + dq": "both_dq"}
    for kind, fn in kinds.items():
        a, b, c = fn(gen(1)), fn(gen(1)), fn(gen(2))
        bm = knv.TILES[tiles[kind]][0]
        for name, qa, qb, qc in zip(("row", "col"), a, b, c):
            if qa is None:
                continue
            lo, hi, scale = bounds[name]
            codes = qa.codes()
            check(
                f"{kind} / {name}: codes are grid neighbours, scales as nearest",
                bool(((codes == lo) | (codes == hi)).all())
                and torch.equal(qa.scale.view(torch.uint8), scale),
            )
            differ = (qa.data != qc.data).float().mean().item()
            check(
                f"{kind} / {name}: a seed reproduces, another changes the bits",
                same(qa, qb) and differ > 0.1,
                f"bytes changed by the other seed: {differ:.3f}",
            )
            del codes
            if name == "row":
                u = model_uniforms(seed(1), *shape, bm, stream=0)
                r = reference_with(u, x, amax=amax)
                ok = same(qa, r)
            else:
                u = model_uniforms(seed(1), *shape, bm, stream=1).t()
                r = reference_with(u, x, amax=amax_t, transpose=True, hadamard=True)
                ok = same_hadamard(qa, r, x)
            del u, r
            check(f"{kind} / {name}: Philox path = reference fed the model's bytes", ok)
        del a, b, c
    del bounds
    torch.cuda.empty_cache()
    check_means(*shape)
    check_independence(shape)


def check_means(rows: int, cols: int) -> None:
    """E[dq] = the value: the same vector repeated n times, mean over the repeats. Each draw
    is lo or lo + step' (step' <= step), so Hoeffding bounds a value's chance of missing 6
    sigma (sigma = step / (2 sqrt(n))) by 2 exp(-18) = 3e-8: below 1e-3 for all 4 checks."""
    r = make((1, cols), 3).float()
    c = make((rows, 1), 4).float()
    amax = torch.tensor(2688.0 / 8, device=DEV)  # a round S_enc: the expectation is exact
    sr = {"amax": amax, "rounding": "stochastic"}
    srh = {**sr, "hadamard": True}
    g = torch.Generator(DEV).manual_seed(5)
    x_rows = r.expand(rows, -1).to(torch.bfloat16).contiguous()  # rowwise copy: rows = r
    x_cols = c.expand(-1, cols).to(torch.bfloat16).contiguous()  # columnwise copy: rows = c.T
    y_cols = hadamard.transform(c.t().to(torch.bfloat16)).float()  # the RHT the copy rounds
    cases = [
        ("rowwise SR", kernels.nvfp4_quantize(x_rows, generator=g, **sr), r),
        ("columnwise RHT SR", kernels.nvfp4_quantize(x_cols, transpose=True, generator=g, **srh),
         y_cols),
        ("both SR, row copy", kernels.nvfp4_quantize_both(x_rows, sr, srh, generator=g)[0], r),
        ("both SR, col copy", kernels.nvfp4_quantize_both(x_cols, sr, srh, generator=g)[1],
         y_cols),
    ]  # fmt: skip
    s_dec = nvfp4.decode_scale(amax).double()
    for name, q, value in cases:
        n = q.shape[0]
        mean = q.dequantize().double().mean(0)
        step = q.scale[0].float().double().repeat_interleave(16) * 2 * s_dec
        err = (mean - value[0].double()).abs()
        worst = (err / (step / (2 * math.sqrt(n)) + 1e-30)).max().item()
        check(
            f"{name}: mean of {n} draws within 6 sigma",
            bool((err <= 6 * step / (2 * math.sqrt(n)) + 1e-12).all()),
            f"worst {worst:.2f} sigma",
        )


def check_independence(shape) -> None:
    """Each x[m, k] is quantized by both copies of one launch with the same value and scale
    (amax 2688, a 6 in every 16-block along rows and columns, every other value a grid
    midpoint, rounded up with probability exactly 1/2). Same bits would make the copies agree
    everywhere; independent bits make the disagreements Binomial(N, 1/2). Bound: 10 sd
    (false failure < 1e-22)."""
    rows, cols = shape
    g = torch.Generator(DEV).manual_seed(6)
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], device=DEV)
    a = mids[torch.randint(0, 7, shape, generator=g, device=DEV)]
    a = a * torch.where(torch.rand(shape, generator=g, device=DEV) < 0.5, -1.0, 1.0)
    i, k = torch.arange(rows, device=DEV)[:, None], torch.arange(cols, device=DEV)[None, :]
    ambiguous = (i - k) % 16 != 0
    x = torch.where(ambiguous, a, 6.0).to(torch.bfloat16)
    del a
    amax = torch.tensor(2688.0, device=DEV)
    sr = {"amax": amax, "rounding": "stochastic"}
    q_row, q_col = kernels.nvfp4_quantize_both(x, sr, sr, generator=g)
    differ = ((q_row.codes() != q_col.codes().t()) & ambiguous).sum().item()
    up_row = ((q_row.codes() != nvfp4.quantize(x, amax=amax).codes()) & ambiguous).sum().item()
    n = ambiguous.sum().item()
    sd = math.sqrt(n) / 2
    check(
        "both SR: rowwise and columnwise copies round independently",
        abs(differ - n / 2) <= 10 * sd and abs(up_row - n / 2) <= 10 * sd,
        f"disagree {differ / n:.5f} (expect 0.5 +- {10 * sd / n:.5f}), "
        f"row copy off nearest {up_row / n:.5f}",
    )


def check_given_uniforms() -> None:
    """The explicit-uniforms path bit for bit against formats/ (24-bit torch.rand uniforms,
    the reference's own draws)."""
    for shape in GIVEN_SHAPES:
        x = make(shape, shape[1], outliers=True)
        rows, cols = shape
        for mode in (
            dict(),
            dict(block="16x16"),
            dict(transpose=True),
            dict(transpose=True, hadamard=True),
        ):
            out_rows, out_cols = (cols, rows) if mode.get("transpose") else (rows, cols)
            u = torch.rand(
                (out_rows, out_cols // 16, 16), generator=torch.Generator(DEV).manual_seed(7),
                device=DEV,
            )  # fmt: skip
            q, dq = kernels.nvfp4_quantize(x, rounding="stochastic", rand=u, return_dq=True, **mode)
            r = nvfp4.quantize(
                x, rounding="stochastic", generator=torch.Generator(DEV).manual_seed(7), **mode
            )
            ok = same_hadamard(q, r, x) if mode.get("hadamard") else same(q, r)
            ok = ok and (mode.get("hadamard") or same_bits(dq, r.dq()))
            check(f"rand= {shape} {mode or 'rowwise'}: bit-exact vs formats/", bool(ok))
            del q, dq, r, u
        # both directions in one launch, through the op (the public call takes no uniforms)
        ur = torch.rand(rows, cols, generator=torch.Generator(DEV).manual_seed(8), device=DEV)
        uc = torch.rand(cols, rows, generator=torch.Generator(DEV).manual_seed(9), device=DEV)
        amax, amax_t = kernels.amax(x).reshape(1), kernels.amax_hadamard_t(x).reshape(1)
        data, scale, dq, data_t, scale_t, dq_t = knv._nvfp4_quantize_2d(
            x, amax, amax_t, None, ur, uc, row=True, col=True, row_2d=False, col_2d=False,
            row_sr=True, col_sr=True, col_hadamard=True, dq_row=True, dq_col=True,
        )  # fmt: skip
        qr = knv._container(data, scale, amax, x.shape, "1x16", False)
        qc = knv._container(data_t, scale_t, amax_t, torch.Size((cols, rows)), "1x16", True)
        rr = reference_with(ur, x, amax=amax.reshape(()))
        rc = reference_with(uc, x, amax=amax_t.reshape(()), transpose=True, hadamard=True)
        check(
            f"rand= {shape} both (row SR + col RHT SR, dq): bit-exact vs formats/",
            same(qr, rr) and same_bits(dq, rr.dq()) and same_hadamard(qc, rc, x),
        )
        del x, ur, uc, data, scale, dq, data_t, scale_t, dq_t, qr, qc, rr, rc
        torch.cuda.empty_cache()


def timings() -> list[dict]:
    shape = bench_quantize.QUICK_SHAPE if SMOKE else bench_quantize.SHAPE
    x = bench_quantize.make_input(shape, DEV)
    copy = harness.copy_bandwidth(DEV, nbytes=2**20 if SMOKE else 2**30, reps=3 if SMOKE else 20)
    wanted = (
        "rowwise SR + dq",
        "rowwise + dq",
        "columnwise RHT SR",
        "columnwise RHT",
        "both SR (grad_output) + dq",
        "both (row + col RHT) + dq",
    )
    selected = [c for c in bench_quantize.cases(x) if c[0].removeprefix("nvfp4 1x16 ")
                .removeprefix("nvfp4 ") in wanted]  # fmt: skip
    reps = (1, 2) if SMOKE else (5, 50)
    rows = bench_quantize.timed_rows(selected, DEV, *reps, eager=False, copy=copy)
    rows.append(
        {"kernel": "device-to-device copy", "time_us": 2 * x.numel() * 2 / copy * 1e6,
         "GB/s": copy / 1e9, "% of copy": 100.0, "MB moved": 4 * x.numel() / 1e6, "tiles": "-"}
    )  # fmt: skip
    return rows


def main() -> int:
    harness.banner(DEV)
    t0 = time.time()
    check_statistics()
    check_given_uniforms()
    print(f"checks: {time.time() - t0:.0f} s, {len(FAILED)} failed", flush=True)
    rows = timings()
    shape = bench_quantize.QUICK_SHAPE if SMOKE else bench_quantize.SHAPE
    print(f"\nNVFP4 SR at {shape} BF16 (CUDA-graph replays, median; copy measured now)")
    harness.print_table(rows, ["kernel", "time_us", "GB/s", "% of copy", "tiles"])
    if FAILED:
        print("FAILED:", *FAILED, sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
