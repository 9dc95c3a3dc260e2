"""Quantize one GEMM operand the way an `OperandConfig` says.

`quantize_operand(x, config, transpose=False)` is the single place where a recipe's operand
description meets a quantizer: linear(), grouped GEMMs and telemetry all go through it, so a
faster quantizer (the Triton kernels of `blockscale/kernels/`) is wired in here once, for every
caller, by choosing it in `_quantize_nvfp4` / `_quantize_mxfp8` by device.

`quantize_rows_and_tokens(x, row, tokens)` makes the two copies a linear layer needs of one
activation (input in the forward, grad_output in the backward): one along its feature dim for
the GEMM at hand, one along tokens for grad_weight. It is the seam for a kernel that reads x
once and writes both copies; today it calls `quantize_operand` twice.

Every result has `.dq(dtype)` (the exact GEMM operand without the global scale) and
`.dequantize(dtype)`. A BF16 config quantizes nothing: it returns a `HighPrecisionTensor` that
holds the tensor itself (transposed as a view), so callers need no special case for it.

With `transpose=True` leading dims are flattened first and the [K, M] transpose is quantized:
blocks then run along the tokens, the layout the grad_weight operands need.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

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


def pad_tokens(x: torch.Tensor, config: OperandConfig) -> torch.Tensor:
    """Zero-pad the rows (tokens) of [M, C] to a multiple of the block that runs along them.

    Exact for a GEMM that contracts M: zero rows change no block amax and add nothing to the
    product (the Hadamard transform is orthogonal and applied to both operands)."""
    pad = -x.shape[0] % config.block_size
    return F.pad(x, (0, 0, 0, pad)) if pad else x


def quantize_rows_and_tokens(
    x: torch.Tensor,
    row: OperandConfig | None,
    tokens: OperandConfig | None,
    generator: torch.Generator | None = None,
) -> tuple[QuantizedOperand | None, QuantizedOperand | None]:
    """The two copies of a [M, C] activation: along C per `row`, and along M (zero-padded to
    the block) per `tokens`, stored [C, M']. A None config skips that copy. Stochastic draws
    happen in that order: the row copy first."""
    row_lp = None if row is None else quantize_operand(x, row, generator=generator)
    tokens_lp = None
    if tokens is not None:
        tokens_lp = quantize_operand(
            pad_tokens(x, tokens), tokens, transpose=True, generator=generator
        )
    return row_lp, tokens_lp
