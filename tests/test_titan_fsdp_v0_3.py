"""FSDP2's quantized all-gather under torchtitan 0.3.0 (`blockscale.integrations.titan.v0_3`,
"FSDP2's quantized all-gather"): a model spec from `with_quantized_all_gather` turns it on in
its parallelize function, which torchtitan's trainer calls with the meta model and the parallel
dims before FSDP2 shards it.

On 2 gloo ranks, `--parallelism.spmd_backend partial_dtensor` (0.3's default, `spmd_types`,
does not run FSDP2 on torch 2.13: docs/TORCHTITAN.md), the DeepSeek-V3 debug model as the
trainer builds it: its config's `update_from_config`, the converter, the meta build, the
wrapped spec's `parallelize_fn` (torchtitan's `parallelize_deepseekv3`: FSDP2 on each block and
the root, FP32 parameters), `to_empty`, `init_weights`. Then one forward: every converted
linear is gathered once, as NVFP4 codes and scales (test_distributed_fsdp_meta.py says why the
logits alone cannot tell), and the logits equal, bit for bit, those of the same weights in the
model converted without FSDP (the forward rounds to nearest), after torchtitan's checkpointer
has taken the model's state dict twice (it compares the local tensors' storages, which a
`ShardedWeight` has none of: the v0_3 state-dict hook) and loaded it back. Forward only: torchtitan turns
FSDP's gradient division off, and the reduce-scatter it then asks for (PREMUL_SUM) gloo does
not implement; the trainer's FSDP2 checkpoint test (test_titan_trainer.py) trains with it on
the launcher's SUM reductions. Once with FSDP alone (dp_shard 2) and once with expert
parallelism on the same ranks (dp_shard 2, ep 2: EP borrows the FSDP dim for the experts, the
linears stay FSDP's), the same tokens on both ranks (test_titan_expert_parallel.py: the
converted linears' amax is over their whole input).
"""

from __future__ import annotations

import logging

import pytest
import torch
from test_distributed_fsdp_meta import (
    _assert_gathers_quantized,
    _assert_sharded_weights,
    _quantized_linears,
)
from test_titan_expert_parallel import _v0_3_parallelism
from test_torchtitan import build_v0_3, needs_v0_3
from torch import nn

import blockscale as bs
from blockscale.distributed import ShardedWeight
from blockscale.distributed.launch import run_local

WORLD = 2
FSDP = {"data_parallel_shard_degree": WORLD}
FSDP_AND_EP = {"data_parallel_shard_degree": WORLD, "expert_parallel_degree": WORLD}


def _titan_worker(rank: int, world_size: int, degrees: dict) -> None:
    parallelism, dims = _v0_3_parallelism(world_size, **degrees)  # before torchtitan's import
    from torch.distributed.tensor import DTensor
    from torchtitan.components.checkpointer.base import ModelWrapper
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.models import deepseek_v3

    from blockscale.integrations.titan.v0_3 import BlockscaleConverter, with_quantized_all_gather

    spec = with_quantized_all_gather(deepseek_v3.model_registry("debugmodel"))
    training = TrainingConfig(mixed_precision_param="float32")

    def parallelize(model):
        return spec.parallelize_fn(
            model, parallel_dims=dims, training=training, parallelism=parallelism,
            compile_config=CompileConfig(), ac_config=None, dump_folder="",
        )  # fmt: skip

    converter = BlockscaleConverter.Config(recipe="nvfp4")
    sharded = build_v0_3("deepseek_v3", "debugmodel", converter, parallelism=parallelism,
                         parallelize=parallelize)  # fmt: skip
    reference = build_v0_3("deepseek_v3", "debugmodel", converter)
    linears = _quantized_linears(sharded)
    assert len(linears) >= 4
    _assert_sharded_weights(sharded, "after torchtitan's parallelize, to_empty and init_weights")
    assert all(isinstance(m.weight, DTensor) for m in linears)  # FSDP2's shards
    assert not any(isinstance(m.weight, ShardedWeight) for m in _quantized_linears(reference))
    # torchtitan's checkpointer: its second state_dict compares the local tensors' storages
    wrapper = ModelWrapper(sharded)
    saved = wrapper.state_dict()
    wrapper.load_state_dict(saved)  # in place: the ShardedWeights stay
    _assert_sharded_weights(sharded, "after torchtitan's checkpointer loaded its state dict")
    tokens = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(0))
    _assert_gathers_quantized(sharded, reference, saved, tokens)


