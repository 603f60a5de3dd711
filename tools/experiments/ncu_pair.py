"""One call of ropekv and one of a peer on a bench case's inputs, inside a profiler range, for
Nsight Compute: ``ncu --profile-from-start off`` then profiles those kernels alone (each runner
called twice first, outside the range, so that compilation, first-call planning and the peers' JIT
builds stay out of it). On a GPU machine::

    ncu --profile-from-start off --section SpeedOfLight --section LaunchStats \\
        --section Occupancy --section WarpStateStats -o mla64 \\
        python3 tools/experiments/ncu_pair.py --peer flashinfer "=paged mla bf16->e4m3 64x1"

Each case's kernels run in the order: ropekv, then the peer (``--peer none``: ropekv alone).
Nsight Compute flushes the caches before each kernel, so its durations are of cold calls; compare
within a case, not with graph-replay times.
"""

from __future__ import annotations

import argparse

import cupy

from ropekv.bench import cases
from ropekv.bench.peers import make_runners


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cases", nargs="+", help="bench case names (as --cases of ropekv bench)")
    parser.add_argument("--peer", default="flashinfer", help="a peer of ropekv bench, or none")
    args = parser.parse_args(argv)
    specs = cases.select_specs(names=args.cases)
    if not specs:
        raise SystemExit(f"no bench case matches {args.cases}")
    peers = () if args.peer == "none" else (args.peer,)
    calls = []
    for spec in specs:
        w = spec.make()
        ropekv, others = make_runners(w, spec, peers)
        chosen = [ropekv]
        for name in peers:
            peer = others.get(name)
            if isinstance(peer, str):  # skipped or failed: why
                raise SystemExit(f"{spec.name}: {name}: {peer}")
            chosen.append(peer)
        for r in chosen:  # compile, plan, JIT-build outside the profiled range
            r.call()
            r.call()
        calls.append((spec.name, chosen))
        print(f"{spec.name}: {', '.join(r.name for r in chosen)}")
    cupy.cuda.runtime.deviceSynchronize()
    cupy.cuda.profiler.start()
    for _, chosen in calls:
        for r in chosen:
            r.call()
        cupy.cuda.runtime.deviceSynchronize()
    cupy.cuda.profiler.stop()


if __name__ == "__main__":
    main()
