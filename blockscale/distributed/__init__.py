"""Distributed training of quantized models on torch.distributed (never a transport of our own).

- `enable_quantized_all_gather(model)`: FSDP2 (`fully_shard`) all-gathers the weights of
  quantized layers as NVFP4 / MXFP8 codes and scales, bit-identical to quantizing the whole
  weight on one device (fsdp.py); a ValueError if nothing in the model is converted.
- `cast_master_weights_to_nvfp4(...)`: ZeRO-style flat FP32 master shards cast into NVFP4
  primary weights (`to_nvfp4_primary_weights`), bit-identical to a one-rank cast for any
  slice boundaries (master_cast.py).
- `enable_expert_parallel(model, group)`: each rank keeps E/W of every MoE layer's experts;
  tokens reach them and come back by all-to-all, and the outputs, the load-balancing loss and
  the expert gradients equal one process's on the group's whole batch (ep.py).
- `QuantizedWeight`: a weight made of quantized copies, which `blockscale.linear` uses as they
  are (weight.py).
- `QuantizedColwiseParallel` / `QuantizedRowwiseParallel`: torch's tensor parallel styles for
  converted linears, which quantize local shards with amaxes reduced over the TP group;
  `apply_tensor_parallel(model, mesh)`: blockscale's own models under such a plan, their
  stacked `wqkv` / `w13` split per projection (`tensor_parallel_plan`,
  `check_tensor_parallel`) (tp.py; imported on first use, since torch.distributed.tensor
  takes ~0.5 s to import). torch's own `ColwiseParallel` / `RowwiseParallel` on converted
  linears compute the same: this package registers tp.py's `forward_on_dtensors` as their
  forward for DTensors (`blockscale.nn.linear.register_dtensor_forward`).

docs/DISTRIBUTED.md describes the mechanisms, the shard rules and what is not done yet.
"""

from blockscale.distributed.ep import ExpertShard, enable_expert_parallel
from blockscale.distributed.fsdp import ShardedWeight, enable_quantized_all_gather
from blockscale.distributed.master_cast import (
    cast_master_weights_to_nvfp4,
    to_nvfp4_primary_weights,
)
from blockscale.distributed.weight import QuantizedWeight
from blockscale.nn.linear import register_dtensor_forward

__all__ = [
    "ExpertShard",
    "QuantizedColwiseParallel",
    "QuantizedRowwiseParallel",
    "QuantizedWeight",
    "ShardedWeight",
    "apply_tensor_parallel",
    "cast_master_weights_to_nvfp4",
    "check_tensor_parallel",
    "enable_expert_parallel",
    "enable_quantized_all_gather",
    "tensor_parallel_plan",
    "to_nvfp4_primary_weights",
]

_TP_NAMES = (
    "QuantizedColwiseParallel",
    "QuantizedRowwiseParallel",
    "apply_tensor_parallel",
    "check_tensor_parallel",
    "tensor_parallel_plan",
)


def _forward_on_dtensors(module, input):
    """A converted Linear's forward under torch's own tensor-parallel styles (tp.py, loaded on
    first use like the names above; a DTensor exists, so torch.distributed.tensor is loaded)."""
    from blockscale.distributed import tp  # noqa: PLC0415 (see the module docstring)

    return tp.forward_on_dtensors(module, input)


register_dtensor_forward(_forward_on_dtensors)


def __getattr__(name: str) -> object:
    if name in _TP_NAMES:
        from blockscale.distributed import tp  # noqa: PLC0415 (see the module docstring)

        return getattr(tp, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
