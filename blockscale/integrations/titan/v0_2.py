"""blockscale's converter for torchtitan 0.2.2 (the last release with Llama 4), which converts
the built model, on the meta device, before it parallelizes and materializes it.

Importing this module registers `BlockscaleConverter` as the model converter "blockscale", the
way torchtitan 0.2.2 takes outside converters:

    --experimental.custom_import blockscale.integrations.titan.v0_2 --model.converters blockscale

Options come from the job config's `[blockscale]` section where the job config has one
(`--job.custom_config_module blockscale.integrations.titan.v0_2` adds it, from `JobConfig`
below: `--blockscale.recipe mxfp8`, `--blockscale.bf16_fqns output`, ...); without it the
defaults apply (nvfp4, the package's layer policy).

The conversion is `blockscale.nn.convert` with `TitanPolicy`: torchtitan 0.2.2's linears are
`nn.Linear`s, and its `GroupedExperts` call `torch._grouped_mm` on their 3D weights, which
`convert` routes to blockscale's grouped GEMM. Without expert parallelism, 0.2.2's
`GroupedExperts.forward` pads each expert's token group to a multiple of 8 rows (a gather
through indices a Triton kernel computes, on CUDA only) for torch's grouped GEMM; blockscale's
takes any group size, so the experts the converter routes (all of them: `convert` routes the
BF16 tail's experts through `torch._grouped_mm` itself) skip that padding
(`UnpaddedGroupedExperts`: the same products, without the gather and its scatter back).
Unverified on a GPU: whether torch's BF16 grouped GEMM takes unpadded groups there.

Expert parallelism (torchtitan's `ExpertParallel`: each expert weight a DTensor sharded whole
experts over the mesh dim "ep", `Shard(0)`). torchtitan's forward takes the local shards with
`to_local()` and calls `_run_experts_grouped_mm` on them; the router cannot follow `to_local`
(an autograd Function, which no torch-function mode sees), so under that forward the converted
experts run torch's BF16 grouped GEMM, unquantized (the router's "not consumed" warning says
so). The converter therefore puts `ExpertParallelShards` in front of each converted experts
class: while the weights are such DTensors, the forward binds their local shards (`to_local()`,
differentiable: the gradients reach the DTensor parameters as under torchtitan's forward) as
the module's weights, and the routed forward quantizes the local experts as it does without
EP. Token groups arrive in EP's layout (torchtitan's dispatch permutes and pads each local
expert's group with zero rows to a multiple of 8, at least 8; rows past the last group are
left over): blockscale's grouped GEMM takes those groups as they are, zero rows change neither
an expert's amax nor another row's result (zero output, zero gradient), and EP's combine drops
them. Every expert's quantizations are its own (per-expert amaxes), and EP keeps the token
order within a group, so with experts split whole across ranks a rank computes, bit for bit,
what one process computes for those experts from the same tokens (rounding to nearest;
tests/test_titan_expert_parallel.py).

Tensor parallel of the experts (torchtitan's `TensorParallel` where TP is on and EP off, and
`ExpertTensorParallel`'s second mesh dim with both): each rank holds a slice of every expert's
hidden dimension (w1, w3 `Shard(1)`, w2 `Shard(2)`) and every token. `ExpertParallelShards`
binds those local shards too, and gives each weight's `GroupedMM` the amax reduction over that
mesh dim (grouped_mm's "Tensor parallel": w1 and w3 column-wise, w2 row-wise), so every
quantized operand is that part of one process's operand, bit for bit; the products that
contract the hidden dimension (w2's output, the input's gradient) are partial sums that
torchtitan's layouts add up, as in its own forward. The slice must hold whole blocks (16 for
NVFP4, 32 for MXFP8; checked at the first forward, with an error naming the rule). Weights
placed any other way keep torchtitan's own forward, in BF16 (the router warns).

gpt-oss (`GptOssGroupedExperts`, a class of its own in 0.2.2: fused gate / up weight, biases,
a clamped SwiGLU; `torch._grouped_mm` on its two 3D weights, the biases added in BF16 between
and after): `convert` routes its two weights as any experts module's, so each quantized
expert weight computes what blockscale's grouped GEMM computes, the biases and the activation
as torchtitan has them. Its forward pads the token groups as `GroupedExperts.forward` does,
through the same CUDA-only kernel, so the converter skips it as it does there
(`UnpaddedGptOssGroupedExperts`: torchtitan's `_run_experts_grouped_mm` of gpt-oss on the
unpadded groups). Under expert or tensor parallelism gpt-oss's experts stay in BF16, with a
logged reason (`gpt_oss_parallel_reason`): `ExpertParallelShards` binds `w1`, `w2`, `w3`,
and gpt-oss's forward also reads its TP degree off its DTensor weights (its second bias is
divided by it), so binding local shards would add that bias once a rank. Their routed
`GroupedMM`s (BF16) are kept on the model root as the other experts' are, so torchtitan's
experts partition functions, which read the weights off every submodule, still run.

Under FSDP (`parallel_dims.fsdp_enabled`: dp_shard or cp above 1, the condition on which
torchtitan's parallelize calls `fully_shard`) the converter also calls
`blockscale.distributed.enable_quantized_all_gather` on the converted meta model, so FSDP2
all-gathers the converted linears' weights as NVFP4 / MXFP8 codes and scales; their
`ShardedWeight`s survive the trainer's `to_empty` and `init_weights`. Not under tensor or
pipeline parallelism (`quantized_all_gather_reason`; the log says which): there the weights
gather in torchtitan's mixed-precision dtype.
"""

