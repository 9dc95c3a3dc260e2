"""How the quantizers differentiate: straight through `dequantize`, nothing else.

`nvfp4.quantize(x)` and `mxfp8.quantize(x)` of a tensor that requires grad, with grad mode on,
return a container that remembers x. Its `dequantize()` is then differentiable with respect to
x by the straight-through estimator: the gradient passes as though `dequantize(quantize(x))`
were the tensor it approximates, which is x itself, or x's transpose (`transpose=True`), or its
Hadamard transform (`hadamard=True`, whose own gradient is applied). Same rule for both
formats, every block shape and rounding, and a `16x16` NVFP4 tensor's `.t()`.

Nothing else carries a gradient: the codes, the scales, the amax and `dq()` (the emulated
GEMM's raw operand, without the global scale) are values of the format, not functions of x
that a gradient could follow. Without grad mode, or for an x that needs no gradient, the
container remembers nothing and `dequantize()` returns a tensor that needs no gradient.

Why straight-through. The true derivative of rounding is zero almost everywhere, so the only
gradient anyone uses through a quantizer is the straight-through one: fake-quantized weights
(`w_q = quantize(w).dequantize()` in a forward) train by it, and it is what torchao's MX and
float8 constructors and TransformerEngine's quantizers give under autograd, so code carried
over from them means the same here. Before (issue 37) MXFP8 happened to pass the gradient
straight through while NVFP4 passed it only through its block scales (122 of 2,048 entries
nonzero, values -3.2 to 4.3): a gradient that was neither. An error for every x that requires
grad would also have been one rule, but it would refuse `quantize(model.weight)`, the first
thing a user tries to see what a format does to a weight.

Training does not go through here: `blockscale.linear` and `blockscale.grouped_mm` are
autograd Functions whose backward quantizes grad_output per the recipe and runs the two
backward GEMMs; they call the quantizers inside `forward`/`backward`, where grad mode is off,
so their containers remember nothing and keep no reference to the input.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# Builds, on demand, the differentiable FP32 tensor a container approximates (from the x that
# quantize was given), or None when quantize ran without autograd.
Source = Callable[[], torch.Tensor] | None


def source_of(x: torch.Tensor, approximated: Callable[[torch.Tensor], torch.Tensor]) -> Source:
    """What a container of `x` remembers: `approximated(x)` deferred (no copy of x is made
    and no graph is built until `dequantize` asks), or None without autograd."""
    if not (torch.is_grad_enabled() and x.requires_grad):
        return None
    return lambda: approximated(x)


def transposed(source: Source) -> Source:
    """The source of a container's exact transpose."""
    return None if source is None else lambda: source().t()


class _StraightThrough(torch.autograd.Function):
    """value in the forward; the gradient to `target` unchanged in the backward."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        ctx.target_dtype = target.dtype
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, grad.to(ctx.target_dtype)


def attach(value: torch.Tensor, source: Source) -> torch.Tensor:
    """`value` (a dequantized tensor), differentiable straight through to its source."""
    if source is None or not torch.is_grad_enabled():
        return value
    return _StraightThrough.apply(value, source())
