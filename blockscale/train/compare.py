"""Compare recipes: one run per recipe or ablation, identical except for the precision.

`bf16` always runs, first when `--recipes` leaves it out (every gap is measured from it), and a
recipe or ablation named twice runs once.

Every run shares the seed, so the same initial weights, the same batches in the same order and
the same hyperparameters; only the recipe (or one switch of it) differs. Ablations switch one
feature of the full NVFP4 recipe off, each in its own run:

    hadamard             nvfp4 without the wgrad Hadamard transform   -> nvfp4-no-hadamard
    stochastic_rounding  nvfp4 rounding gradients to nearest          -> nvfp4-no-stochastic-rounding
    weight_2d            nvfp4 with 1x16 instead of 16x16 weight blocks -> nvfp4-no-weight-2d
    bf16_tail            nvfp4 with every block quantized (bf16_tail=0) -> nvfp4-no-bf16-tail

`noise_floor` (the CLI's default) adds `bf16-seed{seed+1}`, a second BF16 run with another seed:
a recipe's gap to BF16 no larger than that run's is no evidence of a difference.

Runs live in `OUT/NAME` (in `OUT/runs/NAME` for a comparison begun before, one with
`OUT/runs/`). A finished run whose config matches is reused, an unfinished one is resumed (with
the checks of `train --resume`), and one with another config is an error, so rerunning
`compare` after a crash or a `max_minutes` pause continues where it stopped, and `--only NAME`
lets separate processes (one per GPU) fill the same comparison before a last plain `compare`
writes the report. Each run it trains records what the machine gave it (train/machine.py), so
that the report can mark a speed that other processes distorted.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import blockscale.recipes as recipes
from blockscale.train import machine
from blockscale.train.config import TrainConfig, differences
from blockscale.train.errors import UsageError
from blockscale.train.loop import train
from blockscale.train.report import variant_dir, write_report

FINISHED = ("done", "diverged")
BASELINE = "bf16"
DEFAULT_RECIPES = ("bf16", "nvfp4", "mxfp8", "nvfp4_fwd_mxfp8_bwd")
ABLATIONS = {
    "hadamard": {"hadamard": False},
    "stochastic_rounding": {"stochastic_rounding": False},
    "weight_2d": {"weight_2d": False},
    "bf16_tail": {"bf16_tail": 0.0},
}


def ablation_label(name: str) -> str:
    """The run name of an ablation: `hadamard` -> `nvfp4-no-hadamard`."""
    return "nvfp4-no-" + name.replace("_", "-")


def ablation_fields(name: str) -> dict:
    """The TrainConfig fields of an ablation: the nvfp4 recipe with one switch off."""
    return {"recipe": "nvfp4", **ABLATIONS[name]}


def with_baseline(names: Sequence[str]) -> list[str]:
    """The recipes to run: each once, in the order given, and `bf16` first when not given:
    every gap in the report is measured from it (without it the gap column was all "-")."""
    names = list(dict.fromkeys(names))
    return names if BASELINE in names else [BASELINE, *names]


def variants(
    base: TrainConfig, names: list[str], ablate: list[str], noise_floor: bool
) -> dict[str, TrainConfig]:
    """Run name -> config, in report order."""
    for name in names:
        if name not in recipes.names():
            raise UsageError(
                f"recipe {name!r} does not exist; choose from {', '.join(recipes.names())}"
            )
    for name in ablate:
        if name not in ABLATIONS:
            raise UsageError(
                f"ablation {name!r} does not exist; choose from {', '.join(ABLATIONS)}"
            )
    runs = {name: dataclasses.replace(base, recipe=name) for name in with_baseline(names)}
    if noise_floor:
        runs[f"bf16-seed{base.seed + 1}"] = dataclasses.replace(
            base, recipe="bf16", seed=base.seed + 1
        )
    for name in dict.fromkeys(ablate):
        runs[ablation_label(name)] = dataclasses.replace(base, **ablation_fields(name))
    return runs


# What may differ between invocations of one comparison: where and how fast it runs, and its
# checkpoints. Unlike `train --resume`, not `steps` nor the logging cadence: every run of a
# comparison must log the same rows for the same number of steps.
COMPARE_FREE = frozenset({"compile", "device", "max_minutes", "keep_checkpoints", "ckpt_every"})


def run_variant(name: str, cfg: TrainConfig, out: Path, progress: bool = True) -> dict:
    run_dir = variant_dir(out, name)
    if (run_dir / "config.json").exists():
        diffs = differences(TrainConfig.load(run_dir / "config.json"), cfg, COMPARE_FREE)
        if diffs:
            raise UsageError(
                f"{run_dir} holds a run with another config ({'; '.join(diffs)}); "
                "choose another --out"
            )
        summary_path = run_dir / "summary.json"
        if summary_path.exists() and json.loads(summary_path.read_text())["status"] == "done":
            print(f"{name}: finished run found in {run_dir}, reused")
            return json.loads(summary_path.read_text())
        with machine.record(run_dir):
            return train(cfg, run_dir, resume=True, progress=progress)
    with machine.record(run_dir):
        return train(cfg, run_dir, progress=progress)


def compare(
    base: TrainConfig,
    out: Path,
    names: Sequence[str] = DEFAULT_RECIPES,
    ablate: Sequence[str] = (),
    noise_floor: bool = False,
    only: str | None = None,
    progress: bool = True,
    report_only: bool = False,
) -> tuple[Path | None, bool]:
    """Run every variant (or just `only`) and write the report. Returns (the report's path or
    None, whether every run it trained finished). `report_only` trains nothing and reports the
    runs that exist, finished or not."""
    out = Path(out)
    runs = variants(base, list(names), list(ablate), noise_floor)
    if BASELINE not in names and not report_only and only is None:
        print(f"{BASELINE} added: the baseline every recipe's gap is measured from")
    if report_only:
        present = [name for name in runs if (variant_dir(out, name) / "config.json").exists()]
        if not present:
            raise UsageError(f"{out} holds none of this comparison's runs ({', '.join(runs)})")
        return write_report(out, present), True
    if only is not None:
        if only not in runs:
            raise UsageError(
                f"--only {only!r} is not one of this comparison's runs: {', '.join(runs)}"
            )
        return None, run_variant(only, runs[only], out, progress)["status"] in FINISHED
    for name, cfg in runs.items():
        summary = run_variant(name, cfg, out, progress)
        if summary["status"] not in FINISHED:
            print(f"{name} stopped ({summary['status']}); rerun the same command to continue")
            return None, False
    return write_report(out, list(runs)), True
