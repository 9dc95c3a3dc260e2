"""torchtitan's own Trainer with blockscale's converters, as a torchtitan user runs it: tokens/s,
peak memory and losses of each recipe against BF16, on local text with a local tokenizer
(blockscale/integrations/titan/local_text.py; docs/TORCHTITAN.md).

Whichever torchtitan is importable (0.3.x or 0.2.2) is the one measured. Each recipe trains in a
process of its own (`torchrun --standalone --nproc_per_node 1 -m
blockscale.integrations.titan.train`, which is `-m torchtitan.train` plus the stand-ins that
module's docstring describes), so no recipe inherits another's allocator state or compiled
graphs; every figure comes from torchtitan's own metrics, which `titan.train_v0_3` /
`titan.train_v0_2` also write to `<dump>/metrics.jsonl` every step.

Recipes: `bf16` (no converter: torchtitan's mixed precision, BF16 compute on FP32 weights),
`nvfp4`, `mxfp8`, `nvfp4_fwd_mxfp8_bwd` (blockscale's converter, its default layer policy: the
last ~15% of the blocks, the output head and the routers in BF16), and `float8` (torchtitan's
own float8 rowwise converters, through torchao, SM89 or later: every linear but the output head
and the router gates, and every experts module, tail included; the row says why where it
cannot run).

Models: `--model` and `--flavor` name a torchtitan model and flavor: torchtitan's own (their
debug models, for CPU runs), and those the integration registers (docstrings of
`titan.train_v0_3` and `titan.train_v0_2`): DeepSeek-V3 `16B_4L` (2.3B, one 80 GB GPU) and
`small` (~200M, convergence), Llama 4 `17bx16e_2L` (6.5B: an H200, or `--dtype bfloat16`) and
`small` (~200M, 0.2.2 only). The tokenizer's vocabulary must fit the model's: the debug models
take 2048 tokens, `small` 32768, the others more.

Modes:

- speed (the default): `--steps` steps per recipe (and per mode, `--modes eager,compile`;
  compile is torchtitan's `--compile.enable`, model and loss), logging every step. Columns:
  tokens_per_s (the median of torchtitan's per-step tokens/s over the steps after
  `--warmup`), tok_vs_bf16, peak_gib (the highest `max_active` torchtitan logs, the CUDA
  allocator's peak of memory in use, over all steps; reserved memory in the JSON), mem_vs_bf16,
  first_s (the first step, compilation included), loss_first / loss_last, status (ok, or why
  the row has no figures: the last line of the process's error, or a timeout).
- convergence (`--converge`): the same runs for `--steps` steps with torchtitan's checkpoints
  every `--checkpoint-interval` steps (the latest two kept: a checkpoint holds the weights and
  AdamW's state) in `--dump/<model>-<flavor>-<mode>-<recipe>`. A run that is stopped (a
  `--timeout`, a device call's end) loses at most the steps since its last checkpoint: the
  same command again resumes each recipe from its latest checkpoint (torchtitan loads it), the
  data loader where it stopped, and a recipe already at `--steps` is read, not rerun. The
  checkpoints must outlive the call: where each call brings a fresh copy of the repository,
  put `--dump` outside it (`/tmp`). Output:
  each recipe's loss curve (every step, in the JSON), and the table's loss_end (the mean of
  the last `--tail` steps' losses up to end_step, the last step every run reached, so runs cut
  at different steps compare at the same one) and loss_vs_bf16.

`--merge A.json B.json ...` puts the convergence rows of several calls in one table (a
model's four runs split over two device calls): it checks that they share the model and the
run's settings, keeps the complete copy of a run that a call cut short and another completed
(dropping the cut one, said in the output), then takes end_step, loss_end and the ratios over
all. `--plot gaps.png` (with `--converge` or `--merge`) draws each run's loss, as the mean of
its last `--tail` steps at every step, and its gap in % to BF16's first seed, against tokens
seen: where a gap stands against the seed-to-seed one all along, not only at the end.

Several runs at once (`--parallel N`): up to N runs go at a time, each in its own process; on
CUDA each run sees one GPU (`CUDA_VISIBLE_DEVICES`), one no other run holds while it trains, so
on a machine of N GPUs N recipes train at once (a convergence table in one call); with
`--per-gpu K` (`--converge` only) K runs share each GPU, for models too small to fill one.
BF16's seeds (`--bf16-seeds 0,1`): a BF16 run for each, the first the baseline of the ratios,
so a later seed's loss_vs_bf16 is the seed-to-seed gap (its folder and row carry the seed).

The text is tokenized as the steps run, in `--data-workers` processes of torchtitan's data
loader (2; 0: in the training process, whose step time then includes it; data_pct, torchtitan's
data_loading(%) over the timed steps, says how much of a step waited for data). Activation
checkpointing is off unless `--ac` (torchtitan's selective one, its configs' default), and
0.3's CUDA graphs are off
unless `--cuda-graphs`. Learning rate and warm-up are the config's unless `--lr` /
`--lr-warmup`. `--no-weight-cache` (0.2.2): blockscale's layers keep no quantized weight copies
(the converter's `--blockscale.no_weight_cache`; docs/TORCHTITAN.md says what that trades).

    python benchmarks/bench_titan.py --model deepseek_v3 --flavor 16B_4L --modes eager,compile \\
        --batch 4 --seq-len 4096 --assets .titan-assets/bpe-32k --out titan_dsv3.json
    python benchmarks/bench_titan.py --converge --model deepseek_v3 --flavor small --steps 2000 \\
        --assets .titan-assets/bpe-32k --dump runs/titan-converge --recipes bf16,nvfp4,mxfp8 \\
        --bf16-seeds 0,1 --parallel 4
    python benchmarks/bench_titan.py --smoke --assets A --data D    # CPU, debug model, 3 steps
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script from anywhere

import harness  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ["bf16", "nvfp4", "mxfp8", "nvfp4_fwd_mxfp8_bwd", "float8"]
MOE_MODELS = {"deepseek_v3", "llama4", "qwen3"}
SMOKE_MODEL = {"0.3": ("deepseek_v3", "debugmodel"), "0.2": ("llama4", "debugmodel")}
METRICS = "metrics.jsonl"
TPS = "throughput(tps)"
LOSS = "loss_metrics/global_avg_loss"


def titan_version() -> str:
    try:
        return version("torchtitan")
    except PackageNotFoundError:
        raise SystemExit("torchtitan is not importable: install it, or put its folder on "
                         "PYTHONPATH (docs/TORCHTITAN.md)") from None  # fmt: skip


def recipe_args(titan: str, model: str, recipe: str, compile: bool,
                weight_cache: bool = True) -> list[str]:  # fmt: skip
    """The torchtitan arguments that apply `recipe` (module docstring); `weight_cache=False`:
    blockscale's converted layers keep no weight copies (0.2.2's `--blockscale.no_weight_cache`)."""
    if recipe == "bf16":
        return []
    if titan.startswith("0.2."):
        if recipe == "float8":
            converters = "quantize.linear.float8"
            extra = ["--quantize.linear.float8.recipe_name", "rowwise",
                     "--quantize.linear.float8.filter_fqns", "output,router.gate"]  # fmt: skip
            if model in MOE_MODELS:
                converters += ",quantize.grouped_mm.float8"
                extra += ["--quantize.grouped_mm.float8.fqns", "experts"]
            return ["--model.converters", converters, *extra]
        return ["--model.converters", "blockscale",
                "--job.custom_config_module", "blockscale.integrations.titan.v0_2",
                "--blockscale.recipe", recipe,
                *([] if weight_cache else ["--blockscale.no_weight_cache"])]  # fmt: skip
    if not weight_cache:
        raise SystemExit("--no-weight-cache: torchtitan 0.2.2's converter option only")
    if recipe == "float8":
        target = "blockscale.integrations.titan.train_v0_3.float8_rowwise"
        return ["--override.imports", f"{target}={json.dumps({'compile': compile})}"]
    target = "blockscale.integrations.titan.v0_3.blockscale"
    return ["--override.imports", f"{target}={json.dumps({'recipe': recipe})}"]


def titan_args(titan: str, args: argparse.Namespace, recipe: str, compile: bool,
               dump: Path, seed: int | None = None) -> list[str]:  # fmt: skip
    """torchtitan's command line for one run (module docstring); `seed`: else `--seed`'s."""
    seed = args.seed if seed is None else seed
    common = ["--training.steps", str(args.steps),
              "--training.local_batch_size", str(args.batch),
              "--training.seq_len", str(args.seq_len),
              "--metrics.log_freq", "1", "--debug.seed", str(seed)]  # fmt: skip
    if args.dtype:
        common += ["--training.dtype", args.dtype]
    if args.lr is not None:
        common += ["--optimizer.lr", str(args.lr)]
    if args.lr_warmup is not None:
        common += ["--lr_scheduler.warmup_steps", str(args.lr_warmup)]
    if args.converge:
        common += ["--checkpoint.enable", "--checkpoint.interval", str(args.checkpoint_interval),
                   "--checkpoint.keep_latest_k", "2"]  # fmt: skip
        if titan.startswith("0.2."):  # its last checkpoint holds the model alone by default
            common += ["--checkpoint.no_last_save_model_only"]
    if compile:
        common += ["--compile.enable"]
    if titan.startswith("0.2."):
        common += ["--training.dataloader.num_workers", str(args.data_workers)]
        command = ["--experimental.custom_import", "blockscale.integrations.titan.train_v0_2",
                   "--model.name", f"{args.model}_local_text", "--model.flavor", args.flavor,
                   "--model.hf_assets_path", args.assets, "--training.dataset_path", args.data,
                   "--job.dump_folder", str(dump),
                   "--activation_checkpoint.mode", "selective" if args.ac else "none"]  # fmt: skip
        return command + common + recipe_args(titan, args.model, recipe, compile,
                                              args.weight_cache)  # fmt: skip
    command = ["--module", "blockscale.integrations.titan.train_v0_3",
               "--config", f"{args.model}_{args.flavor.lower()}",
               "--hf_assets_path", args.assets, "--dataloader.dataset_path", args.data,
               "--dump_folder", str(dump),
               "--dataloader.num_workers", str(args.data_workers)]  # fmt: skip
    if compile:
        common += ["--compile.components", "model,loss"]
    if not args.cuda_graphs:
        common += ["--training.disable_cuda_graphs"]
    command += common + recipe_args(titan, args.model, recipe, compile, args.weight_cache)
    # tyro's subcommand for the activation-checkpointing union goes last
    return command + ([] if args.ac else ["activation-checkpoint:none"])


def launch(titan_argv: list[str], log: Path, timeout: float, gpu: int | None = None) -> str:
    """Run the trainer in its own process (group) with its output in `log`: "ok", or why not.
    `gpu`: the one GPU it sees (of those this process sees)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", "1", "-m", "blockscale.integrations.titan.train",
               *titan_argv]  # fmt: skip
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    if not torch.cuda.is_available():
        env.setdefault("OMP_NUM_THREADS", "1")  # one CPU process: no thread oversubscription
    if gpu is not None:
        visible = env.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        env["CUDA_VISIBLE_DEVICES"] = ids[gpu]
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as out:
        out.write("$ " + " ".join(command) + "\n")
        out.flush()
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                cwd=ROOT, start_new_session=True)  # fmt: skip
        try:
            code = proc.wait(timeout=timeout or None)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            return f"timeout after {timeout:.0f} s"
    return "ok" if code == 0 else f"exit {code}: {last_error(log)}"


