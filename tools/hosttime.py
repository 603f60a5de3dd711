"""Eager host time per call of every op's decode case on a GPU, CuPy arrays and torch tensors, and
the host time of the first call of a new layout (kernels already compiled).

Usage (on a GPU machine, from the repository root)::

    PYTHONPATH=$PWD python tools/hosttime.py [--profile] [--calls N] [--layers N]
                                             [--replay c|python]

Per case: ``first`` is the median host time over 10 first calls (every op's plans cleared before
each; timed to the call's return, the device synchronised outside the timing), ``cupy`` /
``torch`` the host time per call of back-to-back eager calls with CuPy arrays and with zero-copy
torch views of them (bursts below the launch queue: the host's own work, whatever the kernel's
time). Both time the ropekv call with its arguments built once (``Workload.bound``). ``--profile`` adds a cProfile of the torch
replays and of the first calls (CuPy and torch) of one case. The workloads are ``ropekv bench``'s.
``--layers N`` adds, for the ops with multi-layer caches, the same case on caches of N layers
called with ``layer_idx`` cycling over them through a small wrapper, and the one-layer call
through the same wrapper (``layer_idx=None``), which isolates the wrapper's own cost.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import pstats
import sys

# the cases, the options, the layer_idx wrapper and the replay switch of the CPU harness (tools/,
# this script's folder, is on sys.path); importing it installs no stub
from hostcost import LAYERED, Cycling, add_case_arguments, layered_name, use_replay

# the bench's measurements: per-call host time (ropekv._timing), first calls, plan clearing and
# the torch views of a workload (ropekv.bench.timing)
from ropekv._timing import eager_host_us
from ropekv.bench.timing import clear_plans, first_call_us, torch_workload

FIRST_CALLS = 10  # first calls timed per case and array kind (their median is the figure)


def per_call_us(fn, sync, calls):
    """Host time per eager call, back to back (``ropekv._timing.eager_host_us``: bursts below
    the driver's launch queue, so what is timed is the host's own work)."""
    return eager_host_us(fn, calls=calls, sync=sync)


def layered_rows(w, o, layers, sync, calls):
    """(label, first, first torch, cupy, torch) rows of a case through :class:`Cycling`, on its
    one-layer caches and on caches of ``layers`` layers; [] for an op without layers."""
    import cupy
    import torch

    import ropekv

    name = layered_name(w)
    if name is None:
        return []
    caches = LAYERED[name][1]
    fn, rows = getattr(ropekv, name), []
    for label, n in (("wrapper, one layer", None), (f"{layers} layers", layers)):
        ol = dict(o)
        if n is not None:
            for c in caches:
                shape = (n, *o[c].shape[:-1], o[c].shape[-1] * o[c].dtype.itemsize)
                ol[c] = cupy.zeros(shape, cupy.uint8).view(o[c].dtype)  # fp8 as bytes
        wt, ot = torch_workload(w, ol)
        setattr(ropekv, name, Cycling(fn, n))
        try:
            w.call(ol)
            sync()
            rows.append(
                (
                    f"  {label}",
                    first_call_us(lambda w=w, ol=ol: w.call(ol), sync, FIRST_CALLS),
                    first_call_us(lambda wt=wt, ot=ot: wt.call(ot), sync, FIRST_CALLS),
                    per_call_us(lambda w=w, ol=ol: w.call(ol), sync, calls),
                    per_call_us(lambda wt=wt, ot=ot: wt.call(ot), torch.cuda.synchronize, calls),
                )
            )
        finally:
            setattr(ropekv, name, fn)
    return rows


def first_call_profile(fn, sync, label, sort, lines, n=30):
    """Print a cProfile of ``n`` first calls of ``fn`` (every op's plans cleared before each),
    sorted by ``sort``, its first ``lines`` lines."""
    prof = cProfile.Profile()
    for _ in range(n):
        clear_plans()
        prof.enable()
        fn()
        prof.disable()
    sync()
    print(f"==== first-call profile, {label}")
    pstats.Stats(prof, stream=sys.stdout).sort_stats(sort).print_stats(lines)


def floor(sync, calls=20000):
    """What a call cannot avoid: a bare launch of an empty kernel through the driver wrapper
    ropekv uses, and the attribute reads of one CuPy array / one torch tensor."""
    import cupy
    import torch
    from cupy_backends.cuda.api.driver import launchKernel

    kernel = cupy.RawKernel('extern "C" __global__ void k(const long long* p) {}', "k")
    kernel.compile()
    func = kernel.kernel.ptr
    rec = cupy.cuda.alloc_pinned_memory(8)
    args = cupy.cuda.alloc_pinned_memory(8)
    import ctypes

    ctypes.c_uint64.from_address(args.ptr).value = rec.ptr
    stream = cupy.cuda.get_current_stream().ptr
    out = {
        "bare launchKernel": per_call_us(
            lambda: launchKernel(func, 1, 1, 1, 32, 1, 1, 0, stream, args.ptr, 0), sync, calls
        )
    }
    a = cupy.empty((64, 8, 128), cupy.float16)
    t = torch.empty((64, 8, 128), dtype=torch.float16, device="cuda")
    out["cupy array reads"] = per_call_us(
        lambda: (a.data.ptr, a.shape, a.strides, a.dtype, a.data.device_id), sync, calls
    )
    out["torch tensor reads"] = per_call_us(
        lambda: (t.data_ptr(), t.shape, t.stride(), t.dtype, t.get_device()), sync, calls
    )
    get_stream, get_device = cupy.cuda.get_current_stream, cupy.cuda.runtime.getDevice
    out["cupy current stream"] = per_call_us(lambda: get_stream(0).ptr, sync, calls)
    out["runtime.getDevice"] = per_call_us(get_device, sync, calls)
    raw = torch._C._cuda_getCurrentRawStream
    out["torch current stream"] = per_call_us(lambda: raw(0), sync, calls)
    out["empty lambda"] = per_call_us(lambda: None, sync, calls)
    for k, v in out.items():
        print(f"floor: {k:22s} {v:6.2f} us")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--no-floor", action="store_true")
    add_case_arguments(parser, calls=3000)
    args = parser.parse_args(argv)
    import cupy
    import torch

    from ropekv import _native, bench

    use_replay(args.replay)

    def sync():
        cupy.cuda.runtime.deviceSynchronize()

    specs = {s.name: s for s in bench.bench_specs()}
    rows = []
    for name in args.cases:
        w = specs[name].make()
        o = w.new_outputs()
        w.call(o)  # compiles
        sync()
        call = w.bound(o)  # the ropekv call, its arguments built once
        first = first_call_us(call, sync, FIRST_CALLS)
        cp_us = per_call_us(call, sync, args.calls)
        wt, ot = torch_workload(w, o)
        call_t = wt.bound(ot)
        first_t = first_call_us(call_t, sync, FIRST_CALLS)
        th_us = per_call_us(call_t, torch.cuda.synchronize, args.calls)
        rows.append((name, first, first_t, cp_us, th_us))
        print(
            f"{name:34s} first {first:7.1f} us (torch {first_t:7.1f})   cupy {cp_us:6.2f} us   "
            f"torch {th_us:6.2f} us",
            flush=True,
        )
        if args.layers:
            rows += layered_rows(w, o, args.layers, sync, args.calls)
        if args.profile and name.startswith(("qknorm", "paged gqa fp16->e4m3 64x1")):
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.calls):
                wt.call(ot)
            prof.disable()
            torch.cuda.synchronize()
            print(f"==== replay profile, torch: {name}")
            pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(20)
            first_call_profile(functools.partial(w.call, o), sync, f"cupy: {name}", "cumtime", 35)
            first_call_profile(call_t, torch.cuda.synchronize, f"torch: {name}", "tottime", 30)
    if not args.no_floor:
        floor(sync)
    print(f"\nreplay: {_native.state() if args.replay == 'c' else 'Python (--replay python)'}")
    print(f"{'case':34s} {'first cupy':>11s} {'first torch':>12s} {'cupy':>9s} {'torch':>9s}")
    for name, first, first_t, cp_us, th_us in rows:
        print(f"{name:34s} {first:9.1f}us {first_t:10.1f}us {cp_us:7.2f}us {th_us:7.2f}us")


if __name__ == "__main__":
    main()
