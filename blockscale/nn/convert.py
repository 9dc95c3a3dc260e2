"""`convert(model, recipe)`: make a model's linear layers and routed experts follow a recipe,
from outside.

The model code knows nothing of quantization. `convert` walks the module tree in post-order
(children before their parent) and

- replaces every plain linear with a `blockscale.nn.Linear` that shares its Parameters, so
  optimizers, state_dict keys and tied weights are untouched. A plain linear is an `nn.Linear`
  or a subclass that keeps nn.Linear's own forward (torchtitan's `Linear`, which adds only a
  config): what it computes is `F.linear`, so the swap changes nothing but the precision. A
  subclass with a forward of its own is left alone, since that forward may be no plain linear
  (a scaled bias, another quantizer), and so is attention's `NonDynamicallyQuantizableLinear`:
  `nn.MultiheadAttention` reads its weight and never calls it, so a swap would quantize
  nothing and count a layer that no GEMM of the recipe reaches (`_plain_linear`);
- routes the grouped GEMMs of every experts module (3D expert weights consumed by
  `F.grouped_mm`: transformers 5.x's experts classes, `models/moe.py`'s `Experts`; or by
  `torch.bmm`, every expert on every token: transformers' Llama 4) to
  `blockscale.nn.GroupedMM` modules, leaving its parameters as they are (`nn/experts.py` says
  how and why).

A linear layer or an experts module is skipped, and the log says why, when

- `module_filter_fn(module, fqn)` returns False (experts modules are passed to it whole),
- a weight's dims do not fit the recipe's blocks (e.g. in_features=100 with 16-wide NVFP4
  blocks; an expert weight [E, N, K] is checked as a linear of K inputs and N outputs),
- it is an MoE router: an nn.Linear beside an experts module whose output width is the number
  of experts stays in high precision whatever the filter says (a quantized router moves tokens
  between experts, an error of another kind than a noisy product). transformers' routers are
  their own modules, not nn.Linear, and are never touched;
- it is a transformers experts module set to another implementation than "grouped_mm", or
  one outside transformers' experts-implementation registry other than Llama 4's (only
  grouped_mm calls, and bmm calls on expert weights, are routed).

A module registered under several names (`nn.Sequential(layer, act, layer)`, or one module in
two parents) is one module: it is decided once, from all its names, and the one converted
module (its Parameters shared as before) is put at every name; an experts module is routed
once and is routed at every name. The filter is asked at each name and must give the same
answer at all of them, else a ValueError lists the names of each answer and the model is left
unchanged: either answer would overrule the filter at some name, and no answer can convert a
module at one name only. A linear that is a router beside the experts at any of its names stays
in high precision at all of them.

The log ends with "converted N of M linears" (and "and X of Y expert weights" when the model
has experts), each module counted once however many names it has, as `set_precision` counts.
Without a `module_filter_fn`, a quantized linear that `layer_policy` would keep in BF16 as the
LM head (`LayerPolicy.is_lm_head`) at any of its names is logged at WARNING, with the way to
keep it in BF16: quantizing the head is allowed, but rarely meant.

Experts kept in high precision. An experts weight that the filter or the blocks keep in high
precision (the BF16 blocks of `layer_policy`, say) is routed all the same, to a `GroupedMM` of
the `bf16` recipe: it computes what the model's own call computes (an unquantized
`torch._grouped_mm` in the weight's dtype), but through blockscale's opaque op under
torch.compile. Left to the model, such a weight did not compile on the GPU: transformers'
experts call their own op `transformers::grouped_mm_fallback` for FP32 master weights under
torch.compile, and that op's backward (transformers 5.17) reads `offs` on the host, which
AOTAutograd cannot trace (`DataDependentOutputException`). The log's "X of Y expert weights"
counts the quantized ones.

`layer_policy(model)` builds the paper's filter (arXiv 2509.25149): keep the last ~15% of the
transformer blocks in BF16 (their experts included), plus the LM head, embeddings and MoE
router. It finds the blocks as
the longest `nn.ModuleList` of same-typed modules (`layers`, `h`, `blocks`, ...), or
`nn.ModuleDict` of them keyed by block numbers (torchtitan's `layers`), or the one named by
`blocks`. The LM head is recognised by name or by an output width equal to an
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
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from blockscale.nn.experts import experts_weights, is_bmm_experts, route_grouped_mm
from blockscale.nn.linear import Linear
from blockscale.ops.grouped_mm import unsupported_reason as experts_unsupported_reason
from blockscale.ops.linear import unsupported_reason
from blockscale.ops.weight_cache import scope_forwards
from blockscale.recipes import Recipe, require_bool, require_recipe
from blockscale.recipes import get as get_recipe

logger = logging.getLogger(__name__)

ModuleFilter = Callable[[nn.Module, str], bool]

# What the experts weights a filter keeps in high precision are routed with (module docstring).
UNQUANTIZED = get_recipe("bf16")

# Matched (fnmatch) against the last component of a linear layer's qualified name.
DEFAULT_BF16_NAMES = ("lm_head", "output", "head", "classifier", "*embed*", "*router*", "gate")


def convert(
    model: nn.Module, recipe: Recipe, module_filter_fn: ModuleFilter | None = None
) -> nn.Module:
    """Make `model`'s nn.Linear layers `blockscale.nn.Linear(recipe)` and route its experts'
    grouped GEMMs to `blockscale.nn.GroupedMM(recipe)`, in place; returns model.

    `module_filter_fn(module, fqn) -> bool` picks the linears and experts modules to convert
    (True converts); `layer_policy(model)` builds the paper's. It must answer a bool (Python's
    or numpy's): anything else (None, 0/1, "False", a tensor) raises a TypeError naming the
    module. Every module is decided before any is changed, so a filter that raises leaves the
    model as it was. A module registered under several names is converted once and the same
    converted module is put at each name; the filter must answer the same at all of them, else
    a ValueError (module docstring). An already converted layer or
    experts module gets the new recipe. A bare nn.Linear passed as `model` cannot be swapped
    in place: the converted layer is returned instead.

    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 32))
    >>> model = bs.convert(model, bs.recipes.get("nvfp4"))
    >>> isinstance(model[0], bs.nn.Linear), model(torch.randn(4, 64)).shape
    (True, torch.Size([4, 32]))
    """
    require_recipe(recipe)
    counts = {"total": 0, "converted": 0, "expert_total": 0, "expert_converted": 0}
    # No policy: find the LM head as layer_policy would, to say that it gets quantized.
    heads = _lm_head_finder(model) if module_filter_fn is None and recipe.quantized else None

    def chosen(module: nn.Module, fqns: list[str]) -> bool:
        """The filter's answer: True without a filter."""
        return module_filter_fn is None or _filter_answer(module_filter_fn, module, fqns)

    def wants(module: nn.Module, fqns: list[str], n_experts: set[int]) -> bool:
        counts["total"] += 1
        fqn = fqns[0]
        if module.out_features in n_experts:
            logger.info(
                "%s stays in high precision: router of the %d experts beside it",
                fqn or "<root>",
                module.out_features,
            )
            return False
        if not chosen(module, fqns):
            return False
        reason = unsupported_reason(module.in_features, module.out_features, recipe)
        if reason is not None:
            logger.warning("%s stays in high precision: %s", fqn or "<root>", reason)
            return False
        counts["converted"] += 1
        # a head at any of its names is the same head everywhere
        head = next((f for f in fqns if heads is not None and heads.is_lm_head(module, f)), None)
        if head is not None:
            logger.warning(
                "%s is quantized to %s: it looks like an LM head (%d outputs, an embedding's "
                "vocabulary); convert(model, recipe, module_filter_fn=layer_policy(model)) "
                "keeps it in BF16",
                head or "<root>",
                recipe.name,
                module.out_features,
            )
        return True

    def wanted_experts(
        module: nn.Module, fqns: list[str], weights: dict[str, nn.Parameter]
    ) -> list[str] | None:
        """The expert weights to quantize; None where the module is not routed at all."""
        counts["expert_total"] += len(weights)
        fqn = fqns[0]
        if _experts_not_routable(module, fqn):
            return None
        if not chosen(module, fqns):
            return []
        # transformers marks experts stored as [E, K, N] with is_transposed (Llama 4's, which
        # multiply with bmm, by their class); the usual is [E, N, K].
        transposed = getattr(module, "is_transposed", False) is True or is_bmm_experts(module)
        names = []
        for name, weight in weights.items():
            n, k = (weight.shape[2], weight.shape[1]) if transposed else weight.shape[1:]
            reason = experts_unsupported_reason(k, n, recipe) if recipe.quantized else None
            if reason is not None:
                where = f"{fqn}.{name}" if fqn else name
                logger.warning("%s stays in high precision: %s", where, reason)
                continue
            names.append(name)
        counts["expert_converted"] += len(names)
        return names

    def decide(module: nn.Module, fqns: list[str], n_experts: set[int]) -> Callable[[], nn.Module]:
        """What to do with `module` (a call that does it), decided without changing it, from
        all its names and the experts beside it at any of them."""
        weights = experts_weights(module)
        if weights:
            names = wanted_experts(module, fqns, weights)
            if names is None:
                return lambda: module
            # The weights kept in high precision are routed too, unquantized (module docstring,
            # "Experts kept in high precision").
            kept = [name for name in weights if name not in names]

            def route() -> nn.Module:
                if kept:
                    route_grouped_mm(module, UNQUANTIZED, kept)
                return route_grouped_mm(module, recipe, names) if names else module

            return route
        if isinstance(module, Linear):
            if wants(module, fqns, n_experts):
                return lambda: _set_recipe(module, recipe)
            return lambda: module
        if _plain_linear(module) and wants(module, fqns, n_experts):
            return lambda: Linear.from_float(module, recipe)
        return lambda: module

    # Every module is decided (the filter called on each) before any is changed, so a filter
    # that raises, or returns what is not a bool, leaves the model as it was. A module
    # registered under several names is decided once, from all of them, and its one result is
    # put at each.
    decided = [(found, decide(found.module, found.fqns, found.n_experts)) for found in _tree(model)]
    decided_root = decide(model, [""], set())
    for found, do in decided:
        swapped = do()
        for parent, name in found.places:
            if getattr(parent, name) is not swapped:
                setattr(parent, name, swapped)
    model = scope_forwards(decided_root())  # one forward scope a call (ops/weight_cache.py)
    experts = ""
    if counts["expert_total"]:
        experts = f" and {counts['expert_converted']} of {counts['expert_total']} expert weights"
    logger.info(
        "converted %d of %d linears%s to recipe %s",
        counts["converted"],
        counts["total"],
        experts,
        recipe.name,
    )
    return model


