"""Benchmark ``apply_rope_write_kv`` on the GPU: prefill and decode, fp16 and fp8 caches, against
the device-to-device copy bandwidth measured in the same run.

    PYTHONPATH=. python benchmarks/bench_contiguous.py
"""

from __future__ import annotations

import cupy as cp
import ml_dtypes
import numpy as np

import ropekv
from ropekv._timing import copy_bandwidth, eager_host_us, graph_us, median_us


def setup(B, S, Hq, Hkv, D, C, cache_dtype, dtype=np.float16, seed=0):
    rng = cp.random.default_rng(seed)
    q = rng.standard_normal((B, S, Hq, D), dtype=cp.float32).astype(dtype)
    k = rng.standard_normal((B, S, Hkv, D), dtype=cp.float32).astype(dtype)
    v = rng.standard_normal((B, S, Hkv, D), dtype=cp.float32).astype(dtype)
    if np.dtype(cache_dtype).itemsize == 1:
        cache = cp.zeros((B, 2, Hkv, C, D), cp.uint8).view(cache_dtype)
        scale = cp.asarray([0.5, 0.5], cp.float32)
    else:
        cache = cp.zeros((B, 2, Hkv, C, D), cache_dtype)
        scale = None
    table = ropekv.cos_sin_cache(C, D, xp=cp)
    lens = cp.full((B,), C // 2, cp.int32)
    item = np.dtype(dtype).itemsize
    nbytes = (B * S * Hq * D * item * 2 + 2 * B * S * Hkv * D * item
              + 2 * B * S * Hkv * D * np.dtype(cache_dtype).itemsize + B * S * D * 4 + B * 4)

    def fn():
        ropekv.apply_rope_write_kv(q, k, v, cache, table, kv_end_lens=lens, kv_scale=scale)

    return fn, nbytes


def main():
    bw = copy_bandwidth()
    print(f"device: {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, "
          f"copy bandwidth (1 GiB, read + write): {bw / 1e12:.2f} TB/s")
    rows = []
    for label, cache_dtype in (("fp16", np.float16), ("e4m3", ml_dtypes.float8_e4m3fn)):
        fn, nbytes = setup(8, 1024, 32, 8, 128, 4096, cache_dtype)
        us = median_us(fn, warmup=20, reps=200)
        rows.append((f"prefill 8x1024 fp16->{label}", us, nbytes, None, None))
        fn, nbytes = setup(64, 1, 32, 8, 128, 4096, cache_dtype)
        us = median_us(fn, warmup=20, reps=200)
        rows.append((f"decode 64x1 fp16->{label}", us, nbytes, graph_us(fn), eager_host_us(fn)))
    print(f"{'case':28s} {'us':>8s} {'MB':>8s} {'GB/s':>8s} {'%copy':>6s} {'graph us':>9s} "
          f"{'eager us':>9s}")
    for name, us, nbytes, g, e in rows:
        gbs = nbytes / (us * 1e-6) / 1e9
        print(f"{name:28s} {us:8.1f} {nbytes / 1e6:8.2f} {gbs:8.0f} {gbs * 1e9 / bw * 100:6.1f} "
              f"{'' if g is None else f'{g:9.2f}'} {'' if e is None else f'{e:9.2f}'}")


if __name__ == "__main__":
    main()
