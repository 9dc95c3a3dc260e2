"""Routing an experts module's grouped GEMMs to blockscale, from outside the model.

Mixture-of-experts models (transformers 5.x with `experts_implementation="grouped_mm"`, and
blockscale's own `models/moe.py`) keep their routed experts as 3D parameters, `gate_up_proj`
[E, 2I, H] and `down_proj` [E, H, I], and multiply by them with `F.grouped_mm(x, w.transpose(-2,
-1), offs=offs)` (or `torch._grouped_mm`); transformers' Llama 4 stores them [E, K, N] and
multiplies with `torch.bmm` ("Batched matmuls" below). There is no module per GEMM to swap, so
`convert` must catch the call itself. It does so in three parts:

- `GroupedMM(recipe)`: a module with no parameters whose forward is
  `blockscale.grouped_mm(input, weight_t, offs, recipe)`, or plain `torch._grouped_mm` when
  `quantize_enabled` is False (the precision schedule's switch, as on `Linear`). A converted
  experts module gets a child `grouped_mms` (an `nn.ModuleDict`) holding one per converted
  weight, keyed by the parameter's name, so forward hooks on it see (input, weight_t, offs).
- A `TorchFunctionMode` entered around the experts module's forward only. It follows each
  converted parameter through the layout and dtype ops the forward applies to it (transpose,
  `.to(bfloat16)`, ...: any op whose first argument is one and whose result is 3D) and sends a
  grouped_mm (or a bmm) whose weight is one of them to that parameter's `GroupedMM`. Every
  other call, and every call outside the experts' forward, runs untouched.
- The mode is entered by swapping the instance's class for a generated subclass (cached per
  class, named `Blockscale<Class>`) whose forward runs the original forward inside it. Nothing
  global is patched; other instances of the class are unaffected.

Why a mode and not a weight wrapper tensor subclass (torchao's choice). The parameters stay
exactly what they were: the same Parameter objects, names, dtypes and state_dict values, so an
optimizer built before `convert` still steps them, checkpoints load either way, and FSDP2 (which
swaps in unsharded Parameters around each forward) and a later low-precision all-gather meet
plain tensors. The mode looks the parameters up by name on every forward, so it routes whatever
tensor FSDP2 or `functional_call` has put there. A subclass would replace every Parameter and
carry its dispatch into the optimizer step and the checkpoint; compiled, its `__torch_function__`
is not consulted for grouped_mm (next paragraphs), and a `__torch_dispatch__` sees
`aten._grouped_mm` only below autograd, where blockscale's backward cannot be put in.

Why not transformers' experts registry (`ALL_EXPERTS_FUNCTIONS.register(...)`): it reaches only
transformers' classes, a registered function must re-implement their experts forward (sorting,
gating, biases, expert-parallel sentinels, which change between releases), and our own model
would still need this mechanism. One mechanism serves both, and any other experts module that
calls grouped_mm on its 3D parameters.

torch.compile. Dynamo dispatches `__torch_function__` (of a mode or of a tensor subclass) only
for the public overridable torch functions and for `torch.ops` overloads; `torch._grouped_mm`
is neither, and `F.grouped_mm` is on torch's ignored list, so in a Dynamo-traced forward the call
goes into the graph without the mode or a subclass ever seeing it (measured on torch 2.13: the
mode sees the transpose, then plain `_grouped_mm` is traced). So the generated forward calls the
original forward through `torch._dynamo.nonstrict_trace`: Dynamo puts one opaque call in its
graph, and AOTAutograd then runs the forward as Python on fake tensors, where the C++ binding of
`torch._grouped_mm` does consult the mode. The result is one graph (`fullgraph=True` works),
Inductor compiles the experts' ops with the rest, and autograd sees blockscale's backward.
The price: Dynamo does not look inside the experts forward, so a graph break or a
data-dependent op there (a host read of `offs`, say) is an error instead of a break; the
module's parameters and buffers are passed to the call explicitly (captured tensors would be
constants); nothing read inside is guarded, so the generated forward reads the routing state
(each `quantize_enabled`, each recipe, `training`) where Dynamo does guard it; the call is bound
to its module by an identity-compared constant (as PyTorch's own nonstrict module inputs are),
so compiling each block on its own recompiles once per block; and forward hooks on a `GroupedMM`
run while the graph is traced, not at each compiled step.

transformers' fallback op. transformers' experts (`integrations/moe.py`, 5.x) call grouped_mm
in the weight's dtype (the input cast to it), except where they judge grouped_mm unusable: under
torch.compile (`torch.compiler.is_compiling()`) with non-BF16 weights, as FP32 masters are, they
call their own op `transformers::grouped_mm_fallback(input, weight [E, K, N], offs)`, a loop of
`torch.mm`. Inside the experts' traced call torch 2.13 reports is_compiling() and torch 2.11
does not, so the same model reaches the router through the fallback op on one and through
grouped_mm on the other. The router takes both, the op by its name and its arguments by its
registered schema (whatever the transformers version, and only where transformers registered
it), and sends the op's call to `GroupedMM` as the grouped_mm path would have made it, the input
cast to the weight's dtype (some releases pass it uncast, BF16 under autocast). Unquantized (set_precision off, the bf16 recipe), such a call under a trace
cannot run `torch._grouped_mm` either, whose fake impl accepts only BF16: `GroupedMM` then runs
`_high_precision_grouped_mm`, one opaque op around eager's `torch._grouped_mm` calls.

Widened inputs. With FP32 master weights under BF16 autocast, transformers' experts cast their
BF16 activations to FP32 (the weight's dtype) before each grouped_mm, and the fallback op is
routed with that cast (above). A quantized GroupedMM gets the BF16 activation instead: the
router remembers, within one experts forward, each FP32 cast of a BF16 2-D tensor, and hands the
grouped GEMM the tensor it was cast from, with the output dtype the FP32 call would have had.
The values are the same, so the quantized copies and every result are the same bits
(tests/test_convert_experts.py compares forward and gradients with the FP32 call); what goes
is the FP32 copy (a compiled step stored it, 4 bytes a value, for the quantize kernels to read)
and an FP32 grad_input that the cast's backward then rounded to BF16. At the Mixtral-like shape
that was 1.75 GiB each way for the down projection's input.

Batched matmuls. transformers' Llama 4 experts (`Llama4TextExperts`, in `Llama4ForCausalLM` and
the text model of `Llama4ForConditionalGeneration`, 5.x) take no experts_implementation: every
expert sees every token (the router's scores scale the input; a token an expert does not take
comes with a zero scale), and the forward multiplies `torch.bmm(input [E, T, K], weight [E, K,
N])` on the parameters themselves, `gate_up_proj` [E, H, 2I] and `down_proj` [E, I, H], which
are grouped_mm's weight_t as stored. That bmm is a grouped GEMM of E groups of T tokens. The
router takes `torch.bmm`, `Tensor.bmm`, `torch.matmul`, `Tensor.matmul` and `@` where the
second operand is a converted weight (or a tensor computed from one) and both are 3D with the
same E and K, and sends `input.reshape(E*T, K)` with offs = T, 2T, ..., E*T to the weight's
`GroupedMM`; the [E*T, N] result comes back as [E, T, N], a tensor of its own (no view), as
bmm's is. So the bits are `blockscale.grouped_mm`'s on those operands, each expert's tokens
and weight with their own amax (tests/test_llama4.py). Under autocast the input is quantized
from its cast to the autocast dtype, the values autocast's bmm computes on (as `linear` takes
its input), an FP32 master weight from its own dtype, and the output has the autocast dtype,
as bmm's. A weight kept in high precision (`quantize_enabled` off, the bf16 recipe) runs the
model's own bmm. Any other batched call on a converted weight (a broadcasting matmul, `out=`,
the weight as the first operand) runs as it is, and the warning below names the weight if no
call was routed. Of transformers' classes without an experts_implementation, `convert` routes
those in `BMM_EXPERTS` (Llama 4's, and their subclasses; their weights' blocks are checked with
K and N in that order) and logs the rest as left in high precision; any other experts module
that multiplies its 3D parameters with bmm is routed the same way. Compiled, the bmm is taken
inside the opaque call as grouped_mm is.

Eager costs one Python `__torch_function__` call per torch op inside the experts forward,
microseconds against the GEMMs. A whole-module `torch.save(model)` cannot pickle the generated
class (save the state_dict, which is unchanged). A converted weight that no grouped_mm consumed
in a forward (e.g. transformers' `experts_implementation="eager"` switched on after `convert`)
is reported with a warning rather than left silently in high precision.
"""

