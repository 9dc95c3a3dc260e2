"""One entry point for block-scaled GEMMs: `scaled_mm(a, b, out_dtype, bias, backend)`.

out = a @ b.T * alpha (+ bias), with a [M, K] and b [N, K] quantized along K (two NVFP4 or two
MXFP8 operands) and alpha the product of the NVFP4 global decode scales (none for MXFP8).

Backends (`Backend`, also a field of every recipe):

- `emulated`: exact on any device. The `_dq` operands (code * block scale) are exact in BF16,
  the product accumulates in FP32 (`formats`' emulated GEMM), alpha and bias are applied to the
  FP32 accumulator, and the result is cast once. On CUDA the quantization kernels write the
  `_dq` operands in the pass that quantizes, and one Triton kernel runs the GEMM with alpha,
  bias and the cast applied in registers (kernels/gemm.py; FUSED_GEMM), so the only memory
  pass beyond the GEMM is each `_dq` operand's write. An FP32 output (grad_weight of FP32
  master weights, and grad_input of an FP32 input) with a long contraction is cuBLAS's FP32
  product, scaled in place (FUSED_FP32_MAX_K says where and why).
  Elsewhere (CPU) alpha, bias and the cast are PyTorch ops on the FP32 accumulator.
- `native`: Blackwell tensor cores through `torch.nn.functional.scaled_mm` (gemm/native.py).
  Unverified: see that module.
- `auto` resolves to native on a device with compute capability >= 10.0 and a PyTorch that
  has the API, and to emulated everywhere else. Asking for native where it cannot run raises.

The backend is chosen per call from the recipe (`recipe.backend`), never from the environment.

`Transposed` wraps a 2-D 16x16 NVFP4 operand to stand for its transpose. A 16x16 tile's
quantization is symmetric, so the transpose is exact; the emulated backend reads it as a strided
view of the `_dq` tensor (no copy), and only the native backend, which needs K-major bytes,
builds the transposed codes.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch

from blockscale import _library, _registry
from blockscale.formats.mxfp8 import MXFP8Tensor
from blockscale.formats.nvfp4 import NVFP4Tensor
from blockscale.gemm import emulated, native

# The emulated GEMM's FP32 accumulator is made at most this many bytes of rows at a time on
# CUDA (0: all at once). Smaller chunks lower a step's peak memory but cost a GEMM and an
# epilogue launch each, and split GEMMs run slower: at 16384x4096x4096 on an H100, 64 MiB
# chunks made the eager step 35% slower than whole (docs/KERNELS.md), so the default only
# splits accumulators larger than a [16384, 4096] one.
ACC_CHUNK_BYTES = 256 * 2**20

# On CUDA, run the GEMM and its epilogue as one Triton kernel (kernels/gemm.py) wherever TMA
# can read the operands; False: cuBLAS with an FP32 output, then the epilogue kernel.
FUSED_GEMM = True

# Without alpha or bias (MXFP8, and the MXFP8 backward of nvfp4_fwd_mxfp8_bwd), a BF16 output
# is cast(acc) alone, which cuBLAS's BF16 GEMM computes when its split-K partial sums are
# reduced in FP32 (`allow_bf16_reduced_precision_reduction` off during the call: reduced in
# BF16 they would be rounded twice). Alone, cuBLAS ran the Llama-1B shapes' BF16 GEMMs in 2-66%
# less time than the fused kernel (2026-11-25 late, bench_gemm.py, "cublas_bf16_no_alpha");
# in the model it gave less: compiled llama-1b mxfp8 took 254 against 256 ms a step (H100,
# 2026-11-26, one call; 0.882x against 0.877x of compiled BF16), and its GPU test
# (test_gpu_cublas_bf16_route_rounds_once) found the output rounded once. False: the fused
# kernel for these too.
CUBLAS_BF16_OUT = True

# An FP32 output runs the fused kernel (FP32 tiles) where its contraction is at most this long,
# and is otherwise cuBLAS's FP32 product itself, scaled in place by the epilogue kernel (NVFP4's
# alpha; nothing to do for MXFP8). FP32 outputs come two ways in a step: grad_weight of FP32
# master weights (contraction: the tokens, 8192-16384 at the Llama shapes), where the fused
# kernel's FP32 tiles ran 3-62% slower than cuBLAS in place (2026-11-25 late, H100,
# `bench_gemm.py --fp32-grad-weight`), and grad_input of a layer whose input is FP32 (under
# autocast, the RMSNorm output of an FP32 residual stream feeds q/k/v and gate/up; contraction:
# the layer's output features), where cuBLAS in place writes and then reads and writes again a
# [tokens, hidden] FP32 tensor: there the fused kernel took 223 against 294 us (contraction
# 2048), 98 against 175 us (512) and 426 against 469 us (4096) on an H100, and tied at 5632
# (577 against 592 us; an H200 had it losing there, 559 against 545, and at 14336, 1387
# against 1249; 2026-11-26, `bench_gemm.py --fp32-grad-input`, docs/KERNELS.md). Without
# alpha or bias (MXFP8) cuBLAS's product is the output as it is, with no pass to save, so it
# stays there. 0: cuBLAS for every FP32 output.
FUSED_FP32_MAX_K = 4096

# Whether an activation copy that feeds only emulated GEMMs (a linear's or a grouped GEMM's
# input along K, both copies of grad_output) is written as its `_dq` alone: those GEMMs read
# nothing else and nothing keeps the copy, so its codes and scales had no reader (NVFP4 0.56
# of the 2.56 bytes a value such a copy writes, MXFP8 1.03 of 3.03). The `_dq` bits are the
# same (tests/test_kernel_wiring.py, tests/test_grouped_mm.py). On since 2026-11-29, before
# it was timed on a GPU (docs/KERNELS.md, "Activation copies without their codes": compiled
# for sm_90 on the CPU, 10-29% fewer instructions a launch). A benchmark sets it off to compare.
DQ_ONLY_ACTIVATIONS = True


class Backend(StrEnum):
    """Where block-scaled GEMMs run. AUTO: native on compute capability >= 10.0, else emulated.

    >>> bs.gemm.resolve_backend(bs.gemm.Backend.AUTO, torch.device("cpu"))
    <Backend.EMULATED: 'emulated'>
    """

    AUTO = "auto"
    EMULATED = "emulated"
    NATIVE = "native"


@dataclass
class Transposed:
    """Stands for `base.t()` of a 2-D 16x16 NVFP4 tensor without building it eagerly.

    >>> w = bs.nvfp4.quantize(torch.randn(32, 64), block="16x16")
    >>> t = bs.gemm.Transposed(w)
    >>> t.shape, torch.equal(t.dq(), w.dq().t())
    (torch.Size([64, 32]), True)
    """

    base: NVFP4Tensor

    def __post_init__(self) -> None:
        if self.base.block != "16x16" or self.base.data.dim() != 2:
            raise ValueError(
                f"only a 2-D 16x16 NVFP4 tensor transposes exactly (block={self.base.block}, "
                f"dims={self.base.data.dim()})"
            )
        if self.base.hadamard:
            # its transform ran along rows; transposed, it would run along the contraction's
            # other side, which no GEMM undoes
            raise ValueError("a Hadamard-transformed NVFP4 tensor has no exact transpose")

    @property
    def shape(self) -> torch.Size:
        rows, cols = self.base.shape
        return torch.Size((cols, rows))

    def dq(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return self.base.dq(dtype).t()

    def global_decode_scale(self) -> torch.Tensor:
        return self.base.global_decode_scale()

    def materialize(self) -> NVFP4Tensor:
        return self.base.t()


Operand = NVFP4Tensor | MXFP8Tensor | Transposed


def resolve_backend(backend: Backend | str, device: torch.device) -> Backend:
    """The concrete backend (emulated or native) for `backend` on `device`.

    >>> bs.gemm.resolve_backend("auto", torch.device("cpu"))
    <Backend.EMULATED: 'emulated'>
    """
    if not isinstance(backend, Backend):
        # (constructing the enum from its value is done only for strings: Dynamo in torch
        # 2.11 cannot trace Backend(Backend.X), which compiled linears would otherwise hit)
        backend = Backend(backend)
    if backend is Backend.AUTO:
        return Backend.NATIVE if native.device_supports_native(device) else Backend.EMULATED
    if backend is Backend.NATIVE and not native.device_supports_native(device):
        raise ValueError(
            f"backend='native' needs a CUDA device with compute capability >= "
            f"{native.MIN_CAPABILITY[0]}.{native.MIN_CAPABILITY[1]} and torch scaled_mm with "
            f"float4_e2m1fn_x2; got device {device} (torch {torch.__version__})"
        )
    return backend


def activation_codes(backend: Backend) -> bool:
    """Whether an activation copy made with its `_dq` must also hold its codes, for GEMMs on
    the resolved `backend`: on the native one (it reads codes and scales), or with
    `DQ_ONLY_ACTIVATIONS` off. The one place ops/linear.py and ops/grouped_mm.py ask."""
    return backend is not Backend.EMULATED or not DQ_ONLY_ACTIVATIONS


def _is_nvfp4(op: Operand) -> bool:
    return isinstance(op, NVFP4Tensor | Transposed)


def _hadamard(op: Operand) -> bool:
    return bool(getattr(op.base if isinstance(op, Transposed) else op, "hadamard", False))


def _check(a: Operand, b: Operand, bias: torch.Tensor | None) -> None:
    """The pairings a block-scaled GEMM can multiply, and the bias it can add."""
    if _is_nvfp4(a) != _is_nvfp4(b):
        raise ValueError(
            f"both operands must share a format, got {type(a).__name__} and {type(b).__name__}"
        )
    emulated.check_hadamard_pairing(_hadamard(a), _hadamard(b))
    if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(
            f"scaled_mm needs a [M, K] and b [N, K], got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (b.shape[0],):
        raise ValueError(
            f"bias shape {tuple(bias.shape)} is not ({b.shape[0]},): one value per output "
            f"column N of a [{a.shape[0]}, {a.shape[1]}] @ [{b.shape[0]}, {b.shape[1]}].T"
        )


def _device(op: Operand) -> torch.device:
    return op.base.data.device if isinstance(op, Transposed) else op.data.device


def _alpha(a: Operand, b: Operand) -> torch.Tensor | None:
    if _is_nvfp4(a):
        return a.global_decode_scale() * b.global_decode_scale()
    return None


def _emulated(
    a: Operand, b: Operand, out_dtype: torch.dtype, bias: torch.Tensor | None
) -> torch.Tensor:
    # On CUDA the GEMM reads BF16 operands; CPUs multiply in FP32, so build FP32 ones there
    # directly instead of BF16 ones that would be widened (both are exact).
    dq_dtype = torch.bfloat16 if _device(a).type == "cuda" else torch.float32
    a_dq, b_dq = a.dq(dq_dtype), b.dq(dq_dtype)
    if _fused_epilogue(a_dq, out_dtype, bias):
        # the kernel path (CUDA, or Triton's interpreter in tests): `_gemm` into a new output
        amax_a, amax_b = _amaxes(a, b)
        return _gemm(a_dq, b_dq, amax_a, amax_b, bias, out_dtype)
    alpha = _alpha(a, b)
    # out of place: selective activation checkpointing may keep the product (a saved `mm`)
    acc = emulated.mm_fp32_accumulate(a_dq, b_dq)
    if alpha is not None:
        acc = acc * alpha
    if bias is not None:
        acc = acc + bias
    return acc.to(out_dtype)


def _fused_epilogue(a_dq: torch.Tensor, out_dtype: torch.dtype, bias: torch.Tensor | None) -> bool:
    """Whether the epilogue kernel applies: where the quantization kernels run (CUDA with
    Triton), BF16 or FP32 out, and no bias that autograd would need to see (linear()
    computes grad_bias itself)."""
    if out_dtype not in (torch.bfloat16, torch.float32):
        return False
    if bias is not None and bias.requires_grad and torch.is_grad_enabled():
        return False
    return _library.use_kernels(a_dq)


def _amaxes(a: Operand, b: Operand) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The two NVFP4 tensor amaxes alpha is made of ((None, None) for MXFP8). Passed as they
    are: a torch.stack would be one more launch per GEMM on a launch-bound step."""
    if isinstance(a, Transposed):
        a = a.base
    if not isinstance(a, NVFP4Tensor):
        return None, None
    return a.amax, (b.base.amax if isinstance(b, Transposed) else b.amax)  # type: ignore[union-attr]


