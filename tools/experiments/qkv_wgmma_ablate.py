"""Where qkv_wgmma's time goes: the kernel with a part of it cut out of its source (timing only;
the outputs of a cut kernel are wrong), Llama-3-8B projection, fp16 weights rotated over 4 copies
(200 MB), graph replay of 4 calls. On a GPU machine:
``PYTHONPATH=. python3 tools/experiments/qkv_wgmma_ablate.py VARIANT T...``

VARIANT: ``full``; ``noload`` (only the first stages are copied, the main loop's copies cut);
``noloop`` (no main loop: launch, token addressing, epilogue); ``noepi`` (no cluster epilogue,
its barriers included); ``nostore`` (the epilogue's neox runs computed but not stored);
``noitems`` (the epilogue's barriers alone). Settings from the environment: STAGES, ATOMS, TILE,
SPLIT (the WGMMA_* constants) and PERSM (the CTAs an SM is taken to hold, which sets the split)."""

import os
import sys

import ropekv._compile as C

CUTS = {
    "full": [],
    "noload": [
        ("if (ks + STAGES - 1 < nk) load((ks + STAGES - 1) % STAGES, ks + STAGES - 1);", "")
    ],
    "noloop": [
        (
            "const int nk = (kend - kbeg + BK - 1) / BK;\n\n  // Each thread copies",
            "const int nk = 0;\n\n  // Each thread copies",
        )
    ],
    "noepi": [
        (
            "cluster_epilogue<T, W_DENSE, S, OPTS, true>(p, part, slots, rests, row0, t0, nt, "
            "rank);",
            "",
        )
    ],
    "nostore": [
        (
            "        write_run<T, V>(p, tok, t0 + t, rp.head, rp.da, a);\n"
            "        write_run<T, V>(p, tok, t0 + t, rp.head, rp.db, b);",
            "        if (a[0] == 12345.f)\n"
            "          write_run<T, V>(p, tok, t0 + t, rp.head, rp.da, a);\n"
            "        if (b[0] == 12345.f)\n"
            "          write_run<T, V>(p, tok, t0 + t, rp.head, rp.db, b);",
        )
    ],
    "noitems": [("w < nt * ITEMS; w += S * blockDim.x)", "w < 0; w += S * blockDim.x)")],
}
variant = sys.argv[1]
source = C.read_source("qkv")
for old, new in CUTS[variant]:
    assert source.count(old) == 1, old
    source = source.replace(old, new)
read = C.read_source
C.read_source = lambda stem: source if stem == "qkv" else read(stem)

import cupy as cp
from qkv_timing import K, N, graph_us, llama_call

from ropekv import qkv as Q

Q.WGMMA_MIN_TOKENS, Q.WGMMA_MAX_TOKENS = 1, 1 << 30
SETTINGS = {
    "STAGES": "WGMMA_STAGES",
    "ATOMS": "WGMMA_ATOMS",
    "TILE": "WGMMA_MAX_TILE",
    "SPLIT": "WGMMA_SPLIT",
}
for env, name in SETTINGS.items():
    if env in os.environ:
        setattr(Q, name, int(os.environ[env]))
if "PERSM" in os.environ:
    Q._wgmma_per_sm = lambda smem: int(os.environ["PERSM"])
ws = [(cp.random.standard_normal((N, K), cp.float32) / 64).astype(cp.float16) for _ in range(4)]
out = []
for T in [int(t) for t in sys.argv[2:]]:
    out.append(f"T{T}={graph_us(llama_call(T)[0], ws):.1f}")
given = " ".join(f"{k}={os.environ[k]}" for k in (*SETTINGS, "PERSM") if k in os.environ)
print(variant, given, " ".join(out), flush=True)
