"""The linear layer gives the same bits whether the Triton kernels or the formats/ references
quantize its operands.

On the GPU the kernels are chosen for every CUDA tensor. Here, on the CPU,
`blockscale._library.use_kernels` is switched on so the kernels run in Triton's interpreter
(tests/conftest.py turns it on), the GEMM epilogue kernel included, and
each recipe's forward output, grad_input and grad_weight must equal the reference path's
exactly: the kernels are bit-exact to formats/ for nearest rounding, the `_dq` operands they
write are the same exact values, and the GEMM that consumes them is the same call.
Stochastic rounding is off (the kernels draw Philox bits, not torch.rand's).
"""

import pytest
import torch

from blockscale import _library, recipes
from blockscale.ops import linear

pytest.importorskip("triton")

RECIPES = {
    "nvfp4": recipes.get("nvfp4", stochastic_rounding=False),
    "nvfp4-1x16-weights": recipes.get("nvfp4", stochastic_rounding=False, weight_2d=False),
    "nvfp4_fwd_mxfp8_bwd": recipes.get("nvfp4_fwd_mxfp8_bwd"),
    "mxfp8": recipes.get("mxfp8"),
}


def _step(x, w, b, recipe):
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    out = linear(x, w, b, recipe)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    out.backward(grad)
    return out.detach(), x.grad, w.grad


@pytest.mark.parametrize("tokens", [64, 40], ids=["one-read", "padded-tokens"])
@pytest.mark.parametrize("name", list(RECIPES))
def test_kernel_path_equals_reference_path(name, tokens, monkeypatch):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, tokens // 2, 64, generator=g).bfloat16()
    x[0, 3, 5] = 40.0  # an outlier, so the blocks' scales differ
    w = torch.randn(96, 64, generator=g)
    b = torch.randn(96, generator=g)
    reference = _step(x, w, b, RECIPES[name])

    calls = []
    real = _library.use_kernels

    def on_cpu_too(t):
        calls.append(t.shape)
        return True

    monkeypatch.setattr(_library, "use_kernels", on_cpu_too)
    kernel = _step(x, w, b, RECIPES[name])
    monkeypatch.setattr(_library, "use_kernels", real)

    assert calls, "the kernel path was never taken"
    for got, want, what in zip(kernel, reference, ("output", "grad_input", "grad_weight")):
        torch.testing.assert_close(got, want, atol=0, rtol=0, msg=f"{name}: {what} differs")
