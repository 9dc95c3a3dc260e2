"""Registering blockscale's operators with torch.library without paying for it in eager mode,
and the one switch that says where the Triton kernels run (`use_kernels`).

`library_op(name, mutates_args, triton=...)` registers a function as a `torch.library` op
(`triton_op` for functions that launch Triton kernels through `wrap_triton`, `custom_op`
otherwise) and returns a caller that picks, per call:

- under torch.compile (Dynamo tracing), the registered op: the graph holds one opaque op, so
  Inductor neither retraces its numerics nor drops it;
- in eager mode, the function itself, with `wrap_triton` switched to launching the kernel
  directly (what triton_op's own eager path does): the dispatcher's per-call cost is skipped,
  which matters because a linear step makes a dozen of these calls and small layers are
  launch-bound (host costs per call are measured by benchmarks/launch_overhead.py).

Both run the same code on the same tensors, so the results are the same bits.
The registered op stays reachable as `caller.op` and as `torch.ops.blockscale.<name>`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

import torch

try:  # private: the switch triton_op's own eager path uses; without it, eager uses the op
    from torch._library.triton import set_wrap_triton_enabled
except ImportError:  # pragma: no cover - depends on the torch version
    set_wrap_triton_enabled = None


def library_op(
    name: str, mutates_args: Iterable[str] = (), triton: bool = False
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        make = torch.library.triton_op if triton else torch.library.custom_op
        op = make(name, mutates_args=tuple(mutates_args))(fn)

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling() or (triton and set_wrap_triton_enabled is None):
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


@functools.cache
def kernels() -> ModuleType | None:
    """blockscale.kernels, or None where Triton is not installed (CPU-only installs)."""
    try:
        from blockscale import kernels as module  # noqa: PLC0415 (Triton is optional)
    except ImportError:
        return None
    return module


def use_kernels(x: torch.Tensor) -> bool:
    """Whether `x` is quantized (and its GEMM epilogue run) by the Triton kernels: CUDA
    tensors, when Triton is there. ops/ and gemm/ both ask here, so a test that switches it
    on for CPU tensors (Triton's interpreter) switches the whole kernel path."""
    return x.is_cuda and kernels() is not None
