"""Roofline plot of the quantization kernels and the GEMMs of a linear step, from the JSON that
bench_quantize.py and breakdown_linear.py wrote, against the ceilings measured in those runs.

Axes: arithmetic intensity (operations per byte moved) and attained operations per second,
both logarithmic. A GEMM counts 2*M*N*K FLOPs over the bytes of its operands and output
(the least it must move). A quantization kernel counts one operation per input value (it
does a fixed amount of work per value), so it sits far left, under the memory roof: its
height against that roof is its fraction of the copy bandwidth. Roofs: the device-to-device
copy bandwidth (bytes read + written per second) and the BF16 GEMM TFLOP/s (cuBLAS, largest
ceiling measured in the breakdown runs).

    python benchmarks/research/roofline.py --quantize docs/results/bench_quantize_h100.json \
        --breakdown docs/results/breakdown_nvfp4_h100.json --out docs/img/roofline_h100.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quantize", required=True, help="bench_quantize.py --json output")
    parser.add_argument("--breakdown", required=True, nargs="+", help="breakdown_linear.py JSON")
    parser.add_argument("--out", required=True, help="PNG to write")
    args = parser.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    q = json.loads(Path(args.quantize).read_text())
    m, k = q["shape"]
    copy = q["copy_GBps"] * 1e9 if "copy_GBps" in q else None
    points = []  # (label, intensity, ops/s, kind)
    for row in q["rows"]:
        if "tiny" in row["kernel"]:
            continue
        values = m * k
        seconds = row["time_us"] * 1e-6
        points.append((row["kernel"], values / (row["MB moved"] * 1e6), values / seconds, "quant"))
    peak = 0.0
    for path in args.breakdown:
        b = json.loads(Path(path).read_text())
        copy = copy or b["copy_tbps"] * 1e12
        peak = max([peak, *(t * 1e12 for t in b["gemm_ceiling_tflops"].values())])
        seen = set()
        for row in b["rows"]:
            if not row.get("flops") or (row["shape"], row["phase"]) in seen:
                continue
            seen.add((row["shape"], row["phase"]))
            gm, gk, gn = (int(v) for v in row["shape"].split("x"))
            # BF16 operands; the fused kernel writes BF16, cuBLAS for the epilogue FP32
            fused = "Triton" in row["op"]
            nbytes = 2 * (gm * gk + gn * gk) + (2 if fused else 4) * gm * gn
            kind = "fused epilogue, BF16 out" if fused else "cuBLAS, FP32 out"
            label = f"GEMM {row['phase']} {row['shape']} ({kind})"
            points.append((label, row["flops"] / nbytes, row["tflops"] * 1e12, "gemm"))

    fig, ax = plt.subplots(figsize=(13, 6.5))
    xs = [10 ** (i / 20) for i in range(-40, 81)]
    ax.plot(xs, [min(copy * x, peak) for x in xs], color="black", lw=1.5)
    ax.text(0.012, copy * 0.012 * 1.5, f"copy {copy / 1e12:.2f} TB/s", fontsize=8, rotation=33)
    ax.text(30, peak * 1.15, f"BF16 GEMM {peak / 1e12:.0f} TFLOP/s", fontsize=8)
    markers = {"quant": "o", "gemm": "s"}
    for i, (label, x, y, kind) in enumerate(points, 1):
        roof = min(copy * x, peak)
        ax.scatter(
            [x], [y], marker=markers[kind], s=30, label=f"{i}. {label}: {100 * y / roof:.0f}%"
        )
        ax.annotate(str(i), (x, y), fontsize=7, xytext=(3, 2), textcoords="offset points")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), title="% of the roof",
              title_fontsize=8)  # fmt: skip
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (operations per byte moved)")
    ax.set_ylabel("attained operations per second")
    title = q.get("info", {}).get("name", "")
    ax.set_title(f"Quantization kernels ({m}x{k} BF16) and GEMMs of a linear step, {title}",
                 fontsize=10)  # fmt: skip
    ax.grid(True, which="both", lw=0.2)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=130)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
