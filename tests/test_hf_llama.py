"""A model nobody here wrote: transformers' LlamaForCausalLM (tiny, random init) converted with
the layer policy, trained, compiled with fullgraph=True, and what it saves for backward; plus
benchmarks/bench_model.py's CPU smoke test.

Compiled == eager, and where the bits can match. Dynamo + AOTAutograd (`backend="aot_eager"`)
run the traced graph op for op, so the loss and every gradient must equal eager's. Under
Inductor the model's own BF16 parts do not give eager's bits even unconverted (its fused
RMSNorm, softmax and SiLU backward sum in another order: FP32 differences of ~1e-8, measured),
and a quantized backward turns such a difference into a different rounding decision now and
then; so there the forward loss must match bit for bit (the quantized forward reads the same
inputs) and the gradients within a band. The quantized linears' own compiled numerics are
checked bit for bit in tests/test_compile.py.
"""

import importlib
import json
import logging
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import blockscale.nn as bsnn
from blockscale import recipes
from blockscale.recipes import Format

transformers = pytest.importorskip("transformers")

VOCAB = 128


def tiny_llama(layers: int = 2) -> nn.Module:
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
        attn_implementation="sdpa", use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def exact(name: str) -> recipes.Recipe:
    """The recipe without stochastic rounding (compiled draws are not eager's draws)."""
    switches = {"stochastic_rounding": False} if name == "nvfp4" else {}
    return recipes.get(name, **switches)


def tokens(batch: int = 2, seq: int = 32, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq + 1), generator=torch.Generator().manual_seed(seed))


def loss_and_grads(model: nn.Module, fn, ids: torch.Tensor):
    model.zero_grad(set_to_none=True)
    logits = fn(ids[:, :-1]).logits
    loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_layer_policy_keeps_head_embeddings_and_tail_block_bf16(caplog):
    model = tiny_llama(layers=4)
    with caplog.at_level(logging.INFO, logger="blockscale.nn.convert"):
        bsnn.convert(model, recipes.get("nvfp4"), module_filter_fn=bsnn.layer_policy(model))
    assert type(model.lm_head) is nn.Linear
    assert type(model.model.embed_tokens) is nn.Embedding
    for i, layer in enumerate(model.model.layers):
        linears = [m for m in layer.modules() if isinstance(m, nn.Linear)]
        assert len(linears) == 7
        converted = [isinstance(m, bsnn.Linear) for m in linears]
        # 15% of 4 blocks rounds to 1: the last block stays BF16.
        assert all(converted) if i < 3 else not any(converted), (i, converted)
    assert "converted 21 of 29 linears to recipe nvfp4" in caplog.text


@pytest.mark.parametrize("name", ["nvfp4", "mxfp8"])
def test_converted_llama_trains(name):
    model = tiny_llama()
    bsnn.convert(model, recipes.get(name), module_filter_fn=bsnn.layer_policy(model))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = tokens()
    losses = []
    for _ in range(6):
        loss, _ = loss_and_grads(model, model, ids)
        optimizer.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.1, losses  # ln(128) = 4.85 at the start