from __future__ import annotations

import copy
import functools
import warnings
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn
from torch.overrides import TorchFunctionMode

from blockscale import _registry
from blockscale.ops.grouped_mm import grouped_mm
from blockscale.ops.linear import (
    AmaxReduction,
    output_dtype,
    quantized_input_dtype,
    unaliased,
)
from blockscale.ops.weight_cache import WeightCache
from blockscale.recipes import Recipe, require_recipe

# F.grouped_mm does not consult torch-function handlers today (its torch._grouped_mm call does);
# should it start to, the router must catch it first, since the inner call then runs with the
# mode off.
GROUPED_MM_FUNCTIONS = (torch._grouped_mm, F.grouped_mm)

# Casts whose result, from a BF16 tensor, holds the same values in FP32: transformers' experts
# widen their BF16 activations (autocast's) to the FP32 master weights' dtype before grouped_mm.
_CASTS = frozenset({torch.Tensor.to, torch.Tensor.float, torch.Tensor.type})

# Ops whose result is a function of their tensor argument's values alone (a layout change or
# a cast), so the result of a chain of them is known by the parameter it starts from and its
# own dtype and layout: what the weight cache keys an expert weight's copies by (GroupedMM's
# `weight_source`). A weight reached through any other op is quantized at each use.
_LAYOUT_AND_DTYPE_OPS = frozenset(
    {
        *_CASTS,
        torch.Tensor.bfloat16,
        torch.Tensor.half,
        torch.Tensor.contiguous,
        torch.Tensor.detach,
        torch.Tensor.transpose,
        torch.transpose,
        torch.Tensor.swapaxes,
        torch.swapaxes,
        torch.Tensor.permute,
        torch.permute,
        torch.Tensor.view,
        torch.Tensor.reshape,
        torch.reshape,
        torch.Tensor.mT.__get__,
    }
)

