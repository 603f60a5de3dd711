"""Launch-shape sweep of the QK-norm, paged, contiguous and MLA kernels on the GPU, with FlashInfer
0.7.2 (the fused paged op and the Cake kernels) timed beside them on the same inputs.

    PYTHONPATH=. python benchmarks/sweep.py precompile [stem ...]   # fill CuPy's kernel cache
    PYTHONPATH=. python benchmarks/sweep.py run [--ops qknorm paged ...] [--json out.json]

``precompile`` compiles every instantiation of the named kernel files (all by default) in parallel
processes, so later runs (the sweep, the GPU tests) find them in CuPy's disk cache.

``run`` builds each case once (``ropekv.bench`` workloads), then for each variant of the op's
``TUNING`` times ropekv (decode: per call under CUDA-graph replay; prefill: CUDA events, L2 flushed
when the case would fit in it) and compares its sampled outputs with the first variant's. Peers
are timed once per case. Prints one table per op, fastest variant marked; writes every number to
``--json``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

import numpy as np

from ropekv import bench
from ropekv.check import compare_all

STEMS = ("qknorm", "paged", "contiguous", "mla", "qkv")


# ---- precompile ----------------------------------------------------------------------------------


def _compile_one(job):
    stem, expression = job
    from ropekv import _compile

    t = time.perf_counter()
    try:
        _compile._module(stem, expression, 0)
    except Exception as e:  # noqa: BLE001 - reported, the others go on
        return stem, expression, f"{type(e).__name__}: {str(e)[:300]}"
    return stem, expression, time.perf_counter() - t


def precompile(stems, extra=()):
    import multiprocessing as mp

    jobs = [(s, e) for s in stems for e in importlib.import_module(f"ropekv.{s}").instantiations()]
    jobs += list(extra)
    t = time.perf_counter()
    with mp.get_context("spawn").Pool(min(16, os.cpu_count() or 1)) as pool:
        results = pool.map(_compile_one, jobs, chunksize=1)
    bad = [r for r in results if isinstance(r[2], str)]
    print(f"precompiled {len(jobs) - len(bad)} of {len(jobs)} instantiations in "
          f"{time.perf_counter() - t:.0f} s")
    for stem, e, why in bad:
        print(f"  FAILED {stem} {e}: {why}")
    return not bad


def paged_variant_expressions():
    """The paged kernel shapes the sweep tries, for the dtypes it times."""
    from ropekv import paged

    F16, BF16, E4M3 = bench.F16, bench.BF16, bench.E4M3
    out = set()
    for shape in {*PAGED_LIGHT, *PAGED_HEAVY}:
        for dtype, cache, neox in ((F16, E4M3, True), (F16, F16, True), (BF16, E4M3, False)):
            out.add(("paged", paged.expression(dtype, cache, neox, 8, shape)))
    return sorted(out)


# ---- variants --------------------------------------------------------------------------------

PAGED_LIGHT = ((1, 1, 1),)
PAGED_HEAVY = ((2, 2, 4), (2, 2, 3), (4, 4, 2))


def variants(op, decode, name):
    """[(label, {TUNING key: value})] for one case; the first is the default."""
    if op == "qknorm":
        if decode:
            return [("default", {}), ("narrow4", {"narrow_below": 512}),
                    ("narrow4-w1320", {"narrow_below": 512, "wave_blocks": 1320}),
                    ("w1320", {"wave_blocks": 1320}), ("b256", {"block": 256}),
                    ("b64", {"block": 64, "wave_blocks": 1320})]
        return [("default", {}), ("r2-b320", {"max_block": 320}),
                ("r4-b160", {"prefill_rows": 4}), ("r2-b128", {"max_block": 128}),
                ("r4-b256", {"prefill_rows": 4, "max_block": 256})]
    if op == "contiguous":
        if decode:
            return [("default", {}), ("b64", {"block": 64, "wave_blocks": 1320}),
                    ("b64-w660", {"block": 64})]
        return [("default", {}), ("prows3", {"prefill_rows": 3}),
                ("prows2", {"prefill_rows": 2})]
    if op == "mla":
        if decode:
            return [("default", {}), ("w660", {"wave_blocks": 660}),
                    ("w165", {"wave_blocks": 165}), ("token", {"split_below": 0})]
        return [("default", {}), ("split", {"split_below": 10 ** 9})]
    # paged
    if "mla" in name:
        if decode:
            return [("default", {}), ("min512", {"min_blocks": 512}),
                    ("min2048", {"min_blocks": 2048}), ("min1024-hf2", {"heavy_from": 2})]
        return [("default", {}), ("heavy223", {"heavy": (2, 2, 3)})]
    if decode:
        return [("default", {}), ("section", {"row_group": 0}),
                ("rb128-w660", {"row_block": 128, "wave_blocks": 660}),
                ("rbm256", {"row_block_many": 256})]
    return [("default", {}), ("section", {"row_group": 0}), ("prows3", {"prefill_rows": 3}),
            ("mrb128", {"max_row_block": 128})]


PAGED_CASES = {f"paged gqa fp16->e4m3 {T}x1{'' if T in (1, 64, 256) else ' (sweep)'}"
               for T in bench.DECODE_SWEEP} | {
    "paged gqa fp16->e4m3 8x1024", "paged gqa fp16->fp16 8x1024", "paged gqa fp16->fp16 1x1",
    "paged gqa fp16->fp16 64x1", "paged gqa fp16->fp16 256x1", "paged mla bf16->e4m3 4x2048",
    *(f"paged mla bf16->e4m3 {T}x1" for T in bench.DECODE_SWEEP)}


def cases(ops):
    """The sweep's cases: ``ropekv.bench`` specs of the reworked ops' headline shapes."""
    def wanted(s):
        if s.op == "qknorm":
            return "qwen3-32b" in s.name
        if s.op == "paged":
            return s.name in PAGED_CASES
        return True

    return [s for s in bench.bench_specs() if s.op in ops and wanted(s)]


# ---- timing --------------------------------------------------------------------------------------


def time_fn(fn, spec, flusher, framework="cupy"):
    from ropekv import _timing

    if spec.decode:
        if framework == "torch":
            return bench._torch_graph_us(fn, 100, 10)
        return _timing.graph_us(fn, calls=100, replays=10)
    flush = flusher if spec.nbytes < bench.L2_FLUSH_BELOW else None
    return _timing.device_us(fn, reps=40, flush=flush, budget_s=0.15)


def set_tuning(op, change, defaults):
    mod = importlib.import_module(f"ropekv.{op}")
    mod.TUNING.clear()
    mod.TUNING.update(defaults[op])
    mod.TUNING.update(change)
    plans = getattr(mod, "_PLANS", None)
    if hasattr(plans, "plans"):
        plans.plans.clear()
    elif isinstance(plans, dict):
        plans.clear()


def run(ops, peers, json_path, match=None):
    import cupy

    from ropekv import _timing

    defaults = {op: dict(importlib.import_module(f"ropekv.{op}").TUNING) for op in ops}
    copy_bw = _timing.copy_bandwidth(1 << 30, reps=5)
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s", flush=True)
    flusher = _timing.L2ReadFlusher()
    results = []
    for spec in cases(ops):
        if match and not any(m in spec.name for m in match):
            continue
        t0 = time.perf_counter()
        row = {"op": spec.op, "name": spec.name, "decode": spec.decode, "bytes": spec.nbytes,
               "variants": {}, "peers": {}}
        results.append(row)
        try:
            w = spec.make()
            ropekv, others = bench._runners(w, spec, peers)
            expected = None
            for label, change in variants(spec.op, spec.decode, spec.name):
                set_tuning(spec.op, change, defaults)
                ropekv.reset()
                ropekv.call()
                got = ropekv.outputs()
                if expected is None:
                    expected = got
                    check = None
                else:
                    check = compare_all(got, expected, w.compare_mode)
                us = time_fn(ropekv.call, spec, flusher)
                row["variants"][label] = {"us": us, "check": check or "ok",
                                          "pct_copy": 100 * spec.nbytes / (us * 1e-6) / copy_bw}
            set_tuning(spec.op, {}, defaults)
            for name, r in others.items():
                if isinstance(r, str):
                    row["peers"][name] = {"status": r}
                    continue
                try:
                    if r.reset:
                        r.reset()
                    r.call()
                    mismatch = compare_all(r.outputs(),
                                           r.expect(expected) if r.expect else expected,
                                           w.compare_mode)
                    us = time_fn(r.call, spec, flusher, r.framework)
                    row["peers"][name] = {"us": us, "check": mismatch or "ok"}
                except Exception as e:  # noqa: BLE001
                    row["peers"][name] = {"status": f"error: {bench._one_line(e)}"}
        except Exception as e:  # noqa: BLE001
            row["error"] = bench._one_line(e)
        row["seconds"] = time.perf_counter() - t0
        print(summary_line(row), flush=True)
        if json_path:
            with open(json_path, "w") as f:
                json.dump({"copy_bandwidth": copy_bw, "cases": results}, f, indent=1,
                          default=str)
        del w
        cupy.get_default_memory_pool().free_all_blocks()
    return results


def summary_line(row):
    if "error" in row:
        return f"{row['name']}: ERROR {row['error']}"
    v = row["variants"]
    best = min(v, key=lambda k: v[k]["us"])
    parts = [f"{k}={e['us']:.2f}{'' if e['check'] == 'ok' else '!'}{'*' if k == best else ''}"
             for k, e in v.items()]
    peer = " ".join(f"{k}={e['us']:.2f}{'' if e['check'] == 'ok' else '!'}"
                    if "us" in e else f"{k}:{e['status'][:60]}" for k, e in row["peers"].items())
    return f"{row['name']:42s} {' '.join(parts)} | {peer}"


def prof(name, who, calls=3):
    """Call one bench case's ropekv call (or a peer's) ``calls`` times, for ncu."""
    import cupy

    spec = next(s for s in bench.bench_specs() if s.name == name)
    w = spec.make()
    ropekv, others = bench._runners(w, spec, [] if who == "ropekv" else [who])
    fn = ropekv.call if who == "ropekv" else others[who].call
    for _ in range(calls):
        fn()
    cupy.cuda.Device().synchronize()
    if who != "ropekv":
        bench._torch().cuda.synchronize()


def main(argv=None):
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("precompile")
    p.add_argument("stems", nargs="*", default=list(STEMS))
    p = sub.add_parser("prof")
    p.add_argument("case")
    p.add_argument("who", nargs="?", default="ropekv")
    p = sub.add_parser("run")
    p.add_argument("--ops", nargs="+", default=["qknorm", "paged", "contiguous", "mla"])
    p.add_argument("--peers", nargs="+", default=["flashinfer", "flashinfer-cake"])
    p.add_argument("--json")
    p.add_argument("--match", nargs="+", help="only the cases whose name contains one of these")
    args = ap.parse_args(argv)
    if args.cmd == "prof":
        prof(args.case, args.who)
        return 0
    if args.cmd == "precompile":
        extra = paged_variant_expressions() if "paged" in args.stems else ()
        return 0 if precompile(args.stems, extra) else 1
    run(args.ops, args.peers, args.json, args.match)
    return 0


if __name__ == "__main__":
    sys.exit(main())
