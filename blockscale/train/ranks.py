"""The ranks of a `--fsdp` run: `torchrun --nproc-per-node N -m blockscale train ... --fsdp`
(and of `--ep` and `--tp` runs, at the end).

One process per rank, launched by torchrun (which sets RANK, WORLD_SIZE and LOCAL_RANK). Each
rank joins the default process group (gloo on the CPU, NCCL on CUDA with the GPU of its local
rank), builds the same model from the same seed, converts it, and shards it with FSDP2
(`fully_shard` on every block, then on the root). Quantized layers all-gather their weights as
NVFP4 / MXFP8 (`blockscale.distributed.enable_quantized_all_gather`), as
`tests/test_distributed_fsdp.py` does: convert, enable, then `fully_shard`.

Precision is what one device trains in: FP32 parameters, gradients and AdamW state (sharded
here), BF16 autocast on CUDA. So no `MixedPrecisionPolicy`: unquantized parameters all-gather
in FP32, and gradients reduce-scatter in FP32.

The batch: `batch_size` x `grad_accum` sequences per optimizer step over all ranks, the same
`grad_accum` micro-batches that one process runs with the same flags; rank r runs the micro-
batches r*G/W .. (r+1)*G/W - 1 of the step's G = grad_accum (so W must divide G). FSDP averages
the ranks' gradients, so each rank scales its loss by W: the step's gradient is the mean over
all G micro-batches, as on one process. A run's config therefore says everything about its
math, and the number of ranks may change when it is resumed (any W that divides G).

`Ranks` is also the single-process case (world_size 1, no process group): its collectives are
then no-ops, so the training loop reads the same either way. The loop reaches the functions
below through one class per mode (train/parallel.py).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from blockscale.train.data import batch_seed
from blockscale.train.errors import UsageError

_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world_size: int = 1
    sharded: bool = False  # a --fsdp, --ep or --tp run: a process group, sharded checkpoints
    expert_parallel: bool = False  # an --ep run: experts split over the ranks, the rest replicated
    tensor_parallel: bool = False  # a --tp run: layers split over the ranks, which share a batch

    @property
    def main(self) -> bool:
        """Rank 0: the one that prints, writes the run's files and finalizes checkpoints."""
        return self.rank == 0

    @property
    def data_ranks(self) -> int:
        """How many ranks split each step's micro-batches (1 under --tp: all run them all)."""
        return 1 if self.tensor_parallel else self.world_size

    def micro_batches(self, grad_accum: int) -> range:
        """The micro-batches of each step that this rank runs."""
        share = grad_accum // self.data_ranks
        index = 0 if self.tensor_parallel else self.rank
        return range(index * share, (index + 1) * share)

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The elementwise sum of `tensor` over the ranks' batches (a new tensor): under --tp
        every rank ran the same batches, so its own value."""
        total = tensor.detach().clone()
        if self.sharded and not self.tensor_parallel:
            dist.all_reduce(total)
        return total

    def any(self, *flags: bool, device: torch.device) -> list[bool]:
        """Each flag true on any rank: decisions every rank must take alike (stop, pause)."""
        if not self.sharded:
            return list(flags)
        t = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [bool(v) for v in t.tolist()]

    def barrier(self) -> None:
        if self.sharded:
            dist.barrier()

    def on_main(self, fn, device: torch.device):
        """Run `fn` on rank 0 only and return its (picklable) result on every rank; a
        UsageError or OSError it raises is raised on every rank, so no rank waits for a peer
        that gave up."""
        result, error = None, None
        if self.main:
            try:
                result = fn()
            except (UsageError, OSError) as e:
                error = e
        if self.sharded:
            box = [result, error]
            dist.broadcast_object_list(box, src=0, device=_object_device(device))
            result, error = box
        if error is not None:
            raise error
        return result


def full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (clip_grad_norm_ of sharded gradients returns one), else t."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _object_device(device: torch.device) -> torch.device | None:
    return device if device.type == "cuda" else None


def launched() -> bool:
    """Whether this process was started by torchrun (or any launcher that sets its variables)."""
    return "WORLD_SIZE" in os.environ


def join(device_name: str, flag: str = "--fsdp") -> tuple[Ranks, torch.device]:
    """Join the default process group of a torchrun launch; returns this rank and its device.

    device_name: the run's `--device`: auto (CUDA if there is one), cpu, or cuda (each rank
    takes the GPU of its LOCAL_RANK)."""
    if not launched():
        raise UsageError(
            f"{flag} needs one process per rank, started by torchrun: "
            f"torchrun --nproc-per-node N -m blockscale train {flag} ... (WORLD_SIZE is not set)"
        )
    missing = [name for name in _ENV if name not in os.environ]
    if missing:
        raise UsageError(f"{flag}: the launcher set WORLD_SIZE but not {', '.join(missing)}")
    rank, world, local = (int(os.environ[name]) for name in _ENV)
    if device_name not in ("auto", "cpu", "cuda"):
        raise UsageError(
            f"--device {device_name} with {flag}: each rank uses the GPU of its local rank; "
            "pass --device cuda, cpu or auto"
        )
    use_cuda = device_name == "cuda" or (device_name == "auto" and torch.cuda.is_available())
    if use_cuda:
        if torch.cuda.device_count() <= local:
            raise UsageError(
                f"{flag}: local rank {local} needs GPU {local}, but this machine has "
                f"{torch.cuda.device_count()} CUDA GPU(s)"
            )
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        kwargs = {"device_id": device} if use_cuda else {}
        dist.init_process_group("nccl" if use_cuda else "gloo", **kwargs)
    if (dist.get_rank(), dist.get_world_size()) != (rank, world):
        raise UsageError(
            f"{flag}: the process group has rank {dist.get_rank()} of {dist.get_world_size()}, "
            f"the environment says {rank} of {world}"
        )
    return Ranks(rank, world, sharded=True), device


def leave() -> None:
    """Every rank done before any tears its connections down (a gloo rank whose peer closed
    first can abort at exit), then the process group goes."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def seed_stream(seed: int, rank: int, step: int) -> None:
    """The random stream (stochastic rounding) of a rank that continues none: rank r > 0 of a
    new run (rank 0 continues the stream of initialization, as one process does), or a rank
    that a resumed run's checkpoint has no stream for (more ranks than it was written on)."""
    torch.manual_seed(batch_seed(seed, rank, step))


