"""A step that takes minutes is said before the progress bar (issue 37): `--seq-len 100000` on
`tiny` sat 226 s on its first step with no word; under `timeout 120` it gave no hint why.

Issue 60: `--grad-accum 3000` made 4-minute steps that the FLOP estimate put under a minute, so
nothing was said; and SIGTERM during such a step was not acknowledged, a second one was ignored
too, and the process exited 253 s later. Now the first step is timed, the first signal is
acknowledged at once and a second one stops the run within seconds."""

import dataclasses
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from blockscale.models import build_model
from blockscale.train import TrainConfig, build, read_metrics, step_time, train
from blockscale.train import checkpoint as ckpt
from blockscale.train.data import Batches

ROOT = Path(__file__).resolve().parents[1]

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


SMALL = TrainConfig(
    steps=4,
    batch_size=1,
    seq_len=32,
    grad_accum=4,
    eval_every=0,
    telemetry_every=0,
    ckpt_every=0,
    max_data_bytes=20_000,
)


def test_a_step_of_many_micro_batches_is_timed_and_said(tmp_path, monkeypatch, capsys):
    """The FLOP estimate misses a step made long by its micro-batches (here: made to miss, and
    a minute made a millisecond); the first step's timing says it, once."""
    monkeypatch.setattr(step_time, "slow_step_notice", lambda *args, **kwargs: None)
    monkeypatch.setattr(step_time, "SLOW_STEP_SECONDS", 1e-3)
    train(SMALL, tmp_path / "run", progress=False)
    said = [line for line in capsys.readouterr().out.splitlines() if "training step" in line]
    assert len(said) == 1, said
    assert said[0].startswith("one training step takes about ")
    assert "4 micro-batches (--grad-accum) of " in said[0] and "timed on the first step" in said[0]


def test_the_first_sigterm_is_acknowledged_at_once(tmp_path, monkeypatch, capfd):
    """SIGTERM in the middle of step 2: said on stderr while the step runs, which then
    finishes, is checkpointed, and the run stops."""
    get = Batches.get

    def sigterm_in_step_2(self, step, micro=0):
        if step == 1 and micro == 2:
            os.kill(os.getpid(), signal.SIGTERM)
            assert "SIGTERM received" in capfd.readouterr().err  # before the step goes on
        return get(self, step, micro)

    monkeypatch.setattr(Batches, "get", sigterm_in_step_2)
    capfd.readouterr()
    summary = train(SMALL, tmp_path / "run", progress=False)
    assert summary["status"] == "interrupted" and summary["steps"] == 2
    assert [ckpt.step_of(p) for p in ckpt.checkpoint_dirs(tmp_path / "run")] == [2]


def _lines(stream, into: queue.Queue) -> None:
    for line in stream:
        into.put(line)


def _wait_for(lines: queue.Queue, text: str, seconds: float) -> str:
    """The first line holding `text` within `seconds` (a hang guard), else a failure."""
    deadline, seen = time.monotonic() + seconds, []
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
        except queue.Empty:
            break
        if text in line:
            return line
        seen.append(line)
    pytest.fail(f"no line with {text!r} in {seconds} s; seen: {seen}")


@pytest.mark.skipif(os.name != "posix", reason="needs POSIX signals")
def test_sigterm_in_a_minutes_long_step_is_answered_and_a_second_one_stops_it(tmp_path):
    """`tiny` with 100,000 micro-batches a step (minutes of it): the step is said seconds in,
    the first SIGTERM is acknowledged at once, and the second ends the process within
    seconds (status 130, as a second Ctrl-C), not after the step."""
    flags = ["--quiet", "--out", str(tmp_path / "run"), "--batch-size", "1", "--seq-len", "32"]
    flags += ["--grad-accum", "100000", "--steps", "2", "--eval-every", "0"]
    flags += ["--telemetry-every", "0", "--max-data-bytes", "20000"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.Popen(
        [sys.executable, "-m", "blockscale", "train", *flags],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = queue.Queue(), queue.Queue()
    for stream, into in ((run.stdout, out), (run.stderr, err)):
        threading.Thread(target=_lines, args=(stream, into), daemon=True).start()
    try:
        # Hang guards, not time limits: each takes a second or two.
        notice = _wait_for(out, "one training step takes about", 120)
        assert "100,000 micro-batches (--grad-accum)" in notice
        run.send_signal(signal.SIGTERM)
        ack = _wait_for(err, "SIGTERM received", 30)
        assert "the run stops after step 1 of 2 (micro-batch " in ack
        assert "to go), writes a checkpoint and exits; a second SIGINT or SIGTERM stops" in ack
        run.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        assert run.wait(timeout=120) == 130
        assert time.monotonic() - sent < 30  # the step had minutes to go
        assert "blockscale train: interrupted" in _wait_for(err, "interrupted", 10)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert read_metrics(tmp_path / "run") == []  # no step finished, none claimed
