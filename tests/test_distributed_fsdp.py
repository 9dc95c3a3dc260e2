"""FSDP2 with quantized all-gather (blockscale.distributed.fsdp), on 2 ranks.

CPU: gloo, one process per rank. GPU (marker gpu, 2 GPUs): the same workers over NCCL.
Every check runs inside the workers (an assertion there fails the spawn with its traceback);
the byte counts come back through a file.

Exactness arguments the assertions rest on:
- A shard holds whole 16x16 tiles (or whole blocks along N) and is quantized with the amax
  reduced over the group, so its codes and scales are the full quantization's rows.
- Data parallel over 2 ranks averages two gradients: (g0 + g1) / 2 is what FSDP's AVG
  reduce-scatter gives (2 terms: the sum is order-free, halving is exact), and what one process
  gets by accumulating the two micro-batches' gradients and halving. Stochastic rounding is off
  (two processes cannot draw one process's random stream).
- With MixedPrecisionPolicy(param_dtype=bf16), FSDP computes in BF16 with BF16 gradients; the
  one-process reference does the same by hand: BF16 copies of the unquantized parameters,
  FP32 weights for quantized layers (quantized from FP32, as the shards are), BF16 rotary
  tables (FSDP casts the blocks' float inputs), every gradient rounded to BF16, summed in
  BF16 and halved.
"""

from __future__ import annotations

import copy
import gc
import json
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

import blockscale as bs
from blockscale import _library
from blockscale.distributed import QuantizedWeight, ShardedWeight, enable_quantized_all_gather
from blockscale.distributed import fsdp as fsdp_module
from blockscale.distributed.fsdp import GatherLayout
from blockscale.distributed.launch import run_local
from blockscale.formats import mxfp8, nvfp4
from blockscale.models import build_model, model_config
from blockscale.nn import linear as bs_linear
from blockscale.ops.linear import EXACT_INDUCTOR_OPTIONS
from blockscale.recipes import Format

WORLD = 2
RECIPES = {
    "nvfp4": bs.recipes.nvfp4(stochastic_rounding=False),
    "nvfp4_1x16": bs.recipes.nvfp4(stochastic_rounding=False, weight_2d=False),
    "nvfp4_fwd_mxfp8_bwd": bs.recipes.nvfp4_fwd_mxfp8_bwd(),
    "mxfp8": bs.recipes.mxfp8(),
}


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _shard(model: nn.Module, blocks: list[nn.Module], mp: bool) -> None:
    mesh = init_device_mesh(_device().type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if mp else None)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def _quantize_full(w: torch.Tensor, config, transpose: bool):
    if config.format is Format.NVFP4:
        return nvfp4.quantize(w, block=config.block, transpose=transpose)
    return mxfp8.quantize(w, transpose=transpose)


def _assert_same_container(got, want, what: str) -> None:
    assert tuple(got.shape) == tuple(want.shape), what
    pairs = [("data", got.data, want.data), ("scale", got.scale, want.scale)]
    if hasattr(want, "amax"):
        pairs.append(("amax", got.amax, want.amax))
    for name, a, b in pairs:
        assert a.dtype == b.dtype, f"{what}.{name}: {a.dtype} != {b.dtype}"
        a8 = a.reshape(-1).view(torch.uint8) if a.dtype.itemsize == 1 else a
        b8 = b.reshape(-1).view(torch.uint8) if b.dtype.itemsize == 1 else b
        assert torch.equal(a8.cpu(), b8.cpu()), f"{what}.{name} differs from one-device bits"


# --------------------------------------------------------------------------- the gather


def _gather_worker(rank: int, world_size: int) -> None:
    device = _device()
    for name, recipe in RECIPES.items():
        for mp in (False, True):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(64, 128, bias=False), nn.Linear(128, 64, bias=False))
            with torch.no_grad():  # the largest |w| in rank 1's rows: the amax must travel
                model[0].weight[100, 7] = 3.0
                model[1].weight[5, 9] = -2.5  # and one in rank 0's rows
            model.to(device)
            bs.convert(model, recipe)
            full = [m.weight.detach().clone() for m in model]
            assert enable_quantized_all_gather(model) == 2
            _shard(model, list(model), mp)
            for m, w in zip(model, full, strict=True):
                m.unshard()
                gathered = m.weight
                assert isinstance(gathered, QuantizedWeight), type(gathered)
                assert gathered.dtype == (torch.bfloat16 if mp else torch.float32)
                fwd, dgrad = recipe.output.weight, recipe.grad_input.weight
                _assert_same_container(
                    gathered.rowwise, _quantize_full(w, fwd, False), f"{name} rowwise"
                )
                if dgrad.block == "16x16":
                    assert gathered.columnwise is None
                else:
                    _assert_same_container(
                        gathered.columnwise, _quantize_full(w, dgrad, True), f"{name} columnwise"
                    )
                m.reshard()


