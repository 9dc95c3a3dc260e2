"""How a run spreads over processes: one small class per mode, with the hooks the training loop
calls, so that the loop (train/loop.py) reads the same for every mode.

- `OneProcess`: the whole run in this process; plain checkpoints.
- `FSDP` (`--fsdp`): FSDP2-sharded model, each rank its share of the step's micro-batches.
- `TensorParallel` (`--tp`): the blocks' linears split over the ranks, which all run every
  micro-batch.
- `ExpertParallel` (`--ep`): an MoE model's experts split over the ranks, the rest replicated,
  each rank its share of the micro-batches.

The hooks, in the order a run calls them: `check(cfg)` refuses what the mode cannot run, before
anything is built; `join(cfg)` joins the process group (torchrun modes) and returns the device;
`parallelize` splits the converted model (before the optimizer); `load_checkpoint` /
`save_checkpoint`; per step, `sync_and_clip_grads`; per metrics row, `expert_tokens_total`;
`count_params` and `where` for the run's header line. The process-group facts and collectives
(rank, world size, sums over the ranks) are `self.ranks` (train/ranks.py); the torchrun modes'
mechanics (join, shard, split, clip) live there too.
"""

from __future__ import annotations

from pathlib import Path

import torch

from blockscale.train import build, checkpoint
from blockscale.train.config import TrainConfig, identity
from blockscale.train.errors import UsageError
from blockscale.train.ranks import (
    Ranks,
    average_replicated_grads,
    check_batch,
    clip_expert_parallel,
    clip_tensor_parallel,
    expert_parallel,
    join,
    local_experts,
    seed_stream,
    shard,
    tensor_parallel,
)


