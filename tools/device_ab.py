"""Device times of two ropekv trees side by side on one GPU: ``ropekv bench`` run from each tree
in alternating processes (old, new; then new, old; ...), each case's median per tree and their
ratio.

Why: two recorded runs come from two machines (or two moments of one), and on the H200 the same
unchanged kernel read 2.5% apart between them (fused QKV fp16 at 256 and 8192 tokens: 30.08 ->
30.84 and 606 -> 622 us between the runs of ``8cf288c`` and ``70c761d``), more than the 2% that
issue 34's budget allows. Four alternating processes a tree on one machine put those cases at
0.997-1.002x. So a case that the recorded run flags is read again this way before it counts as
slower.

Usage (on a GPU machine, from the repository root; OLD is a tree holding an older ``ropekv/``,
for instance ``mkdir OLD && git archive REV ropekv | tar x -C OLD``)::

    python tools/device_ab.py OLD --rounds 4 --out ab -- --ops qkv --peers cublas --cases "qkv fp16"

Everything after ``--`` goes to ``ropekv bench`` (its ``--json`` is set per process); without
a ``--peers`` there, ``--peers cublas`` is added (this reads ropekv's times alone, and a bench
without ``--peers`` times every installed peer: with FlashInfer installed a first process
built its JIT modules for 91 s). Prints a line per case: the times of each process and the median
of new over the median of old, after every round that both trees have run (so a run stopped by a
time limit still leaves the rounds it finished).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def order(rounds):
    """The processes' order: ``(tree, round)`` pairs, old first in odd rounds, new first in even
    ones (so that neither tree always runs right after start-up or right after the other)."""
    out = []
    for i in range(1, rounds + 1):
        pair = ("old", "new") if i % 2 else ("new", "old")
        out.extend((tree, i) for tree in pair)
    return out


def run_one(root, json_path, bench_args):
    """One ``ropekv bench`` process with ``root`` as its working directory and first path entry
    (so it imports that tree's ``ropekv``); its return code."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "ropekv", "bench", *bench_args, "--json", json_path]
    run = subprocess.run(cmd, check=False, cwd=root, env=env, stdout=subprocess.DEVNULL)
    return run.returncode


def summarize(results):
    """``[(case, old times, new times, median new / median old)]`` from ``{"old": [bench JSON
    dicts], "new": [...]}``, cases in the order of the first new run; a case missing from any
    run is left out."""
    rows = []
    for case in results["new"][0]["cases"]:
        name = case["name"]
        times = {}
        for tree, runs in results.items():
            found = [next((c for c in r["cases"] if c["name"] == name), None) for r in runs]
            if any(c is None or "us" not in c["ropekv"] for c in found):
                break
            times[tree] = [c["ropekv"]["us"] for c in found]
        else:
            ratio = statistics.median(times["new"]) / statistics.median(times["old"])
            rows.append((name, times["old"], times["new"], ratio))
    return rows


def bench_arguments(args):
    """The arguments each ``ropekv bench`` process gets: ``args``, with ``--peers cublas`` added
    where they name no peers (cuBLAS runs on the fused QKV cases alone)."""
    return list(args) if "--peers" in args else [*args, "--peers", "cublas"]


def print_rows(results):
    """A line per case of ``summarize(results)``."""
    for name, old, new, ratio in summarize(results):
        o = " ".join(f"{x:8.2f}" for x in old)
        n = " ".join(f"{x:8.2f}" for x in new)
        print(f"{name:44s} old {o} | new {n} | new / old {ratio:.3f}", flush=True)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("old", help="a tree holding the older ropekv/ package")
    p.add_argument("--new", default=ROOT, help="the newer tree (default: this checkout)")
    p.add_argument("--rounds", type=int, default=4, help="processes a tree (default 4)")
    p.add_argument("--out", default="device_ab", help="folder for each process's JSON")
    a = p.parse_args(argv[:split])
    bench_args = bench_arguments(argv[split + 1 :])
    os.makedirs(a.out, exist_ok=True)
    roots = {"old": os.path.abspath(a.old), "new": os.path.abspath(a.new)}
    results = {"old": [], "new": []}
    for tree, i in order(a.rounds):
        path = os.path.abspath(os.path.join(a.out, f"{tree}-{i}.json"))
        rc = run_one(roots[tree], path, bench_args)
        if rc != 0:
            sys.exit(f"{tree} round {i}: ropekv bench exited with {rc}")
        with open(path) as f:
            results[tree].append(json.load(f))
        print(f"{tree} round {i}: done", flush=True)
        if len(results["old"]) == len(results["new"]) == i:  # round i done by both trees
            print_rows(results)


if __name__ == "__main__":
    main()
