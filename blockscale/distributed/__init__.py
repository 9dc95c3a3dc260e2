"""Distributed training of quantized models on torch.distributed (never a transport of our own).

- `enable_quantized_all_gather(model)`: FSDP2 (`fully_shard`) all-gathers the weights of
  quantized layers as NVFP4 / MXFP8 codes and scales, bit-identical to quantizing the whole
  weight on one device (fsdp.py).
- `cast_master_weights_to_nvfp4(...)`: ZeRO-style flat FP32 master shards cast into NVFP4
  primary weights (`to_nvfp4_primary_weights`), bit-identical to a one-rank cast for any
  slice boundaries (master_cast.py).
- `QuantizedWeight`: a weight made of quantized copies, which `blockscale.linear` uses as they
  are (weight.py).

docs/DISTRIBUTED.md describes the mechanisms, the shard rules and what is not done yet.
"""

from blockscale.distributed.fsdp import ShardedWeight, enable_quantized_all_gather
from blockscale.distributed.master_cast import (
    cast_master_weights_to_nvfp4,
    to_nvfp4_primary_weights,
)
from blockscale.distributed.weight import QuantizedWeight

__all__ = [
    "QuantizedWeight",
    "ShardedWeight",
    "cast_master_weights_to_nvfp4",
    "enable_quantized_all_gather",
    "to_nvfp4_primary_weights",
]
