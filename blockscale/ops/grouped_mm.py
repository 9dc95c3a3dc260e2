"""`grouped_mm(input, weight_t, offs, recipe)`: a mixture-of-experts grouped GEMM whose three
GEMMs follow a recipe, a drop-in for `torch._grouped_mm` / `F.grouped_mm` (2-D input, 3-D
weights).

input [M, K] holds the tokens of E experts, sorted by expert: expert e owns rows
offs[e-1]:offs[e] (offs int32 on the input's device, cumulative). weight_t [E, K, N] is usually
the transposed view of [E, N, K] expert weights. The numerics are exactly those of a loop of
per-expert `blockscale.linear` calls with the same recipe: every quantization is per expert
(each expert's activations and weight get their own NVFP4 tensor amax), and the three GEMMs are

```
output      [M, N]    rows of e:  input_e       @ weight_e.T    (2-D x 3-D, groups along M)
grad_input  [M, K]    rows of e:  grad_output_e @ weight_e      (2-D x 3-D, groups along M)
grad_weight [E, N, K]      e:     grad_output_e.T @ input_e     (2-D x 2-D, groups along the
                                                                  contraction: the tokens)
```

Operands and what is saved for backward follow `linear` (ops/linear.py) operand by operand:
the input's row copy feeds the forward GEMM and its token copy (Hadamard, for grad_weight) is
saved packed; the 16x16 expert weights serve forward and grad_input (TransposedExperts), a
1x16 or MXFP8 recipe quantizes a second copy along N for grad_input (MXFP8: in the same launch
as the forward's copy, one read of the weights, where the forward keeps it); grad_output's two
copies are made in the backward. The weights' grad_input operand is rebuilt in the backward from
weight_t itself, which is saved as a reference (linear's "Memory": the same bits, no packed
copy kept, each expert scaled with the forward copy's amax), under the same conditions as
`linear` (`recomputes_weight`) except under torch.compile: otherwise, for a stochastic weight
config, weights computed in the forward (models/moe.py's BF16 cast of FP32 experts) or a
traced step, the forward's packed copy is saved. Nothing in high precision is kept beyond
that reference. With a `weight_cache` (ops/weight_cache.py; every `GroupedMM` has one) the
experts' copies are made once per optimizer step and reused, as for `linear`.

Group sizes: any, 0 included. No size has to be a multiple of 16, 32 or 128: the token copies
put each expert in a segment of its own padded with zero tokens (formats/grouped.py), exactly
as `linear` pads a token count, and the row copies need no padding at all. Rows past offs[-1]
(PyTorch's contract allows offs[-1] < M, which transformers uses for expert parallelism) give
zero output rows and get zero gradient.

No host synchronization on CUDA: the group layout, the per-group amaxes, the quantizations and
the GEMMs all read the offsets on the device, each in one launch for all groups. On the CPU the
reference loops over the groups with the offsets on the host. So `offs` is checked on the host
for its dtype and shape; its values are checked on the host on the CPU, and on CUDA by a
device-side assertion (`torch._assert_async`), which raises at the next synchronization rather
than at the call.

A recipe that quantizes nothing is exactly `torch._grouped_mm` (whose rows past offs[-1] are
left unspecified by PyTorch). Dtypes follow `linear`: the output has the autocast dtype when
autocast is on (else the input's, or `out_dtype`), grad_input the input's, grad_weight the
weight's.
"""

from __future__ import annotations

from typing import Any

import torch

from blockscale.formats.grouped import TokenLayout, token_layout
from blockscale.gemm.dispatch import Backend, activation_codes
from blockscale.gemm.grouped import (
    Operand,
    TransposedExperts,
    grouped_mm_rows,
    grouped_mm_tokens,
    packed_weight_rule,
    resolve_grouped_backend,
)
from blockscale.ops.linear import (
    autocast_off,
    cached_dgrad_weight,
    cached_weight,
    dgrad_amax,
    output_dtype,
    recomputes_weight,
)
from blockscale.ops.linear import unsupported_reason as linear_unsupported_reason
from blockscale.ops.quantize import (
    QuantizedOperand,
    load_operand,
    quantize_experts,
    quantize_experts_pair,
    quantize_grouped,
    save_operand,
)
from blockscale.ops.weight_cache import Stamp, WeightCache
from blockscale.recipes import OperandConfig, Recipe, require_recipe