def _shard_rule_worker(rank: int, world_size: int) -> None:
    # 48 rows over 2 ranks: 24 per shard, not whole 16x16 tiles. Every rank raises alike.
    model = nn.Sequential(nn.Linear(64, 48, bias=False)).to(_device())
    bs.convert(model, RECIPES["nvfp4"])
    enable_quantized_all_gather(model)
    _shard(model, [], mp=False)
    with pytest.raises(ValueError, match="each shard has 24 rows, not a multiple of 16"):
        model(torch.randn(4, 64, device=_device()))


@pytest.mark.parametrize("name", list(RECIPES))
def test_shard_quantization_kernel_path_equals_reference(name, monkeypatch):
    # What a rank sends, quantized by the Triton kernels (the GPU path; here in Triton's
    # interpreter) and by formats/, for rank 1's half of a weight whose amax is elsewhere.
    pytest.importorskip("triton")
    layer = bs.nn.Linear(64, 64, bias=False, recipe=RECIPES[name])
    layout = GatherLayout.for_layer(layer, torch.Size((64, 64)), WORLD)
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(3))
    w[5, 7] = 20.0
    amax = w.abs().amax()
    reference = layout.inputs(w[32:], amax)
    monkeypatch.setattr(_library, "use_kernels", lambda t: True)
    kernel = layout.inputs(w[32:], amax)
    assert len(kernel) == len(reference)
    for got, want in zip(kernel, reference, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))  # 1-byte dtypes


class _OneRankMesh:
    """What fsdp_pre_all_gather reads of FSDP's shard mesh, for one rank and no collective."""

    def size(self) -> int:
        return 1

    def get_group(self):
        raise AssertionError("these checks must fail before any collective")


@pytest.mark.parametrize("recipe", [None, "bf16"])
def test_nothing_converted_raises(recipe):
    # Before convert (or with a bf16 recipe) there is nothing to gather quantized: say so
    # rather than return 0 and let FSDP gather every weight unquantized.
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    if recipe is not None:
        bs.convert(model, bs.recipes.get(recipe))
    found = "none with a quantized recipe" if recipe else "no blockscale Linear layer"
    with pytest.raises(ValueError, match=f"{found}.*call bs.convert\\(model, recipe\\)"):
        enable_quantized_all_gather(model)
    assert all(type(p) is nn.Parameter and type(p.data) is torch.Tensor for p in model.parameters())


def test_weight_layout_cannot_change_after_first_gather():
    # FSDP sizes its buffers at the first all-gather: a later recipe change or a switch to
    # BF16 (set_precision) raises instead of computing with something else. mxfp8 first: it
    # needs no amax collective, so one process can run the hook.
    layer = bs.nn.Linear(64, 64, bias=False, recipe=RECIPES["mxfp8"])
    weight = ShardedWeight(torch.randn(64, 64))
    hook_args = (_OneRankMesh(), torch.Size((64, 64)), (64, 1), layer, MixedPrecisionPolicy())
    inputs, _ = weight.fsdp_pre_all_gather(*hook_args)
    assert len(inputs) == 4  # MXFP8 rowwise and columnwise, codes and scales
    layer.recipe = RECIPES["nvfp4"]
    with pytest.raises(ValueError, match="a layer's recipe cannot change"):
        weight.fsdp_pre_all_gather(*hook_args)
    layer.recipe = RECIPES["mxfp8"]
    bs.nn.set_precision(layer, False)
    with pytest.raises(ValueError, match="not a quantized blockscale Linear"):
        weight.fsdp_pre_all_gather(*hook_args)


def test_gathered_weights_equal_one_device_quantization():
    run_local(_gather_worker, WORLD)


def test_shard_that_cuts_tiles_raises():
    run_local(_shard_rule_worker, WORLD)


