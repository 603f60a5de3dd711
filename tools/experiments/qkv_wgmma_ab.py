"""qkv_wgmma forced on at each token count given (Llama-3-8B projection, fp16 weights rotated over
4 copies), timed under graph replay and eagerly with events; ``--cublas`` first times the cuBLAS
path (cuBLAS + qkv_epilogue, eager events) and checks Q and both caches of the two against each
other. ``PATCH="old=>new"`` replaces a string of qkv.cu first (an experiment). A/B of two trees: run
it once with each on ``PYTHONPATH``. On a GPU machine:
``PYTHONPATH=. python3 tools/experiments/qkv_wgmma_ab.py [--cublas] 16 64 128 256``."""

import os
import sys

import cupy as cp
from qkv_timing import K, N, event_us, graph_us, llama_call

import ropekv
from ropekv import _compile
from ropekv import qkv as Q

if os.environ.get("PATCH"):
    old, new = os.environ["PATCH"].split("=>")
    src = _compile.read_source("qkv")
    assert src.count(old) == 1, old
    src = src.replace(old, new)
    orig = _compile.read_source
    _compile.read_source = lambda stem: src if stem == "qkv" else orig(stem)
print("ropekv from", ropekv.__file__)
args = sys.argv[1:]
cub = "--cublas" in args
args = [a for a in args if not a.startswith("--")]
dt = cp.float16
cp.random.seed(0)
ws = [(cp.random.standard_normal((N, K), cp.float32) / 64).astype(dt) for _ in range(4)]
case = llama_call
for T in [int(t) for t in args]:
    line = f"T {T:4d}"
    if cub:
        Q.WGMMA_MAX_TOKENS, Q.MMA_MAX_TOKENS = 0, 16
        f, kc, vc = case(T)
        q0, k0, v0 = f(ws[0]).copy(), kc.copy(), vc.copy()
        line += f"  cublas {event_us(f, ws, 9):6.1f}"
        Q.MMA_MAX_TOKENS = 16
    Q.WGMMA_MIN_TOKENS, Q.WGMMA_MAX_TOKENS = 1, 1 << 30
    f, kc, vc = case(T)
    q = f(ws[0])
    if cub:
        d = max(
            float(cp.abs(a.astype(cp.float32) - b.astype(cp.float32)).max())
            for a, b in ((q, q0), (kc, k0), (vc, v0))
        )
        line += f" (max diff {d:.3g})"
    line += f"  wgmma {graph_us(f, ws, 9):6.1f} ev {event_us(f, ws, 9):6.1f}"
    print(line, flush=True)
