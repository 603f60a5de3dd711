"""``ropekv info``: versions, device, compile cache, which backend would run."""

from __future__ import annotations

import os
import platform


def _cupy_state():
    """(cupy module or None, device count, reason when no device)."""
    try:
        import cupy
    except ImportError as exc:
        return None, 0, f"CuPy is not installed ({exc}); pip install 'ropekv[cuda12]' or [cuda13]"
    try:
        return cupy, cupy.cuda.runtime.getDeviceCount(), None
    except Exception as exc:
        return cupy, 0, f"{type(exc).__name__}: {exc}"


def backend_name():
    """'cuda' when a CUDA device is usable, else 'numpy'."""
    _, count, _ = _cupy_state()
    return "cuda" if count else "numpy"


def info():
    import ml_dtypes
    import numpy as np

    import ropekv

    cupy, count, why = _cupy_state()
    rows = [("ropekv", ropekv.__version__), ("python", platform.python_version()),
            ("numpy", np.__version__), ("ml_dtypes", ml_dtypes.__version__)]
    if cupy is not None:
        rows.append(("cupy", cupy.__version__))
        try:
            from cupy_backends.cuda.libs import nvrtc

            rows.append(("nvrtc", ".".join(map(str, nvrtc.getVersion()))))
        except Exception as exc:
            rows.append(("nvrtc", f"unavailable ({exc})"))
    else:
        rows.append(("cupy", "not installed"))
    if count:
        rt = cupy.cuda.runtime
        rows.append(("cuda runtime", str(rt.runtimeGetVersion())))
        rows.append(("cuda driver", str(rt.driverGetVersion())))
        for i in range(count):
            props = rt.getDeviceProperties(i)
            rows.append((f"device {i}", f"{props['name'].decode()} (sm_{props['major']}"
                                        f"{props['minor']}, {props['multiProcessorCount']} SMs, "
                                        f"{props['totalGlobalMem'] / 2**30:.0f} GiB)"))
    else:
        rows.append(("device", f"none ({why})"))
    cache_dir = os.environ.get("CUPY_CACHE_DIR", os.path.expanduser("~/.cupy/kernel_cache"))
    n = len(os.listdir(cache_dir)) if os.path.isdir(cache_dir) else 0
    rows.append(("compile cache", f"{cache_dir} ({n} entries)"))
    backend = "cuda" if count else "numpy"
    rows.append(("backend", "CUDA kernels for device arrays; NumPy arrays run the NumPy reference"
                 if backend == "cuda" else "NumPy reference (no CUDA device)"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0
