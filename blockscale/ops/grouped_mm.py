"""`grouped_mm(input, weight_t, offs, recipe)`: a mixture-of-experts grouped GEMM whose three
GEMMs follow a recipe, a drop-in for `torch._grouped_mm` / `F.grouped_mm`.

(Work in progress: the per-group kernels replace the loop below; the contract is final.)
"""

from __future__ import annotations

import torch

from blockscale.ops.linear import linear
from blockscale.recipes import Recipe


def check_grouped_inputs(input: torch.Tensor, weight_t: torch.Tensor, offs: torch.Tensor) -> None:
    """Raise ValueError/TypeError naming the rule when the operands do not fit together."""
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
    if offs.device != input.device:
        raise ValueError(f"offs is on {offs.device} but input is on {input.device}")


def grouped_mm(
    input: torch.Tensor,
    weight_t: torch.Tensor,
    offs: torch.Tensor,
    recipe: Recipe,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """out[rows of group e] = input[rows of group e] @ weight_t[e], quantized as `recipe` says.

    input [M, K] with rows grouped by expert, weight_t [E, K, N] (usually a transposed view of
    [E, N, K] expert weights), offs int32 [E] cumulative end rows (offs[-1] <= M; rows past it
    give zeros and get zero gradient). out_dtype: None gives the input's dtype.
    """
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a blockscale Recipe, got {type(recipe).__name__}")
    check_grouped_inputs(input, weight_t, offs)
    if not recipe.quantized:
        return torch._grouped_mm(input, weight_t, offs=offs, out_dtype=out_dtype)
    ends = offs.tolist()
    outs = []
    start = 0
    for e, end in enumerate(ends):
        rows = input[start:end]
        outs.append(linear(rows, weight_t[e].t(), None, recipe))
        start = end
    tail = input.shape[0] - start
    dtype = out_dtype or (outs[0].dtype if outs else input.dtype)
    outs.append(input.new_zeros(tail, weight_t.shape[2], dtype=dtype) + 0 * input[start:, :1])
    return torch.cat([o.to(dtype) for o in outs])
