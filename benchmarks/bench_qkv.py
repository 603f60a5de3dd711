"""Benchmark of ``ropekv.fused_qkv_matmul_append_paged_kv_cache`` on the Llama-3-8B projection
(K 4096, Hq 32, Hkv 8, D 128, N 6144), fp16, RoPE on, fp16 NHD cache with 16-entry pages.

Per case: ropekv's fused skinny GEMM (decode path), ropekv's cuBLAS + epilogue path, cuBLAS alone
(``cupy.matmul``, no RoPE, no cache write), and cuBLAS + ``ropekv.rope_append_paged_kv_cache``
(the unfused composition), all on identical inputs in one run, beside the copy bandwidth measured
in the same run. Weights are rotated over 4 copies (192 MiB, beyond the 60 MB L2) for decode, so
each call streams its weights from HBM. Device-event medians; decode also under CUDA-graph replay.

    python benchmarks/bench_qkv.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

sys.path.insert(0, ".")

import ropekv
from ropekv import _timing, reference
from ropekv import qkv as qkv_mod

K, HQ, HKV, D, PS = 4096, 32, 8, 128, 16
N = (HQ + 2 * HKV) * D
COPIES = 4


def setup(T, wfmt="dense", requests=None, cached=1000):
    """Inputs of one case (CuPy): T tokens over `requests` requests (T requests x 1 token when
    None), each with `cached` tokens already in the cache."""
    import cupy as cp

    rng = np.random.default_rng(T)
    B = T if requests is None else requests
    lengths = np.full(B, T // B)
    lengths[: T - lengths.sum()] += 1
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    pages_per = (cached + lengths.max() + PS - 1) // PS
    num_pages = B * pages_per
    table = rng.permutation(num_pages).astype(np.int32).reshape(B, pages_per)
    x = cp.asarray(rng.standard_normal((T, K)), cp.float16)
    weights, kw = [], {}
    for i in range(COPIES):
        if wfmt == "dense":
            weights.append((cp.random.standard_normal((N, K), cp.float32) / 64).astype(cp.float16))
        elif wfmt == "fp8":
            import ml_dtypes

            w8 = cp.clip(cp.random.standard_normal((N, K), cp.float32) * 8, -440, 440)
            host = cp.asnumpy(w8).astype(ml_dtypes.float8_e4m3fn)
            weights.append(cp.asarray(host.view(np.uint8)).view(ml_dtypes.float8_e4m3fn))
            kw["weight_scales"] = cp.full(N, 1 / 512, cp.float32)
        else:
            weights.append(cp.random.randint(0, 256, (N, K // 2), dtype=cp.int32)
                           .astype(cp.uint8))
            kw["group_size"] = 128
            kw["weight_scales"] = cp.full((N, K // 128), 1 / 300, cp.float16)
    caches = tuple(cp.zeros((num_pages, PS, HKV, D), cp.float16) for _ in range(2))
    case = {"x": x, "weights": weights, "offsets": cp.asarray(offsets),
            "lengths": cp.full(B, cached, cp.int32), "table": cp.asarray(table), "caches": caches,
            "cos_sin": ropekv.cos_sin_cache(cached + T + 16, D, xp=cp),
            "out": cp.empty((T, HQ * D), cp.float16), "kw": kw, "T": T, "B": B}
    # FlashInfer-style indices for the unfused peer
    t = np.arange(T)
    b_of = np.searchsorted(offsets, t, side="right") - 1
    case["batch_indices"] = cp.asarray(b_of.astype(np.int32))
    case["positions"] = cp.asarray((cached + t - offsets[b_of]).astype(np.int32))
    case["kv_indices"] = cp.asarray(table.reshape(-1))
    case["kv_indptr"] = cp.asarray((np.arange(B + 1) * pages_per).astype(np.int32))
    return case


def ropekv_call(case, i=0, path=None):
    old = qkv_mod.GEMV_MAX_TOKENS
    if path is not None:
        qkv_mod.GEMV_MAX_TOKENS = 1 << 30 if path == "gemv" else 0
    try:
        return ropekv.fused_qkv_matmul_append_paged_kv_cache(
            case["x"], case["weights"][i % COPIES], case["offsets"], case["lengths"],
            case["table"], case["caches"], num_q_heads=HQ, cos_sin_cache=case["cos_sin"],
            out=case["out"], **case["kw"])
    finally:
        qkv_mod.GEMV_MAX_TOKENS = old


def matmul_call(case, i=0):
    import cupy as cp

    return cp.matmul(case["x"], case["weights"][i % COPIES].T)


def ropekv_gemm(case):
    """The GEMM of ropekv's cuBLAS path alone (Q|K|V into a (T, N) temporary)."""
    import cupy as cp

    T, x, w = case["T"], case["x"], case["weights"][0]
    tmp = case.setdefault("tmp", cp.empty((T, N), cp.float16))
    qkv_mod._gemm(w.data.ptr, K, x.data.ptr, K, tmp.data.ptr, N, N, T, K, x.dtype, x.dtype, 0,
                  cp.cuda.get_current_stream())


