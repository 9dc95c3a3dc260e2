"""`blockscale.hadamard`: the public name of the 16x16 random Hadamard transform."""

from blockscale.formats.hadamard import DEFAULT_SIGNS, matrix, transform

__all__ = ["DEFAULT_SIGNS", "matrix", "transform"]
