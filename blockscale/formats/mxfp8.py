"""MXFP8: E4M3 values with one power-of-two (E8M0) scale per 32 values (OCP MX v1.0).

The scale exponent is rounded up, e = ceil(log2(block_amax / 448)), so no value saturates.
The quotient is formed as block_amax * fl(1/448) in FP32 and its ceil(log2) is read off the
exponent bits exactly; for block_amax = 448 * 2^k this gives e = k. A block holding Inf or
NaN gets the E8M0 NaN code, so it dequantizes to NaN instead of a finite number.

Under autograd, `dequantize` passes the gradient straight through to x, as nvfp4's does;
nothing else is differentiable (formats/straight_through.py says why).
"""

from dataclasses import dataclass, field

import torch

from blockscale.formats import straight_through
from blockscale.formats._checks import as_2d, check_blocks, check_flags
from blockscale.formats.scales import (
    E4M3_MAX,
    ceil_log2,
    e8m0_from_exponent,
    e8m0_to_float,
    exp2_int,
)

BLOCK = 32
MIN_EXPONENT, MAX_EXPONENT = -127, 127


@dataclass
class MXFP8Tensor:
    """data: float8_e4m3fn [..., K]; scale: float8_e8m0fnu [..., K/32]; `shape` is the
    logical shape ([K, M] for a transpose=True copy of an [M, K] input); `source`: under
    autograd, what `dequantize` passes the gradient to (straight_through.py).

    >>> m = bs.mxfp8.quantize(torch.randn(4, 64))
    >>> m.data.dtype, m.scale.dtype, m.scale.shape
    (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.Size([4, 2]))
    >>> m.dequantize(torch.float32).shape
    torch.Size([4, 64])
    """

    data: torch.Tensor
    scale: torch.Tensor
    shape: torch.Size
    source: straight_through.Source = field(default=None, repr=False, compare=False, kw_only=True)

    def dq(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """data * 2^e: exact in BF16 and FP32 (down to 2^-133), the emulated GEMM operand."""
        values = self.data.float().unflatten(-1, (-1, BLOCK))
        return (values * e8m0_to_float(self.scale).unsqueeze(-1)).flatten(-2).to(dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """data * 2^e in `dtype`; under autograd the gradient passes straight through to the
        quantized x (straight_through.py)."""
        return straight_through.attach(self.dq(torch.float32).to(dtype), self.source)


def scale_exponents(block_amax: torch.Tensor) -> torch.Tensor:
    """int32 exponents e = clamp(ceil(log2(block_amax * fl(1/448))), -127, 127); -127 for 0."""
    p = block_amax.float() * (1.0 / E4M3_MAX)
    finite_positive = torch.isfinite(p) & (p > 0)
    e = ceil_log2(torch.where(finite_positive, p, torch.ones_like(p)))
    e = torch.where(p > 0, e, torch.full_like(e, MIN_EXPONENT))  # zero, or underflowed product
    return e.clamp(MIN_EXPONENT, MAX_EXPONENT)


def quantize(x: torch.Tensor, transpose: bool = False) -> MXFP8Tensor:
    """Quantize x in 1x32 blocks along its last dim (first dim with transpose=True).

    Autograd: the result's `dequantize()` passes the gradient straight through to x (to x's
    transpose with transpose=True); codes and scales carry none.

    >>> x = torch.tensor([[1.0, -2.0, 0.5, 448.0] * 8])  # E4M3 values: exact
    >>> torch.equal(bs.mxfp8.quantize(x).dequantize(torch.float32), x)
    True
    >>> bs.mxfp8.quantize(torch.randn(64, 32), transpose=True).shape  # the columnwise copy
    torch.Size([32, 64])
    """
    check_flags("MXFP8", transpose=transpose)
    x2 = as_2d(x, "MXFP8", transpose)
    rows, cols = x2.shape
    check_blocks(rows, cols, "MXFP8", 1, BLOCK)
    shape = x2.shape if transpose else x.shape
    source = straight_through.source_of(
        x, lambda x: as_2d(x, "MXFP8", transpose).float().reshape(shape)
    )
    x2 = x2.detach()  # the codes and scales are values, not functions of x (see `source`)

    xf = x2.float().reshape(rows, cols // BLOCK, BLOCK)
    block_amax = xf.abs().amax(-1) if xf.numel() else xf.new_zeros(rows, cols // BLOCK)
    e = scale_exponents(block_amax)
    scale = e8m0_from_exponent(e, nan=~torch.isfinite(block_amax))
    data = (xf * exp2_int(-e).unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    lead = shape[:-1]
    return MXFP8Tensor(
        data=data.reshape(*lead, cols),
        scale=scale.reshape(*lead, cols // BLOCK),
        shape=torch.Size(shape),
        source=source,
    )
