"""Offline (no GPU) SASS counts of the QK-norm decode kernels, old against new: nvcc builds the
kernels' cubin for sm_90 (explicit instantiations of kernels/qknorm.cu) and nvdisasm (pip install nvidia-cuda-nvdisasm; NVDISASM=path) lists
it. Prints static instruction counts and ptxas's registers per kernel (nvcc on PATH).

    python tools/experiments/qknorm_sass.py
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import numpy as np

from ropekv import qknorm
from ropekv._arrays import BFLOAT16
from ropekv._compile import read_source

E4M3 = np.dtype("float8_e4m3fn") if hasattr(np, "float8_e4m3fn") else None


def nvdisasm():
    """tools/sass_diff.py's lookup ($NVDISASM, PATH, the nvidia-cuda-nvdisasm wheel)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from sass_diff import find_tool

    found = find_tool("nvdisasm")
    if found:
        return found
    sys.exit("nvdisasm not found: pip install nvidia-cuda-nvdisasm, or set NVDISASM")


def build(expressions, workdir):
    """One cubin (nvcc -cubin -arch=sm_90, ptxas's register report) of the explicit
    instantiations of ``expressions``: (cubin path, ptxas's report)."""
    source = read_source("qknorm")
    lines = [source]
    for e in expressions:
        lines.append(f"template __global__ void {e}(const QKNormParams);")
    cu = os.path.join(workdir, "qknorm_all.cu")
    with open(cu, "w") as f:
        f.write("\n".join(lines))
    out = os.path.join(workdir, "qknorm_all.cubin")
    run = subprocess.run(
        ["nvcc", "-cubin", "-arch=sm_90", "-std=c++17", "-Xptxas", "-v", cu, "-o", out],
        capture_output=True,
        text=True,
        check=True,
    )
    return out, run.stderr


def count(path, name, tool):
    text = subprocess.run([tool, "-c", path], capture_output=True, text=True, check=True).stdout
    body, inside = [], False
    for line in text.splitlines():
        if re.match(rf"\s*\.text\.{re.escape(name)}:", line):
            inside = True
            continue
        if inside and re.match(r"\s*\.(text|section)\.", line):
            break
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if inside and m:
            body.append(m.group(1))
    ops = [re.sub(r"^@!?U?P\w+\s+", "", i).split()[0] for i in body]
    real = [o for o in ops if o not in ("NOP",)]
    return real


def main():
    from ropekv._arrays import FP8_DTYPES

    tool = nvdisasm()
    e4m3 = FP8_DTYPES[0]
    cases = []
    for cache, label in ((BFLOAT16, "bf16"), (e4m3, "e4m3")):
        cases.append((f"old N4 ROWS1 {label}", qknorm.expression(BFLOAT16, cache, True, 4, 1, 0)))
        cases.append((f"old N8 ROWS1 {label}", qknorm.expression(BFLOAT16, cache, True, 8, 1, 0)))
        for i32 in (True, False):
            cases.append(
                (
                    f"new D128 i32={int(i32)} {label}",
                    qknorm.decode_expression(BFLOAT16, cache, True, 128, True, i32),
                )
            )
    workdir = tempfile.mkdtemp()
    path, report = build([e for _, e in cases], workdir)
    names = subprocess.run([tool, "-c", path], capture_output=True, text=True, check=True).stdout
    mangled = re.findall(r"\.text\.(\S+):", names)
    regs = dict(
        re.findall(r"Compiling entry function '(\S+)'.*?Used (\d+) registers", report, re.DOTALL)
    )
    print(f"{'kernel':28} {'SASS':>5} {'regs':>4} {'LDG':>4} {'STG':>4} {'SHFL':>4} {'LDS/STS':>7}")
    for (label, expr), name in zip(cases, order(cases, mangled)):
        ops = count(path, name, tool)

        def k(prefix, ops=ops):
            return sum(o.startswith(prefix) for o in ops)

        print(
            f"{label:28} {len(ops):5} {regs.get(name, '?'):>4} {k('LDG'):4} {k('STG'):4} "
            f"{k('SHFL'):4} {k('LDS') + k('STS'):7}"
        )


def order(cases, mangled):
    """The mangled name of each case's kernel (matched by its template arguments' spelling)."""
    out = []
    for _, expr in cases:
        kernel = expr.split("<")[0]
        args = expr[expr.index("<") + 1 : -1].split(", ")
        # the cases differ in: cache type, N/D and the last bool(s); match on the itanium tail
        want = [m for m in mangled if kernel in m]
        out.append(pick(want, args))
    return out


def pick(names, args):
    """The name among ``names`` whose template arguments mangle as ``args``: the literal
    arguments (ints 'Li<n>E', bools 'Lb0E' / 'Lb1E') in order, and an fp8 type exactly when
    ``args`` name one (the types repeat as substitutions, S0_, so they are not spelled out)."""
    tail = "".join(
        f"Lb{int(a == 'true')}E" if a in ("true", "false") else f"Li{a}E"
        for a in args
        if a in ("true", "false") or a.lstrip("-").isdigit()
    )
    fp8 = [a for a in args if "fp8" in a]
    hits = [n for n in names if n.endswith(tail + "Ev12QKNormParams") and bool(fp8) == ("fp8" in n)]
    if len(hits) != 1:
        raise SystemExit(f"no unique kernel for {args}: {hits}")
    return hits[0]


if __name__ == "__main__":
    main()
