"""The training loop: `train(cfg, run_dir)`, which a resumed run re-enters, and the `Trainer`
it drives through named phases: build (model, data, optimizer; the mode splits the model over
the ranks), resume, prepare the run directory, then `run`: each step (`train_step`) followed by
what is due after it (`log_train`, `evaluate_held_out`, `probe_numerics`, `save_checkpoint`),
and `finish`. One process or several ranks (--fsdp, --tp, --ep) differ only in the mode object
(train/parallel.py), never by a branch in the loop.

A run directory holds `config.json`, `metrics.jsonl` (one JSON object a line), `checkpoints/`
and, once the loop stops, `summary.json`; a folder holding anything else and no run's
`config.json` is someone else's, and no run writes into it (`check_not_foreign`). Metric rows carry a `kind`:

- `train`: `loss` (mean over the steps since the previous row), `lr`, `grad_norm`, `tokens`,
  `tokens_per_s` (training time only: evaluation, telemetry and checkpoints excluded), `time`
  (wall clock when the row was written, Unix seconds: the report uses it to tell which runs
  trained on the same device at the same time, whose speeds do not compare); an MoE model's
  rows add `aux_loss` (the load-balancing loss, mean over the same steps, before its
  coefficient) and `expert_tokens` ({MoE layer: token-expert assignments per expert, summed
  over the same steps});
- `eval`: `val_loss`, `val_bpb` on the held-out split;
- `telemetry`: per converted layer and operand, `sqnr_db`, `zero_frac`, `amax`, and for
  grouped experts the same per expert (telemetry.py).

`loss` is always the cross entropy alone, so an MoE run's loss compares with a dense run's; the
gradient is that of cross entropy + `aux_loss_coef` * aux_loss. Reading the router's counts
costs no synchronization: they are summed on the device and read when a row is written.

Every row carries `step`, the number of optimizer steps completed. All rows of a step are
written before that step's checkpoint, so resuming from the checkpoint at step s first drops the
rows past s and then writes them again: the metrics of an interrupted run end up the same as an
uninterrupted one's. SIGINT/SIGTERM (Ctrl-C) finish the current step, checkpoint and stop,
acknowledged on stderr at once; a second SIGINT or SIGTERM stops at once. `max_minutes` stops
the same way, for machines that lend time in slices: rerun with `--resume` to continue.

`train(..., fsdp=True)` is one rank of a torchrun launch (train/ranks.py): the same loop over
an FSDP2-sharded model, each rank running its share of every step's micro-batches; losses are
summed over the ranks before a row is written, every rank evaluates (the sharded forward needs
them all), rank 0 alone writes rows and files, and checkpoints are sharded (checkpoint.py).
Stopping (a signal, `max_minutes`) is agreed by all ranks at every step. `tp=True` instead: the
model's blocks split over the ranks (tensor parallel), which all run every micro-batch.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

import blockscale.nn as bsnn
from blockscale.models import moe_layers
from blockscale.ops import EXACT_INDUCTOR_OPTIONS
from blockscale.train import build, checkpoint, files, step_time, telemetry
from blockscale.train.config import RESUMABLE, TrainConfig, differences, foreign_config
from blockscale.train.data import Batches, check_evaluable, left_out_notice, load_corpus
from blockscale.train.errors import UsageError
from blockscale.train.evaluate import evaluate
from blockscale.train.parallel import OneProcess, parallelism
from blockscale.train.ranks import full

try:
    from tqdm.auto import tqdm
except ImportError:  # tqdm is a dependency, but a bare GPU image may lack it
    tqdm = None


class Metrics:
    """Append-only JSONL, one row per line. A crash can tear only the last line (the one being
    appended); readers drop it, and `truncate_after(step)` rewrites the file without it and
    without the rows past a checkpoint, atomically (a crash leaves the old file or the new).
    `enabled` False (ranks other than 0 of a --fsdp run): writes nothing."""

    def __init__(self, path: Path, enabled: bool = True) -> None:
        self.path, self.enabled = path, enabled

    def truncate_after(self, step: int) -> None:
        if self.enabled and self.path.exists():
            kept = [row for row in parse_metrics(self.path) if row.get("step", 0) <= step]
            files.write_atomic(self.path, "".join(json.dumps(row) + "\n" for row in kept))

    def write(self, row: dict) -> None:
        if self.enabled:
            files.append_line(self.path, json.dumps(row))

    def sync(self) -> None:
        """Make the rows so far durable (before a checkpoint that counts on them)."""
        if self.enabled and self.path.exists():
            files.fsync_file(self.path)


def parse_metrics(path: Path) -> list[dict]:
    """The rows of a metrics.jsonl. A last line that does not parse, or lacks its newline, is
    a row cut short by a crash and is dropped; a bad line before it is corruption."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e}") from None
    # The piece after the last newline is "" in a whole file, else a row cut short: dropped.
    lines = text.split("\n")[:-1]
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if not isinstance(row, dict):
            raise UsageError(
                f"{path} line {number} is not a JSON object ({line[:40]!r}); only the last "
                "line can be torn by a crash, so this file was damaged otherwise"
            )
        rows.append(row)
    return rows


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return parse_metrics(path) if path.exists() else []