def _filter_answer(module_filter_fn: ModuleFilter, module: nn.Module, fqns: list[str]) -> bool:
    """The filter's answer for `module`: a bool, the same at each of its names, else an error."""
    answers = []
    for fqn in fqns:
        said = module_filter_fn(module, fqn)
        try:
            answers.append((fqn, require_bool("module_filter_fn's answer", said)))
        except TypeError:
            raise TypeError(
                f"module_filter_fn returned {said!r} ({type(said).__name__}) for "
                f"{fqn or '<root>'} ({type(module).__name__}): it must return True (convert) "
                "or False (keep in high precision); the model is unchanged"
            ) from None
    if len({said for _, said in answers}) > 1:
        raise ValueError(
            f"module_filter_fn converts one {type(module).__name__}, registered under "
            f"{len(fqns)} names, at {', '.join(f for f, said in answers if said)} but keeps "
            f"it in high precision at {', '.join(f for f, said in answers if not said)}: "
            "it is one module, converted at all its names or at none, so the filter must "
            "answer the same at each; the model is unchanged"
        )
    if not answers[0][1]:
        logger.debug("%s stays in high precision (module_filter_fn)", fqns[0] or "<root>")
    return answers[0][1]


@dataclass
class _Registered:
    """A module below the root, with every place it is registered at."""

    module: nn.Module
    places: list[tuple[nn.Module, str]] = field(default_factory=list)  # (parent, name)
    fqns: list[str] = field(default_factory=list)
    # The number of experts of each experts module beside it, at any place: a linear with that
    # many outputs is their router.
    n_experts: set[int] = field(default_factory=set)


