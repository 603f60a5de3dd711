"""How much each step of the paged op's first call could save at an op's edge: the bench's
first-call phase over the paged and MLA RMSNorm decode cases (their order, forward and backward
rounds, every op's plans cleared before each call), with one step made free at a time.

A step is made free by caching its result per call's arrays (the first round computes it, the
others reuse it), so a variant's first calls run everything else as they would: an upper bound
of what a faster form of that step could save, not a form ropekv could ship (a cached check is a
second plan cache). Variants: ``base``; ``check``, ``choose``, ``pack`` (the paged op's three
steps); ``all3``; ``written`` (the shared written-array checks, ``_checks.check_written``);
``unbound``, not a bound but the checks as they ran before ``paged._check_bound`` (every call
checked in order: an A/B of that change in one process). Each
variant's phase runs ``reps`` times, the variants interleaved; the table gives the medians of the
edge cases' first calls and of every paged case's.

On a GPU machine::

    PYTHONPATH=. python3 tools/experiments/first_call_bounds.py [REPS] [VARIANT,VARIANT...]
"""

from __future__ import annotations

import statistics
import sys
import time

EDGE = (  # (case, kind): the paged op's cases at its edges in the bench's order
    ("paged mla tp 16 heads bf16->e4m3 256x1", "first_us_torch"),
    ("paged mla tp 16 heads bf16->e4m3 256x1", "first_us"),
    ("paged gqa fp16->e4m3 1x1", "first_us"),
    ("paged gqa fp16->e4m3 1x1", "first_us_torch"),
)


def by_arrays(fn, key):
    """``fn`` with its result cached by ``key(first argument)`` (a dict result copied)."""
    memo = {}

    def cached(first, *args, **kwargs):
        k = key(first)
        found = memo.get(k)
        if found is None:
            found = memo[k] = fn(first, *args, **kwargs)
        return found.copy() if isinstance(found, dict) else found

    return cached


def variants():
    """``{name: [(module, attribute, replacement)]}``."""
    from ropekv import _checks, paged

    def step(name):
        return (paged, name, by_arrays(getattr(paged, name), lambda a: id(a.q_rope.array)))

    return {
        "base": [],
        "check": [step("_check")],
        "choose": [step("_choose")],
        "pack": [step("_pack")],
        "all3": [step("_check"), step("_choose"), step("_pack")],
        "unbound": [(paged, "_check_bound", lambda a, f: None)],
        "written": [
            (
                _checks,
                "check_written",
                by_arrays(_checks.check_written, lambda views: id(views[0].array)),
            )
        ],
    }


def entries():
    """``[((case, kind), call)]`` of the paged and MLA RMSNorm decode cases, as the bench's
    first-call phase builds them."""
    from ropekv.bench import cases, runner

    out = []
    for spec in cases.bench_specs():
        if spec.decode and spec.op in ("paged", "mla"):
            case = {"ropekv": {"first_us": 0.0, "first_us_torch": 0.0}}
            calls, _ = runner._first_calls(spec, case)
            out += [((spec.name, kind), fn) for kind, fn in calls]
    return out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    import cupy

    for name in ("torch", "jax", "flashinfer"):  # imported, as in a recorded run
        try:
            __import__(name)
        except ImportError:
            pass
    from ropekv.bench import timing

    reps = int(argv[0]) if argv else 3
    table = variants()
    if len(argv) > 1:
        table = {v: table[v] for v in argv[1].split(",")}
    calls, sync = entries(), cupy.cuda.runtime.deviceSynchronize
    found = {v: {"edge": {k: [] for k in EDGE}, "paged": []} for v in table}
    t0 = time.perf_counter()
    for _ in range(reps):
        for name, patches in table.items():
            saved = [(m, a, getattr(m, a)) for m, a, _ in patches]
            for module, attr, value in patches:
                setattr(module, attr, value)
            try:
                times = timing.first_call_rounds(calls, sync, timing.FIRST_ROUNDS, 1)
            finally:
                for module, attr, value in saved:
                    setattr(module, attr, value)
            for k in EDGE:
                found[name]["edge"][k].append(statistics.median(times[k]))
            paged = [statistics.median(t) for (case, _), t in times.items() if "paged" in case]
            found[name]["paged"].append(statistics.median(paged))
    print("variant   " + "  ".join(f"{c[-12:]} {k[9:] or 'cupy'}" for c, k in EDGE) + "  paged")
    for name, f in found.items():
        cells = "  ".join(f"{statistics.median(f['edge'][k]):>18.1f}" for k in EDGE)
        print(f"{name:9s} {cells}  {statistics.median(f['paged']):6.1f}")
    print(f"{len(calls)} entries, {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
