"""What the weight cache gains: one optimizer step of G micro-batches with the cache off, with
the default scope ("forward": copies reused within a forward and its backward) and with the
opt-in "step" scope (reused across the micro-batches until the optimizer step), in one process.

The cache's scope decides what it can save (ops/weight_cache.py): "forward" saves NVFP4's
16x16 weight copy in the backward (one weight quantization a layer a micro-batch); "step" also
saves every later micro-batch's copies. Compiled graphs never use the cache (a trace computes
its quantizations), so a compiled row measures that the settings cost the same.

Models: bench_model.py's dense ones (transformers Llama: llama-1b, llama-tiny) and
bench_moe_model.py's MoE ones (qwen3-30b-a3b, mixtral, ..., qwen3-tiny), converted as the
README says (`layer_policy(model)`), FP32 masters, BF16 autocast on CUDA, fused AdamW. The
settings take turns in rounds (--rounds), each timing --steps optimizer steps with
harness.time_fn after one warm-up step, so drift in the machine falls on all of them alike;
the row reports each setting's median over rounds and its ratio to "off".

    python benchmarks/bench_weight_cache.py --models llama-1b,qwen3-30b-a3b --recipes nvfp4,mxfp8 \\
        --grad-accum 1,4 --batch-size 2 --out out/weight_cache.json
    python benchmarks/bench_weight_cache.py --smoke      # CPU, tiny models, eager
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_model  # noqa: E402
import bench_moe_model  # noqa: E402
import harness  # noqa: E402

from blockscale import nn as bsnn  # noqa: E402
from blockscale import recipes  # noqa: E402

SETTINGS = ("off", "forward", "step")


def build(name: str, recipe: str, seq_len: int, device: torch.device) -> tuple[Any, int]:
    """The converted model (README's call) and its vocabulary size."""
    if name in bench_model.MODELS:
        model, vocab = bench_model.build(bench_model.MODELS[name], None, seq_len, device)
        bsnn.convert(model, recipes.get(recipe), module_filter_fn=bsnn.layer_policy(model))
        return model, vocab
    spec = bench_moe_model.MODELS[name]
    model = bench_moe_model.build(spec, recipe, seq_len, device, bf16_tail_fraction=0.15)
    return model, spec.fields["vocab_size"]


def set_cache(model: torch.nn.Module, setting: str) -> None:
    if setting == "off":
        bsnn.set_weight_cache(model, False)
    else:
        bsnn.set_weight_cache(model, True, scope=setting)


def make_step(model, optimizer, forward, device, micro_batches: list[torch.Tensor]):
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step() -> None:
        for tokens in micro_batches:
            with autocast:
                logits = bench_model.logits_of(forward, tokens[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
            (loss / len(micro_batches)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def run_row(name: str, recipe: str, mode: str, accum: int, args, device) -> dict[str, Any]:
    row: dict[str, Any] = {"model": name, "recipe": recipe, "mode": mode, "grad_accum": accum}
    model, vocab = build(name, recipe, args.seq_len, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    forward = torch.compile(model) if mode == "compile" else model
    gen = torch.Generator().manual_seed(1)
    shape = (args.batch_size, args.seq_len + 1)
    batches = [torch.randint(0, vocab, shape, generator=gen).to(device) for _ in range(accum)]
    step = make_step(model, optimizer, forward, device, batches)
    times: dict[str, list[float]] = {s: [] for s in SETTINGS}
    for _ in range(args.rounds):
        for setting in SETTINGS:
            set_cache(model, setting)
            timing = harness.time_fn(step, warmup=1, reps=args.steps, device=device)
            times[setting].append(timing.median_ms)
    off = statistics.median(times["off"])
    for setting in SETTINGS:
        ms = statistics.median(times[setting])
        row[f"{setting}_ms"] = ms
        row[f"{setting}_vs_off"] = off / ms
    tokens = accum * args.batch_size * args.seq_len
    row["tokens"] = tokens
    del model, optimizer, forward, step
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama-1b,qwen3-30b-a3b")
    parser.add_argument("--recipes", default="nvfp4,mxfp8")
    parser.add_argument("--modes", default="eager", help="eager, compile or both (comma list)")
    parser.add_argument("--grad-accum", default="1,4", help="micro-batches a step (comma list)")
    parser.add_argument("--batch-size", type=int, default=2, help="sequences a micro-batch")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="timed steps a setting a round")
    parser.add_argument("--device", default=None)
    parser.add_argument("--smoke", action="store_true", help="CPU-sized models, one round")
    parser.add_argument("--out", metavar="PATH", help="write the rows as JSON")
    args = parser.parse_args(argv)
    if args.smoke:
        args.models, args.recipes, args.grad_accum = "llama-tiny,qwen3-tiny", "nvfp4", "1,2"
        args.seq_len, args.rounds, args.steps = 32, 1, 2
    device = harness.pick_device(args.device)
    info = harness.banner(device)
    rows = []
    for name in args.models.split(","):
        for recipe in args.recipes.split(","):
            for mode in args.modes.split(","):
                for accum in map(int, args.grad_accum.split(",")):
                    rows.append(run_row(name, recipe, mode, accum, args, device))
                    print(rows[-1], flush=True)
                    if args.out:
                        harness.write_json(args.out, {"benchmark": "weight_cache", "banner": info,
                                                      "argv": argv or sys.argv[1:], "rows": rows})  # fmt: skip
    harness.print_table(rows, ["model", "recipe", "mode", "grad_accum", "tokens", "off_ms",
                               "forward_ms", "step_ms", "forward_vs_off", "step_vs_off"])  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
