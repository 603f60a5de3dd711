"""The timing loops of the fused QKV experiment scripts (``qkv_*_sweep.py``, ``qkv_wgmma_ab.py``,
``qkv_wgmma_ablate.py``): ``f(w)`` is one call with weights ``w``, ``ws`` four copies of the
weights that the calls rotate over (200 MB at Llama-3-8B's projection in fp16, so every call
streams its weights from DRAM). Both warm up with 8 calls and return the median per-call time in
microseconds over ``reps`` timed runs. The scripts run from the repository root
(``python3 tools/experiments/<script>.py``), so this module is on their path."""
import cupy as cp


def event_us(f, ws, reps=7):
    """Eager calls: 40 back to back between two events, a run."""
    for i in range(8):
        f(ws[i % 4])
    times = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        for i in range(40):
            f(ws[i % 4])
        b.record()
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b) * 1000 / 40)
    return sorted(times)[reps // 2]


def graph_us(f, ws, reps=7):
    """CUDA-graph replay: one call with each of the 4 weights captured in a graph on a stream of
    its own, 10 replays a run."""
    for i in range(8):
        f(ws[i % 4])
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        for w in ws:
            f(w)
        g = s.end_capture()
    g.launch(s)
    s.synchronize()
    times = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(s)
        for _ in range(10):
            g.launch(s)
        b.record(s)
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b) * 1000 / (10 * len(ws)))
    return sorted(times)[reps // 2]
