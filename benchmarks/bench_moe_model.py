"""transformers mixture-of-experts models as a user trains them: tokens/s of each recipe against
the cast BF16 baseline in one process, eager and compiled, and each recipe's peak memory alone in
a process of its own.

Models (transformers' own classes, random init, `experts_implementation="grouped_mm"` where the
class takes one, SDPA attention, a 32000-token vocabulary, every block an MoE block):

- qwen3-30b-a3b: Qwen3-MoE at Qwen3-30B-A3B's block shape: hidden 2048, 128 experts, top-8,
  expert width 768, 32 heads / 4 KV heads of 128; 2 layers.
- deepseek-v3: DeepSeek-V3's layout scaled to fit one H100: 256 routed experts, top-8 (8
  groups, 4 picked), one shared expert, sigmoid router with its correction bias, multi-head
  latent attention (16 heads, q rank 768, kv rank 512, rope 64, nope 128, v 128), hidden 2048,
  expert width 512 (DeepSeek-V3: 7168 and 2048, the same 3.5-4x ratio); 2 layers. Its FP32
  weights, gradients and AdamW state take 26 GiB.
- mixtral: Mixtral-8x7B's block: hidden 4096, 8 experts, top-2, width 14336, 32 heads / 8 KV
  heads; 1 layer.
- llama4-scout: Llama 4 Scout's block (`Llama4ForCausalLM`, text only): hidden 5120, top-1
  with one shared expert, expert width 8192 (the shared expert's too), 40 heads / 8 KV heads
  of 128, RoPE and QK-norm (both blocks are RoPE blocks, chunked attention of 8192: full causal
  at these lengths); 2 layers, with 4 routed experts where Scout has 16, to fit one 80 GB
  H100. transformers' Llama 4 experts take no experts_implementation: every expert multiplies
  every token (those it was not picked for scaled to zero) with `torch.bmm`, which `convert`
  routes as a grouped GEMM of E groups of all the tokens (nn/experts.py, "Batched matmuls"),
  so the routed GEMMs and their activations are E times a top-1 dispatch's (its tokens/s
  compare across recipes, not with the other models). Parameters: a block has attention
  2*5120*5120 + 2*5120*1024 = 62.9M, 4 routed experts of 3*5120*8192 = 125.8M each (503.3M),
  the shared expert 125.8M, router and norms 31K: 692.1M; 2 blocks and the untied 32000-token
  embedding and LM head (163.8M each): 1711.9M. FP32 weights, gradients and two AdamW states
  (16 B a parameter): 27.4 GB = 25.5 GiB. The BF16 baseline's saved activations (counted on
  the CPU under autocast, not measured on a GPU): 0.66 MiB a token and 1.3 GiB of weight
  casts a block, 24 GiB at B=8, T=2048. 8 experts would be 2718.5M parameters, 40.5 GiB, but
  1.03 MiB a token, 37 GiB: with the weights and AdamW state (12 B a parameter, 30.4 GiB) and
  the logits about 72 GiB before the backward's own, too close to an H100's 79 GiB; 16
  (Scout's): 4731.9M, 70.5 GiB.
- qwen3-tiny, deepseek-tiny, mixtral-tiny, llama4-tiny: the same classes at CPU sizes (--smoke).

Recipes. `bf16` is the cast BF16 baseline: FP32 master weights whose experts' grouped GEMMs run
on BF16 operands, as autocast would cast them (it does not: `torch._grouped_mm` is not an
autocast op, so transformers runs FP32 masters' grouped GEMMs in FP32, slower than BF16 and than
every quantized recipe, whose GEMMs run on BF16 tensor cores; that unconverted model is the
`hf` recipe, on request). The baseline routes the experts as `convert` does, to a
`CastGroupedMM`; its linears are autocast's. Llama 4's experts multiply with `torch.bmm`,
which the router hands to a GroupedMM only when it quantizes: an unquantized one (the bf16
recipe's) runs the model's own bmm, so their CastGroupedMM is never called. bmm is an autocast
op, so under the step's BF16 autocast that bmm is the same baseline, on the BF16 casts of the
FP32 masters with a BF16 output, as blockscale's op gives; Llama 4's `hf` runs the same GEMMs
without the router (on the CPU, without autocast, both run in FP32). A quantized recipe's
model is converted with
`convert(model, recipe, module_filter_fn=layer_policy(model))`, the README's call: with one or
two blocks the paper's 15% tail keeps the last block (or the only one) in BF16, its experts
routed unquantized (so llama4-scout, like qwen3-30b-a3b and deepseek-v3, quantizes its first
block only). `--bf16-tail-fraction 0.0` quantizes every block (the rows before
2026-12-05 were measured so: that call compiled where the README's did not, issue 60); the LM
head, embeddings and routers stay BF16 either way.

The step is bench_model.py's: FP32 parameters, forward under BF16 autocast (CUDA), FP32
cross-entropy, backward, clipping at 1.0, fused AdamW. "compile" is plain
`torch.compile(model)` (`--compile-mode reduce-overhead`: CUDA graph replays). Columns:

- first_s, step_ms (median of --steps after --warmup), tokens_per_s and tok_vs_bf16: one
  process runs every recipe of a model and mode, so the ratios compare like with like;
- peak_gib and mem_vs_bf16: `max_memory_allocated` over the timed steps of a process that ran
  only that model, mode and recipe (--memory process, the default; a recipe run after others
  in one process inherits their allocator's cached blocks and fragmentation). --memory inline
  takes the peaks of the shared process instead (faster), --memory none skips them; the
  shared process's peak is kept as peak_gib_shared either way;
- status: ok, or why the row has no figures (compile_timeout, oom, error: ...);
- profile (--profile TOP, in the JSON): one more step of the shared process under
  torch.profiler: its TOP kernels by device time, launches, host issue and wall time;
- memory_peak (--memory-peak TOP): one more step of the shared process under the CUDA
  allocator's recorder: its highest point above the step's start and the TOP groups of
  allocations live there, by the code that made them (bench_model.memory_peak_step).
  --no-weight-cache runs every row (and its memory process) with the weight cache off;
  --fp32-grad-weight-launch LAUNCH sets kernels/grouped_gemm.py's TOKENS_FP32_LAUNCH (how the
  experts' FP32-output grad_weight GEMMs run: per_tile, halves, pointers);
  --activation-codes writes every activation copy with its codes, as before 2026-11-29 (the
  emulated GEMMs read only the `_dq`; docs/KERNELS.md, "Activation copies without their codes");
  --grouped-gemm-switch NAME=0|1 sets one of kernels/grouped_gemm.py's switches
  (ROWS_FUSED_LOOPS, ROWS_PERSISTENT_NMAJOR, ROWS_WARP_SPECIALIZE, ...).

Sized for one model per 10-minute device call (both modes, bf16 / nvfp4 / mxfp8 and six memory
processes; the whole never timed in one call; in parts on an H200, 2026-11-29: a model's
compiled rows without memory processes about 100 s, two models' eager rows with theirs about
230 s): split with --models, and --eager / --compile if a model does not fit. Every row is
written to --out as it finishes, so a run cut short keeps its rows.

    python benchmarks/bench_moe_model.py --models qwen3-30b-a3b \\
        --out docs/results/bench_moe_model_qwen3_h100.json
    python benchmarks/bench_moe_model.py --models llama4-scout
    python benchmarks/bench_moe_model.py --smoke        # CPU, tiny models, eager
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script from anywhere

import bench_model  # noqa: E402
import harness  # noqa: E402

from blockscale import nn as bsnn  # noqa: E402
from blockscale import recipes  # noqa: E402
from blockscale.nn import experts as bs_experts  # noqa: E402
from blockscale.ops.linear import output_dtype  # noqa: E402

RECIPES = ["bf16", "nvfp4", "mxfp8", "nvfp4_fwd_mxfp8_bwd", "hf"]
VOCAB = 32000


@dataclass(frozen=True)
class MoESpec:
    """A transformers MoE model: its config and model classes and the config's fields.
    `grouped_mm`: whether it takes `experts_implementation="grouped_mm"` (Llama 4's raises)."""

    config: str
    model: str
    fields: dict[str, Any] = field(default_factory=dict)
    grouped_mm: bool = True

    def layers(self) -> int:
        return self.fields["num_hidden_layers"]


def _qwen3(hidden, experts, top_k, width, layers, heads, kv_heads, head_dim, vocab=VOCAB):
    return MoESpec("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        hidden_size=hidden, num_experts=experts, num_experts_per_tok=top_k,
        moe_intermediate_size=width, intermediate_size=4 * width, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        norm_topk_prob=True, vocab_size=vocab))  # fmt: skip


