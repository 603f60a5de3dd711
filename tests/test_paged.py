"""``rope_quantize_fp8_append_paged_kv_cache`` / ``rope_append_paged_kv_cache``: the reference
(CPU), every validation rule (CPU), and the CUDA kernel against the reference and FlashInfer
(GPU)."""

from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import ropekv
from ropekv import reference
from tests.strategies import random, seeds
from tests.tolerance import assert_bytes_equal, assert_close, to_device, to_numpy

F16 = np.dtype(np.float16)
BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E5M2 = np.dtype(ml_dtypes.float8_e5m2)
FP8 = (E4M3, E5M2)
I8 = np.dtype(np.int8)
F32 = np.dtype(np.float32)
INDEX_NAMES = ("pos_ids", "batch_indices", "positions", "kv_indptr", "kv_indices")
OPS = {
    True: ropekv.rope_quantize_fp8_append_paged_kv_cache,
    False: ropekv.rope_append_paged_kv_cache,
}


def random_bytes(rng, shape, dtype):
    dtype = np.dtype(dtype)
    raw = rng.integers(0, 256, (*shape[:-1], shape[-1] * dtype.itemsize), np.uint8)
    return raw.view(dtype)


def make_case(
    seed,
    *,
    T=7,
    Hq=4,
    Hkv=2,
    R=16,
    Dn=0,
    mla=False,
    dtype=F16,
    cache_dtype=E4M3,
    page_size=4,
    kv_layout="NHD",
    B=None,
    index_dtypes=np.int32,
    padding=0,
    packed=False,
    per_head=False,
    extra_pages=3,
    lens=None,
):
    """NumPy arguments of one call: a ragged batch of B requests (each with a random cached
    prefix) over randomly permuted pages, ``lens`` tokens each (random by default). Caches start
    as random bytes, to catch stray writes."""
    rng = np.random.default_rng(seed)
    dtype, cache_dtype = np.dtype(dtype), np.dtype(cache_dtype)
    B = B or int(rng.integers(1, 5))
    cuts = np.sort(rng.integers(0, T + 1, B - 1))
    if lens is None:  # else each request's tokens (summing to T): decode's are ones
        lens = np.diff(np.concatenate([[0], cuts, [T]]))
    lens = np.asarray(lens, np.int64)
    prefix = rng.integers(0, 3 * page_size + 1, B)
    batch = np.repeat(np.arange(B), lens)
    positions = np.concatenate(
        [prefix[b] + np.arange(lens[b]) for b in range(B)] + [np.zeros(0, np.int64)]
    ).astype(np.int64)
    pages = -(-(prefix + lens) // page_size)
    num_pages = int(pages.sum()) + extra_pages
    kv_indices = rng.permutation(num_pages)[: pages.sum()]
    kv_indptr = np.concatenate([[0], np.cumsum(pages)])
    if padding:
        batch[rng.choice(T, min(padding, T), replace=False)] = -1
    P = int(positions.max(initial=0)) + 1 + int(rng.integers(0, 5))
    D = R + Dn
    if mla:
        q = random(rng, (T, Hq, Dn + R), dtype)
        kv = random(rng, (T, Dn + R), dtype)
        q_nope, q_rope = q[..., :Dn], q[..., Dn:]
        k_nope, k_rope = kv[:, :Dn], kv[:, Dn:]
        v = None
        cache = tuple(random_bytes(rng, (num_pages, page_size, d), cache_dtype) for d in (Dn, R))
    else:
        if packed:
            buf = random(rng, (T, Hq + 2 * Hkv, D), dtype)
            q, k, v = buf[:, :Hq], buf[:, Hq : Hq + Hkv], buf[:, Hq + Hkv :]
        else:
            q, k, v = (random(rng, (T, h, D), dtype) for h in (Hq, Hkv, Hkv))
        q_rope, q_nope, k_rope, k_nope = q[..., :R], q[..., R:], k[..., :R], k[..., R:]
        shape = (
            (num_pages, page_size, Hkv, D) if kv_layout == "NHD" else (num_pages, Hkv, page_size, D)
        )
        cache = tuple(random_bytes(rng, shape, cache_dtype) for _ in range(2))
    if not Dn:
        q_nope = k_nope = None
    idx = index_dtypes if isinstance(index_dtypes, tuple | list) else (index_dtypes,) * 5
    values = (positions, batch, positions, kv_indptr, kv_indices)
    args = dict(
        q_rope=q_rope,
        k_rope=k_rope,
        q_nope=q_nope,
        k_nope=k_nope,
        v=v,
        cos_sin_cache=ropekv.cos_sin_cache(P, R, base=rng.uniform(100, 1e6)),
        paged_kv_cache=cache,
        page_size=page_size,
        kv_layout=kv_layout,
        **{n: np.ascontiguousarray(x).astype(t) for n, x, t in zip(INDEX_NAMES, values, idx)},
    )
    if per_head:
        args["quant_scale_q"] = rng.uniform(0.25, 4, Hq).astype(np.float32)
        args["quant_scale_kv"] = rng.uniform(0.25, 4, Hkv if not mla else 1).astype(np.float32)
    else:
        args["quant_scale_q"], args["quant_scale_kv"] = (
            float(rng.uniform(0.25, 4)) for _ in range(2)
        )
    return args


def copy_args(args):
    out = {}
    for n, x in args.items():
        if isinstance(x, tuple):  # paged_kv_cache, kv_cache_scales
            out[n] = tuple(c.copy() for c in x)
        elif isinstance(x, np.ndarray):
            out[n] = x.copy()
        else:
            out[n] = x
    return out


def call(args, quantize=True, **kw):
    return OPS[quantize](**args, **kw)


def naive(args, is_neox=True):
    """An independent per-token, per-head loop with complex-number rotation: the expected q
    outputs and caches (float64 before rounding to the cache dtype)."""
    a = copy_args(args)
    cache0, cache1 = a["paged_kv_cache"]
    out = cache0.dtype
    fp8 = out in FP8
    q_rope, k_rope = a["q_rope"], a["k_rope"]
    T, Hq, R = q_rope.shape
    mla = k_rope.ndim == 2
    Dn = 0 if a["q_nope"] is None else a["q_nope"].shape[-1]
    qro = np.zeros((T, Hq, R), out)
    qno = np.zeros((T, Hq, Dn), out)
    table = a["cos_sin_cache"].astype(np.float64)
    P = table.shape[0]
    ps = a["page_size"]
    B = a["kv_indptr"].shape[0] - 1

    def scale(s, h):
        s = np.asarray(s, np.float64).reshape(-1)
        return float(s[h if s.size > 1 else 0]) if fp8 else 1.0

    def rot(x, p):
        x = x.astype(np.float64)
        e = table[p, : R // 2] + 1j * table[p, R // 2 :]
        z = (x[: R // 2] + 1j * x[R // 2 :]) if is_neox else (x[0::2] + 1j * x[1::2])
        z = z * e
        y = np.empty(R)
        if is_neox:
            y[: R // 2], y[R // 2 :] = z.real, z.imag
        else:
            y[0::2], y[1::2] = z.real, z.imag
        return y

    def cast(x):
        return reference.to_dtype(np.asarray(x, np.float64), out)

    for i in range(T):
        p = int(a["pos_ids"][i])
        roped = 0 <= p < P  # otherwise: q written unrotated, no cache row
        for h in range(Hq):
            s = scale(a["quant_scale_q"], h)
            x = rot(q_rope[i, h], p) if roped else q_rope[i, h].astype(np.float64)
            qro[i, h] = cast(x * s)
            if Dn:
                qno[i, h] = cast(a["q_nope"][i, h].astype(np.float64) * s)
        if not roped:
            continue
        b, pos = int(a["batch_indices"][i]), int(a["positions"][i])
        if not 0 <= b < B or pos < 0:
            continue
        it = int(a["kv_indptr"][b]) + pos // ps
        if not int(a["kv_indptr"][b]) <= it < int(a["kv_indptr"][b + 1]):
            continue
        if not 0 <= it < a["kv_indices"].shape[0]:
            continue
        page, entry = int(a["kv_indices"][it]), pos % ps
        if not 0 <= page < cache0.shape[0]:
            continue
        if mla:
            s = scale(a["quant_scale_kv"], 0)
            cache1[page, entry] = cast(rot(k_rope[i], p) * s)
            if Dn:
                cache0[page, entry] = cast(a["k_nope"][i].astype(np.float64) * s)
            continue
        for h in range(k_rope.shape[1]):
            s = scale(a["quant_scale_kv"], h)
            row = rot(k_rope[i, h], p)
            if Dn:
                row = np.concatenate([row, a["k_nope"][i, h].astype(np.float64)])
            vrow = a["v"][i, h].astype(np.float64)
            if a["kv_layout"] == "NHD":
                cache0[page, entry, h], cache1[page, entry, h] = cast(row * s), cast(vrow * s)
            else:
                cache0[page, h, entry], cache1[page, h, entry] = cast(row * s), cast(vrow * s)
    return qro, qno, (cache0, cache1)


def written_rows(args):
    """Boolean (num_pages, page_size): the cache rows the call writes."""
    cache0 = args["paged_kv_cache"][0]
    ps = args["page_size"]
    page, entry = reference.paged_append_slots(
        args["kv_indices"],
        args["kv_indptr"],
        args["batch_indices"],
        args["positions"],
        ps,
        cache0.shape[0],
    )
    pos = np.asarray(args["pos_ids"]).astype(np.int64)
    ok = (pos >= 0) & (pos < args["cos_sin_cache"].shape[0])
    ok = (page >= 0) & (ok.all(axis=0) if pos.ndim == 2 else ok)  # mRoPE: (3, T)
    mask = np.zeros((cache0.shape[0], ps), bool)
    mask[page[ok], entry[ok]] = True
    return mask


# status= codes of malformed kv_indptr tables (4: first entry, 5: decreasing, 6: past kv_indices)
BAD_INDPTR = [
    ([1, 2, 4], 4),
    ([0, 3, 2], 5),
    ([0, 2, 99], 6),
    ([-1, 2, 4], 4),
    ([0, -5, 4], 5),
    ([0, 4, 2], 5),
]


def malformed(args, indptr):
    """``args`` with another kv_indptr (of the same dtype)."""
    return dict(args, kv_indptr=np.asarray(indptr, args["kv_indptr"].dtype))


def rows(cache, mask, args):
    """The (page, entry) rows of a cache selected by ``mask``, whatever the layout."""
    if cache.ndim == 4 and args["kv_layout"] == "HND":
        cache = cache.transpose(0, 2, 1, 3)
    return cache[mask]


def scale_rows(scales, mask, args):
    """The (page, entry) entries of a per-token-head scale array selected by ``mask``: (n, Hkv)."""
    if args["kv_layout"] == "HND":
        scales = scales.transpose(0, 2, 1)
    return scales[mask]


def assert_codes_close(actual, expected, what):
    """int8 codes: equal or adjacent (a float32 kernel and a float64 reference may round a value
    at .5 either way)."""
    diff = np.abs(to_numpy(actual).astype(np.int32) - expected.astype(np.int32))
    assert diff.max(initial=0) <= 1, f"{what}: int8 codes differ by {diff.max()}"


def check_caches(got, expected, original, args, scales=None):
    """Written rows against the reference, other rows byte-identical; ``scales``: (got,
    expected, original) per-token-head scale pairs, checked the same way."""
    mask = written_rows(args)
    for g, e, o, name in zip(got, expected, original, ("cache 0", "cache 1")):
        g = to_numpy(g)
        if e.dtype == I8:
            assert_codes_close(rows(g, mask, args), rows(e, mask, args), f"{name} written rows")
        else:
            assert_close(rows(g, mask, args), rows(e, mask, args), f"{name} written rows")
        assert_bytes_equal(rows(g, ~mask, args), rows(o, ~mask, args), f"{name} other rows")
    for g, e, o, name in zip(*(scales or ((), (), ())), ("k_scales", "v_scales")):
        g = to_numpy(g)
        assert_close(scale_rows(g, mask, args), scale_rows(e, mask, args), f"{name} written")
        assert_bytes_equal(
            scale_rows(g, ~mask, args), scale_rows(o, ~mask, args), f"{name} other entries"
        )


# ---------------------------------------------------------------------------------------------
# The reference and the NumPy backend


@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2, F16])
def test_reference_matches_a_per_token_loop(mla, is_neox, cache_dtype):
    args = make_case(
        1,
        T=9,
        R=16,
        Dn=8,
        mla=mla,
        cache_dtype=cache_dtype,
        padding=2,
        per_head=True,
        kv_layout="HND" if is_neox else "NHD",
    )
    exp_q, exp_n, exp_cache = naive(args, is_neox)
    got = copy_args(args)
    q, n = call(got, quantize=cache_dtype in FP8, is_neox=is_neox)
    assert isinstance(q, np.ndarray) and q.dtype == cache_dtype
    assert_close(q, exp_q, "q_rope_out")
    assert_close(n, exp_n, "q_nope_out")
    check_caches(got["paged_kv_cache"], exp_cache, args["paged_kv_cache"], args)


@pytest.mark.parametrize("interleaved", [False, True])
def test_mrope_of_text_tokens_is_plain_rope(interleaved):
    """Three equal positions give the 1-D rotation, byte for byte (NumPy backend)."""
    args = make_case(5, T=9, R=64, Dn=0, cache_dtype=F16)
    plain = copy_args(args)
    q0, _ = call(plain, quantize=False)
    args["pos_ids"] = np.stack([args["pos_ids"]] * 3)
    q1, _ = call(
        args,
        quantize=False,
        mrope_section=(12, 10, 10) if interleaved else (8, 12, 12),
        mrope_interleaved=interleaved,
    )
    assert_bytes_equal(q1, q0)
    for a, b in zip(args["paged_kv_cache"], plain["paged_kv_cache"]):
        assert_bytes_equal(a, b)


@given(seed=seeds, interleaved=st.booleans(), mla=st.booleans())
def test_mrope_reference_rows_and_skips(seed, interleaved, mla):
    """The NumPy backend with mRoPE: tokens with a position outside the table on any axis have
    unrotated q rows and no cache row; the others are written."""
    args = make_case(seed % 997, T=11, R=32, Dn=16, mla=mla, cache_dtype=E4M3)
    args, kw = with_mrope(args, np.random.default_rng(seed), interleaved, bad_share=0.3)
    before = copy_args(args)
    call(args, **kw)
    mask = written_rows(before)
    for g, o in zip(args["paged_kv_cache"], before["paged_kv_cache"]):
        assert_bytes_equal(rows(g, ~mask, before), rows(o, ~mask, before))


def test_mrope_validation():
    args = make_case(6, T=5, R=16)
    for kw, exc, match in [
        ({"mrope_section": (4, 4, 4)}, ValueError, "must be non-negative and sum to R/2 = 8"),
        (
            {"mrope_section": (2, 3, 3)},
            ValueError,
            r"pos_ids must have shape \(3, nnz\) = \(3, 5\), got \(5,\)",
        ),
        (
            {"mrope_section": (2, 3, 3), "mrope_interleaved": True},
            ValueError,
            "does not fit the interleaved layout",
        ),
        ({"mrope_interleaved": "no"}, TypeError, "mrope_interleaved must be a bool"),
    ]:
        with pytest.raises(exc, match=match):
            call(copy_args(args), **kw)


def test_position_zero_is_the_identity():
    args = make_case(2, T=5, Hq=2, Hkv=2, R=16, Dn=8, cache_dtype=F16)
    for n in ("pos_ids", "positions"):
        args[n][:] = 0
    q, n = call(args, quantize=False)
    np.testing.assert_array_equal(q, args["q_rope"])
    np.testing.assert_array_equal(n, args["q_nope"])


def test_rotation_preserves_pair_norms():
    args = make_case(3, T=6, R=32, cache_dtype=F16, dtype=F16)
    q, _ = call(args, quantize=False)
    x, y = args["q_rope"].astype(np.float64), q.astype(np.float64)
    norms = lambda z: z[..., :16] ** 2 + z[..., 16:] ** 2
    np.testing.assert_allclose(norms(y), norms(x), rtol=4e-3, atol=1e-3)


def test_unaddressed_rows_stay_byte_identical():
    args = make_case(4, T=11, padding=3, extra_pages=5)
    got = copy_args(args)
    call(got)
    mask = written_rows(args)
    assert 0 < mask.sum() < mask.size
    for g, o in zip(got["paged_kv_cache"], args["paged_kv_cache"]):
        assert_bytes_equal(rows(g, ~mask, args), rows(o, ~mask, args))


def test_nhd_and_hnd_hold_the_same_rows():
    nhd = make_case(5, kv_layout="NHD")
    hnd = make_case(5, kv_layout="HND")
    call(nhd)
    call(hnd)
    for a, b in zip(nhd["paged_kv_cache"], hnd["paged_kv_cache"]):
        mask = written_rows(nhd)
        np.testing.assert_array_equal(
            a[mask].view(np.uint8), b.transpose(0, 2, 1, 3)[mask].view(np.uint8)
        )


def test_int32_and_int64_indices_agree():
    a = make_case(6, index_dtypes=np.int32)
    b = make_case(6, index_dtypes=(np.int64, np.int32, np.int64, np.int32, np.int64))
    qa, _ = call(a)
    qb, _ = call(b)
    np.testing.assert_array_equal(qa.view(np.uint8), qb.view(np.uint8))
    for x, y in zip(a["paged_kv_cache"], b["paged_kv_cache"]):
        np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))


def test_per_head_scales_equal_to_a_scalar_give_the_same_result():
    a = make_case(7)
    b = copy_args(a)
    b["quant_scale_q"] = np.full(4, a["quant_scale_q"], np.float32)
    b["quant_scale_kv"] = np.full(2, a["quant_scale_kv"], np.float32)
    a["quant_scale_q"] = float(np.float32(a["quant_scale_q"]))
    a["quant_scale_kv"] = float(np.float32(a["quant_scale_kv"]))
    qa, _ = call(a)
    qb, _ = call(b)
    np.testing.assert_array_equal(qa.view(np.uint8), qb.view(np.uint8))


def test_scales_are_ignored_without_quantization():
    a = make_case(8, cache_dtype=F16)
    b = copy_args(a)
    b["quant_scale_q"], b["quant_scale_kv"] = 100.0, 0.01
    qa, _ = call(a, quantize=False)
    qb, _ = call(b, quantize=False)
    np.testing.assert_array_equal(qa, qb)
    assert qa.dtype == F16


def test_fp8_saturates():
    args = make_case(9, cache_dtype=E4M3)
    args["quant_scale_q"] = 1e6
    q, _ = call(args)
    assert np.abs(q.astype(np.float32)).max() == 448.0


def test_padding_and_invalid_slots_write_q_but_no_cache_row():
    args = make_case(10, T=6, B=1, padding=0)
    args["batch_indices"][0] = -1  # padding
    args["batch_indices"][1] = 5  # past the batch
    args["positions"][2] = -3  # negative position
    args["positions"][3] = 10_000  # past the request's pages
    args["kv_indices"][:] = 1 << 30  # every page id out of range
    got = copy_args(args)
    q, _ = call(got)
    exp_q, _, _ = naive(args)
    assert_close(q, exp_q)
    for g, o in zip(got["paged_kv_cache"], args["paged_kv_cache"]):
        assert_bytes_equal(g, o)


def test_out_of_table_positions_write_q_unrotated_and_no_cache_row():
    args = make_case(11, T=4, cache_dtype=F16)
    args["pos_ids"][1] = args["cos_sin_cache"].shape[0]
    args["pos_ids"][2] = -1
    out = np.full((4, 4, 16), 7, F16)
    q, _ = call(args, quantize=False, q_rope_out=out)
    assert q is out
    np.testing.assert_array_equal(out[1:3], args["q_rope"][1:3])  # never left stale
    assert not (out[0] == 7).all() and not (out[3] == 7).all()
    mask = written_rows(args)
    assert mask.sum() == 2


def test_out_of_table_positions_quantize_q_with_its_scale():
    args = make_case(13, T=3, Dn=8, cache_dtype=E4M3)
    args["pos_ids"][:] = [-5, 0, 1 << 30]
    args["quant_scale_q"] = 0.5
    q, n = call(args)
    for i in (0, 2):
        assert_close(q[i], reference.to_dtype(args["q_rope"][i].astype(np.float64) * 0.5, E4M3))
        assert_close(n[i], reference.to_dtype(args["q_nope"][i].astype(np.float64) * 0.5, E4M3))


def test_mla_writes_ckv_and_kpe():
    args = make_case(12, mla=True, Hq=3, R=8, Dn=16, T=5)
    _exp_q, exp_n, exp_cache = naive(args)
    got = copy_args(args)
    q, n = call(got)
    assert q.shape == (5, 3, 8) and n.shape == (5, 3, 16)
    assert_close(n, exp_n)
    check_caches(got["paged_kv_cache"], exp_cache, args["paged_kv_cache"], args)


def test_q_nope_none_gives_an_empty_q_nope_out():
    args = make_case(13)
    _q, n = call(args)
    assert n.shape == (7, 4, 0) and n.dtype == E4M3


def test_preallocated_outputs_are_returned():
    args = make_case(14, Dn=8)
    qo, no = np.empty((7, 4, 16), E4M3), np.empty((7, 4, 8), E4M3)
    q, n = call(args, q_rope_out=qo, q_nope_out=no)
    assert q is qo and n is no


@pytest.mark.parametrize(
    "spelling",
    ["float8_e5m2", "torch.float8_e5m2", ml_dtypes.float8_e5m2, np.dtype(ml_dtypes.float8_e5m2)],
)
def test_quantize_dtype_spellings(spelling):
    args = make_case(15, cache_dtype=E5M2)
    q, _ = call(args, quantize_dtype=spelling)
    assert q.dtype == E5M2


def test_quantize_dtype_is_inferred_from_the_cache():
    args = make_case(16, cache_dtype=E5M2)
    q, _ = call(args)
    assert q.dtype == E5M2


def test_torch_cpu_tensors_in_torch_out():
    torch = pytest.importorskip("torch")
    args = make_case(17, Dn=8, cache_dtype=E4M3)
    expected = copy_args(args)
    exp_q, exp_n = call(expected)
    t = {}
    for n, x in args.items():
        if n == "paged_kv_cache":
            t[n] = tuple(torch.from_numpy(c.view(np.uint8)).view(torch.float8_e4m3fn) for c in x)
        elif isinstance(x, np.ndarray):
            t[n] = torch.from_numpy(x.view(np.int16) if x.dtype == BF16 else x)
        else:
            t[n] = x
    q, n = call(t, quantize_dtype=torch.float8_e4m3fn)
    assert isinstance(q, torch.Tensor) and q.dtype == torch.float8_e4m3fn
    assert isinstance(n, torch.Tensor) and n.shape == (7, 4, 8)
    assert_close(q, exp_q)
    assert_close(n, exp_n)
    assert_close(t["paged_kv_cache"][0], expected["paged_kv_cache"][0])


def test_check_indices_raises(monkeypatch):
    monkeypatch.setenv("ROPEKV_CHECK_INDICES", "1")
    call(make_case(18, padding=2))  # padding is not an error
    cases = [
        ("pos_ids", 0, 10_000, "pos_ids"),
        ("batch_indices", 0, 99, "batch_size"),
        ("positions", 0, -1, "negative position"),
        ("positions", 0, 10_000, "page-table"),
        ("kv_indices", slice(None), 1 << 20, "num_pages"),
    ]
    for name, i, value, match in cases:
        args = make_case(18, B=1)
        args[name][i] = value
        with pytest.raises(IndexError, match=match):
            call(args)


def test_launch_shape(monkeypatch):
    """The section kernel: few items per thread take the light shape, many (MLA's 128 query heads)
    the heavy one at vector width 8; short batches split tokens over blocks. The row kernel
    (GQA / MHA heads): decode splits a token's rows over blocks, prefill gives a block a token."""
    from ropekv import paged

    monkeypatch.setitem(paged.TUNING, "min_blocks", 512)
    light, heavy = paged.TUNING["light"], paged.TUNING["heavy"]
    assert paged.launch_shape(448, 8192, 8) == (128, 1, light)
    assert paged.launch_shape(8772, 8192, 8) == (128, 1, heavy)
    assert paged.launch_shape(8772, 8192, 4) == (128, 1, light)
    assert paged.launch_shape(448, 64, 8) == (128, 4, light)
    assert paged.launch_shape(40, 1, 8) == (64, 1, light)
    monkeypatch.setitem(paged.TUNING, "row_block", 128)
    monkeypatch.setitem(paged.TUNING, "row_block_many", 128)
    monkeypatch.setitem(paged.TUNING, "wave_blocks", 660)
    assert paged.row_launch_shape(1, 48, 8) == (128, 1, 3)  # 16 rows a block
    block, rows, splits = paged.row_launch_shape(8192, 48, 8)
    assert splits == 1 and block // 8 * rows >= 48 and rows <= paged.ROWS[-1]
    spelled = tuple(
        f"{', '.join(map(str, shape))}, {mrope}>"
        for shape in (light, heavy)
        for mrope in ("false", "true")
    )
    for e in paged.instantiations():
        assert e.endswith(spelled) or e.startswith(paged.ROW_KERNEL), e


def _choose(T, Hq, Hkv, R, Dn, mla, dtype=BF16, is_neox=False, **options):
    """The kernel and launch shape a device call of these shapes gets (aligned stand-in views:
    :func:`ropekv.paged._choose` reads dtypes, pointers and strides only); ``out_dtype``: the
    caches' and q outputs' (by default ``dtype``)."""
    from types import SimpleNamespace as NS

    from ropekv import paged

    view = NS(dtype=np.dtype(dtype), ptr=0, strides=(1 << 16, 1 << 10, 1))
    table = NS(dtype=F32, ptr=0, strides=(R, 1))
    a = NS(
        q_rope=view,
        q_scale_out=options.get("q_scale_out"),
        k_scales=None,
        status=options.get("status"),
        cache0=view,
        cache1=view,
        cos_sin_cache=table,
    )
    out = np.dtype(options.get("out_dtype", dtype))
    c = NS(R=R, Dn=Dn, T=T, Hq=Hq, Hkv=Hkv, mla=mla, inputs=[view], given_outs=[], out_dtype=out)
    return paged._choose(a, is_neox, c)


def test_mla_decode_takes_the_row_kernel(monkeypatch):
    """MLA's 72-chunk head rows (latent 512, rope 64) run the row kernel below wide_rows_below
    head rows (decode: one chunk a thread, 216-thread blocks, a block a row from
    wide_row_single_from rows), the section kernel from there
    (prefill), and always with wide_rows_below 0 (the earlier choice); status= alone keeps the
    section kernel's status variant, computed scales the option row kernel."""
    from ropekv import paged

    mla = {"Hkv": 1, "R": 64, "Dn": 512, "mla": True}
    one = _choose(1, 128, **mla)
    assert one.shape == ("rows", 1) and (one.block, one.splits, one.tokens) == (216, 43, 1)
    assert _choose(4, 128, **mla).block == 216
    many = _choose(16, 128, **mla)  # 2064 rows: a block a row
    assert many.shape[0] == "rows" and many.block == 72
    assert _choose(31, 128, **mla).shape == ("rows", 4)
    assert _choose(32, 128, **mla).shape[0] != "rows"  # 32 x 129 rows: the section kernel
    assert _choose(64, 16, **mla).block == 216  # 1088 rows
    assert _choose(240, 16, **mla).shape[0] == "rows"
    assert _choose(241, 16, **mla).shape[0] != "rows"
    assert _choose(8192, 16, **mla).shape == paged.TUNING["heavy"]  # 1224 items a token
    assert _choose(1, 128, is_neox=True, **mla).group == 68
    assert _choose(1, 16, status=object(), **mla).shape[0] != "rows"
    scaled = _choose(1, 16, q_scale_out=object(), **mla)
    assert scaled.shape == ("rows", 1) and scaled.opts
    monkeypatch.setitem(paged.TUNING, "wide_row_block", 72)
    assert _choose(1, 128, **mla).block == 72
    monkeypatch.setitem(paged.TUNING, "wide_rows_below", 0)
    old = _choose(1, 128, **mla)
    assert old.shape == paged.TUNING["light"] and (old.block, old.splits) == (128, 73)


def test_row_kernel_gathers_tokens_of_few_heads(monkeypatch):
    """A prefill block of fewer than row_tokens_upto threads (GQA under tensor parallelism:
    8 + 1 + 1 rows of 8 lanes, 3 lane groups of 4 rows, 24 threads) takes several tokens, whole
    warps where they fit; Llama-3-8B's 96-thread prefill blocks, decode blocks and the option
    kernel keep a token a block, and row_tokens_upto 0 restores a token a block."""
    from ropekv import paged

    gqa = {"R": 128, "Dn": 0, "mla": False, "dtype": F16, "is_neox": True}
    tp8 = _choose(8192, 8, 1, **gqa)
    assert (tp8.block, tp8.tokens, tp8.splits) == (24, 4, 1)
    assert _choose(8192, 4, 1, **gqa).tokens == 8  # 16 lanes: 8 tokens, 128 threads
    assert _choose(8192, 32, 8, **gqa).tokens == 1  # 96 threads: 3 whole warps
    assert _choose(1, 8, 1, **gqa).tokens == 1  # decode: 256-thread blocks
    assert _choose(8192, 8, 1, q_scale_out=object(), **gqa).tokens == 1
    assert paged.row_tokens(3, 24) == 3 and paged.row_tokens(8192, 36) == 3
    monkeypatch.setitem(paged.TUNING, "row_tokens_upto", 512)
    assert paged.row_tokens(8192, 24) == 20  # 480 threads
    monkeypatch.setitem(paged.TUNING, "row_tokens_upto", 0)
    assert _choose(8192, 8, 1, **gqa).tokens == 1


def test_empty_batch():
    args = make_case(19, T=0, B=1)
    q, n = call(args)
    assert q.shape == (0, 4, 16) and n.shape == (0, 4, 0)


def exact_rows(args, is_neox=True):
    """float64 q rows (rope | nope) and written K / V rows of ``naive``: the case run with
    float64 caches and unit scales (no rounding), so a test can quantize them itself."""
    a = copy_args(args)
    a["paged_kv_cache"] = tuple(np.zeros(c.shape, np.float64) for c in args["paged_kv_cache"])
    a["quant_scale_q"] = a["quant_scale_kv"] = 1.0
    for name in ("q_scale_out", "kv_cache_scales", "status"):
        a.pop(name, None)
    qro, qno, caches = naive(a, is_neox)
    return np.concatenate([qro, qno], axis=-1), caches


@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("out", FP8)
def test_dynamic_q_quantizes_each_head_row_with_its_own_scale(mla, is_neox, out):
    """q_scale_out: each token's Q head, rope and nope dims together, is quantize_rows of the
    exact roped row; both outputs share the row's scale; the static q scale is not applied."""
    args = with_options(
        make_case(80, T=9, R=16, Dn=8, mla=mla, cache_dtype=out, padding=2),
        np.random.default_rng(0),
        q_dyn=True,
    )
    exact, _ = exact_rows(args, is_neox)
    got = copy_args(args)
    q, n = call(got, is_neox=is_neox)
    stored, scale = reference.quantize_rows(exact, out)
    assert_close(q, stored[..., :16], "q_rope_out")
    assert_close(n, stored[..., 16:], "q_nope_out")
    assert got["q_scale_out"].dtype == F32
    np.testing.assert_allclose(got["q_scale_out"], scale, rtol=1e-6)
    # the dequantized rows are within fp8 rounding of the exact ones; the largest is max_code
    deq = reference.dequantize_rows(np.concatenate([q, n], -1), got["q_scale_out"])
    assert np.all(np.abs(deq - exact) <= np.abs(exact) / 8 + got["q_scale_out"][..., None])
    codes = np.abs(np.concatenate([q, n], -1).astype(np.float64)).max(-1)
    np.testing.assert_array_equal(codes, reference.MAX_CODE[out])


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("out", [E4M3, E5M2, I8])
@pytest.mark.parametrize("quantize", [True, False])
def test_kv_cache_scales_quantize_each_written_row(kv_layout, out, quantize):
    """kv_cache_scales: every written K row (rope and nope together) and V row is quantize_rows
    of the exact row, its scale at the row's (page, entry, head); other rows and entries keep
    their bytes; Q keeps its static scale."""
    rng = np.random.default_rng(1)
    case = make_case(
        81, T=11, R=16, Dn=8, cache_dtype=out if out != I8 else E4M3, padding=2, kv_layout=kv_layout
    )
    if out == I8:
        case["paged_kv_cache"] = tuple(c.view(I8) for c in case["paged_kv_cache"])
    args = with_options(case, rng, kv_dyn=True)
    exact_q, exact = exact_rows(args)
    got = copy_args(args)
    q, _ = call(got, quantize=quantize)
    expected_q = reference.to_dtype(exact_q[..., :16] * args["quant_scale_q"], out)
    np.testing.assert_array_equal(q.view(np.uint8), expected_q.view(np.uint8))
    mask = written_rows(args)
    assert 0 < mask.sum() < mask.size
    for g, e, sg, so, o in zip(
        got["paged_kv_cache"],
        exact,
        got["kv_cache_scales"],
        args["kv_cache_scales"],
        args["paged_kv_cache"],
    ):
        stored, scale = reference.quantize_rows(rows(e, mask, args), out)
        np.testing.assert_array_equal(rows(g, mask, args).view(np.uint8), stored.view(np.uint8))
        np.testing.assert_allclose(scale_rows(sg, mask, args), scale, rtol=1e-6)
        assert_bytes_equal(rows(g, ~mask, args), rows(o, ~mask, args), "other rows")
        assert_bytes_equal(
            scale_rows(sg, ~mask, args), scale_rows(so, ~mask, args), "other scale entries"
        )


def test_dynamic_q_and_kv_scales_together_with_mrope():
    rng = np.random.default_rng(2)
    base = make_case(82, T=12, R=24, Dn=8, padding=1)
    args, kw = with_mrope(base, rng, interleaved=False)
    args = with_options(args, rng, q_dyn=True, kv_dyn=True)
    got = copy_args(args)
    call(got, **kw)
    expected = copy_args(args)
    reference.rope_append_paged_kv_cache(
        *(
            expected[n]
            for n in (
                "q_rope",
                "k_rope",
                "q_nope",
                "k_nope",
                "v",
                "cos_sin_cache",
                "pos_ids",
                "paged_kv_cache",
                "kv_indices",
                "kv_indptr",
                "batch_indices",
                "positions",
            )
        ),
        True,
        1.0,
        1.0,
        4,
        "NHD",
        None,
        None,
        **kw,
        q_scale_out=expected["q_scale_out"],
        kv_cache_scales=expected["kv_cache_scales"],
    )
    for name in ("q_scale_out",):
        np.testing.assert_array_equal(got[name], expected[name])
    for g, e in zip(
        (*got["paged_kv_cache"], *got["kv_cache_scales"]),
        (*expected["paged_kv_cache"], *expected["kv_cache_scales"]),
    ):
        np.testing.assert_array_equal(g.view(np.uint8), e.view(np.uint8))


def test_default_scales_are_one():
    a = make_case(83)
    b = copy_args(a)
    a["quant_scale_q"] = a["quant_scale_kv"] = 1.0
    del b["quant_scale_q"], b["quant_scale_kv"]
    qa, _ = call(a)
    qb, _ = call(b)
    np.testing.assert_array_equal(qa.view(np.uint8), qb.view(np.uint8))
    for x, y in zip(a["paged_kv_cache"], b["paged_kv_cache"]):
        np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))


