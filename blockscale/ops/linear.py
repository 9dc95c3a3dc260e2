"""`linear(input, weight, bias, recipe)`: a linear layer whose three GEMMs follow a recipe.

The autograd Function writes the three GEMMs out, each with both operands quantized along the
dimension it contracts (see `blockscale.recipes`):

```
forward   input        -> input_lp        (output.input, along K)
          weight       -> weight_lp       (output.weight, along K; 16x16 tiles by default)
          output = input_lp @ weight_lp.T * alpha + bias
          saved:  input_t_lp  = input quantized along tokens (grad_weight.input_t)
                  weight for dgrad: the 16x16 weight_lp itself (its transpose is exact), or a
                  copy quantized along N (grad_input.weight, transpose=True)
backward  grad_output  -> grad_output_lp   (grad_input.grad_output, along N)
          grad_input  = grad_output_lp @ weight_t * alpha
          grad_output  -> grad_output_t_lp (grad_weight.grad_output_t, along tokens)
          grad_weight = grad_output_t_lp @ input_t_lp.T * alpha
          grad_bias   = grad_output summed over tokens, in FP32
```

Memory: only low-precision containers are saved for backward (packed codes, scales, amax),
never the high-precision input when the recipe quantizes it; an NVFP4 layer saves about a
quarter of what a BF16 layer saves. The price is that input_t is quantized in the forward,
whether or not a backward follows (`torch.no_grad()` skips it: nothing is saved then).

Tokens: any leading dims are flattened to M. The grad_weight operands are quantized along M,
so M is zero-padded to the block size when it is not a multiple of it. Zero rows change neither
a block's amax nor the product (the Hadamard transform is orthogonal and applied to both
operands), so this is exact; the static dims (K, N) must fit the blocks, which
`unsupported_reason` checks and `convert` uses to skip layers.

Dtypes: the output has the autocast dtype when autocast is on for the input's device, else the
input's dtype; grad_input has the input's dtype, grad_weight the weight's (FP32 master weights
get an FP32 grad_weight straight from the FP32 accumulator). Operands are quantized from the
dtype they arrive in (an FP32 weight is not rounded to BF16 first). Autocast is off inside the
Function so that it cannot recast the exact emulated operands.

Randomness: stochastic rounding draws from PyTorch's default generator in a fixed order
(grad_output for dgrad, then grad_output_t for wgrad), so `torch.manual_seed` reproduces a
step bit for bit. Under torch.compile the draws come from Inductor's generator: reproducible
under a seed, but not the eager bits (set `torch._inductor.config.fallback_random = True` for
those).

torch.compile: everything here traces with fullgraph=True. Inductor relaxes by default what
the quantizers and the GEMM epilogue depend on (FP32 division is lowered to an approximate
instruction in Triton, BF16 round trips between fused ops are dropped, `acc * alpha + bias`
may become one FMA); `EXACT_INDUCTOR_OPTIONS` restores eager's numerics:
`torch.compile(model, options=EXACT_INDUCTOR_OPTIONS)`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from blockscale.gemm.dispatch import Backend, Transposed, resolve_backend, scaled_mm
from blockscale.ops.quantize import (
    HighPrecisionTensor,
    QuantizedOperand,
    load_operand,
    quantize_operand,
    quantize_rows_and_tokens,
    save_operand,
)
from blockscale.recipes import OperandConfig, Recipe

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
    """Why a [out_features, in_features] weight cannot run `recipe`, or None if it can."""
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
    return scaled_mm(a, b, out_dtype=out_dtype, bias=bias, backend=backend)  # type: ignore[arg-type]


def weight_operand(
    weight: torch.Tensor, config: OperandConfig, transpose: bool = False, dq: bool = False
) -> QuantizedOperand:
    """The weight quantized per `config`. A weight that arrives already quantized (one that
    blockscale.distributed all-gathered as NVFP4/MXFP8, or NVFP4 primary weights) has a
    `quantized_copy` method and hands over the copy it holds instead."""
    if hasattr(type(weight), "quantized_copy"):
        return weight.quantized_copy(config, transpose)  # type: ignore[attr-defined]
    return quantize_operand(weight, config, transpose=transpose, dq=dq)


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
    ) -> torch.Tensor:
        lead, k = input.shape[:-1], input.shape[-1]
        x = input.reshape(-1, k)
        with torch.autocast(input.device.type, enabled=False):
            wgrad_cfg = recipe.grad_weight.input_t if ctx.needs_input_grad[1] else None
            x_lp, input_t = quantize_rows_and_tokens(x, recipe.output.input, wgrad_cfg)
            w_lp = weight_operand(weight, recipe.output.weight, dq=True)
            out = _mm(x_lp, w_lp, out_dtype, out_dtype, backend, bias)

            weight_for_dgrad: Operand | None = None
            if ctx.needs_input_grad[0]:
                dgrad_cfg = recipe.grad_input.weight
                if dgrad_cfg.block == "16x16" and dgrad_cfg == recipe.output.weight:
                    weight_for_dgrad = Transposed(w_lp)  # type: ignore[arg-type]
                else:
                    weight_for_dgrad = weight_operand(weight, dgrad_cfg, transpose=True)

        w_tensors, ctx.weight_meta = save_operand(weight_for_dgrad)
        x_tensors, ctx.input_meta = save_operand(input_t)
        ctx.n_weight_tensors = len(w_tensors)
        ctx.save_for_backward(*w_tensors, *x_tensors)
        ctx.recipe, ctx.backend, ctx.compute_dtype = recipe, backend, out_dtype
        ctx.input_shape, ctx.input_dtype, ctx.weight_dtype = input.shape, input.dtype, weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out.reshape(*lead, out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        recipe: Recipe = ctx.recipe
        saved = ctx.saved_tensors
        n = ctx.n_weight_tensors
        go = grad_output.reshape(-1, grad_output.shape[-1])
        grad_input = grad_weight = grad_bias = None
        with torch.autocast(go.device.type, enabled=False):
            go_lp, go_t = quantize_rows_and_tokens(
                go,
                recipe.grad_input.grad_output if ctx.needs_input_grad[0] else None,
                recipe.grad_weight.grad_output_t if ctx.needs_input_grad[1] else None,
                tokens_dq=True,
            )
            if ctx.needs_input_grad[0]:
                weight_t = load_operand(saved[:n], ctx.weight_meta)
                grad_input = _mm(go_lp, weight_t, ctx.input_dtype, ctx.compute_dtype, ctx.backend)
                grad_input = grad_input.reshape(ctx.input_shape)
                # Release grad_output's `_dq` operand and the weight's before grad_weight
                # builds its own two: the step's peak memory is set here.
                del go_lp, weight_t
            if ctx.needs_input_grad[1]:
                input_t = load_operand(saved[n:], ctx.input_meta)
                grad_weight = _mm(go_t, input_t, ctx.weight_dtype, ctx.compute_dtype, ctx.backend)
            if ctx.needs_input_grad[2]:
                grad_bias = go.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        return grad_input, grad_weight, grad_bias, None, None, None


def output_dtype(input: torch.Tensor) -> torch.dtype:
    """The dtype a linear layer returns: the autocast dtype if autocast is on, else input's."""
    device_type = input.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return input.dtype


def linear(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: Recipe
) -> torch.Tensor:
    """input @ weight.T + bias with the three GEMMs quantized as `recipe` says.

    input [..., K], weight [N, K], bias [N] or None. A recipe that quantizes nothing (bf16) is
    exactly `F.linear`. Raises ValueError when K or N does not fit the recipe's blocks.
    """
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a blockscale Recipe, got {type(recipe).__name__}")
    if not recipe.quantized:
        return F.linear(input, weight, bias)
    if weight.dim() != 2 or input.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"input {tuple(input.shape)} and weight {tuple(weight.shape)} do not fit: "
            "need input [..., K] and weight [N, K]"
        )
    reason = unsupported_reason(weight.shape[1], weight.shape[0], recipe)
    if reason is not None:
        raise ValueError(f"recipe {recipe.name} cannot run this layer: {reason}")
    backend = resolve_backend(recipe.backend, input.device)
    return _Linear.apply(input, weight, bias, recipe, backend, output_dtype(input))
