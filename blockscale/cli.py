"""The command line: `blockscale train | compare | eval` (also `python -m blockscale ...`).

Every `TrainConfig` field is a flag of `train` and `compare` (see blockscale/train/config.py or
`blockscale train --help`). Bad input (a flag out of its range, a missing file, an unknown
recipe, a model too large for the device, a corrupt checkpoint, a resume that does not match its
run, an `--out` that is someone else's folder) ends with one line on stderr and exit status 2;
a run that stopped early (Ctrl-C, SIGTERM, `--max-minutes`) exits with 3: run the same command
(train: with `--resume`) to continue it. A second Ctrl-C or SIGTERM stops at once, without a
checkpoint, with 130.

`torchrun --nproc-per-node N -m blockscale train --fsdp ...` trains one run over N ranks
(blockscale/train/ranks.py, docs/DISTRIBUTED.md): rank 0 alone prints and writes the run.
`--ep` instead of `--fsdp` (MoE models) splits the experts over the ranks (expert parallel);
`--tp` splits every block's linears over the ranks (tensor parallel), which share one batch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import blockscale
from blockscale.train.config import (
    COUNT,
    TrainConfig,
    add_config_flags,
    overrides_from_args,
    range_type,
)
from blockscale.train.errors import UsageError

STOPPED = 3  # exit status of a run paused or interrupted before its last step: rerun to continue


def _timestamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _out_dir(out: str | None) -> None:
    if out is not None and Path(out).exists() and not Path(out).is_dir():
        raise UsageError(f"--out {out} is a file, not a directory; choose another --out")


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad command line in one line (its usage is one --help away)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _main_rank() -> bool:
    """Not one of ranks 1.. of a torchrun launch (those stay silent: rank 0 speaks for all)."""
    return os.environ.get("RANK", "0") == "0"


def _fsdp_defaults(overrides: dict, resume: bool, tp: bool) -> None:
    """A new --fsdp or --ep run's defaults: one micro-batch per rank and step (the global batch
    is --batch-size x the number of ranks); --tp ranks share each micro-batch, so they keep
    one process's grad_accum. No numerics probe (not run sharded yet)."""
    if not resume:
        if not tp:
            overrides.setdefault("grad_accum", int(os.environ["WORLD_SIZE"]))
        overrides.setdefault("telemetry_every", 0)


