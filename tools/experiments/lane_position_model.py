"""CPU model of ``lane_position`` (``ropekv/kernels/common.cuh``) against ``ragged_request``'s binary
search: where the lanes' offsets are sorted, the ballot's request (the one lane l < B with
offsets[l] <= t < offsets[l + 1], or -1) must be the search's answer exactly; where they are not,
the kernel runs the search itself, so those batches are only counted.

Batches of B < 32 requests: sorted offsets (small values with repeats, or anywhere in the 32-bit
range), unsorted ones, and tokens inside and past the offsets. Offsets and tokens compare as
unsigned 32-bit values, as the kernels read them.

    python tools/experiments/lane_position_model.py [--batches 300000] [--seed 0]
"""

from __future__ import annotations

import argparse
import random

SPAN = 2**32


def ragged_request(offsets, B, t):
    """The kernels' binary search (common.cuh): the last b with offsets[b] <= t, -1 where t is
    outside [offsets[b], offsets[b + 1]) or b is not a request."""
    lo, hi = 0, B + 1
    while lo < hi:
        mid = (lo + hi) >> 1
        if offsets[mid] <= t:
            lo = mid + 1
        else:
            hi = mid
    b = lo - 1
    if b < 0 or b >= B or t < offsets[b] or t >= offsets[b + 1]:
        return -1
    return b


def ballot(offsets, B, t):
    """lane_position's fast path on 32 lanes (lane l holds offsets[l] for l <= B, 0 past it):
    None where the order check fails (the kernel then searches), else the first hit lane or -1."""
    lanes = [offsets[lane] if lane <= B else 0 for lane in range(32)]
    nxt = [lanes[lane + 1] if lane < 31 else lanes[31] for lane in range(32)]  # __shfl_down_sync
    if not all(lane >= B or lanes[lane] <= nxt[lane] for lane in range(32)):
        return None
    hits = [lane for lane in range(32) if lane < B and lanes[lane] <= t < nxt[lane]]
    return hits[0] if hits else -1


def batch(rng):
    """(offsets[0..B], B, t): a random batch and token."""
    B = rng.randint(0, 31)
    kind = rng.random()
    if kind < 0.5:
        top = rng.choice((40, SPAN - 1))
        offsets = sorted(rng.randint(0, top) for _ in range(B + 1))
    elif kind < 0.8:
        offsets = [rng.randint(0, 40) for _ in range(B + 1)]
    else:
        offsets = sorted(rng.randint(0, 6) for _ in range(B + 1))  # many empty requests
    t = rng.randint(0, 45) if rng.random() < 0.8 else rng.randint(0, SPAN - 1)
    return offsets, B, t


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=300_000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    ran = searched = wrong = 0
    for _ in range(args.batches):
        offsets, B, t = batch(rng)
        got = ballot(offsets, B, t)
        if got is None:
            searched += 1
            continue
        ran += 1
        wrong += got != ragged_request(offsets, B, t)
    print(f"ballot on {ran} batches, {wrong} different from the search; {searched} searched")
    raise SystemExit(1 if wrong else 0)


if __name__ == "__main__":
    main()