@needs_v0_3
@pytest.mark.parametrize("degrees", [FSDP, FSDP_AND_EP], ids=["fsdp", "fsdp_and_ep"])
def test_v0_3_spec_turns_on_quantized_all_gather_under_titans_fsdp(degrees):
    run_local(_titan_worker, WORLD, degrees)


# --------------------------------------------------------------------------- one process


def _dims(backend: str = "partial_dtensor", **degrees: int):
    from torchtitan.distributed import ParallelDims

    sizes = dict(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1) | degrees
    world_size = sizes["dp_replicate"] * sizes["dp_shard"] * sizes["cp"] * sizes["tp"]
    return ParallelDims(**sizes, world_size=world_size * sizes["pp"], spmd_backend=backend)


@needs_v0_3
def test_v0_3_quantized_all_gather_only_where_it_can():
    from blockscale.integrations.titan.v0_3 import quantized_all_gather_reason as reason

    assert reason(_dims(dp_shard=8)) is None and reason(_dims(dp_shard=2, cp=2)) is None
    assert reason(_dims(cp=2)) is None and reason(_dims(dp_replicate=2, dp_shard=4)) is None
    assert reason(_dims(dp_shard=4, ep=2)) is None
    assert reason(_dims()) == "no FSDP sharding (dp_shard and cp are 1)"
    assert reason(_dims(dp_replicate=8)) == "no FSDP sharding (dp_shard and cp are 1)"
    assert reason(_dims(dp_shard=4, tp=2)).startswith("tensor parallelism")
    assert reason(_dims(dp_shard=4, pp=2)).startswith("pipeline parallelism")
    for backend in ("spmd_types", "full_dtensor"):
        assert reason(_dims(backend, dp_shard=8)).startswith(f"spmd_backend {backend}")


@needs_v0_3
def test_v0_3_spec_wraps_the_parallelize_function_once(caplog):
    """The wrapped `parallelize_fn` prepares the converted linears where FSDP2 follows, then
    calls torchtitan's with the same arguments; it leaves a model alone (and says why) under
    tensor parallelism, and one with no converted linear without a word."""
    from torchtitan.models import deepseek_v3

    from blockscale.integrations.titan.v0_3 import with_quantized_all_gather

    calls = []

    def parallelize_fn(model, **kwargs):
        calls.append((model, kwargs))
        return model

    spec = deepseek_v3.model_registry("debugmodel")
    spec.parallelize_fn = parallelize_fn
    wrapped = with_quantized_all_gather(spec)
    assert with_quantized_all_gather(wrapped) is wrapped and spec.parallelize_fn is parallelize_fn

    def model(recipe: str) -> nn.Module:
        with torch.device("meta"):
            return bs.convert(nn.Sequential(nn.Linear(64, 64)), bs.recipes.get(recipe))

    caplog.set_level(logging.INFO, logger="blockscale.integrations.titan.v0_3")
    for dims, recipe, gathered in [(_dims(dp_shard=2), "nvfp4", True),
                                   (_dims(dp_shard=2, tp=2), "nvfp4", False),
                                   (_dims(dp_shard=2), "bf16", False)]:  # fmt: skip
        caplog.clear()
        m = model(recipe)
        assert wrapped.parallelize_fn(m, parallel_dims=dims, training=None) is m
        assert calls.pop() == (m, {"parallel_dims": dims, "training": None})
        assert isinstance(m[0].weight, ShardedWeight) == gathered
        expected = {
            (True, "nvfp4"): ["blockscale: FSDP2 all-gathers 1 linear weights quantized"],
            (False, "nvfp4"): [
                "blockscale: linear weights all-gathered in high precision: tensor "
                "parallelism shards the weights before FSDP"
            ],
            (False, "bf16"): [],
        }[gathered, recipe]
        assert caplog.messages == expected
