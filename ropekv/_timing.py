"""GPU timing shared by ``ropekv bench`` and the benchmark scripts.

Device events around each call, warm-up first, median of many. Launch-bound cases are also timed
under CUDA-graph replay (many calls captured in one graph, replay time over their count) and as
eager back-to-back host time. The copy ceiling is a large device-to-device copy, counting the bytes
read plus the bytes written.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time

import numpy as np


def median_us(fn, *, warmup=10, reps=100, setup=None):
    """Median device time of ``fn()`` in microseconds over ``reps`` calls: :func:`device_us` with
    no time budget. ``setup(i)``, when given, runs before call i outside the timed region."""
    return device_us(fn, warmup=warmup, reps=reps, flush=setup, budget_s=float("inf"))


def graph_us(fn, *, calls=100, replays=20):
    """Per-call device time under CUDA-graph replay: ``calls`` calls captured in one graph, the
    median replay time over ``calls``."""
    import cupy

    fn()  # compile and warm outside the capture
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        try:
            for _ in range(calls):
                fn()
        except BaseException:  # end the capture: an open one breaks every later CUDA call
            with contextlib.suppress(Exception):
                stream.end_capture()
            raise
        graph = stream.end_capture()
        graph.upload(stream)
        for _ in range(3):
            graph.launch(stream)
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        times = []
        for _ in range(replays):
            start.record(stream)
            graph.launch(stream)
            stop.record(stream)
            stop.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, stop) * 1e3 / calls)
    return statistics.median(times)


HOST_BURST = 100  # calls per timed burst: below the driver's queue of pending launches


def eager_host_us(fn, *, calls=2000, sync=None):
    """Host time per call of back-to-back eager calls (the launch-bound path): ``calls`` calls
    in bursts of :data:`HOST_BURST`, each burst timed from its first call to its last call's
    return, the device synchronised before each burst and outside the timing. A burst stays
    below the driver's queue of pending launches, so a kernel slower than the host never makes
    a call wait for the device: what is timed is the host's own work. The median over bursts.
    ``sync``: what waits for the calls (default: the whole device, through CuPy)."""
    if sync is None:
        import cupy

        sync = cupy.cuda.runtime.deviceSynchronize
    for _ in range(50):
        fn()
    sync()
    burst = min(HOST_BURST, calls)
    times = []
    for _ in range(max(1, calls // burst)):
        t0 = time.perf_counter()
        for _ in range(burst):
            fn()
        times.append((time.perf_counter() - t0) / burst * 1e6)
        sync()
    return statistics.median(times)


def copy_bandwidth(nbytes=1 << 30, reps=20):
    """Device-to-device copy bandwidth in bytes/s, counting read + write bytes."""
    import cupy

    src = cupy.empty(nbytes, cupy.uint8)
    dst = cupy.empty_like(src)
    src.fill(1)

    def copy():
        dst[...] = src

    return 2 * nbytes / (median_us(copy, warmup=3, reps=reps) * 1e-6)


class L2Flusher:
    """Evicts the L2 between timed calls by writing a buffer larger than it."""

    def __init__(self, nbytes=256 << 20):
        import cupy

        self.buf = cupy.empty(nbytes, cupy.uint8)

    def __call__(self, i=0):
        self.buf.fill(i & 0xFF)


_SPIN_SOURCE = r"""
extern "C" __global__ void ropekv_spin(long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < (unsigned long long)ns);
}
"""


_SPIN = {}


def _spin_kernel():
    import cupy

    device = cupy.cuda.Device().id
    if device not in _SPIN:
        _SPIN[device] = cupy.RawKernel(_SPIN_SOURCE, "ropekv_spin")
    return _SPIN[device]


def spin(us):
    """Keep the current stream busy for ``us`` microseconds (one thread spinning on the global
    timer), so that work enqueued behind it meanwhile starts back to back."""
    _spin_kernel()((1,), (1,), (np.int64(us * 1e3),))  # on the current stream


def device_us(fn, *, warmup=5, reps=100, flush=None, budget_s=0.5):
    """Median device time of ``fn()`` in microseconds, free of host enqueue time.

    Each timed call is queued behind a spin kernel that lasts longer than the host takes to
    enqueue the events and the call, so the start event fires right before the call's first
    kernel (without it, a call whose Python overhead exceeds its kernel time would be timed at its
    host speed). ``flush(i)``, when given, runs before each call outside the timed region (an L2
    flush). The number of calls is cut to fit ``budget_s`` seconds (at least 5)."""
    import cupy

    stream = cupy.cuda.get_current_stream()
    for i in range(warmup):
        if flush:
            flush(i)
        fn()
    stream.synchronize()
    t0 = time.perf_counter()
    fn()
    host_s = time.perf_counter() - t0
    stream.synchronize()
    once_s = time.perf_counter() - t0
    spin_us = min(max(50.0, 3e6 * host_s), 20000.0)
    per_rep = once_s + spin_us * 1e-6 + (2e-4 if flush else 0.0)
    if math.isfinite(budget_s):
        reps = max(5, min(reps, int(budget_s / per_rep)))
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for i in range(reps):
        if flush:
            flush(i)
        spin(spin_us)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) * 1e3)
    return statistics.median(times)


class L2ReadFlusher:
    """Evicts the L2 between timed calls by reading a buffer larger than it (a reduction), which
    leaves clean lines behind: a write-based flush leaves dirty lines whose write-back would be
    charged to the next timed call."""

    def __init__(self, nbytes=256 << 20):
        import cupy

        self.buf = cupy.ones(nbytes // 4, cupy.float32)
        self.out = cupy.empty((), cupy.float32)

    def __call__(self, i=0):
        import cupy

        cupy.sum(self.buf, out=self.out)
