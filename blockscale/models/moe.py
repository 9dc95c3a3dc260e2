"""A Llama-style mixture-of-experts decoder in one single-device file.

Each block is attention (`models/llama.py`'s, imported, with its norms and rotary tables)
followed by an MoE MLP instead of the dense one:

- `router`: a plain `nn.Linear(dim, n_experts)`. It stays an ordinary linear on purpose: the
  layer policy keeps every name matching `*router*` in BF16, since a quantized router moves
  tokens between experts, an error of another kind than a noisy product.
- Token-choice top-k routing: softmax over all experts, keep the top k per token, renormalize
  the k weights to sum to one (Mixtral's order of operations).
- `experts`: the routed experts as two 3D parameters named as in transformers 5.x,
  `gate_up_proj` [E, 2*I, H] (gate rows first, then up) and `down_proj` [E, H, I], computed as
  two `F.grouped_mm` calls over the tokens sorted by expert, with SwiGLU between them. Keeping
  transformers' names and call means `blockscale.convert` reaches our experts by the same route
  as it reaches a user's transformers model: it intercepts the grouped GEMM from outside, and
  this file knows nothing of quantization.
- `shared_expert` (optional, `shared_ffn_dim > 0`): a dense SwiGLU MLP every token goes
  through, built from `nn.Linear` so `convert` quantizes it like any other linear.
- A load-balancing auxiliary loss (Switch Transformer / GShard): E * sum_e f_e * p_e, where f_e
  is the share of the N*k token-expert assignments that went to expert e and p_e the mean router
  probability of e over the N tokens. It is 1 when both are uniform and grows as routing
  collapses; only p_e carries a gradient (f_e comes from a top-k).

No host synchronization, forward or backward: the sort by expert (`sort`, `searchsorted`
against the expert ids for the int32 group ends `offs`) stays on the device, groups of any size
are passed to the grouped GEMM as they are (empty groups included, no padding to a multiple of
anything), and no shape depends on the routing. A `.item()`, `nonzero` or boolean-mask index
anywhere here would stall a CUDA step on every layer; tests/test_moe_model.py checks the forward
compiles with `fullgraph=True` and that neither pass calls an op that reads device values on
the host.

Dtypes: `F.grouped_mm` has no autocast rule, takes both operands in one dtype, and runs on CUDA
only in BF16. So under autocast (and always on CUDA) both the sorted activations and the weight
views are cast to BF16; on the CPU without autocast it runs in the weight's dtype (FP32 in
training). The routing weights, the softmax and the auxiliary loss are computed in FP32.

The forward returns logits like the dense model's and leaves what training logs on the
modules: `MoETransformer.aux_loss` (the mean over layers of each layer's auxiliary loss, so its
coefficient does not depend on depth) and each `MoE.tokens_per_expert` (int64 [E], the
assignments of the last forward). The training loop adds `aux_loss` times its coefficient to
the loss; evaluation ignores it, so held-out losses compare with the dense models'.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from blockscale.models.llama import MLP, Attention, ModelConfig, RMSNorm, Transformer


@dataclass(frozen=True)
class MoEConfig(ModelConfig):
    """A ModelConfig whose `ffn_dim` is the hidden width of each routed expert."""

    n_experts: int = 8
    top_k: int = 2
    shared_ffn_dim: int = 0  # hidden width of the shared expert; 0: none

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_experts < 1:
            raise ValueError(f"n_experts={self.n_experts} must be at least 1")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} must lie in [1, n_experts={self.n_experts}]")
        if self.shared_ffn_dim < 0 or self.shared_ffn_dim % 32:
            raise ValueError(
                f"shared_ffn_dim={self.shared_ffn_dim} is not a multiple of 32 (every recipe's block)"
            )

    def _block_params(self, experts: int) -> int:
        d = self.dim
        attn = 4 * d * d
        moe = d * self.n_experts + 3 * d * self.ffn_dim * experts + 3 * d * self.shared_ffn_dim
        return attn + moe + 2 * d

    def _outside_blocks(self) -> int:
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return self.vocab_size * self.dim + head + self.dim

    def num_params(self) -> int:
        return self.n_layers * self._block_params(self.n_experts) + self._outside_blocks()

    def active_params(self) -> int:
        """Parameters one token computes with: top_k of the routed experts."""
        return self.n_layers * self._block_params(self.top_k) + self._outside_blocks()


# Named MoE sizes, each with the active MLP width of a dense size (top_k * ffn_dim +
# shared_ffn_dim = its ffn_dim), so a comparison with it holds the compute per token fixed.
MOE_SIZES: dict[str, MoEConfig] = {
    # tiny's 192: two of four experts of 64 plus a shared expert of 64.
    "moe-tiny": MoEConfig(
        dim=64,
        n_layers=2,
        n_heads=4,
        ffn_dim=64,
        seq_len=128,
        n_experts=4,
        top_k=2,
        shared_ffn_dim=64,
    ),
    # small's 1792: two of eight experts of 896 (Mixtral's shape, no shared expert).
    "moe-small": MoEConfig(
        dim=640, n_layers=10, n_heads=10, ffn_dim=896, seq_len=1024, n_experts=8, top_k=2
    ),
}


def _grouped_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    if x.device.type == "cuda" or torch.is_autocast_enabled(x.device.type):
        return torch.bfloat16
    return weight.dtype


class Experts(nn.Module):
    """E SwiGLU MLPs as 3D parameters, over tokens already sorted by expert."""

    def __init__(self, n_experts: int, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * hidden_dim, dim))
        self.down_proj = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        # As nn.Linear does, a usable init here; the model's reset_parameters sets its own.
        nn.init.normal_(self.gate_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)

    def forward(self, x_sorted: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """x_sorted [M, H], rows grouped by expert; offs int32 [E], each group's end row."""
        dtype = _grouped_dtype(x_sorted, self.gate_up_proj)
        gate_up, down = self.gate_up_proj, self.down_proj
        if gate_up.dtype != dtype:
            # Cast, then transpose: the same tensors as the other order in eager, but Inductor
            # lays out a cast in its own shape, and a cast of the transposed view came out
            # [E, K, N]-major, so the converted experts' [E*N, K] weight rows were a transposed
            # copy of it (docs/LOG.md, 2026-11-26 (later)).
            gate_up, down = gate_up.to(dtype), down.to(dtype)
        gate_up_t, down_t = gate_up.transpose(-2, -1), down.transpose(-2, -1)
        gate, up = F.grouped_mm(x_sorted.to(dtype), gate_up_t, offs=offs).chunk(2, dim=-1)
        return F.grouped_mm(F.silu(gate) * up, down_t, offs=offs)

    def extra_repr(self) -> str:
        n, two_i, h = self.gate_up_proj.shape
        return f"n_experts={n}, dim={h}, hidden_dim={two_i // 2}"


