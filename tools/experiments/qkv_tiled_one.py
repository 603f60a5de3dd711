"""One Llama-3-8B QKV call (fp16, NHD fp16 cache, page 16) at T tokens, for ncu."""

import sys

import cupy as cp

import ropekv

T = int(sys.argv[1])
K, Hq, Hkv, D, ps = 4096, 32, 8, 128, 16
N = (Hq + 2 * Hkv) * D
x = (cp.random.standard_normal((T, K))).astype(cp.float16)
w = (cp.random.standard_normal((N, K)) / 64).astype(cp.float16)
pages = T + 64
kc, vc = (cp.zeros((pages, ps, Hkv, D), cp.float16) for _ in range(2))
off = cp.arange(T + 1, dtype=cp.int32)
lens = cp.full(T, 100, cp.int32)
table = cp.arange(T * 8, dtype=cp.int32).reshape(T, 8) % pages
cs = ropekv.cos_sin_cache(4096, D, xp=cp)
for _ in range(3):
    q = ropekv.fused_qkv_matmul_append_paged_kv_cache(
        x, w, off, lens, table, (kc, vc), num_q_heads=Hq, cos_sin_cache=cs
    )
cp.cuda.runtime.deviceSynchronize()
print("ok", T, float(q.astype(cp.float32).std()))