def last_error(log: Path) -> str:
    """The most telling line of a failed run's log: the last exception raised in the trainer
    (not torchrun's report that its child failed)."""
    lines = log.read_text(errors="replace").splitlines()
    for line in reversed(lines):
        text = line.split("]:", 1)[-1].strip()
        name = text.split(":", 1)[0]
        if name.endswith(("Error", "Exception")) and "ChildFailedError" not in name:
            return text[:240]
    return (lines[-1] if lines else "")[:240]


def read_metrics(dump: Path) -> dict[int, dict[str, Any]]:
    """torchtitan's metrics by step; a resumed run's later record of a step wins."""
    path = dump / METRICS
    if not path.exists():
        return {}
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in records}


def summarize(metrics: dict[int, dict[str, Any]], warmup: int, tail: int) -> dict[str, Any]:
    """A row's figures from its metrics (module docstring)."""
    steps = sorted(metrics)
    if not steps:
        return {}
    after = [s for s in steps if s > warmup] or steps[-1:]
    timed = [metrics[s][TPS] for s in after]
    waited = [metrics[s].get("time_metrics/data_loading(%)", 0.0) for s in after]
    losses = [metrics[s][LOSS] for s in steps]
    active = [metrics[s].get("memory/max_active(GiB)", -1) for s in steps]
    reserved = [metrics[s].get("memory/max_reserved(GiB)", -1) for s in steps]
    return {
        "steps_done": steps[-1],
        "tokens_per_s": statistics.median(timed),
        "data_pct": statistics.fmean(waited),
        "peak_gib": max(active) if max(active) > 0 else None,
        "peak_reserved_gib": max(reserved) if max(reserved) > 0 else None,
        "first_s": metrics[steps[0]].get("time_metrics/end_to_end(s)"),
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "loss_end": statistics.fmean(losses[-tail:]),
        "losses": [[s, metrics[s][LOSS]] for s in steps],
    }


