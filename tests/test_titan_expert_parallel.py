"""torchtitan's expert parallelism on the experts blockscale's converters converted, on 2 CPU
ranks over gloo, each against the same converted model on one process fed every rank's tokens.

torchtitan 0.2.2 (`v0_2`): the debug models (DeepSeek-V3, Llama 4) built as torchtitan's
trainer builds them (meta device, the converter, `to_empty`, `init_weights`), then torchtitan's
own `apply_moe_ep_tp` with an EP=2 mesh "ep": each MoE layer's experts become `ExpertParallel`
modules (weights DTensors, `Shard(0)`: 4 whole experts of 8 per rank; tokens dispatched and
combined by all-to-all with uneven splits, which gloo runs). And torchtitan's own parallelize
with dp_shard=2, ep=2 (FSDP2 and EP), forward only.

torchtitan 0.3.0 (`v0_3`): the DeepSeek-V3 debug model, its config given EP=2 through
`update_from_config` as the trainer gives it (the sharding configs: expert weights `Shard(0)` on
"ep", the routed experts' all-to-all dispatch), built on the meta device, parallelized by
torchtitan's own `Module.parallelize` (EP alone) or by its `parallelize_deepseekv3` with
dp_shard=2, ep=2 (FSDP2 and EP, forward and backward: the launcher's SUM reductions stand in for
the PREMUL_SUM gloo lacks, `titan.train`), then `to_empty` and `init_weights`; the one process's
model takes its weights. 0.3's experts forward takes the weights' local shards (`to_local()`) and
calls its `_grouped_mm` seam, which the converted experts' class overrides, so the local experts
run blockscale's grouped GEMM with the converter as it is. Its dispatch
(`AllToAllTokenDispatcher._permute`, plain torch) pads nothing: a local expert's group is rank
0's tokens for it, then rank 1's, which are one process's group for that expert, row for row.
On the `partial_dtensor` SPMD backend: 0.3's default, `spmd_types`, cannot run EP over gloo
(its uneven all-to-all, `spmd_types/_collectives.py` line 920, passes `dist.all_to_all` lists of
unequal tensors, which gloo refuses: "ProcessGroupGloo::alltoall: invalid tensor size"), and
under FSDP2 torch 2.13's `fully_shard` refuses the plain parameters that backend makes
(docs/TORCHTITAN.md).

What is checked against the one process:
- quantized under EP: every converted expert weight reaches blockscale's `GroupedMM` in every
  forward (0.2.2: each weight's own, once; 0.3: the module's one, three times), with the rank's
  4 local experts (torchtitan's 0.2.2 forward alone runs torch's BF16 grouped GEMM there and
  reaches none: the check fails without the converter's `ExpertParallelShards`), and no "not
  consumed" warning;
- the token groups: 0.2.2's EP pads each local expert's group with zero rows (to a multiple of
  8, at least 8), and at least one group here is padded; 0.3's are one process's groups of the
  rank's experts, the same sizes;
- the logits and the experts' gradients (gathered) equal one process's bit for bit: each
  expert's quantizations are its own (per-expert amaxes), EP keeps the token order within a
  group (rank 0's tokens, then rank 1's: one process's stable sort of the same batch), and
  zero rows change no other row's result.

Bit equality needs two choices. The backward rounds to nearest (`nvfp4(stochastic_rounding=
False)`): stochastic rounding draws its noise per call, and the calls' shapes differ between
the runs. And a converted linear's NVFP4 amax is over its whole input, which under EP is the
rank's batch and on one process both ranks' batches: with different tokens per rank only the
experts are converted (the last block's kept BF16, as the default policy keeps it); the default
policy, linears included, is compared with the same tokens on both ranks, where the amaxes
agree.

CPU stand-ins for 0.2.2, as tests/test_torchtitan.py's: torch.histc counts int64 expert indices
on CUDA only (counted from floats here, returned as int64 as CUDA returns them: EP all-to-alls
the counts and splits by their sums), and EP's dispatch computes its padded permutation with a
Triton kernel on CUDA (torchtitan's own CPU version here, `use_cpu=True`). 0.3 needs none beyond
the launcher's (`run_torchtitan_on_cpu`: torchtitan's device the CPU, FSDP2's SUM reductions).
"""