def cmd_train(args: argparse.Namespace) -> int:
    from blockscale.train.loop import exclusive_modes, saved_config, train
    from blockscale.train.ranks import launched, leave

    overrides = overrides_from_args(args)
    _out_dir(args.out)
    flag = "--ep" if args.ep else "--tp" if args.tp else "--fsdp"
    distributed = args.fsdp or args.ep or args.tp
    if args.fsdp + args.ep + args.tp > 1:
        raise UsageError(exclusive_modes(args.fsdp, args.ep, args.tp))
    if distributed:
        if not launched():
            raise UsageError(
                f"{flag} needs one process per rank, started by torchrun: torchrun "
                f"--nproc-per-node N -m blockscale train {flag} ... (WORLD_SIZE is not set)"
            )
        _fsdp_defaults(overrides, args.resume, args.tp)
    elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UsageError(
            f"this process is one of WORLD_SIZE={os.environ['WORLD_SIZE']} ranks; pass --fsdp "
            "(or --ep for an MoE model, or --tp) to train one run over them (without it every "
            "rank would train and write the same run)"
        )
    if args.resume:
        if args.out is None:
            raise UsageError("--resume needs --out DIR, the run to continue")
        # The run's own config; flags may restate it or change what may change (train checks).
        cfg = dataclasses.replace(saved_config(Path(args.out)), **overrides)
    else:
        cfg = TrainConfig(**overrides)
    if distributed and args.out is None:
        raise UsageError(f"{flag} needs --out DIR: every rank must name the same run directory")
    out = Path(args.out or f"runs/{cfg.model}-{cfg.recipe}-{_timestamp()}")
    summary = train(
        cfg,
        out,
        resume=args.resume,
        progress=not args.quiet,
        fsdp=args.fsdp,
        ep=args.ep,
        tp=args.tp,
    )
    if distributed:
        leave()
    if _main_rank():
        print(json.dumps({k: v for k, v in summary.items() if k != "recipe_detail"}))
        print(f"run directory: {out}")
    code = {"done": 0, "diverged": 1}.get(summary["status"], STOPPED)
    if distributed:
        # The run is written and the group destroyed; leave without the exit-time destructors,
        # where a gloo rank whose transport thread was still joinable aborted now and then
        # ("terminate called without an active exception") after all its work had passed.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def cmd_compare(args: argparse.Namespace) -> int:
    from blockscale.train.compare import compare
    from blockscale.train.report import format_table

    cfg = TrainConfig(**overrides_from_args(args))
    _out_dir(args.out)
    names = _csv(args.recipes)
    if not names:
        raise UsageError(
            f"--recipes {args.recipes!r} names no recipe (want a comma-separated list, "
            "e.g. bf16,nvfp4)"
        )
    out = Path(args.out or f"runs/compare-{_timestamp()}")
    report, finished = compare(
        cfg,
        out,
        names,
        _csv(args.ablate),
        args.noise_floor,
        args.only,
        not args.quiet,
        args.report_only,
    )
    if report is None:
        return 0 if finished else STOPPED
    print()
    print(format_table(json.loads((out / "report.json").read_text())["table"]))
    print(f"\nreport: {report}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from blockscale.train.evaluate import eval_run

    result = eval_run(
        Path(args.run),
        args.data,
        args.step,
        args.max_tokens,
        args.batch_size,
        progress=not args.quiet,
        binary_data=args.binary_data,
    )
    print(
        f"{result['run']} ({result['checkpoint']}) on {result['data']}: loss {result['val_loss']:.4f}, {result['val_bpb']:.4f} bits/byte over {result['val_tokens']:,} bytes"
    )
    print(json.dumps(result))
    return 0


def parser() -> argparse.ArgumentParser:
    from blockscale.train.compare import ABLATIONS, DEFAULT_RECIPES

    root = _Parser(
        prog="blockscale", description="Train transformers in NVFP4 and MXFP8, and compare recipes."
    )
    root.add_argument("--version", action="version", version=f"%(prog)s {blockscale.__version__}")
    sub = root.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train one model with one recipe")
    train.add_argument("--out", help="run directory [runs/MODEL-RECIPE-TIMESTAMP]")
    train.add_argument(
        "--resume", action="store_true", help="continue the run in --out from its last checkpoint"
    )
    train.add_argument("--quiet", action="store_true", help="no progress bar")
    train.add_argument(
        "--fsdp",
        action="store_true",
        help="one rank of a torchrun launch: shard the model with FSDP2 over the ranks "
        "(torchrun --nproc-per-node N -m blockscale train --fsdp --out DIR ...)",
    )
    train.add_argument(
        "--ep",
        action="store_true",
        help="one rank of a torchrun launch of an MoE model: each rank keeps n_experts/N "
        "experts (expert parallel) and its share of the batch, the rest replicated "
        "(torchrun --nproc-per-node N -m blockscale train --ep --model moe-tiny --out DIR ...)",
    )
    train.add_argument(
        "--tp",
        action="store_true",
        help="one rank of a torchrun launch: split every block's linears over the ranks "
        "(tensor parallel; an MoE model's attention only), all ranks on the same batch "
        "(torchrun --nproc-per-node N -m blockscale train --tp --out DIR ...)",
    )
    add_config_flags(train)
    train.set_defaults(func=cmd_train)

    compare = sub.add_parser("compare", help="train one run per recipe/ablation and write a report")
    compare.add_argument(
        "--recipes", default=",".join(DEFAULT_RECIPES), help="comma-separated recipes [%(default)s]"
    )
    compare.add_argument(
        "--ablate",
        default="",
        help=f"comma-separated NVFP4 features to switch off, one run each: {', '.join(ABLATIONS)}",
    )
    compare.add_argument(
        "--noise-floor",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="add a second BF16 run with seed+1, the noise a gap must beat [on]",
    )
    compare.add_argument(
        "--only", help="run just this one variant (e.g. nvfp4-no-hadamard) and write no report"
    )
    compare.add_argument(
        "--out",
        help="report directory [runs/compare-TIMESTAMP]; rerun with the same one to continue",
    )
    compare.add_argument("--quiet", action="store_true", help="no progress bars")
    compare.add_argument(
        "--report-only", action="store_true", help="train nothing: report the runs in --out so far"
    )
    add_config_flags(compare, skip=("recipe",))
    compare.set_defaults(func=cmd_compare)

    ev = sub.add_parser("eval", help="loss and bits per byte of a run's checkpoint on any text")
    ev.add_argument("--run", required=True, help="run directory")
    ev.add_argument(
        "--data",
        help="a .txt/.txt.gz file, a directory of them, or 'stdlib' "
        "[the held-out part of the run's own data, text it never trained on]",
    )
    ev.add_argument("--step", type=range_type(int, COUNT), help="checkpoint step [the last]")
    ev.add_argument(
        "--max-tokens",
        type=range_type(int, COUNT),
        default=0,
        help="score only the first N bytes (0: all)",
    )
    ev.add_argument(
        "--batch-size",
        type=range_type(int, COUNT),
        default=0,
        help="sequences per batch (0: the run's) [0]",
    )
    ev.add_argument(
        "--binary-data",
        action="store_true",
        help="score --data even where it does not look like text (bytes outside UTF-8)",
    )
    ev.add_argument("--quiet", action="store_true", help="no progress bar")
    ev.set_defaults(func=cmd_eval)
    return root


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except UsageError as e:
        if _main_rank():
            print(f"blockscale {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"blockscale {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
