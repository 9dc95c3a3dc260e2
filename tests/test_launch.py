"""kernels/_launch.py: a kept compiled kernel is reused only where Triton would pick it too.

The fast launch keys a compiled kernel by what Triton specializes on. These tests check that
key against Triton's own specializer (the C function its binder calls) and its own binder, on
the CPU: equal keys must mean equal Triton specializations, and the bound parameter values
must be the ones Triton's binder hands the launcher. The launches themselves run on the GPU
(every kernel test there goes through them)."""

from __future__ import annotations

import itertools

import pytest
import torch

triton = pytest.importorskip("triton")

from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import BaseBackend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from blockscale.kernels import _launch  # noqa: E402
from blockscale.kernels.gemm import _gemm_kernel  # noqa: E402
from blockscale.kernels.nvfp4 import _nvfp4_dequantize_kernel, _nvfp4_quantize_kernel  # noqa: E402


def _triton_spec(value):
    return native_specialize_impl(BaseBackend, value, False, True, True)


def _values():
    base = torch.zeros(4096, dtype=torch.uint8)
    tensors = [base[i:] for i in (0, 1, 8, 16, 32)]
    tensors += [torch.zeros(64, dtype=d) for d in (torch.bfloat16, torch.float32, torch.int16)]
    tensors.append(torch.zeros(64, dtype=torch.float32)[3:])
    ints = [0, 1, 2, 15, 16, 17, 32, -1, -16, 2**31 - 16, 2**31 - 1, 2**31, -(2**31), -(2**31) - 1]
    ints += [2**40, 2**63 - 1, 2**63, 2**64 - 16, -(2**63)]
    bf16 = torch.zeros(64, 64, dtype=torch.bfloat16)
    descs = [
        TensorDescriptor.from_tensor(bf16, [16, 32]),
        TensorDescriptor.from_tensor(bf16[16:], [16, 32]),
        TensorDescriptor.from_tensor(bf16, [32, 32]),
        TensorDescriptor.from_tensor(torch.zeros(64, 64), [16, 32]),
    ]
    return tensors + ints + [True, False, 0.0, 1.5, -2.0, 1e300, None] + descs


def test_equal_argument_keys_mean_equal_triton_specializations():
    values = _values()
    keys = [_launch._arg_key(v) for v in values]
    specs = [_triton_spec(v) for v in values]
    for (ka, sa, a), (kb, sb, b) in itertools.combinations(zip(keys, specs, values), 2):
        if ka == kb:
            assert sa == sb, (a, b)
    # and the key tells apart what Triton tells apart in this set (it is not trivially coarse)
    assert len(set(keys)) >= len({repr(s) for s in specs})


def test_unknown_argument_types_take_tritons_path():
    for value in ((1, 2), [1], "a", torch.float32):
        with pytest.raises(TypeError):
            _launch._arg_key(value)


def _jit(kernel):
    """The JITFunction of a kernel (under the interpreter the module holds an
    InterpretedFunction of the same Python function)."""
    fn = getattr(kernel, "fn", kernel)
    return kernel if isinstance(kernel, JITFunction) else JITFunction(fn)


def _quantize_call(x, amax, out8, out16, rows, cols, band, **flags):
    args = (x, x.stride(0), x.stride(1), rows, cols, amax, amax, amax, amax, amax, amax)
    args += (out8, out8, out16, out8, out8, out16)
    kwargs = dict(
        ROW=True, COL=flags.get("col", False), ROW_2D=False, COL_2D=False, ROW_SR=False,
        COL_SR=False, COL_HAD=False, RAND_GIVEN=False, DQ_ROW=True, DQ_COL=False, band=band,
        DOT_F32=False, HW=True, BM=64, BK=64, num_warps=4,
    )  # fmt: skip
    return args, kwargs