# Batched matmuls the router takes where the weight operand is a routed 3D parameter (module
# docstring, "Batched matmuls"): [E, T, K] @ [E, K, N] is a grouped GEMM of E groups of T.
BATCHED_MM_FUNCTIONS = frozenset(
    {torch.bmm, torch.Tensor.bmm, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__}
)

# transformers' experts classes (by qualified name; a subclass counts) that take no
# experts_implementation and multiply their 3D parameters, stored [E, K, N], with torch.bmm.
BMM_EXPERTS = frozenset({"transformers.models.llama4.modeling_llama4.Llama4TextExperts"})

# transformers' own grouped GEMM op, (input [M, K], weight [E, K, N], offs) -> [M, N], a loop of
# torch.mm: its experts call it instead of grouped_mm for non-BF16 weights under torch.compile.
TRANSFORMERS_FALLBACK_OP = "transformers::grouped_mm_fallback"

# torch.nn's own modules whose weights are 3D for another reason than experts.
_NOT_EXPERTS = (nn.Conv1d, nn.ConvTranspose1d, nn.Bilinear)


class GroupedMM(nn.Module):
    """`blockscale.grouped_mm` with a recipe, as a module with no parameters.

    forward(input [M, K], weight_t [E, K, N], offs int32 [E]) -> [M, N]. With
    `quantize_enabled` False (or a recipe that quantizes nothing) it is exactly
    `torch._grouped_mm(input, weight_t, offs=offs)`, under a trace through an opaque op where
    the operands are not BF16 (`_unquantized_grouped_mm`).
    `weight_cache` keeps the experts' quantized copies while they are unchanged (as on
    `Linear`; the router passes the parameter the weight came from as `weight_source`).
    `amax_reduction` (None: the operands are whole): what tensor parallel of the experts sets
    while its shards are bound (grouped_mm's "Tensor parallel").

    >>> gmm = bs.nn.GroupedMM(bs.recipes.get("mxfp8"))
    >>> x, w_t = torch.randn(64, 32), torch.randn(2, 32, 64)
    >>> gmm(x, w_t, torch.tensor([32, 64], dtype=torch.int32)).shape
    torch.Size([64, 64])
    """

    def __init__(self, recipe: Recipe) -> None:
        super().__init__()
        self.weight_cache: WeightCache | None = WeightCache()
        self.recipe = recipe
        self.quantize_enabled = True
        self.amax_reduction: AmaxReduction | None = None
        self.register_load_state_dict_post_hook(_clear_after_load)

    @property
    def recipe(self) -> Recipe:
        return self._recipe

    @recipe.setter
    def recipe(self, recipe: Recipe) -> None:
        require_recipe(recipe)
        self._recipe = recipe
        if self.weight_cache is not None:
            self.weight_cache.clear()
        # What compiled experts guard on (a str: Dynamo can neither hash a frozen dataclass
        # nor pass one into a nonstrict_trace call); repr names every field.
        self.recipe_key = repr(recipe)

    def forward(
        self,
        input: torch.Tensor,
        weight_t: torch.Tensor,
        offs: torch.Tensor,
        out_dtype: torch.dtype | None = None,
        *,
        weight_source: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if not self.quantize_enabled or not self.recipe.quantized:
            return _autocast_grouped_mm(input, weight_t, offs, out_dtype)
        cache = None if torch.compiler.is_compiling() else self.weight_cache
        return grouped_mm(
            input,
            weight_t,
            offs,
            self.recipe,
            out_dtype=out_dtype,
            weight_cache=cache,
            weight_source=weight_source,
            amax_reduction=self.amax_reduction,
        )

    def extra_repr(self) -> str:
        state = "" if self.quantize_enabled else ", quantize_enabled=False"
        return f"recipe={self.recipe.name}{state}"


def _clear_after_load(module: nn.Module, incompatible_keys: object) -> None:
    if module.weight_cache is not None:
        module.weight_cache.clear()


def experts_weights(module: nn.Module) -> dict[str, nn.Parameter]:
    """The routed-expert weights of `module` by name, or {} if it is not an experts module.

    An experts module holds, directly, floating-point 3D parameters that share one leading
    dim E >= 2 (the experts). That leaves out torch.nn's 3D-weight layers (Conv1d, Bilinear) and
    3D embeddings such as a ViT's [1, N, D] position table.
    """
    if isinstance(module, _NOT_EXPERTS):
        return {}
    weights = {
        name: p
        for name, p in module._parameters.items()
        if p is not None and p.dim() == 3 and p.is_floating_point()
    }
    n_experts = {p.shape[0] for p in weights.values()}
    if len(n_experts) != 1 or n_experts.pop() < 2:
        return {}
    return weights


def is_bmm_experts(module: nn.Module) -> bool:
    """Whether `module` is one of transformers' experts classes that multiply with bmm
    (`BMM_EXPERTS`: Llama 4's), whose weights are stored [E, K, N]."""
    return any(f"{c.__module__}.{c.__qualname__}" in BMM_EXPERTS for c in type(module).__mro__)


def route_grouped_mm(module: nn.Module, recipe: Recipe, names: Iterable[str]) -> nn.Module:
    """Route `module`'s grouped_mm calls on the 3D parameters `names` to `GroupedMM(recipe)`,
    in place; returns module. On an already routed module, sets `recipe` on those names."""
    names = list(names)
    weights = experts_weights(module)
    unknown = [name for name in names if name not in weights]
    if unknown:
        raise ValueError(
            f"{type(module).__name__} has no 3D expert parameters {unknown} "
            f"(its expert weights: {sorted(weights)})"
        )
    if "forward" in module.__dict__:
        raise ValueError(
            f"{type(module).__name__} has an instance-level forward (e.g. an accelerate hook), "
            "which would bypass the routing: convert before adding it"
        )
    grouped_mms = module._modules.get("grouped_mms")
    held = module.__dict__.get("grouped_mms")
    if grouped_mms is None and isinstance(held, nn.ModuleDict):
        # registered elsewhere in the model, the module keeping a plain reference (torchtitan
        # 0.2.2's converter, integrations/titan/v0_2.py: `hold_grouped_mms_at_root`)
        grouped_mms = held
    if grouped_mms is None:
        if hasattr(module, "grouped_mms"):
            raise ValueError(
                f"{type(module).__name__} already has an attribute 'grouped_mms', "
                "the name convert gives its GroupedMM modules"
            )
        grouped_mms = nn.ModuleDict()
        module.add_module("grouped_mms", grouped_mms)
    for name in names:
        if name in grouped_mms:
            grouped_mms[name].recipe = recipe
        else:
            grouped_mms[name] = GroupedMM(recipe)
    if not isinstance(module, _RoutedExperts):
        module._blockscale_experts = _ExpertsForward(module, type(module).forward)
        module.__class__ = _routed_class(type(module))
    return module


class _ExpertsForward:
    """One converted module and its class's own forward: what the compiled graph's opaque call
    receives. A pytree constant (see `_nonstrict_run`) compared by identity, so each module
    has its own guard, and `copy.deepcopy` of a model copies it along with its module.

    It holds its module weakly. Dynamo (torch 2.13) keeps a constant that a nonstrict_trace
    call was guarded on alive after the compiled model is gone, even past
    `torch._dynamo.reset()`, through a reference the garbage collector does not see; held
    strongly, the module and its FP32 expert weights stayed with it, so a process that
    compiled one model after another (bench_moe_model.py's --memory inline) carried every
    earlier model's experts into the next one's peak (issue 35;
    test_compiled_experts_are_freed_with_their_model)."""

    __slots__ = ("_module", "forward")

    def __init__(self, module: nn.Module, forward: Any) -> None:
        self._module = weakref.ref(module)
        self.forward = forward

    @property
    def module(self) -> nn.Module:
        module = self._module()
        if module is None:  # only a leaked copy outlives its module, and nothing calls that
            raise RuntimeError("the converted experts module of this forward was deleted")
        return module

    def __deepcopy__(self, memo: dict) -> _ExpertsForward:
        # deepcopy of a model has registered the module's copy in `memo` before its state
        return _ExpertsForward(copy.deepcopy(self.module, memo), self.forward)

    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)


