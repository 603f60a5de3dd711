"""Benchmark ``rope_quantize_fp8_append_paged_kv_cache`` / ``rope_append_paged_kv_cache`` on the
GPU against the device-to-device copy bandwidth and FlashInfer 0.5.3 (when it imports), measured
in the same run on identical inputs.

    PYTHONPATH=. python benchmarks/bench_paged.py [--sweep]

Prints one table: case, ropekv time, FlashInfer time, bytes moved (ropekv.bytes), ropekv GB/s
and % of the copy bandwidth; decode cases also per call under CUDA-graph replay and as eager host
time. ``--sweep`` first times the launch-shape variants of ``ropekv.paged.TUNING``.
"""

from __future__ import annotations

import statistics
import sys
import time

import cupy as cp
import ml_dtypes
import numpy as np

import ropekv
from ropekv import bytes as nbytes_of
from ropekv import paged
from ropekv._timing import copy_bandwidth, eager_host_us, graph_us, median_us

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)

try:
    import flashinfer.page
    import flashinfer.rope
    import torch
except Exception as exc:  # noqa: BLE001 - any failure means: no peer in this run
    print(f"FlashInfer not timed: {exc}")
    flashinfer = None


def empty(shape, dtype):
    dtype = np.dtype(dtype)
    if dtype.itemsize == 1:
        return cp.empty(shape, cp.uint8).view(dtype)
    return cp.empty(shape, dtype)


def randn(rng, shape, dtype):
    return rng.standard_normal(shape, dtype=cp.float32).astype(dtype)


def to_torch(x):
    if x is None or not isinstance(x, cp.ndarray):
        return x
    names = {E4M3: torch.float8_e4m3fn, BF16: torch.bfloat16}
    if x.dtype in names:
        bits = cp.uint8 if x.dtype.itemsize == 1 else cp.int16
        return torch.from_dlpack(x.view(bits)).view(names[x.dtype])
    return torch.from_dlpack(x)


