"""Properties of the NumPy references themselves (they are the oracle of every GPU test)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
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
    np.testing.assert_allclose(
        np.hypot(z[..., 0:r:2], z[..., 1:r:2]), np.hypot(x[..., 0:r:2], x[..., 1:r:2])
    )


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


# ---- mRoPE -------------------------------------------------------------------------------------


def hf_style_mrope(table, pos3, section, interleaved):
    """cos, sin (n, R/2) built the way Hugging Face's Qwen2-VL / Qwen3-VL code describes it:
    per-axis tables (3, n, R/2), then chunks by section (Qwen2-VL) or a stride-3 overlay
    (Qwen3-VL)."""
    half = table.shape[1] // 2
    per_axis = np.asarray(table, np.float64)[np.asarray(pos3)]  # (3, n, R)
    out = []
    for part in (per_axis[..., :half], per_axis[..., half:]):
        if interleaved:
            x = part[0].copy()
            x[:, 1 : 3 * section[1] : 3] = part[1][:, 1 : 3 * section[1] : 3]
            x[:, 2 : 3 * section[2] : 3] = part[2][:, 2 : 3 * section[2] : 3]
        else:
            bounds = np.cumsum([0, *section])
            x = np.concatenate([part[a][:, bounds[a] : bounds[a + 1]] for a in range(3)], axis=1)
        out.append(x)
    return out


@given(
    seed=seeds,
    interleaved=st.booleans(),
    section=st.sampled_from([(16, 24, 24), (24, 20, 20), (2, 3, 3), (0, 4, 4), (8, 0, 0)]),
)
def test_mrope_matches_the_hugging_face_layouts(seed, interleaved, section):
    rng = np.random.default_rng(seed)
    half = sum(section)
    table = cos_sin_cache(64, 2 * half)
    pos3 = rng.integers(0, 64, (3, 7))
    cos, sin = reference.mrope_cos_sin(table, pos3, section, interleaved)
    want_cos, want_sin = hf_style_mrope(table, pos3, section, interleaved)
    np.testing.assert_array_equal(cos, want_cos)
    np.testing.assert_array_equal(sin, want_sin)


@given(seed=seeds, interleaved=st.booleans())
def test_mrope_with_equal_positions_is_plain_rope(seed, interleaved):
    """A text token has one position on all three axes: mRoPE is the 1-D rotation."""
    rng = np.random.default_rng(seed)
    table = cos_sin_cache(100, 128)
    p = rng.integers(0, 100, 9)
    cos, sin = reference.mrope_cos_sin(table, np.stack([p, p, p]), (24, 20, 20), interleaved)
    want_cos, want_sin = reference.split_cos_sin(table[p])
    np.testing.assert_array_equal(cos, want_cos)
    np.testing.assert_array_equal(sin, want_sin)


def test_mrope_rows_give_each_axis_its_section():
    for interleaved in (False, True):
        rows = reference.mrope_rows(64, (24, 20, 20), interleaved)
        assert np.bincount(rows, minlength=3).tolist() == [24, 20, 20]
    assert reference.mrope_rows(8, (2, 3, 3)).tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
    assert reference.mrope_rows(8, (2, 3, 3), True).tolist() == [0, 1, 2, 0, 1, 2, 0, 1]


@given(seed=seeds, dtype=st.sampled_from([ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, np.int8]))
def test_quantize_rows_maps_each_rows_amax_onto_the_largest_code(seed, dtype):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((5, 3, 16)) * rng.uniform(1e-3, 1e3, (5, 3, 1))
    stored, scale = reference.quantize_rows(x, dtype)
    code = reference.MAX_CODE[np.dtype(dtype)]
    np.testing.assert_allclose(scale, np.abs(x).max(-1) / code, rtol=1e-12)
    # the largest element lands on the largest code, with its sign
    top = np.abs(x).argmax(-1)[..., None]
    got = np.take_along_axis(stored.astype(np.float64), top, -1)[..., 0]
    np.testing.assert_array_equal(np.abs(got), code)
    # and every element comes back within half a step of the type at its magnitude
    err = np.abs(reference.dequantize_rows(stored, scale) - x)
    if dtype == np.int8:
        bound = 0.5 * scale[..., None]
    else:  # half an ulp of the mantissa, or half the smallest subnormal step
        mant, sub = (3, 2.0**-9) if dtype == ml_dtypes.float8_e4m3fn else (2, 2.0**-16)
        bound = np.maximum(2.0 ** -(mant + 1) * np.abs(x), 0.5 * sub * scale[..., None])
    assert (err <= bound * (1 + 1e-9)).all()


def test_quantize_rows_edge_rows():
    x = np.array([[1.0, -2.0, np.nan, 0.5], [0.0, 0.0, 0.0, 0.0], [np.inf, 1.0, 2.0, 3.0]])
    s8, sc8 = reference.quantize_rows(x, np.int8)
    assert s8.tolist() == [[64, -127, 0, 32], [0, 0, 0, 0], [0, 0, 0, 0]]  # NaN -> 0 in int8
    np.testing.assert_allclose(sc8[:2], [2.0 / 127, 1e-6 / 127])
    assert np.isinf(sc8[2])
    s, _sc = reference.quantize_rows(x, ml_dtypes.float8_e4m3fn)
    f = s.astype(np.float64)
    assert f[0].tolist()[:2] == [224.0, -448.0] and np.isnan(f[0, 2])  # NaN stays NaN in fp8
    assert np.isnan(f[2, 0]) and (f[2, 1:] == 0).all()


def test_heads_view_is_a_view_of_any_rows():
    """``(T, H * D)`` rows as ``(T, H, D)`` without a copy, for contiguous and strided rows (the
    reference writes ``query_out`` / in-place results through it); rows that are not whole heads
    raise."""
    heads_view = reference.heads_view
    x = np.arange(2 * 24, dtype=np.float32).reshape(2, 24)
    v = heads_view(x, 8)
    v[1, 2, 7] = -1
    assert v.shape == (2, 3, 8) and x[1, 23] == -1
    strided = np.arange(4 * 64, dtype=np.float16).reshape(4, 64)[::2, :48]
    w = heads_view(strided, 16)
    assert np.shares_memory(w, strided)
    np.testing.assert_array_equal(w.reshape(2, 48), strided)
    with pytest.raises(ValueError, match="not whole heads of 5"):
        heads_view(x, 5)
