"""Distributed training of quantized models on torch.distributed (never a transport of our own).

- `enable_quantized_all_gather(model)`: FSDP2 (`fully_shard`) all-gathers the weights of
  quantized layers as NVFP4 / MXFP8 codes and scales, bit-identical to quantizing the whole
  weight on one device (fsdp.py).
- `QuantizedWeight`: a weight made of quantized copies, which `blockscale.linear` uses as they
  are (weight.py).

docs/DISTRIBUTED.md describes the mechanisms, the shard rules and what is not done yet.
"""

from blockscale.distributed.fsdp import ShardedWeight, enable_quantized_all_gather
from blockscale.distributed.weight import QuantizedWeight

__all__ = ["QuantizedWeight", "ShardedWeight", "enable_quantized_all_gather"]
