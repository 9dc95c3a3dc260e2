"""NVFP4: E2M1 values, one E4M3 scale per 16 values, one FP32 scale per tensor.

This is the executable form of NUMERICS.md, operation by operation, in FP32. Every fast
kernel is tested bit for bit against `quantize` here.

Decisions where NUMERICS.md leaves room (docs/NUMERICS_NOTES.md has the reasoning):
- The global decode scale S_dec = 1/S_enc is also what the GEMM multiplies by
  (alpha = S_dec_a * S_dec_b), so a GEMM of two quantized tensors equals the product of
  their dequantizations in every case, tiny amaxes and amax == 0 included.
- Non-finite input (amax Inf or NaN) gives S_dec = NaN: every dequantized value and every
  GEMM output made from the tensor is NaN, never a finite number.
- The containers keep leading dims: a [B, T, K] input gives data [B, T, K/2].
  transpose=True flattens leading dims first and quantizes the [K, B*T] transpose.
- Under autograd, `dequantize` passes the gradient straight through to x, as mxfp8's does;
  nothing else is differentiable (formats/straight_through.py says why).
"""

from dataclasses import dataclass, field

import torch

from blockscale.formats import e2m1, straight_through
from blockscale.formats import hadamard as rht
from blockscale.formats._checks import as_2d, check_amax, check_blocks, check_flags
from blockscale.formats.scales import E4M3_MAX, FLT_MAX, to_e4m3

BLOCK = 16
BLOCKS = ("1x16", "16x16")
ROUNDINGS = ("nearest", "stochastic")
_ENCODE_NUMERATOR = E4M3_MAX * e2m1.MAX  # 448 * 6


