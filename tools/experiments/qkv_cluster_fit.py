"""qkv_wgmma where the largest split that fits the SMs leaves more clusters than the GPU runs at
once: 32 row tiles (16 / 8 heads of 128, Qwen3-1.7B's projection, K 2048, N 4096), the shipped
rule (``qkv.WGMMA_CLUSTER_FIT``: a split of 2 on the H200, which holds 30 clusters of 4 at one
CTA an SM) beside the SMs alone (``qkv.WGMMA_CLUSTER_FIT=False``: a split of 4, 32 clusters),
and Llama-3-8B's projection (48 row tiles, a split of 2 either way) as the control; through
``ropekv bench``'s runner (graph replay, weights rotated past the L2, outputs checked against
the default first; the cuBLAS GEMM alone as the peer). On a GPU machine::

    PYTHONPATH=. python3 tools/experiments/qkv_cluster_fit.py [--json out.json]
"""

from __future__ import annotations

import argparse

from ropekv.bench import report, runner, tuning
from ropekv.bench.workloads import qkv

QWEN3_1_7B = {"Hq": 16, "Hkv": 8, "D": 128}


def qwen_case(fmt, T):
    """``qkv.case`` at Qwen3-1.7B's projection (K 2048, N 4096) instead of Llama-3-8B's."""
    return qkv.case(fmt, T, heads=QWEN3_1_7B, K=2048)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json")
    parser.add_argument("--tokens", type=int, nargs="+", default=[17, 32, 64, 128])
    args = parser.parse_args(argv)
    specs = [
        make(fmt, T)
        for make in (qwen_case, qkv.case)
        for fmt in ("dense", "e4m3", "int4")
        for T in args.tokens
    ]
    variant = "qkv.WGMMA_CLUSTER_FIT=False"
    result = runner.run(specs=specs, peers=("cublas",), tune=[(variant, tuning.parse(variant))])
    print(report.text(result))
    if args.json:
        report.write_json(result, args.json)


if __name__ == "__main__":
    main()
