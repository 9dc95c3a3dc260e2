"""E2M1 codes: nearest and stochastic rounding at every edge, decoding, nibble packing."""

import numpy as np
import pytest
import torch

from blockscale.formats import e2m1
from tests import reference_scalar as ref


def f32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def below(x: float) -> float:
    return float(np.nextafter(np.float32(x), np.float32(-np.inf)))


def above(x: float) -> float:
    return float(np.nextafter(np.float32(x), np.float32(np.inf)))


def test_decode_table():
    expected = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    got = e2m1.decode(torch.arange(16, dtype=torch.uint8))
    torch.testing.assert_close(got, f32(expected), atol=0, rtol=0)
    assert torch.signbit(got[8]) and not torch.signbit(got[0])


def test_grid_values_encode_to_themselves():
    grid = [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    pos = e2m1.round_nearest(f32(grid))
    neg = e2m1.round_nearest(-f32(grid[1:]))
    torch.testing.assert_close(pos, torch.arange(8, dtype=torch.uint8), atol=0, rtol=0)
    torch.testing.assert_close(neg, torch.arange(9, 16, dtype=torch.uint8), atol=0, rtol=0)


# Each rounding edge of NUMERICS.md's table, with the code just below it, at it (the tie,
# which goes to the even code: 0, 1, 2, 4 have mantissa bit 0) and just above it.
EDGES = [
    # edge, below, at, above
    (0.25, 0, 0, 1),
    (0.75, 1, 2, 2),
    (1.25, 2, 2, 3),
    (1.75, 3, 4, 4),
    (2.5, 4, 4, 5),
    (3.5, 5, 6, 6),
    (5.0, 6, 6, 7),
]


@pytest.mark.parametrize("edge,code_below,code_at,code_above", EDGES)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_round_nearest_edges(edge, code_below, code_at, code_above, sign):
    values = f32([below(edge), edge, above(edge)]) * sign
    expected = torch.tensor([code_below, code_at, code_above], dtype=torch.uint8)
    if sign < 0:
        expected |= 8
    torch.testing.assert_close(e2m1.round_nearest(values), expected, atol=0, rtol=0)
    model = [ref.e2m1_code_nearest(float(v)) for v in values]
    assert model == expected.tolist()


def test_round_nearest_saturates():
    values = f32([above(6.0), 6.5, 1e30, float("inf"), -7.0, -float("inf")])
    expected = torch.tensor([7, 7, 7, 7, 15, 15], dtype=torch.uint8)
    torch.testing.assert_close(e2m1.round_nearest(values), expected, atol=0, rtol=0)


def test_signed_zeros():
    # Exact zeros of either sign are code 0; a negative value that rounds to zero is code 8.
    values = f32([0.0, -0.0, 0.1, -0.1, -0.25, -1e-40, -below(0.25)])
    expected = torch.tensor([0, 0, 0, 8, 8, 8, 8], dtype=torch.uint8)
    torch.testing.assert_close(e2m1.round_nearest(values), expected, atol=0, rtol=0)
    assert (e2m1.decode(expected) == 0).all()


def test_round_nearest_matches_model_on_random_values():
    g = torch.Generator().manual_seed(0)
    v = torch.randn(4000, generator=g) * 3
    expected = torch.tensor([ref.e2m1_code_nearest(float(x)) for x in v], dtype=torch.uint8)
    torch.testing.assert_close(e2m1.round_nearest(v), expected, atol=0, rtol=0)


def test_pack_hand_checked_bytes():
    codes = torch.tensor([[1, 2, 15, 8, 0, 7]], dtype=torch.uint8)
    # element 2i in the low nibble: (1 | 2<<4), (15 | 8<<4), (0 | 7<<4)
    expected = torch.tensor([[0x21, 0x8F, 0x70]], dtype=torch.uint8)
    torch.testing.assert_close(e2m1.pack(codes), expected, atol=0, rtol=0)
    torch.testing.assert_close(e2m1.unpack(expected), codes, atol=0, rtol=0)


def test_pack_round_trip_3d():
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (3, 5, 32), generator=g, dtype=torch.uint8)
    packed = e2m1.pack(codes)
    assert packed.shape == (3, 5, 16)
    torch.testing.assert_close(e2m1.unpack(packed), codes, atol=0, rtol=0)


def test_pack_odd_length_raises():
    with pytest.raises(ValueError, match="even"):
        e2m1.pack(torch.zeros(3, 5, dtype=torch.uint8))


def test_stochastic_on_grid_and_saturated_values_are_exact():
    grid = [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    values = f32(grid + [-g for g in grid[1:]] + [6.5, -100.0])
    expected = torch.tensor(list(range(8)) + list(range(9, 16)) + [7, 15], dtype=torch.uint8)
    for r in (0.0, 0.5, below(1.0)):
        got = e2m1.round_stochastic(values, torch.full_like(values, r))
        torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_stochastic_threshold_hand_checked():
    # |v| = 0.75 sits halfway between 0.5 (index 1) and 1 (index 2): up iff r < 0.5.
    # |v| = 4.5 is a quarter of the way from 4 (index 6) to 6 (index 7): up iff r < 0.25.
    v = f32([0.75, 0.75, -0.75, 4.5, 4.5, 0.1, 0.1])
    r = f32([below(0.5), 0.5, 0.25, below(0.25), 0.25, 0.19, 0.21])
    expected = torch.tensor([2, 1, 10, 7, 6, 1, 0], dtype=torch.uint8)  # 0.1 = 0.2 of 0 -> 0.5
    torch.testing.assert_close(e2m1.round_stochastic(v, r), expected, atol=0, rtol=0)


def test_stochastic_matches_model_with_given_uniforms():
    g = torch.Generator().manual_seed(2)
    v = torch.randn(3000, generator=g) * 3
    r = torch.rand(3000, generator=g)
    expected = [ref.e2m1_code_stochastic(float(a), float(b)) for a, b in zip(v, r)]
    torch.testing.assert_close(
        e2m1.round_stochastic(v, r), torch.tensor(expected, dtype=torch.uint8), atol=0, rtol=0
    )


def test_stochastic_rand_shape_mismatch_raises():
    with pytest.raises(ValueError, match="rand shape"):
        e2m1.round_stochastic(torch.zeros(4), torch.zeros(5))