class _StopRequest:
    """First SIGINT/SIGTERM: finish the step, checkpoint, stop, and say so at once: a step can
    take minutes, and a signal that nothing acknowledged looked ignored (issue 60). Second
    SIGINT or SIGTERM: stop now, without a checkpoint (KeyboardInterrupt); a scheduler's or
    `timeout`'s second SIGTERM was ignored too, and the step ran on for minutes.

    `notice(signal name)`: the acknowledgement, written straight to stderr's file descriptor
    (a handler may run while the main thread is inside a buffered write, which `print` would
    enter again); None: say nothing (ranks other than 0)."""

    def __init__(self, notice: Callable[[str], str] | None = None) -> None:
        self.requested = False
        self.notice = notice
        self._old: dict = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        if self.notice is not None:
            os.write(2, (self.notice(signal.Signals(signum).name) + "\n").encode())

    def __exit__(self, *exc) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


def _say(message: str, bar) -> None:
    (bar.write if bar is not None else print)(message)
    sys.stdout.flush()  # a log file or pipe sees it now, not when the buffer fills


def saved_config(run_dir: Path) -> TrainConfig:
    """The config.json of the run to resume; refuses a missing folder or file."""
    if not run_dir.is_dir():
        raise UsageError(f"cannot resume {run_dir}: there is no such run directory")
    path = run_dir / "config.json"
    if not path.is_file():
        raise UsageError(
            f"cannot resume {run_dir}: it has no config.json, so nothing says what the run was"
        )
    return TrainConfig.load(path)


def check_resumable(cfg: TrainConfig, run_dir: Path) -> None:
    """Refuse to continue what is not the run `cfg` describes: a missing folder or config.json,
    or a config.json that differs in a field outside RESUMABLE (each difference named)."""
    diffs = differences(saved_config(run_dir), cfg)
    if diffs:
        raise UsageError(
            f"cannot resume {run_dir}: settings that define the run differ from its "
            f"config.json ({'; '.join(diffs)}); only {', '.join(sorted(RESUMABLE))} may change"
        )


def check_run_dir(cfg: TrainConfig, run_dir: Path, resume: bool) -> None:
    """Refuse a run directory that does not fit: on `resume`, one that is not the run `cfg`
    describes (check_resumable); otherwise a file, or a folder that already holds a run."""
    if resume:
        check_resumable(cfg, run_dir)
    elif run_dir.exists() and not run_dir.is_dir():
        raise UsageError(f"{run_dir} is a file, not a run directory; choose another --out")
    elif (run_dir / "metrics.jsonl").exists() or checkpoint.checkpoint_dirs(run_dir):
        raise UsageError(
            f"{run_dir} already holds a run; pass --resume to continue it, or choose another --out"
        )


# What a run writes into its folder, besides the temporaries `.NAME.tmp` of its atomic writes.
RUN_ENTRIES = frozenset(
    {"config.json", "metrics.jsonl", "summary.json", "checkpoints", files.LOCK_NAME}
)


