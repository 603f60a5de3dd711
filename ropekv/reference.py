"""NumPy references of every ropekv operation (float64 maths).

They are the CPU backend (NumPy inputs run here, with the same in-place writes as the kernels) and
the oracle of every GPU test. Imports only NumPy and ml_dtypes.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

FP8_MAX = {
    np.dtype(ml_dtypes.float8_e4m3fn): float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max),
    np.dtype(ml_dtypes.float8_e5m2): float(ml_dtypes.finfo(ml_dtypes.float8_e5m2).max),
}


def is_fp8(dtype):
    return np.dtype(dtype) in FP8_MAX


def to_dtype(x, dtype):
    """Round float64 ``x`` to ``dtype``: nearest even; fp8 saturates to its largest finite value
    (infinities too), NaN stays NaN."""
    dtype = np.dtype(dtype)
    if dtype in FP8_MAX:
        limit = FP8_MAX[dtype]
        x = np.clip(x, -limit, limit)
    return np.asarray(x, np.float64).astype(dtype)


def rope(x, cos, sin, is_neox):
    """Rotate the leading ``2 * cos.shape[-1]`` dims of ``x`` (float64, ``(..., D)``).

    ``cos``/``sin`` broadcast against ``x[..., :R/2]``. neox pairs (i, i + R/2); interleaved pairs
    (2i, 2i + 1). Dims ``[R, D)`` pass through.
    """
    x = np.array(x, np.float64)
    half = cos.shape[-1]
    if is_neox:
        a, b = x[..., :half].copy(), x[..., half:2 * half].copy()
        x[..., :half] = a * cos - b * sin
        x[..., half:2 * half] = b * cos + a * sin
    else:
        a, b = x[..., 0:2 * half:2].copy(), x[..., 1:2 * half:2].copy()
        x[..., 0:2 * half:2] = a * cos - b * sin
        x[..., 1:2 * half:2] = b * cos + a * sin
    return x


def split_cos_sin(rows):
    """float32 table rows ``(..., R)`` -> float64 cos, sin ``(..., R/2)``."""
    rows = np.asarray(rows, np.float64)
    half = rows.shape[-1] // 2
    return rows[..., :half], rows[..., half:]


def apply_rope_write_kv(q, k, v, kv_cache, cos_sin_cache, kv_end_lens=None, position_ids=None,
                        kv_scale=None, write_k_in_place=False, is_neox=True):
    """Reference of :func:`ropekv.apply_rope_write_kv` on NumPy arrays, written in place."""
    B, S = q.shape[:2]
    C = kv_cache.shape[3]
    table = cos_sin_cache if cos_sin_cache.ndim == 3 else cos_sin_cache[None]
    P = table.shape[1]
    fp8 = is_fp8(kv_cache.dtype)
    k_scale, v_scale = (float(kv_scale[0]), float(kv_scale[1])) if fp8 else (1.0, 1.0)
    for b in range(B):
        start = 0 if kv_end_lens is None else int(kv_end_lens[b]) - S
        slots = start + np.arange(S, dtype=np.int64)
        pos = slots if position_ids is None else np.asarray(position_ids[b], np.int64)
        keep = (slots >= 0) & (slots < C) & (pos >= 0) & (pos < P)
        if not keep.any():
            continue
        s_idx, slot, p = np.nonzero(keep)[0], slots[keep], pos[keep]
        cos, sin = split_cos_sin(table[b if table.shape[0] > 1 else 0][p])
        cos, sin = cos[:, None, :], sin[:, None, :]
        q_rot = rope(q[b, s_idx].astype(np.float64), cos, sin, is_neox)
        k_rot = rope(k[b, s_idx].astype(np.float64), cos, sin, is_neox)
        q[b, s_idx] = to_dtype(q_rot, q.dtype)
        if write_k_in_place:
            k[b, s_idx] = to_dtype(k_rot, k.dtype)
        # rows are (n, Hkv, D); the cache holds (Hkv, C, D) per sequence and K/V
        kv_cache[b, 0][:, slot] = to_dtype(k_rot / k_scale, kv_cache.dtype).transpose(1, 0, 2)
        v_val = v[b, s_idx].astype(np.float64) / v_scale
        kv_cache[b, 1][:, slot] = to_dtype(v_val, kv_cache.dtype).transpose(1, 0, 2)
