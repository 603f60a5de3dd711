"""One call of every ropekv kernel on the GPU, each checked against the NumPy backend: the
workload of ``tools/sanitize.sh``'s racecheck, initcheck and synccheck passes."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from tests.test_call_path import check_device_call
from tests.tolerance import to_device

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
CALLS = [
    ("contiguous", {}),
    ("contiguous", {"cache_dtype": E4M3}),
    ("paged", {"cache_dtype": E4M3}),  # GQA
    ("paged", {"cache_dtype": E4M3, "mla": True, "Hkv": 1, "R": 16, "Dn": 32}),
    ("mla", {}),
    ("mla", {"cache_dtype": E4M3, "split": True}),
    ("qknorm", {}),
    ("qknorm", {"cache_dtype": E4M3, "layout": "HND"}),
    ("qkv", {"lengths": (1,)}),  # the fused GEMV kernel
    ("qkv", {}),  # cuBLAS and the epilogue
    ("qkv", {"wfmt": "int4", "cache_dtype": E4M3}),  # dequantize, cuBLAS, fp8 epilogue
    ("qkv", {"wfmt": "fp8", "lengths": (1, 1)}),
]


def main():
    for op, case in CALLS:
        check_device_call(op, 0, to_device, **case)
        print(f"ok {op} {case}")


if __name__ == "__main__":
    main()
