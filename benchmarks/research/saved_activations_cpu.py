"""What one training step keeps for the backward, per recipe, at the bench_model shapes, on the
CPU with no GPU and no activation memory: the floor under a step's peak memory.

A step's peak is at least the parameter state (FP32 weights, gradients and AdamW's two moments:
16 bytes a parameter, the same for every recipe) plus what the forward saves for the backward.
This script counts the second term exactly as the GPU run would make it, on the kernel path
(`use_kernels` forced on: the Triton ops' fake impls give the shapes and dtypes the kernels
write), without running a kernel:

- compile: plain `torch.compile(model, fullgraph=True)` traced as Inductor traces it
  (AOTAutograd with its decompositions, its joint-graph passes and min-cut partitioner:
  `compile_fx.partition_fn`); the saved tensors are the forward graph's
  outputs past the user's, read from their fake values, and the run stops before anything
  executes. Parameters the backward takes as graph inputs are references, not counted.
- eager: the step's forward under FakeTensorMode, with `saved_tensors_hooks` collecting the
  unique storages autograd keeps (a view counts its whole storage), parameters left out.

Both under BF16 autocast, as bench_model.py's step. What this leaves out is the same for every
recipe to first order: the loss stage (the FP32 logits, their log-softmax and gradient) and the
allocator's slack. So with a measured BF16 peak (`--measured`, bench_model JSON files), a
recipe's peak is predicted as BF16's minus BF16's saved bytes plus the recipe's; a measured peak
above that prediction is memory the recipe holds beyond its saved tensors (backward workspaces,
buffers a compiled graph keeps longer). bench_model's step sets the gradients to None, so at
the end of the forward the parameter state is 12 bytes a parameter (weight and AdamW's two
moments); `floor_gib` adds the saved activations to it.

MoE models: bench_moe_model.py's (qwen3-30b-a3b, deepseek-v3, mixtral and their -tiny
variants), built as it builds them: FP32 masters, `bf16` the cast baseline (the experts'
grouped GEMMs on BF16 casts), a quantized recipe converted with every block quantized.

`--inductor-peak` (compile mode): also the peak of each compiled graph as Inductor plans it,
from its scheduler's buffer lifetimes in the order it picked (`torch._inductor.memory`), the
parameters left out: `fw_peak_gib` (the forward, its saved tensors included) and
`bw_peak_gib` (the backward: the saved tensors freed at their last use, the gradients it
returns kept). A full Inductor compile on the CPU (gcc builds the forward's kernels; about
30 s a row), stopped before the backward's code is generated. Opaque ops (the library's
kernels) count their outputs only, not what they allocate inside. Under both options the
GEMM operands are BF16, as on CUDA (the CPU path widens them to FP32).

`--peak-live N` (with `--inductor-peak`): also the N largest buffers live at each graph's planned
peak, with dtype, shape and the ops they came from (a graph input, e.g. a saved tensor, by name
only): how the Mixtral-like experts' FP32 activations were found (docs/MODELS.md, "Widened
inputs").

`--quantized-weights` adds a compiled nvfp4 row whose linears hold `QuantizedWeight`s (as under
FSDP2's quantized all-gather): it should save what the plain-weight row saves.

    python benchmarks/research/saved_activations_cpu.py --models llama-1b,llama-8b --modes compile,eager \\
        --measured docs/results/bench_model_llama1b_eager_recompute_h100.json,... \\
        --out docs/results/saved_activations_cpu.json     # (no TRITON_INTERPRET)
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib
import itertools
import json
import math
import sys
import time
from pathlib import Path

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._inductor import compile_fx
from torch._inductor.decomposition import select_decomp_table
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, from anywhere

import bench_moe_model  # noqa: E402
from bench_model import MODELS, RECIPES, build, logits_of  # noqa: E402

from blockscale import _library, distributed, recipes  # noqa: E402
from blockscale import nn as bsnn  # noqa: E402
from blockscale.gemm import dispatch as gemm_dispatch  # noqa: E402
from blockscale.gemm import grouped as gemm_grouped  # noqa: E402

_REFERENCE = _library.use_kernels  # where the kernels run (none on this CPU)

# the module (blockscale.ops re-exports the function `linear` under the same name)
linear_ops = importlib.import_module("blockscale.ops.linear")

# FP32 weight, AdamW exp_avg and exp_avg_sq; the gradients are None at the forward's end
PARAM_STATE_BYTES = 12
FLOAT_DTYPES = {"torch.bfloat16", "torch.float16", "torch.float32"}
QW_ROW = "nvfp4-quantized-weights"  # --quantized-weights' row


class _Stop(Exception):
    pass


def run_until_stopped(compiled, tokens: torch.Tensor) -> None:
    """One forward of a compiled model whose backend or pass ends the run by raising `_Stop`
    once it has what it needs: that exception, as Dynamo wraps it, is swallowed."""
    try:
        _logits(compiled, tokens)
    except Exception as e:  # Dynamo wraps the backend's exception
        if "_Stop" not in repr(e) and not isinstance(e.__cause__, _Stop):
            raise


def trace_partitioned(model: torch.nn.Module, tokens: torch.Tensor, partition) -> None:
    """Compile `model` (fullgraph) with AOTAutograd and `partition` as its partition function,
    the graphs left uncompiled; `partition` reads what it needs and raises `_Stop`. With
    Inductor's decompositions, as torch.compile traces: they turn a detach into the alias that
    Inductor's joint-graph passes drop, which lets the partitioner's CSE merge two calls that
    differ only by a detach (without them, a compiled backward's merge with the forward's
    weight copy went unseen here: docs/MODELS.md, "Counted")."""
    backend = aot_autograd(fw_compiler=lambda g, _: g, bw_compiler=lambda g, _: g,
                           partition_fn=partition,
                           decompositions=select_decomp_table())  # fmt: skip
    torch._dynamo.reset()
    run_until_stopped(torch.compile(model, backend=backend, fullgraph=True), tokens)


# ops whose output shares its input's storage: a saved tensor made by one is charged to the op
# that wrote the storage
_VIEWS = {"view", "_unsafe_view", "reshape", "t", "transpose", "permute", "slice", "select",
          "alias", "expand", "unsqueeze", "squeeze", "getitem"}  # fmt: skip


def _producer(node) -> str:
    """The op that wrote a saved node's storage, through views and tuple indexing."""
    while node.op == "call_function" and node.args:
        name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
        if name not in _VIEWS or not hasattr(node.args[0], "op"):
            break
        node = node.args[0]
    return str(node.target) if node.op == "call_function" else node.op


