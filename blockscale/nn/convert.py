"""`convert(model, recipe)`: swap a model's linear layers for recipe-driven ones, from outside.

The model code knows nothing of quantization. `convert` walks the module tree in post-order
(children before their parent) and replaces every module whose type is exactly `nn.Linear`
with a `blockscale.nn.Linear` that shares its Parameters, so optimizers, state_dict keys and
tied weights are untouched. Subclasses of nn.Linear are left alone on purpose: their forward
may not be a plain linear (e.g. attention's `NonDynamicallyQuantizableLinear` is read by weight,
not called). A layer is skipped, and the log says why, when

- `module_filter_fn(module, fqn)` returns False, or
- its dims do not fit the recipe's blocks (e.g. in_features=100 with 16-wide NVFP4 blocks).

The log ends with "converted N of M linears".

`layer_policy(model)` builds the paper's filter (arXiv 2509.25149): keep the last ~15% of the
transformer blocks in BF16, plus the LM head, embeddings and MoE router. It finds the blocks as
the longest `nn.ModuleList` of same-typed modules (`layers`, `h`, `blocks`, ...), or the one
named by `blocks`. The LM head is recognised by name or by an output width equal to an
embedding's vocabulary.

The precision schedule (`set_precision`, `PrecisionSchedule`) switches converted layers to
plain high-precision F.linear for the final part of training, where the paper recovers most of
the remaining loss gap.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from torch import nn

from blockscale.nn.linear import Linear
from blockscale.ops.linear import unsupported_reason
from blockscale.recipes import Recipe

logger = logging.getLogger(__name__)

ModuleFilter = Callable[[nn.Module, str], bool]

# Matched (fnmatch) against the last component of a linear layer's qualified name.
DEFAULT_BF16_NAMES = ("lm_head", "output", "head", "classifier", "*embed*", "*router*", "gate")


def convert(
    model: nn.Module, recipe: Recipe, module_filter_fn: ModuleFilter | None = None
) -> nn.Module:
    """Swap `model`'s nn.Linear layers for `blockscale.nn.Linear(recipe)` in place; returns model.

    `module_filter_fn(module, fqn) -> bool` picks the layers to convert (True converts);
    `layer_policy(model)` builds the paper's. An already converted layer gets the new recipe.
    A bare nn.Linear passed as `model` cannot be swapped in place: the converted layer is
    returned instead.
    """
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a blockscale Recipe, got {type(recipe).__name__}")
    counts = {"total": 0, "converted": 0}
    swapped: dict[int, nn.Module] = {}

    def wants(module: nn.Module, fqn: str) -> bool:
        counts["total"] += 1
        if module_filter_fn is not None and not module_filter_fn(module, fqn):
            logger.debug("%s stays in high precision (module_filter_fn)", fqn or "<root>")
            return False
        reason = unsupported_reason(module.in_features, module.out_features, recipe)
        if reason is not None:
            logger.warning("%s stays in high precision: %s", fqn or "<root>", reason)
            return False
        counts["converted"] += 1
        return True

    def swap(module: nn.Module, fqn: str) -> nn.Module:
        if isinstance(module, Linear):
            if wants(module, fqn):
                module.recipe = recipe
            return module
        if type(module) is nn.Linear and wants(module, fqn):
            return Linear.from_float(module, recipe)
        return module

    def visit(parent: nn.Module, prefix: str) -> None:
        for name, child in list(parent.named_children()):
            fqn = f"{prefix}.{name}" if prefix else name
            if id(child) in swapped:  # a module registered twice is converted once
                setattr(parent, name, swapped[id(child)])
                continue
            visit(child, fqn)
            new = swap(child, fqn)
            swapped[id(child)] = new
            if new is not child:
                setattr(parent, name, new)

    visit(model, "")
    model = swap(model, "")
    logger.info(
        "converted %d of %d linears to recipe %s", counts["converted"], counts["total"], recipe.name
    )
    return model


def _find_blocks(model: nn.Module, blocks: str | None) -> tuple[str, int] | None:
    """(fqn, length) of the repeated transformer-block list."""
    modules = dict(model.named_modules())
    if blocks is not None:
        found = modules.get(blocks)
        if not isinstance(found, nn.ModuleList | nn.Sequential):
            raise ValueError(f"blocks={blocks!r} names no nn.ModuleList in the model")
        return blocks, len(found)
    best: tuple[str, int] | None = None
    for fqn, module in modules.items():
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        if len({type(m) for m in module}) != 1:
            continue
        if best is None or len(module) > best[1]:
            best = (fqn, len(module))
    return best


@dataclass(frozen=True)
class LayerPolicy:
    """A `module_filter_fn`: True (convert) unless the layer is in a BF16 block or is named
    like a head, embedding or router, or is an LM head by its vocabulary-sized output."""

    blocks: str | None
    bf16_blocks: frozenset[int]
    bf16_names: tuple[str, ...]
    vocab_sizes: frozenset[int] = field(default_factory=frozenset)

    def __call__(self, module: nn.Module, fqn: str) -> bool:
        last = fqn.rsplit(".", 1)[-1]
        if any(fnmatch.fnmatchcase(last, pattern) for pattern in self.bf16_names):
            return False
        if getattr(module, "out_features", None) in self.vocab_sizes:
            return False
        if self.blocks is not None:
            prefix = f"{self.blocks}." if self.blocks else ""
            if fqn.startswith(prefix):
                index = fqn[len(prefix) :].split(".", 1)[0]
                if index.isdigit() and int(index) in self.bf16_blocks:
                    return False
        return True


def layer_policy(
    model: nn.Module,
    bf16_tail_fraction: float = 0.15,
    bf16_head_blocks: int = 0,
    bf16_names: Iterable[str] = DEFAULT_BF16_NAMES,
    blocks: str | None = None,
) -> LayerPolicy:
    """The paper's layer policy as a `module_filter_fn` for `convert`.

    bf16_tail_fraction: fraction of the transformer blocks, counted from the last, kept in BF16
        (rounded to the nearest count, at least one block when the fraction is positive).
    bf16_head_blocks:   number of leading blocks also kept in BF16 (the paper does this at
        large scale).
    bf16_names:         fnmatch patterns for a linear's last name component kept in BF16.
    blocks:             qualified name of the block ModuleList; found automatically when None.
    """
    if not 0.0 <= bf16_tail_fraction <= 1.0:
        raise ValueError(f"bf16_tail_fraction={bf16_tail_fraction} is not in [0, 1]")
    if bf16_head_blocks < 0:
        raise ValueError(f"bf16_head_blocks={bf16_head_blocks} must be >= 0")
    found = _find_blocks(model, blocks)
    kept: set[int] = set()
    if found is None:
        logger.warning("layer_policy: no repeated block list found; only name rules apply")
        blocks_fqn = None
    else:
        blocks_fqn, n = found
        tail = max(1, round(n * bf16_tail_fraction)) if bf16_tail_fraction > 0 else 0
        kept = set(range(n - min(tail, n), n)) | set(range(min(bf16_head_blocks, n)))
        logger.info(
            "layer_policy: %s has %d blocks; kept in BF16: %s",
            blocks_fqn or "<root>",
            n,
            sorted(kept),
        )
    vocab = frozenset(m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding))
    return LayerPolicy(blocks_fqn, frozenset(kept), tuple(bf16_names), vocab)


def set_precision(model: nn.Module, enabled: bool) -> int:
    """Turn quantization of every converted layer on (True) or off (False: plain high-precision
    F.linear). Returns how many layers were switched."""
    switched = 0
    for module in model.modules():
        if hasattr(module, "quantize_enabled"):
            module.quantize_enabled = bool(enabled)
            switched += 1
    return switched


@dataclass(frozen=True)
class PrecisionSchedule:
    """Quantized training until the last `bf16_final_fraction` of `total_steps`, then BF16.

    The paper switches for the last ~18% of tokens. Call `apply(model, step)` every step
    (resumed runs included: it sets the precision from the step alone, holding no state).
    """

    total_steps: int
    bf16_final_fraction: float = 0.18

    def __post_init__(self) -> None:
        if self.total_steps < 1:
            raise ValueError(f"total_steps={self.total_steps} must be >= 1")
        if not 0.0 <= self.bf16_final_fraction <= 1.0:
            raise ValueError(f"bf16_final_fraction={self.bf16_final_fraction} is not in [0, 1]")

    @property
    def switch_step(self) -> int:
        """The first step that runs in BF16."""
        return self.total_steps - round(self.total_steps * self.bf16_final_fraction)

    def quantized(self, step: int) -> bool:
        return step < self.switch_step

    def apply(self, model: nn.Module, step: int) -> bool:
        """Set the model's precision for `step` (0-based); returns whether it is quantized."""
        enabled = self.quantized(step)
        set_precision(model, enabled)
        return enabled