import functools
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torchtitan.models.gpt_oss.model.moe import GptOssGroupedExperts
from torchtitan.models.gpt_oss.model.moe import (
    _run_experts_grouped_mm as _run_gpt_oss_experts_grouped_mm,
)
from torchtitan.models.moe.moe import GroupedExperts, _run_experts_grouped_mm
from torchtitan.protocols.model_converter import register_model_converter

import blockscale.nn as bsnn
from blockscale.distributed.tp import COLWISE, ROWWISE, expert_reductions, largest_block
from blockscale.integrations.titan import (
    DEFAULT_BF16_TAIL_FRACTION,
    DEFAULT_RECIPE,
    TitanPolicy,
    gather_quantized_unless,
    titan_policy,
)
from blockscale.recipes import get as get_recipe

NAME = "blockscale"
logger = logging.getLogger(__name__)


@dataclass
class Blockscale:
    """The `[blockscale]` job config section."""

    recipe: str = DEFAULT_RECIPE
    """blockscale recipe: nvfp4, mxfp8, nvfp4_fwd_mxfp8_bwd (bf16 converts nothing)."""
    bf16_tail_fraction: float = DEFAULT_BF16_TAIL_FRACTION
    """Fraction of the blocks, counted from the last, kept in BF16 (experts included)."""
    fqns: list[str] = field(default_factory=list)
    """Convert only layers whose fqn contains one of these (replaces the tail rule)."""
    bf16_fqns: list[str] = field(default_factory=list)
    """Keep layers whose fqn contains one of these in BF16."""
    weight_cache: bool = True
    """False (`--blockscale.no_weight_cache`): the converted layers keep no quantized weight
    copies between uses (ops/weight_cache.py). Then nothing holds a copy from the forward to
    the backward (with BF16 weights, NVFP4's 16x16 expert copies, kept otherwise from the
    second step: docs/TORCHTITAN.md, "Llama 4 on a GPU"), at one more quantization of each
    such weight in the backward."""


@dataclass
class JobConfig:
    """What `--job.custom_config_module blockscale.integrations.titan.v0_2` adds to the job
    config. (This module's annotations are evaluated, not postponed: torchtitan resolves them
    in a dataclass it builds elsewhere, where `Blockscale` is no name.)"""

    blockscale: Blockscale = field(default_factory=Blockscale)


class UnpaddedGroupedExperts(GroupedExperts):
    """0.2.2's `GroupedExperts` without its token-group padding (module docstring)."""

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        if isinstance(self.w1, DTensor) or not self.use_grouped_mm:
            return super().forward(x, num_tokens_per_expert)
        return _run_experts_grouped_mm(self.w1, self.w2, self.w3, x, num_tokens_per_expert)


class UnpaddedGptOssGroupedExperts(GptOssGroupedExperts):
    """0.2.2's gpt-oss experts without their token-group padding (module docstring, "gpt-oss")."""

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        if isinstance(self.mlp1_weight, DTensor) or not self.use_grouped_mm:
            return super().forward(x, num_tokens_per_expert)
        return _run_gpt_oss_experts_grouped_mm(
            self.mlp1_weight, self.mlp1_bias, self.mlp2_weight, self.mlp2_bias,
            self.swiglu_limit, x, num_tokens_per_expert,
        )  # fmt: skip


UNPADDED = {
    GroupedExperts: UnpaddedGroupedExperts,
    GptOssGroupedExperts: UnpaddedGptOssGroupedExperts,
}


def gpt_oss_parallel_reason(parallel_dims: Any) -> str | None:
    """Why the converter keeps gpt-oss's experts in BF16 under `parallel_dims`, or None
    (module docstring, "gpt-oss")."""
    if parallel_dims is None or not (parallel_dims.ep_enabled or parallel_dims.tp_enabled):
        return None
    return (
        "gpt-oss's experts under expert or tensor parallelism (blockscale runs the local "
        "shards of GroupedExperts' w1, w2, w3 only; gpt-oss's forward also divides a bias by "
        "the TP degree it reads off its DTensor weights)"
    )


