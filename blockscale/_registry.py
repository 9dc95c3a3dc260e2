"""Registering blockscale's operators with torch.library without paying for it in eager mode.

This module imports nothing of blockscale. kernels/ registers its ops here (`library_op`), and
_library.py, which says where the kernels run, imports kernels/: the imports run one way
(_library -> kernels -> _registry), with no circle (tests/test_import_layers.py).

`library_op(name, mutates_args, triton=...)` registers a function as the op
`torch.ops.blockscale.<name>` and returns a caller that picks, per call:

- under torch.compile (Dynamo tracing), the registered op: the graph holds one opaque op, so
  Inductor neither retraces its numerics nor drops it, and the compiled step runs the very
  kernels eager runs (same bits, no Inductor options needed for them);
- in eager mode, the function itself, with `wrap_triton` switched to launching the kernel
  directly (what triton_op's own eager path does): the dispatcher's per-call cost is skipped,
  which matters because a linear step makes a dozen of these calls and small layers are
  launch-bound (host costs per call are measured by benchmarks/research/launch_overhead.py).

The op is defined with torch.library's low-level API (`Library.define` + one
CompositeExplicitAutograd kernel + a fake impl), not with `custom_op` / `triton_op`. Those put
Python wrappers in every dispatch (an Autograd kernel that redispatches, a backend wrapper with
aliasing checks, an ADInplaceOrView kernel for ops that write an argument): measured on an H100
host, 20-40 us more per call than the lean op (52.8 against 35.8 us for amax_2d, 102 against
71 us for nvfp4_quantize_2d), and a compiled 1B Llama step makes ~900 such calls. Autograd
never reaches these ops: eager calls the function, and compiled graphs call the op inside the
autograd Functions' forward and backward. Triton-backed functions are also registered as a
`triton_op` under `blockscale_inline::<name>`, used only when INLINE_TRITON_KERNELS asks for
torch's decomposition (below).

Both run the same code on the same tensors, so the results are the same bits.
The registered op stays reachable as `caller.op` (a RegisteredOp) and as
`torch.ops.blockscale.<name>`.

Opaque under compile, not inlined. A plain `triton_op` is decomposed by AOTAutograd into its
`wrap_triton` kernel calls, so that Inductor can schedule them itself. That costs compile time
in proportion to the number of calls, not of distinct kernels: each traced call has the
kernel's Triton IR generated and walked to find what it writes (torch's
`identify_accessed_tensors`, uncached), once in functionalization and again in Inductor's
lowering, which then emits and compiles each call site as a user-defined kernel. Measured on a
CPU host for transformers' Llama at the 1B shape (16 blocks, 98 NVFP4 linears under the layer
policy), Dynamo + AOTAutograd alone took 100 s inlined (1,176 such analyses: 63 s) against
29 s opaque and 5 s for BF16; an H100 compile of that model did not finish in 8 minutes.
Inductor has nothing to gain in exchange: our kernels write fresh outputs and nothing around
them fuses into them. So the ops compiled graphs hold are plain ops, which functionalization
keeps whole; Inductor calls each as an extern kernel, whose launch is the eager one plus a
dispatcher call. `INLINE_TRITON_KERNELS = True` (read at trace time) makes traces call the
`blockscale_inline` triton_ops instead, which torch decomposes; for comparisons, e.g.
`benchmarks/bench_model.py --inline-triton`.

Input layouts (`any_strides`). A custom op without a layout tag gets torch's default
`needs_exact_strides`: Inductor hands each extern call its input at the traced strides, and
where that input is a pointwise node not yet stored, it stores a copy for that call alone
(`ExternKernel.require_strides` -> `copy_input`); a one-read node is not stored before its
users (`realize_hint`), so two extern ops reading it got a copy each. NVFP4 is that pattern:
the amax op and then the quantize op read the same activation (compiled llama-1b: the
backward's cast of the FP32 residual gradient to o_proj's and down_proj's BF16 grad_output,
written twice, 2.4 ms a step on an H100). Their kernels take strides, so these ops (dense and
grouped) are tagged `flexible_layout`: Inductor stores the node once and both read it. The
tag lets through whatever layout Inductor picks for a node it stores, so the producer must
lay it out well: a cast of a transposed view is stored transposed (models/moe.py casts its
expert weights before it transposes them for this). Tests:
`test_kernel_path_stores_an_activation_the_amax_and_quantize_ops_share_once`,
`test_kernel_path_moe_layer_reads_each_grouped_input_once_row_major`; figures in docs/LOG.md
(2026-11-26).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch

try:  # private: the switch triton_op's own eager path uses; without it, eager uses the op
    from torch._library import triton as _torch_triton
    from torch._library.triton import set_wrap_triton_enabled
except ImportError:  # pragma: no cover - depends on the torch version
    _torch_triton = None
    set_wrap_triton_enabled = None

# The thread-local flag `set_wrap_triton_enabled` sets, where this torch keeps it as that
# function does (`wrap_triton_enabled.value`, default True): an eager call sets and restores
# it directly, without building a context manager each time (see `call` below).
_WRAP_FLAG = getattr(_torch_triton, "wrap_triton_enabled", None)
_WRAP_DEFAULT = getattr(_torch_triton, "wrap_triton_enabled_default", True)

# False: Triton-backed ops stay single opaque ops in compiled graphs (see the module docstring).
# Read when a trace reaches the op.
INLINE_TRITON_KERNELS = False


def _with_constants(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` run with the real tensors it hands its kernels itself (the cached Hadamard matrix:
    kernels/_common.py builds it real on purpose, outside any mode) let through as constants.
    Triton-backed ops run their own function as their fake impl (what triton_op registers);
    there, without this, the kernel launch under FakeTensorMode rejects them on torch 2.13
    ("Please convert all Tensors to FakeTensors first"), and Dynamo cannot trace a converted
    model's Hadamard quantizations at all."""
    from torch._subclasses.fake_tensor import fake_tensor_tls  # noqa: PLC0415

    def run(*args: Any, **kwargs: Any) -> Any:
        saved = getattr(fake_tensor_tls, "allow_non_fake_inputs_override", None)
        fake_tensor_tls.allow_non_fake_inputs_override = True
        try:
            return fn(*args, **kwargs)
        finally:
            fake_tensor_tls.allow_non_fake_inputs_override = saved

    return run


