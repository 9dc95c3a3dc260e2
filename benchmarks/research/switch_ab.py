"""A module switch's effect on a whole compiled training step, A/B in one process.

Calls of one step in separate processes spread by a few milliseconds at the llama-1b shape
(docs/MODELS.md: 241-245 ms for the same code), as much as a kernel change may save. This
builds bench_model.py's model and step three times in one process: BF16, and the recipe
compiled once with the switch at its default and once flipped (the switch is read while
the graph is traced, so each compiled model keeps its setting), then times them in
alternating rounds, so that clock and thermal drift fall on every variant alike. Each round
times `--steps` steps of each model after one untimed step (harness.time_fn: their median);
the table gives each variant's median over rounds and its ratio to BF16's. Peak memory is not measured here: three models
share the process (bench_model.py measures it, one model a process).

    python benchmarks/research/switch_ab.py --model llama-1b --recipe nvfp4 \\
        --switch blockscale.ops.linear:CAST_INPUT_UNDER_AUTOCAST --json results/ab.json
    python benchmarks/research/switch_ab.py --quick    # CPU smoke test (llama-tiny, eager)
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, from anywhere

import bench_model  # noqa: E402
import harness  # noqa: E402


def parse_switch(text: str) -> tuple[Any, str]:
    """`module:NAME` -> (the module, NAME); the attribute must exist and be a bool."""
    module_name, sep, attr = text.partition(":")
    if not sep or not attr:
        raise SystemExit(f"--switch wants module:NAME, got {text!r}")
    module = importlib.import_module(module_name)
    if not isinstance(getattr(module, attr, None), bool):
        raise SystemExit(f"{module_name}.{attr} is not a boolean switch")
    return module, attr


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = harness.add_common_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    parser.add_argument("--model", default="llama-1b", choices=sorted(bench_model.MODELS))
    parser.add_argument("--recipe", default="nvfp4", choices=bench_model.RECIPES[1:])
    parser.add_argument("--switch", default="blockscale.ops.linear:CAST_INPUT_UNDER_AUTOCAST")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=None, help="override the layer count")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="timed steps a model a round")
    parser.add_argument("--eager", action="store_true", help="time the eager step instead")
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.batch_size, args.seq_len = "llama-tiny", 2, 32
        args.rounds, args.steps, args.eager = 2, 1, True
    device = harness.pick_device(args.device)
    module, attr = parse_switch(args.switch)
    default = getattr(module, attr)
    info = harness.banner(device)
    spec = bench_model.MODELS[args.model]
    gen = torch.Generator().manual_seed(1)
    variants: list[tuple[str, Any]] = []
    try:
        for name, recipe, value in (
            ("bf16", "bf16", default),
            (f"{args.recipe} {attr}={default}", args.recipe, default),
            (f"{args.recipe} {attr}={not default}", args.recipe, not default),
        ):
            setattr(module, attr, value)
            model, vocab = bench_model.build(spec, args.layers, args.seq_len, device)
            optimizer = bench_model.convert_for(model, recipe, device)
            forward = model if args.eager else torch.compile(model)
            step = bench_model.make_step(model, optimizer, forward, device)
            batch = torch.randint(0, vocab, (args.batch_size, args.seq_len + 1), generator=gen)
            batch = batch.to(device)
            t0 = time.perf_counter()
            step(batch)  # compiles under this variant's setting
            harness.synchronize(device)
            print(f"  {name}: first step {time.perf_counter() - t0:.1f} s", flush=True)
            variants.append((name, lambda s=step, b=batch: harness.time_fn(
                s, [(b,)], warmup=1, reps=args.steps, device=device).median_ms))  # fmt: skip
        times: dict[str, list[float]] = {name: [] for name, _ in variants}
        for r in range(args.rounds):
            # the same variant always first, or last, would take any drift within a round
            order = variants if r % 2 == 0 else variants[::-1]
            for name, run in order:
                times[name].append(run())
            print(f"  round {r + 1}: " + ", ".join(f"{n} {times[n][-1]:.1f} ms" for n in times))
    finally:
        setattr(module, attr, default)
    base = statistics.median(times["bf16"])
    rows = [{"variant": name, "median_ms": statistics.median(ms), "min_ms": min(ms),
             "max_ms": max(ms), "vs_bf16": base / statistics.median(ms), "rounds_ms": ms}
            for name, ms in times.items()]  # fmt: skip
    tokens = args.batch_size * args.seq_len
    print(f"\n{args.model} {'eager' if args.eager else 'compiled'}, B={args.batch_size} x "
          f"{args.seq_len} ({tokens} tokens), {args.rounds} rounds of {args.steps} steps")  # fmt: skip
    harness.print_table(rows, ["variant", "median_ms", "min_ms", "max_ms", "vs_bf16"])
    if args.json:
        harness.write_json(args.json, {
            "benchmark": "switch_ab", "banner": info, "argv": sys.argv[1:] if argv is None
            else argv, "model": args.model, "recipe": args.recipe, "switch": args.switch,
            "eager": args.eager, "batch_size": args.batch_size, "seq_len": args.seq_len,
            "rows": rows,
        })  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