def _deepseek(hidden, experts, top_k, width, layers, heads, q_rank, kv_rank, rope, nope, v,
              groups, vocab=VOCAB):  # fmt: skip
    return MoESpec("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        hidden_size=hidden, n_routed_experts=experts, num_experts_per_tok=top_k,
        moe_intermediate_size=width, intermediate_size=4 * width, n_shared_experts=1,
        n_group=groups, topk_group=max(1, groups // 2), first_k_dense_replace=0,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        q_lora_rank=q_rank, kv_lora_rank=kv_rank, qk_rope_head_dim=rope, qk_nope_head_dim=nope,
        v_head_dim=v, vocab_size=vocab))  # fmt: skip


def _mixtral(hidden, experts, top_k, width, layers, heads, kv_heads, vocab=VOCAB):
    return MoESpec("MixtralConfig", "MixtralForCausalLM", dict(
        hidden_size=hidden, num_local_experts=experts, num_experts_per_tok=top_k,
        intermediate_size=width, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, vocab_size=vocab))  # fmt: skip


def _llama4(hidden, experts, top_k, width, layers, heads, kv_heads, head_dim, vocab=VOCAB):
    """Every block MoE (`interleave_moe_layer_step` 1, Scout's). `intermediate_size` is the
    routed and shared experts' width; `intermediate_size_mlp` sizes dense blocks (none here)."""
    return MoESpec("Llama4TextConfig", "Llama4ForCausalLM", dict(
        hidden_size=hidden, num_local_experts=experts, num_experts_per_tok=top_k,
        intermediate_size=width, intermediate_size_mlp=2 * width, interleave_moe_layer_step=1,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, vocab_size=vocab), grouped_mm=False)  # fmt: skip


