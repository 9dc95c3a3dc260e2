"""Registering blockscale's operators with torch.library without paying for it in eager mode,
and the one switch that says where the Triton kernels run (`use_kernels`).

`library_op(name, mutates_args, triton=...)` registers a function as a `torch.library` op
(`triton_op` for functions that launch Triton kernels through `wrap_triton`, `custom_op`
otherwise) and returns a caller that picks, per call:

- under torch.compile (Dynamo tracing), the registered op: the graph holds one opaque op, so
  Inductor neither retraces its numerics nor drops it, and the compiled step runs the very
  kernels eager runs (same bits, no Inductor options needed for them);
- in eager mode, the function itself, with `wrap_triton` switched to launching the kernel
  directly (what triton_op's own eager path does): the dispatcher's per-call cost is skipped,
  which matters because a linear step makes a dozen of these calls and small layers are
  launch-bound (host costs per call are measured by benchmarks/launch_overhead.py).

Both run the same code on the same tensors, so the results are the same bits.
The registered op stays reachable as `caller.op` and as `torch.ops.blockscale.<name>`.

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
them fuses into them. So the FunctionalTensorMode rule of every Triton-backed op here keeps
the op whole (as torch.export does); Inductor calls it as an extern kernel, whose launch is the
eager one (a dispatcher call, ~5 us more host time than eager's direct call, same CPU host).
`INLINE_TRITON_KERNELS = True` restores torch's decomposition (read at trace time; for
comparisons, e.g. `benchmarks/bench_model.py --inline-triton`).
"""

from __future__ import annotations

import functools
import importlib.util
import warnings
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

import torch

try:  # private: the switch triton_op's own eager path uses; without it, eager uses the op
    from torch._library.triton import set_wrap_triton_enabled
except ImportError:  # pragma: no cover - depends on the torch version
    set_wrap_triton_enabled = None

# False: Triton-backed ops stay single opaque ops in compiled graphs (see the module docstring).
INLINE_TRITON_KERNELS = False


def _keep_whole_under_functionalization(op: Any) -> None:
    """Make AOTAutograd's functionalization keep the triton_op `op` as one op, unless
    INLINE_TRITON_KERNELS asks for torch's decomposition into its kernel launches."""
    from torch._subclasses.functional_tensor import FunctionalTensorMode  # noqa: PLC0415

    decompose = op._torch_dispatch_fns.get(FunctionalTensorMode)
    if decompose is None:  # a torch whose triton_op does not decompose: already whole
        return

    def rule(mode: Any, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        if INLINE_TRITON_KERNELS:
            return _with_constants(decompose)(mode, func, types, args, kwargs)
        return mode.__torch_dispatch__(func, types, args, kwargs)

    op.register_torch_dispatch(FunctionalTensorMode, rule)


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


_TRACING_MODES = (
    torch._C._TorchDispatchModeKey.FAKE,
    torch._C._TorchDispatchModeKey.FUNCTIONAL,
    torch._C._TorchDispatchModeKey.PROXY,
)


def tracing() -> bool:
    """Whether a call must go through the registered op rather than launch its kernel: under
    Dynamo, and also where a trace runs our code with fake tensors outside Dynamo's frame (the
    converted experts' `nonstrict_trace` call runs its body under FakeTensorMode, where
    `is_compiling()` is False and a direct launch fails: "Cannot access data pointer of
    Tensor"). One C lookup per mode, no Python walk over the arguments."""
    return torch.compiler.is_compiling() or any(
        torch._C._get_dispatch_mode(key) is not None for key in _TRACING_MODES
    )


def library_op(
    name: str, mutates_args: Iterable[str] = (), triton: bool = False
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        make = torch.library.triton_op if triton else torch.library.custom_op
        op = make(name, mutates_args=tuple(mutates_args))(fn)
        if triton:
            _keep_whole_under_functionalization(op)
            op.register_fake(_with_constants(fn))

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if tracing() or (triton and set_wrap_triton_enabled is None):
                return op(*args, **kwargs)
            if triton:
                # what triton_op's own eager path does: wrap_triton launches the kernel
                # directly instead of dispatching a higher-order op (~1 ms a call)
                with set_wrap_triton_enabled(False):
                    return fn(*args, **kwargs)
            return fn(*args, **kwargs)

        call.op = op  # type: ignore[attr-defined]
        return call

    return register


# Looked up once, at import: whether Triton is installed (find_spec does not import it).
HAS_TRITON = importlib.util.find_spec("triton") is not None


def kernels() -> ModuleType | None:
    """blockscale.kernels, or None where Triton is not installed (CPU-only installs).

    No functools.cache and no global written here: Dynamo traces through a cache wrapper (and
    warns that it does), and a global stored inside a traced autograd.Function is a side
    effect it refuses. An import of a loaded module is a dict lookup, and Dynamo's constant."""
    if not HAS_TRITON:
        return None
    from blockscale import kernels as module  # noqa: PLC0415 (Triton is optional)

    return module


@functools.cache
def warn_reference_path() -> None:
    """Warn, once per process, that CUDA tensors run the pure-PyTorch reference path (many
    times slower) because Triton is not installed. Also called by the training CLI, which
    warns before it builds the run, so that a process sees this message once."""
    warnings.warn(
        "Triton is not installed, so the Triton kernels cannot load and blockscale runs CUDA "
        "tensors through its pure-PyTorch reference path: the same numbers, many times slower "
        "(install triton; `python -c 'import blockscale.kernels'` shows whether they load)",
        RuntimeWarning,
        stacklevel=3,
    )


def use_kernels(x: torch.Tensor) -> bool:
    """Whether `x` is quantized (and its GEMM epilogue run) by the Triton kernels: CUDA
    tensors, when Triton is there. ops/ and gemm/ both ask here, so a test that switches it
    on for CPU tensors (Triton's interpreter) switches the whole kernel path. A CUDA tensor
    without Triton warns once (`warn_reference_path`); not while Dynamo traces, where the
    cached call would be a side effect, and where Inductor needs Triton on CUDA anyway."""
    if not x.is_cuda:
        return False
    if kernels() is None:
        if not torch.compiler.is_compiling():
            warn_reference_path()
        return False
    return True
