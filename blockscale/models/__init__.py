"""Small Llama-style models used by tests, benchmarks and the CLI."""

from blockscale.models.llama import SIZES, ModelConfig, Transformer, model_config

__all__ = ["SIZES", "ModelConfig", "Transformer", "model_config"]