def unfused_call(case, i=0):
    T = case["T"]
    qkv = matmul_call(case, i)
    q = qkv[:, :HQ * D].reshape(T, HQ, D)
    k = qkv[:, HQ * D:(HQ + HKV) * D].reshape(T, HKV, D)
    v = qkv[:, (HQ + HKV) * D:].reshape(T, HKV, D)
    return ropekv.rope_append_paged_kv_cache(
        q, k, None, None, v, case["cos_sin"], case["positions"], case["caches"],
        case["kv_indices"], case["kv_indptr"], case["batch_indices"], case["positions"],
        q_rope_out=case["out"].reshape(T, HQ, D))


def check(case):
    """ropekv's q against the float64 reference for the first tokens (row-wise relative)."""
    import cupy as cp

    t = min(case["T"], 4)
    q = cp.asnumpy(ropekv_call(case))[:t].astype(np.float64)
    w = reference.dequantize_weight(
        cp.asnumpy(case["weights"][0].view(cp.uint8)).view(case["weights"][0].dtype)
        if case["weights"][0].dtype.itemsize == 1 and case["weights"][0].dtype != np.uint8
        else cp.asnumpy(case["weights"][0]),
        None if "weight_scales" not in case["kw"] else cp.asnumpy(case["kw"]["weight_scales"]),
        case["kw"].get("group_size"))
    x = cp.asnumpy(case["x"][:t]).astype(np.float64)
    y = (x @ w[:HQ * D].T).reshape(t, HQ, D)
    pos = cp.asnumpy(case["positions"][:t])
    cos, sin = reference.split_cos_sin(cp.asnumpy(case["cos_sin"])[pos])
    y = reference.rope(y, cos[:, None], sin[:, None], True).reshape(t, -1)
    err = np.linalg.norm(q - y, axis=1) / np.linalg.norm(y, axis=1)
    return float(err.max())


def timed(fn, flush):
    return _timing.median_us(fn, warmup=5, reps=30, setup=flush)


def decode_case(c, wb, cname, report, flush, bw, peers):
    """Decode: weights rotate over COPIES sets, the L2 is flushed before each timed call."""
    report(cname, f"check: max rel err vs fp64 = {check(c):.1e}", 0.0)
    rot = {"i": 0}

    def rotating(fn):
        def call():
            rot["i"] += 1
            return fn(c, rot["i"])
        return call

    report(cname, "ropekv fused (gemv)",
           timed(rotating(lambda c, i: ropekv_call(c, i, "gemv")), flush), wb)
    if peers:
        report(cname, "ropekv cuBLAS + epilogue",
               timed(rotating(lambda c, i: ropekv_call(c, i, "cublas")), flush), wb)
        report(cname, "cupy.matmul alone", timed(rotating(matmul_call), flush), wb)
        try:
            report(cname, "cupy.matmul + rope_append_paged", timed(rotating(unfused_call), flush),
                   wb)
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
            print(f"{cname:28s} unfused peer skipped: {exc!r}")
    try:
        report(cname, "ropekv fused (gemv), graph", _timing.graph_us(
            rotating(lambda c, i: ropekv_call(c, i, "gemv")), calls=40, replays=10), wb)
    except Exception as exc:  # noqa: BLE001
        print(f"{cname:28s} graph replay skipped: {exc!r}")
    report(cname, "weight bytes / copy bandwidth", wb / bw * 1e6, wb)


