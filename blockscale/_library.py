"""Where blockscale's Triton kernels run: `use_kernels(x)`, the one switch that ops/, gemm/ and
distributed/ ask (CUDA tensors, when Triton is installed), and `kernels()`, the one lookup of
the kernels package (None on CPU-only installs).

The ops themselves are registered with torch.library where the kernels are (kernels/ calls
`blockscale._registry.library_op`); this module only looks the kernels up, lazily, so that
importing it needs neither Triton nor the kernels, and kernels/ never imports it.
"""

from __future__ import annotations

import functools
import importlib.util
import warnings
from types import ModuleType

import torch

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
