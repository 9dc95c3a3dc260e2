"""blockscale: NVFP4 and MXFP8 training for PyTorch, exact on any device.

Layers, bottom up (imports go one way): formats -> kernels -> gemm -> recipes -> ops -> nn ->
distributed -> models -> train -> cli. See README.md and docs/.
"""

from blockscale import distributed, gemm, hadamard, mxfp8, nn, nvfp4, ops, recipes
from blockscale.nn import convert
from blockscale.ops import grouped_mm, linear

__version__ = "0.1.0"

__all__ = [
    "convert",
    "distributed",
    "gemm",
    "grouped_mm",
    "hadamard",
    "linear",
    "mxfp8",
    "nn",
    "nvfp4",
    "ops",
    "recipes",
]
