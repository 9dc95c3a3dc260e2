"""Host microseconds of one quantized linear layer's forward + backward, and where they go.

Under FSDP2 the quantized step is host-bound (docs/DISTRIBUTED.md, "Two-GPU measurements"):
the host, not the GPU, sets its pace, and most of the host's time is the Python between a
layer's call and its kernel launches. This script measures that per layer, at a shape whose
GPU work is small, so that back-to-back iterations without synchronization time the host:

- `linear`: `bs.linear` forward + backward with an FP32 master weight under BF16 autocast
  (one GPU without FSDP), and with a `QuantizedWeight` as FSDP2's quantized all-gather hands
  the layer (`fsdp`), against `F.linear` in BF16;
- `hooks`: FSDP2's per-weight all-gather hooks (`fsdp_pre_all_gather` on a one-rank mesh, so
  no all-reduce, then `fsdp_post_all_gather` into the existing weight), cache on and off;
- `--profile`: a cProfile of each case, the functions with the most own time.

Last, each case's host time as a multiple of BF16's `F.linear` (issue 62's goal: at most 2x for
nvfp4 with an FP32 master under autocast). On the CPU the cases run the reference path, so
there the figures say nothing of a GPU host; `host_cpu.py` is the CPU's proxy.

    python benchmarks/research/host_linear.py --out /tmp/host.json --profile
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, from anywhere

import harness  # noqa: E402

import blockscale as bs  # noqa: E402
from blockscale.distributed.fsdp import GatherLayout  # noqa: E402
from blockscale.kernels import _launch  # noqa: E402
from blockscale.ops.weight_cache import WeightCache  # noqa: E402


def profiled(fn, reps: int, top: int) -> str:
    for _ in range(2):
        fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(reps):
        fn()
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text).strip_dirs()
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return text.getvalue()


def op_profile(fn, reps: int, top: int) -> str:
    """The torch profiler's host-side table of `reps` calls: each op's own host time (and the
    CUDA runtime calls it makes), where cProfile sees only Python functions."""
    for _ in range(2):
        fn()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            fn()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)
    return f"{reps} calls\n{table}"


def gathered_weight(layer: torch.nn.Module, dtype: torch.dtype):
    """The QuantizedWeight FSDP2's quantized all-gather gives `layer` on one rank."""
    weight = layer.weight.detach()
    layout = GatherLayout.for_layer(layer, weight.shape, 1)
    amax = weight.abs().amax().float() if layout.needs_amax else None
    inputs = layout.inputs(weight, amax)
    q, _ = layout.assemble(tuple(inputs), amax, dtype)
    return q


def linear_cases(recipe_name: str, m: int, k: int, n: int, device: torch.device) -> dict:
    torch.manual_seed(0)
    base = torch.nn.Linear(k, n, bias=False, device=device)
    x = torch.randn(m, k, device=device, requires_grad=True)
    grad = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    cases = {}
    if recipe_name == "bf16":

        def plain() -> None:
            with torch.autocast(device.type, torch.bfloat16):
                out = F.linear(x, base.weight)
            out.backward(grad)

        cases["bf16 F.linear, autocast"] = plain
        return cases
    recipe = bs.recipes.get(recipe_name)
    layer = bs.convert(torch.nn.Sequential(base), recipe)[0]
    layer.weight_cache = None  # every call quantizes, as without the cache

    def master() -> None:
        with torch.autocast(device.type, torch.bfloat16):
            out = layer(x)
        out.backward(grad)

    cases[f"{recipe_name} FP32 master, autocast"] = master
    q = gathered_weight(layer, torch.bfloat16)
    q.requires_grad_(True)
    xb = x.detach().bfloat16().requires_grad_(True)

    def fsdp() -> None:
        out = bs.linear(xb, q, None, recipe)
        out.backward(grad)

    cases[f"{recipe_name} QuantizedWeight (FSDP2), bf16"] = fsdp
    # a copy of its own: the hooks' cache must not serve the FP32 master case's calls
    cases.update(hook_cases(recipe_name, copy.deepcopy(layer), device))
    return cases


def hook_cases(recipe_name: str, layer: torch.nn.Module, device: torch.device) -> dict:
    """FSDP2's two all-gather hooks of one weight on a one-rank mesh (no collective): the
    first gather after an optimizer step (the cache misses: amax and quantization) and a
    re-gather (the backward's: from the cache), each followed by the post hook writing into
    the unsharded weight, as FSDP2 calls them."""
    import torch.distributed as dist  # noqa: PLC0415
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=0, world_size=1, store=dist.HashStore())
    mesh = init_device_mesh(device.type, (1,))
    layer.weight_cache = WeightCache()
    shard = bs.distributed.ShardedWeight(layer.weight.detach().clone())
    size, stride = shard.shape, shard.stride()
    inputs, meta = shard.fsdp_pre_all_gather(mesh, size, stride, layer, None)
    unsharded, _ = shard.fsdp_post_all_gather(inputs, meta, torch.bfloat16)

    def gather(miss: bool):
        def run() -> None:
            if miss:
                layer.weight_cache.clear()
            inputs, meta = shard.fsdp_pre_all_gather(mesh, size, stride, layer, None)
            shard.fsdp_post_all_gather(inputs, meta, torch.bfloat16, out=unsharded)

        return run

    return {
        f"{recipe_name} hooks, first gather of a step": gather(True),
        f"{recipe_name} hooks, re-gather (cached)": gather(False),
    }


def main(argv: list[str] | None = None) -> int:
    parser = harness.add_common_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    parser.add_argument("--shape", default="512,4096,4096", help="M,K,N")
    parser.add_argument("--recipes", default="bf16,nvfp4,mxfp8")
    parser.add_argument("--profile", action="store_true", help="cProfile each case")
    parser.add_argument(
        "--ops", action="store_true", help="torch.profiler: each case's ops by own host time"
    )
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument(
        "--launch", default="fast", help="fast, triton or both: kernels/_launch.py's FAST_LAUNCH"
    )
    args = parser.parse_args(argv)
    device = harness.pick_device(args.device)
    reps = args.reps or 100
    m, k, n = (int(v) for v in args.shape.split(","))
    record = {"benchmark": "host_linear", "banner": harness.banner(device), "rows": []}
    profiles = {}
    modes = ["fast", "triton"] if args.launch == "both" else [args.launch]
    for name in args.recipes.split(","):
        for case, fn in linear_cases(name, m, k, n, device).items():
            for mode in modes:
                _launch.FAST_LAUNCH = mode == "fast"
                us = harness.host_us(fn, reps, device)
                row = {"case": case, "launch": mode, "shape": args.shape, "host_us": us}
                record["rows"].append(row)
                print(f"{case:48s} {mode:7s} {us:9.1f} us", flush=True)
                if args.profile and mode == modes[0]:
                    profiles[case] = profiled(fn, max(10, reps // 4), args.top)
                if args.ops and mode == modes[0]:
                    profiles[f"{case} (ops)"] = op_profile(fn, max(10, reps // 4), args.top)
    bf16 = {r["launch"]: r["host_us"] for r in record["rows"] if r["case"].startswith("bf16")}
    if bf16:  # issue 62's goal: a quantized layer's host time at most 2x BF16's F.linear
        print("\nhost time against BF16's F.linear (forward + backward):")
        for row in record["rows"]:
            row["vs_bf16"] = row["host_us"] / bf16[row["launch"]]
            print(f"{row['case']:48s} {row['launch']:7s} {row['vs_bf16']:6.2f}x")
    if profiles:
        for case, text in profiles.items():
            print(f"\n=== {case}\n{text}")
    if args.json:
        harness.write_json(args.json, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
