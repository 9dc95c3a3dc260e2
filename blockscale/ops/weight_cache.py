"""The quantized forms of a weight, made once per optimizer step and reused until it changes.

A weight changes once per optimizer step, but a linear layer quantizes it in every forward and
again in the backward (ops/linear.py, "Memory"), and grad accumulation multiplies both by the
micro-batches. A `WeightCache`, one per converted weight (held by `blockscale.nn.Linear` and by
each `GroupedMM`), keeps the copies a step makes of its weight: the forward's (along K) and,
for recipes whose dgrad copy is not the 16x16 forward copy transposed, the copy along N. The
first use after the weight changes makes a copy, as before; every later forward, backward and
micro-batch takes it from the cache (once the cache keeps copies: "When copies are kept"
below). The bits are those of the uncached path: a copy is made by
the same call, from the same tensor, with round-to-nearest only (a stochastic weight config is
never cached: each use draws its own noise).

What a copy is valid for (its stamp): the weight's source tensor (the parameter: the weight
itself, the tensor it is a view of, or, for experts, the parameter the router followed it
from), the source's version counter, storage address, dtype, device, shape and strides, and
the weight's own dtype, shape and strides. A mismatch drops every copy the cache holds. That
catches an in-place edit (`p.mul_(2)` under no_grad), foreach and per-tensor optimizers (they
bump the counter), `load_state_dict` (copy_), and a dtype or device move (`model.bfloat16()`
assigns `p.data`, which keeps the counter but not the storage or dtype).

What the version counter misses, and what catches it instead:
- torch's fused optimizers (`_fused_adamw_`, `_fused_adam_`, `_fused_sgd_`) write the
  parameters without bumping their counters (measured, CPU, torch 2.11 and 2.13), and neither
  do writes through `p.data`. Every `torch.optim.Optimizer.step` therefore clears every cache
  first (a global optimizer step pre-hook, registered when the first cache is made), which
  also frees the copies before the step allocates its own temporaries.
- FSDP2 writes each all-gather into the unsharded parameter with its counter preserved; its
  sharded parameters change only through the optimizer (cleared above) or a checkpoint load.
  `load_state_dict` clears the caches of the modules it loads into (a post hook on the
  modules); a load that bypasses it (`torch.distributed.checkpoint.load` into an FSDP2
  model's state dict, or a `p.data` write by hand) must be followed by
  `blockscale.nn.clear_weight_cache(model)`.

Where the cache does not apply (the weight is quantized as before): under torch.compile or any
trace (a compiled graph computes its quantizations; Python state cannot enter it), in
`torch.inference_mode()` (inference tensors could not be saved for a later backward), for a
weight that arrives quantized or is any tensor subclass (FSDP2's quantized all-gather,
primary weights, DTensor), for a tensor-parallel weight shard (its amax is reduced over ranks
in each forward), and for a weight computed in the forward from something the cache cannot
follow to a parameter. Under FSDP2's quantized all-gather the layer's cache holds something
else instead: its shard's all-gather inputs and amax (distributed/fsdp.py), stamped by the
FP32 shard, so the backward's re-gather and later micro-batches do not quantize it again.

When copies are kept (`from_first_use`). A cache saves work only where a step would make the
same copy twice: a second micro-batch, a backward that uses the forward's copy (NVFP4's 16x16
weight), an activation-checkpointing recomputation. With one micro-batch a step and two copies
(MXFP8: the forward's along K, dgrad's along N), every copy is made once, so keeping them
saves nothing and holds them across the backward and to the optimizer step: on the H200, a
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
import weakref
from collections.abc import Callable
from typing import Any

import torch

from blockscale._registry import tracing

# Whether a new cache also keeps the `_dq` operands (docs/KERNELS.md, "Weight cache": packed
# only by default, since the BF16 copies would add 2 bytes per weight value to the peak).
DEFAULT_KEEP_DQ = False
# Whether a new cache keeps copies from their first use, or only once a step has made one of
# them twice (module docstring, "When copies are kept").
DEFAULT_FROM_FIRST_USE = False

# Every live cache, so that an optimizer step can clear them all.
_LIVE: weakref.WeakSet[WeightCache] = weakref.WeakSet()
_HOOK: list[Any] = []


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
        self, keep_dq: bool = DEFAULT_KEEP_DQ, from_first_use: bool = DEFAULT_FROM_FIRST_USE
    ) -> None:
        self.keep_dq = keep_dq
        self.from_first_use = from_first_use
        self.reused = False  # a copy was made twice under one stamp, in training
        self._stamp: Stamp | None = None
        self._copies: dict[tuple, Any] = {}
        self._made: set[tuple] = set()  # keys made and not kept under `_stamp`
        _LIVE.add(self)
        _register_optimizer_hook()

    def __deepcopy__(self, memo: dict) -> WeightCache:
        # a copied model's weights are other tensors; what was learned of its steps holds
        copied = WeightCache(self.keep_dq, self.from_first_use)
        copied.reused = self.reused
        return copied

    def __reduce__(self) -> tuple:
        return WeightCache, (self.keep_dq, self.from_first_use)

    def __repr__(self) -> str:
        return (
            f"WeightCache(keep_dq={self.keep_dq}, from_first_use={self.from_first_use}, "
            f"reused={self.reused}, copies={len(self._copies)})"
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
        if source is None:
            source = weight if weight._base is None else weight._base
            if source.grad_fn is not None:  # computed in the forward: nothing to key it by
                return None
        if not _plain(source) or source.is_inference():
            return None
        key = (
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
