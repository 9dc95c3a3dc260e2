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

Tensor parallel (`amax_reduction`, an `AmaxReduction` as `linear` takes it): experts whose
hidden dimension is split over ranks, each rank multiplying its shard of every expert
(torchtitan's `TensorParallel` of the experts). w1 / w3 ([E, hidden, dim]) are column-wise:
their weight shards and grad_output shards (per expert) are sharded, `weight=True,
grad_output=True`; w2 ([E, dim, hidden]) is row-wise: its weight and its input (the
activation's columns) are, `input=True, weight=True`. Every NVFP4 copy of a sharded operand
then scales each expert with the whole tensor's amax for that expert (its [E] local amaxes
MAX-reduced, one collective in the forward and one in the backward), so with shards of whole
blocks a shard's codes and scales are exactly that part of one process's. The token groups
(offs) are the same on every rank.

A recipe that quantizes nothing is exactly `torch._grouped_mm` (whose rows past offs[-1] are
left unspecified by PyTorch). Dtypes follow `linear`: the output has the autocast dtype when
autocast is on (else the input's, or `out_dtype`), grad_input the input's, grad_weight the
weight's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from blockscale._registry import tracing
from blockscale.formats.grouped import TokenLayout, token_layout
from blockscale.formats.nvfp4 import NVFP4Tensor, decode_scale
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
    AmaxReduction,
    autocast_off,
    cached_dgrad_weight,
    cached_weight,
    dgrad_amax,
    first_derivatives,
    output_dtype,
    recomputes_weight,
    reduced_amaxes,
    second_order_anchor,
    second_order_input_error,
    second_order_weight_error,
    undo_hadamard,
)
from blockscale.ops.linear import unsupported_reason as linear_unsupported_reason
from blockscale.ops.quantize import (
    QuantizedOperand,
    experts_amax,
    grouped_amax,
    load_operand,
    quantize_experts,
    quantize_experts_pair,
    quantize_grouped,
    save_operand,
)
from blockscale.ops.weight_cache import Stamp, WeightCache, enter_forward, exit_forward
from blockscale.recipes import Format, OperandConfig, Recipe, require_recipe


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
        sharded: AmaxReduction | None,
    ) -> torch.Tensor:
        weight = weight_t.transpose(-2, -1)  # [E, N, K], usually the parameter itself
        layout = token_layout(offs, input.shape[0])
        # codes only where the GEMMs may read them (the native backend; `backend` is resolved,
        # grouped_mm); the backward's copies too
        codes = ctx.codes = activation_codes(backend)
        with autocast_off(input.device.type):
            wgrad_cfg = recipe.grad_weight.input_t if ctx.needs_input_grad[1] else None
            w_cfg = recipe.output.weight
            dgrad_cfg = recipe.grad_input.weight
            ctx.shared = dgrad_cfg.block == "16x16" and dgrad_cfg == recipe.output.weight
            x_amax: tuple[torch.Tensor | None, ...] = (None, None)
            w_amax = None
            if sharded is not None:  # (grouped_mm's `amax_reduction`)
                local: list[torch.Tensor | None] = [None, None, None]
                if sharded.input:
                    local[:2] = grouped_amax(input, offs, layout, recipe.output.input, wgrad_cfg)
                if sharded.weight:
                    # Every weight copy scales with max |w[e]| (no Hadamard on a weight)
                    nvfp4 = [c for c in (w_cfg, dgrad_cfg) if c.format is Format.NVFP4]
                    local[2] = experts_amax(weight, nvfp4[0]) if nvfp4 else None
                *x_amax, w_amax = reduced_amaxes(sharded, local)
            x_lp, x_t = quantize_grouped(
                input, offs, layout, recipe.output.input, wgrad_cfg, codes=codes,
                amax=tuple(x_amax),
            )  # fmt: skip
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

            def make_w(dq: bool) -> QuantizedOperand:  # (an MXFP8 copy ignores `amax`)
                return quantize_experts(weight, w_cfg, dq=dq, codes=w_codes, amax=w_amax)

            dq = not packed_weight_rule(weight)  # (gemm/grouped.py)
            # A forward that keeps grad_input's copy along N makes both from one read
            w_pair = None
            if ctx.needs_input_grad[0] and not (ctx.recompute or ctx.shared):
                w_pair = _weight_pair(weight, w_cfg, dgrad_cfg, dq, cache, stamp, w_codes)
            w_lp = w_pair[0] if w_pair else cached_weight(cache, stamp, make_w, w_cfg, False, dq=dq)
            out = grouped_mm_rows(x_lp, w_lp, offs, out_dtype, backend)
            w_tensors: list[torch.Tensor] = []
            if ctx.recompute:
                amax = dgrad_amax(dgrad_cfg, w_lp, w_amax)
                w_tensors = [weight_t] if amax is None else [weight_t, amax]
            elif ctx.needs_input_grad[0]:

                def make_t(dq: bool) -> QuantizedOperand:
                    return quantize_experts(weight, dgrad_cfg, transpose=True, dq=dq, amax=w_amax)

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
        ctx.recipe, ctx.backend, ctx.sharded = recipe, backend, sharded
        ctx.input_dtype, ctx.weight_dtype = input.dtype, weight_t.dtype
        return out

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved = ctx.saved_tensors
        if torch.is_grad_enabled() and not tracing():
            # create_graph=True: the same GEMMs, differentiable (`_GroupedMMBackward`)
            weight_t = saved[4] if ctx.recompute else None  # (after offs and the layout)
            anchor = second_order_anchor(ctx, grad_output)
            grads = _GroupedMMBackward.apply(grad_output, weight_t, anchor, ctx, saved)
        else:
            grads = _backward_gemms(ctx, grad_output, saved)
        return (*grads, None, None, None, None, None, None, None)