EXPERT_WEIGHTS = ("w1", "w2", "w3")
# Each weight's placement on a mesh dim that splits the hidden dimension (torchtitan's
# `TensorParallel` / `ExpertTensorParallel`): w1, w3 [E, hidden, dim] column-wise, w2
# [E, dim, hidden] row-wise.
HIDDEN_SHARDS = (Shard(1), Shard(2), Shard(1))


@dataclass
class ExpertShards:
    """The local shards (`to_local()`) of an experts module's weights, and where the hidden
    dimension is split, the amax reduction of each weight's grouped GEMM (module docstring,
    "Tensor parallel")."""

    weights: dict[str, torch.Tensor]
    reductions: dict[str, Any] | None = None  # weight -> blockscale.ops.AmaxReduction


def expert_shards(module: nn.Module) -> ExpertShards | None:
    """`module`'s expert weights as `ExpertShards` where all are DTensors on one mesh whose
    dims either split whole experts (named "ep", every weight `Shard(0)`) or split the hidden
    dimension (one dim, `HIDDEN_SHARDS`), else None (torchtitan's own forward then runs)."""
    weights = [module._parameters.get(name) for name in EXPERT_WEIGHTS]
    if not all(isinstance(w, DTensor) for w in weights):
        return None
    mesh = weights[0].device_mesh
    if any(w.device_mesh != mesh for w in weights):
        return None
    names = mesh.mesh_dim_names or (None,) * mesh.ndim
    hidden_dim = None
    for dim, name in enumerate(names):
        placements = tuple(w.placements[dim] for w in weights)
        if name == "ep" and placements == (Shard(0),) * 3:
            continue
        if placements == HIDDEN_SHARDS and hidden_dim is None:
            hidden_dim = dim
            continue
        return None
    if hidden_dim is None and "ep" not in names:
        return None
    local = {name: w.to_local() for name, w in zip(EXPERT_WEIGHTS, weights, strict=True)}
    if hidden_dim is None:
        return ExpertShards(local)
    check_hidden_shards(module, local, mesh.size(hidden_dim))
    return ExpertShards(local, expert_reductions(mesh.get_group(hidden_dim)))


def check_hidden_shards(module: nn.Module, local: dict[str, torch.Tensor], ranks: int) -> None:
    """Raise a ValueError naming the rule unless each rank's slice of the hidden dimension
    holds whole blocks of every quantized copy that runs along it: w1 / w3's rows (the
    weights' 16x16 or 1x16-along-N copies, grad_output's row copies) and w2's columns (its
    input's and weight's copies along K)."""
    hidden = local["w2"].shape[2]
    for name, gmm in module.grouped_mms.items():
        recipe = gmm.recipe
        if not (gmm.quantize_enabled and recipe.quantized):
            continue
        block = largest_block(recipe, ROWWISE if name == "w2" else COLWISE)
        if hidden % block:
            raise ValueError(
                f"{type(module).__name__} under tensor parallel over {ranks} ranks: each rank "
                f"holds {hidden} of the experts' hidden dimension, not a multiple of {block} "
                f"(recipe {recipe.name}: {name}'s blocks run along it and a shard must hold "
                f"whole blocks); the hidden dimension must be a multiple of {block * ranks}"
            )


@contextmanager
def _shards_bound(module: nn.Module, shards: ExpertShards) -> Iterator[None]:
    old = {name: module._parameters[name] for name in shards.weights}
    module._parameters.update(shards.weights)
    for name, reduction in (shards.reductions or {}).items():
        module.grouped_mms[name].amax_reduction = reduction
    try:
        yield
    finally:
        module._parameters.update(old)
        for name in shards.reductions or {}:
            module.grouped_mms[name].amax_reduction = None


class ExpertParallelShards:
    """Put in front of a converted `UnpaddedGroupedExperts`' class: under expert or tensor
    parallelism the routed forward runs on the weights' local shards, so they are quantized
    (module docstring, "Expert parallelism", "Tensor parallel")."""

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        shards = expert_shards(self) if self.use_grouped_mm else None
        if shards is None:
            return super().forward(x, num_tokens_per_expert)
        return _forward_on_shards(self, shards, x, num_tokens_per_expert)


@torch.compiler.disable
def _forward_on_shards(
    module: nn.Module, shards: ExpertShards, *args: torch.Tensor
) -> torch.Tensor:
    # eager (torchtitan's apply_compile leaves the experts out): Dynamo is kept out of the
    # module's parameter swap
    with _shards_bound(module, shards):
        return super(ExpertParallelShards, module).forward(*args)


