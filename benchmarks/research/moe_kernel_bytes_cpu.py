"""Bytes (and GEMM FLOPs) each blockscale kernel moves in one compiled MoE training step, counted
on the CPU from the traced graphs, set against an H200 profile of the same step.

For each bench_moe_model.py model (real shapes, B=8, T=2048) and recipe, one compiled step is
traced as saved_activations_cpu.py traces it (its `_model` and `_cuda_operand_dtypes`;
`use_kernels` forced on, so the graphs hold the kernel path's `blockscale::` ops with their fake
impls' shapes; compile mode, as transformers' experts need on fake tensors), split by
Inductor's own partition function (its joint-graph passes, then the min-cut partitioner), and
nothing executes. Every `blockscale::` node of the forward and backward graphs is listed (op,
inputs' and outputs' shapes and dtypes; `--calls` prints them, --out keeps them) and charged:

- bytes read: each tensor input whole (numel x itemsize of the view the op is handed). For
  the grouped quantize / group amax ops walking a token layout that is x's M rows once each
  (a padding position, source -1, reads nothing; every row of x is one position) plus the
  layout, source and group int32 [P] (8 bytes a position, padding included); for expert
  weights [E*N, K] (no source), the rows plus a 4-byte group a row. A GEMM reads each
  operand once (a floor: tiles re-read from L2 or HBM are not charged). A mutated `out`
  (the grouped GEMMs) is written, not read. The Hadamard matrix (a constant) is left out.
- bytes written: every output (empty ones, for copies not asked for, are 0 bytes);
- FLOPs of GEMM ops: 2*M*N*K with M the operand's total rows, summed over the groups (the
  grad_weight GEMM's contraction is the layout's P positions, padding included).

Ops map to the Triton kernels they launch (kernels/*.py): nvfp4_quantize_grouped_2d ->
`_nvfp4_grouped_kernel` (activations through a layout, and expert weights [E*N, K] through
`_expert_rows`), group_amax_2d -> `_group_amax_kernel`, grouped_gemm_rows -> `_rows_kernel`,
grouped_gemm_tokens -> `_tokens_kernel`, amax_2d -> `_amax_kernel` / `_amax_rht_kernel`,
saved_operand_dq -> `_{nvfp4,mxfp8}_dequantize_kernel`, emulated_gemm -> `_gemm_kernel` or
cuBLAS (+ `_epilogue_kernel`) as dispatch.py's `_gemm` picks from the dtypes and K (TMA
alignment assumed). A call is tagged `weight` where its input is an FP32 master weight (a
graph input, through views) or 3-D (an expert weight's codes dequantized), else `act`
(activations and gradients); `recompute` where the backward repeats a forward call on the
same weight with the same flags (the partitioner's choice). With --profile-json
(bench_moe_model.py --profile files), each kernel's launches are compared with the profile's;
where the trace has more by exactly its recomputes, those are left out of the figures (a
note says so). The profile's time gives GB/s, the % of --peak-tbs, `lost` = ms -
bytes/peak, TFLOP/s and the % of --peak-tflops for GEMMs, and `rooflost` = ms - the larger of
the byte and FLOP floors. The cast BF16 baseline's CUTLASS grouped GEMMs (profile) are set
against the same FLOPs.

Left out: kernels that are not blockscale's (Inductor's fused kernels, cuBLAS, attention,
AdamW), the loss, and profile kernels outside the profile's top-N list (their ms is unknown:
"-"; qwen3-30b-a3b has no profile yet). The profile gives each kernel name's total over its
launches, so time cannot be split between a kernel's weight and activation launches.

    .venv/bin/python benchmarks/research/moe_kernel_bytes_cpu.py \\
        --models deepseek-v3,mixtral,qwen3-30b-a3b --recipes nvfp4,mxfp8 \\
        --profile-json docs/results/moe_deepseek_compiled_process_h200.json,\\
docs/results/moe_mixtral_compiled_process_h200.json \\
        --out docs/results/moe_kernel_bytes_cpu.json      # ~1 min on 2 CPU cores
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import torch
from torch._higher_order_ops.auto_functionalize import auto_functionalized, auto_functionalized_v2
from torch._inductor import compile_fx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/research/
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/

from saved_activations_cpu import _cuda_operand_dtypes, _model, _Stop, trace_partitioned  # noqa: E402

from blockscale import _library  # noqa: E402
from blockscale.gemm import dispatch  # noqa: E402

GROUPED_GEMM_KERNELS = ("_rows_kernel", "_tokens_kernel")
_PASS = {"view", "_unsafe_view", "reshape", "t", "transpose", "permute", "alias", "expand",
         "unsqueeze", "squeeze", "slice", "select", "contiguous", "clone", "as_strided"}  # fmt: skip


def trace(model: torch.nn.Module, tokens: torch.Tensor) -> dict[str, torch.fx.GraphModule]:
    """{"fw": graph, "bw": graph} of one compiled step, partitioned as Inductor partitions it."""
    graphs: dict[str, torch.fx.GraphModule] = {}

    def partition(joint, joint_inputs, **kwargs):
        graphs["fw"], graphs["bw"] = compile_fx.partition_fn(joint, joint_inputs, **kwargs)
        raise _Stop

    trace_partitioned(model, tokens, partition)
    return graphs


def _val(x):
    return x.meta.get("val") if isinstance(x, torch.fx.Node) else x


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _desc(t) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def _call(node: torch.fx.Node):
    """(op name, {argument: node or constant}, mutated argument names, outputs) of a
    `blockscale::` node, also one wrapped in auto_functionalized; None for other nodes."""
    if node.op != "call_function":
        return None
    target, kwargs, mutated = node.target, dict(node.kwargs), set()
    if target in (auto_functionalized, auto_functionalized_v2):
        target = node.args[0]
        bases = kwargs.pop("_all_bases", [])
        for arg in target._schema.arguments:
            if arg.alias_info is not None and arg.alias_info.is_write:
                mutated.add(arg.name)
                index = kwargs.pop(f"_{arg.name}_base_index", None)
                if index is not None:
                    kwargs[arg.name] = bases[index]
    elif not isinstance(target, torch._ops.OpOverload):
        return None
    if target.namespace != "blockscale":
        return None
    named = dict(zip((a.name for a in target._schema.arguments), node.args, strict=False))
    named.update(kwargs)
    out = _val(node)
    outs = [o for o in (out if isinstance(out, (tuple, list)) else [out]) if o is not None]
    if mutated:
        outs = [_val(named[m]) for m in mutated]
    return target._schema.name.split("::")[1], named, mutated, outs


def _weight(x) -> str | None:
    """The graph input x is a view of if that input is FP32 (a master weight), else None."""
    while isinstance(x, torch.fx.Node) and x.op == "call_function":
        name = getattr(x.target, "__name__", str(x.target)).split(".")[0]
        if name not in _PASS or not x.args:
            return None
        x = x.args[0]
    if isinstance(x, torch.fx.Node) and x.op == "placeholder" and _val(x).dtype == torch.float32:
        return x.name
    return None


def kernel_of(op: str, a: dict) -> str:
    """The Triton kernel (or cuBLAS) a call launches, as kernels/*.py and dispatch.py pick."""
    v = {k: _val(x) for k, x in a.items()}
    if op == "amax_2d":
        return "_amax_rht_kernel" if v["hadamard_t"] else "_amax_kernel"
    if op in ("saved_operand_dq",):
        return "_mxfp8_dequantize_kernel" if v["amax"] is None else "_nvfp4_dequantize_kernel"
    if op == "emulated_gemm":
        epilogue = v["amax_a"] is not None or v["bias"] is not None
        fused_fp32 = epilogue and v["a_dq"].shape[1] <= dispatch.FUSED_FP32_MAX_K
        if v["out_dtype"] == torch.float32 and not fused_fp32:
            return "cublas+_epilogue_kernel" if epilogue else "cublas"
        if not epilogue and v["out_dtype"] == torch.bfloat16 == v["a_dq"].dtype:
            return "cublas"
        return "_gemm_kernel"
    named = {"grouped_gemm_rows": "_rows_kernel", "grouped_gemm_rows_packed": "_rows_kernel",
             "grouped_gemm_tokens": "_tokens_kernel", "group_amax_2d": "_group_amax_kernel",
             "nvfp4_quantize_grouped_2d": "_nvfp4_grouped_kernel",
             "mxfp8_quantize_grouped_2d": "_mxfp8_grouped_kernel",
             "nvfp4_quantize_2d": "_nvfp4_quantize_kernel",
             "mxfp8_quantize_2d": "_mxfp8_quantize_kernel",
             "nvfp4_dequantize_3d": "_nvfp4_dequantize_kernel",
             "mxfp8_dequantize_3d": "_mxfp8_dequantize_kernel"}  # fmt: skip
    return named.get(op, f"? ({op})")


def charge(op: str, a: dict, mutated: set, outs: list) -> tuple[int, int, int]:
    """(bytes read, bytes written, FLOPs) of one call (module docstring)."""
    v = {k: _val(x) for k, x in a.items()}
    read = sum(_nbytes(t) for k, t in v.items() if k not in mutated)
    written = sum(_nbytes(t) for t in outs)
    flops = 0
    if op in ("grouped_gemm_rows", "grouped_gemm_rows_packed"):
        (m, k), n = v["a"].shape, v["out"].shape[1]
        flops = 2 * m * n * k
    elif op == "grouped_gemm_tokens":
        (n, p), k = v["a"].shape, v["b"].shape[0]
        flops = 2 * n * k * p
    elif op == "emulated_gemm":
        (m, k), n = v["a_dq"].shape, v["b_dq"].shape[0]
        flops = 2 * m * n * k
    return read, written, flops


def calls_of(graphs: dict[str, torch.fx.GraphModule]) -> list[dict]:
    calls, quantized = [], set()
    for part, gm in graphs.items():
        for node in gm.graph.nodes:
            got = _call(node)
            if got is None:
                continue
            op, a, mutated, outs = got
            read, written, flops = charge(op, a, mutated, outs)
            tensors = {k: _val(x) for k, x in a.items() if isinstance(_val(x), torch.Tensor)}
            first = a.get("x", a.get("a", a.get("a_dq", a.get("data"))))
            # the backward making what the forward made of a weight (same op, input and
            # flags): the partitioner's recompute (not a copy the forward did not make)
            weight = _weight(first)
            flags = tuple((k, x) for k, x in a.items() if isinstance(x, (bool, int, float)))
            recompute = part == "bw" and weight is not None and (op, weight, flags) in quantized
            if part == "fw" and weight is not None:
                quantized.add((op, weight, flags))
            calls.append({
                "graph": part, "op": op, "kernel": kernel_of(op, a), "recompute": recompute,
                "kind": "weight" if weight or _val(first).dim() == 3 else "act",
                "inputs": {k: _desc(t) for k, t in tensors.items() if k not in mutated},
                "outputs": [_desc(t) for t in outs],
                "read": read, "written": written, "flops": flops,
            })  # fmt: skip
    return calls


def by_op(calls: list[dict]) -> list[dict]:
    """Per op name: calls (of them on weights, and backward recomputes), bytes, FLOPs."""
    ops: dict[str, dict] = {}
    for c in calls:
        r = ops.setdefault(c["op"], {"op": c["op"], "kernels": set(), "calls": 0,
                                     "weight_calls": 0, "recompute_calls": 0, "read": 0,
                                     "written": 0, "flops": 0})  # fmt: skip
        r["kernels"].add(c["kernel"])
        r["calls"] += 1
        r["weight_calls"] += c["kind"] == "weight"
        r["recompute_calls"] += c["recompute"]
        for k in ("read", "written", "flops"):
            r[k] += c[k]
    for r in ops.values():
        r["kernels"] = sorted(r["kernels"])
    return sorted(ops.values(), key=lambda r: -r["read"] - r["written"])


def profile_kernels(paths: list[str]) -> dict[tuple[str, str], dict[str, list[float]]]:
    """{(model, recipe): {kernel: [launches, ms]}} from bench_moe_model --profile JSON files."""
    found: dict = {}
    for path in paths:
        for row in json.loads(Path(path).read_text())["rows"]:
            if row.get("mode") != "compile" or "profile" not in row:
                continue
            kernels: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
            for k in row["profile"]["top_kernels"]:
                kernels[k["name"]][0] += k["count"]
                kernels[k["name"]][1] += k["ms"]
            found[(row["model"], row["recipe"])] = dict(kernels)
    return found


def table(
    calls: list[dict], profile: dict | None, peak_tbs: float, peak_tflops: float
) -> list[dict]:
    """One row per kernel: launches, bytes (of them the weights'), FLOPs; with a profile, its
    launches and ms, GB/s, % of the copy ceiling, ms lost against it, TFLOP/s (and % of
    `peak_tflops`), ms lost against the roofline (the larger of the two floors). Where the trace
    has more launches than the profile by exactly its backward recomputes of weight
    quantizations (module docstring), those are left out of the figures, with a note."""
    rows: dict[str, dict] = {}
    for c in calls:
        r = rows.setdefault(c["kernel"], {"kernel": c["kernel"], "ops": set(), "launches": 0,
                                          "recompute_launches": 0, "calls": []})  # fmt: skip
        r["ops"].add(c["op"])
        r["launches"] += 1
        r["recompute_launches"] += c["recompute"]
        r["calls"].append(c)
    for r in rows.values():
        calls_in, r["note"] = r.pop("calls"), ""
        got = profile.get(r["kernel"]) if profile is not None else None
        if got is not None and got[0] != r["launches"]:
            r["note"] = f"trace {r['launches']} launches, profile {got[0]:.0f}"
            if r["launches"] - r["recompute_launches"] == got[0]:
                calls_in = [c for c in calls_in if not c["recompute"]]
                r["note"] += ": the profile's step did not recompute the backward's weight "
                r["note"] += f"quantizations ({r['recompute_launches']}), left out here"
        r["ops"] = sorted(r["ops"])
        r["counted_launches"] = len(calls_in)
        r["bytes"] = sum(c["read"] + c["written"] for c in calls_in)
        r["weight_launches"] = sum(c["kind"] == "weight" for c in calls_in)
        r["weight_bytes"] = sum(c["read"] + c["written"] for c in calls_in if c["kind"] == "weight")
        r["flops"] = sum(c["flops"] for c in calls_in)
        r["floor_ms"] = r["bytes"] / (peak_tbs * 1e12) * 1e3
        if got is not None:
            launches, ms = got
            r.update(profile_launches=launches, profile_ms=ms, gbs=r["bytes"] / ms / 1e6)
            r["pct_peak"] = 100 * r["floor_ms"] / ms
            r["lost_ms"] = ms - r["floor_ms"]
            if r["flops"]:
                r["tflops"] = r["flops"] / ms / 1e9
                r["pct_peak_tflops"] = 100 * r["tflops"] / peak_tflops
            # against the roofline: a GEMM's floor is its FLOPs at peak_tflops where higher
            flop_ms = r["flops"] / (peak_tflops * 1e12) * 1e3
            r["roof_lost_ms"] = ms - max(r["floor_ms"], flop_ms)
    return sorted(rows.values(), key=lambda r: -r.get("profile_ms", 0) - r["bytes"] * 1e-15)


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_table(name: str, recipe: str, rows: list[dict], peak_tbs: float) -> None:
    print(f"\n{name} {recipe}: launches trace/profile, GB moved (weight GB), profile ms, "
          f"GB/s, % of {peak_tbs} TB/s, ms lost to the byte floor, TFLOP/s (% of the BF16 "
          "ceiling), ms lost to the roofline")  # fmt: skip
    print(f"{'kernel':26s} {'launch':>9s} {'GB':>7s} {'(wt)':>7s} {'ms':>7s} {'GB/s':>7s} "
          f"{'%peak':>6s} {'lost':>6s} {'TFLOP/s':>8s} {'%TF':>5s} {'rooflost':>8s}")  # fmt: skip
    for r in rows:
        launches = f"{r['launches']}/{_fmt(r.get('profile_launches'), 'd')}"
        launches += "*" if r["note"] else ""
        print(f"{r['kernel'][:26]:26s} {launches:>9s} {r['bytes'] / 1e9:7.3f} "
              f"{r['weight_bytes'] / 1e9:7.3f} {_fmt(r.get('profile_ms'), '7.2f'):>7s} "
              f"{_fmt(r.get('gbs'), '7.0f'):>7s} {_fmt(r.get('pct_peak'), '6.1f'):>6s} "
              f"{_fmt(r.get('lost_ms'), '6.2f'):>6s} {_fmt(r.get('tflops'), '8.1f'):>8s} "
              f"{_fmt(r.get('pct_peak_tflops'), '5.1f'):>5s} "
              f"{_fmt(r.get('roof_lost_ms'), '8.2f'):>8s}")  # fmt: skip
    for r in rows:
        if r["note"]:
            print(f"  * {r['kernel']}: {r['note']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="deepseek-v3,mixtral,qwen3-30b-a3b")
    parser.add_argument("--recipes", default="nvfp4,mxfp8")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--profile-json", default="", help="comma list of bench_moe_model JSON")
    parser.add_argument("--peak-tbs", type=float, default=4.8, help="copy ceiling, TB/s")
    parser.add_argument("--peak-tflops", type=float, default=790.0,
                        help="BF16 dense GEMM ceiling, TFLOP/s (BENCHMARKS.md: H200 ~790)")  # fmt: skip
    parser.add_argument("--calls", action="store_true", help="print every blockscale:: call")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    _library.use_kernels = lambda t: True  # the kernel path's ops, as on CUDA
    profiles = profile_kernels([p for p in args.profile_json.split(",") if p])
    results = []
    for name in args.models.split(","):
        tokens = torch.zeros(args.batch_size, args.seq_len, dtype=torch.long)
        for recipe in args.recipes.split(","):
            start = time.perf_counter()
            model = _model(name, recipe, args.seq_len)
            with _cuda_operand_dtypes():
                calls = calls_of(trace(model, tokens))
            del model
            rows = table(calls, profiles.get((name, recipe)), args.peak_tbs, args.peak_tflops)
            if args.calls:
                for c in calls:
                    print(f"  {c['graph']} {c['op']:26s} {c['kind']:6s} {c['inputs']} -> "
                          f"{c['outputs']} {(c['read'] + c['written']) / 1e6:.1f} MB")  # fmt: skip
            ops = by_op(calls)
            print(f"\n{name} {recipe}: blockscale:: ops (calls, on weights, backward "
                  "recomputes), GB read, GB written, TFLOP")  # fmt: skip
            for r in ops:
                print(f"  {r['op']:26s} {r['calls']:3d} {r['weight_calls']:3d} "
                      f"{r['recompute_calls']:3d} {r['read'] / 1e9:7.3f} {r['written'] / 1e9:7.3f} "
                      f"{r['flops'] / 1e12:6.2f}  -> {', '.join(r['kernels'])}")  # fmt: skip
            print_table(name, recipe, rows, args.peak_tbs)
            base = profiles.get((name, "bf16"))
            if base is not None:  # the cast baseline's grouped GEMMs, at the same FLOPs
                cutlass = [v for k, v in base.items() if k.startswith("_ZN7cutlass")]
                launches, ms = sum(v[0] for v in cutlass), sum(v[1] for v in cutlass)
                flops = sum(r["flops"] for r in rows if r["kernel"] in GROUPED_GEMM_KERNELS)
                ours = sum(r.get("profile_ms", 0) for r in rows
                           if r["kernel"] in GROUPED_GEMM_KERNELS)  # fmt: skip
                print(f"bf16 CUTLASS grouped GEMMs (profile): {launches:.0f} launches, {ms:.2f} "
                      f"ms, {flops / ms / 1e9:.1f} TFLOP/s at the traced grouped FLOPs "
                      f"({flops / 1e12:.2f} TFLOP; {recipe}'s rows + tokens: {ours:.2f} ms)")  # fmt: skip
            print(f"[traced in {time.perf_counter() - start:.0f} s]", flush=True)
            results.append({"model": name, "recipe": recipe, "batch": args.batch_size,
                            "seq_len": args.seq_len, "peak_tbs": args.peak_tbs,
                            "profiled": (name, recipe) in profiles, "kernels": rows, "ops": ops,
                            "calls": calls})  # fmt: skip
    if args.out:
        info = {"torch": torch.__version__, "device": "cpu (fake tensors)", "argv": sys.argv[1:]}
        Path(args.out).write_text(json.dumps({"info": info, "rows": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