def check_batch(grad_accum: int, ranks: Ranks) -> None:
    if grad_accum % ranks.world_size:
        raise UsageError(
            f"grad_accum={grad_accum} micro-batches per step do not split over "
            f"{ranks.world_size} ranks: under --fsdp the step's micro-batches are shared out "
            f"over the ranks; use a number of ranks that divides {grad_accum} (a new run: "
            f"--grad-accum a multiple of {ranks.world_size})"
        )


def shard(model: torch.nn.Module, quantized_gather: bool, device: torch.device) -> None:
    """FSDP2 on every block and on the root, with quantized all-gather for quantized layers
    (after convert, before fully_shard). Shard rules are checked before anything is sharded,
    so a model that cannot be split this way gets one line, not an error at the first step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from blockscale.distributed import enable_quantized_all_gather
    from blockscale.distributed.fsdp import GatherLayout
    from blockscale.nn import Linear

    world = dist.get_world_size()
    if quantized_gather:
        for name, module in model.named_modules():
            if isinstance(module, Linear) and module.recipe.quantized:
                try:
                    GatherLayout.for_layer(module, module.weight.shape, world)
                except ValueError as e:
                    raise UsageError(f"--fsdp on {world} ranks: {name}: {e}") from None
        enable_quantized_all_gather(model)
    mesh = init_device_mesh(device.type, (world,))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


# --------------------------------------------------------------------------- expert parallel (--ep)
#
# Every rank is a data-parallel rank (its share of the step's micro-batches, as under --fsdp)
# that keeps E/W of every MoE layer's experts (blockscale.distributed.enable_expert_parallel).
# The other parameters are replicated: their gradients are averaged over the ranks after the
# backward (`average_replicated_grads`); the experts' owners already hold their averaged
# gradients (the all-to-all's backward brings every rank's, and a hook divides by W).


def expert_parallel(model: torch.nn.Module, ranks: Ranks) -> None:
    """Split the experts of a converted MoE model over the ranks (before the optimizer)."""
    from blockscale.distributed import enable_expert_parallel

    try:
        enable_expert_parallel(model)
    except ValueError as e:
        raise UsageError(f"--ep on {ranks.world_size} ranks: {e}") from None


def local_experts(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """This rank's expert weights by fully qualified name (an --ep model's; {} otherwise)."""
    from blockscale.nn.experts import experts_weights

    return {
        f"{name}.experts.{w}" if name else f"experts.{w}": p
        for name, m in model.named_modules()
        if getattr(m, "expert_shard", None) is not None
        for w, p in experts_weights(m.experts).items()
    }


def average_replicated_grads(model: torch.nn.Module, ranks: Ranks) -> None:
    """The mean over the ranks of every gradient but the local experts' (one all-reduce of
    them all, flattened). With 2 ranks the sum is order-free and halving exact."""
    experts = {id(p) for p in local_experts(model).values()}
    grads = [p.grad for p in model.parameters() if p.grad is not None and id(p) not in experts]
    if not grads or ranks.world_size == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= ranks.world_size
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def _global_norm(
    local: list[torch.Tensor], replicated: list[torch.Tensor], ranks: Ranks
) -> torch.Tensor:
    """The whole model's gradient norm: the squared norm of each rank's own gradients summed
    over the ranks, plus the replicated gradients' (the same on every rank) once."""
    device = next((g.device for g in (*local, *replicated)), torch.device("cpu"))

    def squared(grads: list[torch.Tensor]) -> torch.Tensor:
        if not grads:
            return torch.zeros((), device=device)
        return torch.nn.utils.get_total_norm(grads).float() ** 2

    local_sq = squared(local)
    if ranks.world_size > 1:
        dist.all_reduce(local_sq)
    return (squared(replicated) + local_sq).sqrt()