def _tree(model: nn.Module) -> list[_Registered]:
    """Every module below `model` once, children before their parent, with all its names.

    It reads `_modules`, not `named_children()`, which yields a module registered twice in one
    parent only once (the other name would keep the plain module), and walks a module met
    before again, so that its children get their names under each of its own."""
    found: dict[int, _Registered] = {}

    def visit(parent: nn.Module, prefix: str) -> None:
        children = [(name, child) for name, child in parent._modules.items() if child is not None]
        n_experts = {
            next(iter(w.values())).shape[0]
            for _, child in children
            if (w := experts_weights(child))
        }
        for name, child in children:
            fqn = f"{prefix}.{name}" if prefix else name
            visit(child, fqn)
            entry = found.setdefault(id(child), _Registered(child))  # dicts keep insertion order
            entry.places.append((parent, name))
            entry.fqns.append(fqn)
            entry.n_experts |= n_experts

    visit(model, "")
    return list(found.values())


def _experts_not_routable(module: nn.Module, fqn: str) -> bool:
    """Whether an experts module's forward makes no grouped_mm (or bmm) call to route (said
    once)."""
    config = getattr(module, "config", None)
    implementation = getattr(config, "_experts_implementation", None)
    if (
        type(module).__module__.startswith("transformers.")
        and not hasattr(config, "_experts_implementation")
        and not is_bmm_experts(module)
    ):
        # a transformers experts class outside its experts-implementation registry makes no
        # grouped_mm call for the router to take; of those, the bmm of Llama 4's (5.x) is
        # routed (nn/experts.py, "Batched matmuls"), a loop is not
        logger.warning(
            "%s stays in high precision: transformers' %s takes no "
            "experts_implementation, so its forward never calls grouped_mm, and only "
            "grouped_mm calls (and Llama 4's experts' bmm) are routed",
            fqn or "<root>",
            type(module).__name__,
        )
        return True
    if implementation not in (None, "grouped_mm"):
        logger.warning(
            "%s stays in high precision: it runs experts_implementation=%r and only "
            "grouped_mm calls are routed (build the model with "
            "experts_implementation='grouped_mm')",
            fqn or "<root>",
            implementation,
        )
        return True
    return False


