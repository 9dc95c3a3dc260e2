"""Whole training steps: tokens/s and peak memory of each recipe on a model size, as ratios to BF16.

One step is what `blockscale train` does per optimizer step (BF16 autocast forward, cross-entropy,
backward, gradient clipping, fused AdamW) on random bytes, with the model built and converted by
`blockscale.train.build` exactly as a training run builds it (default layer policy: the last 15%
of blocks and the LM head stay BF16). For each recipe, in the same run:

- the median step time over `--reps` steps after `--warmup` steps (compilation included in the
  warm-up with `--compile`), tokens/s, and the ratio of the step time to BF16's;
- the peak memory allocated during training (`max_memory_allocated`), and its ratio to BF16's;
- model TFLOP/s (6 x parameters in linear layers x tokens, plus causal attention) and its ratio
  to a BF16 GEMM of the model's MLP shape measured in the same run (the "% GEMM" column).

    python benchmarks/bench_train.py --model small --batch-size 64 --json out/bench_train.json
    python benchmarks/bench_train.py --quick            # CPU smoke test (tiny model)
    python benchmarks/bench_train.py --recipes nvfp4,nvfp4-no-hadamard  # the study's ablations

A name in `--recipes` is a recipe or one of the study's ablations (`nvfp4-no-hadamard`,
`nvfp4-no-stochastic-rounding`, `nvfp4-no-weight-2d`, `nvfp4-no-bf16-tail`), built with the same
switches `blockscale compare --ablate` uses.

This is the planning figure for the convergence study (docs/TRAINING.md): a study run of T tokens
takes about T / tokens_per_s plus evaluation, telemetry and checkpoints.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script from anywhere

import harness  # noqa: E402

from blockscale.ops import EXACT_INDUCTOR_OPTIONS  # noqa: E402
from blockscale.train import build  # noqa: E402
from blockscale.train.compare import ABLATIONS, ablation_fields, ablation_label  # noqa: E402
from blockscale.train.config import TrainConfig  # noqa: E402

RECIPES = ["bf16", "nvfp4", "mxfp8", "nvfp4_fwd_mxfp8_bwd"]
ABLATED = {ablation_label(name): ablation_fields(name) for name in ABLATIONS}


def variant_config(name: str) -> dict:
    """TrainConfig fields of a recipe name or of an ablation's name (`nvfp4-no-hadamard`)."""
    return ABLATED.get(name, {"recipe": name})


def model_flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    """6 x (weights of every linear layer) + causal attention's QK^T and PV (forward 2 x 2 x
    seq x dim / 2 per layer, x3 for forward + backward)."""
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    cfg = model.config
    attention = 3 * 2 * cfg.n_layers * seq_len * cfg.dim  # causal: half of 4 x seq x dim
    return 6 * linear + attention


def run_recipe(
    recipe: str, args: argparse.Namespace, device: torch.device, warmup: int, reps: int
) -> dict:
    cfg = TrainConfig(
        model=args.model,
        **variant_config(recipe),
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        device=str(device),
        compile=args.compile,
    )
    model, _ = build.build_model(cfg, device)
    optimizer = build.build_optimizer(model, cfg, device)
    step_model = torch.compile(model, options=EXACT_INDUCTOR_OPTIONS) if args.compile else model
    autocast = build.autocast_for(device)
    seq_len = model.config.seq_len
    gen = torch.Generator(device="cpu").manual_seed(0)
    batches = [
        torch.randint(0, 256, (args.batch_size, seq_len + 1), generator=gen).to(device)
        for _ in range(2)
    ]

    def step(tokens: torch.Tensor) -> None:
        with autocast():
            logits = step_model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    harness.time_fn(step, [(b,) for b in batches], warmup=1, reps=1, device=device)
    first_s = time.perf_counter() - t0
    timing = harness.time_fn(step, [(b,) for b in batches], warmup=warmup, reps=reps, device=device)
    tokens = args.batch_size * seq_len
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    flops = model_flops_per_token(model, seq_len) * tokens
    row = {
        "recipe": recipe,
        "compile": args.compile,
        "first_step_s": first_s,
        "step_ms": timing.median_ms,
        "p20_ms": timing.p20_ms,
        "p80_ms": timing.p80_ms,
        "tokens_per_s": tokens / (timing.median_ms * 1e-3),
        "tflops": flops / (timing.median_ms * 1e-3) / 1e12,
        "peak_gib": peak / 2**30 if peak is not None else None,
    }
    return row


def main() -> None:
    parser = harness.add_common_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    parser.add_argument("--model", default="small")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=0, help="0: the model size's own")
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    args = parser.parse_args()
    if args.quick:
        args.model, args.batch_size, args.seq_len = "tiny", 4, 64
    device = harness.pick_device(args.device)
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 10)
    reps = args.reps if args.reps is not None else (3 if args.quick else 30)
    info = harness.banner(device)

    names = [r.strip() for r in args.recipes.split(",") if r.strip()]
    if "bf16" not in names:
        names.insert(0, "bf16")  # every ratio is to BF16 measured in this run
    rows = []
    for name in names:
        rows.append(run_recipe(name, args, device, warmup, reps))
        row = rows[-1]  # one line as each finishes: a run cut short still leaves its figures
        peak = f"{row['peak_gib']:.2f} GiB peak" if row["peak_gib"] is not None else "-"
        print(
            f"{name}: first step {row['first_step_s']:.1f} s, {row['step_ms']:.2f} ms/step, "
            f"{row['tokens_per_s']:,.0f} tokens/s, {peak}",
            flush=True,
        )
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the finished recipe's model and optimizer are gone

    probe = TrainConfig(model=args.model)
    mcfg = build.build_model_config(probe)
    tokens = args.batch_size * (args.seq_len or mcfg.seq_len)
    ceiling = (
        harness.gemm_tflops(tokens, mcfg.ffn_dim, mcfg.dim, device)
        if device.type == "cuda"
        else None
    )
    base = next(r for r in rows if r["recipe"] == "bf16")
    for row in rows:
        row["vs_bf16"] = row["step_ms"] / base["step_ms"]
        if row["peak_gib"] is not None and base["peak_gib"]:
            row["mem_vs_bf16"] = row["peak_gib"] / base["peak_gib"]
        if ceiling:
            row["pct_gemm"] = 100 * row["tflops"] / ceiling
    print(
        f"model {args.model}, {args.batch_size} x {args.seq_len or mcfg.seq_len} tokens per step, "
        f"compile={args.compile}; BF16 GEMM ceiling {tokens}x{mcfg.ffn_dim}x{mcfg.dim}: "
        + (f"{ceiling:.0f} TFLOP/s" if ceiling else "-")
    )
    harness.print_table(
        rows,
        [
            "recipe",
            "compile",
            "first_step_s",
            "step_ms",
            "tokens_per_s",
            "vs_bf16",
            "tflops",
            "pct_gemm",
            "peak_gib",
            "mem_vs_bf16",
        ],
    )
    if args.json:
        record = {
            "banner": info,
            "model": args.model,
            "batch_size": args.batch_size,
            "gemm_ceiling_tflops": ceiling,
            "rows": rows,
        }
        harness.write_json(args.json, record)
    if not all(math.isfinite(r["step_ms"]) for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