def unsupported_reason(k: int, n: int, recipe: Recipe) -> str | None:
    """Why experts with weights [E, N, K] cannot run `recipe`, or None if they can."""
    if not recipe.quantized:
        return None  # torch._grouped_mm
    reason = linear_unsupported_reason(k, n, recipe)
    if reason is not None:
        return reason
    ops = [op for _, op in recipe.operands()]
    if any(not op.quantized for op in ops):
        return "a grouped GEMM needs every operand quantized (or none: the bf16 recipe)"
    return None


def check_grouped_inputs(input: torch.Tensor, weight_t: torch.Tensor, offs: torch.Tensor) -> None:
    """Raise naming the rule when the operands do not fit together (shapes, dtypes, devices;
    the offsets' values on the CPU, by a device-side assertion on CUDA)."""
    if not isinstance(offs, torch.Tensor):
        raise TypeError(f"offs must be a torch.Tensor of int32, got {type(offs).__name__}")
    if input.dim() != 2 or weight_t.dim() != 3 or input.shape[1] != weight_t.shape[1]:
        raise ValueError(
            f"input {tuple(input.shape)} and weight_t {tuple(weight_t.shape)} do not fit: "
            "need input [M, K] and weight_t [E, K, N]"
        )
    if offs.dtype != torch.int32:
        raise ValueError(f"offs must be int32 (cumulative end rows), got {offs.dtype}")
    if offs.dim() != 1 or offs.shape[0] != weight_t.shape[0]:
        raise ValueError(
            f"offs must be 1-D with one end row per expert ({weight_t.shape[0]}), "
            f"got shape {tuple(offs.shape)}"
        )
    if offs.device != input.device or weight_t.device != input.device:
        raise ValueError(
            f"input, weight_t and offs must share a device, got {input.device}, "
            f"{weight_t.device} and {offs.device}"
        )
    if offs.shape[0] == 0:
        return
    m = input.shape[0]
    if offs.device.type == "cpu" and not torch.compiler.is_compiling():
        ends = offs.tolist()
        bad = [i for i in range(1, len(ends)) if ends[i] < ends[i - 1]]
        if bad:
            i = bad[0]
            raise ValueError(
                f"offs must not decrease: offs[{i - 1}]={ends[i - 1]} > offs[{i}]={ends[i]}"
            )
        if ends[0] < 0 or ends[-1] > m:
            raise ValueError(f"offs must lie in [0, M={m}], got {ends[0]}..{ends[-1]}")
        return
    ok = (offs[0] >= 0) & (offs[-1] <= m) & (torch.diff(offs) >= 0).all()
    torch._assert_async(ok, f"grouped_mm: offs must be non-decreasing and lie in [0, M={m}]")


def _dgrad_weight(
    weight_t: torch.Tensor,
    recipe: Recipe,
    shared: bool,
    amax: torch.Tensor | None,
    cache: WeightCache | None = None,
    stamp: Stamp | None = None,
    codes: bool = True,
) -> Operand:
    """grad_input's expert-weight operand rebuilt in the backward, with its `_dq` (none where
    the rows GEMM reads the weight packed, gemm/grouped.py's `packed_weight_rule`): the 16x16
    forward copy again, transposed, when `shared`, else the copy along N; the same bits as
    the forward's (round-to-nearest, each expert scaled with the forward copy's amax, `amax`;
    None for MXFP8, which has none). With a `cache`, the copy the forward's `stamp` left
    there, or a new one kept there. `codes=False` (no cache, emulated GEMMs): the 16x16 copy
    as its `_dq` alone, since nothing keeps it (the copy along N keeps its codes)."""
    weight = weight_t.transpose(-2, -1)
    cfg = recipe.output.weight if shared else recipe.grad_input.weight
    codes = codes or cache is not None or not shared

    def make(dq: bool) -> QuantizedOperand:
        return quantize_experts(weight, cfg, transpose=not shared, dq=dq, amax=amax, codes=codes)

    dq = not packed_weight_rule(weight)  # a GEMM that reads the weight packed needs no `_dq`
    w_lp = cached_weight(cache, stamp, make, cfg, not shared, dq=dq, renew=False)
    return TransposedExperts(w_lp) if shared else w_lp  # type: ignore[arg-type,return-value]


