"""Test-wide setup.

Without a GPU the Triton kernels run in Triton's interpreter; the switch is read when a
kernel is defined, so it has to be set here, before any test imports blockscale.kernels.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _fold_along_axis(self, input):
    """Triton's interpreter reduces with a custom combine function (the kernels' max_keep_nan)
    one element at a time in Python: most of the interpreted kernel tests' time. A combine
    function is elementwise, so the same left fold, acc = combine(acc, x[i]) for i = 1, 2, ...,
    applied to whole slices along the axis gives the same values in the same order; this is
    `ReduceOps.generic_reduce` (Triton 3.6) with that loop vectorized."""
    import numpy as np
    import triton.language as tl

    if any(arg.handle.data.size == 0 for arg in input):
        return _generic_reduce(self, input)
    original_axis = self.axis
    input, axis = self.unravel(input, self.axis)
    input_data = [arg.handle.data for arg in input]
    input_shape = input_data[0].shape
    acc = [np.asarray(np.take(d, 0, axis=axis)) for d in input_data]
    for i in range(1, input_shape[axis]):
        acc_tuple = tuple(self.to_tensor(a, arg.dtype) for a, arg in zip(acc, input))
        input_tuple = tuple(
            self.to_tensor(np.take(d, i, axis=axis), arg.dtype) for d, arg in zip(input_data, input)
        )
        ret = self.combine_fn.fn(*acc_tuple, *input_tuple)
        ret = ret if isinstance(ret, tuple) else (ret,)
        acc = [
            _like(r.handle.data if isinstance(r, tl.core.tensor) else r, a)
            for r, a in zip(ret, acc)
        ]
    out = []
    for data, arg in zip(acc, input):
        data = np.asarray(data)
        if self.keep_dims:
            if original_axis is not None:
                data = np.expand_dims(data, axis)
            else:
                for _ in range(len(input_shape)):
                    data = np.expand_dims(data, 0)
        elif original_axis is None:
            data = data.item()
        out.append(self.to_tensor(data, arg.dtype))
    return out


def _like(value, acc):
    """`value` (a combine function's result) as an array of acc's shape and dtype, as the
    original's store into its output array casts it."""
    import numpy as np

    value = np.asarray(value)
    if value.size != acc.size:
        value = np.broadcast_to(value, acc.shape)
    return value.reshape(acc.shape).astype(acc.dtype)


# The language modules each running interpreted launch has patched (a stack: None until the
# launch's own patch is in place).
_launch_langs: list[frozenset | None] = []


def _langs(fn) -> frozenset:
    """What `_patch_lang(fn)` patches: the triton.language modules fn's globals name."""
    import triton.language as tl

    return frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)


def _patch_lang_once(fn):
    """Triton's interpreter patches triton.language again on every device-function call
    (`InterpretedFunction.__call__`), though the launch around it has patched the same modules:
    each builtin it finds is already replaced and left alone, the rest is set to equal
    closures, and its scope is never restored. Inside a launch that already covers fn's
    modules it is skipped; anywhere else it runs as before."""
    if _launch_langs and _launch_langs[-1] is not None and _langs(fn) <= _launch_langs[-1]:
        return _interpreter._LangPatchScope()
    scope = _patch_lang(fn)
    if _launch_langs and _launch_langs[-1] is None:
        _launch_langs[-1] = _langs(fn)
    return scope


def _launch(self, *args, **kwargs):
    _launch_langs.append(None)
    try:
        return _grid_call(self, *args, **kwargs)
    finally:
        _launch_langs.pop()


_generic_reduce = _patch_lang = _grid_call = None
if os.environ.get("TRITON_INTERPRET") == "1":
    try:
        import triton
        from triton.runtime import interpreter as _interpreter
    except ImportError:
        pass
    else:
        # checked against this version's interpreter (pyproject.toml pins it for the tests)
        if triton.__version__ == "3.6.0":
            _generic_reduce = _interpreter.ReduceOps.generic_reduce
            _interpreter.ReduceOps.generic_reduce = _fold_along_axis
            _patch_lang = _interpreter._patch_lang
            _interpreter._patch_lang = _patch_lang_once
            _grid_call = _interpreter.GridExecutor.__call__
            _interpreter.GridExecutor.__call__ = _launch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marker gpu); run on the GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_cpu_thread():
    """tiny's matrices are too small to gain from a second thread, and two OpenMP threads slow
    down several times over when another process shares the cores: train on one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
