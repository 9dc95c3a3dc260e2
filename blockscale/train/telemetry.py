"""Numerics telemetry: which layers does quantization hurt?

Every `telemetry_every` steps a probe runs one extra forward and backward pass over a training
batch with hooks on each converted layer (a module with a `.recipe`). For each operand the
layer's recipe quantizes it records, against the operand's BF16 value:

- `sqnr_db`: signal-to-quantization-noise ratio, 10 log10(sum x^2 / sum (x - q(x))^2);
- `zero_frac`: the fraction of nonzero values that quantize to zero (underflow);
- `amax`: max |x|, which sets the tensor's global scale.

Operands are named as in the recipe (`output.input`, `grad_input.grad_output`, ...). A `_t`
operand is quantized along the token dimension, and one with the Hadamard transform is compared
with its transformed value, since that is what the GEMM consumes.

Why a separate probe rather than hooks on the training step: the training step stays untouched
(and compiled, if `--compile`), the probe runs the uncompiled module, and it runs inside
`torch.random.fork_rng`, so stochastic rounding in the probe draws no random numbers from the
training stream. With or without telemetry a run computes the same losses. A probe costs about
two training steps (one forward and backward plus the quantizations), so 2% at N = 100.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from blockscale.formats import hadamard as rht

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


def operand_stats(x: torch.Tensor, config, transpose: bool) -> torch.Tensor:
    """[sqnr_db, zero_frac, amax] of quantizing x (any shape, last dim K) with `config`."""
    from blockscale.ops import quantize_operand

    x_bf16 = x.detach().to(torch.bfloat16)
    ref = x_bf16.reshape(-1, x.shape[-1])
    ref = ref.t() if transpose else ref
    if config.hadamard:
        ref = rht.transform(ref)
    ref = ref.float()
    q = (
        quantize_operand(x_bf16, config, transpose=transpose)
        .dequantize(torch.float32)
        .reshape(ref.shape)
    )
    signal = ref.square().sum()
    noise = (ref - q).square().sum().clamp_min(signal * 1e-30)
    nonzero = ref != 0
    zero_frac = (nonzero & (q == 0)).sum() / nonzero.sum().clamp_min(1)
    return torch.stack([10 * torch.log10(signal / noise), zero_frac.float(), ref.abs().amax()])


class _Recorder:
    def __init__(self) -> None:
        self.keys: list[tuple[str, str]] = []
        self.values: list[torch.Tensor] = []

    @torch.no_grad()
    def record(self, layer: str, module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        weight_2d = module.recipe.output.weight
        for operand, config in module.recipe.operands():
            source, transpose = _SOURCES[operand]
            if operand == "grad_input.weight" and config == weight_2d and config.block == "16x16":
                continue  # the exact transpose of output.weight: the same numbers
            if config.quantized and source in tensors:
                self.keys.append((layer, operand))
                self.values.append(operand_stats(tensors[source], config, transpose))

    def hook(self, layer: str):
        def forward_hook(module, args, output):
            self.record(layer, module, {"input": args[0], "weight": module.weight})
            if output.requires_grad:
                output.register_hook(lambda grad: self.record(layer, module, {"grad_output": grad}))

        return forward_hook

    def result(self) -> dict[str, dict[str, dict[str, float]]]:
        table: dict[str, dict[str, dict[str, float]]] = {}
        rows = torch.stack(self.values).tolist() if self.values else []
        for (layer, operand), row in zip(self.keys, rows):
            table.setdefault(layer, {})[operand] = dict(zip(STATS, row))
        return table


def probe(
    model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, autocast=contextlib.nullcontext
) -> dict:
    """Telemetry of one forward and backward pass; leaves grads and RNG state as they were
    (grads must be None on entry, as after `zero_grad`). `autocast` makes the forward's
    autocast context. Returns {layer: {operand: {stat: value}}}."""
    layers = converted_layers(model)
    if not layers:
        return {}
    recorder = _Recorder()
    handles = [m.register_forward_hook(recorder.hook(name)) for name, m in layers.items()]
    devices = [inputs.device] if inputs.device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            with autocast():
                logits = model(inputs)
            F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()).backward()
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    return recorder.result()
