"""One entry point for the block-scaled grouped GEMMs of a mixture-of-experts layer.

- `grouped_mm_rows(a, b, offs, out_dtype, backend)`: out [M, N], the rows of group e equal to
  a[rows of e] @ b[e].T * alpha_e (the output and grad_input GEMMs). a is a grouped row
  operand [M, K] (formats/grouped.py), b an expert operand [E, N, K] (or `TransposedExperts`,
  the exact transpose of 16x16 expert weights). Rows past offs[-1] are zero.
- `grouped_mm_tokens(a, b, seg_ends, block, out_dtype, backend)`: out [E, N, K], out[e] =
  a[:, segment e] @ b[:, segment e].T * alpha_e (the grad_weight GEMM) on two token-layout
  operands [N, P] and [K, P].

alpha_e = S_dec_a[e] * S_dec_b[e] from the per-group NVFP4 amaxes; none for MXFP8.

Backends, as for the dense GEMMs (gemm/dispatch.py): `emulated` runs the exact `_dq`
operands through one Triton kernel per grouped GEMM (kernels/grouped_gemm.py) wherever the
kernels run, with the per-group alpha and the cast in its epilogue, reading the offsets from
the device. Elsewhere (the CPU) it loops over the groups with the offsets read on the host and
makes each group's product exactly as a per-expert `linear` would (the same call on the same
shapes: a grad_weight group contracts its tokens padded to the block, not to the layout's 64),
so the CPU result equals a loop of `linear` bit for bit. `native` is Blackwell's
`F.scaled_grouped_mm` (gemm/native_grouped.py, **unverified on hardware**), which writes BF16
only: a grouped GEMM with another output dtype (grad_weight of FP32 master weights) stays
emulated. `auto` picks native only where the native grouped GEMM can run.

Packed expert weights (`packed_weight_rule`, off: 2.8-4.5x BF16 on an H200, slower than the
`_dq` path at every shape, docs/KERNELS.md): the
emulated rows GEMMs can read the expert weight as its packed codes and scales, each weight
tile decoded to the `_dq` values in registers (kernels/grouped_gemm.py,
`grouped_gemm_rows_packed`), so no `_dq` of the weight is made; the same bits up to the order
of the FP32 additions (the same order as the `_dq` kernel's, tile for tile).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockscale import _library
from blockscale._registry import library_op
from blockscale.formats import e2m1
from blockscale.formats.mxfp8 import MXFP8Tensor
from blockscale.formats.nvfp4 import BLOCK, NVFP4Tensor, decode_scale
from blockscale.gemm import emulated, native
from blockscale.gemm.dispatch import Backend, resolve_backend

# Whether the emulated rows GEMMs (output, grad_input) read the expert weight packed rather than
# through its `_dq` (`packed_weight_rule`). Off: measured on an H200 on 2026-11-28
# (docs/results/bench_grouped_rows_packed_h200.json; docs/KERNELS.md, "Rows GEMMs that read
# the expert weights packed"), bit-equal but 1.3-3.3x the time of dequantize + GEMM at every
# shape and tile config (2.8-4.5x BF16), likely since each expert's weight tile is decoded once
# per row tile. A benchmark or test sets it to compare the two.
PACKED_WEIGHT = False


def packed_weight_rule(weight: torch.Tensor) -> bool:
    """Whether the rows GEMMs read this expert weight (the tensor its copies are quantized
    from, or a copy's codes) packed: `PACKED_WEIGHT` on and the kernels run on it. The one
    place that decides: ops/grouped_mm.py asks it whether the weight's copies need a `_dq`,
    and `grouped_mm_rows` whether to launch the packed kernel."""
    return PACKED_WEIGHT and _library.use_kernels(weight)


@dataclass
class TransposedExperts:
    """Stands for the [E, K, N] transpose of 16x16 NVFP4 expert weights [E, N, K]: exact, as a
    16x16 tile's quantization is symmetric; read as a strided view of the `_dq` tensor."""

    base: NVFP4Tensor

    def __post_init__(self) -> None:
        # (the shape, not the data: a copy written as its `_dq` alone has empty [0, K/2] data)
        if self.base.block != "16x16" or len(self.base.shape) != 3:
            raise ValueError(
                f"only 3-D 16x16 NVFP4 expert weights transpose exactly (block="
                f"{self.base.block}, dims={len(self.base.shape)})"
            )

    @property
    def shape(self) -> torch.Size:
        e, n, k = self.base.shape
        return torch.Size((e, k, n))

    @property
    def amax(self) -> torch.Tensor:
        return self.base.amax

    def dq(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return self.base.dq(dtype).transpose(-2, -1)

    def materialize(self) -> NVFP4Tensor:
        """The transposed codes and scales as a K-major container (what the native GEMM
        reads): device ops only, no requantization."""
        codes_t = self.base.codes().transpose(-2, -1)
        tiles = self.base.scale[:, ::BLOCK]  # [E, N/16, K/16]: one scale per tile
        scale_t = tiles.transpose(-2, -1).contiguous().repeat_interleave(BLOCK, dim=1)
        return NVFP4Tensor(e2m1.pack(codes_t.contiguous()), scale_t, self.base.amax, self.shape,
                           "16x16")  # fmt: skip


Operand = NVFP4Tensor | MXFP8Tensor | TransposedExperts


def _is_nvfp4(op: Operand) -> bool:
    return isinstance(op, NVFP4Tensor | TransposedExperts)


def _data(op: Operand) -> torch.Tensor:
    return (op.base if isinstance(op, TransposedExperts) else op).data


def _device(op: Operand) -> torch.device:
    return _data(op).device


def _hadamard(op: Operand) -> bool:
    return bool(getattr(op.base if isinstance(op, TransposedExperts) else op, "hadamard", False))


def _check(a: Operand, b: Operand) -> None:
    if _is_nvfp4(a) != _is_nvfp4(b):
        raise ValueError(
            f"both operands must share a format, got {type(a).__name__} and {type(b).__name__}"
        )
    emulated.check_hadamard_pairing(_hadamard(a), _hadamard(b))


def _dq_dtype(op: Operand) -> torch.dtype:
    # On CUDA the GEMM reads BF16 operands; CPUs multiply in FP32 (both are exact)
    return torch.bfloat16 if _device(op).type == "cuda" else torch.float32


def _amaxes(a: Operand, b: Operand) -> tuple[torch.Tensor, torch.Tensor] | None:
    return (a.amax, b.amax) if _is_nvfp4(a) else None


def _native_for(a: Operand, out_dtype: torch.dtype, backend: Backend | str) -> bool:
    """Whether this GEMM runs natively: the backend resolves to native and the output is BF16
    (the only dtype the native grouped kernels write)."""
    native_backend = resolve_grouped_backend(backend, _device(a)) is Backend.NATIVE
    return native_backend and out_dtype == torch.bfloat16


def _dq_operands(a: Operand, b: Operand):
    """(a_dq, b_dq, the per-group amaxes or None) of the emulated GEMM."""
    dtype = _dq_dtype(a)
    return a.dq(dtype), b.dq(dtype), _amaxes(a, b)


def _packed_rows(a: Operand, b: Operand, offs: torch.Tensor, out_dtype: torch.dtype):
    """The rows GEMM reading the expert weight `b` packed (no `_dq` of it)."""
    base = b.base if isinstance(b, TransposedExperts) else b
    fmt = "nvfp4" if _is_nvfp4(b) else "mxfp8"
    kmajor = not isinstance(b, TransposedExperts)
    a_dq = a.dq(_dq_dtype(a))
    return _library.kernels().grouped_gemm_rows_packed(
        a_dq, base.data, base.scale, offs, fmt, kmajor, _amaxes(a, b), out_dtype
    )


def _host_bounds(ends: torch.Tensor) -> list[tuple[int, int]]:
    e = ends.tolist()
    return list(zip([0, *e[:-1]], e))


def _group_product(a_dq, b_dq, amax, e: int, out_dtype: torch.dtype) -> torch.Tensor:
    # Fresh copies: a CPU GEMM may sum in another order for an operand that starts at another
    # alignment, and a per-expert `linear` multiplies freshly allocated operands.
    acc = emulated.mm_fp32_accumulate(a_dq.clone(), b_dq.clone())
    if amax is not None:  # out of place, as dispatch._emulated's (selective checkpointing)
        acc = acc * (decode_scale(amax[0][e]) * decode_scale(amax[1][e]))
    return acc.to(out_dtype)


def resolve_grouped_backend(backend: Backend | str, device: torch.device) -> Backend:
    """The concrete backend for grouped GEMMs: `auto` is native only where the native grouped
    GEMM can run (Blackwell and a PyTorch built with its kernels), else emulated; an explicit
    `native` raises where it cannot run."""
    resolved = resolve_backend(backend, device)
    if resolved is Backend.NATIVE and not native.grouped_supported(device):
        if Backend(backend) is Backend.NATIVE:
            native.check_grouped_supported(device)
        return Backend.EMULATED
    return resolved


def _native(a: Operand, b: Operand, offs: torch.Tensor) -> torch.Tensor:
    """The native grouped GEMM (BF16 out; unverified on hardware, see gemm/native.py)."""
    a, b = (op.materialize() if isinstance(op, TransposedExperts) else op for op in (a, b))
    amax_a, amax_b = _amaxes(a, b) or (None, None)
    return native.scaled_grouped_mm(
        a.data.contiguous(), a.scale.contiguous(), b.data.contiguous(), b.scale.contiguous(),
        offs, amax_a, amax_b,
    )  # fmt: skip


def grouped_mm_rows(
    a: Operand,
    b: Operand,
    offs: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    backend: Backend | str = Backend.AUTO,
) -> torch.Tensor:
    """out [M, N] = per group a[rows of e] @ b[e].T * alpha_e; zero rows past offs[-1]."""
    _check(a, b)
    if _native_for(a, out_dtype, backend):
        return _native(a, b, offs)
    if packed_weight_rule(_data(b)):
        return _packed_rows(a, b, offs, out_dtype)
    a_dq, b_dq, amax = _dq_operands(a, b)
    if _library.use_kernels(a_dq):
        return _library.kernels().grouped_gemm_rows(a_dq, b_dq, offs, amax, out_dtype)
    amax_a, amax_b = amax or (None, None)
    return _reference_rows(a_dq, b_dq, amax_a, amax_b, offs, out_dtype)


@library_op("blockscale::grouped_gemm_rows_reference")
def _reference_rows(
    a_dq: torch.Tensor,
    b_dq: torch.Tensor,
    amax_a: torch.Tensor | None,
    amax_b: torch.Tensor | None,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The rows GEMM off the kernels (the CPU): a loop over the groups with the offsets read
    on the host, which a trace holds as one opaque op (ops/quantize.py's
    `_reference_grouped` says why)."""
    amax = None if amax_a is None else (amax_a, amax_b)
    out = a_dq.new_zeros(a_dq.shape[0], b_dq.shape[1], dtype=out_dtype)
    for e, (start, end) in enumerate(_host_bounds(offs)):
        if end > start:
            out[start:end] = _group_product(a_dq[start:end], b_dq[e], amax, e, out_dtype)
    return out


@_reference_rows.op.register_fake
def _(a_dq, b_dq, amax_a, amax_b, offs, out_dtype) -> torch.Tensor:
    return a_dq.new_empty(a_dq.shape[0], b_dq.shape[1], dtype=out_dtype)


def grouped_mm_tokens(
    a: Operand,
    b: Operand,
    offs: torch.Tensor,
    seg_ends: torch.Tensor,
    block: int,
    out_dtype: torch.dtype = torch.float32,
    backend: Backend | str = Backend.AUTO,
) -> torch.Tensor:
    """out [E, N, K] = per group a[:, segment e] @ b[:, segment e].T * alpha_e, for token
    operands a [N, P] and b [K, P] (`seg_ends` the layout's segment ends; `offs` the groups'
    row ends and `block` the tokens' block size, read only by the CPU loop)."""
    _check(a, b)
    if _native_for(a, out_dtype, backend):
        return _native(a, b, seg_ends)
    a_dq, b_dq, amax = _dq_operands(a, b)
    if _library.use_kernels(a_dq):
        return _library.kernels().grouped_gemm_tokens(a_dq, b_dq, seg_ends, amax, out_dtype)
    amax_a, amax_b = amax or (None, None)
    return _reference_tokens(a_dq, b_dq, amax_a, amax_b, offs, seg_ends, block, out_dtype)


@library_op("blockscale::grouped_gemm_tokens_reference")
def _reference_tokens(
    a_dq: torch.Tensor,
    b_dq: torch.Tensor,
    amax_a: torch.Tensor | None,
    amax_b: torch.Tensor | None,
    offs: torch.Tensor,
    seg_ends: torch.Tensor,
    block: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The grad_weight GEMM off the kernels, as `_reference_rows`: each group contracts its
    tokens padded to the block, as a per-expert `linear` does."""
    amax = None if amax_a is None else (amax_a, amax_b)
    out = a_dq.new_zeros(seg_ends.shape[0], a_dq.shape[0], b_dq.shape[0], dtype=out_dtype)
    segments = _host_bounds(seg_ends)
    for e, (start, end) in enumerate(_host_bounds(offs)):
        if end > start:
            s0 = segments[e][0]
            s1 = s0 + -(-(end - start) // block) * block
            out[e] = _group_product(a_dq[:, s0:s1], b_dq[:, s0:s1], amax, e, out_dtype)
    return out


@_reference_tokens.op.register_fake
def _(a_dq, b_dq, amax_a, amax_b, offs, seg_ends, block, out_dtype) -> torch.Tensor:
    return a_dq.new_empty(seg_ends.shape[0], a_dq.shape[0], b_dq.shape[0], dtype=out_dtype)
