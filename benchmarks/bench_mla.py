"""Benchmark ``mla_rope_rmsnorm_append_paged_kv_cache`` on the GPU (DeepSeek-V3 shapes: Hq 128,
L 512, R 64, bf16 -> e4m3 cache, page size 16 with shuffled pages) against the device-to-device
copy bandwidth and against the same result built from separate CuPy steps, all in one run. A
Qwen3 QK-norm case (``qk_rmsnorm_rope_append_paged_kv_cache``) follows.

    PYTHONPATH=. python benchmarks/bench_mla.py

The separate-steps path is what an engine without the fused kernel runs: a CuPy RMSNorm of the
latent dims (float32 maths), a CuPy RoPE of q_rope and of the rotary key dims at each token's
position, and a quantize + scatter kernel writing the rows to their pages.
"""

from __future__ import annotations

import cupy as cp
import ml_dtypes
import numpy as np

import ropekv
from ropekv._compile import _header_options
from ropekv._timing import copy_bandwidth, eager_host_us, graph_us, median_us

BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
Hq, L, R, PAGE = 128, 512, 64, 16

_SCATTER = r"""
#include <cuda_fp8.h>
// cache row slot[r] (width columns, e4m3) = fp8(x[r, :] * inv_scale), round to nearest even.
extern "C" __global__ void quantize_scatter(const float* x, const long long* slot,
                                            unsigned char* cache, long long n, int width,
                                            float inv_scale) {
  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i >= n) return;
  long long r = i / width;
  cache[slot[r] * width + (i - r * width)] =
      __nv_cvt_float_to_fp8(x[i] * inv_scale, __NV_SATFINITE, __NV_E4M3);
}
"""


def bf16_to_f32(x):
    """bf16 (CuPy array of ml_dtypes.bfloat16) -> float32, exactly, with integer ops only."""
    return (x.view(cp.uint16).astype(cp.uint32) << 16).view(cp.float32)


