"""Event-timed fused QKV calls, plain against clear_unused_last_page_rows: Llama-3-8B projection,
fp8 weights, one token per request, each request at a cache position that leaves `rest` rows of
its page to clear; qkv_mma_tiled against qkv_mma. From a checkout on a GPU machine:
``PYTHONPATH=. python3 tools/experiments/qkv_clear_time.py`` (``ncu``: the launches to profile)."""

import sys

import cupy as cp

import ropekv
from ropekv import qkv as Q
from tests.test_qkv import LLAMA, make_case
from tests.tolerance import to_device


def timeit(fn, n=40):
    for _ in range(5):
        fn()
    s, e = cp.cuda.Event(), cp.cuda.Event()
    s.record()
    for _ in range(n):
        fn()
    e.record()
    e.synchronize()
    return cp.cuda.get_elapsed_time(s, e) * 1000 / n


mode = sys.argv[1] if len(sys.argv) > 1 else "time"
for wfmt in ("fp8",):
    for T in (64, 128):
        for rest in (15, 7, 0):
            args, kw = make_case(
                1, lengths=(1,) * T, wfmt=wfmt, cached=[1024 + 15 - rest] * T, **LLAMA
            )
            d = {n: to_device(x) for n, x in args.items()}
            dk = {n: to_device(x) for n, x in kw.items()}
            out = cp.empty((T, 32 * 128), cp.float16)
            for path in ("tiled", "mma"):
                Q.TILED_MIN_TOKENS = 17 if path == "tiled" else 100000
                f0 = lambda: ropekv.fused_qkv_matmul_append_paged_kv_cache(**d, **dk, out=out)
                f1 = lambda: ropekv.fused_qkv_matmul_append_paged_kv_cache(
                    **d, **dk, out=out, clear_unused_last_page_rows=True
                )
                if mode == "ncu":
                    if rest == 15 and T == 64:
                        f0()
                        f1()
                        cp.cuda.Device().synchronize()
                    continue
                a, b = timeit(f0), timeit(f1)
                print(
                    f"{wfmt} T{T} rest{rest:2d} {path:5s}: plain {a:6.1f} clear {b:6.1f} us "
                    f"({b / a:.2f}x)",
                    flush=True,
                )
            Q.TILED_MIN_TOKENS = 17