@_registry.library_op("blockscale::emulated_gemm")
def _gemm(
    a_dq: torch.Tensor,
    b_dq: torch.Tensor,
    amax_a: torch.Tensor | None,
    amax_b: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """cast(a_dq @ b_dq.T * alpha + bias) into a new [M, N] tensor (`_gemm_into`). An op so
    that the choice, which reads data pointers, is made on real tensors (under torch.compile
    too); a functional one, which a compiled graph holds as one node. (Writing into an `out`
    argument made AOTAutograd wrap every call in auto_functionalized and Inductor reinplace
    and decompose it again: about 25 ms of compile time per linear on a CPU host;
    docs/LOG.md, 2026-11-25.)"""
    epilogue = amax_a is not None or bias is not None
    fused_fp32 = FUSED_GEMM and epilogue and a_dq.shape[1] <= FUSED_FP32_MAX_K
    if out_dtype == torch.float32 and not fused_fp32:
        # cuBLAS's FP32 product is the output, scaled in place: no second FP32 tensor, and
        # inside this op, so a compiled graph still holds one functional node
        from blockscale.kernels import gemm_epilogue  # noqa: PLC0415 (Triton is optional)

        acc = emulated.mm_fp32_accumulate(a_dq, b_dq)
        if not epilogue:
            return acc
        amax = None if amax_a is None else (amax_a, amax_b)
        return gemm_epilogue(acc, amax, bias, out=acc)
    out = torch.empty(a_dq.shape[0], b_dq.shape[0], dtype=out_dtype, device=a_dq.device)
    _gemm_into(a_dq, b_dq, amax_a, amax_b, bias, out)
    return out


@_gemm.op.register_fake
def _(a_dq, b_dq, amax_a, amax_b, bias, out_dtype) -> torch.Tensor:
    return a_dq.new_empty((a_dq.shape[0], b_dq.shape[0]), dtype=out_dtype)


def _gemm_into(
    a_dq: torch.Tensor,
    b_dq: torch.Tensor,
    amax_a: torch.Tensor | None,
    amax_b: torch.Tensor | None,
    bias: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    """out = cast(a_dq @ b_dq.T * alpha + bias). With FUSED_GEMM, where TMA can read the
    layouts, one Triton kernel applies the epilogue to the accumulator in registers
    (kernels/gemm.py). Otherwise cuBLAS makes the FP32 accumulator, ACC_CHUNK_BYTES of rows at
    a time, and each chunk goes through the epilogue kernel into its rows of the output, so the
    FP32 tensor never exists whole (a [16384, 4096] BF16 output would otherwise need 256 MiB
    beside it). Runs on real tensors only (inside the `_gemm` op under torch.compile)."""
    kernels = _library.kernels()  # (Triton is optional: looked up, not imported here)
    if CUBLAS_BF16_OUT and amax_a is None and bias is None and _cublas_bf16(a_dq, b_dq, out):
        return
    if FUSED_GEMM and kernels.gemm_into(a_dq, b_dq, amax_a, amax_b, bias, out):
        return
    amax = None if amax_a is None else (amax_a, amax_b)
    m, n = out.shape
    rows = m if ACC_CHUNK_BYTES <= 0 else max(128, ACC_CHUNK_BYTES // (4 * max(n, 1)) // 128 * 128)
    for r0 in range(0, m, rows):
        acc = emulated.mm_fp32_accumulate(a_dq[r0 : r0 + rows], b_dq)
        kernels.gemm_epilogue(acc, amax, bias, out=out[r0 : r0 + rows])


def _cublas_bf16(a_dq: torch.Tensor, b_dq: torch.Tensor, out: torch.Tensor) -> bool:
    """out = cast(a_dq @ b_dq.T) by cuBLAS with a BF16 output and FP32 split-K reduction, for
    CUDA BF16 operands and output; False (nothing written) for anything else."""
    if not (a_dq.is_cuda and out.dtype == a_dq.dtype == b_dq.dtype == torch.bfloat16):
        return False
    matmul = torch.backends.cuda.matmul
    reduced = matmul.allow_bf16_reduced_precision_reduction
    matmul.allow_bf16_reduced_precision_reduction = False
    try:
        torch.mm(a_dq, b_dq.t(), out=out)
    finally:
        matmul.allow_bf16_reduced_precision_reduction = reduced
    return True


def _native(
    a: Operand, b: Operand, out_dtype: torch.dtype, bias: torch.Tensor | None
) -> torch.Tensor:
    a = a.materialize() if isinstance(a, Transposed) else a
    b = b.materialize() if isinstance(b, Transposed) else b
    if bias is None:
        return native.scaled_mm(a, b, out_dtype)
    return native.scaled_mm(a, b, torch.float32).add_(bias).to(out_dtype)


def scaled_mm(
    a: Operand,
    b: Operand,
    out_dtype: torch.dtype = torch.float32,
    bias: torch.Tensor | None = None,
    backend: Backend | str = Backend.AUTO,
) -> torch.Tensor:
    """a @ b.T * alpha (+ bias [N], added in FP32 before the single cast to `out_dtype`).

    >>> x, w = torch.randn(8, 64), torch.randn(32, 64)
    >>> a, b = bs.nvfp4.quantize(x), bs.nvfp4.quantize(w)
    >>> out = bs.gemm.scaled_mm(a, b)
    >>> out.shape, out.dtype
    (torch.Size([8, 32]), torch.float32)
    >>> ref = a.dequantize(torch.float32) @ b.dequantize(torch.float32).T
    >>> torch.allclose(out, ref, rtol=1e-5, atol=1e-5)
    True
    """
    _check(a, b, bias)
    return scaled_mm_resolved(a, b, out_dtype, bias, resolve_backend(backend, _device(a)))


def scaled_mm_resolved(
    a: Operand,
    b: Operand,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    backend: Backend,
) -> torch.Tensor:
    """`scaled_mm` on a resolved backend (emulated or native), for a caller whose operands pair
    by construction: ops/linear.py, whose two operands of a GEMM are copies one validated
    recipe pairs (one format, the Hadamard transform on both or neither), along the K its
    shape check matched, with a bias of N values. The same result without `_check`, which
    would repeat those checks at each of a layer's three GEMMs (issue 62: host time)."""
    if out_dtype not in emulated.OUT_DTYPES:
        raise ValueError(f"out_dtype {out_dtype} is not one of {emulated.OUT_DTYPES}")
    if bias is not None and bias.dtype != torch.float32:
        bias = bias.float()
    if backend is Backend.NATIVE:
        return _native(a, b, out_dtype, bias)
    return _emulated(a, b, out_dtype, bias)
