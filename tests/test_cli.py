"""The command line: compare end to end with its report, eval, `python -m blockscale`, and
the one-line errors for bad input."""

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from blockscale.cli import main
from blockscale.train import TrainConfig, machine

ROOT = Path(__file__).resolve().parents[1]
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}


def python_m_blockscale(*args: str) -> subprocess.CompletedProcess:
    """`python -m blockscale ARGS` from the repository root, one thread, output captured."""
    return subprocess.run(
        [sys.executable, "-m", "blockscale", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard: 34 s measured on one loaded core
        env=ONE_THREAD,
    )


FAST = [
    "--steps",
    "8",
    "--batch-size",
    "4",
    "--seq-len",
    "64",
    "--warmup-steps",
    "2",
    "--log-every",
    "2",
    "--eval-every",
    "4",
    "--eval-tokens",
    "4096",
    "--telemetry-every",
    "4",
    "--max-data-bytes",
    "200000",
]


# training tests run on one CPU thread (tests/conftest.py says why)
pytestmark = pytest.mark.usefixtures("one_cpu_thread")


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    args = ["compare", "--quiet", "--out", str(out), "--ablate", "hadamard,bf16_tail", *FAST]
    return out, args


def test_compare_writes_the_report_with_its_plots(compared, capsys):
    out, args = compared
    assert main(args) == 0
    printed = capsys.readouterr().out
    names = [
        "bf16",
        "nvfp4",
        "mxfp8",
        "nvfp4_fwd_mxfp8_bwd",
        "bf16-seed1",
        "nvfp4-no-hadamard",
        "nvfp4-no-bf16-tail",
    ]
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == sorted(names)
    report = (out / "report.md").read_text()
    assert (
        "| run | val loss | gap to BF16 |" in report and f"report: {out / 'report.md'}" in printed
    )
    for name in names:
        assert f"| {name} |" in report and name in printed
    pngs = {"loss_curves.png", "gap_to_bf16.png"} | {
        f"telemetry_{n}.png" for n in names if not n.startswith("bf16")
    }
    assert pngs <= {p.name for p in out.iterdir()}
    for png in pngs:
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"({png})" in report
    table = {row["run"]: row for row in json.loads((out / "report.json").read_text())["table"]}
    assert table["bf16"]["gap_pct"] == 0.0
    assert f"Noise floor: `bf16-seed1` ends {table['bf16-seed1']['gap_pct']:+.2f}%" in report
    # The banner names the torch the runs recorded, not the one writing the report.
    assert f"torch {torch.__version__}. " in report
    summary = json.loads((out / "bf16" / "summary.json").read_text())
    assert summary["torch"] == torch.__version__
    assert all(row["status"] == "done" and row["val_loss"] > 0 for row in table.values())
    # One run after another on one device: none shared it, so every speed compares with BF16's.
    assert all(row["shared_pct"] == 0 and row["speed_vs_bf16"] > 0 for row in table.values())
    assert "shared" not in report.split("## Loss curves")[0].split("|", 1)[1]
    # The ablation differs from the full recipe in its one switch only.
    config = json.loads((out / "nvfp4-no-hadamard" / "config.json").read_text())
    assert config["recipe"] == "nvfp4" and config["hadamard"] is False
    # Each run trained here recorded what the machine gave it, whether or not it was marked.
    for name in names:
        (segment,) = machine.read(out / name)
        assert segment["ran_s"] > 0 and segment["waited_s"] >= 0 and segment["cores"] >= 1
        assert table[name]["waited_pct"] is not None
    assert '"seq_len": 64' in report


def test_compare_rerun_reuses_finished_runs_and_refuses_other_configs(compared, capsys):
    out, args = compared
    assert main(args) == 0
    assert "nvfp4: finished run found" in capsys.readouterr().out
    assert main([*args, "--lr", "0.01"]) == 2
    assert "holds a run with another config (lr: 0.003 there, 0.01 now)" in capsys.readouterr().err


def test_compare_only_runs_one_variant(tmp_path):
    args = [
        "compare",
        "--quiet",
        "--out",
        str(tmp_path),
        "--recipes",
        "bf16,mxfp8",
        "--only",
        "mxfp8",
        *FAST,
    ]
    assert main(args) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["mxfp8"]
    assert not (tmp_path / "report.md").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["train", "--recipe", "nvfp5"], "recipe 'nvfp5' does not exist; choose one of bf16"),
        (["train", "--data", "/no/such/corpus"], "data path '/no/such/corpus' does not exist"),
        (
            ["train", "--model", "1b", "--batch-size", "100000"],
            "choose a smaller --model or --batch-size",
        ),
        (["compare", "--recipes", "bf16,fp3"], "recipe 'fp3' does not exist"),
        (["compare", "--ablate", "dropout"], "ablation 'dropout' does not exist"),
        (["eval", "--run", "/no/such/run"], "/no/such/run is not a run directory"),
    ],
)
def test_bad_input_gets_one_line_and_status_2(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_python_m_blockscale_trains_resumes_and_evaluates(tmp_path):
    train = [
        "train",
        "--quiet",
        "--out",
        str(tmp_path),
        "--steps",
        "3",
        "--log-every",
        "1",
        "--eval-every",
        "0",
        "--seq-len",
        "32",
        "--batch-size",
        "2",
        "--max-data-bytes",
        "100000",
    ]
    done = python_m_blockscale(*train)
    assert done.returncode == 0, done.stderr
    summary = next(line for line in done.stdout.splitlines() if line.startswith("{"))
    assert json.loads(summary)["status"] == "done"
    longer = python_m_blockscale(
        "train", "--quiet", "--out", str(tmp_path), "--resume", "--steps", "5"
    )
    assert longer.returncode == 0, longer.stderr
    steps = [
        json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == [1, 2, 3, 4, 5]
    scored = python_m_blockscale("eval", "--run", str(tmp_path), "--max-tokens", "4096")
    assert scored.returncode == 0, scored.stderr
    assert "step_000005" in scored.stdout and "bits/byte" in scored.stdout


def test_a_paused_run_exits_3_and_resumes_to_0(tmp_path):
    args = ["train", "--quiet", "--out", str(tmp_path), "--steps", "3", "--eval-every", "0"]
    args += ["--seq-len", "32", "--batch-size", "2", "--max-data-bytes", "100000"]
    assert main([*args, "--max-minutes", "1e-9"]) == 3
    assert main([*args, "--resume", "--max-minutes", "0"]) == 0


def test_bench_train_builds_each_ablation_as_compare_does():
    """bench_train's ablation names give the configs `compare --ablate` runs, so the study's
    standalone speeds are of the same variants as its losses."""
    path = ROOT / "benchmarks" / "bench_train.py"
    spec = importlib.util.spec_from_file_location("bench_train", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    from blockscale.train.compare import ABLATIONS, variants

    base = TrainConfig(model="tiny")
    runs = variants(base, ["bf16", "nvfp4"], list(ABLATIONS), noise_floor=False)
    assert len(runs) == 2 + len(ABLATIONS)
    for name, cfg in runs.items():
        assert dataclasses.replace(base, **bench.variant_config(name)) == cfg, name


def _timed_run(name: str, device: str, start: float, rows: int = 21, speed: float = 100.0):
    """A run as the report loads it, training one row a second from `start`."""
    metrics = [
        {"kind": "train", "step": 10 * (i + 1), "loss": 1.0, "time": start + i} for i in range(rows)
    ]
    summary = {"device_id": device, "tokens_per_s": speed, "val_loss": 1.0}
    return {"name": name, "config": {}, "summary": summary, "rows": metrics}


def test_report_marks_runs_that_shared_a_device_and_compares_no_speed_with_them():
    from blockscale.train.report import shared_pct, table

    bf16 = _timed_run("bf16", "host/gpu0", 0.0)
    half = _timed_run("nvfp4", "host/gpu0", 1010.0)  # trains 1010-1030
    other = _timed_run("mxfp8", "host/gpu0", 1020.0)  # 1020-1040: overlaps nvfp4's second half
    elsewhere = _timed_run("nvfp4_fwd_mxfp8_bwd", "host/gpu1", 1010.0)  # same time, other GPU
    untimed = _timed_run("bf16-seed1", "host/gpu0", 0.0)
    for row in untimed["rows"]:
        del row["time"]
    runs = [bf16, half, other, elsewhere, untimed]
    assert shared_pct(half, runs) == 50.0 and shared_pct(other, runs) == 50.0
    assert shared_pct(bf16, runs) == 0.0 and shared_pct(elsewhere, runs) == 0.0
    assert shared_pct(untimed, runs) is None
    rows = {r["run"]: r for r in table(runs)}
    assert rows["nvfp4"]["speed_vs_bf16"] is None and rows["mxfp8"]["speed_vs_bf16"] is None
    assert rows["nvfp4_fwd_mxfp8_bwd"]["speed_vs_bf16"] == 1.0
    assert rows["bf16-seed1"]["speed_vs_bf16"] is None  # no timestamps: it may have shared
    # Nor does any speed compare with a BF16 baseline that may have shared its device.
    untimed_bf16 = _timed_run("bf16", "host/gpu0", 0.0)
    for row in untimed_bf16["rows"]:
        del row["time"]
    rows = {r["run"]: r for r in table([untimed_bf16, elsewhere])}
    assert rows["nvfp4_fwd_mxfp8_bwd"]["speed_vs_bf16"] is None
    # A pause and its resume (a gap far longer than a step) is not training time.
    resumed = _timed_run("nvfp4", "host/gpu0", 900.0, rows=5)
    resumed["rows"] += _timed_run("x", "", 2000.0, rows=5)["rows"]
    assert shared_pct(resumed, [resumed, other]) == 0.0


def test_report_names_runs_whose_peak_memory_predates_the_training_peak():
    from blockscale.train.report import _memory_note, table

    new = _timed_run("bf16", "host/gpu0", 0.0)
    for i, row in enumerate(new["rows"]):
        row["peak_gib"] = 9.0 + i / 100
    new["summary"]["peak_memory_gib"] = 9.19
    old = _timed_run("nvfp4", "host/gpu0", 100.0)
    old["summary"]["peak_memory_gib"] = 11.1
    cpu = _timed_run("mxfp8", "cpu", 200.0)  # no peak at all: nothing to say of it
    note = _memory_note(table([new, old, cpu]))
    assert "`nvfp4`" in note and "`bf16`" not in note and "`mxfp8`" not in note
    assert "predate" not in _memory_note(table([new, cpu]))


def _measured(waited_pct: float) -> dict:
    """What `machine.summarize` gives a run whose threads waited `waited_pct` of their time."""
    ran = 100.0 - waited_pct
    segment = {"wall_s": 10.0, "cpu_s": ran, "ran_s": ran, "waited_s": waited_pct}
    return machine.summarize([{**segment, "others_cores": 1.0, "cores": 2, "load_1min": 3.0}])


def test_report_marks_a_speed_the_machine_distorted_and_says_why():
    """A run whose threads waited for a core (another process on the CPUs) or whose speed
    moved more than 2x between intervals is marked in both speed columns, with one sentence;
    a ratio to a distorted BF16 speed is distorted too. Measured cases are in docs/LOG.md
    (2026-12-05): tens of % waited beside a CPU-bound process, a few % without."""
    from blockscale.train.report import _cells, reliability_lines, table

    started = []

    def run(name: str, waited: float | None, rates=(100.0, 100.0, 100.0)) -> dict:
        start = 100.0 * len(started)  # one run after another: none shared the device
        started.append(name)
        out = _timed_run(name, "cpu", start, rows=len(rates))
        for row, rate in zip(out["rows"], rates):
            row["tokens_per_s"] = rate
        out["machine"] = None if waited is None else _measured(waited)
        return out

    calm, slowed = run("bf16", 2.0), run("nvfp4", 45.0)
    moved = run("mxfp8", 1.0, rates=(50.0, 100.0, 30.0))  # the first interval is warm-up
    steady = run("nvfp4_fwd_mxfp8_bwd", 1.0, rates=(10.0, 100.0, 80.0))
    unknown = run("bf16-seed1", None)
    rows = {r["run"]: r for r in table([calm, slowed, moved, steady, unknown])}
    assert rows["bf16"]["unreliable"] is None and rows["nvfp4_fwd_mxfp8_bwd"]["unreliable"] is None
    assert "waited for a core 45% of the time" in rows["nvfp4"]["unreliable"]
    assert "1.0 of 2 cores busy" in rows["nvfp4"]["unreliable"]
    assert "moved 3.3x between logging intervals" in rows["mxfp8"]["unreliable"]
    assert rows["bf16-seed1"]["unreliable"] is None and rows["bf16-seed1"]["waited_pct"] is None
    assert rows["nvfp4"]["speed_vs_bf16"] == 1.0  # the figure stays, marked
    assert "(unreliable)" in _cells(rows["nvfp4"])[4] and "(unreliable)" in _cells(rows["nvfp4"])[5]
    assert "(unreliable)" not in " ".join(_cells(rows["nvfp4_fwd_mxfp8_bwd"]))
    text = "\n".join(reliability_lines(list(rows.values())))
    assert "- `nvfp4`: its threads waited" in text and "- `mxfp8`: its speed moved" in text
    assert "`bf16`:" not in text and "Not checked for other processes' load" in text
    assert "`bf16-seed1`" in text
    # A distorted BF16 speed distorts every ratio to it.
    rows = {r["run"]: r for r in table([run("bf16", 60.0), run("mxfp8", 1.0)])}
    assert rows["mxfp8"]["unreliable"] is None and rows["mxfp8"]["ratio_unreliable"]
    assert "(unreliable)" in _cells(rows["mxfp8"])[5]
    assert "(unreliable)" not in _cells(rows["mxfp8"])[4]


def test_machine_record_measures_a_segment(tmp_path):
    """`record` appends one row a segment, for a run that exists (its config.json) only."""
    with machine.record(tmp_path):
        sum(i * i for i in range(200_000))
    assert machine.read(tmp_path) == []  # no run there yet: nothing written
    (tmp_path / "config.json").write_text("{}")
    for _ in range(2):
        with machine.record(tmp_path):
            sum(i * i for i in range(200_000))
    rows = machine.read(tmp_path)
    assert len(rows) == 2 and all(r["ran_s"] > 0 and r["wall_s"] > 0 for r in rows)
    summary = machine.summarize(rows)
    assert 0 <= summary["waited_pct"] <= 100 and summary["cores"] >= 1
    assert machine.withheld({**summary, "waited_pct": 5.0}) is None
    assert machine.withheld({**summary, "waited_pct": 50.0}).startswith("its threads waited")


def test_every_plot_has_a_legend_and_the_config_shows_the_seq_len_used(tmp_path, monkeypatch):
    import matplotlib.figure

    from blockscale.train.report import _as_used, plot

    runs = []
    for name in ("bf16", "nvfp4", "bf16-seed1"):
        run = _timed_run(name, "cpu", 0.0, rows=4)
        run["rows"] += [{"kind": "eval", "step": 20, "val_loss": 1.0}]
        runs.append(run)
    saved = {}
    monkeypatch.setattr(
        matplotlib.figure.Figure, "savefig", lambda fig, path, **kw: saved.update({path: fig})
    )
    plot(tmp_path, runs)
    assert {p.name for p in saved} == {"loss_curves.png", "gap_to_bf16.png"}
    for path, fig in saved.items():
        for ax in fig.axes:
            assert ax.get_legend() is not None, (path.name, ax.get_title())
    assert _as_used({"model": "tiny", "seq_len": 0})["seq_len"] == 128
    assert _as_used({"model": "tiny", "seq_len": 64})["seq_len"] == 64
