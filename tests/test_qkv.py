"""``fused_qkv_matmul_append_paged_kv_cache`` and ``pack_int4``: the reference against an
independent loop, packing, every validation rule and the NumPy backend (CPU); both CUDA paths
against the float64 reference (GPU)."""

from __future__ import annotations

import itertools
import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import ropekv
from ropekv import qkv as qkv_mod
from ropekv import reference
from tests.tolerance import assert_close, fp8_ordinal, to_device, to_numpy

F16 = np.dtype(np.float16)
BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E5M2 = np.dtype(ml_dtypes.float8_e5m2)


def read_only(a):
    a.flags.writeable = False
    return a


def make_case(
    seed,
    lengths=(3, 1, 0, 2),
    K=96,
    Hq=4,
    Hkv=2,
    D=16,
    R=16,
    P=64,
    page_size=4,
    layout="NHD",
    dtype=F16,
    cache_dtype=None,
    wfmt="dense",
    group_size=32,
    zero_points=False,
    cached=None,
    bad_pages=False,
    is_neox=True,
    extra_tokens=0,
):
    """NumPy arguments of one call (``args``) and its keywords (``kw``). Caches hold random bytes
    so that stray writes show. ``R=None``: no RoPE."""
    rng = np.random.default_rng(seed)
    dtype, cache_dtype = np.dtype(dtype), np.dtype(cache_dtype or dtype)
    B = len(lengths)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    T = int(offsets[-1]) + extra_tokens  # extra tokens belong to no request
    if cached is None:
        cached = rng.integers(0, 9, B)
    cached = np.asarray(cached, np.int32)
    need = [(int(c) + n + page_size - 1) // page_size for c, n in zip(cached, lengths)]
    max_pages = max(need + [1]) + 1
    num_pages = sum(need) + 3
    table = np.full((B, max_pages), -1, np.int32)
    perm = rng.permutation(num_pages)
    start = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[start : start + n]
        start += n
    if bad_pages and B:
        table[0, 0] = num_pages + 5  # out of range: skipped
        table[-1, 0] = -7
    N = (Hq + 2 * Hkv) * D
    x = rng.standard_normal((T, K)).astype(dtype)
    kw = {"num_q_heads": Hq, "kv_layout": layout, "is_neox": is_neox}
    if wfmt == "dense":
        weight = (rng.standard_normal((N, K)) / math.sqrt(K)).astype(dtype)
    elif wfmt == "fp8":
        weight = (rng.standard_normal((N, K)) * 8).astype(E4M3)
        kw["weight_scales"] = (rng.uniform(0.5, 1.5, N) / (8 * math.sqrt(K))).astype(np.float32)
    else:
        weight = qkv_mod.pack_int4(rng.integers(-8, 8, (N, K)))
        kw["group_size"] = group_size
        kw["weight_scales"] = (
            rng.uniform(0.5, 1.5, (N, K // group_size)) / (4.6 * math.sqrt(K))
        ).astype(dtype)
        if zero_points:
            kw["zero_points"] = rng.integers(0, 256, (N, K // group_size)).astype(np.uint8)
    shape = (num_pages, page_size, Hkv, D) if layout == "NHD" else (num_pages, Hkv, page_size, D)
    nbytes = int(np.prod(shape)) * cache_dtype.itemsize
    caches = tuple(
        rng.integers(0, 256, nbytes, np.uint8).view(cache_dtype).reshape(shape) for _ in range(2)
    )
    if cache_dtype.itemsize == 1:  # no NaN codes, so comparisons stay simple
        caches = tuple(
            np.where(np.isnan(c.astype(np.float32)), 0, c).astype(cache_dtype) for c in caches
        )
        kw["kv_scale"] = (float(rng.uniform(0.3, 2.0)), float(rng.uniform(0.3, 2.0)))
    if R is not None:
        kw["cos_sin_cache"] = ropekv.cos_sin_cache(P, R, base=float(rng.uniform(100, 1e6)))
    args = {
        "hidden_state": x,
        "weight": weight,
        "input_row_offsets": offsets,
        "cache_lengths": cached,
        "block_table": table,
        "paged_kv_cache": caches,
    }
    return args, kw


def call(args, kw, **more):
    return ropekv.fused_qkv_matmul_append_paged_kv_cache(**args, **kw, **more)


def run_reference(args, kw, k, v, out, layout, kv_scale, clear=False):
    """The NumPy reference on the case's inputs into ``k``, ``v`` and ``out`` (the caches in
    ``layout``, scaled by ``kv_scale`` (k, v), the rest of their pages cleared with ``clear``)."""
    reference.fused_qkv_matmul_append_paged_kv_cache(
        args["hidden_state"],
        args["weight"],
        args["input_row_offsets"],
        args["cache_lengths"],
        args["block_table"],
        k,
        v,
        out,
        kw["num_q_heads"],
        kw.get("cos_sin_cache"),
        kw.get("is_neox", True),
        layout,
        kv_scale[0],
        kv_scale[1],
        kw.get("weight_scales"),
        kw.get("group_size"),
        kw.get("zero_points"),
        clear,
    )


def expected(args, kw, clear=False):
    """The reference on copies, with ``clear_unused_last_page_rows`` (``clear``): (q, k_cache,
    v_cache)."""
    k, v = (c.copy() for c in args["paged_kv_cache"])
    T, Hq = args["hidden_state"].shape[0], kw["num_q_heads"]
    out = np.empty((T, Hq * k.shape[3]), args["hidden_state"].dtype)
    scale = kw.get("kv_scale") or (1.0, 1.0)
    run_reference(args, kw, k, v, out, kw.get("kv_layout", "NHD"), scale, clear)
    return out, k, v


def written_mask(args, kw):
    """Boolean (num_pages, page_size): cache entries the call writes."""
    k = args["paged_kv_cache"][0]
    nhd = kw.get("kv_layout", "NHD") == "NHD"
    num_pages, page_size = k.shape[0], k.shape[1] if nhd else k.shape[2]
    T = args["hidden_state"].shape[0]
    request, pos, page, entry = reference.ragged_paged_slots(
        args["input_row_offsets"],
        args["cache_lengths"],
        args["block_table"],
        page_size,
        num_pages,
        T,
    )
    ok = (request >= 0) & (pos >= 0) & (page >= 0)
    if kw.get("cos_sin_cache") is not None:
        ok &= pos < kw["cos_sin_cache"].shape[0]
    mask = np.zeros((num_pages, page_size), bool)
    mask[page[ok], entry[ok]] = True
    return mask


# ---------------------------------------------------------------------------------------------
# The reference, against an independent token-by-token loop


def naive(args, kw):
    x = args["hidden_state"].astype(np.float64)
    w = reference.dequantize_weight(
        args["weight"], kw.get("weight_scales"), kw.get("group_size"), kw.get("zero_points")
    )
    k_cache, v_cache = (c.copy() for c in args["paged_kv_cache"])
    Hq, nhd = kw["num_q_heads"], kw.get("kv_layout", "NHD") == "NHD"
    D = k_cache.shape[3]
    page_size, Hkv = (
        (k_cache.shape[1], k_cache.shape[2]) if nhd else (k_cache.shape[2], k_cache.shape[1])
    )
    offsets, lens, table = (args[n] for n in ("input_row_offsets", "cache_lengths", "block_table"))
    table_cs = kw.get("cos_sin_cache")
    q_out = np.zeros((x.shape[0], Hq * D))
    for t in range(x.shape[0]):
        y = w @ x[t]
        heads = y.reshape(Hq + 2 * Hkv, D).copy()
        b = next((b for b in range(len(lens)) if offsets[b] <= t < offsets[b + 1]), None)
        p = None if b is None else int(lens[b]) + t - int(offsets[b])
        if p is not None and table_cs is not None and p >= table_cs.shape[0]:
            p = None
        if p is not None and table_cs is not None:
            R = table_cs.shape[1]
            cos, sin = table_cs[p, : R // 2].astype(np.float64), table_cs[p, R // 2 :]
            for h in range(Hq + Hkv):  # rotate as complex numbers
                row = heads[h]
                if kw.get("is_neox", True):
                    z = (row[: R // 2] + 1j * row[R // 2 : R]) * (cos + 1j * sin)
                    row[: R // 2], row[R // 2 : R] = z.real, z.imag
                else:
                    z = (row[0:R:2] + 1j * row[1:R:2]) * (cos + 1j * sin)
                    row[0:R:2], row[1:R:2] = z.real, z.imag
        q_out[t] = heads[:Hq].reshape(-1)
        if p is None or p // page_size >= table.shape[1]:
            continue
        page = table[b, p // page_size]
        if not 0 <= page < k_cache.shape[0]:
            continue
        e = p % page_size
        for h in range(Hkv):
            for cache, row in ((k_cache, heads[Hq + h]), (v_cache, heads[Hq + Hkv + h])):
                scale = (kw.get("kv_scale") or (1.0, 1.0))[cache is v_cache]
                scale = scale if cache.dtype.itemsize == 1 else 1.0
                val = reference.to_dtype(row / scale, cache.dtype)
                if nhd:
                    cache[page, e, h] = val
                else:
                    cache[page, h, e] = val
    return reference.to_dtype(q_out, args["hidden_state"].dtype), k_cache, v_cache


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize(
    "is_neox, R", [(True, 16), (False, 16), (True, 8), (False, 6), (True, None)]
)
@pytest.mark.parametrize("wfmt", ["dense", "fp8", "int4"])
def test_reference_matches_a_token_loop(layout, is_neox, R, wfmt):
    args, kw = make_case(
        3,
        layout=layout,
        is_neox=is_neox,
        R=R,
        wfmt=wfmt,
        bad_pages=True,
        extra_tokens=2,
        zero_points=wfmt == "int4",
    )
    q, k, v = expected(args, kw)
    qn, kn, vn = naive(args, kw)
    np.testing.assert_array_equal(q, qn)
    np.testing.assert_array_equal(k.view(np.uint8), kn.view(np.uint8))
    np.testing.assert_array_equal(v.view(np.uint8), vn.view(np.uint8))


def test_reference_skips_positions_past_the_table():
    args, kw = make_case(4, lengths=(3,), cached=[62], P=64)  # positions 62, 63, 64
    q, _, _ = expected(args, kw)
    plain, _, _ = expected(args, {**kw, "cos_sin_cache": None})
    np.testing.assert_array_equal(q[2], plain[2])  # unrotated
    assert not np.array_equal(q[0], plain[0])
    assert written_mask(args, kw).sum() == 2


def test_reference_fp8_cache_divides_by_kv_scale():
    args, kw = make_case(5, cache_dtype=E4M3, R=None)
    kw["kv_scale"] = (0.5, 2.0)
    _, k, v = expected(args, kw)
    _, k1, v1 = expected(args, {**kw, "kv_scale": (1.0, 1.0)})
    mask = written_mask(args, kw)
    kf, k1f = k[mask].astype(np.float64), k1[mask].astype(np.float64)
    small = np.abs(k1f) < 100  # away from saturation: 2x then rounded equals rounded then 2x
    np.testing.assert_array_equal(kf[small], 2 * k1f[small])
    assert np.abs(v[mask].astype(np.float64)).max() <= np.abs(v1[mask].astype(np.float64)).max()


def test_dequantize_int4_formula():
    rng = np.random.default_rng(0)
    q = rng.integers(0, 16, (3, 8))
    packed = qkv_mod.pack_int4(q, signed=False)
    scales = np.array([[1, 2], [3, 4], [5, 6]], np.float16)
    zeros = np.array([[0, 15], [8, 1], [0x17, 4]], np.uint8)  # 0x17: the low 4 bits, 7
    w = reference.dequantize_weight(packed, scales, 4, zeros)
    z = np.repeat(zeros & 0xF, 4, axis=1)
    np.testing.assert_array_equal(w, (q - z) * np.repeat(scales.astype(np.float64), 4, axis=1))
    w8 = reference.dequantize_weight(packed, scales, 4)
    np.testing.assert_array_equal(w8, (q - 8) * np.repeat(scales.astype(np.float64), 4, axis=1))


# ---------------------------------------------------------------------------------------------
# pack_int4


def unpack(packed):
    out = np.empty((packed.shape[0], 2 * packed.shape[1]), np.int64)
    out[:, 0::2], out[:, 1::2] = packed & 0xF, packed >> 4
    return out


@given(st.integers(0, 2**32 - 1), st.integers(1, 5), st.integers(1, 6), st.booleans())
def test_pack_int4_round_trip(seed, n, half_k, signed):
    rng = np.random.default_rng(seed)
    lo, hi = (-8, 8) if signed else (0, 16)
    w = rng.integers(lo, hi, (n, 2 * half_k)).astype(rng.choice([np.int8, np.int32, np.int64]))
    packed = ropekv.pack_int4(w, signed=signed)
    assert packed.dtype == np.uint8 and packed.shape == (n, half_k)
    np.testing.assert_array_equal(unpack(packed) - (8 if signed else 0), w)


def test_pack_int4_layout():
    np.testing.assert_array_equal(ropekv.pack_int4(np.array([[-8, 7, 0, 1]])), [[0xF0, 0x98]])
    np.testing.assert_array_equal(ropekv.pack_int4(np.array([[1, 2]]), signed=False), [[0x21]])


@pytest.mark.parametrize(
    "w, signed, exc, match",
    [
        (np.array([[8, 0]]), True, ValueError, r"\[-8, 7\]"),
        (np.array([[-1, 0]]), False, ValueError, r"\[0, 15\]"),
        (np.array([[1, 2, 3]]), True, ValueError, "even"),
        (np.array([1, 2]), True, ValueError, r"\(N, K\)"),
        (np.array([[1.0, 2.0]]), True, TypeError, "integer"),
    ],
)
def test_pack_int4_rejects(w, signed, exc, match):
    with pytest.raises(exc, match=match):
        ropekv.pack_int4(w, signed=signed)


# ---------------------------------------------------------------------------------------------
# NumPy backend


@pytest.mark.parametrize("wfmt", ["dense", "fp8", "int4"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_numpy_backend_is_the_reference(wfmt, layout):
    args, kw = make_case(
        7, wfmt=wfmt, layout=layout, cache_dtype=E4M3, bad_pages=True, extra_tokens=1
    )
    q_ref, k_ref, v_ref = expected(args, kw)
    q = call(args, kw)
    assert isinstance(q, np.ndarray) and q.dtype == F16
    np.testing.assert_array_equal(q, q_ref)
    np.testing.assert_array_equal(args["paged_kv_cache"][0].view(np.uint8), k_ref.view(np.uint8))
    np.testing.assert_array_equal(args["paged_kv_cache"][1].view(np.uint8), v_ref.view(np.uint8))


def test_numpy_backend_writes_out_in_place():
    args, kw = make_case(8, dtype=BF16)
    out = np.zeros((args["hidden_state"].shape[0], 4 * 16), BF16)
    q_ref, _, _ = expected(args, kw)
    assert call(args, kw, out=out) is out
    np.testing.assert_array_equal(out.view(np.uint16), q_ref.view(np.uint16))


def test_numpy_backend_uint32_offsets_and_empty_batch():
    args, kw = make_case(9)
    args["input_row_offsets"] = args["input_row_offsets"].astype(np.uint32)
    q_ref, _, _ = expected(args, kw)
    np.testing.assert_array_equal(call(args, kw), q_ref)
    args, kw = make_case(9, lengths=())
    assert call(args, kw).shape == (0, 64)


def test_check_indices_raises(monkeypatch):
    monkeypatch.setenv("ROPEKV_CHECK_INDICES", "1")
    args, kw = make_case(10, bad_pages=True)
    with pytest.raises(IndexError, match="no valid page"):
        call(args, kw)
    args, kw = make_case(10, extra_tokens=1)
    with pytest.raises(IndexError, match="no request"):
        call(args, kw)
    args, kw = make_case(10, lengths=(2,), cached=[63], P=64)
    with pytest.raises(IndexError, match="position 64"):
        call(args, kw)
    args, kw = make_case(10)
    call(args, kw)  # valid indices pass


# ---------------------------------------------------------------------------------------------
# Validation: one case per rule, each raising before anything is written


RULES = [
    (
        "cache not a pair",
        lambda a, k: a.update(paged_kv_cache=a["paged_kv_cache"][0]),
        ValueError,
        "pair",
    ),
    (
        "hidden 3-D",
        lambda a, k: a.update(hidden_state=a["hidden_state"][None]),
        ValueError,
        r"hidden_state must have shape \(T, K\)",
    ),
    (
        "hidden float32",
        lambda a, k: a.update(hidden_state=a["hidden_state"].astype(np.float32)),
        TypeError,
        "hidden_state must have dtype",
    ),
    ("K = 0", lambda a, k: a.update(hidden_state=a["hidden_state"][:, :0]), ValueError, "K > 0"),
    ("num_q_heads 0", lambda a, k: k.update(num_q_heads=0), ValueError, "num_q_heads"),
    ("num_q_heads bool", lambda a, k: k.update(num_q_heads=True), ValueError, "num_q_heads"),
    ("layout", lambda a, k: k.update(kv_layout="NDH"), ValueError, "kv_layout"),
    (
        "cache 3-D",
        lambda a, k: a.update(paged_kv_cache=tuple(c[0] for c in a["paged_kv_cache"])),
        ValueError,
        "k_cache must have shape",
    ),
    (
        "v shape",
        lambda a, k: a.update(paged_kv_cache=(a["paged_kv_cache"][0], a["paged_kv_cache"][1][:-1])),
        ValueError,
        "v_cache must have shape",
    ),
    (
        "D odd",
        lambda a, k: a.update(paged_kv_cache=tuple(c[..., :15] for c in a["paged_kv_cache"])),
        ValueError,
        "D even",
    ),
    (
        "cache float32",
        lambda a, k: a.update(
            paged_kv_cache=tuple(c.astype(np.float32) for c in a["paged_kv_cache"])
        ),
        TypeError,
        "k_cache must have dtype",
    ),
    (
        "v dtype",
        lambda a, k: a.update(
            paged_kv_cache=(a["paged_kv_cache"][0], np.zeros(a["paged_kv_cache"][1].shape, BF16))
        ),
        TypeError,
        "v_cache must have the dtype of k_cache",
    ),
    (
        "weight shape",
        lambda a, k: a.update(weight=a["weight"][:-1]),
        ValueError,
        "weight must have shape",
    ),
    (
        "weight float32",
        lambda a, k: a.update(weight=a["weight"].astype(np.float32)),
        TypeError,
        "weight must have dtype",
    ),
    (
        "scales with dense",
        lambda a, k: k.update(weight_scales=np.ones(128, np.float32)),
        ValueError,
        "weight_scales is only used",
    ),
    (
        "zero points with dense",
        lambda a, k: k.update(zero_points=np.ones((128, 3), np.uint8)),
        ValueError,
        "zero_points is only used",
    ),
    (
        "kv_scale with fp16 cache",
        lambda a, k: k.update(kv_scale=1.0),
        ValueError,
        "kv_scale is only used",
    ),
    (
        "offsets 2-D",
        lambda a, k: a.update(input_row_offsets=a["input_row_offsets"][None]),
        ValueError,
        "input_row_offsets must have shape",
    ),
    (
        "offsets empty",
        lambda a, k: a.update(input_row_offsets=a["input_row_offsets"][:0]),
        ValueError,
        "input_row_offsets must have shape",
    ),
    (
        "offsets int64",
        lambda a, k: a.update(input_row_offsets=a["input_row_offsets"].astype(np.int64)),
        TypeError,
        "input_row_offsets must have dtype",
    ),
    (
        "offsets strided",
        lambda a, k: a.update(input_row_offsets=np.repeat(a["input_row_offsets"], 2)[::2]),
        ValueError,
        "C-contiguous",
    ),
    (
        "lengths shape",
        lambda a, k: a.update(cache_lengths=a["cache_lengths"][:-1]),
        ValueError,
        "cache_lengths must have shape",
    ),
    (
        "lengths int64",
        lambda a, k: a.update(cache_lengths=a["cache_lengths"].astype(np.int64)),
        TypeError,
        "cache_lengths must have dtype",
    ),
    (
        "table 1-D",
        lambda a, k: a.update(block_table=a["block_table"][0]),
        ValueError,
        "block_table must have shape",
    ),
    (
        "table rows",
        lambda a, k: a.update(block_table=a["block_table"][:-1]),
        ValueError,
        "block_table must have shape",
    ),
    (
        "table int64",
        lambda a, k: a.update(block_table=a["block_table"].astype(np.int64)),
        TypeError,
        "block_table must have dtype",
    ),
    (
        "cos_sin float64",
        lambda a, k: k.update(cos_sin_cache=k["cos_sin_cache"].astype(np.float64)),
        TypeError,
        "cos_sin_cache must have dtype",
    ),
    (
        "cos_sin 3-D",
        lambda a, k: k.update(cos_sin_cache=k["cos_sin_cache"][None]),
        ValueError,
        r"cos_sin_cache must have shape \(P, R\)",
    ),
    (
        "R odd",
        lambda a, k: k.update(cos_sin_cache=np.ascontiguousarray(k["cos_sin_cache"][:, :5])),
        ValueError,
        "must be even",
    ),
    (
        "R > D",
        lambda a, k: k.update(cos_sin_cache=np.ones((8, 18), np.float32)),
        ValueError,
        r"\[2, D=16\]",
    ),
    (
        "out shape",
        lambda a, k: k.update(out=np.empty((6, 63), F16)),
        ValueError,
        "out must have shape",
    ),
    (
        "out dtype",
        lambda a, k: k.update(out=np.empty((6, 64), BF16)),
        TypeError,
        "out must have the dtype",
    ),
    (
        "out read-only",
        lambda a, k: k.update(out=read_only(np.empty((6, 64), F16))),
        BufferError,
        "out",
    ),
    (
        "hidden strided",
        lambda a, k: a.update(hidden_state=np.repeat(a["hidden_state"], 2, axis=1)[:, ::2]),
        ValueError,
        "hidden_state must be contiguous in its last dimension",
    ),
    (
        "cache read-only",
        lambda a, k: a.update(
            paged_kv_cache=tuple(np.broadcast_to(c[:1], c.shape) for c in a["paged_kv_cache"])
        ),
        BufferError,
        "k_cache",
    ),
]


@pytest.mark.parametrize("mutate, exc, match", [r[1:] for r in RULES], ids=[r[0] for r in RULES])
def test_validation(mutate, exc, match):
    args, kw = make_case(11)
    mutate(args, kw)
    before = [c.copy() for c in args["paged_kv_cache"]]
    with pytest.raises(exc, match=match):
        call(args, kw)
    for c, b in zip(args["paged_kv_cache"], before):
        np.testing.assert_array_equal(np.asarray(c).view(np.uint8), b.view(np.uint8))


QUANT_RULES = [
    (
        "fp8 without scales",
        "fp8",
        lambda a, k: k.pop("weight_scales"),
        ValueError,
        "weight_scales .* is required",
    ),
    (
        "fp8 scales shape",
        "fp8",
        lambda a, k: k.update(weight_scales=k["weight_scales"][:-1]),
        ValueError,
        "weight_scales must have shape",
    ),
    (
        "fp8 scales dtype",
        "fp8",
        lambda a, k: k.update(weight_scales=k["weight_scales"].astype(F16)),
        TypeError,
        "weight_scales must have dtype",
    ),
    (
        "fp8 group_size",
        "fp8",
        lambda a, k: k.update(group_size=32),
        ValueError,
        "group_size is only used",
    ),
    (
        "fp8 e5m2 weight",
        "fp8",
        lambda a, k: a.update(weight=a["weight"].astype(E5M2)),
        TypeError,
        "weight must have dtype",
    ),
    (
        "int4 without group",
        "int4",
        lambda a, k: k.pop("group_size"),
        ValueError,
        "group_size is required",
    ),
    ("int4 odd group", "int4", lambda a, k: k.update(group_size=3), ValueError, "even and divide"),
    (
        "int4 group not dividing",
        "int4",
        lambda a, k: k.update(group_size=64),
        ValueError,
        "divide K=96",
    ),
    (
        "int4 without scales",
        "int4",
        lambda a, k: k.pop("weight_scales"),
        ValueError,
        "weight_scales .* is required",
    ),
    (
        "int4 scales dtype",
        "int4",
        lambda a, k: k.update(weight_scales=k["weight_scales"].astype(np.float32)),
        TypeError,
        "weight_scales must have dtype",
    ),
    (
        "int4 scales shape",
        "int4",
        lambda a, k: k.update(weight_scales=k["weight_scales"][:, :2]),
        ValueError,
        "weight_scales must have shape",
    ),
    (
        "int4 zero points shape",
        "int4",
        lambda a, k: k.update(zero_points=np.zeros((128, 2), np.uint8)),
        ValueError,
        "zero_points must have shape",
    ),
    (
        "int4 zero points dtype",
        "int4",
        lambda a, k: k.update(zero_points=np.zeros((128, 3), np.int32)),
        TypeError,
        "zero_points must have dtype",
    ),
    (
        "int4 weight unpacked",
        "int4",
        lambda a, k: a.update(weight=np.zeros((128, 96), np.uint8)),
        ValueError,
        r"K / 2\) for 4-bit",
    ),
    (
        "int4 odd K",
        "int4",
        lambda a, k: a.update(hidden_state=a["hidden_state"][:, :95]),
        ValueError,
        "even K",
    ),
    (
        "kv_scale negative",
        "fp8cache",
        lambda a, k: k.update(kv_scale=-1.0),
        ValueError,
        "kv_scale must be a finite positive number",
    ),
    (
        "kv_scale triple",
        "fp8cache",
        lambda a, k: k.update(kv_scale=(1.0, 1.0, 1.0)),
        ValueError,
        "pair of floats",
    ),
]


@pytest.mark.parametrize(
    "wfmt, mutate, exc, match", [r[1:] for r in QUANT_RULES], ids=[r[0] for r in QUANT_RULES]
)
def test_validation_quantized(wfmt, mutate, exc, match):
    if wfmt == "fp8cache":
        args, kw = make_case(12, cache_dtype=E4M3)
    else:
        args, kw = make_case(12, wfmt=wfmt)
    mutate(args, kw)
    with pytest.raises(exc, match=match):
        call(args, kw)


@pytest.mark.parametrize("setting", [True, False])
@pytest.mark.parametrize(
    "wfmt, dtype, T, packed",
    [
        ("int4", F16, 1, True),
        ("int4", F16, 4, True),
        ("int4", F16, 5, False),  # token tile 8
        ("int4", BF16, 1, False),  # fp16 pairs only
        ("fp8", F16, 2, True),
        ("fp8", BF16, 3, True),
        ("dense", F16, 1, False),
    ],
)
def test_gemv_takes_the_packed_decode_where_it_applies(
    wfmt, dtype, T, packed, setting, monkeypatch
):
    """GEMV_PACKED (on by default) selects qkv_gemv's packed decode for 4-bit weights with fp16
    inputs and fp8 weights at token tiles up to GEMV_PACKED_MAX_TILE; False restores the float32
    decode (the launch's kernel, with the driver out of the way)."""
    from types import SimpleNamespace

    assert qkv_mod.GEMV_PACKED is True
    got = []
    monkeypatch.setattr(qkv_mod, "Launch", lambda *a, **k: got.append((a[1], k["shared_mem"])))
    K, fmt = 4096, WEIGHT_FORMATS[wfmt]
    wdtype = {"int4": np.dtype(np.uint8), "fp8": E4M3, "dense": np.dtype(dtype)}[wfmt]
    cols = K // 2 if wfmt == "int4" else K
    vx = SimpleNamespace(dtype=np.dtype(dtype))
    vw = SimpleNamespace(ptr=1 << 20, strides=(cols, 1), dtype=wdtype)
    fields = {"group_size": 128, "ws_s0": K // 128 if wfmt == "int4" else 0, "zp_s0": 0}
    decode = (False, setting, False, qkv_mod.GEMV_FORM)
    qkv_mod._gemv(fields, {}, vx, vw, fmt, T, K, 6144, 0, decode, False)
    tt = next(t for t in qkv_mod.GEMV_TILES if t >= T)
    want = qkv_mod.gemv_expression(np.dtype(dtype), fmt, 16, tt, False, False, packed and setting)
    assert want.split(", ")[-2] == ("1" if packed and setting else "0")
    assert got[0][0] == want
    assert got[0][1] <= qkv_mod.GEMV_SMEM  # the fp16 pairs fit the float32 rows' space


def test_instantiations_cover_every_dispatch():
    names = set(qkv_mod.instantiations())
    assert len(names) == len(list(qkv_mod.instantiations()))
    for dtype in (F16, BF16):
        for fmt in (0, 1, 2):
            for tt in qkv_mod.GEMV_TILES:
                assert qkv_mod.gemv_expression(dtype, fmt, 16, tt) in names
                for packed in (1, 2):
                    assert qkv_mod.gemv_expression(dtype, fmt, 16, tt, packed=packed) in names
            for tn in qkv_mod.MMA_TILES:
                assert qkv_mod.mma_expression(dtype, fmt, tn, qkv_mod.MMA_SPLIT) in names
        for tn, opts in itertools.product(qkv_mod.TILED_TILES, (False, True)):
            for split in qkv_mod.TILED_SPLITS:
                for fmt in qkv_mod.TILED_FORMATS:
                    assert (
                        qkv_mod.tiled_expression(
                            dtype, fmt, tn, split, qkv_mod.TILED_STAGES, qkv_mod.TILED_KGROUPS, opts
                        )
                        in names
                    )


def test_mma_applies_and_slices():
    W = WEIGHT_FORMATS
    assert qkv_mod.mma_applies(4096, 128, W["dense"], None)
    assert qkv_mod.mma_applies(96, 32, W["int4"], 32)
    assert not qkv_mod.mma_applies(4096, 128, W["dense"], None, compute_capability=80)
    assert not qkv_mod.mma_applies(4096, 96, W["dense"], None)  # D must divide 128
    assert not qkv_mod.mma_applies(4100, 128, W["dense"], None)  # K in 16-byte loads
    assert not qkv_mod.mma_applies(4104, 128, W["fp8"], None)
    assert not qkv_mod.mma_applies(4096, 128, W["int4"], 16)  # groups of whole loads
    # each CTA of the cluster a whole number of chunks (4 loads), the cluster covering K
    for K, fmt, split in itertools.product(
        (96, 320, 4096, 8192, 14336), qkv_mod.MMA_VALS, qkv_mod.MMA_SPLITS
    ):
        vals = qkv_mod.MMA_VALS[fmt]
        kc = qkv_mod._mma_slice(K, fmt, split)
        assert kc % (4 * vals) == 0 and kc * split >= K
        assert (kc - 4 * vals) * split < K
    assert qkv_mod._mma_slice(4096, W["dense"], 8) == 512
    assert qkv_mod.MMA_SPLIT in qkv_mod.MMA_SPLITS


def test_quantized_weights_take_the_tiled_kernel_while_one_wave_holds_them():
    """fp8 / 4-bit weights run the tensor-core path eagerly up to MMA_QUANTIZED_ANY_GRID tokens,
    and beyond up to MMA_MAX_TOKENS_QUANTIZED only on qkv_mma_tiled and while its unsplit grid
    of 64-token tiles fits one wave (2 CTAs an SM): Llama-3-8B's 48 row tiles on 132 SMs hold 5
    token tiles (320 tokens), Llama-3-70B's 80 hold 3 (192); K that the tiled kernel does not
    take, or a cap at or below MMA_QUANTIZED_ANY_GRID, keeps the cap."""
    W, tiled = WEIGHT_FORMATS, qkv_mod.tiled_settings()
    top = qkv_mod.quantized_top
    assert (qkv_mod.MMA_QUANTIZED_ANY_GRID, qkv_mod.MMA_MAX_TOKENS_QUANTIZED) == (128, 320)
    assert tiled[1] == 64 and tiled[4] == 2  # TILED_MAX_TILE, TILED_CTAS_PER_SM
    for fmt in (W["fp8"], W["int4"]):
        assert top(4096, 6144, fmt, 132, (320, 128), tiled) == 320
        assert top(8192, 10240, fmt, 132, (320, 128), tiled) == 192
        assert top(4096, 6144, fmt, 132, (1000, 128), tiled) == 320
        assert top(4096, 6144, fmt, 66, (320, 128), tiled) == 128  # 2 token tiles: the floor
        assert top(4096, 1536, fmt, 132, (320, 128), tiled) == 320
        assert top(4096, 6144, fmt, 132, (100, 128), tiled) == 100
        assert top(4160, 6144, fmt, 132, (320, 128), tiled) == 128  # not the tiled kernel's K
        assert top(4096, 6144, fmt, 132, (1 << 30, 1 << 30), tiled) == 1 << 30  # any grid


def test_tiled_applies_and_splits():
    W = WEIGHT_FORMATS
    assert qkv_mod.tiled_applies(4096, W["dense"], qkv_mod.TILED_MIN_TOKENS)
    assert not qkv_mod.tiled_applies(4096, W["dense"], qkv_mod.TILED_MIN_TOKENS - 1)
    assert qkv_mod.tiled_applies(4096, W["fp8"], 64)
    assert qkv_mod.tiled_applies(4096, W["int4"], 64)
    assert qkv_mod.tiled_applies(4096, W["int4"], qkv_mod.MMA_MAX_TOKENS_QUANTIZED)
    assert not qkv_mod.tiled_applies(4096, W["int4"], qkv_mod.TILED_MIN_TOKENS - 1)
    assert not qkv_mod.tiled_applies(4104, W["dense"], 64)  # K in whole stages
    assert not qkv_mod.tiled_applies(4160, W["fp8"], 64)  # (128 fp8 values a stage)
    assert not qkv_mod.tiled_applies(4160, W["int4"], 64)  # (128 4-bit values a stage)
    assert qkv_mod.tiled_applies(384, W["int4"], 64)  # groups of 96: 32-value chunks
    assert set(qkv_mod.TILED_FORMATS) == set(W.values()) == set(qkv_mod.TILED_BK)
    # shared memory: stages of 128 weight rows (64-byte rows for 4-bit, with an 8-byte scale
    # entry per row and 32 k values) and of the token tile's hidden rows
    assert qkv_mod._tiled_smem(64, 3, W["fp8"]) == 3 * (128 * 128 + 64 * 256)
    assert qkv_mod._tiled_smem(64, 3, W["dense"]) == 3 * (128 * 128 + 64 * 128)
    assert qkv_mod._tiled_smem(64, 3, W["int4"]) == 3 * (128 * 64 + 64 * 256 + 128 * 4 * 8)
    assert qkv_mod._tiled_smem(128, 1, W["int4"]) == 128 * 132 * 4  # the partial sums
    # every compiled tile at 2-4 stages fits a block's 227 KiB (static shared memory: < 8 KiB);
    # the shipped tile TILED_CTAS_PER_SM times an SM's 228 KiB (1 KiB reserved a block)
    for fmt, tn, stages in itertools.product(qkv_mod.TILED_FORMATS, qkv_mod.TILED_TILES, (2, 3, 4)):
        assert qkv_mod._tiled_smem(tn, stages, fmt) + 8 * 1024 <= 227 * 1024
    for fmt in qkv_mod.TILED_FORMATS:
        smem = qkv_mod._tiled_smem(qkv_mod.TILED_MAX_TILE, qkv_mod.TILED_STAGES, fmt)
        assert qkv_mod.TILED_CTAS_PER_SM * (smem + 8 * 1024) <= 228 * 1024
    # Llama-3-8B (48 row tiles) on 132 SMs at 3 CTAs each: one wave of 384 CTAs from 64 to 512
    # tokens (tiles of 64), then the whole K in one CTA
    wave = 3 * 132
    assert [qkv_mod._tiled_split(48 * t, 8, wave) for t in (1, 2, 4, 8, 16)] == [8, 4, 2, 1, 1]
    assert qkv_mod._tiled_split(48, 4, wave) == 4  # never above TILED_SPLIT
    assert qkv_mod._tiled_split(3 * 48, 8, wave) == 2  # the largest that fits
    assert (
        qkv_mod.TILED_SPLIT in qkv_mod.TILED_SPLITS
        and qkv_mod.TILED_MAX_TILE in qkv_mod.TILED_TILES
    )


# ---------------------------------------------------------------------------------------------
# GPU: both paths against the float64 reference


def rel_rows(actual, expect, D):
    """Largest relative L2 error over rows of D values."""
    a = to_numpy(actual).astype(np.float64).reshape(-1, D)
    e = expect.astype(np.float64).reshape(-1, D)
    den = np.maximum(np.linalg.norm(e, axis=1), 1e-6)
    return float((np.linalg.norm(a - e, axis=1) / den).max(initial=0.0))


def rounded_weights(args, kw):
    """The call as the cuBLAS path computes it for quantized weights: weights dequantized, then
    rounded to the input dtype (documented), so fp8 codes are compared against that."""
    dtype = args["hidden_state"].dtype
    w = reference.to_dtype(
        reference.dequantize_weight(
            args["weight"], kw.get("weight_scales"), kw.get("group_size"), kw.get("zero_points")
        ),
        dtype,
    )
    kw = {n: x for n, x in kw.items() if n not in ("weight_scales", "group_size", "zero_points")}
    return {**args, "weight": w}, kw


WEIGHT_FORMATS = {"dense": qkv_mod.W_DENSE, "fp8": qkv_mod.W_FP8, "int4": qkv_mod.W_INT4}


def record_kernels(monkeypatch):
    """The list to which every qkv Launch from now on appends its kernel's name expression."""
    real, names = qkv_mod.Launch, []

    def launch(*a, **k):
        names.append(a[1])
        return real(*a, **k)

    monkeypatch.setattr(qkv_mod, "Launch", launch)
    return names


def force_path(monkeypatch, path):
    """Make the call take ``path`` ("mma": qkv_mma; "tiled": qkv_mma_tiled, at any token count;
    "wgmma": qkv_wgmma, at any token count (4-bit weights: up to WGMMA_INT4_TOP); "gemv"
    (qkv_gemv, not its lean form); "lean": qkv_gemv_lean where it applies (up to the largest of
    LEAN_TILES tokens); "lean_mma": qkv_lean_mma where it applies (up to the largest of
    LEAN_MMA_TILES tokens); "cublas"; None: the thresholds as shipped)."""
    if path == "lean":
        monkeypatch.setattr(qkv_mod, "GEMV_LEAN_MAX_TOKENS", max(qkv_mod.LEAN_TILES))
        monkeypatch.setattr(qkv_mod, "GEMV_LEAN_DENSE_MAX_TOKENS", max(qkv_mod.LEAN_TILES))
        return
    if path is not None:
        monkeypatch.setattr(qkv_mod, "GEMV_LEAN_MAX_TOKENS", 0)
        monkeypatch.setattr(qkv_mod, "GEMV_LEAN_DENSE_MAX_TOKENS", 0)
    top = max(qkv_mod.LEAN_MMA_TILES) if path == "lean_mma" else 0
    if path is not None:
        monkeypatch.setattr(qkv_mod, "LEAN_MMA_MAX_TOKENS", top)
        monkeypatch.setattr(qkv_mod, "LEAN_MMA_DENSE_MAX_TOKENS", top)
    if path == "lean_mma":
        return
    if path not in (None, "gemv"):  # its few tokens past GEMV_MAX_TOKENS: qkv_gemv all the same
        monkeypatch.setattr(qkv_mod, "GEMV_PACKED_MAX_TOKENS", 0)
    if path == "wgmma":
        monkeypatch.setattr(qkv_mod, "WGMMA_MIN_TOKENS", 1)
        monkeypatch.setattr(qkv_mod, "WGMMA_MAX_TOKENS", 1 << 30)
        monkeypatch.setattr(qkv_mod, "WGMMA_INT4_MIN_TOKENS", 1)
        return
    if path is not None:
        monkeypatch.setattr(qkv_mod, "WGMMA_MAX_TOKENS", 0)
    if path in ("mma", "tiled"):
        monkeypatch.setattr(qkv_mod, "MMA_MIN_TOKENS", 1)
        monkeypatch.setattr(qkv_mod, "MMA_MAX_TOKENS", 1 << 30)
        monkeypatch.setattr(qkv_mod, "MMA_MAX_TOKENS_QUANTIZED", 1 << 30)
        monkeypatch.setattr(qkv_mod, "MMA_QUANTIZED_ANY_GRID", 1 << 30)  # any grid
        monkeypatch.setattr(qkv_mod, "TILED_MIN_TOKENS", 1 if path == "tiled" else 1 << 30)
    elif path is not None:
        monkeypatch.setattr(qkv_mod, "MMA_MAX_TOKENS", 0)
        monkeypatch.setattr(qkv_mod, "MMA_MAX_TOKENS_QUANTIZED", 0)
        monkeypatch.setattr(qkv_mod, "GEMV_MAX_TOKENS", 1 << 30 if path == "gemv" else 0)


def weight_format(args):
    """qkv.py's weight format (W_DENSE, W_FP8, W_INT4) of a case's weights."""
    return {
        args["hidden_state"].dtype: qkv_mod.W_DENSE,
        E4M3: qkv_mod.W_FP8,
        np.dtype(np.uint8): qkv_mod.W_INT4,
    }[args["weight"].dtype]


def load_bytes(args, kw):
    """qkv.py's weight load width (vb) for freshly allocated, so aligned, arrays: 16 bytes where
    K fills them (4-bit: with groups of a multiple of 32), else 0."""
    fmt, K = weight_format(args), args["hidden_state"].shape[1]
    if fmt == qkv_mod.W_INT4 and kw.get("group_size", 0) % 32:
        return 0
    return 16 if K % {qkv_mod.W_FP8: 16, qkv_mod.W_INT4: 32}.get(fmt, 8) == 0 else 0


def packed_decode(args, kw):
    """Whether qkv_gemv runs this call on its packed decode (GEMV_PACKED, GEMV_PACKED_FP8, and
    qkv.py's _packed at the call's token tile)."""
    fmt, (T, _) = weight_format(args), args["hidden_state"].shape
    return (
        qkv_mod.GEMV_PACKED
        and (fmt != qkv_mod.W_FP8 or qkv_mod.GEMV_PACKED_FP8)
        and qkv_mod._packed(args["hidden_state"].dtype, fmt, load_bytes(args, kw), qkv_mod._tile(T))
    )


def taken_path(args, kw, cc=None, sms=None):
    """The path a call of these (freshly allocated, so aligned) device arrays takes on this GPU
    (``cc``, ``sms``: a GPU's compute capability and SM count instead; options in ``kw``).
    test_qkv_options checks it against the kernels the op's plans launch."""
    T, K = args["hidden_state"].shape
    D = args["paged_kv_cache"][0].shape[3]
    fmt = weight_format(args)
    if cc is None or sms is None:
        import cupy as cp

        cc = int(cp.cuda.Device().compute_capability)
        sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    opts = kw.get("status") is not None or kw.get("clear_unused_last_page_rows", False)
    vb = load_bytes(args, kw)
    dtype = args["hidden_state"].dtype
    lean_max = qkv_mod.lean_max_tokens()
    if not opts and qkv_mod.lean_applies(dtype, fmt, vb, D, T, lean_max):
        return "lean"
    if not opts and qkv_mod.lean_mma_applies(dtype, fmt, vb, D, T, lean_max, cc):
        return "lean_mma"
    if qkv_mod.GEMV_MAX_TOKENS < T <= qkv_mod.GEMV_PACKED_MAX_TOKENS and packed_decode(args, kw):
        return "gemv"  # the packed decode's few tokens more, before the tensor-core kernels
    if (
        qkv_mod.wgmma_takes(fmt, T, K, D, qkv_mod.wgmma_settings())
        and cc == qkv_mod.WGMMA_CAPABILITY
        and (fmt != qkv_mod.W_INT4 or kw.get("group_size", 0) % 32 == 0)
    ):
        return "wgmma"
    N = args["weight"].shape[0]
    mma_max = (
        qkv_mod.MMA_MAX_TOKENS
        if fmt == qkv_mod.W_DENSE
        else qkv_mod.quantized_top(
            K,
            N,
            fmt,
            sms,
            (qkv_mod.MMA_MAX_TOKENS_QUANTIZED, qkv_mod.MMA_QUANTIZED_ANY_GRID),
            qkv_mod.tiled_settings(),
        )
    )
    if qkv_mod.MMA_MIN_TOKENS <= T <= mma_max and qkv_mod.mma_applies(
        K, D, fmt, kw.get("group_size"), cc
    ):
        return "tiled" if qkv_mod.tiled_applies(K, fmt, T) else "mma"
    return "gemv" if T <= qkv_mod.GEMV_MAX_TOKENS else "cublas"


def check_gpu(args, kw, out_given=False, monkeypatch=None, path=None):
    if path is not None:
        force_path(monkeypatch, path)
    taken = taken_path(args, kw)
    if path is not None:
        assert taken == path, f"the case cannot take the {path} path"
    # weights rounded to the input dtype: the cuBLAS path's dequantization, the tensor-core
    # kernels' 4-bit
    if (
        taken == "cublas"
        and args["weight"].dtype != args["hidden_state"].dtype
        or taken in ("mma", "tiled", "wgmma", "lean_mma")
        and args["weight"].dtype == np.uint8
    ):
        q_ref, k_ref, v_ref = expected(*rounded_weights(args, kw))
    else:
        q_ref, k_ref, v_ref = expected(args, kw)
    within = packed_fp8_within(args, kw, taken)
    originals = [c.copy() for c in args["paged_kv_cache"]]
    dargs = {n: to_device(x) for n, x in args.items()}
    dkw = {n: to_device(x) for n, x in kw.items()}
    if out_given:
        import cupy as cp

        dkw["out"] = cp.full(q_ref.shape, 7, q_ref.dtype)
    q = call(dargs, dkw)
    if out_given:
        assert q is dkw["out"]
    refs = (q_ref, k_ref, v_ref)
    check_results(args, kw, q, dargs["paged_kv_cache"], originals, refs, within)


def assert_codes_within(got, bounds, mask, what):
    """Every fp8 code of ``got`` (an NHD cache) at ``mask`` inside its ``bounds`` pair (lo, hi)
    of cache-shaped arrays (fp8_interval)."""
    lo, hi = (b[mask] for b in bounds)
    g = got[mask].astype(np.float32)
    bad = np.argwhere((g < lo) | (g > hi))
    assert bad.size == 0, (
        f"{what}: {len(bad)} fp8 codes outside the rounding bound, first at {tuple(bad[0])}: "
        f"{g[tuple(bad[0])]} not in [{lo[tuple(bad[0])]}, {hi[tuple(bad[0])]}]"
    )


def check_results(args, kw, q, caches, originals, refs, fp8_within=None):
    """Q within 1% of the reference's rows, the caches' written rows too (fp8 codes equal or
    adjacent; ``fp8_within``: instead, each code inside its ``(lo, hi)`` pair of cache-shaped
    arrays, one pair a cache, see fp8_interval), every other cache byte unchanged from
    ``originals``."""
    q_ref, k_ref, v_ref = refs
    D = args["paged_kv_cache"][0].shape[3]
    assert rel_rows(q, q_ref, D) <= 1e-2
    mask = written_mask(args, kw)
    nhd = kw.get("kv_layout", "NHD") == "NHD"
    for i, (dc, ref, orig, what) in enumerate(zip(caches, (k_ref, v_ref), originals, "kv")):
        got = to_numpy(dc)
        if not nhd:
            got, ref, orig = (np.swapaxes(x, 1, 2) for x in (got, ref, orig))
        np.testing.assert_array_equal(
            got[~mask].view(np.uint8),
            orig[~mask].view(np.uint8),
            err_msg=f"{what} cache: unaddressed bytes changed",
        )
        if ref.dtype.itemsize == 1 and fp8_within is not None:
            assert_codes_within(got, fp8_within[i], mask, f"{what} cache")  # NHD, as got is here
        elif ref.dtype.itemsize == 1:
            assert_close(
                np.ascontiguousarray(got[mask]), np.ascontiguousarray(ref[mask]), f"{what} cache"
            )
        else:
            assert rel_rows(got[mask], ref[mask], D) <= 1e-2, f"{what} cache"


LLAMA = {"K": 4096, "Hq": 32, "Hkv": 8, "D": 128, "R": 128, "P": 4096, "page_size": 16}


@pytest.mark.gpu
@pytest.mark.parametrize(
    "lengths, path",
    [
        ((1,), None),
        ((1,) * 16, None),
        ((1,) * 7, "gemv"),
        ((40, 0, 89), None),
        ((5, 2), "cublas"),
        ((1,) * 64, "mma"),
        ((60, 0, 68), "mma"),
    ],
)
@pytest.mark.parametrize("wfmt", ["dense", "int4", "fp8"])
def test_gpu_llama3_8b(lengths, path, wfmt, monkeypatch):
    args, kw = make_case(
        20,
        lengths=lengths,
        wfmt=wfmt,
        group_size=128,
        cached=[100 + 37 * i for i in range(len(lengths))],
        **LLAMA,
    )
    check_gpu(args, kw, monkeypatch=monkeypatch, path=path)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "lengths", [(1,) * 5, (1,) * 64, (60, 0, 68), (1,) * 256, (100, 157), (300, 0, 300, 424)]
)
@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize("wfmt", ["dense", "fp8"])
def test_gpu_llama3_8b_tiled(lengths, dtype, wfmt, monkeypatch):
    """qkv_mma_tiled at Llama-3-8B's projection: one token tile of each size (32 at 5 tokens,
    64, 128, 256), several 256-token tiles, prefill-like requests. Cache lengths stay below 1500
    (256 requests of up to 9535 tokens made 2.5 GB caches, copied several times on the host: a
    pytest-xdist worker was killed when such tests ran side by side)."""
    args, kw = make_case(
        25,
        lengths=lengths,
        dtype=dtype,
        cache_dtype=E4M3 if dtype == BF16 else None,
        cached=[(100 + 37 * i) % 1500 for i in range(len(lengths))],
        wfmt=wfmt,
        **{**LLAMA, "P": 8192},
    )
    check_gpu(args, kw, monkeypatch=monkeypatch, path="tiled")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "lengths",
    [
        (1,) * 5,
        (1,) * 17,
        (1,) * 64,
        (1,) * 90,
        (60, 0, 68),
        (80, 0, 80),
        (100, 0, 110),
        (1,) * 256,
        (100, 157),
        (300, 0, 300, 424),
    ],
)
@pytest.mark.parametrize("dtype", [F16, BF16])
def test_gpu_llama3_8b_wgmma(lengths, dtype, monkeypatch):
    """qkv_wgmma at Llama-3-8B's projection: the deep kernel's one token tile of 32 (5 and 17
    tokens), 64, 96 (90), 128, 192 (160) and 256 (210); above 224 tokens (as captured in CUDA
    graphs) several tiles of up to 128 (256 tokens as two, 257 as three of 96), prefill-like
    requests; bf16 into fp8 caches. (fp8 weights: test_gpu_llama3_8b_wgmma_fp8.)"""
    args, kw = make_case(
        28,
        lengths=lengths,
        dtype=dtype,
        cache_dtype=E4M3 if dtype == BF16 else None,
        cached=[(100 + 37 * i) % 1500 for i in range(len(lengths))],
        **{**LLAMA, "P": 8192},
    )
    check_gpu(args, kw, monkeypatch=monkeypatch, path="wgmma")


def check_graph_replays(args, kw, dargs, dkw, originals, refs_of):
    """The call on the device arrays ``dargs`` / ``dkw`` (``dkw["out"]`` given) recorded in a CUDA
    graph, replayed twice on new hidden rows copied into the captured array and on the caches as
    they were (``originals``): Q and both caches as ``refs_of(new host arguments)`` says, no other
    cache byte."""
    import cupy as cp

    out = dkw["out"]
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        assert call(dargs, dkw) is out
        graph = stream.end_capture()
    rng = np.random.default_rng(out.shape[0])
    for _ in range(2):
        hidden = rng.standard_normal(args["hidden_state"].shape).astype(out.dtype)
        for dc, orig in zip(dargs["paged_kv_cache"], originals):
            cp.copyto(dc, to_device(orig))
        cp.copyto(dargs["hidden_state"], to_device(hidden))
        out.fill(7)
        cp.cuda.Device().synchronize()  # (those ran on the current stream, not the graph's)
        graph.launch(stream)
        stream.synchronize()
        new = {**args, "hidden_state": hidden}
        check_results(new, kw, out, dargs["paged_kv_cache"], originals, refs_of(new))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "lengths, dtype, wfmt",
    [
        ((120, 0, 150), F16, "dense"),
        ((1,) * 300, BF16, "dense"),
        ((200, 312), F16, "dense"),
        ((200, 184), F16, "fp8"),
        ((200, 312), BF16, "fp8"),
    ],
)
def test_gpu_capture_runs_the_fused_kernel_beyond_its_eager_range(lengths, dtype, wfmt):
    """On sm_90 a call of up to GRAPH_MAX_TOKENS tokens that runs cuBLAS + the epilogue eagerly
    (16-bit weights above 256 tokens, fp8 above what one wave of the tiled kernel holds) runs, on
    a stream being captured into a CUDA graph, the fused kernel (qkv_wgmma for 16-bit weights,
    qkv_mma_tiled for fp8): the graph, replayed on new hidden rows copied into the captured array
    and on the caches as they were, writes Q and both caches as the reference says, and no other
    cache byte. The eager call (the plan, built outside the capture) is checked too."""
    import cupy as cp

    if int(cp.cuda.Device().compute_capability) != qkv_mod.WGMMA_CAPABILITY:
        pytest.skip("calls of this size are captured on sm_90 only")
    T = sum(lengths)
    assert T <= qkv_mod.GRAPH_MAX_TOKENS
    args, kw = make_case(
        31 + T,
        lengths=lengths,
        dtype=dtype,
        wfmt=wfmt,
        cached=[(100 + 37 * i) % 1500 for i in range(len(lengths))],
        **{**LLAMA, "P": 8192},
    )
    assert taken_path(args, kw) == "cublas"
    originals = [c.copy() for c in args["paged_kv_cache"]]
    dargs = {n: to_device(x) for n, x in args.items()}
    dkw = {n: to_device(x) for n, x in kw.items()}
    dkw["out"] = cp.full((T, kw["num_q_heads"] * LLAMA["D"]), 7, dtype)  # no allocation
    eager = rounded_weights(args, kw) if wfmt != "dense" else (args, kw)  # cuBLAS dequantizes
    check_results(args, kw, call(dargs, dkw), dargs["paged_kv_cache"], originals, expected(*eager))
    check_graph_replays(args, kw, dargs, dkw, originals, lambda new: expected(new, kw))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "lengths", [(1,) * 17, (10, 0, 22), (1,) * 48, (40, 0, 24), (1,) * 90, (60, 0, 68), (1,) * 128]
)
@pytest.mark.parametrize("dtype", [F16, BF16])
def test_gpu_llama3_8b_wgmma_fp8(lengths, dtype):
    """fp8 weights on qkv_wgmma (the shipped thresholds: 17 to 128 tokens, the deep kernel,
    stages of 128 codes at tiles of 32 and 64, of 64 at 96 and 128 (WGMMA_FP8_MIN_STAGES)): codes
    converted to the input dtype in the wgmmas' A registers (W_FP8_REG), per-row scales in the
    epilogue; bf16 into fp8 caches."""
    args, kw = make_case(
        30,
        lengths=lengths,
        dtype=dtype,
        wfmt="fp8",
        cache_dtype=E4M3 if dtype == BF16 else None,
        cached=[(100 + 37 * i) % 1500 for i in range(len(lengths))],
        **{**LLAMA, "P": 8192},
    )
    assert taken_path(args, kw) == "wgmma"
    check_gpu(args, kw)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "lengths",
    [(1,) * 17, (10, 0, 22), (1,) * 64, (40, 0, 24), (60, 0, 68), (100, 0, 57), (120, 104)],
)
@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("zero_points", [False, True])
def test_gpu_llama3_8b_wgmma_int4(lengths, dtype, group_size, zero_points):
    """4-bit weights on qkv_wgmma (the shipped thresholds: WGMMA_INT4_MIN_TOKENS to 224 tokens,
    the deep kernel): groups of 128 dequantized into the wgmmas' A registers (W_INT4_REG), groups
    of 32 (two groups an atom) to the input dtype in shared memory once a CTA (W_INT4), with and
    without zero points; tiles of 32, 64, 128 (W_INT4: stages of one atom), 192 and 256 (stages
    of one atom); bf16 into fp8 caches."""
    args, kw = make_case(
        31 + group_size,
        lengths=lengths,
        dtype=dtype,
        wfmt="int4",
        group_size=group_size,
        zero_points=zero_points,
        cache_dtype=E4M3 if dtype == BF16 else None,
        cached=[(100 + 37 * i) % 1500 for i in range(len(lengths))],
        **{**LLAMA, "P": 8192},
    )
    assert taken_path(args, kw) == "wgmma"
    check_gpu(args, kw)


@pytest.mark.gpu
@pytest.mark.parametrize("lengths, dtype", [((30, 0, 34), F16), ((1,) * 128, BF16)])
def test_gpu_wgmma_int4_in_a_cuda_graph(lengths, dtype):
    """4-bit weights on qkv_wgmma recorded in a CUDA graph: replayed on new hidden rows copied
    into the captured array and on the caches as they were, Q and both caches as the reference
    (weights rounded once to the input dtype) says, no other cache byte."""
    import cupy as cp

    if int(cp.cuda.Device().compute_capability) != qkv_mod.WGMMA_CAPABILITY:
        pytest.skip("qkv_wgmma runs on sm_90 only")
    T = sum(lengths)
    args, kw = make_case(
        33 + T,
        lengths=lengths,
        dtype=dtype,
        wfmt="int4",
        group_size=128,
        zero_points=dtype == BF16,
        cached=[(100 + 37 * i) % 1500 for i in range(len(lengths))],
        **{**LLAMA, "P": 8192},
    )
    assert taken_path(args, kw) == "wgmma"
    originals = [c.copy() for c in args["paged_kv_cache"]]
    dargs = {n: to_device(x) for n, x in args.items()}
    dkw = {n: to_device(x) for n, x in kw.items()}
    dkw["out"] = cp.full((T, kw["num_q_heads"] * LLAMA["D"]), 7, dtype)
    check_graph_replays(
        args, kw, dargs, dkw, originals, lambda new: expected(*rounded_weights(new, kw))
    )


@pytest.mark.gpu
@pytest.mark.parametrize(
    "wfmt, lengths",
    [
        ("int4", (1,) * 17),
        ("int4", (40, 0, 24)),
        ("int4", (100, 0, 57)),
        ("int4", (120, 104)),
        ("fp8", (40, 0, 24)),  # (fp8: 17 to 128 tokens)
    ],
)
@pytest.mark.parametrize("dtype", [F16, BF16])
def test_gpu_llama3_8b_wgmma_shared_form(wfmt, lengths, dtype, monkeypatch):
    """WGMMA_INT4_REG / WGMMA_FP8_REG = False: 4-bit weights with groups of 128 and fp8 weights
    take the shared-memory forms (W_INT4, W_FP8) again, with the same results as the reference;
    zero points with bf16."""
    monkeypatch.setattr(qkv_mod, "WGMMA_INT4_REG", False)
    monkeypatch.setattr(qkv_mod, "WGMMA_FP8_REG", False)
    args, kw = make_case(
        35,
        lengths=lengths,
        dtype=dtype,
        wfmt=wfmt,
        group_size=128 if wfmt == "int4" else None,
        zero_points=dtype == BF16 and wfmt == "int4",
        cached=[(100 + 37 * i) % 1500 for i in range(len(lengths))],
        **{**LLAMA, "P": 8192},
    )
    assert taken_path(args, kw) == "wgmma"
    check_gpu(args, kw, monkeypatch=monkeypatch, path="wgmma")


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 5, 17, 33, 64, 97, 128, 150, 224])
@pytest.mark.parametrize("atoms", [1, 2])
@pytest.mark.parametrize("split", [1, 2, 4, 8])
def test_gpu_wgmma_int4_settings(T, atoms, split, monkeypatch):
    """qkv_wgmma with 4-bit weights at every deep tile (32 to 256 tokens) and stage width, K
    slices of one to several stages (splits of 1 to 8, a slice past K's end), a partial row tile
    (N = 320), groups of 64 with zero points (the register form, W_INT4_REG) or of 32 without
    (the shared-memory form), tokens outside every request, interleaved RoPE on part of the
    head."""
    if T > 128:  # three stages of two atoms at tiles of 192 and 256 exceed the shared memory
        atoms = 1
    monkeypatch.setattr(qkv_mod, "WGMMA_INT4_ATOMS", atoms)
    monkeypatch.setattr(qkv_mod, "WGMMA_INT4_MIN_STAGES", 1)  # atoms at every tile
    # the split as WGMMA_SPLIT says (a wave of any size), the stages as many as fit the SM's
    # shared memory (overriding SM_SHARED_BYTES instead asked the driver for more than exists)
    monkeypatch.setattr(qkv_mod, "_sm_count", lambda device: 1 << 20)
    monkeypatch.setattr(qkv_mod, "WGMMA_SPLIT", split)
    lengths = (T // 2, 0, T - T // 2 - 1)
    args, kw = make_case(
        41 + T + split,
        lengths=lengths,
        dtype=BF16 if (T + atoms) % 2 else F16,
        wfmt="int4",
        group_size=64 if split % 2 == 0 else 32,
        zero_points=split % 2 == 0,
        K=1536 if atoms == 1 else 1664,
        Hq=3,
        Hkv=1,
        D=64,
        R=32,
        P=512,
        page_size=16,
        extra_tokens=1,
        is_neox=bool(T % 3),
        cached=[5 * i for i in range(len(lengths))],
    )
    check_gpu(args, kw, monkeypatch=monkeypatch, path="wgmma")


@pytest.mark.gpu
@pytest.mark.parametrize("T, wfmt", [(17, "int4"), (64, "dense"), (100, "fp8")])
def test_gpu_wgmma_split_whose_clusters_run_at_once(T, wfmt, monkeypatch):
    """32 row tiles (16 / 8 heads of 128, Qwen3-1.7B's projection): the largest split that fits
    the SMs is 4 (128 CTAs), whose 32 clusters the H200 does not run at once (30), so qkv_wgmma
    takes a split of 2 there (a split of 4 where the device holds 32 clusters of 4); results as
    the reference either way."""
    import cupy as cp

    if int(cp.cuda.Device().compute_capability) != qkv_mod.WGMMA_CAPABILITY:
        pytest.skip("qkv_wgmma runs on sm_90 only")
    names = record_kernels(monkeypatch)
    held = []
    real = qkv_mod._active_clusters

    def active(expression, device, split, smem):
        held.append((split, real(expression, device, split, smem)))
        return held[-1][1]

    monkeypatch.setattr(qkv_mod, "_active_clusters", active)
    lengths = (T // 3, 0, T - T // 3)
    args, kw = make_case(
        90 + T,
        lengths=lengths,
        wfmt=wfmt,
        group_size=128,
        dtype=BF16 if T % 2 else F16,
        cached=[11 * i for i in range(len(lengths))],
        K=2048,
        Hq=16,
        Hkv=8,
        D=128,
        R=128,
        P=512,
        page_size=16,
    )
    check_gpu(args, kw, monkeypatch=monkeypatch, path="wgmma")
    # the split: qkv_wgmma's third template argument
    wgmma = [int(n.split("<")[1].split(",")[2]) for n in names if n.startswith("qkv_wgmma")]
    if qkv_mod._sm_count(cp.cuda.Device().id) >= 128:  # (a split of 4 fits the SMs' wave)
        assert held and held[0][0] == 4
        assert set(wgmma) == {4 if held[0][1] is None or held[0][1] >= 32 else 2}


@pytest.mark.gpu
@pytest.mark.parametrize("T", [17, 33, 64, 128, 150, 200])
@pytest.mark.parametrize("tile", [32, 64, 96, 128])
@pytest.mark.parametrize("stages, atoms", [(2, 1), (3, 2), (4, 1), (6, 1)])
def test_gpu_wgmma_settings(T, tile, stages, atoms, monkeypatch):
    """qkv_wgmma under every token tile, stage count and stage width, deep (one CTA an SM, a
    wgmma group left running: 3 stages at least; all tokens one tile, of 32 to 256) or not (tiles
    of up to ``tile``), each at every token count: K slices of one to several stages (splits of
    1 to 8, a slice past K's end), a partial row tile (N = 320), tokens outside every request,
    interleaved RoPE on part of the head; fp8 weights in either form (A registers or shared
    memory)."""
    deep = (T + tile // 32 + stages) % 3 != 0
    # fp8 weights: the deep kernel only, up to WGMMA_FP8_TOP tokens
    fp8 = deep and T <= qkv_mod.WGMMA_FP8_TOP and (T + tile // 32) % 2 == 0
    tn = qkv_mod._wgmma_tile(T, tile, deep)
    if tn > 128:  # a tile of 192 or 256 tokens holds 5 or 4 stages of one atom (fit off below)
        stages, atoms = min(stages, qkv_mod._wgmma_stages(tn, 8, 1, True)), 1
    monkeypatch.setattr(qkv_mod, "WGMMA_MAX_TILE", tile)
    monkeypatch.setattr(qkv_mod, "WGMMA_STAGES", stages)
    monkeypatch.setattr(qkv_mod, "WGMMA_DEEP_STAGES", stages)
    monkeypatch.setattr(qkv_mod, "WGMMA_DEEP_MAX_TOKENS", 1 << 30 if deep else 0)
    monkeypatch.setattr(qkv_mod, "WGMMA_ATOMS", atoms)
    monkeypatch.setattr(qkv_mod, "SM_SHARED_BYTES", 1 << 30)  # the split as WGMMA_SPLIT says
    monkeypatch.setattr(qkv_mod, "WGMMA_SPLIT", (1, 2, 4, 8)[(T + tile // 32 + stages) % 4])
    lengths = (T // 2, 0, T - T // 2 - 1)
    monkeypatch.setattr(qkv_mod, "WGMMA_FP8_MIN_TOKENS", 1)
    monkeypatch.setattr(qkv_mod, "WGMMA_FP8_ATOMS", atoms)
    monkeypatch.setattr(qkv_mod, "WGMMA_FP8_MIN_STAGES", 1)  # atoms at every tile
    monkeypatch.setattr(qkv_mod, "WGMMA_FP8_REG", (T + stages) % 2 == 1)
    args, kw = make_case(
        29 + T + tile,
        lengths=lengths,
        dtype=BF16 if T % 2 else F16,
        wfmt="fp8" if fp8 else "dense",
        K=1536 if atoms == 1 else 1664,
        Hq=3,
        Hkv=1,
        D=64,
        R=32,
        P=512,
        page_size=16,
        extra_tokens=1,
        is_neox=bool(T % 3),
        cached=[5 * i for i in range(len(lengths))],
    )
    check_gpu(args, kw, monkeypatch=monkeypatch, path="wgmma")


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [(1,) * 5, (1,) * 64, (60, 0, 68), (100, 157)])
@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("zero_points", [False, True])
def test_gpu_llama3_8b_tiled_int4(lengths, dtype, group_size, zero_points, monkeypatch):
    """qkv_mma_tiled with 4-bit weights at Llama-3-8B's projection: groups of 32 (a group per
    32-value chunk) and 128, with and without zero points, token tiles of 32 and 64 and several
    64-token tiles (the tiled kernel forced past MMA_MAX_TOKENS_QUANTIZED)."""
    args, kw = make_case(
        26 + group_size,
        lengths=lengths,
        dtype=dtype,
        wfmt="int4",
        group_size=group_size,
        zero_points=zero_points,
        cache_dtype=E4M3 if dtype == BF16 else None,
        cached=[100 + 37 * i for i in range(len(lengths))],
        **{**LLAMA, "P": 8192},
    )
    check_gpu(args, kw, monkeypatch=monkeypatch, path="tiled")


@pytest.mark.gpu
@pytest.mark.parametrize("T", [17, 33, 64, 128])
@pytest.mark.parametrize("tile", [32, 64, 128])
@pytest.mark.parametrize("kgroups", [1, 2])
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_gpu_tiled_int4_settings(T, tile, kgroups, stages, monkeypatch):
    """qkv_mma_tiled with 4-bit weights under every token tile, k-group count and stage count:
    K slices of one to several stages (splits of 1 to 8), a partial row tile (N = 320), groups
    of 64 and zero points, tokens outside every request."""
    monkeypatch.setattr(qkv_mod, "TILED_MAX_TILE", tile)
    monkeypatch.setattr(qkv_mod, "TILED_KGROUPS", kgroups)
    monkeypatch.setattr(qkv_mod, "TILED_STAGES", stages)
    monkeypatch.setattr(qkv_mod, "TILED_CTAS_PER_SM", 1000)  # the split as TILED_SPLIT says
    monkeypatch.setattr(qkv_mod, "TILED_SPLIT", (1, 2, 4, 8)[(T + tile // 32) % 4])
    lengths = (T // 2, 0, T - T // 2 - 1)
    args, kw = make_case(
        27 + T + tile,
        lengths=lengths,
        dtype=BF16 if T % 2 else F16,
        wfmt="int4",
        group_size=64,
        zero_points=True,
        K=1536,
        Hq=3,
        Hkv=1,
        D=64,
        R=64,
        P=512,
        page_size=16,
        extra_tokens=1,
        cached=[5 * i for i in range(len(lengths))],
    )
    check_gpu(args, kw, monkeypatch=monkeypatch, path="tiled")


# token counts around every switch: GEMV_MAX_TOKENS / MMA_MIN_TOKENS, token tiles 8 / 16 / 32 /
# 64 / 128 / 256, TILED_MIN_TOKENS, MMA_QUANTIZED_ANY_GRID, MMA_MAX_TOKENS_QUANTIZED,
# MMA_MAX_TOKENS (dense weights), qkv_wgmma's tiles of 192 and 256, WGMMA_DEEP_MAX_TOKENS and
# WGMMA_MAX_TOKENS,
# two 64-token tiles (qkv_mma) and two 256-token tiles (qkv_mma_tiled)
SWITCH_TOKENS = [
    1,
    2,
    3,
    7,
    8,
    9,
    15,
    16,
    17,
    31,
    32,
    33,
    63,
    64,
    65,
    127,
    128,
    129,
    192,
    193,
    224,
    225,
    255,
    256,
    257,
    320,
    321,
]


@pytest.mark.gpu
@pytest.mark.parametrize("T", SWITCH_TOKENS)
@pytest.mark.parametrize("wfmt", ["dense", "fp8", "int4"])
def test_gpu_token_counts_around_switches(T, wfmt):
    """The shipped thresholds at every token count around a switch, a Llama-like head layout
    (D 128, whole heads in a tile), requests of mixed lengths with an empty one."""
    cuts = sorted({0, T // 3, T // 3, T})  # an empty request
    lengths = tuple(b - a for a, b in itertools.pairwise(cuts)) + (0,)
    dtype = BF16 if T % 2 else F16
    args, kw = make_case(
        30 + T,
        lengths=lengths,
        wfmt=wfmt,
        group_size=128,
        zero_points=T % 3 == 0,
        dtype=dtype,
        cache_dtype=E4M3 if T % 4 == 1 else None,
        cached=[50 + 7 * i for i in range(len(lengths))],
        K=1024,
        Hq=8,
        Hkv=2,
        D=128,
        R=128,
        P=512,
        page_size=16,
        layout="HND" if T % 5 == 0 else "NHD",
    )
    check_gpu(args, kw)


@pytest.mark.gpu
@given(
    seed=st.integers(0, 2**32 - 1),
    K=st.sampled_from([96, 192, 320, 512, 2048]),
    T=st.sampled_from(SWITCH_TOKENS),
    D=st.sampled_from([16, 32, 64, 128]),
    heads=st.sampled_from([(4, 2), (6, 1), (3, 3)]),
    dtype=st.sampled_from([F16, BF16]),
    cache=st.sampled_from(["same", "e4m3", "e5m2"]),
    layout=st.sampled_from(["NHD", "HND"]),
    rope=st.sampled_from(["neox", "interleaved", "partial", "none"]),
    wfmt=st.sampled_from(["dense", "fp8", "int4"]),
    zero_points=st.booleans(),
    page_size=st.sampled_from([1, 4, 16]),
    out_given=st.booleans(),
    split=st.sampled_from(qkv_mod.MMA_SPLITS),
    stages=st.sampled_from([2, 3, 4]),
    tiled=st.booleans(),
)
def test_gpu_mma_path(
    seed,
    K,
    T,
    D,
    heads,
    dtype,
    cache,
    layout,
    rope,
    wfmt,
    zero_points,
    page_size,
    out_given,
    split,
    stages,
    tiled,
):
    """Both tensor-core kernels at any token count (forced; qkv_mma_tiled where it applies),
    partial row tiles (N not a multiple of 128), K slices shorter than a chunk or a stage or
    empty, every weight format, hostile page tables and tokens outside every request."""
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.integers(0, T + 1, 2))
    lengths = (int(cuts[0]), int(cuts[1] - cuts[0]), 0, int(T - cuts[1]))
    R = {"neox": D, "interleaved": D, "partial": D // 4 * 2 or 2, "none": None}[rope]
    cache_dtype = {"same": None, "e4m3": E4M3, "e5m2": E5M2}[cache]
    args, kw = make_case(
        seed,
        lengths=lengths,
        K=K,
        Hq=heads[0],
        Hkv=heads[1],
        D=D,
        R=R,
        P=256,
        page_size=page_size,
        layout=layout,
        dtype=dtype,
        cache_dtype=cache_dtype,
        wfmt=wfmt,
        group_size=32,
        zero_points=zero_points,
        is_neox=rope != "interleaved",
        bad_pages=bool(seed % 2),
        extra_tokens=int(seed % 3 == 0),
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(qkv_mod, "MMA_SPLIT", split)
        mp.setattr(qkv_mod, "TILED_SPLIT", split)
        mp.setattr(qkv_mod, "TILED_STAGES", stages)
        mp.setattr(qkv_mod, "TILED_MAX_TILE", (32, 64, 128)[seed % 3])
        mp.setattr(qkv_mod, "TILED_CTAS_PER_SM", (3, 1000)[seed % 2])  # the split cut or not
        mp.setattr(qkv_mod, "TILED_KGROUPS", 1 + seed % 5 % 2)
        fmt = WEIGHT_FORMATS[wfmt]
        path = "tiled" if tiled and qkv_mod.tiled_applies(K, fmt, T, 1) else "mma"
        check_gpu(args, kw, out_given=out_given, monkeypatch=mp, path=path)


@pytest.mark.gpu
@pytest.mark.parametrize("wfmt", ["fp8", "dense"])
@pytest.mark.parametrize("T", [1, 20, 70])
def test_gpu_mma_many_requests(T, wfmt):
    """More requests than the mma kernels stage in shared memory (then they search the offsets in
    global memory), most of them empty, on either side of that limit (dense weights from 20
    tokens: qkv_mma_tiled)."""
    for B in (256, 300):
        lengths = [0] * B
        for i, b in enumerate(np.random.default_rng(B + T).choice(B, T)):
            lengths[b] += 1
        args, kw = make_case(
            50 + T,
            lengths=tuple(lengths),
            K=256,
            Hq=2,
            Hkv=1,
            D=64,
            R=64,
            P=512,
            page_size=16,
            wfmt=wfmt,
            cached=[3] * B,
        )
        with pytest.MonkeyPatch.context() as mp:
            check_gpu(args, kw, monkeypatch=mp, path="tiled" if wfmt == "dense" else "mma")


@pytest.mark.gpu
@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("lengths", [(1,), (1, 2), (2, 0, 2)])
def test_gpu_int4_decodes(fast, lengths, monkeypatch):
    """Both 4-bit decodes of the fused kernel (1 + q/16 floats, and the plain one) with zero
    points, at token tiles 1, 2 and 4."""
    monkeypatch.setattr(qkv_mod, "FAST_INT4", fast)
    args, kw = make_case(
        24,
        lengths=lengths,
        wfmt="int4",
        group_size=64,
        zero_points=True,
        dtype=BF16,
        cache_dtype=E4M3,
        cached=[5] * len(lengths),
        **{**LLAMA, "K": 1024},
    )
    check_gpu(args, kw, monkeypatch=monkeypatch, path="gemv")


@pytest.mark.gpu
@pytest.mark.parametrize("packed, late", [(True, False), (True, True), (False, False)])
@pytest.mark.parametrize("lengths", [(1,), (1, 1), (2, 0, 2)])
@pytest.mark.parametrize("group_size, zero_points", [(128, False), (32, True), (64, True)])
def test_gpu_gemv_packed_int4(packed, late, lengths, group_size, zero_points, monkeypatch):
    """qkv_gemv's packed 4-bit decode (fp16: (q - zero) * scale as fp16 pairs, fp16 sums of each
    load; ``late``: the scale on those sums) and the float32 one, at token tiles 1, 2 and 4 (4:
    two k chunks of the hidden rows), Llama-3-8B's projection."""
    monkeypatch.setattr(qkv_mod, "GEMV_PACKED", packed)
    monkeypatch.setattr(qkv_mod, "GEMV_PACKED_LATE_SCALE", late)
    args, kw = make_case(
        31,
        lengths=lengths,
        wfmt="int4",
        group_size=group_size,
        zero_points=zero_points,
        cached=[9 + 17 * i for i in range(len(lengths))],
        **LLAMA,
    )
    check_gpu(args, kw, monkeypatch=monkeypatch, path="gemv")


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("lengths", [(1,), (1, 1), (2, 0, 2)])
@pytest.mark.parametrize("dtype", [F16, BF16])
def test_gpu_gemv_packed_fp8(packed, lengths, dtype, monkeypatch):
    """qkv_gemv's packed fp8 decode (two codes a conversion, loads refilled as consumed) and the
    plain one, at token tiles 1, 2 and 4, K 8192 (two k chunks at tiles 2 and 4)."""
    monkeypatch.setattr(qkv_mod, "GEMV_PACKED", packed)
    monkeypatch.setattr(qkv_mod, "GEMV_PACKED_FP8", packed)
    args, kw = make_case(
        32,
        lengths=lengths,
        wfmt="fp8",
        dtype=dtype,
        cache_dtype=E4M3,
        cached=[3 + 11 * i for i in range(len(lengths))],
        **{**LLAMA, "K": 8192},
    )
    check_gpu(args, kw, monkeypatch=monkeypatch, path="gemv")


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [(3,), (1, 0, 3), (2, 2)])
@pytest.mark.parametrize("wfmt, dtype", [("int4", F16), ("fp8", F16), ("fp8", BF16)])
def test_gpu_gemv_packed_past_gemv_max_tokens(lengths, wfmt, dtype, monkeypatch):
    """GEMV_PACKED_MAX_TOKENS = 4 (the candidate) with qkv_lean_mma off: 3-4 tokens of 4-bit
    (fp16) and fp8 weights run qkv_gemv's packed decode (token tile 4) instead of qkv_mma, the
    other thresholds as shipped."""
    monkeypatch.setattr(qkv_mod, "GEMV_PACKED_MAX_TOKENS", 4)
    monkeypatch.setattr(qkv_mod, "LEAN_MMA_MAX_TOKENS", 0)
    monkeypatch.setattr(qkv_mod, "GEMV_PACKED_FP8", True)
    names = record_kernels(monkeypatch)
    args, kw = make_case(
        34,
        lengths=lengths,
        wfmt=wfmt,
        dtype=dtype,
        group_size=128,
        zero_points=True,
        cached=[20 + 5 * i for i in range(len(lengths))],
        **LLAMA,
    )
    refs = expected(args, kw)
    originals = [c.copy() for c in args["paged_kv_cache"]]
    d = {n: to_device(a) for n, a in args.items()}
    q = call(d, {n: to_device(a) for n, a in kw.items()})
    check_results(args, kw, q, d["paged_kv_cache"], originals, refs)
    (name,) = names
    assert name.startswith("qkv_gemv<") and name.split(", ")[-2] == "1", name


# qkv_gemv's packed 4-bit decode (P4 in qkv.cu: 4-bit weights, fp16 inputs, token tiles up to
# GEMV_PACKED_MAX_TILE) rounds in fp16 where the reference does not: each weight (q - zero) *
# scale once (the subtraction is exact), then every product-and-add of the two fp16 sums of a
# 32-value load (k = 8c + i and 8c + 4 + i, c and i < 4, in that order; one hfma2 a pair), before
# float32 takes over. That is documented (docs/design/qkv.md), and its error can exceed one fp8
# step: near zero an e4m3 step is 2^-9 .. 2^-6 while the fp16 sums err by up to about 4e-3 at
# Llama-3-8B's projection (int4, groups of 32 with zero points, one token: a k-cache code of
# 0.0508 against the reference's 0.0586, reproduced bit for bit by packed_int4_projection).
# The fp8 codes of that decode are therefore checked against the rounding bound below (first
# order, from the arithmetic), not against one step.
U16 = 2.0**-11  # fp16's unit roundoff
U32 = 2.0**-24


def _load_halves(a):
    """(..., K) in k order -> (..., K / 32, 2, 16): each 32-value load's two fp16 sums' terms in
    the order the kernel adds them (k = 8c + 4h + i: half h, step 4c + i)."""
    s = a.shape[:-1]
    return np.swapaxes(a.reshape(*s, -1, 4, 2, 4), -3, -2).reshape(*s, -1, 2, 16)


def packed_int4_projection(x, weight, scales, group_size, zero_points):
    """The packed 4-bit decode's projection of one fp16 token ``x`` (K,) in NumPy, float32 (N,):
    fp16 weights (q - zero) * scale, each load's two fp16 sums by fused multiply-adds rounded to
    fp16, their float32 sum added to lane (load % 32)'s float32 sum in load order, then the
    warp's butterfly (lane 0's result). One chunk of the hidden row (K <= the kernel's kc)."""
    f16, f64 = np.float16, np.float64
    w = reference.dequantize_weight(weight, scales, group_size, zero_points)
    w = _load_halves(w.astype(f16).astype(f64))  # (q - zero) exact, the product rounded once
    xs = _load_halves(np.asarray(x, f64))
    s = np.zeros(w.shape[:-1], f16)
    for j in range(16):  # one fma each: exact in float64 (22-bit products), rounded to fp16
        s = (w[..., j] * xs[..., j] + s.astype(f64)).astype(f16)
    loads = s[..., 0].astype(np.float32) + s[..., 1].astype(np.float32)  # (N, K / 32)
    nv = loads.shape[1]
    loads = np.pad(loads, ((0, 0), (0, -nv % 32))).reshape(len(loads), -1, 32)
    lanes = np.zeros((len(loads), 32), np.float32)
    for u in range(loads.shape[1]):
        lanes = lanes + loads[:, u]
    idx = np.arange(32)
    for off in (16, 8, 4, 2, 1):
        lanes = lanes + lanes[:, idx ^ off]
    return lanes[:, 0]


def packed_int4_bound(x, w):
    """Bound on |packed decode - exact| for each output row (N,), token ``x`` (K,), float64
    weights ``w`` (N, K) (the reference's): u16 (sum |x w| (the weights' rounding) + sum over
    both halves of every load of its partial sums' |.| (each fma's rounding; recursive
    summation's first-order bound)), 10% on top for the second-order terms (at most 17 u16 of
    them, 1%); float32 from there on: u32 (K / 32 + 8) sum |x w|; fp16 subnormals: 2^-24 per
    product and sum step."""
    terms = w * np.asarray(x, np.float64)
    mag = np.abs(terms).sum(axis=1)
    part = np.abs(np.cumsum(_load_halves(terms), axis=-1)).sum(axis=(-1, -2, -3))
    K = w.shape[1]
    return 1.1 * U16 * (mag + part) + U32 * (K / 32 + 8) * mag + 2.0**-24 * 2 * K


def fp8_interval(args, kw, row_bound):
    """(lo, hi) cache-shaped fp8 code bounds of the k and v caches (NHD): the reference's value
    before rounding, e (float64, divided by the kv scale), widened by the projection's error
    bound ``row_bound`` (T, N) carried through RoPE (a rotated element mixes two rows of its
    head: at most twice the head's largest bound) and the kernel's float32 RoPE and scale
    (2^-20 of the head's largest |value|), then rounded as the kernel rounds: lo =
    fp8(e - b) <= code <= fp8(e + b) = hi (rounding is monotone). Elements nothing writes: 0."""
    k, v = args["paged_kv_cache"]
    f64 = [np.zeros(c.shape, np.float64) for c in (k, v)]
    Hq = kw["num_q_heads"]
    T = args["hidden_state"].shape[0]
    num_pages, page_size, Hkv, D = k.shape
    out = np.empty((T, Hq * D), np.float64)
    run_reference(args, kw, *f64, out, "NHD", (1.0, 1.0))
    _, _, page, entry = reference.ragged_paged_slots(
        args["input_row_offsets"],
        args["cache_lengths"],
        args["block_table"],
        page_size,
        num_pages,
        T,
    )
    mask = written_mask(args, kw)
    result = []
    for i, (c, e) in enumerate(zip((k, v), f64)):
        scale = kw.get("kv_scale", (1.0, 1.0))[i]
        rows = row_bound[:, (Hq + i * Hkv) * D : (Hq + (i + 1) * Hkv) * D].reshape(T, Hkv, D)
        b = np.zeros(e.shape[:3])
        for t in range(T):
            if page[t] >= 0 and mask[page[t], entry[t]]:
                top = np.abs(e[page[t], entry[t]]).max(axis=-1)
                b[page[t], entry[t]] = 2 * rows[t].max(axis=-1) + 2.0**-20 * top
        e, b = e / scale, b[..., None] / scale
        lo, hi = (reference.to_dtype(y, c.dtype).astype(np.float32) for y in (e - b, e + b))
        result.append((lo, hi))
    return result


def packed_fp8_within(args, kw, taken):
    """Where a call on path ``taken`` runs qkv_gemv's packed decode (4-bit weights, fp16 inputs,
    token tiles up to GEMV_PACKED_MAX_TILE: fp16 sums) or the lean kernel's (the same arithmetic)
    into an fp8 cache: fp8_interval's (lo, hi) bounds of each code, NHD whatever the layout, a
    pair a cache. Else None (the codes are read against the reference's, one step apart)."""
    if (
        args["weight"].dtype != np.uint8
        or args["hidden_state"].dtype != F16
        or args["paged_kv_cache"][0].dtype.itemsize != 1
        or taken not in ("gemv", "lean")
    ):
        return None
    if taken == "gemv" and not packed_decode(args, kw):
        return None  # the float32 decode
    if kw.get("kv_layout", "NHD") != "NHD":  # fp8_interval reads NHD caches
        nhd = tuple(np.swapaxes(c, 1, 2) for c in args["paged_kv_cache"])
        args, kw = {**args, "paged_kv_cache": nhd}, {**kw, "kv_layout": "NHD"}
    return fp8_interval(args, kw, packed_int4_row_bound(args, kw))


def packed_int4_row_bound(args, kw):
    """packed_int4_bound of every token: (T, N)."""
    w = reference.dequantize_weight(
        args["weight"], kw["weight_scales"], kw["group_size"], kw.get("zero_points")
    )
    return np.stack([packed_int4_bound(x, w) for x in args["hidden_state"]])


def test_packed_int4_rounding_reproduces_the_gpu_code():
    """The case the reverted lean GEMV test failed on the H200 (seed 36, Llama-3-8B, int4 groups
    of 32 with zero points, fp16, one token, e4m3 cache): the packed decode's arithmetic in
    NumPy gives the k-cache code the GPU wrote (0.05078125, two steps from the reference's
    0.05859375), and every code lies inside fp8_interval's bound; the bound holds for the
    projection itself."""
    args, kw = make_case(
        36,
        lengths=(1,),
        wfmt="int4",
        dtype=F16,
        cache_dtype=E4M3,
        cached=[7],
        group_size=32,
        zero_points=True,
        **LLAMA,
    )
    x = args["hidden_state"][0]
    proj = packed_int4_projection(
        x, args["weight"], kw["weight_scales"], 32, kw["zero_points"]
    ).astype(np.float64)
    w = reference.dequantize_weight(args["weight"], kw["weight_scales"], 32, kw["zero_points"])
    bound = packed_int4_bound(x, w)
    assert np.all(np.abs(proj - w @ x.astype(np.float64)) <= bound)
    # the emulated projection through the reference's RoPE and rounding: a weight column of it
    a2 = {**args, "hidden_state": np.ones((1, 1)), "weight": proj[:, None]}
    kw2 = {n: a for n, a in kw.items() if n not in ("weight_scales", "group_size", "zero_points")}
    _, k_emu, v_emu = expected(a2, kw2)
    _, k_ref, _ = expected(args, kw)
    mask = written_mask(args, kw)
    steps = np.abs(fp8_ordinal(k_emu[mask]) - fp8_ordinal(k_ref[mask]))
    (where,) = np.argwhere(steps > 1)  # the one code the H200 got wrong by the old rule
    assert float(k_emu[mask][tuple(where)]) == 0.05078125
    assert float(k_ref[mask][tuple(where)]) == 0.05859375
    for got, (lo, hi) in zip((k_emu, v_emu), fp8_interval(args, kw, bound[None])):
        g = got[mask].astype(np.float32)
        assert np.all((lo[mask] <= g) & (g <= hi[mask]))


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [(1,), (1, 1), (2,)])
@pytest.mark.parametrize("fp8_cache", [True, False])
@pytest.mark.parametrize(
    "dtype, group_size, zero_points",
    [
        (F16, 32, True),
        (F16, 32, False),
        (F16, 64, True),
        (F16, 128, False),
        (F16, 128, True),
        (BF16, 32, True),
        (BF16, 64, False),
        (BF16, 128, True),
    ],
)
def test_gpu_gemv_int4_groups_and_caches(
    lengths, fp8_cache, dtype, group_size, zero_points, monkeypatch
):
    """qkv_gemv at 1-2 tokens, 4-bit weights, groups of 32 / 64 / 128 with and without zero
    points, fp16 inputs (the packed decode, PACKED 1) and bf16 (the float32 decode), e4m3 or
    16-bit caches, Llama-3-8B's projection. fp16 inputs with an e4m3 cache: the codes inside the
    packed decode's rounding bound (fp8_interval); every other case by check_results' rules."""
    force_path(monkeypatch, "gemv")
    names = record_kernels(monkeypatch)
    qkv_mod._OP.clear()  # a plan of the same key from an earlier test would launch no Launch
    args, kw = make_case(
        36 + group_size + len(lengths) + 2 * zero_points,
        lengths=lengths,
        wfmt="int4",
        dtype=dtype,
        cache_dtype=E4M3 if fp8_cache else None,
        cached=[7 + 13 * i for i in range(len(lengths))],
        group_size=group_size,
        zero_points=zero_points,
        **LLAMA,
    )
    refs = expected(args, kw)
    packed = dtype == F16
    within = None
    if packed and fp8_cache:
        within = fp8_interval(args, kw, packed_int4_row_bound(args, kw))
    originals = [c.copy() for c in args["paged_kv_cache"]]
    d = {n: to_device(a) for n, a in args.items()}
    q = call(d, {n: to_device(a) for n, a in kw.items()})
    check_results(args, kw, q, d["paged_kv_cache"], originals, refs, within)
    (name,) = names
    assert name.startswith("qkv_gemv<") and name.split(", ")[-2] == ("1" if packed else "0"), name


def test_gemv_form_expressions():
    """GEMV_FORM: compiled into the packed 4-bit decode only (fp16 inputs, 16-byte loads, token
    tiles up to GEMV_PACKED_MAX_TILE; every other qkv_gemv: 0), every one of GEMV_FORMS among
    the instantiations, the template's FORM just before PACKED (PACKED and OPTS stay last)."""
    names = set(qkv_mod.instantiations())
    assert qkv_mod.GEMV_FORM in qkv_mod.GEMV_FORMS and 0 in qkv_mod.GEMV_FORMS
    W_DENSE, W_FP8, W_INT4 = qkv_mod.W_DENSE, qkv_mod.W_FP8, qkv_mod.W_INT4
    for form in qkv_mod.GEMV_FORMS:
        for dtype, fmt, tt, packed, opts in itertools.product(
            (F16, BF16), (W_DENSE, W_FP8, W_INT4), (1, 2, 4, 8), (0, 1, 2), (False, True)
        ):
            e = qkv_mod.gemv_expression(dtype, fmt, 16, tt, False, opts, packed, form)
            if packed and (fmt == W_INT4 or tt <= 2):
                assert e in names, e
            fields = e[len("qkv_gemv<") : -1].split(", ")
            p4 = packed and fmt == W_INT4 and dtype == F16 and tt <= qkv_mod.GEMV_PACKED_MAX_TILE
            assert fields[-3] == str(form if p4 else 0), e
            assert fields[-2] == str(packed if p4 else int(bool(packed) and fields[-2] != "0"))
            assert fields[-1] == ("true" if opts else "false"), e
    # None: GEMV_FORM's current value
    assert qkv_mod.gemv_expression(F16, W_INT4, 16, 1, False, False, 1) == (
        qkv_mod.gemv_expression(F16, W_INT4, 16, 1, False, False, 1, qkv_mod.GEMV_FORM)
    )
    assert qkv_mod.gemv_form(W_INT4, 1, 3) == 3 and qkv_mod.gemv_form(W_INT4, 0, 3) == 0
    assert qkv_mod.gemv_form(W_FP8, 1, 3) == 0 and qkv_mod.gemv_form(W_DENSE, 1, 1) == 0


def test_gemv_form_offsets32():
    """GEMV_FORM bit 1 (32-bit scale / zero-point offsets) only where every row's offset plus
    K / group_size stays below 2^31; no zero points (zp_s0 0) and 16-bit weights (group 0) too."""
    ok = qkv_mod._offsets32
    assert ok({"group_size": 128, "ws_s0": 32, "zp_s0": 32}, 6144, 4096)
    assert ok({"group_size": 32, "ws_s0": 128, "zp_s0": 0}, 6144, 4096)
    assert ok({"group_size": 0, "ws_s0": 0, "zp_s0": 0}, 6144, 4096)
    assert not ok({"group_size": 128, "ws_s0": 2**20, "zp_s0": 32}, 4096, 4096)
    assert not ok({"group_size": 128, "ws_s0": 32, "zp_s0": 2**20}, 4096, 4096)
    assert not ok({"group_size": 128, "ws_s0": -32, "zp_s0": 32}, 6144, 4096)
    edge = 2**31 - 1 - 32  # (N - 1) * s0 + K / G == 2^31 - 1: still fits
    assert ok({"group_size": 128, "ws_s0": edge, "zp_s0": 0}, 2, 4096)
    assert not ok({"group_size": 128, "ws_s0": edge + 1, "zp_s0": 0}, 2, 4096)


@pytest.mark.parametrize("ws_s0, want", [(32, 3), (2**20, 1)])
def test_gemv_form_drops_offsets32_where_they_overflow(ws_s0, want, monkeypatch):
    """GEMV_FORM 3 launches form 3 where the 32-bit offsets fit, form 1 where they could not;
    a form outside GEMV_FORMS is refused."""
    from types import SimpleNamespace

    got = []
    monkeypatch.setattr(qkv_mod, "Launch", lambda *a, **k: got.append(a[1]))
    K, N = 4096, 6144
    vx = SimpleNamespace(dtype=F16)
    vw = SimpleNamespace(ptr=1 << 20, strides=(K // 2, 1), dtype=np.dtype(np.uint8))
    fields = {"group_size": 128, "ws_s0": ws_s0, "zp_s0": 32}
    qkv_mod._gemv(fields, {}, vx, vw, qkv_mod.W_INT4, 1, K, N, 0, (False, True, False, 3), False)
    assert got == [qkv_mod.gemv_expression(F16, qkv_mod.W_INT4, 16, 1, False, False, 1, want)]
    assert got[0] in set(qkv_mod.instantiations())
    with pytest.raises(ValueError, match="GEMV_FORM"):
        qkv_mod._gemv(
            fields, {}, vx, vw, qkv_mod.W_INT4, 1, K, N, 0, (False, True, False, 2), False
        )


# GEMV_FORM's GPU check: shapes (make_case keywords) of the packed 4-bit decode
GEMV_FORM_SHAPES = {
    "llama": LLAMA,
    # 12 loads a row: most lanes' loads off; 60 row pairs: the last block's last two warps idle
    "odd": {"K": 384, "Hq": 3, "Hkv": 1, "D": 24, "R": 16, "P": 64, "page_size": 4},
    # 256 loads a row: the loop's second round of loads (and, at 2 tokens, a second k chunk)
    "k8192": {**LLAMA, "K": 8192},
}


def _gemv_form_cases():
    """(form, lengths, shape, fp8_cache, group_size, zero_points, late) of test_gpu_gemv_forms:
    GEMV_FORM's default at 1-2 tokens, groups of 32 / 64 / 128 with and without zero points,
    e4m3 and 16-bit caches on Llama-3-8B's projection and a small odd shape, K 8192; the other
    forms and the late scale (16-bit cache: its rounding is not the bound's) on fewer."""
    top = qkv_mod.GEMV_FORM
    groups = [(32, True), (64, False), (128, True), (128, False)]
    for lengths, fp8, (g, zp) in itertools.product([(1,), (1, 1)], [True, False], groups):
        yield top, lengths, "llama", fp8, g, zp, False
    for lengths, fp8, (g, zp) in itertools.product([(1,), (2,)], [True, False], groups[:3]):
        yield top, lengths, "odd", fp8, g, zp, False
    for lengths, fp8 in itertools.product([(1,), (1, 1)], [True, False]):
        yield top, lengths, "k8192", fp8, 128, True, False
    for lengths in [(1,), (1, 1)]:
        yield top, lengths, "llama", False, 64, True, True
    for form in qkv_mod.GEMV_FORMS:
        if form not in (0, top):
            for lengths, (g, zp) in itertools.product([(1,), (1, 1)], [groups[0], groups[3]]):
                yield form, lengths, "llama", True, g, zp, False


@pytest.mark.gpu
@pytest.mark.parametrize(
    "form, lengths, shape, fp8_cache, group_size, zero_points, late", list(_gemv_form_cases())
)
def test_gpu_gemv_forms(
    form, lengths, shape, fp8_cache, group_size, zero_points, late, monkeypatch
):
    """qkv_gemv's packed 4-bit decode (fp16 inputs) in each GEMV_FORM at 1-2 tokens (token tiles
    1 and 2): the very bytes of form 0 (today's kernel; every form builds the same weight pairs
    and sums them in the same order), then the reference's results (e4m3 caches: inside the
    packed decode's rounding bound, fp8_interval). ``late``: GEMV_PACKED_LATE_SCALE."""
    force_path(monkeypatch, "gemv")
    monkeypatch.setattr(qkv_mod, "GEMV_PACKED_LATE_SCALE", late)
    names = record_kernels(monkeypatch)
    args, kw = make_case(
        90 + group_size + 3 * len(lengths) + 5 * zero_points + form,
        lengths=lengths,
        wfmt="int4",
        dtype=F16,
        cache_dtype=E4M3 if fp8_cache else None,
        cached=[7 + 13 * i for i in range(len(lengths))],
        group_size=group_size,
        zero_points=zero_points,
        **GEMV_FORM_SHAPES[shape],
    )
    refs = expected(args, kw)
    outs = {}
    for f in (0, form):
        monkeypatch.setattr(qkv_mod, "GEMV_FORM", f)
        qkv_mod._OP.clear()  # a plan of the same key from an earlier call would launch no Launch
        d = {n: to_device(a) for n, a in args.items()}
        q = call(d, {n: to_device(a) for n, a in kw.items()})
        outs[f] = (q, d["paged_kv_cache"])
    for old, new in zip((outs[0][0], *outs[0][1]), (outs[form][0], *outs[form][1])):
        np.testing.assert_array_equal(to_numpy(new).view(np.uint8), to_numpy(old).view(np.uint8))
    within = fp8_interval(args, kw, packed_int4_row_bound(args, kw)) if fp8_cache else None
    originals = list(args["paged_kv_cache"])
    q, caches = outs[form]
    check_results(args, kw, q, caches, originals, refs, within)
    fields = [n[len("qkv_gemv<") : -1].split(", ") for n in names]
    assert all(n.startswith("qkv_gemv<") for n in names), names
    assert [f[-3:-1] for f in fields] == [
        ["0", "2" if late else "1"],
        [str(form), "2" if late else "1"],
    ], names


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [(1,), (2, 0, 2)])
@pytest.mark.parametrize("wfmt", ["int4", "fp8"])
def test_gpu_gemv_packed_unaligned_hidden(lengths, wfmt, monkeypatch):
    """The packed decodes with hidden rows that are not 16-byte aligned (the scalar staging of
    the hidden rows; 4-bit: into the fp16 pair order), a K of two chunks at tile 4 with a
    partial last one."""
    import cupy as cp

    force_path(monkeypatch, "gemv")
    monkeypatch.setattr(qkv_mod, "GEMV_PACKED", True)
    monkeypatch.setattr(qkv_mod, "GEMV_PACKED_FP8", True)
    args, kw = make_case(
        33,
        lengths=lengths,
        wfmt=wfmt,
        group_size=64,
        zero_points=True,
        cached=[40] * len(lengths),
        K=3200,
        Hq=4,
        Hkv=2,
        D=128,
        R=64,
        P=256,
        page_size=16,
    )
    q_ref, k_ref, v_ref = expected(args, kw)
    x = args["hidden_state"]
    wide = np.zeros((x.shape[0], x.shape[1] + 3), x.dtype)
    wide[:, 1 : 1 + x.shape[1]] = x
    d = {n: to_device(a) for n, a in args.items()}
    d["hidden_state"] = cp.asarray(wide)[:, 1 : 1 + x.shape[1]]
    originals = [c.copy() for c in args["paged_kv_cache"]]
    q = call(d, {n: to_device(a) for n, a in kw.items()})
    check_results(args, kw, q, d["paged_kv_cache"], originals, (q_ref, k_ref, v_ref))


# qkv_gemv_lean's GPU checks: shapes (make_case keywords). "odd": pairs of a block across a
# head's end (12 pairs a head), 60 pairs (the last block's partly dead), partial RoPE; "k8320":
# three rounds of loads, most lanes of the last one off.
LEAN_SHAPES = {
    "llama": LLAMA,
    "odd": {"K": 384, "Hq": 3, "Hkv": 1, "D": 24, "R": 16, "P": 64, "page_size": 4},
    "k8320": {"K": 8320, "Hq": 4, "Hkv": 2, "D": 64, "R": 64, "P": 256, "page_size": 16},
}


@pytest.mark.gpu
@pytest.mark.parametrize("shape", sorted(LEAN_SHAPES))
@pytest.mark.parametrize("lengths", [(1,), (1, 1), (2, 0, 1), (1, 1, 1, 1)])
@pytest.mark.parametrize(
    "wfmt, dtype, group_size, zero_points",
    [
        ("dense", F16, 0, False),
        ("dense", BF16, 0, False),
        ("fp8", F16, 32, False),
        ("fp8", BF16, 32, False),
        ("int4", F16, 32, True),
        ("int4", F16, 128, False),
        ("int4", F16, 64, True),
    ],
)
@pytest.mark.parametrize("fp8_cache", [False, True])
def test_gpu_gemv_lean(
    shape, lengths, wfmt, dtype, group_size, zero_points, fp8_cache, monkeypatch
):
    """qkv_gemv_lean at token tiles 1, 2 and 4 (1-4 tokens), 16-bit and fp8 weights (fp16 and
    bf16 inputs) and 4-bit weights (fp16 inputs; groups of 32 / 64 / 128, with and without zero
    points), 16-bit and e4m3 caches: the reference's results (4-bit into e4m3: inside the packed
    decode's rounding bound, fp8_interval), every other cache byte unchanged, one qkv_gemv_lean
    launch."""
    force_path(monkeypatch, "lean")
    names = record_kernels(monkeypatch)
    qkv_mod._OP.clear()  # a plan cached by an earlier test of the worker would launch nothing new
    args, kw = make_case(
        300 + len(lengths) + 7 * group_size + 3 * fp8_cache,
        lengths=lengths,
        wfmt=wfmt,
        dtype=dtype,
        cache_dtype=E4M3 if fp8_cache else None,
        cached=[5 + 9 * i for i in range(len(lengths))],
        group_size=group_size,
        zero_points=zero_points,
        **LEAN_SHAPES[shape],
    )
    assert taken_path(args, kw) == "lean"
    refs = expected(args, kw)
    within = None
    if fp8_cache and wfmt == "int4":
        within = fp8_interval(args, kw, packed_int4_row_bound(args, kw))
    originals = [c.copy() for c in args["paged_kv_cache"]]
    d = {n: to_device(a) for n, a in args.items()}
    q = call(d, {n: to_device(a) for n, a in kw.items()})
    check_results(args, kw, q, d["paged_kv_cache"], originals, refs, within)
    T = sum(lengths)
    tt = next(t for t in qkv_mod.LEAN_TILES if t >= T)
    assert names == [
        qkv_mod.lean_expression(
            np.dtype(dtype),
            {"dense": qkv_mod.W_DENSE, "fp8": qkv_mod.W_FP8, "int4": qkv_mod.W_INT4}[wfmt],
            tt,
        )
    ], names


# the head shapes (K, Hq, Hkv, D) of the lean kernels' hypothesis tests: heads of 8-32 row pairs,
# so blocks across heads and partly dead last blocks
LEAN_RANDOM_SHAPES = [(384, 2, 1, 16), (640, 3, 1, 24), (320, 4, 2, 32), (1152, 1, 1, 64)]


def lean_random_case(
    seed, T, max_tokens, wfmt, bf16, shape, rope, cache, layout, page_size, zero_points
):
    """A random small call of ``T`` tokens for the lean kernels' hypothesis tests: ragged over four
    requests (one empty), tokens of no request on a third of the seeds (while ``T`` is below
    ``max_tokens``, the kernel's largest), out-of-range pages on odd seeds, 4-bit groups of 32 or
    64; ``rope`` "neox" / "interleaved" / "partial" (half the head) / "none", ``cache`` "same" /
    "e4m3" / "e5m2"."""
    K, Hq, Hkv, D = shape
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.integers(0, T + 1, 2))
    lengths = (int(cuts[0]), int(cuts[1] - cuts[0]), 0, int(T - cuts[1]))
    R = {"neox": D, "interleaved": D, "partial": D // 2, "none": None}[rope]
    return make_case(
        seed,
        lengths=lengths,
        K=K,
        Hq=Hq,
        Hkv=Hkv,
        D=D,
        R=R,
        P=256,
        page_size=page_size,
        layout=layout,
        dtype=BF16 if bf16 else F16,
        cache_dtype={"same": None, "e4m3": E4M3, "e5m2": E5M2}[cache],
        wfmt=wfmt,
        group_size=32 if seed % 2 else 64,
        zero_points=zero_points,
        is_neox=rope != "interleaved",
        bad_pages=bool(seed % 2),
        extra_tokens=int(seed % 3 == 0 and T < max_tokens),
    )


def run_lean_case(args, kw, refs, unaligned):
    """Run a call on the device (its hidden rows 2 bytes past a 16-byte boundary when
    ``unaligned``: the scalar loads) and check it: ``refs``' results, every other cache byte
    unchanged."""
    import cupy as cp

    originals = [c.copy() for c in args["paged_kv_cache"]]
    d = {n: to_device(a) for n, a in args.items()}
    if unaligned:
        x = args["hidden_state"]
        wide = cp.zeros((x.shape[0], x.shape[1] + 3), x.dtype)
        wide[:, 1 : 1 + x.shape[1]] = cp.asarray(x)
        d["hidden_state"] = wide[:, 1 : 1 + x.shape[1]]
    q = call(d, {n: to_device(a) for n, a in kw.items()})
    check_results(args, kw, q, d["paged_kv_cache"], originals, refs)


@pytest.mark.gpu
@given(
    seed=st.integers(0, 2**32 - 1),
    T=st.integers(1, 4),
    wfmt=st.sampled_from(["dense", "fp8", "int4"]),
    bf16=st.booleans(),
    shape=st.sampled_from(LEAN_RANDOM_SHAPES),
    rope=st.sampled_from(["neox", "interleaved", "partial", "none"]),
    cache=st.sampled_from(["same", "e4m3", "e5m2"]),
    layout=st.sampled_from(["NHD", "HND"]),
    page_size=st.sampled_from([1, 4, 16]),
    zero_points=st.booleans(),
    unaligned=st.booleans(),
    form=st.sampled_from(qkv_mod.GEMV_LEAN_FORMS),
)
def test_gpu_gemv_lean_shapes(
    seed, T, wfmt, bf16, shape, rope, cache, layout, page_size, zero_points, unaligned, form
):
    """qkv_gemv_lean on random small shapes (heads of 8-32 pairs, so blocks across heads and
    partly dead last blocks), RoPE forms, cache dtypes and layouts, ragged batches with empty
    requests, tokens of no request and out-of-range pages, hidden rows not 16-byte aligned (the
    scalar loads): the reference's results, every other cache byte unchanged. 4-bit weights with
    a 16-bit cache only (an 8-bit one has its own bound: test_gpu_gemv_lean); each of
    GEMV_LEAN_FORMS."""
    if wfmt == "int4":
        bf16, cache = False, "same"
    args, kw = lean_random_case(
        seed, T, 4, wfmt, bf16, shape, rope, cache, layout, page_size, zero_points
    )
    with pytest.MonkeyPatch.context() as mp:
        force_path(mp, "lean")
        mp.setattr(qkv_mod, "GEMV_LEAN_FORM", (form,) * 3)
        mp.setattr(qkv_mod, "GEMV_LEAN_WIDE_FORM", (form,) * 3)
        assert taken_path(args, kw) == "lean"
        run_lean_case(args, kw, expected(args, kw), unaligned)


def lean_mma_name(args, T):
    """The qkv_lean_mma instantiation a call of ``T`` tokens of these arrays launches."""
    tt, shape = qkv_mod.lean_mma_shape(T, args["paged_kv_cache"][0].shape[3], weight_format(args))
    return qkv_mod.lean_mma_expression(args["hidden_state"].dtype, weight_format(args), tt, shape)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", sorted(LEAN_SHAPES))
@pytest.mark.parametrize("lengths", [(3,), (1,) * 8, (2, 0, 7), (5, 6, 0, 5)])
@pytest.mark.parametrize(
    "wfmt, dtype, group_size, zero_points",
    [
        ("dense", F16, 0, False),
        ("dense", BF16, 0, False),
        ("fp8", F16, 32, False),
        ("fp8", BF16, 32, False),
        ("int4", F16, 32, True),
        ("int4", F16, 128, False),
        ("int4", BF16, 64, True),
    ],
)
@pytest.mark.parametrize("fp8_cache", [False, True])
def test_gpu_lean_mma(shape, lengths, wfmt, dtype, group_size, zero_points, fp8_cache, monkeypatch):
    """qkv_lean_mma at token tiles 8 and 16 (3-16 tokens, ragged, an empty request), 16-bit, fp8
    and 4-bit weights (fp16 and bf16 inputs; groups of 32 / 64 / 128, with and without zero
    points), 16-bit and e4m3 caches, blocks across heads and a partly dead last block ("odd"),
    three rounds of loads with most lanes of the last off ("k8320"): the reference's results
    (4-bit: on the weights rounded to the input dtype, as the other tensor-core kernels), every
    other cache byte unchanged, one qkv_lean_mma launch."""
    names = record_kernels(monkeypatch)
    qkv_mod._OP.clear()  # a plan cached by an earlier test of the worker would launch nothing new
    args, kw = make_case(
        400 + sum(lengths) + 7 * group_size + 3 * fp8_cache,
        lengths=lengths,
        wfmt=wfmt,
        dtype=dtype,
        cache_dtype=E4M3 if fp8_cache else None,
        cached=[5 + 9 * i for i in range(len(lengths))],
        group_size=group_size,
        zero_points=zero_points,
        **LEAN_SHAPES[shape],
    )
    check_gpu(args, kw, monkeypatch=monkeypatch, path="lean_mma")
    assert names == [lean_mma_name(args, sum(lengths))], names


@pytest.mark.gpu
@given(
    seed=st.integers(0, 2**32 - 1),
    T=st.integers(1, 16),
    wfmt=st.sampled_from(["dense", "fp8", "int4"]),
    bf16=st.booleans(),
    shape=st.sampled_from(LEAN_RANDOM_SHAPES),
    rope=st.sampled_from(["neox", "interleaved", "partial", "none"]),
    cache=st.sampled_from(["same", "e4m3", "e5m2"]),
    layout=st.sampled_from(["NHD", "HND"]),
    page_size=st.sampled_from([1, 4, 16]),
    zero_points=st.booleans(),
    unaligned=st.booleans(),
    block=st.sampled_from(qkv_mod.LEAN_MMA_SHAPES),
)
def test_gpu_lean_mma_shapes(
    seed, T, wfmt, bf16, shape, rope, cache, layout, page_size, zero_points, unaligned, block
):
    """qkv_lean_mma on random small shapes (heads of 8-32 pairs, so blocks across heads and
    partly dead last blocks), 1-16 tokens, RoPE forms, cache dtypes and layouts, ragged batches
    with empty requests, tokens of no request and out-of-range pages, hidden rows not 16-byte
    aligned (the scalar loads): the reference's results (4-bit: on the weights rounded to the
    input dtype), every other cache byte unchanged, one qkv_lean_mma launch; each compiled block
    shape (LEAN_MMA_SHAPES) whose row pairs a head holds."""
    if shape[3] // 2 < 8 * block[1]:
        block = qkv_mod.LEAN_MMA_SHAPES[0]
    args, kw = lean_random_case(
        seed, T, 16, wfmt, bf16, shape, rope, cache, layout, page_size, zero_points
    )
    with pytest.MonkeyPatch.context() as mp:
        force_path(mp, "lean_mma")
        mp.setattr(qkv_mod, "LEAN_MMA_SHAPE", (block,) * 3)  # both tiles, every format
        mp.setattr(qkv_mod, "LEAN_MMA_WIDE_SHAPE", (block,) * 3)
        names = record_kernels(mp)
        qkv_mod._OP.clear()
        assert taken_path(args, kw) == "lean_mma"
        refs = expected(*rounded_weights(args, kw)) if wfmt == "int4" else expected(args, kw)
        run_lean_case(args, kw, refs, unaligned)
        assert names == [lean_mma_name(args, args["hidden_state"].shape[0])], names


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["lean", "lean_mma", "gemv", "mma", "wgmma", "cublas"])
@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize("T", [1, 2])
def test_gpu_infinite_weight(path, dtype, T, monkeypatch):
    """An infinite 16-bit weight in the last k values of a V row (K 384: the lean kernel's lanes
    past the row's end) gives that V value +-Inf, as the reference does (Inf times the hidden
    value), not NaN; every other written value is finite and the reference's. The lean kernel's
    off lanes once multiplied the row's last weights by zero hidden values: Inf * 0 = NaN."""
    import cupy as cp

    if path == "wgmma" and int(cp.cuda.Device().compute_capability) != qkv_mod.WGMMA_CAPABILITY:
        pytest.skip("qkv_wgmma runs on sm_90 alone")
    K, Hq, D = 384, 2, 32
    args, kw = make_case(31 + T, lengths=(T,), K=K, Hq=Hq, Hkv=1, D=D, R=D, dtype=dtype)
    x = args["hidden_state"]
    x[:, K - 1] = np.where(np.arange(T) % 2, -1.5, 0.75).astype(x.dtype)  # signs differ
    col = 5
    args["weight"][(Hq + 1) * D + col, K - 1] = np.inf  # V head 0, value 5
    force_path(monkeypatch, path)
    assert taken_path(args, kw) == path
    q_ref, k_ref, v_ref = expected(args, kw)
    originals = [c.copy() for c in args["paged_kv_cache"]]
    d = {n: to_device(a) for n, a in args.items()}
    q = call(d, {n: to_device(a) for n, a in kw.items()})
    mask = written_mask(args, kw)
    got_v = to_numpy(d["paged_kv_cache"][1])
    assert np.isinf(v_ref[mask][:, 0, col]).all()  # the reference: +-Inf, the case works
    np.testing.assert_array_equal(got_v[mask][:, 0, col], v_ref[mask][:, 0, col])
    pages, entries = np.nonzero(mask)
    finite, got_finite = v_ref.copy(), got_v.copy()
    finite[pages, entries, 0, col] = 0  # the rest as check_results reads it
    got_finite[pages, entries, 0, col] = 0
    assert np.isfinite(got_finite[mask].astype(np.float32)).all()
    caches = (d["paged_kv_cache"][0], got_finite)
    check_results(args, kw, q, caches, originals, (q_ref, k_ref, finite))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize("cache", ["same", "e4m3"])
def test_gpu_k_8192(dtype, cache):
    args, kw = make_case(
        21,
        lengths=(2, 1),
        K=8192,
        Hq=8,
        Hkv=2,
        D=128,
        R=64,
        P=512,
        page_size=16,
        dtype=dtype,
        cache_dtype=E4M3 if cache == "e4m3" else None,
    )
    check_gpu(args, kw)


@pytest.mark.gpu
@given(
    seed=st.integers(0, 2**32 - 1),
    K=st.sampled_from([96, 320]),
    T=st.sampled_from([1, 7, 129]),
    dtype=st.sampled_from([F16, BF16]),
    cache=st.sampled_from(["same", "e4m3", "e5m2"]),
    layout=st.sampled_from(["NHD", "HND"]),
    rope=st.sampled_from(["neox", "interleaved", "partial", "none"]),
    wfmt=st.sampled_from(["dense", "fp8", "int4"]),
    zero_points=st.booleans(),
    path=st.sampled_from([None, "gemv", "cublas"]),
    page_size=st.sampled_from([1, 4, 16]),
    out_given=st.booleans(),
)
def test_gpu_small_shapes(
    seed, K, T, dtype, cache, layout, rope, wfmt, zero_points, path, page_size, out_given
):
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.integers(0, T + 1, 2))
    lengths = (int(cuts[0]), int(cuts[1] - cuts[0]), 0, int(T - cuts[1]))
    R = {"neox": 32, "interleaved": 32, "partial": 8, "none": None}[rope]
    cache_dtype = {"same": None, "e4m3": E4M3, "e5m2": E5M2}[cache]
    args, kw = make_case(
        seed,
        lengths=lengths,
        K=K,
        Hq=4,
        Hkv=2,
        D=32,
        R=R,
        P=256,
        page_size=page_size,
        layout=layout,
        dtype=dtype,
        cache_dtype=cache_dtype,
        wfmt=wfmt,
        group_size=32,
        zero_points=zero_points,
        is_neox=rope != "interleaved",
        bad_pages=bool(seed % 2),
        extra_tokens=int(seed % 3 == 0),
    )
    with pytest.MonkeyPatch.context() as mp:
        check_gpu(args, kw, out_given=out_given, monkeypatch=mp, path=path)


@pytest.mark.gpu
def test_gpu_strided_hidden_and_caches_sliced_from_one_buffer():
    import cupy as cp

    args, kw = make_case(22, lengths=(3, 30), K=384, Hq=4, Hkv=2, D=32, R=32, P=256)
    q_ref, k_ref, v_ref = expected(args, kw)
    x = args["hidden_state"]
    wide = np.zeros((x.shape[0], x.shape[1] + 64), x.dtype)
    wide[:, 8 : 8 + x.shape[1]] = x
    k, v = args["paged_kv_cache"]
    both = cp.asarray(np.stack([k, v], axis=1))  # (pages, 2, ps, Hkv, D): one buffer
    for path in ("mma", "tiled", "gemv", "cublas"):
        with pytest.MonkeyPatch.context() as mp:
            force_path(mp, path)
            dwide = cp.asarray(wide)
            d = {n: to_device(a) for n, a in args.items()}
            d["hidden_state"] = dwide[:, 8 : 8 + x.shape[1]]
            fresh = both.copy()
            d["paged_kv_cache"] = (fresh[:, 0], fresh[:, 1])
            out_buf = cp.zeros((x.shape[0], 4 * 32 + 24), x.dtype)
            out = out_buf[:, 16 : 16 + 4 * 32]  # a strided view, written in place
            q = call(d, {n: to_device(a) for n, a in kw.items()}, out=out)
            assert q is out
            assert rel_rows(q, q_ref, 32) <= 1e-2
            assert not out_buf[:, :16].any() and not out_buf[:, 16 + 128 :].any()
            mask = written_mask(args, kw)
            assert rel_rows(to_numpy(fresh[:, 0])[mask], k_ref[mask], 32) <= 1e-2
            assert rel_rows(to_numpy(fresh[:, 1])[mask], v_ref[mask], 32) <= 1e-2


@pytest.mark.gpu
def test_gpu_rejects_mixed_devices():
    args, kw = make_case(23)
    args["hidden_state"] = to_device(args["hidden_state"])
    with pytest.raises(ValueError, match="one device"):
        call(args, kw)


@pytest.mark.gpu
@pytest.mark.parametrize("out_given", [False, True])
@pytest.mark.parametrize("wfmt", ["dense", "int4"])
def test_gpu_repeated_decode_replays_the_launch_plan(out_given, wfmt):
    """A decode step repeated with new arrays of one layout replays the cached launch of the fused
    kernel: new pointers, new outputs, results still those of the reference."""
    for seed in (40, 41, 42):
        args, kw = make_case(
            seed, lengths=(1,), wfmt=wfmt, group_size=128, cached=[77], **{**LLAMA, "K": 1024}
        )
        check_gpu(args, kw, out_given=out_given)


def test_wgmma_stages_fit_the_shared_memory_of_their_ctas():
    """Deep tiles (one CTA an SM) take as many stages as fit, 3 at least; the others as many as
    leave room for a second CTA, 2 at least; a request below the floor is raised to it."""
    stages = qkv_mod._wgmma_stages
    assert [stages(tn, 8, 1, True) for tn in (32, 64, 96, 128, 192, 256)] == [8, 8, 7, 6, 5, 4]
    assert [stages(tn, 4, 1, False) for tn in (32, 64, 96, 128)] == [4, 4, 3, 3]
    assert stages(64, 2, 1, True) == 3 and stages(64, 1, 1, False) == 2
    assert [stages(tn, 8, 1, True, True) for tn in (32, 64, 96, 128)] == [8, 8, 8, 7]  # fp8
    assert [stages(tn, 8, 2, True, True) for tn in (64, 96, 128)] == [4, 3, 3]  # 128 codes
    assert [stages(tn, 8, 2, True, qkv_mod.W_INT4) for tn in (32, 64, 96, 128)] == [
        8,
        6,
        4,
        3,
    ]  # 4-bit
    assert [stages(tn, 8, 1, True, qkv_mod.W_INT4) for tn in (32, 64, 96, 128)] == [8, 8, 8, 8]
    for tn, deep, wq in qkv_mod._wgmma_tiles():  # as the shipped settings configure them
        _, _, smem = qkv_mod._wgmma_config(tn, deep, wq, qkv_mod.wgmma_settings())
        assert qkv_mod._wgmma_per_sm(smem, deep, tn) == (1 if deep else 2)


def test_wgmma_split_keeps_its_clusters_in_one_wave():
    """qkv_wgmma's split: the largest whose grid fits the SMs' wave and whose clusters the device
    runs at once (the H200 at one CTA an SM: 66 of 2, 30 of 4, 15 of 8), else the next smaller;
    no limit where the driver cannot say."""
    h200 = {1: 132, 2: 66, 4: 30, 8: 15}.get
    split = qkv_mod.fitting_split
    assert [split(t, 8, 132, h200) for t in (10, 15, 16, 20, 30, 32, 33, 48, 66, 67)] == [
        8,
        8,
        4,
        4,
        4,
        2,
        2,
        2,
        2,
        1,
    ]
    assert [split(t, 8, 132) for t in (16, 32, 33, 34)] == [8, 4, 4, 2]  # the SMs alone
    assert split(32, 8, 132, lambda s: None) == 4
    assert split(32, 2, 132, h200) == 2  # never above the setting
    assert qkv_mod.WGMMA_CLUSTER_FIT and qkv_mod.wgmma_settings().cluster_fit


def test_int4_groups_of_whole_atoms_take_the_register_form():
    """4-bit weights whose groups hold whole atoms (multiples of 64) take W_INT4_REG, whose stages
    need no 16-bit buffers; groups of 32, or WGMMA_INT4_REG off, take W_INT4; both forms of every
    shipped tile are instantiated, fp8's (W_FP8, W_FP8_REG) too."""
    settings = qkv_mod.wgmma_settings()
    W4, REG = qkv_mod.W_INT4, qkv_mod.W_INT4_REG
    assert [qkv_mod.int4_form(g, settings) for g in (32, 64, 96, 128, 4096)] == [
        W4,
        REG,
        W4,
        REG,
        REG,
    ]
    assert qkv_mod.int4_form(128, settings._replace(int4_reg=False)) == W4
    names = set(qkv_mod.instantiations())
    for tn in (32, 64, 96, 128, 192, 256):
        atoms, stages, smem = qkv_mod._wgmma_config(tn, True, REG, settings)
        assert smem == max(stages * atoms * (128 * 32 + tn * 128), tn * 132 * 4) + 1024
        for wq in (W4, REG):
            a, st, _ = qkv_mod._wgmma_config(tn, True, wq, settings)
            assert qkv_mod.wgmma_expression(F16, tn, 2, st, a, False, True, wq) in names
    for tn in (32, 64, 96, 128):  # fp8's tiles (17 to 128 tokens)
        atoms, stages, smem = qkv_mod._wgmma_config(tn, True, qkv_mod.W_FP8_REG, settings)
        assert smem == max(stages * atoms * (128 * 64 + tn * 128), tn * 132 * 4) + 1024
        for wq in (qkv_mod.W_FP8, qkv_mod.W_FP8_REG):
            a, st, _ = qkv_mod._wgmma_config(tn, True, wq, settings)
            assert qkv_mod.wgmma_expression(F16, tn, 2, st, a, False, True, wq) in names


def test_fp8_weights_take_the_wgmma_kernel_in_its_range():
    """fp8 weights take qkv_wgmma (deep) from WGMMA_FP8_MIN_TOKENS (17: qkv_lean_mma keeps 1-16)
    to WGMMA_FP8_TOP tokens with K in whole stages of WGMMA_FP8_ATOMS atoms; the tiles of that
    range are instantiated in both forms (codes in the A registers, and the shared-memory one)."""
    W, takes = WEIGHT_FORMATS, qkv_mod.wgmma_takes
    settings = qkv_mod.wgmma_settings()
    lo, top = qkv_mod.WGMMA_FP8_MIN_TOKENS, qkv_mod.WGMMA_FP8_TOP
    assert lo == qkv_mod.LEAN_MMA_MAX_TOKENS + 1
    assert [takes(W["fp8"], T, 4096, 128, settings) for T in (lo - 1, lo, 32, 48, top)] == [
        False,
        True,
        True,
        True,
        True,
    ]
    assert not takes(W["fp8"], top + 1, 4096, 128, settings)
    assert not takes(W["fp8"], 32, 4096 + 64, 128, settings)  # K not whole stages of 128
    assert not takes(W["fp8"], 32, 4096, 128, settings._replace(fp8_min_tokens=48))
    tiles = {(tn, deep) for tn, deep, wq in qkv_mod._wgmma_tiles() if wq == W["fp8"]}
    assert tiles == {(32, True), (64, True), (96, True), (128, True)}
    assert {(32, True, W["fp8"]), (32, True, qkv_mod.W_FP8_REG)} <= set(qkv_mod._wgmma_tiles())


def test_int4_weights_take_the_wgmma_kernel_in_its_range(monkeypatch):
    """4-bit weights take qkv_wgmma (deep) from WGMMA_INT4_MIN_TOKENS to WGMMA_INT4_TOP tokens
    with K in whole stages of WGMMA_INT4_ATOMS atoms; 1 << 30 gives every count back to the
    tensor-core kernels; the shipped instantiations hold its tiles; stages of 32-byte rows."""
    W, takes = WEIGHT_FORMATS, qkv_mod.wgmma_takes
    settings = qkv_mod.wgmma_settings()
    lo = qkv_mod.WGMMA_INT4_MIN_TOKENS
    top = min(qkv_mod.WGMMA_INT4_TOP, qkv_mod.WGMMA_DEEP_MAX_TOKENS)
    assert [takes(W["int4"], T, 4096, 128, settings) for T in (lo - 1, lo, 64, top, top + 1)] == [
        False,
        True,
        True,
        True,
        False,
    ]
    two = settings._replace(int4_atoms=2)  # K in stages of 128 values
    assert takes(W["int4"], 64, 4096 + 128, 128, two)
    assert not takes(W["int4"], 64, 4096 + 64, 128, two)
    assert not takes(W["int4"], 64, 4096, 256, settings)  # heads wider than the row tile
    assert not takes(W["int4"], 64, 4096, 128, settings._replace(int4_min_tokens=1 << 30))
    assert takes(W["int4"], 1, 4096, 128, settings._replace(int4_min_tokens=1))
    tiles = {(tn, deep) for tn, deep, wq in qkv_mod._wgmma_tiles() if wq == W["int4"]}
    assert tiles == {(32, True), (64, True), (96, True), (128, True), (192, True), (256, True)}
    names = set(qkv_mod.instantiations())
    for tn in (32, 64, 96, 128, 192, 256):
        atoms, stages, smem = qkv_mod._wgmma_config(tn, True, W["int4"], settings)
        assert (
            smem
            == max(stages * atoms * (128 * 32 + tn * 128) + 2 * atoms * 128 * 128, tn * 132 * 4)
            + 1024
        )
        expr = qkv_mod.wgmma_expression(F16, tn, 2, stages, atoms, False, True, W["int4"])
        assert expr.endswith(", 2>") and expr in names
    # stages of one atom where two would leave fewer than int4_min_stages (128 tokens: 3)
    config = qkv_mod._wgmma_config
    rule = settings._replace(int4_atoms=2, int4_min_stages=4)
    assert [config(tn, True, W["int4"], rule)[:2] for tn in (32, 64, 96, 128, 192, 256)] == [
        (2, 8),
        (2, 6),
        (2, 4),
        (1, 8),
        (1, 6),
        (1, 5),
    ]
    assert config(128, True, W["int4"], rule._replace(int4_min_stages=1))[:2] == (2, 3)
    fp8 = settings._replace(fp8_atoms=2, fp8_min_stages=4)  # fp8: the same rule
    assert [config(tn, True, W["fp8"], fp8)[:2] for tn in (64, 96, 128)] == [(2, 4), (1, 8), (1, 7)]
    assert config(128, True, W["fp8"], fp8._replace(fp8_min_stages=1))[:2] == (2, 3)
    monkeypatch.setattr(qkv_mod, "WGMMA_INT4_MIN_TOKENS", 1 << 30)
    assert not any(wq == W["int4"] for _, _, wq in qkv_mod._wgmma_tiles())


def test_the_call_passes_the_settings_functions_values(monkeypatch):
    """The op spells its TILED_* and WGMMA_* flags out (they are built on every call): they are
    what tiled_settings() and wgmma_settings() say, after any setting changes."""
    seen = []
    monkeypatch.setattr(qkv_mod, "_OP", lambda arrays, flags, *rest: seen.append(flags))
    monkeypatch.setattr(qkv_mod, "WGMMA_FP8_ATOMS", 4)
    monkeypatch.setattr(qkv_mod, "TILED_KGROUPS", 2)
    args, kw = make_case(1)
    call(args, kw)
    (flags,) = seen
    assert qkv_mod.tiled_settings() in flags and qkv_mod.wgmma_settings() in flags
    assert flags.index(qkv_mod.tiled_settings()) + 1 == flags.index(qkv_mod.wgmma_settings())


def test_mma_form_expressions():
    """MMA_FORM: the compiled form of each weight format (4-bit weights: MMA_FORM; others: 0),
    every one of MMA_FORMS among the instantiations, others refused."""
    names = set(qkv_mod.instantiations())
    assert qkv_mod.MMA_FORM in qkv_mod.MMA_FORMS and 0 in qkv_mod.MMA_FORMS
    for form in qkv_mod.MMA_FORMS:
        for fmt in WEIGHT_FORMATS.values():
            e = qkv_mod.mma_expression(F16, fmt, 16, qkv_mod.MMA_SPLIT, False, form)
            assert e in names
            assert e.endswith(f", {qkv_mod.mma_form(fmt, form)}>"), e
    assert qkv_mod.mma_form(qkv_mod.W_DENSE, 5) == 0 and qkv_mod.mma_form(qkv_mod.W_FP8, 5) == 0
    assert qkv_mod.mma_form(qkv_mod.W_INT4, 5) == 5 and qkv_mod.mma_form(qkv_mod.W_INT4, 13) == 13


@pytest.mark.parametrize("ws_s0, want", [(32, 13), (2**20, 5)])
def test_mma_form_drops_offsets32_where_they_overflow(ws_s0, want, monkeypatch):
    """MMA_FORM 13 launches form 13 where the rows' 32-bit scale / zero-point offsets fit, form 5
    where they could not (the rule of GEMV_FORM bit 1: _offsets32) and at token tiles past
    MMA_OFFSETS32_MAX_TILE; a form outside MMA_FORMS is refused."""
    from types import SimpleNamespace

    got = []
    monkeypatch.setattr(qkv_mod, "Launch", lambda *a, **k: got.append(a[1]))
    monkeypatch.setattr(qkv_mod, "_compute_capability", lambda device: 90)
    K, N, D = 4096, 6144, 128
    vx = SimpleNamespace(dtype=F16, ptr=1 << 20, strides=(K,))
    vw = SimpleNamespace(ptr=1 << 20, strides=(K // 2, 1), dtype=np.dtype(np.uint8))
    fields = {"group_size": 128, "ws_s0": ws_s0, "zp_s0": 32}
    tiled = qkv_mod.tiled_settings()
    split = qkv_mod.MMA_SPLIT
    tile = qkv_mod.MMA_OFFSETS32_MAX_TILE
    for T in (tile, tile + 1):
        qkv_mod._mma(
            fields,
            {},
            vx,
            vw,
            qkv_mod.W_INT4,
            T,
            K,
            N,
            D,
            0,
            False,
            split,
            tiled,
            False,
            (13, tile),
        )
    above = qkv_mod.MMA_TILES[qkv_mod.MMA_TILES.index(tile) + 1]
    assert got == [
        qkv_mod.mma_expression(F16, qkv_mod.W_INT4, tile, split, False, want),
        qkv_mod.mma_expression(F16, qkv_mod.W_INT4, above, split, False, 5),
    ]
    assert set(got) <= set(qkv_mod.instantiations())
    with pytest.raises(ValueError, match="MMA_FORM"):
        qkv_mod._mma(
            fields, {}, vx, vw, qkv_mod.W_INT4, 16, K, N, D, 0, False, split, tiled, False, (9, 8)
        )


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [(3,), (1, 0, 3), (2, 2, 1, 3), (16,), (5, 0, 4, 4, 3)])
@pytest.mark.parametrize("form", [f for f in qkv_mod.MMA_FORMS if f])
@pytest.mark.parametrize(
    "wfmt, dtype, group_size, zero_points",
    [
        ("int4", F16, 128, True),
        ("int4", F16, 32, False),
        ("int4", BF16, 64, True),
        ("fp8", F16, 0, False),
        ("fp8", BF16, 0, False),
    ],
)
def test_gpu_mma_forms(lengths, form, wfmt, dtype, group_size, zero_points, monkeypatch):
    """qkv_mma's forms (MMA_FORM) at 3-16 tokens (token tiles 8 and 16), Llama-3-8B's projection:
    the reference's results, and the very bytes of form 0 (today's kernel): every form builds the
    same weight pairs and sums them in the same order. Form 13 at every token tile here (its
    default stops at MMA_OFFSETS32_MAX_TILE)."""
    force_path(monkeypatch, "mma")
    monkeypatch.setattr(qkv_mod, "MMA_OFFSETS32_MAX_TILE", max(qkv_mod.MMA_TILES))
    names = record_kernels(monkeypatch)
    extra = {"group_size": group_size, "zero_points": zero_points} if wfmt == "int4" else {}
    args, kw = make_case(
        60 + sum(lengths) + form,
        lengths=lengths,
        wfmt=wfmt,
        dtype=dtype,
        cached=[9 + 17 * i for i in range(len(lengths))],
        **extra,
        **LLAMA,
    )
    refs = expected(args, kw)
    results = {}
    for f in (0, form):
        monkeypatch.setattr(qkv_mod, "MMA_FORM", f)
        qkv_mod._OP.clear()  # a plan of the same key from an earlier call would launch no Launch
        originals = [c.copy() for c in args["paged_kv_cache"]]
        d = {n: to_device(a) for n, a in args.items()}
        q = call(d, {n: to_device(a) for n, a in kw.items()})
        check_results(args, kw, q, d["paged_kv_cache"], originals, refs)
        results[f] = [to_numpy(x) for x in (q, *d["paged_kv_cache"])]
    for old, new in zip(results[0], results[form]):
        np.testing.assert_array_equal(new.view(np.uint8), old.view(np.uint8))
    fmt = WEIGHT_FORMATS[wfmt]
    assert [n.split(", ")[-1] for n in names] == [
        "0>",
        f"{qkv_mod.mma_form(fmt, form)}>",
    ], names
    assert all(n.startswith("qkv_mma<") for n in names), names