from __future__ import annotations

import functools
import importlib
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from test_torchtitan import build_v0_2_from, build_v0_3, needs_v0_2, needs_v0_3

import blockscale as bs
import blockscale.nn as bsnn
from blockscale.distributed.launch import run_local

WORLD = 2
BATCH, LENGTH = 2, 32  # per rank
RECIPE = bs.recipes.nvfp4(stochastic_rounding=False)
EXPERTS_ONLY = ["--blockscale.fqns", "moe.experts", "--blockscale.bf16_fqns", "layers.5."]
EXPERTS_ONLY_V0_3 = {"fqns": ["moe.routed_experts"], "bf16_fqns": ["layers.5."]}
WEIGHTS_V0_2 = ("w1", "w2", "w3")
WEIGHTS_V0_3 = ("w1_EFD", "w2_EDF", "w3_EFD")


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


def _grouped_mms(model: torch.nn.Module):
    """(name, GroupedMM) of each converted experts module, of either version: 0.2.2's one per
    weight (`grouped_mms`, named `<experts>.w1`, ...), 0.3's one for the three (`grouped_mm`,
    named `<experts>`)."""
    for fqn, module in model.named_modules():
        for weight, gmm in getattr(module, "grouped_mms", {}).items():
            yield f"{fqn}.{weight}", gmm
        gmm = getattr(module, "grouped_mm", None)
        if isinstance(gmm, bsnn.GroupedMM):
            yield fqn, gmm