@pytest.mark.parametrize("name", ["nvfp4", "mxfp8", "nvfp4_fwd_mxfp8_bwd"])
def test_fullgraph_trace_equals_eager_bit_for_bit(name):
    """One graph, no break, and the traced graph run op for op gives eager's loss and grads;
    an optimizer step and a second batch compile nothing more (no recompile per layer or per
    step: every converted block's linears are traced into the one frame)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = tiny_llama(layers=3)
    bsnn.convert(model, exact(name), module_filter_fn=bsnn.layer_policy(model, 0.3))
    ids = tokens()
    eager = loss_and_grads(model, model, ids)
    compiled_model = torch.compile(model, fullgraph=True, backend="aot_eager")
    compiled = loss_and_grads(model, compiled_model, ids)
    assert torch.equal(eager[0], compiled[0])
    differ = [n for n in eager[1] if not torch.equal(eager[1][n], compiled[1][n])]
    assert not differ, differ
    torch.optim.AdamW(model.parameters(), lr=1e-3).step()
    loss_and_grads(model, compiled_model, tokens(seed=2))
    assert counters["stats"]["unique_graphs"] == 1 and counters["aot_autograd"]["total"] == 1, (
        counters
    )
    torch._dynamo.reset()


def test_inductor_compiled_llama_loss_equals_eager():
    """Plain torch.compile, as a user writes it: no Inductor options (on the CPU, Inductor's C++
    keeps IEEE division and every rounding the references spell out; on CUDA the quantizers
    are opaque ops)."""
    torch._dynamo.reset()
    model = tiny_llama()
    bsnn.convert(model, exact("nvfp4"), module_filter_fn=bsnn.layer_policy(model, 0.5))
    ids = tokens()
    eager = loss_and_grads(model, model, ids)
    fn = torch.compile(model, fullgraph=True)
    compiled = loss_and_grads(model, fn, ids)
    assert torch.equal(eager[0], compiled[0])
    for n, g in eager[1].items():
        # A gradient's error from one flipped NVFP4 rounding (of 2^-3 relative, in one of the
        # 16-value blocks that feed it) stays far below 5% of the gradient's norm.
        err = (compiled[1][n] - g).norm() / g.norm()
        assert err < 0.05, (n, err.item())
    torch._dynamo.reset()


# ------------------------------------------------------------------ saved for backward


def packed_bytes(values: int, fmt: Format) -> float:
    """Bytes of `values` quantized: NVFP4 4-bit codes + an E4M3 scale per 16 + the amax, which on
    CUDA is one element of the amax kernel's 2-float (plain, Hadamard) buffer, so its saved view
    keeps 8 bytes alive; MXFP8 8-bit codes + an E8M0 scale per 32."""
    if fmt is Format.NVFP4:
        return values / 2 + values / 16 + 8
    return values + values / 32


def _amax_pool_storages() -> dict[int, int]:
    """Address -> bytes of kernels/amax.py's zeroed-pair blocks now (CUDA eager calls take
    each amax from one: 512 pairs, 8 KiB, freed with the last amax viewing it)."""
    # (by its module path: the package's `amax` is the function of that name)
    amax_kernels = importlib.import_module("blockscale.kernels.amax")  # (needs Triton)

    storages = [b[0].untyped_storage() for b in amax_kernels._ZEROED.blocks.values()]
    return {s.data_ptr(): s.nbytes() for s in storages}


def saved_bytes_per_converted_linear(model: nn.Module, ids: torch.Tensor) -> dict[str, int]:
    """Bytes of the unique storages each blockscale Linear saves for backward (a view saved
    counts its whole storage: a BF16 buffer kept alive through a view is caught), beside the
    model's parameters: a weight saved itself is a reference to memory held anyway. An amax
    from the amax kernels' pool of zeroed pairs counts its own bytes: the pool block is shared
    by up to 512 amaxes (on the H200 a saved weight amax counted as the block's 8192 bytes)."""
    storages: dict[str, dict[int, int]] = {}
    current: list[str] = []
    held = {p.untyped_storage().data_ptr() for p in model.parameters()}
    # every pool block seen since the forward began (a block handed out amaxes in this
    # linear's forward was in the pool at its start or is still there at its save)
    pooled = ids.device.type == "cuda"
    pool = _amax_pool_storages() if pooled else {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if pooled:
            pool.update(_amax_pool_storages())
        if current and s.data_ptr() not in held:
            if pool.get(s.data_ptr()) == s.nbytes():
                storages[current[-1]][t.data_ptr()] = t.numel() * t.element_size()
            else:
                storages[current[-1]][s.data_ptr()] = s.nbytes()
        return t

    handles = []
    for fqn, module in model.named_modules():
        if isinstance(module, bsnn.Linear):
            storages[fqn] = {}
            handles.append(module.register_forward_pre_hook(lambda m, a, f=fqn: current.append(f)))
            handles.append(module.register_forward_hook(lambda m, a, o: current.pop() and None))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids[:, :-1]).logits.sum().backward()
    for h in handles:
        h.remove()
    return {fqn: sum(s.values()) for fqn, s in storages.items()}


DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU")]),
]  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["nvfp4", "mxfp8", "nvfp4_fwd_mxfp8_bwd"])
def test_converted_linears_save_only_packed_operands(name, device):
    """What a converted linear keeps for backward beside its weight (saved itself: dgrad's
    operand is quantized again from it) is at most the packed tokens copy of its input and,
    for an NVFP4 dgrad weight, the weight's amax; a BF16 copy of the input would be 2
    bytes/value, a packed weight copy 0.56 (NVFP4) or 1.03 (MXFP8). On CUDA the kernels make
    the copies: a saved view into a larger buffer (a `_dq` written beside the codes, say)
    counts its whole storage and fails this."""
    recipe = recipes.get(name)
    model = tiny_llama().to(device)
    bsnn.convert(model, recipe, module_filter_fn=bsnn.layer_policy(model, 0.0))
    ids = tokens(batch=2, seq=30).to(device)  # 60 tokens: token copies are padded to the block
    saved = saved_bytes_per_converted_linear(model, ids)
    assert len(saved) == 14
    modules = dict(model.named_modules())
    for fqn, got in saved.items():
        linear = modules[fqn]
        in_fmt = recipe.grad_weight.input_t
        m = -(2 * 30) // in_fmt.block_size * -in_fmt.block_size
        bound = packed_bytes(m * linear.in_features, in_fmt.format)
        bound += 8 if recipe.grad_input.weight.format is Format.NVFP4 else 0  # the weight amax
        assert 0 < got <= bound, f"{fqn}: saved {got} bytes, packed operands are {bound:.0f}"


