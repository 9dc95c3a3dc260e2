"""Kernel launches with less host work: `launch(kernel, grid, *args, **kwargs)`.

A quantized linear layer makes about ten Triton launches per forward and backward, and at the
shapes where the step is host-bound (FSDP2, small layers) what bounds it is the Python around
each one. Triton's `JITFunction.run` binds the arguments into a dict, asks the C
specializer about each, builds a cache key (including `str(options)`), checks the globals the
kernel read, and builds launch metadata, then calls the compiled kernel's launcher.

Here, after a kernel's first launch through Triton for a given specialization, the compiled
kernel is kept under a key that is finer than Triton's: per tensor argument its dtype and
whether its address is 16-byte aligned; per integer whether it is 1, a multiple of 16, and
which of int32 / int64 / uint64 holds it; per descriptor its dtype, block shape and padding;
the type of every other argument; the value of every constexpr and launch option; the
device. Two calls with equal keys therefore have equal Triton specializations (the test
checks the key against Triton's own specializer), and the kept kernel is the one Triton
would have picked. Later launches call its launcher directly. The arguments are bound and
keyed by a function generated per kernel (`_generate_bind`, as Triton makes its binder):
Python's own argument binding, and the key of each tensor and int argument written inline,
about half the host time of binding and keying in a loop (7 against 14 us a launch of the
quantize kernel on a CPU host).

Where this does not apply, `kernel[grid]` runs as before: under Triton's interpreter (the CPU
tests), while `wrap_triton` is enabled (tracing: torch.compile records the launch), with
launch hooks set (profilers that need Triton's metadata), for arguments of another type, and
when `FAST_LAUNCH` is False (by default under any Triton but 3.6). The bits are the same
either way: the same compiled kernel gets the same arguments.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
from triton import knobs
from triton.tools.tensor_descriptor import TensorDescriptor

from blockscale.kernels._common import interpreting

try:  # private: the switch the registry's eager path sets (see blockscale/_registry.py)
    from torch._library.triton import is_wrap_triton_enabled
except ImportError:  # pragma: no cover - depends on the torch version
    is_wrap_triton_enabled = None

# False: every launch goes through `kernel[grid]` (benchmarks compare the two). On by default
# only for the Triton release whose compiled-kernel launcher this calls as Triton 3.6 does
# (the version pyproject.toml pins); any other uses Triton's own path.
FAST_LAUNCH = triton.__version__.startswith("3.6.")

_INT32 = 2**31
_UINT63 = 2**63


class _Kernel:
    """What a fast launch needs of one JIT function: its parameters in order, which are
    constexprs, their defaults, the compiled kernels by key, and `fast_bind`, a function
    generated for this kernel that does `bind` and `key` in one call (below)."""

    __slots__ = ("names", "constexpr", "defaults", "compiled", "fast_bind")

    def __init__(self, kernel: Any) -> None:
        self.names = {p.name: i for i, p in enumerate(kernel.params)}
        self.constexpr = [p.is_constexpr for p in kernel.params]
        self.defaults = [p.default if p.has_default else _MISSING for p in kernel.params]
        self.compiled: dict[tuple, Any] = {}
        self.fast_bind = _generate_bind(kernel.params)

    def bind(self, args: tuple, kwargs: dict) -> tuple[list[Any], tuple]:
        """(every parameter's value in order, the launch options): what Triton's binder makes
        of the call. Raises TypeError where Triton would reject it (Triton then says why)."""
        if len(args) > len(self.defaults):
            raise TypeError("too many arguments")
        values = list(args) + self.defaults[len(args) :]
        options = []
        for name, value in kwargs.items():
            index = self.names.get(name)
            if index is None:
                options.append((name, value))
            elif index < len(args):
                raise TypeError(f"{name} given twice")
            else:
                values[index] = value
        if any(value is _MISSING for value in values):  # (`in` would compare tensors)
            raise TypeError("missing argument")
        return values, tuple(options)

    def key(self, values: list[Any], options: tuple, device: int) -> tuple:
        """The launch's key (module docstring): equal keys, equal Triton specializations."""
        return (
            device,
            options,
            *[v if c else _arg_key(v) for v, c in zip(values, self.constexpr, strict=True)],
        )


def _generate_bind(params: list[Any]) -> Any:
    """`fast_bind(device, *args, **kwargs) -> (key, values)` for a kernel with these parameters:
    the same key as `_Kernel.key(*_Kernel.bind(args, kwargs), device)` and the same values
    (tests/test_launch.py checks both), in one generated function. Python's own argument
    binding places the arguments (and raises TypeError where `bind` does), and each runtime
    argument's key is written inline for the two common types (tensors and ints), so a launch
    makes no Python call per argument. Triton's binder is made the same way."""
    names = [p.name for p in params]
    reserved = {"_bs_device", "_bs_options", "_bs_defaults", "_bs_Tensor", "_bs_INT32",
                "_bs_UINT63", "_bs_arg_key", "int", "type", "tuple"}  # fmt: skip
    if reserved & set(names) or not all(n.isidentifier() for n in names):
        raise ValueError(f"kernel parameters {names} clash with the generated binder's names")
    signature, key = [], []
    for name, p in zip(names, params, strict=True):
        signature.append(f"{name}=_bs_defaults[{len(signature)}]" if p.has_default else name)
        if p.is_constexpr:
            key.append(name)
        else:
            key.append(
                f"((({name}.dtype, {name}.data_ptr() % 16 == 0) if type({name}) is _bs_Tensor "
                f"else ((int, {name} == 1, {name} % 16 == 0, 0 if -_bs_INT32 <= {name} < "
                f"_bs_INT32 else (1 if -_bs_UINT63 <= {name} < _bs_UINT63 else 2)) "
                f"if type({name}) is int else _bs_arg_key({name}))))"
            )
    source = (
        f"def fast_bind(_bs_device, {', '.join(signature)}, **_bs_options):\n"
        f"    return ((_bs_device, tuple(_bs_options.items()), {', '.join(key)}), "
        f"[{', '.join(names)}])\n"
    )
    scope = {
        "_bs_defaults": [p.default if p.has_default else None for p in params],
        "_bs_Tensor": torch.Tensor,
        "_bs_INT32": _INT32,
        "_bs_UINT63": _UINT63,
        "_bs_arg_key": _arg_key,
    }
    exec(compile(source, f"<fast_bind of {len(params)} parameters>", "exec"), scope)
    return scope["fast_bind"]


_MISSING = object()
_KERNELS: dict[Any, _Kernel] = {}


def _arg_key(value: Any) -> Any:
    """The part of a runtime argument Triton specializes on (a finer split is harmless), or
    raises TypeError for a type this module does not know."""
    kind = type(value)
    if kind is torch.Tensor or isinstance(value, torch.Tensor):
        return (value.dtype, value.data_ptr() % 16 == 0)
    if kind is int:
        width = 0 if -_INT32 <= value < _INT32 else (1 if -_UINT63 <= value < _UINT63 else 2)
        return (int, value == 1, value % 16 == 0, width)
    if kind is bool or kind is float:
        return kind
    if value is None:
        return (None,)
    if kind is TensorDescriptor:
        return (kind, value.base.dtype, tuple(value.block_shape), value.padding)
    raise TypeError(kind)


@functools.cache
def _cuda() -> bool:
    """Whether this torch has CUDA devices (a CPU-only build compiles kernels for tools such as
    benchmarks/research/sass_cpu.py, which stand in for the launch)."""
    return torch.cuda.is_available()


def _hooks() -> bool:
    """Whether a launch hook is set (a profiler's): Triton's path then builds the launch
    metadata and calls it. Triton 3.6 keeps an empty `HookChain` there when none is."""
    for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


def _direct() -> bool:
    """Whether launches may skip Triton's path here (module docstring)."""
    return FAST_LAUNCH and not interpreting() and _cuda() and not _hooks()


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """`kernel[grid](*args, **kwargs)` through `wrap_triton` (which launches the kernel itself
    where it is off, or records it under a trace), launched directly instead once the kernel
    has been compiled for this specialization (module docstring)."""
    if is_wrap_triton_enabled is None or is_wrap_triton_enabled() or not _direct():
        _wrapped(kernel)[grid](*args, **kwargs)
        return
    _fast(kernel, grid, args, kwargs)


def _wrapped(kernel: Any) -> Any:
    """`torch.library.wrap_triton(kernel)`. Switched off, it hands back the kernel itself, but
    torch 2.11 first refuses anything not made by triton.jit, Triton's interpreted functions
    included (the CPU tests): there the kernel is handed back here."""
    try:
        return torch.library.wrap_triton(kernel)
    except RuntimeError:
        if interpreting() and is_wrap_triton_enabled is not None and not is_wrap_triton_enabled():
            return kernel
        raise


def direct(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """`launch` for a caller that never runs under a trace (its op has a separate fake impl),
    so `wrap_triton` need not be asked."""
    if not _direct():
        kernel[grid](*args, **kwargs)
        return
    _fast(kernel, grid, args, kwargs)


def _fast(kernel: Any, grid: tuple[int, ...], args: tuple, kwargs: dict) -> None:
    """The kept compiled kernel's launch, or Triton's path where there is none yet."""
    spec = _KERNELS.get(kernel)
    if spec is None:
        spec = _KERNELS[kernel] = _Kernel(kernel)
    device = torch._C._cuda_getDevice()
    try:
        key, values = spec.fast_bind(device, *args, **kwargs)
        compiled = spec.compiled.get(key)  # (hashes the key: an unhashable constexpr raises)
    except TypeError:  # an argument this module does not cover: Triton's own path
        kernel[grid](*args, **kwargs)
        return
    if compiled is None:
        compiled = kernel[grid](*args, **kwargs)
        if hasattr(compiled, "result"):  # an asynchronous compile's future
            compiled = compiled.result()
        spec.compiled[key] = compiled
        return
    stream = torch._C._cuda_getCurrentRawStream(device)
    grid_y = grid[1] if len(grid) > 1 else 1
    grid_z = grid[2] if len(grid) > 2 else 1
    compiled.run(
        grid[0], grid_y, grid_z, stream, compiled.function, compiled.packed_metadata, None,
        None, None, *values,
    )  # fmt: skip


def scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Triton's runtime allocator, for kernels that make tensor descriptors on the device (the
    warp-specialized GEMMs): their global scratch, 128 bytes a program, from PyTorch's caching
    allocator on the launch's stream (`triton.set_allocator(scratch)` before such a launch;
    the allocator is per thread)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.empty(size, dtype=torch.int8, device=device)
