"""`blockscale.nn.Linear`: an `nn.Linear` whose forward runs `blockscale.linear` with a recipe.

It subclasses `nn.Linear` so everything that inspects a model (optimizers, FSDP, state_dict
keys, `isinstance` checks, weight tying) sees the same parameters under the same names.
`from_float` wraps an existing layer and shares its parameters rather than copying them.

`quantize_enabled` is the precision schedule's switch (`blockscale.nn.set_precision`): when
False the layer computes a plain `F.linear` in the input's (or autocast's) precision. It is a
Python attribute, so under torch.compile flipping it costs one recompilation, once.

Under torch.compile the forward is one opaque call to `ops.linear.compiled_linear` in Dynamo's
graph, which AOTAutograd traces: the same ops, without Dynamo interpreting the quantization's
Python per layer (the bulk of a converted model's extra compile time). The recipe goes in as
a `RecipeConstant`, kept beside it; assigning `recipe` replaces both, and a compiled model
then recompiles. A weight that holds quantized copies (FSDP2's quantized all-gather, NVFP4
primary weights) takes the same call, carried as its inner tensors; any other tensor subclass
but a DTensor runs `linear` eagerly at a graph break (`_linear_at_a_graph_break`).

DTensors: torch's own `ColwiseParallel` / `RowwiseParallel` (torchtitan's parallelize functions
apply them to layers its converter has already swapped) leave the layer's class as it is and
hand it DTensor weights and inputs, which `linear` cannot take. A quantized layer then runs the
forward `register_dtensor_forward` installed: blockscale.distributed registers tensor
parallel's (distributed/tp.py, `forward_on_dtensors`: the local shards with the TP group's amax
reduction, as blockscale's own Quantized*Parallel styles compute, or a ValueError naming the
layouts it takes). A hook rather than a call, since nn/ cannot import distributed/ (DESIGN.md,
"Layers"). FSDP2's parameters are no DTensors in the forward (it gathers them first), and a
layer that computes in BF16 (`quantize_enabled` False, a bf16 recipe) keeps DTensor's F.linear.

Weight cache (ops/weight_cache.py): each layer keeps its weight's quantized copies in
`weight_cache` for reuse within one forward of the model and its backward (a 16x16 NVFP4
copy serves the backward too; a layer called twice in a forward quantizes once; eager only,
compiled graphs quantize as before). `set_weight_cache(model, True, scope="step")` keeps them
across forwards until the next optimizer step (grad accumulation), for loops that change
weights only through torch.optim optimizers. By default a cache starts keeping copies once a
forward and its backward make one of them twice (with two copies, as MXFP8 has, that never
happens, and it holds nothing); `from_first_use=True` keeps them from the first use.
`set_weight_cache(model, False)` turns it off (`weight_cache = None`), `keep_dq=True` keeps
the `_dq` operands too; `clear_weight_cache(model)` drops what is held.
`load_state_dict` and a new `recipe` clear it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from blockscale.ops.linear import (
    RecipeConstant,
    compiled_linear,
    holds_quantized_copies,
    is_dtensor,
    linear,
)
from blockscale.ops.weight_cache import (
    DEFAULT_FROM_FIRST_USE,
    DEFAULT_KEEP_DQ,
    DEFAULT_SCOPE,
    WeightCache,
)
from blockscale.recipes import Recipe, require_bool, require_recipe


class Linear(nn.Linear):
    """nn.Linear with its three GEMMs quantized as `recipe` says.

    >>> layer = bs.nn.Linear(64, 32, recipe=bs.recipes.get("nvfp4"))
    >>> layer(torch.randn(4, 64)).shape
    torch.Size([4, 32])
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        recipe: Recipe,
    ) -> None:
        bias = require_bool("bias", bias)  # nn.Linear reads "False" as a bias wanted
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.weight_cache: WeightCache | None = WeightCache()
        self.recipe = recipe
        self.quantize_enabled = True
        self.register_load_state_dict_post_hook(_clear_after_load)

    @property
    def recipe(self) -> Recipe:
        return self._recipe

    @recipe.setter
    def recipe(self, recipe: Recipe) -> None:
        require_recipe(recipe)
        self._recipe = recipe
        self._recipe_constant = RecipeConstant.of(recipe)
        if self.weight_cache is not None:
            self.weight_cache.clear()

    @classmethod
    def from_float(cls, module: nn.Linear, recipe: Recipe) -> Linear:
        """A Linear that shares `module`'s weight and bias Parameters (no copy, no init)."""
        if not isinstance(module, nn.Linear):
            raise TypeError(f"from_float takes an nn.Linear, got {type(module).__name__}")
        with torch.device("meta"):
            new = cls(
                module.in_features, module.out_features, bias=module.bias is not None, recipe=recipe
            )
        new.weight = module.weight
        new.bias = module.bias
        new.train(module.training)
        return new

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.quantize_enabled:
            return F.linear(input, self.weight, self.bias)
        # DTensors under a bf16 recipe go on to `linear`, which is F.linear: DTensor's own.
        dtensors = is_dtensor(input) or is_dtensor(self.weight)
        if dtensors and _dtensor_forward is not None and self.recipe.quantized:
            return _dtensor_forward(self, input)
        if torch.compiler.is_dynamo_compiling():
            if not (_plain(input) and _traceable_weight(self.weight)):
                return _linear_at_a_graph_break(input, self.weight, self.bias, self.recipe)
            bias = () if self.bias is None else (self.bias,)
            return compiled_linear(self._recipe_constant, input, self.weight, *bias)
        cache = None if torch.compiler.is_compiling() else self.weight_cache
        return linear(input, self.weight, self.bias, self.recipe, weight_cache=cache)

    def extra_repr(self) -> str:
        state = "" if self.quantize_enabled else ", quantize_enabled=False"
        return f"{super().extra_repr()}, recipe={self.recipe.name}{state}"