class _Eager(threading.local):
    on = False


_EAGER = _Eager()


def in_eager_call() -> bool:
    """Whether this thread is inside an eager call of a Triton-backed op (`call` below), as
    opposed to the registered op run by a compiled graph, where the graph's memory and
    streams are its own (CUDA-graph trees warm up and replay it from a private pool)."""
    return _EAGER.on


_FAKE = torch._C._TorchDispatchModeKey.FAKE
_FUNCTIONAL = torch._C._TorchDispatchModeKey.FUNCTIONAL
_PROXY = torch._C._TorchDispatchModeKey.PROXY


def tracing() -> bool:
    """Whether a call must go through the registered op rather than launch its kernel: under
    Dynamo, and also where a trace runs our code with fake tensors outside Dynamo's frame (the
    converted experts' `nonstrict_trace` call runs its body under FakeTensorMode, where
    `is_compiling()` is False and a direct launch fails: "Cannot access data pointer of
    Tensor"). One C lookup per mode, no Python walk over the arguments."""
    if torch.compiler.is_compiling():
        return True
    mode = torch._C._get_dispatch_mode
    return mode(_FAKE) is not None or mode(_FUNCTIONAL) is not None or mode(_PROXY) is not None


# The Library objects that hold the lean ops' registrations (they unregister when collected).
_LIBRARIES: dict[str, torch.library.Library] = {}
INLINE_NAMESPACE = "blockscale_inline"