@pytest.mark.parametrize("kernel", [_nvfp4_quantize_kernel, _nvfp4_dequantize_kernel])
def test_bind_gives_tritons_bound_values_and_equal_keys_equal_specializations(kernel):
    jit = _jit(kernel)
    binder = create_function_from_signature(jit.signature, jit.params, BaseBackend)
    spec = _launch._Kernel(jit)
    buf = torch.zeros(1 << 16, dtype=torch.uint8)
    calls = []
    for offset, rows, cols, band, col in itertools.product(
        (0, 1, 16), (64, 65, 1), (64, 48), (1, 8), (False, True)
    ):
        x = torch.zeros(rows * cols + 32, dtype=torch.bfloat16)[offset:].as_strided(
            (rows, cols), (cols, 1)
        )
        amax = torch.zeros(4)[offset % 4 :]
        out8, out16 = buf[offset:], torch.zeros(8, dtype=torch.int16)
        if kernel is _nvfp4_quantize_kernel:
            calls.append(_quantize_call(x, amax, out8, out16, rows, cols, band, col=col))
        else:
            # (a stack of one: rows per stack, then the codes' and scales' strides)
            strides = (rows * cols // 2, cols // 2, rows * cols // 16, cols // 16)
            args = (out8, buf, out16, rows, cols, rows, *strides, band)
            calls.append((args, dict(BR=32, BC=128, num_warps=4)))
    keys, specializations = [], []
    for args, kwargs in calls:
        params, specialization, options = binder(*args, **kwargs)
        values, opts = spec.bind(args, kwargs)
        assert len(values) == len(params)
        for mine, theirs in zip(values, params.values(), strict=True):
            assert mine is theirs
        assert dict(opts) == options
        key = spec.key(values, opts, 0)
        # the generated binder the launches use: the same key and the very same values
        fast_key, fast_values = spec.fast_bind(0, *args, **kwargs)
        assert fast_key == key
        assert len(fast_values) == len(values)
        assert all(a is b for a, b in zip(fast_values, values, strict=True))
        keys.append(key)
        specializations.append((tuple(specialization), str(options)))
    for (ka, sa), (kb, sb) in itertools.combinations(zip(keys, specializations), 2):
        if ka == kb:
            assert sa == sb


def test_bind_rejects_what_triton_rejects():
    spec = _launch._Kernel(_jit(_nvfp4_dequantize_kernel))
    t = torch.zeros(8, dtype=torch.uint8)
    with pytest.raises(TypeError):  # BR, BC missing
        spec.bind((t, t, t, 1, 2, 1), {})
    with pytest.raises(TypeError):  # R given twice
        spec.bind((t, t, t, 1, 2, 1), dict(R=3, BR=32, BC=128))
    with pytest.raises(TypeError):  # too many
        spec.bind((t,) * 12, {})
    for args, kwargs in (((t, t, t, 1, 2, 1), {}), ((t, t, t, 1, 2, 1), dict(R=3, BR=32, BC=128))):
        with pytest.raises(TypeError):
            spec.fast_bind(0, *args, **kwargs)
    with pytest.raises(TypeError):
        spec.fast_bind(0, *(t,) * 12)


def test_fast_bind_keys_other_argument_types_as_arg_key_does():
    """Runtime arguments other than plain tensors and ints (a Parameter, bools, floats, None,
    descriptors) take `_arg_key` inside the generated binder: the key is `key`'s."""
    spec = _launch._Kernel(_jit(_nvfp4_dequantize_kernel))
    p = torch.nn.Parameter(torch.zeros(8, dtype=torch.uint8), requires_grad=False)
    for r in (1, 16, 2**31, 2**63, True, 1.5, None, p):
        args, kwargs = (p, p, p, r, 2, 2, 1, 1, 1, 1, 1), dict(BR=32, BC=128, num_warps=4)
        values, opts = spec.bind(args, kwargs)
        assert spec.fast_bind(3, *args, **kwargs)[0] == spec.key(values, opts, 3)


def test_gemm_descriptor_arguments_are_keyed():
    spec = _launch._Kernel(_jit(_gemm_kernel))
    assert spec.names["PROGRAMS"] > 0  # the GEMM goes through `direct` with descriptors
    bf16 = torch.zeros(64, 64, dtype=torch.bfloat16)
    a = TensorDescriptor.from_tensor(bf16, [16, 32])
    b = TensorDescriptor.from_tensor(bf16, [32, 32])
    assert _launch._arg_key(a) != _launch._arg_key(b)
    assert (_triton_spec(a) != _triton_spec(b)) and _launch._arg_key(a) == _launch._arg_key(
        TensorDescriptor.from_tensor(torch.ones(128, 64, dtype=torch.bfloat16), [16, 32])
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp8"])
def test_gpu_fast_launch_equals_tritons_launch(recipe, monkeypatch):
    """A linear layer's forward and backward, twice each way (the second fast launch reuses the
    kept kernels), on two inputs of one specialization: the same bits as Triton's own path."""
    import blockscale as bs  # noqa: PLC0415

    def run(fast: bool, seed: int):
        monkeypatch.setattr(_launch, "FAST_LAUNCH", fast)
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512))
        layer = bs.convert(model, bs.recipes.get(recipe)).cuda()[0]
        x = torch.randn(4, 64, 256, device="cuda", requires_grad=True)
        with torch.autocast("cuda", torch.bfloat16):
            out = layer(x)
        out.float().square().sum().backward()
        return [out, x.grad, layer.weight.grad, layer.bias.grad]

    for seed in (0, 1):
        slow = run(False, seed)
        fast = run(True, seed)
        again = run(True, seed)
        for a, b, c in zip(slow, fast, again, strict=True):
            torch.testing.assert_close(b, a, atol=0, rtol=0)
            torch.testing.assert_close(c, a, atol=0, rtol=0)
    assert any(s.compiled for s in _launch._KERNELS.values())
