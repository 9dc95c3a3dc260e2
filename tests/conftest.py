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
