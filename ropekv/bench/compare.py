"""Comparison of two runs' outputs, shared by ``ropekv bench`` (each peer against ropekv before
timing) and ``ropekv check`` (each kernel against the NumPy reference). Tolerances follow
``tests/tolerance.py``: fp16 / bf16 within 1e-3 / 8e-3 relative, fp8 codes equal or adjacent;
matrix products (the fused QKV projection) by relative Frobenius error, 1e-2.
"""

from __future__ import annotations

import numpy as np

from ropekv.bench.arrays import BF16, FP8, to_numpy

RTOL = {np.dtype(np.float16): 1e-3, BF16: 8e-3, np.dtype(np.float32): 1e-5}
ATOL = {np.dtype(np.float16): 1e-5, BF16: 1e-5, np.dtype(np.float32): 1e-7}
GEMM_RTOL = 1e-2


def _fp8_ordinal(codes):
    c = codes.view(np.uint8).astype(np.int32)
    mag = c & 0x7F
    return np.where(c & 0x80, -mag, mag)


def compare(actual, expected, what="output", mode="elementwise"):
    """Compare two host arrays; return None when they agree, else a one-line reason.

    ``mode="elementwise"``: per-dtype tolerances (fp8 codes equal or adjacent; fp16 / bf16 within
    1e-3 / 8e-3 relative, NaN where the expected is NaN; integers exact). ``mode="gemm"``: relative
    Frobenius error at most 1e-2 (different accumulation orders of a long dot product)."""
    actual, expected = to_numpy(actual), to_numpy(expected)
    if actual.shape != expected.shape:
        return f"{what}: shape {actual.shape} != {expected.shape}"
    if actual.dtype != expected.dtype:
        return f"{what}: dtype {actual.dtype} != {expected.dtype}"
    if actual.size == 0:
        return None
    if mode == "gemm":
        a, e = actual.astype(np.float64), expected.astype(np.float64)
        if not np.array_equal(np.isnan(a), np.isnan(e)):
            return f"{what}: NaN positions differ"
        a, e = np.nan_to_num(a), np.nan_to_num(e)
        err = np.linalg.norm(a - e) / max(np.linalg.norm(e), 1e-30)
        return None if err <= GEMM_RTOL else f"{what}: relative error {err:.2e} > {GEMM_RTOL}"
    if expected.dtype in FP8:
        a, e = actual.astype(np.float32), expected.astype(np.float32)
        nan = np.isnan(e)
        if not np.array_equal(np.isnan(a), nan):
            return f"{what}: NaN positions differ"
        diff = np.abs(_fp8_ordinal(actual) - _fp8_ordinal(expected))
        diff = np.where(nan | ((a == 0) & (e == 0)), 0, diff)
        bad = np.argwhere(diff > 1)
        if bad.size:
            i = tuple(bad[0])
            return (
                f"{what}: {len(bad)} of {e.size} fp8 codes differ by more than one, first at "
                f"{i}: {a[i]} vs {e[i]}"
            )
        return None
    if expected.dtype.kind in "iub":
        return None if np.array_equal(actual, expected) else f"{what}: integer values differ"
    a, e = actual.astype(np.float64), expected.astype(np.float64)
    nan = np.isnan(e)
    if not np.array_equal(np.isnan(a), nan):
        return f"{what}: NaN positions differ"
    a, e = np.where(nan, 0, a), np.where(nan, 0, e)
    tol = ATOL.get(expected.dtype, 0.0) + RTOL.get(expected.dtype, 1e-6) * np.abs(e)
    bad = np.argwhere(np.abs(a - e) > tol)
    if bad.size:
        i = tuple(bad[0])
        return (
            f"{what}: {len(bad)} of {e.size} values out of tolerance, first at {i}: "
            f"{a[i]} vs {e[i]}"
        )
    return None


def compare_all(actual, expected, mode="elementwise"):
    """Compare the outputs both dicts hold (name -> array); None or the first reason."""
    shared = [k for k in expected if k in actual]
    if not shared:
        return "no output in common to compare"
    for name in shared:
        reason = compare(actual[name], expected[name], name, mode)
        if reason:
            return reason
    return None
