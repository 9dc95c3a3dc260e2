"""One mixture-of-experts layer, forward + backward (router, dispatch, experts, combine): time
and peak memory of each recipe as ratios to BF16, eager and compiled, in the same run.

The layer is models/moe.py's `MoE` (a BF16 softmax top-k router, tokens sorted by expert on the
device, the experts' two grouped GEMMs with SwiGLU between, the weighted combine), converted
from outside with `blockscale.convert` (the router stays BF16); BF16 is the unconverted layer.
FP32 parameters under BF16 autocast, as training runs them; one step is the layer's forward on
x [tokens, dim] plus a backward of a random gradient. `--compile` adds each recipe under plain
`torch.compile(layer)`, timed after its first (compiling) call, whose time is reported too.

Weight cache (ops/weight_cache.py): `--weight-cache off on first dq` runs each quantized recipe
once per mode in the same process (`on`: the default cache, packed copies kept once a step
makes one twice; `first`: kept from their first use; `dq`: from their first use, with the
`_dq` operands; `off`: every use quantizes). A step is `--micro-batches` forwards and
backwards and then what an optimizer step does to the cache (it is cleared), so the cache
saves what it would in training: the backward's and the later micro-batches' quantizations.

    python benchmarks/bench_moe_layer.py --json results/bench_moe_layer_h100.json
    python benchmarks/bench_moe_layer.py --weight-cache off on dq --micro-batches 1 2
    python benchmarks/bench_moe_layer.py --quick            # CPU smoke test
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script from anywhere

import harness  # noqa: E402

import blockscale.nn as bsnn  # noqa: E402
from blockscale import recipes  # noqa: E402
from blockscale.models.moe import MoE, MoEConfig  # noqa: E402

# (label, dim, expert hidden, experts, top_k): a DeepSeek-V3-like routed layer (scaled to one
# GPU's memory) and a Mixtral-like one.
LAYERS = [("deepseek-v3-like", 7168, 2048, 16, 4), ("mixtral-like", 4096, 14336, 8, 2)]
QUICK_LAYERS = [("tiny", 64, 64, 4, 2)]
RECIPES = ["bf16", "nvfp4", "nvfp4_fwd_mxfp8_bwd", "mxfp8"]
CACHE_MODES = ["off", "on", "first", "dq"]


def set_cache(layer, mode: str) -> None:
    if mode == "off":
        bsnn.set_weight_cache(layer, False)
    elif mode in ("first", "dq"):
        bsnn.set_weight_cache(layer, True, keep_dq=mode == "dq", from_first_use=True)


def layer_for(dim: int, hidden: int, experts: int, top_k: int, device) -> MoE:
    cfg = MoEConfig(dim=dim, n_layers=1, n_heads=1, ffn_dim=hidden, seq_len=32, n_experts=experts,
                    top_k=top_k)  # fmt: skip
    torch.manual_seed(0)
    layer = MoE(cfg).to(device)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.02)
    return layer


def main(argv: list[str] | None = None) -> int:
    parser = harness.add_common_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    parser.add_argument("--recipes", nargs="+", default=RECIPES, choices=RECIPES)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--compile", action="store_true", help="also each recipe compiled")
    parser.add_argument("--layers", nargs="+", default=None, choices=[name for name, *_ in LAYERS])
    parser.add_argument("--weight-cache", nargs="+", default=["on"], choices=CACHE_MODES,
                        help="weight cache modes to time each quantized recipe with")  # fmt: skip
    parser.add_argument("--micro-batches", nargs="+", type=int, default=[1],
                        help="forward+backward passes per step (grad accumulation)")  # fmt: skip
    args = parser.parse_args(argv)
    device = harness.pick_device(args.device)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    args.reps = args.reps if args.reps is not None else (2 if args.quick else 15)
    tokens = 64 if args.quick else args.tokens
    names = ["bf16"] + [r for r in args.recipes if r != "bf16"]
    autocast = (
        (lambda: torch.autocast("cuda", dtype=torch.bfloat16))
        if device.type == "cuda"
        else (lambda: torch.autocast("cpu", enabled=False))
    )
    info = harness.banner(device)
    rows: list[dict[str, Any]] = []
    layers = QUICK_LAYERS if args.quick else [s for s in LAYERS if s[0] in (args.layers or [s[0]])]
    for label, dim, hidden, experts, top_k in layers:
        base = layer_for(dim, hidden, experts, top_k, device)
        x = torch.randn(tokens, dim, device=device).requires_grad_(True)
        go = torch.randn(
            tokens,
            dim,
            device=device,
            dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
        )
        runs = [(mode, micro, name, cache)
                for mode in (["eager", "compile"] if args.compile else ["eager"])
                for micro in args.micro_batches
                for name in names
                for cache in (["-"] if name == "bf16" else args.weight_cache)]  # fmt: skip
        for mode, micro, name, cache in runs:
            layer = copy.deepcopy(base)
            recipe = recipes.get(name)
            if recipe.quantized:
                bsnn.convert(layer, recipe)
                set_cache(layer, cache)
            fn = torch.compile(layer) if mode == "compile" else layer

            def step(fn=fn, layer=layer, x=x, go=go, micro=micro):
                layer.zero_grad(set_to_none=True)
                x.grad = None
                for _ in range(micro):
                    with autocast():
                        out = fn(x)
                    out.backward(go)
                bsnn.clear_weight_cache(layer)  # what an optimizer step does to it

            t0 = time.perf_counter()
            step()
            harness.synchronize(device)
            first = time.perf_counter() - t0
            timing = harness.time_fn(step, warmup=args.warmup, reps=args.reps, device=device)
            peak = harness.peak_memory(step, device)
            rows.append({"layer": label, "tokens": tokens, "mode": mode, "recipe": name,
                         "weight_cache": cache, "micro_batches": micro,
                         "first_s": first, "ms": timing.median_ms,
                         "peak_mib": None if peak is None else peak / 2**20})  # fmt: skip
            print(f"  {label} {mode} {name} cache={cache} x{micro}: {timing.median_ms:.3f} ms (first call {first:.1f} s)", flush=True)  # fmt: skip
            del layer, fn
            if mode == "compile":
                torch._dynamo.reset()
    for r in rows:
        same = [q for q in rows if q["layer"] == r["layer"] and q["recipe"] == "bf16" and q["micro_batches"] == r["micro_batches"]]  # fmt: skip
        base = next(q for q in same if q["mode"] == r["mode"])
        eager_bf16 = next(q for q in same if q["mode"] == "eager")
        r["time_vs_bf16"] = r["ms"] / base["ms"]
        r["vs_eager_bf16"] = r["ms"] / eager_bf16["ms"]
        r["mem_vs_bf16"] = None if r["peak_mib"] is None else r["peak_mib"] / base["peak_mib"]
    harness.print_table(rows, ["layer", "tokens", "mode", "recipe", "weight_cache",
                               "micro_batches", "first_s", "ms",
                               "time_vs_bf16", "vs_eager_bf16", "peak_mib", "mem_vs_bf16"])  # fmt: skip
    if args.json:
        harness.write_json(args.json, {"benchmark": "moe_layer", "banner": info, "rows": rows,
                                       "argv": sys.argv[1:] if argv is None else argv})  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