def _compile_worker(rank: int, world_size: int) -> None:
    # torch.compile traces the gathered QuantizedWeight as a subclass (its
    # __tensor_flatten__); with EXACT_INDUCTOR_OPTIONS the compiled steps equal eager's bits.
    device = _device()
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(64, 64, bias=False), nn.ReLU(), nn.Linear(64, 64, bias=False)
        ).to(device)
        bs.convert(model, RECIPES["nvfp4"])
        enable_quantized_all_gather(model)
        _shard(model, [model[0], model[2]], mp=False)
        models.append(model)
    eager, compiled = models
    # the gathered QuantizedWeight goes into Dynamo's graph with the rest of the layer
    # (nn/linear.py), not to the eager linear at a graph break
    breaks = []
    at_a_break = bs_linear._linear_at_a_graph_break
    bs_linear._linear_at_a_graph_break = lambda *args: breaks.append(1) or at_a_break(*args)
    run = torch.compile(compiled, options=EXACT_INDUCTOR_OPTIONS)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank)).to(device)
    for step in range(2):
        want = eager(x * (step + 1)).square().mean()
        got = run(x * (step + 1)).square().mean()
        want.backward()
        got.backward()
        assert got.item() == want.item(), step
        for a, b in zip(compiled.parameters(), eager.parameters(), strict=True):
            assert torch.equal(a.grad.full_tensor(), b.grad.full_tensor()), step
    assert not breaks


def test_compiled_fsdp_equals_eager():
    run_local(_compile_worker, WORLD)


# --------------------------------------------------------------------------- training


def _batches(steps: int, world_size: int, vocab: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab, (steps, world_size, 2, 33), generator=g).to(device)


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def _reference_run(
    model: nn.Module, data: torch.Tensor, dtype: torch.dtype, lr: float
) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """One process: each step runs every rank's micro-batch and averages the gradients as
    FSDP does. Unquantized parameters compute in `dtype`; quantized layers' weights stay FP32
    (FSDP quantizes them from the FP32 shards)."""
    masters = dict(model.named_parameters())
    quantized = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, bs.nn.Linear)}
    compute = copy.deepcopy(model)
    params = dict(compute.named_parameters())
    for n, p in params.items():
        if n not in quantized:
            p.data = p.data.to(dtype)
    for b in compute.buffers():  # FSDP casts the blocks' float inputs (the rotary tables) too
        b.data = b.data.to(dtype)
    opt = torch.optim.AdamW(masters.values(), lr=lr)
    losses = []
    for step in range(data.shape[0]):
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(masters[n])
        acc: dict[str, torch.Tensor] = {}
        step_losses = []
        for tokens in data[step]:
            loss = _loss(compute, tokens)
            loss.backward()
            step_losses.append(loss.item())
            for n, p in params.items():
                g = p.grad.to(dtype)
                acc[n] = g if n not in acc else acc[n] + g
                p.grad = None
        for n, p in masters.items():
            p.grad = (acc[n] * 0.5).float()
        opt.step()
        opt.zero_grad()
        losses.append(step_losses)
    return losses, {n: p.detach().clone() for n, p in masters.items()}


class CountingAllGather(AllGather):
    """FSDP's all-gather, counting the bytes each rank receives."""

    def __init__(self) -> None:
        self.bytes = 0

    def allocate(self, size, *, dtype, device):
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.bytes += output_tensor.numel() * output_tensor.element_size()
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group, async_op=async_op)


def _count_all_gathers(model: nn.Module) -> CountingAllGather:
    counter = CountingAllGather()
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_custom_all_gather(counter)
    return counter


