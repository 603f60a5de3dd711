"""Comparisons against the float64 references, one tolerance per output dtype.

fp16/bf16 outputs must be within one unit in the last place of the reference rounded to the same
dtype (relative 1e-3 / 8e-3); fp8 outputs are compared by code, equal or adjacent (a float32
kernel and a float64 reference may round a value at a boundary either way).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

RTOL = {
    np.dtype(np.float16): 1e-3,
    np.dtype(ml_dtypes.bfloat16): 8e-3,
    np.dtype(np.float32): 1e-5,
}
# Below these magnitudes the result is subnormal or a cancellation, and absolute error rules.
ATOL = {
    np.dtype(np.float16): 1e-5,
    np.dtype(ml_dtypes.bfloat16): 1e-5,
    np.dtype(np.float32): 1e-7,
}
FP8 = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2))


def to_numpy(x):
    """Host copy of a NumPy, CuPy, torch or JAX array, fp8 included, keeping its dtype."""
    if isinstance(x, np.ndarray):
        return x
    mod = type(x).__module__
    if mod.startswith("cupy"):
        if x.dtype.itemsize == 1 and x.dtype.kind == "V" or x.dtype in FP8:
            return x.view(np.uint8).get().view(x.dtype)
        return x.get()
    if mod.startswith("torch"):
        import torch

        names = {
            torch.float8_e4m3fn: FP8[0],
            torch.float8_e5m2: FP8[1],
            torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
        }
        t = x.detach().cpu()
        if t.dtype in names:
            bits = torch.uint8 if t.dtype.itemsize == 1 else torch.int16
            return t.view(bits).numpy().view(names[t.dtype])
        return t.numpy()
    return np.asarray(x)


def to_device(x):
    """A CuPy copy of a NumPy array (fp8 through a uint8 view, which CuPy can allocate), of each
    array of a tuple; anything else (None, scalars) is returned as it is."""
    import cupy as cp

    if isinstance(x, tuple):
        return tuple(to_device(y) for y in x)
    if not isinstance(x, np.ndarray):
        return x
    if x.dtype in FP8:
        return cp.asarray(np.ascontiguousarray(x).view(np.uint8)).view(x.dtype)
    return cp.asarray(x)


def fp8_ordinal(codes):
    """Map fp8 bytes to integers in which adjacent representable values differ by 1."""
    c = codes.view(np.uint8).astype(np.int32)
    mag = c & 0x7F
    return np.where(c & 0x80, -mag, mag)


def assert_close(actual, expected, what="output", fp8_atol=0.0):
    """``actual`` (any array) against ``expected`` (NumPy, same dtype, from the reference). fp8:
    codes equal or adjacent, or values within ``fp8_atol`` of each other (the float32 error a
    kernel may have where a value cancels to near zero beside the row's largest, once a dynamic
    scale has stretched that row to the format's range)."""
    actual = to_numpy(actual)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    if expected.dtype in FP8:
        a, e = actual.astype(np.float32), expected.astype(np.float32)
        nan = np.isnan(e)
        assert np.array_equal(np.isnan(a), nan), f"{what}: NaN positions differ"
        diff = np.abs(fp8_ordinal(actual) - fp8_ordinal(expected))
        diff = np.where(nan | ((a == 0) & (e == 0)), 0, diff)  # +0 and -0 are one value
        diff = np.where(np.abs(a - e) <= fp8_atol, 0, diff)
        bad = np.argwhere(diff > 1)
        assert bad.size == 0, (
            f"{what}: {len(bad)} fp8 codes differ by more than one, first at "
            f"{tuple(bad[0])}: {a[tuple(bad[0])]} vs {e[tuple(bad[0])]}"
        )
        return
    if expected.dtype.kind in "iub":
        assert np.array_equal(actual, expected), f"{what}: integer values differ"
        return
    a, e = actual.astype(np.float64), expected.astype(np.float64)
    nan = np.isnan(e)
    assert np.array_equal(np.isnan(a), nan), f"{what}: NaN positions differ"
    a, e = np.where(nan, 0, a), np.where(nan, 0, e)
    tol = ATOL[expected.dtype] + RTOL[expected.dtype] * np.abs(e)
    err = np.abs(a - e)
    bad = np.argwhere(err > tol)
    assert bad.size == 0, (
        f"{what}: {len(bad)} of {e.size} values out of tolerance, first at "
        f"{tuple(bad[0])}: {a[tuple(bad[0])]} vs {e[tuple(bad[0])]}"
    )


def assert_bytes_equal(actual, expected, what="cache"):
    """Byte-identical (for cache regions nothing should have touched)."""
    a = to_numpy(actual).view(np.uint8)
    e = np.ascontiguousarray(expected).view(np.uint8)
    assert np.array_equal(a, e), f"{what}: bytes changed"
