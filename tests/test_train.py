"""The training loop end to end on `tiny` (CPU): files, convergence, determinism, exact resume,
telemetry, the precision schedule, evaluation and bad input. Runs are shared per module to keep
the file at about a minute on two cores."""

import dataclasses
import json
import math
import os
import shutil
import signal

import pytest
import torch
from safetensors.torch import load_file

from blockscale.models import model_config
from blockscale.train import TrainConfig, UsageError, eval_run, read_metrics, train
from blockscale.train.build import check_memory, lr_at
from blockscale.train.data import Batches

# Ten NVFP4 steps, every row logged, checkpoints and telemetry mid-run.
SHORT = TrainConfig(
    recipe="nvfp4",
    steps=10,
    batch_size=4,
    seq_len=64,
    warmup_steps=2,
    log_every=1,
    eval_every=5,
    eval_tokens=4096,
    telemetry_every=3,
    ckpt_every=4,
    max_data_bytes=200_000,
)


# training tests run on one CPU thread (tests/conftest.py says why)
pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def rows(run_dir, kind):
    return [r for r in read_metrics(run_dir) if r["kind"] == kind]


def losses(run_dir):
    return [r["loss"] for r in rows(run_dir, "train")]


def without_speed(run_dir):
    """The metric rows without what depends on the clock (speed, wall time)."""
    clock = ("tokens_per_s", "time")
    return [{k: v for k, v in r.items() if k not in clock} for r in read_metrics(run_dir)]


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bf16") / "run"
    cfg = TrainConfig(steps=60, log_every=5, eval_every=30, ckpt_every=30, max_data_bytes=1_000_000)
    return out, train(cfg, out, progress=False)


@pytest.fixture(scope="module")
def nvfp4_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("nvfp4") / "run"
    return out, train(SHORT, out, progress=False)


def test_a_run_writes_its_files_and_its_loss_falls(bf16_run):
    out, summary = bf16_run
    assert {p.name for p in out.iterdir()} == {
        "config.json",
        "metrics.jsonl",
        "checkpoints",
        "summary.json",
    }
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000030", "step_000060"]
    assert {p.name for p in (out / "checkpoints" / "step_000060").iterdir()} == {
        "model.safetensors",
        "trainer.safetensors",
        "manifest.json",
    }
    assert summary["status"] == "done" and summary["steps"] == 60
    train_rows = rows(out, "train")
    assert [r["step"] for r in train_rows] == list(range(5, 61, 5))
    assert all(math.isfinite(r["loss"]) and r["tokens_per_s"] > 0 for r in train_rows)
    # Bytes start at ln(256) = 5.55 nats; 60 steps get well below it.
    assert train_rows[0]["loss"] > 4.5 and train_rows[-1]["loss"] < train_rows[0]["loss"] - 1.0
    evals = rows(out, "eval")
    assert [r["step"] for r in evals] == [30, 60] and evals[1]["val_loss"] < evals[0]["val_loss"]
    assert summary["val_loss"] == evals[-1]["val_loss"]


def test_same_seed_gives_the_same_losses_and_telemetry_changes_none(nvfp4_run, tmp_path):
    out, _ = nvfp4_run
    again = train(SHORT, tmp_path / "again", progress=False)
    assert (
        losses(tmp_path / "again") == losses(out) and again["val_loss"] == nvfp4_run[1]["val_loss"]
    )
    train(dataclasses.replace(SHORT, telemetry_every=0), tmp_path / "quiet", progress=False)
    assert losses(tmp_path / "quiet") == losses(out)
    train(dataclasses.replace(SHORT, seed=1), tmp_path / "seed1", progress=False)
    assert losses(tmp_path / "seed1") != losses(out)


def test_an_interrupted_run_resumes_exactly(tmp_path, monkeypatch):
    # Rows every 4 steps and a stop after step 6: the checkpoint carries a half-done row.
    cfg = dataclasses.replace(SHORT, log_every=4)
    out = tmp_path / "uninterrupted"
    train(cfg, out, progress=False)
    get = Batches.get

    def interrupt_at_step_5(self, step, micro=0):
        if step == 5 and micro == 0:
            os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C: the step finishes, then it stops
        return get(self, step, micro)

    monkeypatch.setattr(Batches, "get", interrupt_at_step_5)
    stopped = train(cfg, tmp_path / "run", progress=False)
    assert stopped["status"] == "interrupted"
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == [
        "step_000004",
        "step_000006",
    ]
    monkeypatch.setattr(Batches, "get", get)
    resumed = train(cfg, tmp_path / "run", resume=True, progress=False)
    assert resumed["status"] == "done"
    assert without_speed(tmp_path / "run") == without_speed(out)
    final = load_file(tmp_path / "run" / "checkpoints" / "step_000010" / "model.safetensors")
    expected = load_file(out / "checkpoints" / "step_000010" / "model.safetensors")
    assert final.keys() == expected.keys()
    assert all(torch.equal(final[k], expected[k]) for k in final)

    # A crash while writing the last checkpoint: resume from the one before it.
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step_000010")
    (tmp_path / "run" / "checkpoints" / "step_000010.tmp").mkdir()
    train(cfg, tmp_path / "run", resume=True, progress=False)
    assert without_speed(tmp_path / "run") == without_speed(out)