class _GroupedMMLog:
    """Forward hooks on every converted experts module's GroupedMMs: (name, quantized, E,
    group sizes) per call."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls = []
        self.handles = [
            gmm.register_forward_hook(functools.partial(self._log, name, gmm))
            for name, gmm in _grouped_mms(model)
        ]

    def _log(self, name, gmm, module, args, output):
        input, weight_t, offs = args[:3]
        sizes = torch.diff(offs.long(), prepend=offs.new_zeros(1).long())
        self.calls.append((name, gmm.recipe.quantized, weight_t.shape[0], sizes.tolist()))

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


@contextmanager
def _consumed(model: torch.nn.Module) -> Iterator[_GroupedMMLog]:
    """`model`'s grouped GEMMs logged while entered (the log is yielded); on exit, that no
    converted experts module warned its weights went unconsumed (ran unquantized)."""
    log = _GroupedMMLog(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield log
    log.close()
    assert not [w for w in caught if "not consumed" in str(w.message)]


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum")


def _tokens(same_tokens: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's batch (rank r's: rows [r*BATCH, (r+1)*BATCH)): inputs and labels."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 2048, (WORLD * BATCH, LENGTH + 1), generator=gen)
    if same_tokens:
        tokens[BATCH:] = tokens[:BATCH].repeat(WORLD - 1, 1)
    return tokens[:, :-1], tokens[:, 1:]


def _step_equals_one_process(
    model: torch.nn.Module,
    reference: torch.nn.Module,
    rank: int,
    same_tokens: bool,
    experts: dict[str, torch.nn.Module],
    weights: tuple[str, ...],
    name: str,
) -> tuple[list, list]:
    """A forward and backward of `model` on this rank's tokens and of `reference` (one process)
    on every rank's, their grouped GEMMs logged: the same logits, and the same gradients of
    `experts`' `weights` (gathered), bit for bit. Returns both logs' calls."""
    inputs, labels = _tokens(same_tokens)
    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    with _consumed(model) as log:
        logits = model(inputs[mine])
        _loss(logits, labels[mine]).backward()
    ref_log = _GroupedMMLog(reference)
    expected_logits = reference(inputs)
    _loss(expected_logits, labels).backward()
    ref_log.close()

    assert torch.equal(logits, expected_logits[mine]), name
    for fqn, module in experts.items():
        for w in weights:
            grad = getattr(module, w).grad.full_tensor()  # the same order on every rank
            assert torch.isfinite(grad).all() and grad.abs().sum() > 0, (name, fqn, w)
            expected_grad = reference.get_submodule(fqn).get_parameter(w).grad
            assert torch.equal(grad, expected_grad), (name, fqn, w)
    return log.calls, ref_log.calls


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

    calls, ref_calls = _step_equals_one_process(
        model, reference, rank, same_tokens, experts, WEIGHTS_V0_2, name
    )
    # every converted weight of every experts module, once, on this rank's 4 experts
    expected = sorted(f"{fqn}.{w}" for fqn in experts for w in WEIGHTS_V0_2)
    assert sorted(call[0] for call in calls) == expected, name
    # quantized: all but the last block's (BF16, routed to torch's grouped GEMM)
    quantized = sorted(call[0] for call in calls if call[1])
    assert quantized == [fqn for fqn in expected if not fqn.startswith("layers.5.")], name
    assert all(call[2] == n_experts // world_size for call in calls)
    # EP's padded groups reached the grouped GEMM as they are
    assert all(s >= 8 and s % 8 == 0 for call in calls for s in call[3]), calls
    # some group held zero rows under EP (a local expert's tokens, padded): one process's
    # groups are the same tokens unpadded
    ref_sizes = {call[0]: call[3] for call in ref_calls}
    padded = [
        ep_size > ref_size
        for fqn, _, _, sizes in calls
        for ep_size, ref_size in zip(sizes, ref_sizes[fqn][rank * len(sizes) :], strict=False)
    ]
    assert any(padded), name


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

    inputs, _ = _tokens(same_tokens=False)
    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    with _consumed(model) as log:
        logits = model(inputs[mine])
    assert len(log.calls) == 15  # 5 experts modules, 3 weights each, this rank's 4 experts
    assert all(call[2] == 4 for call in log.calls)
    assert sum(call[1] for call in log.calls) == 12  # all but the last block's quantized
    assert torch.equal(logits, reference(inputs)[mine])


@needs_v0_2
def test_v0_2_experts_quantized_under_titans_parallelize_with_fsdp_and_ep():
    run_local(_titan_parallelize_worker, WORLD)


# torchtitan 0.3.0


def _v0_3_parallelism(world_size: int, **degrees: int) -> tuple[Any, Any]:
    """0.3's parallelism config on the `partial_dtensor` backend (module docstring) and its
    parallel dims, in a rank that has not imported torchtitan yet: the launcher points
    torchtitan at the CPU first, as for its trainer. `degrees`: ParallelismConfig's; by default
    EP over all ranks (on the dp_shard ranks, as its meshes require: dp_shard * cp * tp ==
    efsdp * ep)."""
    from blockscale.integrations.titan.train import run_torchtitan_on_cpu

    run_torchtitan_on_cpu()
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.utils import set_spmd_backend

    degrees = degrees or {
        "data_parallel_shard_degree": world_size,
        "expert_parallel_degree": world_size,
    }
    parallelism = ParallelismConfig(**degrees, spmd_backend="partial_dtensor")
    set_spmd_backend(parallelism.spmd_backend)  # what the trainer does
    dims = ParallelDims.from_config(parallelism, world_size)
    dims.build_mesh()
    return parallelism, dims


def _build_v0_3(options: dict, parallelism: Any = None, parallelize: Any = None) -> Any:
    """The DeepSeek-V3 debug model converted to NVFP4 by the 0.3 converter with `options`, its
    quantized layers then rounding to nearest (module docstring)."""
    from blockscale.integrations.titan.v0_3 import BlockscaleConverter

    converter = BlockscaleConverter.Config(recipe="nvfp4", **options)
    model = build_v0_3("deepseek_v3", "debugmodel", converter, parallelism=parallelism,
                       parallelize=parallelize)  # fmt: skip
    for module in model.modules():
        if isinstance(module, bsnn.Linear | bsnn.GroupedMM) and module.recipe.quantized:
            module.recipe = RECIPE
    return model


def _v0_3_against_one_process(rank: int, model: Any, options: dict, same_tokens: bool) -> None:
    """`model` (parallelized with EP=2) against one process's model with its weights: every
    experts module's weights on the "ep" dim, the converted ones quantized on the rank's 4
    experts, in one process's token groups; the same logits and expert gradients."""
    from torch.distributed.tensor import DTensor, Shard
    from torchtitan.models.common.moe import GroupedExperts

    reference = _build_v0_3(options)
    reference.load_state_dict(
        {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    )
    experts = {n: m for n, m in model.named_modules() if isinstance(m, GroupedExperts)}
    converted = [n for n, m in experts.items() if hasattr(m, "grouped_mm")]
    assert len(experts) == 5 and len(converted) == 4, (list(experts), converted)  # not layers.5
    local = reference.get_submodule(converted[0]).num_experts // WORLD
    for module in experts.values():
        w1 = module.w1_EFD
        assert isinstance(w1, DTensor) and w1.placements[-1] == Shard(0), w1
        assert w1.device_mesh.mesh_dim_names[-1] == "ep" and w1.to_local().shape[0] == local

    calls, ref_calls = _step_equals_one_process(
        model, reference, rank, same_tokens, experts, WEIGHTS_V0_3, "deepseek_v3"
    )
    # the converted modules' GroupedMM, for w1, w3 and w2, quantized, on the local experts
    assert sorted(call[0] for call in calls) == sorted(converted * 3), calls
    assert all(call[1] and call[2] == local for call in calls), calls
    # groups unpadded: one process's groups of this rank's experts (which hold tokens)
    ref_sizes = {call[0]: call[3] for call in ref_calls}
    for fqn, _, _, sizes in calls:
        assert sizes == ref_sizes[fqn][rank * local : (rank + 1) * local], (fqn, sizes)
        assert sum(sizes) > 0


def _v0_3_ep_worker(rank: int, world_size: int, options: dict, same_tokens: bool) -> None:
    """torchtitan's `Module.parallelize` (EP alone: the dense weights stay whole tensors)."""
    parallelism, dims = _v0_3_parallelism(world_size)

    def parallelize(model):
        model.parallelize(dims)
        return model

    model = _build_v0_3(options, parallelism, parallelize)
    _v0_3_against_one_process(rank, model, options, same_tokens)


@needs_v0_3
def test_v0_3_experts_are_quantized_under_expert_parallelism_and_match_one_process():
    """DeepSeek-V3, experts converted (the last block's kept BF16), each rank its own tokens."""
    run_local(_v0_3_ep_worker, WORLD, EXPERTS_ONLY_V0_3, False)


@needs_v0_3
def test_v0_3_default_policy_under_expert_parallelism_matches_one_process():
    """DeepSeek-V3 with the default policy (linears converted too), the same tokens on both
    ranks (module docstring)."""
    run_local(_v0_3_ep_worker, WORLD, {}, True)


def _v0_3_titan_parallelize_worker(rank: int, world_size: int) -> None:
    """torchtitan's own `parallelize_deepseekv3` with dp_shard=2, ep=2: EP, then FSDP2 over the
    blocks (its experts over an "efsdp" dim of 1), FP32 parameters (no mixed-precision cast);
    forward and backward."""
    parallelism, dims = _v0_3_parallelism(world_size)  # before torchtitan's first import
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.models.deepseek_v3.parallelize import parallelize_deepseekv3

    training = TrainingConfig(mixed_precision_param="float32")

    def parallelize(model):
        return parallelize_deepseekv3(
            model, parallel_dims=dims, training=training, parallelism=parallelism,
            compile_config=CompileConfig(), ac_config=None, dump_folder="",
        )  # fmt: skip

    model = _build_v0_3(EXPERTS_ONLY_V0_3, parallelism, parallelize)
    _v0_3_against_one_process(rank, model, EXPERTS_ONLY_V0_3, False)


@needs_v0_3
def test_v0_3_experts_quantized_under_titans_parallelize_with_fsdp_and_ep():
    run_local(_v0_3_titan_parallelize_worker, WORLD)