# ------------------------------------------------------------------ bench_model.py


def bench_model():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_model

    return bench_model


def test_bench_model_runs_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "bench_model.json"
    rows = bench_model().main(["--models", "llama-tiny,tiny", "--recipes", "nvfp4", "--eager",
                               "--quick", "--profile", "--out", str(out)])  # fmt: skip
    assert [(r["model"], r["recipe"]) for r in rows] == [
        ("llama-tiny", "bf16"), ("llama-tiny", "nvfp4"), ("tiny", "bf16"), ("tiny", "nvfp4")
    ]  # fmt: skip
    for r in rows:
        assert r["status"] == "ok", r["status"]
        assert r["tokens_per_s"] > 0 and r["tok_vs_bf16"] > 0 and r["host_ms"] > 0
        assert r["profile"]["top_host_ops"] and r["profile"]["wall_ms"] > 0
    assert out.exists()
    assert "tok_vs_bf16" in capsys.readouterr().out.splitlines()[-len(rows) - 2]  # table last


def test_bench_model_memory_process_runs_each_row_alone(tmp_path, capsys):
    """--memory process: after a model and mode's rows, one process per recipe runs that row
    alone with the run's other options (each prints its row; no memory_status means it
    wrote one), and the shared process's peaks move to peak_gib_shared (on the CPU there are
    none: peak_gib is CUDA's allocator)."""
    out = tmp_path / "rows.json"
    rows = bench_model().main(["--models", "llama-tiny", "--recipes", "nvfp4", "--eager",
                               "--quick", "--no-shared-input", "--memory", "process",
                               "--memory-steps", "1", "--out", str(out)])  # fmt: skip
    assert [r["recipe"] for r in rows] == ["bf16", "nvfp4"]
    for r in rows:
        assert r["status"] == "ok" and "memory_status" not in r, r
        assert "peak_gib_shared" in r and r["peak_gib"] is None
    printed = capsys.readouterr().out
    assert "llama-tiny eager bf16 alone: peak_gib=- [ok]" in printed
    assert "llama-tiny eager nvfp4 alone: peak_gib=- [ok]" in printed
    assert json.loads(out.read_text())["memory"] == "process"


def test_bench_model_memory_process_arguments():
    """What the process of one row is given: the run's switches and shape, not its rows,
    timing, profiling or output options (either spelling of an option with a value)."""
    given = ["--models", "llama-1b,llama-8b", "--recipes=bf16,nvfp4", "--compile", "--profile",
             "--batch-size", "2", "--steps", "6", "--warmup=2", "--no-shared-input",
             "--compile-mode", "reduce-overhead", "--memory", "process", "--out", "x.json",
             "--memory-steps", "3", "--layers", "8"]  # fmt: skip
    args = SimpleNamespace(memory_steps=3)
    assert bench_model().alone_argv(given, "llama-8b", "compile", "nvfp4", args) == [
        "--batch-size", "2", "--no-shared-input", "--compile-mode", "reduce-overhead",
        "--layers", "8", "--models", "llama-8b", "--recipes", "nvfp4", "--compile",
        "--memory", "inline", "--warmup", "1", "--steps", "3",
    ]  # fmt: skip


