"""CPU tests of the RoPE cos/sin tables in ``ropekv.rope``."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from ropekv.rope import cos_sin_cache, freqs_cis_to_cos_sin, inv_frequencies

ATOL = 2e-6  # float32 rounding of values in [-1.4, 1.4]

LLAMA31 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
DEEPSEEK_V3 = {
    "type": "yarn",  # DeepSeek-V3's config.json still uses the legacy key
    "factor": 40,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def closed_form(positions, rotary_dim, base, inv_freq=None, scale=1.0):
    """Build a reference table from explicit angles, column by column."""
    positions = np.asarray(positions, dtype=np.float64)
    if inv_freq is None:
        inv_freq = [base ** (-2.0 * i / rotary_dim) for i in range(rotary_dim // 2)]
    table = np.empty((positions.size, rotary_dim), dtype=np.float64)
    for i, f in enumerate(inv_freq):
        table[:, i] = scale * np.cos(positions * f)
        table[:, rotary_dim // 2 + i] = scale * np.sin(positions * f)
    return table


def llama3_reference(rotary_dim, base, cfg):
    """Meta's per-frequency ``apply_scaling`` loop from the Llama 3.1 reference code."""
    factor, low, high = cfg["factor"], cfg["low_freq_factor"], cfg["high_freq_factor"]
    old_len = cfg["original_max_position_embeddings"]
    out = []
    for i in range(rotary_dim // 2):
        freq = 1.0 / base ** (2 * i / rotary_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            out.append(freq)
        elif wavelen > old_len / low:
            out.append(freq / factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return out


def yarn_reference(rotary_dim, base, cfg):
    """YaRN (NTK-by-parts) written per dimension, following the paper's definitions."""
    factor, orig = cfg["factor"], cfg["original_max_position_embeddings"]
    truncate = cfg.get("truncate", True)

    def dim_for(rotations):
        # Solve orig / wavelength(d) == rotations for d, with wavelength(d) = 2π base^(2d/R).
        return rotary_dim / 2 * math.log(orig / (2 * math.pi * rotations), base)

    low, high = dim_for(cfg.get("beta_fast", 32)), dim_for(cfg.get("beta_slow", 1))
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    out = []
    for i in range(rotary_dim // 2):
        freq = base ** (-2 * i / rotary_dim)
        interp_weight = min(max((i - low) / (high - low), 0.0), 1.0)
        out.append(interp_weight * freq / factor + (1 - interp_weight) * freq)
    return out


# --------------------------------------------------------------------------- plain tables


@pytest.mark.parametrize(
    ("max_position", "rotary_dim", "base"),
    [(1, 2, 10000.0), (7, 4, 10000.0), (257, 64, 10000.0), (4096, 128, 500000.0), (33, 96, 1e6)],
)
def test_plain_table_matches_closed_form(max_position, rotary_dim, base):
    table = cos_sin_cache(max_position, rotary_dim, base=base)
    assert table.shape == (max_position, rotary_dim)
    assert table.dtype == np.float32
    assert table.flags.c_contiguous
    expected = closed_form(np.arange(max_position), rotary_dim, base)
    np.testing.assert_allclose(table, expected, rtol=0, atol=ATOL)


def test_position_zero_is_identity_rotation():
    table = cos_sin_cache(16, 128, base=500000.0)
    np.testing.assert_array_equal(table[0, :64], np.ones(64, np.float32))
    np.testing.assert_array_equal(table[0, 64:], np.zeros(64, np.float32))


def test_inv_frequencies_plain():
    inv_freq, attention_factor = inv_frequencies(8, base=10000.0)
    assert inv_freq.dtype == np.float64
    assert inv_freq.shape == (4,)
    np.testing.assert_allclose(inv_freq, [1.0, 0.1, 0.01, 0.001], rtol=1e-15)
    assert attention_factor == 1.0


@pytest.mark.parametrize("xp", [None, np, "numpy"])
def test_numpy_xp_spellings(xp):
    table = cos_sin_cache(5, 8, xp=xp)
    assert type(table) is np.ndarray
    np.testing.assert_array_equal(table, cos_sin_cache(5, 8))


@pytest.mark.parametrize("scaling", [None, {"rope_type": "default"}, {"type": "default"}])
def test_default_scaling_is_plain(scaling):
    np.testing.assert_array_equal(
        cos_sin_cache(64, 32, scaling=scaling), cos_sin_cache(64, 32, scaling=None)
    )


def test_numpy_integer_arguments_accepted():
    table = cos_sin_cache(np.int64(9), np.int32(16), base=np.float32(100.0))
    np.testing.assert_array_equal(table, cos_sin_cache(9, 16, base=100.0))


# --------------------------------------------------------------------------- scaled tables


@pytest.mark.parametrize("factor", [2.0, 4, 8.5])
@pytest.mark.parametrize("key", ["rope_type", "type"])
def test_linear_scaling_is_plain_table_at_scaled_positions(factor, key):
    table = cos_sin_cache(300, 64, base=10000.0, scaling={key: "linear", "factor": factor})
    expected = closed_form(np.arange(300) / factor, 64, 10000.0)
    np.testing.assert_allclose(table, expected, rtol=0, atol=ATOL)


def test_llama31_matches_reference_loop():
    inv_freq, attention_factor = inv_frequencies(128, base=500000.0, scaling=LLAMA31)
    reference = llama3_reference(128, 500000.0, LLAMA31)
    np.testing.assert_allclose(inv_freq, reference, rtol=1e-12)
    assert attention_factor == 1.0

    plain = [500000.0 ** (-2 * i / 128) for i in range(64)]
    kept = sum(math.isclose(a, b, rel_tol=1e-12) for a, b in zip(reference, plain, strict=True))
    divided = sum(
        math.isclose(a, b / 8, rel_tol=1e-12) for a, b in zip(reference, plain, strict=True)
    )
    # The Llama 3.1 config must exercise all three bands: kept, divided and blended.
    assert kept > 0
    assert divided > 0
    assert kept + divided < 64

    positions = np.array([0, 1, 2, 100, 8191, 8192, 50_000, 131_071])
    table = cos_sin_cache(131_072, 128, base=500000.0, scaling=LLAMA31)
    expected = closed_form(positions, 128, 500000.0, inv_freq=reference)
    np.testing.assert_allclose(table[positions], expected, rtol=0, atol=ATOL)


def test_yarn_deepseek_v3_matches_reference():
    inv_freq, attention_factor = inv_frequencies(64, base=10000.0, scaling=DEEPSEEK_V3)
    reference = yarn_reference(64, 10000.0, DEEPSEEK_V3)
    np.testing.assert_allclose(inv_freq, reference, rtol=1e-12)
    # mscale == mscale_all_dim: the magnitude correction cancels (DeepSeek applies it elsewhere).
    assert attention_factor == pytest.approx(1.0)

    table = cos_sin_cache(4096, 64, base=10000.0, scaling=DEEPSEEK_V3)
    expected = closed_form(np.arange(4096), 64, 10000.0, inv_freq=reference)
    np.testing.assert_allclose(table, expected, rtol=0, atol=ATOL)


@pytest.mark.parametrize(
    ("extra", "expected_factor"),
    [
        ({}, 0.1 * math.log(40) + 1),
        (
            {"mscale": 0.707, "mscale_all_dim": 1.0},
            (0.0707 * math.log(40) + 1) / (0.1 * math.log(40) + 1),
        ),
        ({"mscale": 1.0}, 0.1 * math.log(40) + 1),  # mscale alone is ignored, as in transformers
        ({"attention_factor": 1.25, "mscale": 0.5, "mscale_all_dim": 1.0}, 1.25),
    ],
)
def test_yarn_attention_factor_applied(extra, expected_factor):
    cfg = {"rope_type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, **extra}
    inv_freq, attention_factor = inv_frequencies(64, base=10000.0, scaling=cfg)
    assert attention_factor == pytest.approx(expected_factor, rel=1e-12)

    table = cos_sin_cache(512, 64, base=10000.0, scaling=cfg)
    expected = closed_form(np.arange(512), 64, 10000.0, inv_freq=inv_freq, scale=expected_factor)
    np.testing.assert_allclose(table, expected, rtol=0, atol=ATOL)
    norms = table[:, :32].astype(np.float64) ** 2 + table[:, 32:].astype(np.float64) ** 2
    np.testing.assert_allclose(norms, expected_factor**2, rtol=1e-5)


def test_yarn_factor_one_has_unit_attention_factor():
    cfg = {"rope_type": "yarn", "factor": 1.0, "original_max_position_embeddings": 4096}
    inv_freq, attention_factor = inv_frequencies(64, scaling=cfg)
    assert attention_factor == 1.0
    np.testing.assert_allclose(inv_freq, inv_frequencies(64)[0], rtol=1e-15)


def test_yarn_without_truncation_matches_reference():
    cfg = {
        "rope_type": "yarn",
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
    }
    inv_freq, _ = inv_frequencies(64, base=150000.0, scaling=cfg)
    np.testing.assert_allclose(inv_freq, yarn_reference(64, 150000.0, cfg), rtol=1e-12)
    truncated, _ = inv_frequencies(64, base=150000.0, scaling={**cfg, "truncate": True})
    assert not np.allclose(inv_freq, truncated), "truncate must change the ramp"


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"rotary_dim": 7}, ValueError, r"rotary_dim must be a positive even integer, got 7"),
        ({"rotary_dim": 0}, ValueError, r"rotary_dim.*got 0"),
        ({"rotary_dim": -4}, ValueError, r"rotary_dim.*got -4"),
        ({"rotary_dim": 64.0}, TypeError, r"rotary_dim.*float"),
        ({"rotary_dim": True}, TypeError, r"rotary_dim.*bool"),
        ({"max_position": 0}, ValueError, r"max_position must be an integer >= 1, got 0"),
        ({"max_position": -3}, ValueError, r"max_position.*got -3"),
        ({"max_position": 10.5}, TypeError, r"max_position.*float"),
        ({"max_position": "128"}, TypeError, r"max_position.*str"),
        ({"base": 0.0}, ValueError, r"base must be a positive finite number, got 0\.0"),
        ({"base": -10000.0}, ValueError, r"base.*got -10000\.0"),
        ({"base": float("nan")}, ValueError, r"base.*nan"),
        ({"base": "10000"}, TypeError, r"base.*str"),
    ],
)
def test_bad_arguments(kwargs, exc, match):
    args = {"max_position": 16, "rotary_dim": 64, "base": 10000.0, **kwargs}
    with pytest.raises(exc, match=match):
        cos_sin_cache(args["max_position"], args["rotary_dim"], base=args["base"])


@pytest.mark.parametrize("xp", ["torch", "NumPy", "", np.float32, object(), math])
def test_bad_xp(xp):
    with pytest.raises(ValueError, match=r"^xp must be"):
        cos_sin_cache(4, 8, xp=xp)


@pytest.mark.parametrize(
    ("scaling", "exc", "match"),
    [
        ({"rope_type": "dynamic", "factor": 2.0}, ValueError, r"'dynamic'.*'linear'.*'yarn'"),
        ({"type": "longrope"}, ValueError, r"unknown rope_type 'longrope'.*supported"),
        ({"factor": 2.0}, ValueError, r"'rope_type'"),
        ([("rope_type", "linear")], TypeError, r"scaling must be None or"),
        ({"rope_type": "linear"}, ValueError, r"scaling\['factor'\] is required.*'linear'"),
        ({"rope_type": "linear", "factor": 0}, ValueError, r"scaling\['factor'\].*got 0"),
        ({"rope_type": "linear", "factor": "2"}, TypeError, r"scaling\['factor'\].*str"),
        (
            {k: v for k, v in LLAMA31.items() if k != "low_freq_factor"},
            ValueError,
            r"scaling\['low_freq_factor'\] is required.*'llama3'",
        ),
        (
            {k: v for k, v in LLAMA31.items() if k != "original_max_position_embeddings"},
            ValueError,
            r"scaling\['original_max_position_embeddings'\] is required",
        ),
        (
            {**LLAMA31, "low_freq_factor": 4.0, "high_freq_factor": 1.0},
            ValueError,
            r"low_freq_factor.*smaller than.*high_freq_factor",
        ),
        (
            {k: v for k, v in DEEPSEEK_V3.items() if k != "original_max_position_embeddings"},
            ValueError,
            r"scaling\['original_max_position_embeddings'\] is required.*'yarn'",
        ),
        (
            {k: v for k, v in DEEPSEEK_V3.items() if k != "factor"},
            ValueError,
            r"scaling\['factor'\] is required.*'yarn'",
        ),
        ({**DEEPSEEK_V3, "truncate": "no"}, TypeError, r"scaling\['truncate'\]"),
    ],
)
def test_bad_scaling(scaling, exc, match):
    with pytest.raises(exc, match=match):
        cos_sin_cache(16, 64, scaling=scaling)
    with pytest.raises(exc, match=match):
        inv_frequencies(64, scaling=scaling)


# --------------------------------------------------------------------------- MAX freqs_cis


def interleave(table):
    """Build a Modular MAX style freqs_cis table: (cos_i, sin_i) pairs per frequency."""
    half = table.shape[1] // 2
    out = np.empty_like(table)
    out[:, 0::2] = table[:, :half]
    out[:, 1::2] = table[:, half:]
    return out


@pytest.mark.parametrize(("max_position", "rotary_dim"), [(1, 2), (37, 64), (300, 128)])
def test_freqs_cis_round_trip(max_position, rotary_dim):
    table = cos_sin_cache(max_position, rotary_dim, base=500000.0, scaling=LLAMA31)
    freqs_cis = interleave(table.astype(np.float64))
    converted = freqs_cis_to_cos_sin(freqs_cis)
    assert converted.dtype == np.float32
    assert converted.flags.c_contiguous
    np.testing.assert_array_equal(converted, table)
    np.testing.assert_array_equal(freqs_cis, interleave(table))  # input left untouched


def test_freqs_cis_column_mapping_and_dtypes():
    freqs_cis = np.arange(3 * 8, dtype=np.float32).reshape(3, 8)
    expected = np.concatenate([freqs_cis[:, 0::2], freqs_cis[:, 1::2]], axis=1)
    np.testing.assert_array_equal(freqs_cis_to_cos_sin(freqs_cis), expected)
    np.testing.assert_array_equal(freqs_cis_to_cos_sin(freqs_cis.tolist()), expected)
    bf16 = freqs_cis_to_cos_sin(freqs_cis.astype(ml_dtypes.bfloat16))
    assert bf16.dtype == np.float32
    np.testing.assert_array_equal(bf16, expected)
    # A strided (non-contiguous) view converts the same way.
    wide = np.zeros((3, 16), np.float32)
    wide[:, ::2] = freqs_cis
    np.testing.assert_array_equal(freqs_cis_to_cos_sin(wide[:, ::2]), expected)


@pytest.mark.parametrize(
    ("freqs_cis", "exc", "match"),
    [
        (np.zeros(8), ValueError, r"freqs_cis must be a 2-D array.*got shape \(8,\)"),
        (np.zeros((2, 4, 2)), ValueError, r"freqs_cis.*got shape \(2, 4, 2\)"),
        (np.zeros((4, 7)), ValueError, r"freqs_cis.*even.*\(4, 7\)"),
        (np.zeros((4, 8), np.complex64), ValueError, r"freqs_cis.*complex"),
        (np.zeros((4, 8), bool), TypeError, r"freqs_cis.*real numeric dtype"),
    ],
)
def test_freqs_cis_validation(freqs_cis, exc, match):
    with pytest.raises(exc, match=match):
        freqs_cis_to_cos_sin(freqs_cis)