class OneProcess:
    """One process, no process group: the hooks as a single device runs them. The torchrun
    modes below override the ones they change."""

    flag = ""  # the command-line flag that picks the mode
    label = ""  # how the run's header names the mode
    expert_parallel = False
    tensor_parallel = False

    def __init__(self) -> None:
        self.ranks = Ranks()

    def check(self, cfg: TrainConfig) -> None:
        """Refuse a config this mode cannot run (one line), before anything is built."""

    def join(self, cfg: TrainConfig) -> torch.device:
        """Set up this process's rank; returns the device it trains on."""
        return build.resolve_device(cfg.device)

    def parallelize(self, model: torch.nn.Module, recipe, cfg: TrainConfig, device) -> None:
        """Split the converted model over the ranks (after convert, before the optimizer)."""

    def sync_and_clip_grads(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
        """Make the step's gradients whole (what the backward left rank-local) and clip them
        to `max_norm` (math.inf: no clipping); returns the global gradient norm."""
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    def expert_tokens_total(self, counts: torch.Tensor) -> torch.Tensor:
        """The token-expert assignments of the whole step from this rank's counts."""
        return self.ranks.sum(counts)

    def count_params(self, model: torch.nn.Module) -> int:
        """The whole model's parameter count, as one device holds it."""
        return sum(p.numel() for p in model.parameters())

    def where(self, device: torch.device) -> str:
        """Where the run trains, for its header line."""
        return str(device)

    def load_checkpoint(
        self, path: Path, model, optimizer, cfg: TrainConfig, device: torch.device
    ) -> tuple[int, dict]:
        """Restore the model, the optimizer and the random stream from checkpoint `path`;
        returns (its step, this rank's loop state: the sums since the last metrics row)."""
        if checkpoint.is_sharded(path):
            raise UsageError(
                f"checkpoint {path} was written by a --fsdp run; resume it with torchrun "
                "--nproc-per-node N -m blockscale train --fsdp --resume"
            )
        return checkpoint.load(path, model, optimizer, run=identity(cfg))

    def save_checkpoint(
        self, run_dir: Path, step: int, model, optimizer, sums: dict, cfg: TrainConfig, device
    ) -> None:
        """Write the checkpoint of `step` (every rank calls it: collective where sharded)."""
        state = (run_dir, step, model, optimizer, sums, cfg.keep_checkpoints)
        checkpoint.save(*state, run=identity(cfg))


class _Torchrun(OneProcess):
    """What the torchrun modes share: one process per rank, launched by torchrun, each joining
    the default process group; sharded checkpoints; no telemetry yet."""

    def check(self, cfg: TrainConfig) -> None:
        if cfg.telemetry_every:
            raise UsageError(
                f"telemetry_every={cfg.telemetry_every}: the numerics probe does not run under "
                f"{self.flag} yet (docs/DISTRIBUTED.md); pass --telemetry-every 0"
            )

    def join(self, cfg: TrainConfig) -> torch.device:
        joined, device = join(cfg.device, self.flag)
        self.ranks = Ranks(
            joined.rank,
            joined.world_size,
            sharded=True,
            expert_parallel=self.expert_parallel,
            tensor_parallel=self.tensor_parallel,
        )
        if not self.tensor_parallel:  # under --tp every rank runs every micro-batch
            check_batch(cfg.grad_accum, self.ranks)
        return device

    def where(self, device: torch.device) -> str:
        return f"{self.ranks.world_size} rank(s) ({device.type}, {self.label})"

    def load_checkpoint(
        self, path: Path, model, optimizer, cfg: TrainConfig, device: torch.device
    ) -> tuple[int, dict]:
        if not checkpoint.is_sharded(path):
            raise UsageError(
                f"checkpoint {path} was written by one process, and a one-process "
                "checkpoint does not load into a sharded model yet; resume it without --fsdp"
            )
        step, written = checkpoint.load_sharded(
            path, model, optimizer, identity(cfg), self.ranks, device, cfg.seed
        )
        return step, carried_over(written, self.ranks)

    def save_checkpoint(
        self, run_dir: Path, step: int, model, optimizer, sums: dict, cfg: TrainConfig, device
    ) -> None:
        state = (run_dir, step, model, optimizer, sums, cfg.keep_checkpoints)
        checkpoint.save_sharded(*state, identity(cfg), self.ranks, device)


class FSDP(_Torchrun):
    """`--fsdp`: FSDP2 on every block and the root, quantized all-gather (train/ranks.py)."""

    flag, label = "--fsdp", "FSDP2"

    def parallelize(self, model: torch.nn.Module, recipe, cfg: TrainConfig, device) -> None:
        # The precision schedule switches layers to BF16, which a quantized all-gather cannot
        # follow (its layout is fixed at the first gather): such runs gather FP32 weights. One
        # rank gathers nothing, so it keeps plain weights too (the same numbers: each layer
        # quantizes its whole FP32 weight itself, which is what a one-rank gather would hand it).
        quantized_gather = recipe.quantized and cfg.bf16_final_fraction == 0
        shard(model, quantized_gather and self.ranks.world_size > 1, device)
        if not self.ranks.main:  # rank 0 continues the stream of initialization, as one process
            seed_stream(cfg.seed, self.ranks.rank, 0)


class TensorParallel(_Torchrun):
    """`--tp`: every block's linears split over the ranks, which share each micro-batch."""

    flag, label, tensor_parallel = "--tp", "TP", True

    def check(self, cfg: TrainConfig) -> None:
        if cfg.compile:
            raise UsageError(
                "--compile with --tp: a compiled tensor-parallel run is not tried yet "
                "(docs/DISTRIBUTED.md); leave out --compile"
            )
        super().check(cfg)

    def parallelize(self, model: torch.nn.Module, recipe, cfg: TrainConfig, device) -> None:
        # Every rank continues the stream of initialization: replicated tensors (a row-wise
        # layer's grad_output) then draw the same stochastic rounding on every rank, and the
        # split ones as many values each.
        tensor_parallel(model, self.ranks, device)

    def sync_and_clip_grads(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
        return clip_tensor_parallel(model, max_norm, self.ranks)


class ExpertParallel(_Torchrun):
    """`--ep`: each rank keeps E/W of every MoE layer's experts and the rest whole."""

    flag, label, expert_parallel = "--ep", "EP", True

    def check(self, cfg: TrainConfig) -> None:
        if not isinstance(build.build_model_config(cfg), build.MoEConfig):
            raise UsageError(
                f"--ep splits an MoE model's experts over the ranks; model {cfg.model!r} has "
                "none (use --model moe-tiny or moe-small, or --fsdp for a dense model)"
            )
        super().check(cfg)

    def parallelize(self, model: torch.nn.Module, recipe, cfg: TrainConfig, device) -> None:
        expert_parallel(model, self.ranks)
        if not self.ranks.main:  # rank 0 continues the stream of initialization, as one process
            seed_stream(cfg.seed, self.ranks.rank, 0)

    def sync_and_clip_grads(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
        # The experts' owners hold their averaged gradients; the rest: averaged here.
        average_replicated_grads(model, self.ranks)
        return clip_expert_parallel(model, max_norm, self.ranks)

    def expert_tokens_total(self, counts: torch.Tensor) -> torch.Tensor:
        return counts  # every rank counted the group's batch: not summed again

    def count_params(self, model: torch.nn.Module) -> int:
        # The whole model's: the other ranks' experts counted too.
        mine = sum(p.numel() for p in local_experts(model).values())
        return super().count_params(model) + (self.ranks.world_size - 1) * mine


def parallelism(fsdp: bool = False, ep: bool = False, tp: bool = False) -> OneProcess:
    """The mode the flags pick (at most one of them: train() refuses two)."""
    if ep:
        return ExpertParallel()
    if tp:
        return TensorParallel()
    return FSDP() if fsdp else OneProcess()


def carried_over(written: list[dict], ranks: Ranks) -> dict:
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
