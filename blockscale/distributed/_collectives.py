"""Amax reduction over a process group that keeps NaN.

A MAX all-reduce of floats is not guaranteed to propagate NaN (NCCL's may return the other
operand). Amaxes are non-negative, and for non-negative floats the order of their bit patterns
read as int32 is the float order, with Inf (0x7F800000) below the quiet NaN (0x7FC00000). So
the reduction runs on the bits, NaNs first made that one positive NaN: exact, and NaN anywhere
gives NaN everywhere, as NUMERICS.md asks of non-finite input.
"""

import torch
import torch.distributed as dist

NAN_BITS = 0x7FC00000


def amax_bits(amax: torch.Tensor) -> torch.Tensor:
    """FP32 amaxes (>= 0 or NaN) as int32 bits whose integer max is the NaN-propagating max."""
    amax = amax.float()
    return amax.view(torch.int32).masked_fill(torch.isnan(amax), NAN_BITS)


def all_reduce_amax(amax: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The elementwise max of `amax` over the group's ranks (FP32, NaN-propagating)."""
    bits = amax_bits(amax).clone()
    dist.all_reduce(bits, op=dist.ReduceOp.MAX, group=group)
    return bits.view(torch.float32)
