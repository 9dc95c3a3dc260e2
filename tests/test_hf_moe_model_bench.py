"""benchmarks/bench_moe_model.py on the CPU: what each recipe's model is, and the --smoke run
(tiny transformers MoE models, eager, with a memory process per recipe)."""

import sys
from pathlib import Path

import pytest
import torch

import blockscale.nn as bsnn

pytest.importorskip("transformers")


def bench_moe_model():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_moe_model

    return bench_moe_model


def test_bench_moe_model_builds_the_cast_baseline_and_the_converted_models():
    """bf16: the experts' grouped GEMMs on BF16 casts of the FP32 masters, linears untouched;
    a recipe: the README's layer policy by default (the last of 2 blocks kept in BF16, its
    experts routed unquantized), every block with bf16_tail_fraction=0.0; head and routers
    left alone."""
    bench = bench_moe_model()
    spec = bench.MODELS["qwen3-tiny"]
    cpu = torch.device("cpu")
    base = bench.build(spec, "bf16", 32, cpu)
    nvfp4 = bench.build(spec, "nvfp4", 32, cpu, bf16_tail_fraction=0.0)
    readme = bench.build(spec, "nvfp4", 32, cpu)
    unconverted = bench.build(spec, "hf", 32, cpu)
    for model in (base, nvfp4, unconverted):
        assert {p.dtype for p in model.parameters()} == {torch.float32}
    for block in base.model.layers:
        assert all(type(g) is bench.CastGroupedMM for g in block.mlp.experts.grouped_mms.values())
        assert type(block.self_attn.q_proj) is torch.nn.Linear
    for block in nvfp4.model.layers:  # both blocks
        grouped = block.mlp.experts.grouped_mms.values()
        assert [g.recipe.name for g in grouped] == ["nvfp4", "nvfp4"]
        assert isinstance(block.self_attn.q_proj, bsnn.Linear)
    head, tail = readme.model.layers
    assert [g.recipe.name for g in head.mlp.experts.grouped_mms.values()] == ["nvfp4"] * 2
    assert [g.recipe.name for g in tail.mlp.experts.grouped_mms.values()] == ["bf16"] * 2
    assert type(tail.self_attn.q_proj) is torch.nn.Linear
    assert type(nvfp4.lm_head) is torch.nn.Linear
    assert not any(hasattr(m, "grouped_mms") for m in unconverted.modules())
    # the baseline's grouped GEMM: BF16 operands, FP32 gradients for the masters
    x = torch.randn(40, 64, requires_grad=True)
    weight = torch.randn(8, 64, 64, requires_grad=True)
    offs = torch.tensor([5, 10, 10, 20, 25, 30, 35, 40], dtype=torch.int32)
    out = bench.CastGroupedMM(bench.recipes.get("bf16"))(x, weight.transpose(-2, -1), offs)
    expected = torch._grouped_mm(x.bfloat16(), weight.bfloat16().transpose(-2, -1), offs=offs)
    assert torch.equal(out, expected.float())
    out.sum().backward()
    assert weight.grad.dtype == torch.float32 and weight.grad.abs().sum() > 0


def test_bench_moe_model_smoke_runs_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "bench_moe_model.json"
    rows = bench_moe_model().main(["--smoke", "--eager", "--models", "mixtral-tiny",
                                   "--recipes", "nvfp4", "--memory", "process",
                                   "--out", str(out)])  # fmt: skip
    assert [(r["model"], r["mode"], r["recipe"]) for r in rows] == [
        ("mixtral-tiny", "eager", "bf16"), ("mixtral-tiny", "eager", "nvfp4")
    ]  # fmt: skip
    for r in rows:
        assert r["status"] == "ok", r["status"]
        assert r["tokens_per_s"] > 0 and r["tok_vs_bf16"] > 0
        assert "memory_status" not in r, r["memory_status"]  # its own process ran too
    printed = capsys.readouterr().out
    assert "mixtral-tiny eager nvfp4 alone: peak_gib=- [ok]" in printed  # no peak on the CPU
    assert "tok_vs_bf16" in printed.splitlines()[-len(rows) - 2]  # the table comes last
    assert out.exists()
