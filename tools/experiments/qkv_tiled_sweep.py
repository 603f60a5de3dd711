"""Event-timed eager QKV calls (Llama-3-8B fp16, weights rotated over 4 copies, 200 MB) at token
counts the bench lacks: the shipped path, the cuBLAS path, qkv_mma and qkv_mma_tiled, per T. On a
GPU machine: ``PYTHONPATH=. python3 tools/experiments/qkv_tiled_sweep.py 17 32 64 128``."""

import sys

import cupy as cp
from qkv_timing import event_us

import ropekv
from ropekv import qkv as Q

K, Hq, Hkv, D, ps = 4096, 32, 8, 128, 16
N = (Hq + 2 * Hkv) * D
ws = [(cp.random.standard_normal((N, K)) / 64).astype(cp.float16) for _ in range(4)]
cs = ropekv.cos_sin_cache(8192, D, xp=cp)


def run(T, label, **patch):
    old = {k: getattr(Q, k) for k in patch}
    for k, v in patch.items():
        setattr(Q, k, v)
    try:
        cp.random.seed(T)  # the same hidden rows for every path of one T (maxdiff compares them)
        x = cp.random.standard_normal((T, K)).astype(cp.float16)
        pages = T + 64
        kc, vc = (cp.zeros((pages, ps, Hkv, D), cp.float16) for _ in range(2))
        off = cp.arange(T + 1, dtype=cp.int32)
        lens = cp.full(T, 100, cp.int32)
        table = (cp.arange(T * 8, dtype=cp.int32).reshape(T, 8)) % pages
        f = lambda w: Q.fused_qkv_matmul_append_paged_kv_cache(
            x, w, off, lens, table, (kc, vc), num_q_heads=Hq, cos_sin_cache=cs
        )
        ref = f(ws[0]).copy()
        return event_us(f, ws, 5), ref
    finally:
        for k, v in old.items():
            setattr(Q, k, v)


for T in [int(t) for t in sys.argv[1:]]:
    base, ref = run(T, "shipped")
    # qkv_wgmma (fp16 weights on sm_90, the shipped path up to WGMMA_MAX_TOKENS) off for the others
    cub, qc = run(T, "cublas", MMA_MAX_TOKENS=0, WGMMA_MAX_TOKENS=0)
    err = float(cp.abs(ref.astype(cp.float32) - qc.astype(cp.float32)).max())
    line = (
        f"T={T:5d} shipped {base:7.1f} us  cublas {cub:7.1f} us  ratio {cub / base:5.2f}  "
        f"maxdiff {err:.3g}"
    )
    if T <= 512:
        mma, _ = run(T, "mma", TILED_MIN_TOKENS=1 << 30, MMA_MAX_TOKENS=1 << 30, WGMMA_MAX_TOKENS=0)
        line += f"  qkv_mma {mma:7.1f}"
    tiled, _ = run(T, "tiled", MMA_MAX_TOKENS=1 << 30, WGMMA_MAX_TOKENS=0)
    line += f"  tiled {tiled:7.1f}"
    print(line, flush=True)
