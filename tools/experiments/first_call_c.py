"""The first call's C helpers on trial: host time of a first call of a layout with
``_native.first_call_c(True)`` (``overlap_pairs``, ``written_layouts``, ``same_device`` and the
argument reader ``read_views`` in C) and ``(False)`` (their Python forms), interleaved in one
process, and the bytecode each executes; ``--switch read`` switches the argument reader alone.

On a GPU machine (under 60 s, most of it start-up and the kernels' compilation)::

    PYTHONPATH=. python3 tools/experiments/first_call_c.py [--rounds 31]

On a CPU (the stand-ins and stubbed driver of ``tools/hostcost.py``: no device, so no
synchronisation; the C replay launches through a no-op stub)::

    PYTHONPATH=. python3 tools/experiments/first_call_c.py --cpu

Why interleaved: on the H200 host one first call's time drifts with the process's state (202 us
after start-up, 128-177 after importing torch / JAX / FlashInfer, 91-104 later for paged GQA at
one token, ``first_call_drift.py``), far more than the helpers can save. So, after settling
rounds (every case, both settings, untimed), each round times one first call of every case and
array kind with the switch on and off back to back, in the order on-off in even rounds and off-on
in odd ones (every op's plans cleared before each call, the device synchronised outside the
timing). A drift phase then lands on both settings alike. Per case and kind it prints the median
and the spread (min-max) of each setting, the median of the paired differences (off - on: above
0, C saves that much) and the bytecode instructions each setting's first call executes (Python
frames only; the C helpers' work is not bytecode).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

CASES = (
    "paged gqa fp16->e4m3 1x1",
    "paged gqa fp16->e4m3 1x1 dynamic q kv scales",
    "qknorm qwen3-32b tp 8/1 bf16->bf16 1x1",
    "qk_rope llama 32/8/128 fp16 1",
    "contiguous fp16->e4m3 1x1",
)
ROUNDS = 31  # timed rounds (each: one first call per case, kind and setting)
SETTLE = 3  # untimed rounds first


def count_opcodes(fn):
    """Bytecode instructions executed by ``fn()`` in every Python frame it enters."""
    n = [0]

    def trace(frame, event, arg):
        frame.f_trace_opcodes = True
        if event == "opcode":
            n[0] += 1
        return trace

    sys.settrace(trace)
    try:
        fn()
    finally:
        sys.settrace(None)
    return n[0]


def gpu_calls(names):
    """``({(case, kind): call}, sync)`` on the GPU: bench workloads, CuPy arrays and torch
    tensors viewing them, each called once (kernels compiled)."""
    import cupy
    import torch

    from ropekv.bench import cases
    from ropekv.bench.timing import torch_workload

    specs = {s.name: s for s in cases.bench_specs()}
    calls = {}
    for name in names:
        w = specs[name].make()
        o = {k: w.a[k] for k in w.outputs_names}
        tw, to = torch_workload(w, o)
        calls[name, "cupy"], calls[name, "torch"] = w.bound(o), tw.bound(to)
    for call in calls.values():
        call()
    torch.cuda.synchronize()
    return calls, cupy.cuda.runtime.deviceSynchronize


def cpu_calls(names):
    """``({(case, kind): call}, None)`` on stand-ins of CuPy arrays and torch tensors with a
    stubbed driver (``tools/hostcost.py``; it installs a stand-in ``torch`` module)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from hostcost import Case, host_workloads, install_stubs, to_cupy, to_torch

    install_stubs()
    calls = {}
    for name, w in host_workloads(list(names)).items():
        calls[name, "cupy"], calls[name, "torch"] = Case(w, to_cupy), Case(w, to_torch)
    for call in calls.values():
        call()
    return calls, None


