"""Time per launch of near-empty kernels under CUDA-graph replay: what a launch's parameter size,
static shared memory, the PDL instructions and a two-load index chain cost, at several grid sizes.

Each kernel is captured 200 times into one graph; the graph's replay is timed with events and
divided by 200 (median of 20 replays: ``ropekv._timing.graph_us``). On a GPU machine::

    PYTHONPATH=. python3 tools/experiments/launch_cost.py

H200 at 32666ad (docs/design/kernels.md, "Decode: the QK-norm kernel beside the Cake kernel"): 0.545 us an
empty launch of 10 blocks of 128 threads; 448 bytes of parameters and 10 KB of static shared
memory cost at most 0.02 us; ``griddepcontrol.launch_dependents`` first thing costs nothing at
10-132 blocks and 0.33 / 0.73 us at 640 / 1280 blocks of an empty kernel, placed first or last
(hidden behind a body of two dependent loads at 640 blocks, not at 1280: 1.58 -> 2.02 us);
``griddepcontrol.wait`` costs nothing; a body of two dependent loads takes about 0.45 us more.
"""

import cupy as cp
import numpy as np

from ropekv._timing import graph_us

WORDS = 56  # 448 bytes of parameters, about the size of QKNormParams
PARAMS = ", ".join(f"unsigned long long w{i}" for i in range(WORDS))
SUM = " + ".join(f"w{i}" for i in range(1, WORDS, 8))
NOBODY = "if (out && threadIdx.x == 999) out[0] = 1;"  # never true: keeps the kernel non-empty
CHAIN = (
    "int i = a[blockIdx.x & 7]; int v = b[i & 1023];"
    " out[blockIdx.x * blockDim.x + threadIdx.x] = v;"
)
DEP = 'asm volatile("griddepcontrol.launch_dependents;");'
WAIT = 'asm volatile("griddepcontrol.wait;" ::: "memory");'
SRC = f"""
extern "C" __global__ void k_small(int* out) {{ {NOBODY} }}
extern "C" __global__ void k_params({PARAMS}) {{
  unsigned long long s = {SUM};
  if (w0 && threadIdx.x == 999) ((unsigned long long*)w0)[0] = s;
}}
extern "C" __global__ void k_smem(int* out) {{
  __shared__ float buf[2560];
  buf[threadIdx.x] = threadIdx.x;
  __syncthreads();
  if (out && threadIdx.x == 999) out[0] = buf[(threadIdx.x + 1) % 128];
}}
extern "C" __global__ void k_dep(int* out) {{ {DEP} {NOBODY} }}
extern "C" __global__ void k_wait(int* out) {{ {WAIT} {NOBODY} }}
extern "C" __global__ void k_dep_end(int* out) {{ {NOBODY} {DEP} }}
extern "C" __global__ void k_chain(const int* a, const int* b, int* out) {{ {CHAIN} }}
extern "C" __global__ void k_chain_pdl(const int* a, const int* b, int* out) {{
  {DEP} {WAIT} {CHAIN}
}}
"""


def main():
    mod = cp.RawModule(code=SRC, options=("-arch=sm_90",))
    a = cp.zeros(1024, cp.int32)
    b = cp.arange(1024, dtype=cp.int32)
    out = cp.zeros(1 << 20, cp.int32)
    cases = {
        "empty": ("k_small", (out,)),
        "448 B params": ("k_params", tuple(np.uint64(0) for _ in range(WORDS))),
        "10 KB smem": ("k_smem", (out,)),
        "launch_dependents": ("k_dep", (out,)),
        "wait": ("k_wait", (out,)),
        "launch_dependents last": ("k_dep_end", (out,)),
        "two-load chain": ("k_chain", (a, b, out)),
        "chain + PDL": ("k_chain_pdl", (a, b, out)),
    }
    print("us per launch, graph replay; columns: blocks of 128 threads")
    grids = (10, 64, 132, 256, 640, 1280)
    print(f"{'kernel':24s}" + "".join(f"{g:>8d}" for g in grids))
    for label, (name, args) in cases.items():
        f = mod.get_function(name)
        row = [
            graph_us(lambda g=g, f=f, args=args: f((g,), (128,), args), calls=200) for g in grids
        ]
        print(f"{label:24s}" + "".join(f"{t:8.3f}" for t in row))


if __name__ == "__main__":
    main()
