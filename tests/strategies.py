"""Hypothesis strategies shared by the op tests: dtypes, head shapes, positions, strided views."""

from __future__ import annotations

import ml_dtypes
import numpy as np
from hypothesis import strategies as st

INPUT_DTYPES = [np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)]
FP8_DTYPES = [np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)]
HEAD_DIMS = [64, 80, 96, 128, 256]

input_dtypes = st.sampled_from(INPUT_DTYPES)
seeds = st.integers(0, 2**32 - 1)


@st.composite
def cache_dtypes(draw, input_dtype):
    """The input dtype itself or one of the fp8 formats."""
    return draw(st.sampled_from([input_dtype, *FP8_DTYPES]))


@st.composite
def gqa_heads(draw, max_kv=8):
    """(Hq, Hkv) with Hq a multiple of Hkv."""
    hkv = draw(st.sampled_from([h for h in (1, 2, 4, 8) if h <= max_kv]))
    return hkv * draw(st.sampled_from([1, 2, 4])), hkv


@st.composite
def head_and_rotary_dims(draw):
    """(D, R): D from the usual head dims, R even and at most D, sometimes odd R/2."""
    d = draw(st.sampled_from(HEAD_DIMS))
    r = draw(st.sampled_from([d, d, d // 2, 32, 6, 2 * draw(st.integers(1, d // 2))]))
    return d, r


def random(rng, shape, dtype, scale=1.0):
    """Standard-normal values in ``dtype`` (fp8 included), never zeros."""
    return (rng.standard_normal(shape) * scale).astype(dtype)


def packed_views(rng, shape_prefix, heads, d, dtype):
    """Slices of one packed buffer ``(*shape_prefix, sum(heads), d)``, one per head group, the way
    serving engines split a fused qkv projection."""
    buf = random(rng, (*shape_prefix, sum(heads), d), dtype)
    out, start = [], 0
    for h in heads:
        out.append(buf[..., start : start + h, :])
        start += h
    return out
