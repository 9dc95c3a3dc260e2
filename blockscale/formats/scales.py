"""Block scale codecs: saturating E4M3 (NVFP4) and power-of-two E8M0 (MXFP8)."""

import torch

E4M3_MAX = 448.0
E8M0_BIAS = 127
E8M0_NAN = 255
FLT_MAX = torch.finfo(torch.float32).max


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """FP32 -> float8_e4m3fn, round to nearest even, saturating at +-448.

    The clamp makes the result independent of what the cast does out of range, which differs
    across devices and torch versions (torch 2.13's CPU cast saturates: 500 and inf give 448;
    one that does not saturate can only give NaN, E4M3 having no infinity). NaN stays NaN.
    """
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def exp2_int(e: torch.Tensor) -> torch.Tensor:
    """2**e as FP32 for integer e in [-149, 127], built from its bits (no libm rounding)."""
    e = e.to(torch.int32)
    normal = ((e + 127).clamp(min=1) << 23).view(torch.float32)
    subnormal = (torch.ones_like(e) << (e + 149).clamp(0, 22)).view(torch.float32)
    return torch.where(e >= -126, normal, subnormal)


def ceil_log2(p: torch.Tensor) -> torch.Tensor:
    """Exact ceil(log2(p)) of positive finite FP32 values, as int32 (reads the exponent bits,
    so powers of two are exact where a float log2 could land one ulp off)."""
    mantissa, exponent = torch.frexp(p)  # p = mantissa * 2**exponent, mantissa in [0.5, 1)
    return torch.where(mantissa == 0.5, exponent - 1, exponent).to(torch.int32)


def e8m0_from_exponent(e: torch.Tensor, nan: torch.Tensor | None = None) -> torch.Tensor:
    """int exponents in [-127, 127] -> float8_e8m0fnu (code e + 127); `nan` marks NaN codes."""
    code = (e.to(torch.int32) + E8M0_BIAS).to(torch.uint8)
    if nan is not None:
        code = torch.where(nan, torch.full_like(code, E8M0_NAN), code)
    return code.view(torch.float8_e8m0fnu)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """float8_e8m0fnu -> FP32 (code 255 -> NaN), without relying on a dtype cast kernel."""
    code = scale.view(torch.uint8).to(torch.int32)
    value = exp2_int(code - E8M0_BIAS)
    return torch.where(code == E8M0_NAN, torch.full_like(value, float("nan")), value)