def align_ends(rows: list[dict[str, Any]], tail: int) -> None:
    """Each convergence row's loss_end over the same steps: the `tail` up to end_step, the last
    step that every row with losses reached (a run cut by its timeout stops early)."""
    curves = [r for r in rows if r.get("losses")]
    if not curves:
        return
    end = min(r["losses"][-1][0] for r in curves)
    for row in curves:
        window = [loss for step, loss in row["losses"] if end - tail < step <= end]
        row["end_step"], row["loss_end"] = end, statistics.fmean(window)


RATIOS = (("tokens_per_s", "tok_vs_bf16"), ("peak_gib", "mem_vs_bf16"),
          ("loss_end", "loss_vs_bf16"))  # fmt: skip


def add_ratios(rows: list[dict[str, Any]], ratios: Sequence[tuple[str, str]] = RATIOS) -> None:
    """Each row's `ratios` (figure, its ratio's key) to the first BF16 row of its mode that
    finished; for a convergence table's loss_end, to its first BF16 row however far it got,
    since `align_ends` took every row's loss_end at the step all of them reached."""
    for row in rows:
        bf16 = [b for b in rows if b["recipe"] == "bf16" and b["mode"] == row["mode"]]
        for key, ratio in ratios:
            aligned = key == "loss_end" and "end_step" in row
            base = next((b for b in bf16 if aligned or b.get("status") == "ok"), None)
            if base is not None and row.get(key) and base.get(key):
                row[ratio] = row[key] / base[key]