def _model(
    name: str, recipe: str, seq_len: int, quantized_weights: bool = False
) -> torch.nn.Module:
    """The bench_model (or bench_moe_model) model, its parameters allocated but never written
    (nothing runs). `quantized_weights`: its converted linears' weights replaced by `QuantizedWeight`s (NVFP4
    primary weights; FSDP2's quantized all-gather hands the layers the same kind), quantized
    from small random values on the CPU reference path."""
    if name in bench_moe_model.MODELS:
        spec = bench_moe_model.MODELS[name]
        # every block quantized, as this tool's rows were measured (bench_moe_model.py)
        meta = torch.device("meta")
        return bench_moe_model.build(spec, recipe, seq_len, meta, bf16_tail_fraction=0.0).to_empty(
            device="cpu"
        )
    model, _ = build(MODELS[name], None, seq_len, torch.device("meta"))
    model = model.to_empty(device="cpu")
    if recipe != "bf16":
        bsnn.convert(model, recipes.get(recipe), module_filter_fn=bsnn.layer_policy(model))
    if quantized_weights:
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.02)
        use_kernels, _library.use_kernels = _library.use_kernels, _REFERENCE
        try:
            distributed.to_nvfp4_primary_weights(model)
        finally:
            _library.use_kernels = use_kernels
    return model


def _logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return logits_of(model, tokens)


class _Cuda:
    type = "cuda"


@contextlib.contextmanager
def _cuda_operand_dtypes():
    """The GEMMs' `_dq` operands in BF16, as on CUDA (gemm/dispatch.py and gemm/grouped.py
    widen them to FP32 on other devices, which a trace would count as copies)."""
    dq_dtype, device, resolve = (
        gemm_grouped._dq_dtype, gemm_dispatch._device, gemm_dispatch.resolve_backend
    )  # fmt: skip
    cpu = torch.device("cpu")
    gemm_grouped._dq_dtype = lambda op: torch.bfloat16
    gemm_dispatch._device = lambda op: _Cuda  # read for the dtype and the backend only
    gemm_dispatch.resolve_backend = lambda b, d: resolve(b, cpu if d is _Cuda else d)
    try:
        yield
    finally:
        gemm_grouped._dq_dtype, gemm_dispatch._device = dq_dtype, device
        gemm_dispatch.resolve_backend = resolve


