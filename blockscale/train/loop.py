"""The training loop: one function, `train(cfg, run_dir)`, that a resumed run re-enters.

A run directory holds `config.json`, `metrics.jsonl` (one JSON object a line), `checkpoints/`
and, once the loop stops, `summary.json`. Metric rows carry a `kind`:

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
uninterrupted one's. SIGINT/SIGTERM (Ctrl-C) finish the current step, checkpoint and stop; a
second Ctrl-C stops at once. `max_minutes` stops the same way, for machines that lend time in
slices: rerun with `--resume` to continue.

`train(..., fsdp=True)` is one rank of a torchrun launch (train/ranks.py): the same loop over
an FSDP2-sharded model, each rank running its share of every step's micro-batches; losses are
summed over the ranks before a row is written, every rank evaluates (the sharded forward needs
them all), rank 0 alone writes rows and files, and checkpoints are sharded (checkpoint.py).
Stopping (a signal, `max_minutes`) is agreed by all ranks at every step. `tp=True` instead: the
model's blocks split over the ranks (tensor parallel), which all run every micro-batch.
"""

from __future__ import annotations

import json
import math
import signal
import socket
import statistics
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import blockscale.nn as bsnn
from blockscale.models import moe_layers
from blockscale.ops import EXACT_INDUCTOR_OPTIONS
from blockscale.train import build, checkpoint, files, step_time, telemetry
from blockscale.train.config import RESUMABLE, TrainConfig, differences, identity
from blockscale.train.data import Batches, load_corpus
from blockscale.train.errors import UsageError
from blockscale.train.evaluate import evaluate
from blockscale.train.ranks import (
    Ranks,
    average_replicated_grads,
    check_batch,
    clip_expert_parallel,
    clip_tensor_parallel,
    expert_parallel,
    full,
    join,
    local_experts,
    seed_stream,
    shard,
    tensor_parallel,
)

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
    """First SIGINT/SIGTERM: finish the step, checkpoint, stop. Second SIGINT: stop now."""

    def __init__(self) -> None:
        self.requested = False
        self._old: dict = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


def _say(message: str, bar) -> None:
    (bar.write if bar is not None else print)(message)


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


def _carried_over(written: list[dict], ranks: Ranks) -> dict:
    """This rank's part of the loop state (sums since the last metrics row) of a sharded
    checkpoint written by `len(written)` ranks: its own on as many ranks; on another number,
    rank 0 takes the sums of all and the others start from zero (the row's mean is the same
    up to the order of additions). Under --tp every rank's sums are the same: rank 0's."""
    if ranks.tensor_parallel:
        return written[0]
    if len(written) == ranks.world_size:
        return written[ranks.rank]
    mine = written if ranks.main else []
    out = {"loss_sum": sum((m["loss_sum"] for m in mine), 0.0)}  # 0.0: a float tensor
    out["loss_steps"] = written[0]["loss_steps"]
    if "aux_sum" in written[0]:
        out["aux_sum"] = sum((m["aux_sum"] for m in mine), 0.0)
        tokens = torch.tensor([m["expert_tokens"] for m in written], dtype=torch.int64)
        # Under --ep every rank's counts are already the group's: rank 0 takes one rank's.
        total = tokens[0] if ranks.expert_parallel else tokens.sum(0)
        out["expert_tokens"] = (total if mine else tokens[0] * 0).tolist()
    return out