def _weight_pair(
    weight: torch.Tensor,
    w_cfg: OperandConfig,
    dgrad_cfg: OperandConfig,
    dq: bool,
    cache: WeightCache | None,
    stamp: Stamp | None,
    codes: bool = True,
) -> tuple[QuantizedOperand, QuantizedOperand] | None:
    """The forward's copy along K (with its `_dq` if `dq`) and grad_input's copy along N,
    packed, from one read of the expert weights (`quantize_experts_pair`), offered to `cache`
    as `cached_weight` offers them (`WeightCache.keep`); None where the cache holds either
    already or one launch cannot make both (then each copy is made on its own, as before).
    The pair is MXFP8 only, whose rounding is always to nearest, so both copies are
    cacheable."""
    keys = ((w_cfg, False), (dgrad_cfg, True))
    if cache is not None and (
        cache.keep_dq or any(cache.get(stamp, key) is not None for key in keys)
    ):
        return None  # (a `keep_dq` cache keeps the copy along N with its `_dq`: made alone)
    pair = quantize_experts_pair(weight, w_cfg, dgrad_cfg, dq=dq, codes=codes)
    if pair is not None and cache is not None:
        for key, op in zip(keys, pair):
            cache.keep(stamp, key, op)  # (a cache is handed in with its stamp, grouped_mm)
    return pair


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        input: torch.Tensor,
        weight_t: torch.Tensor,
        offs: torch.Tensor,
        recipe: Recipe,
        backend: Backend,
        out_dtype: torch.dtype,
        cache: WeightCache | None,
        stamp: Stamp | None,
    ) -> torch.Tensor:
        weight = weight_t.transpose(-2, -1)  # [E, N, K], usually the parameter itself
        layout = token_layout(offs, input.shape[0])
        # codes only where the GEMMs may read them (the native backend; `backend` is resolved,
        # grouped_mm); the backward's copies too
        codes = ctx.codes = activation_codes(backend)
        with autocast_off(input.device.type):
            wgrad_cfg = recipe.grad_weight.input_t if ctx.needs_input_grad[1] else None
            x_lp, x_t = quantize_grouped(
                input, offs, layout, recipe.output.input, wgrad_cfg, codes=codes
            )
            w_cfg = recipe.output.weight
            dgrad_cfg = recipe.grad_input.weight
            ctx.shared = dgrad_cfg.block == "16x16" and dgrad_cfg == recipe.output.weight
            # not under a trace: compiled, the experts' weights are usually a forward-made cast
            ctx.recompute = ctx.needs_input_grad[0] and recomputes_weight(
                weight_t, dgrad_cfg, under_trace=False
            )

            # The forward's weight copy needs its codes only where something keeps it: the
            # cache, or the backward (the shared 16x16 copy saved for grad_input), or where
            # the GEMMs may read codes (`codes`, the activations' rule: the native backend)
            keeps_w = cache is not None or (
                ctx.shared and ctx.needs_input_grad[0] and not ctx.recompute
            )
            w_codes = codes or keeps_w

            def make_w(dq: bool) -> QuantizedOperand:
                return quantize_experts(weight, w_cfg, dq=dq, codes=w_codes)

            dq = not packed_weight_rule(weight)  # (gemm/grouped.py)
            # A forward that keeps grad_input's copy along N makes both from one read
            w_pair = None
            if ctx.needs_input_grad[0] and not (ctx.recompute or ctx.shared):
                w_pair = _weight_pair(weight, w_cfg, dgrad_cfg, dq, cache, stamp, w_codes)
            w_lp = w_pair[0] if w_pair else cached_weight(cache, stamp, make_w, w_cfg, False, dq=dq)
            out = grouped_mm_rows(x_lp, w_lp, offs, out_dtype, backend)
            w_tensors: list[torch.Tensor] = []
            if ctx.recompute:
                amax = dgrad_amax(dgrad_cfg, w_lp)
                w_tensors = [weight_t] if amax is None else [weight_t, amax]
            elif ctx.needs_input_grad[0]:

                def make_t(dq: bool) -> QuantizedOperand:
                    return quantize_experts(weight, dgrad_cfg, transpose=True, dq=dq)

                if ctx.shared:
                    weight_for_dgrad = TransposedExperts(w_lp)  # type: ignore[arg-type]
                elif w_pair:
                    weight_for_dgrad = w_pair[1]
                else:
                    weight_for_dgrad = cached_weight(
                        cache, stamp, make_t, dgrad_cfg, True, dq=False
                    )
                w_tensors, ctx.weight_meta = save_operand(weight_for_dgrad)
            ctx.cache, ctx.stamp = cache, stamp

        x_tensors, ctx.input_meta = save_operand(x_t)
        ctx.n_weight_tensors = len(w_tensors)
        ctx.save_for_backward(
            offs, layout.seg_ends, layout.source, layout.group, *w_tensors, *x_tensors
        )
        ctx.recipe, ctx.backend = recipe, backend
        ctx.input_dtype, ctx.weight_dtype = input.dtype, weight_t.dtype
        return out

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        recipe: Recipe = ctx.recipe
        offs, seg_ends, source, group, *saved = ctx.saved_tensors
        layout = TokenLayout(seg_ends, source, group)
        n = ctx.n_weight_tensors
        grad_input = grad_weight_t = None
        with autocast_off(grad_output.device.type):
            go_lp, go_t = quantize_grouped(
                grad_output,
                offs,
                layout,
                recipe.grad_input.grad_output if ctx.needs_input_grad[0] else None,
                recipe.grad_weight.grad_output_t if ctx.needs_input_grad[1] else None,
                tokens_dq=True,
                codes=ctx.codes,
            )
            if ctx.needs_input_grad[0]:
                if ctx.recompute:
                    amax = saved[1] if n == 2 else None
                    weight_t = _dgrad_weight(
                        saved[0], recipe, ctx.shared, amax, ctx.cache, ctx.stamp, ctx.codes
                    )
                else:
                    weight_t = cached_dgrad_weight(ctx.cache, ctx.stamp, recipe, ctx.shared)
                    if weight_t is None:
                        weight_t = load_operand(saved[:n], ctx.weight_meta)
                    elif ctx.shared:
                        weight_t = TransposedExperts(weight_t)  # type: ignore[arg-type]
                grad_input = grouped_mm_rows(go_lp, weight_t, offs, ctx.input_dtype, ctx.backend)
                del go_lp, weight_t
            if ctx.needs_input_grad[1]:
                input_t = load_operand(saved[n:], ctx.input_meta)
                block = recipe.grad_weight.input_t.block_size
                grad_weight = grouped_mm_tokens(
                    go_t, input_t, offs, seg_ends, block, ctx.weight_dtype, ctx.backend
                )
                grad_weight_t = grad_weight.transpose(-2, -1)
        return grad_input, grad_weight_t, None, None, None, None, None, None


