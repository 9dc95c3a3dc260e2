"""Measurements for docs/DISTRIBUTED.md, on local ranks (gloo on the CPU, NCCL with --cuda).

    python benchmarks/bench_distributed.py suite --json docs/results/distributed_2gpu.json  # 2 GPUs
    python benchmarks/bench_distributed.py suite --smoke      # the same on CPU ranks, tiny sizes
    python benchmarks/bench_distributed.py bytes --model tiny     # all-gather bytes per step
    python benchmarks/bench_distributed.py cast --model 1b --cuda --ranks 1   # partial cast per call
    TRITON_INTERPRET=1 python benchmarks/bench_distributed.py cast --model tiny --ranks 1  # CPU check

`suite`: everything issue 34's "Measure" asks of two GPUs, in one command that writes one JSON
(after every part, so a run cut short keeps what it measured) and prints short tables. Parts
(`--parts`, in this order; `--budget-s` skips the parts that would start after it):
- `train`: `torchrun --nproc-per-node 2 -m blockscale train --fsdp` against one process with
  `--grad-accum 2` (the same global batch), per recipe (bf16, nvfp4, mxfp8), stochastic
  rounding off and `--grad-clip 0`: tokens/s, step time, peak memory (rank 0's) and whether
  the loss rows are equal bit for bit (on CUDA they need not be: attention's backward sums
  in a varying order).
- `exact`: the same `--fsdp` comparison, short, with `--deterministic` (train/loop.py): there
  the loss rows must be equal bit for bit on CUDA too.
- `tp`, `ep`: `--tp` (`small`, the ranks share one batch; one process with the same flags) and
  `--ep` (`moe-small`, `--aux-loss-coef 0`; one process with `--grad-accum 2`), nvfp4 without
  stochastic rounding: the same columns, and the largest relative loss difference.
- `sr`: nvfp4 as trained (stochastic rounding, clipping): 2 ranks against one process with
  the same seed, and one process with another seed (the seed-to-seed noise): mean and largest
  |loss difference| of each pair over the rows.
- `cast`: `cast_master_weights_to_nvfp4` per call on the ranks for blockscale's `1b` model.
- `hf`: transformers Llama at the 1B and 8B (8 layers) shapes, the user's FSDP2 (fully_shard
  per decoder layer and the root, MixedPrecisionPolicy(bf16, reduce fp32), FP32 masters,
  fused AdamW), converted with `layer_policy` (head, embeddings, last block in BF16) or not
  (bf16), eager and with each decoder layer compiled: tokens/s and peak memory per GPU as
  ratios to BF16 in the same call, and the bytes all-gathered per step counted at the
  collectives (one counting AllGather per FSDP module, installed after the timed steps), in
  total and for the groups of the converted blocks alone. `--hf-ranks 1,2` adds FSDP2 on one
  GPU; `0` adds one GPU without FSDP (FP32 masters under BF16 autocast, the same per-GPU batch
  and mode): the one-GPU ratios the FSDP2 rows are to match.
  A (mode, recipe) that fails is a row with its error; the others still run.

A failed run's rows carry its exception lines (`error`); each train run's whole stderr is kept
in `<json stem>_stderr/` beside `--json`.

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
import gc
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
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
        counter = _counting_all_gather()
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


# --------------------------------------------------------------------------- suite

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("train", "exact", "tp", "ep", "sr", "cast", "hf")
HF_SHAPES = {  # transformers LlamaConfig fields (Llama 3.2 1B; Llama 3.1 8B cut to 8 layers)
    "llama-1b": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True,
    ),
    "llama-8b-8l": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=8, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256,
    ),
    "llama-tiny": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=256,
    ),
}  # fmt: skip


@dataclass(frozen=True)
class SuiteSizes:
    model: str  # --fsdp, --tp and the cast
    moe_model: str  # --ep
    steps: int
    exact_steps: int  # the `exact` part's deterministic runs
    train_flags: tuple[str, ...]  # batch and sequence flags of every train run
    hf_models: tuple[str, ...]
    hf_batch: int  # sequences per rank
    hf_seq: int
    hf_warmup: int
    hf_steps: int
    cast_model: str
    cast_repeats: int
    recipes: tuple[str, ...] = ("bf16", "nvfp4", "mxfp8")
    hf_modes: tuple[str, ...] = ("eager", "compiled")
    run_flags: tuple[str, ...] = field(
        default=("--quiet", "--log-every", "1", "--eval-every", "0", "--telemetry-every", "0")
    )


FULL = SuiteSizes(
    "small", "moe-small", 30, 6, ("--batch-size", "16"), ("llama-1b", "llama-8b-8l"), 2, 2048, 3,
    6, "1b", 10,
)  # fmt: skip
SMOKE = SuiteSizes(
    "tiny", "moe-tiny", 3, 3, ("--batch-size", "2", "--seq-len", "32", "--max-data-bytes", "50000"),
    ("llama-tiny",), 1, 32, 1, 2, "tiny", 2,
)  # fmt: skip


def _launch_train(out: Path, ranks: int, mode: str | None, flags: list[str], cpu: bool) -> dict:
    """One `blockscale train` run (under torchrun when `mode` is a distributed flag): its loss
    rows, tokens/s (median over the steps after the first), step time and peak memory."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if cpu:
        env["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, "-m"]
    if mode is not None:
        command += ["torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), "-m"]
    command += ["blockscale", "train", *([mode] if mode else []), "--out", str(out), *flags]
    command += ["--device", "cpu"] if cpu else []
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    record: dict = {"ranks": ranks, "mode": mode, "wall_s": time.perf_counter() - start}
    (out.parent / f"{out.name}.stderr").write_text(done.stderr)  # kept whole, beside the run
    if done.returncode != 0:
        return {**record, "error": _error_text(done.stderr), "stderr": str(out) + ".stderr"}
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    tokens_per_step = summary["tokens"] / summary["steps"]
    rate = summary["tokens_per_s"]
    return {
        **record,
        "losses": [r["loss"] for r in rows if r["kind"] == "train"],
        "tokens_per_s": rate,
        "step_ms": 1000 * tokens_per_step / rate if rate else None,
        "peak_gib": summary["peak_memory_gib"],
        "device": summary["device"],
    }


def _error_text(text: str) -> str:
    """What a failed run said: every distinct exception line of its ranks' tracebacks (torchrun
    ends with its own summary, which names no cause), then the last lines."""
    found: list[str] = []
    for line in text.splitlines():
        bare = re.sub(r"^\[rank\d+\]:\s*", "", line)  # torchrun's prefix on a rank's lines
        head = bare.split(":", 1)[0].strip()
        cause = head.endswith(("Error", "Exception", "Interrupt")) or ": error:" in bare
        if cause and line not in found:
            found.append(line)
    found = [f for f in found if "ChildFailedError" not in f][:10]
    return "\n".join(found + ["--- last lines:"] + text.splitlines()[-15:])


def _first_error(row: dict) -> str:
    """The first exception line of a row's error (its own, or its runs'), or ''."""
    errors = [row.get("error")] + [row[k].get("error") for k in ("two", "one") if k in row]
    text = next((e for e in errors if e), "")
    return text.splitlines()[0][:300] if text else ""


def _compare(sharded: dict, one: dict) -> dict:
    """Loss rows and speed of a multi-rank run against one process."""
    if "error" in sharded or "error" in one:
        return {"error": sharded.get("error") or one.get("error")}
    a, b = sharded["losses"], one["losses"]
    rel = max((abs(x - y) / abs(y) for x, y in zip(a, b, strict=True)), default=0.0)
    peak = sharded["peak_gib"], one["peak_gib"]
    return {
        "losses_bit_equal": a == b,
        "max_rel_loss_diff": rel,
        "tokens_per_s_vs_one": sharded["tokens_per_s"] / one["tokens_per_s"],
        "peak_vs_one": peak[0] / peak[1] if all(peak) else None,
    }


def _suite_train(sizes: SuiteSizes, tmp: Path, cpu: bool, part: str) -> list[dict]:
    steps = sizes.exact_steps if part == "exact" else sizes.steps
    base = [*sizes.run_flags, "--steps", str(steps), *sizes.train_flags]
    if part == "exact":  # the same math summed in a fixed order on CUDA (train/loop.py)
        base.append("--deterministic")
    exact = ["--no-stochastic-rounding", "--grad-clip", "0"]
    if part in ("train", "exact"):
        cases = [  # stochastic rounding is an nvfp4 switch only
            (r, "--fsdp", sizes.model, ["--recipe", r, *(exact if r == "nvfp4" else exact[1:])],
             ["--grad-accum", "2"])
            for r in sizes.recipes
        ]  # fmt: skip
    elif part == "tp":
        cases = [("nvfp4", "--tp", sizes.model, ["--recipe", "nvfp4", *exact], [])]
    else:
        flags = ["--recipe", "nvfp4", *exact, "--aux-loss-coef", "0"]
        cases = [("nvfp4", "--ep", sizes.moe_model, flags, ["--grad-accum", "2"])]
    results = []
    for recipe, mode, model, flags, one_flags in cases:
        common = [*base, "--model", model, *flags]
        name = f"{part}-{mode[2:]}-{recipe}"
        two = _launch_train(tmp / f"{name}-2", 2, mode, common, cpu)
        one = _launch_train(tmp / f"{name}-1", 1, None, [*common, *one_flags], cpu)
        results.append(
            {"part": part, "mode": mode, "recipe": recipe, "model": model, "two": two, "one": one,
             **_compare(two, one)}
        )  # fmt: skip
    return results


def _suite_sr(sizes: SuiteSizes, tmp: Path, cpu: bool) -> list[dict]:
    """nvfp4 as trained: is 2 ranks vs one process within one process's seed-to-seed noise?"""
    common = [*sizes.run_flags, "--steps", str(sizes.steps), *sizes.train_flags]
    common += ["--model", sizes.model, "--recipe", "nvfp4"]
    two = _launch_train(tmp / "sr-2", 2, "--fsdp", common, cpu)
    one = _launch_train(tmp / "sr-1", 1, None, [*common, "--grad-accum", "2"], cpu)
    seed = _launch_train(
        tmp / "sr-1-seed1", 1, None, [*common, "--grad-accum", "2", "--seed", "1"], cpu
    )
    runs = {"two": two, "one": one, "one_seed1": seed}
    if any("error" in r for r in runs.values()):
        return [{"part": "sr", **runs}]

    def gaps(a: list[float], b: list[float]) -> dict:
        d = [abs(x - y) for x, y in zip(a[1:], b[1:], strict=True)]  # the first: before any draw
        return {"mean": sum(d) / len(d) if d else 0.0, "max": max(d, default=0.0)}

    return [
        {
            "part": "sr",
            **runs,
            "two_vs_one": gaps(two["losses"], one["losses"]),
            "seed_noise": gaps(one["losses"], seed["losses"]),
            **_compare(two, one),
        }
    ]


def _suite_cast(sizes: SuiteSizes, tmp: Path, cpu: bool) -> list[dict]:
    out = str(tmp / "cast.json")
    run_local(_cast_worker, 2, sizes.cast_model, 2, sizes.cast_repeats, out,
              device="cpu" if cpu else "cuda")  # fmt: skip
    with open(out) as f:
        return [{"part": "cast", "model": sizes.cast_model, "ranks": 2, **json.load(f)}]


def _hf_measure(
    model, opt, tokens: torch.Tensor, sizes: SuiteSizes, device, autocast: bool = False
) -> dict:
    """Warm-up steps, timed steps (the slowest rank), the peak memory (the largest), then one
    step with counting all-gathers installed (after the timing: the custom all-gather is not
    FSDP's default path)."""
    from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415

    def step() -> torch.Tensor:
        return hf_step(model, opt, tokens, autocast)

    start = time.perf_counter()
    for _ in range(sizes.hf_warmup):
        step()
    harness.synchronize(device)
    warmup_s = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(sizes.hf_steps):
        loss = step()
    harness.synchronize(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    counters = {}
    for name, m in model.named_modules():
        if isinstance(m, FSDPModule):
            counters[name] = _counting_all_gather()
            m.set_custom_all_gather(counters[name])
    step()
    row = torch.tensor([seconds, peak], dtype=torch.float64, device=device)
    dist.all_reduce(row, op=dist.ReduceOp.MAX)  # the slowest rank, the largest peak
    tokens_per_step = dist.get_world_size() * tokens[:, :-1].numel()
    return {
        "warmup_s": warmup_s,
        "step_ms": 1000 * row[0].item() / sizes.hf_steps,
        "tokens_per_s": tokens_per_step * sizes.hf_steps / row[0].item(),
        "peak_gib": row[1].item() if device.type == "cuda" else None,
        "all_gather_bytes": sum(c.bytes for c in counters.values()),
        "all_gather_bytes_by_group": {n: c.bytes for n, c in counters.items()},
        "loss": loss.item(),
    }


def hf_step(model, opt, tokens: torch.Tensor, autocast: bool = False) -> torch.Tensor:
    """One training step of a transformers causal LM on `tokens` [B, T+1]: FP32 cross-entropy,
    backward, optimizer step; returns the loss. `autocast`: the forward under BF16 autocast
    (a model without FSDP's MixedPrecisionPolicy)."""
    with torch.autocast(tokens.device.type, torch.bfloat16, enabled=autocast):
        logits = model(tokens[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def hf_tokens(shape: str, batch: int, seq: int, rank: int, device: torch.device):
    """The LlamaConfig of a HF_SHAPES entry and this rank's random tokens [batch, seq + 1]."""
    import transformers  # noqa: PLC0415

    config = transformers.LlamaConfig(
        **HF_SHAPES[shape], max_position_embeddings=max(seq, 64), attn_implementation="sdpa",
        use_cache=False,
    )  # fmt: skip
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=g)
    return config, tokens.to(device)


def hf_llama_under_fsdp(config, recipe: str, compiled: bool, mesh, device: torch.device):
    """A random transformers Llama as a user shards it: converted with `layer_policy` (unless
    bf16) and quantized all-gather enabled, then `fully_shard` per decoder layer (compiled
    first when `compiled`) and on the root with MixedPrecisionPolicy(bf16, reduce fp32), fused
    AdamW (the CPU has one too). mesh=None: the same model on one device without FSDP (FP32
    parameters; step it with autocast). `recipe` may end in ":nocache": the weight caches
    off (`set_weight_cache(model, False)`; under FSDP2 the shard is quantized at every gather
    again). Returns the model, its optimizer and the indices of its converted blocks."""
    import transformers  # noqa: PLC0415
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: PLC0415

    from blockscale import recipes  # noqa: PLC0415

    torch.manual_seed(0)
    with device:
        model = transformers.LlamaForCausalLM(config)
    converted: set[int] = set()
    recipe, _, variant = recipe.partition(":")
    if variant not in ("", "nocache"):
        raise ValueError(f"unknown recipe variant {variant!r} (known: nocache)")
    if recipe != "bf16":
        bsnn.convert(model, recipes.get(recipe), module_filter_fn=bsnn.layer_policy(model))
        if variant == "nocache":
            bsnn.set_weight_cache(model, False)
        if mesh is not None:
            enable_quantized_all_gather(model)
        converted = {
            i for i, layer in enumerate(model.model.layers)
            if any(isinstance(m, bsnn.Linear) and m.recipe.quantized for m in layer.modules())
        }  # fmt: skip
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        if compiled:
            layer.compile()
        if mesh is not None:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    if mesh is not None:
        fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    return model, opt, converted


def _hf_worker(
    rank: int, world_size: int, sizes: SuiteSizes, shape: str, out: str, fsdp: bool = True
) -> None:
    """Every (recipe, mode) of one transformers Llama shape under the user's FSDP2 (or, with
    fsdp=False, on one device without it)."""
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

    device = _device()
    mesh = init_device_mesh(device.type, (world_size,)) if fsdp else None
    config, tokens = hf_tokens(shape, sizes.hf_batch, sizes.hf_seq, rank, device)
    results = []
    for mode in sizes.hf_modes:
        for recipe in ("bf16", *(r for r in sizes.recipes if r != "bf16")):  # bf16: the base
            torch._dynamo.reset()
            model, opt, converted = hf_llama_under_fsdp(
                config, recipe, mode == "compiled", mesh, device
            )
            key = {"model": shape, "ranks": world_size, "fsdp": fsdp, "mode": mode,
                   "recipe": recipe}  # fmt: skip
            try:  # every rank runs the same code, so a compile error stops all of them alike
                row = _hf_measure(model, opt, tokens, sizes, device, autocast=not fsdp)
            except Exception:  # noqa: BLE001 (a row that failed, recorded; the rest still run)
                results.append({**key, "error": _error_text(traceback.format_exc())})
            else:
                results.append({**key, "converted_blocks": sorted(converted), **row})
            del model, opt
            # a converted model's modules hold reference cycles, so without a collection here
            # the previous row's model may still hold its memory while the next row is
            # measured, as long as Python's cyclic GC has not run (peaks then depend on when
            # it does; each row's peak is meant to be the recipe's alone)
            gc.collect()
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if rank == 0:  # after every row: a call cut short keeps the rows it measured
                with open(out, "w") as f:
                    json.dump(results, f)


def _counting_all_gather():
    """FSDP's all-gather through `dist.all_gather_into_tensor`, counting the bytes each rank
    receives (installed with `FSDPModule.set_custom_all_gather`)."""
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

    return Counting()


def _suite_hf(sizes: SuiteSizes, tmp: Path, cpu: bool, ranks: list[int]) -> list[dict]:
    rows = []
    for shape in sizes.hf_models:
        for n in ranks:  # 0: one device without FSDP
            out = str(tmp / f"hf-{shape}-{n}.json")
            try:
                run_local(_hf_worker, max(n, 1), sizes, shape, out, n > 0,
                          device="cpu" if cpu else "cuda")  # fmt: skip
            except Exception as e:  # one shape failing (memory, say) leaves the others
                rows.append({"model": shape, "ranks": n, "error": _error_text(str(e))})
            if not os.path.exists(out):
                continue
            with open(out) as f:
                found = json.load(f)
            for r in found:  # ratios to BF16 of the same shape, ranks and mode, in this call
                base = next(b for b in found if b["mode"] == r["mode"] and b["recipe"] == "bf16")
                if "error" in r or "error" in base:
                    continue
                r["tokens_per_s_vs_bf16"] = r["tokens_per_s"] / base["tokens_per_s"]
                if r["peak_gib"] and base["peak_gib"]:
                    r["peak_vs_bf16"] = r["peak_gib"] / base["peak_gib"]
                if not base["all_gather_bytes"]:  # one rank: FSDP2 gathers nothing
                    continue
                r["all_gather_vs_bf16"] = r["all_gather_bytes"] / base["all_gather_bytes"]
                if r["converted_blocks"]:  # the converted blocks' groups alone
                    groups = [f"model.layers.{i}" for i in r["converted_blocks"]]
                    mine = sum(r["all_gather_bytes_by_group"][g] for g in groups)
                    theirs = sum(base["all_gather_bytes_by_group"][g] for g in groups)
                    r["converted_blocks_all_gather_vs_bf16"] = mine / theirs
            rows += found
    return rows


def _print_suite(record: dict) -> None:
    parts = record["parts"]
    runs = [r for p in ("train", "exact", "tp", "ep") for r in parts.get(p, [])]
    if runs:
        print("\ntrain: 2 ranks against one process, the same global batch")
        harness.print_table(
            [
                {"run": f"{r['part']} {r.get('mode', '')} {r['model']} {r['recipe']}",
                 "tok/s 2 ranks": r["two"].get("tokens_per_s"),
                 "tok/s one": r["one"].get("tokens_per_s"),
                 "ratio": r.get("tokens_per_s_vs_one"),
                 "step ms 2": r["two"].get("step_ms"), "step ms one": r["one"].get("step_ms"),
                 "peak GiB 2": r["two"].get("peak_gib"), "peak GiB one": r["one"].get("peak_gib"),
                 "losses equal": r.get("losses_bit_equal", "error"),
                 "max rel diff": r.get("max_rel_loss_diff")}
                for r in runs
            ],  # fmt: skip
            ["run", "tok/s 2 ranks", "tok/s one", "ratio", "step ms 2", "step ms one",
             "peak GiB 2", "peak GiB one", "losses equal", "max rel diff"],
        )  # fmt: skip
    for r in parts.get("sr", []):
        if "seed_noise" in r:
            print(
                f"\nsr (nvfp4 as trained): |2 ranks - one| mean {harness.fmt(r['two_vs_one']['mean'])}"
                f" max {harness.fmt(r['two_vs_one']['max'])}; seed-to-seed |one - one seed 1| "
                f"mean {harness.fmt(r['seed_noise']['mean'])} max {harness.fmt(r['seed_noise']['max'])}"
            )
    for r in parts.get("cast", []):
        _print_cast(r)
    hf = [r for r in parts.get("hf", []) if "error" not in r]
    if hf:
        print("\ntransformers Llama under FSDP2 (ratios to BF16 of the same shape, ranks and mode)")
        harness.print_table(
            hf,
            ["model", "ranks", "fsdp", "mode", "recipe", "tokens_per_s", "tokens_per_s_vs_bf16",
             "peak_gib", "peak_vs_bf16", "all_gather_bytes", "all_gather_vs_bf16",
             "converted_blocks_all_gather_vs_bf16"],
        )  # fmt: skip
    failed = [(p, _first_error(r)) for p, rs in parts.items() for r in rs if _first_error(r)]
    failed += [(p, why) for p, why in record["skipped"].items()]
    for p, why in failed:
        print(f"{p}: {why}")


def suite(args: argparse.Namespace) -> dict:
    sizes = SMOKE if args.smoke else FULL
    if args.recipes:
        sizes = SuiteSizes(**{**sizes.__dict__, "recipes": tuple(args.recipes.split(","))})
    if args.hf_modes:
        sizes = SuiteSizes(**{**sizes.__dict__, "hf_modes": tuple(args.hf_modes.split(","))})
    if args.hf_batch:
        sizes = SuiteSizes(**{**sizes.__dict__, "hf_batch": args.hf_batch})
    if args.hf_models:
        sizes = SuiteSizes(**{**sizes.__dict__, "hf_models": tuple(args.hf_models.split(","))})
    cpu = not args.cuda
    wanted = args.parts.split(",") if args.parts else list(PARTS)
    unknown = sorted(set(wanted) - set(PARTS))
    if unknown:
        raise SystemExit(f"--parts: unknown {unknown}; choose from {', '.join(PARTS)}")
    record: dict = {
        "banner": harness.banner(torch.device("cpu" if cpu else "cuda")),
        "sizes": sizes.__dict__,
        "parts": {},
        "skipped": {},
        "part_seconds": {},
    }
    start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="bench-distributed-"))
    for part in (p for p in PARTS if p in wanted):
        elapsed = time.perf_counter() - start
        if args.budget_s and elapsed > args.budget_s:
            record["skipped"][part] = f"not started: {elapsed:.0f} s past --budget-s"
            continue
        t0 = time.perf_counter()
        if part in ("train", "exact", "tp", "ep"):
            rows = _suite_train(sizes, tmp, cpu, part)
        elif part == "sr":
            rows = _suite_sr(sizes, tmp, cpu)
        elif part == "cast":
            rows = _suite_cast(sizes, tmp, cpu)
        else:
            ranks = [int(n) for n in args.hf_ranks.split(",")]
            rows = _suite_hf(sizes, tmp, cpu, ranks)
        record["parts"][part] = rows
        record["part_seconds"][part] = time.perf_counter() - t0
        if args.json:  # each train run's whole stderr, beside the JSON
            logs = Path(args.json).with_name(Path(args.json).stem + "_stderr")
            logs.mkdir(parents=True, exist_ok=True)
            for f in tmp.glob("*.stderr"):
                shutil.copy(f, logs / f.name)
        print(f"{part}: {record['part_seconds'][part]:.0f} s", flush=True)
        if args.json:
            harness.write_json(args.json, record)
    record["total_seconds"] = time.perf_counter() - start
    _print_suite(record)
    if args.json:
        harness.write_json(args.json, record)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=("bytes", "cast", "suite"))
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5, help="cast: timed calls per path")
    parser.add_argument("--warmup", type=int, default=2, help="cast: untimed calls per path")
    parser.add_argument("--cuda", action="store_true", help="(suite: implied unless --smoke)")
    parser.add_argument(
        "--json", metavar="PATH", help="cast, suite: also write the results as JSON"
    )
    parser.add_argument("--smoke", action="store_true", help="suite: tiny sizes on CPU ranks")
    parser.add_argument("--parts", help=f"suite: comma-separated subset of {','.join(PARTS)}")
    parser.add_argument("--recipes", help="suite: comma-separated [bf16,nvfp4,mxfp8]")
    parser.add_argument("--hf-models", help=f"suite: comma-separated of {','.join(HF_SHAPES)}")
    parser.add_argument("--hf-modes", help="suite: comma-separated [eager,compiled]")
    parser.add_argument(
        "--hf-ranks", default="2", help="suite: rank counts for hf, 0 = one GPU without FSDP [2]"
    )
    parser.add_argument("--hf-batch", type=int, help="suite: hf sequences per rank [2]")
    parser.add_argument("--budget-s", type=float, default=0, help="suite: start no part after")
    args = parser.parse_args()
    if args.what == "suite":
        args.cuda = not args.smoke
        suite(args)
        return
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
