"""What a CUDA graph of a fused QKV call costs where the call runs cuBLAS eagerly: Llama-3-8B
projection (weights rotated over 4 copies), fp16, fp8 and 4-bit weights (the formats given), each
token count given.
``eager``: the shipped eager path (cuBLAS + the epilogue above WGMMA_MAX_TOKENS /
MMA_MAX_TOKENS_QUANTIZED), its device time (``ropekv._timing.device_us``: each call queued behind a
spin kernel, so the host's time stays out, as the bench times prefill); ``events``: 40 eager
calls back to back between two events (host-bound where the host takes longer); ``graph``: the
same call captured in a CUDA graph (the fused kernel, up to GRAPH_MAX_TOKENS), replayed;
``diff``: the largest difference of Q and both caches between one eager call and one graph replay
on the same inputs. On a GPU machine:
``PYTHONPATH=. python3 tools/experiments/qkv_capture_cost.py fp16,fp8,int4 144 256 384``."""

import sys

import cupy as cp
import ml_dtypes
import numpy as np
from qkv_timing import K, N, event_us, graph_us, llama_call

from ropekv import _timing
from ropekv import qkv as Q


def weights(wfmt):
    cp.random.seed(0)
    if wfmt == "fp16":
        return [
            (cp.random.standard_normal((N, K), cp.float32) / 64).astype(cp.float16)
            for _ in range(4)
        ], {}
    if wfmt == "int4":  # groups of 128 columns, float16 scales
        packed = [
            cp.asarray(Q.pack_int4(np.random.default_rng(i).integers(-8, 8, (N, K))))
            for i in range(4)
        ]
        return packed, {
            "weight_scales": cp.full((N, K // 128), 1 / 512, cp.float16),
            "group_size": 128,
        }
    codes = [
        cp.asarray(
            np.random.default_rng(i).integers(0, 0x40, (N, K), np.uint8) | np.uint8(0x80 * (i & 1))
        ).view(ml_dtypes.float8_e4m3fn)
        for i in range(4)
    ]  # |w| < 2, no NaN codes
    return codes, {"weight_scales": cp.full(N, 1 / 64, cp.float32)}


def diff(f, w, kc, vc):
    """Largest difference between an eager call and a captured one, on the same inputs."""
    kc[...] = 0
    vc[...] = 0
    q0 = f(w).astype(cp.float32)
    k0, v0 = kc.astype(cp.float32), vc.astype(cp.float32)
    kc[...] = 0
    vc[...] = 0
    cp.cuda.Device().synchronize()  # (the graph runs on a stream of its own)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        q = f(w)
        g = s.end_capture()
    g.launch(s)
    s.synchronize()
    return max(
        float(cp.abs(a.astype(cp.float32) - b).max()) for a, b in ((q, q0), (kc, k0), (vc, v0))
    )


for wfmt in sys.argv[1].split(","):
    ws, extra = weights(wfmt)
    for T in [int(t) for t in sys.argv[2:]]:
        f, kc, vc = llama_call(T, **extra)
        turn = iter(range(1 << 30))
        eager = _timing.device_us(lambda: f(ws[next(turn) % 4]), reps=60, budget_s=2.0)
        print(
            f"{wfmt} T {T:4d}  eager {eager:6.1f}  events {event_us(f, ws, 9):6.1f}  "
            f"graph {graph_us(f, ws, 9):6.1f}  diff {diff(f, ws[0], kc, vc):.3g}",
            flush=True,
        )