def check_not_foreign(run_dir: Path) -> None:
    """Refuse a folder that is not a blockscale run's, before anything is made or written in
    it: one whose config.json is another program's (config.foreign_config), or, without a
    config.json, one that holds anything a run does not write. A new or empty folder, and a
    run's (other files beside its config.json included), pass. Before, `train --out DIR`
    overwrote a foreign config.json and deleted a summary.json, and `--resume` on a
    transformers model's folder trained a run of defaults over its config (issue 60)."""
    if not run_dir.is_dir():
        return
    config = run_dir / "config.json"
    if config.exists():
        try:
            values = json.loads(config.read_text())
        except (OSError, UnicodeDecodeError, ValueError):
            values = None  # not JSON: not a run's
        problem = foreign_config(values)
        if problem is not None:
            raise UsageError(
                f"{run_dir} is not a blockscale run: its config.json {problem}; choose another "
                "--out (a new or empty folder), and nothing in this one is touched"
            )
        return
    temporaries = {f".{name}.tmp" for name in RUN_ENTRIES}
    others = sorted(p.name for p in run_dir.iterdir() if p.name not in RUN_ENTRIES | temporaries)
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise UsageError(
            f"{run_dir} is not a blockscale run: it has no config.json and holds what no run "
            f"writes ({shown}); choose another --out (a new or empty folder), and nothing in "
            "this one is touched"
        )


@files.one_writer(check_not_foreign)  # one process writes a run folder (files.py), only a run's
def train(
    cfg: TrainConfig,
    run_dir: Path,
    resume: bool = False,
    progress: bool = True,
    fsdp: bool = False,
    ep: bool = False,
    tp: bool = False,
) -> dict:
    """Train (or continue training) the run in `run_dir`; returns its summary.

    Nothing in `run_dir` is written until the run is built and, when resuming, its checkpoint
    has loaded: a resume that fails leaves the run as it was.

    fsdp: this process is one rank of a torchrun launch (train/ranks.py): it joins the default
    process group (which stays initialized on return), trains its share of each step on the
    FSDP2-sharded model and writes its part of the sharded checkpoints; rank 0 alone prints
    and writes the run's files, and other ranks return only {"status": ...}.

    ep: the same, with an MoE model's experts split over the ranks (expert parallel) instead
    of FSDP2: each rank keeps E/N experts and the other weights whole, whose gradients it
    averages over the ranks after the backward (train/ranks.py).

    tp: the same, with the model's blocks split over the ranks (tensor parallel, train/ranks.py)
    and every rank running all of each step's micro-batches (the ranks share the batch)."""
    run_dir = Path(run_dir)
    check_run_dir(cfg, run_dir, resume)
    if fsdp + ep + tp > 1:
        raise UsageError(exclusive_modes(fsdp, ep, tp))
    mode = parallelism(fsdp=fsdp, ep=ep, tp=tp)
    mode.check(cfg)
    with deterministic_algorithms(cfg.deterministic):
        device = mode.join(cfg)
        trainer = Trainer(cfg, run_dir, mode, device)
        if resume:
            trainer.resume()
        trainer.prepare_run_dir()
        return trainer.run(progress)


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool) -> Iterator[None]:
    """Within: torch's deterministic algorithms only, where `enabled` (`--deterministic`), so a
    run's CUDA work repeats bit for bit. Otherwise attention's backward (flash attention's dQ,
    added by atomics) and cuBLAS sum in an order that changes from run to run, and two runs,
    or a 2-rank run and its one-process twin, differ in the last bits from the first backward
    on. cuBLAS reads its workspace setting when it starts, so this is entered before the run
    touches the GPU; blockscale's own kernels need nothing (their only atomics are integer
    maxima, whose result does not depend on the order). The previous setting comes back on
    exit."""
    if not enabled:
        yield
        return
    before = torch.are_deterministic_algorithms_enabled()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


