"""The training configuration: one flat dataclass, every field a command-line flag.

`blockscale train --lr 1e-3 --no-hadamard` sets `lr` and `hadamard`; the flags are generated from
the fields below, so this file is the reference for both. Defaults train the `tiny` model on the
standard library's source in about a minute on two CPU cores; the study script overrides sizes.
A run directory stores its config as `config.json`, and `--resume` reads it back.

Every numeric field carries its range (`Range`), checked in one place for both doors: a flag out
of range ends the command with one line and status 2, and `TrainConfig(lr=-1)` raises a
`UsageError` naming the field and the rule.

Resuming: the fields in `RESUMABLE` may change when a run is continued (how long it trains, how
often it logs, evaluates, probes and checkpoints, where it runs); every other field defines what
is trained and how, so a resumed run must match its `config.json` in all of them
(`differences` names each one that does not).
"""

import argparse
import dataclasses
import json
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path

from blockscale.train import files
from blockscale.train.errors import UsageError


@dataclass(frozen=True)
class Range:
    """An interval of allowed values, closed unless `low_open` / `high_open`; None: unbounded.
    Floats must also be finite."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def problem(self, value: float) -> str | None:
        """Why `value` is out of range (a phrase after the value), or None."""
        if isinstance(value, float) and not math.isfinite(value):
            return "is not a finite number"
        low = self.low is None or (value > self.low if self.low_open else value >= self.low)
        high = self.high is None or (value < self.high if self.high_open else value <= self.high)
        if low and high:
            return None
        if self.high is None:
            return f"must be {'>' if self.low_open else 'at least'} {_number(self.low)}"
        left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
        return f"must lie in {left}{_number(self.low)}, {_number(self.high)}{right}"


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


COUNT = Range(0)  # 0 means off (or: all, or: the default) where the help says so
AT_LEAST_1 = Range(1)
FRACTION = Range(0.0, 1.0)
POSITIVE = Range(0.0, low_open=True)
BETA = Range(0.0, 1.0, high_open=True)
SEED = Range(0, 2**63 - 1)


def _f(default, help: str, allowed: Range | None = None):
    return field(default=default, metadata={"help": help, "range": allowed})


@dataclass
class TrainConfig:
    # What is trained, on what.
    model: str = _f("tiny", "model size: tiny, small, base, 1b, moe-tiny, moe-small")
    seq_len: int = _f(0, "sequence length in bytes (0: the model size's own)", COUNT)
    recipe: str = _f("bf16", "precision recipe: bf16, nvfp4, mxfp8, nvfp4_fwd_mxfp8_bwd")
    hadamard: bool | None = _f(
        None, "recipe switch: Hadamard transform on wgrad (unset: recipe default)"
    )
    stochastic_rounding: bool | None = _f(None, "recipe switch: stochastic rounding of gradients")
    weight_2d: bool | None = _f(None, "recipe switch: 16x16 weight blocks")
    bf16_tail: float = _f(
        0.15, "fraction of the last blocks kept in BF16 (the lm head always is)", FRACTION
    )
    weight_cache: bool = _f(
        True,
        "keep each converted weight's quantized copies to the next optimizer step once a step "
        "makes one of them twice, e.g. with grad accumulation (the same bits; the loop changes "
        "weights only through its optimizer; off: quantize at every use)",
    )
    bf16_final_fraction: float = _f(
        0.0, "precision schedule: train the last fraction of steps in BF16", FRACTION
    )
    data: str = _f("stdlib", "a .txt/.txt.gz file, a directory of them, or 'stdlib'")
    max_data_bytes: int = _f(0, "use only this many bytes of training text (0: all)", COUNT)
    binary_data: bool = _f(
        False, "train on --data even where it does not look like text (bytes outside UTF-8)"
    )
    # Optimization.
    steps: int = _f(200, "optimizer steps", AT_LEAST_1)
    batch_size: int = _f(16, "sequences per micro-batch", AT_LEAST_1)
    grad_accum: int = _f(1, "micro-batches per optimizer step", AT_LEAST_1)
    lr: float = _f(3e-3, "peak learning rate", POSITIVE)
    min_lr_ratio: float = _f(0.1, "final learning rate as a fraction of the peak", FRACTION)
    warmup_steps: int = _f(20, "linear warm-up steps", COUNT)
    schedule: str = _f("cosine", "learning-rate schedule after warm-up: cosine or wsd")
    decay_fraction: float = _f(
        0.2, "wsd: fraction of steps spent in the final linear decay", FRACTION
    )
    weight_decay: float = _f(0.1, "AdamW weight decay on matrices (not on norms)", Range(0.0))
    beta1: float = _f(0.9, "AdamW beta1", BETA)
    beta2: float = _f(0.95, "AdamW beta2", BETA)
    grad_clip: float = _f(1.0, "clip the global gradient norm to this (0: off)", Range(0.0))
    aux_loss_coef: float = _f(
        0.01, "MoE models: weight of the load-balancing loss in the loss", Range(0.0)
    )
    seed: int = _f(0, "seed for initialization, data order and stochastic rounding", SEED)
    # Bookkeeping.
    log_every: int = _f(10, "write a training-loss row every N steps", AT_LEAST_1)
    eval_every: int = _f(
        50, "evaluate on held-out text every N steps (and at the end; 0: off)", COUNT
    )
    eval_tokens: int = _f(32768, "held-out bytes per evaluation (0: all)", COUNT)
    telemetry_every: int = _f(50, "numerics telemetry every N steps (0: off)", COUNT)
    ckpt_every: int = _f(
        100, "checkpoint every N steps (and at the end; 0: at the end only)", COUNT
    )
    keep_checkpoints: int = _f(2, "how many recent checkpoints to keep (0: all)", COUNT)
    compile: bool = _f(False, "torch.compile the model")
    device: str = _f("auto", "cpu, cuda, cuda:N, or auto")
    deterministic: bool = _f(
        False,
        "CUDA: only deterministic kernels (attention's backward, cuBLAS), so a run repeats bit "
        "for bit; slower",
    )
    max_minutes: float = _f(
        0.0, "checkpoint and stop after this many minutes; rerun to continue (0: off)", Range(0.0)
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            problem = field_problem(f, getattr(self, f.name))
            if problem:
                raise UsageError(f"{f.name}={getattr(self, f.name)!r} {problem}")

    def recipe_switches(self) -> dict[str, bool]:
        names = ("hadamard", "stochastic_rounding", "weight_2d")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def save(self, path: Path) -> None:
        files.write_atomic(path, json.dumps(dataclasses.asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> "TrainConfig":
        try:
            values = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UsageError(f"cannot read run config {path}: {e}") from None
        if not isinstance(values, dict):
            raise UsageError(f"run config {path} is not a JSON object")
        problem = foreign_config(values)
        if problem is not None:
            raise UsageError(f"{path.parent} is not a blockscale run: its {path.name} {problem}")
        try:
            return cls(**values)
        except UsageError as e:
            raise UsageError(f"run config {path}: {e}") from None


def foreign_config(values: object) -> str | None:
    """Why parsed JSON is not a blockscale run's config.json (a phrase after "its
    config.json"), or None. A run's holds TrainConfig's fields and nothing else (no field has
    been retired, so every run's config.json qualifies): one with other keys, or none, is
    another program's, like a transformers model's, which `train --resume` once read as a run
    of defaults and then overwrote (issue 60)."""
    if not isinstance(values, dict):
        return "is not a JSON object"
    if not values:
        return "holds no run settings"
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    foreign = sorted(set(values) - known)
    if not foreign:
        return None
    listed = ", ".join(foreign[:4]) + (", ..." if len(foreign) > 4 else "")
    return f"has keys that are not run settings ({listed})"


_HINTS = typing.get_type_hints(TrainConfig)
CHOICES = {"schedule": ("cosine", "wsd")}

# May change when a run is resumed: how long it trains and what it measures, checkpoints and runs
# on. None changes the quantized numerics; moving between CPU (FP32) and CUDA (BF16 autocast)
# changes the unquantized parts' precision (docs/TRAINING.md, "What `--resume` checks").
RESUMABLE = frozenset(
    {
        "steps",
        "max_minutes",
        "log_every",
        "eval_every",
        "eval_tokens",
        "telemetry_every",
        "ckpt_every",
        "keep_checkpoints",
        "compile",
        "device",
        "binary_data",  # lets a run read what it would refuse; reads nothing else
        "deterministic",  # the same math, summed in a fixed order
        "weight_cache",  # the same bits, computed once a step instead of at every use
    }
)


def field_problem(f: dataclasses.Field, value) -> str | None:
    """Why `value` does not fit field `f` (its type, choices and range), or None."""
    kind = _HINTS[f.name]
    if kind in (bool, bool | None):
        ok = isinstance(value, bool) or (kind is not bool and value is None)
        return None if ok else "is not true or false"
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        return "is not an integer"
    if kind is float and (isinstance(value, bool) or not isinstance(value, int | float)):
        return "is not a number"
    if kind is str and not isinstance(value, str):
        return "is not a string"
    if f.name in CHOICES and value not in CHOICES[f.name]:
        return f"is not one of {', '.join(map(repr, CHOICES[f.name]))}"
    rule = f.metadata.get("range")
    return rule.problem(value) if rule is not None else None


def differences(saved: TrainConfig, new: TrainConfig, free=RESUMABLE) -> list[str]:
    """'name: old there, new now' for every field outside `free` whose value differs."""
    return [
        f"{f.name}: {getattr(saved, f.name)!r} there, {getattr(new, f.name)!r} now"
        for f in dataclasses.fields(TrainConfig)
        if f.name not in free and getattr(saved, f.name) != getattr(new, f.name)
    ]


def identity(cfg: TrainConfig) -> dict:
    """The fields that define a run (all but RESUMABLE): what a checkpoint records of its run."""
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in RESUMABLE}


def range_type(kind: type, rule: Range):
    """An argparse `type` that parses `kind` (int or float) and checks `rule`, so a bad value
    ends the command with argparse's one line and status 2 before anything is built."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {'an integer' if kind is int else 'a number'}"
            ) from None
        problem = rule.problem(value)
        if problem:
            raise argparse.ArgumentTypeError(f"{text} {problem}")
        return value

    parse.__name__ = kind.__name__  # what argparse names in its own messages
    return parse


def flag_type(f: dataclasses.Field):
    """The argparse `type` of a numeric field's flag: its kind and its range."""
    return range_type(_HINTS[f.name], f.metadata["range"])


def add_config_flags(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One `--flag` per field. Unset flags stay out of the namespace (default SUPPRESS), so a
    caller can tell an explicit override from a default (what `--resume` needs)."""
    for f in dataclasses.fields(TrainConfig):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = _HINTS[f.name]
        help = f"{f.metadata['help']} [{f.default}]"
        if kind in (bool, bool | None):
            parser.add_argument(
                flag,
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=help,
            )
        elif kind is str:
            parser.add_argument(
                flag,
                dest=f.name,
                choices=CHOICES.get(f.name),
                default=argparse.SUPPRESS,
                help=help,
            )
        else:
            parser.add_argument(
                flag, dest=f.name, type=flag_type(f), default=argparse.SUPPRESS, help=help
            )


def overrides_from_args(args: argparse.Namespace) -> dict:
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    return {k: v for k, v in vars(args).items() if k in names}
