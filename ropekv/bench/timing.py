"""Timing of one runner on one case (``ropekv._timing`` holds the timers themselves).

Prefill cases: CUDA events around each call, queued behind a spin kernel so the host's enqueueing
stays out of the measurement, the L2 flushed by a read when the case's bytes would fit in it;
median of many. Decode cases (launch-bound): per-call time under CUDA-graph replay (CuPy's graph
for ropekv and CuPy peers, torch's for torch peers), plus host time per eager call, back to back
(``_timing.eager_host_us``: bursts below the launch queue, the host's own work), with CuPy arrays
and (ropekv) with torch tensors viewing the same memory; ropekv's host time is that of its call
with the arguments built once (``Workload.bound``). On the NumPy backend
(the CPU tests) a call's host time stands for all of these.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time
from typing import Any

import numpy as np

from ropekv.bench.arrays import _torch, one_line, torch_view
from ropekv.bench.peers import peer_availability

L2_FLUSH_BELOW = 120 << 20  # cases moving fewer bytes than this could be served from the 60 MB L2


def torch_graph_us(fn, calls, replays):
    """Device time per call of ``fn()`` captured ``calls`` times in one CUDA graph, replayed
    ``replays`` times."""
    torch = _torch()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(replays):
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3 / calls)
    del graph
    return float(np.median(times))


@contextlib.contextmanager
def _eager_path_in_graphs():
    """The graph replay times the path an eager call takes: a fused QKV call that runs cuBLAS
    eagerly runs the fused kernel instead on a capturing stream (up to
    ``ropekv.qkv.GRAPH_MAX_TOKENS`` tokens), so that is set to 0 while capturing: such a call is
    refused there and its case falls back to events, as the case's host time is that of the
    eager path (``docs/design/qkv.md`` has the captured one's cost)."""
    from ropekv import qkv

    saved = qkv.GRAPH_MAX_TOKENS
    qkv.GRAPH_MAX_TOKENS = 0
    try:
        yield
    finally:
        qkv.GRAPH_MAX_TOKENS = saved


def time_runner(r, spec, settings, flusher):
    """{"us": per-call device time, "graph_us", "host_us", "event_us" where measured}."""
    if r.framework == "numpy":
        return host_time(r.call, spec, settings)
    from ropekv import _timing

    res: dict[str, Any] = {}
    if spec.decode:
        try:
            with _eager_path_in_graphs():
                res["graph_us"] = (
                    torch_graph_us(r.call, settings["graph_calls"], 10)
                    if r.framework == "torch"
                    else _timing.graph_us(r.call, calls=settings["graph_calls"], replays=10)
                )
        except Exception as e:  # noqa: BLE001 - not capturable: fall back to events
            res["graph_error"] = one_line(e)
        res.update(eager_host_times(r, settings))
    flush = flusher if spec.nbytes < L2_FLUSH_BELOW else None
    res["event_us"] = _timing.device_us(
        r.call, reps=settings["reps"], flush=flush, budget_s=settings["budget_s"]
    )
    res["l2_flushed"] = flush is not None
    res["us"] = res.get("graph_us", res["event_us"])
    return res


def eager_host_times(r, settings):
    """The host times of runner ``r`` on the CUDA backend: ``{"host_us": host time per eager call
    (``ropekv._timing.eager_host_us`` on ``r.host_call``, ropekv's call with its arguments built
    once, else ``r.call``), "first_us": the first call of a layout (ropekv's runner only:
    :func:`first_call_us`)}``. A case measures them once, then ``remeasure_host`` again."""
    import cupy

    from ropekv import _timing

    res = {"host_us": _timing.eager_host_us(r.host_call or r.call, calls=settings["host_calls"])}
    if r.name == "ropekv":  # its budget: the first call of a layout
        res["first_us"] = first_call_us(r.host_call, cupy.cuda.runtime.deviceSynchronize)
    return res


# first calls timed per case and array kind as the case runs (their median goes into the case's
# host_rounds; the recorded figure comes from first_call_rounds, below)
FIRST_CALLS = 5


def launch_ops(modules=None):
    """Every ``ropekv._launch.Op`` of ``modules`` (op modules, or their names under ``ropekv``;
    default: every op module, ``ropekv._registry.OP_MODULES``)."""
    import importlib

    from ropekv import _launch, _registry

    found = []
    for m in _registry.OP_MODULES if modules is None else modules:
        module = importlib.import_module(f"ropekv.{m}") if isinstance(m, str) else m
        found += [v for v in vars(module).values() if isinstance(v, _launch.Op)]
    return found


def clear_plans(modules=None):
    """Forget the launch plans (of one-layer and of multi-layer calls) of every op of
    ``modules`` (default: every op module), so that the next call of any layout is a first
    call, planned with the ``TUNING`` of that moment. The bench's first calls, ``--tune``'s
    variants and the host-time tools all clear plans through this."""
    for op in launch_ops(modules):
        op.clear()


def first_call_us(fn, sync=None, n=FIRST_CALLS):
    """Median host time of ``n`` first calls of a layout (its kernels already compiled; every
    op's plans cleared before each): from the call to its return, the device synchronised by
    ``sync`` before and after, outside the timing (None: no device, as on the stand-ins of
    ``tools/hostcost.py``). The plans are cleared once more afterwards, so the calls that follow
    plan afresh, as the first call after this one would."""
    times = [_one_first_call(fn, sync) for _ in range(n)]
    clear_plans()
    return statistics.median(times)


def _one_first_call(fn, sync):
    """Host time (us) of one call of ``fn`` after every op's plans are cleared, the device
    synchronised by ``sync`` before and after it, outside the timing (None: no device)."""
    clear_plans()
    if sync is not None:
        sync()
    t0 = time.perf_counter()
    fn()
    us = (time.perf_counter() - t0) * 1e6
    if sync is not None:
        sync()
    return us


# The recorded first-call figure (``ropekv bench``'s ``first_us``, ``first_us_torch``): the median
# over FIRST_ROUNDS rounds of a phase after every case has run (first_call_rounds), after
# FIRST_SETTLE untimed rounds.
FIRST_ROUNDS = 7
FIRST_SETTLE = 1


def first_call_rounds(calls, sync=None, rounds=FIRST_ROUNDS, settle=FIRST_SETTLE):
    """``{key: [us, one per round]}``: host times of first calls of ``calls`` (``(key, fn)``
    pairs, each a call with its arguments built once and its kernels compiled), in rounds that
    each time one first call of every entry, forward in even rounds and backward in odd ones,
    after ``settle`` untimed rounds; every op's plans cleared before each call, the device
    synchronised by ``sync`` before and after it, outside the timing.

    Why rounds over all cases rather than several first calls of one case at once: on the H200
    host the same first call's time depends on the process's moment far more than on ropekv
    (paged GQA at one token: 202 us right after start-up, 128-177 after importing torch, JAX and
    FlashInfer, 91-104 at every later point; tools/experiments/first_call_drift.py), and the
    recorded run of 66c8261, which took 5 first calls as each case ran, put 42 of 288 figures
    above the 150 us budget, mostly early cases. Interleaved rounds, taken once the run's device
    timing and peers' compilation are done, give each case the same moments, so a drift phase
    moves every case's spread (min / max over rounds, recorded beside the median), not one
    case's figure."""
    calls = list(calls)
    times = {key: [] for key, _ in calls}
    for r in range(settle + rounds):
        for key, fn in calls if r % 2 == 0 else calls[::-1]:
            us = _one_first_call(fn, sync)
            if r >= settle:
                times[key].append(us)
    clear_plans()
    return times


def torch_workload(w, o):
    """``(tw, to)``: a shallow copy of workload ``w`` whose arrays are torch tensors viewing
    ``w``'s (DLPack, zero-copy), and the outputs ``o`` viewed the same way."""
    tw = copy.copy(w)
    tw.a = {k: torch_view(v) for k, v in w.a.items()}
    return tw, {k: torch_view(v) for k, v in o.items()}


def torch_host_us(w, calls):
    """{"host_us_torch": host time per eager call of ropekv's call made with torch tensors viewing
    the workload's arrays (DLPack, zero-copy), "first_us_torch": its first call of a layout}; {}
    without PyTorch, {"host_torch_error": ...} when the call fails on torch tensors."""
    if peer_availability().get("torch"):
        return {}
    try:
        torch = _torch()
        tw, o = torch_workload(w, w.new_outputs())
        from ropekv import _timing

        fn, sync = tw.bound(o), torch.cuda.synchronize
        return {
            "host_us_torch": _timing.eager_host_us(fn, calls=calls, sync=sync),
            "first_us_torch": first_call_us(fn, sync),
        }
    except Exception as e:  # noqa: BLE001 - reported, the case goes on
        return {"host_torch_error": one_line(e)}


def host_time(fn, spec, settings):
    """The NumPy backend's stand-in: median host time per call (``us``; ``host_us`` for decode)."""
    fn()
    times = []
    for _ in range(max(3, settings["reps"] // 10)):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    us = statistics.median(times)
    return {
        "us": us,
        "event_us": us,
        "l2_flushed": False,
        **({"host_us": us} if spec.decode else {}),
    }
