"""`torchrun ... -m blockscale train --fsdp` (blockscale/train/ranks.py) on CPU ranks (gloo).

Each run is a real launch: `python -m torch.distributed.run --standalone --nproc-per-node N`,
one thread per rank, the tiny model for 6 steps of 2 x 32 bytes per rank.

What is exact, and why (each asserted below):
- A --fsdp run on W ranks trains what one process trains with the same flags: the step's
  `grad_accum` micro-batches are the same batches (the run's default grad_accum is W), rank r
  runs its share, and FSDP averages the ranks' gradients (2 terms: the sum is order-free and
  halving is exact), as one process accumulates its micro-batches' gradients scaled by 1/2.
  So losses and held-out losses equal the one-process run's bit for bit when two things are
  off: stochastic rounding (one process draws every micro-batch from one stream, two ranks from
  two) and gradient clipping (`--grad-clip 0`): the global gradient norm is summed from the
  shards in another order, so `grad_norm` agrees only to ~1e-7 relative, and an active clip
  coefficient carries that difference into every later step. With stochastic rounding on, the
  first step's loss is still exact (the forward draws nothing).
- Resuming on the same number of ranks is exact, stochastic rounding included: each rank's
  random stream and loop sums are in the checkpoint.
- Resuming a 2-rank checkpoint on 1 rank (DCP reshards): exact without stochastic rounding and
  clipping (rank 0 runs both micro-batches: the same sums); with stochastic rounding the first
  step after the resume is exact and later losses stay within 1e-3 relative (measured: 1e-4).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from blockscale.cli import main
from blockscale.train import TrainConfig, UsageError, eval_run, read_metrics, train
from blockscale.train import checkpoint as ckpt
from blockscale.train.parallel import carried_over
from blockscale.train.ranks import Ranks, check_batch

ROOT = Path(__file__).resolve().parents[1]
STEPS = 6


def run_flags(model: str) -> list[str]:
    """A short run of `model` that logs, evaluates and checkpoints often enough to compare."""
    return [
        "--quiet", "--model", model, "--steps", str(STEPS), "--batch-size", "2",
        "--seq-len", "32", "--log-every", "1", "--eval-every", "3", "--eval-tokens", "2048",
        "--ckpt-every", "3", "--keep-checkpoints", "0", "--max-data-bytes", "50000",
    ]  # fmt: skip


RUN = run_flags("tiny")
# Every comparison exact (see the module docstring): no stochastic rounding, no clipping.
EXACT = {"bf16": ["--recipe", "bf16", "--grad-clip", "0"]}
EXACT["nvfp4"] = ["--recipe", "nvfp4", "--no-stochastic-rounding", "--grad-clip", "0"]

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def torchrun(ranks: int, *args: str, mode: str = "--fsdp") -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", str(ranks), "-m", "blockscale", "train", mode, *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def launch(ranks: int, out: Path, *args: str, mode: str = "--fsdp") -> subprocess.CompletedProcess:
    done = torchrun(ranks, "--out", str(out), *args, mode=mode)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def rows(run_dir: Path) -> list[dict]:
    """The metric rows without what depends on the clock."""
    return [
        {k: v for k, v in r.items() if k not in ("tokens_per_s", "time")}
        for r in read_metrics(run_dir)
    ]


def split_grad_norm(found: list[dict]) -> tuple[list[dict], list[float]]:
    """The rows without grad_norm, and the grad_norms of the train rows."""
    norms = [r["grad_norm"] for r in found if r["kind"] == "train"]
    return [{k: v for k, v in r.items() if k != "grad_norm"} for r in found], norms


def resumed_from(run_dir: Path, step: int, tmp_path: Path) -> Path:
    """A copy of the run as a crash after the checkpoint of `step` would leave it (its rows
    past `step` stay: resuming drops them first)."""
    copy = tmp_path / "resumed"
    shutil.copytree(run_dir, copy)
    for later in ckpt.checkpoint_dirs(copy):
        if ckpt.step_of(later) > step:
            shutil.rmtree(later)
    (copy / "summary.json").unlink()
    return copy


@pytest.fixture(scope="module", params=list(EXACT))
def sharded(request, tmp_path_factory):
    """(recipe, a 2-rank run, its stdout)."""
    out = tmp_path_factory.mktemp(f"fsdp-{request.param}") / "run"
    done = launch(2, out, *RUN, *EXACT[request.param])
    return request.param, out, done.stdout


def assert_run_folder_files(run_dir: Path) -> None:
    """What a finished run folder holds, written by rank 0 alone (no per-rank files)."""
    assert sorted(p.name for p in run_dir.iterdir()) == [
        "checkpoints",
        "config.json",
        "metrics.jsonl",
        "summary.json",
    ]


def assert_two_rank_run_files(run_dir: Path) -> None:
    """Rank 0's files only, and every checkpoint DCP's two shards with the two ranks' loop
    states and a manifest that verifies; no temporary folder left."""
    assert_run_folder_files(run_dir)
    for folder in ckpt.checkpoint_dirs(run_dir):
        names = sorted(p.name for p in folder.iterdir())
        assert names == [
            ".metadata",
            "__0_0.distcp",
            "__1_0.distcp",
            "manifest.json",
            "rank_0.safetensors",
            "rank_1.safetensors",
        ]
        assert ckpt.is_sharded(folder) and ckpt.verify(folder)
    assert not list((run_dir / "checkpoints").glob("*.tmp"))


def test_rank_0_alone_writes_the_run(sharded):
    recipe, run_dir, stdout = sharded
    assert stdout.count("run directory:") == 1  # rank 0 alone prints
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["status"], summary["ranks"], summary["steps"]) == ("done", 2, STEPS)
    config = json.loads((run_dir / "config.json").read_text())
    # a new --fsdp run: one micro-batch per rank and step; the probe does not run sharded
    assert (config["grad_accum"], config["telemetry_every"]) == (2, 0)
    found = read_metrics(run_dir)
    assert [r["step"] for r in found if r["kind"] == "train"] == list(range(1, STEPS + 1))
    assert [r["step"] for r in found if r["kind"] == "eval"] == [3, 6]
    assert {r["kind"] for r in found} == {"train", "eval"}
    assert found[0]["tokens"] == 2 * 2 * 32  # the global batch: 2 ranks x 2 sequences
    assert_two_rank_run_files(run_dir)


def test_losses_equal_one_process_with_the_same_flags(sharded, tmp_path):
    recipe, run_dir, _ = sharded
    cfg = TrainConfig.load(run_dir / "config.json")  # grad_accum=2: the same global batch
    train(cfg, tmp_path / "one", progress=False)
    got, got_norms = split_grad_norm(rows(run_dir))
    want, want_norms = split_grad_norm(rows(tmp_path / "one"))
    assert got == want  # losses and held-out losses bit for bit
    assert got_norms == pytest.approx(want_norms, rel=1e-5, abs=0)


def test_resume_on_two_ranks_is_exact(sharded, tmp_path):
    recipe, run_dir, _ = sharded
    copy = resumed_from(run_dir, 3, tmp_path)
    launch(2, copy, "--resume", "--quiet")
    assert rows(copy) == rows(run_dir)


def test_a_two_rank_checkpoint_resumes_on_one_rank(sharded, tmp_path):
    recipe, run_dir, _ = sharded
    copy = resumed_from(run_dir, 3, tmp_path)
    launch(1, copy, "--resume", "--quiet")
    got, got_norms = split_grad_norm(rows(copy))
    want, want_norms = split_grad_norm(rows(run_dir))
    assert got == want
    assert got_norms == pytest.approx(want_norms, rel=1e-5, abs=0)
    assert json.loads((copy / "summary.json").read_text())["ranks"] == 1


def test_a_sharded_checkpoint_evaluates_in_one_process_and_checks_its_manifest(
    sharded, tmp_path, capsys
):
    recipe, run_dir, _ = sharded
    last_eval = [r for r in read_metrics(run_dir) if r["kind"] == "eval"][-1]
    result = eval_run(run_dir, max_tokens=2048)
    assert result["val_loss"] == last_eval["val_loss"]
    # Resuming without --fsdp is refused in one line; a flipped byte is caught by the manifest.
    copy = resumed_from(run_dir, 3, tmp_path)
    assert main(["train", "--resume", "--out", str(copy), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "was written by a --fsdp run; resume it with torchrun" in err and err.count("\n") == 1
    shard = ckpt.checkpoint_dirs(copy)[-1] / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(UsageError, match="SHA-256 of __1_0.distcp differs from its manifest"):
        ckpt.verify(shard.parent)


@pytest.mark.slow
def test_stochastic_rounding_first_step_and_resume(tmp_path):
    # nvfp4 as trained (stochastic rounding, clipping at 1.0): ~25 s of launches.
    run_dir = tmp_path / "run"
    launch(2, run_dir, *RUN, "--recipe", "nvfp4")
    cfg = TrainConfig.load(run_dir / "config.json")
    train(cfg, tmp_path / "one", progress=False)
    first = [r["loss"] for r in read_metrics(run_dir) if r["kind"] == "train"][0]
    assert first == [r["loss"] for r in read_metrics(tmp_path / "one") if r["kind"] == "train"][0]

    copy = resumed_from(run_dir, 3, tmp_path)
    launch(2, copy, "--resume", "--quiet")
    assert rows(copy) == rows(run_dir)  # every rank's random stream restored

    shutil.rmtree(copy)
    copy = resumed_from(run_dir, 3, tmp_path)
    launch(1, copy, "--resume", "--quiet")
    got = [r["loss"] for r in read_metrics(copy) if r["kind"] == "train"]
    want = [r["loss"] for r in read_metrics(run_dir) if r["kind"] == "train"]
    assert got[:4] == want[:4]  # up to the checkpoint, and the step after it (no draws yet)
    assert got[4:] == pytest.approx(want[4:], rel=1e-3)


def test_fsdp_without_torchrun_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["train", "--fsdp", "--out", str(tmp_path / "run"), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "--fsdp needs one process per rank, started by torchrun" in err
    assert err.count("\n") == 1 and not (tmp_path / "run").exists()


def test_a_number_of_ranks_must_divide_the_micro_batches():
    check_batch(4, Ranks(1, 2, sharded=True))
    assert list(Ranks(1, 2, sharded=True).micro_batches(4)) == [2, 3]
    with pytest.raises(UsageError, match="grad_accum=2 micro-batches per step do not split"):
        check_batch(2, Ranks(0, 3, sharded=True))


def test_loop_sums_carried_onto_another_number_of_ranks():
    # What a checkpoint's ranks summed since the last row: on as many ranks each takes its own;
    # on another number rank 0 takes them all and the others start from float zeros (an int 0
    # made rank 1 of a 1-to-2-rank resume fail at its first += of a float loss).
    written = [
        {"loss_sum": 1.5, "loss_steps": 2, "aux_sum": 0.25, "expert_tokens": [[1, 2]]},
        {"loss_sum": 2.5, "loss_steps": 2, "aux_sum": 0.5, "expert_tokens": [[3, 4]]},
    ]
    assert carried_over(written, Ranks(1, 2, sharded=True)) == written[1]
    assert carried_over(written, Ranks(0, 1, sharded=True)) == {
        "loss_sum": 4.0,
        "loss_steps": 2,
        "aux_sum": 0.75,
        "expert_tokens": [[4, 6]],
    }
    other = carried_over(written[:1], Ranks(1, 2, sharded=True))
    assert other == {"loss_sum": 0.0, "loss_steps": 2, "aux_sum": 0.0, "expert_tokens": [[0, 0]]}
    assert isinstance(other["loss_sum"], float) and isinstance(other["aux_sum"], float)