SPEED_COLUMNS = ["model", "flavor", "mode", "recipe", "tokens_per_s", "tok_vs_bf16", "peak_gib",
                 "mem_vs_bf16", "first_s", "data_pct", "loss_first", "loss_last",
                 "status"]  # fmt: skip
CONVERGE_COLUMNS = ["model", "flavor", "mode", "recipe", "seed", "steps_done", "end_step",
                    "loss_end", "loss_vs_bf16", "tokens_per_s", "peak_gib", "status"]  # fmt: skip
# the gaps a convergence table is for are tenths of a percent: 3.658 against 3.668 is 1.0028,
# which three significant digits print as 3.66, 3.67 and 1 (columns of CONVERGE_COLUMNS only)
FORMATS = {"loss_end": ".4f", "loss_vs_bf16": ".4f"}


def run_recipe(titan: str, args: argparse.Namespace, recipe: str, mode: str,
               dump: Path, seed: int | None = None, gpu: int | None = None) -> dict[str, Any]:  # fmt: skip
    row: dict[str, Any] = {"model": args.model, "flavor": args.flavor, "mode": mode,
                           "recipe": recipe, "seed": args.seed if seed is None else seed}  # fmt: skip
    if args.dump:
        row["dump"] = str(dump)
    done = read_metrics(dump) if args.converge else {}
    if args.converge and done and max(done) >= args.steps:
        row["status"] = "ok"  # finished in an earlier call: read, not rerun
    else:
        argv = titan_args(titan, args, recipe, mode == "compile", dump, seed)
        started = time.perf_counter()
        row["status"] = launch(argv, dump / "log.txt", args.timeout, gpu)
        row["wall_s"] = time.perf_counter() - started
    row.update(summarize(read_metrics(dump), args.warmup, args.tail))
    return row


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="torchtitan model: deepseek_v3, llama4 "
                        "(0.2.2), qwen3 / llama3 (0.3), ...")  # fmt: skip
    parser.add_argument("--flavor", default=None, help="debugmodel, 16B_4L, small, 17bx16e_2L, ...")
    parser.add_argument("--recipes", default="bf16,nvfp4,mxfp8,float8",
                        help=f"of {', '.join(RECIPES)}; bf16 always runs first")  # fmt: skip
    parser.add_argument("--modes", default="eager", help="eager, compile or eager,compile")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of tokens/s")
    parser.add_argument("--batch", type=int, default=4, help="torchtitan's local_batch_size")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                        help="torchtitan's training.dtype (default float32 weights)")  # fmt: skip
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--lr-warmup", type=int, default=None, help="warm-up steps of the LR")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bf16-seeds", default=None,
                        help="a BF16 run for each of these seeds (0,1): the seed-to-seed gap")  # fmt: skip
    parser.add_argument("--parallel", type=int, default=1,
                        help="runs at a time; on CUDA each on a GPU of its own")  # fmt: skip
    parser.add_argument("--per-gpu", type=int, default=1,
                        help="with --parallel: runs that share one GPU (convergence only: "
                             "their speeds are not a recipe's own)")  # fmt: skip
    parser.add_argument("--ac", action="store_const", const="selective", default=None,
                        help="torchtitan's selective activation checkpointing")  # fmt: skip
    parser.add_argument("--cuda-graphs", action="store_true", help="0.3: keep CUDA graphs on")
    parser.add_argument("--no-weight-cache", dest="weight_cache", action="store_false",
                        help="0.2.2: blockscale's layers keep no quantized weight copies")  # fmt: skip
    parser.add_argument("--data", default=".data/train.txt.gz",
                        help="the text: a .txt/.txt.gz file, a folder or a comma list")  # fmt: skip
    parser.add_argument("--data-workers", type=int, default=2,
                        help="data loader processes that tokenize ahead of the steps")  # fmt: skip
    parser.add_argument("--assets", default=".titan-assets/bpe-32k",
                        help="tokenizer assets folder (python -m "
                        "blockscale.integrations.titan.local_text)")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=0, help="s per run, 0: none")
    parser.add_argument("--converge", action="store_true",
                        help="convergence mode: loss curves, checkpoints, resume")  # fmt: skip
    parser.add_argument("--checkpoint-interval", type=int, default=100)
    parser.add_argument("--tail", type=int, default=50, help="steps averaged into loss_end")
    parser.add_argument("--dump", default=None, help="run folders (default: a temporary one; "
                        "--converge needs one to resume)")  # fmt: skip
    parser.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                        help="the convergence rows of several calls' --out files in one table "
                             "(nothing runs; --tail applies)")  # fmt: skip
    parser.add_argument("--plot", metavar="PNG", default=None,
                        help="with --converge or --merge: each run's loss and its gap to BF16 "
                             "against tokens seen, as a PNG (matplotlib)")  # fmt: skip
    parser.add_argument("--smoke", action="store_true", help="CPU: the version's debug model, "
                        "batch 2, sequence 64, 3 steps, bf16 and nvfp4")  # fmt: skip
    parser.add_argument("--out", metavar="PATH", help="write the rows as JSON")
    args = parser.parse_args(argv)
    if args.smoke:
        model, flavor = SMOKE_MODEL[titan_version()[:3]]
        args.model, args.flavor = args.model or model, args.flavor or flavor
        smoke = {"batch": 2, "seq_len": 64, "steps": 3, "warmup": 1, "recipes": "bf16,nvfp4",
                 "assets": ".titan-assets/bpe-2k", "data_workers": 0}  # fmt: skip
        for name, value in smoke.items():
            if getattr(args, name) == parser.get_default(name):
                setattr(args, name, value)
    if args.plot and not (args.converge or args.merge):
        parser.error("--plot draws loss curves: --converge or --merge")
    if args.merge:
        return args
    if not args.model or not args.flavor:
        parser.error("--model and --flavor are needed (or --smoke)")
    if args.converge and not args.dump:
        parser.error("--converge needs --dump, the folder its checkpoints resume from")
    if args.parallel < 1:
        parser.error("--parallel needs 1 or more")
    if args.per_gpu < 1:
        parser.error("--per-gpu needs 1 or more")
    if args.per_gpu > 1 and not args.converge:
        parser.error("--per-gpu shares a GPU between runs, so their speeds mean nothing: "
                     "--converge only")  # fmt: skip
    try:
        args.bf16_seeds = [int(s) for s in args.bf16_seeds.split(",")] if args.bf16_seeds else None
    except ValueError:
        parser.error(f"--bf16-seeds {args.bf16_seeds!r}: integers separated by commas")
    args.tail = min(args.tail, args.steps)
    return args


