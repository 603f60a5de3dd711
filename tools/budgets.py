"""Read a recorded ``ropekv bench`` run against the host and device budgets of the architecture
issue (34), given the previous recorded run: no GPU needed, only the two JSON files.

The budgets: host time per eager call over each op's decode cases, median at most 8 us with CuPy
and 10 us with torch, no case above 12 us; the first call of a layout at most 150 us; each case's
device time within 2% of the previous run's (a case only one run has is not compared). A run
in which peers compiled their modules (its ``peer_builds``) does not count: its host figures read
slower.

Usage (from the repository root; OLD and NEW as ``ropekv bench --json`` writes them)::

    python tools/budgets.py OLD.json NEW.json

Prints each op's host medians, then every figure past its budget; exits 0 when all hold, 1
otherwise. Beside them, not counted as misses, the host drift between the two runs: each peer's
and each op's median host time per eager call in OLD and NEW (``host_drift``). The peers' code
does not change between runs, so when their host times move with ropekv's, the host moved. A
case the device budget flags is read again with ``tools/device_ab.py`` before it counts as
slower: two recorded runs come from two machines (CONTRIBUTING.md).
"""

from __future__ import annotations

import json
import statistics
import sys

HOST_MEDIAN_US = {"host_us": 8.0, "host_us_torch": 10.0}  # per op, over its decode cases
HOST_CASE_US = 12.0  # any decode case, CuPy or torch
FIRST_CALL_US = 150.0  # the first call of a layout, CuPy or torch
DEVICE_RATIO = 1.02  # new / old device time of a case both runs have


def read(result_old, result_new):
    """``(medians, misses)``: ``{op: {key: median}}`` of the new run's decode host times, and a
    line per figure past its budget."""
    by_op: dict[str, dict[str, list]] = {}
    misses = []
    for c in result_new["cases"]:
        r = c.get("ropekv", {})
        if not c.get("decode"):
            continue
        for key in HOST_MEDIAN_US:
            if key in r:
                by_op.setdefault(c["op"], {}).setdefault(key, []).append(r[key])
                if r[key] > HOST_CASE_US:
                    misses.append(f"host {c['name']}: {key} {r[key]:.1f} us > {HOST_CASE_US:g}")
    for c in result_new["cases"]:
        r = c.get("ropekv", {})
        for key in ("first_us", "first_us_torch"):
            if r.get(key, 0) > FIRST_CALL_US:
                rounds = r.get("first_rounds", {}).get(key)  # in order, then in reverse, ...
                each = f" (rounds {' '.join(f'{us:.0f}' for us in rounds)})" if rounds else ""
                misses.append(
                    f"first call {c['name']}: {key} {r[key]:.1f} us > {FIRST_CALL_US:g}{each}"
                )
    medians = {
        op: {key: statistics.median(v) for key, v in figures.items()}
        for op, figures in by_op.items()
    }
    for op, figures in medians.items():
        for key, median in figures.items():
            if median > HOST_MEDIAN_US[key]:
                misses.append(f"host {op}: median {key} {median:.1f} us > {HOST_MEDIAN_US[key]:g}")
    for peer, (seconds, n) in (result_new.get("peer_builds") or {}).items():
        misses.append(
            f"run: {peer} compiled for {seconds:.0f} s in {n} cases of this run, so its host "
            "figures do not count (ropekv.bench.runner.peer_builds); run it again"
        )
    old = {c["name"]: c.get("ropekv", {}).get("us") for c in result_old["cases"]}
    for c in result_new["cases"]:
        us, was = c.get("ropekv", {}).get("us"), old.get(c["name"])
        if us and was and us / was > DEVICE_RATIO:
            misses.append(f"device {c['name']}: {was:.2f} -> {us:.2f} us ({us / was:.3f}x)")
    return medians, misses


def _host_medians(result):
    """``{label: median}`` of the decode cases' host time per eager call with CuPy arrays:
    ``ropekv <op>`` for each op, ``<peer> <op>`` for each peer that timed one."""
    figures: dict[str, list] = {}
    for c in result["cases"]:
        if not c.get("decode"):
            continue
        if "host_us" in c.get("ropekv", {}):
            figures.setdefault(f"ropekv {c['op']}", []).append(c["ropekv"]["host_us"])
        for peer, r in (c.get("peers") or {}).items():
            if isinstance(r, dict) and "host_us" in r:
                figures.setdefault(f"{peer} {c['op']}", []).append(r["host_us"])
    return {label: statistics.median(v) for label, v in figures.items()}


def host_drift(result_old, result_new):
    """A line per label both runs have (:func:`_host_medians`): its median in each and their
    ratio, ropekv's first."""
    old, new = _host_medians(result_old), _host_medians(result_new)
    labels = sorted(set(old) & set(new), key=lambda k: (not k.startswith("ropekv "), k))
    return [f"{k}: {old[k]:.1f} -> {new[k]:.1f} us ({new[k] / old[k]:.2f}x)" for k in labels]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[0], "\nusage: python tools/budgets.py OLD.json NEW.json")
        return 2
    with open(argv[0]) as f_old, open(argv[1]) as f_new:
        runs = json.load(f_old), json.load(f_new)
    medians, misses = read(*runs)
    for op, figures in medians.items():
        cells = ", ".join(f"{key} {v:.1f}" for key, v in figures.items())
        print(f"{op}: median host us over decode cases: {cells}")
    for line in host_drift(*runs):
        print("host drift (median us per eager call, OLD -> NEW):", line)
    for line in misses:
        print("MISS", line)
    print("all budgets hold" if not misses else f"{len(misses)} figures past their budgets")
    return 0 if not misses else 1


if __name__ == "__main__":
    sys.exit(main())