MODELS: dict[str, MoESpec] = {
    "qwen3-30b-a3b": _qwen3(2048, 128, 8, 768, 2, 32, 4, 128),
    "deepseek-v3": _deepseek(2048, 256, 8, 512, 2, 16, 768, 512, 64, 128, 128, groups=8),
    "mixtral": _mixtral(4096, 8, 2, 14336, 1, 32, 8),
    "llama4-scout": _llama4(5120, 4, 1, 8192, 2, 40, 8, 128),
    "qwen3-tiny": _qwen3(64, 8, 2, 32, 2, 4, 2, 16, vocab=256),
    "deepseek-tiny": _deepseek(64, 8, 2, 32, 2, 4, 32, 32, 16, 16, 16, groups=2, vocab=256),
    "mixtral-tiny": _mixtral(64, 4, 2, 64, 1, 4, 2, vocab=256),
    "llama4-tiny": _llama4(64, 4, 1, 64, 2, 4, 2, 16, vocab=256),
}
SMOKE_MODELS = "qwen3-tiny,deepseek-tiny,mixtral-tiny,llama4-tiny"


class CastGroupedMM(bsnn.GroupedMM):
    """The cast BF16 baseline's grouped GEMM: `torch._grouped_mm` on the BF16 casts of its
    operands (the FP32 masters get their gradients through the casts), the output in the dtype
    blockscale's grouped_mm gives (autocast's when on, else the input's)."""

    def forward(self, input, weight_t, offs, out_dtype=None, *, weight_source=None):
        out = torch._grouped_mm(input.bfloat16(), weight_t.bfloat16(), offs=offs)
        return out.to(out_dtype or output_dtype(input))


