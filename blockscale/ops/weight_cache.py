"""The quantized forms of a weight, made once and reused while nothing can have changed it.

A linear layer quantizes its weight in every forward and again in the backward (ops/linear.py,
"Memory"), and a layer called twice in a forward, activation checkpointing's recomputation
and grad accumulation's micro-batches multiply that. A `WeightCache`, one per converted
weight (held by `blockscale.nn.Linear` and by each `GroupedMM`), keeps the copies of its
weight: the forward's (along K) and, for recipes whose dgrad copy is not the 16x16 forward
copy transposed, the copy along N. The bits are those of the uncached path: a copy is made by
the same call, from the same tensor, with round-to-nearest only (a stochastic weight config is
never cached: each use draws its own noise).

How long a copy is valid (`scope`). A cache must never serve a copy of values the weight no
longer holds, and users change weights in ways nothing in torch reports: a write through
`p.data` (the update of hand-written loops and of optimizers outside torch.optim), numpy
memory shared with the weight, a dtype round trip that gives the storage back at its old
address. No cheap check sees those (the version counter does not move; comparing the values
would read the weight, which is most of what quantizing it costs). So the default scope,
"forward", bounds reuse instead: a copy is reused only within the forward scope that made it
and in the backwards that follow it, up to the next forward scope; between two calls of the
model anything may change, and the next call quantizes again. Within one forward no user
code runs between the layers, so nothing can change a weight there (a model whose own
forward writes its weights through `.data` is outside this promise); the backward uses the
copy its forward computed with, as a saved tensor would.

- Forward scopes. Each call of a model that `convert` converted is one scope (forward hooks on
  the model: `scope_forwards`); a `linear` or `grouped_mm` called outside any scope is a
  scope of its own. Opening a scope where none is open and no backward runs starts a new
  epoch (a process-wide counter), and a copy's stamp holds its epoch. A backward (its
  hooks, FSDP2's re-gather, activation checkpointing's recomputation) runs in the latest
  epoch. Outside a scope and a backward nothing is cached.
- "step" (`set_weight_cache(model, True, scope="step")`): copies are also reused by later
  forwards (grad accumulation's micro-batches, an evaluation) until the next
  `torch.optim.Optimizer.step`. Only for loops in which the weights change through a
  torch.optim optimizer, `load_state_dict` or in-place ops on the parameters themselves; the
  CLI's loop is one and sets it (blockscale/train/build.py).

What a copy is valid for (its stamp): the epoch (scope "forward"), the weight's source tensor
(the parameter: the weight itself, the tensor it is a view of, or, for experts, the parameter
the router followed it from), the source's version counter, storage address, dtype, device,
shape and strides, and the weight's own dtype, shape and strides. A mismatch drops every copy
the cache holds. That catches, within a scope and under "step", an in-place edit (`p.mul_(2)`
under no_grad), foreach and per-tensor optimizers (they bump the counter), `load_state_dict`
(copy_), and a dtype or device move. torch's fused optimizers (`_fused_adamw_`, ...) write
the parameters without bumping their counters (measured, CPU, torch 2.11 and 2.13), so every
`torch.optim.Optimizer.step` clears every cache first (a global optimizer step pre-hook,
registered when the first cache is made), which also frees the copies before the step
allocates its own temporaries; `load_state_dict` clears the caches of the modules it loads
into (a post hook). Under "step", a change none of these shows (`p.data`, a checkpoint loaded
into an FSDP2 model's shards without `load_state_dict`) must be followed by
`blockscale.nn.clear_weight_cache(model)`; under "forward" the next call is enough.

Where the cache does not apply (the weight is quantized as before): under torch.compile or any
trace (a compiled graph computes its quantizations; Python state cannot enter it), in
`torch.inference_mode()` (inference tensors could not be saved for a later backward), for a
weight that arrives quantized or is any tensor subclass (FSDP2's quantized all-gather,
primary weights, DTensor), for a tensor-parallel weight shard (its amax is reduced over ranks
in each forward), and for a weight computed in the forward from something the cache cannot
follow to a parameter. Under FSDP2's quantized all-gather the layer's cache holds something
else instead: its shard's all-gather inputs and amax (distributed/fsdp.py), stamped by the
FP32 shard, so the backward's re-gather (and, under "step", later micro-batches) does not
quantize it again.

When copies are kept (`from_first_use`). A cache saves work only where a step would make the
same copy twice: a second micro-batch, a backward that uses the forward's copy (NVFP4's 16x16
weight), an activation-checkpointing recomputation. With one micro-batch a step and two copies
(MXFP8: the forward's along K, dgrad's along N), every copy is made once, so keeping them
saves nothing and holds them across the backward and to the next forward: on the H200, a
transformers Mixtral-like layer trained eager with mxfp8 peaked 1.85 GiB higher with the copies
kept from their first use (1.04x BF16's peak instead of 0.99x) at the same step time
(docs/KERNELS.md, "Weight cache"). So by default (`from_first_use=False`) a cache keeps
nothing until it sees one of its weight's copies made a second time under one stamp in
training; from then on (`reused`, which stays set) it keeps every copy from its first use,
as with `from_first_use=True`. The first step with grad accumulation thus makes its copies
twice, once; later steps make each once. Forwards without grad (an evaluation under
`torch.no_grad()`) read the cache but neither set `reused` nor keep copies: evaluating every
N steps must not raise the training step's peak. The bits are the same either way.

Memory (docs/KERNELS.md, "Weight cache"): a cache that keeps copies holds the packed codes and
scales of each, 0.5625 bytes per weight value for NVFP4 and 1.03 for MXFP8, between the first
use and the next optimizer step; with `keep_dq=True` also each copy's BF16 `_dq` operand (2
bytes per value) where the kernels make one, so no use dequantizes again.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from blockscale._registry import tracing
from blockscale.recipes import require_bool

# Whether a new cache also keeps the `_dq` operands (docs/KERNELS.md, "Weight cache": packed
# only by default, since the BF16 copies would add 2 bytes per weight value to the peak).
DEFAULT_KEEP_DQ = False
# Whether a new cache keeps copies from their first use, or only once a step has made one of
# them twice (module docstring, "When copies are kept").
DEFAULT_FROM_FIRST_USE = False

# How long a new cache's copies may be reused (module docstring, "How long a copy is valid").
SCOPES = ("forward", "step")
DEFAULT_SCOPE = "forward"

# Every live cache, so that an optimizer step can clear them all.
_LIVE: weakref.WeakSet[WeightCache] = weakref.WeakSet()
_HOOK: list[Any] = []


class _Forwards(threading.local):
    """How many forward scopes this thread is inside (module docstring, "Forward scopes")."""

    depth = 0


_FORWARDS = _Forwards()
# The number of the latest forward scope opened in the process: the `epoch` of every copy
# made in it. One counter for all threads: another thread's forward only ends reuse sooner.
_EPOCH = [0]


def _in_backward() -> bool:
    """Whether this thread is running an autograd backward (its hooks and recomputations)."""
    return torch._C._current_graph_task_id() != -1


def enter_forward() -> None:
    """Open a forward scope (module docstring, "Forward scopes"): where none is open and no
    backward runs, this starts a new epoch, so that nothing made before it is reused in it.
    Pair with `exit_forward`. A no-op under a trace."""
    if tracing():
        return
    if _FORWARDS.depth == 0 and not _in_backward():
        _EPOCH[0] += 1
    _FORWARDS.depth += 1


def exit_forward() -> None:
    if tracing():
        return
    _FORWARDS.depth = max(0, _FORWARDS.depth - 1)


def forward_epoch() -> int | None:
    """The epoch whose copies may be reused now: the open forward scope's, or in a backward the
    latest one's (its forward's, or a later forward's, whose copies a recomputation may then
    reuse); None outside both, where nothing may be reused."""
    if _FORWARDS.depth > 0 or _in_backward():
        return _EPOCH[0]
    return None


def _enter_hook(module: nn.Module, args: Any) -> None:
    if not torch.compiler.is_compiling():
        enter_forward()


def _exit_hook(module: nn.Module, args: Any, output: Any) -> None:
    if not torch.compiler.is_compiling():
        exit_forward()


def scope_forwards(model: nn.Module) -> nn.Module:
    """Make each call of `model` one forward scope, so that its layers share within the call
    what they may share (a weight read by two layers, an input quantized for q, k and v) and
    nothing past it (module docstring, "Forward scopes"); `convert` does this for the model
    it converts. Registered once per module (a copy carries its hooks); returns model."""
    if not getattr(model, "_blockscale_forward_scope", False):
        model.register_forward_pre_hook(_enter_hook, prepend=True)
        model.register_forward_hook(_exit_hook, always_call=True)
        model._blockscale_forward_scope = True
    return model


@dataclasses.dataclass(frozen=True, eq=False)
class Stamp:
    """What a cached copy is valid for: the source tensor (weakly) and its metadata.
    `training`: grad was enabled where the stamp was taken (a forward that trains, or its
    backward); not part of what the copy is valid for."""

    source: weakref.ref
    key: tuple
    training: bool = True

    def matches(self, other: Stamp | None) -> bool:
        if other is None or self.key != other.key:
            return False
        source = self.source()
        return source is not None and source is other.source()


def _plain(t: torch.Tensor) -> bool:
    return type(t) in (torch.Tensor, torch.nn.Parameter)


def _layout(t: torch.Tensor) -> tuple:
    return (t.dtype, t.device, tuple(t.shape), t.stride())


class WeightCache:
    """The quantized copies of one weight, valid while the weight is unchanged (module
    docstring). `keep_dq`: keep each copy's BF16 `_dq` GEMM operand too (else it is made
    again by the dequantize kernel at each use, from the cached packed copy).
    `from_first_use`: keep every copy from its first use; else only once a step has made one
    of them twice (`reused`; module docstring, "When copies are kept")."""

    def __init__(
        self,
        keep_dq: bool = DEFAULT_KEEP_DQ,
        from_first_use: bool = DEFAULT_FROM_FIRST_USE,
        scope: str = DEFAULT_SCOPE,
    ) -> None:
        self.keep_dq = require_bool("keep_dq", keep_dq)
        self.from_first_use = require_bool("from_first_use", from_first_use)
        if scope not in SCOPES:
            raise ValueError(f"scope={scope!r} is not one of {SCOPES}")
        self.scope = scope
        self.reused = False  # a copy was made twice under one stamp, in training
        self._stamp: Stamp | None = None
        self._copies: dict[tuple, Any] = {}
        self._made: set[tuple] = set()  # keys made and not kept under `_stamp`
        _LIVE.add(self)
        _register_optimizer_hook()

    def __deepcopy__(self, memo: dict) -> WeightCache:
        # a copied model's weights are other tensors; what was learned of its steps holds
        copied = WeightCache(self.keep_dq, self.from_first_use, self.scope)
        copied.reused = self.reused
        return copied

    def __reduce__(self) -> tuple:
        return WeightCache, (self.keep_dq, self.from_first_use, self.scope)

    def __repr__(self) -> str:
        return (
            f"WeightCache(keep_dq={self.keep_dq}, from_first_use={self.from_first_use}, "
            f"scope={self.scope!r}, reused={self.reused}, copies={len(self._copies)})"
        )

    def clear(self) -> None:
        self._stamp = None
        self._copies = {}
        self._made = set()

    @property
    def keeps(self) -> bool:
        """Whether a copy made now is kept from its first use."""
        return self.from_first_use or self.reused

    def __len__(self) -> int:
        return len(self._copies)

    def held_bytes(self) -> int:
        """Bytes of the tensors the cached copies hold (codes, scales, amaxes, `_dq`; one
        tensor two copies share, such as an amax, counted once)."""
        seen: dict[tuple, int] = {}
        for op in self._copies.values():
            for t in _tensors(op):
                seen[(t.data_ptr(), t.shape)] = t.numel() * t.element_size()
        return sum(seen.values())

    def stamp(self, weight: torch.Tensor, source: torch.Tensor | None = None) -> Stamp | None:
        """The stamp of `weight`'s copies, or None where the cache must not apply (module
        docstring). `source`: the parameter `weight` was computed from by layout and dtype
        ops only (the experts router tells); None: `weight` itself or the leaf it views."""
        if tracing() or torch.is_inference_mode_enabled() or not _plain(weight):
            return None
        epoch = forward_epoch() if self.scope == "forward" else -1
        if epoch is None:  # outside every forward scope and backward: nothing bounds reuse
            return None
        if source is None:
            source = weight if weight._base is None else weight._base
            if source.grad_fn is not None:  # computed in the forward: nothing to key it by
                return None
        if not _plain(source) or source.is_inference():
            return None
        key = (
            epoch,
            source._version,
            source.data_ptr(),
            *_layout(source),
            *_layout(weight),
            weight.storage_offset() - source.storage_offset() if weight._base is source else 0,
        )
        return Stamp(weakref.ref(source), key, torch.is_grad_enabled())

    def get(self, stamp: Stamp | None, key: tuple) -> Any:
        """The copy `key` made under `stamp`, or None."""
        if stamp is None or not stamp.matches(self._stamp):
            return None
        return self._copies.get(key)

    def fetch(
        self,
        stamp: Stamp | None,
        key: tuple,
        make: Callable[[bool], Any],
        dq: bool,
        renew: bool = True,
    ) -> Any:
        """The copy `key` of the weight `stamp` describes: cached, or `make(dq)` (offered to
        `keep`). `dq`: the caller feeds a GEMM now, so the copy needs its `_dq` (made in the
        same pass when it is new; rebuilt from the packed copy on demand otherwise).
        `renew=False` (a backward, whose stamp is its forward's): keep only while the cache
        still holds that stamp; once cleared (an optimizer step since), the weight may have
        changed without a trace in the stamp (a fused optimizer), so nothing is kept under
        it."""
        if stamp is None:
            return make(dq)
        found = self.get(stamp, key)
        if found is None:
            found = make(dq or self.keep_dq)
            if renew or stamp.matches(self._stamp):
                self.keep(stamp, key, found)
        return found

    def keep(self, stamp: Stamp, key: tuple, op: Any) -> None:
        """Offer `op`, just made, as copy `key` under `stamp`: kept (`put`) if the cache keeps
        copies from their first use (`keeps`), or if this is the second time a step in
        training made it (which sets `reused`)."""
        self._renew(stamp)
        if not self.keeps:
            if not stamp.training:
                return
            if key not in self._made:
                self._made.add(key)
                return
            self.reused = True
        self.put(stamp, key, op)

    def put(self, stamp: Stamp, key: tuple, op: Any) -> None:
        """Keep `op` as copy `key` under `stamp`, whatever `keeps` says (what FSDP2's
        all-gather keeps for its re-gather, distributed/fsdp.py)."""
        self._renew(stamp)
        self._copies[key] = op if self.keep_dq else _packed(op)

    def _renew(self, stamp: Stamp) -> None:
        """A new stamp drops the old copies (and what was made under the old one)."""
        if not stamp.matches(self._stamp):
            self._stamp, self._copies, self._made = stamp, {}, set()


def _packed(op: Any) -> Any:
    """`op` without the `_dq` operand the kernels attached to it (ops/quantize.py)."""
    if getattr(op, "dq_bf16", None) is None:
        return op
    return dataclasses.replace(op, dq_bf16=None)


def _tensors(op: Any) -> list[torch.Tensor]:
    found = []
    for v in vars(op).values():
        for t in v if isinstance(v, (tuple, list)) else (v,):
            if isinstance(t, torch.Tensor):
                found.append(t)
    return found


def clear_all() -> None:
    """Drop the copies of every cache in the process."""
    for cache in list(_LIVE):
        cache.clear()


@torch.compiler.disable
def _before_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    clear_all()


def _register_optimizer_hook() -> None:
    if not _HOOK:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _HOOK.append(register_optimizer_step_pre_hook(_before_optimizer_step))