def switch(which):
    """The setter of the C forms on trial: ``all`` (:func:`ropekv._native.first_call_c`: the three
    checks and the argument reader) or ``read`` (the argument reader alone, ``read_views``)."""
    from ropekv import _arrays, _launch, _native

    if which == "all":
        return _native.first_call_c
    module = _launch.native_module()
    reader = None if module is None else module.read_views

    def read_only(on=None):
        before = _arrays.NATIVE_READ[0] is not None
        if on is not None:
            _arrays.NATIVE_READ[0] = reader if on else None
        return before

    return read_only


def measure(calls, sync, rounds=ROUNDS, settle=SETTLE, which="all"):
    """``{(case, kind, on): [us per round]}``: ``settle`` untimed rounds, then ``rounds`` rounds
    of one first call per case, kind and setting (on-off in even rounds, off-on in odd ones)."""
    from ropekv.bench.timing import clear_plans, first_call_us

    first_call_c = switch(which)
    before = first_call_c()
    times = {(case, kind, on): [] for case, kind in calls for on in (True, False)}
    try:
        for r in range(settle + rounds):
            order = (True, False) if r % 2 == 0 else (False, True)
            for (case, kind), fn in calls.items():
                for on in order:
                    first_call_c(on)
                    us = first_call_us(fn, sync, n=1)  # one first call: plans cleared
                    if r >= settle:
                        times[case, kind, on].append(us)
    finally:
        first_call_c(before)
        clear_plans()
    return times


def opcodes(calls, which="all"):
    """``{(case, kind, on): bytecode instructions of one first call}``."""
    from ropekv.bench.timing import clear_plans

    first_call_c = switch(which)
    before = first_call_c()
    # CPython 3.12 reports no opcode events in a process's first traced call (3.12.1: a function
    # counts 0, then 79 on every later call; 3.11 and 3.13 count it the first time): one untimed
    # count first, so the first case is not read as 0
    count_opcodes(lambda: sorted([2, 1]))
    counts = {}
    try:
        for (case, kind), fn in calls.items():
            for on in (True, False):
                first_call_c(on)
                clear_plans()
                counts[case, kind, on] = count_opcodes(fn)
    finally:
        first_call_c(before)
        clear_plans()
    return counts


def report(times, counts):
    """The table: per case and kind, each setting's median [min-max] us, the paired
    differences' median (off - on) and the bytecode counts."""
    print(
        f"{'case':46s} {'kind':5s} {'C on: median [min-max] us':>27s} "
        f"{'C off: median [min-max] us':>28s} {'off-on':>7s} {'opcodes on/off':>15s}"
    )
    for case, kind in dict.fromkeys((c, k) for c, k, _ in times):
        on, off = times[case, kind, True], times[case, kind, False]
        diff = statistics.median(b - a for a, b in zip(on, off))

        def cell(xs):
            return f"{statistics.median(xs):7.1f} [{min(xs):6.1f}-{max(xs):6.1f}]"

        ops = f"{counts[case, kind, True]}/{counts[case, kind, False]}"
        print(f"{case:46s} {kind:5s} {cell(on):>27s} {cell(off):>28s} {diff:7.1f} {ops:>15s}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="stand-ins, stubbed driver (no GPU)")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--settle", type=int, default=SETTLE)
    parser.add_argument("--cases", nargs="+", default=CASES, help="bench case names (exact)")
    parser.add_argument(
        "--switch",
        choices=("all", "read"),
        default="all",
        help="the C forms switched: all of them, or the argument reader (read_views) alone",
    )
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    calls, sync = (cpu_calls if args.cpu else gpu_calls)(args.cases)
    from ropekv import _launch, _native

    module = _launch.native_module()
    print(f"replay: {_native.state()}")
    if module is None:
        print("no C replay loaded: the switch changes nothing here")
    print(f"set-up {time.perf_counter() - t0:.1f} s; {args.settle} settling + {args.rounds} rounds")
    times = measure(calls, sync, args.rounds, args.settle, args.switch)
    report(times, opcodes(calls, args.switch))
    print(f"total {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
