"""Numerics telemetry: which layers does quantization hurt?

Every `telemetry_every` steps a probe runs one extra forward and backward pass over a training
batch with hooks on each converted layer: a `blockscale.nn.Linear`, and a
`blockscale.nn.GroupedMM` (one grouped GEMM of converted MoE experts). For each operand the
layer's recipe quantizes it records, against the operand's BF16 value:

- `sqnr_db`: signal-to-quantization-noise ratio, 10 log10(sum x^2 / sum (x - q(x))^2);
- `zero_frac`: the fraction of nonzero values that quantize to zero (underflow);
- `amax`: max |x|, which sets the tensor's global scale.

Operands are named as in the recipe (`output.input`, `grad_input.grad_output`, ...). A `_t`
operand is quantized along the token dimension, and one with the Hadamard transform is compared
with its transformed value, since that is what the GEMM consumes.

Grouped GEMMs: each expert's operands are quantized on their own (their own global amax), so
the probe quantizes each expert's slice: rows offs[e-1]:offs[e] of the input and of
grad_output, and weight_t[e]. A token-dim (`_t`) slice whose row count is not a multiple of the
block is zero-padded to one, as the grouped GEMM pads it (zeros change no amax and add no
signal or noise). The layer's entry under `layers` sums signal and noise over its experts (so
it reads like a Linear's: the SQNR of the whole operand), and `experts` keeps the per-expert
values and the tokens each expert got; an expert that got no tokens has no activation values
(None). Reading `offs` on the host synchronizes, which the probe may do: it is off the
training path.

Why a separate probe rather than hooks on the training step: the training step stays untouched
(and compiled, if `--compile`), the probe runs the uncompiled module, and it runs inside
`torch.random.fork_rng`, so stochastic rounding in the probe draws no random numbers from the
training stream. With or without telemetry a run computes the same losses. A probe costs about
two training steps (one forward and backward plus the quantizations), so 2% at N = 100.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

import blockscale.nn as bsnn
from blockscale.formats import hadamard as rht
from blockscale.models import MoETransformer
from blockscale.ops import quantize_operand
from blockscale.ops.quantize import pad_tokens

STATS = ("sqnr_db", "zero_frac", "amax")

# Which tensor each operand is quantized from, and whether along the token dimension.
_SOURCES = {
    "output.input": ("input", False),
    "output.weight": ("weight", False),
    "grad_input.grad_output": ("grad_output", False),
    "grad_input.weight": ("weight", True),
    "grad_weight.grad_output_t": ("grad_output", True),
    "grad_weight.input_t": ("input", True),
}


def converted_layers(model: nn.Module) -> dict[str, nn.Module]:
    return {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and getattr(m, "recipe", None) is not None
    }


def grouped_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The quantized grouped GEMMs (experts kept in BF16 are routed too, unquantized:
    nn/convert.py, "Experts kept in high precision")."""
    return {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, bsnn.GroupedMM) and m.recipe.quantized
    }


def operand_sums(x: torch.Tensor, config, transpose: bool) -> torch.Tensor:
    """float64 [signal, noise, zeros, nonzeros, amax] of quantizing x (any shape, last dim K)
    with `config`: sums that add up over the experts of a grouped GEMM."""
    x_bf16 = x.detach().to(torch.bfloat16).reshape(-1, x.shape[-1])
    if transpose:
        x_bf16 = pad_tokens(x_bf16, config)
    ref = x_bf16.t() if transpose else x_bf16
    if config.hadamard:
        ref = rht.transform(ref)
    ref = ref.float()
    q = quantize_operand(x_bf16, config, transpose=transpose).dequantize(torch.float32)
    q = q.reshape(ref.shape)
    nonzero = ref != 0
    sums = [
        ref.square().sum(),
        (ref - q).square().sum(),
        (nonzero & (q == 0)).sum(),
        nonzero.sum(),
        ref.abs().amax(),
    ]
    return torch.stack([v.double() for v in sums])


def stats_of(sums: list[float]) -> dict[str, float]:
    """{sqnr_db, zero_frac, amax} from `operand_sums` (or their sum over experts)."""
    signal, noise, zeros, nonzeros, amax = sums
    return {
        "sqnr_db": 10 * math.log10(signal / max(noise, signal * 1e-30)) if signal else math.nan,
        "zero_frac": zeros / max(nonzeros, 1.0),
        "amax": amax,
    }


def operand_stats(x: torch.Tensor, config, transpose: bool) -> dict[str, float]:
    """{sqnr_db, zero_frac, amax} of quantizing x with `config` (synchronizes)."""
    return stats_of(operand_sums(x, config, transpose).tolist())


def _wanted_operands(recipe):
    """(operand, config) pairs the probe records: the quantized ones, except a grad_input
    weight that is the exact transpose of a 16x16 output weight (the same numbers)."""
    weight_2d = recipe.output.weight
    for operand, config in recipe.operands():
        if operand == "grad_input.weight" and config == weight_2d and config.block == "16x16":
            continue
        if config.quantized:
            yield operand, config


