"""Converted linears under torch's own ColwiseParallel / RowwiseParallel (the styles torchtitan's
parallelize functions apply), on 2 gloo ranks: they must compute what blockscale's
QuantizedColwiseParallel / QuantizedRowwiseParallel compute (blockscale.distributed.tp,
`forward_on_dtensors`), which tests/test_distributed_tp.py holds against one process.

- test_distributed_tp's MLP (fc1 column-wise, fc2 row-wise, biases, shards 50x apart in
  magnitude) under both plans: output, the input's gradient and every parameter's gradient
  equal bit for bit, with the same number of amax all-reduces, for nvfp4 (stochastic rounding
  off, and on with the same seed), mxfp8 and nvfp4_fwd_mxfp8_bwd; the same with
  sequence-parallel layouts (tokens sharded between the pairs), but for fc2's grad_bias there
  (`tp._torch_style_layout`: torch's style reduces the output whole before the bias, then
  shards it, so that gradient sums the 40 tokens at once; within the FP32 bound of
  test_distributed_tp for two orders of one sum). A bf16 recipe and a layer
  switched to BF16 by `set_precision` compute torch's DTensor F.linear: the unconverted
  model's bits.
- torch.compile(fullgraph=True) of the torch-style plan gives eager's bits (output, the
  input's and the weights' gradients, as test_distributed_tp compares the quantized styles).
- what is not one of those two layouts raises a ValueError that says which layouts are taken
  (a replicated weight, a 2-D mesh, a column-wise layer handed a sharded input), and a shard
  that cuts blocks raises `check_shards`' error at the first forward.
- a process that never imported blockscale.distributed.tp runs the plan: the forward is
  reached through the hook `blockscale.distributed` registers on import.
- torchtitan 0.2.2's Llama 4 debug model, converted by blockscale's converter and parallelized
  by torchtitan's own `parallelize_llama` (TP=2), every block dense: one amax all-reduce per
  converted linear and forward, the first column-wise output one device's bit for bit, the
  logits within 1e-5 relative of the unparallelized converted model's (row-wise sums round
  in FP32 otherwise; with the amaxes left local, 4e4 times farther), a backward with finite
  gradients. Not its MoE blocks: torchtitan's experts TensorParallel distributes every
  submodule's `w1`/`w2`/`w3`, and a converted experts module's `grouped_mms` ModuleDict
  (nn/experts.py) has entries of those names ("'GroupedMM' object has no attribute
  'is_leaf'"); experts kept in BF16 are routed too, so no converter option avoids it.
"""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from test_distributed_tp import (
    ALL_REDUCES_PER_STEP,
    PLAN,
    RECIPES,
    WORLD,
    _assert_within,
    _bound,
    _data,
    _mlp,
    compile_worker,
    counting_all_reduce,
)
from test_torchtitan import build_v0_2_from, copy_whole_into, needs_v0_2, unwrapped
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import blockscale as bs
from blockscale.distributed import QuantizedColwiseParallel, QuantizedRowwiseParallel, tp
from blockscale.distributed.launch import run_local

TORCH_PLAN = {"0": ColwiseParallel(), "2": RowwiseParallel()}
SEQUENCE_PLANS = (
    {
        "0": QuantizedColwiseParallel(input_layouts=Shard(1)),
        "2": QuantizedRowwiseParallel(output_layouts=Shard(1)),
    },
    {"0": ColwiseParallel(input_layouts=Shard(1)), "2": RowwiseParallel(output_layouts=Shard(1))},
)


