"""How many clusters of S CTAs a GPU runs at once when each CTA takes a whole SM (384 threads and
200 KB of dynamic shared memory, as ``qkv_wgmma``'s deep tiles do), by two measures: the driver's
``cuOccupancyMaxActiveClusters``, and a probe kernel whose CTAs stamp their start and spin 200 us
(a CTA that starts after the first ones ended ran in a second wave). A cluster's CTAs share a GPC,
so this can be less than the SMs over S: on the H200 (132 SMs) 66 of 2, 39 of 3, 30 of 4, 17 of 6
and 15 of 8 (``docs/design/qkv.md``, the split that keeps its clusters in one wave). On a GPU
machine::

    python3 tools/experiments/cluster_occupancy.py
"""

from __future__ import annotations

import ctypes

import cupy as cp
import numpy as np

from ropekv._launch import _cu_occupancy_max_active_clusters, _LaunchConfig

SOURCE = r"""
template <int S>
__global__ void __cluster_dims__(S, 1, 1) __launch_bounds__(384, 1)
    spin(unsigned long long* t, long long ns) {
  extern __shared__ unsigned char smem[];
  unsigned long long t0, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  if (threadIdx.x == 0) {
    smem[0] = 1;
    t[2 * blockIdx.x] = t0;
  }
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - t0 < ns);
  if (threadIdx.x == 0) t[2 * blockIdx.x + 1] = now;
}
"""
SIZES = (1, 2, 3, 4, 6, 8)
SMEM = 200 * 1024  # one CTA an SM


def main():
    names = [f"spin<{s}>" for s in SIZES]
    module = cp.RawModule(
        code=SOURCE, options=("-std=c++17", "--gpu-architecture=sm_90"), name_expressions=names
    )
    query = _cu_occupancy_max_active_clusters()  # (ropekv's binding: argument types set)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    print(f"{sms} SMs; one CTA an SM (384 threads, {SMEM // 1024} KB of shared memory)")
    for s, name in zip(SIZES, names):
        kernel = module.get_function(name)
        kernel.max_dynamic_shared_size_bytes = SMEM
        config = _LaunchConfig()
        config.grid[:] = (s, 1, 1)
        config.block[:] = (384, 1, 1)
        config.shared_mem = SMEM
        held = ctypes.c_int(-1)
        rc = query(ctypes.byref(held), kernel.kernel.ptr, ctypes.byref(config))
        for clusters in sorted({sms // s, -(-128 // s)}):
            t = cp.zeros(2 * clusters * s, cp.uint64)
            kernel((clusters * s,), (384,), (t, np.int64(200_000)), shared_mem=SMEM)
            cp.cuda.Device().synchronize()
            stamps = t.get().reshape(-1, 2).astype(np.int64)
            late = int((stamps[:, 0] >= stamps[:, 1].min()).sum())
            print(
                f"clusters of {s}: {held.value if rc == 0 else '?'} at once (driver); "
                f"{clusters} clusters ({clusters * s} CTAs): {late} CTAs in a second wave"
            )


if __name__ == "__main__":
    main()