def prefill_case(c, cname, report):
    T = c["T"]
    c["weights"] = c["weights"][:1] * COPIES
    flops = 2 * T * N * K
    report(cname, f"check: max rel err vs fp64 = {check(c):.1e}", 0.0)
    t_mm = timed(lambda: matmul_call(c), None)
    t_ro = timed(lambda: ropekv_call(c), None)
    report(cname, "cupy.matmul alone", t_mm, extra=f"{flops / t_mm / 1e6:.0f} TFLOP/s")
    report(cname, "ropekv (cuBLAS + epilogue)", t_ro, extra=f"{t_ro / t_mm:.3f}x cuBLAS alone")
    t_g = timed(lambda: ropekv_gemm(c), None)
    report(cname, "  of which its cuBLAS GEMM", t_g, extra=f"epilogue ~{t_ro - t_g:.1f} us")
    try:
        t_un = timed(lambda: unfused_call(c), None)
        report(cname, "cupy.matmul + rope_append_paged", t_un,
               extra=f"{t_un / t_mm:.3f}x cuBLAS alone")
    except Exception as exc:  # noqa: BLE001
        print(f"{cname:28s} unfused peer skipped: {exc!r}")
    if T <= 256:
        report(cname, "ropekv fused (gemv)", timed(lambda: ropekv_call(c, 0, "gemv"), None))


def main():
    import cupy as cp

    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    opts = ap.parse_args()
    dev = cp.cuda.Device()
    name = cp.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
    bw = _timing.copy_bandwidth()
    print(f"# {name}; copy bandwidth {bw / 1e12:.2f} TB/s (1 GiB D2D, read + write)")
    flush = _timing.L2Flusher()
    rows = []

    def report(case_name, what, us, wbytes=None, extra=""):
        gbs = ""
        if wbytes is not None:
            rate = wbytes / us * 1e6  # bytes/s
            gbs = f"{rate / 1e9:8.0f} GB/s {rate / bw * 100:5.1f}%"
        print(f"{case_name:28s} {what:34s} {us:9.2f} us {gbs} {extra}", flush=True)
        rows.append({"case": case_name, "what": what, "us": us, "weight_bytes": wbytes})

    tokens = (1, 16, 64) if opts.quick else (1, 2, 4, 8, 16, 32, 64)
    for T in tokens:
        decode_case(setup(T), N * K * 2, f"decode fp16 T={T}", report, flush, bw, peers=True)
    for wfmt, bytes_per in (("int4", 0.5), ("fp8", 1)):
        for T in (1, 16) if opts.quick else (1, 4, 16):
            decode_case(setup(T, wfmt), int(N * K * bytes_per), f"decode {wfmt} T={T}", report,
                        flush, bw, peers=False)
    qkv_mod.FAST_INT4 = True
    decode_case(setup(1, "int4"), N * K // 2, "decode int4 T=1 1+q/16 decode", report, flush, bw,
                peers=False)
    qkv_mod.FAST_INT4 = False
    for T in (8192,) if opts.quick else (256, 1024, 8192):
        prefill_case(setup(T, requests=8), f"prefill fp16 T={T}", report)
    c = setup(8192, "int4", requests=8)
    report("prefill int4 T=8192", "ropekv (dequant + cuBLAS + epi)",
           timed(lambda: ropekv_call(c), None))

    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"gpu": name, "copy_bandwidth": bw, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