class _RoutedExperts:
    """Mixin of the generated classes: forward runs the original one under the router.

    Compiled, this forward is what Dynamo traces and nothing inside the opaque call is
    guarded, so the state the call depends on is read here and passed along: a flipped
    `quantize_enabled` (set_precision), a new recipe (its `recipe_key`, the repr of every
    field) or train/eval then
    recompiles instead of replaying a stale graph.
    """

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        state = (
            self.training,
            tuple((g.quantize_enabled, g.recipe_key) for g in self.grouped_mms.values()),
        )
        tensors = dict(self.named_parameters())
        tensors.update(self.named_buffers())
        return self._blockscale_run(self._blockscale_experts, state, tensors, args, kwargs)


@functools.cache
def _routed_class(cls: type[nn.Module]) -> type[nn.Module]:
    return type(
        f"Blockscale{cls.__name__}",
        (_RoutedExperts, cls),
        {"_blockscale_run": staticmethod(_nonstrict_run()), "__module__": __name__},
    )


@functools.cache
def _nonstrict_run() -> Any:
    """`_run_routed` as Dynamo must see it. Built at the first conversion, not on import:
    importing torch._dynamo takes over a second."""
    from torch._dynamo import nonstrict_trace

    pytree.register_constant(_ExpertsForward)
    return nonstrict_trace(_run_routed)


