"""Checkpoints: safetensors files in `checkpoints/step_NNNNNN/`, written atomically.

A checkpoint holds everything a resumed run needs to continue bit for bit:

- `model.safetensors`: the model's parameters (tied weights handled by `save_model`);
- `trainer.safetensors`: AdamW's state tensors, the torch RNG states (stochastic rounding draws
  from them), and in its metadata the step, the optimizer's param groups and the loop's own
  state (the loss summed since the last metrics row).

The learning rate is a function of the step and batches are a function of (seed, step), so the
schedule and the data loader need no state of their own. A checkpoint is written into a
temporary folder and renamed into place, so a crash while writing leaves the previous one intact.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, load_model, save_file, save_model

from blockscale.train.errors import UsageError


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    # A `step_N.tmp` folder is a checkpoint whose writing was cut short: never a candidate.
    return sorted(p for p in root.iterdir() if p.is_dir() and re.fullmatch(r"step_\d+", p.name))


def save(
    run_dir: Path, step: int, model: torch.nn.Module, optimizer, meta: dict, keep: int
) -> Path:
    final = run_dir / "checkpoints" / f"step_{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_model(model, str(tmp / "model.safetensors"))
    state = optimizer.state_dict()
    tensors = {
        f"optim.{idx}.{name}": value.detach().cpu().contiguous()
        for idx, entry in state["state"].items()
        for name, value in entry.items()
    }
    tensors["rng.cpu"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    metadata = {
        "step": str(step),
        "param_groups": json.dumps(state["param_groups"]),
        "meta": json.dumps(meta),
    }
    save_file(tensors, str(tmp / "trainer.safetensors"), metadata=metadata)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in checkpoint_dirs(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_weights(path: Path, model: torch.nn.Module) -> None:
    try:
        missing, unexpected = load_model(model, str(path / "model.safetensors"), strict=False)
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise UsageError(
            f"checkpoint {path} is corrupt or incomplete ({e}); delete it to use an earlier one"
        ) from None
    if missing or unexpected:
        raise UsageError(
            f"checkpoint {path} does not fit this model (missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})"
        )


def load(path: Path, model: torch.nn.Module, optimizer) -> tuple[int, dict]:
    """Restore model, optimizer and RNG states; returns (step, meta)."""
    load_weights(path, model)
    file = path / "trainer.safetensors"
    try:
        tensors = load_file(str(file))

        with safe_open(str(file), "pt") as f:
            metadata = f.metadata()
        step = int(metadata["step"])
        groups = json.loads(metadata["param_groups"])
        meta = json.loads(metadata["meta"])
    except (SafetensorError, OSError, KeyError, ValueError) as e:
        raise UsageError(
            f"checkpoint {path} is corrupt or incomplete ({e}); delete it to use an earlier one"
        ) from None
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        if key.startswith("optim."):
            _, idx, name = key.split(".", 2)
            state.setdefault(int(idx), {})[name] = value
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    torch.set_rng_state(tensors["rng.cpu"])
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng.cuda"])
    return step, meta