def _plain_linear(module: nn.Module) -> bool:
    """Whether `module` is a linear `convert` swaps (module docstring): an nn.Linear whose
    class keeps nn.Linear's forward, other than attention's read-by-weight output projection."""
    return (
        isinstance(module, nn.Linear)
        and type(module).forward is nn.Linear.forward
        and not isinstance(module, NonDynamicallyQuantizableLinear)
    )


def _set_recipe(module: Linear, recipe: Recipe) -> Linear:
    module.recipe = recipe
    return module


def _block_list(module: nn.Module) -> list[str] | None:
    """The names of a block list's entries, in order: an nn.ModuleList's (or nn.Sequential's)
    indices, or the keys of an nn.ModuleDict whose keys are all block numbers (torchtitan's
    `layers`, `"0"`, `"1"`, ...; a pipeline stage's may start past 0). None for anything else."""
    if isinstance(module, nn.ModuleList | nn.Sequential):
        return [str(i) for i in range(len(module))]
    if isinstance(module, nn.ModuleDict) and all(key.isdigit() for key in module):
        return list(module.keys())
    return None


def _find_blocks(model: nn.Module, blocks: str | None) -> tuple[str, list[str]] | None:
    """(fqn, entry names in order) of the repeated transformer-block list."""
    modules = dict(model.named_modules())
    if blocks is not None:
        found = modules.get(blocks)
        names = None if found is None else _block_list(found)
        if names is None:
            raise ValueError(
                f"blocks={blocks!r} names no nn.ModuleList, nn.Sequential or nn.ModuleDict "
                "keyed by block numbers in the model"
            )
        return blocks, names
    best: tuple[str, list[str]] | None = None
    for fqn, module in modules.items():
        if isinstance(module, nn.Sequential):
            continue  # a pipeline of different layers more often than a block list
        names = _block_list(module)
        if names is None or len(names) < 2:
            continue
        if len({type(m) for m in module.children()}) != 1:
            continue
        if best is None or len(names) > len(best[1]):
            best = (fqn, names)
    return best


