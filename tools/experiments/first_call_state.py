"""What the CPU's state does to a first call: host time of one first call of a layout after
different work, in one process (``docs/design/host-path.md``, "What else moves a first call").

The target (paged MLA, 16 heads, 256 tokens: the bench's op-edge case) is timed with CuPy arrays
and with torch tensors right after one of: its own first call (``none``), a first call of
another case of the same op (``same``), of another op (``other``: MLA RMSNorm, CuPy and torch;
``othercupy``: CuPy only), the same-op call then a 64 MB write on the host (``flush``) or a 3 ms
sleep (``sleep``). Every op's plans are cleared before each call and the device synchronised
outside the timing; ``prepare`` is the op's own checks and planning. Rounds alternate the order
of the settings. Run it under ``taskset -c N`` to pin the process to one core.

On a GPU machine::

    PYTHONPATH=. python3 tools/experiments/first_call_state.py [--rounds 31]
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/: hostcost
sys.path.insert(0, str(Path(__file__).resolve().parent))
from first_call_c import gpu_calls  # this directory's siblings
from first_call_edge import first as timed_first
from hostcost import timer

TARGET = "paged mla tp 16 heads bf16->e4m3 256x1"
SAME = "paged mla tp 16 heads bf16->e4m3 128x1"
OTHER = "mla rmsnorm bf16->e4m3 1x1"
SETTINGS = ("none", "same", "other", "othercupy", "flush", "sleep")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--settle", type=int, default=4)
    args = parser.parse_args(argv)
    for name in ("torch", "jax", "flashinfer"):  # the bench's process imports them
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    from ropekv.bench.timing import launch_ops

    calls, sync = gpu_calls([TARGET, SAME, OTHER])
    buf = np.zeros(64 << 20, np.uint8)
    acc = {}
    for op in launch_ops():  # one timer, on the op's prepare
        op.prepare = timer(acc, "prepare", op.prepare)

    def first(fn):
        """``(us, prepare us)`` of one first call of ``fn`` (first_call_edge's timing)."""
        steps = timed_first(fn, sync, acc)
        return steps["total"], steps.get("prepare", 0.0)

    def before(setting, r):
        if setting == "none":
            first(calls[TARGET, "cupy"])
            first(calls[TARGET, "torch"])
            return
        if setting in ("same", "flush", "sleep"):
            first(calls[SAME, "cupy"])
            first(calls[SAME, "torch"])
        if setting == "flush":
            buf[:] = r & 255
        elif setting == "sleep":
            time.sleep(0.003)
        elif setting in ("other", "othercupy"):
            first(calls[OTHER, "cupy"])
            if setting == "other":
                first(calls[OTHER, "torch"])

    found = {}
    for r in range(args.settle + args.rounds):
        for setting in SETTINGS if r % 2 else SETTINGS[::-1]:
            for kind in ("torch", "cupy"):
                before(setting, r)
                us = first(calls[TARGET, kind])
                if r >= args.settle:
                    found.setdefault((setting, kind), []).append(us)
    print(f"cores: {sorted(os.sched_getaffinity(0))}")
    for setting in SETTINGS:
        cells = []
        for kind in ("cupy", "torch"):
            rows = found[setting, kind]
            total = statistics.median(x[0] for x in rows)
            prep = statistics.median(x[1] for x in rows)
            cells.append(f"{kind} {total:6.1f} (prepare {prep:5.1f})")
        print(f"after {setting:10s} " + "  ".join(cells))


if __name__ == "__main__":
    main()
