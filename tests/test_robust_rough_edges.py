"""Rough edges a new user hit (issue 18): eval read training text with no progress shown, compare
nested its runs one folder too deep, and the MXFP8 heatmap painted noise as structure."""

import json
import shutil

import pytest

from blockscale.cli import main
from blockscale.train import TrainConfig, eval_run, train
from blockscale.train.data import load_corpus
from blockscale.train.report import MIN_SPAN_DB, heatmap_range, load_run, variant_dir, write_report

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

SHORT = TrainConfig(
    steps=2,
    batch_size=2,
    seq_len=32,
    eval_every=0,
    telemetry_every=0,
    max_data_bytes=50_000,
)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("edges") / "run"
    train(SHORT, out, progress=False)
    return out


def test_eval_defaults_to_the_runs_held_out_text(run):
    result = eval_run(run, max_tokens=2000)
    held_out = load_corpus(SHORT.data).val
    assert result["data"] == "stdlib (held out)"
    assert result["val_tokens"] == min(2000, held_out.numel() - 1) // 32 * 32


def test_eval_shows_progress_and_quiet_hides_it(run, capsys):
    assert main(["eval", "--run", str(run), "--max-tokens", "4096", "--batch-size", "4"]) == 0
    shown = capsys.readouterr()
    assert "eval" in shown.err and "batch" in shown.err
    assert "(held out)" in shown.out
    assert main(["eval", "--run", str(run), "--max-tokens", "4096", "--quiet"]) == 0
    assert "batch" not in capsys.readouterr().err


def test_compare_keeps_its_runs_directly_in_out_and_still_reads_the_old_layout(run, tmp_path):
    """Runs used to sit in OUT/runs/NAME (runs/compare-TS/runs/NAME by default)."""
    assert variant_dir(tmp_path, "bf16") == tmp_path / "bf16"
    shutil.copytree(run, tmp_path / "runs" / "bf16")
    assert variant_dir(tmp_path, "bf16") == tmp_path / "runs" / "bf16"
    # The runs it has not started yet join the others there.
    assert variant_dir(tmp_path, "nvfp4") == tmp_path / "runs" / "nvfp4"
    report = write_report(tmp_path, ["bf16"])
    table = json.loads((tmp_path / "report.json").read_text())["table"]
    assert report.exists() and [row["run"] for row in table] == ["bf16"]
    assert load_run(variant_dir(tmp_path, "bf16"))["summary"]["status"] == "done"


def test_heatmap_colours_span_at_least_six_db_and_ignore_one_outlier():
    mxfp8_like = [31.17, 31.3, 31.45, 31.6, 31.78] * 10
    lo, hi = heatmap_range(mxfp8_like)
    assert hi - lo == pytest.approx(MIN_SPAN_DB) and lo < 31.17 and hi > 31.78
    nvfp4_like = [16.8 + 0.1 * i for i in range(66)]  # 16.8 ... 23.3 dB
    assert heatmap_range(nvfp4_like) == pytest.approx((16.9, 23.2))
    # One operand quantized exactly reads hundreds of dB; it must not wash the rest out.
    lo, hi = heatmap_range([*nvfp4_like, 300.0])
    assert hi < 30
    assert heatmap_range([float("nan")]) == (0.0, MIN_SPAN_DB)
