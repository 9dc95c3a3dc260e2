"""Building a run from its config: device, recipe, model (converted from outside), optimizer.

Shared by `train`, `eval` and `compare`, so a checkpoint is always loaded into exactly the model
that wrote it. Precision: parameters and optimizer state stay FP32. On CUDA the forward runs
under BF16 autocast, so whatever the recipe leaves unquantized (attention, norms, BF16 layers)
computes in BF16; on the CPU it runs in FP32, where BF16 buys no speed.
"""

from __future__ import annotations

import contextlib
import functools
import math
from pathlib import Path

import torch

import blockscale.nn as bsnn
import blockscale.recipes as recipes
from blockscale import _library, models
from blockscale.models import SIZES, ModelConfig, MoEConfig, Transformer, model_config
from blockscale.ops.linear import is_dtensor
from blockscale.train.config import TrainConfig
from blockscale.train.errors import UsageError

GIB = 2**30


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(
            f"device={name!r} is not a device (use cpu, cuda, cuda:N or auto)"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"device={name!r} asked for, but this machine has no CUDA GPU")
    return device


def autocast_for(device: torch.device):
    """A factory of the forward's autocast context (a fresh one per use)."""
    if device.type == "cuda":
        return functools.partial(torch.autocast, "cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext


def build_recipe(cfg: TrainConfig) -> recipes.Recipe:
    if cfg.recipe not in recipes.names():
        raise UsageError(
            f"recipe {cfg.recipe!r} does not exist; choose one of {', '.join(recipes.names())}"
        )
    try:
        return recipes.get(cfg.recipe, **cfg.recipe_switches())
    except ValueError as e:
        raise UsageError(str(e)) from None


def build_model_config(cfg: TrainConfig) -> ModelConfig:
    if cfg.model not in SIZES:
        raise UsageError(f"model {cfg.model!r} does not exist; choose one of {', '.join(SIZES)}")
    return model_config(cfg.model, **({"seq_len": cfg.seq_len} if cfg.seq_len else {}))


def _available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 2**62  # unknown: do not refuse


def _mlp_values_per_token(mcfg: ModelConfig) -> int:
    """Activation values one layer's MLP keeps per token: about 6 per hidden dimension; an MoE
    layer keeps that for each of its top_k experts and the shared one, plus the token's k
    sorted copies and k expert outputs (4 per model dimension and assignment)."""
    if isinstance(mcfg, MoEConfig):
        routed = mcfg.top_k * (6 * mcfg.ffn_dim + 4 * mcfg.dim)
        return routed + 6 * mcfg.shared_ffn_dim
    return 6 * mcfg.ffn_dim


def estimate_bytes(mcfg: ModelConfig, cfg: TrainConfig, device: torch.device) -> int:
    """A rough lower bound: FP32 weights, grads and two AdamW moments (16 bytes a parameter),
    plus the activations autograd keeps for one micro-batch (about 16 values per model
    dimension and what the MLP keeps, per token and layer, and the logits)."""
    act_bytes = 2 if device.type == "cuda" else 4
    tokens = cfg.batch_size * mcfg.seq_len
    per_layer = 16 * mcfg.dim + _mlp_values_per_token(mcfg)
    acts = tokens * (mcfg.n_layers * per_layer * act_bytes + 3 * 4 * mcfg.vocab_size)
    return 16 * mcfg.num_params() + acts


def check_memory(mcfg: ModelConfig, cfg: TrainConfig, device: torch.device) -> None:
    need, have = estimate_bytes(mcfg, cfg, device), _available_bytes(device)
    if need > have:
        raise UsageError(
            f"model {cfg.model!r} ({mcfg.num_params() / 1e6:.0f}M parameters) with batch_size={cfg.batch_size} x "
            f"seq_len={mcfg.seq_len} needs about {need / GIB:.1f} GiB, but {device} has {have / GIB:.1f} GiB free; "
            "choose a smaller --model or --batch-size"
        )


def warn_if_reference_path(device: torch.device, recipe: recipes.Recipe) -> bool:
    """Warn when a quantized recipe will run on CUDA without the kernels, before the run is
    built rather than at its first quantization: the library's warning
    (`_library.warn_reference_path`), so the process shows it once."""
    slow = device.type == "cuda" and recipe.quantized and _library.kernels() is None
    if slow:
        _library.warn_reference_path()
    return slow


def build_model(cfg: TrainConfig, device: torch.device) -> tuple[Transformer, recipes.Recipe]:
    """The model, initialized from `cfg.seed` and converted to the recipe (a BF16 recipe is
    not converted: the baseline is plain `nn.Linear`)."""
    mcfg = build_model_config(cfg)
    recipe = build_recipe(cfg)
    if cfg.compile and isinstance(mcfg, MoEConfig) and device.type != "cuda":
        raise UsageError(
            f"--compile with model {cfg.model!r} needs a CUDA device, not {device}: compiled "
            "F.grouped_mm takes BF16 operands only, and on the CPU the experts run in FP32"
        )
    check_memory(mcfg, cfg, device)
    warn_if_reference_path(device, recipe)
    torch.manual_seed(cfg.seed)
    model = models.build_model(mcfg).to(device)
    if recipe.quantized:
        policy = bsnn.layer_policy(model, bf16_tail_fraction=cfg.bf16_tail)
        bsnn.convert(model, recipe, module_filter_fn=policy)
        # This loop changes the weights only through its torch.optim optimizer and
        # load_state_dict, so copies may be reused across micro-batches (ops/weight_cache.py)
        bsnn.set_weight_cache(model, cfg.weight_cache, scope="step")
    return model, recipe


def build_optimizer(
    model: torch.nn.Module, cfg: TrainConfig, device: torch.device
) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": params, "weight_decay": wd}
        for group, wd in ((decay, cfg.weight_decay), (no_decay, 0.0))
        for params in _by_kind(group)
    ]
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=device.type == "cuda"
    )


def _by_kind(params: list[torch.nn.Parameter]) -> list[list[torch.nn.Parameter]]:
    """`params` as one list, or, where some are DTensors (`--tp` splits the blocks' linears and
    leaves the rest plain), the DTensors and the plain tensors apart: CUDA's fused AdamW runs
    one multi-tensor kernel per group and refuses a group that mixes the two."""
    split = [[p for p in params if is_dtensor(p)], [p for p in params if not is_dtensor(p)]]
    return [kind for kind in split if kind] if split[0] else [params]


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Learning rate of the (0-based) step: linear warm-up, then cosine or WSD decay to
    `min_lr_ratio * lr`. WSD holds the peak and decays linearly over the last `decay_fraction`."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    low = cfg.min_lr_ratio
    if cfg.schedule == "cosine":
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        factor = low + (1 - low) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    else:
        decay_steps = max(1, round(cfg.decay_fraction * cfg.steps))
        progress = (step - (cfg.steps - decay_steps)) / decay_steps
        factor = 1.0 - (1 - low) * min(1.0, max(0.0, progress))
    return cfg.lr * factor
