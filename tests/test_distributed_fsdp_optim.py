"""The optimizers and utilities a training loop calls on weights under quantized all-gather.

`enable_quantized_all_gather` makes each quantized weight a `ShardedWeight` (a wrapper
subclass of the FP32 tensor, blockscale/distributed/fsdp.py). CUDA users get torch's fused or
foreach optimizers by default, which call `_fused_adamw_`, `_foreach_mul_`, ... on lists of
parameters: ops that mutate their arguments and return nothing. Before the fix the wrapper
returned its first argument for every mutating op, and torch refused ("Expected
__torch_dispatch__ for aten::_foreach_mul_ to return None"). Here, every optimizer variant
(AdamW, Adam, SGD x per-tensor, foreach, fused: torch >= 2.4 runs fused on the CPU too),
`clip_grad_norm_` (foreach norms), `zero_grad(set_to_none=False)`, DCP of the optimizer state
and a compiled optimizer step must give the same bits (atol=0) as the same optimizer on plain
parameters: without FSDP (one process) and under FSDP2 (2 gloo ranks; plain FSDP2 with the
same recipe gathers the FP32 weight and each layer quantizes it whole, which the quantized
all-gather reproduces bit for bit, test_distributed_fsdp.py), and the optimizer state stays
plain FP32 tensors, sharded.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import blockscale as bs
from blockscale.distributed import ShardedWeight, enable_quantized_all_gather
from blockscale.distributed.launch import run_local

WORLD = 2
RECIPES = {"nvfp4": bs.recipes.nvfp4(stochastic_rounding=False), "mxfp8": bs.recipes.mxfp8()}
OPTIMIZERS = {  # name: (class, keyword arguments)
    f"{cls.__name__}_{impl}": (cls, {**extra, **kw})
    for cls, extra in (
        (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
        (torch.optim.Adam, {"lr": 1e-2}),
        (torch.optim.SGD, {"lr": 1e-1, "momentum": 0.9, "weight_decay": 0.01}),
    )
    for impl, kw in (
        ("per_tensor", {"foreach": False}),
        ("foreach", {"foreach": True}),
        ("fused", {"fused": True}),
    )
}


def _device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    cls, kw = OPTIMIZERS[name]
    return cls(params, **kw)


def _states(opt: torch.optim.Optimizer) -> list[tuple[torch.Tensor, str, torch.Tensor]]:
    """(parameter, key, state tensor) for every state tensor, in parameter order."""
    params = opt.param_groups[0]["params"]
    return [(p, k, v) for p in params for k, v in sorted(opt.state[p].items())]


def _local(t: torch.Tensor) -> torch.Tensor:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t._data if isinstance(t, ShardedWeight) else t


def _assert_equal(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    a, b = _local(a), _local(b)
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(a, b), f"{what}: max diff {(a.float() - b.float()).abs().max().item()}"


# ----------------------------------------------------------------------------- one process


def test_mutating_ops_return_what_aten_returns():
    w = ShardedWeight(torch.zeros(4, 4))
    x = torch.ones(4, 4)
    assert w.add_(1) is w and torch.equal(w._data, x)  # in place: the wrapper itself
    assert torch.add(x, x, out=w) is w and torch.equal(w._data, 2 * x)  # out=
    torch._foreach_add_([w], [x])  # schema returns (): the dispatch must return None
    assert torch.equal(w._data, 3 * x)
    values, indices = torch.empty(4, 4), torch.empty(4, 4, dtype=torch.long)
    got = torch.sort(w, out=(values, indices))  # a plain tensor's out=: the caller's tensors
    assert got[0] is values and got[1] is indices
    assert type(w * 2) is torch.Tensor  # arithmetic: plain


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizers_step_a_sharded_weight_as_a_plain_one(name, recipe):
    # The reproduction: no FSDP at all, one converted Linear(64, 64).
    runs = []
    for wrap in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64))
        bs.convert(model, RECIPES[recipe])
        if wrap:
            assert enable_quantized_all_gather(model) == 1
        opt = _optimizer(name, model.parameters())
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
        norms = []
        for _ in range(3):
            model(x).square().mean().backward()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, foreach=True))
            opt.step()
            opt.zero_grad(set_to_none=False)
        runs.append((model, opt, norms))
    (plain, plain_opt, plain_norms), (wrapped, opt, norms) = runs
    assert isinstance(wrapped[0].weight.data, ShardedWeight)
    assert torch.equal(torch.stack(norms), torch.stack(plain_norms))
    for (n, a), b in zip(wrapped.named_parameters(), plain.parameters(), strict=True):
        _assert_equal(a, b, n)
        assert a.grad is not None and not a.grad.any(), f"{n}: zero_grad(set_to_none=False)"
    for (_, key, a), (_, _, b) in zip(_states(opt), _states(plain_opt), strict=True):
        assert type(a) is torch.Tensor, (key, type(a))  # plain state, not a ShardedWeight
        _assert_equal(a, b, key)


# ----------------------------------------------------------------------------- FSDP2, 2 ranks


class _Net(nn.Module):
    """Two converted linears (one with a bias) and a LayerNorm: quantized weights and plain
    parameters in one parameter group, as in a transformer block."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 128)
        self.norm = nn.LayerNorm(128)
        self.fc2 = nn.Linear(128, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


def _sharded_net(recipe: str, quantized_gather: bool) -> nn.Module:
    torch.manual_seed(0)
    model = _Net().to(_device())
    bs.convert(model, RECIPES[recipe])
    if quantized_gather:
        assert enable_quantized_all_gather(model) == 2
    mesh = init_device_mesh(_device().type, (dist.get_world_size(),))
    fully_shard(model.fc1, mesh=mesh)
    fully_shard(model.fc2, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _train(model, opt, x, steps: int, step_fn=None) -> list[torch.Tensor]:
    """Steps of a user's loop: backward, clip (foreach norms), step, zero_grad(False)."""
    out = []
    for _ in range(steps):
        loss = model(x).square().mean()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, foreach=True)
        (step_fn or opt.step)()
        opt.zero_grad(set_to_none=False)
        out += [loss.detach(), norm.full_tensor() if hasattr(norm, "full_tensor") else norm]
    return out


def _assert_same_training(a_model, a_opt, a_rows, b_model, b_opt, b_rows, what: str) -> None:
    assert torch.equal(torch.stack(a_rows), torch.stack(b_rows)), (what, a_rows, b_rows)
    for (n, a), b in zip(a_model.named_parameters(), b_model.parameters(), strict=True):
        _assert_equal(a, b, f"{what} {n}")
        assert not a.grad.to_local().any(), f"{what} {n}: zero_grad(set_to_none=False)"
    names = {id(p): n for n, p in a_model.named_parameters()}
    for (p, key, a), (_, _, b) in zip(_states(a_opt), _states(b_opt), strict=True):
        n = names[id(p)]
        local = a.to_local() if hasattr(a, "to_local") else a
        assert type(local) is torch.Tensor, (what, n, key, type(local))  # plain, FP32, sharded
        if local.dim():
            assert local.dtype == torch.float32 and local.shape == p.to_local().shape, (n, key)
        _assert_equal(a, b, f"{what} {n}.{key}")


def _optimizers_worker(rank: int, world_size: int, names: list[str], recipes: list[str]) -> None:
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(rank)).to(_device())
    for recipe in recipes:
        for name in names:
            runs, errors = [], []
            for quantized_gather in (True, False):
                model = _sharded_net(recipe, quantized_gather)
                opt = _optimizer(name, model.parameters())
                try:
                    runs.append((model, opt, _train(model, opt, x, 3)))
                except NotImplementedError as e:
                    errors.append(str(e))
            if errors:
                # DTensor has no sharding rule for some fused kernels (`_fused_sgd_` on torch
                # 2.11 and 2.13): plain FSDP2 fails alike, with the same message.
                assert len(errors) == 2 and errors[0] == errors[1], errors
                assert "does not have a sharding strategy registered" in errors[0], errors
                continue
            (model, opt, rows), (plain, plain_opt, plain_rows) = runs
            assert isinstance(model.fc1.weight.to_local(), ShardedWeight)
            _assert_same_training(
                model, opt, rows, plain, plain_opt, plain_rows, f"{recipe} {name}"
            )