def test_telemetry_reports_each_converted_layer_and_operand(nvfp4_run):
    out, _ = nvfp4_run
    telemetry = rows(out, "telemetry")
    assert [r["step"] for r in telemetry] == [0, 3, 6, 9, 10]
    layers = telemetry[-1]["layers"]
    # tiny has 2 blocks; the BF16 tail keeps the last one, and the LM head stays BF16.
    assert sorted(layers) == [
        "layers.0.attn.wo",
        "layers.0.attn.wqkv",
        "layers.0.mlp.w13",
        "layers.0.mlp.w2",
    ]
    operands = set(layers["layers.0.mlp.w2"])
    assert operands == {
        "output.input",
        "output.weight",
        "grad_input.grad_output",
        "grad_weight.grad_output_t",
        "grad_weight.input_t",
    }  # grad_input.weight is output.weight's exact transpose (16x16 blocks) and is not repeated
    for stats in (s for layer in layers.values() for s in layer.values()):
        # NVFP4 of roughly Gaussian data: about 17-21 dB (E2M1 has 3 bits of magnitude).
        assert 12 < stats["sqnr_db"] < 30
        assert 0 <= stats["zero_frac"] < 0.5 and stats["amax"] > 0


def test_precision_schedule_switches_to_bf16_for_the_final_fraction(nvfp4_run, tmp_path):
    out, _ = nvfp4_run
    quiet = dict(telemetry_every=0)
    train(dataclasses.replace(SHORT, recipe="bf16", **quiet), tmp_path / "bf16", progress=False)
    train(
        dataclasses.replace(SHORT, bf16_final_fraction=1.0, **quiet),
        tmp_path / "all",
        progress=False,
    )
    assert losses(tmp_path / "all") == losses(tmp_path / "bf16")
    train(
        dataclasses.replace(SHORT, bf16_final_fraction=0.5, **quiet),
        tmp_path / "half",
        progress=False,
    )
    half, quantized = losses(tmp_path / "half"), losses(out)
    assert half[:5] == quantized[:5] and all(a != b for a, b in zip(half[5:], quantized[5:]))


def test_eval_scores_a_saved_run_on_any_text(bf16_run, tmp_path):
    out, summary = bf16_run
    text = tmp_path / "other.txt"
    text.write_text("The quick brown fox jumps over the lazy dog.\n" * 200)
    result = eval_run(out, str(text))
    assert result["checkpoint"] == "step_000060"
    assert result["val_tokens"] == (text.stat().st_size - 1) // 128 * 128
    assert math.isfinite(result["val_loss"]) and result["val_bpb"] == pytest.approx(
        result["val_loss"] / math.log(2)
    )
    partial = eval_run(out, "stdlib", step=30, max_tokens=2000)
    assert partial["checkpoint"] == "step_000030" and partial["val_tokens"] == 15 * 128


def test_a_corrupt_checkpoint_gets_one_clear_error(bf16_run, tmp_path):
    out, _ = bf16_run
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    weights = copy / "checkpoints" / "step_000060" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    cfg = TrainConfig.load(copy / "config.json")
    with pytest.raises(UsageError, match="step_000060 is corrupt: model.safetensors has 100 bytes"):
        train(cfg, copy, resume=True, progress=False)
    with pytest.raises(UsageError, match="already holds a run; pass --resume"):
        train(cfg, copy, progress=False)


def test_a_time_limit_pauses_and_resume_finishes(tmp_path):
    cfg = TrainConfig(
        steps=4,
        log_every=1,
        eval_every=0,
        telemetry_every=0,
        max_minutes=1e-9,
        max_data_bytes=100_000,
    )
    assert train(cfg, tmp_path, progress=False)["status"] == "paused"
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_000001"]
    done = train(dataclasses.replace(cfg, max_minutes=0), tmp_path, resume=True, progress=False)
    assert done["status"] == "done" and [r["step"] for r in rows(tmp_path, "train")] == [1, 2, 3, 4]


def test_deterministic_holds_for_the_run_and_is_undone_after(tmp_path, monkeypatch):
    # `--deterministic` (CUDA runs that repeat bit for bit, and 2-rank runs equal to one
    # process): on for the whole run, from before the model is built, and off again after,
    # so a library caller's process is left as it was.
    from blockscale.train import loop

    seen = []
    build = loop.build.build_model

    def recording(cfg, device):
        seen.append(("build", torch.are_deterministic_algorithms_enabled()))
        return build(cfg, device)

    monkeypatch.setattr(loop.build, "build_model", recording)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)  # restored after the test
    assert not torch.are_deterministic_algorithms_enabled()
    cfg = TrainConfig(steps=1, batch_size=2, seq_len=32, eval_every=0, max_data_bytes=50_000)
    train(dataclasses.replace(cfg, deterministic=True), tmp_path / "on", progress=False)
    assert not torch.are_deterministic_algorithms_enabled()
    train(cfg, tmp_path / "off", progress=False)
    assert seen == [("build", True), ("build", False)]
    assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") == ":4096:8"  # cuBLAS's fixed order
    assert losses(tmp_path / "on") == losses(tmp_path / "off")  # the CPU already repeats