def test_bench_model_reports_a_compile_that_runs_out_of_time(monkeypatch):
    """A compile that stalls: the backend sleeps far past the limit, so the limit fires inside
    the first step whatever the machine's speed, load or warm compile caches (a real compile
    of the tiny model can finish inside any fixed limit once cached), and wherever Dynamo is
    then. The stall is cut short: the alarm repeats until it gets out of the step."""
    real_compile = torch.compile
    slept_to_the_end = []

    def stalled_backend(gm, example_inputs):
        time.sleep(60)
        slept_to_the_end.append(True)
        return gm.forward

    def compile_that_stalls(model, **kwargs):
        return real_compile(model, backend=stalled_backend)

    monkeypatch.setattr(torch, "compile", compile_that_stalls)
    rows = bench_model().main(["--models", "llama-tiny", "--recipes", "bf16", "--compile",
                               "--quick", "--compile-timeout", "0.5"])  # fmt: skip
    assert len(rows) == 1 and rows[0]["status"].startswith("compile_timeout"), rows[0]["status"]
    assert "tokens_per_s" not in rows[0]
    assert not slept_to_the_end


# The limit's own behaviour, with the places an alarm can land that the compile test above
# reaches only by chance: each block below sleeps or loops far past the limit, so none of these
# depends on the machine's speed or load.


def test_time_limit_fires_again_after_an_alarm_is_caught():
    """The first alarm lands where something catches it (Dynamo falling back, a gc callback);
    the next part of the step stalls. One alarm would leave the stall unbounded."""
    bm = bench_model()
    caught, stalled_to_the_end = [], []
    with pytest.raises(bm.CompileTimeout, match="did not finish in 0.05 s"), bm.TimeLimit(0.05):
        try:
            time.sleep(30)
        except bm.CompileTimeout as e:
            caught.append(e)
        time.sleep(30)
        stalled_to_the_end.append(True)
    assert len(caught) == 1 and not stalled_to_the_end


def test_time_limit_raises_after_a_step_that_caught_every_alarm():
    """A step that catches every alarm and then finishes, past the limit: it is still a timeout,
    not a row of figures measured after an unbounded compile."""
    bm = bench_model()
    caught = 0
    end = time.monotonic() + 0.3
    with pytest.raises(bm.CompileTimeout), bm.TimeLimit(0.05):
        while True:
            try:
                if time.monotonic() >= end:
                    break
                time.sleep(0.01)
            except bm.CompileTimeout:
                caught += 1
    assert caught >= 1


def test_time_limit_lets_the_timeout_unwind():
    """While the timeout is on its way out, the except and finally blocks it passes (Dynamo's
    clean-up) run to their end, however many repeats fall inside them."""
    bm = bench_model()
    cleaned_up = []
    with pytest.raises(bm.CompileTimeout) as raised, bm.TimeLimit(0.05):
        try:
            time.sleep(30)
        except bm.CompileTimeout:
            time.sleep(0.3)  # six repeats of the alarm
            cleaned_up.append(True)
            raise
    assert cleaned_up and raised.value.__context__ is None


def test_time_limit_leaves_no_timer_behind():
    """A step inside its limit: no exception, and the timer and the SIGALRM handler are as they
    were, whether the block ended normally or by another exception."""
    bm = bench_model()
    before = signal.getsignal(signal.SIGALRM)
    with bm.TimeLimit(30):
        pass
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGALRM) is before
    with pytest.raises(KeyError), bm.TimeLimit(30):
        raise KeyError("not a timeout")
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGALRM) is before


