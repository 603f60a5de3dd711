"""Arrays on either side of the bench: dtypes, seeded random inputs in NumPy or CuPy, host copies
of any array (CuPy, torch, NumPy; fp8 and bfloat16 included), zero-copy torch views, and whether a
CUDA device is usable. Imports only NumPy and ml_dtypes at module level; CuPy and torch when used.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

F16 = np.dtype(np.float16)
BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E5M2 = np.dtype(ml_dtypes.float8_e5m2)
FP8 = (E4M3, E5M2)


def _dtname(dt):
    return {F16: "fp16", BF16: "bf16", E4M3: "e4m3", E5M2: "e5m2"}.get(np.dtype(dt), str(dt))


def _special(dt):
    dt = np.dtype(dt)
    return dt in FP8 or dt == BF16


def _bits(x):
    """Same-size integer view of an fp8 / bfloat16 array (what CuPy kernels can copy and index)."""
    dt = np.dtype(x.dtype)
    if _special(dt):
        return x.view(np.uint8 if dt.itemsize == 1 else np.uint16)
    return x


def _copy(x):
    dt = np.dtype(x.dtype)
    return _bits(x).copy().view(dt) if _special(dt) else x.copy()


def _assign(dst, src):
    _bits(dst)[...] = _bits(src)


class _Gen:
    """Seeded random arrays in NumPy (``xp=numpy``) or directly on the device (``xp=cupy``)."""

    def __init__(self, xp, seed):
        self.xp, self.rng = xp, np.random.default_rng(seed)
        if xp is not np:
            xp.random.seed(seed)

    def randn(self, shape, dtype, scale=1.0, offset=0.0):
        if self.xp is np:
            a = self.rng.standard_normal(shape, dtype=np.float32)
        else:
            a = self.xp.random.standard_normal(shape, dtype=np.float32)
        if scale != 1.0 or offset != 0.0:
            a = a * np.float32(scale) + np.float32(offset)
        return self.cast(a, dtype)

    def cast(self, a, dtype):
        """float32 ``a`` -> ``dtype`` (bfloat16 on the device rounded to nearest even through the
        bits; fp8 only on the host, saturated to 240)."""
        dtype = np.dtype(dtype)
        if dtype == BF16 and self.xp is not np:
            u = a.view(np.uint32)
            u = (u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16
            return u.astype(np.uint16).view(BF16)
        if dtype in FP8:  # only for poisoned caches in `ropekv check`, built on the host
            return np.asarray(np.clip(a, -240, 240), np.float32).astype(dtype)
        return a.astype(dtype)

    def bytes(self, shape):
        """Uniformly random uint8."""
        if self.xp is np:
            return self.rng.integers(0, 256, shape, dtype=np.uint8)
        return self.xp.random.randint(0, 256, size=shape).astype(np.uint8)

    def float32(self, a):
        """``a`` (fp16 / bf16 / float32) as float32, bfloat16 through its bits."""
        if np.dtype(a.dtype) == BF16:
            return (a.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
        return a.astype(np.float32)

    def zeros(self, shape, dtype):
        dtype = np.dtype(dtype)
        if _special(dtype):
            return self.xp.zeros(shape, np.uint8 if dtype.itemsize == 1 else np.uint16).view(dtype)
        return self.xp.zeros(shape, dtype)

    def cache(self, shape, dtype, poison):
        """A cache: random contents when ``poison`` (checks), zeros otherwise (bench)."""
        return self.randn(shape, dtype) if poison else self.zeros(shape, dtype)

    def put(self, host):
        return host if self.xp is np else to_device(np.ascontiguousarray(host))


# ---- host and device copies ----------------------------------------------------------------------


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


def _torch():
    import torch

    return torch


def torch_view(x):
    """Zero-copy torch view of a CuPy or NumPy array (fp8 / bfloat16 through a same-size
    integer view)."""
    if x is None:
        return None
    torch = _torch()
    dt = np.dtype(x.dtype)
    wrap = torch.from_numpy if isinstance(x, np.ndarray) else torch.from_dlpack
    if _special(dt):
        target = {E4M3: torch.float8_e4m3fn, E5M2: torch.float8_e5m2, BF16: torch.bfloat16}[dt]
        return wrap(x.view(np.uint8 if dt.itemsize == 1 else np.int16)).view(target)
    return wrap(x)


def _torch_dtype(dt):
    torch = _torch()
    return {
        F16: torch.float16,
        BF16: torch.bfloat16,
        E4M3: torch.float8_e4m3fn,
        E5M2: torch.float8_e5m2,
        np.dtype(np.float32): torch.float32,
    }[np.dtype(dt)]


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


def one_line(e):
    """``Type: first line of the message`` of an exception, for tables and JSON."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:160] if text else ''}"
