"""4-bit weights with bf16 inputs at few tokens: the shipped path (``qkv_gemv`` at 1-2 tokens,
where ``qkv_gemv_lean`` takes fp16 inputs alone, and ``qkv_lean_mma`` from 3) beside
``qkv_lean_mma`` from one token (``qkv.GEMV_LEAN_MAX_TOKENS=0``), and the fp16-input cases beside
them, on Llama-3-8B's projection, through ``ropekv bench``'s runner (graph replay, weights
rotated past the L2, outputs checked against the default first; the cuBLAS fp16 / bf16 GEMM alone
as the peer). On a GPU machine::

    PYTHONPATH=. python3 tools/experiments/qkv_bf16_int4.py [--json out.json]
"""

from __future__ import annotations

import argparse

from ropekv.bench import report, runner, tuning
from ropekv.bench.arrays import BF16, F16
from ropekv.bench.workloads import qkv


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args(argv)
    specs = [qkv.case("int4", T, dtype) for dtype in (BF16, F16) for T in args.tokens]
    variant = "qkv.GEMV_LEAN_MAX_TOKENS=0"
    tune = [(variant, tuning.parse(variant))]
    result = runner.run(specs=specs, peers=("cublas",), tune=tune)
    print(report.text(result))
    if args.json:
        report.write_json(result, args.json)


if __name__ == "__main__":
    main()