def _train_worker(rank: int, world_size: int, out_path: str) -> None:
    device = _device()
    steps, lr = 3, 1e-2
    cfg = model_config("tiny")
    data = _batches(steps, world_size, cfg.vocab_size, device)
    sizes = {}
    runs = [  # (recipe, mixed precision, quantized all-gather)
        ("nvfp4", False, True),
        ("nvfp4", True, True),
        ("mxfp8", False, True),  # a columnwise copy, rebuilt in place on the backward re-gather
        ("nvfp4", False, False),
        ("nvfp4", True, False),
    ]
    for recipe_name, mp, quantized in runs:
        torch.manual_seed(0)
        model = build_model(cfg).to(device)
        bs.convert(model, RECIPES[recipe_name])
        reference = copy.deepcopy(model)
        if quantized:
            enable_quantized_all_gather(model)
        _shard(model, list(model.layers), mp)
        counter = _count_all_gathers(model)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        losses = []
        for step in range(steps):
            loss = _loss(model, data[step, rank])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        if recipe_name == "nvfp4":
            label = f"{'bf16' if mp else 'fp32'}{'_nvfp4' if quantized else ''}"
            sizes[label] = counter.bytes // steps
        if not quantized:
            continue
        dtype = torch.bfloat16 if mp else torch.float32
        ref_losses, ref_params = _reference_run(reference, data, dtype, lr)
        assert losses == [s[rank] for s in ref_losses], (recipe_name, mp, losses, ref_losses)
        for n, p in model.named_parameters():
            assert torch.equal(p.full_tensor(), ref_params[n]), f"{n} after {steps} steps"
            # masters and optimizer state: FP32, sharded, plain tensors under the DTensors
            assert p.dtype == torch.float32 and p.to_local().shape[0] == p.shape[0] // world_size
            for state in ("exp_avg", "exp_avg_sq"):
                local = opt.state[p][state].to_local()
                assert type(local) is torch.Tensor and local.dtype == torch.float32, (n, state)
                assert local.shape == p.to_local().shape, (n, state)
        if recipe_name == "nvfp4" and not mp:  # a sharded checkpoint: FP32 values, in place
            path = f"{out_path}.dcp"
            dcp.save({"model": model.state_dict(), "opt": opt.state_dict()}, checkpoint_id=path)
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
            state = {"model": model.state_dict(), "opt": opt.state_dict()}
            dcp.load(state, checkpoint_id=path)
            model.load_state_dict(state["model"])
            linears = {
                f"{n}.weight" for n, m in model.named_modules() if isinstance(m, bs.nn.Linear)
            }
            for n, p in model.named_parameters():
                # still a ShardedWeight: the next all-gather is quantized again
                assert isinstance(p.to_local(), ShardedWeight) == (n in linears), n
                assert torch.equal(p.full_tensor(), ref_params[n]), f"{n} after a checkpoint"
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(sizes, f)


def test_training_steps_and_all_gather_bytes(tmp_path):
    out = tmp_path / "bytes.json"
    run_local(_train_worker, WORLD, str(out))
    got = json.loads(out.read_text())
    # What each rank receives per step: blocks gather twice (forward, and again for the
    # backward after resharding), the root group (embeddings, final norm, head) once.
    cfg = model_config("tiny")
    model = build_model(cfg)
    bs.convert(model, RECIPES["nvfp4"])
    quantized = {id(m.weight) for m in model.modules() if isinstance(m, bs.nn.Linear)}
    block_params = {id(p) for p in model.layers.parameters()}

    def expected(plain_bytes: int, nvfp4: bool) -> int:
        total = 0
        for p in model.parameters():
            n = p.numel()
            nbytes = n * 129 // 256 if (nvfp4 and id(p) in quantized) else n * plain_bytes
            total += nbytes * (2 if id(p) in block_params else 1)
        return total

    assert got["fp32"] == expected(4, False)
    assert got["bf16"] == expected(2, False)
    assert got["fp32_nvfp4"] == expected(4, True)
    assert got["bf16_nvfp4"] == expected(2, True)


