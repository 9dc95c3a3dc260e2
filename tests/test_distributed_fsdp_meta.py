"""FSDP2's quantized all-gather (blockscale.distributed.fsdp) on a model built on the meta device,
on 2 CPU ranks over gloo: torchtitan's order (meta build, convert, enable_quantized_all_gather,
fully_shard, to_empty, init in place) and to_empty before fully_shard; and torchtitan 0.2.2's
converter under torchtitan's own parallelize.

What tells a quantized all-gather from an unquantized one: the weights' shards are ShardedWeights
(FSDP2 calls their `fsdp_pre_all_gather`, whose inputs are codes and scales) and the bytes each
rank receives. The losses cannot tell: an unquantized gather of the same FP32 weights quantizes
the same values after the gather, to the same bits (the quantized gather is built to be exact).
So each run records what every `fsdp_pre_all_gather` returned and what FSDP gathered, and its
losses must equal bit for bit those of the same model built on the CPU with the same values,
which the CPU tests of test_distributed_fsdp.py check against one process.
"""

from __future__ import annotations

import functools
import importlib

import pytest
import torch
import torch.distributed as dist
from test_distributed_fsdp import RECIPES, WORLD, _batches, _count_all_gathers, _loss, _shard
from test_torchtitan import build_v0_2_from, needs_v0_2
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

import blockscale as bs
from blockscale.distributed import ShardedWeight, enable_quantized_all_gather
from blockscale.distributed.launch import run_local
from blockscale.models import build_model, model_config

# Bytes a rank sends per value of its shard: NVFP4 16x16 codes (1/2) and one E4M3 scale a tile
# (1/256); MXFP8 rowwise and columnwise codes (1 + 1) and one E8M0 scale per 32 (1/32 + 1/32).
SENT_PER_VALUE = {"nvfp4": 129 / 256, "mxfp8": 2 + 1 / 16}


def _quantized_linears(model: nn.Module) -> list[bs.nn.Linear]:
    return [m for m in model.modules() if isinstance(m, bs.nn.Linear) and m.recipe.quantized]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _assert_sharded_weights(model: nn.Module, when: str) -> None:
    for m in _quantized_linears(model):
        local = _local(m.weight)
        assert isinstance(local, ShardedWeight), f"{when}: a {type(local).__name__}"
        assert local.device.type == "cpu" and type(local._data) is torch.Tensor, when


class _PreAllGatherLog:
    """Wraps `ShardedWeight.fsdp_pre_all_gather` (the signature FSDP2 reads follows
    `__wrapped__`): the shard's value count and the bytes of what each call returned."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []
        self.hook = ShardedWeight.fsdp_pre_all_gather

    def __enter__(self) -> _PreAllGatherLog:
        hook = self.hook

        @functools.wraps(hook)
        def logged(weight, *args, **kwargs):
            inputs, metadata = hook(weight, *args, **kwargs)
            sent = sum(t.numel() * t.element_size() for t in inputs)
            self.calls.append((weight._data.numel(), sent))
            return inputs, metadata

        ShardedWeight.fsdp_pre_all_gather = logged
        return self

    def __exit__(self, *exc: object) -> None:
        ShardedWeight.fsdp_pre_all_gather = self.hook


@torch.no_grad()
def _init_in_place(model: nn.Module, values: dict[str, torch.Tensor]) -> None:
    """What torchtitan's `init_weights` does to the materialized model (`trunc_normal_` and
    `normal_` in place, on DTensors once sharded), then the reference's values `copy_`d in, so
    that the run can be compared with the model built on the CPU."""
    for p in model.parameters():
        nn.init.trunc_normal_(p, std=0.02)
        p.normal_(0.0, 0.02)
    _assert_sharded_weights(model, "after in-place init")
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        value = values[name]
        if isinstance(t, DTensor):
            value = distribute_tensor(value, t.device_mesh, t.placements)
        t.copy_(value)


def _train(model: nn.Module, data: torch.Tensor, rank: int) -> tuple[list[float], list, int]:
    """Three AdamW steps: the losses, what each pre-all-gather hook sent, the bytes gathered."""
    counter = _count_all_gathers(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    with _PreAllGatherLog() as log:
        for step in range(data.shape[0]):
            loss = _loss(model, data[step, rank])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses, log.calls, counter.bytes


def _meta_worker(rank: int, world_size: int, order: str) -> None:
    cfg = model_config("tiny")
    data = _batches(3, world_size, cfg.vocab_size, torch.device("cpu"))
    for name in ("nvfp4", "mxfp8"):
        # the reference: built on the CPU, its values kept for the meta build
        torch.manual_seed(0)
        on_cpu = bs.convert(build_model(cfg), RECIPES[name])
        state = [*on_cpu.named_parameters(), *on_cpu.named_buffers()]
        values = {n: t.detach().clone() for n, t in state}
        enable_quantized_all_gather(on_cpu)
        _shard(on_cpu, list(on_cpu.layers), mp=True)
        expected = _train(on_cpu, data, rank)

        with torch.device("meta"):
            model = build_model(cfg)
        bs.convert(model, RECIPES[name])
        count = enable_quantized_all_gather(model)
        if order == "to_empty_first":
            model.to_empty(device="cpu")
            _assert_sharded_weights(model, "after to_empty")
            _init_in_place(model, values)
            _shard(model, list(model.layers), mp=True)
        else:  # torchtitan's order
            _shard(model, list(model.layers), mp=True)
            model.to_empty(device="cpu")
            _assert_sharded_weights(model, "after to_empty")
            _init_in_place(model, values)
        _assert_sharded_weights(model, "before the first forward")
        losses, calls, gathered = _train(model, data, rank)

        # quantized: every prepared weight's shard sent as codes and scales, at every gather
        assert len(calls) >= 3 * count, (name, len(calls), count)
        for values_in_shard, sent in calls:
            assert sent == values_in_shard * SENT_PER_VALUE[name], (name, values_in_shard, sent)
        assert (losses, calls, gathered) == expected, (name, order)
        # the check at the first forward saw the gathered QuantizedWeight and is gone
        for m in _quantized_linears(model):
            assert not m._forward_pre_hooks, name


def test_meta_build_fully_shard_then_to_empty():
    """torchtitan's order: meta build, convert, enable, fully_shard, to_empty, init in place."""
    run_local(_meta_worker, WORLD, "fully_shard_first")