def _buffer_row(info) -> dict:
    """One buffer live at a planned peak: its name, size, dtype, shape and the ops it came
    from (an input of the graph, such as a saved tensor, has no dtype or ops here)."""
    buffer = info.buffer
    node = getattr(buffer, "node", None)
    try:
        layout = node.get_layout() if node is not None else None
    except (AttributeError, NotImplementedError):
        layout = None
    defining = getattr(buffer, "defining_op", None)
    origins = getattr(getattr(defining, "node", None), "origins", None) or ()
    return {
        "name": buffer.get_name() if hasattr(buffer, "get_name") else buffer.name,
        "gib": info.size_alloc / 2**30,
        "dtype": str(layout.dtype) if layout is not None else None,
        "shape": [int(d) for d in layout.size] if layout is not None else None,
        "ops": sorted({str(o.target) for o in origins}),
    }


def inductor_peaks(
    model: torch.nn.Module, tokens: torch.Tensor, live: int = 0
) -> dict[str, int | list]:
    """{"fw": bytes, "bw": bytes}: each compiled graph's peak as Inductor's scheduler plans it
    (module docstring, `--inductor-peak`); inputs named primals_* (the parameters) left out.
    `live` > 0: also "fw_live" and "bw_live", the `live` largest buffers live at each peak
    (`--peak-live`)."""
    import torch._inductor.config as inductor_config  # noqa: PLC0415
    import torch._inductor.memory as memory  # noqa: PLC0415

    peaks: dict[str, int] = {}
    reorder = memory.reorder_for_peak_memory

    def record(nodes, name_to_buf, name_to_fused_node, graph_inputs, graph_outputs, **kw):
        order = reorder(nodes, name_to_buf, name_to_fused_node, graph_inputs, graph_outputs,
                        **kw)  # fmt: skip
        _, freeable = memory.prepare_planning_info(
            order, name_to_buf, name_to_fused_node, graph_inputs, graph_outputs
        )
        infos, _, _ = memory.compute_memory_timeline(order, freeable, graph_outputs)
        delta = [0] * (len(order) + 2)
        counted = []
        for info in infos:
            buffer = info.buffer
            if isinstance(buffer, memory.FreeableInputBuffer) and buffer.name.startswith("primals"):
                continue  # a parameter: held for the whole step, in every recipe
            counted.append(info)
            delta[info.start_step] += info.size_alloc
            if info.end_step != -1:
                delta[info.end_step + 1] -= info.size_free
        by_step = list(itertools.accumulate(delta))
        graph = "bw" if "fw" in peaks else "fw"
        at = max(range(len(by_step)), key=by_step.__getitem__)
        peaks[graph] = by_step[at]
        if live:
            held = [
                i for i in counted if i.start_step <= at and (i.end_step == -1 or i.end_step >= at)
            ]
            held.sort(key=lambda i: -i.size_alloc)
            peaks[f"{graph}_live"] = [_buffer_row(i) for i in held[:live]]
        if "bw" in peaks:
            raise _Stop  # before the backward's code is generated
        return order

    memory.reorder_for_peak_memory = record
    torch._dynamo.reset()
    try:
        with (
            torch._functorch.config.patch(force_non_lazy_backward_lowering=True,
                                          enable_autograd_cache=False),
            inductor_config.patch(fx_graph_cache=False, reorder_for_peak_memory=True),
        ):  # fmt: skip
            run_until_stopped(torch.compile(model, fullgraph=True), tokens)
    finally:
        memory.reorder_for_peak_memory = reorder
    return peaks


def saved_compiled(model: torch.nn.Module, tokens: torch.Tensor) -> list[tuple[str, str, tuple]]:
    """(producer, dtype, shape, bytes) of each activation the compiled forward saves."""
    saved: list = []

    def partition(joint, joint_inputs, **kwargs):
        fw, bw = compile_fx.partition_fn(joint, joint_inputs, **kwargs)
        output = next(n for n in fw.graph.nodes if n.op == "output").args[0]
        for node in output[kwargs["num_fwd_outputs"] :]:
            value = node.meta.get("val") if hasattr(node, "meta") else None
            if node.op == "placeholder" or not isinstance(value, torch.Tensor):
                continue  # a graph input (a parameter) or a symbolic size
            nbytes = value.numel() * value.element_size()
            saved.append((_producer(node), str(value.dtype), tuple(value.shape), nbytes))
        raise _Stop

    trace_partitioned(model, tokens, partition)
    return saved


