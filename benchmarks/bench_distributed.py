"""Measurements for docs/DISTRIBUTED.md, on local ranks (gloo on the CPU, NCCL with --cuda).

    python benchmarks/bench_distributed.py bytes --model tiny     # all-gather bytes per step
    python benchmarks/bench_distributed.py cast --model 1b --cuda --ranks 1   # partial cast per call
    TRITON_INTERPRET=1 python benchmarks/bench_distributed.py cast --model tiny --ranks 1  # CPU check

`bytes`: one FSDP2 training step of the named model (every block and the root fully_shard-ed,
the nvfp4 recipe on every linear), counting the bytes each rank receives at the all-gathers,
for FP32 and BF16 parameters (plain FSDP) and for quantized all-gather with either.
`cast`: the weights of the named model's linears as flat FP32 masters cut into equal slices
(shifted one element, so every cut is odd; the shards are views of each rank's one buffer),
timing `cast_master_weights_to_nvfp4` per call on each rank through the kernels and through
the PyTorch reference, side by side (harness.time_host_and_device): the host time to issue a
call and, on CUDA, the device time with every launch queued; the reference synchronizes once
(its tiles-per-weight copy), so its device time includes host time. Also whether both paths
wrote the same bits, and a one-process cast of the whole weights (quantize_operand per weight:
the kernels on CUDA) beside them. `--ranks 1` works on one GPU (NCCL) or CPU (gloo). On the
CPU the kernel path runs only under TRITON_INTERPRET=1 (Triton's interpreter: a check that it
runs and matches, not a timing).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script from anywhere

import harness  # noqa: E402

from blockscale import _library  # noqa: E402
from blockscale import nn as bsnn  # noqa: E402
from blockscale.distributed import (  # noqa: E402
    cast_master_weights_to_nvfp4,
    enable_quantized_all_gather,
)
from blockscale.distributed.launch import run_local  # noqa: E402
from blockscale.formats import nvfp4  # noqa: E402
from blockscale.models import build_model, model_config  # noqa: E402
from blockscale.recipes import nvfp4 as nvfp4_recipe  # noqa: E402


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


def _cast_worker(
    rank: int, world_size: int, model_name: str, warmup: int, reps: int, out_path: str
) -> None:
    device = _device()
    shapes = _linear_shapes(model_name)
    g = torch.Generator(device=device).manual_seed(0)
    sizes = [s.numel() for s in shapes]
    total = sum(sizes)
    cuts = [0, *[min(total, r * (total // world_size) + 1) for r in range(1, world_size)], total]
    lo, hi = cuts[rank], cuts[rank + 1]
    mine = torch.randn(hi - lo, generator=g, device=device)

    def targets() -> list[nvfp4.NVFP4Tensor]:
        return [
            nvfp4.NVFP4Tensor(
                torch.zeros(r, c // 2, dtype=torch.uint8, device=device),
                torch.zeros(r, c // 16, dtype=torch.float8_e4m3fn, device=device),
                torch.zeros((), device=device),
                torch.Size((r, c)),
                "16x16",
            )
            for r, c in shapes
        ]

    # the shards are views of this rank's one buffer, as a distributed optimizer's (the kernels
    # read them in place)
    shards, offsets, base = [], [], 0
    for n in sizes:
        a, b = max(lo, base), min(hi, base + n)
        shards.append(mine[a - lo : b - lo] if b > a else None)
        offsets.append(max(a - base, 0))
        base += n

    # The library's switch, as the tests flip it: CUDA tensors take the kernels, CPU tensors
    # the reference; on the CPU the kernels run only in Triton's interpreter (a check that the
    # path runs, not a kernel timing).
    paths = ["kernels", "reference"]
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        paths = ["reference"]
    results, outputs = {}, {}
    for path in paths:
        _library.use_kernels = lambda t, on=path == "kernels": on
        out = targets()
        host, dev = harness.time_host_and_device(
            lambda out=out: cast_master_weights_to_nvfp4(out, shards, offsets),
            warmup=warmup, reps=reps, device=device, before=dist.barrier,
        )  # fmt: skip
        outputs[path] = out
        row = torch.tensor(
            [host.median_ms, host.p20_ms, host.p80_ms, dev.median_ms if dev else float("nan")],
            dtype=torch.float64,
            device=device,
        )
        gathered = [torch.zeros_like(row) for _ in range(world_size)]
        dist.all_gather(gathered, row)
        results[path] = [t.tolist() for t in gathered]
    same = None
    if len(paths) == 2:
        same = all(
            torch.equal(k.data, r.data)
            and torch.equal(k.scale.view(torch.uint8), r.scale.view(torch.uint8))
            and torch.equal(k.amax, r.amax)
            for k, r in zip(outputs["kernels"], outputs["reference"], strict=True)
        )
    if rank == 0:
        from blockscale.ops.quantize import quantize_operand  # noqa: PLC0415
        from blockscale.recipes import Format, OperandConfig  # noqa: PLC0415

        config = OperandConfig(Format.NVFP4, "16x16")
        full = [torch.randn(s, generator=g, device=device) for s in shapes]
        one_host, one_dev = harness.time_host_and_device(
            lambda: [quantize_operand(w, config) for w in full],
            warmup=1, reps=max(1, reps // 2), device=device,
        )  # fmt: skip
        with open(out_path, "w") as f:
            json.dump(
                {
                    "params": total,
                    "weights": len(shapes),
                    "backend": dist.get_backend(),
                    "per_rank_host_median_p20_p80_device_ms": results,
                    "kernels_equal_reference": same,
                    "one_process_full_cast_host_device_ms": [
                        one_host.median_ms,
                        one_dev.median_ms if one_dev else None,
                    ],
                },
                f,
            )


def _print_cast(record: dict) -> None:
    rows = []
    for path, ranks in record["per_rank_host_median_p20_p80_device_ms"].items():
        slowest = max(ranks, key=lambda r: r[0])
        device_ms = max(r[3] for r in ranks)
        rows.append(
            {
                "path": path,
                "host ms (slowest rank)": slowest[0],
                "host p20-p80": f"{harness.fmt(slowest[1])}-{harness.fmt(slowest[2])}",
                "device ms (slowest rank)": None if device_ms != device_ms else device_ms,
            }
        )
    one_host, one_dev = record["one_process_full_cast_host_device_ms"]
    rows.append(
        {
            "path": "one process, whole weights (quantize_operand per weight)",
            "host ms (slowest rank)": one_host,
            "device ms (slowest rank)": one_dev,
        }
    )
    print(
        f"cast_master_weights_to_nvfp4, {record['model']}: {record['weights']} weights, "
        f"{record['params']} params, {record['ranks']} rank(s) over {record['backend']}; "
        f"kernels equal reference: {record['kernels_equal_reference']}"
    )
    harness.print_table(
        rows, ["path", "host ms (slowest rank)", "host p20-p80", "device ms (slowest rank)"]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=("bytes", "cast"))
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5, help="cast: timed calls per path")
    parser.add_argument("--warmup", type=int, default=2, help="cast: untimed calls per path")
    parser.add_argument("--cuda", action="store_true")
    parser.add_argument("--json", metavar="PATH", help="cast: also write the results as JSON")
    args = parser.parse_args()
    device = "cuda" if args.cuda else "cpu"
    out = os.path.join(tempfile.mkdtemp(), "result.json")
    if args.what == "bytes":
        run_local(_bytes_worker, args.ranks, args.model, out, device=device)
        with open(out) as f:
            print(json.dumps({"model": args.model, "ranks": args.ranks, **json.load(f)}, indent=1))
        return
    info = harness.banner(torch.device("cuda" if args.cuda else "cpu"))
    run_local(_cast_worker, args.ranks, args.model, args.warmup, args.repeats, out, device=device)
    with open(out) as f:
        record = {"model": args.model, "ranks": args.ranks, **json.load(f)}
    _print_cast(record)
    if args.json:
        harness.write_json(args.json, {"banner": info, **record})


if __name__ == "__main__":
    main()
