"""Expert parallelism: each rank of a group keeps E/W of an MoE layer's experts and the tokens
travel to them and back by all-to-all (torch.distributed collectives only).

`enable_expert_parallel(model, group)` is applied from outside to a model whose MoE layers
follow blockscale's layer protocol (`models/moe.py`'s `MoE`; this layer cannot import it):
a module with `top_k`, an `experts` child whose 3D parameters [E, ...] are the routed experts,
and the two seams of its forward, `run_experts(x_sorted, offs)` and `routing_totals(probs,
counts)`. It keeps rank r's experts [r*E/W, (r+1)*E/W) of every expert weight and swaps each
layer's class for a generated subclass (one per class, like `nn/experts.py`'s) whose seams do:

```
run_experts     counts per expert [E] -> all-to-all -> [W, E] on every rank  (collective 1)
                .tolist() of that table: the splits            (the layer's one host sync)
                rows sorted by expert -> all-to-all to the experts' owners   (collective 2)
                received rows put in (expert, source rank, position) order
                the local experts: the experts module's own forward, [E/W] offsets
                outputs back to (source rank, expert, position) -> all-to-all  (collective 3)
routing_totals  router probabilities gathered in rank order [N_all, E]       (collective 4)
                assignments per expert summed over the table
```

The router, the top-k and the combine stay in the layer's own forward, replicated as in one
process. The experts module runs its own forward on its slice, so a converted one (its
`grouped_mms` route `F.grouped_mm` to `blockscale.grouped_mm` with the recipe convert gave it)
computes the local experts in bf16, nvfp4, mxfp8 or nvfp4_fwd_mxfp8_bwd alike.

Exactness. Ranks 0..W-1 holding batches B_0..B_{W-1} compute what one process computes on
their concatenation, for every value that is a function of one token:
- An expert's group is the same rows in the same order: one process sorts the assignments of
  the concatenated batch by expert, stably, so expert e's rows are rank 0's in rank 0's order,
  then rank 1's, ...; the owner of e puts the rows it receives in exactly that order. So the
  per-expert NVFP4 amaxes, the 1x16 / 1x32 row blocks and the 16-token Hadamard blocks of the
  wgrad operands are the one-process ones, and the expert outputs and the expert weight
  gradients are equal bit for bit (tested for bf16, nvfp4, mxfp8 and nvfp4_fwd_mxfp8_bwd).
- The load-balancing loss and `tokens_per_expert` are those of the whole group's batch: the
  counts are summed over ranks (integers), and the probabilities are gathered in rank order
  and averaged as one process averages them, so the loss is the same bits on every rank.
- Gradients. Each rank's loss reaches every expert through the combine, so an expert's owner
  receives the gradient of the sum of the ranks' losses; a hook on each local expert weight
  divides it by W, which makes it the gradient of their mean, what data parallelism's averaging
  gives every other parameter (exact for W a power of two). The gather of the probabilities
  is differentiated as a gather: rank r's probabilities get the gradient that every rank's
  loss sends them (one all-to-all in the backward), so the non-expert gradients averaged over
  the ranks are the one-process ones (up to the order of FP32 sums over tokens).

Host synchronization: one device-to-host copy per layer per forward (the counts table, read
once for both all-to-alls' split sizes and the probabilities' gather), none in the backward:
the autograd functions keep the forward's split sizes and run the reverse all-to-alls with
them (three per layer: outputs, rows, probabilities). No other op in the path reads device
data on the host: the received rows are ordered by `searchsorted` and a stable `argsort` on
the device. Fixed-capacity buffers, which would need no host read at all, are not built: a
capacity per expert either drops the tokens past it (another model than the one-process
one) or pads every exchange to the worst case (more bytes).

Rules: every rank of the group runs every forward and (if any) backward of the layers alike;
the collectives of the backward are part of the autograd graph, so a rank cannot leave out the
load-balancing loss another rank backpropagates. E must be divisible by W.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from blockscale.nn.experts import experts_weights

SEAMS = ("run_experts", "routing_totals")


@dataclass(frozen=True)
class ExpertShard:
    """Which experts a rank holds: [first, first + n_local) of n_experts, over `group`.

    >>> shard = bs.distributed.ExpertShard(group=None, rank=1, world_size=4, n_experts=8)
    >>> shard.first, shard.n_local  # rank 1 holds experts 2 and 3
    (2, 2)
    """

    group: dist.ProcessGroup | None
    rank: int
    world_size: int
    n_experts: int

    @property
    def n_local(self) -> int:
        return self.n_experts // self.world_size

    @property
    def first(self) -> int:
        return self.rank * self.n_local


def _exchange(
    input: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup | None
) -> torch.Tensor:
    output = input.new_empty((sum(recv), *input.shape[1:]))
    dist.all_to_all_single(output, input.contiguous(), recv, send, group=group)
    return output


def all_to_all(
    input: torch.Tensor,
    send: list[int],
    recv: list[int],
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Rows input[sum(send[:d]) : sum(send[:d+1])] go to rank d; the result holds the rows
    received from ranks 0, 1, ... in that order (recv[s] from rank s). Differentiable: torch's
    autograd all_to_all_single, whose backward is the reverse exchange with the same sizes (no
    host read)."""
    from torch.distributed.nn.functional import all_to_all_single  # noqa: PLC0415

    output = input.new_empty((sum(recv), *input.shape[1:]))
    group = group if group is not None else dist.group.WORLD
    return all_to_all_single(output, input.contiguous(), recv, send, group=group)


