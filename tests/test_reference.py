"""Properties of the NumPy references themselves (they are the oracle of every GPU test)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from ropekv import reference
from ropekv.rope import cos_sin_cache
from tests.strategies import seeds

dims = st.sampled_from([2, 8, 64, 128])


def angles(rng, half, n=5):
    theta = rng.uniform(-50, 50, (n, 1, half))
    return np.cos(theta), np.sin(theta)


@given(seed=seeds, r=dims, is_neox=st.booleans())
def test_position_zero_is_identity(seed, r, is_neox):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((5, 3, r + 4))
    table = cos_sin_cache(4, r)
    cos, sin = reference.split_cos_sin(table[0])
    np.testing.assert_array_equal(reference.rope(x, cos, sin, is_neox), x)


@given(seed=seeds, r=dims, is_neox=st.booleans())
def test_rotate_by_p_then_minus_p_returns_input(seed, r, is_neox):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((5, 3, r + 6))
    cos, sin = angles(rng, r // 2)
    back = reference.rope(reference.rope(x, cos, sin, is_neox), cos, -sin, is_neox)
    np.testing.assert_allclose(back, x, rtol=0, atol=1e-12)


@given(seed=seeds, r=dims)
def test_pair_norms_are_preserved_and_tail_passes_through(seed, r):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((5, 3, r + 6))
    cos, sin = angles(rng, r // 2)
    h = r // 2
    y = reference.rope(x, cos, sin, True)
    np.testing.assert_allclose(np.hypot(y[..., :h], y[..., h:r]), np.hypot(x[..., :h], x[..., h:r]))
    np.testing.assert_array_equal(y[..., r:], x[..., r:])
    z = reference.rope(x, cos, sin, False)
    np.testing.assert_allclose(np.hypot(z[..., 0:r:2], z[..., 1:r:2]),
                               np.hypot(x[..., 0:r:2], x[..., 1:r:2]))


@given(seed=seeds, r=dims)
def test_neox_and_interleaved_agree_under_the_pair_permutation(seed, r):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((5, 3, r))
    cos, sin = angles(rng, r // 2)
    # interleaved position 2i <-> half-split position i, 2i + 1 <-> i + R/2
    perm = np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2)])
    neox = reference.rope(x[..., perm], cos, sin, True)
    inter = reference.rope(x, cos, sin, False)
    np.testing.assert_allclose(inter[..., perm], neox, rtol=0, atol=1e-12)


def test_fp8_rounding_saturates_and_rounds_to_nearest_even():
    e4m3 = ml_dtypes.float8_e4m3fn
    x = np.array([500.0, -1e9, np.inf, -np.inf, 448.0, 1.0625, 1.1875, np.nan])
    got = reference.to_dtype(x, e4m3).astype(np.float64)
    # 1.0625 is halfway between 1.0 and 1.125: ties to even (1.0); 1.1875 -> 1.25
    np.testing.assert_array_equal(got[:7], [448, -448, 448, -448, 448, 1.0, 1.25])
    assert np.isnan(got[7])
    e5m2 = reference.to_dtype(np.array([1e6, -1e6]), ml_dtypes.float8_e5m2).astype(np.float64)
    np.testing.assert_array_equal(e5m2, [57344, -57344])