def test_every_optimizer_under_fsdp_equals_plain_fsdp():
    run_local(_optimizers_worker, WORLD, list(OPTIMIZERS), ["nvfp4"])


def test_foreach_and_fused_adamw_under_fsdp_mxfp8():
    # mxfp8 gathers a columnwise copy too (rebuilt in place on the backward's re-gather)
    run_local(_optimizers_worker, WORLD, ["AdamW_foreach", "AdamW_fused"], ["mxfp8"])


def _checkpoint_worker(rank: int, world_size: int, path: str, names: list[str]) -> None:
    # Two steps, a DCP save of model and optimizer (as train/checkpoint.py does it), a fresh
    # model and optimizer loaded from it, then two more steps on both: the same bits.
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(rank)).to(_device())
    for name in names:
        model = _sharded_net("nvfp4", True)
        opt = _optimizer(name, model.parameters())
        _train(model, opt, x, 2)
        model_state, optim_state = get_state_dict(model, opt)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=f"{path}/{name}")
        resumed = _sharded_net("nvfp4", True)
        resumed_opt = _optimizer(name, resumed.parameters())
        model_state, optim_state = get_state_dict(resumed, resumed_opt)
        dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=f"{path}/{name}")
        set_state_dict(
            resumed, resumed_opt, model_state_dict=model_state, optim_state_dict=optim_state
        )
        assert isinstance(resumed.fc2.weight.to_local(), ShardedWeight)
        rows = _train(model, opt, x, 2)
        resumed_rows = _train(resumed, resumed_opt, x, 2)
        _assert_same_training(resumed, resumed_opt, resumed_rows, model, opt, rows, name)


