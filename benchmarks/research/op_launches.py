"""Device time of blockscale's ops in one training step of a model, by op, shapes and flags.

A profile's top kernels name a kernel (`_nvfp4_quantize_kernel`: 350 launches, 24.6 ms in a
compiled llama-1b nvfp4 step) but not which of its uses cost what. This records one step
under torch.profiler with the ops' input shapes and constant arguments, and sums the device
time of the kernels each `blockscale::` op launched, grouped by (op, input shapes, constant
arguments): the forward's input copies apart from the backward's stochastic grad_output
copies, the weight copies, the amax passes and the GEMMs, each with its launch count and
microseconds a launch. The copy bandwidth measured in the same run is printed as the ceiling
for the memory-bound ones. The model and step are bench_model.py's (FP32 masters under BF16
autocast, fused AdamW, the default layer policy), compiled (plain torch.compile): eagerly
the ops launch their kernels without going through PyTorch's dispatcher (blockscale/
_registry.py, `library_op`: a host-time shortcut), so the profiler sees their kernels but no
op to charge them to (an eager nvfp4 llama-1b step on an H200 showed none, 2026-12-02).

    python benchmarks/research/op_launches.py --model llama-1b --recipe nvfp4 \\
        --json results/op_launches_llama1b_nvfp4.json
    python benchmarks/research/op_launches.py --quick        # CPU smoke test (no kernels)
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, from anywhere

import bench_model  # noqa: E402
import harness  # noqa: E402


def op_rows(events: Any) -> list[dict[str, Any]]:
    """The profiler's `blockscale::` op events grouped by (name, input shapes, constant
    arguments): launches, the device time of their kernels and the kernels' names, largest
    first."""
    groups: dict[tuple[str, str, str], dict[str, Any]] = defaultdict(
        lambda: {"count": 0, "us": 0.0, "kernels": set()}
    )
    for e in events:
        if not e.name.startswith("blockscale::"):
            continue
        key = (e.name, str(e.input_shapes), str(getattr(e, "concrete_inputs", "")))
        group = groups[key]
        group["count"] += 1
        group["us"] += sum(k.duration for k in e.kernels)
        group["kernels"].update(k.name[:48] for k in e.kernels)
    rows = [
        {"op": name, "shapes": shapes, "constants": constants, "count": g["count"],
         "ms": g["us"] / 1e3, "us_per_launch": g["us"] / g["count"],
         "kernels": ",".join(sorted(g["kernels"]))}
        for (name, shapes, constants), g in groups.items()
    ]  # fmt: skip
    return sorted(rows, key=lambda r: -r["ms"])


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = harness.add_common_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    parser.add_argument("--model", default="llama-1b", choices=sorted(bench_model.MODELS))
    parser.add_argument("--recipe", default="nvfp4", choices=bench_model.RECIPES)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.batch_size, args.seq_len = "llama-tiny", 2, 32
    device = harness.pick_device(args.device)
    model, vocab = bench_model.build(bench_model.MODELS[args.model], None, args.seq_len, device)
    optimizer = bench_model.convert_for(model, args.recipe, device)
    step = bench_model.make_step(model, optimizer, torch.compile(model), device)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (args.batch_size, args.seq_len + 1), generator=gen)
    tokens = tokens.to(device)
    for _ in range(args.warmup or 3):  # the first compiles
        step(tokens)
    harness.synchronize(device)
    ceiling = harness.copy_bandwidth(device) if device.type == "cuda" else None
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, record_shapes=True) as prof:
        step(tokens)
        harness.synchronize(device)
    rows = op_rows(prof.events())
    info = harness.banner(device)
    total = sum(r["ms"] for r in rows)
    copy = f"{ceiling / 1e12:.2f} TB/s" if ceiling else "-"
    print(f"{args.model} {args.recipe} compiled, B={args.batch_size} x {args.seq_len}: "
          f"blockscale ops' kernels {total:.2f} ms; copy {copy}")  # fmt: skip
    if rows:
        columns = ["ms", "count", "us_per_launch", "op", "shapes", "constants", "kernels"]
        harness.print_table(rows, columns)
    else:
        print("no blockscale ops ran (a bf16 recipe)")
    if args.json:
        harness.write_json(args.json, {
            "benchmark": "op_launches", "banner": info, "model": args.model,
            "recipe": args.recipe, "compile": True, "batch_size": args.batch_size,
            "seq_len": args.seq_len, "copy_bytes_per_s": ceiling, "rows": rows,
        })  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