def saved_eager(model: torch.nn.Module, tokens: torch.Tensor) -> list[tuple[str, str, tuple]]:
    """The same for an eager forward, run on fake tensors (the producer is not known: "?").

    Eager linears that read one input tensor share its quantization (ops/linear.py, "Shared
    input"), which the library turns off under any trace mode, FakeTensorMode included; linear
    is told it is not tracing here, so the count keeps one saved copy per input as a real eager
    step does."""
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    seen: dict[StorageWeakRef, tuple] = {}
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake = {name: mode.from_tensor(t, static_shapes=True) for name, t in params.items()}
        for name, t in fake.items():
            t.requires_grad_(params[name].requires_grad)
        held = {StorageWeakRef(t.untyped_storage()) for t in fake.values()}
        fake.update({name: mode.from_tensor(t) for name, t in buffers.items()})
        ids = mode.from_tensor(tokens)

        def pack(t: torch.Tensor) -> torch.Tensor:
            ref = StorageWeakRef(t.untyped_storage())
            if ref not in held and ref not in seen:
                seen[ref] = ("?", str(t.dtype), tuple(t.shape), t.untyped_storage().nbytes())
            return t

        # linear's eager-only rules (the shared input) read `tracing()` in its own namespace;
        # the library ops keep taking the op route (fake impls) through _registry's
        tracing = linear_ops.tracing
        linear_ops.tracing = lambda: False
        try:
            with (
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
                torch.autocast("cpu", dtype=torch.bfloat16),
            ):
                torch.func.functional_call(model, fake, (ids,))
        finally:
            linear_ops.tracing = tracing
            linear_ops._SHARED.clear()
            # (the loss adds the same for every recipe: the FP32 logits' log-softmax)
    return list(seen.values())


