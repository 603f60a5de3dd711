"""Every path of ``ropekv.fused_qkv_matmul_append_paged_kv_cache`` beside cuBLAS, per token count
and weight precision, on the Llama-3-8B projection (K 4096, Hq 32, Hkv 8, D 128, N 6144, fp16
input, RoPE, fp16 NHD cache with 16-entry pages): the tensor-core path (``qkv_mma``), the CUDA-core
skinny GEMM (``qkv_gemv``), cuBLAS + the ropekv epilogue, and ``cupy.matmul`` alone (fp16 weights,
no RoPE, no cache write), all in one run beside the copy bandwidth of the same run.

Small batches: device-event medians with the weights rotated over 4 copies and the L2 flushed
before each call, so every call streams its weights from HBM; ropekv's one-launch paths also under
CUDA-graph replay (rotated weights). Each path's Q is checked against the cuBLAS path's first.
Large batches: device-event medians.

    python benchmarks/bench_qkv_paths.py [--tokens 1 16 64] [--formats dense fp8 int4]
"""

from __future__ import annotations

import argparse
import json
import sys

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")

import numpy as np  # noqa: E402

from ropekv import _timing  # noqa: E402
from ropekv import qkv as qkv_mod  # noqa: E402

import bench_qkv as bq  # noqa: E402  (its setup(): inputs and rotated weight copies)

BYTES_PER = {"dense": 2, "fp8": 1, "int4": 0.5}
PATHS = {
    "mma": {"MMA_MIN_TOKENS": 1, "MMA_MAX_TOKENS": 1 << 30, "MMA_MAX_TOKENS_QUANTIZED": 1 << 30},
    "gemv": {"MMA_MAX_TOKENS": 0, "MMA_MAX_TOKENS_QUANTIZED": 0, "GEMV_MAX_TOKENS": 1 << 30},
    "cublas": {"MMA_MAX_TOKENS": 0, "MMA_MAX_TOKENS_QUANTIZED": 0, "GEMV_MAX_TOKENS": 0},
    "default": {},
}
VARIANTS = {f"mma S{s}": {**PATHS["mma"], "MMA_SPLIT": s} for s in qkv_mod.MMA_SPLITS}
PATHS.update(VARIANTS)


def call(case, i, path):
    import ropekv

    saved = {n: getattr(qkv_mod, n) for n in PATHS[path]}
    for n, v in PATHS[path].items():
        setattr(qkv_mod, n, v)
    try:
        return ropekv.fused_qkv_matmul_append_paged_kv_cache(
            case["x"], case["weights"][i % bq.COPIES], case["offsets"], case["lengths"],
            case["table"], case["caches"], num_q_heads=bq.HQ, cos_sin_cache=case["cos_sin"],
            out=case["out"], **case["kw"])
    finally:
        for n, v in saved.items():
            setattr(qkv_mod, n, v)


def rel_err(a, b):
    import cupy as cp

    a, b = (cp.asnumpy(x).astype(np.float64) for x in (a, b))
    return float((np.linalg.norm(a - b, axis=1) / np.maximum(np.linalg.norm(b, axis=1), 1e-9))
                 .max())


def main():
    import cupy as cp

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="*",
                    default=[1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256])
    ap.add_argument("--formats", nargs="*", default=["dense", "fp8", "int4"])
    ap.add_argument("--prefill", type=int, nargs="*", default=[8192])
    ap.add_argument("--variants", action="store_true", help="cluster size sweep")
    ap.add_argument("--json")
    opts = ap.parse_args()
    bw = _timing.copy_bandwidth()
    print(f"# copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    rows = []
    flush = _timing.L2Flusher()

    def report(case, what, us, wbytes=None, extra=""):
        rate = "" if wbytes is None else \
            f"{wbytes / us / 1e6:5.2f} TB/s {wbytes / us * 1e6 / bw * 100:5.1f}% copy"
        print(f"{case:18s} {what:26s} {us:9.2f} us {rate} {extra}", flush=True)
        rows.append({"case": case, "what": what, "us": us, "weight_bytes": wbytes,
                     "extra": extra})

    for wfmt in opts.formats:
        wb = int(bq.N * bq.K * BYTES_PER[wfmt])
        made = bq.setup(1, wfmt)  # the weight copies, made once per format
        for T in opts.tokens:
            copies, bq.COPIES = bq.COPIES, 0
            try:
                c = bq.setup(T, wfmt)
            finally:
                bq.COPIES = copies
            c["weights"], c["kw"] = made["weights"], made["kw"]
            name = f"{wfmt} T={T}"
            ref = call(c, 0, "cublas").copy()
            rot = {"i": 0}

            def rotating(path):
                def fn():
                    rot["i"] += 1
                    return call(c, rot["i"], path)
                return fn

            paths = ["mma", "cublas"] + (["gemv"] if T <= 8 else [])
            if opts.variants:
                paths = list(VARIANTS)
            for path in paths:
                err = rel_err(call(c, 0, path), ref)
                if not opts.variants:
                    us = _timing.median_us(rotating(path), warmup=5, reps=30, setup=flush)
                    report(name, path, us, wb, f"err vs cublas path {err:.1e}")
                if path != "cublas":  # cuBLAS cannot be called under CuPy's stream capture
                    us = _timing.graph_us(rotating(path), calls=40, replays=10)
                    report(name, path + ", graph", us, wb,
                           f"err vs cublas path {err:.1e}" if opts.variants else "")
            if wfmt == "dense" and not opts.variants:
                def mm():
                    rot["i"] += 1
                    return cp.matmul(c["x"], c["weights"][rot["i"] % bq.COPIES].T)
                report(name, "cupy.matmul alone",
                       _timing.median_us(mm, warmup=5, reps=30, setup=flush), wb)
            if T in (1, 16, 64) and not opts.variants:
                host = _timing.eager_host_us(lambda: call(c, 0, "default"), calls=500)
                report(name, "eager host time (default)", host)
        report(wfmt, "weight bytes / copy bw", wb / bw * 1e6, wb)
    for T in opts.prefill:
        c = bq.setup(T, "dense", requests=8)
        c["weights"] = c["weights"][:1] * bq.COPIES
        flops = 2 * T * bq.N * bq.K
        t_mm = _timing.median_us(lambda: cp.matmul(c["x"], c["weights"][0].T), warmup=5, reps=30)
        t_ro = _timing.median_us(lambda: call(c, 0, "default"), warmup=5, reps=30)
        report(f"prefill T={T}", "cupy.matmul alone", t_mm,
               extra=f"{flops / t_mm / 1e6:.0f} TFLOP/s")
        report(f"prefill T={T}", "ropekv (default path)", t_ro, extra=f"{t_ro / t_mm:.3f}x")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"copy_bandwidth": bw, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