def gpu_slots(gpus: int, per_gpu: int) -> list[int]:
    """The GPU of each place a parallel run can take: every GPU `per_gpu` times, spread so that
    the first runs land on different GPUs."""
    return [gpu for _ in range(per_gpu) for gpu in range(gpus)]


def merge(paths: list[str], tail: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One convergence table from the JSONs of several calls (a model's runs split over calls
    that each fit a device call): the same model, flavor and run settings in all; BF16 rows
    first, lowest seed first (the ratios' baseline), then the rest in file order, with
    end_step, loss_end and loss_vs_bf16 taken again over all of them (no speed ratios: the runs
    came from other calls, on shared GPUs).

    A run (mode, recipe, seed) in several files: the copy that reached the most steps (the
    first of them on a tie; a complete one where there is one) is kept and the others, cut
    shorter by their call, are dropped (listed under "dropped" in the JSON, and printed), since
    a cut run would pull end_step back for every row; two complete copies are refused. Copies
    of one run from separate calls are separate runs of the same settings (each started at
    step 1 where its call could not resume the other), not parts of one."""
    records = [json.loads(Path(p).read_text()) for p in paths]
    for path, record in zip(paths, records):
        if record.get("benchmark") != "titan_converge":
            raise SystemExit(f"{path}: not a --converge JSON")
    keys = ("batch", "seq_len", "steps")
    settings = {(r["rows"][0]["model"], r["rows"][0]["flavor"], *(r[k] for k in keys))
                for r in records if r["rows"]}  # fmt: skip
    if len(settings) > 1:
        raise SystemExit(f"runs of different settings (model, flavor, {', '.join(keys)}): "
                         f"{sorted(settings)}")  # fmt: skip
    steps = records[0]["steps"]
    found: dict[tuple, list[tuple[str, dict[str, Any]]]] = {}
    for path, record in zip(paths, records):
        for row in record["rows"]:
            found.setdefault((row["mode"], row["recipe"], row["seed"]), []).append((path, row))
    rows, dropped = [], []
    for run, copies in found.items():
        whole = [path for path, row in copies if row.get("steps_done") == steps]
        if len(whole) > 1:
            raise SystemExit(f"run {run} complete ({steps} steps) in more than one file: "
                             f"{whole}")  # fmt: skip
        kept_path, kept = max(copies, key=lambda copy: copy[1].get("steps_done") or 0)
        rows.append(kept)
        for path, row in copies:
            if row is not kept:
                dropped.append({"path": path, "mode": run[0], "recipe": run[1], "seed": run[2],
                                "steps_done": row.get("steps_done")})  # fmt: skip
                print(f"dropped {run[1]} seed {run[2]} of {path} ({row.get('steps_done')} of "
                      f"{steps} steps): {kept_path} has it to step "
                      f"{kept.get('steps_done')}")  # fmt: skip
    rows.sort(key=lambda r: (r["mode"], r["recipe"] != "bf16", r["seed"] if r["recipe"] == "bf16"
                             else 0))  # fmt: skip
    for row in rows:  # each call's ratios were to its own BF16 row
        for _, ratio in RATIOS:
            row.pop(ratio, None)
    align_ends(rows, tail)
    add_ratios(rows, [("loss_end", "loss_vs_bf16")])  # speeds of other calls do not compare
    merged = {**{k: records[0][k] for k in keys}, "benchmark": "titan_converge",
              "merged_from": [{"path": p, "banner": r.get("banner")} for p, r in
                              zip(paths, records)], "dropped": dropped, "rows": rows}  # fmt: skip
    return merged, rows


def trailing_means(losses: list[list[float]], tail: int) -> list[tuple[int, float]]:
    """(step, mean of the losses of the `tail` steps up to it) for each step from the first
    step with a whole window (the loss_end of a run stopped there)."""
    out, total, start = [], 0.0, 0
    for i, (step, loss) in enumerate(losses):
        total += loss
        while losses[start][0] <= step - tail:
            total -= losses[start][1]
            start += 1
        if step - losses[0][0] + 1 >= tail:
            out.append((int(step), total / (i - start + 1)))
    return out


def plot_gaps(rows: list[dict[str, Any]], tail: int, tokens_per_step: int,
              path: str) -> dict[tuple, list[tuple[float, float]]]:  # fmt: skip
    """`--plot`: each run's trailing `tail`-step mean loss (left) and its gap in % to the first
    BF16 row of its mode at the same step (right), against millions of tokens seen; BF16 rows
    of other seeds dashed (the seed-to-seed gap to read the others against). Returns the right
    panel's points by (mode, recipe, seed)."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    curves = {(r["mode"], r["recipe"], r["seed"]): dict(trailing_means(r["losses"], tail))
              for r in rows if r.get("losses")}  # fmt: skip
    curves = {run: curve for run, curve in curves.items() if curve}  # shorter than `tail`: none
    gaps: dict[tuple, list[tuple[float, float]]] = {}
    fig, (ax_loss, ax_gap) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for n, ((mode, recipe, seed), curve) in enumerate(curves.items()):
        label = f"{recipe} seed {seed}" + (f" ({mode})" if len({k[0] for k in curves}) > 1 else "")
        style = {"color": colors[n % len(colors)], "linestyle": "--" if recipe == "bf16" else "-"}
        tokens = [step * tokens_per_step / 1e6 for step in curve]
        ax_loss.plot(tokens, list(curve.values()), label=label, linewidth=1.0, **style)
        base = next((c for k, c in curves.items() if k[0] == mode and k[1] == "bf16"), None)
        if base is None or base is curve:
            continue
        points = [(step * tokens_per_step / 1e6, 100 * (loss / base[step] - 1))
                  for step, loss in curve.items() if step in base]  # fmt: skip
        gaps[(mode, recipe, seed)] = points
        ax_gap.plot([t for t, _ in points], [g for _, g in points], label=label, linewidth=1.0,
                    **style)  # fmt: skip
    ax_loss.set(title=f"training loss, mean of {tail} steps", xlabel="tokens (M)", ylabel="loss")
    ax_loss.set_ylim(top=min(max(c.values()) for c in curves.values()))
    ax_gap.axhline(0.0, color="black", linewidth=0.8)
    ax_gap.set(title="gap to BF16 (first seed)", xlabel="tokens (M)", ylabel="%")
    for ax in (ax_loss, ax_gap):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return gaps


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    if args.merge:
        merged, rows = merge(args.merge, args.tail)
        if args.out:
            harness.write_json(args.out, merged)
        harness.print_table(rows, CONVERGE_COLUMNS, FORMATS)
        if args.plot:
            plot_gaps(rows, args.tail, merged["batch"] * merged["seq_len"], args.plot)
        return rows
    titan = titan_version()
    names = [r.strip() for r in args.recipes.split(",") if r.strip()]
    unknown = [r for r in names if r not in RECIPES]
    if unknown:
        raise SystemExit(f"unknown recipes {unknown}; choose from {', '.join(RECIPES)}")
    names = ["bf16"] + [r for r in names if r != "bf16"]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if set(modes) - {"eager", "compile"}:
        raise SystemExit(f"--modes {args.modes!r}: each mode is eager or compile")
    info = harness.banner(harness.pick_device())
    info["torchtitan"] = titan
    runs = [(mode, recipe, seed) for mode in modes for recipe in names
            for seed in (args.bf16_seeds or [args.seed] if recipe == "bf16" else [args.seed])]  # fmt: skip
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    rows: list[dict[str, Any]] = []

    def record(row: dict[str, Any]) -> None:
        rows.append(row)
        figures = ", ".join(f"{k}={harness.fmt(row.get(k))}" for k in
                            ("tokens_per_s", "peak_gib", "loss_last"))  # fmt: skip
        print(f"  {args.model} {args.flavor} {row['mode']} {row['recipe']} seed {row['seed']}: "
              f"{figures} [{row['status']}]", flush=True)  # fmt: skip
        rows.sort(key=lambda r: runs.index((r["mode"], r["recipe"], r["seed"])))
        if args.converge:
            align_ends(rows, args.tail)
        add_ratios(rows)
        if args.out:
            harness.write_json(args.out, {
                "benchmark": "titan_converge" if args.converge else "titan",
                "banner": info, "argv": sys.argv[1:] if argv is None else argv,
                "batch": args.batch, "seq_len": args.seq_len, "steps": args.steps,
                "warmup": args.warmup, "rows": rows})  # fmt: skip

    # the GPUs not in use by a run (parallel runs on CUDA): a run takes one while it trains
    free: queue.Queue[int] | None = None
    if gpus and args.parallel > 1:
        free = queue.Queue()
        for gpu in gpu_slots(gpus, args.per_gpu):
            free.put(gpu)

    def run(mode: str, recipe: str, seed: int, dump: Path) -> dict[str, Any]:
        gpu = None if free is None else free.get()
        try:
            return run_recipe(titan, args, recipe, mode, dump, seed, gpu)
        finally:
            if free is not None:
                free.put(gpu)

    with tempfile.TemporaryDirectory() as tmp:
        base = Path(args.dump or tmp)
        jobs = []
        with concurrent.futures.ThreadPoolExecutor(max_workers=args.parallel) as pool:
            for mode, recipe, seed in runs:
                dump = base / f"{args.model}-{args.flavor}-{mode}-{recipe}"
                if seed != args.seed:
                    dump = dump.with_name(f"{dump.name}-seed{seed}")
                if args.dump and not args.converge:  # a fresh folder: no earlier run's metrics
                    dump = dump.with_name(dump.name + time.strftime("-%Y%m%d-%H%M%S"))
                jobs.append(pool.submit(run, mode, recipe, seed, dump))
                if args.parallel == 1:
                    record(jobs[-1].result())
            if args.parallel > 1:
                for job in concurrent.futures.as_completed(jobs):
                    record(job.result())
    print(f"\ntorchtitan {titan}, B={args.batch} T={args.seq_len}, {args.steps} steps; "
          "each recipe in its own process; ratios to BF16 of the same mode")  # fmt: skip
    harness.print_table(rows, CONVERGE_COLUMNS if args.converge else SPEED_COLUMNS, FORMATS)
    if args.plot:
        plot_gaps(rows, args.tail, args.batch * args.seq_len, args.plot)
    return rows


if __name__ == "__main__":
    main()
