"""torchtitan 0.3's tensor parallel of the routed experts on the experts blockscale's v0_3
converter converted, on 2 CPU ranks over gloo (integrations/titan/v0_3.py, "Tensor parallel";
ops' grouped_mm, "Tensor parallel").

With TP on and EP off, 0.3's sharding configs split every routed expert's hidden dimension over
the "tp" mesh dim (`moe_sharding.expert_param_placement_dense`: w1_EFD, w3_EFD `Shard(1)`,
w2_EDF `Shard(2)`), and `GroupedExperts.forward` multiplies the local shards (`to_local()`)
through its `_grouped_mm` seam, every token on each rank. Before the converter gave the
experts' GroupedMM an amax reduction there, the converted experts ran quantized on those shards
with no collective: each rank scaled its shard with its own per-expert amaxes, which are not
one process's, and nothing said so (measured: no amax collective, and the weight gradients
below differ).

On the `partial_dtensor` SPMD backend (tests/test_titan_expert_parallel.py says why not
`spmd_types`; on that backend the converted experts refuse hidden shards, last test), the
DeepSeek-V3 debug model's config given TP=2 through `update_from_config` as the trainer gives
it, nvfp4 rounding to nearest (as `_build_v0_3` sets it), against the same weights on one
process fed the same tokens.

One converted experts module (layers.1's, 8 experts, dim 256, hidden 256), parallelized by
torchtitan's own `Module.parallelize` (its sharding config), rank 1's half of w1's hidden rows
scaled up 50x so the two shards' amaxes differ:
- the module's GroupedMM runs three times, quantized, on the local shards (hidden 128);
- amax collectives: 3 in the forward and 3 in the backward (one per grouped GEMM each way: the
  converter reduces every operand of each, w2's whole grad_output included);
- exact: every weight gradient is that rank's slice of one process's, bit for bit. Each
  contracts the tokens, which TP does not split, from operands that are exactly one process's
  slices (shards of whole blocks, amaxes reduced; on the CPU a GEMM of a slice sums in the
  whole GEMM's order);
- not exact, by rounding only: the output and the input's gradient contract the split hidden
  dimension. Each rank's partial product is rounded to BF16 by torchtitan's experts (they
  compute in BF16) and the ranks' partials are then added, where one process rounds their sum
  once. The output is bounded elementwise (below, with its derivation); the input's gradient,
  whose partials (w1's and w3's, each rounded) are not seen here, normwise: within 2^-7 of
  one process's max, measured 3.4e-3;
- with each rank's local amaxes instead (the reduction made the identity), w1's gradient is
  not one process's slice: the test can fail.

The whole model (experts converted only, the last block's kept BF16; the linears unconverted
under torchtitan's TP) under `Module.parallelize` at TP=2: every converted experts module on its
shards with 3 + 3 amax collectives per step, logits within 2^-8 of one process's normwise (the
bound of the 0.2.2 test, whose Llama 4 measured 5.5e-4: the experts' BF16 partial sums, and a
later quantization they move; measured here 4.2e-7); then one MoE block compiled as
torchtitan's `apply_compile` compiles each block (`fullgraph=True`; here AOTAutograd without
Inductor): the compiled graphs hold the experts' amax all-reduces (3 forward, 3 backward), and
logits and every expert gradient equal the eager TP model's, bit for bit.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from test_distributed_tp import counting_all_reduce
from test_titan_expert_parallel import (
    EXPERTS_ONLY_V0_3,
    WEIGHTS_V0_3,
    _build_v0_3,
    _loss,
    _v0_3_parallelism,
)
from test_torchtitan import build_v0_3, needs_v0_3

from blockscale.distributed.launch import run_local

WORLD = 2
EXPERTS = "layers.1.moe.routed_experts.inner_experts"
CONVERTED = [f"layers.{i}.moe.routed_experts.inner_experts" for i in (1, 2, 3, 4)]  # not 5 (BF16)


def _tensor_parallelism(world_size: int) -> tuple[Any, Any]:
    """0.3's parallelism config and dims with TP over all ranks (`partial_dtensor`)."""
    return _v0_3_parallelism(world_size, tensor_parallel_degree=world_size)


@contextmanager
def _collectives() -> Iterator[list[int]]:
    """blockscale's amax all-reduces counted while entered (`counting_all_reduce`: each
    reduction's size), `tp.all_reduce_amax` restored on exit."""
    from blockscale.distributed import tp

    real = tp.all_reduce_amax
    calls, tp.all_reduce_amax = counting_all_reduce()
    try:
        yield calls
    finally:
        tp.all_reduce_amax = real


def _weight_shapes(model: torch.nn.Module) -> tuple[list, list]:
    """Forward pre-hooks on every converted experts module's GroupedMM: (module, quantized,
    weight_t's [E, K, N]) per call; returns the list and the hooks' handles."""
    calls = []

    def hook(fqn, gmm, args):
        calls.append((fqn, gmm.recipe.quantized, tuple(args[1].shape)))

    handles = [
        m.grouped_mm.register_forward_pre_hook(functools.partial(hook, fqn))
        for fqn, m in model.named_modules()
        if hasattr(m, "grouped_mm")
    ]
    return calls, handles


