"""What a converted transformers Llama keeps for the backward when compiled, not only eagerly
(tests/test_hf_llama.py checks each eager linear): benchmarks/research/saved_activations_cpu.py on the
tiny Llama, through Inductor's min-cut partition on the kernel path's ops.

The partitioner decides what a compiled forward saves, and it could as well keep a quantize
op's BF16 `_dq` operand (2 bytes a value) as its packed codes (0.56 for NVFP4); nothing in
the eager tests would see it. The script runs in a child process without TRITON_INTERPRET, as
on CUDA: its trace needs the jit kernels' fake impls, and nothing executes.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("triton")

SCRIPT = (
    Path(__file__).resolve().parents[1] / "benchmarks" / "research" / "saved_activations_cpu.py"
)
QUANTIZED = ["nvfp4", "mxfp8", "nvfp4_fwd_mxfp8_bwd"]


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("saved") / "saved.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, str(SCRIPT), "--models", "llama-tiny", "--recipes",
           ",".join(["bf16", *QUANTIZED]), "--modes", "compile,eager", "--batch-size", "2",
           "--seq-len", "64", "--quantized-weights", "--out", str(out)]  # fmt: skip
    # A hang guard: 224 s measured on one core beside a CPU-bound process.
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(out.read_text())["rows"]
    return {(r["mode"], r["recipe"]): r for r in found}


@pytest.mark.parametrize("recipe", QUANTIZED)
def test_compiled_forward_saves_no_dq_operand(rows, recipe):
    """No floating output of a quantize op (a `_dq` copy) is among the compiled forward's saved
    tensors: the backward gets packed codes and scales, as eagerly."""
    row = rows[("compile", recipe)]
    assert row["saved_bytes"] > 0
    assert row["quantize_float_outputs_bytes"] == 0, row["largest"]


@pytest.mark.parametrize("mode", ["compile", "eager"])
@pytest.mark.parametrize("recipe", QUANTIZED)
def test_converted_llama_saves_less_than_bf16(rows, mode, recipe):
    """Per token, a converted linear's saved input is 0.56 (NVFP4) or 1.03 (MXFP8) bytes a
    value against BF16's 2; the tiny Llama's other saved tensors are the same in every recipe,
    so the recipe saves strictly less."""
    assert rows[(mode, recipe)]["saved_bytes"] < rows[(mode, "bf16")]["saved_bytes"]


def test_compiled_quantized_weights_save_no_more_than_plain_weights(rows):
    """Linears whose weights arrive quantized (FSDP2's quantized all-gather, NVFP4 primary
    weights) save what plain weights save: the backward dequantizes the codes it holds anyway.
    The forward and the backward dequantize the same 16x16 copy; had the backward's dequantize
    been merged with the forward's (AOTAutograd's CSE), the partitioner would save the `_dq`
    (ops/quantize.py, `_saved_dq`: 812 against 665 kB here before it)."""
    quantized = rows[("compile", "nvfp4-quantized-weights")]["saved_bytes"]
    assert 0 < quantized <= rows[("compile", "nvfp4")]["saved_bytes"]


MOE_QUANTIZED = ["nvfp4", "mxfp8"]


@pytest.fixture(scope="module")
def moe_rows(tmp_path_factory):
    """bench_moe_model.py's tiny Qwen3-MoE (FP32 masters; `bf16` is the cast baseline, whose
    experts' grouped GEMMs run on BF16 casts), compiled."""
    out = tmp_path_factory.mktemp("saved_moe") / "saved.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, str(SCRIPT), "--models", "qwen3-tiny", "--recipes",
           ",".join(["bf16", *MOE_QUANTIZED]), "--modes", "compile", "--batch-size", "2",
           "--seq-len", "64", "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    return {r["recipe"]: r for r in json.loads(out.read_text())["rows"]}


@pytest.mark.parametrize("recipe", MOE_QUANTIZED)
def test_compiled_moe_saves_packed_operands_and_less_than_the_cast_baseline(moe_rows, recipe):
    """The compiled quantized MoE forward keeps no `_dq` of a grouped operand (the backward
    dequantizes the saved codes through `saved_operand_dq`, as the dense linears do) and saves
    less than the cast BF16 baseline, which keeps its experts' BF16 weight casts and BF16
    activations (issue 35: at the real shapes 0.64x / 0.76x for nvfp4 / mxfp8, qwen3-30b-a3b,
    docs/MODELS.md)."""
    row = moe_rows[recipe]
    assert row["quantize_float_outputs_bytes"] == 0, row["largest"]
    assert 0 < row["saved_bytes"] < moe_rows["bf16"]["saved_bytes"]