@pytest.mark.parametrize("indptr, code", BAD_INDPTR + [([0, 2, 4], 0), ([0, 0, 0], 0)])
def test_indptr_status_reference(indptr, code):
    for dtype in (np.int32, np.int64):
        assert reference.paged_indptr_status(np.asarray(indptr, dtype), 4) == code


@pytest.mark.parametrize("indptr, code", BAD_INDPTR)
def test_status_failure_writes_nothing_on_the_host(indptr, code):
    args = with_options(
        malformed(make_case(84, T=9, B=2, Dn=8), indptr), np.random.default_rng(3), True, True, True
    )
    got = copy_args(args)
    q_out = np.full((9, 4, 16), 3, np.uint8).view(E4M3)
    call(got, q_rope_out=q_out)
    assert got["status"][0] == code
    assert np.all(q_out.view(np.uint8) == 3)
    for g, o in zip(
        (*got["paged_kv_cache"], *got["kv_cache_scales"], got["q_scale_out"]),
        (*args["paged_kv_cache"], *args["kv_cache_scales"], args["q_scale_out"]),
    ):
        assert_bytes_equal(g, o, "untouched")


def test_status_of_a_valid_table_is_zero_on_the_host():
    args = with_options(make_case(85, Dn=8), np.random.default_rng(4), status=True)
    got = copy_args(args)
    q, _ = call(got)
    assert got["status"][0] == 0
    expected, _ = call(copy_args(make_case(85, Dn=8)))
    np.testing.assert_array_equal(q.view(np.uint8), expected.view(np.uint8))
    empty = dict(malformed(make_case(86, T=0, B=1), [0, 9]), status=np.zeros(1, np.int32))
    call(empty)
    assert empty["status"][0] == 6