@dataclass
class NVFP4Tensor:
    """A quantized tensor. `shape` is the logical (unpacked) shape of what was quantized:
    x's shape, or [K, M] for a transpose=True copy of an [M, K] input.

    data:  uint8 [..., K/2], element 2i in the low nibble
    scale: float8_e4m3fn [..., K/16] row-major (16x16: each tile's scale on its 16 rows)
    amax:  FP32 scalar the global scale came from
    source: under autograd, what `dequantize` passes the gradient to (straight_through.py)

    >>> q = bs.nvfp4.quantize(torch.randn(4, 32))
    >>> q.data.shape, q.scale.shape, q.amax.dtype  # two codes a byte, one scale per 16
    (torch.Size([4, 16]), torch.Size([4, 2]), torch.float32)
    >>> q.dequantize(torch.float32).shape
    torch.Size([4, 32])
    """

    data: torch.Tensor
    scale: torch.Tensor
    amax: torch.Tensor
    shape: torch.Size
    block: str = "1x16"
    hadamard: bool = False
    source: straight_through.Source = field(default=None, repr=False, compare=False, kw_only=True)

    def codes(self) -> torch.Tensor:
        """Unpacked uint8 E2M1 codes, [..., K]."""
        return e2m1.unpack(self.data)

    def global_decode_scale(self) -> torch.Tensor:
        """S_dec (FP32 scalar); NaN when amax is not finite."""
        return decode_scale(self.amax)

    def dq(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """code * block scale, without the global scale: exact in BF16 (at most 6
        significant bits), the operand an emulated GEMM consumes."""
        values = e2m1.decode(self.codes()).unflatten(-1, (-1, BLOCK))
        return (values * self.scale.float().unsqueeze(-1)).flatten(-2).to(dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """code * block scale * S_dec, in FP32, then cast to `dtype`.

        For a Hadamard copy this is the transformed tensor (H is not undone). Under autograd
        the gradient passes straight through to the quantized x (straight_through.py)."""
        value = (self.dq(torch.float32) * self.global_decode_scale()).to(dtype)
        return straight_through.attach(value, self.source)

    def t(self) -> "NVFP4Tensor":
        """The exact transpose of a 2-D 16x16 tensor: codes and scales transposed, no
        requantization (a 16x16 tile's scale and the global scale are symmetric)."""
        if self.block != "16x16" or self.data.dim() != 2:
            raise ValueError(
                f"only 2-D 16x16 tensors transpose exactly (block={self.block}, "
                f"dims={self.data.dim()}); requantize with transpose=True instead"
            )
        if self.hadamard:
            # The transform ran along the rows; after a transpose it would run along the
            # columns, which no GEMM operand of ours expects.
            raise ValueError("a Hadamard-transformed tensor has no exact transpose")
        rows, cols = self.shape
        codes_t = self.codes().t()
        tiles = self.scale[::BLOCK]  # [rows/16, cols/16]: one scale per tile
        scale_t = tiles.t().contiguous().repeat_interleave(BLOCK, dim=0)
        return NVFP4Tensor(
            e2m1.pack(codes_t),
            scale_t,
            self.amax,
            torch.Size((cols, rows)),
            "16x16",
            source=straight_through.transposed(self.source),
        )


def encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """S_enc = 448*6/amax, capped at FLT_MAX; 1 where amax == 0 or S_enc == 0 (amax Inf)."""
    amax = amax.float()
    # One correctly rounded FP32 division, as in TE. A Python number on the left
    # (`2688 / amax`) would make torch compute reciprocal(amax) * 2688: two roundings.
    s_enc = torch.div(torch.full_like(amax, _ENCODE_NUMERATOR), amax).clamp(max=FLT_MAX)
    return torch.where((amax == 0) | (s_enc == 0), torch.ones_like(s_enc), s_enc)


def decode_scale(amax: torch.Tensor) -> torch.Tensor:
    """S_dec = 1/S_enc; NaN when amax is Inf or NaN so that no overflow decodes finite."""
    s_dec = 1.0 / encode_scale(amax)
    return torch.where(torch.isfinite(amax), s_dec, torch.full_like(s_dec, float("nan")))


def block_scales(block_amax: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """E4M3 block scales from FP32 block amaxes and the tensor amax (NUMERICS.md order)."""
    s_enc = encode_scale(amax)
    mult = s_enc * (1.0 / e2m1.MAX)  # reciprocal of 6 first (FP32), then the product
    b = (block_amax.float() * mult).clamp(max=FLT_MAX)
    return to_e4m3(b)


def encode_multipliers(scale: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """Per block: 1 / (float(scale) * S_dec), capped at FLT_MAX (a zero scale gives FLT_MAX)."""
    s_dec = 1.0 / encode_scale(amax)
    return (1.0 / (scale.float() * s_dec)).clamp(max=FLT_MAX)


def quantize(
    x: torch.Tensor,
    block: str = "1x16",
    rounding: str = "nearest",
    hadamard: bool = False,
    transpose: bool = False,
    generator: torch.Generator | None = None,
    amax: torch.Tensor | None = None,
) -> NVFP4Tensor:
    """Quantize x along its last dim (or, with transpose=True, along its first dim).

    block:     "1x16" (16 consecutive values) or "16x16" (tiles; rows must be a multiple of 16)
    rounding:  "nearest" (ties to even) or "stochastic" (uniforms from `generator`, or from
               PyTorch's default generator so torch.manual_seed reproduces the bits)
    hadamard:  apply the 16x16 RHT along the quantized dim first (rounded to BF16)
    amax:      use this tensor amax instead of max|x| (e.g. one reduced over ranks): a float32
               tensor of one value, >= 0 (NaN or Inf for non-finite input)

    Autograd: the result's `dequantize()` passes the gradient straight through to x (to x's
    transpose or Hadamard transform where those were asked); codes and scales carry none.

    >>> x = torch.tensor([[0.0, 0.4, 1.1, 1.6, 2.2, 2.9, 4.1, -6.0] * 2])
    >>> bs.nvfp4.quantize(x).dequantize(torch.float32)[0, :8]  # the nearest E2M1 values
    tensor([ 0.0000,  0.5000,  1.0000,  1.5000,  2.0000,  3.0000,  4.0000, -6.0000])
    >>> bs.nvfp4.quantize(torch.randn(32, 64), block="16x16", transpose=True).shape
    torch.Size([64, 32])
    """
    check_flags("NVFP4", hadamard=hadamard, transpose=transpose)
    if amax is not None:
        check_amax(amax, "NVFP4")
    if block not in BLOCKS:
        raise ValueError(f"block={block!r} is not one of {BLOCKS}")
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding={rounding!r} is not one of {ROUNDINGS}")
    x2 = as_2d(x, "NVFP4", transpose)
    rows, cols = x2.shape
    check_blocks(rows, cols, "NVFP4", BLOCK if block == "16x16" else 1, BLOCK)
    shape = x2.shape if transpose else x.shape
    lead = shape[:-1]

    def approximated(x: torch.Tensor) -> torch.Tensor:
        x2 = as_2d(x, "NVFP4", transpose)
        return (rht.transform(x2) if hadamard else x2).float().reshape(shape)

    source = straight_through.source_of(x, approximated)
    x2 = x2.detach()  # the codes and scales are values, not functions of x (see `source`)

    xf = (rht.transform(x2) if hadamard else x2).float()
    if amax is None:
        amax = xf.abs().amax() if xf.numel() else xf.new_zeros(())
    amax = amax.detach().float().reshape(())

    tiles = (
        xf.abs().reshape(rows, cols // BLOCK, BLOCK).amax(-1)
        if xf.numel()
        else xf.new_zeros(rows, cols // BLOCK)
    )
    if block == "16x16" and rows:
        tiles = tiles.reshape(rows // BLOCK, BLOCK, -1).amax(1).repeat_interleave(BLOCK, dim=0)
    scale = block_scales(tiles, amax)

    v = xf.reshape(rows, cols // BLOCK, BLOCK) * encode_multipliers(scale, amax).unsqueeze(-1)
    v = v.clamp(-e2m1.MAX, e2m1.MAX)
    if rounding == "nearest":
        codes = e2m1.round_nearest(v)
    else:
        rand = torch.rand(v.shape, generator=generator, device=v.device, dtype=torch.float32)
        codes = e2m1.round_stochastic(v, rand)
    data = e2m1.pack(codes.reshape(rows, cols))
    return NVFP4Tensor(
        data=data.reshape(*lead, cols // 2),
        scale=scale.reshape(*lead, cols // BLOCK),
        amax=amax,
        shape=torch.Size(shape),
        block=block,
        hadamard=hadamard,
        source=source,
    )
