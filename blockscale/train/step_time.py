"""Say before the progress bar when one training step will take over a minute.

The bar moves once a step. A step that takes minutes (a long `--seq-len`, a large model on a
CPU) looked like a hung run: `--seq-len 100000` on `tiny` sat 226 s on one step with no word,
and a `timeout` around it gave no hint why (issue 37). So before the bar appears, the step is
estimated and, when it comes out over `SLOW_STEP_SECONDS`, one line says so and why.

The estimate: a training step costs 6 FLOPs per parameter per token (forward and backward), plus
causal attention's 6 x layers x positions x width per token (the usual accounting; MoE experts
count by the share of them a token visits). It is divided by the rate this device reaches on a
matrix product, measured here in a few milliseconds, and only when the step's FLOPs could take
a minute at a generous rate: a short step costs no measurement. It is rough, a factor of a
few either way (quantization's emulation and small matrices slow a step, a fused attention
kernel can beat the probe's rate, and so can a machine that is busy while it is timed), which
is enough to tell a step of minutes from one of a second.
"""

from __future__ import annotations

import time

import torch
from torch import nn

SLOW_STEP_SECONDS = 60.0
# FLOP/s no device of its kind beats on this work; below `SLOW_STEP_SECONDS` at this rate a
# step is surely short and nothing is measured.
FAST_RATE = {"cpu": 1e11, "cuda": 1e15}
# The side of the square matrix product timed to measure a device's rate.
PROBE_SIZE = {"cpu": 512, "cuda": 4096}


def step_flops(model: nn.Module, seq_len: int, tokens: int) -> tuple[float, float]:
    """(total, attention) FLOPs of one training step over `tokens` tokens of `seq_len`."""
    cfg = model.config
    embeddings = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Embedding))
    params = sum(p.numel() for p in model.parameters()) - embeddings
    n_experts = getattr(cfg, "n_experts", 0)
    if n_experts:  # a token visits top_k of the routed experts
        routed = sum(p.numel() for p in model.parameters() if p.dim() == 3)
        params -= routed * (1 - cfg.top_k / n_experts)
    attention = 6.0 * cfg.n_layers * seq_len * cfg.dim * tokens
    return 6.0 * params * tokens + attention, attention


def measured_rate(device: torch.device) -> float:
    """FLOP/s of a square matrix product in the dtype training computes in on `device`."""
    n = PROBE_SIZE.get(device.type, 512)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    torch.mm(a, a)  # warm-up (a first call loads libraries)
    repeats = 3
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        torch.mm(a, a)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return repeats * 2.0 * n**3 / max(time.perf_counter() - start, 1e-9)


def slow_step_notice(
    model: nn.Module, seq_len: int, tokens: int, device: torch.device, rate: float | None = None
) -> str | None:
    """The line to print when one step of `tokens` tokens (this process's share) of `seq_len`
    is estimated at over SLOW_STEP_SECONDS on `device`, else None. `rate`: FLOP/s, measured
    when not given (and only when the step could be slow)."""
    flops, attention = step_flops(model, seq_len, tokens)
    if rate is None:
        if flops < SLOW_STEP_SECONDS * FAST_RATE.get(device.type, FAST_RATE["cuda"]):
            return None
        rate = measured_rate(device)
    seconds = flops / rate
    if seconds <= SLOW_STEP_SECONDS:
        return None
    n_params = sum(p.numel() for p in model.parameters())
    if attention > flops / 2:
        reason = (
            f"attention over {seq_len:,} positions is {attention / flops:.0%} of the work; "
            "a shorter --seq-len makes steps much shorter"
        )
    else:
        reason = (
            f"{n_params / 1e6:,.1f}M parameters times {tokens:,} tokens; a smaller model or "
            "--batch-size makes steps shorter"
        )
    return (
        f"one training step is estimated at about {_duration(seconds)} on {device.type} "
        f"({flops:.1e} FLOPs at the {rate / 1e9:,.0f} GFLOP/s measured here): {reason}. "
        "The progress bar moves once a step."
    )


def say_if_slow(model: nn.Module, seq_len: int, tokens: int, device: torch.device) -> None:
    """Print `slow_step_notice`'s line, if any (the training loop calls this once, before its
    progress bar)."""
    notice = slow_step_notice(model, seq_len, tokens, device)
    if notice is not None:
        print(notice, flush=True)


def _duration(seconds: float) -> str:
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
