"""Read a recorded ``ropekv bench`` run against the kernel targets of the decode issue (38) and the
quantized-QKV issue (35): no GPU needed, only the run's JSON.

Targets (each ratio is peer time / ropekv time, taken within the run):

- decode: every decode case with a FlashInfer peer (``flashinfer``, ``flashinfer-cake``) at least
  1.15x each of them (a miss shows the time the target asks and the case's bytes at the run's
  copy bandwidth: a target below that asks for more than copy bandwidth);
- one token: every decode case of one token at most 1.6 us, fused QKV aside (a GEMM: its
  targets are the QKV ones below);
- prefill: plain paged GQA, contiguous and QK-norm cases at 8 x 1024 or 4 x 2048 tokens (a
  16-bit or e4m3 cache, no option) at least 85% of copy bandwidth; paged MLA's (128 heads) at
  least 93%;
- no cliff: in every decode series, no case faster than the one of fewer tokens before it;
- fused QKV against the cuBLAS fp16 GEMM alone (``cublas``): 4-bit weights at least 2.5x at 1-16
  tokens, 1.6x at 64, 1.1x at 128; fp8 weights 1.6x, 1.3x, 1.1x; fp16 weights at least 85% of
  copy bandwidth on the weights at 1-16 tokens, 1.0x at 64-256 tokens and 0.97x at 8192.

Usage (from the repository root)::

    python tools/targets.py RUN.json

Prints each target's count and every case that misses it; exits 0 when all hold, 1 otherwise.
"""

from __future__ import annotations

import itertools
import json
import re
import sys
from collections import defaultdict

FLASHINFER = ("flashinfer", "flashinfer-cake")
DECODE_RATIO = 1.15
ONE_TOKEN_US = 1.6
PREFILL = re.compile(
    r"^(paged gqa|contiguous|qknorm)\b.* (fp16|bf16)->(fp16|bf16|e4m3) (8x1024|4x2048)$"
)
PREFILL_PCT = 85.0
MLA_PREFILL = re.compile(r"^paged mla (bf16|fp16)->\w+ (8x1024|4x2048)$")
MLA_PREFILL_PCT = 93.0
QKV = re.compile(r"^qkv (fp16|fp8w|int4w) K\d+ N\d+ T(\d+)$")
# weight format -> [(first token count, last token count, least ratio against the GEMM alone)]
QKV_RATIO = {
    "int4w": [(1, 16, 2.5), (64, 64, 1.6), (128, 128, 1.1)],
    "fp8w": [(1, 16, 1.6), (64, 64, 1.3), (128, 128, 1.1)],
    "fp16": [(64, 256, 1.0), (8192, 8192, 0.97)],
}
QKV_FP16_WEIGHT_PCT = (1, 16, 85.0)  # tokens, least % of copy bandwidth on the weights


def _ok(case, peer):
    entry = case.get("peers", {}).get(peer, {})
    return entry if entry.get("status") == "ok" and "ratio" in entry else None


def decode_ratios(cases, copy_bw=None):
    """(met, rows): rows (name, least ratio over the FlashInfer peers, ropekv us, the time the
    target asks (the fastest FlashInfer peer's / DECODE_RATIO), the case's bytes at the run's
    copy bandwidth ``copy_bw`` in bytes/s, or None without it)."""
    rows = []
    for c in cases:
        peers = [e for p in FLASHINFER if (e := _ok(c, p))]
        if c.get("decode") and peers:
            need = min(e["us"] for e in peers) / DECODE_RATIO
            floor = c["bytes"] / copy_bw * 1e6 if copy_bw and c.get("bytes") else None
            ratio = min(e["ratio"] for e in peers)
            rows.append((c["name"], ratio, c["ropekv"]["us"], need, floor))
    return sum(r[1] >= DECODE_RATIO for r in rows), rows


def one_token(cases):
    return [
        (c["name"], c["ropekv"]["us"])
        for c in cases
        if c.get("decode") and c.get("tokens") == 1 and c.get("op") != "qkv"
    ]


def prefill(cases):
    """rows (name, % of copy, the least it must read)."""
    rows = []
    for c in cases:
        if c.get("decode"):
            continue
        if PREFILL.match(c["name"]):
            rows.append((c["name"], c["ropekv"]["pct_copy"], PREFILL_PCT))
        elif MLA_PREFILL.match(c["name"]):
            rows.append((c["name"], c["ropekv"]["pct_copy"], MLA_PREFILL_PCT))
    return rows


