"""`linear(input, weight, bias, recipe)`: a linear layer whose three GEMMs follow a recipe.

The autograd Function writes the three GEMMs out, each with both operands quantized along the
dimension it contracts (see `blockscale.recipes`):

```
forward   input        -> input_lp        (output.input, along K)
          weight       -> weight_lp       (output.weight, along K; 16x16 tiles by default)
          output = input_lp @ weight_lp.T * alpha + bias
          saved:  input_t_lp  = input quantized along tokens (grad_weight.input_t)
                  weight itself (a reference) and weight_lp's amax
backward  weight       -> weight_t         the 16x16 weight_lp again (its transpose is exact),
                                           or a copy quantized along N (grad_input.weight)
          grad_output  -> grad_output_lp   (grad_input.grad_output, along N)
          grad_input  = grad_output_lp @ weight_t * alpha
          grad_output  -> grad_output_t_lp (grad_weight.grad_output_t, along tokens)
          grad_weight = grad_output_t_lp @ input_t_lp.T * alpha
          grad_bias   = grad_output summed over tokens, in FP32
```

Memory: of the input only low-precision containers are saved for backward (packed codes,
scales, amax), never the high-precision input when the recipe quantizes it. The price is that
input_t is quantized in the forward, whether or not a backward follows (`torch.no_grad()`
skips it: nothing is saved then). Of the weight, the backward quantizes dgrad's operand
again from the weight itself, which the Function saves as `F.linear` does: a reference to a
tensor that lives anyway (the parameter), plus the FP32 amax the forward scaled it with (the
already reduced one under tensor parallel, so the backward needs no collective). A saved
packed copy would cost 0.56 bytes per parameter (NVFP4) or 1.03 (MXFP8) of activation memory,
~0.9 GiB at the llama-8b shape; the price is one more weight quantization per backward. The
bits are those of the forward's copy (the same weight, config and amax; round-to-nearest is
deterministic), and autograd's version counter raises if the weight changes in place between
forward and backward. The forward's packed copy is still saved where rebuilding it would not
give the same bits or would cost memory: a stochastically rounded weight config, a weight
that arrives quantized (blockscale.distributed's all-gathered or primary weights: there are
no high-precision values to rebuild from), and a weight computed in the forward (a cast copy,
say: saving it would keep it alive, at 2 bytes per value or more). `RECOMPUTE_WEIGHT = False`
saves the packed copy always. Beside the weight, which both keep, an NVFP4 layer saves about a
quarter of what a BF16 layer saves (BF16's input). Compiled, AOTAutograd's partitioner picks
what the backward graph keeps: with the weight a graph input, it takes the weight and
quantizes it again there (tests/test_compile.py). For that the rebuild must not be the
forward's call again: Inductor drops the detach on the saved amax, and the partitioner's CSE
then merged the two equal calls, so the backward read the forward's BF16 `_dq`, held from
forward to backward (1.18 GiB at the llama-1b shape, 2.8 GiB at llama-8b's; docs/MODELS.md).
On the emulated backend the rebuild writes the `_dq` alone (`quantize_operand`'s
`codes=False`): all the GEMM reads, and a call of its own. (The native backend, unverified
on hardware, reads the codes, so its rebuild is still the forward's call: a compiled graph
keeps the forward's copy there.) With a `weight_cache`
(ops/weight_cache.py; every `blockscale.nn.Linear` has one) the forward's copy and dgrad's are
made once per optimizer step and taken from the cache by later forwards and backwards, with
the same bits; the cache holds the packed copies (0.56 bytes a value for NVFP4) until the next
optimizer step.

Shared input: layers that read the same input tensor one after another (q/k/v projections,
gate/up) quantize it once. The last forward's quantized input (both copies) is kept with a
weak reference to the input and its version counter; the next forward that gets the very
same tensor, unmodified, with the same two input configs reuses the copies, and saves the same
packed input_t (one saved copy for the three projections, not three). Only deterministic
configs are shared (round-to-nearest: stochastic draws must stay independent per layer), only
eager (a trace computes each quantization; `SHARE_INPUT_QUANTIZATION = False` turns sharing
off), not under tensor parallel's amax reduction, and not for inference tensors (made under
`torch.inference_mode()`, they have no version counter). The kept copies (including the `_dq`
operand, which the next sharing GEMM reads instead of a new one) live until a forward with
another input replaces them or a backward starts. The bits are those of separate quantizations.

Tokens: any leading dims are flattened to M. The grad_weight operands are quantized along M,
so M is zero-padded to the block size when it is not a multiple of it. Zero rows change neither
a block's amax nor the product (the Hadamard transform is orthogonal and applied to both
operands), so this is exact; the static dims (K, N) must fit the blocks, which
`unsupported_reason` checks and `convert` uses to skip layers. The output comes back with the
input's leading dims as a tensor of its own, not a view of the [M, N] product, so a model may
change it in place as it may F.linear's (`unaliased`; transformers' Llama 4 does).

Dtypes: the output has the autocast dtype when autocast is on for the input's device, else the
input's dtype; grad_input has the input's dtype, grad_weight the weight's (FP32 master weights
get an FP32 grad_weight straight from the FP32 accumulator). Under autocast the input is
quantized from its cast to the autocast dtype, the values autocast's `F.linear` would compute
on (TransformerEngine's layers cast their input to the autocast dtype too); grad_input is then
made in that dtype and widened, as the cast's backward widens it (`CAST_INPUT_UNDER_AUTOCAST`;
an FP32-master model's norm outputs are FP32, and compiled, the cast is Inductor's to fuse into
the norm, so the quantize passes read half the bytes: no change in the 1B step's time was
measured, docs/MODELS.md, "The input's autocast cast"). The weight is quantized from
the dtype it arrives in (an FP32 master is not rounded to BF16 first). Autocast is off inside
the Function so that it cannot recast the exact emulated operands.

Randomness: stochastic rounding draws from PyTorch's default generator in a fixed order
(grad_output for dgrad, then grad_output_t for wgrad), so `torch.manual_seed` reproduces a
step bit for bit. Under torch.compile the draws come from Inductor's generator: reproducible
under a seed, but not the eager bits (set `torch._inductor.config.fallback_random = True` for
those).

Tensor parallel: `linear(..., amax_reduction=AmaxReduction(reduce, input=..., weight=...,
grad_output=...))` says which operands are shards of logically whole tensors; the NVFP4
amaxes of those operands' copies are computed locally, reduced by `reduce` (one collective per
forward, one per backward) and handed to the quantizers, so each shard is quantized exactly
as its part of the whole tensor (blockscale.distributed.tp builds this for DTensor plans).
A DTensor input or weight raises: the quantizers and GEMMs here take local tensors.

torch.compile: everything here traces with fullgraph=True. Inductor relaxes by default what
the quantizers and the GEMM epilogue depend on (FP32 division is lowered to an approximate
instruction in Triton, BF16 round trips between fused ops are dropped, `acc * alpha + bias`
may become one FMA); `EXACT_INDUCTOR_OPTIONS` restores eager's numerics:
`torch.compile(model, options=EXACT_INDUCTOR_OPTIONS)`.

Compile time: Dynamo need not trace this module. `compiled_linear` is `linear` as one opaque
call in Dynamo's graph (`nonstrict_trace`), whose ops AOTAutograd then records by running this
Python on fake tensors, forward and backward. Dynamo interprets every bytecode of what it
traces (about 7,000 instructions per NVFP4 layer, forward and backward, on the kernel path:
quantize-call bookkeeping, containers, dispatch checks), which was most of a converted Llama's
extra compile time; AOTAutograd runs the same Python at Python speed and records the same ops,
so the compiled graph and its bits are unchanged (docs/LOG.md, 2026-11-25).
`blockscale.nn.Linear` calls it under Dynamo; `linear` called from other traced code is still
traced by Dynamo.

Second derivatives: a backward under `create_graph=True` (a gradient penalty,
`torch.autograd.grad(out, x, create_graph=True)`) runs the same GEMMs on the same quantized
operands, so the first derivatives are the same bits, inside a Function of their own
(`_LinearBackward`) whose backward differentiates them with every quantizer
straight-through (formats/straight_through.py): FP32 GEMMs on the dequantized operands the
backward GEMMs read. grad_input = G @ W gives ggi @ W to grad_output and G.T @ ggi to the
weight; grad_weight = Gt @ Xt.T gives grad_output the transposed (ggw @ Xt), with the
Hadamard transform's backward applied where the token copy has it (so that it cancels, as in
the GEMM); grad_bias gives it ggb on every row. Two terms cannot be given, and raise
NotImplementedError when a second backward needs them, rather than coming out as zero:
grad_weight's with respect to the input, which is never saved (only its packed token copy,
which the graph cannot reach through), and grad_input's with respect to a weight of which only
the packed copy was saved ("Memory": a stochastically rounded copy, a weight that arrives
quantized or is computed in the forward, `RECOMPUTE_WEIGHT = False`). A gradient penalty on
the input's gradient of a converted model with plain weights needs neither. torch.compile
refuses double backward itself; a traced backward keeps the plain path.
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch._dynamo import nonstrict_trace

from blockscale._registry import tracing
from blockscale.formats.hadamard import matrix as hadamard_matrix
from blockscale.formats.nvfp4 import NVFP4Tensor
from blockscale.gemm.dispatch import (
    Backend,
    Transposed,
    activation_codes,
    resolve_backend,
    scaled_mm_resolved,
)
from blockscale.ops.quantize import (
    HighPrecisionTensor,
    QuantizedOperand,
    load_operand,
    operand_amax,
    quantize_operand,
    quantize_rows_and_tokens,
    rows_and_tokens_amax,
    save_operand,
)
from blockscale.ops.weight_cache import (
    Stamp,
    WeightCache,
    enter_forward,
    exit_forward,
    forward_epoch,
)
from blockscale.recipes import Format, OperandConfig, Recipe, Rounding, require_recipe

Operand = QuantizedOperand | Transposed

# Inductor options under which compiled quantization reproduces eager's bits: IEEE FP32
# division, BF16 round trips kept and no FMA contraction (emulate_precision_casts also turns
# Triton's fp fusion off), subnormals not flushed in library calls.
EXACT_INDUCTOR_OPTIONS = {
    "eager_numerics.division_rounding": True,
    "emulate_precision_casts": True,
    "eager_numerics.disable_ftz": True,
}


def unsupported_reason(in_features: int, out_features: int, recipe: Recipe) -> str | None:
    """Why a [out_features, in_features] weight cannot run `recipe`, or None if it can.

    >>> bs.ops.unsupported_reason(64, 32, bs.recipes.get("nvfp4")) is None
    True
    >>> bs.ops.unsupported_reason(60, 32, bs.recipes.get("nvfp4"))
    'in_features=60 is not a multiple of 16 (output.input is nvfp4 1x16, nearest)'
    """
    checks = (
        ("in_features", in_features, "output.input", recipe.output.input),
        ("in_features", in_features, "output.weight", recipe.output.weight),
        ("out_features", out_features, "grad_input.grad_output", recipe.grad_input.grad_output),
        ("out_features", out_features, "grad_input.weight", recipe.grad_input.weight),
    )
    for dim_name, dim, operand, op in checks:
        if dim % op.block_size:
            return (
                f"{dim_name}={dim} is not a multiple of {op.block_size} "
                f"({operand} is {op.describe()})"
            )
    w = recipe.output.weight
    if w.block == "16x16" and out_features % 16:
        return f"out_features={out_features} is not a multiple of 16 (output.weight is 16x16)"
    return None


def _mm(
    a: Operand,
    b: Operand,
    out_dtype: torch.dtype,
    compute_dtype: torch.dtype,
    backend: Backend,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """a @ b.T (+ bias): block-scaled through the dispatch, or a plain GEMM for BF16 operands."""
    if isinstance(a, HighPrecisionTensor):
        b_hp = b.data.to(compute_dtype)  # type: ignore[union-attr]
        bias_hp = None if bias is None else bias.to(compute_dtype)
        return F.linear(a.data.to(compute_dtype), b_hp, bias_hp).to(out_dtype)
    return scaled_mm_resolved(a, b, out_dtype, bias, backend)  # type: ignore[arg-type]


def weight_operand(
    weight: torch.Tensor,
    config: OperandConfig,
    transpose: bool = False,
    dq: bool = False,
    amax: torch.Tensor | None = None,
    codes: bool = True,
) -> QuantizedOperand:
    """The weight quantized per `config` (NVFP4 with `amax`, if given; `codes`: as
    `quantize_operand`'s). A weight that arrives already quantized (one that
    blockscale.distributed all-gathered as NVFP4/MXFP8, or NVFP4 primary weights) has a
    `quantized_copy` method and hands over the copy it holds instead."""
    if holds_quantized_copies(weight):
        return weight.quantized_copy(config, transpose)  # type: ignore[attr-defined]
    if config.format is not Format.NVFP4:
        amax = None
    return quantize_operand(weight, config, transpose=transpose, dq=dq, amax=amax, codes=codes)


def holds_quantized_copies(weight: torch.Tensor) -> bool:
    """A weight that arrives quantized (a `QuantizedWeight`): it hands over its copies."""
    return hasattr(type(weight), "quantized_copy")


# Whether the backward quantizes dgrad's weight operand again instead of saving the forward's
# packed copy (module docstring, "Memory"). Read at each forward; grouped_mm follows it too.
RECOMPUTE_WEIGHT = True


def recomputes_weight(
    weight: torch.Tensor, config: OperandConfig, under_trace: bool = True
) -> bool:
    """Whether the backward rebuilds the dgrad operand (quantized per `config`) from `weight`
    itself, which is then saved in place of a packed copy: a plain tensor (not one that arrives
    quantized), a round-to-nearest config (a stochastic one would draw other bits), and storage
    that outlives the step anyway: a leaf (a parameter) or a view of one. A weight computed in
    the forward (e.g. `w.to(torch.bfloat16)`, as models/moe.py does for F.grouped_mm) would be
    kept alive by the save, at more bytes than its packed copy; it is told by its autograd
    history, so one computed from a weight that needs no gradient (a frozen weight cast
    under autograd, say) looks like a leaf and is saved. Under a trace the last rule is
    left to the compiler: what a compiled graph keeps for its backward is chosen by
    AOTAutograd's partitioner, not by what the Function saves (and traced inputs have no
    autograd history to read it from), and `under_trace` is the answer there. linear's weights
    are graph inputs, so True; grouped_mm passes False, because experts' weights usually reach
    it as a cast made in the forward, which a compiled backward rebuilding from it kept alive
    (measured on an H100, compiled MoE layer: nvfp4 peak 0.93x -> 1.41x BF16's,
    docs/TRAINING.md)."""
    if (
        not RECOMPUTE_WEIGHT
        or holds_quantized_copies(weight)
        or config.rounding is not Rounding.NEAREST
    ):
        return False
    if tracing():
        return under_trace
    base = weight if weight._base is None else weight._base
    return base.grad_fn is None


def cached_weight(
    cache: WeightCache | None,
    stamp: Stamp | None,
    make: Callable[[bool], QuantizedOperand],
    config: OperandConfig,
    transpose: bool,
    dq: bool,
    renew: bool = True,
) -> QuantizedOperand:
    """The weight's copy per `config` (along N with `transpose`): from `cache` where it holds
    one made under `stamp`, else `make(dq)`, kept there (`renew`: see `WeightCache.fetch`).
    Round-to-nearest copies only: a stochastic one draws new bits at each use
    (ops/weight_cache.py)."""
    if cache is None or config.rounding is not Rounding.NEAREST:
        return make(dq)
    return cache.fetch(stamp, (config, transpose), make, dq, renew)


def cached_dgrad_weight(
    cache: WeightCache | None, stamp: Stamp | None, recipe: Recipe, shared: bool
) -> QuantizedOperand | None:
    """dgrad's weight copy as the cache holds it under the forward's `stamp` (the 16x16
    forward copy when `shared`, else the copy along N), or None."""
    if cache is None:
        return None
    if shared:
        return cache.get(stamp, (recipe.output.weight, False))
    return cache.get(stamp, (recipe.grad_input.weight, True))


def _dgrad_weight(
    weight: torch.Tensor,
    recipe: Recipe,
    shared: bool,
    amax: torch.Tensor | None,
    cache: WeightCache | None = None,
    stamp: Stamp | None = None,
    dq_only: bool = False,
) -> Operand:
    """dgrad's weight operand rebuilt in the backward, with its `_dq` (it feeds the GEMM now):
    the 16x16 forward copy again, transposed, when `shared`, else the copy along N. `amax`:
    the forward's (the same bits as the forward's copy), None where the format has none.
    With a `cache`, the copy the forward's `stamp` left there, or a new one kept there.
    `dq_only` (an emulated GEMM, which reads only the `_dq`): without a cache, the 16x16 copy
    is rebuilt without its codes (`quantize_operand`'s `codes=False`). That also keeps it
    from being the forward's call again: a compiled graph merges two equal calls, and the
    backward then holds the forward's `_dq` from forward to backward (module docstring,
    "Memory")."""
    if shared:
        config = recipe.output.weight
        codes = not dq_only or cache is not None

        def make(dq: bool) -> QuantizedOperand:
            return weight_operand(weight, config, dq=dq, amax=amax, codes=codes)

        w_lp = cached_weight(cache, stamp, make, config, False, dq=True, renew=False)
        return Transposed(w_lp)  # type: ignore[arg-type]
    config = recipe.grad_input.weight

    def make_t(dq: bool) -> QuantizedOperand:
        return weight_operand(weight, config, transpose=True, dq=dq, amax=amax)

    return cached_weight(cache, stamp, make_t, config, True, dq=True, renew=False)


@dataclass(frozen=True)
class AmaxReduction:
    """Which operands of a linear are shards of a logically whole tensor, and the collective
    that makes their NVFP4 tensor amaxes whole (tensor parallel: blockscale.distributed.tp).

    `reduce(t)`: the elementwise max of the FP32 vector `t` over the ranks that hold the other
    shards, the same result on each (NaN anywhere gives NaN). `input`: the input is sharded
    along K (a row-wise layer); `weight`: the weight is a shard (along N or K);
    `grad_output`: grad_output is sharded along N (a column-wise layer). For each, the
    amaxes its copies would take from the local tensor are reduced first (one collective for
    the forward's, one for the backward's; none when no operand is NVFP4), so every rank
    scales with the amax of the whole tensor. With shards that hold whole blocks, the codes
    and block scales are then exactly the whole tensor's. A Hadamard token copy's amax is the
    max over per-column transforms (tokens are not sharded), so it reduces the same way.

    >>> x, w, r = torch.randn(4, 64), torch.randn(32, 64), bs.recipes.get("nvfp4")
    >>> alone = bs.ops.AmaxReduction(lambda t: t, input=True)  # one rank: the max is its own
    >>> torch.equal(bs.linear(x, w, None, r, amax_reduction=alone), bs.linear(x, w, None, r))
    True
    """

    reduce: Callable[[torch.Tensor], torch.Tensor]
    input: bool = False
    weight: bool = False
    grad_output: bool = False


def reduced_amaxes(
    reduction: AmaxReduction, amaxes: list[torch.Tensor | None]
) -> list[torch.Tensor | None]:
    """The local amaxes (None where an operand has none; a scalar, or a grouped GEMM's [E]
    vector) reduced in one collective, each in its own shape."""
    present = [a.float().reshape(-1) for a in amaxes if a is not None]
    if not present:
        return amaxes
    whole = reduction.reduce(torch.cat(present)).split([a.numel() for a in present])
    parts = iter(whole)
    return [None if a is None else next(parts).reshape(a.shape) for a in amaxes]


def dgrad_amax(
    config: OperandConfig, w_lp: QuantizedOperand, w_amax: torch.Tensor | None = None
) -> torch.Tensor | None:
    """The tensor amax dgrad's weight copy is scaled with, for the backward to reuse: the
    reduced one under tensor parallel, else the forward copy's own (max |w|: no recipe puts a
    Hadamard transform on a weight, so every NVFP4 copy of it has this amax; for stacked
    expert weights, grouped_mm's, the per-expert amaxes [E]). None for a
    non-NVFP4 config, or where the forward copy has no amax either (then the backward's
    quantizer finds it, as the forward's separate copy did)."""
    if config.format is not Format.NVFP4:
        return None
    if w_amax is not None:
        return w_amax
    return w_lp.amax if isinstance(w_lp, NVFP4Tensor) else None


# Whether consecutive forwards on the same input tensor share its quantization (module docstring).
SHARE_INPUT_QUANTIZATION = True


class _SharedInput(threading.local):
    """The last forward's quantized input, per thread (module docstring, "Shared input")."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.ref: weakref.ref | None = None
        self.version = -1
        self.key: tuple = ()
        self.value: tuple | None = None

    def get(self, input: torch.Tensor, key: tuple) -> tuple | None:
        if self.ref is None or self.ref() is not input:
            return None
        if input._version != self.version or self.key != (forward_epoch(), *key):
            return None
        return self.value

    def put(self, input: torch.Tensor, key: tuple, value: tuple) -> None:
        epoch = forward_epoch()
        if epoch is None:  # no forward scope bounds the reuse (ops/weight_cache.py)
            self.clear()
            return
        self.ref, self.version, self.key, self.value = (
            weakref.ref(input),
            input._version,
            (epoch, *key),
            value,
        )


_SHARED = _SharedInput()


def _shareable(*configs: OperandConfig | None) -> bool:
    return (
        SHARE_INPUT_QUANTIZATION
        and not tracing()
        and all(c is None or c.rounding is Rounding.NEAREST for c in configs)
    )


def _quantized_input(
    input: torch.Tensor,
    x: torch.Tensor,
    dtype: torch.dtype,
    row_cfg: OperandConfig,
    wgrad_cfg: OperandConfig | None,
    x_amax: torch.Tensor | None,
    tokens_amax: torch.Tensor | None,
    codes: bool = True,
) -> tuple:
    """(input_lp, input_t) of `x` (input flattened) cast to `dtype`, reused from the previous
    forward when it quantized the same unmodified input the same way (`codes`:
    quantize_rows_and_tokens'). The cast is made only where a quantization is."""
    if (
        not _shareable(row_cfg, wgrad_cfg)
        or x_amax is not None
        or tokens_amax is not None
        or input.is_inference()  # no version counter to tell an in-place change by
        # copies made there are inference tensors, which a training forward could not save
        or torch.is_inference_mode_enabled()
    ):
        return quantize_rows_and_tokens(
            x.to(dtype), row_cfg, wgrad_cfg, row_amax=x_amax, tokens_amax=tokens_amax, codes=codes
        )
    key = (row_cfg, wgrad_cfg, codes, dtype)  # the same tensor has the same shape
    found = _SHARED.get(input, key)
    if found is None:
        found = quantize_rows_and_tokens(x.to(dtype), row_cfg, wgrad_cfg, codes=codes)
        _SHARED.put(input, key, found)
    return found


_NOTHING = contextlib.nullcontext()


def autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """Autocast switched off for `device_type`, as `torch.autocast(device_type,
    enabled=False)`; where it is off already (FSDP2's mixed precision, a backward), a shared
    no-op context instead of a new autocast object (a few microseconds a call, twice a layer).
    Under a trace the autocast context is always entered, so the traced graph records it."""
    if torch.is_autocast_enabled(device_type) or tracing():
        return torch.autocast(device_type, enabled=False)
    return _NOTHING


def unaliased(out: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """`out` in `shape`, as a tensor that is no view: it shares `out`'s storage (no copy),
    for a caller that holds `out` nowhere else. Autograd refuses an in-place change to a
    Function's output that is a view of a tensor made inside the Function (a reshape of the
    GEMM's [M, N], even to the same shape), and models do change a linear's output in place:
    transformers' Llama 4 adds its routed experts into the shared expert's output.
    `aten._unsafe_view` is the reshape `torch.matmul` returns for that reason (the experts
    router returns its bmm result so too). `contiguous` copies only an output no GEMM here
    makes. An `out` of that shape that is no view already (a 2-D input's) is returned as it
    is, without the two calls."""
    if out.shape == shape and out._base is None and out.is_contiguous():
        return out
    return torch.ops.aten._unsafe_view(out.contiguous(), shape)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        input: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        recipe: Recipe,
        backend: Backend,
        out_dtype: torch.dtype,
        sharded: AmaxReduction | None,
        cache: WeightCache | None,
        stamp: Stamp | None,
    ) -> torch.Tensor:
        lead, k = input.shape[:-1], input.shape[-1]
        x = input if input.dim() == 2 else input.reshape(-1, k)
        # Under autocast, the autocast dtype's values of the input (module docstring, "Dtypes"):
        # traced, the cast is one more op for Inductor to fuse into the input's producer.
        ctx.cast_dtype = quantized_input_dtype(input, out_dtype)
        with autocast_off(input.device.type):
            wgrad_cfg = recipe.grad_weight.input_t if ctx.needs_input_grad[1] else None
            dgrad_cfg = recipe.grad_input.weight
            shared = dgrad_cfg.block == "16x16" and dgrad_cfg == recipe.output.weight
            dgrad_copy = ctx.needs_input_grad[0] and not shared
            x_amax = tokens_amax = w_amax = None
            if sharded is not None:
                local: list[torch.Tensor | None] = [None, None, None]
                if sharded.input:
                    x = x.to(ctx.cast_dtype)  # (then the quantization's cast is a no-op)
                    local[:2] = rows_and_tokens_amax(x, recipe.output.input, wgrad_cfg)
                if sharded.weight and not holds_quantized_copies(weight):
                    # Both weight copies scale with max |w|: a recipe puts no Hadamard
                    # transform on a weight.
                    configs = [recipe.output.weight] + ([dgrad_cfg] if dgrad_copy else [])
                    nvfp4 = [c for c in configs if c.format is Format.NVFP4]
                    local[2] = operand_amax(weight, nvfp4[0]) if nvfp4 else None
                x_amax, tokens_amax, w_amax = reduced_amaxes(sharded, local)
            # an emulated GEMM reads only the row copy's `_dq` (the token copy is saved packed)
            x_lp, input_t = _quantized_input(
                input, x, ctx.cast_dtype, recipe.output.input, wgrad_cfg, x_amax, tokens_amax,
                codes=activation_codes(backend),
            )  # fmt: skip
            w_cfg = recipe.output.weight

            def make_w(dq: bool) -> QuantizedOperand:
                return weight_operand(weight, w_cfg, dq=dq, amax=w_amax)

            w_lp = cached_weight(cache, stamp, make_w, w_cfg, False, dq=True)
            out = _mm(x_lp, w_lp, out_dtype, out_dtype, backend, bias)

            # What dgrad's weight operand is rebuilt from in the backward (the weight itself and
            # the amax), or its packed copy (module docstring, "Memory").
            ctx.recompute = ctx.needs_input_grad[0] and recomputes_weight(weight, dgrad_cfg)
            ctx.shared = shared
            w_tensors: list[torch.Tensor] = []
            if ctx.recompute:
                amax = dgrad_amax(dgrad_cfg, w_lp, w_amax)
                w_tensors = [weight] if amax is None else [weight, amax]
            elif ctx.needs_input_grad[0]:

                def make_t(dq: bool) -> QuantizedOperand:
                    return weight_operand(weight, dgrad_cfg, transpose=True, dq=dq, amax=w_amax)

                weight_for_dgrad = (
                    cached_weight(cache, stamp, make_t, dgrad_cfg, True, dq=False)
                    if dgrad_copy
                    else Transposed(w_lp)  # type: ignore[arg-type]
                )
                w_tensors, ctx.weight_meta = save_operand(weight_for_dgrad)
            ctx.cache, ctx.stamp = cache, stamp

        x_tensors, ctx.input_meta = save_operand(input_t)
        ctx.n_weight_tensors = len(w_tensors)
        ctx.save_for_backward(*w_tensors, *x_tensors)
        ctx.recipe, ctx.backend, ctx.compute_dtype = recipe, backend, out_dtype
        ctx.sharded = sharded
        ctx.input_shape, ctx.input_dtype, ctx.weight_dtype = input.shape, input.dtype, weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return unaliased(out, (*lead, out.shape[-1]))

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if not tracing():  # a traced backward keeps no eager state to release
            _SHARED.clear()  # the forward's last kept input copies are not needed past here
        saved = ctx.saved_tensors
        if torch.is_grad_enabled() and not tracing():
            # create_graph=True: the same GEMMs, differentiable (module docstring, "Second
            # derivatives"). A traced backward never is: torch.compile refuses double backward.
            weight = _weight_input(ctx, saved)
            anchor = second_order_anchor(ctx, grad_output)
            grads = _LinearBackward.apply(grad_output, weight, anchor, ctx, saved)
        else:
            grads = _backward_gemms(ctx, grad_output, saved)
        return (*grads, None, None, None, None, None, None)


def _backward_gemms(
    ctx: Any,
    grad_output: torch.Tensor,
    saved: tuple[torch.Tensor, ...],
    kept: dict[str, Any] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(grad_input, grad_weight, grad_bias) of `_Linear` from its `ctx` and saved tensors,
    None where not needed. `kept`: a dict that receives the operands the two GEMMs read
    (`_LinearBackward`'s second derivative), which are then kept past their GEMM."""
    recipe: Recipe = ctx.recipe
    n = ctx.n_weight_tensors
    go = grad_output if grad_output.dim() == 2 else grad_output.reshape(-1, grad_output.shape[-1])
    grad_input = grad_weight = grad_bias = None
    with autocast_off(go.device.type):
        row_cfg = recipe.grad_input.grad_output if ctx.needs_input_grad[0] else None
        tokens_cfg = recipe.grad_weight.grad_output_t if ctx.needs_input_grad[1] else None
        go_amax = tokens_amax = None
        sharded: AmaxReduction | None = ctx.sharded
        if sharded is not None and sharded.grad_output:
            local = list(rows_and_tokens_amax(go, row_cfg, tokens_cfg))
            go_amax, tokens_amax = reduced_amaxes(sharded, local)
        go_lp, go_t = quantize_rows_and_tokens(
            go, row_cfg, tokens_cfg, tokens_dq=True, row_amax=go_amax,
            tokens_amax=tokens_amax, codes=activation_codes(ctx.backend),
        )  # fmt: skip
        if ctx.needs_input_grad[0]:
            if ctx.recompute:
                weight, *amax = saved[:n]
                amax = amax[0] if amax else None
                weight_t = _dgrad_weight(
                    weight, recipe, ctx.shared, amax, ctx.cache, ctx.stamp,
                    dq_only=ctx.backend is Backend.EMULATED,
                )  # fmt: skip
            else:
                weight_t = cached_dgrad_weight(ctx.cache, ctx.stamp, recipe, ctx.shared)
                if weight_t is None:
                    weight_t = load_operand(saved[:n], ctx.weight_meta)
                elif ctx.shared:
                    weight_t = Transposed(weight_t)  # type: ignore[arg-type]
            # in the dtype the forward cast the input to, then as a cast's backward would
            grad_input = _mm(go_lp, weight_t, ctx.cast_dtype, ctx.compute_dtype, ctx.backend)
            if grad_input.dim() != len(ctx.input_shape):  # (else it is [M, K] already)
                grad_input = grad_input.reshape(ctx.input_shape)
            if grad_input.dtype != ctx.input_dtype:
                grad_input = grad_input.to(ctx.input_dtype)
            if kept is not None:
                kept["grad_output"], kept["weight_t"] = go_lp, weight_t
            # Release grad_output's `_dq` operand and the weight's before grad_weight
            # builds its own two: the step's peak memory is set here.
            del go_lp, weight_t
        if ctx.needs_input_grad[1]:
            input_t = load_operand(saved[n:], ctx.input_meta)
            grad_weight = _mm(go_t, input_t, ctx.weight_dtype, ctx.compute_dtype, ctx.backend)
            if kept is not None:
                kept["input_t"] = input_t
        if ctx.needs_input_grad[2]:
            grad_bias = go.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
    return grad_input, grad_weight, grad_bias


def _weight_input(ctx: Any, saved: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
    """The weight itself where the forward saved it (`ctx.recompute`), for the second
    derivative of grad_input with respect to it; None where only a packed copy was saved."""
    return saved[0] if ctx.recompute else None


def second_order_anchor(ctx: Any, grad_output: torch.Tensor) -> torch.Tensor | None:
    """An empty tensor that requires grad, handed to `_LinearBackward` where a second
    derivative could need a tensor the backward cannot reach: grad_weight's with respect to
    the input (never saved), or grad_input's with respect to a weight saved only packed. It
    makes the results part of the graph even when nothing else is (a root grad_output and no
    weight), so that a second backward through them reaches `_LinearBackward.backward`, which
    raises, instead of treating them as constants (a gradient of exactly zero)."""
    if ctx.needs_input_grad[0] and ctx.needs_input_grad[1] and not ctx.recompute:
        return torch.empty(0, device=grad_output.device, requires_grad=True)
    return None


def operand_values(op: Operand | None) -> torch.Tensor | None:
    """The FP32 values an operand stands for: codes times block scales times the global
    decode scale (a Hadamard copy's transformed values; a `Transposed` copy transposed)."""
    if op is None:
        return None
    if isinstance(op, Transposed):
        return op.base.dequantize(torch.float32).t()
    return op.dequantize(torch.float32)


def undo_hadamard(y: torch.Tensor) -> torch.Tensor:
    """y @ H.T in each run of 16 values along the last dim, in FP32: the inverse of the
    16x16 transform (H is orthogonal), and the backward of applying it."""
    h = hadamard_matrix(device=y.device)
    return (y.float().unflatten(-1, (-1, h.shape[0])) @ h.t()).flatten(-2)


def describe_linear(ctx: Any, out_features: int) -> str:
    """The layer in an error message: shapes and recipe (a Function does not know its name)."""
    weight = [out_features, ctx.input_shape[-1]]
    return f"blockscale.linear (input {list(ctx.input_shape)}, weight {weight}, {ctx.recipe.name})"


def second_order_input_error(where: str) -> NotImplementedError:
    """A second derivative of grad_weight with respect to the input: not supported."""
    return NotImplementedError(
        f"{where}: a second derivative through the weight's gradient needs the gradient of "
        "grad_weight = grad_output.T @ input with respect to the input, and this op does not "
        "keep the input for backward (only its quantized token copy, which is not connected "
        "to the input in the autograd graph), so that term would be silently lost. Supported: "
        "second derivatives through the input's gradient (e.g. a gradient penalty on "
        "torch.autograd.grad(out, x, create_graph=True)), and through the weight's gradient "
        "where the op's input does not require grad"
    )


def second_order_weight_error(where: str, config: OperandConfig) -> NotImplementedError:
    """A second derivative of grad_input with respect to a weight saved packed: not supported."""
    return NotImplementedError(
        f"{where}: a second derivative through the input's gradient needs the gradient of "
        "grad_input = grad_output @ weight with respect to the weight, and this op saved only "
        f"the weight's quantized copy for backward (grad_input.weight is {config.describe()}; "
        "the weight itself is kept only for a round-to-nearest copy of a plain weight tensor "
        "that is a leaf or a view of one, not for a stochastically rounded copy, a weight that "
        "arrives quantized, a weight computed in the forward, or RECOMPUTE_WEIGHT = False), so "
        "that term would be silently lost"
    )


def first_derivatives(
    ctx: Any,
    gemms: Callable[..., tuple],
    outer: Any,
    grad_output: torch.Tensor,
    saved: tuple[torch.Tensor, ...],
) -> tuple:
    """The `forward` of a backward run as a differentiable op (`_LinearBackward`, grouped_mm's
    `_GroupedMMBackward`): the plain backward's `gemms(outer, grad_output, saved, kept)`, the
    same bits, with the operands they read kept on `ctx` for the second derivatives."""
    ctx.set_materialize_grads(False)  # an unused result's gradient stays None
    kept: dict[str, Any] = {}
    grads = gemms(outer, grad_output, saved, kept)
    ctx.kept, ctx.outer = kept, outer
    ctx.go_shape, ctx.go_dtype = grad_output.shape, grad_output.dtype
    ctx.device_type = grad_output.device.type
    return grads


class _LinearBackward(torch.autograd.Function):
    """`_Linear`'s backward as a differentiable op (module docstring, "Second derivatives").

    forward: the same GEMMs on the same quantized operands as the plain backward
    (`_backward_gemms`), so the first derivatives are the same bits. backward: the second
    derivatives of grad_input = G @ W, grad_weight = Gt @ Xt.T and grad_bias = sum(G) with
    every quantizer straight-through (formats/straight_through.py), as FP32 GEMMs on the
    dequantized operands the forward GEMMs read."""

    @staticmethod
    def forward(
        ctx: Any,
        grad_output: torch.Tensor,
        weight: torch.Tensor | None,
        anchor: torch.Tensor | None,
        outer: Any,
        saved: tuple[torch.Tensor, ...],
    ) -> tuple[torch.Tensor | None, ...]:
        return first_derivatives(ctx, _backward_gemms, outer, grad_output, saved)

    @staticmethod
    def backward(
        ctx: Any,
        grad_grad_input: torch.Tensor | None,
        grad_grad_weight: torch.Tensor | None,
        grad_grad_bias: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, ...]:
        outer = ctx.outer
        recipe: Recipe = outer.recipe
        n = ctx.go_shape[-1]
        where = describe_linear(outer, n)
        m = math.prod(ctx.go_shape[:-1])
        d_go: torch.Tensor | None = None
        d_weight = None
        with autocast_off(ctx.device_type):
            if grad_grad_input is not None:
                ggi = grad_grad_input.reshape(m, -1).float()
                w_t = operand_values(ctx.kept["weight_t"])  # [K, N]: grad_input = G @ w_t.T
                d_go = ggi @ w_t
                if ctx.needs_input_grad[1]:
                    g = operand_values(ctx.kept["grad_output"])  # [M, N]
                    d_weight = (g.t() @ ggi).to(outer.weight_dtype)
                elif outer.needs_input_grad[1]:
                    raise second_order_weight_error(where, recipe.grad_input.weight)
            if grad_grad_weight is not None:
                if outer.needs_input_grad[0]:
                    raise second_order_input_error(where)
                # grad_weight = T(G.T) @ Xt.T with T the token copy's transform (if any):
                # d/dG.T = T's backward of (ggw @ Xt), unpadded
                x_t = operand_values(ctx.kept["input_t"])  # [K, M']
                d_go_t = grad_grad_weight.float() @ x_t
                if recipe.grad_weight.grad_output_t.hadamard:
                    d_go_t = undo_hadamard(d_go_t)
                d_go = _added(d_go, d_go_t[:, :m].t())
            if grad_grad_bias is not None:
                d_go = _added(d_go, grad_grad_bias.float().expand(m, n))
        if d_go is not None:
            d_go = d_go.to(ctx.go_dtype).reshape(ctx.go_shape)
        return d_go, d_weight, None, None, None


def _added(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
    return b if a is None else a + b


def is_dtensor(t: torch.Tensor) -> bool:
    """Whether `t` is a DTensor, without importing torch.distributed.tensor (half a second):
    no DTensor exists before it is imported."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


# Whether a floating input under autocast is quantized from its cast to the autocast dtype, as
# autocast's F.linear computes on that cast (module docstring, "Dtypes"); False: from its own
# dtype (an FP32 input's own values, as before 2026-12-03).
CAST_INPUT_UNDER_AUTOCAST = True


def quantized_input_dtype(input: torch.Tensor, out_dtype: torch.dtype) -> torch.dtype:
    """The dtype `linear` quantizes `input` from, given the dtype it returns (`output_dtype`:
    the autocast dtype when autocast is on): that dtype for a floating input under autocast
    (`CAST_INPUT_UNDER_AUTOCAST`), else the input's own."""
    if CAST_INPUT_UNDER_AUTOCAST and input.is_floating_point() and out_dtype != input.dtype:
        return out_dtype
    return input.dtype


def output_dtype(input: torch.Tensor) -> torch.dtype:
    """The dtype a linear layer returns: the autocast dtype if autocast is on, else input's."""
    device_type = input.device.type
    if device_type != "meta" and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return input.dtype


def linear(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    recipe: Recipe,
    *,
    amax_reduction: AmaxReduction | None = None,
    weight_cache: WeightCache | None = None,
) -> torch.Tensor:
    """input @ weight.T + bias with the three GEMMs quantized as `recipe` says.

    input [..., K], weight [N, K], bias [N] or None. A recipe that quantizes nothing (bf16) is
    exactly `F.linear`. Raises ValueError when K or N does not fit the recipe's blocks.
    `amax_reduction`: input, weight or grad_output are shards of whole tensors (tensor
    parallel; see `AmaxReduction`); None: every operand is whole.
    `weight_cache`: where the weight's quantized copies are kept from one use to the next
    while the weight is unchanged (ops/weight_cache.py; the same bits as without it); None
    quantizes the weight at each use.

    >>> x, w = torch.randn(4, 64), torch.randn(32, 64)
    >>> bs.linear(x, w, None, bs.recipes.get("nvfp4")).shape
    torch.Size([4, 32])
    >>> torch.equal(bs.linear(x, w, None, bs.recipes.get("bf16")), torch.nn.functional.linear(x, w))
    True
    """
    require_recipe(recipe)
    memo = not tracing()  # (traced, each is computed: shapes may be symbolic)
    if not _once(recipe, "quantized", lambda: recipe.quantized, memo):
        return F.linear(input, weight, bias)
    for name, t in (("input", input), ("weight", weight)):
        if is_dtensor(t):
            raise TypeError(
                f"blockscale.linear got a DTensor {name}: it computes on local tensors; for "
                "tensor parallel, parallelize a converted blockscale.nn.Linear (with torch's "
                "ColwiseParallel / RowwiseParallel or blockscale.distributed."
                "QuantizedColwiseParallel / QuantizedRowwiseParallel), which hands linear "
                "its local shards"
            )
    if weight.dim() != 2 or input.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"input {tuple(input.shape)} and weight {tuple(weight.shape)} do not fit: "
            "need input [..., K] and weight [N, K]"
        )
    n, k = weight.shape
    reason = _once(recipe, (n, k), lambda: unsupported_reason(k, n, recipe), memo)
    if reason is not None:
        raise ValueError(f"recipe {recipe.name} cannot run this layer: {reason}")
    if input.is_meta or weight.is_meta:
        return meta_output(F.linear(input, weight.to(input.dtype), None), bias, input)
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(
            f"bias shape {tuple(bias.shape)} is not ({weight.shape[0]},): one value per output "
            f"feature of weight {tuple(weight.shape)}"
        )
    device = input.device
    backend = _once(recipe, device, lambda: resolve_backend(recipe.backend, device), memo)
    enter_forward()  # a call outside the model's forward scope is a scope of its own
    try:
        # A weight shard's amax is reduced over ranks in each forward: not cached.
        stamp = None
        if weight_cache is not None and not (amax_reduction is not None and amax_reduction.weight):
            stamp = weight_cache.stamp(weight)
        cache = None if stamp is None else weight_cache
        return _Linear.apply(
            input, weight, bias, recipe, backend, output_dtype(input), amax_reduction, cache, stamp
        )
    finally:
        exit_forward()


# What `linear` derives from a recipe alone, or with a weight shape or device (`_once`): keyed
# by the recipe's id and dropped when the recipe is collected, so an id is never another's.
_RECIPE_FACTS: dict[tuple[int, Any], Any] = {}


def _once(recipe: Recipe, what: Any, compute: Callable[[], Any], memo: bool = True) -> Any:
    """`compute()`, a function of `recipe` and `what` alone, computed once per recipe object
    (`memo`; else at each call): linear's checks and backend for a layer's recipe, weight
    shape and device at its first call, not at every call (issue 62: host time). A Recipe is
    frozen, but hashing one walks its six operand configs, so the key is its id. An exception
    is raised again at each call."""
    if not memo:
        return compute()
    key = (id(recipe), what)
    found = _RECIPE_FACTS.get(key, _MISSING)
    if found is _MISSING:
        found = _RECIPE_FACTS[key] = compute()
        weakref.finalize(recipe, _RECIPE_FACTS.pop, key, None)
    return found


_MISSING = object()


def meta_output(output: torch.Tensor, bias: torch.Tensor | None, input: torch.Tensor):
    """A meta-device forward (how tools count shapes and FLOPs, and how a model is built before
    its weights exist): the plain GEMM's shape in the dtype the quantized op returns, no
    values. Autocast has no meta device, so the quantized path, which turns it off, cannot run;
    nothing is quantized, and a backward through it gives shapes only as well."""
    if bias is not None:
        output = output + bias.to(output.dtype)
    return output.to(output_dtype(input))


class RecipeConstant:
    """A recipe as a constant of a `nonstrict_trace` call (`compiled_linear`): Dynamo can pass
    neither a frozen dataclass into such a call nor rebuild one in its bytecode, but it takes a
    registered pytree constant. One per distinct recipe (`of`), compared by identity, so two
    layers with equal recipes give Dynamo the same constant (the same guard); a copy or an
    unpickled one is the canonical one again."""

    __slots__ = ("recipe",)
    _canonical: dict[Recipe, RecipeConstant] = {}

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe

    @classmethod
    def of(cls, recipe: Recipe) -> RecipeConstant:
        return cls._canonical.setdefault(recipe, cls(recipe))

    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)

    def __reduce__(self) -> tuple:
        return RecipeConstant.of, (self.recipe,)

    def __repr__(self) -> str:
        return f"RecipeConstant({self.recipe.name})"


pytree.register_constant(RecipeConstant)


@nonstrict_trace
def compiled_linear(
    recipe: RecipeConstant, input: torch.Tensor, weight: torch.Tensor, *bias: torch.Tensor
) -> torch.Tensor:
    """`linear(input, weight, bias, recipe.recipe)` for Dynamo-traced code: one opaque call in
    Dynamo's graph, traced by AOTAutograd (module docstring). `bias`: the bias, or nothing
    (a nonstrict_trace call takes no None). Plain tensors, or a weight that holds quantized
    copies (a `QuantizedWeight`: Dynamo passes its inner tensors); other tensor subclasses go
    through `linear`, run eagerly at a graph break (blockscale/nn/linear.py).
    Nothing read inside is guarded by Dynamo: what the result depends on is the recipe (the
    constant), the tensors' metadata and autocast, which Dynamo guards at the call."""
    return linear(input, weight, bias[0] if bias else None, recipe.recipe)