class MoE(nn.Module):
    """Router, routed experts and the optional shared expert of one block."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = Experts(cfg.n_experts, cfg.dim, cfg.ffn_dim)
        self.shared_expert = MLP(cfg.dim, cfg.shared_ffn_dim) if cfg.shared_ffn_dim else None
        self.aux_loss: torch.Tensor | None = None
        self.tokens_per_expert: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        n_tokens, k = x.shape[0], self.top_k
        probs = self.router(x).float().softmax(dim=-1)  # [N, E]
        weights, chosen = probs.topk(k, dim=-1)  # [N, k]
        weights = weights / weights.sum(dim=-1, keepdim=True)

        # Assignment i (token i // k) goes to expert chosen.flatten()[i]. Sort the assignments
        # by expert; each group's end row is where the sorted ids pass the expert's id.
        expert_ids, order = chosen.flatten().sort(stable=True)
        experts = torch.arange(self.n_experts, device=x.device, dtype=expert_ids.dtype)
        offs = torch.searchsorted(expert_ids, experts, right=True, out_int32=True)
        # In the grouped GEMM's dtype already (the experts would cast them), so that rows which
        # run_experts sends between ranks travel in it.
        x_sorted = x[order // k]
        x_sorted = x_sorted.to(_grouped_dtype(x_sorted, self.experts.gate_up_proj))
        out_sorted = self.run_experts(x_sorted, offs)
        # Back to assignment order (a permutation: no two rows collide), then the weighted sum
        # of each token's k expert outputs, in FP32.
        out = torch.zeros_like(out_sorted).index_copy(0, order, out_sorted)
        out = (out.view(n_tokens, k, -1).float() * weights.unsqueeze(-1)).sum(dim=1)
        out = out.to(out_sorted.dtype)
        if self.shared_expert is not None:
            out = out + self.shared_expert(x)

        counts = torch.diff(offs, prepend=offs.new_zeros(1)).long()
        probs, counts = self.routing_totals(probs, counts)
        share = counts.float() / (probs.shape[0] * k)
        self.aux_loss = self.n_experts * (share * probs.mean(dim=0)).sum()
        self.tokens_per_expert = counts
        return out.view(*shape[:-1], out.shape[-1])

    # The two steps below are seams: a wrapper applied from outside (expert parallelism,
    # blockscale/distributed/ep.py) replaces them; this file stays single-device.

    def run_experts(self, x_sorted: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """The routed experts on the assignments sorted by expert (offs int32 [E]: each
        expert's end row); the outputs in the same order."""
        return self.experts(x_sorted, offs)

    def routing_totals(
        self, probs: torch.Tensor, counts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The router probabilities [N, E] and assignments per expert [E] that the
        load-balancing loss and `tokens_per_expert` are computed from: this layer's own."""
        return probs, counts


class MoEBlock(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.moe_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.moe = MoE(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.moe(self.moe_norm(x))


class MoETransformer(Transformer):
    """The dense Transformer with MoE blocks; `aux_loss` holds the last forward's mean
    load-balancing loss over layers."""

    block_type = MoEBlock
    residual_outputs = (*Transformer.residual_outputs, "experts.down_proj")

    def __init__(self, cfg: MoEConfig) -> None:
        if not isinstance(cfg, MoEConfig):
            raise TypeError(f"MoETransformer needs a MoEConfig, got {type(cfg).__name__}")
        super().__init__(cfg)
        self.aux_loss: torch.Tensor | None = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = super().forward(tokens)
        self.aux_loss = torch.stack([layer.moe.aux_loss for layer in self.layers]).mean()
        return logits


def moe_layers(model: nn.Module) -> dict[str, MoE]:
    """The model's MoE layers by qualified name (empty for a dense model)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, MoE)}
