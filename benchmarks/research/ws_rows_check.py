"""GPU check of the warp-specialized rows GEMM (kernels/grouped_gemm.py ROWS_WARP_SPECIALIZE):
where and by how much its output differs from the same tiles without warp specialization.

On an H200 (2026-12-01) the launch ran (no hang, since A's descriptor is made in the kernel)
and was faster, but `bench_grouped_mm.py --gemm-configs` reported its bits unequal to the
same tiles' without it. This script tells a different order of the FP32 sums (both within
rounding of an FP64 reference, a few elements a BF16 step apart) from a wrong result (tiles
read or written wrongly: errors far above rounding, whole rows or tiles, or a result that
moves between runs), and where the differences sit: which groups, whether a group's last
(partial) row tile, which 64-row half of a tile (each consumer warpgroup owns one), the rows
past offs[-1].

    python benchmarks/research/ws_rows_check.py [--json PATH]

Cases: the GPU test's (128 uneven experts of 0-400 rows, one empty, 50 rows past offs[-1],
K 768, N 1024), the same with the weight N-major, and 128 experts of 1024 rows each (no
partial tile). Prints one line a case; exits non-zero when a result is wrong (not when only
the order differs).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from blockscale.formats.nvfp4 import decode_scale  # noqa: E402
from blockscale.kernels import grouped_gemm as gg  # noqa: E402


def operands(sizes: torch.Tensor, tail: int, k: int, n: int, n_major: bool, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    offs = sizes.cumsum(0).to(torch.int32)
    m = int(offs[-1]) + tail
    a = torch.randn(m, k, generator=g, device="cuda").bfloat16()
    b = torch.randn(len(sizes), n, k, generator=g, device="cuda").bfloat16()
    if n_major:
        b = b.transpose(1, 2).contiguous().transpose(1, 2)
    amax = tuple(torch.rand(len(sizes), generator=g, device="cuda") + 1 for _ in range(2))
    return a, b, offs, amax


def reference(a, b, offs, amax) -> torch.Tensor:
    """FP64 product of each group times its alpha (what both launches round)."""
    out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float64, device=a.device)
    start = 0
    alpha = decode_scale(amax[0]).double() * decode_scale(amax[1]).double()
    for e, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = (a[start:end].double() @ b[e].double().T) * alpha[e]
        start = end
    return out


def run(ws: bool, a, b, offs, amax) -> torch.Tensor:
    gg.ROWS_WARP_SPECIALIZE = ws
    try:
        out = gg.grouped_gemm_rows(a, b, offs, amax, torch.bfloat16)
        torch.cuda.synchronize()
        return out
    finally:
        gg.ROWS_WARP_SPECIALIZE = False


def check(name: str, sizes: torch.Tensor, tail: int, n_major: bool) -> dict:
    a, b, offs, amax = operands(sizes, tail, 768, 1024, n_major, seed=0)
    saved = gg.ROWS_CONFIG
    gg.ROWS_CONFIG = gg.ROWS_WS_CONFIG  # the same tiles with and without
    try:
        plain = run(False, a, b, offs, amax)
        ws = run(True, a, b, offs, amax)
        ws_again = run(True, a, b, offs, amax)
    finally:
        gg.ROWS_CONFIG = saved
    ref = reference(a, b, offs, amax)
    bm = gg.ROWS_WS_CONFIG[0]
    m_used = int(offs[-1])
    diff = ws != plain
    rows = diff.any(1).nonzero().flatten()
    starts = torch.cat((offs.new_zeros(1), offs[:-1])).long()
    group = torch.searchsorted(offs.long(), rows, right=True)  # E for rows past offs[-1]
    in_group = rows - starts[group.clamp(max=len(sizes) - 1)]
    size = (offs.long() - starts)[group.clamp(max=len(sizes) - 1)]
    last_tile = (in_group // bm) == ((size - 1) // bm)
    scale = ref.abs().max().item()

    def rel(x: torch.Tensor) -> float:
        return ((x.double() - ref).norm() / ref.norm()).item()

    record = {
        "case": name,
        "elements differing": int(diff.sum()),
        "of": diff.numel(),
        "rows differing": len(rows),
        "max |ws - plain| / max |ref|": (ws.double() - plain.double()).abs().max().item() / scale,
        "rel err ws": rel(ws),
        "rel err plain": rel(plain),
        "ws repeatable": bool(torch.equal(ws, ws_again)),
        "tail rows nonzero (ws)": int((ws[m_used:] != 0).any(1).sum()),
        "differing rows past offs[-1]": int((group == len(sizes)).sum()),
        "differing rows in a group's last row tile": int(last_tile[group < len(sizes)].sum()),
        "differing rows in a tile's first / second 64": [
            int(((in_group % bm) < 64).sum()),
            int(((in_group % bm) >= 64).sum()),
        ],
        "groups with a difference": sorted(set(group.tolist()))[:20],
    }
    wrong = (
        record["rel err ws"] > 2 * record["rel err plain"] + 1e-6
        or not record["ws repeatable"]
        or record["tail rows nonzero (ws)"]
    )
    record["verdict"] = "WRONG" if wrong else ("same bits" if not diff.any() else "order only")
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the records here")
    args = parser.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    uneven = torch.randint(0, 400, (128,), generator=g, device="cuda")
    uneven[3] = 0
    even = torch.full((128,), 1024, device="cuda")
    records = [
        check("uneven, K-major", uneven, 50, False),
        check("uneven, N-major", uneven, 50, True),
        check("1024 each, K-major", even, 0, False),
    ]
    for r in records:
        print(json.dumps(r))
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    return int(any(r["verdict"] == "WRONG" for r in records))


if __name__ == "__main__":
    sys.exit(main())
