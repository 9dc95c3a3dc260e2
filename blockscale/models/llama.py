"""A Llama-style decoder in one single-device file.

RMSNorm, rotary position embeddings, causal attention through `scaled_dot_product_attention`, a
SwiGLU MLP, and a tied or untied output head. The model knows nothing of quantization or
parallelism: `blockscale.convert` swaps its `nn.Linear` layers from outside.

Two choices follow from the job (studying what low precision does to training):

- The projections are fused as in Megatron-LM, the code base the NVFP4 pretraining paper used:
  one `wqkv` and one `w13` (gate and up) per block. One tensor then shares one NVFP4 global
  scale, as it would there, and the CPU emulation runs half as many quantizations per step.
- Every linear dimension is a multiple of 32, so each recipe's blocks (1x16, 16x16, 1x32) tile
  every operand; `ModelConfig.__post_init__` refuses sizes that break this.

Names of submodules are stable (`layers.{i}.attn.wqkv`, `layers.{i}.mlp.w2`, `lm_head`,
`tok_embeddings`) because layer policies and telemetry address layers by these names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelConfig:
    dim: int
    n_layers: int
    n_heads: int
    ffn_dim: int
    seq_len: int
    vocab_size: int = 256
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("dim", "ffn_dim", "vocab_size"):
            value = getattr(self, name)
            if value % 32:
                raise ValueError(f"{name}={value} is not a multiple of 32 (every recipe's block)")
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(f"dim={self.dim} does not split into {self.n_heads} even-sized heads")

    def num_params(self) -> int:
        per_block = 4 * self.dim * self.dim + 3 * self.dim * self.ffn_dim + 2 * self.dim
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return self.n_layers * per_block + self.vocab_size * self.dim + head + self.dim


# Named sizes (blockscale.models.SIZES adds the MoE ones). Byte-level vocabulary (256), so
# nearly every parameter sits in the blocks.
DENSE_SIZES: dict[str, ModelConfig] = {
    "tiny": ModelConfig(dim=64, n_layers=2, n_heads=4, ffn_dim=192, seq_len=128),
    "small": ModelConfig(dim=640, n_layers=10, n_heads=10, ffn_dim=1792, seq_len=1024),
    "base": ModelConfig(dim=768, n_layers=18, n_heads=12, ffn_dim=2048, seq_len=1024),
    "1b": ModelConfig(dim=2048, n_layers=20, n_heads=16, ffn_dim=5632, seq_len=2048),
}


def rotary_tables(cfg: ModelConfig, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    head_dim = cfg.dim // cfg.n_heads
    inv_freq = cfg.rope_theta ** (-torch.arange(0, head_dim, 2, device=device) / head_dim)
    angles = torch.outer(torch.arange(cfg.seq_len, device=device).float(), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, H, T, D]; rotate pairs (first half, second half) of each head.
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.wqkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        # Heads counted from wqkv's output ([q; k; v], whole heads each): a layer split over
        # ranks from outside (distributed.tp) hands this rank n_heads / ranks of them.
        q, k, v = self.wqkv(x).view(B, T, 3, -1, C // self.n_heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        q, k = apply_rotary(q, cos[:T], sin[:T]), apply_rotary(k, cos[:T], sin[:T])
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w13 = nn.Linear(dim, 2 * hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg.dim, cfg.ffn_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    # What a subclass varies (models/moe.py): the block, and which parameters write into the
    # residual stream (initialized with a depth-scaled std).
    block_type: type[nn.Module] = Block
    residual_outputs: tuple[str, ...] = ("wo.weight", "w2.weight")

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(self.block_type(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_embeddings.weight
        cos, sin = rotary_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        # GPT-2 style: N(0, 0.02), residual outputs scaled down by the depth.
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(self.residual_outputs):
                p.normal_(0.0, residual_std)
            else:
                p.normal_(0.0, 0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: int64 [B, T] with T <= seq_len. Returns logits [B, T, vocab_size]."""
        if tokens.shape[1] > self.config.seq_len:
            raise ValueError(f"sequence of {tokens.shape[1]} exceeds seq_len={self.config.seq_len}")
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, self.rope_cos, self.rope_sin)
        return self.lm_head(self.norm(x))
