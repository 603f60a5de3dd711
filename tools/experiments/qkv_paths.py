"""fp16 fused QKV (Llama-3-8B projection, weights rotated over 4 copies) at each token count
given, under three path settings: ``cublas`` (cuBLAS + the epilogue: WGMMA_MAX_TOKENS = 128),
``deep`` (qkv_wgmma's deep kernel, all tokens one tile, up to 256) and ``tiles128`` (qkv_wgmma
above 192 tokens as tiles of at most 128, two CTAs an SM). ``dev``: eager device time
(``ropekv._timing.device_us``, each call queued behind a spin kernel); ``graph``: CUDA-graph replay
(tools/experiments/qkv_timing.py; ``cublas`` there is the capture path); ``d``: the largest
difference of Q and both caches from the first setting's. Two rounds. ``QKV_SOURCE=name`` compiles
``ropekv/kernels/<name>.cu`` in place of qkv.cu (an older qkv.cu copied there: an A/B of the
kernel source at the same settings). On a GPU machine:
``PYTHONPATH=. python3 tools/experiments/qkv_paths.py 160 193 224 256``."""

import os
import sys

import cupy as cp
from qkv_timing import K, N, graph_us, llama_call

from ropekv import _compile, _timing
from ropekv import qkv as Q

if os.environ.get("QKV_SOURCE"):
    _orig, _name = _compile.read_source, os.environ["QKV_SOURCE"]
    _source = _orig(_name)
    _compile.read_source = lambda stem: _source if stem == "qkv" else _orig(stem)

cp.random.seed(0)
ws = [(cp.random.standard_normal((N, K), cp.float32) / 64).astype(cp.float16) for _ in range(4)]
CFG = {"cublas": (128, 128), "deep": (256, 256), "tiles128": (256, 192)}  # (MAX, DEEP_MAX)
for _ in range(2):
    for T in [int(t) for t in sys.argv[1:]]:
        line = f"T {T:4d}"
        ref = None
        for name, (top, deep) in CFG.items():
            Q.WGMMA_MAX_TOKENS, Q.WGMMA_DEEP_MAX_TOKENS = top, deep
            f, kc, vc = llama_call(T)
            kc[...] = 0
            vc[...] = 0
            out = (f(ws[0]).astype(cp.float32), kc.astype(cp.float32), vc.astype(cp.float32))
            ref = ref or out
            d = max(float(cp.abs(a - b).max()) for a, b in zip(ref, out))
            turn = iter(range(1 << 30))
            dev = _timing.device_us(
                lambda f=f, turn=turn: f(ws[next(turn) % 4]), reps=80, budget_s=2.0
            )
            line += f" | {name} dev {dev:5.1f} graph {graph_us(f, ws, 9):5.1f} d {d:.2g}"
        print(line, flush=True)
