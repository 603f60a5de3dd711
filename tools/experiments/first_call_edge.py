"""Where a first call's time goes when it follows another op's call: the op-edge effect of the
bench's first-call rounds (``docs/design/host-path.md``), taken apart by step.

For each target case, each round makes one first call of a predecessor (a case of the same op,
or of another op: the two alternate from round to round), then times the target's first calls
with CuPy arrays and with torch tensors, as the bench's rounds order them (every op's plans
cleared before each call, the device synchronised outside the timing). Every step of the first
call is wrapped in a timer (:data:`STEPS`), so the table says which steps grow after another op.

On a GPU machine::

    PYTHONPATH=. python3 tools/experiments/first_call_edge.py [--rounds 41]

On a CPU, ``--cpu`` takes the stand-ins and stubbed driver of ``tools/hostcost.py`` (no device).

``--bench`` replays the bench's first-call phase itself (``ropekv.bench.runner.first_call_phase``:
every decode case, CuPy arrays and torch tensors, in its groups, forward and backward rounds, after
importing torch, JAX and FlashInfer where present) with the step timers on, and prints every
entry's median steps in forward and in backward rounds, in the phase's order.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/: hostcost
from first_call_c import cpu_calls, gpu_calls  # this directory's sibling
from hostcost import TimedCaller, timer

# (target, a predecessor of the same op, one of another op): the bench's op edges with the
# largest steps in the recorded run of 52b2e17
PAIRS = (
    (
        "paged mla tp 16 heads bf16->e4m3 256x1",
        "paged mla tp 16 heads bf16->e4m3 128x1",
        "mla rmsnorm bf16->e4m3 1x1",
    ),
    (
        "paged gqa fp16->e4m3 1x1",
        "paged gqa fp16->e4m3 64x1",
        "contiguous fp16->int8 kv rows 256x1",
    ),
    (
        "qknorm bf16->e4m3 64x1",
        "qknorm qwen3-32b bf16->bf16 1x1",
        "paged mla tp 16 heads bf16->e4m3 256x1",
    ),
)
ROUNDS = 41
SETTLE = 4

# (module, attribute) of the first call's steps; each timed on its own (nested ones included
# in their callers' figures too)
STEPS = (
    ("ropekv._arrays", "read_arguments"),
    ("ropekv._checks", "check_written"),
    ("ropekv._launch", "native_plan"),
    ("ropekv._launch", "torch_reads"),
    ("ropekv._launch", "function_pointer"),
    ("ropekv.paged", "_check"),
    ("ropekv.paged", "_outputs"),
    ("ropekv.paged", "_choose"),
    ("ropekv.paged", "_pack"),
    ("ropekv.qknorm", "_check"),
    ("ropekv.qknorm", "_choose"),
    ("ropekv.qknorm", "_pack"),
)


def timers(acc):
    """Wrap every step of :data:`STEPS` and every op's ``prepare`` and C replay launch in a
    timer adding to ``acc``; returns the undo list."""
    from ropekv.bench.timing import launch_ops

    saved, timed = [], functools.partial(timer, acc)
    for mod_name, attr in STEPS:
        mod = importlib.import_module(mod_name)
        if hasattr(mod, attr):
            saved.append((mod, attr, getattr(mod, attr)))
            setattr(mod, attr, timed(f"{mod_name.rsplit('.', 1)[1]}.{attr}", getattr(mod, attr)))
    for op in launch_ops():
        saved.append((op, "prepare", op.prepare))
        op.prepare = timed("prepare", op.prepare)
        if op.caller is not None:  # the C replay: its miss (the layout read) and first launch
            saved.append((op, "caller", op.caller))
            op.caller = TimedCaller(op.caller, timed)
    return saved


def undo(saved):
    for obj, attr, value in reversed(saved):
        setattr(obj, attr, value)


def first(fn, sync, acc):
    from ropekv.bench.timing import clear_plans

    clear_plans()
    if sync is not None:
        sync()
    acc.clear()
    t0 = time.perf_counter_ns()
    fn()
    acc["total"] = time.perf_counter_ns() - t0
    if sync is not None:
        sync()
    return {k: v / 1e3 for k, v in acc.items()}


def measure(calls, sync, pairs, rounds, settle):
    """``{(target, kind, before): [{step: us}, one per round]}``."""
    acc = {}
    saved = timers(acc)
    out = {}
    try:
        for r in range(settle + rounds):
            for target, same, other in pairs:
                for before, pred in (("same", same), ("other", other))[:: 1 if r % 2 else -1]:
                    first(calls[pred, "cupy"], sync, acc)
                    first(calls[pred, "torch"], sync, acc)
                    for kind in ("cupy", "torch"):
                        steps = first(calls[target, kind], sync, acc)
                        if r >= settle:
                            out.setdefault((target, kind, before), []).append(steps)
    finally:
        undo(saved)
    return out


def bench_phase(rounds, settle):
    """``[(name, kind, {"fwd" | "bwd": [{step: us}]})]`` of the bench's first-call phase, in its
    entry order, with the step timers on."""
    import cupy

    for name in ("torch", "jax", "flashinfer"):
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    from ropekv.bench import cases, runner

    sync = cupy.cuda.runtime.deviceSynchronize
    specs = [s for s in cases.bench_specs() if s.decode]
    acc, found, groups, entries, held = {}, [], [], [], 0
    for spec in specs:
        case = {"ropekv": {"first_us": 0.0, "first_us_torch": 0.0}}
        try:
            calls, nbytes = runner._first_calls(spec, case)
        except Exception as e:  # noqa: BLE001 - a case the device cannot hold
            print(f"{spec.name}: {type(e).__name__}: {e}")
            continue
        entries += [((spec.name, "cupy" if k == "first_us" else "torch"), fn) for k, fn in calls]
        held += nbytes
        if held >= runner.FIRST_PHASE_BYTES:
            groups.append(entries)
            entries, held = [], 0
    if entries:
        groups.append(entries)
    saved = timers(acc)
    try:
        for g, group in enumerate(groups):
            print(f"group {g}: {len(group)} entries, from {group[0][0]} to {group[-1][0]}")
            times = {key: {"fwd": [], "bwd": []} for key, _ in group}
            for r in range(settle + rounds):
                for key, fn in group if r % 2 == 0 else group[::-1]:
                    steps = first(fn, sync, acc)
                    if r >= settle:
                        times[key]["fwd" if r % 2 == 0 else "bwd"].append(steps)
            found += [(*key, times[key]) for key, _ in group]
            group.clear()
    finally:
        undo(saved)
    return found


def bench_report(found):
    def med(rows, k):
        return statistics.median(row.get(k, 0.0) for row in rows)

    for name, kind, t in found:
        f, b = t["fwd"], t["bwd"]
        keys = sorted({k for row in f + b for k in row}, key=lambda k: (k != "total", k))
        cells = " ".join(f"{k.split('.')[-1]} {med(f, k):.0f}/{med(b, k):.0f}" for k in keys)
        print(f"{name} ({kind}) fwd/bwd: {cells}")


def report(out):
    for (target, kind, before), rows in out.items():
        keys = sorted({k for row in rows for k in row}, key=lambda k: (k != "total", k))
        cells = ", ".join(
            f"{k} {statistics.median(row.get(k, 0.0) for row in rows):.1f}" for k in keys
        )
        print(f"{target} ({kind}) after {before} op: {cells}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="stand-ins, stubbed driver (no GPU)")
    parser.add_argument("--bench", action="store_true", help="the bench's first-call phase")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--settle", type=int, default=SETTLE)
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    if args.bench:
        bench_report(bench_phase(args.rounds, args.settle))
        print(f"total {time.perf_counter() - t0:.1f} s")
        return
    names = list(dict.fromkeys(n for p in PAIRS for n in p))
    calls, sync = (cpu_calls if args.cpu else gpu_calls)(names)
    print(f"set-up {time.perf_counter() - t0:.1f} s; {args.settle} + {args.rounds} rounds")
    report(measure(calls, sync, PAIRS, args.rounds, args.settle))
    print(f"total {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