def test_meta_build_to_empty_then_fully_shard():
    run_local(_meta_worker, WORLD, "to_empty_first")


def _lost_weight_worker(rank: int, world_size: int) -> None:
    # A checkpoint loaded with assign=True replaces the sharded weights by plain DTensors: FSDP2
    # would all-gather them in FP32, so the first forward raises on every rank alike.
    model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.ReLU(), nn.Linear(64, 64, bias=False))
    bs.convert(model, RECIPES["nvfp4"])
    enable_quantized_all_gather(model)
    _shard(model, [], mp=False)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert all(type(_local(v)) is torch.Tensor for v in state.values())
    model.load_state_dict(state, assign=True)
    with pytest.raises(RuntimeError, match=r"0\.weight was prepared by enable_quantized_all"):
        model(torch.randn(4, 64))
    dist.barrier()


def test_weight_replaced_under_fsdp_raises_at_first_forward():
    run_local(_lost_weight_worker, WORLD)


# --------------------------------------------------------------------------- one process


def _meta_model() -> nn.Sequential:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 128, bias=False), nn.ReLU(), nn.Linear(128, 64))
    bs.convert(model, RECIPES["mxfp8"])
    assert enable_quantized_all_gather(model) == 2
    return model


@pytest.mark.parametrize("swap", [False, True])
def test_weight_stays_sharded_through_to_empty_to_and_in_place_init(swap):
    """`to_empty`, `.to`, `_apply` and in-place init keep the ShardedWeight (no FSDP here), with
    `_apply` setting `.data` or swapping the tensors (torch.__future__'s switch)."""
    values = [torch.randn(128, 64), torch.randn(64, 128)]
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(swap)
    try:
        model = _meta_model()
        model.to_empty(device="cpu")
        _assert_sharded_weights(model, "after to_empty")
        with torch.no_grad():
            for m, value in zip(_quantized_linears(model), values, strict=True):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.normal_(m.weight)
                nn.init.zeros_(m.weight)
                m.weight.copy_(value)
            nn.init.zeros_(model[2].bias)
        _assert_sharded_weights(model, "after in-place init")
        model.to("meta").to_empty(device="cpu")
        model._apply(lambda t: t.to("cpu", copy=True))
        _assert_sharded_weights(model, "after .to and _apply")
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)
    model = _meta_model().to_empty(device="cpu")
    with torch.no_grad():
        for m, value in zip(_quantized_linears(model), values, strict=True):
            m.weight.copy_(value)
        model[2].bias.zero_()
    x = torch.randn(8, 64)
    hidden = torch.relu(bs.linear(x, values[0], None, RECIPES["mxfp8"]))
    assert torch.equal(model(x), bs.linear(hidden, values[1], model[2].bias, RECIPES["mxfp8"]))


