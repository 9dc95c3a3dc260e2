"""Small Llama-style models used by tests, benchmarks and the CLI: dense (`llama.py`) and
mixture of experts (`moe.py`), with one table of named sizes over both."""

from dataclasses import replace

from blockscale.models.llama import DENSE_SIZES, ModelConfig, Transformer
from blockscale.models.moe import MOE_SIZES, MoE, MoEConfig, MoETransformer, moe_layers

SIZES: dict[str, ModelConfig] = {**DENSE_SIZES, **MOE_SIZES}


def model_config(name: str, **overrides) -> ModelConfig:
    """The named size, with fields replaced by `overrides` (e.g. `seq_len=256`)."""
    if name not in SIZES:
        raise ValueError(f"model size {name!r} does not exist; choose one of {', '.join(SIZES)}")
    return replace(SIZES[name], **overrides)


def build_model(cfg: ModelConfig) -> Transformer:
    """The model a config describes: a MoETransformer for a MoEConfig, else the dense one."""
    return MoETransformer(cfg) if isinstance(cfg, MoEConfig) else Transformer(cfg)


__all__ = [
    "DENSE_SIZES",
    "MOE_SIZES",
    "SIZES",
    "ModelConfig",
    "MoE",
    "MoEConfig",
    "MoETransformer",
    "Transformer",
    "build_model",
    "model_config",
    "moe_layers",
]
