"""``ropekv check``: every available op on this GPU against the NumPy reference.

For a user validating a new GPU, driver or CUDA version: a fixed set of seeded random cases per op
(small shapes, every cache dtype, both cache layouts, int32 and int64 indices), each run once
through the CUDA kernels on CuPy arrays and once through the NumPy reference (the same public
function given NumPy arrays), every output compared: q outputs, and the whole cache (cache bytes
the op must not touch start random and must come back unchanged). Prints a pass/fail table and
returns 1 on any failure.

The comparison helpers here (:func:`to_numpy`, :func:`compare`) are shared with ``ropekv bench``,
which checks every peer's output against ropekv's before timing it. Tolerances follow
``tests/tolerance.py``: fp16 / bf16 within 1e-3 / 8e-3 relative, fp8 codes equal or adjacent;
matrix products (the fused QKV projection) by relative Frobenius error, 1e-2.
"""

from __future__ import annotations

import sys
import time

import ml_dtypes
import numpy as np

FP8 = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2))
BF16 = np.dtype(ml_dtypes.bfloat16)
RTOL = {np.dtype(np.float16): 1e-3, BF16: 8e-3, np.dtype(np.float32): 1e-5}
ATOL = {np.dtype(np.float16): 1e-5, BF16: 1e-5, np.dtype(np.float32): 1e-7}
GEMM_RTOL = 1e-2


# ---- host copies of any array ------------------------------------------------------------------


def to_numpy(x):
    """Host copy of a NumPy, CuPy or torch array, fp8 and bfloat16 included, keeping its dtype."""
    if x is None or isinstance(x, np.ndarray):
        return x
    mod = type(x).__module__
    if mod.startswith("cupy"):
        dt = np.dtype(x.dtype)
        if dt.itemsize <= 2 and (dt in FP8 or dt == BF16):
            bits = np.uint8 if dt.itemsize == 1 else np.uint16
            return x.view(bits).get().view(dt)
        return x.get()
    if mod.startswith("torch"):
        import torch

        names = {torch.float8_e4m3fn: FP8[0], torch.float8_e5m2: FP8[1], torch.bfloat16: BF16}
        t = x.detach().cpu()
        if t.dtype in names:
            bits = torch.uint8 if t.dtype.itemsize == 1 else torch.int16
            return t.contiguous().view(bits).numpy().view(names[t.dtype])
        return t.numpy()
    return np.asarray(x)


def to_device(a):
    """CuPy copy of a NumPy array (fp8 / bfloat16 through a same-size integer view)."""
    import cupy

    if not isinstance(a, np.ndarray):
        return a
    if a.dtype in FP8 or a.dtype == BF16:
        bits = np.uint8 if a.dtype.itemsize == 1 else np.uint16
        return cupy.asarray(np.ascontiguousarray(a).view(bits)).view(a.dtype)
    return cupy.asarray(a)


# ---- comparison --------------------------------------------------------------------------------


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
            return (f"{what}: {len(bad)} of {e.size} fp8 codes differ by more than one, first at "
                    f"{i}: {a[i]} vs {e[i]}")
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
        return (f"{what}: {len(bad)} of {e.size} values out of tolerance, first at {i}: "
                f"{a[i]} vs {e[i]}")
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


# ---- the device ----------------------------------------------------------------------------------


def gpu_status():
    """(True, device name) when a CUDA device is usable through CuPy, else (False, reason)."""
    try:
        import cupy
    except Exception as e:  # noqa: BLE001 - any import failure means no GPU path
        return False, f"CuPy is not importable ({type(e).__name__}: {e})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001
        return False, f"no CUDA device found ({type(e).__name__}: {e})"
    if n < 1:
        return False, "no CUDA device found"
    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
    return True, name.decode() if isinstance(name, bytes) else str(name)


# ---- ropekv check --------------------------------------------------------------------------------


def check_cases(ops=None):
    """The (op, case name, builder) triples of every op that exists in ``ropekv``."""
    from ropekv import bench

    return [c for c in bench.check_specs() if ops is None or c[0] in ops]


def _run_one(build):
    """Run one check case: reference on NumPy, kernel on CuPy copies; None or the reason."""
    ref_case = build()
    gpu_case = ref_case.to_device()
    ref_case.call(ref_case.a)
    gpu_case.call(gpu_case.a)
    import cupy

    cupy.cuda.Device().synchronize()
    return compare_all(gpu_case.outputs(full=True), ref_case.outputs(full=True),
                       ref_case.compare_mode)


def check(ops=None, out=None):
    """Run every check case; print the table; return the exit code (0 all passed, 1 otherwise)."""
    out = sys.stdout if out is None else out
    ok, device = gpu_status()
    if not ok:
        print(f"ropekv check: {device}; it needs a CUDA GPU (the NumPy reference alone has nothing "
              f"to check against)", file=sys.stderr)
        return 1
    import ropekv
    from ropekv import bench

    t0 = time.perf_counter()
    missing = [op for op, fns in bench.OP_FUNCTIONS.items() if not hasattr(ropekv, fns[0])]
    cases = check_cases(ops)
    rows, failures, lost = [], 0, None
    for i, (op, name, build) in enumerate(cases):
        bench.progress(i, len(cases), f"check {name}")
        t = time.perf_counter()
        if lost:
            reason = f"not run: the CUDA context was lost in '{lost}'"
        else:
            try:
                reason = _run_one(build)
            except Exception as e:  # noqa: BLE001 - a crash is a failure to report, not to hide
                reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                if bench.context_lost(reason):
                    lost = f"{op} {name}"
        ms = (time.perf_counter() - t) * 1e3
        failures += reason is not None
        rows.append([op, name, "FAIL" if reason else "pass", f"{ms:.0f}", reason or ""])
    bench.progress(len(cases), len(cases), "done")
    print(f"ropekv check on {device}", file=out)
    print(bench.format_table(["op", "case", "result", "ms", "detail"], rows), file=out)
    if missing:
        print(f"not in this ropekv (skipped): {', '.join(missing)}", file=out)
    print(f"{len(rows) - failures} passed, {failures} failed in "
          f"{time.perf_counter() - t0:.1f} s", file=out)
    return 1 if failures or not rows else 0
