"""torchtitan 0.2.2's tensor parallel of the experts on the experts blockscale's v0_2 converter
converted, on 2 CPU ranks over gloo (integrations/titan/v0_2.py, "Tensor parallel"; ops'
grouped_mm, "Tensor parallel").

One experts module (the Llama 4 debug model's, converted, nvfp4 rounding to nearest) under
torchtitan's own `TensorParallel` style (w1, w3 `Shard(1)`, w2 `Shard(2)` over a "tp" mesh,
every token on each rank), against the same module on one process, fed the same tokens:
- every weight reaches a quantized `GroupedMM` on its local shard (no "not consumed" warning);
- the amaxes are reduced: 3 collectives in the forward (one per weight) and 2 in the backward
  (w1's and w3's grad_output shards); w2's grad_output is whole;
- every weight gradient is that rank's slice of one process's, bit for bit: each contracts the
  tokens, which TP does not split, from operands that are exactly one process's slices
  (whole blocks, amaxes reduced; on the CPU a GEMM of a slice sums in the whole GEMM's order);
- the output and the input's gradient contract the split hidden dimension: a sum of two
  partial products, each rank's rounded to BF16 by torchtitan's experts, so they differ from
  one process by rounding only (the output within an elementwise bound, the gradient
  normwise);
- with each rank's local amaxes instead of the reduced ones, the weight gradients are not one
  process's: half of w1's hidden rows (rank 1's) are scaled up 50x, so the shards' amaxes
  differ.

And the whole debug model through torchtitan's own `parallelize_llama`: at TP=2 (its MoE blocks
included): every experts module runs on its shards (the last block's in BF16, by the layer
policy), no "not consumed" warning, logits within 2^-8 relative of one process (its BF16
partial sums), a backward with finite gradients; and on 4 ranks with dp_shard=2, tp=2, ep=2,
etp=2 (`ExpertTensorParallel`: each rank pair holds 4 whole experts, each rank half their
hidden dimension), experts converted only, forward: every experts module on its 4 local
experts' shards, logits within 2^-8 relative of one process.
"""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
import torch.nn.functional as F
from test_titan_expert_parallel import (
    BATCH,
    EXPERTS_ONLY,
    RECIPE,
    _build,
    _consumed,
    _cpu_stand_ins,
    _tokens,
)
from test_torchtitan import build_v0_2_from, copy_whole_into, needs_v0_2

from blockscale.distributed.launch import run_local

WORLD = 2
TOKENS = 96