class Trainer:
    """One run on this process. `__init__` builds it (data, the model converted to its recipe
    and split over the ranks by the mode, the optimizer); `resume` continues it from its newest
    checkpoint; `prepare_run_dir` writes its config; `run` is the loop over the steps, each
    (`train_step`) followed by what is due after it: a metrics row (`log_train`), evaluation,
    telemetry, a checkpoint. The distributed modes act only through `self.mode`'s hooks
    (train/parallel.py)."""

    def __init__(self, cfg: TrainConfig, run_dir: Path, mode: OneProcess, device: torch.device):
        self.cfg, self.run_dir, self.mode, self.device = cfg, run_dir, mode, device
        self.ranks = mode.ranks
        self.metrics = Metrics(run_dir / "metrics.jsonl", enabled=self.ranks.main)
        corpus = load_corpus(cfg.data, cfg.max_data_bytes, binary_ok=cfg.binary_data)
        if cfg.eval_every:  # refused before anything is built or trained
            check_evaluable(corpus, build.build_model_config(cfg).seq_len, cfg.eval_tokens)
        self.data_notice = left_out_notice(corpus)
        self.model, self.recipe = build.build_model(cfg, device)
        mode.parallelize(self.model, self.recipe, cfg, device)
        self.val_data, self.seq_len = corpus.val, self.model.config.seq_len
        self.batches = Batches(corpus.train, self.seq_len, cfg.batch_size, cfg.seed)
        self.optimizer = build.build_optimizer(self.model, cfg, device)
        self.tokens_per_step = cfg.batch_size * cfg.grad_accum * self.seq_len
        self.start = self.reached = 0  # reached: optimizer steps completed (the summary's step)
        self.sums = _Sums(self.model, {"loss_sum": 0.0, "loss_steps": 0}, device)
        # Inductor's default fast math (approximate division, dropped BF16 round trips, FMA)
        # would move quantization codes; these options keep eager's numerics, for every recipe.
        self.step_model = (
            torch.compile(self.model, options=EXACT_INDUCTOR_OPTIONS) if cfg.compile else self.model
        )
        self.autocast = build.autocast_for(device)
        self.schedule = bsnn.PrecisionSchedule(cfg.steps, cfg.bf16_final_fraction)
        self.quantized_now: bool | None = None
        self.memory = _PeakMemory(device)
        self.bar = None
        self.n_params = 0  # the whole model's, counted when the run begins
        self.step_now = self.micro_done = 0  # where the loop is (a stop request says it)
        self.first_step = step_time.FirstStep(0, device, None, True)  # (timed once begun)
        self.time = _TrainingTime()

    def resume(self) -> None:
        """Load the newest checkpoint, if the run has one: model, optimizer, random stream and
        the sums since the last metrics row."""
        ckpts = checkpoint.checkpoint_dirs(self.run_dir)
        if ckpts:
            self.start, carried = self.mode.load_checkpoint(
                ckpts[-1], self.model, self.optimizer, self.cfg, self.device
            )
            self.sums = _Sums(self.model, carried, self.device)

    def prepare_run_dir(self) -> None:
        """Rank 0 makes the folder, keeps the rows up to the resumed step and writes the config."""

        def prepare() -> None:
            with files.reported(self.run_dir):
                self.run_dir.mkdir(parents=True, exist_ok=True)
                # First, since it can still refuse (a damaged row before the last): a fresh start
                # keeps no rows, a resumed run those up to its checkpoint.
                self.metrics.truncate_after(self.start if self.start else -1)
                self.cfg.save(self.run_dir / "config.json")
                (self.run_dir / "summary.json").unlink(missing_ok=True)

        self.ranks.barrier()  # every rank has checked the run directory before rank 0 writes
        self.ranks.on_main(prepare, self.device)

    def run(self, progress: bool) -> dict:
        """Train from the resumed step to cfg.steps, or until the loss diverges, a signal or
        max_minutes stops it; returns the summary (other ranks than 0: {"status": ...})."""
        cfg = self.cfg
        self.begin(progress)
        status, step, started = "done", self.start, time.perf_counter()
        try:
            with _StopRequest(self.stop_notice if self.ranks.main else None) as stop:
                for step in range(self.start, cfg.steps):
                    lr, grad_norm = self.train_step(step)
                    done = self.reached = step + 1
                    last = done == cfg.steps
                    if self.bar is not None:
                        self.bar.update(1)
                    if _due(cfg.log_every, done, last):
                        mean_loss = self.log_train(done, lr, grad_norm)
                        if not math.isfinite(mean_loss):
                            status = "diverged"
                            self.say(
                                f"step {done}: loss is {mean_loss}; stopping (the run diverged)"
                            )
                            break
                    self.time.pause()  # evaluation, telemetry and checkpoints are not training
                    self.memory.training()  # the steps' peak so far, before evaluation and probes
                    with self.checkpointed_on_failure(done):
                        if _due(cfg.eval_every, done, last):
                            self.evaluate_held_out(done)
                        if _due(cfg.telemetry_every, done, last):
                            self.probe_numerics(done)
                    # Every rank stops at the same step (each checkpoints with the others).
                    stopping, out_of_time = self.ranks.any(
                        stop.requested, self.out_of_time(started), device=self.device
                    )
                    self.step_now, self.micro_done = done, 0  # a request from now: the next step
                    if last or stopping or out_of_time or _due(cfg.ckpt_every, done, last):
                        self.save_checkpoint(done)
                    self.memory.restart()  # the next steps' peak starts here
                    self.time.resume()
                    if (stopping or out_of_time) and not last:
                        status = "interrupted" if stopping else "paused"
                        self.say(
                            f"stopped at step {done} ({status}); rerun to continue (train: --resume)"
                        )
                        break
        except OSError as e:  # a metrics row or a checkpoint could not be written
            raise files.write_failure(self.run_dir, e) from None
        except torch.OutOfMemoryError:
            raise self.out_of_memory(step) from None
        finally:
            if self.bar is not None:
                self.bar.close()
        return self.finish(status)

    def begin(self, progress: bool) -> None:
        """Open the progress bar, say what the run is, and probe a fresh run's initial weights."""
        cfg = self.cfg
        said = False
        if self.ranks.main:  # a step over a minute is said before the bar (step_time.py)
            if self.data_notice is not None:
                print(self.data_notice, flush=True)
            per_rank = self.tokens_per_step // self.ranks.data_ranks
            said = step_time.say_if_slow(self.model, self.seq_len, per_rank, self.device)
        if progress and self.ranks.main and tqdm is not None:
            self.bar = tqdm(
                total=cfg.steps,
                initial=self.start,
                unit="step",
                dynamic_ncols=True,
                desc=self.recipe.name,
            )
        # ... or, where the estimate missed it, seconds into the first step, once timed
        micro_batches = len(self.ranks.micro_batches(cfg.grad_accum))
        say = self.say if self.ranks.main else None
        self.first_step = step_time.FirstStep(micro_batches, self.device, say, said)
        self.n_params = self.mode.count_params(self.model)
        self.say(
            f"{self.run_dir}: model {cfg.model} ({self.n_params / 1e6:.2f}M params), recipe "
            f"{self.recipe.name}, {self.mode.where(self.device)}, {cfg.steps} steps of "
            f"{self.tokens_per_step} tokens"
            + (f", resuming at step {self.start}" if self.start else "")
        )
        if self.start == 0:
            self.probe_numerics(0)
        self.memory.restart()
        self.reached = self.start
        self.time = _TrainingTime()

    def train_step(self, step: int) -> tuple[float, torch.Tensor]:
        """One optimizer step (0-based `step`): the precision schedule, the learning rate, this
        rank's micro-batches forward and backward, the gradients made whole and clipped (the
        mode's hook), AdamW. Returns (the learning rate, the gradient norm before clipping)."""
        cfg = self.cfg
        if self.recipe.quantized and self.quantized_now != self.schedule.quantized(step):
            self.quantized_now = self.schedule.apply(self.model, step)
        lr = build.lr_at(cfg, step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.step_now, self.micro_done = step, 0
        for micro in self.ranks.micro_batches(cfg.grad_accum):
            self.forward_backward(*self.batches.get(step, micro))
            self.micro_done += 1
            self.first_step.tick()
        clip = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
        grad_norm = self.mode.sync_and_clip_grads(self.model, clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.sums.steps += 1
        self.time.steps += 1
        return lr, grad_norm

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """One micro-batch: the loss (cross entropy, plus an MoE model's load-balancing loss)
        scaled to its share of the step, its backward, and the sums the next row reports."""
        cfg, sums = self.cfg, self.sums
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        with self.autocast():
            logits = self.step_model(x)
        ce = F.cross_entropy(logits.float().flatten(0, 1), y.flatten()) / cfg.grad_accum
        loss = ce
        if sums.routed:
            aux = self.model.aux_loss / cfg.grad_accum
            loss = ce + cfg.aux_loss_coef * aux
            sums.add_routing(aux)
        # FSDP averages the ranks' gradients: a rank's loss counts world_size times, so the
        # step's gradient is the mean over all the micro-batches (not under --tp, where every
        # rank runs them all).
        share = self.ranks.data_ranks
        (loss * share if share > 1 else loss).backward()
        sums.loss += ce.detach()

    def log_train(self, step: int, lr: float, grad_norm: torch.Tensor) -> float:
        """Write the training row of `step` (means over all ranks' micro-batches since the last
        row; synchronizes the device) and start the next row's sums; returns its loss."""
        sums = self.sums
        mean_loss = (self.ranks.sum(sums.loss) / sums.steps).item()
        tokens_per_s = self.time.tokens_per_s(self.tokens_per_step)
        row = {
            "kind": "train",
            "step": step,
            "loss": mean_loss,
            "lr": lr,
            "grad_norm": full(grad_norm).item(),
            "tokens": step * self.tokens_per_step,
            "tokens_per_s": tokens_per_s,
            "time": round(time.time(), 3),
        }
        if self.memory.enabled:
            row["peak_gib"] = self.memory.training()
        if sums.routed:
            row["aux_loss"] = (self.ranks.sum(sums.aux) / sums.steps).item()
            counted = self.mode.expert_tokens_total(sums.expert_tokens)
            row["expert_tokens"] = dict(zip(sums.routed, counted.tolist()))
        self.metrics.write(row)
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{mean_loss:.4f}", tok_s=f"{tokens_per_s:,.0f}")
        sums.reset()
        return mean_loss

    def evaluate_held_out(self, step: int) -> None:
        """The eval row of `step`: loss and bits per byte on the held-out split."""
        self.memory.restart()
        result = evaluate(
            self.model,
            self.val_data,
            self.seq_len,
            self.cfg.batch_size,
            self.device,
            self.cfg.eval_tokens,
        )
        if self.memory.enabled:
            result["peak_gib"] = self.memory.since_restart()
        self.metrics.write({"kind": "eval", "step": step, **result})
        self.say(
            f"step {step}: val loss {result['val_loss']:.4f}, {result['val_bpb']:.3f} bits/byte"
        )

    def probe_numerics(self, step: int) -> None:
        """The telemetry row of `step` (quantized recipes; telemetry.py): an eager probe off the
        training path, on the step's first micro-batch."""
        if not (self.cfg.telemetry_every and self.recipe.quantized):
            return
        x, y = self.batches.get(step, 0)
        self.memory.restart()
        found = telemetry.probe(
            self.model, x.to(self.device), y.to(self.device), self.autocast, self.cfg.aux_loss_coef
        )
        row = {"kind": "telemetry", "step": step, **found}
        if self.memory.enabled:  # the probe runs eagerly, off the training path
            row["peak_gib"] = self.memory.since_restart()
        self.metrics.write(row)

    def stop_notice(self, signal_name: str) -> str:
        """The line that acknowledges a first SIGINT/SIGTERM: where the run is, what it does
        next, and how long the step has to go where the first step was timed."""
        step, micro_batches = self.step_now + 1, self.first_step.micro_batches
        where = f"step {step} of {self.cfg.steps}"
        if 0 < self.micro_done < micro_batches:
            left = self.first_step.left(self.micro_done)
            to_go = f"; about {step_time.duration(left)} to go" if left is not None else ""
            where += f" (micro-batch {self.micro_done:,} of {micro_batches:,} done{to_go})"
        below_bar = "\n" if self.bar is not None else ""
        return (
            f"{below_bar}{signal_name} received: the run stops after {where}, writes a "
            "checkpoint and exits; a second SIGINT or SIGTERM stops it at once, without that "
            "checkpoint (--resume then goes on from the one before)"
        )

    @contextlib.contextmanager
    def checkpointed_on_failure(self, step: int) -> Iterator[None]:
        """Within: what runs after step `step` (evaluation, the probe). Where it fails with an
        error, the checkpoint of `step` is written before the error goes on, so no trained
        step is lost to it: a final evaluation that failed ended a run with every step trained
        and none checkpointed (issue 60). One process only: a sharded checkpoint is collective,
        and a rank that failed alone would leave the others waiting in it."""
        try:
            yield
        except Exception as e:
            if self.ranks.sharded:
                raise
            self.save_checkpoint(step)
            if isinstance(e, UsageError):
                raise UsageError(
                    f"{e} (after step {step}, which is checkpointed: fix that and rerun with "
                    "--resume)"
                ) from None
            raise

    def out_of_time(self, started: float) -> bool:
        minutes = (time.perf_counter() - started) / 60
        return self.cfg.max_minutes > 0 and minutes > self.cfg.max_minutes

    def save_checkpoint(self, step: int) -> None:
        self.metrics.sync()  # the rows up to `step` are on disk before its checkpoint
        carried = self.sums.carried()
        self.mode.save_checkpoint(
            self.run_dir, step, self.model, self.optimizer, carried, self.cfg, self.device
        )

    def out_of_memory(self, step: int) -> UsageError:
        cfg = self.cfg
        return UsageError(
            f"out of memory on {self.device} at step {step}: batch_size={cfg.batch_size} x "
            f"seq_len={self.seq_len} of model {cfg.model!r} does not fit; lower --batch-size "
            "(raise --grad-accum to keep the batch)"
        )

    def say(self, message: str) -> None:
        if self.ranks.main:
            _say(message, self.bar)

    def finish(self, status: str) -> dict:
        """Rank 0 writes summary.json and returns the summary; other ranks {"status": ...}."""
        if not self.ranks.main:
            return {"status": status}
        summary = summarize(
            self.run_dir,
            self.cfg,
            self.recipe,
            status,
            self.n_params,
            self.device,
            self.reached,
            self.tokens_per_step,
        )
        if self.ranks.sharded:
            summary["ranks"] = self.ranks.world_size
        with files.reported(self.run_dir):
            files.write_atomic(self.run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
        return summary


def _due(every: int, step: int, last: bool) -> bool:
    """Whether what runs every `every` steps (0: off) runs after `step` (and after the last)."""
    return bool(every) and (step % every == 0 or last)


class _Sums:
    """What the next metrics row reports, summed on the device over the steps since the last
    row: the cross entropy and, for an MoE model, the load-balancing loss and each routed
    layer's token-expert assignments per expert (reading the router's counts costs no
    synchronization until a row is written). A checkpoint carries them over (`carried`), so a
    resumed run writes the same mean in its next row as an uninterrupted one."""

    def __init__(self, model: torch.nn.Module, carried: dict, device: torch.device):
        self.routed = moe_layers(model)
        self.loss = torch.tensor(carried["loss_sum"], device=device)
        self.steps = carried["loss_steps"]
        self.aux = torch.tensor(carried.get("aux_sum", 0.0), device=device)
        n_experts = getattr(model.config, "n_experts", 0)
        self.expert_tokens = torch.tensor(
            carried.get("expert_tokens", [[0] * n_experts] * len(self.routed)),
            dtype=torch.int64,
            device=device,
        )

    def add_routing(self, aux: torch.Tensor) -> None:
        """Add a micro-batch's load-balancing loss and its routers' counts."""
        self.aux += aux.detach()
        self.expert_tokens += torch.stack([m.tokens_per_expert for m in self.routed.values()])

    def carried(self) -> dict:
        """What a checkpoint carries over to the next metrics row."""
        sums = {"loss_sum": self.loss.item(), "loss_steps": self.steps}
        if self.routed:
            sums.update(aux_sum=self.aux.item(), expert_tokens=self.expert_tokens.tolist())
        return sums

    def reset(self) -> None:
        self.loss.zero_()
        self.aux.zero_()
        self.expert_tokens.zero_()
        self.steps = 0


class _TrainingTime:
    """Training's own time since the last metrics row: the wall clock less what evaluation,
    telemetry and checkpoints took (`pause` before them, `resume` after)."""

    def __init__(self) -> None:
        self._restart(time.perf_counter())

    def _restart(self, now: float) -> None:
        self.since, self.excluded, self.steps, self._paused_at = now, 0.0, 0, now

    def pause(self) -> None:
        self._paused_at = time.perf_counter()

    def resume(self) -> None:
        self.excluded += time.perf_counter() - self._paused_at

    def tokens_per_s(self, tokens_per_step: int) -> float:
        """The training speed since the last row; starts the next row's count."""
        now = time.perf_counter()
        rate = self.steps * tokens_per_step / max(now - self.since - self.excluded, 1e-9)
        self._restart(now)
        return rate


def exclusive_modes(fsdp: bool, ep: bool, tp: bool) -> str:
    """The one line that refuses two of --fsdp, --ep and --tp together."""
    given = [flag for flag, on in (("--ep", ep), ("--tp", tp), ("--fsdp", fsdp)) if on]
    return (
        f"{' with '.join(given)}: one of --fsdp, --ep and --tp at a time (they do not run "
        "together yet); pass one"
    )


class _PeakMemory:
    """The peak memory of the training steps alone: evaluation, the eager telemetry probe and
    checkpointing run between restarts and are not counted in it. No-op off CUDA."""

    def __init__(self, device: torch.device):
        self.device, self.enabled, self.peak = device, device.type == "cuda", 0.0

    def since_restart(self) -> float:
        return torch.cuda.max_memory_allocated(self.device) / 2**30

    def restart(self) -> None:
        if self.enabled:
            torch.cuda.reset_peak_memory_stats(self.device)

    def training(self) -> float | None:
        """Training's peak so far in this process, in GiB (call it before anything else runs)."""
        if self.enabled:
            self.peak = max(self.peak, self.since_restart())
        return self.peak if self.enabled else None


def device_id(device: torch.device) -> str:
    """This host and this device (a GPU's UUID): runs with the same id and overlapping times
    shared the device."""
    which = str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else "cpu"
    return f"{socket.gethostname()}/{which}"


def summarize(
    run_dir: Path,
    cfg: TrainConfig,
    recipe,
    status: str,
    n_params: int,
    device,
    steps: int,
    tokens_per_step: int,
) -> dict:
    """The run's summary. `steps`: the optimizer steps completed (the newest checkpoint's step
    when the run stopped cleanly), which can be past the last training row's."""
    rows = read_metrics(run_dir)
    train_rows = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    # The first interval holds warm-up (and compilation): the median of the rest is the speed.
    rates = [r["tokens_per_s"] for r in train_rows[1:]] or [r["tokens_per_s"] for r in train_rows]
    # Training's peak over every segment of a resumed run, without evaluation and probes.
    peaks = [r["peak_gib"] for r in train_rows if r.get("peak_gib") is not None]
    peak = max(peaks) if peaks else None
    return {
        "status": status,
        "recipe": recipe.name,
        "recipe_detail": recipe.describe(),
        "model": cfg.model,
        "params": n_params,
        "device": str(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"),
        "device_id": device_id(device),
        "torch": torch.__version__,
        "steps": steps,
        "tokens": steps * tokens_per_step,
        "final_loss": train_rows[-1]["loss"] if train_rows else None,
        "val_loss": evals[-1]["val_loss"] if evals else None,
        "val_bpb": evals[-1]["val_bpb"] if evals else None,
        "tokens_per_s": statistics.median(rates) if rates else None,
        "peak_memory_gib": peak,
    }
