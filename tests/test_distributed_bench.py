"""`benchmarks/bench_distributed.py suite --smoke`: the two-GPU measurement suite on CPU ranks
(gloo) at tiny sizes, so that the command the GPU machine runs is known to work end to end.

What it must produce: one JSON with every requested part and the short tables; the `--fsdp`
run's loss rows equal one process's with `--grad-accum 2` bit for bit (stochastic rounding off,
`--grad-clip 0`); `--tp` within 1e-5 of one process (docs/DISTRIBUTED.md says why not equal);
the transformers Llama's converted blocks all-gather at most 0.3x of BF16's bytes for nvfp4.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_suite_smoke_runs_every_part(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "suite.json"
    command = [
        sys.executable, str(ROOT / "benchmarks" / "bench_distributed.py"), "suite", "--smoke",
        "--parts", "train,tp,cast,hf", "--recipes", "nvfp4", "--hf-modes", "eager",
        "--json", str(out),
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)  # the cast's reference path: a check of the command
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(out.read_text())
    assert sorted(record["parts"]) == ["cast", "hf", "tp", "train"] and not record["skipped"]
    (train,) = record["parts"]["train"]
    assert train["recipe"] == "nvfp4" and train["losses_bit_equal"] is True, train
    assert len(train["two"]["losses"]) == record["sizes"]["steps"]
    assert train["two"]["tokens_per_s"] > 0 and train["one"]["tokens_per_s"] > 0
    (tp,) = record["parts"]["tp"]
    assert tp["max_rel_loss_diff"] < 1e-5, tp
    (cast,) = record["parts"]["cast"]
    assert cast["ranks"] == 2 and cast["weights"] > 0
    hf = {(r["mode"], r["recipe"]): r for r in record["parts"]["hf"]}
    assert sorted(hf) == [("eager", "bf16"), ("eager", "nvfp4")]
    nvfp4 = hf["eager", "nvfp4"]
    assert nvfp4["converted_blocks"], nvfp4  # layer_policy keeps the last block in BF16
    assert nvfp4["converted_blocks_all_gather_vs_bf16"] < 0.3, nvfp4
    assert nvfp4["all_gather_vs_bf16"] < 1 and nvfp4["tokens_per_s_vs_bf16"] > 0
    assert "train: 2 ranks against one process" in done.stdout
    assert "transformers Llama under FSDP2" in done.stdout


def test_a_failed_run_reports_its_ranks_exception_lines():
    # torchrun ends a failed launch with its own summary, which names no cause; the ranks'
    # lines carry a `[rankN]:` prefix. Both GPU failures of 2026-11-27 hid behind that.
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_distributed

    stderr = "\n".join(
        [
            "[rank0]: Traceback (most recent call last):",
            '[rank0]:   File "x.py", line 1, in <module>',
            "[rank0]: AssertionError: shape must be positive",
            "[rank1]: AssertionError: shape must be positive",
            "blockscale train: error: out of memory on cuda:0 at step 3",
            "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
            "  exitcode  : 1 (pid: 838)",
        ]
    )
    text = bench_distributed._error_text(stderr)
    causes = text.split("\n--- last lines:")[0].splitlines()
    assert causes == [
        "[rank0]: AssertionError: shape must be positive",
        "[rank1]: AssertionError: shape must be positive",
        "blockscale train: error: out of memory on cuda:0 at step 3",
    ]
    assert bench_distributed._first_error({"two": {"error": text}, "one": {}}) == causes[0]
