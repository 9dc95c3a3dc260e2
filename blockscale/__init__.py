"""blockscale: NVFP4 and MXFP8 training for PyTorch, exact on any device.

Layers, bottom up (imports go one way): formats -> kernels -> gemm -> recipes -> ops -> nn ->
distributed -> models -> train -> cli. See README.md and docs/.
"""

from blockscale import hadamard, mxfp8, nvfp4

__version__ = "0.1.0"

__all__ = ["hadamard", "mxfp8", "nvfp4"]
