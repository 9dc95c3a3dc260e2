"""Resume never trusts a mismatched run: what `train --resume` refuses, what it lets change, and
that a refused or failed resume leaves the run directory as it was. Also the checkpoint
manifest, numeric checkpoint order and the summary's step."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from blockscale.cli import main
from blockscale.train import TrainConfig, UsageError, read_metrics, train
from blockscale.train import checkpoint as ckpt
from blockscale.train.config import RESUMABLE

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

RUN = [
    "--quiet",
    "--recipe",
    "nvfp4",
    "--steps",
    "4",
    "--batch-size",
    "2",
    "--seq-len",
    "32",
    "--log-every",
    "3",
    "--eval-every",
    "0",
    "--telemetry-every",
    "0",
    "--ckpt-every",
    "2",
    "--max-data-bytes",
    "50000",
]


def snapshot(run_dir):
    """Every file of a run with its bytes (a refused resume must change none)."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("resume") / "run"
    assert main(["train", "--out", str(out), *RUN]) == 0
    return out


@pytest.fixture
def copy(run, tmp_path):
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def test_resume_refuses_a_missing_directory_and_creates_none(tmp_path, capsys):
    missing = tmp_path / "nothing-here"
    assert main(["train", "--resume", "--out", str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"cannot resume {missing}: there is no such run directory" in err
    assert err.count("\n") == 1 and not missing.exists()


def test_resume_refuses_a_run_without_config_json(copy, capsys):
    (copy / "config.json").unlink()
    before = snapshot(copy)
    assert main(["train", "--resume", "--out", str(copy)]) == 2
    assert "it has no config.json" in capsys.readouterr().err
    assert snapshot(copy) == before


def test_resume_names_every_setting_that_defines_the_run(copy, capsys):
    before = snapshot(copy)
    args = ["train", "--resume", "--out", str(copy), "--recipe", "mxfp8", "--batch-size", "3"]
    assert main([*args, "--seq-len", "64", "--no-hadamard"]) == 2
    err = capsys.readouterr().err
    for diff in (
        "recipe: 'nvfp4' there, 'mxfp8' now",
        "batch_size: 2 there, 3 now",
        "seq_len: 32 there, 64 now",
        "hadamard: None there, False now",
    ):
        assert diff in err
    assert err.count("\n") == 1 and snapshot(copy) == before
    # The library refuses the same, whoever calls it.
    saved = TrainConfig.load(copy / "config.json")
    with pytest.raises(UsageError, match="model: 'tiny' there, 'small' now"):
        train(TrainConfig(**{**saved.__dict__, "model": "small"}), copy, resume=True)
    assert snapshot(copy) == before


def test_resume_lets_the_bookkeeping_settings_change(copy):
    assert {"steps", "max_minutes", "log_every", "ckpt_every"} <= RESUMABLE
    more = ["--steps", "6", "--log-every", "1", "--max-minutes", "5", "--ckpt-every", "3"]
    assert main(["train", "--resume", "--out", str(copy), "--quiet", *more]) == 0
    saved = json.loads((copy / "config.json").read_text())
    assert saved["steps"] == 6 and saved["log_every"] == 1
    assert [r["step"] for r in read_metrics(copy)] == [3, 4, 5, 6]


def test_another_runs_checkpoint_is_refused(run, tmp_path, capsys):
    other = tmp_path / "other"
    assert main(["train", "--out", str(other), *RUN, "--seed", "1"]) == 0
    mine = tmp_path / "mine"
    shutil.copytree(run, mine)
    newest = ckpt.checkpoint_dirs(mine)[-1]
    shutil.rmtree(newest)
    shutil.copytree(ckpt.checkpoint_dirs(other)[-1], newest)  # same model, same step, seed 1
    before = snapshot(mine)
    assert main(["train", "--resume", "--out", str(mine), "--steps", "6"]) == 2
    err = capsys.readouterr().err
    assert "was written by another run (seed: 1 there, 0 now)" in err
    assert snapshot(mine) == before


def test_a_failed_checkpoint_load_writes_nothing_into_the_run(copy, capsys):
    """config.json, summary.json and metrics.jsonl were rewritten before the checkpoint loaded:
    a resume that then failed had already damaged the run."""
    trainer = ckpt.checkpoint_dirs(copy)[-1] / "trainer.safetensors"
    trainer.write_bytes(trainer.read_bytes()[:-8])
    before = snapshot(copy)
    assert main(["train", "--resume", "--out", str(copy), "--steps", "8", "--log-every", "1"]) == 2
    assert "step_000004 is corrupt: trainer.safetensors has" in capsys.readouterr().err
    assert snapshot(copy) == before


@pytest.mark.parametrize("name", ["model.safetensors", "trainer.safetensors"])
def test_flipped_bytes_in_a_checkpoint_fail_its_manifest(copy, name, capsys):
    file = ckpt.checkpoint_dirs(copy)[-1] / name
    data = bytearray(file.read_bytes())
    for offset in (-40, -30, -20, -10):  # tensor data: the header is at the start
        data[offset] ^= 0xFF
    file.write_bytes(bytes(data))
    assert main(["train", "--resume", "--out", str(copy), "--steps", "6"]) == 2
    err = capsys.readouterr().err
    assert f"step_000004 is corrupt: the SHA-256 of {name} differs from its manifest" in err
    assert "delete that folder to resume from the checkpoint before it" in err


def test_a_checkpoint_that_loads_but_does_not_fit_is_not_called_corrupt(copy):
    """Intact files (the manifest matches) that do not fit the model: a mismatch, and the
    message does not advise deleting a valid checkpoint."""
    newest = ckpt.checkpoint_dirs(copy)[-1]
    model = torch.nn.Linear(3, 3)
    with pytest.raises(UsageError) as error:
        ckpt.load_weights(newest, model)
    assert "does not fit this model" in str(error.value) and "delete" not in str(error.value)


def test_checkpoints_sort_by_step_number_past_a_million(tmp_path):
    """Names sorted as text put step_1000000 before step_999999, so the newest checkpoint was
    pruned right after it was written."""
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    for step in (999_998, 999_999, 1_000_000):
        ckpt.save(tmp_path, step, model, optimizer, {}, keep=2)
    assert [p.name for p in ckpt.checkpoint_dirs(tmp_path)] == ["step_999999", "step_1000000"]


def test_summary_step_is_the_step_reached_not_the_last_row(run):
    """Rows every 3 steps, 4 steps: the run ends at step 4 (its checkpoint), not 3."""
    summary = json.loads((run / "summary.json").read_text())
    assert [r["step"] for r in read_metrics(run)] == [3, 4]
    paused = run.parent / "paused"
    cfg = TrainConfig.load(run / "config.json")
    stopped = train(
        TrainConfig(**{**cfg.__dict__, "max_minutes": 1e-9, "log_every": 3}), paused, progress=False
    )
    assert stopped["status"] == "paused" and stopped["steps"] == 1
    assert ckpt.step_of(ckpt.checkpoint_dirs(paused)[-1]) == 1 and read_metrics(paused) == []
    assert summary["steps"] == 4 and summary["tokens"] == 4 * 2 * 32


def test_resumed_weights_equal_the_uninterrupted_ones(run, tmp_path):
    """The checks above cost nothing in exactness: a resume that passes them continues bit
    for bit."""
    half = tmp_path / "half"
    assert main(["train", "--out", str(half), *RUN, "--steps", "2"]) == 0
    config = json.loads((half / "config.json").read_text())
    assert config["steps"] == 2
    assert main(["train", "--resume", "--out", str(half), "--quiet", "--steps", "4"]) == 0
    got = load_file(ckpt.checkpoint_dirs(half)[-1] / "model.safetensors")
    want = load_file(ckpt.checkpoint_dirs(run)[-1] / "model.safetensors")
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_damaged_metrics_row_refuses_the_resume_and_changes_nothing(copy, capsys):
    metrics = copy / "metrics.jsonl"
    rows = metrics.read_text().splitlines()
    metrics.write_text("\n".join(["{not json", *rows]) + "\n")
    before = snapshot(copy)
    assert main(["train", "--resume", "--out", str(copy), "--steps", "6"]) == 2
    assert "metrics.jsonl line 1 is not a JSON object" in capsys.readouterr().err
    assert snapshot(copy) == before


def test_a_checkpoint_from_before_manifests_still_resumes(copy):
    for folder in ckpt.checkpoint_dirs(copy):
        (folder / ckpt.MANIFEST).unlink()
    assert main(["train", "--resume", "--out", str(copy), "--quiet", "--steps", "5"]) == 0
    assert (ckpt.checkpoint_dirs(copy)[-1] / ckpt.MANIFEST).exists()  # new ones get one


def test_eval_refuses_another_runs_checkpoint(run, tmp_path, capsys):
    other = tmp_path / "other"
    assert main(["train", "--out", str(other), *RUN, "--lr", "0.001"]) == 0
    mine = tmp_path / "mine"
    shutil.copytree(run, mine)
    newest = ckpt.checkpoint_dirs(mine)[-1]
    shutil.rmtree(newest)
    shutil.copytree(ckpt.checkpoint_dirs(other)[-1], newest)
    assert main(["eval", "--run", str(mine), "--max-tokens", "1000", "--quiet"]) == 2
    assert "was written by another run (lr: 0.001 there, 0.003 now)" in capsys.readouterr().err


def test_a_failed_final_evaluation_loses_no_trained_step(run, tmp_path, monkeypatch, capsys):
    """A run whose final evaluation failed (`evaluation text has 0 bytes`, issue 60) had trained
    every step and checkpointed none past its last regular one: `--resume` started again at
    step 0. Now the step is checkpointed before the error goes on, and `--resume` finishes
    with the weights of the run that never failed."""
    from blockscale.train import loop

    def fails(*args, **kwargs):
        raise UsageError("evaluation text has 0 bytes; seq_len=32 needs at least 33")

    out = tmp_path / "run"
    # checkpoints at the end only, evaluation at step 4, the last
    flags = [*RUN, "--ckpt-every", "0", "--eval-every", "4"]
    monkeypatch.setattr(loop, "evaluate", fails)
    assert main(["train", "--out", str(out), *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "evaluation text has 0 bytes" in err
    assert "(after step 4, which is checkpointed: fix that and rerun with --resume)" in err
    assert [ckpt.step_of(p) for p in ckpt.checkpoint_dirs(out)] == [4]
    monkeypatch.undo()
    assert main(["train", "--resume", "--out", str(out), *flags, "--eval-every", "0"]) == 0
    assert json.loads((out / "summary.json").read_text())["steps"] == 4
    got = load_file(ckpt.checkpoint_dirs(out)[-1] / "model.safetensors")
    want = load_file(ckpt.checkpoint_dirs(run)[-1] / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