def test_bench_model_memory_peak_from_an_allocator_trace():
    """--memory-peak's reading of a CUDA allocator trace (the events of
    torch.cuda.memory._snapshot(), innermost frame first): the highest allocated point, what
    reached it, and what is live there charged to the innermost frame of our or the model's
    code. A later, lower point and an allocation freed before the peak must not count."""

    def frames(*where):
        return [{"filename": f, "line": line, "name": name} for f, line, name in where]

    torch_frame = ("/x/torch/nn/functional.py", 10, "linear")
    quantize = frames(torch_frame, ("/x/blockscale/ops/quantize.py", 200, "_both"),
                      ("/x/benchmarks/bench_model.py", 150, "step"))  # fmt: skip
    gemm = frames(("/x/blockscale/gemm/dispatch.py", 90, "mm"), ("/x/benchmarks/b.py", 1, "s"))
    other = frames(torch_frame)
    gib = 2**30
    events = [
        {"action": "alloc", "addr": 1, "size": 2 * gib, "frames": quantize},
        {"action": "alloc", "addr": 2, "size": 1 * gib, "frames": other},
        {"action": "free_requested", "addr": 2, "size": 1 * gib, "frames": other},
        {"action": "free_completed", "addr": 2, "size": 1 * gib, "frames": other},
        {"action": "alloc", "addr": 3, "size": gib // 2, "frames": quantize},
        {"action": "alloc", "addr": 4, "size": gib, "frames": gemm},  # the peak: 3.5 GiB
        {"action": "free_completed", "addr": 1, "size": 2 * gib, "frames": quantize},
        {"action": "alloc", "addr": 5, "size": gib, "frames": other},  # 2.5 GiB, lower
        {"action": "segment_alloc", "addr": 9, "size": 8 * gib, "frames": other},
    ]
    peak = bench_model().peak_from_trace(events, top=5)
    assert peak["peak_above_start_gib"] == 3.5
    assert peak["peak_reached_at"] == "gemm/dispatch.py:90:mm"
    assert peak["live_at_peak"] == [
        {"origin": "ops/quantize.py:200:_both", "gib": 2.5, "count": 2},
        {"origin": "gemm/dispatch.py:90:mm", "gib": 1.0, "count": 1},
    ]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bench_model_memory_peak():
    """--memory-peak on CUDA: the recorded step's highest point is at least what was allocated
    before it and at most the timed steps' max_memory_allocated, and the quantized model's
    peak charges some of its live memory to blockscale's code."""
    rows = bench_model().main(["--models", "llama-tiny", "--recipes", "nvfp4", "--eager",
                               "--quick", "--memory-peak", "--device", "cuda"])  # fmt: skip
    for r in rows:
        assert r["status"] == "ok", r["status"]
        peak = r["memory_peak"]
        assert peak["peak_above_start_gib"] > 0 and peak["live_at_peak"]
        assert peak["peak_gib"] <= r["peak_gib"] * 1.01
    origins = [g["origin"] for g in rows[1]["memory_peak"]["live_at_peak"]]
    assert any(o.split(":")[0] in ("ops/linear.py", "ops/quantize.py") or "kernels/" in o
               for o in origins), origins  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["nvfp4", "mxfp8"])
def test_gpu_plain_compile_of_converted_llama_tracks_eager(name):
    """Plain torch.compile of a converted Llama on CUDA under BF16 autocast, three AdamW steps.
    The quantizers and GEMMs are opaque ops that run eager's kernels; Inductor still fuses the
    model's own BF16 ops (RMSNorm, rotary, SiLU) with other roundings than eager, which is
    noise BF16 itself shows. So the compiled losses must follow eager's as closely as BF16's
    compiled losses follow BF16 eager (x10, or 2e-3 relative, the larger): a quantizer that
    Inductor rewrote, dropped or fed other operands would move them by far more."""

    def losses(recipe_name: str | None, compiled: bool) -> torch.Tensor:
        torch._dynamo.reset()
        model = tiny_llama(layers=3).cuda()
        if recipe_name is not None:
            bsnn.convert(model, exact(recipe_name), module_filter_fn=bsnn.layer_policy(model))
        fn = torch.compile(model) if compiled else model
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        out = []
        for step in range(3):
            ids = tokens(batch=4, seq=64, seed=step).cuda()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss, _ = loss_and_grads(model, fn, ids)
            optimizer.step()
            out.append(loss)
        return torch.stack(out)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).abs() / b.abs()).max().item()

    noise = rel(losses(None, True), losses(None, False))
    got = rel(losses(name, True), losses(name, False))
    assert got <= max(10 * noise, 2e-3), (got, noise)
    torch._dynamo.reset()
