"""The timing loops of the fused QKV experiment scripts (``qkv_paths.py``; the earlier sweeps and
ablations are in git history), and their Llama-3-8B call (``llama_call``):
``f(w)`` is one call with weights ``w``, ``ws`` four copies of the
weights that the calls rotate over (200 MB at Llama-3-8B's projection in fp16, so every call
streams its weights from DRAM). Both warm up with 8 calls and return the median per-call time in
microseconds over ``reps`` timed runs. The scripts run from the repository root
(``python3 tools/experiments/<script>.py``), so this module is on their path."""

import cupy as cp

import ropekv
from ropekv import qkv as Q

K, HQ, HKV, D, PAGE = 4096, 32, 8, 128, 16  # Llama-3-8B's projection, pages of 16 tokens
N = (HQ + 2 * HKV) * D
_COS_SIN = []


def llama_call(T, dtype=cp.float16, **extra):
    """``(f, k_cache, v_cache)``: ``f(w)`` is the fused QKV call of ``T`` tokens (hidden rows
    seeded by T, one token a request after 100 cached, fresh zero caches of 8 pages a request)
    with weights ``w`` and the keywords ``extra``; it returns Q."""
    if not _COS_SIN:
        _COS_SIN.append(ropekv.cos_sin_cache(8192, D, xp=cp))
    cp.random.seed(T)
    x = cp.random.standard_normal((T, K), cp.float32).astype(dtype)
    pages = T * 8
    kc, vc = (cp.zeros((pages, PAGE, HKV, D), dtype) for _ in range(2))
    off = cp.arange(T + 1, dtype=cp.int32)
    lens = cp.full(T, 100, cp.int32)
    table = cp.arange(pages, dtype=cp.int32).reshape(T, 8)

    def f(w):
        return Q.fused_qkv_matmul_append_paged_kv_cache(
            x, w, off, lens, table, (kc, vc), num_q_heads=HQ, cos_sin_cache=_COS_SIN[0], **extra
        )

    return f, kc, vc


def event_us(f, ws, reps=7):
    """Eager calls: 40 back to back between two events, a run."""
    for i in range(8):
        f(ws[i % 4])
    times = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        for i in range(40):
            f(ws[i % 4])
        b.record()
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b) * 1000 / 40)
    return sorted(times)[reps // 2]


def graph_us(f, ws, reps=7):
    """CUDA-graph replay: one call with each of the 4 weights captured in a graph on a stream of
    its own, 10 replays a run."""
    for i in range(8):
        f(ws[i % 4])
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        for w in ws:
            f(w)
        g = s.end_capture()
    g.launch(s)
    s.synchronize()
    times = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(s)
        for _ in range(10):
            g.launch(s)
        b.record(s)
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b) * 1000 / (10 * len(ws)))
    return sorted(times)[reps // 2]