@dataclass(frozen=True)
class LayerPolicy:
    """A `module_filter_fn`: True (convert) unless the layer (a linear or an experts module) is
    in a BF16 block or is named like a head, embedding or router, or is, outside the blocks,
    an LM head by its vocabulary-sized output.

    >>> blocks = torch.nn.ModuleList([torch.nn.Linear(64, 64) for _ in range(4)])
    >>> model = torch.nn.ModuleDict({"layers": blocks, "lm_head": torch.nn.Linear(64, 256)})
    >>> policy = bs.nn.layer_policy(model)  # the last block and the head stay in BF16
    >>> policy.bf16_blocks, policy(blocks[0], "layers.0"), policy(model["lm_head"], "lm_head")
    (frozenset({3}), True, False)
    """

    blocks: str | None
    bf16_blocks: frozenset[int]
    bf16_names: tuple[str, ...]
    vocab_sizes: frozenset[int] = field(default_factory=frozenset)

    def __call__(self, module: nn.Module, fqn: str) -> bool:
        last = fqn.rsplit(".", 1)[-1]
        if any(fnmatch.fnmatchcase(last, pattern) for pattern in self.bf16_names):
            return False
        index = self._block_index(fqn)
        if index is not None:
            return not (index.isdigit() and int(index) in self.bf16_blocks)
        return not self.is_lm_head(module, fqn)

    def _block_index(self, fqn: str) -> str | None:
        """The first name component after the block list's, or None outside the blocks."""
        if self.blocks is None:
            return None
        prefix = f"{self.blocks}." if self.blocks else ""
        return fqn[len(prefix) :].split(".", 1)[0] if fqn.startswith(prefix) else None

    def is_lm_head(self, module: nn.Module, fqn: str) -> bool:
        """Whether the layer is an LM head: outside the blocks, an output as wide as an
        embedding's vocabulary. Inside a block such a width is a coincidence of sizes (an MLP
        as wide as the vocabulary), not an LM head."""
        if self._block_index(fqn) is not None:
            return False
        return getattr(module, "out_features", None) in self.vocab_sizes


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
    blocks:             qualified name of the block list (an nn.ModuleList, or an nn.ModuleDict
        keyed by block numbers as torchtitan's `layers`); found automatically when None. The
        tail and head are counted in the list's order; an nn.ModuleDict's blocks are then
        named by their keys.

    >>> blocks = torch.nn.ModuleList([torch.nn.Linear(64, 64) for _ in range(4)])
    >>> model = torch.nn.ModuleDict({"layers": blocks, "lm_head": torch.nn.Linear(64, 256)})
    >>> model = bs.convert(model, bs.recipes.get("nvfp4"), bs.nn.layer_policy(model))
    >>> [isinstance(m, bs.nn.Linear) for m in (*blocks, model["lm_head"])]
    [True, True, True, False, False]
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
        blocks_fqn, names = found
        kept = _kept_blocks(names, bf16_tail_fraction, bf16_head_blocks)
        logger.info(
            "layer_policy: %s has %d blocks; kept in BF16: %s",
            blocks_fqn or "<root>",
            len(names),
            sorted(kept),
        )
    return LayerPolicy(blocks_fqn, frozenset(kept), tuple(bf16_names), _vocab_sizes(model))


def block_policy(
    blocks: str,
    names: Iterable[str],
    bf16_tail_fraction: float = 0.15,
    bf16_head_blocks: int = 0,
    bf16_names: Iterable[str] = DEFAULT_BF16_NAMES,
    vocab_sizes: Iterable[int] = (),
) -> LayerPolicy:
    """`layer_policy`'s rule for blocks known by name rather than found in a built model (a
    trainer that converts a model's config before it builds it: torchtitan 0.3): `blocks` the
    block list's qualified name, `names` its entries' names in order ("0", "1", ...).

    >>> policy = bs.nn.block_policy("layers", [str(i) for i in range(8)])
    >>> policy.bf16_blocks, policy(None, "layers.0.attention.wq"), policy(None, "layers.7.w1")
    (frozenset({7}), True, False)
    """
    if not 0.0 <= bf16_tail_fraction <= 1.0:
        raise ValueError(f"bf16_tail_fraction={bf16_tail_fraction} is not in [0, 1]")
    if bf16_head_blocks < 0:
        raise ValueError(f"bf16_head_blocks={bf16_head_blocks} must be >= 0")
    kept = _kept_blocks(list(names), bf16_tail_fraction, bf16_head_blocks)
    return LayerPolicy(blocks, frozenset(kept), tuple(bf16_names), frozenset(vocab_sizes))


def _kept_blocks(names: list[str], bf16_tail_fraction: float, bf16_head_blocks: int) -> set[int]:
    """The blocks kept in BF16, by number: the last ~`bf16_tail_fraction` (at least one when
    positive) and the first `bf16_head_blocks`, counted in the list's order. An nn.ModuleDict's
    blocks are kept by their keys (the block numbers its names carry)."""
    n = len(names)
    tail = max(1, round(n * bf16_tail_fraction)) if bf16_tail_fraction > 0 else 0
    positions = set(range(n - min(tail, n), n)) | set(range(min(bf16_head_blocks, n)))
    return {int(names[i]) for i in positions}


def _vocab_sizes(model: nn.Module) -> frozenset[int]:
    return frozenset(m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding))


