"""Quantized weights on ``qkv_wgmma``: the codes converted into the wgmmas' A registers (the
shipped forms: 4-bit weights with groups of a multiple of 64, ``W_INT4_REG``; fp8 weights,
``W_FP8_REG``) beside the 16-bit shared-memory buffers (``qkv.WGMMA_INT4_REG=False`` /
``qkv.WGMMA_FP8_REG=False``), on Llama-3-8B's projection (4-bit groups of 128), through
``ropekv bench``'s runner (graph replay, weights rotated past the L2, outputs checked against the
default first; the cuBLAS fp16 / bf16 GEMM alone as the peer). On a GPU machine::

    PYTHONPATH=. python3 tools/experiments/qkv_reg_forms.py [--format int4 fp8] [--bf16]
        [--tokens 17 64 ...] [--json out.json]
"""

from __future__ import annotations

import argparse

from ropekv.bench import report, runner, tuning
from ropekv.bench.arrays import BF16, F16
from ropekv.bench.workloads import qkv

# the token counts each format takes qkv_wgmma at (4-bit: 17-224, fp8: 48-128)
TOKENS = {"int4": (17, 32, 64, 96, 128, 192, 224), "fp8": (48, 64, 96, 128)}
VARIANT = {"int4": "qkv.WGMMA_INT4_REG=False", "fp8": "qkv.WGMMA_FP8_REG=False"}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json")
    parser.add_argument("--format", nargs="+", choices=sorted(TOKENS), default=["int4", "fp8"])
    parser.add_argument("--tokens", type=int, nargs="+", help="default: each format's range")
    parser.add_argument("--bf16", action="store_true", help="bf16 inputs too")
    args = parser.parse_args(argv)
    dtypes = (F16, BF16) if args.bf16 else (F16,)
    specs = [
        qkv.case({"fp8": "e4m3"}.get(fmt, fmt), T, dtype)
        for fmt in args.format
        for dtype in dtypes
        for T in args.tokens or TOKENS[fmt]
    ]
    variant = ",".join(VARIANT[fmt] for fmt in args.format)
    tune = [(variant, tuning.parse(variant))]
    result = runner.run(specs=specs, peers=("cublas",), tune=tune)
    print(report.text(result))
    if args.json:
        report.write_json(result, args.json)


if __name__ == "__main__":
    main()
