"""Whether a change alters the compiled kernels, without a GPU: the SASS of two source trees'
kernels, compared kernel by kernel.

Why: a refactor of a kernel source (a helper taken out, a loop rewritten) needs a side-by-side
timing on the GPU unless it compiles to the same machine code. This tool settles that on any
machine with CuPy's NVRTC, ptxas and nvdisasm, no GPU needed: each tree's ``ropekv`` compiles the
op's kernel instantiations (its ``instantiations()``, those containing one of the ``--match``
strings) with NVRTC and ``ropekv._compile``'s options to PTX, ptxas assembles it for one
architecture (one ptxas for both trees: an NVRTC 12 cubin is an ELF that nvdisasm 13 refuses),
nvdisasm lists the kernels, and each kernel's instructions are compared with branch labels and
addresses set aside. The paged kernels' row-addressing helpers (``lean_row``, ``lean_source``,
``lean_dest``) were checked this way: all 252 lean-kernel instantiations with 32-bit offsets
identical on sm_90.

Usage (from the repository root; OLD is a tree holding an older ``ropekv/``, for instance
``mkdir OLD && git archive REV ropekv | tar x -C OLD``)::

    python tools/sass_diff.py OLD --stem paged --match "rope_append_paged_rows_lean<" --arch sm_90

Prints a line per kernel that differs (its instruction counts, old and new), the kernels only one
tree has, and a summary; exits 0 when every kernel both trees have is identical, 1 otherwise.
ptxas: ``$PTXAS``, then PATH (nvcc's). nvdisasm: ``$NVDISASM``, then PATH, then the
nvidia-cuda-nvdisasm wheel (``pip install nvidia-cuda-nvdisasm``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Run in each tree's own process (its ropekv on sys.path first): the matching expressions, one
# NVRTC program for all of them (compute_XX), its PTX and {expression: lowered name} written to OUT.
COMPILE = """
import importlib, json, sys
from cupy_backends.cuda.libs import nvrtc
from ropekv import _compile as c
stem, arch, out, matches = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
module = importlib.import_module("ropekv." + stem)
names = [e for e in dict.fromkeys(module.instantiations())
         if (not matches or any(m in e for m in matches))
         and (arch.endswith("a") or not c.arch_specific(e))]
virtual = "compute_" + arch.split("_", 1)[1]
prog = nvrtc.createProgram(c.read_source(stem), stem + ".cu", [], [])
for e in names:
    nvrtc.addNameExpression(prog, e)
nvrtc.compileProgram(prog, ["--gpu-architecture=" + virtual, *c.OPTIONS, *c._header_options()])
ptx = nvrtc.getPTX(prog)
with open(out + ".ptx", "wb") as f:
    f.write(ptx if isinstance(ptx, bytes) else ptx.encode())
with open(out + ".json", "w") as f:
    json.dump({e: nvrtc.getLoweredName(prog, e) for e in names}, f)
"""

_FUNCTION = re.compile(r"^\.text\.(\S+):\s*$")
_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s*(.*?)\s*;")
_LABEL = re.compile(r"\.L_x_\d+")


def find_tool(name):
    """``$NAME`` (upper case), then PATH, then a pip wheel's ``nvidia/cu13|cu12/bin``; or None."""
    found = os.environ.get(name.upper()) or shutil.which(name)
    if found:
        return found
    for base in sys.path:
        for cuda in ("cu13", "cu12"):
            path = os.path.join(base, "nvidia", cuda, "bin", name)
            if os.path.exists(path):
                return path
    return None


def functions(listing):
    """``{mangled name: [instruction, ...]}`` of an nvdisasm listing, each instruction without
    its address and with branch labels replaced by ``L`` (they are numbered per cubin)."""
    out, current = {}, None
    for line in listing.splitlines():
        head = _FUNCTION.match(line)
        if head:
            current = out.setdefault(head.group(1), [])
            continue
        ins = _INSTRUCTION.match(line)
        if ins and current is not None:
            current.append(_LABEL.sub("L", ins.group(1)))
    return out


def compare(old, new):
    """``(same, differ, only_old, only_new)`` of two ``{expression: instructions}`` maps:
    ``differ`` lists ``(expression, old count, new count)``."""
    same, differ = [], []
    for e in old.keys() & new.keys():
        if old[e] == new[e]:
            same.append(e)
        else:
            differ.append((e, len(old[e]), len(new[e])))
    return (
        sorted(same),
        sorted(differ),
        sorted(old.keys() - new.keys()),
        sorted(new.keys() - old.keys()),
    )


def kernels(tree, stem, arch, matches, workdir, tools):
    """``{expression: instructions}`` of ``tree``'s kernels of ``stem`` that match."""
    ptxas, disasm = tools
    out = os.path.join(workdir, "kernels")
    path = os.pathsep.join(p for p in (tree, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path)
    subprocess.run(
        [sys.executable, "-c", COMPILE, stem, arch, out, *matches], cwd=tree, env=env, check=True
    )
    with open(out + ".json") as f:
        lowered = json.load(f)
    subprocess.run([ptxas, f"-arch={arch}", out + ".ptx", "-o", out + ".cubin"], check=True)
    listing = subprocess.run(
        [disasm, "-c", out + ".cubin"], capture_output=True, text=True, check=True
    ).stdout
    by_name = functions(listing)
    return {e: by_name.get(name, []) for e, name in lowered.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", help="a tree holding the older ropekv/ package")
    parser.add_argument("--new", default=ROOT, help="the newer tree (default: this checkout)")
    parser.add_argument("--stem", required=True, help="the kernel file: paged, qknorm, ...")
    parser.add_argument(
        "--match", nargs="*", default=[], help="expressions containing one of these"
    )
    parser.add_argument("--arch", default="sm_90", help="the architecture (default sm_90)")
    args = parser.parse_args(argv)
    tools = find_tool("ptxas"), find_tool("nvdisasm")
    if tools[0] is None:
        sys.exit("ptxas not found: put the CUDA toolkit's bin on PATH, or set PTXAS")
    if tools[1] is None:
        sys.exit("nvdisasm not found: pip install nvidia-cuda-nvdisasm, or set NVDISASM")
    with tempfile.TemporaryDirectory() as work:
        old_dir, new_dir = os.path.join(work, "old"), os.path.join(work, "new")
        os.makedirs(old_dir)
        os.makedirs(new_dir)
        old = kernels(args.old, args.stem, args.arch, args.match, old_dir, tools)
        new = kernels(args.new, args.stem, args.arch, args.match, new_dir, tools)
    same, differ, only_old, only_new = compare(old, new)
    for e, a, b in differ:
        print(f"differs: {e} ({a} -> {b} instructions)")
    for e in only_old:
        print(f"only in old: {e}")
    for e in only_new:
        print(f"only in new: {e}")
    print(f"{len(same)} identical, {len(differ)} differ of {len(same) + len(differ)} ({args.arch})")
    return 0 if not differ else 1


if __name__ == "__main__":
    sys.exit(main())
