"""torchtitan 0.2.2's expert parallelism on the experts blockscale's v0_2 converter converted, on
2 CPU ranks over gloo: the debug models (DeepSeek-V3, Llama 4) built as torchtitan's trainer
builds them (meta device, the converter, `to_empty`, `init_weights`), then torchtitan's own
`apply_moe_ep_tp` with an EP=2 mesh "ep": each MoE layer's experts become `ExpertParallel`
modules (weights DTensors, `Shard(0)`: 4 whole experts of 8 per rank; tokens dispatched and
combined by all-to-all with uneven splits, which gloo runs). And torchtitan's own parallelize
with dp_shard=2, ep=2 (FSDP2 and EP), forward only.

What is checked against the same converted model on one process, fed every rank's tokens:
- quantized under EP: every converted expert weight reaches its `GroupedMM` once per forward,
  with the rank's local experts and EP's padded token groups (torchtitan's forward alone runs
  torch's BF16 grouped GEMM there and reaches none: the check fails without the converter's
  `ExpertParallelShards`), and no "not consumed" warning;
- padding: EP pads each local expert's group with zero rows (to a multiple of 8, at least 8),
  and at least one group here is padded;
- the logits and the experts' gradients (gathered) equal one process's bit for bit: each
  expert's quantizations are its own (per-expert amaxes), EP keeps the token order within a
  group (rank 0's tokens, then rank 1's: one process's stable sort of the same batch), and
  zero rows change no other row's result.

Bit equality needs two choices. The backward rounds to nearest (`nvfp4(stochastic_rounding=
False)`): stochastic rounding draws its noise per call, and the calls' shapes differ between
the runs. And a converted linear's NVFP4 amax is over its whole input, which under EP is the
rank's batch and on one process both ranks' batches: with different tokens per rank only the
experts are converted (`fqns=["moe.experts"]`, the last block's kept BF16 and routed, as the
default policy keeps it); the default policy, linears included, is compared with the same
tokens on both ranks, where the amaxes agree.

CPU stand-ins, as tests/test_torchtitan.py's: torch.histc counts int64 expert indices on CUDA
only (counted from floats here, returned as int64 as CUDA returns them: EP all-to-alls the
counts and splits by their sums), and EP's dispatch computes its padded permutation with a
Triton kernel on CUDA (torchtitan's own CPU version here, `use_cpu=True`).
"""

from __future__ import annotations

import functools
import importlib
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from test_torchtitan import build_v0_2_from, needs_v0_2

import blockscale as bs
from blockscale.distributed.launch import run_local

WORLD = 2
BATCH, LENGTH = 2, 32  # per rank
RECIPE = bs.recipes.nvfp4(stochastic_rounding=False)
EXPERTS_ONLY = ["--blockscale.fqns", "moe.experts", "--blockscale.bf16_fqns", "layers.5."]


def _cpu_stand_ins() -> None:
    import torchtitan.models.moe.utils as moe_utils
    from torchtitan.models.moe.kernels import generate_permute_indices

    histc = torch.histc
    torch.histc = lambda i, *a, **k: histc(i.float(), *a, **k).to(i.dtype)
    moe_utils.generate_permute_indices = functools.partial(generate_permute_indices, use_cpu=True)


def _build(name: str, args: list[str], parallel_dims: Any = None) -> torch.nn.Module:
    """The debug model as torchtitan's trainer builds it: meta, converted, parallelized where
    `parallel_dims` are given (torchtitan's own parallelize), `to_empty`, `init_weights`."""
    from torchtitan.config import ConfigManager

    import blockscale.integrations.titan.v0_2  # noqa: F401 (registers "blockscale")

    spec = importlib.import_module(f"torchtitan.models.{name}").get_train_spec()
    custom = ["--job.custom_config_module", "blockscale.integrations.titan.v0_2"]
    job_config = ConfigManager().parse_args(["--model.converters", "blockscale", *custom, *args])

    def round_to_nearest(converters) -> None:
        (converter,) = converters.converters
        converter.recipe = RECIPE  # round to nearest (module docstring)

    return build_v0_2_from(spec, job_config, parallel_dims, converters=round_to_nearest)


