"""Quantize one GEMM operand the way an `OperandConfig` says.

`quantize_operand(x, config, transpose=False)` is the single place where a recipe's operand
description meets a quantizer: linear(), grouped GEMMs and telemetry all go through it, so a
faster quantizer (the Triton kernels of `blockscale/kernels/`) is wired in here once, for every
caller, by choosing it in `_quantize_nvfp4` / `_quantize_mxfp8` by device.

`quantize_rows_and_tokens(x, row, tokens)` makes the two copies a linear layer needs of one
activation (input in the forward, grad_output in the backward): one along its feature dim for
the GEMM at hand, one along tokens for grad_weight. Where the kernels run and the formats
allow, one kernel reads x once and writes both copies; otherwise it calls `quantize_operand`
twice.

Quantizers: on CUDA tensors the Triton kernels of `blockscale/kernels/` (bit-exact to
formats/ for nearest rounding; stochastic rounding hashes its bits from a seed drawn from
PyTorch's generator), elsewhere the formats/ references. Callers that feed a GEMM right away ask for
`dq=True`: the kernel then writes the exact BF16 `_dq` operand in the same pass, and the
returned `NVFP4Operand` / `MXFP8Operand` hands it to the GEMM; copies saved for backward skip
it and rebuild it there with the dequantize kernel.

Every result has `.dq(dtype)` (the exact GEMM operand without the global scale) and
`.dequantize(dtype)`. A BF16 config quantizes nothing: it returns a `HighPrecisionTensor` that
holds the tensor itself (transposed as a view), so callers need no special case for it.

With `transpose=True` leading dims are flattened first and the [K, M] transpose is quantized:
blocks then run along the tokens, the layout the grad_weight operands need.

Given amaxes: `quantize_operand(..., amax=)` and `quantize_rows_and_tokens(..., row_amax=,
tokens_amax=)` scale an NVFP4 copy with a given tensor amax instead of its own (None, the
default, computes its own: the same bits as without the argument). Tensor parallel uses them
with the whole tensor's amax, reduced over ranks from what `operand_amax` /
`rows_and_tokens_amax` compute on each shard (the token copy's amax is of its Hadamard
transform when it has one, so it is a second amax, not the row copy's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from blockscale import _library
from blockscale._registry import library_op, tracing
from blockscale.formats import grouped, mxfp8, nvfp4
from blockscale.formats import hadamard as rht
from blockscale.formats._checks import FLOAT_DTYPES
from blockscale.formats.grouped import TokenLayout
from blockscale.formats.mxfp8 import BLOCK as MX_BLOCK
from blockscale.formats.mxfp8 import MXFP8Tensor
from blockscale.formats.nvfp4 import BLOCK as NVFP4_BLOCK
from blockscale.formats.nvfp4 import NVFP4Tensor
from blockscale.gemm.dispatch import Transposed
from blockscale.gemm.grouped import TransposedExperts
from blockscale.recipes import Format, OperandConfig, Rounding


@dataclass
class HighPrecisionTensor:
    """An operand a recipe leaves unquantized. `data` is the tensor (or its [K, M] view).

    >>> x = torch.randn(4, 32)
    >>> q = bs.ops.quantize_operand(x, bs.recipes.OperandConfig())  # BF16: not quantized
    >>> type(q).__name__, q.data is x
    ('HighPrecisionTensor', True)
    """

    data: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dq(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return self.data.to(dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.data.to(dtype)


def _kernels() -> ModuleType:
    """blockscale.kernels; called only where `_library.use_kernels` said the kernels run."""
    return _library.kernels()  # type: ignore[return-value]


def _as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t.to(dtype)`, without the call where t has that dtype (the kernels' BF16 `_dq` for
    the GEMM on CUDA: what `to` would return then, t itself, at a torch call less)."""
    return t if t.dtype == dtype else t.to(dtype)


