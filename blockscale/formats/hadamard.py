"""The 16x16 random Hadamard transform (RHT) applied to the wgrad operands.

H = (1/4) * diag(s) @ H16, with H16 the Sylvester Hadamard matrix and s a fixed sign
vector shared by every layer and rank. H is orthogonal, so transforming both operands of
grad_weight = grad_output_t @ input_t.T along the token dimension leaves their product
unchanged while spreading outliers across each 16-wide block before quantization.

Rounding: the transform is defined as the exact sum of the 16 products (each product of a
value and +-1/4 is exact), rounded once to FP32 and then to BF16. Any FP32 accumulation
order gives the same FP32 sum whenever the partial sums are exact, which holds unless one
block spans more than ~2^16 in magnitude; the reference computes the sum in FP64 so that
the definition has no order in it at all.
"""

import torch

DEFAULT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
SIZE = 16


def sylvester(n: int = SIZE) -> torch.Tensor:
    """The n x n Sylvester Hadamard matrix of +-1 (n a power of two), FP32."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"n={n} is not a power of two (Sylvester construction)")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


def matrix(
    signs: tuple[int, ...] = DEFAULT_SIGNS,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """H = (1/4) * diag(signs) @ H16 (entries +-1/4, exact in every float dtype).

    >>> H = bs.hadamard.matrix()
    >>> H.shape, H.abs().unique().tolist()
    (torch.Size([16, 16]), [0.25])
    >>> torch.equal(H @ H.T, torch.eye(16))  # orthonormal, exactly
    True
    """
    if len(signs) != SIZE or any(s not in (1, -1) for s in signs):
        raise ValueError(f"signs must be {SIZE} values of +1 or -1, got {signs}")
    # Built on the device from arange and bit arithmetic, with no host-to-device copy, so
    # that it can run inside CUDA graph capture: H16[i, j] = (-1)^popcount(i & j).
    i = torch.arange(SIZE, device=device)
    both = i[:, None] & i[None, :]
    parity = (both ^ (both >> 1) ^ (both >> 2) ^ (both >> 3)) & 1
    negative_rows = sum(1 << k for k, s in enumerate(signs) if s < 0)
    row_sign = 1 - 2 * ((negative_rows >> i) & 1)
    h = (row_sign[:, None] * (1 - 2 * parity)).to(torch.float32) * 0.25
    return h.to(dtype)


def transform(x: torch.Tensor, signs: tuple[int, ...] = DEFAULT_SIGNS) -> torch.Tensor:
    """Apply y = x16 @ H to every run of 16 values along the last dim; returns BF16.

    >>> x = torch.randn(2, 32)
    >>> y = bs.hadamard.transform(x)
    >>> y.shape, y.dtype
    (torch.Size([2, 32]), torch.bfloat16)
    """
    if x.dim() == 0 or x.shape[-1] % SIZE:
        raise ValueError(
            f"last dim {tuple(x.shape)[-1:]} is not a multiple of {SIZE} (Hadamard block)"
        )
    h = matrix(signs, torch.float64, x.device)
    blocks = x.to(torch.float64).reshape(*x.shape[:-1], -1, SIZE)
    return bf16_values((blocks @ h).reshape(x.shape).to(torch.float32)).to(torch.bfloat16)


def bf16_values(y: torch.Tensor) -> torch.Tensor:
    """FP32 `y` rounded to the nearest BF16 value (ties to even; NaN stays NaN), still FP32:
    the values `y.to(torch.bfloat16)` holds, computed on the bits. torch 2.11's CPU Inductor
    drops a BF16 round trip inside a fused kernel (`y.to(bfloat16).float()` reads `y`), even
    with `emulate_precision_casts` (2.13 keeps it), so a compiled CPU reference would quantize
    the unrounded transform; integer ops it cannot drop. Cast to BF16 afterwards, exactly."""
    bits = y.view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # the bits as an unsigned value
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    bits = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)  # no wrap-around
    return torch.where(torch.isnan(y), y, bits.view(torch.float32))