# ---------------------------------------------------------------------------------------------
# Validation: one test per rule


def bad(match, exc=ValueError, quantize=True, **changes):
    args = make_case(20, Dn=8)
    args.update(changes)
    with pytest.raises(exc, match=match):
        call(args, quantize=quantize)


def test_q_rope_must_be_3d():
    bad(r"q_rope must have shape \(nnz, Hq, R\)", q_rope=np.zeros((7, 64), F16))


def test_q_rope_dtype():
    bad(
        "q_rope must have dtype float16 or bfloat16",
        TypeError,
        q_rope=np.zeros((7, 4, 16), np.float32),
    )


def test_rotary_dim_must_be_even():
    bad("rotary dim R .* must be even", q_rope=np.zeros((7, 4, 15), F16))


def test_k_rope_rank():
    bad(
        r"k_rope must have shape \(nnz, Hkv, R\) \(GQA/MHA\) or \(nnz, R\)",
        k_rope=np.zeros((7, 2, 16, 1), F16),
    )


def test_k_rope_shape():
    bad(r"k_rope must have shape \(nnz, Hkv, R\)", k_rope=np.zeros((7, 2, 8), F16))


def test_inputs_share_the_dtype_of_q_rope():
    bad("k_rope must have the dtype of q_rope", TypeError, k_rope=np.zeros((7, 2, 16), BF16))


def test_q_nope_and_k_nope_go_together():
    bad("q_nope and k_nope must both be arrays or both be None", k_nope=None)


def test_q_nope_shape():
    bad(r"q_nope must have shape \(nnz, Hq, no_rope_dim\)", q_nope=np.zeros((7, 3, 8), F16))


def test_k_nope_shape():
    bad(r"k_nope must have shape \(nnz, Hkv, no_rope_dim\)", k_nope=np.zeros((7, 2, 4), F16))


def test_v_required_for_gqa():
    bad("v is required for GQA/MHA", v=None)


def test_v_shape():
    bad(r"v must have shape \(nnz, Hkv, head_dim\) = \(7, 2, 24\)", v=np.zeros((7, 2, 16), F16))


def test_v_must_be_none_for_mla():
    args = make_case(21, mla=True, Dn=8)
    args["v"] = np.zeros((7, 1, 24), F16)
    with pytest.raises(ValueError, match="v must be None for MLA"):
        call(args)


def test_cos_sin_cache_dtype():
    bad(
        "cos_sin_cache must have dtype float32",
        TypeError,
        cos_sin_cache=np.zeros((64, 16), np.float64),
    )


def test_cos_sin_cache_shape():
    bad(r"cos_sin_cache must have shape \(P, R\)", cos_sin_cache=np.zeros((64, 8), np.float32))


def test_token_index_arrays_shape():
    bad(r"positions must have shape \(nnz,\)", positions=np.zeros(6, np.int32))


def test_index_dtype():
    bad("kv_indices must have dtype int32 or int64", TypeError, kv_indices=np.zeros(8, np.uint32))


def test_index_arrays_must_be_contiguous():
    bad("kv_indptr must be C-contiguous", kv_indptr=np.zeros(8, np.int32)[::2])


def test_kv_indptr_not_empty():
    bad("kv_indptr must have shape .* at least one entry", kv_indptr=np.zeros(0, np.int32))


def test_paged_kv_cache_is_a_pair():
    bad("paged_kv_cache must be a pair", paged_kv_cache=(np.zeros(4, E4M3),))


def test_page_size_positive():
    bad("page_size must be a positive integer", page_size=0)


def test_page_size_fits_int32_even_with_empty_caches_of_that_size():
    k, v = make_case(20, Dn=8)["paged_kv_cache"]
    big = 2**31
    empty = tuple(np.zeros((0, big, *c.shape[2:]), c.dtype) for c in (k, v))
    bad("page_size must be a positive integer of at most", page_size=big, paged_kv_cache=empty)


def test_kv_layout_choice():
    bad("kv_layout must be one of 'NHD', 'HND'", kv_layout="NDH")


def test_cache_shape_follows_layout():
    args = make_case(22, Dn=8)
    args["kv_layout"] = "HND"
    with pytest.raises(ValueError, match=r"k_cache must have shape \(num_pages, Hkv, page_size"):
        call(args)


def test_cache_page_size_must_match():
    bad(r"k_cache must have shape .*for NHD", page_size=8)


def test_mla_cache_shapes():
    args = make_case(23, mla=True, Dn=8)
    ckv, kpe = args["paged_kv_cache"]
    args["paged_kv_cache"] = (ckv, kpe[..., :4])
    with pytest.raises(ValueError, match=r"kpe_cache must have shape .*rope_dim"):
        call(args)


def test_caches_share_a_dtype():
    args = make_case(24, Dn=8)
    k, v = args["paged_kv_cache"]
    args["paged_kv_cache"] = (k, v.view(E5M2))
    with pytest.raises(TypeError, match="v_cache must have the dtype of k_cache"):
        call(args)


def test_quantized_op_needs_an_fp8_cache():
    args = make_case(25, Dn=8, cache_dtype=F16)
    with pytest.raises(
        TypeError, match="k_cache must have dtype float8_e4m3fn or float8_e5m2, got float16"
    ):
        call(args)


def test_cache_must_match_quantize_dtype():
    args = make_case(26, Dn=8, cache_dtype=E4M3)
    with pytest.raises(TypeError, match="k_cache must have the quantize dtype float8_e5m2"):
        call(args, quantize_dtype="float8_e5m2")


def test_quantize_dtype_must_be_fp8():
    bad("quantize_dtype must be float8_e4m3fn or float8_e5m2", TypeError, quantize_dtype=np.float16)


def test_unknown_quantize_dtype_name():
    bad(
        "quantize_dtype must be float8_e4m3fn or float8_e5m2",
        TypeError,
        quantize_dtype="torch.float32",
    )


def test_non_quantized_op_cache_dtype():
    args = make_case(27, Dn=8, cache_dtype=BF16)
    with pytest.raises(
        TypeError,
        match="k_cache must have dtype float16 or float8_e4m3fn or float8_e5m2, got bfloat16",
    ):
        call(args, quantize=False)


def test_scale_array_shape():
    bad(r"quant_scale_kv must have shape \(Hkv,\)", quant_scale_kv=np.ones(3, np.float32))


def test_scale_array_dtype():
    bad("quant_scale_q must have dtype float32", TypeError, quant_scale_q=np.ones(4, np.float64))


def test_q_rope_out_shape():
    bad(r"q_rope_out must have shape \(nnz, Hq, R\)", q_rope_out=np.zeros((7, 4, 8), E4M3))


def test_q_nope_out_dtype():
    bad(
        "q_nope_out must have the quantize dtype float8_e4m3fn",
        TypeError,
        q_nope_out=np.zeros((7, 4, 8), E5M2),
        quantize_dtype="float8_e4m3fn",
    )


def test_last_dim_must_be_contiguous():
    bad(
        "q_rope must be contiguous in its last dimension",
        q_rope=np.zeros((7, 4, 32), F16)[..., ::2],
    )


def _wrong(rng, x):
    """``x`` (an array) the way a caller gets one wrong: a dim more or less, one size off, another
    dtype, strided rows, no rows, or None."""
    how = int(rng.integers(0, 6))
    if how == 5:
        return x[:0]
    if how == 0:
        return x[..., 0] if x.ndim > 1 else x.reshape(1, -1)
    # (values kept where they may stay valid: zeroed page ids would send several tokens to one
    # cache row, whose bytes a GPU's write order then decides)
    if how == 1:
        k = int(rng.integers(0, x.ndim))
        shape = list(x.shape)
        shape[k] = max(shape[k] + int(rng.choice([-1, 1])), 0)
        return np.resize(x, shape)
    if how == 2:
        with np.errstate(invalid="ignore", over="ignore"):
            return x.astype(rng.choice([F16, BF16, F32, E4M3, I8, np.dtype(np.int64)]))
    if how == 3:
        wide = np.zeros((*x.shape[:-1], 2 * x.shape[-1]), x.dtype)
        return wide[..., ::2]
    return None


def _odd_rotary_dim(args):
    """The call with R - 1 rotary dims in every array that has them."""
    args = dict(args)
    for name in ("q_rope", "k_rope", "cos_sin_cache", "v"):
        if args[name] is not None:
            args[name] = args[name][..., :-1]
    k, v = args["paged_kv_cache"]
    args["paged_kv_cache"] = (k[..., :-1] if args["v"] is not None else k, v[..., :-1])
    return args


def _v_head_dim_off(args):
    """The call with a head dim of v that is not R + no_rope_dim (GQA; MLA has no v)."""
    args = dict(args)
    if args["v"] is not None:
        T, H, D = args["v"].shape
        args["v"] = np.zeros((T, H, D + 1), args["v"].dtype)
    return args


def _no_q_heads(args):
    """The call with no q heads."""
    args = dict(args)
    for name in ("q_rope", "q_nope"):
        if args[name] is not None:
            args[name] = args[name][:, :0]
    return args


def _strided_copy(x):
    """A copy of ``x`` with its strides (of a view of a C-contiguous array, as ``_wrong`` makes)."""
    if x is None or x.flags.c_contiguous:
        return None if x is None else x.copy()
    base = x.base.copy()
    offset = x.__array_interface__["data"][0] - x.base.__array_interface__["data"][0]
    return np.ndarray(x.shape, x.dtype, buffer=base, offset=offset, strides=x.strides)