class _ExpertParallel:
    """Mixin of the generated layer classes: the seams of one process, over the group."""

    expert_shard: ExpertShard

    def run_experts(self, x_sorted: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        shard = self.expert_shard
        world, rank, n_local = shard.world_size, shard.rank, shard.n_local
        mine = slice(shard.first, shard.first + n_local)
        counts = torch.diff(offs, prepend=offs.new_zeros(1)).long()
        # Every rank's counts on every rank (an all-gather, written as an all-to-all, which
        # every torch >= 2.11 backend has without a deprecation), then the one host read.
        table_dev = _exchange(
            counts.repeat(world), [len(counts)] * world, [len(counts)] * world, shard.group
        ).view(world, -1)
        table = table_dev.tolist()
        send = [sum(table[rank][d * n_local : (d + 1) * n_local]) for d in range(world)]
        recv = [sum(row[mine]) for row in table]
        self._expert_parallel_table = table_dev, [sum(row) for row in table]

        # Received: source-rank-major, each source's rows by expert. Put them expert-major
        # (expert, source rank, position): the order of one process's stable sort.
        x_recv = all_to_all(x_sorted, send, recv, shard.group)
        local = table_dev[:, mine]  # [W, E/W] rows from each source for each local expert
        rows = torch.arange(x_recv.shape[0], device=offs.device)
        chunk = torch.searchsorted(local.flatten().cumsum(0), rows, right=True)
        order = (chunk % n_local).argsort(stable=True)
        local_offs = local.sum(0).cumsum(0).to(torch.int32)
        y_local = self.experts(x_recv[order], local_offs)
        y_recv = torch.zeros_like(y_local).index_copy(0, order, y_local)
        return all_to_all(y_recv, recv, send, shard.group)

    def routing_totals(
        self, probs: torch.Tensor, counts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        shard = self.expert_shard
        table_dev, assignments = self._expert_parallel_table
        self._expert_parallel_table = None
        # Every rank's probabilities, in rank order: [N_all, E] as one process has them.
        tokens = [a // self.top_k for a in assignments]
        probs_all = all_to_all(
            probs.repeat(shard.world_size, 1),
            [probs.shape[0]] * shard.world_size,
            tokens,
            shard.group,
        )
        return probs_all, table_dev.sum(0)


@functools.cache
def _expert_parallel_class(cls: type[nn.Module]) -> type[nn.Module]:
    return type(f"ExpertParallel{cls.__name__}", (_ExpertParallel, cls), {"__module__": __name__})


def _is_moe_layer(module: nn.Module) -> bool:
    experts = getattr(module, "experts", None)
    return (
        isinstance(experts, nn.Module)
        and all(callable(getattr(module, seam, None)) for seam in SEAMS)
        and isinstance(getattr(module, "top_k", None), int)
        and bool(experts_weights(experts))
    )


def enable_expert_parallel(model: nn.Module, group: dist.ProcessGroup | None = None) -> int:
    """Shard the routed experts of every MoE layer of `model` over `group` (default: the
    world) and route their tokens by all-to-all; returns the number of layers. In place.

    Call it on every rank of the group, on models built alike (same initial weights), after
    `blockscale.convert` (converting later finds no experts when a rank keeps only one) and
    before building the optimizer (the expert weights become new, smaller Parameters). Raises
    ValueError if the model has no MoE layer, one is already expert-parallel, or a layer's
    expert count is not divisible by the group size.

    >>> import torch.distributed as dist
    >>> from blockscale.models import build_model, model_config
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> model = build_model(model_config("moe-tiny"))
    >>> model = bs.convert(model, bs.recipes.get("mxfp8"), bs.nn.layer_policy(model))
    >>> bs.distributed.enable_expert_parallel(model)  # MoE layers split (one rank: all local)
    2
    >>> dist.destroy_process_group()
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    layers = {name: m for name, m in model.named_modules() if _is_moe_layer(m)}
    if not layers:
        raise ValueError(
            "expert parallel found no MoE layer (a module with top_k, 3D expert weights under "
            f"'experts' and the seams {SEAMS}, as blockscale.models.MoE) in "
            f"{type(model).__name__}"
        )
    for name, layer in layers.items():
        if isinstance(layer, _ExpertParallel):
            raise ValueError(f"MoE layer {name!r} is already expert-parallel")
        n_experts = next(iter(experts_weights(layer.experts).values())).shape[0]
        if n_experts % world:
            raise ValueError(
                f"MoE layer {name!r} has n_experts={n_experts}, not divisible by the "
                f"expert-parallel group size {world} (each rank keeps n_experts/{world})"
            )
    for layer in layers.values():
        weights = experts_weights(layer.experts)
        shard = ExpertShard(group, rank, world, next(iter(weights.values())).shape[0])
        for name, weight in weights.items():
            local = weight.detach()[shard.first : shard.first + shard.n_local].clone()
            param = nn.Parameter(local, requires_grad=weight.requires_grad)
            if world > 1 and param.requires_grad:
                param.register_hook(functools.partial(torch.div, other=world))
            setattr(layer.experts, name, param)
        layer.expert_shard = shard
        layer._expert_parallel_table = None
        layer.__class__ = _expert_parallel_class(type(layer))
    return len(layers)