def _is_experts(module: torch.nn.Module, fqn: str) -> bool:
    return bool(bs_experts.experts_weights(module))


def build(
    spec: MoESpec,
    recipe: str,
    seq_len: int,
    device: torch.device,
    bf16_tail_fraction: float = 0.15,
) -> torch.nn.Module:
    """The model (FP32, on `device`, seeded), made to run `recipe`."""
    import transformers  # noqa: PLC0415 (optional)

    torch.manual_seed(0)
    experts = {"experts_implementation": "grouped_mm"} if spec.grouped_mm else {}
    config = getattr(transformers, spec.config)(
        **spec.fields, max_position_embeddings=max(seq_len, 2048), use_cache=False,
        attn_implementation="sdpa", **experts,
    )  # fmt: skip
    with torch.device(device):
        model = getattr(transformers, spec.model)(config)
    if recipe == "bf16":
        bsnn.convert(model, recipes.get("bf16"), module_filter_fn=_is_experts)
        # Llama 4's (bmm experts) are never called: autocast's bmm is their baseline (docstring)
        for module in model.modules():
            grouped_mms = getattr(module, "grouped_mms", None)
            if isinstance(grouped_mms, torch.nn.ModuleDict):
                for name in list(grouped_mms):
                    grouped_mms[name] = CastGroupedMM(recipes.get("bf16"))
    elif recipe != "hf":
        policy = bsnn.layer_policy(model, bf16_tail_fraction=bf16_tail_fraction)
        bsnn.convert(model, recipes.get(recipe), module_filter_fn=policy)
    return model


def run_case(name: str, mode: str, recipe: str, args, device: torch.device) -> dict[str, Any]:
    row: dict[str, Any] = {"model": name, "mode": mode, "recipe": recipe, "status": "ok"}
    model = optimizer = forward = step = batches = None
    try:
        spec = MODELS[name]
        model = build(spec, recipe, args.seq_len, device, args.bf16_tail_fraction)
        if args.no_weight_cache:
            bsnn.set_weight_cache(model, False)
        row["layers"] = spec.layers()
        row["params_m"] = sum(p.numel() for p in model.parameters()) / 1e6
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=1e-4, fused=device.type == "cuda", foreach=None
        )
        forward = torch.compile(model, mode=args.compile_mode) if mode == "compile" else model
        step = bench_model.make_step(model, optimizer, forward, device)
        gen = torch.Generator().manual_seed(1)
        shape = (args.batch_size, args.seq_len + 1)
        vocab = spec.fields["vocab_size"]
        batches = [torch.randint(0, vocab, shape, generator=gen).to(device) for _ in range(2)]
        t0 = time.perf_counter()
        with bench_model.TimeLimit(args.compile_timeout if mode == "compile" else 0):
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
        if args.profile:  # after the peak: the profiler's own buffers stay out of it
            row["profile"] = bench_model.profile_step(step, batches[0], device, args.profile)
        if args.memory_peak and device.type == "cuda":
            row["memory_peak"] = bench_model.memory_peak_step(
                step, batches[0], device, args.memory_peak
            )
    except Exception as e:  # a failing recipe must not lose the others' figures
        row["status"] = bench_model.failure(e)
    finally:
        del model, optimizer, forward, step, batches  # the next row starts from free memory
        torch._dynamo.reset()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def peak_alone(name: str, mode: str, recipe: str, args) -> dict[str, Any]:
    """Run one model, mode and recipe in a process of its own: its row (peak_gib, status)."""
    command = ["--models", name, "--recipes", recipe, f"--{mode}", "--memory", "none",
               "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
               "--warmup", "1", "--steps", str(args.memory_steps),
               "--compile-timeout", str(args.compile_timeout)]  # fmt: skip
    if args.no_weight_cache:
        command.append("--no-weight-cache")
    command += ["--bf16-tail-fraction", str(args.bf16_tail_fraction)]
    if args.compile_mode:
        command += ["--compile-mode", args.compile_mode]
    if args.fp32_grad_weight_launch:
        command += ["--fp32-grad-weight-launch", args.fp32_grad_weight_launch]
    if args.activation_codes:
        command.append("--activation-codes")
    for switch in args.grouped_gemm_switch:
        command += ["--grouped-gemm-switch", switch]
    if args.device:
        command += ["--device", args.device]
    alone = harness.row_alone(__file__, command, args.memory_timeout)
    if "model" not in alone:  # no row: say which process
        alone["status"] = "memory " + alone["status"]
    return alone


