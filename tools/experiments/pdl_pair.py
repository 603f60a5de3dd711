"""Programmatic dependent launch (``enable_pdl=True``) measured where it can pay: a producer
kernel, then the ropekv op reading what it wrote, both captured in one CUDA graph.

The producer is an RMSNorm of a ``(T, hidden)`` hidden state written into the op's query input
(for Llama-3-8B's paged GQA case that is exactly the ``(T, 32, 128)`` q; for the other ops the
first ``T * hidden`` elements of it), in two forms: plain, and one that executes
``griddepcontrol.launch_dependents`` first (so the dependent grid may be scheduled before the
producer ends; its ``griddepcontrol.wait`` still waits for the producer to finish and flush).
Each pair is captured 100 times into one graph and the replay is timed with events
(``ropekv._timing.graph_us``, the median of 20 replays), with the op's ``enable_pdl`` off and on.
On a GPU machine::

    PYTHONPATH=. python3 tools/experiments/pdl_pair.py [CASE ...]

Cases are ``ropekv bench`` case names (decode cases by default).
"""

from __future__ import annotations

import sys

import cupy as cp

from ropekv import bench
from ropekv._timing import graph_us

SRC = r"""
template <typename T, bool TRIGGER>
__global__ void rmsnorm(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y,
                        int hidden) {
  if (TRIGGER) asm volatile("griddepcontrol.launch_dependents;" :::);
  const T* row = x + (long long)blockIdx.x * hidden;
  float s = 0.f;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) { float v = float(row[i]); s += v * v; }
  __shared__ float part[32];
  for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = s;
  __syncthreads();
  if (threadIdx.x < 32) {
    s = threadIdx.x < (blockDim.x >> 5) ? part[threadIdx.x] : 0.f;
    for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (threadIdx.x == 0) part[0] = rsqrtf(s / hidden + 1e-6f);
  }
  __syncthreads();
  float r = part[0];
  T* out = y + (long long)blockIdx.x * hidden;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) out[i] = T(float(row[i]) * r * float(w[i]));
}
"""
DECODE = [
    "paged gqa fp16->e4m3 1x1",
    "paged gqa fp16->e4m3 64x1",
    "paged gqa fp16->e4m3 256x1",
    "qknorm qwen3-32b bf16->bf16 1x1",
    "qknorm qwen3-32b bf16->bf16 64x1",
    "paged mla bf16->e4m3 1x1",
    "paged mla bf16->e4m3 64x1",
]
QUERY = ("q_rope", "q")  # the op's query input, by workload


def producer(module, dtype, trigger, q, T):
    """A launcher of the RMSNorm producer writing ``q`` (as ``(T, hidden)``)."""
    ctype = {"float16": "__half", "bfloat16": "__nv_bfloat16"}[dtype.name]
    kernel = module.get_function(f"rmsnorm<{ctype}, {'true' if trigger else 'false'}>")
    hidden = q.size // T
    x = cp.random.standard_normal((T, hidden), dtype=cp.float32).astype(q.dtype)
    w = cp.random.standard_normal((hidden,), dtype=cp.float32).astype(q.dtype)
    y = q.reshape(T, hidden)
    return lambda: kernel((T,), (256,), (x, w, y, cp.int32(hidden)))


def pair(first, second):
    """Both launchers, one after the other (one captured unit of the graph)."""

    def run():
        first()
        second()

    return run


def main(cases):
    names = [f"rmsnorm<{t}, {b}>" for t in ("__half", "__nv_bfloat16") for b in ("true", "false")]
    module = cp.RawModule(
        code="#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n" + SRC,
        options=("-std=c++17",),
        name_expressions=names,
    )
    specs = {s.name: s for s in bench.bench_specs()}
    print(
        f"{'case':36s} {'op':>7s} {'prod':>7s} {'pair':>7s} {'pdl':>7s} {'trig':>7s} {'trig+pdl':>8s}"
    )
    for name in cases:
        w = specs[name].make()
        o = w.new_outputs()
        q = next(w.a[k] for k in QUERY if k in w.a)
        T = q.shape[0]
        plain = w.bound(o)
        pdl = w.bound(o, enable_pdl=True)
        prod = producer(module, q.dtype, False, q, T)
        trig = producer(module, q.dtype, True, q, T)
        row = [
            graph_us(plain),
            graph_us(prod),
            graph_us(pair(prod, plain)),
            graph_us(pair(prod, pdl)),
            graph_us(pair(trig, plain)),
            graph_us(pair(trig, pdl)),
        ]
        print(f"{name:36s} " + " ".join(f"{t:7.2f}" for t in row[:5]) + f" {row[5]:8.2f}")


if __name__ == "__main__":
    main(sys.argv[1:] or DECODE)
