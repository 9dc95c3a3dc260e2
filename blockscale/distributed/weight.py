"""`QuantizedWeight`: a linear weight that holds quantized copies instead of values.

`blockscale.linear` quantizes its weight on every call. Two distributed setups hand it a
weight that is already quantized:

- FSDP2 with quantized all-gather (`distributed/fsdp.py`): the unsharded parameter FSDP builds
  after the all-gather is made of the gathered NVFP4 / MXFP8 codes and scales;
- NVFP4 primary weights (`distributed/master_cast.py`): the model keeps only NVFP4 weights,
  written from ZeRO-sharded FP32 masters.

A `QuantizedWeight` is a tensor subclass with the logical shape [N, K] and dtype of the
high-precision weight (so autograd gives it a grad_weight of that dtype, and FSDP reduces it as
it would any parameter's), holding one container per operand it serves:

- `rowwise`: the copy quantized along K, for the forward GEMM (`recipe.output.weight`);
- `columnwise`: the copy quantized along N ([K, N] layout) for grad_input
  (`recipe.grad_input.weight`), absent for 16x16 NVFP4 weights, whose rowwise copy transposes
  exactly.

`_Linear` asks `weight.quantized_copy(config, transpose)` for the copy an operand needs, and
gets the held container if its config matches, or a ValueError that says what was held. The
values themselves are not there: any other use (`F.linear`, arithmetic, printing values)
raises, so a layer switched to BF16 cannot silently compute with something else.

The containers' tensors are updated in place (`update_`) rather than replaced: autograd saves
them in the forward, and FSDP refills the same buffers when it gathers again for the backward.
"""

from __future__ import annotations

from typing import Any

import torch

from blockscale import _library
from blockscale.formats import mxfp8
from blockscale.formats.mxfp8 import MXFP8Tensor
from blockscale.formats.nvfp4 import NVFP4Tensor
from blockscale.ops.quantize import as_operand, quantize_operand
from blockscale.recipes import Format, OperandConfig, Rounding

Container = NVFP4Tensor | MXFP8Tensor

# Ops that only re-describe the same weight (FSDP wraps its unsharded tensor in as_strided and
# nn.Parameter, which detaches): they return a QuantizedWeight sharing the containers.
_SAME_WEIGHT = {
    torch.ops.aten.detach.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.as_strided.default,
    torch.ops.aten.view.default,
}
# Ops that only need the metadata (autograd and FSDP make zero gradients this way).
_LIKE = {
    torch.ops.aten.zeros_like.default: torch.zeros,
    torch.ops.aten.empty_like.default: torch.empty,
}


def _tensors(q: Container) -> list[torch.Tensor]:
    if isinstance(q, NVFP4Tensor):
        return [q.data, q.scale, q.amax]
    return [q.data, q.scale]