def _experts_and_tokens():
    """The first converted experts module of the Llama 4 debug model (8 experts, hidden 512),
    rank 1's half of w1's hidden rows scaled up 50x, and sorted tokens with uneven groups."""
    from blockscale.integrations.titan.v0_2 import UnpaddedGroupedExperts

    model = _build("llama4", EXPERTS_ONLY)
    experts = next(m for m in model.modules() if isinstance(m, UnpaddedGroupedExperts))
    hidden = experts.w1.shape[1]
    with torch.no_grad():
        experts.w1[:, hidden // 2 :] *= 50
    gen = torch.Generator().manual_seed(1)
    counts = torch.tensor([20, 0, 7, 16, 1, 30, 12, 10])
    assert counts.sum() == TOKENS and counts.numel() == experts.num_experts
    x = torch.randn(TOKENS, experts.w1.shape[2], generator=gen)
    grad = torch.randn(TOKENS, experts.w1.shape[2], generator=gen)
    return experts, x, counts, grad


def _run(experts, x, counts, grad):
    x = x.clone().requires_grad_()
    with _consumed(experts) as log:
        out = experts(x, counts)
        out.backward(grad)
    return out.detach(), x.grad, log.calls


def _assert_close(got, want, what, relative=1e-5):
    error = ((got - want).abs().max() / want.abs().max()).item()
    assert error <= relative, (what, error)


def _module_worker(rank: int, world_size: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from torchtitan.distributed.expert_parallel import TensorParallel

    from blockscale.distributed import tp

    reference, x, counts, grad = _experts_and_tokens()
    assert all(g.recipe == RECIPE for g in reference.grouped_mms.values())
    want, want_dx, _ = _run(reference, x, counts, grad)
    hidden = reference.w1.shape[1]
    rows = slice(rank * hidden // world_size, (rank + 1) * hidden // world_size)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))

    def parallel(reduce_amax):
        experts = copy.deepcopy(reference)
        experts.zero_grad()
        parallelize_module(experts, mesh, TensorParallel())
        calls = []

        def counted(t, group=None):
            calls.append(t.numel())
            return reduce_amax(t, group)

        tp.all_reduce_amax = counted  # read at each reduction
        try:
            out, dx, gmm_calls = _run(experts, x, counts, grad)
        finally:
            tp.all_reduce_amax = real
        magnitude = out.abs()
        dist.all_reduce(out)  # w2's partial products
        dist.all_reduce(magnitude)  # |partial 0| + |partial 1|
        return experts, out, magnitude, dx, calls, gmm_calls

    real = tp.all_reduce_amax
    experts, out, magnitude, dx, calls, gmm_calls = parallel(real)
    assert sorted(call[0] for call in gmm_calls) == [".w1", ".w2", ".w3"]
    assert all(quantized for _, quantized, _, _ in gmm_calls), gmm_calls
    # forward: w1, w3 (weight), w2 (input row and token copies, weight); backward: w1, w3
    assert len(calls) == 5, calls
    for name, part in (("w1", (slice(None), rows)), ("w3", (slice(None), rows)),
                       ("w2", (slice(None), slice(None), rows))):  # fmt: skip
        local = getattr(experts, name).grad.to_local()
        assert torch.equal(local, getattr(reference, name).grad[part]), name
    # torchtitan's experts compute in BF16 (`_run_experts_grouped_mm`): each rank's partial
    # output is rounded to BF16 (u = 2^-8 relative), then the two are added, where one process
    # rounds their sum once; FP32's own roundings are far below (the 2^-7 margin)
    bound = 2.0**-8 * (magnitude + want.abs()) * (1 + 2.0**-7)
    assert ((out - want).abs() <= bound).all(), ((out - want).abs() / bound).max().item()
    # the input's gradient is such a sum too (each rank's BF16 partial, all-reduced by
    # torchtitan's input layout), whose partials are not seen here: normwise, measured 3e-3
    _assert_close(dx, want_dx, "grad_input", relative=2.0**-6)

    # each rank its shards' own amaxes: the weight gradients are no longer one process's
    local_only = lambda t, group=None: t.float()  # noqa: E731
    experts, *_ = parallel(local_only)
    assert not torch.equal(experts.w1.grad.to_local(), reference.w1.grad[:, rows])


@needs_v0_2
def test_v0_2_experts_under_titans_tensor_parallel_match_one_process():
    run_local(_module_worker, WORLD)


def _model_worker(rank: int, world_size: int) -> None:
    import torchtitan.distributed.parallel_dims as titan_parallel_dims
    from torch.distributed.tensor import DTensor
    from torchtitan.config import ConfigManager

    from blockscale.integrations.titan.v0_2 import ExpertParallelShards

    _cpu_stand_ins()
    titan_parallel_dims.device_type = "cpu"  # torchtitan builds its meshes on "cuda" otherwise
    spec = importlib.import_module("torchtitan.models.llama4").get_train_spec()
    args = ["--model.converters", "blockscale", "--training.mixed_precision_param", "float32",
            "--parallelism.disable_loss_parallel"]  # fmt: skip
    job_config = ConfigManager().parse_args(args)
    dims = titan_parallel_dims.ParallelDims(
        dp_replicate=1, dp_shard=1, cp=1, tp=world_size, pp=1, ep=1, etp=1, world_size=world_size
    )
    parallel, reference = (build_v0_2_from(spec, job_config, d) for d in (dims, None))
    copy_whole_into(parallel, reference)
    experts = [m for m in parallel.modules() if isinstance(m, ExpertParallelShards)]
    assert len(experts) == 3 and all(isinstance(m.w1, DTensor) for m in experts), len(experts)

    tokens = torch.randint(0, 2048, (2, 65), generator=torch.Generator().manual_seed(0))
    want = reference(tokens[:, :-1]).detach()
    with _consumed(parallel) as log:
        logits = parallel(tokens[:, :-1])
    assert len(log.calls) == 9  # 3 experts modules (every other block) x 3 weights, local shards
    assert sum(call[1] for call in log.calls) == 6  # the last block's kept BF16 (policy)
    # the experts' partial outputs are rounded to BF16 on each rank (see the module test), and
    # a moved value may move a later quantization by a code: measured 5.5e-4 relative
    _assert_close(logits, want, "logits", relative=2.0**-8)
    F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
    for name, p in parallel.named_parameters():
        assert p.grad is not None and bool(p.grad.full_tensor().isfinite().all()), name


@needs_v0_2
def test_v0_2_llama4_moe_under_titans_tensor_parallel():
    run_local(_model_worker, WORLD)


@needs_v0_2
def test_a_hidden_shard_that_cuts_blocks_raises():
    """The rule check alone (no ranks): 24 hidden columns a rank is no multiple of 16."""
    from blockscale.integrations.titan import v0_2

    experts, *_ = _experts_and_tokens()
    local = {"w1": experts.w1[:, :24], "w2": experts.w2[:, :, :24], "w3": experts.w3[:, :24]}
    with pytest.raises(ValueError, match="multiple of 16"):
        v0_2.check_hidden_shards(experts, local, 2)


def _expert_tensor_parallel_worker(rank: int, world_size: int) -> None:
    """torchtitan's own parallelize with dp_shard=2, tp=2, ep=2, etp=2 on 4 ranks: the
    experts under `ExpertTensorParallel` (a mesh ("ep", "etp"): 4 whole experts of 8 a rank
    pair, each rank half of their hidden dimension), the rest under TP and FSDP2. Experts
    converted only (`EXPERTS_ONLY`: the linears' amaxes would be over each rank's batch).
    Forward only, as test_titan_expert_parallel's FSDP2 run (gloo has no PREMUL_SUM)."""
    import torchtitan.distributed.parallel_dims as titan_parallel_dims
    from torch.distributed.tensor import DTensor

    _cpu_stand_ins()
    titan_parallel_dims.device_type = "cpu"  # torchtitan builds its meshes on "cuda" otherwise
    degrees = {"data_parallel_shard": 2, "tensor_parallel": 2, "expert_parallel": 2,
               "expert_tensor_parallel": 2}  # fmt: skip
    args = [*EXPERTS_ONLY, "--training.mixed_precision_param", "float32",
            "--parallelism.disable_loss_parallel"]  # fmt: skip
    for name, degree in degrees.items():
        args += [f"--parallelism.{name}_degree", str(degree)]
    dims = titan_parallel_dims.ParallelDims(
        dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=1, ep=2, etp=2, world_size=world_size
    )
    model = _build("llama4", args, dims)
    reference = _build("llama4", args)
    state = {
        k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()
    }
    reference.load_state_dict(state)
    experts = [m for m in model.modules() if hasattr(m, "grouped_mms")]
    assert len(experts) == 3
    # (held by FSDP2 over "efsdp", 1 rank; unsharded in the forward to the ("ep", "etp") mesh)
    assert all(m.w1.device_mesh.mesh_dim_names == ("efsdp", "ep", "etp") for m in experts)

    inputs, _ = _tokens(same_tokens=False)
    mine = slice(rank // 2 * BATCH, (rank // 2 + 1) * BATCH)  # the TP pair shares a batch
    with _consumed(model) as log:
        logits = model(inputs[mine])
    assert len(log.calls) == 9 and all(call[2] == 4 for call in log.calls)  # 4 local experts
    assert sum(call[1] for call in log.calls) == 6  # the last block's kept BF16
    # BF16 partial sums over the hidden halves, as in the TP model test
    _assert_close(logits, reference(inputs)[mine], "logits", relative=2.0**-8)


@needs_v0_2
def test_v0_2_experts_under_titans_expert_tensor_parallel():
    run_local(_expert_tensor_parallel_worker, 4)