def _module_worker(rank: int, world_size: int) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    from blockscale.distributed import tp

    parallelism, dims = _tensor_parallelism(world_size)
    model = _build_v0_3(EXPERTS_ONLY_V0_3, parallelism)  # sharding configs set, not applied
    reference = model.get_submodule(EXPERTS)
    hidden = reference.w1_EFD.shape[1]
    with torch.no_grad():
        reference.w1_EFD[:, hidden // 2 :] *= 50  # rank 1's half: the shards' amaxes differ
    gen = torch.Generator().manual_seed(1)
    counts = torch.tensor([20, 0, 7, 16, 1, 30, 12, 10])  # uneven groups, one empty
    assert counts.numel() == reference.num_experts
    x = torch.randn(int(counts.sum()), reference.w1_EFD.shape[2], generator=gen)
    grad = torch.randn(x.shape, generator=gen)

    def run(experts: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        x_ = x.clone().requires_grad_()
        out = experts(x_, counts)
        out.backward(grad)
        return out.detach(), x_.grad

    want, want_dx = run(reference)
    rows = slice(rank * hidden // world_size, (rank + 1) * hidden // world_size)
    local = hidden // world_size
    placements = {"w1_EFD": Shard(1), "w2_EDF": Shard(2), "w3_EFD": Shard(1)}
    slices = {"w1_EFD": (slice(None), rows), "w2_EDF": (slice(None), slice(None), rows),
              "w3_EFD": (slice(None), rows)}  # fmt: skip

    def parallel() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, list, list[int]]:
        experts = copy.deepcopy(reference)
        experts.zero_grad(set_to_none=True)
        experts.parallelize(dims)  # torchtitan's own: its sharding config
        for name, placement in placements.items():
            w = getattr(experts, name)
            assert isinstance(w, DTensor) and w.placements == (placement,), (name, w)
            assert w.device_mesh.mesh_dim_names == ("tp",)
        calls, handles = _weight_shapes(experts)
        try:
            with _collectives() as reduced:
                x_ = x.clone().requires_grad_()
                out = experts(x_, counts)
                forward = len(reduced)
                out.backward(grad)
                backward = len(reduced) - forward
        finally:
            for handle in handles:
                handle.remove()
        return experts, out.detach(), x_.grad, calls, [forward, backward]

    experts, out, dx, calls, collectives = parallel()
    e, d = reference.num_experts, x.shape[1]
    # w1, w3, w2, each quantized on this rank's hidden shard
    assert [c[1:] for c in calls] == [(True, (e, d, local)), (True, (e, d, local)),
                                      (True, (e, local, d))], calls  # fmt: skip
    assert collectives == [3, 3], collectives
    for name, part in slices.items():
        got = getattr(experts, name).grad.to_local()
        assert torch.equal(got, getattr(reference, name).grad[part]), name

    partials = out.abs()
    dist.all_reduce(out)  # w2's partial products, as torchtitan's Partial output adds them
    dist.all_reduce(partials)  # |P0| + |P1|
    dist.all_reduce(dx)  # the input's gradient is Partial over "tp" in torchtitan too
    # out = P0 + P1 (FP32 sum of each rank's FP32 GEMM p_r rounded to BF16), want = bf16(q)
    # (one process's FP32 GEMM q). With u = 2^-8 (BF16, to nearest: |P_r - p_r| <= u|P_r|,
    # |q - want| <= u|want|): |out - want| <= u (|P0| + |P1| + |want|) + |p0 + p1 - q| +
    # 2^-24 |out|. p0 + p1 - q: the same exactly quantized products accumulated in FP32 by
    # three GEMMs, each within 1e-6 of its largest output normwise (the emulated GEMM's tested
    # accuracy, NUMERICS_NOTES.md 18), so below 3e-6 < 2^-18 of max(|P0| + |P1| + |want|).
    # Measured: the largest error is 0.95 of the u term alone.
    scale = (partials + want.abs()).max()
    bound = 2.0**-8 * (partials + want.abs()) + 2.0**-24 * out.abs() + 2.0**-18 * scale
    assert ((out - want).abs() <= bound).all(), ((out - want).abs() / bound).max().item()
    error = ((dx - want_dx).abs().max() / want_dx.abs().max()).item()
    assert error <= 2.0**-7, error  # normwise (module docstring); measured 3.4e-3

    # each rank its shards' own amaxes: w1's gradient is no longer one process's slice
    tp.all_reduce_amax, real = (lambda t, group=None: t.float()), tp.all_reduce_amax
    try:
        experts, *_ = parallel()
    finally:
        tp.all_reduce_amax = real
    assert not torch.equal(experts.w1_EFD.grad.to_local(), reference.w1_EFD.grad[:, rows])


@needs_v0_3
def test_v0_3_experts_under_tensor_parallel_match_one_process():
    run_local(_module_worker, WORLD)


def _counting_backend(found: dict[str, int]) -> Any:
    """AOTAutograd without Inductor (aot_eager's compilers) that counts, in the forward and
    backward graphs, the all-reduces of int32 tensors: blockscale's amax reductions (they
    reduce the amaxes' bits, `distributed/_collectives.py`); torchtitan's own are of floats."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def counting(kind: str):
        def compiler(gm: torch.fx.GraphModule, inputs: Any) -> Any:
            found[kind] += sum(
                node.target is torch.ops._c10d_functional.all_reduce.default
                and node.args[0].meta["val"].dtype == torch.int32
                for node in gm.graph.nodes
            )
            return make_boxed_func(gm.forward)

        return compiler

    return aot_autograd(fw_compiler=counting("forward"), bw_compiler=counting("backward"))


def _model_worker(rank: int, world_size: int) -> None:
    from torch.distributed.tensor import DTensor

    parallelism, dims = _tensor_parallelism(world_size)

    def parallelize(model):
        model.parallelize(dims)  # what parallelize_deepseekv3 does for TP on partial_dtensor
        return model

    model = _build_v0_3(EXPERTS_ONLY_V0_3, parallelism, parallelize)
    reference = _build_v0_3(EXPERTS_ONLY_V0_3)
    reference.load_state_dict(
        {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    )
    experts = {n: m for n, m in model.named_modules() if n.endswith("inner_experts")}
    assert [n for n, m in experts.items() if hasattr(m, "grouped_mm")] == CONVERTED
    assert all(isinstance(m.w1_EFD, DTensor) for m in experts.values())

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 2048, (2, 33), generator=gen)  # every rank the whole batch (TP)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def step() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        logits = model(inputs).full_tensor()
        _loss(logits, labels).backward()
        grads = {
            f"{fqn}.{w}": getattr(m, w).grad.to_local() for fqn, m in experts.items()
            for w in WEIGHTS_V0_3
        }  # fmt: skip
        return logits.detach(), grads

    calls, handles = _weight_shapes(model)
    try:
        with _collectives() as reduced:
            logits, grads = step()
    finally:
        for handle in handles:
            handle.remove()
    assert sorted(c[0] for c in calls) == sorted(CONVERTED * 3), calls
    assert all(quantized and 128 in shape[1:] for _, quantized, shape in calls), calls
    assert len(reduced) == 2 * 3 * len(CONVERTED), reduced
    want = reference(inputs).detach()
    error = ((logits - want).abs().max() / want.abs().max()).item()
    assert error <= 2.0**-8, error  # normwise (module docstring); measured 4.2e-7

    # one MoE block compiled as torchtitan's apply_compile compiles each block
    found = {"forward": 0, "backward": 0}
    torch._dynamo.reset()
    torch._dynamo.config.capture_scalar_outputs = True  # apply_compile sets it for MoE
    model.layers["1"].compile(backend=_counting_backend(found), fullgraph=True)
    compiled_logits, compiled_grads = step()
    assert found == {"forward": 3, "backward": 3}, found
    assert torch.equal(compiled_logits, logits)
    for name, grad in grads.items():
        assert torch.equal(compiled_grads[name], grad), name


@needs_v0_3
def test_v0_3_deepseek_v3_under_tensor_parallel_eager_and_compiled():
    run_local(_model_worker, WORLD)


@needs_v0_3
def test_v0_3_hidden_shards_that_cut_blocks_raise():
    """The rule check alone (no ranks): hidden 256 over 32 ranks is 8 a rank, no NVFP4 block;
    over 16 ranks, one block each."""
    from blockscale.integrations.titan.v0_3 import BlockscaleConverter, check_hidden_split

    model = build_v0_3("deepseek_v3", "debugmodel", BlockscaleConverter.Config(recipe="nvfp4"))
    experts = model.get_submodule(EXPERTS)
    check_hidden_split(experts, {"w1_EFD": 256, "w2_EDF": 256, "w3_EFD": 256}, 16)
    with pytest.raises(ValueError, match="w1_EFD splits a dimension of 256.*multiple of 512"):
        check_hidden_split(experts, {"w1_EFD": 256, "w2_EDF": 256, "w3_EFD": 256}, 32)


@needs_v0_3
def test_v0_3_experts_refuse_plain_hidden_shards():
    """torchtitan's default `spmd_types` backend shards the experts' weights as plain local
    tensors (measured at TP=2: [8, 128, 256] tensors for w1_EFD, no DTensor), which blockscale
    cannot reduce over: a ValueError, not each rank scaling its shard alone."""
    from blockscale.integrations.titan.v0_3 import BlockscaleConverter

    model = build_v0_3("deepseek_v3", "debugmodel", BlockscaleConverter.Config(recipe="nvfp4"))
    experts = model.get_submodule(EXPERTS)
    x, counts = torch.randn(16, 256), torch.full((8,), 2)
    experts(x, counts)  # whole weights: runs
    experts.w1_EFD = torch.nn.Parameter(experts.w1_EFD.detach()[:, :128].clone())
    with pytest.raises(ValueError, match="spmd_backend partial_dtensor"):
        experts(x, counts)
