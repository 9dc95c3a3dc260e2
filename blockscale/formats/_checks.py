"""Input rules shared by the quantizers: errors name the value and the rule."""

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def as_2d(x: torch.Tensor, fmt: str, transpose: bool) -> torch.Tensor:
    """Check dtype and rank, flatten leading dims to [M, K], and optionally transpose.

    Any layout is accepted (non-contiguous inputs are read as they are); the returned view
    may be non-contiguous. With transpose=True the result is the [K, M] view of the
    flattened tensor: blocks then run along x's first (flattened) dim.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fmt} quantize expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"dtype {x.dtype} is not supported: {fmt} quantizes float32, bfloat16 or float16"
        )
    if x.dim() == 0:
        raise ValueError(f"{fmt} quantize needs at least 1 dim (blocks run along the last one)")
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    return x2.t() if transpose else x2


def check_blocks(rows: int, cols: int, fmt: str, block_rows: int, block_cols: int) -> None:
    if cols % block_cols:
        raise ValueError(
            f"K={cols} is not a multiple of {block_cols} ({fmt} block "
            f"{block_rows}x{block_cols} runs along the quantized dim)"
        )
    if rows % block_rows:
        raise ValueError(
            f"rows={rows} is not a multiple of {block_rows} ({fmt} {block_rows}x{block_cols} "
            "blocks also span rows)"
        )
