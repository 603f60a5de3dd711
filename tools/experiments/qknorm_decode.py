"""A/B of the QK-norm decode kernel (``qk_rmsnorm_rope_decode``) against the generic kernel it
replaces at decode (``TUNING["decode_tokens"] = 0``), on the GPU: Qwen3-32B heads (Hq 64, Hkv 8)
and tensor-parallel heads (8, 1), D 128, bf16 inputs on one packed qkv with float32 weights, bf16
and e4m3 caches (page 16, NHD), 1-256 tokens of one request each over a 1024-token prefix. Each
case first checks that both kernels write the same outputs (q_out, and the caches: 16-bit values
within 1e-2 relative, fp8 codes equal or one apart), then times each under CUDA-graph replay (100
calls a graph, median of 20 replays, ``ropekv._timing.graph_us``), interleaved, 3 rounds, and
prints a table. On a GPU machine::

    PYTHONPATH=. python3 tools/experiments/qknorm_decode.py [--rows 8 16] [--tokens 1 64]

``--rows``: also time the decode kernel at these ``TUNING["decode_rows"]`` (head rows a block).
"""

from __future__ import annotations

import argparse
import statistics

import cupy as cp
import ml_dtypes
import numpy as np

import ropekv
from ropekv import qknorm
from ropekv._timing import graph_us

BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
PAGE, PREFIX, D = 16, 1024, 128


def case(T, Hq, Hkv, cache_dtype, seed=0):
    """Arguments (CuPy) of T decode tokens, one request each, each after PREFIX cached tokens."""
    rng = np.random.default_rng(seed)
    pages_per = -(-(PREFIX + 1) // PAGE)
    num_pages = T * pages_per + 1
    table = rng.permutation(num_pages)[: T * pages_per].reshape(T, pages_per).astype(np.int32)
    qkv = (rng.standard_normal((T, Hq + 2 * Hkv, D)) * 3).astype(BF16)
    shape = (num_pages, PAGE, Hkv, D)
    caches = [(rng.standard_normal(shape) * 0.5).astype(cache_dtype) for _ in range(2)]
    return {
        "qkv": qkv,
        "caches": caches,
        "args": {
            "q_gamma": rng.uniform(0.5, 1.5, D).astype(np.float32),
            "k_gamma": rng.uniform(0.5, 1.5, D).astype(np.float32),
            "cos_sin_cache": ropekv.cos_sin_cache(PREFIX + 64, D, base=1e6),
            "input_row_offsets": np.arange(T + 1, dtype=np.int32),
            "cache_lengths": np.full(T, PREFIX, np.int32),
            "block_table": table,
        },
    }


def device_call(c, Hq, Hkv):
    """A closure calling the op on fresh device copies of the case (returns it and the arrays)."""
    from tests.tolerance import to_device

    qkv = to_device(c["qkv"])
    caches = tuple(to_device(x) for x in c["caches"])
    args = {k: to_device(v) for k, v in c["args"].items()}
    out = cp.empty((qkv.shape[0], Hq, D), qkv.dtype)

    def call():
        ropekv.qk_rmsnorm_rope_append_paged_kv_cache(
            qkv[:, :Hq],
            qkv[:, Hq : Hq + Hkv],
            qkv[:, Hq + Hkv :],
            paged_kv_cache=caches,
            q_out=out,
            **args,
        )

    return call, (out, *caches)


def to_host(x):
    from tests.tolerance import to_numpy

    return to_numpy(x)


def same_outputs(a, b, cache_dtype):
    """Both kernels' outputs agree (16-bit within 1e-2 relative, fp8 codes at most one apart)."""
    for x, y, name in zip(a, b, ("q_out", "k_cache", "v_cache")):
        x, y = to_host(x), to_host(y)
        if x.dtype == E4M3:
            diff = np.abs(x.view(np.int8).astype(int) - y.view(np.int8).astype(int))
            # codes adjacent (sign-magnitude: same sign, magnitude one apart) or equal
            if (diff > 1).any():
                raise AssertionError(f"{name}: fp8 codes differ by more than one step")
        else:
            x32, y32 = x.astype(np.float32), y.astype(np.float32)
            if not np.allclose(x32, y32, rtol=1e-2, atol=1e-2):
                raise AssertionError(f"{name}: max diff {np.abs(x32 - y32).max()}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="*", default=[])
    ap.add_argument("--tokens", type=int, nargs="*", default=[1, 4, 16, 64, 128, 256])
    ap.add_argument("--rounds", type=int, default=3)
    opt = ap.parse_args()
    default = dict(qknorm.TUNING)
    variants = [("old", {"decode_tokens": 0}), ("new", {})]
    variants += [(f"new rows {r}", {"decode_rows": r}) for r in opt.rows]
    head = f"{'heads':>6} {'cache':>5} {'T':>4} " + " ".join(f"{n:>12}" for n, _ in variants)
    print(head + "   new/old")
    for Hq, Hkv in ((64, 8), (8, 1)):
        for cache_dtype, cname in ((BF16, "bf16"), (E4M3, "e4m3")):
            for T in opt.tokens:
                c = case(T, Hq, Hkv, cache_dtype)
                outs, calls = [], []
                for _, tune in variants:
                    qknorm.TUNING.clear()
                    qknorm.TUNING.update(default, **tune)
                    call, arrays = device_call(c, Hq, Hkv)
                    call()
                    cp.cuda.runtime.deviceSynchronize()
                    outs.append(arrays)
                    calls.append((tune, call))
                for o in outs[1:]:
                    same_outputs(outs[0], o, cache_dtype)
                times = [[] for _ in variants]
                for _ in range(opt.rounds):
                    for i, (tune, call) in enumerate(calls):
                        qknorm.TUNING.clear()
                        qknorm.TUNING.update(default, **tune)
                        times[i].append(graph_us(call, calls=100, replays=20))
                qknorm.TUNING.clear()
                qknorm.TUNING.update(default)
                med = [statistics.median(t) for t in times]
                cells = " ".join(f"{m:12.2f}" for m in med)
                print(f"{Hq:>3}/{Hkv:<2} {cname:>5} {T:4} {cells}   {med[0] / med[1]:.2f}x")


if __name__ == "__main__":
    main()