def add_ratios(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        base = next((b for b in rows if b["model"] == r["model"] and b["mode"] == r["mode"]
                     and b["recipe"] == "bf16"), None)  # fmt: skip
        if base is None:
            continue
        if "tokens_per_s" in r and "tokens_per_s" in base:
            r["tok_vs_bf16"] = r["tokens_per_s"] / base["tokens_per_s"]
        if r.get("peak_gib") and base.get("peak_gib"):
            r["mem_vs_bf16"] = r["peak_gib"] / base["peak_gib"]


COLUMNS = ["model", "layers", "mode", "recipe", "first_s", "step_ms", "tokens_per_s",
           "tok_vs_bf16", "peak_gib", "mem_vs_bf16", "status"]  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="qwen3-30b-a3b,deepseek-v3,mixtral",
                        help=f"comma list of {', '.join(MODELS)}")  # fmt: skip
    parser.add_argument("--recipes", default="bf16,nvfp4,mxfp8",
                        help=f"of {', '.join(RECIPES)}; bf16 is always run")  # fmt: skip
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument("--eager", action="store_true", help="eager rows only")
    modes.add_argument("--compile", action="store_true", help="compiled rows only")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=8, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps after the first")
    parser.add_argument("--compile-timeout", type=float, default=240.0, help="s, 0: none")
    parser.add_argument("--compile-mode", default=None,
                        help="torch.compile's mode (default: none, plain torch.compile(model)); "
                        "'reduce-overhead' replays the step's kernels as CUDA graphs")  # fmt: skip
    parser.add_argument("--memory", choices=["process", "inline", "none"], default=None,
                        help="peak memory from a process per recipe (the default), the shared "
                             "process, or not at all (the default with --smoke)")  # fmt: skip
    parser.add_argument("--memory-steps", type=int, default=2, help="timed steps per process")
    parser.add_argument("--memory-timeout", type=float, default=300.0, help="s per process")
    parser.add_argument("--profile", type=int, default=0, metavar="TOP",
                        help="one more step under torch.profiler per row: its TOP kernels by "
                        "device time, launches and host time (in the JSON)")  # fmt: skip
    parser.add_argument("--memory-peak", type=int, default=0, metavar="TOP",
                        help="one more step under the CUDA allocator's recorder per row: the "
                             "TOP groups of allocations live at its highest point, by the "
                             "code that made them (in the JSON, and printed)")  # fmt: skip
    parser.add_argument("--no-weight-cache", action="store_true",
                        help="every converted weight quantized at each use "
                             "(blockscale.nn.set_weight_cache(model, False))")  # fmt: skip
    parser.add_argument("--fp32-grad-weight-launch", choices=["per_tile", "halves", "pointers"],
                        help="how FP32-output grad_weight GEMMs run "
                             "(kernels/grouped_gemm.py TOKENS_FP32_LAUNCH)")  # fmt: skip
    parser.add_argument("--activation-codes", action="store_true",
                        help="activation copies that feed only emulated GEMMs written with their "
                             "codes too (bench_model.set_activation_codes)")  # fmt: skip
    parser.add_argument("--grouped-gemm-switch", action="append", default=[], metavar="NAME=0|1",
                        help="set a switch of kernels/grouped_gemm.py (ROWS_FUSED_LOOPS, "
                             "ROWS_PERSISTENT_NMAJOR, ROWS_WARP_SPECIALIZE, ...); "
                             "repeatable")  # fmt: skip
    parser.add_argument(
        "--bf16-tail-fraction",
        type=float,
        default=0.15,
        help="layer_policy's (0.15, its default, is the README's call; 0.0 "
        "quantizes every block, as the rows before 2026-12-05 did)",
    )
    parser.add_argument("--device", default=None)
    parser.add_argument("--smoke", action="store_true",
                        help="CPU smoke test: the tiny models (unless --models), batch 2, "
                             "sequence 32, 1 warm-up, 2 steps")  # fmt: skip
    parser.add_argument("--out", metavar="PATH", help="write the rows as JSON")
    parser.add_argument("--child-json", metavar="PATH", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        if args.models == parser.get_default("models"):
            args.models = SMOKE_MODELS
        args.batch_size, args.seq_len, args.warmup, args.steps = 2, 32, 1, 2
        args.device = args.device or "cpu"
    if args.memory is None:
        args.memory = "none" if args.smoke else "process"
    args.out = args.child_json or args.out
    return args


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    if args.fp32_grad_weight_launch or args.grouped_gemm_switch:
        from blockscale.kernels import grouped_gemm  # noqa: PLC0415 (needs Triton)
    if args.fp32_grad_weight_launch:
        grouped_gemm.TOKENS_FP32_LAUNCH = args.fp32_grad_weight_launch
    for switch in args.grouped_gemm_switch:
        name, _, value = switch.partition("=")
        if not isinstance(getattr(grouped_gemm, name, None), bool) or value not in ("0", "1"):
            raise SystemExit(f"--grouped-gemm-switch {switch!r}: not a switch NAME=0|1")
        setattr(grouped_gemm, name, value == "1")
    bench_model.set_activation_codes(args.activation_codes)
    device = harness.pick_device(args.device)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise SystemExit(f"unknown models {unknown}; choose from {', '.join(MODELS)}")
    names = [r.strip() for r in args.recipes.split(",") if r.strip()]
    if args.child_json is None:
        names = ["bf16"] + [r for r in names if r != "bf16"]  # ratios need BF16 in this run
    for r in names:
        if r not in ("bf16", "hf"):
            recipes.get(r)  # an unknown name fails before any model is built
    modes = ["eager"] if args.eager else ["compile"] if args.compile else ["eager", "compile"]
    info = harness.banner(device)
    rows: list[dict[str, Any]] = []

    def record() -> None:
        add_ratios(rows)
        if args.out:
            harness.write_json(args.out, {
                "benchmark": "moe_model", "banner": info,
                "argv": sys.argv[1:] if argv is None else argv, "batch_size": args.batch_size,
                "seq_len": args.seq_len, "memory": args.memory, "rows": rows})  # fmt: skip

    for name in models:
        for mode in modes:
            for recipe in names:
                row = run_case(name, mode, recipe, args, device)
                if args.child_json is None and args.memory != "inline":
                    row["peak_gib_shared"] = row.pop("peak_gib", None)
                rows.append(row)
                figures = ", ".join(f"{k}={harness.fmt(row.get(k))}" for k in
                                    ("first_s", "step_ms", "tokens_per_s"))  # fmt: skip
                print(f"  {name} {mode} {recipe}: {figures} [{row['status']}]", flush=True)
                record()  # after every row: a run cut short keeps the rows it finished
            if args.memory == "process":
                harness.take_peaks_alone(
                    rows[-len(names) :],
                    lambda recipe, name=name, mode=mode: peak_alone(name, mode, recipe, args),
                )
                record()
    print(f"\nB={args.batch_size} T={args.seq_len}, tokens/s ratios to the cast BF16 baseline "
          f"in one process; peak memory: {args.memory}")  # fmt: skip
    harness.print_table(rows, COLUMNS)
    bench_model.print_profiles(rows)
    return rows


if __name__ == "__main__":
    main()
