"""The quantizers under autograd (issue 37): `nvfp4.quantize(x).dequantize()` passed a gradient
only through its block scales (122 of 2,048 entries nonzero), `mxfp8`'s passed it straight
through, and nothing said which was meant. Now both pass it straight through `dequantize`,
to x (or x's transpose, or its Hadamard transform), and nothing else carries a gradient
(formats/straight_through.py)."""

import pytest
import torch

from blockscale import mxfp8, nvfp4
from blockscale.formats import hadamard as rht

CASES = {
    "nvfp4": (nvfp4, {}),
    "nvfp4-16x16": (nvfp4, {"block": "16x16"}),
    "nvfp4-stochastic": (nvfp4, {"rounding": "stochastic"}),
    "nvfp4-transpose": (nvfp4, {"transpose": True}),
    "nvfp4-hadamard": (nvfp4, {"hadamard": True}),
    "nvfp4-hadamard-transpose": (nvfp4, {"hadamard": True, "transpose": True}),
    "mxfp8": (mxfp8, {}),
    "mxfp8-transpose": (mxfp8, {"transpose": True}),
}


def expected_grad(x: torch.Tensor, g: torch.Tensor, options: dict) -> torch.Tensor:
    """The straight-through gradient: that of the tensor the container approximates."""
    x = x.detach().requires_grad_()
    x2 = x.reshape(-1, x.shape[-1])
    x2 = x2.t() if options.get("transpose") else x2
    approximated = (rht.transform(x2) if options.get("hadamard") else x2).float()
    (grad,) = torch.autograd.grad(approximated.reshape(g.shape), x, g)
    return grad


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_dequantize_passes_the_gradient_straight_through(case, dtype, device):
    fmt, options = CASES[case]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 64, generator=g).to(device, dtype).requires_grad_()
    torch.manual_seed(1)
    q = fmt.quantize(x, **options)
    upstream = torch.randn(q.shape, generator=g).to(device)
    (q.dequantize() * upstream).sum().backward()
    want = expected_grad(x, upstream, options)
    assert x.grad.dtype == dtype
    torch.testing.assert_close(x.grad, want, atol=0, rtol=0)
    if not options.get("hadamard"):  # plainly the upstream gradient, in x's layout
        flat = upstream.t() if options.get("transpose") else upstream
        want = flat.reshape(x.shape).to(dtype)
        torch.testing.assert_close(x.grad, want, atol=0, rtol=0)
    # the same bits as without autograd; the format's values carry no gradient
    torch.manual_seed(1)
    with torch.no_grad():
        plain = fmt.quantize(x, **options)
    assert torch.equal(q.data.view(torch.uint8), plain.data.view(torch.uint8))
    assert torch.equal(q.scale.view(torch.uint8), plain.scale.view(torch.uint8))
    assert torch.equal(q.dequantize().detach(), plain.dequantize())
    assert not (q.data.requires_grad or q.scale.requires_grad or q.dq().requires_grad)
    assert plain.source is None and not plain.dequantize().requires_grad


def test_an_exact_16x16_transpose_keeps_the_gradient():
    x = torch.randn(32, 64, requires_grad=True)
    q = nvfp4.quantize(x, block="16x16").t()
    upstream = torch.randn(q.shape)
    (q.dequantize() * upstream).sum().backward()
    torch.testing.assert_close(x.grad, upstream.t(), atol=0, rtol=0)


def test_the_issue_example_gives_ones_for_both_formats():
    for fmt in (nvfp4, mxfp8):
        x = torch.randn(32, 64, requires_grad=True)
        fmt.quantize(x).dequantize().sum().backward()
        assert torch.equal(x.grad, torch.ones_like(x)), fmt.__name__


def test_a_parameter_quantizes_without_a_copy_or_a_graph_until_dequantized():
    """quantize(model.weight) keeps a reference to the weight only (no graph, no copy)."""
    w = torch.nn.Parameter(torch.randn(32, 64))
    q = nvfp4.quantize(w)
    assert q.amax.grad_fn is None and q.scale.grad_fn is None
    assert q.dequantize().grad_fn is not None
    with torch.no_grad():
        assert q.dequantize().grad_fn is None
