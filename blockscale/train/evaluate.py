"""Evaluation: mean loss and bits per byte on held-out or any other text.

Tokens are bytes, so bits per byte is the mean loss in nats divided by ln 2, comparable across
models and recipes with no tokenizer caveat. `eval_run` loads a run's config and last (or a
given) checkpoint into the same converted model that trained, and evaluates it in the precision
that run ended in (BF16 if its precision schedule switched at the end). By default it scores the
held-out part of the run's own data (the split training never reads, data.load_corpus), with a
progress bar: scoring all of a corpus on a CPU takes minutes.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

import blockscale.nn as bsnn
from blockscale.train import build, checkpoint
from blockscale.train.config import TrainConfig, identity
from blockscale.train.data import eval_windows, load_corpus, read_all
from blockscale.train.errors import UsageError

try:
    from tqdm.auto import tqdm
except ImportError:  # tqdm is a dependency, but a bare GPU image may lack it
    tqdm = None


@torch.no_grad()
def evaluate(
    model,
    tokens: torch.Tensor,
    seq_len: int,
    batch_size: int,
    device,
    max_tokens: int = 0,
    progress: bool = False,
) -> dict:
    """{"val_loss", "val_bpb", "val_tokens"} over consecutive windows of `tokens`."""
    if batch_size < 1:
        raise UsageError(f"batch_size={batch_size} must be at least 1")
    x, y = eval_windows(tokens, seq_len, max_tokens)
    starts = range(0, x.shape[0], batch_size)
    if progress and tqdm is not None:
        starts = tqdm(starts, unit="batch", desc="eval", dynamic_ncols=True)
    autocast = build.autocast_for(device)
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    # fork_rng: evaluating must not move the training run's random stream.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for i in starts:
            xb, yb = x[i : i + batch_size].to(device), y[i : i + batch_size].to(device)
            with autocast():
                logits = model(xb)
            total += F.cross_entropy(
                logits.float().flatten(0, 1), yb.flatten(), reduction="sum"
            ).double()
    model.train(was_training)
    loss = total.item() / y.numel()
    return {"val_loss": loss, "val_bpb": loss / math.log(2), "val_tokens": y.numel()}


def eval_run(
    run_dir: Path,
    data: str | None = None,
    step: int | None = None,
    max_tokens: int = 0,
    batch_size: int = 0,
    progress: bool = False,
    binary_data: bool = False,
) -> dict:
    """Evaluate a run's checkpoint on all of `data` (a file, directory or 'stdlib'), or with
    `data` None on the held-out part of the run's own data. `batch_size` 0: the run's.
    `binary_data`: score `data` even where it does not look like text (data.check_text); the
    run's own data is read as the run read it."""
    if batch_size < 0 or max_tokens < 0:
        raise UsageError(
            f"batch_size={batch_size} and max_tokens={max_tokens} must be at least 0 (0: default)"
        )
    if not (run_dir / "config.json").is_file():
        raise UsageError(f"{run_dir} is not a run directory (it has no config.json)")
    cfg = TrainConfig.load(run_dir / "config.json")
    ckpts = checkpoint.checkpoint_dirs(run_dir)
    if step is not None:
        ckpts = [c for c in ckpts if checkpoint.step_of(c) == step]
    if not ckpts:
        raise UsageError(
            f"{run_dir} has no checkpoint{f' at step {step}' if step is not None else ''}"
        )
    device = build.resolve_device(cfg.device)
    model, _ = build.build_model(cfg, device)
    checkpoint.check_run(ckpts[-1], identity(cfg))
    checkpoint.load_weights(ckpts[-1], model)
    if cfg.bf16_final_fraction > 0 and cfg.recipe != "bf16":
        bsnn.set_precision(model, False)
    if data is None:
        tokens = load_corpus(cfg.data, binary_ok=cfg.binary_data).val
        data = f"{cfg.data} (held out)"
    else:
        tokens = read_all(data, binary_ok=binary_data)
    result = evaluate(
        model,
        tokens,
        model.config.seq_len,
        batch_size or cfg.batch_size,
        device,
        max_tokens,
        progress,
    )
    return {"run": str(run_dir), "checkpoint": ckpts[-1].name, "data": data, **result}