class _Recorder:
    """Collects operand sums on the device; `result()` reads them all at once."""

    def __init__(self) -> None:
        # (layer, operand, expert or None) -> sums
        self.keys: list[tuple[str, str, int | None]] = []
        self.values: list[torch.Tensor] = []
        self.tokens: dict[str, list[int]] = {}

    @torch.no_grad()
    def record(self, layer: str, module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        for operand, config in _wanted_operands(module.recipe):
            source, transpose = _SOURCES[operand]
            if source in tensors:
                self.keys.append((layer, operand, None))
                self.values.append(operand_sums(tensors[source], config, transpose))

    @torch.no_grad()
    def record_grouped(
        self, layer: str, module: nn.Module, ends: list[int], tensors: dict[str, torch.Tensor]
    ) -> None:
        """Per expert e: rows ends[e-1]:ends[e] of the activations, and weight_t[e] of the
        weight (`tensors["weight"]` holds weight_t [E, K, N])."""
        for operand, config in _wanted_operands(module.recipe):
            source, transpose = _SOURCES[operand]
            if source not in tensors:
                continue
            for e, (start, end) in enumerate(zip([0, *ends], ends)):
                if source == "weight":
                    part = tensors["weight"][e].t()  # [N, K], as a Linear's weight
                elif end > start:
                    part = tensors[source][start:end]
                else:
                    continue  # no tokens: no activation values to quantize
                self.keys.append((layer, operand, e))
                self.values.append(operand_sums(part, config, transpose))

    def hook(self, layer: str):
        def forward_hook(module, args, output):
            self.record(layer, module, {"input": args[0], "weight": module.weight})
            if output.requires_grad:
                output.register_hook(lambda grad: self.record(layer, module, {"grad_output": grad}))

        return forward_hook

    def grouped_hook(self, layer: str):
        def forward_hook(module, args, kwargs, output):
            given = dict(zip(("input", "weight_t", "offs"), args), **kwargs)
            ends = given["offs"].tolist()
            self.tokens[layer] = [b - a for a, b in zip([0, *ends], ends)]
            tensors = {"input": given["input"], "weight": given["weight_t"]}
            self.record_grouped(layer, module, ends, tensors)
            if output.requires_grad:
                output.register_hook(
                    lambda grad: self.record_grouped(layer, module, ends, {"grad_output": grad})
                )

        return forward_hook

    def result(self) -> dict:
        """{"layers": {layer: {operand: stats}}} and, for grouped GEMMs, {"experts": {layer:
        {"tokens": [per expert], operand: {stat: [per expert, None where it got no tokens]}}}}."""
        rows = torch.stack(self.values).tolist() if self.values else []
        totals: dict[tuple[str, str], list[float]] = {}
        per_expert: dict[tuple[str, str], dict[int, list[float]]] = {}
        for (layer, operand, expert), sums in zip(self.keys, rows):
            total = totals.setdefault((layer, operand), [0.0] * 5)
            total[:4] = [a + b for a, b in zip(total[:4], sums[:4])]
            total[4] = max(total[4], sums[4])
            if expert is not None:
                per_expert.setdefault((layer, operand), {})[expert] = sums
        layers: dict[str, dict[str, dict[str, float]]] = {}
        for (layer, operand), sums in totals.items():
            layers.setdefault(layer, {})[operand] = stats_of(sums)
        out: dict = {"layers": layers}
        if self.tokens:
            experts: dict[str, dict] = {layer: {"tokens": t} for layer, t in self.tokens.items()}
            for (layer, operand), by_expert in per_expert.items():
                n = len(self.tokens[layer])
                stats = [stats_of(by_expert[e]) if e in by_expert else None for e in range(n)]
                experts[layer][operand] = {
                    name: [None if s is None else s[name] for s in stats] for name in STATS
                }
            out["experts"] = experts
        return out


def probe(
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    autocast=contextlib.nullcontext,
    aux_loss_coef: float = 0.0,
) -> dict:
    """Telemetry of one forward and backward pass; leaves grads and RNG state as they were
    (grads must be None on entry, as after `zero_grad`). `autocast` makes the forward's
    autocast context; an MoE model's backward includes its load-balancing loss times
    `aux_loss_coef`, as training's does. Returns `_Recorder.result()`'s {"layers": ...,
    "experts": ...}."""
    layers, grouped = converted_layers(model), grouped_layers(model)
    if not layers and not grouped:
        return {"layers": {}}
    recorder = _Recorder()
    handles = [m.register_forward_hook(recorder.hook(name)) for name, m in layers.items()]
    handles += [
        m.register_forward_hook(recorder.grouped_hook(name), with_kwargs=True)
        for name, m in grouped.items()
    ]
    devices = [inputs.device] if inputs.device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            with autocast():
                logits = model(inputs)
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
            if isinstance(model, MoETransformer):
                loss = loss + aux_loss_coef * model.aux_loss
            loss.backward()
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    return recorder.result()
