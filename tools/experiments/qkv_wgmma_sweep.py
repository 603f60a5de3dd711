"""Event-timed eager QKV calls (Llama-3-8B projection, fp16 or bf16 weights rotated over 4 copies,
200 MB, so every call streams its weights from DRAM): the cuBLAS path (cuBLAS + qkv_epilogue)
against qkv_wgmma under several settings, per token count, Q and the K cache cross-checked against
the cuBLAS path's. On a GPU machine:
``PYTHONPATH=. python3 tools/experiments/qkv_wgmma_sweep.py [--bf16] 17 32 64 128 256``."""

import sys

import cupy as cp
from qkv_timing import event_us

import ropekv
from ropekv import qkv as Q

K, Hq, Hkv, D, ps = 4096, 32, 8, 128, 16
N = (Hq + 2 * Hkv) * D
dt = cp.float16
args = sys.argv[1:]
if "--bf16" in args:
    import ml_dtypes

    dt = ml_dtypes.bfloat16
    args.remove("--bf16")
ws = [(cp.random.standard_normal((N, K), cp.float32) / 64).astype(dt) for _ in range(4)]
cs = ropekv.cos_sin_cache(8192, D, xp=cp)

SETTINGS = {  # name: module constants
    "cublas": dict(WGMMA_MAX_TOKENS=0, MMA_MAX_TOKENS=16),
    "s4a1": dict(WGMMA_MIN_TOKENS=1, WGMMA_MAX_TOKENS=1 << 30, WGMMA_STAGES=4, WGMMA_ATOMS=1),
    "s3a1": dict(WGMMA_MIN_TOKENS=1, WGMMA_MAX_TOKENS=1 << 30, WGMMA_STAGES=3, WGMMA_ATOMS=1),
    "s6a1": dict(WGMMA_MIN_TOKENS=1, WGMMA_MAX_TOKENS=1 << 30, WGMMA_STAGES=6, WGMMA_ATOMS=1),
    "s3a2": dict(WGMMA_MIN_TOKENS=1, WGMMA_MAX_TOKENS=1 << 30, WGMMA_STAGES=3, WGMMA_ATOMS=2),
    "s4a1t64": dict(
        WGMMA_MIN_TOKENS=1,
        WGMMA_MAX_TOKENS=1 << 30,
        WGMMA_STAGES=4,
        WGMMA_ATOMS=1,
        WGMMA_MAX_TILE=64,
    ),
    "s4a1sp2": dict(
        WGMMA_MIN_TOKENS=1, WGMMA_MAX_TOKENS=1 << 30, WGMMA_STAGES=4, WGMMA_ATOMS=1, WGMMA_SPLIT=2
    ),
}


def run(T, patch):
    old = {k: getattr(Q, k) for k in patch}
    for k, v in patch.items():
        setattr(Q, k, v)
    try:
        cp.random.seed(T)
        x = cp.random.standard_normal((T, K), cp.float32).astype(dt)
        pages = T * 8  # every token its own pages: no two write one cache row
        kc, vc = (cp.zeros((pages, ps, Hkv, D), dt) for _ in range(2))
        off = cp.arange(T + 1, dtype=cp.int32)
        lens = cp.full(T, 100, cp.int32)
        table = cp.arange(pages, dtype=cp.int32).reshape(T, 8)
        f = lambda w: Q.fused_qkv_matmul_append_paged_kv_cache(
            x, w, off, lens, table, (kc, vc), num_q_heads=Hq, cos_sin_cache=cs
        )
        ref = f(ws[0]).copy()
        kref = kc.copy()
        return event_us(f, ws), ref, kref
    finally:
        for k, v in old.items():
            setattr(Q, k, v)


names = [n for n in SETTINGS if n != "cublas"]
print(
    f"{'T':>5} {'cublas':>8} " + " ".join(f"{n:>9}" for n in names) + "  (us; ratio cublas / best)"
)
for T in [int(t) for t in args]:
    base, qb, kb = run(T, SETTINGS["cublas"])
    line, best = f"{T:5d} {base:8.1f} ", 1e9
    for n in names:
        us, q, kq = run(T, SETTINGS[n])
        dq = float(cp.abs(q.astype(cp.float32) - qb.astype(cp.float32)).max())
        dk = float(cp.abs(kq.astype(cp.float32) - kb.astype(cp.float32)).max())
        flag = "" if dq < 0.05 and dk < 0.05 else "!"
        line += f"{us:8.1f}{flag or ' '} "
        best = min(best, us)
    print(line + f" {base / best:5.2f}x", flush=True)
