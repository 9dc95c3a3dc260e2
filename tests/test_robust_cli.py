"""Bad command lines end in one line on stderr and status 2, before anything is built; each
case here was a traceback or was accepted with odd behaviour (issue 18)."""

import dataclasses
import json
import tomllib
from pathlib import Path

import pytest

import blockscale
from blockscale.cli import main
from blockscale.train import TrainConfig, UsageError
from blockscale.train.config import field_problem


def fails_with(args, capsys) -> str:
    """Run the CLI on `args`; it must exit 2 with one line on stderr, returned."""
    with pytest.raises(SystemExit) as stop:
        main(args)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--lr", "-1", "argument --lr: -1 must be > 0"),
        ("--lr", "0", "argument --lr: 0 must be > 0"),
        ("--lr", "nan", "argument --lr: nan is not a finite number"),
        ("--lr", "inf", "argument --lr: inf is not a finite number"),
        ("--beta1", "1.5", "argument --beta1: 1.5 must lie in [0, 1)"),
        ("--beta2", "1", "argument --beta2: 1 must lie in [0, 1)"),
        ("--seq-len", "-16", "argument --seq-len: -16 must be at least 0"),
        ("--weight-decay", "-5", "argument --weight-decay: -5 must be at least 0"),
        ("--grad-clip", "-1", "argument --grad-clip: -1 must be at least 0"),
        ("--ckpt-every", "-1", "argument --ckpt-every: -1 must be at least 0"),
        ("--eval-every", "-1", "argument --eval-every: -1 must be at least 0"),
        ("--keep-checkpoints", "-1", "argument --keep-checkpoints: -1 must be at least 0"),
        ("--max-minutes", "-1", "argument --max-minutes: -1 must be at least 0"),
        ("--eval-tokens", "-5", "argument --eval-tokens: -5 must be at least 0"),
        ("--warmup-steps", "-10", "argument --warmup-steps: -10 must be at least 0"),
        ("--steps", "0", "argument --steps: 0 must be at least 1"),
        ("--batch-size", "abc", "argument --batch-size: 'abc' is not an integer"),
        ("--batch-size", "2.5", "argument --batch-size: '2.5' is not an integer"),
        ("--bf16-tail", "1.5", "argument --bf16-tail: 1.5 must lie in [0, 1]"),
        ("--seed", "-1", "argument --seed: -1 must lie in [0, "),
        ("--schedule", "linear", "argument --schedule: invalid choice: 'linear'"),
    ],
)
@pytest.mark.parametrize("command", ["train", "compare"])
def test_every_numeric_flag_has_its_range(command, flag, value, message, capsys):
    err = fails_with([command, flag, value], capsys)
    assert f"blockscale {command}: error: {message}" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["eval", "--run", "x", "--batch-size", "-1"], "--batch-size: -1 must be at least 0"),
        (["eval", "--run", "x", "--max-tokens", "-5"], "--max-tokens: -5 must be at least 0"),
        (["eval", "--run", "x", "--step", "-2"], "--step: -2 must be at least 0"),
        (["train", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ],
)
def test_other_bad_flags_get_one_line(args, message, capsys):
    assert message in fails_with(args, capsys)