def _run_routed(
    experts: _ExpertsForward,
    state: tuple,
    tensors: dict[str, torch.Tensor],
    args: tuple,
    kwargs: dict,
) -> Any:
    """The original forward with `tensors` bound and grouped_mm routed. `state` is read by the
    caller for Dynamo's guards (see `_RoutedExperts`); the modules hold the same values.

    Where the nonstrict call itself fails to trace, Dynamo breaks the graph and then traces
    this frame as ordinary code, where `torch._grouped_mm` bypasses the router (module
    docstring): the experts would compile unquantized, forward and backward, with no error
    (seen on torch 2.11 before the library ops took the op route under fake tensors). That
    trace is sent to the eager run instead: a graph break, but blockscale's numerics."""
    if torch.compiler.is_dynamo_compiling():
        return _run_routed_eagerly(experts, tensors, args, kwargs)
    return _routed_body(experts, tensors, args, kwargs)


def _routed_body(
    experts: _ExpertsForward, tensors: dict[str, torch.Tensor], args: tuple, kwargs: dict
) -> Any:
    module = experts.module
    with _bound(module, tensors), _GroupedMMRouter(module) as router:
        output = experts.forward(module, *args, **kwargs)
    missing = [name for name in module.grouped_mms if name not in router.routed]
    if missing:
        warnings.warn(
            f"{type(module).__name__}: converted expert weights {missing} were not consumed by "
            "torch._grouped_mm / F.grouped_mm (or a bmm) in this forward, so they ran "
            "unquantized (blockscale routes only grouped_mm calls, and bmm [E, T, K] @ [E, K, N], "
            "on the weight or a tensor computed from it; for transformers models use "
            "experts_implementation='grouped_mm')",
            stacklevel=2,
        )
    return output