def summarize(saved: list) -> dict:
    by_dtype: dict[str, int] = collections.Counter()
    by_site: dict[tuple, int] = collections.Counter()
    for target, dtype, shape, nbytes in saved:
        by_dtype[dtype] += nbytes
        by_site[(target, dtype, shape)] += nbytes
    top = sorted(by_site.items(), key=lambda kv: -kv[1])[:12]
    # a quantize op's floating outputs are its `_dq` operands (and amax scalars): a `_dq` saved
    # for backward is the BF16 copy the packed codes exist to avoid
    dq_bytes = sum(
        nbytes
        for target, dtype, shape, nbytes in saved
        if "quantize" in target and dtype in FLOAT_DTYPES and math.prod(shape) > 2
    )
    return {
        "saved_gib": sum(by_dtype.values()) / 2**30,
        "saved_bytes": sum(by_dtype.values()),
        "quantize_float_outputs_bytes": dq_bytes,
        "by_dtype_gib": {k: v / 2**30 for k, v in sorted(by_dtype.items())},
        "largest": [
            {"op": t, "dtype": d, "shape": list(s), "gib": b / 2**30} for (t, d, s), b in top
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama-1b")
    parser.add_argument("--recipes", default="bf16,nvfp4,mxfp8")
    parser.add_argument("--modes", default="compile,eager")
    parser.add_argument("--batch-size", type=int, default=0, help="0: 8 for 1B shapes, 4 for 8B")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--measured", default="", help="comma list of bench_model JSON files")
    parser.add_argument("--quantized-weights", action="store_true",
                        help="also count compiled nvfp4 with QuantizedWeight weights "
                        "(recipe row 'nvfp4-quantized-weights')")  # fmt: skip
    parser.add_argument("--inductor-peak", action="store_true",
                        help="compile mode: also each compiled graph's peak as Inductor plans "
                        "it (fw_peak_gib, bw_peak_gib; module docstring)")  # fmt: skip
    parser.add_argument("--peak-live", type=int, default=0, metavar="N",
                        help="with --inductor-peak: also the N largest buffers live at each "
                        "graph's peak (fw_peak_live, bw_peak_live), printed and in the JSON")  # fmt: skip
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    _library.use_kernels = lambda t: True  # the kernel path's ops, as on CUDA

    measured = {}
    for path in filter(None, args.measured.split(",")):
        for r in json.loads(Path(path).read_text())["rows"]:
            if r.get("status") == "ok":
                measured[(r["model"], r["mode"], r["recipe"])] = r["peak_gib"]
    rows = []
    for name in args.models.split(","):
        if name not in MODELS and name not in bench_moe_model.MODELS:
            parser.error(f"unknown model {name!r}")
        batch = args.batch_size or (4 if name == "llama-8b" else 8)
        modes = args.modes.split(",")
        if name in bench_moe_model.MODELS and "eager" in modes:
            # transformers' experts read the routing on the host, which fake tensors cannot give
            print(f"{name}: compile mode only (an eager MoE forward cannot run on fake tensors)")
            modes.remove("eager")
        tokens = torch.zeros(batch, args.seq_len, dtype=torch.long)
        for mode in modes:
            base = None
            names = args.recipes.split(",")
            moe = name in bench_moe_model.MODELS
            if args.quantized_weights and mode == "compile" and "nvfp4" in names and not moe:
                names.append(QW_ROW)
            for recipe in names:
                if recipe not in RECIPES and recipe != QW_ROW and not moe:
                    parser.error(f"unknown recipe {recipe!r}")
                start = time.perf_counter()
                model = _model(name, recipe.split("-")[0], args.seq_len, recipe == QW_ROW)
                n_params = sum(p.numel() for p in model.parameters())
                with _cuda_operand_dtypes():
                    saved = (saved_compiled if mode == "compile" else saved_eager)(model, tokens)
                    peaks = {}
                    if args.inductor_peak and mode == "compile":
                        peaks = inductor_peaks(model, tokens, args.peak_live)
                row = {"model": name, "mode": mode, "recipe": recipe, "batch": batch,
                       "seq_len": args.seq_len, "params_m": n_params / 1e6,
                       "param_state_gib": n_params * PARAM_STATE_BYTES / 2**30,
                       **summarize(saved)}  # fmt: skip
                row["floor_gib"] = row["param_state_gib"] + row["saved_gib"]
                for k in ("fw", "bw"):
                    if k in peaks:
                        row[f"{k}_peak_gib"] = peaks[k] / 2**30
                    if f"{k}_live" in peaks:
                        row[f"{k}_peak_live"] = peaks[f"{k}_live"]
                base = row if recipe == "bf16" else base
                line = ""
                if base is not None:
                    row["saved_vs_bf16"] = row["saved_gib"] / base["saved_gib"]
                    row["floor_vs_bf16"] = row["floor_gib"] / base["floor_gib"]
                    line = f"(x{row['saved_vs_bf16']:.3f}), floor x{row['floor_vs_bf16']:.3f}"
                    for k in ("fw", "bw"):
                        if f"{k}_peak_gib" in row and f"{k}_peak_gib" in base:
                            row[f"{k}_peak_vs_bf16"] = row[f"{k}_peak_gib"] / base[f"{k}_peak_gib"]
                            line += f", {k} peak {row[f'{k}_peak_gib'] * 1024:.1f} MiB"
                            line += f" (x{row[f'{k}_peak_vs_bf16']:.3f})"
                bf16_peak = measured.get((name, mode, "bf16"))
                if base is not None and bf16_peak:
                    row["predicted_peak_gib"] = bf16_peak - base["saved_gib"] + row["saved_gib"]
                    row["predicted_vs_bf16"] = row["predicted_peak_gib"] / bf16_peak
                    line += f", peak predicted x{row['predicted_vs_bf16']:.3f}"
                    peak = measured.get((name, mode, recipe))
                    if peak:
                        row["measured_peak_gib"] = peak
                        row["measured_vs_bf16"] = peak / bf16_peak
                        row["held_beyond_saved_gib"] = peak - row["predicted_peak_gib"]
                        line += (f", measured x{row['measured_vs_bf16']:.3f} "
                                 f"({row['held_beyond_saved_gib']:+.2f} GiB)")  # fmt: skip
                rows.append(row)
                del model
                print(
                    f"{name:9s} {mode:8s} {recipe:20s} saved {row['saved_gib']:6.2f} GiB {line} "
                    f"[{time.perf_counter() - start:.0f} s]",
                    flush=True,
                )
                for k in ("fw", "bw"):
                    for b in row.get(f"{k}_peak_live", []):
                        what = f"{b['dtype']} {tuple(b['shape'])}" if b["shape"] else "(input)"
                        ops = ",".join(b["ops"])[:80]
                        print(f"    {k} peak: {b['gib']:6.3f} GiB  {b['name']}  {what}  {ops}")
    if args.out:
        info = {"torch": torch.__version__, "device": "cpu (fake tensors)", "argv": sys.argv[1:]}
        Path(args.out).write_text(json.dumps({"info": info, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
