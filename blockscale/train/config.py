"""The training configuration: one flat dataclass, every field a command-line flag.

`blockscale train --lr 1e-3 --no-hadamard` sets `lr` and `hadamard`; the flags are generated from
the fields below, so this file is the reference for both. Defaults train the `tiny` model on the
standard library's source in about a minute on two CPU cores; the study script overrides sizes.
A run directory stores its config as `config.json`, and `--resume` reads it back.
"""

import argparse
import dataclasses
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path

from blockscale.train.errors import UsageError


def _f(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass
class TrainConfig:
    # What is trained, on what.
    model: str = _f("tiny", "model size: tiny, small, base, 1b, moe-tiny, moe-small")
    seq_len: int = _f(0, "sequence length in bytes (0: the model size's own)")
    recipe: str = _f("bf16", "precision recipe: bf16, nvfp4, mxfp8, nvfp4_fwd_mxfp8_bwd")
    hadamard: bool | None = _f(
        None, "recipe switch: Hadamard transform on wgrad (unset: recipe default)"
    )
    stochastic_rounding: bool | None = _f(None, "recipe switch: stochastic rounding of gradients")
    weight_2d: bool | None = _f(None, "recipe switch: 16x16 weight blocks")
    bf16_tail: float = _f(0.15, "fraction of the last blocks kept in BF16 (the lm head always is)")
    bf16_final_fraction: float = _f(
        0.0, "precision schedule: train the last fraction of steps in BF16"
    )
    data: str = _f("stdlib", "a .txt/.txt.gz file, a directory of them, or 'stdlib'")
    max_data_bytes: int = _f(0, "use only this many bytes of training text (0: all)")
    # Optimization.
    steps: int = _f(200, "optimizer steps")
    batch_size: int = _f(16, "sequences per micro-batch")
    grad_accum: int = _f(1, "micro-batches per optimizer step")
    lr: float = _f(3e-3, "peak learning rate")
    min_lr_ratio: float = _f(0.1, "final learning rate as a fraction of the peak")
    warmup_steps: int = _f(20, "linear warm-up steps")
    schedule: str = _f("cosine", "learning-rate schedule after warm-up: cosine or wsd")
    decay_fraction: float = _f(0.2, "wsd: fraction of steps spent in the final linear decay")
    weight_decay: float = _f(0.1, "AdamW weight decay on matrices (not on norms)")
    beta1: float = _f(0.9, "AdamW beta1")
    beta2: float = _f(0.95, "AdamW beta2")
    grad_clip: float = _f(1.0, "clip the global gradient norm to this (0: off)")
    aux_loss_coef: float = _f(0.01, "MoE models: weight of the load-balancing loss in the loss")
    seed: int = _f(0, "seed for initialization, data order and stochastic rounding")
    # Bookkeeping.
    log_every: int = _f(10, "write a training-loss row every N steps")
    eval_every: int = _f(50, "evaluate on held-out text every N steps (and at the end)")
    eval_tokens: int = _f(32768, "held-out bytes per evaluation (0: all)")
    telemetry_every: int = _f(50, "numerics telemetry every N steps (0: off)")
    ckpt_every: int = _f(100, "checkpoint every N steps (and at the end)")
    keep_checkpoints: int = _f(2, "how many recent checkpoints to keep")
    compile: bool = _f(False, "torch.compile the model")
    device: str = _f("auto", "cpu, cuda, cuda:N, or auto")
    max_minutes: float = _f(
        0.0, "checkpoint and stop after this many minutes; rerun to continue (0: off)"
    )

    def __post_init__(self) -> None:
        if self.schedule not in ("cosine", "wsd"):
            raise UsageError(f"schedule={self.schedule!r} is not one of 'cosine', 'wsd'")
        for name in ("steps", "batch_size", "grad_accum", "log_every"):
            if getattr(self, name) < 1:
                raise UsageError(f"{name}={getattr(self, name)} must be at least 1")
        for name in ("bf16_tail", "bf16_final_fraction", "decay_fraction", "min_lr_ratio"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise UsageError(f"{name}={getattr(self, name)} must lie in [0, 1]")
        if self.aux_loss_coef < 0:
            raise UsageError(f"aux_loss_coef={self.aux_loss_coef} must be at least 0")

    def recipe_switches(self) -> dict[str, bool]:
        names = ("hadamard", "stochastic_rounding", "weight_2d")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(dataclasses.asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> "TrainConfig":
        try:
            values = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise UsageError(f"cannot read run config {path}: {e}") from None
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})


def add_config_flags(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One `--flag` per field. Unset flags stay out of the namespace (default SUPPRESS), so a
    caller can tell an explicit override from a default (what `--resume` needs)."""
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        help = f"{f.metadata['help']} [{f.default}]"
        if kind in (bool, bool | None):
            parser.add_argument(
                flag,
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=help,
            )
        else:
            parser.add_argument(flag, dest=f.name, type=kind, default=argparse.SUPPRESS, help=help)


def overrides_from_args(args: argparse.Namespace) -> dict:
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    return {k: v for k, v in vars(args).items() if k in names}