def clip_expert_parallel(model: torch.nn.Module, max_norm: float, ranks: Ranks) -> torch.Tensor:
    """clip_grad_norm_ over the whole model of an --ep run: the replicated gradients' squared
    norm once, plus the local experts' summed over the ranks; every rank then scales by the
    same coefficient (a rank-local norm would clip the replicated weights differently)."""
    experts = {id(p) for p in local_experts(model).values()}
    params = [p for p in model.parameters() if p.grad is not None]
    shared = [p.grad for p in params if id(p) not in experts]
    own = [p.grad for p in params if id(p) in experts]
    total = _global_norm(own, shared, ranks)
    if math.isfinite(max_norm):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


# --------------------------------------------------------------------------- tensor parallel (--tp)
#
# Every rank holds 1/W of each block's linears (blockscale.distributed.apply_tensor_parallel:
# wqkv and w13 split per projection, wo and w2 row-wise) and the rest whole, and all ranks run
# the same micro-batches: the activations between the split layers are whole on every rank
# (the row-wise outputs are all-reduced, the column-wise inputs' gradients too), so every
# replicated parameter gets the same gradient on every rank and nothing is averaged. The
# split parameters are DTensors whose whole value is the one-device weight.


def tensor_parallel(model: torch.nn.Module, ranks: Ranks, device: torch.device) -> None:
    """Split a converted model's blocks over the ranks (before the optimizer); a model that
    does not split (heads, hidden dim, block rules) is one line."""
    from torch.distributed.device_mesh import init_device_mesh

    from blockscale.distributed import apply_tensor_parallel, check_tensor_parallel

    try:
        check_tensor_parallel(model, ranks.world_size)
    except ValueError as e:
        raise UsageError(f"--tp on {ranks.world_size} ranks: {e}") from None
    apply_tensor_parallel(model, init_device_mesh(device.type, (ranks.world_size,)))


def clip_tensor_parallel(model: torch.nn.Module, max_norm: float, ranks: Ranks) -> torch.Tensor:
    """clip_grad_norm_ over the whole model of a --tp run: the split gradients' local squared
    norms summed over the ranks, plus the replicated gradients' once; every rank scales its
    local gradients by the same coefficient (torch's formula, max_norm / (norm + 1e-6) capped
    at 1)."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    split = [g.to_local() for g in grads if isinstance(g, DTensor)]
    whole = [g for g in grads if not isinstance(g, DTensor)]
    total = _global_norm(split, whole, ranks)
    if math.isfinite(max_norm):
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in split + whole:
            g.mul_(coef.to(g.device))
    return total
