"""Block scales to and from the cuBLAS 128x4 blocked layout."""

import pytest
import torch

from blockscale.formats import swizzle


def exact(a: torch.Tensor, b, **kw) -> None:
    torch.testing.assert_close(a, torch.as_tensor(b).to(a.dtype), atol=0, rtol=0, **kw)


def cublas_offset(r: int, c: int, cols_padded: int) -> int:
    """Where scale [r, c] lives, as cuBLAS documents its 1D block scaling factor layout:
    128x4 tiles in row-major tile order, inside a tile (r % 32) * 16 + (r % 128) // 32 * 4
    + c % 4."""
    tile = (r // 128) * (cols_padded // 4) + c // 4
    return tile * 512 + (r % 32) * 16 + (r % 128) // 32 * 4 + c % 4


def random_scales(rows: int, cols: int, dtype=torch.uint8, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(1, 255, (rows, cols), generator=g, dtype=torch.uint8)
    return raw.view(dtype)


def test_padded_shape():
    assert swizzle.padded_shape(1, 1) == (128, 4)
    assert swizzle.padded_shape(128, 4) == (128, 4)
    assert swizzle.padded_shape(129, 5) == (256, 8)
    assert swizzle.padded_shape(0, 0) == (0, 0)


def test_hand_checked_positions():
    # [128, 4]: element (33, 2) -> 1 * 16 + 1 * 4 + 2 = 22; (0, 3) -> 3; (127, 0) -> 31*16+3*4.
    s = torch.arange(512, dtype=torch.int32).reshape(128, 4)
    b = swizzle.to_blocked(s)
    assert b[22] == s[33, 2] and b[3] == s[0, 3] and b[508] == s[127, 0]
    # [256, 8]: element (130, 5) is in tile (1, 1) = tile 3, at 2 * 16 + 0 * 4 + 1 -> 1569.
    s = torch.arange(2048, dtype=torch.int32).reshape(256, 8)
    assert swizzle.to_blocked(s)[1569] == s[130, 5]


@pytest.mark.parametrize("rows,cols", [(1, 1), (128, 4), (130, 5), (300, 9), (256, 8), (7, 12)])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float8_e4m3fn, torch.float8_e8m0fnu])
def test_layout_matches_cublas_formula_and_round_trips(rows, cols, dtype):
    s = random_scales(rows, cols, dtype, seed=rows * 31 + cols)
    b = swizzle.to_blocked(s)
    rp, cp = swizzle.padded_shape(rows, cols)
    assert b.dtype == dtype and b.shape == (rp * cp,)
    expected = torch.zeros(rp * cp, dtype=torch.uint8)  # padding is zero
    for r in range(rows):
        for c in range(cols):
            expected[cublas_offset(r, c, cp)] = s.view(torch.uint8)[r, c]
    exact(b.view(torch.uint8), expected)
    back = swizzle.from_blocked(b, rows, cols)
    assert back.dtype == dtype and back.shape == (rows, cols)
    exact(back.view(torch.uint8), s.view(torch.uint8))


def test_non_contiguous_and_wider_dtypes():
    s = random_scales(200, 12, seed=1)[:, ::2]
    assert not s.is_contiguous()
    exact(swizzle.from_blocked(swizzle.to_blocked(s), 200, 6), s)
    f = torch.randn(130, 5, generator=torch.Generator().manual_seed(2))
    exact(swizzle.from_blocked(swizzle.to_blocked(f), 130, 5), f)


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match=r"must be 2-D .* shape \(4,\)"):
        swizzle.to_blocked(torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="has 100 elements, expected 512"):
        swizzle.from_blocked(torch.zeros(100, dtype=torch.uint8), 3, 3)