def setup(*, B, S, Hq, Hkv, R, Dn, mla=False, dtype=F16, out=E4M3, prefix=0, page_size=16,
          layout="NHD", seed=0):
    """One case: ropekv and FlashInfer calls on the same inputs (separate caches and q outputs,
    pre-allocated, as CUDA-graph users do), and the bytes the op must move."""
    rng = cp.random.default_rng(seed)
    T = B * S
    D = R + Dn
    q = randn(rng, (T, Hq, D), dtype)
    if mla:
        kv = randn(rng, (T, D), dtype)
        k_rope, k_nope, v = kv[:, Dn:], kv[:, :Dn], None
        q_rope, q_nope = q[..., Dn:], q[..., :Dn]
    else:
        k, v = randn(rng, (T, Hkv, D), dtype), randn(rng, (T, Hkv, D), dtype)
        q_rope, q_nope = q[..., :R], q[..., R:]
        k_rope, k_nope = k[..., :R], k[..., R:]
    if not Dn:
        q_nope = k_nope = None
    pages = -(-(prefix + S) // page_size)
    num_pages = B * pages + 64
    kv_indices = cp.asarray(np.random.default_rng(seed).permutation(num_pages)[:B * pages],
                            cp.int32)
    kv_indptr = cp.arange(B + 1, dtype=cp.int32) * pages
    batch_indices = cp.repeat(cp.arange(B, dtype=cp.int32), S)
    positions = cp.tile(cp.arange(S, dtype=cp.int32), B) + prefix
    table = ropekv.cos_sin_cache(prefix + S + 16, R, xp=cp)
    if mla:
        shapes = [(num_pages, page_size, Dn), (num_pages, page_size, R)]
    elif layout == "NHD":
        shapes = [(num_pages, page_size, Hkv, D)] * 2
    else:
        shapes = [(num_pages, Hkv, page_size, D)] * 2

    def caches():
        return tuple(cp.zeros(s, cp.uint8 if out.itemsize == 1 else out).view(out)
                     for s in shapes)

    args = {"q_rope": q_rope, "k_rope": k_rope, "q_nope": q_nope, "k_nope": k_nope, "v": v,
                "cos_sin_cache": table, "pos_ids": positions, "kv_indices": kv_indices,
                "kv_indptr": kv_indptr, "batch_indices": batch_indices, "positions": positions,
                "page_size": page_size, "kv_layout": layout}
    mine = dict(args, paged_kv_cache=caches(), q_rope_out=empty((T, Hq, R), out),
                q_nope_out=empty((T, Hq, Dn), out))
    op = (ropekv.rope_quantize_fp8_append_paged_kv_cache if out.itemsize == 1
          else ropekv.rope_append_paged_kv_cache)

    def fn():
        op(**mine)

    peer = None
    if flashinfer is not None and out.itemsize == 1:
        theirs = {n: to_torch(x) for n, x in args.items()}
        theirs.update(paged_kv_cache=tuple(to_torch(c) for c in caches()),
                      q_rope_out=to_torch(empty((T, Hq, R), out)),
                      q_nope_out=to_torch(empty((T, Hq, Dn), out)) if Dn else None,
                      quantize_dtype=torch.float8_e4m3fn)

        def peer():
            flashinfer.rope.rope_quantize_fp8_append_paged_kv_cache(**theirs)

        def check():
            fn()
            fn()  # the second call takes the eager fast path
            peer()
            cp.cuda.Device().synchronize()
            a = mine["q_rope_out"].view(cp.uint8).get()
            b = theirs["q_rope_out"].view(torch.uint8).cpu().numpy()
            c = [x.view(cp.uint8).get() for x in mine["paged_kv_cache"]]
            d = [x.view(torch.uint8).cpu().numpy() for x in theirs["paged_kv_cache"]]
            same = [float((a == b).mean())] + [float((x == y).mean()) for x, y in zip(c, d)]
            return "same bytes as FlashInfer: q {:.4f}, caches {:.4f} / {:.4f}".format(*tuple(same))
    elif flashinfer is not None and not mla:
        # FlashInfer has no one-launch RoPE + append without quantization: its two launches.
        tq, tk = to_torch(q.copy()), to_torch(k.copy())
        tv, tpos, tcache = to_torch(v), to_torch(positions), tuple(to_torch(c) for c in caches())
        last = to_torch(cp.full(B, (prefix + S - 1) % page_size + 1, cp.int32))
        targs = [to_torch(x) for x in (table, batch_indices, kv_indices, kv_indptr)]

        def peer():
            flashinfer.rope.apply_rope_with_cos_sin_cache_inplace(
                tpos, tq.view(T, -1), tk.view(T, -1), D, targs[0], True)
            flashinfer.page.append_paged_kv_cache(tk, tv, targs[1], tpos, tcache, targs[2],
                                                  targs[3], last, layout)

        def check():
            return "FlashInfer: 2 launches (apply_rope_with_cos_sin_cache_inplace + append)"
    else:
        def check():
            return ""

    if mla:
        nb = nbytes_of.paged_mla_bytes(T, Hq, Dn, R, dtype, out, out)
    else:
        nb = nbytes_of.rope_kv_bytes(T, Hq, Hkv, D, R, dtype, out, out)
    return fn, peer, nb, check


def torch_graph_us(fn, calls=100, replays=20):
    fn()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        g.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3 / calls)
    return statistics.median(times)


