"""``qkv_gemv_lean``'s forms at the token counts it takes (1-2), on Llama-3-8B's projection (4-bit
groups of 128), through ``ropekv bench``'s runner (graph replay, weights rotated past the L2,
outputs checked against the default first; the cuBLAS GEMM alone as the peer): the shipped forms
(``qkv.GEMV_LEAN_FORM`` at a tile of one token, ``qkv.GEMV_LEAN_WIDE_FORM`` at two, each by weight
format) beside each ``--forms`` value given to every format and tile. On a GPU machine::

    PYTHONPATH=. python3 tools/experiments/qkv_lean_forms.py [--forms 3 7 15] [--tokens 1 2]
        [--bf16] [--json out.json]
"""

from __future__ import annotations

import argparse

from ropekv.bench import report, runner, tuning
from ropekv.bench.arrays import BF16, F16
from ropekv.bench.workloads import qkv


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json")
    parser.add_argument("--forms", type=int, nargs="+", default=[3, 7, 15])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--bf16", action="store_true", help="bf16 inputs too (16-bit, fp8)")
    args = parser.parse_args(argv)
    specs = [
        qkv.case(fmt, T, dtype)
        for dtype in ((F16, BF16) if args.bf16 else (F16,))
        for fmt in ("dense", "e4m3", "int4")
        if not (fmt == "int4" and dtype == BF16)  # qkv_lean_mma's from one token
        for T in args.tokens
    ]
    variants = [
        f"qkv.GEMV_LEAN_FORM={(f,) * 3},qkv.GEMV_LEAN_WIDE_FORM={(f,) * 3}" for f in args.forms
    ]
    result = runner.run(
        specs=specs, peers=("cublas",), tune=[(v, tuning.parse(v)) for v in variants]
    )
    print(report.text(result))
    if args.json:
        report.write_json(result, args.json)


if __name__ == "__main__":
    main()
