"""Quantize one GEMM operand the way an `OperandConfig` says.

`quantize_operand(x, config, transpose=False)` is the single place where a recipe's operand
description meets a quantizer: linear(), grouped GEMMs and telemetry all go through it, so a
faster quantizer (the Triton kernels of `blockscale/kernels/`) is wired in here once, for every
caller, by choosing it in `_quantize_nvfp4` / `_quantize_mxfp8` by device.

Every result has `.dq(dtype)` (the exact GEMM operand without the global scale) and
`.dequantize(dtype)`. A BF16 config quantizes nothing: it returns a `HighPrecisionTensor` that
holds the tensor itself (transposed as a view), so callers need no special case for it.

With `transpose=True` leading dims are flattened first and the [K, M] transpose is quantized:
blocks then run along the tokens, the layout the grad_weight operands need.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockscale.formats import mxfp8, nvfp4
from blockscale.formats.mxfp8 import MXFP8Tensor
from blockscale.formats.nvfp4 import NVFP4Tensor
from blockscale.recipes import Format, OperandConfig


@dataclass
class HighPrecisionTensor:
    """An operand a recipe leaves unquantized. `data` is the tensor (or its [K, M] view)."""

    data: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dq(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return self.data.to(dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.data.to(dtype)


QuantizedOperand = NVFP4Tensor | MXFP8Tensor | HighPrecisionTensor


def _quantize_nvfp4(
    x: torch.Tensor, config: OperandConfig, transpose: bool, generator: torch.Generator | None
) -> NVFP4Tensor:
    return nvfp4.quantize(
        x,
        block=config.block,
        rounding=config.rounding.value,
        hadamard=config.hadamard,
        transpose=transpose,
        generator=generator,
    )


def _quantize_mxfp8(x: torch.Tensor, transpose: bool) -> MXFP8Tensor:
    return mxfp8.quantize(x, transpose=transpose)


def quantize_operand(
    x: torch.Tensor,
    config: OperandConfig,
    transpose: bool = False,
    generator: torch.Generator | None = None,
) -> QuantizedOperand:
    """Quantize `x` per `config` along its last dim (its first, flattened, with transpose=True).

    `generator` feeds stochastic rounding; None draws from PyTorch's default generator, so
    `torch.manual_seed` reproduces the bits and CUDA graph replays draw fresh noise.
    """
    if not isinstance(config, OperandConfig):
        raise TypeError(f"config must be an OperandConfig, got {type(config).__name__}")
    if config.format is Format.NVFP4:
        return _quantize_nvfp4(x, config, transpose, generator)
    if config.format is Format.MXFP8:
        return _quantize_mxfp8(x, transpose)
    if transpose:
        return HighPrecisionTensor(x.reshape(-1, x.shape[-1]).t())
    return HighPrecisionTensor(x)