_run_routed_eagerly = torch.compiler.disable(_routed_body, recursive=True)


@contextmanager
def _bound(module: nn.Module, tensors: dict[str, torch.Tensor]) -> Iterator[None]:
    """Make `tensors` (by qualified name) the module's parameters and buffers for a while.

    Eagerly they are the module's own and nothing changes; in the compiled graph's call they are
    the traced stand-ins, and reads of `self.<name>` must return those for gradients to flow."""
    swapped = []
    try:
        for fqn, tensor in tensors.items():
            prefix, _, name = fqn.rpartition(".")
            owner = module.get_submodule(prefix)
            slots = owner._parameters if name in owner._parameters else owner._buffers
            if slots[name] is not tensor:
                swapped.append((slots, name, slots[name]))
                slots[name] = tensor
        yield
    finally:
        for slots, name, old in reversed(swapped):
            slots[name] = old


def _grouped_mm_args(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    offs: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[Any, ...]:
    return mat_a, mat_b, offs, bias, out_dtype


def _fallback_args(func: Any, args: tuple, kwargs: dict) -> tuple[Any, ...]:
    """transformers' fallback op's arguments, bound by its registered schema (input, weight,
    offs in every release seen); a fourth tensor argument is returned as the bias, which the
    router refuses."""
    overload = func if isinstance(func, torch._ops.OpOverload) else func.default
    names = [argument.name for argument in overload._schema.arguments]
    bound = dict(zip(names, args)) | kwargs
    input, weight, offs, *rest = (bound.get(name) for name in names)
    bias = next((v for v in rest if isinstance(v, torch.Tensor)), None)
    return input, weight, offs, bias, None


def _bf16_to_fp32(narrow: torch.dtype, wide: torch.dtype) -> bool:
    return narrow == torch.bfloat16 and wide == torch.float32


def _widens(source: Any, out: torch.Tensor) -> bool:
    """Whether `out` is `source`, a BF16 activation, cast to FP32 (the same values)."""
    return (
        isinstance(source, torch.Tensor)
        and _bf16_to_fp32(source.dtype, out.dtype)
        and source.shape == out.shape
        and source.device == out.device
    )


def _is_transformers_fallback(func: Any) -> bool:
    """Whether `func` is transformers' `transformers::grouped_mm_fallback` op (the packet or an
    overload), which its experts call instead of grouped_mm where they judge grouped_mm
    unusable (module docstring, "transformers' fallback op")."""
    if not isinstance(func, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        return False
    packet = getattr(func, "overloadpacket", func)
    return getattr(packet, "_qualified_op_name", None) == TRANSFORMERS_FALLBACK_OP


class _GroupedMMRouter(TorchFunctionMode):
    """Sends grouped_mm calls whose weight was computed from a converted parameter to that
    parameter's GroupedMM, for the duration of one experts forward."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.grouped_mms = module.grouped_mms
        # id -> (parameter name, weak reference, the parameter if only layout and dtype ops
        # led here, else None): the converted parameters and every 3D tensor computed from one
        # in this forward. Weak, so a transient cast copy is freed as usual.
        self.sources: dict[int, tuple[str, weakref.ref, torch.Tensor | None]] = {}
        for name in self.grouped_mms:
            param = getattr(module, name)
            self._track(param, name, param)
        self.routed: set[str] = set()
        # id -> (weak reference to an FP32 cast of a BF16 activation, that activation)
        self.widened: dict[int, tuple[weakref.ref, torch.Tensor]] = {}

    def _track(self, tensor: torch.Tensor, name: str, param: torch.Tensor | None) -> None:
        self.sources[id(tensor)] = (name, weakref.ref(tensor), param)

    def _source(self, obj: Any) -> tuple[str, torch.Tensor | None] | None:
        entry = self.sources.get(id(obj))
        if entry is None or entry[1]() is not obj:
            return None
        return entry[0], entry[2]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in GROUPED_MM_FUNCTIONS:
            return self._grouped_mm(func, args, kwargs)
        if func in BATCHED_MM_FUNCTIONS:
            out = self._batched_mm(func, args, kwargs)
            if out is not None:
                return out
        if _is_transformers_fallback(func):
            return self._grouped_mm(func, args, kwargs, fallback=True)
        out = func(*args, **kwargs)
        if args and isinstance(out, torch.Tensor) and out.dim() == 3:
            source = self._source(args[0])
            if source is not None:
                name, param = source
                self._track(out, name, param if func in _LAYOUT_AND_DTYPE_OPS else None)
        elif func in _CASTS and isinstance(out, torch.Tensor) and _widens(args[0], out):
            self.widened[id(out)] = (weakref.ref(out), args[0])
        return out

    def _batched_mm(self, func: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
        """input [E, T, K] @ weight [E, K, N], the weight computed from a converted parameter,
        as the grouped GEMM of E groups of T tokens (module docstring, "Batched matmuls");
        None for any other call, which then runs as it is."""
        if len(args) != 2 or kwargs:
            return None
        input, weight = args
        source = self._source(weight)
        if (
            source is None
            or not isinstance(input, torch.Tensor)
            or input.dim() != 3
            or weight.dim() != 3
            or input.shape[0] != weight.shape[0]
            or input.shape[2] != weight.shape[1]
        ):
            return None
        name, param = source
        gmm = self.grouped_mms[name]
        self.routed.add(name)
        if not gmm.quantize_enabled or not gmm.recipe.quantized:
            return func(*args)  # the model's own product, as unconverted
        experts, tokens, k = input.shape
        # under autocast, the values autocast's bmm computes on, as `linear` takes them
        input = input.to(quantized_input_dtype(input, output_dtype(input)))
        offs = torch.arange(1, experts + 1, device=input.device, dtype=torch.int32) * tokens
        out = gmm(input.reshape(experts * tokens, k), weight, offs, weight_source=param)
        return unaliased(out, (experts, tokens, out.shape[-1]))  # bmm's is no view either

    def _narrow(self, input: torch.Tensor) -> torch.Tensor | None:
        """The BF16 activation `input` was widened from in this forward, or None. Let go of
        once taken, so the router keeps no activation alive past its grouped GEMM."""
        entry = self.widened.pop(id(input), None)
        return entry[1] if entry is not None and entry[0]() is input else None

    def _grouped_mm(
        self, func: Any, args: tuple, kwargs: dict, fallback: bool = False
    ) -> torch.Tensor:
        if fallback:
            input, weight_t, offs, bias, out_dtype = _fallback_args(func, args, kwargs)
        else:
            input, weight_t, offs, bias, out_dtype = _grouped_mm_args(*args, **kwargs)
        source = self._source(weight_t)
        if source is None:
            return func(*args, **kwargs)
        name, param = source
        gmm = self.grouped_mms[name]
        narrow = None
        if gmm.quantize_enabled and gmm.recipe.quantized and input.dim() == 2:
            # Quantize the BF16 activation rather than its FP32 cast (module docstring,
            # "Widened inputs"): the same values, so the same bits, in half the bytes.
            narrow = self._narrow(input)
            if narrow is None and fallback and _bf16_to_fp32(input.dtype, weight_t.dtype):
                narrow = input  # the fallback op's uncast input, which it would cast
        if narrow is not None:
            if out_dtype is None:  # what the call on the FP32 input would have returned
                out_dtype = output_dtype(weight_t if fallback else input)
            input = narrow
        elif fallback:
            # as transformers' grouped_mm path casts it (some releases call the fallback op
            # on the input uncast), so a compiled step makes eager's call
            input = input.to(weight_t.dtype)
        if input.dim() != 2 or offs is None or bias is not None:
            raise ValueError(
                f"grouped_mm on the converted expert weight {name!r} must be input [M, K] @ "
                f"weight_t [E, K, N] with offs and no bias; got input {tuple(input.shape)}, "
                f"offs={'None' if offs is None else 'given'}, "
                f"bias={'None' if bias is None else 'given'}"
            )
        self.routed.add(name)
        if out_dtype is None:
            return self.grouped_mms[name](input, weight_t, offs, weight_source=param)
        return self.grouped_mms[name](
            input, weight_t, offs, out_dtype=out_dtype, weight_source=param
        )


def _autocast_grouped_mm(
    input: torch.Tensor,
    weight_t: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """An unquantized grouped GEMM as autocast would run a matmul: under autocast, on both
    operands cast to the autocast dtype (the result then in `out_dtype`, if given), else in
    their own dtype. `torch._grouped_mm` is not an autocast op, so a model's own call on FP32
    master weights multiplies in FP32: for the BF16 tail block that `layer_policy` keeps, the
    README's Qwen3-30B-A3B-like MoE compiled ran nvfp4 at 0.44x BF16 (H200, 2026-12-05), where
    the quantized blocks' GEMMs and every BF16 baseline run on BF16 tensor cores."""
    device = input.device.type
    if device == "meta" or not torch.is_autocast_enabled(device):
        return _unquantized_grouped_mm(input, weight_t, offs, out_dtype)
    dtype = torch.get_autocast_dtype(device)
    out = _unquantized_grouped_mm(input.to(dtype), weight_t.to(dtype), offs)
    return out if out_dtype is None else out.to(out_dtype)


def _unquantized_grouped_mm(
    input: torch.Tensor,
    weight_t: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`torch._grouped_mm`, also where a trace cannot take it: its fake impl accepts only BF16,
    so an unquantized grouped GEMM on FP32 expert weights (set_precision off, or the bf16
    recipe, on FP32 masters) runs `_high_precision_grouped_mm` under a trace."""
    if _registry.tracing() and not input.dtype == weight_t.dtype == torch.bfloat16:
        return _high_precision_grouped_mm(input, weight_t, offs, out_dtype)
    return torch._grouped_mm(input, weight_t, offs=offs, out_dtype=out_dtype)


def _high_precision_grouped_mm(
    input: torch.Tensor,
    weight_t: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """One opaque op whose forward and backward run eager's `torch._grouped_mm` calls, in any
    dtype, so compiled gives eager's bits."""
    return _high_precision_forward(input, weight_t, offs, out_dtype)


@torch.library.custom_op("blockscale::grouped_mm_high_precision", mutates_args=())
def _high_precision_forward(
    input: torch.Tensor,
    weight_t: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    return torch._grouped_mm(input, weight_t, offs=offs, out_dtype=out_dtype)


@_high_precision_forward.register_fake
def _(input, weight_t, offs, out_dtype=None):
    return input.new_empty(input.shape[0], weight_t.shape[-1], dtype=out_dtype or input.dtype)


@torch.library.custom_op("blockscale::grouped_mm_high_precision_backward", mutates_args=())
def _high_precision_backward(
    input: torch.Tensor, weight_t: torch.Tensor, offs: torch.Tensor, grad_output: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    # what autograd runs for torch._grouped_mm (the same bits: tested against it)
    grad_output = grad_output.to(input.dtype)
    grad_input = torch._grouped_mm(grad_output, weight_t.transpose(-2, -1), offs=offs)
    return grad_input, torch._grouped_mm(input.t(), grad_output, offs=offs)


@_high_precision_backward.register_fake
def _(input, weight_t, offs, grad_output):
    return torch.empty_like(input), weight_t.new_empty(weight_t.shape)


def _high_precision_setup_context(ctx, inputs, output):
    input, weight_t, offs, _ = inputs
    ctx.save_for_backward(input, weight_t, offs)


def _high_precision_grads(ctx, grad_output):
    input, weight_t, offs = ctx.saved_tensors
    grad_input, grad_weight_t = _high_precision_backward(input, weight_t, offs, grad_output)
    return grad_input, grad_weight_t, None, None


_high_precision_forward.register_autograd(
    _high_precision_grads, setup_context=_high_precision_setup_context
)