class RegisteredOp:
    """What `library_op` registered for one function: `lean`, the op compiled graphs call
    (`torch.ops.blockscale.<name>`), and for Triton-backed functions `inline`, the triton_op
    that INLINE_TRITON_KERNELS traces instead (`torch.ops.blockscale_inline.<name>`).
    `register_fake` sets the fake impl of both (it may be set again: the last one counts)."""

    def __init__(self, lean: Any, inline: Any, fake: Callable[..., Any] | None) -> None:
        self.lean = lean
        self.inline = inline
        self.fake = fake

    def register_fake(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        self.fake = fn
        if self.inline is not None:
            self.inline.register_fake(fn)
        return fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.inline is not None and INLINE_TRITON_KERNELS:
            return self.inline(*args, **kwargs)
        return self.lean(*args, **kwargs)


def _define_lean(
    name: str,
    fn: Callable[..., Any],
    mutates_args: tuple[str, ...],
    kernel: Callable[..., Any],
    registered: RegisteredOp,
    tags: tuple[torch.Tag, ...] = (),
) -> Any:
    """`name` defined with torch.library's low-level API: one CompositeExplicitAutograd kernel
    (`kernel`) and a fake impl that defers to `registered`'s current one. No Python
    autograd, ADInplaceOrView or backend wrapper in the dispatch path, which is what a
    compiled graph pays per call through custom_op/triton_op (docs/LOG.md: 20-40 us a call on
    an H100 host). Nothing needs them: eager calls go to the function itself, and the op is
    only reached inside compiled or traced code, where autograd sits outside it."""
    namespace, op_name = name.split("::")
    lib = _LIBRARIES.get(namespace)
    if lib is None:
        lib = _LIBRARIES[namespace] = torch.library.Library(namespace, "FRAGMENT")
    lib.define(op_name + torch.library.infer_schema(fn, mutates_args=mutates_args), tags=tags)
    lib.impl(op_name, kernel, "CompositeExplicitAutograd")

    def fake(*args: Any, **kwargs: Any) -> Any:
        if registered.fake is None:
            raise NotImplementedError(f"{name} has no fake impl (register_fake)")
        return registered.fake(*args, **kwargs)

    torch.library.register_fake(name, fake, lib=lib)
    return getattr(getattr(torch.ops, namespace), op_name).default


def library_op(
    name: str,
    mutates_args: Iterable[str] = (),
    triton: bool = False,
    any_strides: bool = False,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register `fn` as `torch.ops.<name>` (module docstring). `any_strides=True`: the op
    reads its tensor arguments at whatever strides they come with (its kernels take the
    strides), so it is tagged `flexible_layout` and Inductor stores an input two such ops
    read once (module docstring, "Input layouts")."""

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        mutates = tuple(mutates_args)
        if triton and set_wrap_triton_enabled is not None:

            def kernel(*args: Any, **kwargs: Any) -> Any:
                with set_wrap_triton_enabled(False):
                    return fn(*args, **kwargs)

        else:
            kernel = fn
        registered = RegisteredOp(None, None, _with_constants(fn) if triton else None)
        tags = (torch.Tag.flexible_layout,) if any_strides else ()
        registered.lean = _define_lean(name, fn, mutates, kernel, registered, tags)
        if triton:
            inline_name = f"{INLINE_NAMESPACE}::{name.split('::')[1]}"
            registered.inline = torch.library.triton_op(inline_name, mutates_args=mutates)(fn)
            registered.inline.register_fake(registered.fake)

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if tracing() or (triton and set_wrap_triton_enabled is None):
                return registered(*args, **kwargs)
            if triton:
                # what triton_op's own eager path does: wrap_triton launches the kernel
                # directly instead of dispatching a higher-order op (~1 ms a call)
                if _WRAP_FLAG is None:
                    with set_wrap_triton_enabled(False):
                        return fn(*args, **kwargs)
                saved, was_eager = getattr(_WRAP_FLAG, "value", _WRAP_DEFAULT), _EAGER.on
                _WRAP_FLAG.value, _EAGER.on = False, True
                try:
                    return fn(*args, **kwargs)
                finally:
                    _WRAP_FLAG.value, _EAGER.on = saved, was_eager
            return fn(*args, **kwargs)

        call.op = registered  # type: ignore[attr-defined]
        return call

    return register