def _step(model: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    """Output, the input's gradient and every parameter's whole gradient of one step, with the
    default generator seeded alike (stochastic rounding draws from it)."""
    torch.manual_seed(2)
    x = x.clone().requires_grad_()
    out = model(x)
    out.backward(grad)
    grads = [p.grad for p in model.parameters()]
    assert all(isinstance(g, DTensor) for g in grads)
    return [out, x.grad, *(g.full_tensor() for g in grads)]


def _assert_same_bits(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    names = ["output", "grad_input", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert len(got) == len(want)
    for name, a, b in zip(names, got, want, strict=False):  # the SP case leaves fc2.bias out
        assert torch.equal(a, b), f"{what}: {name} differs"


def _styles_worker(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    x, grad = _data()
    real_all_reduce = tp.all_reduce_amax
    calls, counted = counting_all_reduce()
    tp.all_reduce_amax = counted  # read when a quantized style is applied, or at each forward
    recipes = {**RECIPES, "nvfp4 (stochastic rounding)": bs.recipes.nvfp4()}
    for name, recipe in recipes.items():
        steps = []
        for plan in (PLAN, TORCH_PLAN):
            model = parallelize_module(_mlp(recipe), mesh, plan)
            calls.clear()
            steps.append(_step(model, x, grad))
            assert len(calls) == ALL_REDUCES_PER_STEP[name.split()[0]], (name, plan, calls)
        assert type(model[0]) is bs.nn.Linear  # torch's style: the class is the converter's
        _assert_same_bits(steps[1], steps[0], name)

    tokens = slice(rank * 10, (rank + 1) * 10)
    steps = []
    for plan in SEQUENCE_PLANS:
        model = parallelize_module(_mlp(RECIPES["nvfp4"]), mesh, plan)
        calls.clear()
        steps.append(_step(model, x[:, tokens], grad[:, tokens]))
        assert len(calls) == ALL_REDUCES_PER_STEP["nvfp4"], calls
    # fc2's bias: torch's style sums its gradient over all 40 tokens (the output was reduced
    # whole, then sharded), the quantized one over each rank's 20 (a Partial gradient)
    _assert_same_bits(steps[1][:-1], steps[0][:-1], "sequence parallel")
    bound = _bound(40, torch.ones(1, 40), grad.reshape(-1, 64).T).reshape(-1)
    _assert_within(steps[1][-1], steps[0][-1], bound, "sequence parallel: fc2.bias")
    tp.all_reduce_amax = real_all_reduce

    # BF16: DTensor's own F.linear, the unconverted model's bits
    unconverted = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    unconverted.load_state_dict(_mlp(RECIPES["nvfp4"]).state_dict())
    plain = _step(parallelize_module(unconverted, mesh, TORCH_PLAN), x, grad)
    bf16 = parallelize_module(_mlp(bs.recipes.get("bf16")), mesh, TORCH_PLAN)
    _assert_same_bits(_step(bf16, x, grad), plain, "bf16 recipe")
    switched = parallelize_module(_mlp(RECIPES["nvfp4"]), mesh, TORCH_PLAN)
    assert bs.nn.set_precision(switched, False) == 2
    _assert_same_bits(_step(switched, x, grad), plain, "set_precision(False)")


def test_torch_styles_compute_what_the_quantized_styles_compute():
    run_local(_styles_worker, WORLD)


def test_compiled_torch_styles_equal_eager():
    run_local(compile_worker, WORLD, TORCH_PLAN)


def _refusals_worker(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    x = torch.randn(4, 64)
    layouts = "takes the DTensors of torch's ColwiseParallel"

    # the shard rules, at the first forward (torch's style applies without looking)
    model = parallelize_module(
        bs.convert(nn.Sequential(nn.Linear(64, 48)), RECIPES["nvfp4"]), mesh, TORCH_PLAN
    )
    with pytest.raises(ValueError, match="colwise over 2 ranks: each shard has N=24, not a mul"):
        model(x)
    model = bs.convert(nn.Sequential(nn.Linear(96, 64)), RECIPES["mxfp8"])
    model = parallelize_module(model, mesh, {"0": RowwiseParallel()})
    with pytest.raises(ValueError, match="each shard has K=48, not a multiple of 32.*of 64"):
        model(torch.randn(4, 48))

    # a replicated weight (every parameter distributed as Replicate, as torchtitan's NoParallel)
    layer = distribute_module(bs.convert(nn.Sequential(nn.Linear(64, 64)), RECIPES["nvfp4"]), mesh)
    replicated = DTensor.from_local(x, mesh, (Replicate(),))
    with pytest.raises(ValueError, match=rf"weight \(Replicate\(\),\) on a 1-D mesh.*{layouts}"):
        layer(replicated)

    # a column-wise weight handed a sharded input (the style converts only plain inputs)
    model = parallelize_module(
        bs.convert(nn.Sequential(nn.Linear(64, 64)), RECIPES["nvfp4"]), mesh, TORCH_PLAN
    )
    sharded = DTensor.from_local(x, mesh, (Shard(1),))
    with pytest.raises(ValueError, match=rf"input \(Shard\(dim=1\),\) on a 1-D mesh.*{layouts}"):
        model(sharded)
    with pytest.raises(ValueError, match=rf"input a Tensor \(not a DTensor\).*{layouts}"):
        model[0].forward(x)  # without the style's input hook

    # a 2-D mesh: Shard(0) over its first dim is still not the 1-D TP layout
    mesh_2d = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("tp", "other"))
    layer = bs.convert(nn.Linear(64, 64, bias=False), RECIPES["nvfp4"])
    weight = distribute_tensor(layer.weight.detach(), mesh_2d, (Shard(0), Replicate()))
    layer.weight = nn.Parameter(weight)
    with pytest.raises(ValueError, match=r"on a 2-D mesh.*on a 1-D mesh"):
        layer(DTensor.from_local(x, mesh_2d, (Replicate(), Replicate())))


def test_torch_styles_refuse_what_they_cannot_compute():
    run_local(_refusals_worker, WORLD)


FRESH_PROCESS = """
import sys
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
import blockscale as bs

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
mlp = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 64))
mlp = bs.convert(mlp, bs.recipes.get("nvfp4"))
mlp = parallelize_module(mlp, init_device_mesh("cpu", (1,)), {"0": ColwiseParallel(),
                                                              "1": RowwiseParallel()})
print("blockscale.distributed.tp" in sys.modules)
x = torch.randn(4, 64)
print(torch.equal(mlp(x), bs.linear(bs.linear(x, mlp[0].weight.to_local(), mlp[0].bias.to_local(),
      mlp[0].recipe), mlp[1].weight.to_local(), mlp[1].bias.to_local(), mlp[1].recipe)))
dist.destroy_process_group()
"""


def test_a_process_that_never_imported_tp_runs_torch_styles():
    """The layer reaches tp.py through the hook blockscale.distributed registers when
    `import blockscale` imports it, not through anyone having imported tp.py before."""
    done = subprocess.run(
        [sys.executable, "-c", FRESH_PROCESS], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True"], done.stdout


# --------------------------------------------------------------------------- torchtitan 0.2.2


def _titan_tp_worker(rank: int, world_size: int) -> None:
    """torchtitan 0.2.2's Llama 4 debug model as its trainer builds it with tp=2: meta build,
    the converter (nvfp4, its layer policy), torchtitan's own `parallelize_llama` (torch's
    Colwise / Rowwise / SequenceParallel / PrepareModuleInput plan, its default activation
    checkpointing; no async TP, float8, compile or loss parallel), `to_empty`, `init_weights`.
    The reference is the same converted model without TP, whose weights the TP model takes.

    Every block dense (`interleave_moe_layer_step` past the last block): torchtitan's
    TensorParallel for the experts cannot be applied to converted experts (test module
    docstring, and docs/TORCHTITAN.md)."""
    import torchtitan.distributed.parallel_dims as titan_parallel_dims
    from torchtitan.config import ConfigManager

    import blockscale.integrations.titan.v0_2  # noqa: F401 (registers "blockscale")

    titan_parallel_dims.device_type = "cpu"  # torchtitan builds its meshes on "cuda" otherwise
    spec = importlib.import_module("torchtitan.models.llama4").get_train_spec()
    args = [
        "--model.converters", "blockscale",
        "--training.mixed_precision_param", "float32",
        "--parallelism.disable_loss_parallel",
    ]  # fmt: skip
    job_config = ConfigManager().parse_args(args)
    dims = titan_parallel_dims.ParallelDims(
        dp_replicate=1, dp_shard=1, cp=1, tp=world_size, pp=1, ep=1, etp=1, world_size=world_size
    )

    def every_block_dense(model_args) -> None:
        model_args.interleave_moe_layer_step = model_args.n_layers + 1

    parallel, reference = (
        build_v0_2_from(spec, job_config, parallel_dims, configure=every_block_dense)
        for parallel_dims in (dims, None)
    )

    linears = [m for m in parallel.modules() if isinstance(m, bs.nn.Linear) and m.recipe.quantized]
    assert len(linears) == 35  # 7 a block, the last block kept in BF16 by the policy
    assert all(type(m) is bs.nn.Linear and isinstance(m.weight, DTensor) for m in linears)
    copy_whole_into(parallel, reference)

    outputs = {}
    for key, model in (("parallel", parallel), ("reference", reference)):
        wq = next(m for n, m in model.named_modules() if unwrapped(n) == "layers.0.attention.wq")
        wq.register_forward_hook(lambda m, i, out, key=key: outputs.setdefault(key, out))
    tokens = torch.randint(0, 2048, (2, 65), generator=torch.Generator().manual_seed(0))
    want = reference(tokens[:, :-1]).detach()
    real_all_reduce = tp.all_reduce_amax
    calls, counted = counting_all_reduce()
    tp.all_reduce_amax = counted  # read at each forward of a layer under torch's styles
    logits = parallel(tokens[:, :-1])
    assert len(calls) == len(linears)  # one amax all-reduce per layer and forward
    # The first column-wise layer's input is whole and the same: its output columns are one
    # device's, bit for bit. Downstream, each row-wise layer (wo, w2) sums two partial
    # products in FP32, which rounds otherwise than one device's GEMM (test_distributed_tp),
    # and a moved value may move the next quantization by a code: measured 3e-7 relative.
    cols = slice(rank * 128, (rank + 1) * 128)
    assert torch.equal(outputs["parallel"], outputs["reference"][..., cols])
    scale = want.abs().max()
    assert (logits - want).abs().max() <= 1e-5 * scale
    tp.all_reduce_amax = lambda t, group=None: t.float()  # each rank its shards' own amaxes
    local = parallel(tokens[:, :-1]).detach()
    tp.all_reduce_amax = real_all_reduce
    assert (local - want).abs().max() > 1e-3 * scale  # measured 1.2e-2

    loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    for name, p in parallel.named_parameters():
        assert p.grad is not None and bool(p.grad.full_tensor().isfinite().all()), name


@needs_v0_2
def test_v0_2_llama4_under_titans_tensor_parallel():
    run_local(_titan_tp_worker, WORLD)