def _lm_head_finder(model: nn.Module) -> LayerPolicy:
    """A LayerPolicy read only for `is_lm_head`: the blocks and vocabularies that
    `layer_policy(model)` would find, without its logging."""
    found = _find_blocks(model, None)
    return LayerPolicy(None if found is None else found[0], frozenset(), (), _vocab_sizes(model))


def set_precision(model: nn.Module, enabled: bool) -> int:
    """Turn quantization of every converted layer on (True) or off (False: plain high-precision
    F.linear, or torch._grouped_mm for experts). Returns how many modules were switched (one
    per converted linear and one per converted expert weight).

    >>> model = bs.convert(torch.nn.Sequential(torch.nn.Linear(64, 64)), bs.recipes.get("nvfp4"))
    >>> bs.nn.set_precision(model, False)  # one converted linear switched to plain F.linear
    1
    """
    enabled = require_bool("enabled", enabled)
    switched = 0
    for module in model.modules():
        if hasattr(module, "quantize_enabled"):
            module.quantize_enabled = enabled
            switched += 1
    return switched


@dataclass(frozen=True)
class PrecisionSchedule:
    """Quantized training until the last `bf16_final_fraction` of `total_steps`, then BF16.

    The paper switches for the last ~18% of tokens. Call `apply(model, step)` every step
    (resumed runs included: it sets the precision from the step alone, holding no state).

    >>> schedule = bs.nn.PrecisionSchedule(total_steps=100, bf16_final_fraction=0.2)
    >>> schedule.switch_step, schedule.quantized(79), schedule.quantized(80)
    (80, True, False)
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
