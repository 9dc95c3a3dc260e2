"""Whole models as a user trains them: tokens/s, peak memory and compile time of each recipe
against BF16, eager and compiled, in one process.

Models: transformers' `LlamaForCausalLM` (random init, SDPA attention) at a 1B shape (hidden 2048,
ffn 5632, 16 layers, 32 heads / 8 KV heads) and an 8B shape (hidden 4096, ffn 14336, 8 of its
32 layers, 32 heads / 8 KV heads), both with a 32000-token vocabulary; blockscale's own `1b` and
`small` (blockscale.models, byte vocabulary); `llama-tiny` and `tiny` for CPU smoke tests.
transformers is the optional `hf` extra: only the llama-* models need it.

One step, the same for every recipe: FP32 parameters, forward under BF16 autocast (CUDA),
cross-entropy in FP32 on the logits, backward, gradient clipping at 1.0, fused AdamW (CUDA). A
recipe's model is built from the same seed, then converted with
`convert(model, recipe, module_filter_fn=layer_policy(model))` (the last ~15% of blocks, the LM
head and the embeddings stay BF16); BF16 is the unconverted model. "compile" is plain
`torch.compile(model)`, no options. For each (model, mode, recipe):

- first_s: the first step, which compiles in compile mode (so it is the compile time);
- step_ms (median over --steps after --warmup), tokens/s, and their ratio to BF16 in the same
  mode (tok_vs_bf16); compiled rows also give tok_vs_bf16_eager;
- peak_gib: max_memory_allocated over the timed steps (weights, gradients, AdamW state and the
  step's activations), and mem_vs_bf16;
- host_ms: how long the host takes to issue one step (the step returns before the GPU is done
  unless the host is the bottleneck: host_ms close to step_ms means launch-bound);
- status: ok, or why the row has no figures (compile_timeout, oom, error: ...).

--compile-timeout bounds the first compiled step (a repeating SIGALRM in the main thread, where
Dynamo and Inductor run, and a check of the elapsed time after it; see TimeLimit): a compile
that stalls or ends past the limit is reported as compile_timeout and the run goes on.
--profile records one more step under torch.profiler per row: the top kernels by device time,
the number of kernel launches and the host time; with --out they go into the JSON too.
--memory-peak (CUDA) records one more step's allocations and reports the highest point: its
GiB, the allocation that reached it and what is live there, grouped by the code that made it.
--memory process takes each row's peak_gib from a process that runs only that model, mode and
recipe (the run's other options passed on, --memory-steps timed steps after one), so no recipe
inherits another's cached blocks; the shared process's peaks stay as peak_gib_shared.

    python benchmarks/bench_model.py --models llama-1b --recipes bf16,nvfp4,mxfp8 \\
        --batch-size 8 --seq-len 2048 --out results/bench_model_llama1b.json
    python benchmarks/bench_model.py --models llama-tiny,tiny --quick   # CPU smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script from anywhere

import harness  # noqa: E402
import replaced  # noqa: E402
import tiles  # noqa: E402

from blockscale import _registry, recipes  # noqa: E402
from blockscale import nn as bsnn  # noqa: E402
from blockscale.models import build_model, model_config  # noqa: E402

RECIPES = ["bf16", "nvfp4", "mxfp8", "nvfp4_fwd_mxfp8_bwd"]


@dataclass(frozen=True)
class ModelSpec:
    """A benchmarked model: transformers Llama fields (`hf`) or a blockscale size (`size`)."""

    hf: dict[str, int] | None = None
    size: str | None = None

    def layers(self) -> int:
        if self.hf is not None:
            return self.hf["num_hidden_layers"]
        return model_config(self.size).n_layers  # type: ignore[arg-type]


def _llama(hidden: int, ffn: int, layers: int, heads: int, kv_heads: int, vocab: int) -> ModelSpec:
    return ModelSpec(hf=dict(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                             num_attention_heads=heads, num_key_value_heads=kv_heads,
                             vocab_size=vocab))  # fmt: skip


MODELS: dict[str, ModelSpec] = {
    "llama-1b": _llama(2048, 5632, 16, 32, 8, 32000),
    "llama-8b": _llama(4096, 14336, 8, 32, 8, 32000),
    "llama-tiny": _llama(64, 128, 2, 4, 2, 256),
    "1b": ModelSpec(size="1b"),
    "small": ModelSpec(size="small"),
    "tiny": ModelSpec(size="tiny"),
}


def build(spec: ModelSpec, layers: int | None, seq_len: int, device: torch.device):
    """The model (FP32, on `device`, seeded) and its vocabulary size."""
    torch.manual_seed(0)
    if spec.hf is not None:
        from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415 (optional)

        fields = dict(spec.hf)
        if layers:
            fields["num_hidden_layers"] = layers
        config = LlamaConfig(**fields, max_position_embeddings=max(seq_len, 2048),
                             attn_implementation="sdpa", use_cache=False)  # fmt: skip
        with torch.device(device):
            model = LlamaForCausalLM(config)
        return model, config.vocab_size
    overrides: dict[str, Any] = {"seq_len": seq_len}
    if layers:
        overrides["n_layers"] = layers
    cfg = model_config(spec.size, **overrides)  # type: ignore[arg-type]
    with torch.device(device):
        model = build_model(cfg)
    return model, cfg.vocab_size


def logits_of(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    out = model(tokens)
    return out.logits if hasattr(out, "logits") else out


class CompileTimeout(Exception):
    pass


def _timeout_in_chain(e: BaseException | None) -> bool:
    """Whether `e` is a CompileTimeout or was raised while one was handled (Dynamo wraps)."""
    while e is not None:
        if isinstance(e, CompileTimeout):
            return True
        e = e.__cause__ or e.__context__
    return False


class TimeLimit:
    """Raise CompileTimeout in the main thread once `seconds` have passed (0: no limit).

    One alarm is not enough: its exception can land where something catches it and goes on. A
    weakref callback or __del__ that the garbage collector runs mid-step only prints what it
    raises (and a signal that comes during a long collection can be handled in the first such
    callback); an `except Exception` in Dynamo or the model moves on. The step then runs on,
    into a stalled compile perhaps, with no alarm left. So the alarm repeats every
    min(seconds, 1 s) until the block ends, and a block that ends past the limit without
    raising raises CompileTimeout on the way out: the outcome depends on the elapsed time only.

    A repeat does nothing while a CompileTimeout is being handled (the except and finally
    blocks it passes on its way out must run to their end) or inside __enter__ and __exit__
    (which arm and disarm the timer: an exception there would leave it running)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.armed = False
        self.deadline = 0.0
        self.previous: Any = None

    def __enter__(self) -> None:
        if self.seconds <= 0 or not hasattr(signal, "SIGALRM"):
            return
        self.deadline = time.monotonic() + self.seconds
        self.previous = signal.signal(signal.SIGALRM, self._expire)
        self.armed = True
        signal.setitimer(signal.ITIMER_REAL, self.seconds, min(self.seconds, 1.0))

    def __exit__(self, kind: type[BaseException] | None, value: Any, tb: Any) -> None:
        if not self.armed:
            return
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL if self.previous is None else self.previous)
        self.armed = False
        over = time.monotonic() - self.deadline
        if kind is None and over >= 0:
            raise CompileTimeout(f"first step ended {over:.1f} s past the {self.seconds:g} s limit")

    def _expire(self, signum: int, frame: Any) -> None:
        if frame is not None and any(frame.f_code is c for c in _TIME_LIMIT_OWN_CODE):
            return
        if _timeout_in_chain(sys.exc_info()[1]):
            return
        raise CompileTimeout(f"first step did not finish in {self.seconds:g} s")


