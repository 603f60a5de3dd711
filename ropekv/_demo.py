"""``ropekv demo``: a Llama-3-8B-shaped prefill, then decode steps, through ropekv's ops on a real
cache, checked against the NumPy reference (on the GPU) or against an independent complex-number
rotation (on the NumPy backend)."""

from __future__ import annotations

import time

import ml_dtypes
import numpy as np

import ropekv
from ropekv import reference

# Llama-3-8B attention: 32 query heads, 8 KV heads, head dim 128, rope base 500000, llama3 scaling
HQ, HKV, D = 32, 8, 128
SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
BATCH, PROMPT, CAPACITY = 4, 256, 512
MAX_STEPS = CAPACITY - PROMPT  # decode steps that fit in the cache (and the cos/sin table)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


def _pick_backend(requested):
    from ropekv._info import device_state

    _, count, why = device_state()
    if requested == "cuda" and not count:
        raise SystemExit(f"ropekv demo --backend cuda: {why} (see ropekv info)")
    return ("cuda" if count else "numpy") if requested == "auto" else requested


def _codes_close(got, want):
    """fp16: relative 1e-3 (one ulp); fp8: codes equal or adjacent."""
    if got.dtype == E4M3:
        a = got.view(np.uint8).astype(np.int32)
        b = want.view(np.uint8).astype(np.int32)
        a, b = np.where(a & 0x80, -(a & 0x7F), a), np.where(b & 0x80, -(b & 0x7F), b)
        return int(np.abs(a - b).max()) <= 1
    g, w = got.astype(np.float64), want.astype(np.float64)
    return bool(np.all(np.abs(g - w) <= 1e-5 + 1e-3 * np.abs(w)))


def _complex_rope(x, pos, table):
    """Independent oracle for the NumPy backend: rotate half-split pairs as complex numbers."""
    half = table.shape[1] // 2
    rows = table[pos].astype(np.float64)
    z = x[..., :half].astype(np.float64) + 1j * x[..., half : 2 * half]
    z = z * (rows[:, None, :half] + 1j * rows[:, None, half:])
    return np.concatenate([z.real, z.imag], -1)


def demo(backend="auto", steps=8):
    """Run the demo; returns the exit code. ``steps``: decode steps, 0 to ``MAX_STEPS``."""
    if not 0 <= steps <= MAX_STEPS:
        raise ValueError(
            f"steps must be between 0 and {MAX_STEPS} (a {PROMPT}-token prompt in "
            f"a {CAPACITY}-token cache), got {steps}"
        )
    backend = _pick_backend(backend)
    rng = np.random.default_rng(0)
    table = ropekv.cos_sin_cache(CAPACITY, D, base=500000.0, scaling=SCALING)
    _banner(backend, steps)
    call = _call_cuda if backend == "cuda" else _call_numpy
    rows, ok_all = [], True
    for cache_dtype in (np.dtype(np.float16), E4M3):
        cache = np.zeros((BATCH, 2, HKV, CAPACITY, D), cache_dtype)
        scale = np.array([0.05, 0.05], np.float32) if cache_dtype == E4M3 else None
        dev = None
        if backend == "cuda":
            import cupy

            dev = {
                "cache": cupy.asarray(cache.view(np.uint8)).view(cache_dtype),
                "table": cupy.asarray(table),
                "scale": None if scale is None else cupy.asarray(scale),
            }
        lens = np.zeros(BATCH, np.int32)
        for phase, S, n_calls in (("prefill", PROMPT, 1), ("decode", 1, steps)):
            if n_calls == 0:
                continue
            total, ok = 0.0, True
            for _ in range(n_calls):
                lens = lens + S
                q = rng.standard_normal((BATCH, S, HQ, D)).astype(np.float16)
                k = rng.standard_normal((BATCH, S, HKV, D)).astype(np.float16)
                v = rng.standard_normal((BATCH, S, HKV, D)).astype(np.float16)
                seconds, good = call(q, k, v, cache, table, lens, scale, dev)
                total += seconds
                ok &= good
            rows.append(
                (
                    phase,
                    str(cache_dtype),
                    BATCH * S * n_calls,
                    n_calls,
                    total / n_calls * 1e3,
                    "ok" if ok else "MISMATCH",
                )
            )
            ok_all &= ok
    return _report(rows, backend, ok_all)


def _banner(backend, steps):
    print(
        f"ropekv {ropekv.__version__} demo: Llama-3-8B attention shapes (Hq {HQ}, Hkv {HKV}, "
        f"D {D}), batch {BATCH}, prompt {PROMPT} tokens, {steps} decode steps, cache capacity "
        f"{CAPACITY}"
    )
    if backend == "numpy":
        print(
            "backend: NumPy reference on the host (no CUDA device); checks use an independent "
            "complex-number rotation"
        )
    else:
        import cupy

        name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
        print(f"backend: CUDA kernels on {name}; checks against the NumPy reference")


def _call_cuda(q, k, v, cache, table, lens, scale, dev):
    """One call on the device arrays ``dev`` (their cache a copy of ``cache``), checked against
    the NumPy reference run on ``cache``; ``(seconds, ok)``."""
    import cupy

    want_q = q.copy()
    gq, gk, gv, gl = (cupy.asarray(x) for x in (q, k, v, lens))
    cupy.cuda.Device().synchronize()
    t0 = time.perf_counter()
    ropekv.apply_rope_write_kv(
        gq,
        gk,
        gv,
        dev["cache"],
        dev["table"],
        kv_end_lens=gl,
        kv_scale=dev["scale"],
    )
    cupy.cuda.Device().synchronize()
    seconds = time.perf_counter() - t0
    reference.apply_rope_write_kv(want_q, k.copy(), v, cache, table, lens, kv_scale=scale)
    got_cache = dev["cache"].view(cupy.uint8).get().view(cache.dtype)
    return seconds, _codes_close(gq.get(), want_q) & _codes_close(got_cache, cache)


def _call_numpy(q, k, v, cache, table, lens, scale, dev):
    """One call of the NumPy backend, checked against an independent complex-number rotation;
    ``(seconds, ok)``."""
    S = q.shape[1]
    q_in, k_in = q.copy(), k.copy()
    t0 = time.perf_counter()
    ropekv.apply_rope_write_kv(q, k, v, cache, table, kv_end_lens=lens, kv_scale=scale)
    seconds = time.perf_counter() - t0
    pos = np.arange(int(lens[0]) - S, int(lens[0]))
    ok = _codes_close(q, _complex_rope(q_in, pos, table).astype(np.float16))
    k_rot = _complex_rope(k_in, pos, table)
    ok &= _codes_close(
        cache[:, 0, :, pos].transpose(1, 0, 2, 3),
        reference.to_dtype(k_rot / (scale[0] if scale is not None else 1.0), cache.dtype),
    )
    return seconds, ok


def _report(rows, backend, ok_all):
    """Print the table of ``rows`` and the verdict; the exit code."""
    print(f"\n{'phase':8s} {'cache':14s} {'tokens':>7s} {'calls':>6s} {'ms/call':>9s}  check")
    for phase, dtype, tokens, calls, ms, status in rows:
        print(f"{phase:8s} {dtype:14s} {tokens:7d} {calls:6d} {ms:9.3f}  {status}")
    print(
        "\n(times are wall-clock per call including host work; `ropekv bench` measures device time)"
        if backend == "cuda"
        else "\n(NumPy backend: float64 maths on the host)"
    )
    if not ok_all:
        print("demo FAILED: results differ from the reference")
        return 1
    print("demo passed: every output matches")
    return 0
