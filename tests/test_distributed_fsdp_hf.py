"""FSDP2 of converted transformers models, as a user writes it (2 gloo ranks; GPU: NCCL).

The user's own loop: `convert`, `enable_quantized_all_gather`, `fully_shard` on every decoder
layer and on the root with `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` (or
none), FP32 master weights, BF16 autocast or not, torch's AdamW (foreach or fused). Models:
a tiny random `LlamaForCausalLM` (converted with `layer_policy`: the head, the embeddings and
the last block stay BF16) and a tiny `Qwen3MoeForCausalLM` (its linears and its 3D experts
converted; the experts are routed to `blockscale.grouped_mm` and gather as plain FSDP
parameters, in the policy's dtype: docs/DISTRIBUTED.md says why not quantized).

What is compared: 3 steps, each rank its own batch, against one process that runs both
batches and averages the gradients as FSDP does. With a MixedPrecisionPolicy the one-process
reference computes as FSDP does, by hand: BF16 copies of every parameter but the quantized
linears' weights (those are quantized from FP32, as the shards are), every gradient rounded
to BF16 (what the BF16 compute hands FSDP), then reduced in FP32 (two terms: order-free) and
halved (exact). Losses, parameters and optimizer state are equal bit for bit (atol=0).
Stochastic rounding is off (two processes cannot draw one process's stream).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import blockscale as bs
from blockscale.distributed import QuantizedWeight, ShardedWeight, enable_quantized_all_gather
from blockscale.distributed.launch import run_local

transformers = pytest.importorskip("transformers")

WORLD, STEPS, VOCAB = 2, 3, 128
RECIPES = {"nvfp4": bs.recipes.nvfp4(stochastic_rounding=False), "mxfp8": bs.recipes.mxfp8()}


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def hf_model(kind: str) -> nn.Module:
    """A tiny random transformers model; every linear's N splits into whole 32-row blocks
    over 2 ranks (MXFP8's columnwise copy needs them), so k/v have 4 heads of 16."""
    common = dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        vocab_size=VOCAB, max_position_embeddings=64, attn_implementation="sdpa",
        use_cache=False,
    )  # fmt: skip
    if kind == "llama":
        config = transformers.LlamaConfig(intermediate_size=128, **common)
    else:
        config = transformers.Qwen3MoeConfig(
            intermediate_size=128, moe_intermediate_size=64, num_experts=4,
            num_experts_per_tok=2, experts_implementation="grouped_mm", **common,
        )  # fmt: skip
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def convert(model: nn.Module, kind: str, recipe: str) -> None:
    policy = bs.nn.layer_policy(model) if kind == "llama" else None
    bs.convert(model, RECIPES[recipe], module_filter_fn=policy)


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1]).logits
    return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def _autocast(on: bool, device: torch.device):
    return torch.autocast(device.type, torch.bfloat16) if on else contextlib.nullcontext()


def _optimizer(params, impl: str) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, **{impl: True})


def _reference(model, data, mp: bool, autocast: bool, impl: str, device):
    """One process: every rank's batch, gradients averaged as FSDP averages them."""
    masters = dict(model.named_parameters())
    quantized = {
        f"{n}.weight"
        for n, m in model.named_modules()
        if isinstance(m, bs.nn.Linear) and m.recipe.quantized
    }
    compute = copy.deepcopy(model)
    params = dict(compute.named_parameters())
    if mp:
        for n, p in params.items():
            if n not in quantized:
                p.data = p.data.to(torch.bfloat16)
    opt = _optimizer(masters.values(), impl)
    losses = []
    for step in range(STEPS):
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(masters[n])
        grads: dict[str, torch.Tensor] = {}
        step_losses = []
        for tokens in data[step]:
            with _autocast(autocast, device):
                loss = _loss(compute, tokens)
            loss.backward()
            step_losses.append(loss.item())
            for n, p in params.items():
                g = (p.grad.to(torch.bfloat16) if mp else p.grad).float()
                grads[n] = g if n not in grads else grads[n] + g
                p.grad = None
        for n, p in masters.items():
            p.grad = grads[n] * 0.5
        opt.step()
        opt.zero_grad()
        losses.append(step_losses)
    return losses, masters, opt


