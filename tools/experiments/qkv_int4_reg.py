"""4-bit weights on ``qkv_wgmma``: the codes dequantized into the wgmmas' A registers (the
shipped form for groups of a multiple of 64, ``W_INT4_REG``) beside the 16-bit shared-memory
buffers (``qkv.WGMMA_INT4_REG=False``), on Llama-3-8B's projection (groups of 128), through
``ropekv bench``'s runner (graph replay, weights rotated past the L2, outputs checked against the
default first; the cuBLAS fp16 / bf16 GEMM alone as the peer). On a GPU machine::

    PYTHONPATH=. python3 tools/experiments/qkv_int4_reg.py [--tokens 17 64 ...] [--json out.json]
"""

from __future__ import annotations

import argparse

from ropekv.bench import report, runner, tuning
from ropekv.bench.arrays import BF16, F16
from ropekv.bench.workloads import qkv


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json")
    parser.add_argument("--tokens", type=int, nargs="+", default=[17, 32, 64, 96, 128, 192, 224])
    parser.add_argument("--bf16", action="store_true", help="bf16 inputs too")
    args = parser.parse_args(argv)
    dtypes = (F16, BF16) if args.bf16 else (F16,)
    specs = [qkv.case("int4", T, dtype) for dtype in dtypes for T in args.tokens]
    variant = "qkv.WGMMA_INT4_REG=False"
    tune = [(variant, tuning.parse(variant))]
    result = runner.run(specs=specs, peers=("cublas",), tune=tune)
    print(report.text(result))
    if args.json:
        report.write_json(result, args.json)


if __name__ == "__main__":
    main()
