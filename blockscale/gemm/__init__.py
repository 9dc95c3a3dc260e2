"""gemm/: one dispatch point for block-scaled GEMMs (emulated everywhere, native on Blackwell)."""

from blockscale.gemm.dispatch import Backend, Transposed, resolve_backend, scaled_mm

__all__ = ["Backend", "Transposed", "resolve_backend", "scaled_mm"]
