"""Measurements for docs/DISTRIBUTED.md, on local ranks (gloo on the CPU, NCCL with --cuda).

    python benchmarks/bench_distributed.py bytes --model tiny     # all-gather bytes per step
    python benchmarks/bench_distributed.py cast --model 1b        # partial cast time per call

`bytes`: one FSDP2 training step of the named model (every block and the root fully_shard-ed,
the nvfp4 recipe on every linear), counting the bytes each rank receives at the all-gathers,
for FP32 and BF16 parameters (plain FSDP) and for quantized all-gather with either.
`cast`: the weights of the named model's linears as flat FP32 masters cut into equal slices
(shifted one element, so every cut is odd), timing `cast_master_weights_to_nvfp4` per call on
each rank, and a one-process cast of the whole weights (formats/ or the kernels) beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from blockscale import nn as bsnn
from blockscale.distributed import cast_master_weights_to_nvfp4, enable_quantized_all_gather
from blockscale.distributed.launch import run_local
from blockscale.formats import nvfp4
from blockscale.models import build_model, model_config
from blockscale.recipes import nvfp4 as nvfp4_recipe


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _bytes_worker(rank: int, world_size: int, model_name: str, out_path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard  # noqa: PLC0415
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather  # noqa: PLC0415

    class Counting(AllGather):
        def __init__(self) -> None:
            self.bytes = 0

        def allocate(self, size, *, dtype, device):
            return torch.empty(size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            self.bytes += output_tensor.numel() * output_tensor.element_size()
            return dist.all_gather_into_tensor(
                output_tensor, input_tensor, group, async_op=async_op
            )

    device = _device()
    cfg = model_config(model_name)
    tokens = torch.randint(0, cfg.vocab_size, (1, 65), device=device)
    result = {}
    for label, mp, quantized in (
        ("fp32", False, False),
        ("bf16", True, False),
        ("nvfp4 (fp32 shards)", False, True),
        ("nvfp4 (bf16 mixed precision)", True, True),
    ):
        torch.manual_seed(0)
        model = build_model(cfg).to(device)
        bsnn.convert(model, nvfp4_recipe())
        if quantized:
            enable_quantized_all_gather(model)
        mesh = init_device_mesh(device.type, (world_size,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if mp else None)
        for block in model.layers:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        counter = Counting()
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_custom_all_gather(counter)
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
        result[label] = counter.bytes
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)


def _linear_shapes(model_name: str) -> list[torch.Size]:
    with torch.device("meta"):
        model = build_model(model_config(model_name))
    return [m.weight.shape for m in model.modules() if isinstance(m, nn.Linear)]


def _cast_worker(rank: int, world_size: int, model_name: str, repeats: int, out_path: str) -> None:
    device = _device()
    shapes = _linear_shapes(model_name)
    g = torch.Generator(device=device).manual_seed(0)
    sizes = [s.numel() for s in shapes]
    total = sum(sizes)
    cuts = [0, *[min(total, r * (total // world_size) + 1) for r in range(1, world_size)], total]
    lo, hi = cuts[rank], cuts[rank + 1]
    mine = torch.randn(hi - lo, generator=g, device=device)
    targets = [
        nvfp4.NVFP4Tensor(
            torch.zeros(r, c // 2, dtype=torch.uint8, device=device),
            torch.zeros(r, c // 16, dtype=torch.float8_e4m3fn, device=device),
            torch.zeros((), device=device),
            torch.Size((r, c)),
            "16x16",
        )
        for r, c in shapes
    ]
    shards, offsets, base = [], [], 0
    for n in sizes:
        a, b = max(lo, base), min(hi, base + n)
        shards.append(mine[a - lo : b - lo] if b > a else None)
        offsets.append(max(a - base, 0))
        base += n

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    cast_master_weights_to_nvfp4(targets, shards, offsets)  # warm-up
    times = []
    for _ in range(repeats):
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        cast_master_weights_to_nvfp4(targets, shards, offsets)
        sync()
        times.append(time.perf_counter() - t0)
    out = torch.tensor([min(times), sum(times) / len(times)], dtype=torch.float64)
    gathered = [torch.zeros_like(out) for _ in range(world_size)]
    dist.all_gather(gathered, out)
    if rank == 0:
        from blockscale.ops.quantize import quantize_operand  # noqa: PLC0415
        from blockscale.recipes import Format, OperandConfig  # noqa: PLC0415

        config = OperandConfig(Format.NVFP4, "16x16")
        full = [torch.randn(s, generator=g, device=device) for s in shapes]
        sync()
        t0 = time.perf_counter()
        for w in full:
            quantize_operand(w, config)
        sync()
        one = time.perf_counter() - t0
        with open(out_path, "w") as f:
            json.dump(
                {
                    "params": total,
                    "weights": len(shapes),
                    "per_rank_min_mean_s": [t.tolist() for t in gathered],
                    "one_process_full_cast_s": one,
                },
                f,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=("bytes", "cast"))
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cuda", action="store_true")
    args = parser.parse_args()
    device = "cuda" if args.cuda else "cpu"
    out = os.path.join(tempfile.mkdtemp(), "result.json")
    if args.what == "bytes":
        run_local(_bytes_worker, args.ranks, args.model, out, device=device)
    else:
        run_local(_cast_worker, args.ranks, args.model, args.repeats, out, device=device)
    with open(out) as f:
        print(json.dumps({"model": args.model, "ranks": args.ranks, **json.load(f)}, indent=1))


if __name__ == "__main__":
    main()