def test_version(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out == f"blockscale {blockscale.__version__}\n"
    # the version pip installs is the one printed
    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    assert pyproject["project"]["version"] == blockscale.__version__


@pytest.mark.parametrize("command", ["train", "compare"])
def test_out_naming_a_file_is_refused(command, tmp_path, capsys):
    file = tmp_path / "notes.txt"
    file.write_text("mine\n")
    assert main([command, "--out", str(file)]) == 2
    err = capsys.readouterr().err
    assert f"--out {file} is a file, not a directory" in err and err.count("\n") == 1
    assert file.read_text() == "mine\n"


@pytest.mark.parametrize("recipes", ["", " , "])
def test_compare_with_no_recipe_is_refused(recipes, tmp_path, capsys):
    assert main(["compare", "--out", str(tmp_path / "c"), "--recipes", recipes]) == 2
    err = capsys.readouterr().err
    assert "names no recipe" in err and err.count("\n") == 1
    assert not (tmp_path / "c").exists()


def test_the_library_config_checks_the_same_ranges():
    with pytest.raises(UsageError, match=r"lr=-1 must be > 0"):
        TrainConfig(lr=-1)
    with pytest.raises(UsageError, match=r"grad_clip=nan is not a finite number"):
        TrainConfig(grad_clip=float("nan"))
    with pytest.raises(UsageError, match=r"steps='10' is not an integer"):
        TrainConfig(steps="10")
    with pytest.raises(UsageError, match=r"compile=1 is not true or false"):
        TrainConfig(compile=1)
    # Every numeric field has a range (a field added without one would take any value).
    for f in dataclasses.fields(TrainConfig):
        if f.type in ("int", "float", int, float):
            assert f.metadata["range"] is not None, f.name
            assert field_problem(f, -(10**30)) is not None, f.name


def test_a_hand_edited_config_json_gets_one_clear_error(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"model": "tiny", "batch_size": -4}))
    assert main(["train", "--resume", "--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert "config.json: batch_size=-4 must be at least 1" in err
    (run / "config.json").write_text("[1, 2]")
    assert main(["train", "--resume", "--out", str(run)]) == 2
    assert "is not a JSON object" in capsys.readouterr().err


def test_out_where_no_folder_can_be_made_gets_one_line(capsys):
    assert main(["train", "--out", "/proc/no-such-run", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "cannot write the run in /proc/no-such-run: [Errno" in err and err.count("\n") == 1


def test_compare_runs_each_recipe_once_and_always_the_bf16_baseline(tmp_path, capsys):
    """`compare --recipes nvfp4,nvfp4` ran nvfp4 once plus the bf16-seed1 noise run, with no
    bf16 run to measure a gap from: the gap column was all "-" (issue 37)."""
    from blockscale.train.compare import variants

    runs = variants(TrainConfig(), ["nvfp4", "nvfp4"], ["hadamard", "hadamard"], True)
    assert list(runs) == ["bf16", "nvfp4", "bf16-seed1", "nvfp4-no-hadamard"]
    assert runs["bf16"].recipe == "bf16" and runs["bf16"].seed == 0
    # the command line: the runs it would make, named by --report-only on an empty folder
    args = ["compare", "--recipes", "nvfp4,nvfp4", "--report-only", "--out", str(tmp_path)]
    assert main(args) == 2
    assert "holds none of this comparison's runs (bf16, nvfp4, bf16-seed1)" in (
        capsys.readouterr().err
    )


def foreign_folder(tmp_path) -> Path:
    """A transformers model's folder: its config.json and a summary.json of its own."""
    folder = tmp_path / "llama"
    folder.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "summary.json").write_text('{"eval_loss": 1.25}\n')
    return folder


def contents(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*")}


@pytest.mark.parametrize("resume", [False, True], ids=["fresh", "resume"])
def test_out_holding_another_programs_config_is_refused_untouched(resume, tmp_path, capsys):
    """`train --out DIR` overwrote a config.json that was not a run's and deleted its
    summary.json; `--resume` read it as a run config, trained a run of defaults and replaced
    it (issue 60). Now one line, and the folder is as it was (no lock file either)."""
    folder = foreign_folder(tmp_path)
    before = contents(folder)
    args = ["train", *(["--resume"] if resume else []), "--out", str(folder), "--steps", "1"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"{folder} is not a blockscale run: its config.json has keys that are not run " in err
    assert "(architectures, hidden_size, model_type)" in err
    assert contents(folder) == before


def test_out_holding_other_files_is_refused_and_a_run_folder_is_not(tmp_path, capsys):
    """No config.json, other files: someone else's folder, refused. An empty folder, or one
    holding only what a run writes, is taken."""
    folder = tmp_path / "papers"
    folder.mkdir()
    (folder / "draft.tex").write_text("mine\n")
    (folder / "metrics.jsonl").write_text('{"mine": 1}\n')
    before = contents(folder)
    assert main(["train", "--out", str(folder), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"{folder} is not a blockscale run: it has no config.json and holds what no run " in err
    assert "writes (draft.tex)" in err and contents(folder) == before
    empty = tmp_path / "empty"
    empty.mkdir()
    args = ["--quiet", "--steps", "1", "--batch-size", "2", "--seq-len", "32"]
    args += ["--eval-every", "0", "--telemetry-every", "0", "--max-data-bytes", "20000"]
    assert main(["train", "--out", str(empty), *args]) == 0
    # a run's own folder: a fresh start refused as a run, --resume taken
    assert main(["train", "--out", str(empty), *args]) == 2
    assert "already holds a run; pass --resume" in capsys.readouterr().err
    assert main(["train", "--resume", "--out", str(empty), *args, "--steps", "2"]) == 0


def test_a_config_with_foreign_keys_is_not_read_as_a_run(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"lr": 0.1, "epochs": 3}))
    with pytest.raises(UsageError, match=r"its config.json has keys that are not run settings"):
        TrainConfig.load(tmp_path / "config.json")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UsageError, match=r"its config.json holds no run settings"):
        TrainConfig.load(tmp_path / "config.json")
