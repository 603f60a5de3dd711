"""``ropekv info``: versions, device, ropekv's and CuPy's compile caches, which backend would
run."""

from __future__ import annotations

import os
import platform

# CUDA runtime status codes that mean "no GPU here" rather than a fault.
_INSUFFICIENT_DRIVER, _NO_DEVICE = 35, 100
_NO_GPU = "no GPU found (the CUDA driver sees no device)"


def _cuda_version(v):
    """12090 -> '12.9'."""
    return f"{v // 1000}.{v % 1000 // 10}"


def _no_device_reason(cupy, exc):
    """A plain sentence for why ``getDeviceCount`` raised ``exc``."""
    rt = cupy.cuda.runtime
    status = getattr(exc, "status", None)
    try:
        driver = rt.driverGetVersion()  # 0 when no driver is installed at all
    except Exception:  # noqa: BLE001 - any failure here means no driver to ask
        driver = 0
    if driver == 0:
        return "no GPU / no CUDA driver found"
    if status == _INSUFFICIENT_DRIVER:
        runtime = rt.runtimeGetVersion()
        fix = (
            "install ropekv[cuda12] instead of ropekv[cuda13], or update the driver"
            if driver // 1000 < 13 <= runtime // 1000
            else "update the driver"
        )
        return (
            f"the CUDA driver ({_cuda_version(driver)}) is older than CuPy's CUDA runtime "
            f"({_cuda_version(runtime)}): {fix}"
        )
    if status == _NO_DEVICE:
        return _NO_GPU
    return f"no usable GPU ({type(exc).__name__}: {exc})"


def device_state():
    """(cupy module or None, device count, reason when the count is 0)."""
    try:
        import cupy
    except ImportError:
        return (
            None,
            0,
            (
                "CuPy is not installed (pip install 'ropekv[cuda12]' or "
                "'ropekv[cuda13]' for the CUDA kernels)"
            ),
        )
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - CuPy raises CUDARuntimeError and friends
        return cupy, 0, _no_device_reason(cupy, exc)
    return cupy, count, None if count else _NO_GPU


def _cupy_cache():
    """CuPy's kernel cache (``$CUPY_CACHE_DIR``, else ``~/.cupy/kernel_cache``) and its size."""
    cache_dir = os.environ.get("CUPY_CACHE_DIR")
    if not cache_dir:
        try:
            cache_dir = os.path.join(os.path.expanduser("~"), ".cupy", "kernel_cache")
        except (RuntimeError, KeyError, OSError) as exc:
            return f"none (no home directory: {exc})"
    try:
        n = len(os.listdir(cache_dir)) if os.path.isdir(cache_dir) else 0
    except OSError as exc:
        return f"{cache_dir} (unreadable: {exc})"
    return f"{cache_dir} ({n} entries)"


def info():
    import ml_dtypes
    import numpy as np

    import ropekv

    cupy, count, why = device_state()
    rows = [
        ("ropekv", ropekv.__version__),
        ("python", platform.python_version()),
        ("numpy", np.__version__),
        ("ml_dtypes", ml_dtypes.__version__),
    ]
    if cupy is not None:
        rows.append(("cupy", cupy.__version__))
        try:
            from cupy_backends.cuda.libs import nvrtc

            rows.append(("nvrtc", ".".join(map(str, nvrtc.getVersion()))))
        except Exception as exc:  # noqa: BLE001 - a missing NVRTC wheel is one row, not a crash
            rows.append(("nvrtc", f"unavailable ({exc})"))
    else:
        rows.append(("cupy", "not installed"))
    if count:
        rt = cupy.cuda.runtime
        rows.append(("cuda runtime", str(rt.runtimeGetVersion())))
        rows.append(("cuda driver", str(rt.driverGetVersion())))
        for i in range(count):
            props = rt.getDeviceProperties(i)
            rows.append(
                (
                    f"device {i}",
                    (
                        f"{props['name'].decode()} (sm_{props['major']}"
                        f"{props['minor']}, {props['multiProcessorCount']} "
                        f"SMs, {props['totalGlobalMem'] / 2**30:.0f} GiB)"
                    ),
                )
            )
    else:
        rows.append(("device", f"none: {why}"))
    from ropekv import _cache, _native

    _native.load()
    rows.append(("ropekv cache", _cache.describe()))
    rows.append(("cupy cache", _cupy_cache()))
    rows.append(("plan replay", _native.state()))
    backend = "cuda" if count else "numpy"
    rows.append(
        (
            "backend",
            "CUDA kernels for device arrays; NumPy arrays run the NumPy reference"
            if backend == "cuda"
            else "NumPy reference (no CUDA device)",
        )
    )
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0