def _cache_worker(rank: int, world_size: int) -> None:
    """The weight cache under quantized all-gather: each shard quantized once per optimizer
    step (not at the backward's re-gather, not per micro-batch), the same losses and weights
    as without the cache, and a stale copy never used after an in-place edit or a load."""
    device = _device()
    cfg = model_config("tiny")
    data = _batches(6, world_size, cfg.vocab_size, device)
    made, reduced = [], []
    inputs = GatherLayout.inputs
    shards_amax = fsdp_module._shards_amax

    def counting(self, shard, amax):
        made.append(self.shape)
        return inputs(self, shard, amax)

    def counting_amax(shards, group):
        reduced.append(len(shards))
        return shards_amax(shards, group)

    GatherLayout.inputs = counting
    fsdp_module._shards_amax = counting_amax
    by_default = dict(fsdp_module.CACHE_GATHER_INPUTS)
    fsdp_module.CACHE_GATHER_INPUTS[Format.MXFP8] = True  # the mechanism, for both formats
    try:
        for name in ("nvfp4", "mxfp8"):
            models, opts = [], []
            for cached in (True, False):
                torch.manual_seed(0)
                model = build_model(cfg).to(device)
                bs.convert(model, RECIPES[name])
                # across micro-batches: the opt-in scope (ops/weight_cache.py), the CLI's
                bs.nn.set_weight_cache(model, cached, scope="step")
                enable_quantized_all_gather(model)
                _shard(model, list(model.layers), mp=True)
                models.append(model)
                opts.append(torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True))
            in_blocks = {id(m) for m in models[0].layers.modules()}
            linears = [m for m in models[0].modules() if isinstance(m, bs.nn.Linear)]
            blocks = sum(id(m) in in_blocks for m in linears)
            root = len(linears) - blocks
            for step in range(3):  # 2 micro-batches a step
                losses, amaxes = [], []
                for model, opt in zip(models, opts, strict=True):
                    made.clear()
                    reduced.clear()
                    for micro in range(2):
                        loss = _loss(model, data[2 * step + micro, rank])
                        loss.backward()
                        losses.append(loss.item())
                    opt.step()
                    opt.zero_grad()
                    losses.append(len(made))
                    amaxes.append(list(reduced))
                # without the cache, a block's weights are quantized at the forward's gather
                # and at the backward's re-gather of each micro-batch, the root's (gathered
                # once a micro-batch: FSDP keeps the root unsharded for the backward) at each
                # forward; with it, each once a step
                assert losses[2] == blocks + root, (name, losses)
                assert losses[5] == 4 * blocks + 2 * root, (name, losses)
                assert losses[:2] == losses[3:5], (name, step, losses)
                # the amaxes (NVFP4): with the cache, one all-reduce a weight at the first step,
                # then one for all of them (_AmaxBatch); without, one a gather
                if name == "nvfp4":
                    first = [1] * (blocks + root)
                    assert amaxes[0] == (first if step == 0 else [blocks + root]), amaxes
                    assert amaxes[1] == [1] * (4 * blocks + 2 * root), amaxes
                else:
                    assert amaxes == [[], []], amaxes
            for (n, p), q in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
                assert torch.equal(p.full_tensor(), q.full_tensor()), (name, n)
            # an in-place edit and a load_state_dict, each followed by a forward
            for model in models:
                with torch.no_grad():
                    model.layers[0].attn.wqkv.weight.mul_(0.5)
            assert _loss(models[0], data[0, rank]).item() == _loss(models[1], data[0, rank]).item()
            state = {k: v * 0.75 for k, v in models[1].state_dict().items()}
            for model in models:
                model.load_state_dict(state)
            assert _loss(models[0], data[1, rank]).item() == _loss(models[1], data[1, rank]).item()
            # nothing the amax batch holds outlives the model
            layer = weakref.ref(models[0].layers[0].attn.wqkv)
            del models, opts, linears
            gc.collect()
            assert layer() is None
    finally:
        GatherLayout.inputs = inputs
        fsdp_module._shards_amax = shards_amax
        fsdp_module.CACHE_GATHER_INPUTS.update(by_default)


def test_gather_inputs_cached_for_nvfp4_layouts_only_by_default():
    """The default chosen by measurement (CACHE_GATHER_INPUTS): NVFP4 layouts keep their
    all-gather inputs, layouts with an MXFP8 copy quantize the shard at each gather."""
    cached = {}
    for name in ("nvfp4", "mxfp8", "nvfp4_fwd_mxfp8_bwd"):
        layer = bs.convert(nn.Sequential(nn.Linear(64, 64)), bs.recipes.get(name))[0]
        cached[name] = GatherLayout.for_layer(layer, torch.Size((64, 64)), 2).cached
    assert cached == {"nvfp4": True, "mxfp8": False, "nvfp4_fwd_mxfp8_bwd": False}


@pytest.mark.parametrize("world_size", [1, 2])
def test_weight_cache_quantizes_each_shard_once_a_step(world_size):
    run_local(_cache_worker, world_size)


@pytest.mark.gpu
def test_fsdp_on_two_gpus(tmp_path):
    if torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} GPUs")
    run_local(_gather_worker, WORLD, device="cuda")
    run_local(_compile_worker, WORLD, device="cuda")
    run_local(_train_worker, WORLD, str(tmp_path / "bytes.json"), device="cuda")
    run_local(_cache_worker, WORLD, device="cuda")


def test_gathered_weights_on_one_rank_equal_one_device_quantization():
    """A one-rank mesh (a single-GPU run of a multi-GPU script): FSDP2 skips the collective
    there and hands the post-all-gather hook only its first input; the hook rebuilds every
    copy from what the rank sent, so the weight is the same as on N ranks."""
    run_local(_gather_worker, 1)
