"""How much each step of the paged op's first call could save at an op's edge: the bench's
first-call phase over the paged and MLA RMSNorm decode cases (their order, forward and backward
rounds, every op's plans cleared before each call), with one step made free at a time.

A step is made free by caching its result per call's arrays (the first round computes it, the
others reuse it), so a variant's first calls run everything else as they would: an upper bound
of what a faster form of that step could save, not a form ropekv could ship (a cached check is a
second plan cache). Variants: ``base``; ``check``, ``choose``, ``pack`` (the paged op's three
steps); ``all3``; ``written`` (the shared written-array checks, ``_checks.check_written``);
``unbound``, not a bound but the checks as they ran before ``paged._check_bound`` (every call
checked in order: an A/B of that change in one process); ``unpacked``, the record as a first call
built it before its strides were gathered in one call (``paged._values`` as it was, below: an A/B
of that change). Each
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


# the record as a first call built it before its strides were gathered in one call (the
# ``unpacked`` variant; ropekv's code at bf7d201, where the checks read the cache rows' strides)
def _index64_before(a):
    """``paged._index64`` as it was: a loop over the index arrays."""
    from ropekv.paged import INT64

    bits = 0
    for bit, name in enumerate(
        ("pos_ids", "batch_indices", "positions", "kv_indptr", "kv_indices")
    ):
        if getattr(a, name).dtype == INT64:
            bits |= 1 << bit
    return bits


def _cache_strides_before(a, c):
    """The ``(page, entry, head)`` strides of the K-rope, K-nope and V rows, as
    ``paged._cache_rows`` read them."""
    if c.mla:
        kr = (a.cache1.strides[0], a.cache1.strides[1], 0)
        return kr, (a.cache0.strides[0], a.cache0.strides[1], 0), (0, 0, 0)
    k_st, v_st = a.cache0.strides, a.cache1.strides
    if c.kv_layout == "NHD":
        return k_st[:3], k_st[:3], v_st[:3]
    k_st, v_st = (k_st[0], k_st[2], k_st[1]), (v_st[0], v_st[2], v_st[1])
    return k_st, k_st, v_st


def _values_before(a, f, c, choice):
    """``paged._values`` as it was: the record's fields one by one."""
    from ropekv.paged import _decode_guess

    vqr, vkr, vqn, vkn, vv, vt = a.q_rope, a.k_rope, a.q_nope, a.k_nope, a.v, a.cos_sin_cache
    vqro, vqno = a.q_rope_out, a.q_nope_out
    T, Hq, Hkv, R, Dn, mla, sections = c.T, c.Hq, c.Hkv, c.R, c.Dn, c.mla, c.sections
    index64 = _index64_before(a)
    zero2 = (0, 0)
    qn_st = vqn.strides[:2] if vqn is not None else zero2
    kn_in = (vkn.strides[0], 0 if mla else vkn.strides[1]) if vkn is not None else zero2
    qro_st = vqro.strides[:2] if vqro is not None else (Hq * R, R)
    qno_st = vqno.strides[:2] if vqno is not None else (Hq * Dn, Dn)
    krc, knc, vc = _cache_strides_before(a, c)
    (krc_sp, krc_se, krc_sh), (knc_sp, knc_se, knc_sh), (vc_sp, vc_se, vc_sh) = krc, knc, vc
    B = a.kv_indptr.shape[0] - 1
    return {
        "qr_sn": vqr.strides[0],
        "qr_sh": vqr.strides[1],
        "qn_sn": qn_st[0],
        "qn_sh": qn_st[1],
        "kr_sn": vkr.strides[0],
        "kr_sh": 0 if mla else vkr.strides[1],
        "kn_sn": kn_in[0],
        "kn_sh": kn_in[1],
        "v_sn": 0 if vv is None else vv.strides[0],
        "v_sh": 0 if vv is None else vv.strides[1],
        "qro_sn": qro_st[0],
        "qro_sh": qro_st[1],
        "qno_sn": qno_st[0],
        "qno_sh": qno_st[1],
        "krc_sp": krc_sp,
        "krc_se": krc_se,
        "krc_sh": krc_sh,
        "knc_sp": knc_sp,
        "knc_se": knc_se,
        "knc_sh": knc_sh,
        "vc_sp": vc_sp,
        "vc_se": vc_se,
        "vc_sh": vc_sh,
        "cs_sp": vt.strides[0],
        "num_pages": c.num_pages,
        "num_indices": a.kv_indices.shape[0],
        "q_scale": c.q_scale,
        "kv_scale": c.kv_scale,
        "Hq": Hq,
        "Hkv": Hkv,
        "Hv": 0 if mla else Hkv,
        "R": R,
        "Dn": Dn,
        "B": B,
        "page_size": c.page_size,
        "P": c.P,
        "index64": index64,
        "group": choice.group,
        "rows": choice.rows,
        "pid_st": T,
        "mrope": int(bool(sections)),
        "mrope_t": sections[0] if sections else 0,
        "mrope_h": sections[1] if sections else 0,
        "mrope_w": sections[2] if sections else 0,
        "mrope_interleaved": int(f.mrope_interleaved),
        # the lean kernels' decode guess (LeanSlot in paged.cu): one token a request
        "guess": _decode_guess(T, B),
    }


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
        "unpacked": [(paged, "_values", _values_before)],
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