def test_optimizer_state_checkpoint_round_trips(tmp_path):
    run_local(_checkpoint_worker, WORLD, str(tmp_path), ["AdamW_foreach", "AdamW_fused"])


def _compiled_step_worker(rank: int, world_size: int, names: list[str]) -> None:
    # torch.compile(opt.step) on DTensor parameters whose local tensors are ShardedWeights:
    # the same compiled update as on plain FSDP2 parameters, bit for bit.
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(rank)).to(_device())
    for name in names:
        runs = []
        for quantized_gather in (True, False):
            torch._dynamo.reset()
            model = _sharded_net("nvfp4", quantized_gather)
            opt = _optimizer(name, model.parameters())
            runs.append((model, opt, _train(model, opt, x, 2, torch.compile(opt.step))))
        (model, opt, rows), (plain, plain_opt, plain_rows) = runs
        _assert_same_training(model, opt, rows, plain, plain_opt, plain_rows, f"compiled {name}")


@pytest.mark.slow
def test_compiled_optimizer_step_under_fsdp_equals_plain_fsdp():
    run_local(_compiled_step_worker, WORLD, ["AdamW_fused", "AdamW_foreach"])


@pytest.mark.gpu
def test_fused_optimizers_on_two_gpus(tmp_path):
    """CUDA's defaults: fused and foreach AdamW / Adam / SGD over NCCL, and the checkpoint."""
    if torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} GPUs")
    run_local(_optimizers_worker, WORLD, list(OPTIMIZERS), ["nvfp4", "mxfp8"], device="cuda")
    run_local(_checkpoint_worker, WORLD, str(tmp_path), ["AdamW_fused"], device="cuda")
    run_local(_compiled_step_worker, WORLD, ["AdamW_fused", "AdamW_foreach"], device="cuda")
