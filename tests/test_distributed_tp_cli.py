"""`torchrun ... -m blockscale train --tp` (tensor parallel, train/ranks.py) on CPU ranks (gloo).

Real launches as in test_distributed_cli.py: 2 ranks, tiny (`nvfp4`, stochastic rounding off,
`--grad-clip 0`) for 6 steps of 2 x 32 bytes, one thread a rank. Under --tp the ranks share
each batch, so a new run keeps one process's grad_accum (1) and the global batch is
--batch-size sequences.

What is equal, and why (each asserted below):
- The first step's loss equals one process's bit for bit (every forward GEMM's quantized
  operands are the one-device ones, and the logits came out equal); later losses and held-out
  losses within 1e-5 relative (measured: bit for bit through step 5, then 1e-7): a row-wise
  layer's output is a sum of two partial products, one FP32 rounding away from one device's,
  and a value on a rounding edge may then quantize one code apart, so the runs drift.
- `grad_norm` within 1e-5 (summed from the shards in another order).
- Resuming on 2 ranks is exact: the model and AdamW state (the stacked weights as contiguous
  pieces of the one-device tensors in DCP), the shared random stream and the loop sums.
- `blockscale eval` of the sharded checkpoint in one process computes the one-device forward
  of the same weights: the run's last held-out loss within 1e-5.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import test_distributed_cli as fsdp_cli
from test_distributed_cli import (
    STEPS,
    assert_two_rank_run_files,
    resumed_from,
    rows,
    run_flags,
    split_grad_norm,
)

from blockscale.cli import main
from blockscale.train import TrainConfig, eval_run, read_metrics, train

RUN = [*run_flags("tiny"), "--recipe", "nvfp4", "--no-stochastic-rounding", "--grad-clip", "0"]

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def torchrun(ranks: int, *args: str) -> subprocess.CompletedProcess:
    return fsdp_cli.torchrun(ranks, *args, mode="--tp")


def launch(ranks: int, out: Path, *args: str) -> subprocess.CompletedProcess:
    return fsdp_cli.launch(ranks, out, *args, mode="--tp")


@pytest.fixture(scope="module")
def tensor_parallel(tmp_path_factory):
    """(a 2-rank --tp run, its stdout)."""
    out = tmp_path_factory.mktemp("tp") / "run"
    done = launch(2, out, *RUN)
    return out, done.stdout


def test_rank_0_alone_writes_the_run(tensor_parallel):
    run_dir, stdout = tensor_parallel
    assert stdout.count("run directory:") == 1
    assert "2 rank(s) (cpu, TP)" in stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["status"], summary["ranks"], summary["steps"]) == ("done", 2, STEPS)
    assert summary["params"] == 139584  # the whole model's, not a rank's shards
    config = json.loads((run_dir / "config.json").read_text())
    assert (config["grad_accum"], config["telemetry_every"]) == (1, 0)  # the ranks share a batch
    found = read_metrics(run_dir)
    assert [r["step"] for r in found if r["kind"] == "train"] == list(range(1, STEPS + 1))
    assert [r["step"] for r in found if r["kind"] == "eval"] == [3, 6]
    assert found[0]["tokens"] == 2 * 32
    assert_two_rank_run_files(run_dir)


def test_losses_match_one_process_with_the_same_flags(tensor_parallel, tmp_path):
    run_dir, _ = tensor_parallel
    cfg = TrainConfig.load(run_dir / "config.json")
    train(cfg, tmp_path / "one", progress=False)
    got, got_norms = split_grad_norm(rows(run_dir))
    want, want_norms = split_grad_norm(rows(tmp_path / "one"))
    assert got[0] == want[0]  # the first step's loss bit for bit
    assert [r["kind"] for r in got] == [r["kind"] for r in want]
    for g, w in zip(got, want, strict=True):
        for key in ("loss", "val_loss"):
            if key in w:
                assert g[key] == pytest.approx(w[key], rel=1e-5, abs=0), (g, w)
    assert got_norms == pytest.approx(want_norms, rel=1e-5, abs=0)


def test_resume_on_two_ranks_is_exact(tensor_parallel, tmp_path):
    run_dir, _ = tensor_parallel
    copy = resumed_from(run_dir, 3, tmp_path)
    launch(2, copy, "--resume", "--quiet")
    assert rows(copy) == rows(run_dir)


def test_a_two_rank_checkpoint_resumes_on_one_rank(tensor_parallel, tmp_path):
    # DCP reshards: one rank holds every head again (the stacked weights were written as
    # contiguous pieces of the one-device tensors)
    run_dir, _ = tensor_parallel
    copy = resumed_from(run_dir, 3, tmp_path)
    launch(1, copy, "--resume", "--quiet")
    got, want = rows(copy), rows(run_dir)
    assert got[:4] == want[:4]  # the rows up to the checkpoint, kept
    assert [r["kind"] for r in got] == [r["kind"] for r in want]
    for g, w in zip(got, want, strict=True):
        key = "loss" if g["kind"] == "train" else "val_loss"
        # one rank sums the row-wise contractions whole: FP32 order, as against one process
        assert g[key] == pytest.approx(w[key], rel=1e-5, abs=0), (g, w)
    assert json.loads((copy / "summary.json").read_text())["ranks"] == 1


def test_a_tp_checkpoint_evaluates_in_one_process(tensor_parallel):
    run_dir, _ = tensor_parallel
    last_eval = [r for r in read_metrics(run_dir) if r["kind"] == "eval"][-1]
    result = eval_run(run_dir, max_tokens=2048)
    assert result["val_loss"] == pytest.approx(last_eval["val_loss"], rel=1e-5, abs=0)


def test_tp_refusals_are_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["train", "--tp", "--out", str(tmp_path / "run"), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "--tp needs one process per rank, started by torchrun" in err
    assert err.count("\n") == 1 and not (tmp_path / "run").exists()
    assert main(["train", "--tp", "--fsdp", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "--tp with --fsdp: one of --fsdp, --ep and --tp at a time" in err
    assert err.count("\n") == 1


def test_a_model_that_does_not_split_over_the_ranks_is_one_line(tmp_path):
    # tiny has 4 heads: 3 ranks cannot each hold whole heads
    done = torchrun(3, "--out", str(tmp_path / "run"), *RUN)
    assert done.returncode != 0
    assert "--tp on 3 ranks: layers.0.attn: n_heads=4 does not split over 3" in done.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