_TIME_LIMIT_OWN_CODE = (TimeLimit.__enter__.__code__, TimeLimit.__exit__.__code__)


def convert_for(model: torch.nn.Module, recipe: str, device: torch.device):
    """`model` converted to `recipe` in place (the default layer policy; bf16: unchanged),
    and the optimizer every row trains it with (AdamW, fused on CUDA)."""
    if recipe != "bf16":
        bsnn.convert(model, recipes.get(recipe), module_filter_fn=bsnn.layer_policy(model))
    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda", foreach=None)


def make_step(model, optimizer, forward, device) -> Callable[[torch.Tensor], None]:
    autocast = (
        (lambda: torch.autocast("cuda", dtype=torch.bfloat16))
        if device.type == "cuda"
        else contextlib.nullcontext
    )

    def step(tokens: torch.Tensor) -> None:
        with autocast():
            logits = logits_of(forward, tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def host_ms(step: Callable, batches: list, device: torch.device, reps: int = 3) -> float:
    """Median host time to issue one step (the GPU idle at its start)."""
    times = []
    for i in range(reps):
        harness.synchronize(device)
        t0 = time.perf_counter()
        step(batches[i % len(batches)])
        times.append((time.perf_counter() - t0) * 1e3)
    harness.synchronize(device)
    return sorted(times)[len(times) // 2]


def profile_step(step: Callable, tokens: torch.Tensor, device: torch.device, top: int) -> dict:
    """One step under torch.profiler: top kernels by device time, launches, host time."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    harness.synchronize(device)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        step(tokens)
        issued = time.perf_counter() - t0
        harness.synchronize(device)
        wall = time.perf_counter() - t0
    averages = prof.key_averages()
    on_device = [e for e in averages if e.device_type == torch.autograd.DeviceType.CUDA]
    key = "self_device_time_total"
    kernels = sorted(on_device, key=lambda e: getattr(e, key), reverse=True)
    device_us = sum(getattr(e, key) for e in on_device)
    launch_names = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")
    launches = sum(e.count for e in averages if e.key in launch_names)
    host_ops = sorted(
        (e for e in averages if e.device_type == torch.autograd.DeviceType.CPU),
        key=lambda e: e.self_cpu_time_total,
        reverse=True,
    )
    return {
        "wall_ms": wall * 1e3,
        "host_issue_ms": issued * 1e3,
        "device_ms": device_us / 1e3,
        "kernels": sum(e.count for e in on_device),
        "launches": launches,
        "top_kernels": [
            {
                "name": e.key[:100],
                "count": e.count,
                "ms": getattr(e, key) / 1e3,
                "pct": 100 * getattr(e, key) / device_us if device_us else None,
            }
            for e in kernels[:top]
        ],  # fmt: skip
        "top_host_ops": [
            {"name": e.key[:100], "count": e.count, "self_ms": e.self_cpu_time_total / 1e3}
            for e in host_ops[:top]
        ],
    }


def cprofile_step(step: Callable, tokens: torch.Tensor, device: torch.device, top: int) -> dict:
    """One step under cProfile (the GPU idle at its start): where the host's time goes, by
    Python function, the self time (tottime) and the time under it (cumtime) per step."""
    import cProfile  # noqa: PLC0415
    import pstats  # noqa: PLC0415

    harness.synchronize(device)
    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.enable()
    step(tokens)
    profiler.disable()
    issued = time.perf_counter() - t0
    harness.synchronize(device)
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]

    def where(key: tuple) -> str:
        file, line, func = key
        return f"{'/'.join(Path(file).parts[-2:])}:{line}:{func}"[-100:]

    def rows(column: int) -> list[dict[str, Any]]:
        ranked = sorted(stats.items(), key=lambda kv: kv[1][column], reverse=True)[:top]
        return [{"name": where(k), "calls": v[1], "self_ms": v[2] * 1e3, "cum_ms": v[3] * 1e3}
                for k, v in ranked]  # fmt: skip

    return {"host_issue_ms": issued * 1e3, "by_self": rows(2), "by_cum": rows(3)}


# Where an allocation is charged: the innermost frame in one of these, else the innermost.
_OWN_CODE = ("blockscale/", "transformers/", "benchmarks/")


def _origin(frames: list[dict[str, Any]]) -> str:
    """'file:line:function' of the frame an allocation is charged to (innermost first)."""
    chosen = next((f for f in frames if any(k in f["filename"] for k in _OWN_CODE)), None)
    chosen = chosen or (frames[0] if frames else None)
    if chosen is None:
        return "?"
    return f"{'/'.join(Path(chosen['filename']).parts[-2:])}:{chosen['line']}:{chosen['name']}"


def peak_from_trace(events: list[dict[str, Any]], top: int) -> dict[str, Any]:
    """The highest point of allocated memory in a CUDA caching-allocator trace (the events of
    `torch.cuda.memory._snapshot()["device_traces"][i]`), relative to where the trace began:
    the bytes, the allocation that reached it, and the allocations live there grouped by the
    code that made them. An allocation counts from its 'alloc' to its 'free_completed' (the
    allocator's own allocated-bytes stat moves at those two events)."""
    live: dict[int, tuple[int, str]] = {}
    current = peak = 0
    peak_live: dict[int, tuple[int, str]] = {}
    peak_at = "(trace start)"
    for event in events:
        action = event.get("action")
        if action == "alloc":
            origin = _origin(event.get("frames") or [])
            live[event["addr"]] = (event["size"], origin)
            current += event["size"]
            if current > peak:
                peak, peak_at, peak_live = current, origin, dict(live)
        elif action == "free_completed" and event["addr"] in live:
            current -= live.pop(event["addr"])[0]
    groups: dict[str, list[int]] = {}
    for size, origin in peak_live.values():
        entry = groups.setdefault(origin, [0, 0])
        entry[0] += size
        entry[1] += 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "peak_above_start_gib": peak / 2**30,
        "peak_reached_at": peak_at,
        "live_at_peak": [{"origin": o, "gib": b / 2**30, "count": n} for o, (b, n) in ranked],
    }


def memory_peak_step(step: Callable, tokens: torch.Tensor, device: torch.device, top: int):
    """One step under the CUDA allocator's recorder: what is live at its highest point
    (`peak_from_trace`), with the bytes allocated before the step (weights, AdamW state)."""
    harness.synchronize(device)
    start = torch.cuda.memory_allocated(device)
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    try:
        step(tokens)
        harness.synchronize(device)
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    events = snapshot["device_traces"][device.index or 0]
    summary = peak_from_trace(events, top)
    summary["allocated_before_step_gib"] = start / 2**30
    summary["peak_gib"] = summary["allocated_before_step_gib"] + summary["peak_above_start_gib"]
    return summary


def failure(e: BaseException) -> str:
    """A row's status for an exception; Dynamo and Inductor wrap what they catch, so the
    timeout and out-of-memory are looked for along the chain of causes."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, CompileTimeout):
            return f"compile_timeout ({seen})"
        if isinstance(seen, torch.OutOfMemoryError):
            return "oom"
        seen = seen.__cause__ or seen.__context__
    first_line = (str(e).splitlines() or [""])[0]
    return f"error: {type(e).__name__}: {first_line[:200]}"


def run_case(name: str, spec: ModelSpec, mode: str, recipe: str, args, device) -> dict[str, Any]:
    row: dict[str, Any] = {"model": name, "mode": mode, "recipe": recipe, "status": "ok"}
    model = optimizer = forward = step = batches = None
    try:
        model, vocab = build(spec, args.layers, args.seq_len, device)
        row["layers"] = args.layers or spec.layers()
        optimizer = convert_for(model, recipe, device)
        row["params_m"] = sum(p.numel() for p in model.parameters()) / 1e6
        forward = torch.compile(model, mode=args.compile_mode) if mode == "compile" else model
        step = make_step(model, optimizer, forward, device)
        gen = torch.Generator().manual_seed(1)
        shape = (args.batch_size, args.seq_len + 1)
        batches = [torch.randint(0, vocab, shape, generator=gen).to(device) for _ in range(2)]
        limit = args.compile_timeout if mode == "compile" else 0
        t0 = time.perf_counter()
        with TimeLimit(limit):
            step(batches[0])
            harness.synchronize(device)
        row["first_s"] = time.perf_counter() - t0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        timing = harness.time_fn(
            step, [(b,) for b in batches], warmup=args.warmup, reps=args.steps, device=device
        )
        row["step_ms"] = timing.median_ms
        row["tokens_per_s"] = args.batch_size * args.seq_len / (timing.median_ms * 1e-3)
        if device.type == "cuda":
            row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        row["host_ms"] = host_ms(step, batches, device)
        if args.profile:
            row["profile"] = profile_step(step, batches[0], device, args.profile_top)
        if args.cprofile:
            row["cprofile"] = cprofile_step(step, batches[0], device, args.profile_top)
        if args.memory_peak and device.type == "cuda":
            row["memory_peak"] = memory_peak_step(step, batches[0], device, args.profile_top)
    except Exception as e:  # a failing recipe must not lose the others' figures
        row["status"] = failure(e)
    finally:
        del model, optimizer, forward, step, batches  # the next row starts from free memory
        torch._dynamo.reset()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def add_ratios(rows: list[dict[str, Any]]) -> None:
    def find(model: str, mode: str) -> dict[str, Any] | None:
        for r in rows:
            if r["model"] == model and r["mode"] == mode and r["recipe"] == "bf16":
                return r if "step_ms" in r else None
        return None

    for r in rows:
        if "step_ms" not in r:
            continue
        base = find(r["model"], r["mode"])
        if base is not None:
            r["tok_vs_bf16"] = r["tokens_per_s"] / base["tokens_per_s"]
            if r.get("peak_gib") and base.get("peak_gib"):
                r["mem_vs_bf16"] = r["peak_gib"] / base["peak_gib"]
        eager = find(r["model"], "eager")
        if r["mode"] == "compile" and eager is not None:
            r["tok_vs_bf16_eager"] = r["tokens_per_s"] / eager["tokens_per_s"]
        base_compile = find(r["model"], "compile")
        if r["mode"] == "compile" and base_compile is not None and "first_s" in base_compile:
            r["compile_vs_bf16"] = r["first_s"] / base_compile["first_s"]


def print_profiles(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        peak = r.get("memory_peak")
        if peak:
            print(f"\nmemory peak {r['model']} {r['mode']} {r['recipe']}: "
                  f"{peak['peak_gib']:.2f} GiB ({peak['allocated_before_step_gib']:.2f} before the "
                  f"step), reached allocating at {peak['peak_reached_at']}")  # fmt: skip
            harness.print_table(peak["live_at_peak"], ["origin", "gib", "count"])
        host = r.get("cprofile")
        if host:
            print(f"\ncprofile {r['model']} {r['mode']} {r['recipe']}: "
                  f"host issue {host['host_issue_ms']:.1f} ms under cProfile")  # fmt: skip
            harness.print_table(host["by_self"], ["name", "calls", "self_ms", "cum_ms"])
            harness.print_table(host["by_cum"], ["name", "calls", "self_ms", "cum_ms"])
        prof = r.get("profile")
        if not prof:
            continue
        print(
            f"\nprofile {r['model']} {r['mode']} {r['recipe']}: wall {prof['wall_ms']:.1f} ms, "
            f"host issue {prof['host_issue_ms']:.1f} ms, device {prof['device_ms']:.1f} ms, "
            f"{prof['kernels']} kernels, {prof['launches']} launch calls"
        )
        if prof["top_kernels"]:
            harness.print_table(prof["top_kernels"], ["name", "count", "ms", "pct"])
        else:
            harness.print_table(prof["top_host_ops"], ["name", "count", "self_ms"])


COLUMNS = ["model", "layers", "mode", "recipe", "first_s", "step_ms", "tokens_per_s",
           "tok_vs_bf16", "tok_vs_bf16_eager", "compile_vs_bf16", "peak_gib", "mem_vs_bf16",
           "host_ms", "status"]  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="llama-1b", help=f"comma list of {', '.join(MODELS)}")
    parser.add_argument("--recipes", default="bf16,nvfp4,mxfp8", help=f"of {', '.join(RECIPES)}")
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument("--eager", action="store_true", help="eager rows only")
    modes.add_argument("--compile", action="store_true", help="compiled rows only")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps after the first")
    parser.add_argument("--layers", type=int, default=0, help="override the layer count")
    parser.add_argument("--compile-mode", default=None,
                        help="torch.compile's mode (default: none, plain torch.compile(model)); "
                        "'reduce-overhead' replays the step's kernels as CUDA graphs")  # fmt: skip
    parser.add_argument("--compile-timeout", type=float, default=300.0, help="s, 0: none")
    parser.add_argument("--profile", action="store_true", help="profile one step per row")
    parser.add_argument("--cprofile", action="store_true",
                        help="one step per row under cProfile: host time by Python function")  # fmt: skip
    parser.add_argument("--memory-peak", action="store_true",
                        help="CUDA: record one step's allocations and report what is live at "
                        "its highest point, grouped by the code that allocated it")  # fmt: skip
    parser.add_argument("--profile-top", type=int, default=12)
    parser.add_argument("--inline-triton", action="store_true",
                        help="let AOTAutograd decompose the Triton ops (torch's triton_op "
                             "default; blockscale keeps them opaque)")  # fmt: skip
    parser.add_argument("--no-shared-input", action="store_true",
                        help="quantize every layer's input on its own (ops/linear.py's "
                             "SHARE_INPUT_QUANTIZATION off: q/k/v and gate/up each quantize it)")  # fmt: skip
    parser.add_argument("--no-input-cast", action="store_true",
                        help="under autocast, quantize an FP32 input from its own values "
                             "(ops/linear.py's CAST_INPUT_UNDER_AUTOCAST off, as before "
                             "2026-12-03) instead of from its BF16 cast")  # fmt: skip
    parser.add_argument("--no-recompute-weight", action="store_true",
                        help="save each weight's packed dgrad copy for backward (ops/linear.py's "
                             "RECOMPUTE_WEIGHT off) instead of quantizing it again there")  # fmt: skip
    parser.add_argument("--no-cublas-bf16-out", action="store_true",
                        help="BF16 GEMM outputs without alpha or bias (MXFP8) from the fused "
                             "kernel, not cuBLAS with FP32 split-K reduction (gemm/dispatch.py's "
                             "CUBLAS_BF16_OUT off, as before 2026-11-26)")  # fmt: skip
    parser.add_argument("--activation-codes", action="store_true",
                        help="activation copies that feed only emulated GEMMs written with their "
                             "codes and scales too (gemm/dispatch.py's DQ_ONLY_ACTIVATIONS off, "
                             "as before 2026-11-29)")  # fmt: skip
    parser.add_argument("--fp32-fused-max-k", type=int, default=None, metavar="K",
                        help="FP32 GEMM outputs with a contraction of at most K run the fused "
                             "kernel, longer ones cuBLAS scaled in place (gemm/dispatch.py's "
                             "FUSED_FP32_MAX_K; 0: cuBLAS for all, as before 2026-11-26)")  # fmt: skip
    replaced.add_arg(parser)
    tiles.add_arg(parser)
    parser.add_argument("--device", default=None)
    parser.add_argument("--quick", action="store_true",
                        help="CPU smoke test: batch 2, sequence 32, 1 warm-up, 2 steps")  # fmt: skip
    parser.add_argument("--memory", choices=["inline", "process"], default="inline",
                        help="peak_gib from this process (the default: each recipe after the "
                             "ones before it) or from a process per model, mode and recipe "
                             "(each alone; the shared process's peaks become peak_gib_shared)")  # fmt: skip
    parser.add_argument("--memory-steps", type=int, default=2, help="timed steps per process")
    parser.add_argument("--memory-timeout", type=float, default=300.0, help="s per process")
    parser.add_argument("--out", metavar="PATH", help="write the rows as JSON")
    parser.add_argument("--child-json", metavar="PATH", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.out = args.child_json or args.out
    if args.quick:
        args.batch_size, args.seq_len, args.warmup, args.steps = 2, 32, 1, 2
    return args


# the options a process of one model, mode and recipe (--memory process) does not take from
# the run that starts it, with whether each takes a value
NOT_PASSED_ON = {"--models": True, "--recipes": True, "--steps": True, "--warmup": True,
                 "--out": True, "--memory": True, "--memory-steps": True,
                 "--memory-timeout": True, "--eager": False, "--compile": False,
                 "--profile": False, "--cprofile": False, "--memory-peak": False}  # fmt: skip


def alone_argv(given: list[str], name: str, mode: str, recipe: str, args) -> list[str]:
    """The arguments of the process that measures one model, mode and recipe alone: the run's
    own (every switch and shape that changes what a step holds), less the rows, timing,
    profiling and output options, then that row's, `--memory-steps` timed steps after one."""
    kept: list[str] = []
    skip = False
    for arg in given:
        if skip:
            skip = False
            continue
        option, equals, _ = arg.partition("=")
        if option in NOT_PASSED_ON:
            skip = NOT_PASSED_ON[option] and not equals
            continue
        kept.append(arg)
    return [*kept, "--models", name, "--recipes", recipe, f"--{mode}", "--memory", "inline",
            "--warmup", "1", "--steps", str(args.memory_steps)]  # fmt: skip


def set_activation_codes(full: bool) -> None:
    """With `full`, every activation copy is written with its codes (gemm/dispatch.py's
    DQ_ONLY_ACTIVATIONS off: the code before 2026-11-29); else the default."""
    importlib.import_module("blockscale.gemm.dispatch").DQ_ONLY_ACTIVATIONS = not full


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    device = harness.pick_device(args.device)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise SystemExit(f"unknown models {unknown}; choose from {', '.join(MODELS)}")
    names = [r.strip() for r in args.recipes.split(",") if r.strip()]
    if args.child_json is None:
        names = ["bf16"] + [r for r in names if r != "bf16"]  # ratios need BF16 in this run
    for r in names:
        recipes.get(r)  # an unknown name fails before any model is built
    modes = ["eager"] if args.eager else ["compile"] if args.compile else ["eager", "compile"]
    _registry.INLINE_TRITON_KERNELS = args.inline_triton
    ops_linear = importlib.import_module("blockscale.ops.linear")
    ops_linear.SHARE_INPUT_QUANTIZATION = not args.no_shared_input
    ops_linear.RECOMPUTE_WEIGHT = not args.no_recompute_weight
    ops_linear.CAST_INPUT_UNDER_AUTOCAST = not args.no_input_cast
    dispatch = importlib.import_module("blockscale.gemm.dispatch")
    dispatch.CUBLAS_BF16_OUT = not args.no_cublas_bf16_out
    set_activation_codes(args.activation_codes)
    if args.fp32_fused_max_k is not None:
        dispatch.FUSED_FP32_MAX_K = args.fp32_fused_max_k
    replaced.apply(args)  # (for the rest of this process)
    tiles.apply(args)
    info = harness.banner(device)
    rows: list[dict[str, Any]] = []

    def record() -> None:  # after every row: a run cut short keeps the rows it finished
        add_ratios(rows)
        if args.out:
            harness.write_json(args.out, {
                "benchmark": "model", "banner": info,
                "argv": sys.argv[1:] if argv is None else argv,
                "batch_size": args.batch_size, "seq_len": args.seq_len,
                "inline_triton": args.inline_triton, "shared_input": not args.no_shared_input,
                "recompute_weight": not args.no_recompute_weight,
                "input_cast": not args.no_input_cast,
                "cublas_bf16_out": dispatch.CUBLAS_BF16_OUT,
                "fp32_fused_max_k": dispatch.FUSED_FP32_MAX_K,
                "replaced": args.replaced, "tiles": args.tiles, "band": tiles.band(),
                "compile_mode": args.compile_mode, "memory": args.memory, "rows": rows})  # fmt: skip

    alone = args.memory == "process" and args.child_json is None
    given = sys.argv[1:] if argv is None else argv
    for name in models:
        for mode in modes:
            for recipe in names:
                row = run_case(name, MODELS[name], mode, recipe, args, device)
                if alone:
                    row["peak_gib_shared"] = row.pop("peak_gib", None)
                rows.append(row)
                figures = ", ".join(f"{k}={harness.fmt(row.get(k))}" for k in
                                    ("first_s", "step_ms", "tokens_per_s", "peak_gib", "host_ms"))  # fmt: skip
                print(f"  {name} {mode} {recipe}: {figures} [{row['status']}]", flush=True)
                record()
            if alone:

                def run(recipe: str, name: str = name, mode: str = mode) -> dict[str, Any]:
                    child = alone_argv(given, name, mode, recipe, args)
                    return harness.row_alone(__file__, child, args.memory_timeout)

                harness.take_peaks_alone(rows[-len(names) :], run)
                record()
    add_ratios(rows)
    print_profiles(rows)
    print(f"\nB={args.batch_size} T={args.seq_len}, ratios to BF16 in the same mode and run")
    harness.print_table(rows, COLUMNS)
    return rows


if __name__ == "__main__":
    main()