def torch_eager_us(fn, calls=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


GQA = {"Hq": 32, "Hkv": 8, "R": 128, "Dn": 0}
MLA = {"Hq": 128, "Hkv": 1, "R": 64, "Dn": 512, "mla": True, "dtype": BF16}
PREFILL = [
    ("GQA 32/8/128 fp16->e4m3 NHD p16, 8x1024", {**GQA, "B": 8, "S": 1024}),
    ("GQA 32/8/128 fp16->fp16 NHD p16, 8x1024", {**GQA, "B": 8, "S": 1024, "out": F16}),
    ("GQA 32/8 64+64 bf16->e4m3 HND p16, 8x1024",
     {**GQA, "B": 8, "S": 1024, "R": 64, "Dn": 64, "dtype": BF16, "layout": "HND"}),
    ("MLA 128 64+512 bf16->e4m3, 4x2048", {**MLA, "B": 4, "S": 2048}),
]
DECODE = [
    ("GQA decode 1 tok fp16->e4m3", {**GQA, "B": 1, "S": 1, "prefix": 1000}),
    ("GQA decode 64 tok fp16->e4m3", {**GQA, "B": 64, "S": 1, "prefix": 1000}),
    ("GQA decode 256 tok fp16->e4m3", {**GQA, "B": 256, "S": 1, "prefix": 1000}),
    ("MLA decode 128 tok bf16->e4m3", {**MLA, "B": 128, "S": 1, "prefix": 1000}),
]


# (unroll, rot_unroll, min_blocks_per_sm); tests/test_paged.py checks each against the reference
VARIANTS = ((4, 1, 4), (2, 2, 4), (4, 2, 3), (4, 1, 1), (2, 1, 6), (2, 1, 1), (1, 1, 8), (1, 1, 1))


def sweep():
    """Time each kernel shape (forced for every call) on the main cases; the table below uses
    paged.TUNING as shipped (its light / heavy choice per call)."""
    default = dict(paged.TUNING)
    picked = [*PREFILL[:1], *PREFILL[3:], *DECODE[1:2]]
    print("sweep (us): unroll, rot_unroll, min_blocks_per_sm, max_block ->",
          " | ".join(name for name, _ in picked))
    cases = [setup(**kw) for _, kw in picked]
    for unroll, rot, minb in VARIANTS:
        for max_block in (128, 256):
            shape = (unroll, rot, minb)
            paged.TUNING.update(light=shape, heavy=shape, max_block=max_block)
            t = []
            for i, (fn, _, _, _) in enumerate(cases):
                t.append(graph_us(fn) if i == len(cases) - 1 else
                         median_us(fn, warmup=5, reps=50))
            print(f"  {unroll} {rot} {minb} {max_block:4d} -> "
                  + " | ".join(f"{x:8.2f}" for x in t), flush=True)
    paged.TUNING.update(default)


def main():
    props = cp.cuda.runtime.getDeviceProperties(0)
    bw = copy_bandwidth()
    print(f"device: {props['name'].decode()}, copy bandwidth (1 GiB, read + write): "
          f"{bw / 1e12:.2f} TB/s; TUNING {paged.TUNING}")
    if "--sweep" in sys.argv:
        sweep()
    rows = []
    for name, kw in PREFILL:
        fn, peer, nb, check = setup(**kw)
        note = check()
        us = median_us(fn, warmup=20, reps=200)
        peer_us = median_us(peer, warmup=20, reps=200) if peer else None
        same_size = copy_bandwidth(nb // 2, reps=20)
        rows.append((name, us, peer_us, nb, same_size, None, None, None, None, note))
    for name, kw in DECODE:
        fn, peer, nb, check = setup(**kw)
        note = check()
        us = median_us(fn, warmup=20, reps=200)
        peer_us = median_us(peer, warmup=20, reps=200) if peer else None
        g, e = graph_us(fn), eager_host_us(fn)
        pg = torch_graph_us(peer) if peer else None
        pe = torch_eager_us(peer) if peer else None
        rows.append((name, us, peer_us, nb, None, g, pg, e, pe, note))

    def f(x, w=8, p=1):
        return " " * w if x is None else f"{x:{w}.{p}f}"

    print(f"\n{'case':44s} {'ropekv':>8s} {'FI':>8s} {'MB':>8s} {'GB/s':>7s} {'%copy':>6s} "
          f"{'%cp@sz':>6s} {'graph':>7s} {'FIgraph':>7s} {'eager':>7s} {'FIeager':>7s}")
    for name, us, pus, nb, same, g, pg, e, pe, note in rows:
        gbs = nb / (us * 1e-6)
        print(f"{name:44s} {f(us)} {f(pus)} {nb / 1e6:8.2f} {gbs / 1e9:7.0f} "
              f"{gbs / bw * 100:6.1f} {f(None if same is None else gbs / same * 100, 6)} "
              f"{f(g, 7, 2)} {f(pg, 7, 2)} {f(e, 7, 2)} {f(pe, 7, 2)}")
    print()
    for name, *_, note in rows:
        if note:
            print(f"{name}: {note}")
    print("(us = median device time per call; graph = per call under CUDA-graph replay; eager = "
          "host time per back-to-back eager call; %copy against the 1 GiB copy, %cp@sz against a "
          "copy of the same bytes)")


if __name__ == "__main__":
    main()
