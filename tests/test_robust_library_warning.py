"""CUDA tensors without Triton run the pure-PyTorch reference path, many times slower: the
library says so once per process, whoever calls it (issue 18). Tested on the CPU: `kernels`
is made to answer None, and a stand-in answers `is_cuda` as a CUDA tensor does (the only
thing `use_kernels` reads)."""

import types
import warnings

import pytest
import torch

from blockscale import _library
from blockscale.train import build

CUDA_TENSOR = types.SimpleNamespace(is_cuda=True)


@pytest.fixture
def no_triton(monkeypatch):
    monkeypatch.setattr(_library, "kernels", lambda: None)
    _library.warn_reference_path.cache_clear()
    yield
    _library.warn_reference_path.cache_clear()


def caught_warnings(calls):
    """The warnings `calls()` raises, none hidden by the warnings module's own once-filter."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        calls()
    return caught


@pytest.mark.usefixtures("no_triton")
def test_cuda_tensor_without_triton_warns_once():
    caught = caught_warnings(lambda: [_library.use_kernels(CUDA_TENSOR) for _ in range(2)])
    assert len(caught) == 1 and issubclass(caught[0].category, RuntimeWarning)
    message = str(caught[0].message)
    assert message.startswith("Triton is not installed, so the Triton kernels cannot load")
    assert "pure-PyTorch reference path" in message and "many times slower" in message
    assert not _library.use_kernels(CUDA_TENSOR)  # and the reference path runs


@pytest.mark.usefixtures("no_triton")
def test_cpu_tensor_never_warns():
    assert caught_warnings(lambda: _library.use_kernels(torch.zeros(2))) == []
    assert not _library.use_kernels(torch.zeros(2))


@pytest.mark.usefixtures("no_triton")
def test_the_training_cli_and_the_library_warn_once_between_them():
    def build_then_quantize():
        assert build.warn_if_reference_path(torch.device("cuda"), build.recipes.get("nvfp4"))
        _library.use_kernels(CUDA_TENSOR)

    assert len(caught_warnings(build_then_quantize)) == 1


@pytest.mark.usefixtures("no_triton")
def test_no_warning_while_dynamo_traces(monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert caught_warnings(lambda: _library.use_kernels(CUDA_TENSOR)) == []


def test_cuda_tensor_with_triton_is_not_warned_about(monkeypatch):
    monkeypatch.setattr(_library, "kernels", lambda: types.ModuleType("kernels"))
    _library.warn_reference_path.cache_clear()
    assert caught_warnings(lambda: _library.use_kernels(CUDA_TENSOR)) == []
    assert _library.use_kernels(CUDA_TENSOR)
