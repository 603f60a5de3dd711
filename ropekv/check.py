"""``ropekv check``: every available op on this GPU against the NumPy reference.

For a user validating a new GPU, driver or CUDA version: a fixed set of seeded random cases per op
(small shapes, every cache dtype, both cache layouts, int32 and int64 indices), each run once
through the CUDA kernels on CuPy arrays and once through the NumPy reference (the same public
function given NumPy arrays), every output compared: q outputs, and the whole cache (cache bytes
the op must not touch start random and must come back unchanged). Prints a pass/fail table and
returns 1 on any failure.

The cases are ``ropekv bench``'s workloads at small shapes, built on the host
(:func:`ropekv.bench.check_specs`); the comparison (:func:`compare`, re-exported here from
``ropekv.bench.compare``) is the one the bench applies to every peer before timing it. Tolerances
follow ``tests/tolerance.py``: fp16 / bf16 within 1e-3 / 8e-3 relative, fp8 codes equal or
adjacent; matrix products (the fused QKV projection) by relative Frobenius error, 1e-2.

This module imports ``ropekv.bench``; ``ropekv.bench`` never imports it.
"""

from __future__ import annotations

import sys
import time

from ropekv.bench.arrays import BF16, FP8, gpu_status, to_device, to_numpy
from ropekv.bench.cases import check_specs
from ropekv.bench.compare import ATOL, GEMM_RTOL, RTOL, compare, compare_all
from ropekv.bench.report import format_table
from ropekv.bench.runner import context_lost, progress
from ropekv.bench.workloads import OP_FUNCTIONS

__all__ = [
    "ATOL",
    "BF16",
    "FP8",
    "GEMM_RTOL",
    "RTOL",
    "check",
    "check_cases",
    "compare",
    "compare_all",
    "gpu_status",
    "run_case",
    "to_device",
    "to_numpy",
]


# ---- ropekv check --------------------------------------------------------------------------------


def check_cases(ops=None):
    """The (op, case name, builder) triples of every op that exists in ``ropekv``."""
    return [c for c in check_specs() if ops is None or c[0] in ops]


def run_case(build):
    """Run one check case (a builder of :func:`check_cases`): reference on NumPy, kernel on
    CuPy copies; None when they agree, else the reason."""
    ref_case = build()
    gpu_case = ref_case.to_device()
    ref_case.call(ref_case.a)
    gpu_case.call(gpu_case.a)
    import cupy

    cupy.cuda.Device().synchronize()
    return compare_all(
        gpu_case.outputs(full=True), ref_case.outputs(full=True), ref_case.compare_mode
    )


def check(ops=None, out=None):
    """Run every check case; print the table; return the exit code (0 all passed, 1 otherwise)."""
    out = sys.stdout if out is None else out
    ok, device = gpu_status()
    if not ok:
        print(
            f"ropekv check: {device}; it needs a CUDA GPU (the NumPy reference alone has nothing "
            f"to check against)",
            file=sys.stderr,
        )
        return 1
    import ropekv

    t0 = time.perf_counter()
    missing = [op for op, fns in OP_FUNCTIONS.items() if not hasattr(ropekv, fns[0])]
    cases = check_cases(ops)
    rows, failures, lost = [], 0, None
    for i, (op, name, build) in enumerate(cases):
        progress(i, len(cases), f"check {name}")
        t = time.perf_counter()
        if lost:
            reason = f"not run: the CUDA context was lost in '{lost}'"
        else:
            try:
                reason = run_case(build)
            except Exception as e:  # noqa: BLE001 - a crash is a failure to report, not to hide
                reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                if context_lost(reason):
                    lost = f"{op} {name}"
        ms = (time.perf_counter() - t) * 1e3
        failures += reason is not None
        rows.append([op, name, "FAIL" if reason else "pass", f"{ms:.0f}", reason or ""])
    progress(len(cases), len(cases), "done")
    print(f"ropekv check on {device}", file=out)
    print(format_table(["op", "case", "result", "ms", "detail"], rows), file=out)
    if missing:
        print(f"not in this ropekv (skipped): {', '.join(missing)}", file=out)
    print(
        f"{len(rows) - failures} passed, {failures} failed in {time.perf_counter() - t0:.1f} s",
        file=out,
    )
    return 1 if failures or not rows else 0
