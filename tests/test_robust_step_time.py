"""A step that takes minutes is said before the progress bar (issue 37): `--seq-len 100000` on
`tiny` sat 226 s on its first step with no word; under `timeout 120` it gave no hint why."""

import dataclasses

import pytest
import torch

from blockscale.models import build_model
from blockscale.train import TrainConfig, build, step_time, train

# A CPU rate no CPU beats by much (100 GFLOP/s), so the estimates below hold on any machine.
CPU_RATE = 1e11


def model_for(cfg: TrainConfig):
    with torch.device("meta"):  # shapes are all an estimate reads
        return build_model(build.build_model_config(cfg))


@pytest.mark.parametrize(
    ("model", "seq_len", "batch"), [("tiny", 100_000, 1), ("moe-tiny", 100_000, 1)]
)
def test_a_long_sequence_is_estimated_slow_and_the_reason_is_attention(model, seq_len, batch):
    cfg = TrainConfig(model=model, seq_len=seq_len, batch_size=batch)
    notice = step_time.slow_step_notice(
        model_for(cfg), seq_len, batch * seq_len, torch.device("cpu"), rate=CPU_RATE
    )
    assert notice is not None and "one training step is estimated at about 1 min" in notice
    assert "attention over 100,000 positions is 99% of the work; a shorter --seq-len" in notice


def test_a_big_model_is_estimated_slow_for_its_size():
    cfg = TrainConfig(model="1b", seq_len=2048, batch_size=16)
    notice = step_time.slow_step_notice(
        model_for(cfg), 2048, 16 * 2048, torch.device("cpu"), rate=CPU_RATE
    )
    assert notice is not None and "parameters times 32,768 tokens" in notice


def test_a_default_step_is_not_slow_and_measures_nothing(monkeypatch):
    def no_measuring(device):
        raise AssertionError("a short step needs no measurement")

    monkeypatch.setattr(step_time, "measured_rate", no_measuring)
    cfg = TrainConfig()
    model = model_for(cfg)
    assert step_time.slow_step_notice(model, 128, 16 * 128, torch.device("cpu")) is None
    assert step_time.slow_step_notice(model, 128, 16 * 128, torch.device("cpu"), 1e9) is None


def test_train_says_it_once_before_the_first_step(tmp_path, monkeypatch, capsys):
    """The loop's one call: on a device measured (here: made) slow, the line comes first."""
    monkeypatch.setattr(step_time, "FAST_RATE", {"cpu": 1.0, "cuda": 1.0})
    monkeypatch.setattr(step_time, "measured_rate", lambda device: 1e3)
    cfg = TrainConfig(steps=2, batch_size=2, seq_len=32, eval_every=0, telemetry_every=0)
    train(dataclasses.replace(cfg, max_data_bytes=20_000), tmp_path / "run", progress=False)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("one training step is estimated at about")
    assert sum("one training step is estimated" in line for line in out) == 1