def _on_device(x):
    """A CuPy copy of ``x`` (a NumPy array, None, or anything else) with its strides: a view of a
    C-contiguous array copied whole and viewed the same way on the device."""
    if not isinstance(x, np.ndarray) or x.flags.c_contiguous or x.size == 0:
        return to_device(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x
    import cupy as cp

    base = to_device(x.base.reshape(-1).view(np.uint8))  # (strides positive: make_case, _wrong)
    offset = x.__array_interface__["data"][0] - x.base.__array_interface__["data"][0]
    raw = cp.ndarray(
        x.shape, np.uint8 if x.itemsize == 1 else x.dtype, base.data + offset, x.strides
    )
    return raw.view(x.dtype) if x.itemsize == 1 else raw


def _call_outcome(args, quantize, kw, device=False):
    from ropekv.bench.timing import clear_plans

    clear_plans()  # every call a first call (a device call's plan would replay)
    args = dict(args)  # the caches copied as they are (the op writes them), the rest read only
    args["paged_kv_cache"] = tuple(map(_strided_copy, args["paged_kv_cache"]))
    if device:
        args = {
            k: tuple(map(_on_device, x)) if k == "paged_kv_cache" else _on_device(x)
            for k, x in args.items()
        }
        kw = {k: _on_device(x) for k, x in kw.items()}
    try:
        out = call(args, quantize=quantize, **kw)
    except (TypeError, ValueError, BufferError) as e:
        return type(e).__name__, str(e)
    caches = tuple(to_numpy(c).tobytes() for c in args["paged_kv_cache"])
    return "ok", tuple(to_numpy(o).tobytes() for o in out), caches


@pytest.mark.parametrize(
    "c_form, device",
    [(False, False), (True, False), pytest.param(True, True, marks=pytest.mark.gpu)],
)
def test_bound_checks_decide_as_the_checks_in_order(c_form, device, monkeypatch):
    """The checks of a first call bound in one call (``paged._check_bound``, C or Python form)
    give every call the outputs, cache bytes or error of the checks taken in order, on valid
    calls of every form and on calls with one argument wrong; on host arrays and on CuPy
    arrays (their views read from the arrays' structs)."""
    from ropekv import _arrays as ar
    from ropekv import _native, paged

    if c_form:
        module = _native.load()
        if module is None:
            pytest.skip(f"no C extension: {_native.state()}")
        module.configure_views(ar.ArrayView)
        monkeypatch.setattr(ar, "NATIVE_BIND_DIMS", [module.bind_dims])
    else:
        monkeypatch.setattr(ar, "NATIVE_BIND_DIMS", [None])
    bound = paged._check_bound
    took = []

    def counted(a, f):
        c = bound(a, f)
        took.append(c is not None)
        return c

    rng = np.random.default_rng(34)
    outcomes = []
    for seed in range(300):
        mla, Dn = bool(rng.integers(0, 2)), int(rng.choice([0, 8]))
        args = make_case(
            seed,
            mla=mla,
            Dn=Dn if not mla else 8,
            kv_layout=str(rng.choice(["NHD", "HND"])),
            cache_dtype=rng.choice([E4M3, E5M2]),
            index_dtypes=tuple(rng.choice([np.int32, np.int64], 5)),
            per_head=bool(rng.integers(0, 2)),
            T=int(rng.choice([0, 1, 7])),
        )
        quantize, kw = bool(rng.integers(0, 2)), {}
        if rng.integers(0, 3) == 0:
            T, Hq, R = args["q_rope"].shape
            kw["q_rope_out"] = np.zeros((T, Hq, R), args["paged_kv_cache"][0].dtype)
        if not quantize:
            kw["quantize_dtype"] = args["paged_kv_cache"][0].dtype
        if rng.integers(0, 6) == 0:  # every dim bound, but a rule past the binding broken
            args = (_odd_rotary_dim, _no_q_heads, _v_head_dim_off)[int(rng.integers(0, 3))](args)
            kw.pop("q_rope_out", None)
        elif rng.integers(0, 4):  # one thing wrong
            name = str(rng.choice([n for n, x in args.items() if x is not None]))
            x = args[name]
            if name == "paged_kv_cache":
                k = int(rng.integers(0, 2))
                x = tuple(_wrong(rng, c) if i == k else c for i, c in enumerate(x))
            elif isinstance(x, np.ndarray):
                x = _wrong(rng, x)
            elif name == "page_size":
                x = rng.choice([0, -4, 2, 8, x])
            elif name == "kv_layout":
                x = rng.choice(["NHD", "HND", "nhd"])
            args[name] = x
        monkeypatch.setattr(paged, "_check_bound", counted)
        with_bound = _call_outcome(args, quantize, kw, device)
        monkeypatch.setattr(paged, "_check_bound", lambda a, f: None)
        in_order = _call_outcome(args, quantize, kw, device)
        assert with_bound == in_order, (seed, with_bound[:2], in_order[:2])
        outcomes.append(with_bound[0])
    assert sum(took) > 80 and took.count(False) > 80  # both ways taken
    assert outcomes.count("ok") > 80 and len(set(outcomes)) >= 3  # valid calls and errors


def test_read_only_cache_is_refused():
    args = make_case(28, Dn=8)
    args["paged_kv_cache"][1].flags.writeable = False
    with pytest.raises(BufferError, match="v_cache is written in place"):
        call(args)


def bad_option(
    match, exc=ValueError, quantize=True, q_dyn=False, kv_dyn=False, case=None, **changes
):
    """One validation rule of the options: ``changes`` applied after ``with_options``."""
    args = with_options(case or make_case(20, Dn=8), np.random.default_rng(5), q_dyn, kv_dyn)
    args.update(changes)
    with pytest.raises(exc, match=match):
        call(args, quantize=quantize)


def test_q_scale_out_excludes_quant_scale_q():
    bad_option(
        "quant_scale_q .* and q_scale_out .* exclude each other",
        q_dyn=True,
        quant_scale_q=np.ones(4, np.float32),
    )


def test_q_scale_out_needs_an_fp8_dtype():
    fp16 = make_case(20, Dn=8, cache_dtype=F16)
    bad_option(
        "q_scale_out is only used with a float8 k_cache, but k_cache is float16",
        quantize=False,
        q_dyn=True,
        case=fp16,
    )
    int8 = make_case(20, Dn=8)
    int8["paged_kv_cache"] = tuple(c.view(I8) for c in int8["paged_kv_cache"])
    bad_option(
        "q_scale_out is only used with a float8 k_cache, but k_cache is int8",
        q_dyn=True,
        kv_dyn=True,
        case=int8,
    )


def test_q_scale_out_dtype_and_shape():
    bad_option(
        "q_scale_out must have dtype float32",
        TypeError,
        q_dyn=True,
        q_scale_out=np.zeros((7, 4), np.float16),
    )
    bad_option(
        r"q_scale_out must have shape \(nnz, Hq\)",
        q_dyn=True,
        q_scale_out=np.zeros((7, 5), np.float32),
    )


def test_kv_cache_scales_refused_for_mla():
    mla = make_case(20, Dn=8, mla=True, Hkv=1)
    args = dict(
        mla,
        quant_scale_kv=None,
        kv_cache_scales=tuple(np.zeros(c.shape[:-1], np.float32) for c in mla["paged_kv_cache"]),
    )
    with pytest.raises(ValueError, match="no heads to scale"):
        call(args)


def test_int8_quantize_dtype_needs_kv_cache_scales():
    bad_option("an int8 quantize_dtype needs kv_cache_scales", quantize_dtype="int8")


def test_kv_cache_scales_is_a_pair():
    bad_option(
        "kv_cache_scales must be a pair",
        kv_dyn=True,
        kv_cache_scales=np.zeros((10, 4, 2), np.float32),
    )
    bad_option(
        "kv_cache_scales must be a pair",
        kv_dyn=True,
        kv_cache_scales=(np.zeros((10, 4, 2), np.float32), None),
    )


def test_kv_cache_scales_shape_follows_layout_and_dtype():
    args = with_options(make_case(20, Dn=8), np.random.default_rng(6), kv_dyn=True)
    num_pages = args["paged_kv_cache"][0].shape[0]
    hnd = (np.zeros((num_pages, 2, 4), np.float32),) * 2
    bad_option(
        r"k_scales must have shape \(num_pages, page_size, Hkv\) for NHD",
        kv_dyn=True,
        kv_cache_scales=hnd,
    )
    bad_option(
        "v_scales must have dtype float32",
        TypeError,
        kv_dyn=True,
        kv_cache_scales=(args["kv_cache_scales"][0], np.zeros((num_pages, 4, 2), np.float16)),
    )


def test_status_dtype_and_shape():
    bad_option("status must have dtype int32", TypeError, status=np.zeros(1, np.int64))
    bad_option(r"status must have shape \(1,\)", status=np.zeros(2, np.int32))


def test_option_arrays_must_not_overlap_the_caches():
    args = with_options(make_case(20, Dn=8), np.random.default_rng(7), kv_dyn=True)
    k_scales = args["kv_cache_scales"][0]
    with pytest.raises(ValueError, match="overlap|share"):
        call(dict(args, kv_cache_scales=(k_scales, k_scales)))


# ---------------------------------------------------------------------------------------------
# GPU: the kernel against the reference


def device_args(args):
    """CuPy copies; q/k/v sliced from one packed host buffer stay slices of one device buffer."""
    import cupy as cp

    out = {}
    base = args["q_rope"].base
    if base is not None and all(
        args[n] is None or args[n].base is base for n in ("k_rope", "q_nope", "k_nope", "v")
    ):
        dev = cp.asarray(base)
        start = base.__array_interface__["data"][0]
        for n in ("q_rope", "k_rope", "q_nope", "k_nope", "v"):
            x = args[n]
            if x is None:
                out[n] = None
                continue
            off = (x.__array_interface__["data"][0] - start) // x.itemsize
            out[n] = cp.ndarray(x.shape, x.dtype, dev.data + off * x.itemsize, strides=x.strides)
    for n, x in args.items():
        if n == "paged_kv_cache":
            out[n] = tuple(to_device(c) for c in x)
        else:
            out.setdefault(n, to_device(x))
    return out


def with_mrope(args, rng, interleaved, bad_share=0.1):
    """``args`` with (3, T) mRoPE pos_ids (the temporal row the old pos_ids, the others random,
    a few out of range) and the keywords that go with them."""
    P, R = args["cos_sin_cache"].shape
    T = args["pos_ids"].shape[0]
    ids = np.stack([args["pos_ids"]] + [rng.integers(0, P, T) for _ in range(2)]).astype(np.int64)
    bad = rng.random(T) < bad_share
    ids[rng.integers(0, 3, bad.sum()), np.flatnonzero(bad)] = rng.choice([-1, P], bad.sum())
    x = (R // 2) // 3
    args = dict(args, pos_ids=ids.astype(args["pos_ids"].dtype))
    return args, {"mrope_section": (R // 2 - 2 * x, x, x), "mrope_interleaved": interleaved}


def with_options(args, rng, q_dyn=False, kv_dyn=False, status=False):
    """``args`` with the option arrays: ``q_scale_out`` (dynamic Q), ``kv_cache_scales``
    (per-token-head KV scales; random bytes, to catch stray writes) and ``status``, and the
    static scales they replace left out."""
    T, Hq, _ = args["q_rope"].shape
    args = dict(args)
    if q_dyn:
        args["q_scale_out"] = random_bytes(rng, (T, Hq), F32)
        args["quant_scale_q"] = None
    if kv_dyn:
        shape = args["paged_kv_cache"][0].shape[:-1]
        args["kv_cache_scales"] = tuple(random_bytes(rng, shape, F32) for _ in range(2))
        args["quant_scale_kv"] = None
    if status:
        args["status"] = np.full((1,), -7, np.int32)
    return args


def check_against_reference(args, quantize, is_neox=True, prealloc=False, mrope=None):
    dev = device_args(args)
    T, Hq, R = args["q_rope"].shape
    Dn = 0 if args["q_nope"] is None else args["q_nope"].shape[-1]
    out = args["paged_kv_cache"][0].dtype
    kw = {}
    if prealloc:
        import cupy as cp

        kw["q_rope_out"] = (
            cp.zeros((T, Hq, R + 8), cp.uint8).view(out)[..., 4 : R + 4]
            if out.itemsize == 1
            else cp.zeros((T, Hq, R), out)
        )
    expected = copy_args(args)
    one = lambda x: 1.0 if x is None else x
    exp_q, exp_n = reference.rope_append_paged_kv_cache(
        expected["q_rope"],
        expected["k_rope"],
        expected["q_nope"],
        expected["k_nope"],
        expected["v"],
        expected["cos_sin_cache"],
        expected["pos_ids"],
        expected["paged_kv_cache"],
        expected["kv_indices"],
        expected["kv_indptr"],
        expected["batch_indices"],
        expected["positions"],
        is_neox,
        one(expected["quant_scale_q"]),
        one(expected["quant_scale_kv"]),
        args["page_size"],
        args["kv_layout"],
        np.zeros((T, Hq, R), out),
        np.zeros((T, Hq, Dn), out),
        **(mrope or {}),
        q_scale_out=expected.get("q_scale_out"),
        kv_cache_scales=expected.get("kv_cache_scales"),
    )
    q, n = call(dev, quantize, is_neox=is_neox, **kw, **(mrope or {}))
    if prealloc:
        assert q is kw["q_rope_out"]
    assert type(q).__module__.startswith("cupy")
    if "status" in args:
        assert int(to_numpy(dev["status"])[0]) == 0, "status of a well-formed kv_indptr"
    check = assert_codes_close if out == I8 else assert_close
    # dynamic q scales stretch each head row to the fp8 range: a rotated value that cancels to
    # near zero may then differ from the float64 reference by the row's float32 error (a few
    # ulps of the largest code), beyond one code where codes are that dense
    more = (
        {"fp8_atol": 8 * 2.0**-24 * float(ml_dtypes.finfo(out).max)}
        if "q_scale_out" in args and out != I8
        else {}
    )
    check(to_numpy(q), exp_q, "q_rope_out", **more)  # every row: unrotated without a position
    check(to_numpy(n), exp_n, "q_nope_out", **more)
    if "q_scale_out" in args:
        assert_close(dev["q_scale_out"], expected["q_scale_out"], "q_scale_out")
    scales = None
    if "kv_cache_scales" in args:
        scales = (dev["kv_cache_scales"], expected["kv_cache_scales"], args["kv_cache_scales"])
    check_caches(
        dev["paged_kv_cache"], expected["paged_kv_cache"], args["paged_kv_cache"], args, scales
    )


GQA_HEADS = [(32, 8), (64, 8), (24, 6), (64, 16), (8, 8)]


@st.composite
def cases(draw):
    mla = draw(st.booleans())
    dtype = draw(st.sampled_from([F16, BF16]))
    quantize = draw(st.booleans())
    cache_dtype = draw(st.sampled_from(FP8 if quantize else (dtype, *FP8)))
    T = draw(st.sampled_from([1, 19, 199, 2047]))
    if mla:
        Hq = draw(st.sampled_from([128, 1]))
        if Hq == 128:
            T = min(T, 199)
        kw = {"mla": True, "Hq": Hq, "Hkv": 1, "R": 64, "Dn": 512}
    else:
        Hq, Hkv = draw(st.sampled_from(GQA_HEADS))
        D = draw(st.sampled_from([64, 128, 256]))
        R = draw(st.sampled_from([D, D // 2]))
        if T * Hq * D > 4 << 20:
            T = 199
        kw = {
            "Hq": Hq,
            "Hkv": Hkv,
            "R": R,
            "Dn": D - R,
            "kv_layout": draw(st.sampled_from(["NHD", "HND"])),
            "packed": draw(st.booleans()),
        }
    idx = tuple(draw(st.sampled_from([np.int32, np.int64])) for _ in INDEX_NAMES)
    case = make_case(
        draw(seeds),
        T=T,
        dtype=dtype,
        cache_dtype=cache_dtype,
        page_size=draw(st.sampled_from([1, 16, 32, 128])),
        B=draw(st.integers(1, min(T, 8))),
        index_dtypes=idx,
        padding=draw(st.sampled_from([0, 0, 3])),
        per_head=draw(st.booleans()),
        **kw,
    )
    return (
        case,
        quantize,
        draw(st.booleans()),
        draw(st.booleans()),
        draw(st.sampled_from([None, None, "chunked", "interleaved"])),
    )


@pytest.mark.gpu
@given(case=cases(), seed=seeds)
def test_kernel_matches_reference(case, seed):
    args, quantize, is_neox, prealloc, mrope = case
    kw = None
    if mrope:
        args, kw = with_mrope(args, np.random.default_rng(seed), mrope == "interleaved")
    check_against_reference(args, quantize, is_neox, prealloc, kw)


@st.composite
def option_cases(draw):
    """A case of ``cases`` with some of the options on: dynamic Q (fp8 outputs), per-token-head
    KV scales (GQA/MHA; fp8 or int8 caches) and status, alone and together."""
    args, quantize, is_neox, prealloc, mrope = draw(cases())
    out = args["paged_kv_cache"][0].dtype
    mla = args["k_rope"].ndim == 2
    q_dyn = out in FP8 and draw(st.booleans())
    kv_dyn = not mla and out.itemsize == 1 and draw(st.booleans())
    if kv_dyn and draw(st.integers(0, 2)) == 0:  # int8: with per-token-head scales only
        kv_dyn, q_dyn = True, False
        args = dict(args, paged_kv_cache=tuple(c.view(I8) for c in args["paged_kv_cache"]))
    status = draw(st.booleans()) or not (q_dyn or kv_dyn)
    return args, quantize, is_neox, prealloc, mrope, (q_dyn, kv_dyn, status)


@pytest.mark.gpu
@given(case=option_cases(), seed=seeds)
def test_options_match_reference(case, seed):
    """q_scale_out, kv_cache_scales and status (the option kernel) against the reference, with
    mRoPE, layouts, rope styles, nope dims, packed inputs and padding drawn as in the plain test;
    every untouched cache row and scale entry byte-identical."""
    args, quantize, is_neox, prealloc, mrope, (q_dyn, kv_dyn, status) = case
    rng = np.random.default_rng(seed)
    kw = None
    if mrope:
        args, kw = with_mrope(args, rng, mrope == "interleaved")
    args = with_options(args, rng, q_dyn, kv_dyn, status)
    check_against_reference(args, quantize, is_neox, prealloc, kw)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "row_block, wave_blocks, prefill_rows",
    [(256, 1320, 4), (64, 0, 4), (32, 0, 1), (512, 10**9, 4)],
)
def test_options_on_every_row_kernel_shape(row_block, wave_blocks, prefill_rows, monkeypatch):
    """Computed scales reduce a row over its lane group in shared memory: groups split over
    blocks, 1 or 4 rows a group, lane groups that are not a power of two (D 128 with R 64: 12
    lanes) and MLA's 68-lane Q rows."""
    from ropekv import paged

    for key, value in (
        ("row_block", row_block),
        ("wave_blocks", wave_blocks),
        ("prefill_rows", prefill_rows),
        ("max_row_block", 512),
    ):
        monkeypatch.setitem(paged.TUNING, key, value)
    rng = np.random.default_rng(60)
    gqa = make_case(61, T=77, B=3, Hq=32, Hkv=8, R=64, Dn=64, page_size=16, packed=True)
    check_against_reference(with_options(gqa, rng, True, True, True), quantize=True)
    hnd = make_case(
        62, T=19, B=5, Hq=8, Hkv=8, R=128, page_size=16, kv_layout="HND", cache_dtype=I8
    )
    check_against_reference(with_options(hnd, rng, False, True, True), quantize=False)
    mla = make_case(63, T=9, B=9, Hq=16, Hkv=1, R=64, Dn=512, mla=True, dtype=BF16, page_size=16)
    check_against_reference(with_options(mla, rng, True, False, True), quantize=True, is_neox=False)


@pytest.mark.gpu
@pytest.mark.parametrize("indptr, code", BAD_INDPTR)
@pytest.mark.parametrize("options", [(False, False), (True, True)])
def test_status_failure_writes_nothing(indptr, code, options):
    """A malformed kv_indptr: status holds the first failing check's code and the caches, the
    scale arrays and the given q outputs keep every byte."""
    import cupy as cp

    rng = np.random.default_rng(70)
    args = make_case(71, T=40, B=2, Hq=8, Hkv=2, R=64, Dn=64, page_size=4)
    args = with_options(malformed(args, indptr), rng, *options, status=True)
    dev = device_args(args)
    T, Hq, R = args["q_rope"].shape
    q_out = cp.asarray(random_bytes(rng, (T, Hq, R), np.uint8)).view(E4M3)
    n_out = cp.asarray(random_bytes(rng, (T, Hq, 64), np.uint8)).view(E4M3)
    before = [to_numpy(x).copy() for x in (q_out, n_out)]
    call(dev, q_rope_out=q_out, q_nope_out=n_out)
    assert int(dev["status"].get()[0]) == code
    for got, old, name in zip((q_out, n_out), before, ("q_rope_out", "q_nope_out")):
        assert_bytes_equal(got, old, name)
    for got, old in zip(dev["paged_kv_cache"], args["paged_kv_cache"]):
        assert_bytes_equal(got, old, "cache")
    for name in ("q_scale_out", "kv_cache_scales"):
        if name in args:
            for got, old in zip(
                *(
                    (dev[name], args[name])
                    if name == "kv_cache_scales"
                    else ((dev[name],), (args[name],))
                )
            ):
                assert_bytes_equal(got, old, name)


def _bad_indptrs(indptr, num_indices):
    """(kv_indptr, code) pairs breaking a valid table of any length each way: a first entry
    other than 0 (4), an entry below the one before it (5), a last one past kv_indices (6)."""
    first = np.array(indptr)
    first[0] = 1
    down = np.array(indptr)
    down[len(down) // 2] = down[len(down) // 2 + 1] + 1
    last = np.array(indptr)
    last[-1] = num_indices + 1
    return [(first, 4), (down, 5), (last, 6)]


@pytest.mark.gpu
@pytest.mark.parametrize("B", [9, 40])
def test_status_alone_in_the_section_kernel(B, monkeypatch):
    """status= as the only option where the call runs the section kernel (MLA's 576-element
    rows): its status variant runs, writes the reference's outputs and code 0 on a valid table,
    and on a malformed one the code and nothing else (B 9: a warp's vote; 40: the block's)."""
    import cupy as cp

    from ropekv import paged

    seen = []
    real = paged.Launch
    monkeypatch.setattr(
        paged,
        "Launch",
        lambda stem, expression, *a, **k: (
            seen.append(expression),
            real(stem, expression, *a, **k),
        )[1],
    )
    paged._MLA.clear()
    rng = np.random.default_rng(80 + B)
    mla = make_case(81, T=B, B=B, Hq=16, Hkv=1, R=64, Dn=512, mla=True, dtype=BF16, page_size=16)
    check_against_reference(with_options(mla, rng, status=True), quantize=True, is_neox=False)
    assert seen and all(e.startswith(paged.KERNEL + "_status<") for e in seen), seen
    for indptr, code in _bad_indptrs(mla["kv_indptr"], mla["kv_indices"].shape[0]):
        args = with_options(malformed(mla, indptr), rng, status=True)
        dev = device_args(args)
        T, Hq, R = args["q_rope"].shape
        q_out = cp.asarray(random_bytes(rng, (T, Hq, R), np.uint8)).view(E4M3)
        n_out = cp.asarray(random_bytes(rng, (T, Hq, 512), np.uint8)).view(E4M3)
        before = [to_numpy(x).copy() for x in (q_out, n_out)]
        call(dev, is_neox=False, q_rope_out=q_out, q_nope_out=n_out)
        assert int(dev["status"].get()[0]) == code, (indptr, code)
        for got, old, name in zip((q_out, n_out), before, ("q_rope_out", "q_nope_out")):
            assert_bytes_equal(got, old, name)
        for got, old in zip(dev["paged_kv_cache"], args["paged_kv_cache"]):
            assert_bytes_equal(got, old, "cache")
    assert all(e.startswith(paged.KERNEL + "_status<") for e in seen), seen


@pytest.mark.gpu
def test_status_of_an_empty_batch_is_written():
    """No tokens: one block validates and writes the code (0 or the failing check's)."""
    for indptr, code in (([0, 0], 0), ([0, 5], 6), ([2, 2], 4)):
        args = make_case(72, T=0, B=1)
        args = dict(malformed(args, indptr), status=np.full((1,), -7, np.int32))
        dev = device_args(args)
        call(dev)
        assert int(dev["status"].get()[0]) == code


def _poison_indices(args, dtype=np.int32, indptr=True):
    """Garbage in a call's index arrays (at least 13 tokens, 2 requests): batch indices and
    positions past both ends of their ranges and negative, ``kv_indptr[1]`` at the dtype's
    largest value (``indptr``), every other page id at its smallest, two positions past the
    table; int64 arrays also get entries whose low 32 bits are in range and whose high bits are
    not (a position, a batch index, ``kv_indptr[2]``, a page id): the lean kernels' 32-bit index
    chain must read them as out of range. Returns ``args``."""
    big = np.iinfo(dtype)
    args["batch_indices"][:4] = [big.max, big.min, 2, -1]
    args["positions"][4:8] = [big.max, big.min, -1, 1 << 20]
    if indptr:
        args["kv_indptr"][1] = big.max
    args["kv_indices"][::2] = big.min
    args["pos_ids"][8:10] = [big.max, big.min]
    if np.dtype(dtype) == np.int64:
        args["positions"][11] = (1 << 40) + 3
        args["batch_indices"][12] = -(1 << 40)
        args["kv_indices"][1] += 1 << 32
        if indptr:
            args["kv_indptr"][2] += 1 << 32
    return args


def _mla(Hq):
    """make_case's DeepSeek MLA shape (latent 512, rope 64, bf16, pages of 16) with Hq heads."""
    return {"Hq": Hq, "Hkv": 1, "R": 64, "Dn": 512, "mla": True, "dtype": BF16, "page_size": 16}


@pytest.mark.gpu
def test_hostile_indices_with_options_never_write_out_of_bounds():
    import cupy as cp

    args = _poison_indices(make_case(31, T=16, B=2, Hq=8, Hkv=2, R=32, Dn=32), indptr=False)
    check_against_reference(
        with_options(args, np.random.default_rng(73), True, True, True), quantize=True
    )
    cp.cuda.Device().synchronize()


@pytest.mark.gpu
def test_dynamic_scales_decode_and_prefill_shapes():
    """Llama-like decode (64 requests of one token) and prefill with both computed scales."""
    rng = np.random.default_rng(74)
    for T, B in ((512, 2), (64, 64)):
        args = make_case(75, T=T, B=B, Hq=32, Hkv=8, R=128, page_size=16, packed=True)
        check_against_reference(with_options(args, rng, True, True, False), quantize=True)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [F16, E4M3, E5M2])
def test_llama_prefill_and_decode_shapes(cache_dtype):
    for T, B in ((512, 2), (64, 64)):
        args = make_case(
            30, T=T, B=B, Hq=32, Hkv=8, R=128, page_size=16, cache_dtype=cache_dtype, packed=True
        )
        check_against_reference(args, quantize=cache_dtype in FP8)


# the launch shapes `ropekv bench --tune` times: (unroll, rot_unroll, min blocks/SM)
VARIANTS = ((4, 1, 4), (2, 2, 4), (4, 2, 3), (4, 1, 1), (2, 1, 6), (2, 1, 1), (1, 1, 8), (1, 1, 1))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_launch_shape_matches_reference(variant, monkeypatch):
    from ropekv import paged

    monkeypatch.setitem(paged.TUNING, "row_group", 0)  # the section kernel for every shape
    monkeypatch.setitem(paged.TUNING, "wide_rows_below", 0)
    for block in (128, 256):
        monkeypatch.setitem(paged.TUNING, "light", variant)
        monkeypatch.setitem(paged.TUNING, "heavy", variant)
        monkeypatch.setitem(paged.TUNING, "max_block", block)
        check_against_reference(
            make_case(50, T=77, B=3, Hq=32, Hkv=8, R=64, Dn=64, page_size=16, packed=True),
            quantize=True,
        )
        check_against_reference(
            make_case(51, T=9, B=9, Hq=16, Hkv=1, R=64, Dn=512, mla=True, dtype=BF16, page_size=16),
            quantize=True,
            is_neox=False,
        )


@pytest.mark.gpu
@pytest.mark.parametrize(
    "row_block, wave_blocks, prefill_rows", [(128, 660, 4), (64, 10**9, 4), (256, 0, 3), (32, 0, 1)]
)
def test_every_row_kernel_shape_matches_reference(
    row_block, wave_blocks, prefill_rows, monkeypatch
):
    """The row kernel split over blocks (decode) and a block per token (prefill), rows per lane
    group 1 to 4, GQA with a nope part, MHA, and MLA forced onto it."""
    from ropekv import paged

    for key, value in (
        ("row_block", row_block),
        ("wave_blocks", wave_blocks),
        ("prefill_rows", prefill_rows),
        ("max_row_block", 256),
        ("row_group", 128),
    ):
        monkeypatch.setitem(paged.TUNING, key, value)
    check_against_reference(
        make_case(52, T=77, B=3, Hq=32, Hkv=8, R=64, Dn=64, page_size=16, packed=True),
        quantize=True,
    )
    check_against_reference(
        make_case(53, T=19, B=19, Hq=8, Hkv=8, R=128, page_size=16, cache_dtype=F16), quantize=False
    )
    check_against_reference(
        make_case(54, T=9, B=9, **_mla(16)),
        quantize=True,
        is_neox=False,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("row_group", [32, 0])
def test_hostile_indices_never_write_out_of_bounds(row_group, monkeypatch):
    import cupy as cp

    from ropekv import paged

    monkeypatch.setitem(paged.TUNING, "row_group", row_group)  # row kernel, section kernel
    monkeypatch.setitem(paged.TUNING, "wide_rows_below", 0)
    args = _poison_indices(make_case(31, T=16, B=2))
    check_against_reference(args, quantize=True)
    cp.cuda.Device().synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("Hq", [128, 16])
@pytest.mark.parametrize("wide_row_block", [256, 72])
def test_mla_decode_on_the_row_kernel(Hq, wide_row_block, monkeypatch):
    """DeepSeek MLA decode (latent 512, rope 64, bf16 -> fp8; 128 heads and 16 under tensor
    parallelism) on the row kernel: one, two and four rows a lane group, padding tokens, both
    RoPE styles (72- and 68-lane rows), int64 indices."""
    from ropekv import paged

    monkeypatch.setitem(paged.TUNING, "wide_row_block", wide_row_block)
    monkeypatch.setitem(paged.TUNING, "wide_rows_below", 1 << 30)  # every T below: the row kernel
    monkeypatch.setitem(paged.TUNING, "wide_row_single_from", 1 << 30)
    mla = _mla(Hq)
    for T, neox in ((1, False), (4, True), (16, False), (33, False), (63, True)):
        assert _choose(T, Hq, 1, 64, 512, True, is_neox=neox).shape[0] == "rows"
        args = make_case(100 + T, T=T, B=min(T, 5), padding=T // 4, **mla)
        check_against_reference(args, quantize=True, is_neox=neox)
    args = make_case(99, T=8, B=3, index_dtypes=np.int64, cache_dtype=E5M2, **mla)
    check_against_reference(args, quantize=True, is_neox=False)


@pytest.mark.gpu
def test_hostile_indices_on_the_mla_row_kernel():
    """Garbage indices on MLA decode's row kernel: nothing written out of bounds."""
    import cupy as cp

    args = _poison_indices(make_case(33, T=16, B=2, **_mla(16)))
    assert _choose(16, 16, 1, 64, 512, True).shape[0] == "rows"
    check_against_reference(args, quantize=True, is_neox=False)
    cp.cuda.Device().synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(8, 1), (4, 1), (2, 1), (32, 8)])
@pytest.mark.parametrize("row_tokens_upto", [128, 512])
def test_row_kernel_with_several_tokens_a_block(heads, row_tokens_upto, monkeypatch):
    """The row kernel's prefill blocks of several tokens (GQA under tensor parallelism): a last
    block with spare tokens, padding, a nope part (12-lane rows), HND, fp16 caches, mRoPE."""
    from ropekv import paged

    monkeypatch.setitem(paged.TUNING, "row_tokens_upto", row_tokens_upto)
    monkeypatch.setitem(paged.TUNING, "wave_blocks", 0)  # the prefill shape at a test's size
    Hq, Hkv = heads
    rng = np.random.default_rng(110)
    for T, B, R, Dn in ((77, 3, 128, 0), (1, 1, 128, 0), (45, 5, 64, 64)):
        args = make_case(
            111 + T, T=T, B=B, Hq=Hq, Hkv=Hkv, R=R, Dn=Dn, page_size=16, padding=3, packed=True
        )
        check_against_reference(args, quantize=True)
    args = make_case(112, T=50, B=2, Hq=Hq, Hkv=Hkv, R=128, page_size=8, kv_layout="HND")
    check_against_reference(args, quantize=True, is_neox=False)
    args = make_case(113, T=29, B=4, Hq=Hq, Hkv=Hkv, R=128, page_size=16, cache_dtype=F16)
    check_against_reference(args, quantize=False)
    args, kw = with_mrope(
        make_case(114, T=61, B=3, Hq=Hq, Hkv=Hkv, R=128, page_size=16), rng, False
    )
    check_against_reference(args, quantize=True, mrope=kw)


@pytest.mark.gpu
def test_torch_cuda_tensors_in_torch_out():
    torch = pytest.importorskip("torch")
    args = make_case(32, T=33, Hq=8, Hkv=2, R=64, Dn=64, cache_dtype=E4M3)
    dev = device_args(args)
    t = {
        n: torch.from_dlpack(x) if hasattr(x, "__dlpack__") and x.dtype.itemsize > 1 else x
        for n, x in dev.items()
    }
    t["paged_kv_cache"] = tuple(
        torch.from_dlpack(c.view(np.uint8)).view(torch.float8_e4m3fn) for c in dev["paged_kv_cache"]
    )
    q, n = call(t)
    torch.cuda.synchronize()
    assert isinstance(q, torch.Tensor) and q.is_cuda and q.dtype == torch.float8_e4m3fn
    expected = copy_args(args)
    exp_q, exp_n = call(expected)
    assert_close(q, exp_q)
    assert_close(n, exp_n)
    assert_close(t["paged_kv_cache"][1], expected["paged_kv_cache"][1])


@pytest.mark.gpu
def test_repeated_calls_reuse_the_launch_and_read_new_values():
    """A repeated call of one layout replays its plan (no new plan) and reads the arrays' current
    contents."""
    import cupy as cp

    from ropekv import paged

    args = make_case(33, T=40, B=3, Hq=8, Hkv=2, R=32, Dn=32, cache_dtype=E4M3)
    dev = device_args(args)
    call(dev)
    plans = len(paged._GQA.plans)
    rng = np.random.default_rng(0)
    args["q_rope"] = random(rng, args["q_rope"].shape, F16)
    args["pos_ids"] = rng.permutation(args["pos_ids"]).astype(np.int32)
    dev["q_rope"][...] = cp.asarray(args["q_rope"])
    dev["pos_ids"][...] = cp.asarray(args["pos_ids"])
    q, _ = call(dev)
    assert len(paged._GQA.plans) == plans
    expected = copy_args(args)
    exp_q, _ = call(expected)
    assert_close(q, exp_q, "second call")


@pytest.mark.gpu
def test_explicit_stream():
    import cupy as cp

    args = make_case(34, T=50, Dn=16)
    dev = device_args(args)
    cp.cuda.Device().synchronize()  # the copies ran on the null stream: order them first
    stream = cp.cuda.Stream(non_blocking=True)
    q, _ = call(dev, stream=stream)
    q2, _ = call(dev, stream=stream)  # the cached plan keeps the stream
    stream.synchronize()
    expected = copy_args(args)
    exp_q, _ = call(expected)
    assert_close(q, exp_q)
    assert_close(q2, exp_q)


# ---------------------------------------------------------------------------------------------
# GPU: FlashInfer 0.7.2 on identical torch inputs


def flashinfer_or_skip():
    pytest.importorskip("torch")
    try:
        import flashinfer.rope
    except Exception as exc:  # noqa: BLE001 - not installed, or its JIT build failed
        pytest.skip(f"flashinfer unavailable: {exc}")
    return flashinfer.rope


@pytest.mark.gpu
@pytest.mark.parametrize(
    "mla,R,Dn,layout,dtype,out,is_neox",
    [
        (False, 128, 0, "NHD", F16, E4M3, True),
        (False, 64, 64, "HND", BF16, E5M2, False),
        (False, 64, 64, "NHD", F16, E4M3, True),
        (True, 64, 512, "NHD", BF16, E4M3, True),
        (True, 64, 512, "NHD", F16, E4M3, False),
    ],
)
def test_matches_flashinfer(mla, R, Dn, layout, dtype, out, is_neox):
    fi = flashinfer_or_skip()
    import torch

    args = make_case(
        40,
        T=300,
        B=5,
        Hq=16 if mla else 32,
        Hkv=1 if mla else 8,
        R=R,
        Dn=Dn,
        mla=mla,
        dtype=dtype,
        cache_dtype=out,
        kv_layout=layout,
        page_size=16,
        packed=not mla,
    )
    names = {E4M3: torch.float8_e4m3fn, E5M2: torch.float8_e5m2}
    dev = device_args(args)

    def torch_args():
        t = {}
        for n, x in dev.items():
            if n == "paged_kv_cache":
                t[n] = tuple(torch.from_dlpack(c.view(np.uint8).copy()).view(names[out]) for c in x)
            elif x is not None and hasattr(x, "__dlpack__"):
                t[n] = (
                    torch.from_dlpack(x.view(np.int16)).view(torch.bfloat16)
                    if x.dtype == BF16
                    else torch.from_dlpack(x)
                )
            else:
                t[n] = x
        return t

    ours, theirs = torch_args(), torch_args()
    q1, n1 = call(ours, is_neox=is_neox)
    q2, n2 = fi.rope_quantize_fp8_append_paged_kv_cache(
        **theirs, is_neox=is_neox, quantize_dtype=names[out]
    )
    torch.cuda.synchronize()
    assert q1.dtype == q2.dtype and n1.shape == n2.shape and n1.dtype == n2.dtype
    assert_close(q1, to_numpy(q2), "q_rope_out vs FlashInfer")
    assert_close(n1, to_numpy(n2), "q_nope_out vs FlashInfer")
    for a, b in zip(ours["paged_kv_cache"], theirs["paged_kv_cache"]):
        assert_close(a, to_numpy(b), "cache vs FlashInfer")
        same = (to_numpy(a).view(np.uint8) == to_numpy(b).view(np.uint8)).mean()
        assert same > 0.999, f"only {same:.4%} of cache bytes identical to FlashInfer's"


def test_fp8_tolerance_of_a_stretched_row():
    """The fp8 check with ``fp8_atol`` (dynamic q scales): codes two apart are accepted only where
    their values lie within it (e5m2 subnormals 2 and 4 x 2^-16, as a rotation that cancels to
    near zero gave them on the H200), and one code apart always."""
    e5m2 = np.dtype(ml_dtypes.float8_e5m2)
    got = np.array([-2 * 2.0**-16, 1.0, 0.75], np.float32).astype(e5m2)
    ref = np.array([-4 * 2.0**-16, 1.0, 0.875], np.float32).astype(e5m2)
    assert_close(got, ref, "near zero", fp8_atol=1e-4)
    with pytest.raises(AssertionError, match="differ by more than one"):
        assert_close(got, ref, "near zero")
    far = np.array([2.0, 1.0, 0.75], np.float32).astype(e5m2)  # 2.0 against 2.5: a code apart
    assert_close(far, np.array([2.5, 1.0, 0.75], np.float32).astype(e5m2), "one code")
    with pytest.raises(AssertionError, match="differ by more than one"):
        assert_close(
            np.array([2.0], np.float32).astype(e5m2),
            np.array([3.0], np.float32).astype(e5m2),
            "far",
            fp8_atol=1e-4,
        )


# ---------------------------------------------------------------------------------------------
# The lean kernel (plain decode calls: one chunk of one head row per thread)


def _choose_lean(*args, **kw):
    """:func:`_choose` as a device call makes it: with the lean kernel allowed (no mRoPE)."""
    from ropekv import paged

    real = paged._choose
    with pytest.MonkeyPatch.context() as m:
        m.setattr(paged, "_choose", lambda a, is_neox, c: real(a, is_neox, c, lean=True))
        return _choose(*args, **kw)


def test_lean_kernel_takes_plain_decode_calls(monkeypatch):
    """Plain calls below lean_below tokens take the lean kernel: blocks (G, S, 1) of a token's
    rows spread evenly (about lean_block threads), grid (T, splits); more blocks than
    lean_wave_blocks gather tokens. Options, lean_below tokens and more, and lean_below 0 keep
    the row / section kernels (mRoPE: _prepare passes lean=False)."""
    from ropekv import paged

    _lean_everywhere(monkeypatch)
    monkeypatch.setitem(paged.TUNING, "lean_block", 128)
    gqa = {"R": 128, "Dn": 0, "mla": False, "dtype": F16, "is_neox": True}
    tp8 = _choose_lean(16, 8, 1, **gqa)  # 10 rows of 8 lanes: one block a token
    assert tp8.shape == ("lean", False) and not tp8.opts
    assert (tp8.group, tp8.rows, tp8.tokens, tp8.splits) == (8, 10, 1, 1)
    llama = _choose_lean(64, 32, 8, **gqa)  # 48 rows: 3 blocks of 16 rows a token
    assert (llama.group, llama.rows, llama.tokens, llama.splits) == (8, 16, 1, 3)
    mla = {"Hkv": 1, "R": 64, "Dn": 512, "mla": True}
    one = _choose_lean(1, 128, **mla)  # 129 rows of 72 lanes: a block a row
    assert one.shape[0] == "lean" and (one.group, one.rows, one.splits) == (72, 1, 129)
    assert _choose_lean(1, 128, is_neox=True, **mla).group == 68
    wide = _choose_lean(256, 16, **mla)  # 17 x 256 blocks of a row: 3 rows a block
    assert (wide.rows, wide.tokens, wide.splits) == (3, 1, 6)
    assert _choose_lean(1, 8, 1, q_scale_out=object(), **gqa).shape == ("rows", 1)
    assert _choose_lean(1, 16, status=object(), **mla).shape[0] != "lean"
    # lean_below tokens and more: prefill, the lean kernel only from lean_prefill_from
    monkeypatch.setitem(paged.TUNING, "lean_prefill_from", 2048)
    assert _choose_lean(paged.TUNING["lean_below"], 8, 1, **gqa).shape[0] != "lean"
    assert _choose(1, 8, 1, **gqa).shape[0] == "rows"  # lean=False (mRoPE)
    monkeypatch.setitem(paged.TUNING, "lean_below", 0)
    assert _choose_lean(1, 8, 1, **gqa).shape == ("rows", 1)
    assert _choose_lean(1, 128, **mla).shape == ("rows", 1)


def _lean_everywhere(monkeypatch):
    """TUNING that gives the lean kernel every plain call it can serve below lean_below tokens
    (the thresholds of where it runs by default set aside: the tests cover the kernel)."""
    from ropekv import paged

    monkeypatch.setitem(paged.TUNING, "lean_narrow_from", 1)
    monkeypatch.setitem(paged.TUNING, "lean_wide_chunks", 1 << 62)


def test_where_the_lean_kernel_runs_by_default():
    """The shipped thresholds: GQA / MHA rows (at most row_group lanes) from lean_narrow_from
    tokens up to lean_below; MLA rows while T x rows x lanes is at most lean_wide_chunks."""
    from ropekv import paged

    gqa = {"R": 128, "Dn": 0, "mla": False, "dtype": F16, "is_neox": True}
    narrow_from = paged.TUNING["lean_narrow_from"]
    if narrow_from > 1:
        assert _choose_lean(narrow_from - 1, 32, 8, **gqa).shape[0] != "lean"
    assert _choose_lean(narrow_from, 32, 8, **gqa).shape[0] == "lean"
    assert _choose_lean(1, 8, 1, **gqa).shape[0] == "lean"  # every decode size (narrow_from 1)
    assert _choose_lean(paged.TUNING["lean_below"] - 1, 8, 1, **gqa).shape[0] == "lean"
    # and from lean_below on, prefill: from lean_prefill_from (lean_below: no row-kernel window)
    assert paged.TUNING["lean_prefill_from"] == paged.TUNING["lean_below"]
    assert _choose_lean(paged.TUNING["lean_below"], 8, 1, **gqa).shape[0] == "lean"
    mla = {"Hkv": 1, "R": 64, "Dn": 512, "mla": True}  # 72 lanes a row
    assert _choose_lean(4, 128, **mla).shape[0] == "lean"  # 4 x 129 x 72 chunks
    assert _choose_lean(16, 128, **mla).shape[0] != "lean"
    assert _choose_lean(16, 16, **mla).shape[0] == "lean"  # 16 x 17 x 72
    assert _choose_lean(64, 16, **mla).shape[0] != "lean"


def test_lean_shape_gathers_tokens_past_the_wave(monkeypatch):
    from ropekv import paged

    monkeypatch.setitem(paged.TUNING, "lean_block", 128)
    assert paged.lean_shape(1, 10, 8) == ((8, 10, 1), (1, 1))
    assert paged.lean_shape(256, 48, 8) == ((8, 16, 1), (256, 3))
    monkeypatch.setitem(paged.TUNING, "lean_wave_blocks", 0)
    assert paged.lean_shape(77, 10, 8) == ((8, 10, 3), (26, 1))  # 80-thread rows, 3 tokens
    assert paged.lean_shape(77, 6, 8) == ((8, 6, 5), (16, 1))  # 48-thread rows, 5 tokens
    # a token's narrow rows past lean_max_block threads: blocks of lean_split_block (Llama's 48
    # rows: 128 threads, not 192); wide rows keep lean_max_block
    assert paged.TUNING["lean_split_block"] == 128
    assert paged.lean_shape(77, 48, 8) == ((8, 16, 1), (77, 3))
    assert paged.lean_shape(77, 40, 16) == ((16, 8, 1), (77, 5))
    assert paged.lean_shape(5, 129, 72) == ((72, 3, 1), (5, 43))
    monkeypatch.setitem(paged.TUNING, "lean_split_block", 256)
    assert paged.lean_shape(77, 48, 8) == ((8, 24, 1), (77, 2))
    for T, H, G in ((1, 129, 72), (300, 6, 16), (4000, 48, 8), (9, 3, 256)):
        (gx, gy, gz), (bx, by) = paged.lean_shape(T, H, G)
        assert gx == G and gx * gy * gz <= paged.LEAN_THREADS and gz <= 64
        assert gy * by >= H and gz * bx >= T


def test_lean_offsets_widen_past_31_bits():
    """The lean kernel's offsets are 32-bit while every array's span (inputs, q outputs, caches,
    the table) and every index value a slot can use fit in 31 bits, 64-bit otherwise."""
    from types import SimpleNamespace as NS

    from ropekv import paged

    c = NS(T=4, Hq=8, Hkv=1, R=128, Dn=0, num_pages=10, page_size=16, P=4096)
    wide = [NS(size=1, span=(0, 1 << 40))]  # arrays whose spans bound nothing: the exact span
    values = dict.fromkeys(paged._STRIDES, 0)
    values.update(qr_sn=1152, qr_sh=128, kr_sn=1152, kr_sh=128, cs_sp=128)
    values.update(krc_sp=2048, krc_se=128, vc_sp=2048, vc_se=128)
    assert paged._lean_span(values, c) == 4095 * 128 + 128
    assert paged._lean_span(values, c) <= paged.INT32_SPAN
    values["vc_sp"] = 1 << 28  # 10 pages of 2**28 elements
    assert paged._lean_span(values, c) > paged.INT32_SPAN
    values["vc_sp"], values["qr_sn"] = 2048, -(1 << 30)  # a negative stride counts its size
    assert paged._lean_span(values, c) > paged.INT32_SPAN
    # and 64-bit index arithmetic where an index value a slot can use may pass 31 bits
    values.update(qr_sn=1152, B=3, num_indices=40)
    assert not paged._lean_wide(values, c, wide)
    values["num_indices"] = (1 << 31) // 16  # positions up to 2**31 would have a slot
    assert paged._lean_wide(values, c, wide)
    values["num_indices"], values["B"] = 40, 2**31 - 1
    assert paged._lean_wide(values, c, wide)
    values["B"], c.num_pages = 3, 2**31
    assert paged._lean_wide(values, c, wide)
    c.num_pages, values["vc_sp"] = 10, 1 << 28
    assert paged._lean_wide(values, c, wide)
    # the arrays' own spans decide without the exact span where they bound it within 31 bits
    c.num_pages, values["vc_sp"] = 10, 2048
    narrow = [NS(size=1, span=(-64, 1 << 20)), None]
    assert not paged._lean_wide(values, c, narrow)
    values["vc_sp"] = 1 << 28  # (the exact span would say 64-bit; the spans given say 32-bit)
    assert not paged._lean_wide(values, c, narrow)
    assert paged._span_bound(narrow, c) == (1 << 20) + 64 + 128
    assert paged._span_bound([*narrow, NS(size=0, span=(0, 0))], c) > paged.INT32_SPAN
    assert paged._span_bound([None], c) == 4 * 8 * 128 + 128  # new q outputs: T x Hq x D


@pytest.fixture
def launched(monkeypatch):
    """The kernel instantiations the paged op's launches are built with (``ropekv.paged``'s
    ``expression`` watched), its plans dropped before and after (a plan keeps its kernel), the
    lean kernel given every plain call it can serve (:func:`_lean_everywhere`)."""
    from ropekv import paged

    seen = []
    real = paged.expression

    def watch(*args, **kw):
        e = real(*args, **kw)
        seen.append(e)
        return e

    monkeypatch.setattr(paged, "expression", watch)
    _lean_everywhere(monkeypatch)
    for op in (paged._GQA, paged._MLA):
        op.clear()
    yield seen
    for op in (paged._GQA, paged._MLA):
        op.clear()


def _lean_ran(seen, wide=False, rows=1):
    """Whether the last launch ran the lean kernel (``rows`` > 1: its U-rows form with U =
    ``rows``) with 64-bit (``wide``) or 32-bit offsets."""
    from ropekv import paged

    offsets = "long long>" if wide else "int>"
    if rows > 1:
        return (
            seen
            and seen[-1].startswith(paged.LEAN_ROWS_KERNEL + "<")
            and seen[-1].endswith(f", {rows}, {offsets}")
        )
    return seen and seen[-1].startswith(paged.LEAN_KERNEL + "<") and seen[-1].endswith(offsets)


LEAN_GQA = [  # (Hq, Hkv, R, Dn, dtype, cache, layout, page_size, is_neox, index dtype)
    (32, 8, 128, 0, F16, E4M3, "NHD", 16, True, np.int32),
    (8, 1, 128, 0, F16, E4M3, "NHD", 16, True, np.int64),
    (4, 1, 128, 0, BF16, E5M2, "HND", 32, False, np.int32),
    (24, 6, 64, 64, BF16, E4M3, "NHD", 7, True, (np.int64, np.int32, np.int64, np.int32, np.int64)),
    (8, 8, 256, 0, F16, F16, "HND", 1, False, np.int32),
    (16, 2, 32, 96, BF16, BF16, "NHD", 16, True, np.int64),
    (32, 8, 64, 64, F16, E5M2, "HND", 128, False, np.int32),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", LEAN_GQA)
def test_lean_kernel_matches_reference(case, launched):
    """GQA / MHA decode on the lean kernel: heads of 8 / 1 to 32 / 8, rope-only and rope + nope
    rows, fp16 / bf16 into fp8 and 16-bit caches, both layouts, page sizes 1 to 128 (7: no power
    of two), both RoPE styles, int32 / int64 / mixed indices, padding, per-head scales, q outputs
    given (a misaligned fp8 row start) or new, packed q / k / v."""
    Hq, Hkv, R, Dn, dtype, cache, layout, page_size, is_neox, idx = case
    quantize = cache in FP8
    for T, B, padding, per_head, packed, prealloc in (
        (1, 1, 0, False, False, False),
        (4, 4, 1, True, True, False),
        (19, 5, 3, False, True, True),
        (64, 64, 0, True, False, False),
        (256, 256, 9, False, True, False),
    ):
        args = make_case(
            120 + T,
            T=T,
            B=B,
            Hq=Hq,
            Hkv=Hkv,
            R=R,
            Dn=Dn,
            dtype=dtype,
            cache_dtype=cache,
            kv_layout=layout,
            page_size=page_size,
            index_dtypes=idx,
            padding=padding,
            per_head=per_head,
            packed=packed,
        )
        check_against_reference(args, quantize, is_neox, prealloc and quantize)
        assert _lean_ran(launched), launched[-1:]


@pytest.mark.gpu
@pytest.mark.parametrize("Hq", [128, 16])
def test_lean_kernel_mla_decode(Hq, launched):
    """DeepSeek MLA decode (latent 512, rope 64, bf16 -> fp8) on the lean kernel: 72- and 68-lane
    rows, padding, int64 indices, e5m2, a block a row and (past lean_wave_blocks) 3 rows a
    block."""
    mla = _mla(Hq)
    for T, neox in ((1, False), (4, True), (16, False), (63, True), (256, False)):
        args = make_case(130 + T, T=T, B=min(T, 5), padding=T // 4, **mla)
        check_against_reference(args, quantize=True, is_neox=neox)
        assert _lean_ran(launched), launched[-1:]
    args = make_case(131, T=8, B=3, index_dtypes=np.int64, cache_dtype=E5M2, per_head=True, **mla)
    check_against_reference(args, quantize=True, is_neox=False)
    assert _lean_ran(launched)


@pytest.mark.gpu
@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("index", [np.int32, np.int64])
def test_lean_kernel_hostile_indices(mla, index, launched):
    """Garbage indices on the lean kernel: positions, requests, kv_indptr and page ids outside
    their ranges (int64 ones past 32 bits too), a page size of no power of two: the rows of
    tokens without a slot are skipped, nothing is written out of bounds (the caches' other
    bytes are checked)."""
    import cupy as cp

    shape = (
        {k: v for k, v in _mla(16).items() if k != "page_size"}
        if mla
        else {"Hq": 8, "Hkv": 2, "R": 64, "Dn": 32}
    )
    for page_size in (16, 5):
        args = make_case(32, T=16, B=2, page_size=page_size, index_dtypes=index, **shape)
        _poison_indices(args, index)
        args["pos_ids"][10] = -1
        check_against_reference(args, quantize=True, is_neox=not mla)
        assert _lean_ran(launched)
    cp.cuda.Device().synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("index", [np.int32, np.int64])
def test_lean_kernel_decode_guess(mla, index, launched):
    """The lean kernels' decode guess (one token a request, T == B: token t's kv_indptr entries
    loaded before its batch index lands) against the reference wherever it holds and wherever it
    does not: every token in its own request; the requests permuted (the guess fails for most
    tokens); padding; hostile indices (the guess holds for one of the poisoned tokens, whose
    request's kv_indptr entries are out of range); with the guess off (lean_guess False), the
    same results. The caches' other bytes are checked."""
    from ropekv import paged

    shape = _mla(16) if mla else {"Hq": 8, "Hkv": 1, "R": 128, "Dn": 0}
    T = 16
    for seed, how in enumerate(("own", "permuted", "padded", "hostile")):
        args = make_case(150 + seed, T=T, B=T, lens=[1] * T, index_dtypes=index, **shape)
        assert np.array_equal(args["batch_indices"], np.arange(T))
        if how == "permuted":
            rng = np.random.default_rng(seed)
            order = rng.permutation(T)
            args["batch_indices"][:] = order
            # token t in request order[t], at that request's one position (in its pages)
            args["positions"][:] = args["positions"][order]
        elif how == "padded":
            args["batch_indices"][[0, 5, 15]] = -1
        elif how == "hostile":
            _poison_indices(args, index)
        for guess in (True, False):
            with pytest.MonkeyPatch.context() as m:
                m.setitem(paged.TUNING, "lean_guess", guess)
                for op in (paged._GQA, paged._MLA):
                    op.clear()
                check_against_reference(args, quantize=True, is_neox=not mla)
            assert _lean_ran(launched), launched[-1:]


def test_decode_guess_flag_where_one_token_a_request(monkeypatch):
    """The record's guess field: set for calls of as many tokens as requests (decode) while
    lean_guess is on, clear otherwise."""
    from ropekv import paged

    for T, B, on, want in ((4, 4, True, 1), (1, 1, True, 1), (5, 4, True, 0), (3, 4, True, 0)):
        monkeypatch.setitem(paged.TUNING, "lean_guess", on)
        assert paged._decode_guess(T, B) == want, (T, B, on)
    monkeypatch.setitem(paged.TUNING, "lean_guess", False)
    assert paged._decode_guess(4, 4) == 0


@pytest.mark.gpu
def test_lean_kernel_64bit_offsets(monkeypatch, launched):
    """The lean kernel's 64-bit offset instantiation (taken where a span passes 31 bits; here
    forced by a span limit of 0) on GQA and MLA decode."""
    from ropekv import paged

    monkeypatch.setattr(paged, "INT32_SPAN", 0)
    args = make_case(140, T=19, B=4, Hq=32, Hkv=8, R=64, Dn=64, page_size=16, padding=2)
    check_against_reference(args, quantize=True)
    assert _lean_ran(launched, wide=True), launched[-1:]
    mla = _mla(16)
    check_against_reference(make_case(141, T=5, B=2, **mla), quantize=True, is_neox=False)
    assert _lean_ran(launched, wide=True)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(8, 1), (4, 1), (32, 8)])
def test_lean_kernel_blocks_of_several_tokens(heads, monkeypatch, launched):
    """The lean kernel's blocks of several tokens (lean_wave_blocks 0: its shape past the wave):
    a last block with spare tokens, padding, fp16 caches, interleaved RoPE."""
    from ropekv import paged

    monkeypatch.setitem(paged.TUNING, "lean_wave_blocks", 0)
    Hq, Hkv = heads
    for T, B, R, Dn, cache, neox in (
        (77, 3, 128, 0, E4M3, True),
        (45, 5, 64, 64, F16, False),
        (1, 1, 128, 0, E5M2, True),
    ):
        args = make_case(
            150 + T,
            T=T,
            B=B,
            Hq=Hq,
            Hkv=Hkv,
            R=R,
            Dn=Dn,
            page_size=16,
            padding=3,
            cache_dtype=cache,
        )
        check_against_reference(args, quantize=cache in FP8, is_neox=neox)
        assert _lean_ran(launched)


@pytest.mark.gpu
def test_calls_the_lean_kernel_leaves_to_the_row_kernels(monkeypatch, launched):
    """mRoPE, the options and lean_below 0 (today's launch, what `--tune paged.lean_below=0`
    times) keep the row kernels at decode, and still match the reference."""
    from ropekv import paged

    rng = np.random.default_rng(160)
    args, kw = with_mrope(make_case(161, T=4, B=2, Hq=8, Hkv=1, R=128, page_size=16), rng, False)
    check_against_reference(args, quantize=True, mrope=kw)
    assert launched[-1].startswith(paged.ROW_KERNEL + "<")
    args = with_options(make_case(162, T=4, B=2, Hq=8, Hkv=1, R=128), rng, True, True, True)
    check_against_reference(args, quantize=True)
    assert launched[-1].startswith(paged.ROW_KERNEL + "_opts<")
    monkeypatch.setitem(paged.TUNING, "lean_below", 0)
    for T, shape in ((1, {"Hq": 8, "Hkv": 1, "R": 128}), (64, {"Hq": 32, "Hkv": 8, "R": 128})):
        check_against_reference(make_case(163 + T, T=T, B=T, page_size=16, **shape), True)
        assert launched[-1].startswith(paged.ROW_KERNEL + "<")
    mla = _mla(128)
    check_against_reference(make_case(165, T=4, B=4, **mla), quantize=True, is_neox=False)
    assert launched[-1].startswith(paged.ROW_KERNEL + "<")


@pytest.mark.parametrize("record", ["PARAMS", "LEAN_PARAMS"])
def test_lean_kernel_reads_its_sources_and_destinations_by_index(record):
    """The lean kernel indexes the record from q_rope, qr_sn, q_rope_out, qro_sn and krc_sp: those
    fields must stay consecutive in PARAMS and LEAN_PARAMS, each run of one field type
    (tests/test_compile.py: the records are the C structs)."""
    from ropekv import paged

    params = getattr(paged, record)
    fields = params.dtype.fields
    runs = (
        ("q_rope", "q_nope", "k_rope", "k_nope", "v"),
        ("q_rope_out", "q_nope_out", "kr_cache", "kn_cache", "v_cache"),
        ("qr_sn", "qr_sh", "qn_sn", "qn_sh", "kr_sn", "kr_sh", "kn_sn", "kn_sh", "v_sn", "v_sh"),
        ("qro_sn", "qro_sh", "qno_sn", "qno_sh"),
        ("krc_sp", "krc_se", "krc_sh", "knc_sp", "knc_se", "knc_sh", "vc_sp", "vc_se", "vc_sh"),
    )
    for run in runs:
        size = fields[run[0]][0].itemsize
        assert {fields[n][0] for n in run} == {fields[run[0]][0]}
        assert [fields[n][1] - fields[run[0]][1] for n in run] == [
            size * k for k in range(len(run))
        ]


def test_lean_record_by_offset_width():
    """A lean kernel's call packs LEAN_PARAMS (int32 strides) where its offsets are 32-bit and
    PARAMS where they are 64-bit; a stride outside int32 takes the 64-bit form even where every
    span fits (a dimension of extent one)."""
    from ropekv import paged

    assert paged.LEAN_PARAMS.dtype.itemsize < paged.PARAMS.dtype.itemsize
    values = dict.fromkeys(paged._STRIDES, 1) | {"B": 1, "num_indices": 1}

    class Call:
        T, Hq, Hkv, R, Dn, P, page_size, num_pages = 1, 1, 1, 64, 0, 16, 16, 4

    views = [None]  # (arrays whose spans fit: the strides decide)
    assert not paged._lean_wide(values, Call, views)
    assert paged._lean_wide(values | {"qr_sn": 2**31}, Call, views)
    assert paged._lean_wide(values | {"krc_sp": -(2**31)}, Call, views)


# Tests written for the row and section kernels whose decode calls the lean kernel now takes:
# rerun with the lean kernel off, so today's kernels keep their coverage (the calls of 1024 tokens
# and more, `lean_below=0`).
TODAYS_KERNEL_TESTS = [
    *(("every_launch_shape", test_every_launch_shape_matches_reference, (v,)) for v in VARIANTS),
    *(
        ("every_row_kernel_shape", test_every_row_kernel_shape_matches_reference, shape)
        for shape in ((128, 660, 4), (64, 10**9, 4), (256, 0, 3), (32, 0, 1))
    ),
    *(("hostile", test_hostile_indices_never_write_out_of_bounds, (g,)) for g in (32, 0)),
    *(
        ("mla_decode", test_mla_decode_on_the_row_kernel, (Hq, block))
        for Hq in (128, 16)
        for block in (256, 72)
    ),
    *(
        ("several_tokens", test_row_kernel_with_several_tokens_a_block, (heads, upto))
        for heads in ((8, 1), (4, 1), (2, 1), (32, 8))
        for upto in (128, 512)
    ),
]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "name, test, params",
    TODAYS_KERNEL_TESTS,
    ids=[f"{name}-{'-'.join(map(str, params))}" for name, _, params in TODAYS_KERNEL_TESTS],
)
def test_todays_kernels_with_the_lean_kernel_off(name, test, params, monkeypatch):
    from ropekv import paged

    monkeypatch.setitem(paged.TUNING, "lean_below", 0)
    test(*params, monkeypatch)


@pytest.mark.gpu
def test_hostile_indices_on_the_mla_row_kernel_with_the_lean_kernel_off(monkeypatch):
    from ropekv import paged

    monkeypatch.setitem(paged.TUNING, "lean_below", 0)
    test_hostile_indices_on_the_mla_row_kernel()


# ---------------------------------------------------------------------------------------------
# The lean kernel with C chunks of a row per thread (wide rows past lean_wide_chunks)


def _multi_shape(T, Hq, **kw):
    return _choose_lean(T, Hq, **{"Hkv": 1, "R": 64, "Dn": 512, "mla": True, **kw})


def test_lean_multi_takes_wide_rows_past_lean_wide_chunks(monkeypatch):
    """Plain calls of wide rows (MLA) past lean_wide_chunks chunks, up to lean_multi_upto, below
    lean_below tokens, take the C-chunk lean kernel: ceil(G / C) lanes a row (at least the row's
    rotary chunks), blocks (lanes, S, tokens) of at most LEAN_THREADS threads. The one-chunk lean
    kernel keeps the calls below lean_wide_chunks; options, GQA rows, lean_multi_upto 0 (today's
    choice) and rows whose rotary chunks outnumber the lanes keep the other kernels."""
    from ropekv import paged

    below = paged.TUNING["lean_wide_chunks"]
    # the shipped split: 4 / 16 tokens x 128 heads, 16 / 64 tokens x 16 heads
    assert max(4 * 129 * 72, 16 * 17 * 72) <= below < min(16 * 129 * 72, 64 * 17 * 72)
    assert _multi_shape(4, 128).shape == ("lean", False)
    assert _multi_shape(16, 16).shape == ("lean", False)
    # C: lean_multi_many (2) for tokens of at least lean_multi_many_from head rows, lean_multi (4)
    # below; 129 rows of 72 chunks: 36 lanes of 2, 17 rows: 18 lanes of 4
    assert 17 < paged.TUNING["lean_multi_many_from"] <= 129
    assert _multi_shape(16, 128).shape == ("lean_multi", 2) and _multi_shape(16, 128).block == 36
    assert _multi_shape(64, 16).shape == ("lean_multi", 4)
    upto = paged.TUNING["lean_multi_upto"]
    assert 256 * 129 * 72 <= upto < 512 * 129 * 72  # the shipped split: 128 heads x 256 tokens
    assert _multi_shape(256, 16).shape == ("lean_multi", 4)
    assert _multi_shape(256, 128).shape == ("lean_multi", 2)
    assert _multi_shape(512, 128).shape[0] not in ("lean", "lean_multi")  # the section kernel
    monkeypatch.setitem(paged.TUNING, "lean_multi_many_from", 1 << 30)  # lean_multi below
    wide = _multi_shape(64, 128)  # 129 rows of 72 chunks: 18 lanes of 4
    assert wide.shape == ("lean_multi", 4) and (wide.group, wide.block) == (72, 18)
    assert wide.rows * wide.block * wide.tokens <= paged.LEAN_THREADS
    assert wide.rows * wide.splits >= 129 and not wide.opts
    assert _multi_shape(256, 16, is_neox=True)[:4] == (8, 68, ("lean_multi", 4), 17)
    assert _multi_shape(64, 128, status=object()).shape[0] not in ("lean", "lean_multi")
    assert _multi_shape(paged.TUNING["lean_below"], 128).shape[0] not in ("lean", "lean_multi")
    gqa = {"R": 128, "Dn": 0, "mla": False, "dtype": F16, "is_neox": True}
    assert _choose_lean(512, 32, 8, **gqa).shape == ("lean", False)  # 8-chunk rows: unchanged
    # GQA rows of 64 interleaved rotary chunks (R = 512): 16 lanes at C = 4 cannot hold them
    big = {"R": 512, "Dn": 0, "mla": False, "dtype": F16, "is_neox": False}
    assert _choose_lean(256, 8, 1, **big).shape[0] != "lean_multi"
    for C, lanes in ((1, 72), (2, 36), (3, 24), (5, 15), (8, 9)):
        monkeypatch.setitem(paged.TUNING, "lean_multi", C)
        got = _multi_shape(128, 128)
        assert (got.block, got.shape) == (lanes, ("lean_multi", -(-72 // lanes)))
        assert lanes * (got.shape[1] - 1) < 72 <= lanes * got.shape[1]
    monkeypatch.setitem(paged.TUNING, "lean_multi", 0)  # taken as 1
    assert _multi_shape(128, 128).shape == ("lean_multi", 1)
    monkeypatch.setitem(paged.TUNING, "lean_multi", 9)  # 8 lanes: the 8 interleaved rotary chunks
    assert _multi_shape(128, 128).shape == ("lean_multi", 9)
    assert _multi_shape(128, 128, is_neox=True).block == 8  # ceil(68 / 9): 4 rotary chunks
    monkeypatch.setitem(paged.TUNING, "lean_multi", 16)  # 5 lanes < ri = 8
    assert _multi_shape(128, 128).shape[0] != "lean_multi"
    monkeypatch.setitem(paged.TUNING, "lean_multi", 4)
    monkeypatch.setitem(paged.TUNING, "lean_multi_upto", 0)  # today's choice
    for T, Hq in ((64, 128), (256, 128), (256, 16), (1024, 16)):
        assert _multi_shape(T, Hq).shape[0] not in ("lean", "lean_multi")
    assert _multi_shape(4, 128).shape == ("lean", False)
    monkeypatch.setitem(paged.TUNING, "lean_multi_upto", 1 << 22)
    monkeypatch.setitem(paged.TUNING, "lean_wide_chunks", 0)  # every wide call of lean_below
    assert _multi_shape(1, 128).shape == ("lean_multi", 4)
    monkeypatch.setitem(paged.TUNING, "lean_multi_many_from", 129)  # a token's rows, not its heads
    assert _multi_shape(1, 128).shape == ("lean_multi", 2)
    assert _multi_shape(1, 127).shape == ("lean_multi", 4)
    monkeypatch.setitem(paged.TUNING, "lean_multi_many", 3)
    assert _multi_shape(1, 128).shape == ("lean_multi", 3)


def test_lean_multi_kernels_are_compiled():
    """The compile tests build the C-chunk lean kernel at 2 and 4 chunks and TUNING's."""
    from ropekv import paged

    made = [e for e in paged.instantiations() if e.startswith(paged.LEAN_MULTI_KERNEL + "<")]
    tuned = (paged.TUNING["lean_multi"], paged.TUNING["lean_multi_many"])
    for C in (*paged.LEAN_MULTI_CHUNKS, *tuned):
        for stream, offsets in itertools.product(("false", "true"), ("int", "long long")):
            tail = f", 8, {C}, {stream}, {offsets}>"
            assert any(e.endswith(tail) for e in made), tail


def test_lean_multi_streams_calls_past_most_of_the_l2(monkeypatch):
    """The C-chunk lean kernel takes the streaming hint where a call's head rows move more bytes
    (read and written) than lean_stream_l2 of the device's L2: on the H200's 60 MiB, MLA 128 heads
    bf16 -> e4m3 at 256 tokens (57 MB) and not at 128 (28.5 MB); lean_stream_l2 moves the line."""
    from types import SimpleNamespace as NS

    from ropekv import paged

    monkeypatch.setattr(paged, "l2_bytes", lambda device: 60 << 20)
    a = NS(q_rope=NS(dtype=np.dtype(BF16)))

    def streams(T, Hq, out=E4M3, mla=True, Hkv=1, Dn=512):
        c = NS(T=T, Hq=Hq, Hkv=Hkv, mla=mla, R=64, Dn=Dn, out_dtype=np.dtype(out), device=0)
        return paged._lean_stream(a, c)

    assert paged.TUNING["lean_stream_l2"] == 0.75
    assert streams(256, 128) and not streams(128, 128)
    assert not streams(1024, 16)  # 30 MB: 16 heads never reach it below lean_below tokens
    assert streams(200, 128, out=BF16)  # 59 MB: 16-bit outputs move a third more
    mha = {"mla": False, "Hkv": 128, "Dn": 448}  # 384 rows of 512 elements a token
    assert streams(128, 128, **mha) and not streams(32, 128, **mha)
    rows = 256 * 129 * 576 * 3  # bytes of the 256-token call
    monkeypatch.setitem(paged.TUNING, "lean_stream_l2", rows / (60 << 20))
    assert not streams(256, 128)  # the line is strict
    monkeypatch.setitem(paged.TUNING, "lean_stream_l2", 0)
    assert streams(1, 16)


@pytest.fixture
def launched_multi(launched, monkeypatch):
    """:func:`launched` with the C-chunk lean kernel given every plain call of wide rows below
    lean_below tokens."""
    from ropekv import paged

    monkeypatch.setitem(paged.TUNING, "lean_wide_chunks", 0)
    monkeypatch.setitem(paged.TUNING, "lean_multi_upto", 1 << 62)
    return launched


DECODE_LAYOUTS = [  # (kernel form, make_case kwargs): the decode kernels of GQA / MHA and MLA
    ("lean", {"Hq": 8, "Hkv": 1, "R": 128, "page_size": 16}),
    ("lean", {"Hq": 32, "Hkv": 8, "R": 64, "Dn": 64, "page_size": 7, "cache_dtype": F16}),
    ("lean", _mla(16)),
    ("multi", _mla(16)),
    ("rows", {"Hq": 32, "Hkv": 8, "R": 128, "page_size": 16}),
    ("rows", {"Hq": 4, "Hkv": 1, "R": 64, "Dn": 32, "page_size": 5, "dtype": BF16}),
]


@pytest.mark.gpu
@pytest.mark.parametrize("index", [np.int32, np.int64])
@pytest.mark.parametrize("form, shape", DECODE_LAYOUTS)
def test_decode_batch_layouts_match_reference(form, shape, index, launched, monkeypatch):
    """Decode batches (no more tokens than requests) on the lean, C-chunk lean and plain row
    kernels: one token a request (token t in request t), ragged requests (some with none, T <
    B), every token one request later than its index, and garbage indices (past both ends,
    kv_indptr[1] at the dtype's largest value); the reference's results, the caches' other bytes
    unchanged. (A kernel that read kv_indptr[t] beside batch_indices[t], betting on token t in
    request t, passed these and was 2-5% slower at decode: docs/design/kernels.md.)"""
    from ropekv import paged

    if form == "multi":
        monkeypatch.setitem(paged.TUNING, "lean_wide_chunks", 0)
        monkeypatch.setitem(paged.TUNING, "lean_multi_upto", 1 << 62)
    if form == "rows":
        monkeypatch.setitem(paged.TUNING, "lean_below", 0)
    kernel = {
        "lean": paged.LEAN_KERNEL + "<",
        "multi": paged.LEAN_MULTI_KERNEL + "<",
        "rows": paged.ROW_KERNEL + "<",
    }[form]
    T = 24
    rng = np.random.default_rng(190)
    ragged = rng.multinomial(T, np.ones(T + 6) / (T + 6))  # T + 6 requests, some empty
    for i, lens in enumerate((np.ones(T, np.int64), ragged, np.ones(T, np.int64), None)):
        B = len(lens) if lens is not None else T
        args = make_case(191 + i, T=T, B=B, lens=lens, index_dtypes=index, **shape)
        if i == 2:  # every token one request later (the last one padding)
            args["batch_indices"] = np.roll(args["batch_indices"], -1)
            args["batch_indices"][-1] = -1
        if i == 3:
            _poison_indices(args, index)
        quantize = args["paged_kv_cache"][0].dtype in FP8
        check_against_reference(args, quantize=quantize, is_neox=bool(i % 2))
        assert launched[-1].startswith(kernel), launched[-1:]


def _multi_ran(seen, chunks=None, wide=False, stream=False):
    from ropekv import paged

    tail = f"{'true' if stream else 'false'}, {'long long' if wide else 'int'}>"
    if chunks is not None:
        tail = f", {chunks}, {tail}"
    return (
        bool(seen)
        and seen[-1].startswith(paged.LEAN_MULTI_KERNEL + "<")
        and seen[-1].endswith(tail)
    )


@pytest.mark.gpu
@pytest.mark.parametrize("C", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("Hq", [128, 16])
def test_lean_multi_kernel_mla_decode(Hq, C, monkeypatch, launched_multi):
    """DeepSeek MLA (latent 512, rope 64, bf16 -> fp8) on the C-chunk lean kernel: 72- and
    68-lane rows at 1 to 5 chunks a lane (last chunks past the row's end at 3 and 5), padding,
    decode and past the wave."""
    from ropekv import paged

    monkeypatch.setitem(paged.TUNING, "lean_multi", C)
    monkeypatch.setitem(paged.TUNING, "lean_multi_many", C)
    mla = _mla(Hq)
    for T, neox in ((1, False), (4, True), (16, False), (63, True), (130, False)):
        args = make_case(170 + T, T=T, B=min(T, 5), padding=T // 4, **mla)
        check_against_reference(args, quantize=True, is_neox=neox)
        G = 68 if neox else 72
        assert _multi_ran(launched_multi, -(-G // -(-G // C))), launched_multi[-1:]


@pytest.mark.gpu
@pytest.mark.parametrize("Hq", [128, 16])
def test_lean_multi_kernel_streaming_hint(Hq, monkeypatch, launched_multi):
    """The C-chunk lean kernel's streaming form (lean_stream_l2 0: every call takes it) on MLA
    decode with both RoPE styles, padding and past the wave, against the reference; and the plain
    form where the line is past the call."""
    from ropekv import paged

    mla = _mla(Hq)
    for limit, stream in ((0, True), (1e9, False)):
        monkeypatch.setitem(paged.TUNING, "lean_stream_l2", limit)
        for T, neox in ((1, True), (16, False), (130, True)):
            args = make_case(200 + T, T=T, B=min(T, 5), padding=T // 4, **mla)
            check_against_reference(args, quantize=True, is_neox=neox)
            assert _multi_ran(launched_multi, stream=stream), launched_multi[-1:]


@pytest.mark.gpu
@pytest.mark.parametrize("C", [2, 4])
def test_lean_multi_kernel_mla_options(C, monkeypatch, launched_multi):
    """The C-chunk lean kernel on MLA with int64 / mixed indices, e5m2, per-head scales, packed
    inputs, bf16 caches (no quantization), a misaligned fp8 q_rope_out (vector width 4: 144
    chunks a row) and pages of no power of two."""
    from ropekv import paged

    monkeypatch.setitem(paged.TUNING, "lean_multi", C)
    mla = _mla(16)
    for seed, kw, quantize, neox, prealloc in (
        (180, {"index_dtypes": np.int64, "cache_dtype": E5M2, "per_head": True}, True, False, 0),
        (181, {"packed": True, "index_dtypes": (np.int64, np.int32) * 2 + (np.int64,)}, 1, 1, 0),
        (182, {"cache_dtype": BF16}, False, True, False),
        (183, {"cache_dtype": BF16, "packed": True}, False, False, False),
        (184, {"per_head": True}, True, False, True),
        (185, {"page_size": 7, "padding": 3}, True, True, False),
    ):
        args = make_case(seed, **{"T": 24, "B": 4, **mla, **kw})
        check_against_reference(args, bool(quantize), is_neox=bool(neox), prealloc=prealloc)
        assert _multi_ran(launched_multi), launched_multi[-1:]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_lean_multi_kernel_wide_gqa_rows(layout, launched_multi):
    """GQA / MHA heads too wide for a lane group (head_dim 512: rope 64 + 448, 60 / 64 chunks)
    on the C-chunk lean kernel: K and V rows, both RoPE styles, fp8 and fp16 caches."""
    for seed, Hq, Hkv, cache, neox, ps in (
        (190, 8, 2, E4M3, True, 16),
        (191, 4, 4, F16, False, 7),
        (192, 16, 1, E5M2, False, 1),
    ):
        args = make_case(
            seed,
            T=33,
            B=3,
            Hq=Hq,
            Hkv=Hkv,
            R=64,
            Dn=448,
            cache_dtype=cache,
            kv_layout=layout,
            page_size=ps,
            padding=2,
        )
        check_against_reference(args, quantize=cache in FP8, is_neox=neox)
        assert _multi_ran(launched_multi), launched_multi[-1:]


@pytest.mark.gpu
@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("index", [np.int32, np.int64])
def test_lean_multi_kernel_hostile_indices(mla, index, launched_multi):
    """Garbage indices on the C-chunk lean kernel (test_lean_kernel_hostile_indices' cases):
    tokens without a slot skipped, nothing written out of bounds."""
    import cupy as cp

    shape = (
        {k: v for k, v in _mla(16).items() if k != "page_size"}
        if mla
        else {"Hq": 8, "Hkv": 2, "R": 64, "Dn": 448}
    )
    for page_size in (16, 5):
        args = make_case(33, T=16, B=2, page_size=page_size, index_dtypes=index, **shape)
        _poison_indices(args, index)
        args["pos_ids"][10] = -1
        check_against_reference(args, quantize=True, is_neox=not mla)
        assert _multi_ran(launched_multi)
    cp.cuda.Device().synchronize()


@pytest.mark.gpu
def test_lean_multi_kernel_64bit_offsets_and_token_blocks(monkeypatch, launched_multi):
    """The C-chunk lean kernel's 64-bit offsets (a span limit of 0) and its blocks of several
    tokens (lean_wave_blocks 0, a last block with spare tokens)."""
    from ropekv import paged

    monkeypatch.setattr(paged, "INT32_SPAN", 0)
    check_against_reference(make_case(200, T=5, B=2, **_mla(16)), quantize=True, is_neox=False)
    assert _multi_ran(launched_multi, wide=True), launched_multi[-1:]
    args = make_case(201, T=19, B=4, Hq=8, Hkv=2, R=64, Dn=448, page_size=16, padding=2)
    check_against_reference(args, quantize=True)
    assert _multi_ran(launched_multi, wide=True)
    monkeypatch.setattr(paged, "INT32_SPAN", 2**31 - 1)
    monkeypatch.setitem(paged.TUNING, "lean_wave_blocks", 0)
    for Hq, T in ((1, 45), (2, 77), (16, 9)):  # 2 / 3 / 17 rows of 18 lanes
        args = make_case(202 + T, T=T, B=3, padding=3, **_mla(Hq))
        check_against_reference(args, quantize=True, is_neox=T % 2 == 0)
        assert _multi_ran(launched_multi)


@pytest.mark.gpu
def test_lean_multi_off_keeps_todays_kernels(monkeypatch, launched):
    """lean_multi_upto 0 (today's choice, what `--tune paged.lean_multi_upto=0` times): MLA at
    64 and 256 tokens x 128 / 16 heads runs the row / section kernels, and matches."""
    from ropekv import paged

    monkeypatch.setitem(paged.TUNING, "lean_wide_chunks", 1 << 18)
    monkeypatch.setitem(paged.TUNING, "lean_multi_upto", 0)
    for T, Hq in ((64, 128), (256, 16)):
        check_against_reference(make_case(210 + T, T=T, B=8, **_mla(Hq)), True, is_neox=False)
        assert not launched[-1].startswith(paged.LEAN_MULTI_KERNEL), launched[-1:]
        assert not launched[-1].startswith(paged.LEAN_KERNEL + "<"), launched[-1:]
    monkeypatch.setitem(paged.TUNING, "lean_multi_upto", 1 << 22)  # the C-chunk kernel at 64 x 128
    check_against_reference(make_case(212, T=64, B=8, **_mla(128)), True, is_neox=False)
    assert _multi_ran(launched, paged.TUNING["lean_multi_many"])


# ---------------------------------------------------------------------------------------------
# Issue 38: GQA / MHA prefill on the lean kernel, section kernels at FlashInfer's occupancy


def test_gqa_prefill_takes_the_lean_kernel(monkeypatch):
    """Plain GQA / MHA calls from lean_prefill_from tokens take the lean kernel (blocks of whole
    rows, several tokens a block under tensor parallelism); between lean_below and
    lean_prefill_from, with the options, with mRoPE, and with lean_prefill_from 0 (0663de9) or
    lean_below 0 (ee077f9) the row kernels stay; MLA prefill keeps the section kernel."""
    from ropekv import paged

    gqa = {"R": 128, "Dn": 0, "mla": False, "dtype": F16, "is_neox": True}
    start, below = paged.TUNING["lean_prefill_from"], paged.TUNING["lean_below"]
    assert start >= below
    monkeypatch.setitem(paged.TUNING, "lean_prefill_rows", 1)  # one row a thread (0a1cafe)
    llama = _choose_lean(8192, 32, 8, **gqa)  # 48 rows of 8 lanes: 3 blocks of 16 rows a token
    assert llama.shape == ("lean", False) and not llama.opts
    assert (llama.group, llama.rows, llama.tokens, llama.splits) == (8, 16, 1, 3)
    tp8 = _choose_lean(8192, 8, 1, **gqa)  # 10 rows: 3 tokens, 240 threads a block
    assert (tp8.shape[0], tp8.rows, tp8.tokens, tp8.splits) == ("lean", 10, 3, 1)
    tp4 = _choose_lean(8192, 4, 1, **gqa)  # 6 rows: 5 tokens, 240 threads
    assert (tp4.shape[0], tp4.rows, tp4.tokens, tp4.splits) == ("lean", 6, 5, 1)
    assert _choose_lean(start, 32, 8, **gqa).shape[0] == "lean"
    if start - 1 >= paged.TUNING["lean_below"]:
        assert _choose_lean(start - 1, 32, 8, **gqa).shape[0] == "rows"
    assert _choose_lean(8192, 24, 6, R=64, Dn=64, mla=False).shape[0] == "lean"
    scaled = _choose_lean(8192, 32, 8, q_scale_out=object(), **gqa)
    assert scaled.shape[0] == "rows" and scaled.opts
    assert _choose(8192, 32, 8, **gqa).shape[0] == "rows"  # lean=False (mRoPE)
    mla = {"Hkv": 1, "R": 64, "Dn": 512, "mla": True}
    assert _choose_lean(8192, 16, **mla).shape == paged.TUNING["heavy"]
    assert _choose_lean(8192, 128, **mla).shape == paged.TUNING["heavy"]
    monkeypatch.setitem(paged.TUNING, "lean_prefill_from", 0)
    assert _choose_lean(8192, 32, 8, **gqa).shape == ("rows", 4)
    monkeypatch.setitem(paged.TUNING, "lean_prefill_from", start)
    monkeypatch.setitem(paged.TUNING, "lean_below", 0)
    assert _choose_lean(8192, 32, 8, **gqa).shape == ("rows", 4)

    for rows in (2, 3):  # the rows form: the same calls, the same fall-backs
        monkeypatch.setitem(paged.TUNING, "lean_below", below)
        monkeypatch.setitem(paged.TUNING, "lean_prefill_rows", rows)
        assert _choose_lean(start, 32, 8, **gqa).shape == ("lean_rows", rows)
        assert _choose_lean(8192, 24, 6, R=64, Dn=64, mla=False).shape == ("lean_rows", rows)
        assert _choose_lean(8192, 32, 8, q_scale_out=object(), **gqa).shape[0] == "rows"
        assert _choose(8192, 32, 8, **gqa).shape[0] == "rows"
        assert _choose_lean(8192, 16, **mla).shape == paged.TUNING["heavy"]
        if start - 1 >= paged.TUNING["lean_below"]:
            assert _choose_lean(start - 1, 32, 8, **gqa).shape[0] == "rows"
        monkeypatch.setitem(paged.TUNING, "lean_prefill_from", 0)
        assert _choose_lean(8192, 32, 8, **gqa).shape == ("rows", 4)
        monkeypatch.setitem(paged.TUNING, "lean_prefill_from", start)


# (rows a thread, heads): (S, tokens, splits) of the lean kernel at 8192 tokens of fp16 neox
# rows of 128 (8 lanes), Llama 32 / 8 (48 rows), TP 8 / 1 (10) and 4 / 1 (6): S U rows a block
LEAN_ROWS_SHAPES = {
    (1, (32, 8)): (16, 1, 3),  # 128 threads (lean_split_block)
    (1, (8, 1)): (10, 3, 1),
    (1, (4, 1)): (6, 5, 1),
    (2, (32, 8)): (24, 1, 1),  # 192 threads, a token a block
    (2, (8, 1)): (5, 6, 1),  # 240 threads
    (2, (4, 1)): (3, 10, 1),
    (3, (32, 8)): (16, 2, 1),  # 256 threads
    (3, (8, 1)): (4, 8, 1),  # 12 rows for 10: rows 10 and 11 skipped
    (3, (4, 1)): (2, 16, 1),
    (4, (32, 8)): (12, 2, 1),
    (4, (8, 1)): (3, 10, 1),
    (4, (4, 1)): (2, 16, 1),
}


@pytest.mark.parametrize("rows, heads", list(LEAN_ROWS_SHAPES))
def test_lean_prefill_rows_choice(rows, heads, monkeypatch):
    """lean_prefill_rows = U: the lean kernel's prefill calls (narrow rows, from lean_below
    tokens) take U head rows a thread, blocks (G, S, tokens) with S U rows covering the token's
    rows (the shapes of the bench's prefill cases); decode keeps one row a thread; U = 1 is the
    one-row kernel; the launch's kernel, grid and block; the instantiation is listed for the
    compile tests."""
    from ropekv import paged

    monkeypatch.setitem(paged.TUNING, "lean_prefill_rows", rows)
    gqa = {"R": 128, "Dn": 0, "mla": False, "dtype": F16, "is_neox": True}
    c = _choose_lean(8192, *heads, **gqa)
    assert c.shape == (("lean_rows", rows) if rows > 1 else ("lean", False))
    assert (c.rows, c.tokens, c.splits) == LEAN_ROWS_SHAPES[rows, heads]
    assert c.group == 8 and c.rows * c.tokens * c.group <= paged.LEAN_THREADS
    H = heads[0] + 2 * heads[1]
    assert c.rows * rows * c.splits >= H > c.rows * rows * c.splits - c.rows * rows
    decode = _choose_lean(512, *heads, **gqa)
    assert decode.shape == ("lean", False)
    listed = (E4M3, True, 8, ("lean_rows", rows, True)), (F16, False, 4, ("lean_rows", rows, False))
    names = set(paged.instantiations())
    for out, neox, n, shape in listed if rows > 1 else ():
        assert paged.expression(F16, out, neox, n, shape) in names


@pytest.mark.parametrize(
    "dtype, out, key",
    [
        (BF16, E4M3, "lean_prefill_rows_bf16_8bit"),
        (BF16, E5M2, "lean_prefill_rows_bf16_8bit"),
        (BF16, I8, "lean_prefill_rows_bf16_8bit"),
        (BF16, BF16, "lean_prefill_rows"),
        (F16, E4M3, "lean_prefill_rows"),
        (F16, F16, "lean_prefill_rows"),
    ],
)
def test_lean_prefill_rows_by_dtypes(dtype, out, key, monkeypatch):
    """U at prefill: lean_prefill_rows_bf16_8bit for bf16 inputs into 8-bit caches (the one-row
    kernel's 62 registers), lean_prefill_rows for every other pair; the shipped values (2 and 1:
    the side-by-side H200 run in the comment above LEAN_ROWS_KERNEL)."""
    from ropekv import paged

    assert (paged.TUNING["lean_prefill_rows_bf16_8bit"], paged.TUNING["lean_prefill_rows"]) == (
        2,
        1,
    )
    gqa = {"R": 128, "Dn": 0, "mla": False, "is_neox": True}
    for rows in (1, 2, 3):
        monkeypatch.setitem(paged.TUNING, "lean_prefill_rows", 4)
        monkeypatch.setitem(paged.TUNING, "lean_prefill_rows_bf16_8bit", 4)
        monkeypatch.setitem(paged.TUNING, key, rows)
        c = _choose_lean(8192, 32, 8, dtype=dtype, out_dtype=out, **gqa)
        assert c.shape == (("lean_rows", rows) if rows > 1 else ("lean", False)), (rows, c)
        assert _choose_lean(512, 32, 8, dtype=dtype, out_dtype=out, **gqa).shape == ("lean", False)


def test_section_kernel_shapes_of_issue_38(monkeypatch):
    """The section kernel's shipped shapes: MLA prefill and 128-head decode past the lean kernels
    take min blocks 5 (heavy) and 4 (light) (the kernel's section_min_blocks keeps neox and
    mRoPE at 4); every instantiation of them is listed for the compile tests."""
    from ropekv import paged
    from ropekv._compile import read_source

    mla = {"Hkv": 1, "R": 64, "Dn": 512, "mla": True}
    assert _choose_lean(512, 128, **mla).shape == paged.TUNING["heavy"]  # past lean_multi_upto
    monkeypatch.setitem(paged.TUNING, "lean_multi_upto", 0)  # the section kernel from 64 tokens
    assert paged.TUNING["heavy"][2] == 5 and paged.TUNING["light"][2] == 4
    assert _choose_lean(64, 128, **mla).shape == paged.TUNING["light"]  # 73 x 128 items
    assert _choose_lean(128, 128, **mla).shape == paged.TUNING["heavy"]
    names = set(paged.instantiations())
    for shape in (paged.TUNING["light"], paged.TUNING["heavy"]):
        for neox in (False, True):
            for opts in (False, True):
                assert paged.expression(BF16, E4M3, neox, 8, shape, False, opts) in names
    source = read_source("paged")
    assert "__launch_bounds__(256, section_min_blocks(NEOX, MROPE, MINB))" in source


LEAN_PREFILL = [  # (Hq, Hkv, R, Dn, dtype, cache, layout, page_size, is_neox, index dtype)
    (32, 8, 128, 0, F16, E4M3, "NHD", 16, True, np.int32),
    (8, 1, 128, 0, F16, F16, "NHD", 16, True, np.int64),
    (4, 1, 128, 0, BF16, E5M2, "HND", 32, False, np.int32),
    (24, 6, 64, 64, BF16, E4M3, "NHD", 7, True, (np.int64, np.int32, np.int64, np.int32, np.int64)),
    (32, 8, 128, 0, BF16, BF16, "HND", 16, True, np.int32),
    (8, 1, 128, 0, F16, E4M3, "NHD", 16, True, np.int32),
    (4, 1, 128, 0, F16, F16, "NHD", 16, True, np.int32),
]


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("case", LEAN_PREFILL)
def test_lean_kernel_gqa_prefill_matches_reference(case, rows, monkeypatch, launched):
    """GQA / MHA prefill (lean_prefill_from tokens and more) on the lean kernel, one to four head
    rows a thread (lean_prefill_rows): 32 / 8, 8 / 1 and 4 / 1 heads (blocks of one token and of
    several, rows past a token's skipped), rope + nope rows, fp8 and 16-bit caches, both
    layouts, a page size of no power of two, both RoPE styles, mixed index dtypes, padding,
    per-head scales, packed inputs; the caches' other bytes unchanged."""
    from ropekv import paged

    for key in ("lean_prefill_rows", "lean_prefill_rows_bf16_8bit"):
        monkeypatch.setitem(paged.TUNING, key, rows)
    Hq, Hkv, R, Dn, dtype, cache, layout, page_size, is_neox, idx = case
    # past lean_wave_blocks: 8 / 1 and 4 / 1 heads in blocks of 2-3 tokens, spare ones in the last
    T = max(paged.TUNING["lean_prefill_from"], paged.TUNING["lean_wave_blocks"]) + 61
    args = make_case(
        170,
        T=T,
        B=3,
        Hq=Hq,
        Hkv=Hkv,
        R=R,
        Dn=Dn,
        dtype=dtype,
        cache_dtype=cache,
        kv_layout=layout,
        page_size=page_size,
        index_dtypes=idx,
        padding=17,
        per_head=Hq % 8 == 0,
        packed=Hq == 32,
    )
    check_against_reference(args, quantize=cache in FP8, is_neox=is_neox)
    assert _lean_ran(launched, rows=rows), launched[-1:]


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("index", [np.int32, np.int64])
def test_lean_kernel_gqa_prefill_hostile_indices(index, rows, monkeypatch, launched):
    """Garbage indices at prefill on the lean kernel, one to four head rows a thread (32-bit and
    forced 64-bit offsets): rows of tokens without a slot skipped, nothing written out of
    bounds."""
    import cupy as cp

    from ropekv import paged

    for key in ("lean_prefill_rows", "lean_prefill_rows_bf16_8bit"):
        monkeypatch.setitem(paged.TUNING, key, rows)
    T = paged.TUNING["lean_prefill_from"] + 5
    for wide in (False, True):
        if wide:  # a span limit of 0 (not in the plan key): the plans dropped
            monkeypatch.setattr(paged, "INT32_SPAN", 0)
            paged._GQA.clear()
        args = make_case(171, T=T, B=2, Hq=8, Hkv=2, R=64, Dn=32, page_size=5, index_dtypes=index)
        _poison_indices(args, index)
        args["pos_ids"][10] = -1
        args["batch_indices"][T - 3 :] = -1
        check_against_reference(args, quantize=True)
        assert _lean_ran(launched, wide=wide, rows=rows), launched[-1:]
    cp.cuda.Device().synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2, 2, 5), (1, 1, 4), (2, 2, 6), (1, 1, 5)])
def test_section_kernel_min_blocks_match_reference(shape, monkeypatch):
    """The section kernel at min blocks 4-6 (48 / 40 registers, with spills where the cap binds):
    MLA interleaved and neox, decode and prefill, status=, and GQA (plain and mRoPE) forced onto
    it."""
    from ropekv import paged

    for key, value in (
        ("light", shape),
        ("heavy", shape),
        ("lean_below", 0),  # no lean kernel: the section kernel for MLA
        ("wide_rows_below", 0),
    ):
        monkeypatch.setitem(paged.TUNING, key, value)
    mla = _mla(16)
    for T, neox in ((300, False), (77, True), (1100, False)):
        args = make_case(180 + T, T=T, B=3, padding=5, **mla)
        check_against_reference(args, quantize=True, is_neox=neox)
    rng = np.random.default_rng(183)
    args = with_options(make_case(182, T=40, B=2, **mla), rng, status=True)
    check_against_reference(args, quantize=True, is_neox=False)
    monkeypatch.setitem(paged.TUNING, "row_group", 0)  # GQA on the section kernel
    check_against_reference(
        make_case(185, T=77, B=3, Hq=32, Hkv=8, R=64, Dn=64, page_size=16, packed=True),
        quantize=True,
    )
    args, kw = with_mrope(make_case(184, T=33, B=2, Hq=8, Hkv=1, R=128, page_size=16), rng, False)
    check_against_reference(args, quantize=True, mrope=kw)


def test_record_strides_are_the_arrays_strides(monkeypatch):
    """The record's stride fields, gathered by one program a form (``paged._stride_program``),
    are the arrays' strides in elements: the inputs (MLA's k rows have no head stride), the q
    outputs (a new one's C-contiguous), the cache rows' (page, entry, head) strides in either
    layout (MLA: K-rope rows in kpe_cache, K-nope rows in ckv_cache, no V), the table's row."""
    from ropekv import paged

    seen = []
    for op in (paged._GQA, paged._MLA):
        prepare = op.prepare
        monkeypatch.setattr(op, "prepare", lambda v, f, p=prepare: seen.append((v, f)) or p(v, f))

    def st(view, *axes):
        return [0] * len(axes) if view is None else [view.strides[k] for k in axes]

    rng = np.random.default_rng(12)
    for seed in range(60):
        mla, layout = bool(seed % 2), ("NHD", "HND")[seed // 2 % 2]
        Dn, packed = 8 if mla else int(rng.choice([0, 8])), bool(rng.integers(0, 2))
        args = make_case(seed, mla=mla, Dn=Dn, kv_layout=layout, packed=packed and not mla)
        T, Hq, R = args["q_rope"].shape
        if rng.integers(0, 2):  # given q outputs, with row strides of their own
            wide = np.zeros((T, Hq, 2 * R), args["paged_kv_cache"][0].dtype)
            args["q_rope_out"] = wide[..., :R]
        if Dn and rng.integers(0, 2):
            wide = np.zeros((T, Hq + 1, Dn), args["paged_kv_cache"][0].dtype)
            args["q_nope_out"] = wide[:, 1:]
        seen.clear()
        ropekv.rope_quantize_fp8_append_paged_kv_cache(**args)
        ((views, flags),) = seen
        a, f = paged._Views._make(views), paged._Flags._make(flags)
        c = paged._check(a, f)
        values = paged._values(a, f, c, paged._choose(a, f.is_neox, c))
        k_in = (
            [*st(a.k_rope, 0), 0, *st(a.k_nope, 0), 0, 0, 0]
            if mla
            else [*st(a.k_rope, 0, 1), *st(a.k_nope, 0, 1), *st(a.v, 0, 1)]
        )
        rows = (0, 1, 2) if layout == "NHD" else (0, 2, 1)
        caches = (
            [*st(a.cache1, 0, 1), 0, *st(a.cache0, 0, 1), 0, 0, 0, 0]
            if mla
            else st(a.cache0, *rows) * 2 + st(a.cache1, *rows)
        )
        qro = st(a.q_rope_out, 0, 1) if a.q_rope_out is not None else [c.Hq * c.R, c.R]
        qno = st(a.q_nope_out, 0, 1) if a.q_nope_out is not None else [c.Hq * c.Dn, c.Dn]
        want = [
            *st(a.q_rope, 0, 1),
            *st(a.q_nope, 0, 1),
            *k_in,
            *qro,
            *qno,
            *caches,
            a.cos_sin_cache.strides[0],
        ]
        assert [values[n] for n in paged._STRIDE_FIELDS] == want, (seed, mla, layout)