def copy_values(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst = src (as dst's shape), skipped where dst already is src's memory; one-byte codes
    and float8 scales are copied as bytes, which every device's copy kernel supports."""
    if dst.data_ptr() == src.data_ptr():
        return
    if dst.element_size() == 1:
        dst, src = dst.view(torch.uint8), src.view(torch.uint8)
    dst.copy_(src.view(dst.shape))


class QuantizedWeight(torch.Tensor):
    """A [N, K] weight made of its quantized copies (see the module docstring).

    >>> model = bs.convert(torch.nn.Sequential(torch.nn.Linear(64, 32)), bs.recipes.get("nvfp4"))
    >>> _ = bs.distributed.to_nvfp4_primary_weights(model)
    >>> isinstance(model[0].weight, bs.distributed.QuantizedWeight), model[0].weight.shape
    (True, torch.Size([32, 64]))
    """

    rowwise: Container
    columnwise: Container | None
    rowwise_config: OperandConfig
    columnwise_config: OperandConfig | None

    @staticmethod
    def __new__(
        cls,
        shape: torch.Size,
        dtype: torch.dtype,
        rowwise: tuple[OperandConfig, Container],
        columnwise: tuple[OperandConfig, Container] | None = None,
        requires_grad: bool = False,
    ) -> QuantizedWeight:
        device = rowwise[1].data.device
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, shape, dtype=dtype, device=device, requires_grad=requires_grad
        )

    def __init__(
        self,
        shape: torch.Size,
        dtype: torch.dtype,
        rowwise: tuple[OperandConfig, Container],
        columnwise: tuple[OperandConfig, Container] | None = None,
        requires_grad: bool = False,
    ) -> None:
        if len(shape) != 2:
            raise ValueError(f"a QuantizedWeight is a 2-D [N, K] weight, got shape {tuple(shape)}")
        self.rowwise_config, self.rowwise = rowwise
        self.columnwise_config, self.columnwise = columnwise or (None, None)
        if tuple(self.rowwise.shape) != tuple(shape):
            raise ValueError(
                f"rowwise copy has shape {tuple(self.rowwise.shape)}, weight {tuple(shape)}"
            )
        if self.columnwise is not None and tuple(self.columnwise.shape) != tuple(shape)[::-1]:
            raise ValueError(
                f"columnwise copy has shape {tuple(self.columnwise.shape)}, "
                f"need {tuple(shape)[::-1]} for weight {tuple(shape)}"
            )

    __torch_function__ = torch._C._disabled_torch_function_impl

    # torch.compile sees a QuantizedWeight as the tensors of its containers (a traceable
    # subclass); the names below are how __tensor_flatten__ lists them.
    _r_data = property(lambda self: self.rowwise.data)
    _r_scale = property(lambda self: self.rowwise.scale)
    _r_amax = property(lambda self: self.rowwise.amax)
    _c_data = property(lambda self: self.columnwise.data)
    _c_scale = property(lambda self: self.columnwise.scale)
    _c_amax = property(lambda self: self.columnwise.amax)

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        names = ["_r_data", "_r_scale"]
        if isinstance(self.rowwise, NVFP4Tensor):
            names.append("_r_amax")
        if self.columnwise is not None:
            names += ["_c_data", "_c_scale"]
            if isinstance(self.columnwise, NVFP4Tensor):
                names.append("_c_amax")
        meta = (self.rowwise_config, self.columnwise_config, self.rowwise.shape, self.dtype)
        return names, meta

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: Any, outer_size: Any, outer_stride: Any):
        row_cfg, col_cfg, shape, dtype = meta

        def make(prefix: str, cfg: OperandConfig, shape: torch.Size) -> Container:
            data, scale = inner[f"{prefix}_data"], inner[f"{prefix}_scale"]
            if f"{prefix}_amax" in inner:
                return NVFP4Tensor(data, scale, inner[f"{prefix}_amax"], shape, cfg.block)
            return MXFP8Tensor(data, scale, shape)

        rowwise = (row_cfg, make("_r", row_cfg, shape))
        columnwise = None
        if col_cfg is not None:
            columnwise = (col_cfg, make("_c", col_cfg, torch.Size(tuple(shape)[::-1])))
        return QuantizedWeight(torch.Size(outer_size), dtype, rowwise, columnwise)

    def quantized_copy(self, config: OperandConfig, transpose: bool = False) -> Any:
        """The held copy `config` asks for (along K, or with transpose=True along N), as a GEMM
        operand; ValueError if this weight holds no such copy."""
        held, held_config = (
            (self.columnwise, self.columnwise_config)
            if transpose
            else (self.rowwise, self.rowwise_config)
        )
        if held is None or held_config != config:
            direction = "columnwise (along N)" if transpose else "rowwise (along K)"
            have = "nothing" if held_config is None else held_config.describe()
            raise ValueError(
                f"the layer asks for a {direction} weight copy quantized as {config.describe()}, "
                f"but this quantized weight holds {have} there; the weight was quantized for "
                "another recipe (a recipe cannot change once weights are quantized ahead)"
            )
        return as_operand(held)

    def containers(self) -> list[Container]:
        return [c for c in (self.rowwise, self.columnwise) if c is not None]

    def update_(self, other: QuantizedWeight) -> None:
        """Copy `other`'s containers into this weight's tensors, in place and without bumping
        their version counters (autograd may hold them: see the module docstring)."""
        mine = [t for c in self.containers() for t in _tensors(c)]
        theirs = [t for c in other.containers() for t in _tensors(c)]
        if [t.shape for t in mine] != [t.shape for t in theirs]:
            raise ValueError("update_ needs a QuantizedWeight with the same layout")
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(mine)):
            for dst, src in zip(mine, theirs, strict=True):
                copy_values(dst, src)

    def _same_weight(self, requires_grad: bool = False) -> QuantizedWeight:
        columnwise = None
        if self.columnwise is not None:
            columnwise = (self.columnwise_config, self.columnwise)
        return QuantizedWeight(
            self.shape,
            self.dtype,
            (self.rowwise_config, self.rowwise),
            columnwise,  # type: ignore[arg-type]
            requires_grad=requires_grad,
        )

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        weight = args[0]
        if func in _SAME_WEIGHT:
            if func is torch.ops.aten.as_strided.default and (
                tuple(args[1]) != tuple(weight.shape) or kwargs.get("storage_offset", 0)
            ):
                raise ValueError("a QuantizedWeight only takes as_strided onto its own shape")
            if func is torch.ops.aten.view.default and tuple(args[1]) != tuple(weight.shape):
                raise ValueError("a QuantizedWeight cannot be reshaped")
            return weight._same_weight()
        if func in _LIKE:
            dtype = kwargs.get("dtype") or weight.dtype
            device = kwargs.get("device") or weight.device
            return _LIKE[func](weight.shape, dtype=dtype, device=device)
        raise TypeError(
            f"{func} got a QuantizedWeight: this weight holds only quantized copies "
            f"({weight.rowwise_config.describe()}), so only blockscale.linear with the recipe "
            "it was quantized for can use it (a layer switched to BF16 needs its "
            "high-precision weight)"
        )

    def __repr__(self) -> str:  # type: ignore[override]
        col = self.columnwise_config
        cols = "" if col is None else f", columnwise={col.describe()}"
        return (
            f"QuantizedWeight(shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"rowwise={self.rowwise_config.describe()}{cols})"
        )


def quantize_weight(
    x: torch.Tensor, config: OperandConfig, transpose: bool, amax: torch.Tensor | None
) -> Container:
    """A weight (or a shard of one) quantized per `config`, along its last dim or, with
    transpose=True, its first; NVFP4 with the given tensor amax (None: its own). The Triton
    kernels on CUDA, formats/ elsewhere: the same bits."""
    if config.format is Format.NVFP4:
        # a weight's copy rounds to nearest, with no Hadamard transform, whatever `config` says
        if config.rounding is not Rounding.NEAREST or config.hadamard:
            config = OperandConfig(Format.NVFP4, block=config.block)
        return quantize_operand(x, config, transpose=transpose, amax=amax)
    kernels = _library.kernels() if _library.use_kernels(x) else None
    if kernels is not None:
        return kernels.mxfp8_quantize(x, transpose=transpose)
    return mxfp8.quantize(x, transpose=transpose)