@pytest.mark.parametrize("how", ["_apply", "load_state_dict(assign=True)"])
def test_weight_replaced_raises_at_first_forward(how):
    model = _meta_model().to_empty(device="cpu")
    if how == "_apply":
        # a function that makes plain tensors, swapped in (torch.__future__'s switch; without
        # it `_apply` sets `.data`, which a ShardedWeight ignores: docs/DISTRIBUTED.md)
        before = torch.__future__.get_swap_module_params_on_conversion()
        torch.__future__.set_swap_module_params_on_conversion(True)
        try:
            model._apply(lambda t: t.clone())
        finally:
            torch.__future__.set_swap_module_params_on_conversion(before)
    else:
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        model.load_state_dict(state, assign=True)
    assert not isinstance(model[0].weight, ShardedWeight)
    with pytest.raises(RuntimeError, match="0.weight was prepared.*all-gather it unquantized"):
        model(torch.randn(4, 64))


# --------------------------------------------------------------------------- torchtitan 0.2.2


def _titan_worker(rank: int, world_size: int) -> None:
    """torchtitan 0.2.2's Llama 4 debug model as its trainer builds it with dp_shard=2: meta
    build, the converter (given the parallel dims), torchtitan's own parallelize (FSDP2 on each
    block and the root), to_empty, init_weights; then one forward, whose logits equal those of
    the same weights in a model converted without FSDP, bit for bit (the forward quantizes
    with nearest rounding). Forward only: torchtitan turns FSDP's gradient division off, and
    the reduce-scatter it then asks for (PREMUL_SUM) gloo does not implement."""
    import torchtitan.distributed.parallel_dims as titan_parallel_dims
    from torchtitan.config import ConfigManager

    import blockscale.integrations.titan.v0_2  # noqa: F401 (registers "blockscale")

    titan_parallel_dims.device_type = "cpu"  # torchtitan builds its meshes on "cuda" otherwise
    histc = torch.histc  # test_torchtitan.histc_on_cpu: 0.2.2's router counts int64 on CUDA only
    torch.histc = lambda i, *a, **k: histc(i if i.is_floating_point() else i.float(), *a, **k)
    spec = importlib.import_module("torchtitan.models.llama4").get_train_spec()
    args = ["--model.converters", "blockscale", "--training.mixed_precision_param", "float32"]
    job_config = ConfigManager().parse_args(args)
    dims = titan_parallel_dims.ParallelDims(
        dp_replicate=1, dp_shard=world_size, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=world_size
    )
    sharded, reference = (
        build_v0_2_from(spec, job_config, parallel_dims, seed=None)
        for parallel_dims in (dims, None)
    )
    linears = _quantized_linears(sharded)
    assert len(linears) >= 4
    _assert_sharded_weights(sharded, "after torchtitan's parallelize, to_empty and init")
    assert not any(isinstance(m.weight, ShardedWeight) for m in _quantized_linears(reference))
    tokens = torch.randint(0, 2048, (2, 64), generator=torch.Generator().manual_seed(0))
    _assert_gathers_quantized(sharded, reference, sharded.state_dict(), tokens)


def _assert_gathers_quantized(
    sharded: nn.Module, reference: nn.Module, state: dict, tokens: torch.Tensor
) -> None:
    """`reference` loaded with `state` (`sharded`'s state dict, DTensors gathered), then one
    forward of each on `tokens`: every converted linear of `sharded` all-gathered once, as
    NVFP4 codes and scales, and the logits equal bit for bit."""
    reference.load_state_dict(
        {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}
    )
    with _PreAllGatherLog() as log:
        logits = sharded(tokens)
    assert len(log.calls) == len(_quantized_linears(sharded))
    for values_in_shard, sent in log.calls:
        assert sent == values_in_shard * SENT_PER_VALUE["nvfp4"]
    assert torch.equal(logits, reference(tokens))


@needs_v0_2
def test_v0_2_converter_turns_on_quantized_all_gather_under_titans_fsdp():
    run_local(_titan_worker, WORLD)


@needs_v0_2
def test_v0_2_converter_gathers_quantized_only_where_it_can():
    from torchtitan.distributed.parallel_dims import ParallelDims

    from blockscale.integrations.titan.v0_2 import quantized_all_gather_reason

    def reason(**degrees):
        sizes = dict(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1) | degrees
        world_size = sizes["dp_replicate"] * sizes["dp_shard"] * sizes["cp"] * sizes["tp"]
        return quantized_all_gather_reason(
            ParallelDims(**sizes, world_size=world_size * sizes["pp"])
        )

    assert reason(dp_shard=8) is None and reason(dp_shard=2, cp=2) is None
    assert reason(cp=2) is None and reason(dp_replicate=2, dp_shard=4) is None
    assert quantized_all_gather_reason(None) == "no FSDP sharding (dp_shard and cp are 1)"
    assert reason(dp_replicate=8) == "no FSDP sharding (dp_shard and cp are 1)"
    assert reason(dp_shard=4, tp=2).startswith("tensor parallelism")
    assert reason(dp_shard=4, pp=2).startswith("pipeline parallelism")
