"""Test-wide setup.

Without a GPU the Triton kernels run in Triton's interpreter; the switch is read when a
kernel is defined, so it has to be set here, before any test imports blockscale.kernels.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