def grouped_mm(
    input: torch.Tensor,
    weight_t: torch.Tensor,
    offs: torch.Tensor,
    recipe: Recipe,
    out_dtype: torch.dtype | None = None,
    *,
    weight_cache: WeightCache | None = None,
    weight_source: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[rows of expert e] = input[rows of e] @ weight_t[e], the three GEMMs quantized as
    `recipe` says (module docstring). input [M, K], weight_t [E, K, N], offs int32 [E]
    cumulative end rows (offs[-1] <= M; rows past it give zeros). Raises ValueError when the
    shapes, dtypes or devices do not fit, or K or N does not fit the recipe's blocks.

    `weight_cache`: where the experts' quantized copies are kept from one use to the next
    while the weights are unchanged (ops/weight_cache.py; the same bits as without it).
    `weight_source`: the parameter weight_t was computed from by layout and dtype ops only
    (a transpose, a cast), which the cache then keys the copies by; None: weight_t is the
    parameter or a view of it, or the cache does not apply.

    >>> x, w_t = torch.randn(64, 32), torch.randn(2, 32, 16)  # experts 0 and 1: 32 rows each
    >>> offs = torch.tensor([32, 64], dtype=torch.int32)
    >>> bs.grouped_mm(x, w_t, offs, bs.recipes.get("nvfp4")).shape
    torch.Size([64, 16])
    """
    require_recipe(recipe)
    check_grouped_inputs(input, weight_t, offs)
    if not recipe.quantized:
        return torch._grouped_mm(input, weight_t, offs=offs, out_dtype=out_dtype)
    reason = unsupported_reason(weight_t.shape[1], weight_t.shape[2], recipe)
    if reason is not None:
        raise ValueError(f"recipe {recipe.name} cannot run these experts: {reason}")
    if input.is_meta or weight_t.is_meta:  # shapes and dtypes only (linear.meta_output)
        dtype = out_dtype if out_dtype is not None else output_dtype(input)
        return torch._grouped_mm(input, weight_t.to(input.dtype), offs=offs).to(dtype)
    backend = resolve_grouped_backend(recipe.backend, input.device)
    dtype = out_dtype if out_dtype is not None else output_dtype(input)
    # Stamped here, not in the Function: `weight_source` must not become an autograd input.
    stamp = None if weight_cache is None else weight_cache.stamp(weight_t, weight_source)
    cache = None if stamp is None else weight_cache
    return _GroupedMM.apply(input, weight_t, offs, recipe, backend, dtype, cache, stamp)