def _hf_worker(rank: int, world_size: int, cases: list[tuple]) -> None:
    device = _device()
    mesh = init_device_mesh(device.type, (world_size,))
    g = torch.Generator().manual_seed(1234)
    data = torch.randint(0, VOCAB, (STEPS, world_size, 2, 33), generator=g).to(device)
    for kind, recipe, mp, autocast, impl in cases:
        what = (kind, recipe, f"mp={mp}", f"autocast={autocast}", impl)
        model = hf_model(kind).to(device)
        convert(model, kind, recipe)
        reference = copy.deepcopy(model)
        wrapped = {
            f"{n}.weight"
            for n, m in model.named_modules()
            if isinstance(m, bs.nn.Linear) and m.recipe.quantized
        }
        assert enable_quantized_all_gather(model) == len(wrapped) > 0
        policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if mp else None, reduce_dtype=torch.float32
        )
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        opt = _optimizer(model.parameters(), impl)
        losses = []
        for step in range(STEPS):
            with _autocast(autocast, device):
                loss = _loss(model, data[step, rank])
            loss.backward()
            if step == 0:  # what the first block gathered: quantized copies for its linears
                layer = model.model.layers[0]
                layer.unshard()
                q = layer.self_attn.q_proj.weight
                assert isinstance(q, QuantizedWeight), (what, type(q))
                assert q.dtype == (torch.bfloat16 if mp else torch.float32), what
                if kind == "qwen3_moe":  # experts: plain tensors in the policy's dtype
                    experts = layer.mlp.experts.gate_up_proj
                    assert type(experts) is nn.Parameter, (what, type(experts))
                    assert experts.dtype == (torch.bfloat16 if mp else torch.float32), what
                layer.reshard()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        ref_losses, ref_params, ref_opt = _reference(reference, data, mp, autocast, impl, device)
        assert losses == [s[rank] for s in ref_losses], (what, losses, ref_losses)
        for (n, p), ref in zip(model.named_parameters(), ref_params.values(), strict=True):
            assert torch.equal(p.full_tensor(), ref), (what, n)
            local = p.to_local()
            assert isinstance(local, ShardedWeight) == (n in wrapped), (what, n, type(local))
            for key in ("exp_avg", "exp_avg_sq"):
                state = opt.state[p][key]
                assert type(state.to_local()) is torch.Tensor, (what, n, key)
                assert state.to_local().dtype == torch.float32, (what, n, key)
                assert torch.equal(state.full_tensor(), ref_opt.state[ref][key]), (what, n, key)


# (model, recipe, MixedPrecisionPolicy(bf16, fp32), BF16 autocast, AdamW implementation)
CASES = [
    ("llama", "nvfp4", True, False, "foreach"),
    ("llama", "nvfp4", False, True, "foreach"),
    ("llama", "mxfp8", True, True, "fused"),
    ("qwen3_moe", "nvfp4", True, False, "foreach"),
    ("qwen3_moe", "mxfp8", False, True, "fused"),
]


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_transformers_model_under_fsdp_equals_one_process(case):
    run_local(_hf_worker, WORLD, [case])


@pytest.mark.gpu
def test_transformers_llama_under_fsdp_on_two_gpus():
    """NCCL, CUDA's Triton kernels, fused AdamW: the same comparison as on the CPU."""
    if torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} GPUs")
    cases = [
        ("llama", "nvfp4", True, False, "fused"),
        ("llama", "nvfp4", False, True, "fused"),
        ("llama", "mxfp8", True, True, "foreach"),
        ("qwen3_moe", "nvfp4", True, True, "fused"),
    ]
    run_local(_hf_worker, WORLD, cases, device="cuda")


def _compiled_worker(rank: int, world_size: int, recipe: str) -> None:
    # The benchmark's setup (bench_distributed.py's `hf` part): each decoder layer compiled
    # (`layer.compile()`, Inductor's defaults), FSDP2 with quantized all-gather, so the
    # linears get QuantizedWeights inside compiled code. With a cold compile cache this failed
    # in Dynamo on torch 2.11 ("sources must not be empty for symbol"), on GPUs and on the CPU;
    # the caches are off here so that every compile is a first one.
    torch._inductor.config.force_disable_caches = True
    device = _device()
    mesh = init_device_mesh(device.type, (world_size,))
    tokens = torch.randint(0, VOCAB, (2, 2, 33), generator=torch.Generator().manual_seed(rank))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    runs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        model = hf_model("llama").to(device)
        convert(model, "llama", recipe)
        enable_quantized_all_gather(model)
        for layer in model.model.layers:
            if compiled:
                layer.compile()
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        opt = _optimizer(model.parameters(), "foreach")
        losses = []
        for step in range(2):
            loss = _loss(model, tokens[step].to(device))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        runs.append(losses)
    # Inductor's default fast math in the unquantized ops: close to eager, not equal.
    assert torch.allclose(torch.tensor(runs[1]), torch.tensor(runs[0]), rtol=1e-2), runs


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["nvfp4"])
def test_compiled_layers_under_fsdp_compile_on_a_cold_cache(recipe):
    run_local(_compiled_worker, 1, recipe)