DTensorForward = Callable[[Linear, torch.Tensor], torch.Tensor]
_dtensor_forward: DTensorForward | None = None


def register_dtensor_forward(forward: DTensorForward) -> None:
    """Make `forward(layer, input)` the forward of every quantized Linear whose weight or input
    is a DTensor (module docstring, "DTensors"); blockscale.distributed registers its own when
    imported, as `import blockscale` does. Until one is registered, `linear` raises a TypeError
    for a DTensor."""
    global _dtensor_forward
    _dtensor_forward = forward


def _clear_after_load(module: nn.Module, incompatible_keys: object) -> None:
    if module.weight_cache is not None:
        module.weight_cache.clear()


def set_weight_cache(
    model: nn.Module,
    enabled: bool,
    keep_dq: bool = DEFAULT_KEEP_DQ,
    from_first_use: bool = DEFAULT_FROM_FIRST_USE,
    scope: str = DEFAULT_SCOPE,
) -> int:
    """Give every converted linear and expert weight of `model` a new, empty weight cache
    (`keep_dq`: it keeps the `_dq` operands too; `from_first_use`: it keeps copies from their
    first use, not only once a step has made one twice), or none (enabled=False: each use
    quantizes the weight again). Returns how many modules were set.

    `scope` (ops/weight_cache.py, "How long a copy is valid"): "forward", the default, reuses a
    copy only within the forward of the model that made it and that forward's backward, which
    no change of the weight between two calls can make stale. "step" also reuses it in later
    forwards (grad accumulation's micro-batches) until the next `torch.optim.Optimizer.step`:
    only for loops in which the weights change through a torch.optim optimizer,
    `load_state_dict` or in-place ops on the parameters themselves, never through `p.data`,
    shared numpy memory or an update written by hand (the CLI's loop sets it).

    >>> model = bs.convert(torch.nn.Sequential(torch.nn.Linear(64, 64)), bs.recipes.get("nvfp4"))
    >>> bs.nn.set_weight_cache(model, False)  # quantize the weight at every use instead
    1
    """
    enabled = require_bool("enabled", enabled)
    count = 0
    for module in model.modules():
        if hasattr(module, "weight_cache"):
            module.weight_cache = WeightCache(keep_dq, from_first_use, scope) if enabled else None
            count += 1
    return count


def clear_weight_cache(model: nn.Module) -> int:
    """Drop the quantized copies every weight cache in `model` holds. Needed only under the
    opt-in `scope="step"`, after a weight change that neither an optimizer step,
    `load_state_dict` nor the version counter shows (a write through `p.data`, a checkpoint
    loaded into an FSDP2 model's shards without `load_state_dict`); the default scope never
    reuses a copy past the next call. Returns how many caches were cleared.

    >>> model = bs.convert(torch.nn.Sequential(torch.nn.Linear(64, 64)), bs.recipes.get("nvfp4"))
    >>> with torch.no_grad():
    ...     _ = model[0].weight.data.mul_(0.5)  # a write the version counter does not show
    >>> bs.nn.clear_weight_cache(model)
    1
    """
    count = 0
    for module in model.modules():
        cache = getattr(module, "weight_cache", None)
        if isinstance(cache, WeightCache):
            cache.clear()
            count += 1
    return count


def _plain(t: torch.Tensor) -> bool:
    """Not a tensor subclass (a Parameter is not one here)."""
    return type(t) in (torch.Tensor, nn.Parameter)


def _traceable_weight(weight: torch.Tensor) -> bool:
    """A weight `compiled_linear` takes: a plain tensor, or one that holds its quantized copies
    (FSDP2's quantized all-gather, NVFP4 primary weights), which Dynamo carries as its inner
    tensors (`__tensor_flatten__`) and AOTAutograd traces `linear` with."""
    return _plain(weight) or holds_quantized_copies(weight)


@torch.compiler.disable
def _linear_at_a_graph_break(input, weight, bias, recipe) -> torch.Tensor:
    """`linear` run eagerly inside a compiled model, for an input or weight that is a tensor
    subclass other than a quantized weight (until 2026-12-05, DTensors under tensor parallelism:
    now `_dtensor_forward`, which Dynamo traces as it traces tp.py's styles). Letting
    Dynamo trace `linear` itself broke it into pieces recompiled per weight shape, one of which
    failed on the first compile with a fresh cache ("sources must not be empty for symbol",
    building guards for a size of a subclass's scales; seen on two GPUs and on the CPU).
    Quantized weights took this path too until 2026-11-28: torch 2.11's nonstrict_trace
    refused them ("Unsupported output type"), which was a data read in the E2M1 code check
    under fake tensors (formats/_checks.py now skips it under any trace)."""
    return linear(input, weight, bias, recipe)
