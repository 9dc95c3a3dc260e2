"""Where a training step of transformers Llama under FSDP2 spends its time, per recipe.

Measured on two H200s (docs/DISTRIBUTED.md, "Two-GPU measurements"): under FSDP2 with quantized
all-gather, nvfp4 adds about 300 ms to the 1B shape's step whatever the batch and on one rank
too, where one GPU without FSDP adds a fraction of that. This script is the first look: the
user's FSDP2 setup of `bench_distributed.py`'s `hf` part (fully_shard per decoder layer and
the root, MixedPrecisionPolicy(bf16, fp32), FP32 masters, fused AdamW, eager), a few warm-up
steps, then one profiled step per recipe. Rank 0 prints, per recipe:

- the step's wall time, and the time the GPU was busy (sum of kernel time on the compute
  stream is not separated from the others: `cuda_total` is over every stream);
- the operators with the most self device time, and those with the most self host time
  (a host-bound step shows host time near the wall time);
  Both tables count calls: FSDP's own ranges (`FSDP::...`) and blockscale's library ops
  (`blockscale::...`) are operators there.

A Chrome trace per recipe is written to --out (open in chrome://tracing or Perfetto).

    python benchmarks/research/profile_fsdp.py --ranks 2 --shape llama-1b --out /tmp/prof
    python benchmarks/research/profile_fsdp.py --ranks 2 --shape llama-tiny --cpu   # CPU check
    python benchmarks/research/profile_fsdp.py --ranks 0 ...   # one device, no FSDP (autocast)
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, from anywhere

from bench_distributed import HF_SHAPES, hf_llama_under_fsdp, hf_step, hf_tokens  # noqa: E402

from blockscale.distributed.launch import run_local  # noqa: E402


def _worker(rank: int, world: int, shape: str, recipes: list[str], batch: int, seq: int,
            warmup: int, out: str, fsdp: bool, python: bool) -> None:  # fmt: skip
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mesh = init_device_mesh(device.type, (world,)) if fsdp else None
    config, tokens = hf_tokens(shape, batch, seq, rank, device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    activities += [torch.profiler.ProfilerActivity.CUDA] if cuda else []
    for recipe in recipes:
        model, opt, _ = hf_llama_under_fsdp(config, recipe, False, mesh, device)
        for _ in range(warmup):
            hf_step(model, opt, tokens, autocast=not fsdp)
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        if python:  # where the host's Python time goes, per function
            profiler = cProfile.Profile()
            profiler.enable()
            hf_step(model, opt, tokens, autocast=not fsdp)
            if cuda:
                torch.cuda.synchronize()
            profiler.disable()
            if rank == 0:
                print(f"\n=== {recipe}: Python functions, one step (cProfile)")
                stats = pstats.Stats(profiler).strip_dirs()
                stats.sort_stats("tottime").print_stats(35)
                stats.sort_stats("cumulative").print_stats(45)
            del model, opt
            dist.barrier()
            continue
        with torch.profiler.profile(activities=activities) as prof:
            start = time.perf_counter()
            hf_step(model, opt, tokens, autocast=not fsdp)
            if cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - start
        if rank == 0:
            _report(recipe, wall, prof, cuda)
            ranks = f"{world}ranks" if fsdp else "nofsdp"
            prof.export_chrome_trace(str(Path(out) / f"trace_{shape}_{ranks}_{recipe}.json"))
        del model, opt
        if cuda:
            torch.cuda.empty_cache()
        dist.barrier()


def _report(recipe: str, wall: float, prof, cuda: bool) -> None:
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events) if cuda else 0.0
    host_us = sum(e.self_cpu_time_total for e in events)
    print(f"\n=== {recipe}: step {1000 * wall:.1f} ms wall; device busy (all streams, summed) "
          f"{device_us / 1000:.1f} ms; host self time {host_us / 1000:.1f} ms")  # fmt: skip
    if cuda:
        print(
            events.table(sort_by="self_device_time_total", row_limit=20, max_name_column_width=70)
        )
    print(events.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=70))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="llama-1b", choices=sorted(HF_SHAPES))
    parser.add_argument("--ranks", type=int, default=2, help="0: one device without FSDP")
    parser.add_argument("--recipes", default="bf16,nvfp4")
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--cpu", action="store_true", help="gloo ranks on the CPU (a check)")
    parser.add_argument(
        "--python", action="store_true", help="cProfile one step instead (host Python time)"
    )
    parser.add_argument("--out", default=".", help="folder for the Chrome traces")
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    run_local(_worker, max(args.ranks, 1), args.shape, args.recipes.split(","), args.batch, args.seq,
              args.warmup, args.out, args.ranks > 0, args.python,
              device="cpu" if args.cpu else "cuda")  # fmt: skip


if __name__ == "__main__":
    main()