@dataclass
class NVFP4Operand(NVFP4Tensor):
    """An NVFP4Tensor whose `_dq` the kernels provide: written by the quantize pass, or built
    by the dequantize kernel on demand (never cached, so saved copies stay packed).
    `saved`: rebuilt in the backward from saved tensors (`load_operand`; see `_saved_dq`)."""

    dq_bf16: torch.Tensor | None = field(default=None, repr=False, compare=False)
    saved: bool = field(default=False, repr=False, compare=False)

    def dq(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        if self.dq_bf16 is not None:
            return _as_dtype(self.dq_bf16, dtype)
        if _library.use_kernels(self.data):
            if self.saved and tracing():
                return _saved_dq(self.data, self.scale, self.amax, list(self.shape)).to(dtype)
            return _as_dtype(_kernels().nvfp4_dequantize_dq(self), dtype)
        return super().dq(dtype)


@dataclass
class MXFP8Operand(MXFP8Tensor):
    """An MXFP8Tensor whose `_dq` the kernels provide, as NVFP4Operand's."""

    dq_bf16: torch.Tensor | None = field(default=None, repr=False, compare=False)
    saved: bool = field(default=False, repr=False, compare=False)

    def dq(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        if self.dq_bf16 is not None:
            return _as_dtype(self.dq_bf16, dtype)
        if _library.use_kernels(self.data):
            if self.saved and tracing():
                return _saved_dq(self.data, self.scale, None, list(self.shape)).to(dtype)
            return _as_dtype(_kernels().mxfp8_dequantize_dq(self), dtype)
        return super().dq(dtype)


@library_op("blockscale::saved_operand_dq")
def _saved_dq(
    data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor | None, shape: list[int]
) -> torch.Tensor:
    """The `_dq` of an operand the backward rebuilds from saved codes (NVFP4 with its `amax`,
    MXFP8 without), in a traced backward: the kernels' dequantize, under an op of its own.
    Where the forward dequantized the same codes (a weight that arrives quantized feeds the
    forward GEMM and, transposed, dgrad from its one 16x16 copy), AOTAutograd's CSE merged the
    two identical dequantize nodes, and the partitioner then saved the BF16 `_dq` for the
    backward (2 bytes a value, every layer's gathered weight under FSDP2) instead of reading
    the codes it holds anyway: compiled nvfp4 under FSDP2 peaked at 1.08x BF16's on two H200s
    (8B shape, 2026-11-28; the saved bytes are counted on the CPU by
    tests/test_saved_activations.py)."""
    if amax is None:
        return _kernels().mxfp8_dequantize_dq(MXFP8Tensor(data, scale, torch.Size(shape)))
    return _kernels().nvfp4_dequantize_dq(NVFP4Tensor(data, scale, amax, torch.Size(shape)))


@_saved_dq.op.register_fake
def _(data, scale, amax, shape) -> torch.Tensor:
    return data.new_empty(shape, dtype=torch.bfloat16)


def as_operand(q: NVFP4Tensor | MXFP8Tensor, dq: torch.Tensor | None = None):
    """Wrap a formats container (and its precomputed `_dq`, if any) as a GEMM operand."""
    if isinstance(q, NVFP4Tensor):
        return NVFP4Operand(q.data, q.scale, q.amax, q.shape, q.block, q.hadamard, dq)
    return MXFP8Operand(q.data, q.scale, q.shape, dq)


QuantizedOperand = NVFP4Tensor | MXFP8Tensor | HighPrecisionTensor


def _nvfp4_options(config: OperandConfig) -> dict:
    return {"block": config.block, "rounding": config.rounding.value}


def _blocks_fit(x: torch.Tensor, config: OperandConfig, transpose: bool) -> bool:
    """Whether a 2-D x fits an NVFP4 copy's blocks (along its rows with `transpose`), so that
    the checked kernel entry applies; where not, the public one raises with the reason."""
    rows, cols = (x.shape[1], x.shape[0]) if transpose else x.shape
    return cols % NVFP4_BLOCK == 0 and (config.block != "16x16" or rows % NVFP4_BLOCK == 0)


def _quantize_nvfp4(
    x: torch.Tensor,
    config: OperandConfig,
    transpose: bool,
    generator: torch.Generator | None,
    dq: bool,
    amax: torch.Tensor | None,
    codes: bool = True,
) -> NVFP4Tensor:
    options = dict(_nvfp4_options(config), hadamard=config.hadamard, transpose=transpose)
    if _library.use_kernels(x):
        if x.dim() == 2 and x.dtype in FLOAT_DTYPES and _blocks_fit(x, config, transpose):
            data, scale, dq_t, amax = _kernels().quantize_2d(
                x, config.block == "16x16", config.rounding is Rounding.STOCHASTIC,
                config.hadamard, transpose, amax, dq, generator, codes=codes,
            )  # fmt: skip
            shape = torch.Size((x.shape[1], x.shape[0])) if transpose else x.shape
            e4m3 = torch.float8_e4m3fn
            return NVFP4Operand(data, scale.view(e4m3), amax, shape, config.block,
                                config.hadamard, dq_t if dq else None)  # fmt: skip
        out = _kernels().nvfp4_quantize(x, generator=generator, amax=amax, return_dq=dq, **options)
        return as_operand(*out) if dq else as_operand(out)
    return nvfp4.quantize(x, generator=generator, amax=amax, **options)


def _quantize_mxfp8(x: torch.Tensor, transpose: bool, dq: bool) -> MXFP8Tensor:
    if _library.use_kernels(x):
        blocks_dim = 0 if transpose else 1
        if x.dim() == 2 and x.dtype in FLOAT_DTYPES and x.shape[blocks_dim] % MX_BLOCK == 0:
            data, scale, dq_t = _kernels().mxfp8_quantize_checked(x, transpose, dq)
            shape = torch.Size((x.shape[1], x.shape[0])) if transpose else x.shape
            return _mxfp8_operand(data, scale, shape, dq_t if dq else None)
        out = _kernels().mxfp8_quantize(x, transpose=transpose, return_dq=dq)
        return as_operand(*out) if dq else as_operand(out)
    return mxfp8.quantize(x, transpose=transpose)


def _mxfp8_operand(
    data: torch.Tensor, scale: torch.Tensor, shape: torch.Size, dq: torch.Tensor | None
) -> MXFP8Operand:
    """The operand of a 2-D MXFP8 copy from the kernels' bytes: what the kernels' container
    holds (views of the same bytes as E4M3 and E8M0), without building the container first."""
    e4m3, e8m0 = torch.float8_e4m3fn, torch.float8_e8m0fnu
    return MXFP8Operand(data.view(e4m3), scale.view(e8m0), shape, dq)


def quantize_operand(
    x: torch.Tensor,
    config: OperandConfig,
    transpose: bool = False,
    generator: torch.Generator | None = None,
    dq: bool = False,
    amax: torch.Tensor | None = None,
    *,
    codes: bool = True,
) -> QuantizedOperand:
    """Quantize `x` per `config` along its last dim (its first, flattened, with transpose=True).

    `generator` feeds stochastic rounding; None draws from PyTorch's default generator, so
    `torch.manual_seed` reproduces the bits and CUDA graph replays draw fresh noise.
    `dq=True`: the result feeds a GEMM now, so a kernel writes its `_dq` in the same pass.
    `amax` (NVFP4 only): the tensor amax to scale with instead of the copy's own, e.g. the
    whole tensor's when x is a shard of it (`operand_amax` gives a copy's own, so a shard's
    can be reduced over ranks first); an FP32 tensor of one value. None: the copy's own.
    `codes=False` (with dq=True): the caller reads only the `_dq` and keeps nothing (an
    emulated GEMM's operand), so where a kernel writes a rowwise NVFP4 copy of a 2-D tensor it
    writes the `_dq` alone, and the result's `data` and `scale` are empty; elsewhere (other
    formats, a copy along the first dim, the reference path) they are written as usual.

    >>> x = torch.randn(4, 32)
    >>> q = bs.ops.quantize_operand(x, bs.recipes.OperandConfig("nvfp4"))
    >>> torch.equal(q.data, bs.nvfp4.quantize(x).data)
    True
    """
    if not isinstance(config, OperandConfig):
        raise TypeError(f"config must be an OperandConfig, got {type(config).__name__}")
    if amax is not None and config.format is not Format.NVFP4:
        raise ValueError(
            f"an amax was given for a {config.describe()} operand: only NVFP4 has a tensor "
            "amax (MXFP8 scales are per block, BF16 is not quantized)"
        )
    if config.format is Format.NVFP4:
        return _quantize_nvfp4(x, config, transpose, generator, dq, amax, codes)
    if config.format is Format.MXFP8:
        return _quantize_mxfp8(x, transpose, dq)
    if transpose:
        return HighPrecisionTensor(x.reshape(-1, x.shape[-1]).t())
    return HighPrecisionTensor(x)


def pad_tokens(x: torch.Tensor, config: OperandConfig) -> torch.Tensor:
    """Zero-pad the rows (tokens) of [M, C] to a multiple of the block that runs along them.

    Exact for a GEMM that contracts M: zero rows change no block amax and add nothing to the
    product (the Hadamard transform is orthogonal and applied to both operands)."""
    pad = -x.shape[0] % config.block_size
    return F.pad(x, (0, 0, 0, pad)) if pad else x


def _both_from_one_read(
    x: torch.Tensor,
    row: OperandConfig,
    tokens: OperandConfig,
    generator: torch.Generator | None,
    tokens_dq: bool,
    row_amax: torch.Tensor | None,
    tokens_amax: torch.Tensor | None,
    row_dq: bool = True,
    codes: bool = True,
) -> tuple[QuantizedOperand, QuantizedOperand] | None:
    """Both copies from one kernel pass over x, where the formats allow it; else None."""
    if not _library.use_kernels(x) or row.format is not tokens.format or row.hadamard:
        return None
    if x.shape[0] % tokens.block_size:  # the token copy needs padding: no shared read
        return None
    if row.format is Format.NVFP4:
        if x.dim() != 2 or x.dtype not in FLOAT_DTYPES or x.shape[1] % NVFP4_BLOCK:
            return None  # (the separate quantizers say what is wrong, if anything)
        m, c = x.shape
        stochastic = Rounding.STOCHASTIC
        data, scale, dq, amax_r, data_t, scale_t, dq_t, amax_t = _kernels().quantize_both_2d(
            x, row.block == "16x16", row.rounding is stochastic, tokens.block == "16x16",
            tokens.rounding is stochastic, tokens.hadamard, row_amax, tokens_amax, row_dq,
            tokens_dq, generator, codes,
        )  # fmt: skip
        e4m3 = torch.float8_e4m3fn
        return (
            NVFP4Operand(data, scale.view(e4m3), amax_r, x.shape, row.block, False,
                         dq if row_dq else None),
            NVFP4Operand(data_t, scale_t.view(e4m3), amax_t, torch.Size((c, m)), tokens.block,
                         tokens.hadamard, dq_t if tokens_dq else None),
        )  # fmt: skip
    elif row.format is Format.MXFP8:
        if x.dim() == 2 and x.dtype in FLOAT_DTYPES and x.shape[1] % MX_BLOCK == 0:
            data, scale, dq, data_t, scale_t, dq_t = _kernels().mxfp8_quantize_both_checked(
                x, row_dq, tokens_dq, codes
            )
            m, c = x.shape
            return (
                _mxfp8_operand(data, scale, x.shape, dq if row_dq else None),
                _mxfp8_operand(data_t, scale_t, torch.Size((c, m)), dq_t if tokens_dq else None),
            )
        (q_row, dq_row), (q_tok, dq_tok) = _kernels().mxfp8_quantize_both(
            x, return_dq=(row_dq, tokens_dq), codes=codes
        )
    else:
        return None
    # A token copy saved for backward gets no `_dq` (the kernel does not write it).
    return as_operand(q_row, dq_row), as_operand(q_tok, dq_tok)


def quantize_rows_and_tokens(
    x: torch.Tensor,
    row: OperandConfig | None,
    tokens: OperandConfig | None,
    generator: torch.Generator | None = None,
    tokens_dq: bool = False,
    row_amax: torch.Tensor | None = None,
    tokens_amax: torch.Tensor | None = None,
    row_dq: bool = True,
    *,
    codes: bool = True,
) -> tuple[QuantizedOperand | None, QuantizedOperand | None]:
    """The two copies of a [M, C] activation: along C per `row`, and along M (zero-padded to
    the block) per `tokens`, stored [C, M']. A None config skips that copy. The row copy
    feeds a GEMM now (its `_dq` is made with it, unless `row_dq=False`: an FSDP2 weight shard
    only travels packed); `tokens_dq` says whether the token copy does too (backward) or is
    saved (forward). Stochastic draws: the row copy first. `codes=False`: a copy made with its
    `_dq` whose GEMM reads only that (an emulated one) and that nothing keeps is written as
    the `_dq` alone where the kernels allow (both copies from one read; a rowwise NVFP4 copy
    alone), its `data` and `scale` empty; elsewhere the codes are written as usual.

    `row_amax` / `tokens_amax` (NVFP4 copies only; None: the copy's own): the tensor amaxes to
    scale with, as `quantize_operand`'s `amax`. They are two different amaxes when the token
    copy is Hadamard-transformed; `rows_and_tokens_amax` computes a shard's own pair.

    >>> nvfp4 = bs.recipes.OperandConfig("nvfp4")
    >>> row, tokens = bs.ops.quantize_rows_and_tokens(torch.randn(20, 32), nvfp4, nvfp4)
    >>> row.shape, tokens.shape  # 20 tokens zero-padded to 32 in the token copy
    (torch.Size([20, 32]), torch.Size([32, 32]))
    """
    if row is not None and tokens is not None:
        both = _both_from_one_read(
            x, row, tokens, generator, tokens_dq, row_amax, tokens_amax, row_dq, codes
        )
        if both is not None:
            return both
    row_lp = None
    if row is not None:
        row_lp = quantize_operand(
            x, row, generator=generator, dq=row_dq, amax=row_amax, codes=codes
        )
    tokens_lp = None
    if tokens is not None:
        tokens_lp = quantize_operand(
            pad_tokens(x, tokens),
            tokens,
            transpose=True,
            generator=generator,
            dq=tokens_dq,
            amax=tokens_amax,
        )
    return row_lp, tokens_lp


def operand_amax(
    x: torch.Tensor, config: OperandConfig, transpose: bool = False
) -> torch.Tensor | None:
    """The tensor amax `quantize_operand(x, config, transpose)` would compute itself (max |x|,
    or max |y| of the Hadamard-transformed copy y), FP32 scalar; None where the format has no
    tensor amax (MXFP8, BF16). Same reads and same value as the quantizer's own.

    >>> x = torch.randn(4, 32)
    >>> torch.equal(bs.ops.operand_amax(x, bs.recipes.OperandConfig("nvfp4")), x.abs().max())
    True
    """
    if config.format is not Format.NVFP4:
        return None
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    if _library.use_kernels(x):
        if not config.hadamard:
            return _kernels().amax(x2)
        # the kernels transform along dim 0 of what they read (see kernels.nvfp4_quantize)
        return _kernels().amax_hadamard_t(x2 if transpose else x2.t())
    x2 = x2.t() if transpose else x2
    xf = (rht.transform(x2) if config.hadamard else x2).float()
    return xf.abs().amax() if xf.numel() else xf.new_zeros(())


def rows_and_tokens_amax(
    x: torch.Tensor, row: OperandConfig | None, tokens: OperandConfig | None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The (row, tokens) amaxes `quantize_rows_and_tokens(x, row, tokens)` would compute
    itself: the token copy's is that of the zero-padded, possibly Hadamard-transformed
    transpose. None for a copy that is skipped or has no tensor amax. With the kernels and two
    NVFP4 copies both come from one read of x.

    >>> x = torch.randn(20, 32)
    >>> row, tokens = bs.ops.rows_and_tokens_amax(x, bs.recipes.OperandConfig("nvfp4"), None)
    >>> torch.equal(row, x.abs().max()), tokens
    (True, None)
    """
    row_nv = row if row is not None and row.format is Format.NVFP4 else None
    tokens_nv = tokens if tokens is not None and tokens.format is Format.NVFP4 else None
    if row_nv is None and tokens_nv is None:
        return None, None
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    x_pad = x2 if tokens_nv is None else pad_tokens(x2, tokens_nv)
    one_read = row_nv is not None and tokens_nv is not None and not row_nv.hadamard
    if one_read and _library.use_kernels(x):
        plain, transformed = _kernels().amax_fused(x_pad, hadamard_t=tokens_nv.hadamard)
        return plain, (transformed if tokens_nv.hadamard else plain)
    row_amax = None if row_nv is None else operand_amax(x2, row_nv)
    tokens_amax = None if tokens_nv is None else operand_amax(x_pad, tokens_nv, transpose=True)
    return row_amax, tokens_amax


# Wrappers that stand for an exact transpose of the container they hold (`.base`).
_VIEWS = {"t": Transposed, "te": TransposedExperts}


def save_operand(op: Any) -> tuple[list[torch.Tensor], tuple[Any, ...]]:
    """Split an operand (a container, a transposed view of one, or None) into the tensors for
    ctx.save_for_backward and the metadata `load_operand` rebuilds it from."""
    if op is None:
        return [], ("none",)
    for kind, view in _VIEWS.items():
        if isinstance(op, view):
            tensors, meta = save_operand(op.base)
            return tensors, (kind, meta)
    if isinstance(op, NVFP4Tensor):
        return [op.data, op.scale, op.amax], ("nvfp4", op.shape, op.block, op.hadamard)
    if isinstance(op, MXFP8Tensor):
        return [op.data, op.scale], ("mxfp8", op.shape)
    return [op.data], ("hp",)


def load_operand(tensors: tuple[torch.Tensor, ...], meta: tuple[Any, ...]) -> Any:
    """The operand `save_operand` split; saved containers rebuild their `_dq` on demand."""
    kind = meta[0]
    if kind in _VIEWS:
        return _VIEWS[kind](load_operand(tensors, meta[1]))
    if kind == "nvfp4":
        return NVFP4Operand(*tensors, shape=meta[1], block=meta[2], hadamard=meta[3], saved=True)
    if kind == "mxfp8":
        return MXFP8Operand(*tensors, shape=meta[1], saved=True)
    if kind == "hp":
        return HighPrecisionTensor(tensors[0])
    return None


# ----------------------------------------------------------------------------- grouped


def quantize_grouped(
    x: torch.Tensor,
    offs: torch.Tensor,
    layout: TokenLayout,
    row: OperandConfig | None,
    tokens: OperandConfig | None,
    generator: torch.Generator | None = None,
    tokens_dq: bool = False,
    *,
    codes: bool = True,
    amax: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
) -> tuple[QuantizedOperand | None, QuantizedOperand | None]:
    """The two copies of a grouped activation [M, C] (formats/grouped.py): along C per `row`,
    each row with its group's amax (it feeds a GEMM now: its `_dq` is made with it), and along
    the tokens per `tokens` into the token layout [C, P] (`tokens_dq`: also its `_dq`). A None
    config skips that copy. Where both share a format the kernels make them from one read of
    x; nothing waits for the host. The CPU reference loops over the groups on the host.
    Stochastic draws: the row copy first. `codes=False`: each copy made with its `_dq` (the
    row copy; the token copy with `tokens_dq`) is written as its `_dq` alone, the result's
    `data` and `scale` empty, for a caller whose GEMMs read only the `_dq` (the emulated
    ones) and that keeps nothing of it; the reference path writes them as usual.
    `amax` (row, tokens): FP32 [E] group amaxes an NVFP4 copy scales with instead of its own
    (None: its own), e.g. the whole tensor's when x holds some of its columns (tensor
    parallel; `grouped_amax` gives a copy's own)."""
    for cfg in (row, tokens):
        if cfg is not None and not cfg.quantized:
            raise ValueError("a grouped GEMM quantizes every operand (or none: the bf16 recipe)")
    for cfg, given in zip((row, tokens), amax, strict=True):
        if given is not None and (cfg is None or cfg.format is not Format.NVFP4):
            raise ValueError("a group amax is given only for an NVFP4 copy that is made")
    if row is not None and tokens is not None and row.format is not tokens.format:
        row_lp, _ = quantize_grouped(
            x, offs, layout, row, None, generator, codes=codes, amax=(amax[0], None)
        )
        _, tok_lp = quantize_grouped(
            x, offs, layout, None, tokens, generator, tokens_dq, codes=codes,
            amax=(None, amax[1]),
        )  # fmt: skip
        return row_lp, tok_lp
    fmt = (row or tokens).format  # type: ignore[union-attr]
    if _library.use_kernels(x):
        if fmt is Format.NVFP4:
            row_out, tok_out = _kernels().nvfp4_quantize_grouped(
                x,
                layout,
                rows=row.rounding.value if row else None,
                tokens=tokens.rounding.value if tokens else None,
                hadamard=bool(tokens and tokens.hadamard),
                return_dq=(True, tokens_dq),
                amax=amax,
                generator=generator,
                codes=(codes, codes),
            )
        else:
            row_out, tok_out = _kernels().mxfp8_quantize_grouped(
                x, layout, rows=row is not None, tokens=tokens is not None,
                return_dq=(True, tokens_dq), codes=(codes, codes),
            )  # fmt: skip
        row_lp = None if row_out is None else as_operand(*row_out)
        tok_lp = None if tok_out is None else as_operand(*tok_out)
        return row_lp, tok_lp
    if fmt is Format.MXFP8:
        row_lp = None if row is None else mxfp8.quantize(x)  # (no amax: the groups do not matter)
        tok_lp = None
        if tokens is not None:
            data, scale = _reference_grouped(x, offs, "mxfp8", None, "nearest", False)
            cap = grouped.token_capacity(x.shape[0], offs.shape[0])
            tok_lp = MXFP8Tensor(data, scale, torch.Size((x.shape[1], cap)))
        return row_lp, tok_lp
    parts = _reference_grouped(
        x,
        offs,
        "nvfp4",
        None if row is None else row.rounding.value,
        None if tokens is None else tokens.rounding.value,
        bool(tokens and tokens.hadamard),
        *amax,
    )
    row_lp = tok_lp = None
    if row is not None:
        data, scale, amax, *parts = parts
        row_lp = NVFP4Tensor(data, scale, amax, x.shape, "1x16", False)
    if tokens is not None:
        data, scale, amax = parts
        shape = torch.Size((x.shape[1], grouped.token_capacity(x.shape[0], offs.shape[0])))
        tok_lp = NVFP4Tensor(data, scale, amax, shape, "1x16", tokens.hadamard)
    return row_lp, tok_lp


@library_op("blockscale::grouped_quantize_reference")
def _reference_grouped(
    x: torch.Tensor,
    offs: torch.Tensor,
    fmt: str,
    row: str | None,
    tokens: str | None,
    hadamard: bool,
    row_amax: torch.Tensor | None = None,
    tokens_amax: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """The CPU reference of `quantize_grouped` (formats/grouped.py), as tensors: NVFP4's row
    copy (data, scale, amax) when `row` names its rounding, then its token copy (data, scale,
    amax) when `tokens` does (with the given group amaxes, if any); MXFP8's token copy (data,
    scale). It loops over the groups with
    the offsets read on the host, which no trace can follow (a guard on each group's size):
    so a trace (torch.compile, a converted experts module's nonstrict call) holds it as one
    opaque op, which runs this same function on the real tensors, and eager calls it
    directly. Hence a compiled CPU step gives eager's bits, in a graph whose size does not
    grow with the number of experts."""
    if fmt == "mxfp8":
        q = grouped.mxfp8_quantize_tokens(x, offs)
        return [q.data, q.scale]
    out: list[torch.Tensor] = []
    if row is not None:
        q = grouped.nvfp4_quantize_rows(x, offs, row, amax=row_amax)
        out += [q.data, q.scale, _not_an_input(q.amax, row_amax)]
    if tokens is not None:
        q = grouped.nvfp4_quantize_tokens(x, offs, tokens, hadamard=hadamard, amax=tokens_amax)
        out += [q.data, q.scale, _not_an_input(q.amax, tokens_amax)]
    return out


def _not_an_input(found: torch.Tensor, given: torch.Tensor | None) -> torch.Tensor:
    """A given amax comes back as the copy's amax: a library op's output may not be (or
    alias) one of its inputs (AOTAutograd refuses it under CI's settings, warns otherwise), so
    with one given the output is a fresh [E] tensor with the same values."""
    return found if given is None else found.clone()


@_reference_grouped.op.register_fake
def _(x, offs, fmt, row, tokens, hadamard, row_amax=None, tokens_amax=None) -> list[torch.Tensor]:
    (m, c), groups = x.shape, offs.shape[0]
    p = grouped.token_capacity(m, groups)
    if fmt == "mxfp8":
        scale = x.new_empty(c, p // mxfp8.BLOCK, dtype=torch.float8_e8m0fnu)
        return [x.new_empty(c, p, dtype=torch.float8_e4m3fn), scale]
    out: list[torch.Tensor] = []
    for rows, cols, wanted in ((m, c, row), (c, p, tokens)):
        if wanted is not None:
            out += [
                x.new_empty(rows, cols // 2, dtype=torch.uint8),
                x.new_empty(rows, cols // NVFP4_BLOCK, dtype=torch.float8_e4m3fn),
                x.new_empty(groups, dtype=torch.float32),
            ]
    return out


def grouped_amax(
    x: torch.Tensor,
    offs: torch.Tensor,
    layout: TokenLayout,
    row: OperandConfig | None,
    tokens: OperandConfig | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The FP32 [E] group amaxes (row, tokens) `quantize_grouped(x, offs, layout, row, tokens)`
    would compute itself: each group's max |x|, and for a Hadamard token copy each group's max
    over its transformed segment. None for a copy that is skipped or not NVFP4 (MXFP8 has no
    tensor amax). One read of x on the kernels; an opaque op on the reference path, which
    loops over the groups on the host."""
    want_row = row is not None and row.format is Format.NVFP4
    want_tok = tokens is not None and tokens.format is Format.NVFP4
    if not (want_row or want_tok):
        return None, None
    hadamard = want_tok and bool(tokens.hadamard)  # type: ignore[union-attr]
    plain = want_row or (want_tok and not hadamard)
    if _library.use_kernels(x):
        found = _kernels().group_amax(x, layout, plain=plain, hadamard=hadamard)
    else:
        found = tuple(_reference_group_amax(x, offs, plain, hadamard))
        found = (found[0] if plain else None, found[-1] if hadamard else None)
    plain_amax, hadamard_amax = found
    row_amax = plain_amax if want_row else None
    tokens_amax = (hadamard_amax if hadamard else plain_amax) if want_tok else None
    return row_amax, tokens_amax


@library_op("blockscale::group_amax_reference")
def _reference_group_amax(
    x: torch.Tensor, offs: torch.Tensor, plain: bool, hadamard: bool
) -> list[torch.Tensor]:
    """formats.grouped.group_amax as an op (its host loop is opaque to a trace): the plain
    amaxes if `plain`, then the Hadamard token copy's if `hadamard`."""
    out = [grouped.group_amax(x, offs)] if plain else []
    return out + ([grouped.group_amax(x, offs, hadamard_tokens=True)] if hadamard else [])


@_reference_group_amax.op.register_fake
def _(x, offs, plain, hadamard) -> list[torch.Tensor]:
    return [x.new_empty(offs.shape[0], dtype=torch.float32) for _ in range(plain + hadamard)]


def experts_amax(w: torch.Tensor, config: OperandConfig) -> torch.Tensor | None:
    """The FP32 [E] amaxes `quantize_experts(w, config)` finds itself (max |w[e]|, along K or
    N alike: no weight copy is Hadamard-transformed), or None for a config without a tensor
    amax (MXFP8)."""
    if config.format is not Format.NVFP4:
        return None
    if _library.use_kernels(w):
        return _kernels().experts_amax(w)
    return grouped.experts_amax(w)


def quantize_experts(
    w: torch.Tensor,
    config: OperandConfig,
    transpose: bool = False,
    dq: bool = False,
    amax: torch.Tensor | None = None,
    *,
    codes: bool = True,
) -> QuantizedOperand:
    """Expert weights w [E, N, K] quantized per `config`, each expert with its own amax: along K
    ([E, N, K]), or with transpose=True along N ([E, K, N], the grad_input copy). `amax` (NVFP4
    only, FP32 [E]): the experts' amaxes to scale with instead of finding them (a backward
    rebuilding the forward's copy); ignored for MXFP8, which has none. `codes=False` (a copy
    along K with its `_dq`, for a caller whose GEMMs read only the `_dq` and that keeps
    nothing of it): the `_dq` alone, `data` and `scale` empty; the reference path writes
    them as usual."""
    if not config.quantized:
        raise ValueError("quantize_experts needs a quantized config (BF16 weights are used as is)")
    if transpose and not codes:
        raise ValueError("a copy along N keeps its codes (codes=False is for the copy along K)")
    kernels = _library.use_kernels(w)
    if config.format is Format.NVFP4:
        if transpose and config.block == "16x16":
            raise ValueError("a 16x16 weight's transpose is exact: use TransposedExperts")
        if not kernels:
            return grouped.nvfp4_quantize_experts(w, config.block, transpose=transpose, amax=amax)
        if transpose:
            out = _kernels().nvfp4_quantize_experts_t(w, return_dq=dq, amax=amax)
        else:
            out = _kernels().nvfp4_quantize_experts(
                w, config.block, return_dq=dq, amax=amax, codes=codes
            )
    else:
        if not kernels:
            return grouped.mxfp8_quantize_experts(w, transpose=transpose)
        out = _kernels().mxfp8_quantize_experts(w, transpose=transpose, return_dq=dq, codes=codes)
    return as_operand(*out) if dq else as_operand(out)


def quantize_experts_pair(
    w: torch.Tensor,
    config: OperandConfig,
    config_t: OperandConfig,
    dq: bool = False,
    *,
    codes: bool = True,
) -> tuple[QuantizedOperand, QuantizedOperand] | None:
    """Both copies of expert weights w [E, N, K] from one read, for a forward that keeps the
    copy along N for grad_input: (along K per `config`, with its `_dq` if `dq`; along N per
    `config_t`, packed), the bits of two `quantize_experts` calls. None where one launch cannot
    make both: formats other than MXFP8 for both (an NVFP4 1x16 pair would share one amax
    pass but is not wired; NVFP4 16x16 shares its one copy already), or the CPU reference.
    `codes=False`: the copy along K as `quantize_experts(codes=False)` makes it."""
    if not (config.format is Format.MXFP8 and config_t.format is Format.MXFP8):
        return None
    if not _library.use_kernels(w):
        return None
    along_k, along_n = _kernels().mxfp8_quantize_experts_pair(w, return_dq=dq, codes=codes)
    return (as_operand(*along_k) if dq else as_operand(along_k)), as_operand(along_n)