def _backward_gemms(
    ctx: Any,
    grad_output: torch.Tensor,
    saved: tuple[torch.Tensor, ...],
    kept: dict[str, Any] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(grad_input, grad_weight_t) of `_GroupedMM` from its `ctx` and saved tensors, None
    where not needed. `kept`: a dict that receives the operands the two GEMMs read
    (`_GroupedMMBackward`'s second derivative), which are then kept past their GEMM."""
    recipe: Recipe = ctx.recipe
    offs, seg_ends, source, group, *saved = saved
    layout = TokenLayout(seg_ends, source, group)
    n = ctx.n_weight_tensors
    grad_input = grad_weight_t = None
    with autocast_off(grad_output.device.type):
        row_cfg = recipe.grad_input.grad_output if ctx.needs_input_grad[0] else None
        tokens_cfg = recipe.grad_weight.grad_output_t if ctx.needs_input_grad[1] else None
        go_amax: list[torch.Tensor | None] = [None, None]
        sharded: AmaxReduction | None = ctx.sharded
        if sharded is not None and sharded.grad_output:
            local = grouped_amax(grad_output, offs, layout, row_cfg, tokens_cfg)
            go_amax = reduced_amaxes(sharded, list(local))
        go_lp, go_t = quantize_grouped(
            grad_output, offs, layout, row_cfg, tokens_cfg, tokens_dq=True, codes=ctx.codes,
            amax=tuple(go_amax),
        )  # fmt: skip
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
            if kept is not None:
                kept["grad_output"], kept["weight_t"] = go_lp, weight_t
            del go_lp, weight_t
        if ctx.needs_input_grad[1]:
            input_t = load_operand(saved[n:], ctx.input_meta)
            block = recipe.grad_weight.input_t.block_size
            grad_weight = grouped_mm_tokens(
                go_t, input_t, offs, seg_ends, block, ctx.weight_dtype, ctx.backend
            )
            grad_weight_t = grad_weight.transpose(-2, -1)
            if kept is not None:
                kept["input_t"] = input_t
    return grad_input, grad_weight_t


def _expert_values(op: Any) -> Callable[[int, tuple], torch.Tensor]:
    """`values(e, part)`: the FP32 values of `part` of a grouped operand (rows, columns or
    matrices that belong to expert e): its `_dq` there times e's decode scale (NVFP4, whose
    `amax` holds one per expert; MXFP8 has none)."""
    dq = op.dq(torch.float32)
    scales = decode_scale(op.amax) if isinstance(op, NVFP4Tensor | TransposedExperts) else None

    def values(e: int, part: tuple) -> torch.Tensor:
        return dq[part] if scales is None else dq[part] * scales[e]

    return values


class _GroupedMMBackward(torch.autograd.Function):
    """`_GroupedMM`'s backward as a differentiable op, as ops/linear.py's `_LinearBackward`.

    forward: the plain backward's GEMMs on the same quantized operands (the same bits).
    backward: per expert e, with the quantizers straight-through, the second derivatives of
    grad_input_e = G_e @ W_e and grad_weight_e = Gt_e @ Xt_e.T as FP32 GEMMs on the
    dequantized operands. It loops over the experts with the offsets on the host (one
    synchronization on CUDA: a path a second derivative alone takes)."""

    @staticmethod
    def forward(
        ctx: Any,
        grad_output: torch.Tensor,
        weight_t: torch.Tensor | None,
        anchor: torch.Tensor | None,
        outer: Any,
        saved: tuple[torch.Tensor, ...],
    ) -> tuple[torch.Tensor | None, ...]:
        ctx.offs, ctx.seg_ends = saved[0], saved[1]
        return first_derivatives(ctx, _backward_gemms, outer, grad_output, saved)

    @staticmethod
    def backward(
        ctx: Any, grad_grad_input: torch.Tensor | None, grad_grad_weight_t: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        outer = ctx.outer
        recipe: Recipe = outer.recipe
        experts = ctx.offs.shape[0]
        where = (
            f"blockscale.grouped_mm ({experts} experts, grad_output {tuple(ctx.go_shape)}, "
            f"recipe {recipe.name})"
        )
        ends = ctx.offs.tolist()
        rows = list(zip([0, *ends[:-1]], ends))
        d_go = d_weight_t = None
        with autocast_off(ctx.device_type):
            if grad_grad_input is not None:
                if not ctx.needs_input_grad[1] and outer.needs_input_grad[1]:
                    raise second_order_weight_error(where, recipe.grad_input.weight)
                ggi = grad_grad_input.float()
                w_t = ctx.kept["weight_t"]  # [E, K, N]: grad_input_e = G_e @ w_t[e].T
                weights = _expert_values(w_t)
                g = _expert_values(ctx.kept["grad_output"]) if ctx.needs_input_grad[1] else None
                d_go = ggi.new_zeros(ctx.go_shape)
                if g is not None:
                    d_weight_t = ggi.new_zeros(w_t.shape)
                for e, (start, end) in enumerate(rows):
                    if end == start:
                        continue
                    d_go[start:end] = ggi[start:end] @ weights(e, (e,))
                    if g is not None:
                        d_weight_t[e] = ggi[start:end].t() @ g(e, (slice(start, end),))
                if d_weight_t is not None:
                    d_weight_t = d_weight_t.to(outer.weight_dtype)
            if grad_grad_weight_t is not None:
                if outer.needs_input_grad[0]:
                    raise second_order_input_error(where)
                ggw_t = grad_grad_weight_t.float()
                x_t = _expert_values(ctx.kept["input_t"])  # [K, P]: e's tokens from its
                # segment's start
                if d_go is None:
                    d_go = ggw_t.new_zeros(ctx.go_shape)
                seg_ends = ctx.seg_ends.tolist()
                for e, (start, end) in enumerate(rows):
                    s0, s1 = (seg_ends[e - 1] if e else 0), seg_ends[e]
                    if end == start:
                        continue
                    # grad_weight_e = T(G_e.T) @ Xt_e.T, T the token copy's transform (if any)
                    d_go_t = ggw_t[e].t() @ x_t(e, (slice(None), slice(s0, s1)))
                    if recipe.grad_weight.grad_output_t.hadamard:
                        d_go_t = undo_hadamard(d_go_t)
                    d_go[start:end] += d_go_t[:, : end - start].t()
        if d_go is not None:
            d_go = d_go.to(ctx.go_dtype)
        return d_go, d_weight_t, None, None, None


def grouped_mm(
    input: torch.Tensor,
    weight_t: torch.Tensor,
    offs: torch.Tensor,
    recipe: Recipe,
    out_dtype: torch.dtype | None = None,
    *,
    weight_cache: WeightCache | None = None,
    weight_source: torch.Tensor | None = None,
    amax_reduction: AmaxReduction | None = None,
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
    `amax_reduction`: input, weight_t or grad_output are shards of whole tensors (experts
    under tensor parallel: module docstring, "Tensor parallel"); None: every operand is
    whole. A sharded weight is quantized at each use (no `weight_cache`), as `linear` does.

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
    if amax_reduction is not None and amax_reduction.weight:
        weight_cache = None
    enter_forward()  # a call outside the model's forward scope is a scope of its own
    try:
        stamp = None if weight_cache is None else weight_cache.stamp(weight_t, weight_source)
        cache = None if stamp is None else weight_cache
        return _GroupedMM.apply(
            input, weight_t, offs, recipe, backend, dtype, cache, stamp, amax_reduction
        )
    finally:
        exit_forward()