def test_a_model_too_large_for_memory_is_refused_before_allocating():
    cfg = TrainConfig(model="1b", batch_size=4096)
    with pytest.raises(UsageError, match=r"model '1b' \(1029M parameters\).*needs about"):
        check_memory(model_config("1b"), cfg, torch.device("cpu"))


def test_learning_rate_schedules():
    cos = TrainConfig(steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1)
    assert lr_at(cos, 0) == pytest.approx(0.1) and lr_at(cos, 9) == pytest.approx(1.0)
    assert lr_at(cos, 55) == pytest.approx(0.55) and lr_at(cos, 100) == pytest.approx(0.1)
    wsd = dataclasses.replace(cos, schedule="wsd", decay_fraction=0.2)
    assert lr_at(wsd, 79) == pytest.approx(1.0) and lr_at(wsd, 90) == pytest.approx(0.55)
    assert lr_at(wsd, 100) == pytest.approx(0.1)
    with pytest.raises(UsageError, match="schedule='linear' is not one of"):
        TrainConfig(schedule="linear")


def test_config_round_trips_through_json(tmp_path):
    cfg = dataclasses.replace(SHORT, hadamard=False)
    cfg.save(tmp_path / "config.json")
    assert TrainConfig.load(tmp_path / "config.json") == cfg
    assert json.loads((tmp_path / "config.json").read_text())["hadamard"] is False


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True])
def test_cuda_runs_every_recipe_under_bf16_autocast(tmp_path, compile):
    for recipe in ("bf16", "nvfp4", "mxfp8", "nvfp4_fwd_mxfp8_bwd"):
        cfg = dataclasses.replace(SHORT, recipe=recipe, device="cuda", compile=compile, steps=12)
        summary = train(cfg, tmp_path / recipe, progress=False)
        assert summary["status"] == "done" and summary["peak_memory_gib"] > 0
        # The summary's peak is the training steps' own: the largest of the train rows'.
        peaks = [r["peak_gib"] for r in rows(tmp_path / recipe, "train")]
        assert summary["peak_memory_gib"] == max(peaks) and peaks == sorted(peaks)
        train_losses = losses(tmp_path / recipe)
        assert all(math.isfinite(v) for v in train_losses) and train_losses[-1] < train_losses[0]
        if recipe != "bf16":
            sqnr = [
                s["sqnr_db"]
                for r in rows(tmp_path / recipe, "telemetry")
                for layer in r["layers"].values()
                for s in layer.values()
            ]
            assert sqnr and all(12 < v < 40 for v in sqnr)
            assert all(r["peak_gib"] > 0 for r in rows(tmp_path / recipe, "telemetry"))


def test_weight_cache_switch_gives_the_same_bits(tmp_path, monkeypatch):
    # `--no-weight-cache` quantizes each weight at every use instead of once a step; the bits
    # are the same (tests/test_weight_cache.py per op), so the losses and the saved weights of a
    # run with two micro-batches a step are equal bit for bit, dense layers and experts alike.
    from blockscale.train import loop

    caches = {}
    build = loop.build.build_model

    def recording(cfg, device):
        model, recipe = build(cfg, device)
        held = [m.weight_cache for m in model.modules() if hasattr(m, "weight_cache")]
        caches[cfg.weight_cache] = held
        return model, recipe

    monkeypatch.setattr(loop.build, "build_model", recording)
    cfg = TrainConfig(model="moe-tiny", recipe="nvfp4", steps=3, batch_size=2, seq_len=32,
                      grad_accum=2, eval_every=0, telemetry_every=0, log_every=1,
                      max_data_bytes=50_000)  # fmt: skip
    train(cfg, tmp_path / "on", progress=False)
    train(dataclasses.replace(cfg, weight_cache=False), tmp_path / "off", progress=False)
    assert caches[True] and all(c is not None for c in caches[True])
    assert len(caches[False]) == len(caches[True]) and all(c is None for c in caches[False])
    assert losses(tmp_path / "on") == losses(tmp_path / "off")
    on, off = (load_file(p / "checkpoints" / "step_000003" / "model.safetensors")
               for p in (tmp_path / "on", tmp_path / "off"))  # fmt: skip
    assert on.keys() == off.keys()
    for name in on:
        torch.testing.assert_close(on[name], off[name], atol=0, rtol=0, msg=name)
