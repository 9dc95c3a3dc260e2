"""Input rules shared by the quantizers: errors name the value and the rule."""

import torch

from blockscale._registry import tracing

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


def check_amax(amax: object, fmt: str) -> None:
    """A given tensor amax: a float32 tensor of one value, not negative (NaN and Inf are
    allowed: they mark non-finite input). The sign is read only from CPU tensors outside
    a trace (torch.compile, or fake tensors), where reading it costs no device synchronization."""
    if not isinstance(amax, torch.Tensor):
        raise TypeError(
            f"{fmt} amax must be a float32 torch.Tensor holding one value, got "
            f"{type(amax).__name__} {amax!r} (wrap it: torch.tensor(value))"
        )
    if amax.numel() != 1:
        raise ValueError(
            f"{fmt} amax must hold one value (the tensor's max |x|), got shape {tuple(amax.shape)}"
        )
    if amax.dtype != torch.float32:
        raise ValueError(
            f"{fmt} amax dtype {amax.dtype} is not float32 (the global scale is computed in FP32 "
            "from the exact amax)"
        )
    if amax.device.type == "cpu" and not tracing() and bool(amax < 0):
        raise ValueError(f"{fmt} amax={amax.item()} is negative: an amax is a max of |x|")


def check_codes(codes: torch.Tensor) -> None:
    """E2M1 codes to pack: uint8 values 0..15 (4 bits each; a larger one would spill into its
    neighbour's nibble). Values are read only from CPU tensors outside a trace."""
    if codes.dtype != torch.uint8:
        raise ValueError(f"E2M1 codes must be uint8, got {codes.dtype}")
    if codes.device.type == "cpu" and not tracing() and codes.numel():
        top = int(codes.max())
        if top > 15:
            raise ValueError(f"E2M1 code {top} is above 15: a code is 4 bits (sign | index 0-7)")


def check_flags(fmt: str, **flags: object) -> None:
    """Switches must be real bools: a string such as "False" is truthy and would switch on."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{fmt} quantize: {name}={value!r} is not True or False")