@functools.cache
def _expert_parallel_class(cls: type[nn.Module]) -> type[nn.Module]:
    return type(cls.__name__, (ExpertParallelShards, cls), {"__module__": __name__})


HELD_AT = "blockscale_grouped_mms"


def hold_grouped_mms_at_root(model: nn.Module) -> int:
    """Move each converted experts module's `grouped_mms` (the GroupedMM children `convert`
    gives it) to a ModuleDict `HELD_AT` on the model, keyed by the experts' fqn (dots as
    dashes); the experts module keeps a plain reference, which its routed forward reads.
    torchtitan's `TensorParallel` of the experts runs its partition function on every
    submodule of the experts module and reads `w1`, `w2`, `w3` off each, so with any child
    module there the model cannot be parallelized; on the model the GroupedMMs are still
    found by `model.modules()` (set_precision, the weight caches' clearing) and hold no
    state. Returns how many experts modules were changed."""
    moved = [
        (fqn, module)
        for fqn, module in model.named_modules()
        if isinstance(module, tuple(UNPADDED.values())) and "grouped_mms" in module._modules
    ]
    if not moved:
        return 0
    held = model._modules.get(HELD_AT)
    if held is None:
        held = nn.ModuleDict()
        model.add_module(HELD_AT, held)
    for fqn, module in moved:
        grouped_mms = module._modules.pop("grouped_mms")
        module.__dict__["grouped_mms"] = grouped_mms
        held[fqn.replace(".", "-")] = grouped_mms
    return len(moved)


def model_policy(model: nn.Module, options: Blockscale) -> TitanPolicy:
    """`TitanPolicy` for a built torchtitan model (its blocks: `model.layers`)."""
    layers = getattr(model, "layers", None)
    if isinstance(layers, nn.ModuleDict):
        names = list(layers.keys())
    else:
        names = [str(i) for i in range(len(layers or ()))]
    return titan_policy(names, options.bf16_tail_fraction, options.fqns, options.bf16_fqns)


def quantized_all_gather_reason(parallel_dims: Any) -> str | None:
    """Why torchtitan's parallelization leaves the converted linears' FSDP2 all-gather in high
    precision, or None when it takes the quantized one (module docstring)."""
    if parallel_dims is None or not parallel_dims.fsdp_enabled:
        return "no FSDP sharding (dp_shard and cp are 1)"
    if parallel_dims.tp_enabled:
        return "tensor parallelism shards the weights before FSDP"
    if parallel_dims.pp_enabled:
        return "pipeline parallelism deep-copies the model, which a ShardedWeight does not allow"
    return None


class BlockscaleConverter:
    """torchtitan 0.2.2's `ModelConverter` for blockscale's recipes (module docstring)."""

    def __init__(self, job_config: Any, parallel_dims: Any) -> None:
        self.options = getattr(job_config, "blockscale", None) or Blockscale()
        self.recipe = get_recipe(self.options.recipe)  # an unknown name fails before a build
        self.parallel_dims = parallel_dims

    def convert(self, model: nn.Module) -> None:
        if not self.recipe.quantized:
            return
        policy = model_policy(model, self.options)
        for module in model.modules():
            if type(module) in UNPADDED:
                # convert routes every experts module (BF16 ones through torch's grouped GEMM)
                module.__class__ = UNPADDED[type(module)]
        kept = gpt_oss_parallel_reason(self.parallel_dims)

        def wanted(module: nn.Module, fqn: str) -> bool:
            if kept is None or not isinstance(module, GptOssGroupedExperts):
                return policy(module, fqn)
            if policy(module, fqn):
                logger.warning("%s stays in high precision: %s", fqn, kept)
            return False

        bsnn.convert(model, self.recipe, module_filter_fn=wanted)
        if not self.options.weight_cache:
            bsnn.set_weight_cache(model, False)
        for module in model.modules():
            routed = isinstance(module, UnpaddedGroupedExperts) and hasattr(module, "grouped_mms")
            if routed and not isinstance(module, ExpertParallelShards):
                module.__class__ = _expert_parallel_class(type(module))
        hold_grouped_mms_at_root(model)
        gather_quantized_unless(model, quantized_all_gather_reason(self.parallel_dims), logger)

    def post_optimizer_hook(self, model: nn.Module | list[nn.Module]) -> None:
        """Nothing: every step quantizes the weights the optimizer has just written (the
        converted layers' caches last one forward and its backward), so there is no state to
        refresh after a step. torchtitan calls this hook on every converter."""


register_model_converter(BlockscaleConverter, NAME)