@files.one_writer  # one process writes a run folder: the others are refused (files.py)
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
    metrics = Metrics(run_dir / "metrics.jsonl")
    if resume:
        check_resumable(cfg, run_dir)
    elif run_dir.exists() and not run_dir.is_dir():
        raise UsageError(f"{run_dir} is a file, not a run directory; choose another --out")
    elif metrics.path.exists() or checkpoint.checkpoint_dirs(run_dir):
        raise UsageError(
            f"{run_dir} already holds a run; pass --resume to continue it, or choose another --out"
        )
    if fsdp or ep or tp:
        flag = "--ep" if ep else "--tp" if tp else "--fsdp"
        if fsdp + ep + tp > 1:
            raise UsageError(exclusive_modes(fsdp, ep, tp))
        if tp and cfg.compile:
            raise UsageError(
                "--compile with --tp: a compiled tensor-parallel run is not tried yet "
                "(docs/DISTRIBUTED.md); leave out --compile"
            )
        if ep and not isinstance(build.build_model_config(cfg), build.MoEConfig):
            raise UsageError(
                f"--ep splits an MoE model's experts over the ranks; model {cfg.model!r} has "
                "none (use --model moe-tiny or moe-small, or --fsdp for a dense model)"
            )
        if cfg.telemetry_every:
            raise UsageError(
                f"telemetry_every={cfg.telemetry_every}: the numerics probe does not run under "
                f"{flag} yet (docs/DISTRIBUTED.md); pass --telemetry-every 0"
            )
        ranks, device = join(cfg.device, flag)
        ranks = Ranks(
            ranks.rank, ranks.world_size, sharded=True, expert_parallel=ep, tensor_parallel=tp
        )
        if not tp:  # under --tp every rank runs every micro-batch
            check_batch(cfg.grad_accum, ranks)
    else:
        ranks, device = Ranks(), build.resolve_device(cfg.device)
    metrics.enabled = ranks.main
    corpus = load_corpus(cfg.data, cfg.max_data_bytes, binary_ok=cfg.binary_data)
    model, recipe = build.build_model(cfg, device)
    if ranks.tensor_parallel:
        # After convert, before the optimizer. Every rank continues the stream of
        # initialization: replicated tensors (a row-wise layer's grad_output) then draw the
        # same stochastic rounding on every rank, and the split ones as many values each.
        tensor_parallel(model, ranks, device)
    elif ranks.expert_parallel:
        expert_parallel(model, ranks)  # after convert (in build_model), before the optimizer
        if not ranks.main:  # rank 0 continues the stream of initialization, as one process
            seed_stream(cfg.seed, ranks.rank, 0)
    elif ranks.sharded:
        # The precision schedule switches layers to BF16, which a quantized all-gather cannot
        # follow (its layout is fixed at the first gather): such runs gather FP32 weights. One
        # rank gathers nothing, so it keeps plain weights too (the same numbers: each layer
        # quantizes its whole FP32 weight itself, which is what a one-rank gather would hand it).
        quantized_gather = recipe.quantized and cfg.bf16_final_fraction == 0
        shard(model, quantized_gather and ranks.world_size > 1, device)
        if not ranks.main:  # rank 0 continues the stream of initialization, as one process
            seed_stream(cfg.seed, ranks.rank, 0)
    seq_len = model.config.seq_len
    batches = Batches(corpus.train, seq_len, cfg.batch_size, cfg.seed)
    optimizer = build.build_optimizer(model, cfg, device)

    start, partial = 0, {"loss_sum": 0.0, "loss_steps": 0}
    ckpts = checkpoint.checkpoint_dirs(run_dir)
    if resume and ckpts:
        latest = ckpts[-1]
        if checkpoint.is_sharded(latest) != ranks.sharded:
            raise UsageError(
                f"checkpoint {latest} was written by a --fsdp run; resume it with torchrun "
                "--nproc-per-node N -m blockscale train --fsdp --resume"
                if not ranks.sharded
                else f"checkpoint {latest} was written by one process, and a one-process "
                "checkpoint does not load into a sharded model yet; resume it without --fsdp"
            )
        if ranks.sharded:
            start, written = checkpoint.load_sharded(
                latest, model, optimizer, identity(cfg), ranks, device, cfg.seed
            )
            partial = _carried_over(written, ranks)
        else:
            start, partial = checkpoint.load(latest, model, optimizer, run=identity(cfg))

    def prepare() -> None:
        with files.reported(run_dir):
            run_dir.mkdir(parents=True, exist_ok=True)
            # First, since it can still refuse (a damaged row before the last): a fresh start
            # keeps no rows, a resumed run those up to its checkpoint.
            metrics.truncate_after(start if start else -1)
            cfg.save(run_dir / "config.json")
            (run_dir / "summary.json").unlink(missing_ok=True)

    ranks.barrier()  # every rank has checked the run directory before rank 0 writes into it
    ranks.on_main(prepare, device)

    # Inductor's default fast math (approximate division, dropped BF16 round trips, FMA) would
    # move quantization codes; these options keep eager's numerics, for every recipe alike.
    step_model = torch.compile(model, options=EXACT_INDUCTOR_OPTIONS) if cfg.compile else model
    autocast = build.autocast_for(device)
    schedule = bsnn.PrecisionSchedule(cfg.steps, cfg.bf16_final_fraction)
    quantized_now = None
    tokens_per_step = cfg.batch_size * cfg.grad_accum * seq_len
    memory = _PeakMemory(device)

    def run_telemetry(step: int) -> None:
        if cfg.telemetry_every and recipe.quantized:
            x, y = batches.get(step, 0)
            memory.restart()
            found = telemetry.probe(model, x.to(device), y.to(device), autocast, cfg.aux_loss_coef)
            row = {"kind": "telemetry", "step": step, **found}
            if memory.enabled:  # the probe runs eagerly, off the training path
                row["peak_gib"] = memory.since_restart()
            metrics.write(row)

    n_params = sum(p.numel() for p in model.parameters())
    if ranks.expert_parallel:  # the whole model's: the other ranks' experts counted too
        n_params += (ranks.world_size - 1) * sum(p.numel() for p in local_experts(model).values())
    if ranks.main:  # a step over a minute is said before the bar (step_time.py)
        step_time.say_if_slow(model, seq_len, tokens_per_step // ranks.data_ranks, device)
    bar = None
    if progress and ranks.main and tqdm is not None:
        bar = tqdm(
            total=cfg.steps, initial=start, unit="step", dynamic_ncols=True, desc=recipe.name
        )

    def say(message: str) -> None:
        if ranks.main:
            _say(message, bar)

    where = (
        f"{ranks.world_size} rank(s) ({device.type}, {_mode(ranks)})"
        if ranks.sharded
        else str(device)
    )
    say(
        f"{run_dir}: model {cfg.model} ({n_params / 1e6:.2f}M params), recipe {recipe.name}, "
        f"{where}, {cfg.steps} steps of {tokens_per_step} tokens"
        + (f", resuming at step {start}" if start else "")
    )
    if start == 0:
        run_telemetry(0)
    memory.restart()

    status, step, started = "done", start, time.perf_counter()
    reached = start  # optimizer steps completed: the summary's step, whatever the row cadence
    # The loss of the steps since the last row; a checkpoint carries it over, so a resumed run
    # writes the same mean loss in its next row as an uninterrupted one.
    loss_sum = torch.tensor(partial["loss_sum"], device=device)
    loss_steps, timed_steps = partial["loss_steps"], 0
    # An MoE model's load-balancing loss and tokens per expert, summed like the loss.
    routed = moe_layers(model)
    aux_sum = torch.tensor(partial.get("aux_sum", 0.0), device=device)
    n_experts = getattr(model.config, "n_experts", 0)
    expert_tokens = torch.tensor(
        partial.get("expert_tokens", [[0] * n_experts] * len(routed)),
        dtype=torch.int64,
        device=device,
    )

    def carried() -> dict:
        """What a checkpoint carries over to the next metrics row."""
        sums = {"loss_sum": loss_sum.item(), "loss_steps": loss_steps}
        if routed:
            sums.update(aux_sum=aux_sum.item(), expert_tokens=expert_tokens.tolist())
        return sums

    clock, excluded = time.perf_counter(), 0.0
    try:
        with _StopRequest() as stop:
            for step in range(start, cfg.steps):
                if recipe.quantized and quantized_now != schedule.quantized(step):
                    quantized_now = schedule.apply(model, step)
                lr = build.lr_at(cfg, step)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                for micro in ranks.micro_batches(cfg.grad_accum):
                    x, y = batches.get(step, micro)
                    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                    with autocast():
                        logits = step_model(x)
                    ce = F.cross_entropy(logits.float().flatten(0, 1), y.flatten()) / cfg.grad_accum
                    loss = ce
                    if routed:
                        aux = model.aux_loss / cfg.grad_accum
                        loss = ce + cfg.aux_loss_coef * aux
                        aux_sum += aux.detach()
                        expert_tokens += torch.stack([m.tokens_per_expert for m in routed.values()])
                    # FSDP averages the ranks' gradients: a rank's loss counts world_size
                    # times, so the step's gradient is the mean over all the micro-batches
                    # (not under --tp, where every rank runs them all).
                    share = ranks.data_ranks
                    (loss * share if share > 1 else loss).backward()
                    loss_sum += ce.detach()
                clip = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
                if ranks.expert_parallel:
                    # The experts' owners hold their averaged gradients; the rest: averaged here.
                    average_replicated_grads(model, ranks)
                    grad_norm = clip_expert_parallel(model, clip, ranks)
                elif ranks.tensor_parallel:
                    grad_norm = clip_tensor_parallel(model, clip, ranks)
                else:
                    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                loss_steps += 1
                timed_steps += 1
                done = reached = step + 1
                last = done == cfg.steps
                if bar is not None:
                    bar.update(1)

                if done % cfg.log_every == 0 or last:
                    # The mean over all ranks' micro-batches; synchronizes the device.
                    mean_loss = (ranks.sum(loss_sum) / loss_steps).item()
                    now = time.perf_counter()
                    seconds = max(now - clock - excluded, 1e-9)
                    row = {
                        "kind": "train",
                        "step": done,
                        "loss": mean_loss,
                        "lr": lr,
                        "grad_norm": full(grad_norm).item(),
                        "tokens": done * tokens_per_step,
                        "tokens_per_s": timed_steps * tokens_per_step / seconds,
                        "time": round(time.time(), 3),
                    }
                    if memory.enabled:
                        row["peak_gib"] = memory.training()
                    if routed:
                        row["aux_loss"] = (ranks.sum(aux_sum) / loss_steps).item()
                        # Under --ep every rank counted the group's batch: not summed again.
                        counted = (
                            expert_tokens if ranks.expert_parallel else ranks.sum(expert_tokens)
                        )
                        row["expert_tokens"] = dict(zip(routed, counted.tolist()))
                        aux_sum.zero_()
                        expert_tokens.zero_()
                    metrics.write(row)
                    if bar is not None:
                        bar.set_postfix(
                            loss=f"{mean_loss:.4f}", tok_s=f"{row['tokens_per_s']:,.0f}"
                        )
                    loss_sum.zero_()
                    loss_steps, timed_steps, clock, excluded = 0, 0, now, 0.0
                    if not math.isfinite(mean_loss):
                        status = "diverged"
                        say(f"step {done}: loss is {mean_loss}; stopping (the run diverged)")
                        break
                t0 = time.perf_counter()
                memory.training()  # what the steps so far used, before evaluation and probes
                if cfg.eval_every and (done % cfg.eval_every == 0 or last):
                    memory.restart()
                    result = evaluate(
                        model, corpus.val, seq_len, cfg.batch_size, device, cfg.eval_tokens
                    )
                    if memory.enabled:
                        result["peak_gib"] = memory.since_restart()
                    metrics.write({"kind": "eval", "step": done, **result})
                    say(
                        f"step {done}: val loss {result['val_loss']:.4f}, {result['val_bpb']:.3f} bits/byte"
                    )
                if cfg.telemetry_every and (done % cfg.telemetry_every == 0 or last):
                    run_telemetry(done)
                out_of_time = (
                    cfg.max_minutes > 0 and (time.perf_counter() - started) / 60 > cfg.max_minutes
                )
                # Every rank stops at the same step (each checkpoints with the others).
                stopping, out_of_time = ranks.any(stop.requested, out_of_time, device=device)
                if (
                    last
                    or stopping
                    or out_of_time
                    or (cfg.ckpt_every and done % cfg.ckpt_every == 0)
                ):
                    metrics.sync()  # the rows up to `done` are on disk before its checkpoint
                    state = (run_dir, done, model, optimizer, carried(), cfg.keep_checkpoints)
                    if ranks.sharded:
                        checkpoint.save_sharded(*state, identity(cfg), ranks, device)
                    else:
                        checkpoint.save(*state, run=identity(cfg))
                memory.restart()  # the next steps' peak starts here
                excluded += time.perf_counter() - t0
                if (stopping or out_of_time) and not last:
                    status = "interrupted" if stopping else "paused"
                    say(f"stopped at step {done} ({status}); rerun to continue (train: --resume)")
                    break
    except OSError as e:  # a metrics row or a checkpoint could not be written
        raise files.write_failure(run_dir, e) from None
    except torch.OutOfMemoryError:
        raise UsageError(
            f"out of memory on {device} at step {step}: batch_size={cfg.batch_size} x seq_len={seq_len} of model "
            f"{cfg.model!r} does not fit; lower --batch-size (raise --grad-accum to keep the batch)"
        ) from None
    finally:
        if bar is not None:
            bar.close()
    if not ranks.main:
        return {"status": status}
    summary = summarize(run_dir, cfg, recipe, status, n_params, device, reached, tokens_per_step)
    if ranks.sharded:
        summary["ranks"] = ranks.world_size
    with files.reported(run_dir):
        files.write_atomic(run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    return summary


def exclusive_modes(fsdp: bool, ep: bool, tp: bool) -> str:
    """The one line that refuses two of --fsdp, --ep and --tp together."""
    given = [flag for flag, on in (("--ep", ep), ("--tp", tp), ("--fsdp", fsdp)) if on]
    return (
        f"{' with '.join(given)}: one of --fsdp, --ep and --tp at a time (they do not run "
        "together yet); pass one"
    )


def _mode(ranks: Ranks) -> str:
    return "EP" if ranks.expert_parallel else "TP" if ranks.tensor_parallel else "FSDP2"


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