class _GroupedMMLog:
    """Forward hooks on every experts module's GroupedMMs: (fqn, weight, recipe, E, group
    sizes) per call."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls = []
        self.handles = [
            gmm.register_forward_hook(functools.partial(self._log, f"{fqn}.{weight}", gmm))
            for fqn, module in model.named_modules()
            for weight, gmm in getattr(module, "grouped_mms", {}).items()
        ]

    def _log(self, name, gmm, module, args, output):
        input, weight_t, offs = args[:3]
        sizes = torch.diff(offs.long(), prepend=offs.new_zeros(1).long())
        self.calls.append((name, gmm.recipe.quantized, weight_t.shape[0], sizes.tolist()))

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum")


def _ep_worker(rank: int, world_size: int, names: list[str], args: list[str], same: bool) -> None:
    _cpu_stand_ins()
    for name in names:
        _compare(rank, world_size, name, args, same)


def _compare(rank: int, world_size: int, name: str, args: list[str], same_tokens: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torchtitan.models.llama4.infra.parallelize import apply_moe_ep_tp

    from blockscale.integrations.titan.v0_2 import ExpertParallelShards, UnpaddedGroupedExperts

    reference, model = _build(name, args), _build(name, args)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    apply_moe_ep_tp(model, tp_mesh=None, ep_mesh=mesh["ep"], etp_mesh=None, ep_etp_mesh=None)
    experts = {n: m for n, m in model.named_modules() if isinstance(m, UnpaddedGroupedExperts)}
    assert len(experts) >= 3, name
    n_experts = reference.get_submodule(next(iter(experts))).num_experts
    for module in experts.values():
        assert isinstance(module, ExpertParallelShards)
        assert type(module).__name__ == "BlockscaleUnpaddedGroupedExperts"
        assert isinstance(module.w1, DTensor) and module.w1.placements == (Shard(0),)
        assert module.w1.to_local().shape[0] == n_experts // world_size

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 2048, (world_size * BATCH, LENGTH + 1), generator=gen)
    if same_tokens:
        tokens[BATCH:] = tokens[:BATCH].repeat(world_size - 1, 1)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    mine = slice(rank * BATCH, (rank + 1) * BATCH)

    log = _GroupedMMLog(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logits = model(inputs[mine])
        _loss(logits, labels[mine]).backward()
    log.close()
    assert not [w for w in caught if "not consumed" in str(w.message)], name
    # every converted weight of every experts module, once, on this rank's 4 experts
    expected = sorted(f"{fqn}.{w}" for fqn in experts for w in ("w1", "w2", "w3"))
    assert sorted(call[0] for call in log.calls) == expected, name
    # quantized: all but the last block's (BF16, routed to torch's grouped GEMM)
    quantized = sorted(call[0] for call in log.calls if call[1])
    assert quantized == [fqn for fqn in expected if not fqn.startswith("layers.5.")], name
    assert all(call[2] == n_experts // world_size for call in log.calls)
    # EP's padded groups reached the grouped GEMM as they are
    assert all(s >= 8 and s % 8 == 0 for call in log.calls for s in call[3]), log.calls

    ref_log = _GroupedMMLog(reference)
    expected_logits = reference(inputs)
    _loss(expected_logits, labels).backward()
    ref_log.close()
    # some group held zero rows under EP (a local expert's tokens, padded): one process's
    # groups are the same tokens unpadded
    ref_sizes = {call[0]: call[3] for call in ref_log.calls}
    padded = [
        ep_size > ref_size
        for fqn, _, _, sizes in log.calls
        for ep_size, ref_size in zip(sizes, ref_sizes[fqn][rank * len(sizes) :], strict=False)
    ]
    assert any(padded), name

    assert torch.equal(logits, expected_logits[mine]), name
    for fqn, module in experts.items():
        for w in ("w1", "w2", "w3"):
            grad = getattr(module, w).grad.full_tensor()  # the same order on every rank
            assert torch.isfinite(grad).all() and grad.abs().sum() > 0, (name, fqn, w)
            expected_grad = reference.get_submodule(fqn).get_parameter(w).grad
            assert torch.equal(grad, expected_grad), (name, fqn, w)


@needs_v0_2
def test_v0_2_experts_are_quantized_under_expert_parallelism_and_match_one_process():
    """DeepSeek-V3 and Llama 4, experts converted (the last block's routed in BF16), each
    rank its own tokens."""
    run_local(_ep_worker, WORLD, ["deepseek_v3", "llama4"], EXPERTS_ONLY, False)


@needs_v0_2
def test_v0_2_default_policy_under_expert_parallelism_matches_one_process():
    """DeepSeek-V3 with the default policy (linears converted too), the same tokens on both
    ranks (module docstring)."""
    run_local(_ep_worker, WORLD, ["deepseek_v3"], [], True)


def _titan_parallelize_worker(rank: int, world_size: int) -> None:
    """torchtitan's own parallelize with dp_shard=2, ep=2 (EP borrows the FSDP dim; FSDP2 then
    shards each block and, over an "efsdp" dim of 1, the experts), the converter given the
    parallel dims, as its trainer builds the model. Forward only: torchtitan turns FSDP's
    gradient division off, and the reduce-scatter it then asks for (PREMUL_SUM) gloo does not
    implement (as in test_distributed_fsdp_meta)."""
    import torchtitan.distributed.parallel_dims as titan_parallel_dims
    from torch.distributed.tensor import DTensor

    _cpu_stand_ins()
    titan_parallel_dims.device_type = "cpu"  # torchtitan builds its meshes on "cuda" otherwise
    degrees = ["--parallelism.data_parallel_shard_degree", str(world_size)]
    degrees += ["--parallelism.expert_parallel_degree", str(world_size)]
    args = [*EXPERTS_ONLY, "--training.mixed_precision_param", "float32", *degrees]
    dims = titan_parallel_dims.ParallelDims(
        dp_replicate=1, dp_shard=world_size, cp=1, tp=1, pp=1, ep=world_size, etp=1,
        world_size=world_size,
    )  # fmt: skip
    model = _build("deepseek_v3", args, dims)
    reference = _build("deepseek_v3", args)
    state = {
        k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()
    }
    reference.load_state_dict(state)

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 2048, (world_size * BATCH, LENGTH), generator=gen)
    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    log = _GroupedMMLog(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logits = model(tokens[mine])
    log.close()
    assert not [w for w in caught if "not consumed" in str(w.message)]
    assert len(log.calls) == 15  # 5 experts modules, 3 weights each, this rank's 4 experts
    assert all(call[2] == 4 for call in log.calls)
    assert sum(call[1] for call in log.calls) == 12  # all but the last block's quantized
    assert torch.equal(logits, reference(tokens)[mine])


@needs_v0_2
def test_v0_2_experts_quantized_under_titans_parallelize_with_fsdp_and_ep():
    run_local(_titan_parallelize_worker, WORLD)