def cliffs(cases):
    """(series, tokens before, us before, tokens, us) where a decode case reads faster than the
    case of fewer tokens before it in its series."""
    series = defaultdict(list)
    for c in cases:
        if c.get("decode"):
            series[c.get("series") or c["name"]].append((c["tokens"], c["ropekv"]["us"]))
    drops = []
    for name, points in series.items():
        points.sort()
        for (t0, us0), (t1, us1) in itertools.pairwise(points):
            if us1 < us0:
                drops.append((name, t0, us0, t1, us1))
    return drops


def qkv(cases):
    """rows (name, what, figure, the least it must read)."""
    rows = []
    for c in cases:
        m = QKV.match(c["name"])
        if not m:
            continue
        fmt, tokens = m.group(1), int(m.group(2))
        gemm = _ok(c, "cublas")
        for lo, hi, least in QKV_RATIO[fmt]:
            if lo <= tokens <= hi and gemm:
                rows.append((c["name"], "x the GEMM alone", gemm["ratio"], least))
        lo, hi, least = QKV_FP16_WEIGHT_PCT
        if fmt == "fp16" and lo <= tokens <= hi:
            rows.append(
                (
                    c["name"],
                    "% of copy bandwidth on the weights",
                    c["ropekv"]["pct_copy_weights"],
                    least,
                )
            )
    return rows


def read(result):
    """Lines of the report and the number of figures that miss their target."""
    cases = [c for c in result["cases"] if "error" not in c and "ropekv" in c]
    lines, misses = [], 0
    met, rows = decode_ratios(cases, result.get("copy_bandwidth"))
    lines.append(f"decode >= {DECODE_RATIO}x FlashInfer: {met} of {len(rows)} cases")
    past_copy = 0
    for name, ratio, us, need, floor in rows:
        if ratio < DECODE_RATIO:
            misses += 1
            past_copy += floor is not None and need < floor
            at = "" if floor is None else f"; its bytes at copy bandwidth: {floor:.2f} us"
            lines.append(f"  MISS {name}: {ratio:.3f}x ({us:.2f} us; the target: {need:.2f}{at})")
    if past_copy:
        lines.append(
            f"  ({past_copy} of these ask less time than their bytes take at copy bandwidth)"
        )
    ones = one_token(cases)
    over = [(n, us) for n, us in ones if us > ONE_TOKEN_US]
    lines.append(f"one-token decode <= {ONE_TOKEN_US} us: {len(ones) - len(over)} of {len(ones)}")
    misses += len(over)
    lines += [f"  MISS {n}: {us:.2f} us" for n, us in over]
    pre = prefill(cases)
    low = [(n, pct, least) for n, pct, least in pre if pct < least]
    lines.append(f"prefill % of copy: {len(pre) - len(low)} of {len(pre)} at target")
    misses += len(low)
    lines += [f"  MISS {n}: {pct:.1f}% < {least:g}%" for n, pct, least in low]
    drops = cliffs(cases)
    lines.append(f"no cliff: {len(drops)} decode points faster than the point before them")
    misses += len(drops)
    lines += [
        f"  MISS {s}: {t0} tokens {us0:.2f} us, {t1} tokens {us1:.2f} us ({us1 / us0:.3f}x)"
        for s, t0, us0, t1, us1 in drops
    ]
    q = qkv(cases)
    short = [r for r in q if r[2] < r[3]]
    lines.append(f"fused QKV: {len(q) - len(short)} of {len(q)} figures at target")
    misses += len(short)
    lines += [
        f"  MISS {n}: {v:.1f}{what} < {least:g}"
        if what.startswith("%")
        else f"  MISS {n}: {v:.3f}{what} < {least:g}"
        for n, what, v, least in short
    ]
    return lines, misses


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[0], "\nusage: python tools/targets.py RUN.json")
        return 2
    with open(argv[0]) as f:
        lines, misses = read(json.load(f))
    print("\n".join(lines))
    print("all targets hold" if not misses else f"{misses} figures miss their targets")
    return 0 if not misses else 1


if __name__ == "__main__":
    sys.exit(main())
