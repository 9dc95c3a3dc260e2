"""`torchrun ... -m blockscale train --ep` (expert parallel, train/ranks.py) on CPU ranks (gloo).

Each run is a real launch: 2 ranks, moe-tiny (4 experts: 2 a rank) for 6 steps of 2 x 32 bytes a
rank, one thread a rank. Like test_distributed_cli.py's --fsdp runs, a 2-rank --ep run is
compared with one process with the same flags (the same grad_accum = 2 micro-batches a step).

What is equal, and why (each asserted below):
- BF16: the first step's loss and `grad_norm` and every step's `expert_tokens` are equal bit for
  bit: the forward is (an expert's rows are the one-process rows in the one-process order), and
  `expert_tokens` is written from rank 0's counts, already the group's (not summed again).
  Later losses and held-out losses agree within 1e-5 relative (measured: ~1e-7), not bit for
  bit: an expert's owner computes its weight gradient in one GEMM over both ranks' rows, one
  process in two (a micro-batch each) whose results it adds, so FP32 sums run in another order.
- NVFP4: within 1e-3 relative (measured: 3e-4; the first step 2e-6) and `grad_norm` within 1e-2
  (measured 3e-3): the expert GEMMs' per-expert tensor scale (the amax of an expert's rows) is
  taken over both ranks' rows at once under --ep, over one micro-batch's in one process, so the
  experts quantize with other scales from the first forward on (--ep equals one process bit
  for bit on the concatenated batch, tests/test_distributed_ep.py, not on its micro-batches).
  The routing then drifts: `expert_tokens` are compared at the first step only.
- The load-balancing loss is the group's batch's under --ep (both ranks' tokens at once), each
  micro-batch's in one process: `aux_loss` differs by design (~1e-3 here), and so would the
  gradient, so the comparison runs with `--aux-loss-coef 0` (the CE gradient alone).
- Resuming on 2 ranks is exact: the model, AdamW state (experts as shards of the whole [E, ...]
  tensors in DCP), each rank's random stream and loop sums are in the checkpoint.
Stochastic rounding is off (`--no-stochastic-rounding`): one process draws both micro-batches
from one stream, two ranks from two.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import test_distributed_cli as fsdp_cli
from test_distributed_cli import STEPS, assert_run_folder_files, resumed_from, rows, run_flags

from blockscale.cli import main
from blockscale.train import TrainConfig, eval_run, read_metrics, train
from blockscale.train import checkpoint as ckpt

RUN = [*run_flags("moe-tiny"), "--aux-loss-coef", "0"]
RECIPES = {"bf16": ["--recipe", "bf16"]}
RECIPES["nvfp4"] = ["--recipe", "nvfp4", "--no-stochastic-rounding"]

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def torchrun(ranks: int, *args: str) -> subprocess.CompletedProcess:
    return fsdp_cli.torchrun(ranks, *args, mode="--ep")


def launch(ranks: int, out: Path, *args: str) -> subprocess.CompletedProcess:
    return fsdp_cli.launch(ranks, out, *args, mode="--ep")


@pytest.fixture(scope="module", params=list(RECIPES))
def expert_parallel(request, tmp_path_factory):
    """(recipe, a 2-rank --ep run, its stdout)."""
    out = tmp_path_factory.mktemp(f"ep-{request.param}") / "run"
    done = launch(2, out, *RUN, *RECIPES[request.param])
    return request.param, out, done.stdout


def test_rank_0_alone_writes_the_run(expert_parallel):
    recipe, run_dir, stdout = expert_parallel
    assert stdout.count("run directory:") == 1  # rank 0 alone prints
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["status"], summary["ranks"], summary["steps"]) == ("done", 2, STEPS)
    assert json.loads((run_dir / "config.json").read_text())["grad_accum"] == 2
    found = read_metrics(run_dir)
    assert [r["step"] for r in found if r["kind"] == "train"] == list(range(1, STEPS + 1))
    assert [r["step"] for r in found if r["kind"] == "eval"] == [3, 6]
    assert found[0]["tokens"] == 2 * 2 * 32  # the global batch: 2 ranks x 2 sequences
    # every token goes to top_k=2 experts: the group's 128 tokens, counted once
    assert all(sum(n) == 2 * 128 for n in found[0]["expert_tokens"].values())
    assert_run_folder_files(run_dir)
    for folder in ckpt.checkpoint_dirs(run_dir):
        assert ckpt.is_sharded(folder) and ckpt.verify(folder)
        assert {"rank_0.safetensors", "rank_1.safetensors"} <= {p.name for p in folder.iterdir()}


def test_losses_match_one_process_with_the_same_flags(expert_parallel, tmp_path):
    recipe, run_dir, _ = expert_parallel
    cfg = TrainConfig.load(run_dir / "config.json")  # grad_accum=2: the same global batch
    summary = train(cfg, tmp_path / "one", progress=False)
    assert json.loads((run_dir / "summary.json").read_text())["params"] == summary["params"]
    got, want = rows(run_dir), rows(tmp_path / "one")
    assert [r["kind"] for r in got] == [r["kind"] for r in want]
    exact = recipe == "bf16"
    if exact:
        assert got[0]["loss"] == want[0]["loss"] and got[0]["grad_norm"] == want[0]["grad_norm"]
    assert got[0]["expert_tokens"] == want[0]["expert_tokens"]
    loss_tol, norm_tol = (1e-5, 1e-5) if exact else (1e-3, 1e-2)
    for g, w in zip(got, want):
        key = "loss" if g["kind"] == "train" else "val_loss"
        assert g[key] == pytest.approx(w[key], rel=loss_tol, abs=0)
        if g["kind"] == "train":
            assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=norm_tol, abs=0)
            if exact:
                assert g["expert_tokens"] == w["expert_tokens"]


def test_resume_on_two_ranks_is_exact_and_evaluates_in_one_process(expert_parallel, tmp_path):
    recipe, run_dir, _ = expert_parallel
    copy = resumed_from(run_dir, 3, tmp_path)
    launch(2, copy, "--resume", "--quiet")
    assert rows(copy) == rows(run_dir)
    # The experts were written as parts of the whole tensors: one process loads them all.
    last_eval = [r for r in read_metrics(run_dir) if r["kind"] == "eval"][-1]
    assert eval_run(run_dir, max_tokens=2048)["val_loss"] == last_eval["val_loss"]


def test_experts_must_split_over_the_ranks(tmp_path):
    done = torchrun(3, "--out", str(tmp_path / "run"), *RUN)  # 4 experts on 3 ranks
    assert done.returncode != 0
    line = "blockscale train: error: --ep on 3 ranks: MoE layer 'layers.0.moe' has n_experts=4"
    assert done.stderr.count(line) == 1, done.stderr[-3000:]
    assert not (tmp_path / "run").exists()


def test_refusals_are_one_line(tmp_path, capsys, monkeypatch):
    out = str(tmp_path / "run")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["train", "--ep", "--out", out, "--model", "moe-tiny", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "--ep needs one process per rank, started by torchrun" in err and err.count("\n") == 1
    assert main(["train", "--ep", "--fsdp", "--out", out, "--model", "moe-tiny"]) == 2
    err = capsys.readouterr().err
    assert "--ep with --fsdp" in err and err.count("\n") == 1
    # Refused before joining a process group: the launcher's variables alone suffice here.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert main(["train", "--ep", "--out", out, "--model", "tiny", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "--ep splits an MoE model's experts over the ranks; model 'tiny' has none" in err
    assert err.count("\n") == 1 and not (tmp_path / "run").exists()


def test_a_two_rank_checkpoint_resumes_on_one_rank(expert_parallel, tmp_path):
    # DCP reshards the experts (written as parts of the whole tensors): one rank keeps all 4.
    recipe, run_dir, _ = expert_parallel
    if recipe != "bf16":
        pytest.skip("one recipe is enough for the resharding (a 6 s launch)")
    copy = resumed_from(run_dir, 3, tmp_path)
    launch(1, copy, "--resume", "--quiet")
    got, want = rows(copy), rows(run_dir)
    assert got[:4] == want[:4]  # the rows up to the checkpoint, kept
    for g, w in zip(got, want):
        key = "loss" if g["kind"] == "train" else "val_loss"
        # one rank runs the experts' wgrad a micro-batch at a time: FP32 order (measured 3e-9)
        assert g[key] == pytest.approx(w[key], rel=1e-5, abs=0)
        assert g.get("expert_tokens") == w.get("expert_tokens")
    assert json.loads((copy / "summary.json").read_text())["ranks"] == 1
