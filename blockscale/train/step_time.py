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

The estimate counts FLOPs, and a step of many small micro-batches spends its time elsewhere
(dispatch, the optimizer's and autograd's bookkeeping): `--grad-accum 3000` on `tiny` was
estimated at 59 s, under the line, and took 4 minutes, with no word (issue 60). So the first
step's micro-batches are also timed (`FirstStep`): once a few have run after the first (which
pays warm-up), the step's length is their mean times the micro-batches it has, and a step over
`SLOW_STEP_SECONDS` is said then, seconds into it, unless the estimate already said so. The
mean also tells a stop request how long the step still has to go (loop.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable

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
        f"one training step is estimated at about {duration(seconds)} on {device.type} "
        f"({flops:.1e} FLOPs at the {rate / 1e9:,.0f} GFLOP/s measured here): {reason}. "
        "The progress bar moves once a step."
    )


def say_if_slow(model: nn.Module, seq_len: int, tokens: int, device: torch.device) -> bool:
    """Print `slow_step_notice`'s line, if any (the training loop calls this once, before its
    progress bar); returns whether it did."""
    notice = slow_step_notice(model, seq_len, tokens, device)
    if notice is not None:
        print(notice, flush=True)
    return notice is not None


# Micro-batches timed after the first (warm-up) before the first step's length is judged, and
# the seconds after which fewer will do.
TIMED_MICRO_BATCHES = 3
TIMED_SECONDS = 1.0


class FirstStep:
    """Times the micro-batches of a run's first step (module docstring). `tick` after each of
    them; `per_micro` is the seconds one takes (None until measured). `say`: prints a line
    (None: this process prints nothing, a rank other than 0); `said`: the FLOP estimate
    already announced a slow step."""

    def __init__(
        self,
        micro_batches: int,
        device: torch.device,
        say: Callable[[str], None] | None,
        said: bool,
    ) -> None:
        self.micro_batches, self.device, self.say, self.said = micro_batches, device, say, said
        self.per_micro: float | None = None
        self.done = 0
        self._since = 0.0
        self._watching = micro_batches > 1  # one micro-batch: the bar's first move says it

    def tick(self) -> None:
        """One micro-batch of the first step has run."""
        if not self._watching:
            return
        self.done += 1
        if self.done == self.micro_batches:  # a step too short to judge: the bar says the rest
            self._watching = False
        if self.device.type == "cuda":  # time the work, not its launch (a few syncs, once)
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        if self.done == 1:
            self._since = now
            return
        timed, elapsed = self.done - 1, now - self._since
        if timed < TIMED_MICRO_BATCHES and elapsed < TIMED_SECONDS and self._watching:
            return
        self._watching = False
        self.per_micro = elapsed / timed
        seconds = self.per_micro * self.micro_batches
        if seconds > SLOW_STEP_SECONDS and not self.said and self.say is not None:
            self.said = True
            self.say(
                f"one training step takes about {duration(seconds)} on {self.device.type}: "
                f"{self.micro_batches:,} micro-batches (--grad-accum) of {self.per_micro:.3g} s "
                "each, timed on the first step; fewer and larger micro-batches make steps "
                "shorter. The progress bar moves once a step."
            )

    def left(self, done: int) -> float | None:
        """Seconds the step has to go after `done` of its micro-batches (None: not timed)."""
        if self.per_micro is None:
            return None
        return self.per_micro * (self.micro_batches - done)


def duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