def f32_to_bf16(x):
    """float32 -> bf16, round to nearest even (finite inputs)."""
    u = x.view(cp.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(cp.uint16).view(BF16)


def setup_mla(new, cached, seed=0):
    """Inputs of one MLA call: ``new`` tokens per request after ``cached`` ones."""
    rng = cp.random.default_rng(seed)
    new, cached = np.asarray(new), np.asarray(cached)
    B, T = len(new), int(new.sum())
    pages_per = -(-(cached + new) // PAGE)
    max_pages = int(pages_per.max())
    num_pages = int(pages_per.sum())
    perm = np.random.default_rng(seed).permutation(num_pages).astype(np.int32)
    table = np.full((B, max_pages), -1, np.int32)
    at = 0
    for b in range(B):
        table[b, :pages_per[b]] = perm[at:at + pages_per[b]]
        at += pages_per[b]
    a = {
        "q_rope": f32_to_bf16(rng.standard_normal((T, Hq, R), dtype=cp.float32)),
        "kv": f32_to_bf16(rng.standard_normal((T, L + R), dtype=cp.float32) * 2),
        "gamma": f32_to_bf16(rng.random(L, dtype=cp.float32) + 0.5),
        "cos_sin_cache": ropekv.cos_sin_cache(int((cached + new).max()) + 1, R, xp=cp),
        "input_row_offsets": cp.asarray(np.concatenate([[0], np.cumsum(new)]).astype(np.int32)),
        "cache_lengths": cp.asarray(cached.astype(np.int32)),
        "block_table": cp.asarray(table),
        "kv_cache": cp.zeros((num_pages, PAGE, L + R), cp.uint8).view(E4M3),
    }
    out = cp.empty_like(a["q_rope"])
    # each input read once, each output written once; one float32 cos/sin row per token
    nbytes = T * (2 * Hq * R * 2 + (L + R) * 2 + (L + R) * 1 + R * 4)

    def fused():
        ropekv.mla_rope_rmsnorm_append_paged_kv_cache(**a, kv_scale=0.5, q_rope_out=out)

    return a, out, fused, nbytes


def separate_steps(a, kv_scale=0.5, eps=1e-6):
    """The same result from CuPy steps; returns (fn, q_out, cache)."""
    scatter = cp.RawKernel(_SCATTER, "quantize_scatter", options=("-std=c++17",
                                                                  *_header_options()))
    cache = cp.zeros_like(a["kv_cache"].view(cp.uint8))
    T = a["q_rope"].shape[0]
    offsets, lengths = a["input_row_offsets"], a["cache_lengths"]
    gamma = bf16_to_f32(a["gamma"])
    table = a["cos_sin_cache"]
    bt = a["block_table"]
    q_out = cp.empty_like(a["q_rope"])

    def rope_interleaved(x, cos, sin):  # x (..., R) float32, cos/sin broadcast to (..., R/2)
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return cp.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], -1).reshape(x.shape)

    def fn():
        t = cp.arange(T, dtype=cp.int32)
        req = cp.searchsorted(offsets, t, side="right") - 1
        pos = lengths[req] + t - offsets[req]
        slot = bt[req, pos // PAGE].astype(cp.int64) * PAGE + pos % PAGE
        cos, sin = table[pos, :R // 2], table[pos, R // 2:]
        # 1. RMSNorm of the latent dims
        x = bf16_to_f32(a["kv"])
        lat = x[:, :L]
        normed = lat * cp.reciprocal(cp.sqrt((lat * lat).mean(1, keepdims=True) + eps)) * gamma
        # 2. RoPE of q_rope and of the rotary key dims
        q_rot = rope_interleaved(bf16_to_f32(a["q_rope"]), cos[:, None], sin[:, None])
        q_out.view(cp.uint16)[...] = f32_to_bf16(q_rot).view(cp.uint16)
        pe = rope_interleaved(x[:, L:], cos, sin)
        # 3. quantize + scatter the rows into their pages
        rows = cp.ascontiguousarray(cp.concatenate([normed, pe], 1))
        n = rows.size
        scatter(((n + 255) // 256,), (256,), (rows, slot, cache, np.int64(n), np.int32(L + R),
                                              np.float32(1 / kv_scale)))

    return fn, q_out, cache


def check(a, out, sep_q, sep_cache):
    """Both paths wrote the same rows: q within bf16 rounding, fp8 codes within one."""
    dq = cp.abs(bf16_to_f32(out) - bf16_to_f32(sep_q)).max().item()
    mine = a["kv_cache"].view(cp.uint8).astype(cp.int32)
    theirs = sep_cache.astype(cp.int32)

    def ordinal(c):
        return cp.where(c & 0x80, -(c & 0x7F), c & 0x7F)

    dcode = cp.abs(ordinal(mine) - ordinal(theirs)).max().item()
    return dq, dcode


def setup_qknorm(new, cached, Hq=64, Hkv=8, D=128, seed=1):
    rng = cp.random.default_rng(seed)
    new, cached = np.asarray(new), np.asarray(cached)
    B, T = len(new), int(new.sum())
    pages_per = -(-(cached + new) // PAGE)
    num_pages = int(pages_per.sum())
    perm = np.random.default_rng(seed).permutation(num_pages).astype(np.int32)
    table = np.full((B, int(pages_per.max())), -1, np.int32)
    at = 0
    for b in range(B):
        table[b, :pages_per[b]] = perm[at:at + pages_per[b]]
        at += pages_per[b]
    qkv = f32_to_bf16(rng.standard_normal((T, Hq + 2 * Hkv, D), dtype=cp.float32))
    caches = tuple(cp.zeros((num_pages, PAGE, Hkv, D), cp.uint8).view(E4M3) for _ in range(2))
    gamma = cp.ones(D, cp.float32)
    table_cs = ropekv.cos_sin_cache(int((cached + new).max()) + 1, D, base=1e6, xp=cp)
    offsets = cp.asarray(np.concatenate([[0], np.cumsum(new)]).astype(np.int32))
    lengths = cp.asarray(cached.astype(np.int32))
    bt = cp.asarray(table)
    q_out = cp.empty((T, Hq, D), qkv.dtype)
    nbytes = T * (2 * Hq * D * 2 + 2 * Hkv * D * 2 + 2 * Hkv * D + D * 4)

    def fused():
        ropekv.qk_rmsnorm_rope_append_paged_kv_cache(
            qkv[:, :Hq], qkv[:, Hq:Hq + Hkv], qkv[:, Hq + Hkv:], gamma, gamma, table_cs, offsets,
            lengths, bt, caches, kv_scale=0.5, q_out=q_out)

    return fused, nbytes


def main():
    bw = copy_bandwidth()
    print(f"device: {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, "
          f"copy bandwidth (1 GiB, read + write): {bw / 1e12:.2f} TB/s")
    rows = []
    rng = np.random.default_rng(0)
    cases = (("MLA prefill 4x2048 (+1024 cached)", (2048,) * 4, (1024,) * 4, False),
             ("MLA decode 128x1", (1,) * 128, tuple(rng.integers(1, 4096, 128)), True))
    for name, new, cached, decode in cases:
        a, out, fused, nbytes = setup_mla(new, cached)
        fused()
        sep, sep_q, sep_cache = separate_steps(a)
        sep()
        cp.cuda.get_current_stream().synchronize()
        dq, dcode = check(a, out, sep_q, sep_cache)
        print(f"{name}: fused vs separate steps: max |q diff| {dq:.3g}, max fp8 code diff "
              f"{dcode}")
        if decode:
            # The separate steps allocate temporaries, which a graph capture forbids: they are
            # timed eagerly (device time of one call, CUDA events).
            us = graph_us(fused)
            print(f"  {name}: eager host time per fused call {eager_host_us(fused):.1f} us, "
                  f"eager device time {median_us(fused):.2f} us")
            rows.append((f"{name} [graph; sep eager]", us, nbytes, median_us(sep)))
        else:
            us = median_us(fused, warmup=20, reps=200)
            rows.append((name, us, nbytes, median_us(sep, warmup=5, reps=30)))
        del a, out, sep_q, sep_cache
    for name, new, cached, decode in (
            ("QK-norm Qwen3 64/8/128 e4m3 prefill 8x1024", (1024,) * 8, (0,) * 8, False),
            ("QK-norm Qwen3 64/8/128 e4m3 decode 128x1", (1,) * 128, (512,) * 128, True)):
        fused, nbytes = setup_qknorm(new, cached)
        if decode:
            rows.append((name + " [graph]", graph_us(fused), nbytes, None))
        else:
            rows.append((name, median_us(fused, warmup=20, reps=200), nbytes, None))

    print(f"{'case':48s} {'ropekv us':>10s} {'MB':>8s} {'GB/s':>7s} {'%copy':>6s} "
          f"{'separate us':>12s} {'ratio':>6s}")
    for name, us, nbytes, sep_us in rows:
        gbs = nbytes / (us * 1e-6) / 1e9
        sep = "" if sep_us is None else f"{sep_us:12.1f} {sep_us / us:6.2f}"
        print(f"{name:48s} {us:10.2f} {nbytes / 1e6:8.2f} {gbs:7.0f} {gbs * 1e9 / bw * 100:6.1f} "
              f"{sep}")


if __name__ == "__main__":
    main()
