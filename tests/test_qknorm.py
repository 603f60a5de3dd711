"""``ropekv.qk_rmsnorm_rope_append_paged_kv_cache``: the reference's properties, the NumPy
backend, the validation rules (CPU), and the kernel against the reference (GPU)."""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import ropekv
from ropekv import _arrays as ar
from ropekv import reference
from ropekv.bench.arrays import torch_view
from ropekv.bench.tuning import applied
from ropekv.qknorm import DECODE_KERNEL, FLAT_KERNEL
from tests.strategies import FP8_DTYPES, INPUT_DTYPES, seeds
from tests.tolerance import assert_bytes_equal, assert_close, to_device, to_numpy

BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
op = ropekv.qk_rmsnorm_rope_append_paged_kv_cache


def make_case(
    seed,
    *,
    Hq=8,
    Hkv=2,
    D=32,
    R=None,
    dtype=np.float16,
    cache_dtype=None,
    new=(3, 0, 2),
    cached=(0, 5, 17),
    page_size=4,
    layout="NHD",
    gamma_f32=True,
    P=None,
    packed=False,
):
    """A ragged batch over a shuffled paged cache (distinct pages per request), NumPy arrays."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    cache_dtype = dtype if cache_dtype is None else np.dtype(cache_dtype)
    R = D if R is None else R
    new, cached = np.asarray(new), np.asarray(cached)
    B, T = len(new), int(new.sum())
    ends = cached + new
    pages_per = np.maximum(-(-ends // page_size), 1)
    max_pages = int(pages_per.max()) + 1
    num_pages = int(pages_per.sum()) + 2
    perm = rng.permutation(num_pages)
    table = np.full((B, max_pages), -1, np.int32)
    at = 0
    for b in range(B):
        table[b, : pages_per[b]] = perm[at : at + pages_per[b]]
        at += pages_per[b]
    P = int(ends.max()) + 8 if P is None else P
    shape = (num_pages, page_size, Hkv, D) if layout == "NHD" else (num_pages, Hkv, page_size, D)
    caches = tuple((rng.standard_normal(shape) * 0.5).astype(cache_dtype) for _ in range(2))
    qkv = (rng.standard_normal((T, Hq + 2 * Hkv, D)) * 3).astype(dtype)
    if packed:  # views into one projection output
        q, k, v = qkv[:, :Hq], qkv[:, Hq : Hq + Hkv], qkv[:, Hq + Hkv :]
    else:
        q, k, v = (
            np.ascontiguousarray(x)
            for x in (qkv[:, :Hq], qkv[:, Hq : Hq + Hkv], qkv[:, Hq + Hkv :])
        )
    gdt = np.float32 if gamma_f32 else dtype
    args = {
        "q": q,
        "k": k,
        "v": v,
        "q_gamma": rng.uniform(0.5, 1.5, D).astype(gdt),
        "k_gamma": rng.uniform(0.5, 1.5, D).astype(gdt),
        "cos_sin_cache": ropekv.cos_sin_cache(P, R, base=1e6),
        "input_row_offsets": np.concatenate([[0], np.cumsum(new)]).astype(np.int32),
        "cache_lengths": cached.astype(np.int32),
        "block_table": table,
        "paged_kv_cache": caches,
    }
    return args, {"kv_layout": layout}


def expected(args, kw, is_neox=True, kv_scale=None, epsilon=1e-6, **options):
    kc, vc = (c.copy() for c in args["paged_kv_cache"])
    q_out = np.empty_like(args["q"])
    fp8 = kc.dtype in FP8_DTYPES
    ks, vs = (
        (kv_scale if isinstance(kv_scale, tuple) else (kv_scale or 1.0,) * 2) if fp8 else (1.0, 1.0)
    )
    reference.qk_rmsnorm_rope_append_paged_kv_cache(
        args["q"],
        args["k"],
        args["v"],
        args["q_gamma"],
        args["k_gamma"],
        args["cos_sin_cache"],
        args["input_row_offsets"],
        args["cache_lengths"],
        args["block_table"],
        kc,
        vc,
        q_out,
        epsilon,
        is_neox,
        kw["kv_layout"],
        ks,
        vs,
        **options,
    )
    return q_out, kc, vc


def written_rows(args, kw, position_ids=None):
    """Mask of the rows the call writes (``position_ids``: mRoPE's, all three in [0, P))."""
    kc = args["paged_kv_cache"][0]
    nhd = kw["kv_layout"] == "NHD"
    num_pages, page_size = kc.shape[0], kc.shape[1] if nhd else kc.shape[2]
    P = args["cos_sin_cache"].shape[0]
    req, pos, page, entry = reference.ragged_paged_slots(
        args["input_row_offsets"],
        args["cache_lengths"],
        args["block_table"],
        page_size,
        num_pages,
        args["q"].shape[0],
    )
    if position_ids is None:
        ok = (req >= 0) & (pos < P) & (page >= 0)
    else:
        ok = (req >= 0) & np.all((position_ids >= 0) & (position_ids < P), axis=0) & (page >= 0)
    mask = np.zeros(kc.shape[:3], bool)  # (pages, entries, heads) or (pages, heads, entries)
    if nhd:
        mask[page[ok], entry[ok], :] = True
    else:
        mask[page[ok], :, entry[ok]] = True
    return mask


def tail_rows(args, kw, position_ids=None):
    """Boolean mask like written_rows: each request's last-page rows past its new length (requests
    with new tokens whose page is in the table, and with mRoPE ``position_ids`` whose last token
    has its positions in [0, P)), from the lengths directly."""
    kc = args["paged_kv_cache"][0]
    nhd = kw["kv_layout"] == "NHD"
    num_pages, page_size = kc.shape[0], kc.shape[1] if nhd else kc.shape[2]
    offs = np.asarray(args["input_row_offsets"], np.int64)
    lens, table = np.asarray(args["cache_lengths"], np.int64), args["block_table"]
    mask = np.zeros(kc.shape[:3], bool)
    for b in range(len(lens)):
        end = lens[b] + offs[b + 1] - offs[b]
        if offs[b + 1] == offs[b] or end % page_size == 0:
            continue
        P = args["cos_sin_cache"].shape[0]
        if position_ids is not None and not np.all(
            (position_ids[:, offs[b + 1] - 1] >= 0) & (position_ids[:, offs[b + 1] - 1] < P)
        ):
            continue
        page = table[b, (end - 1) // page_size]
        if 0 <= page < num_pages:
            if nhd:
                mask[page, end % page_size :, :] = True
            else:
                mask[page, :, end % page_size :] = True
    return mask


# ---- CPU ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_numpy_backend_matches_reference_and_leaves_other_rows(layout):
    args, kw = make_case(0, layout=layout, cache_dtype=E4M3)
    q_ref, kc_ref, vc_ref = expected(args, kw, kv_scale=(0.5, 2.0))
    before = tuple(c.copy() for c in args["paged_kv_cache"])
    out = op(**args, **kw, kv_scale=(0.5, 2.0))
    np.testing.assert_array_equal(out, q_ref)
    mask = written_rows(args, kw)
    assert mask.sum() == 5 * 2
    for got, ref, old in zip(args["paged_kv_cache"], (kc_ref, vc_ref), before):
        assert_bytes_equal(got, ref)
        assert_bytes_equal(got[~mask], old[~mask])


def test_heads_are_normalised_then_roped():
    args, kw = make_case(1, new=(1,), cached=(0,))  # position 0: rope is the identity
    args["q_gamma"] = np.ones_like(args["q_gamma"])
    out = op(**args, **kw).astype(np.float64)
    np.testing.assert_allclose(np.sqrt(np.mean(out * out, axis=-1)), 1.0, rtol=2e-3)
    x = args["q"].astype(np.float64)
    want = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(out, want, rtol=1e-3, atol=1e-3)
    page = args["block_table"][0, 0]
    np.testing.assert_array_equal(args["paged_kv_cache"][1][page, 0], args["v"][0])


@given(seed=seeds, layout=st.sampled_from(["NHD", "HND"]), is_neox=st.booleans())
def test_prefix_cached_run_equals_full_prefill(seed, layout, is_neox):
    full, kw = make_case(seed, new=(7, 5), cached=(0, 0), layout=layout)
    steps = dict(full, paged_kv_cache=tuple(c.copy() for c in full["paged_kv_cache"]))
    q_full = op(**full, **kw, is_neox=is_neox)
    idx1, idx2 = np.r_[0:3, 7:9], np.r_[3:7, 9:12]
    q1 = op(
        **dict(
            steps,
            q=steps["q"][idx1],
            k=steps["k"][idx1],
            v=steps["v"][idx1],
            input_row_offsets=np.array([0, 3, 5], np.int32),
        ),
        **kw,
        is_neox=is_neox,
    )
    q2 = op(
        **dict(
            steps,
            q=steps["q"][idx2],
            k=steps["k"][idx2],
            v=steps["v"][idx2],
            input_row_offsets=np.array([0, 4, 7], np.int32),
            cache_lengths=np.array([3, 2], np.int32),
        ),
        **kw,
        is_neox=is_neox,
    )
    np.testing.assert_array_equal(np.concatenate([q1, q2])[np.argsort(np.r_[idx1, idx2])], q_full)
    for a, b in zip(steps["paged_kv_cache"], full["paged_kv_cache"]):
        assert_bytes_equal(a, b)


@given(seed=seeds, is_neox=st.booleans(), layout=st.sampled_from(["NHD", "HND"]))
def test_norm_order_commutes_with_a_uniform_weight(seed, is_neox, layout):
    """A weight of one value per row commutes with the rotation: both orders agree (reference),
    and the NumPy backend is the reference."""
    args, kw = make_case(seed, layout=layout)
    args["q_gamma"][:] = 1.25
    args["k_gamma"][:] = 0.75
    outs = []
    for order in ("before_rope", "after_rope"):
        q_ref, kc_ref, vc_ref = expected(args, kw, is_neox, norm_order=order)
        outs.append((q_ref, kc_ref, vc_ref))
        run = dict(args, paged_kv_cache=tuple(c.copy() for c in args["paged_kv_cache"]))
        q = op(**run, **kw, is_neox=is_neox, norm_order=order)
        np.testing.assert_array_equal(q, q_ref)
        for got, ref in zip(run["paged_kv_cache"], (kc_ref, vc_ref)):
            assert_bytes_equal(got, ref)
    for a, b in zip(*outs):
        np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64), rtol=2e-3, atol=2e-3)


def test_norm_after_rope_differs_with_a_varying_weight():
    """The two orders are different maths when gamma varies along the row (not a no-op flag)."""
    args, kw = make_case(6, new=(2,), cached=(5,))
    before, _, _ = expected(args, kw)
    after, _, _ = expected(args, kw, norm_order="after_rope")
    x = args["q"].astype(np.float64)
    table = args["cos_sin_cache"][5:7].astype(np.float64)
    cos, sin = table[:, None, :16], table[:, None, 16:]
    rot = reference.rope(x, cos, sin, True)
    want = rot / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6) * args["q_gamma"]
    np.testing.assert_allclose(after.astype(np.float64), want, rtol=2e-3, atol=2e-3)
    assert np.abs(after.astype(np.float64) - before.astype(np.float64)).max() > 0.1


@pytest.mark.parametrize("order", ["before_rope", "after_rope"])
def test_weight_offset_adds_to_the_weights(order):
    """Gemma's (1 + w): weight_offset=1 with w equals offset 0 with 1 + w (NumPy backend)."""
    args, kw = make_case(7)
    args["q_gamma"] = (args["q_gamma"] - 1).astype(np.float32)
    args["k_gamma"] = (args["k_gamma"] - 1).astype(np.float32)
    plain = dict(
        args,
        q_gamma=args["q_gamma"] + np.float32(1),
        k_gamma=args["k_gamma"] + np.float32(1),
        paged_kv_cache=tuple(c.copy() for c in args["paged_kv_cache"]),
    )
    q_gemma = op(**args, **kw, weight_offset=1.0, norm_order=order)
    q_plain = op(**plain, **kw, norm_order=order)
    np.testing.assert_array_equal(q_gemma, q_plain)
    for a, b in zip(args["paged_kv_cache"], plain["paged_kv_cache"]):
        assert_bytes_equal(a, b)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_clear_unused_last_page_rows_zeroes_the_tails_only(layout):
    """K and V rows past each request's new length on its last page become zeros; written rows
    are those of a call without the option; all other rows keep their bytes (NumPy backend)."""
    args, kw = make_case(9, layout=layout, new=(3, 0, 2, 4), cached=(0, 5, 17, 4))
    plain = dict(args, paged_kv_cache=tuple(c.copy() for c in args["paged_kv_cache"]))
    before = tuple(c.copy() for c in args["paged_kv_cache"])
    q_plain = op(**plain, **kw)
    q = op(**args, **kw, clear_unused_last_page_rows=True)
    np.testing.assert_array_equal(q, q_plain)
    tail, written = tail_rows(args, kw), written_rows(args, kw)
    assert tail.sum() == 2 * 2  # one row of 2 heads each for requests 0 (ends at 3) and 2 (19)
    assert not (tail & written).any()
    for got, ref, old in zip(args["paged_kv_cache"], plain["paged_kv_cache"], before):
        assert not got[tail].view(np.uint8).any()
        assert_bytes_equal(got[written], ref[written])
        assert_bytes_equal(got[~tail & ~written], old[~tail & ~written])


def mrope_case(rng, args, R, interleaved, text_share=0.3, bad_share=0.0):
    """(position_ids (3, T) int32, mrope_section) for ``args``: image-like tokens with three
    different positions, text-like ones with one (the cache position), a few out of range."""
    half, T = R // 2, args["q"].shape[0]
    x = half // 3
    section = (half - 2 * x, x, x)
    P = args["cos_sin_cache"].shape[0]
    pos = rng.integers(0, P, (3, T))
    text = rng.random(T) < text_share
    pos[:, text] = pos[0, text]
    bad = rng.random(T) < bad_share
    pos[rng.integers(0, 3, T)[bad], np.flatnonzero(bad)] = rng.choice([-1, P, 2**31 - 1], bad.sum())
    return pos.astype(np.int32), section


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_mrope_of_text_tokens_is_plain_rope(interleaved, layout):
    """Three equal positions (the cache position) give the 1-D rotation, byte for byte."""
    args, kw = make_case(10, layout=layout)
    _req, pos, _, _ = reference.ragged_paged_slots(
        args["input_row_offsets"], args["cache_lengths"], args["block_table"], 4, 12, 5
    )
    plain = dict(args, paged_kv_cache=tuple(c.copy() for c in args["paged_kv_cache"]))
    q_plain = op(**plain, **kw)
    ids = np.stack([pos] * 3).astype(np.int64)
    q = op(
        **args,
        **kw,
        position_ids=ids,
        mrope_section=(6, 5, 5) if interleaved else (4, 6, 6),
        mrope_interleaved=interleaved,
    )
    np.testing.assert_array_equal(q, q_plain)
    for a, b in zip(args["paged_kv_cache"], plain["paged_kv_cache"]):
        assert_bytes_equal(a, b)


@given(seed=seeds, interleaved=st.booleans())
def test_mrope_backend_matches_reference_and_changes_image_tokens(seed, interleaved):
    rng = np.random.default_rng(seed)
    args, kw = make_case(seed % 1000, layout="NHD")
    ids, section = mrope_case(rng, args, 32, interleaved, text_share=0.0)
    q_ref, kc_ref, vc_ref = expected(
        args, kw, position_ids=ids, mrope_section=section, mrope_interleaved=interleaved
    )
    q = op(**args, **kw, position_ids=ids, mrope_section=section, mrope_interleaved=interleaved)
    np.testing.assert_array_equal(q, q_ref)
    for got, ref in zip(args["paged_kv_cache"], (kc_ref, vc_ref)):
        assert_bytes_equal(got, ref)


def test_mrope_validation():
    ids = np.zeros((3, 5), np.int32)
    bad(
        ValueError,
        r"mrope_section \(t, h, w\) must be non-negative and sum to R/2 = 16",
        {"mrope_section": (4, 4, 4), "position_ids": ids},
    )
    bad(
        ValueError,
        "mrope_section must be three integers",
        {"mrope_section": (4.0, 6, 6), "position_ids": ids},
    )
    bad(
        ValueError,
        "mrope_section must be three integers",
        {"mrope_section": 16, "position_ids": ids},
    )
    bad(
        ValueError,
        "does not fit the interleaved layout",
        {"mrope_section": (0, 8, 8), "mrope_interleaved": True, "position_ids": ids},
    )
    bad(
        ValueError,
        r"position_ids \(3, T\) is required with mrope_section",
        {"mrope_section": (4, 6, 6)},
    )
    bad(
        ValueError,
        r"position_ids must have shape \(3, T\) = \(3, 5\), got \(5,\)",
        {"mrope_section": (4, 6, 6), "position_ids": np.zeros(5, np.int32)},
    )
    bad(
        TypeError,
        "position_ids must have dtype int32 or int64, got float32",
        {"mrope_section": (4, 6, 6), "position_ids": ids.astype(np.float32)},
    )
    bad(ValueError, "position_ids is only used with mrope_section", {"position_ids": ids})
    bad(TypeError, "mrope_interleaved must be a bool", {"mrope_interleaved": "yes"})


def test_mrope_check_indices_names_the_position(monkeypatch):
    args, kw = make_case(11)
    ids = np.ones((3, 5), np.int32)
    ids[2, 3] = 10_000
    monkeypatch.setenv("ROPEKV_CHECK_INDICES", "1")
    with pytest.raises(IndexError, match=r"token 3 has width position 10000 \(position_ids"):
        op(**args, **kw, position_ids=ids, mrope_section=(4, 6, 6))


def malform(offsets, kind):
    """A copy of ``offsets`` that fails the ``kind`` check (the status code it must give)."""
    offs = offsets.copy()
    if kind == 1:
        offs[0] = 1
    elif kind == 2:
        offs[1] = offs[2] + 1  # above the next one
    elif kind == 3:
        offs[-1] -= 1
    return offs


@pytest.mark.parametrize("kind", [0, 1, 2, 3])
def test_status_codes_and_no_writes_on_the_numpy_backend(kind):
    args, kw = make_case(12, new=(3, 2, 2), cached=(0, 5, 17))
    args["input_row_offsets"] = malform(args["input_row_offsets"], kind)
    assert reference.ragged_offsets_status(args["input_row_offsets"], 7) == kind
    before = tuple(c.copy() for c in args["paged_kv_cache"])
    q_out = np.full_like(args["q"], 7)
    status = np.full(1, 99, np.int32)
    ref = None if kind else expected(args, kw)
    op(**args, **kw, q_out=q_out, status=status)
    assert status[0] == kind
    if kind:
        assert (q_out == 7).all()
        for got, old in zip(args["paged_kv_cache"], before):
            assert_bytes_equal(got, old)
    else:
        np.testing.assert_array_equal(q_out, ref[0])
        for got, want in zip(args["paged_kv_cache"], ref[1:]):
            assert_bytes_equal(got, want)


def test_status_of_an_empty_batch():
    args, kw = make_case(13, new=(0, 0), cached=(1, 2))
    status = np.full(1, 99, np.int32)
    op(**args, **kw, status=status)
    assert status[0] == 0
    args["input_row_offsets"] = np.array([0, 0, 2], np.int32)
    op(**args, **kw, status=status)
    assert status[0] == 3


def test_status_validation():
    bad(TypeError, "status must have dtype int32, got int64", {"status": np.zeros(1, np.int64)})
    bad(
        ValueError,
        r"status must have shape \(1,\) = \(1,\), got \(2,\)",
        {"status": np.zeros(2, np.int32)},
    )
    ro = np.zeros(1, np.int32)
    ro.flags.writeable = False
    bad(BufferError, "status is written in place", {"status": ro})


def test_in_place_q():
    args, kw = make_case(2, packed=True)
    q_ref, _, _ = expected(args, kw)
    out = op(**args, **kw, q_out=args["q"])
    assert out is args["q"]
    np.testing.assert_array_equal(args["q"], q_ref)


def test_check_indices_raises(monkeypatch):
    args, kw = make_case(3)
    args["block_table"][2, 17 // 4] = 99
    monkeypatch.setenv("ROPEKV_CHECK_INDICES", "1")
    with pytest.raises(IndexError, match="outside"):
        op(**args, **kw)


def bad(exc, match, kw_extra=None, **changes):
    args, kw = make_case(4)
    args.update(changes)
    kw.update(kw_extra or {})
    with pytest.raises(exc, match=match):
        op(**args, **kw)


def test_q_shape_and_dtype():
    bad(ValueError, r"q must have shape \(T, Hq, D\)", q=np.zeros((5, 256), np.float16))
    bad(TypeError, "q must have dtype", q=np.zeros((5, 8, 32), np.float32))


def test_k_v_shapes_and_heads():
    bad(ValueError, r"v must have shape", v=np.zeros((5, 3, 32), np.float16))
    bad(
        ValueError,
        "multiple of k's",
        k=np.zeros((5, 3, 32), np.float16),
        v=np.zeros((5, 3, 32), np.float16),
    )
    bad(TypeError, "k must have the dtype of q", k=np.zeros((5, 2, 32), BF16))


def test_gammas():
    bad(ValueError, r"k_gamma must have shape \(D,\)", k_gamma=np.ones(16, np.float32))
    bad(TypeError, "q_gamma must have dtype", q_gamma=np.ones(32, np.float64))


def test_rotary_dim():
    bad(ValueError, "must be even and in", cos_sin_cache=ropekv.cos_sin_cache(32, 64))


def test_cache_tuple_layout_and_shape():
    bad(
        ValueError,
        r"paged_kv_cache must be a tuple \(k_cache, v_cache\)",
        paged_kv_cache=np.zeros((8, 4, 2, 32), np.float16),
    )
    bad(ValueError, "kv_layout must be one of", kw_extra={"kv_layout": "NDH"})
    bad(
        ValueError,
        r"v_cache must have shape .*for NHD",
        paged_kv_cache=(np.zeros((8, 4, 2, 32), np.float16), np.zeros((8, 2, 4, 32), np.float16)),
    )


def test_cache_dtype_and_scale():
    bad(
        TypeError,
        "k_cache must have dtype",
        paged_kv_cache=tuple(np.zeros((12, 4, 2, 32), BF16) for _ in range(2)),
    )
    bad(ValueError, "only used with float8", kw_extra={"kv_scale": 2.0})
    bad(
        ValueError,
        "kv_scale must be a float or a",
        kw_extra={"kv_scale": (1.0, 2.0, 3.0)},
        paged_kv_cache=tuple(np.zeros((12, 4, 2, 32), E4M3) for _ in range(2)),
    )


def test_norm_order_and_weight_offset_are_checked():
    bad(
        ValueError,
        "norm_order must be one of 'before_rope', 'after_rope', got 'post'",
        kw_extra={"norm_order": "post"},
    )
    bad(ValueError, "norm_order must be one of", kw_extra={"norm_order": True})
    bad(
        TypeError, "weight_offset must be a real number, got True", kw_extra={"weight_offset": True}
    )
    bad(TypeError, "weight_offset must be a real number", kw_extra={"weight_offset": "1"})
    bad(
        ValueError,
        "weight_offset must be a finite non-negative number",
        kw_extra={"weight_offset": float("inf")},
    )
    bad(
        ValueError,
        "weight_offset must be a finite non-negative number",
        kw_extra={"weight_offset": -1.0},
    )


def test_non_bool_flags_are_refused():
    for flag in ("is_neox", "enable_pdl", "clear_unused_last_page_rows"):
        bad(TypeError, f"{flag} must be a bool, got 1", kw_extra={flag: 1})


def test_offsets_dtype():
    bad(
        TypeError,
        "input_row_offsets must have dtype",
        input_row_offsets=np.array([0, 3, 3, 5], np.float32),
    )


def test_q_out_overlap():
    args, kw = make_case(5, packed=True)
    with pytest.raises(ValueError, match="overlaps q partially"):
        op(**args, **kw, q_out=args["q"].base[:, 1:9])  # one head further along


# ---- GPU ---------------------------------------------------------------------------------------


def check_on_device(
    args, kw, *, is_neox=True, in_place=False, kv_scale=None, given=False, clear=False, **options
):
    """Run the kernel on copies of ``args`` and compare with the reference (``given``: into a
    pre-allocated output; ``options``: the norm_order and weight_offset keywords)."""
    import cupy as cp

    q_ref, kc_ref, vc_ref = expected(
        args, kw, is_neox, kv_scale, clear_unused_last_page_rows=clear, **options
    )
    mask = written_rows(args, kw, options.get("position_ids"))
    if clear:
        tail = tail_rows(args, kw, options.get("position_ids"))
        assert not kc_ref[tail].view(np.uint8).any()
        mask |= tail
    dev = {k: to_device(v) for k, v in args.items() if k not in ("q", "k", "v")}
    _T, Hq, _D = args["q"].shape
    if args["q"].base is not None and args["q"].base is args["k"].base:  # keep the packing
        qkv = cp.asarray(args["q"].base)
        Hkv = args["k"].shape[1]
        dev.update(q=qkv[:, :Hq], k=qkv[:, Hq : Hq + Hkv], v=qkv[:, Hq + Hkv :])
    else:
        dev.update(q=to_device(args["q"]), k=to_device(args["k"]), v=to_device(args["v"]))
    extra = {"q_out": dev["q"]} if in_place else {}
    if given:
        extra = {"q_out": cp.full(dev["q"].shape, np.nan, dev["q"].dtype)}
    out = op(
        **dev,
        **kw,
        is_neox=is_neox,
        kv_scale=kv_scale,
        **extra,
        **{n: to_device(x) for n, x in options.items()},
        clear_unused_last_page_rows=clear,
    )
    assert isinstance(out, cp.ndarray)
    if extra:
        assert out is extra["q_out"]
    assert_close(out, q_ref, "q_out")
    for got, ref, old, name in zip(
        dev["paged_kv_cache"], (kc_ref, vc_ref), args["paged_kv_cache"], ("k_cache", "v_cache")
    ):
        got = to_numpy(got)
        assert_close(got[mask], ref[mask], name)
        assert_bytes_equal(got[~mask], old[~mask], f"untouched {name} rows")


@pytest.mark.gpu
@given(
    seed=seeds,
    dtype=st.sampled_from(INPUT_DTYPES),
    data=st.data(),
    heads=st.sampled_from([(32, 4), (32, 8), (64, 4), (64, 8), (16, 16), (6, 2)]),
    layout=st.sampled_from(["NHD", "HND"]),
    is_neox=st.sampled_from([True, True, False]),
    page_size=st.sampled_from([1, 16, 32]),
    new=st.lists(st.integers(0, 24), min_size=1, max_size=4),
    gamma_f32=st.booleans(),
    in_place=st.booleans(),
    packed=st.booleans(),
    norm_order=st.sampled_from(["before_rope", "after_rope"]),
    weight_offset=st.sampled_from([0.0, 0.0, 1.0, 0.5]),
    clear=st.booleans(),
    mrope=st.sampled_from([None, None, "chunked", "interleaved"]),
)
def test_kernel_matches_reference(
    seed,
    dtype,
    data,
    heads,
    layout,
    is_neox,
    page_size,
    new,
    gamma_f32,
    in_place,
    packed,
    norm_order,
    weight_offset,
    clear,
    mrope,
):
    Hq, Hkv = heads
    D, R = data.draw(
        st.sampled_from([(128, 128), (128, 128), (64, 64), (128, 64), (256, 256), (80, 40)])
    )
    cache_dtype = data.draw(st.sampled_from([dtype, *FP8_DTYPES]))
    cached = data.draw(st.lists(st.integers(0, 200), min_size=len(new), max_size=len(new)))
    kv_scale = (
        data.draw(st.sampled_from([None, 0.5, (2.0, 0.25)])) if cache_dtype in FP8_DTYPES else None
    )
    args, kw = make_case(
        seed,
        Hq=Hq,
        Hkv=Hkv,
        D=D,
        R=R,
        dtype=dtype,
        cache_dtype=cache_dtype,
        new=new,
        cached=cached,
        page_size=page_size,
        layout=layout,
        gamma_f32=gamma_f32,
        packed=packed,
    )
    options = {}
    if mrope:
        ids, section = mrope_case(
            np.random.default_rng(seed), args, R, mrope == "interleaved", bad_share=0.1
        )
        options = {
            "position_ids": ids.astype(data.draw(st.sampled_from([np.int32, np.int64]))),
            "mrope_section": section,
            "mrope_interleaved": mrope == "interleaved",
        }
    check_on_device(
        args,
        kw,
        is_neox=is_neox,
        in_place=in_place and not packed,
        kv_scale=kv_scale,
        norm_order=norm_order,
        weight_offset=weight_offset,
        clear=clear,
        **options,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_qwen3_long_prefill(layout):
    args, kw = make_case(
        24,
        Hq=32,
        Hkv=4,
        D=128,
        dtype=BF16,
        cache_dtype=E4M3,
        new=(600, 0, 700),
        cached=(0, 2, 50),
        page_size=16,
        layout=layout,
        packed=True,
    )
    check_on_device(args, kw, kv_scale=0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("cache_dtype", [BF16, E4M3])
def test_qwen3_prefill_and_decode(layout, cache_dtype):
    prefill, kw = make_case(
        21,
        Hq=64,
        Hkv=4,
        D=128,
        dtype=BF16,
        cache_dtype=cache_dtype,
        new=(40, 0, 25),
        cached=(0, 9, 100),
        page_size=16,
        layout=layout,
    )
    check_on_device(prefill, kw)
    decode, kw = make_case(
        22,
        Hq=32,
        Hkv=8,
        D=128,
        dtype=BF16,
        cache_dtype=cache_dtype,
        new=(1,) * 6,
        cached=(0, 1, 15, 16, 17, 300),
        page_size=16,
        layout=layout,
        packed=True,
    )
    check_on_device(decode, kw)


# the decode kernel (qk_rmsnorm_rope_decode): plain calls of few tokens, D 64 / 128 / 256 with
# R == D at 16-byte lanes. Requests: "few" (< 32: the request found among the lanes), "many"
# (32..512: staged in shared memory), "huge" (> 512: searched in global memory); some empty,
# some tokens past the table's pages or with a position past the cos/sin table.
DECODE_BATCHES = {
    "few": ((1, 0, 1, 1, 0, 1), (0, 3, 15, 16, 17, 300)),
    "many": ((1, 0) * 20, tuple(range(0, 400, 10))),
    "huge": ((0,) * 590 + (1,) * 10, (5,) * 590 + tuple(range(0, 300, 30))),
}


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("batch", ["few", "many", "huge"])
@pytest.mark.parametrize("cache_dtype", [BF16, E4M3])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_decode_kernel_matches_reference(D, batch, cache_dtype, layout):
    import cupy as cp  # noqa: F401 (GPU only)

    new, cached = DECODE_BATCHES[batch]
    heads = (64, 8) if D == 128 else (8, 1)
    page_size = 16 if batch == "few" else 1
    for seed, is_neox, gamma_f32, packed in ((61, True, True, True), (62, False, False, False)):
        args, kw = make_case(
            seed,
            Hq=heads[0],
            Hkv=heads[1],
            D=D,
            dtype=BF16 if seed % 2 else np.float16,
            cache_dtype=cache_dtype if seed % 2 else np.float16,
            new=new,
            cached=cached,
            page_size=page_size,
            layout=layout,
            gamma_f32=gamma_f32,
            packed=packed,
            P=290,  # the last "few" request's token and some "many" / "huge" ones: no position
        )
        table = args["block_table"]
        table[-2, cached[-2] // page_size] = 10**6  # request B - 2's token: a page out of range
        table[0, 0] = -3  # a negative page id: request 0's token (if any) writes nothing
        check_on_device(args, kw, is_neox=is_neox, in_place=not packed, kv_scale=None)


# the flat decode kernel at every token count it can take
# (tp_flat_from 0: few-head calls on the flat kernel's own shape, not its spread one)
FLAT_EVERYWHERE = {
    "flat_below": 1 << 30,
    "decode_tokens": 0,
    "few_head_tokens": 0,
    "decode_by_token": 0,
    "tp_flat_from": 0,
}
# TUNING variants of the decode kernels: the defaults (the token-rows kernel from rows_from head
# rows up to 256 tokens), the token-rows kernel at every size at 1-4 rows a lane (blocks of up to 8 warps for 4), the flat kernel
# (4-element lanes at few tokens), the flat kernel at 16-byte lanes (D 64: 8 rows a warp, so a
# warp holds rows of two tokens), and the (T, splits) kernel of decode_flat 0
DECODE_VARIANTS = {
    "default": {},
    **{f"rows{u}": {"rows_per_lane": u, "rows_from": 0} for u in (1, 2, 3)},
    "rows4": {"rows_per_lane": 4, "rows_block_warps": 8, "rows_from": 0},
    "flat": FLAT_EVERYWHERE,
    "flat16": {**FLAT_EVERYWHERE, "decode_narrow_below": 0, "decode_min_blocks": 0},
    "splits": {"decode_flat": 0, "decode_tokens": 128, "decode_by_token": 0},
}


# The flat decode kernel at serving shapes: Qwen3-32B heads (64 / 8) and Tensor-parallel heads
# (8 / 1: 10 rows a token, so blocks and warps hold rows of several tokens) at N x 1 decode (N
# requests: the search among the lanes below 32, the decode guess checked against the search's path
# from 32 to 512), as many tokens as requests but not one a request (the guess failing for half
# the tokens: the search after it), a prefill of TP heads (the flat kernel at any T for H <=
# decode_heads; 8 requests: a ballot for each of a warp's two tokens), and 600
# requests (the search in global memory); each TUNING variant.
FLAT_CASES = {
    "32b-1": ((64, 8), (1,), (37,)),
    "32b-256": ((64, 8), (1,) * 256, tuple(range(3, 3 + 5 * 256, 5))),
    "tp-16": ((8, 1), (1,) * 16, tuple(range(0, 160, 10))),
    "tp-64": ((8, 1), (1,) * 64, tuple(range(64))),
    "tp-256": ((8, 1), (1,) * 256, tuple(range(0, 768, 3))),
    "tp-64-uneven": ((8, 1), (2, 0) * 32, tuple(range(0, 640, 10))),
    "32b-64-uneven": ((64, 8), (0, 2) * 32, tuple(range(5, 645, 10))),
    "tp-prefill": ((8, 1), (100, 0, 97, 130, 1, 64, 3, 120), (0, 5, 17, 0, 40, 300, 0, 9)),
    "tp-huge": ((8, 1), (0,) * 590 + (1,) * 10, (5,) * 590 + tuple(range(0, 300, 30))),
}
FLAT_VARIANTS = {
    **DECODE_VARIANTS,
    "flat4": {**FLAT_EVERYWHERE, "decode_narrow_below": 100_000},  # 4-element lanes at every T
    "flat-big": {**FLAT_EVERYWHERE, "decode_min_blocks": 0, "decode_rows": 64},  # 64 rows a block
}


def _plain_decode_case(seed, heads, new, cached, D, cache_dtype, P, negative_page=False):
    """``(args, kw, views)``: a plain bf16 QK-norm call (packed q / k / v, pages of 16, the layout
    and the gammas' dtype alternating with ``seed``) and the ArrayViews ``_decode_kernel`` takes;
    with two requests or more, request 1's first new token on a page out of range and, with
    ``negative_page``, request 0's on a negative page id."""
    args, kw = make_case(
        seed,
        Hq=heads[0],
        Hkv=heads[1],
        D=D,
        dtype=BF16,
        cache_dtype=cache_dtype,
        new=new,
        cached=cached,
        page_size=16,
        layout="HND" if seed % 2 else "NHD",
        gamma_f32=bool(seed % 2),
        packed=True,
        P=P,
    )
    table = args["block_table"]
    if len(new) > 1:
        table[1, cached[1] // 16] = 10**6  # request 1's first new token: a page out of range
        if negative_page:
            table[0, cached[0] // 16] = -3  # request 0's first new token: a negative page id
    names = ("q", "k", "v", "q_gamma", "k_gamma", "cos_sin_cache", "input_row_offsets")
    arrays = [args[n] for n in names] + [args["cache_lengths"], table, *args["paged_kv_cache"]]
    views = [
        ar.ArrayView("x", 256, x.shape, tuple(st // x.itemsize for st in x.strides), x.dtype, 0)
        for x in arrays
    ]
    return args, kw, views


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(FLAT_CASES))
@pytest.mark.parametrize("variant", sorted(FLAT_VARIANTS))
@pytest.mark.parametrize("cache_dtype", [BF16, E4M3])
def test_flat_decode_kernel_matches_reference(case, variant, cache_dtype):
    import cupy as cp  # noqa: F401 (GPU only)

    from ropekv import qknorm

    heads, new, cached = FLAT_CASES[case]
    seed = 70 + sorted(FLAT_CASES).index(case)
    # P: some tokens of tp-256 and 32b-256 have no position
    args, kw, views = _plain_decode_case(seed, heads, new, cached, 128, cache_dtype, P=1000)
    with applied({"qknorm": FLAT_VARIANTS[variant]}):
        kernel = qknorm._decode_kernel(views, None, True, 128, True)
        if variant == "splits":  # the (T, splits) kernel up to 128 tokens, then the general one
            assert kernel is None or not kernel[0].startswith(qknorm.FLAT_KERNEL), kernel
        elif variant.startswith("flat"):  # every case here: the flat kernel
            assert kernel and kernel[0].startswith(qknorm.FLAT_KERNEL), kernel
        elif sum(new) <= 256 and (  # rows<U>, and the defaults from rows_from rows: token rows
            variant != "default" or sum(new) * (heads[0] + 2 * heads[1]) >= 16384
        ):
            assert kernel and kernel[0].startswith(qknorm.ROWS_KERNEL), kernel
        check_on_device(args, kw, kv_scale=0.5 if cache_dtype == E4M3 else None)


# The request among the lanes (lane_position, kernels/common.cuh) at fewer than 32 requests: a
# ballot where the offsets are sorted (empty requests make equal offsets, the last of which is the
# search's answer), the binary search where a flat warp holds rows of three tokens (1 / 1 heads
# at D 64 on 8-element lanes: 3 rows a token, 8 rows a warp). Unsorted offsets: the hostile tests.
LANE_CASES = {
    "1-1": ((1, 1), (2, 0, 3, 1, 0, 0, 4, 1), (0, 3, 9, 1, 7, 0, 2, 30)),
    "2-1": ((2, 1), (0, 1, 1, 0, 2, 3), (4, 0, 17, 2, 6, 1)),
    "8-1": ((8, 1), (0, 1) * 15 + (1,), tuple(range(31))),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(LANE_CASES))
@pytest.mark.parametrize("variant", ["default", "flat", "flat16", "rows1", "rows2"])
def test_request_among_the_lanes_matches_reference(case, variant):
    import cupy as cp  # noqa: F401 (GPU only)

    from ropekv import qknorm

    heads, new, cached = LANE_CASES[case]
    args, kw, views = _plain_decode_case(len(new), heads, new, cached, 64, BF16, P=1000)
    with applied({"qknorm": FLAT_VARIANTS[variant]}):
        kernel = qknorm._decode_kernel(views, None, True, 64, True)
        assert kernel, (case, variant)
        check_on_device(args, kw)


# The decode kernels built with the guess (GUESS) leave the search among the lanes out: the host
# sends them 32 to 512 requests of a token each (qknorm.guesses). One sent fewer must still find
# each token's request (the staged search): GUESS_REQUESTS widened to one request here, so the host
# takes those kernels for LANE_CASES' one-token-a-request calls and for one to 16 tokens.
GUESS_FEW = {
    "32b-1": ((64, 8), (1,), (37,)),
    "tp-16": ((8, 1), (1,) * 16, tuple(range(0, 160, 10))),
    "32b-16": ((64, 8), (1,) * 16, tuple(range(0, 800, 50))),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(GUESS_FEW))
@pytest.mark.parametrize("variant", ["default", "splits", "flat16"])
def test_guess_kernels_sent_fewer_requests_match_reference(case, variant):
    import cupy as cp  # noqa: F401 (GPU only)

    from ropekv import qknorm

    heads, new, cached = GUESS_FEW[case]
    args, kw, views = _plain_decode_case(len(new), heads, new, cached, 128, BF16, P=1000)
    change = {**FLAT_VARIANTS[variant], "GUESS_REQUESTS": (1, 512)}
    with applied({"qknorm": change}):
        kernel = qknorm._decode_kernel(views, None, True, 128, True)
        assert kernel and kernel[0].endswith(", true>"), (case, variant, kernel)
        check_on_device(args, kw)


# fp8 q on the decode kernels (DECODE_Q_DTYPES: e4m3): (heads, new, cached, D, TUNING, kernel).
# Static or dynamic q scales, bf16 or e4m3 caches; tokens without a position (P 500), a page out
# of range and a negative page id (_plain_decode_case); the flat kernel at 4- and 8-element
# lanes, the (T, splits) kernel, tensor-parallel heads and a batch past kStageMax requests.
FP8_Q_DECODE = {
    "32b-1": ((64, 8), (1,), (37,), 128, {}, FLAT_KERNEL),
    "32b-16": ((64, 8), (1,) * 16, tuple(range(0, 800, 50)), 128, {}, FLAT_KERNEL),
    "32b-64": ((64, 8), (1,) * 64, tuple(range(3, 643, 10)), 128, {}, DECODE_KERNEL),
    "32b-16-splits": ((64, 8), (1,) * 16, tuple(range(16)), 128, {"decode_flat": 0}, DECODE_KERNEL),
    "tp-64": ((8, 1), (1,) * 64, tuple(range(0, 640, 10)), 128, {}, None),
    "d64-32": ((16, 4), (1,) * 32, tuple(range(32)), 64, {}, DECODE_KERNEL),
    "d256-4": ((16, 4), (1,) * 4, (0, 300, 499, 500), 256, {}, FLAT_KERNEL),
    "huge": ((8, 1), (0,) * 590 + (1,) * 10, (5,) * 590 + tuple(range(0, 600, 60)), 128, {}, None),
}


def test_decode_kernels_take_fp8_q():
    """fp8 q (CPU: the choice): the flat and (T, splits) decode kernels take e4m3 q as their
    last template argument with the plain call's launch shape; the token-rows kernel's calls
    keep the quantizing generic kernel (None); e5m2 q is not a decode q dtype."""
    from ropekv import qknorm

    assert qknorm.DECODE_Q_DTYPES == (E4M3,)
    for name, (heads, new, cached, D, tuning, kernel) in FP8_Q_DECODE.items():
        _, _, views = _plain_decode_case(3, heads, new, cached, D, E4M3, P=500)
        with applied({"qknorm": tuning}):
            plain = qknorm._decode_kernel(views, None, True, D, True)
            fp8 = qknorm._decode_kernel(views, None, True, D, True, E4M3)
        assert plain and fp8, name
        assert fp8[0] == plain[0][:-1] + ", __nv_fp8_e4m3>" and fp8[1:] == plain[1:], name
        assert kernel is None or fp8[0].startswith(kernel + "<"), (name, fp8[0])
        assert fp8[0] in set(qknorm.instantiations())
    _, _, views = _plain_decode_case(3, (64, 8), (1,) * 256, tuple(range(256)), 128, E4M3, P=500)
    assert qknorm._decode_kernel(views, None, True, 128, True)[0].startswith(qknorm.ROWS_KERNEL)
    assert qknorm._decode_kernel(views, None, True, 128, True, E4M3) is None


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(FP8_Q_DECODE))
@pytest.mark.parametrize("q_mode", ["static", "dynamic"])
@pytest.mark.parametrize("cache_dtype", [BF16, E4M3])
def test_decode_kernels_store_fp8_q_on_device(case, q_mode, cache_dtype, monkeypatch):
    """fp8 q from the decode kernels: q's codes and scales, the written cache rows (every other
    byte kept) against the reference, for interleaved and neox RoPE."""
    import cupy as cp  # noqa: F401 (GPU only)

    from ropekv import qknorm

    heads, new, cached, D, tuning, kernel = FP8_Q_DECODE[case]
    seed = 300 + sorted(FP8_Q_DECODE).index(case)
    chosen = []
    real = qknorm._decode_kernel
    monkeypatch.setattr(qknorm, "_decode_kernel", lambda *a: chosen.append(real(*a)) or chosen[-1])
    for is_neox in (True, False):
        args, kw, _ = _plain_decode_case(seed, heads, new, cached, D, cache_dtype, 500, True)
        quant = quant_arrays(args, kw, q_dynamic=q_mode == "dynamic", seed=seed)
        with applied({"qknorm": tuning}):
            check_quant_on_device(
                args,
                kw,
                quant,
                is_neox=is_neox,
                kv_scale=0.5 if cache_dtype == E4M3 else None,
                q_dtype=E4M3,
                q_scale=0.125 if q_mode == "static" else None,
            )
        got = chosen[-1][0] if chosen and chosen[-1] else None
        assert got and got.endswith(", __nv_fp8_e4m3>"), got
        assert kernel is None or got.startswith(kernel + "<"), got


def test_decode_kernel_is_chosen_for_plain_decode_calls():
    """_decode_kernel's choice (CPU): the compiled geometries of plain calls of few tokens, with
    32-bit offsets while every extent fits; here as before the token-rows kernel (its choice:
    test_token_rows_kernel_is_chosen_for_plain_decode_calls)."""
    with applied({"qknorm": {"decode_by_token": 0}}):
        _decode_choices()


def _decode_view(shape, dtype=BF16, strides=None):
    if strides is None:
        strides = tuple(int(np.prod(shape[i + 1 :])) for i in range(len(shape)))
    return ar.ArrayView("x", 256, tuple(shape), strides, np.dtype(dtype), 0)


def _decode_choice(
    T=1,
    Hq=64,
    Hkv=8,
    D=128,
    R=None,
    pages=100,
    gamma=np.float32,
    fits=True,
    is_neox=True,
    requests=None,
):
    """_decode_kernel's answer for a plain call of these dimensions (bf16, NHD, page size 16;
    ``requests``, T by default)."""
    from ropekv import qknorm

    view = _decode_view
    R = D if R is None else R
    B = T if requests is None else requests
    views = (
        view((T, Hq, D)),
        view((T, Hkv, D)),
        view((T, Hkv, D)),
        view((D,), gamma),
        view((D,), gamma),
        view((4096, R), np.float32),
        view((B + 1,), np.int32),
        view((B,), np.int32),
        view((B, 64), np.int32),
        view((pages, 16, Hkv, D)),
        view((pages, 16, Hkv, D)),
    )
    return qknorm._decode_kernel(views, None, is_neox, R, fits)


def test_token_rows_kernel_takes_calls_from_rows_from_head_rows():
    """By default the token-rows kernel takes calls of at least rows_from head rows (Qwen3-32B's
    80 rows a token at 256 tokens, not at 128; never 8 / 1 heads' 10 rows up to 256 tokens)."""
    from ropekv import qknorm

    assert qknorm.TUNING["rows_from"] == 16384
    rows256 = qknorm.rows_expression(BF16, BF16, True, 128, True, 4, guess=True)
    assert _decode_choice(T=256)[0] == rows256
    assert _decode_choice(T=205)[0].startswith(qknorm.ROWS_KERNEL)  # 16400 rows
    assert _decode_choice(T=204) is None  # 16320 rows: the general kernel, as before
    split128 = qknorm.decode_expression(BF16, BF16, True, 128, True, True, guess=True)
    assert _decode_choice(T=128)[0] == split128
    assert _decode_choice(T=256, Hq=8, Hkv=1)[0].startswith(qknorm.DECODE_KERNEL + "<")
    assert _decode_choice(T=257, Hq=8, Hkv=1)[0].startswith(qknorm.FLAT_KERNEL)


def test_decode_guess_is_compiled_in_for_one_token_a_request_only():
    """The decode kernels with the decode guess (kernels/common.cuh, RequestGuess) take calls of
    as many tokens as requests from 32 to 512 requests; the others take the kernels without its
    code (the search among the lanes below 32 requests, shared memory or global memory else)."""
    from ropekv import qknorm

    assert qknorm.GUESS_REQUESTS == (32, 512)
    for T, requests, heads, guess in (
        (31, None, (64, 8), False),
        (32, None, (64, 8), True),
        (128, None, (8, 1), True),
        (256, None, (64, 8), True),
        (64, 8, (8, 1), False),
        (64, 63, (64, 8), False),
        (128, 200, (8, 1), False),
    ):
        kernel = _decode_choice(T=T, Hq=heads[0], Hkv=heads[1], requests=requests)[0]
        assert kernel.endswith(", true>" if guess else ", false>"), (T, requests, kernel)
    with applied({"qknorm": FLAT_EVERYWHERE}):
        assert _decode_choice(T=600)[0].endswith(", false>")  # 600 requests: past the slots


def test_token_rows_kernel_is_chosen_for_plain_decode_calls():
    """The token-rows decode kernel (CPU), rows_from 0: up to rows_tokens tokens with 32-bit
    offsets; a warp per token of S = 32 / lanes rows a step (4 at D 128 neox, 8 at D 64, 1 at
    D 256 interleaved), U steps: the smallest U whose grid holds at most rows_warps warps,
    balanced."""
    with applied({"qknorm": {"rows_from": 0}}):
        _token_rows_choices()


def _token_rows_choices():
    from ropekv import qknorm

    choose = _decode_choice

    def rows(T, U, per_token, warps, **kw):
        kernel, grid, block = choose(T=T, **kw)
        D, is_neox = kw.get("D", 128), kw.get("is_neox", True)
        guess = qknorm.guesses(T, T)  # (one token a request)
        assert kernel == qknorm.rows_expression(BF16, BF16, is_neox, D, True, U, guess), (T, kw)
        assert grid == (-(-T // warps), per_token) and block == (32 * warps,), (T, kw)

    # Qwen3-32B heads, 80 rows a token: 1 row a lane (20 warps a token) while T 20 <= 512,
    # 3 at 64 tokens (7 warps of 12 rows), 4 from 128 (5 warps of 16 rows: past 512 warps)
    rows(1, 1, 20, 1)
    rows(3, 1, 20, 3)
    rows(16, 1, 20, 4)
    rows(64, 3, 7, 4)
    rows(128, 4, 5, 4)
    rows(256, 4, 5, 4)
    # Tensor-parallel heads (10 rows): 3 warps of 4 rows; at 256 tokens 2 of 8 (512 warps)
    rows(1, 1, 3, 1, Hq=8, Hkv=1)
    rows(128, 1, 3, 4, Hq=8, Hkv=1)
    rows(256, 2, 2, 4, Hq=8, Hkv=1)
    rows(1, 1, 10, 1, D=64)  # 8 rows a step
    rows(1, 1, 80, 1, D=256, is_neox=False)  # 32 lanes a row
    with applied({"qknorm": {"rows_per_lane": 4, "rows_block_warps": 2}}):
        rows(1, 4, 5, 1)
        rows(7, 4, 5, 2)
        rows(1, 3, 1, 1, Hq=8, Hkv=1)  # balanced: 12 rows hold the 10
    with applied({"qknorm": {"rows_warps": 10**6}}):
        rows(256, 1, 20, 4)
    # past rows_tokens, or 64-bit offsets: the kernels before it
    assert choose(T=257) is None
    assert choose(T=300, Hq=8, Hkv=1)[0].startswith(qknorm.FLAT_KERNEL)
    assert choose(pages=2**20)[0] == qknorm.decode_expression(BF16, BF16, True, 128, True, False)
    for refused in ({"D": 80}, {"R": 64}, {"fits": False}):
        assert choose(**refused) is None, refused
    with applied({"qknorm": {"decode_by_token": 0}}):
        assert choose()[0] == qknorm.flat_expression(BF16, BF16, True, 128, True, 4)


def _decode_choices():
    from ropekv import qknorm

    view, choose = _decode_view, _decode_choice

    # the defaults: 64 / 8 heads (80 rows a token) take the flat kernel below 17 tokens, T H rows
    # in one sequence: 80 rows at 16 lanes of 4 elements, 2 rows a warp: 4 rows a block makes 20
    # blocks (>= 80 / 32); the (T, splits) kernel up to 128 tokens, then none (the general one)
    kernel, grid, block = choose()
    assert kernel == qknorm.flat_expression(BF16, BF16, True, 128, True, 4)
    assert grid == (20,) and block == (64,)
    assert choose(T=16)[0].startswith(qknorm.FLAT_KERNEL)
    kernel, grid, block = choose(T=17)
    assert kernel == qknorm.decode_expression(BF16, BF16, True, 128, True, True)
    assert grid == (17, 5)
    assert choose(T=128)[1] == (128, 5)
    # Tensor-parallel heads (H = 10 <= decode_heads): the (T, splits) kernel up to
    # few_head_tokens (256) in blocks of 16 rows, of 12 (whole warps of 4 rows holding the 10)
    # from few_head_rows_from (128) tokens; the flat kernel past it, at any T (tp_flat_from 0:
    # no spread shape)
    assert qknorm.TUNING["few_head_tokens"] == 256
    assert qknorm.TUNING["few_head_rows_from"] == 128
    assert choose(Hq=8, Hkv=1)[1:] == ((1, 1), (128,))
    assert choose(T=127, Hq=8, Hkv=1)[1:] == ((127, 1), (128,))
    assert choose(T=128, Hq=8, Hkv=1)[1:] == ((128, 1), (96,))
    assert choose(T=256, Hq=8, Hkv=1)[1:] == ((256, 1), (96,))
    assert choose(T=256, Hq=8, Hkv=2)[1:] == ((256, 1), (96,))  # 12 rows: 3 warps
    assert choose(T=256, Hq=8, Hkv=1, D=256)[1:] == ((256, 1), (160,))  # 10 rows of 16 lanes
    assert choose(T=257, Hq=8, Hkv=1)[1:] == ((161,), (128,))  # 2570 rows, 16 a block
    with applied({"qknorm": {"few_head_tokens": 0}}):  # the flat kernel past decode_tokens
        assert choose(T=129, Hq=8, Hkv=1)[1:] == ((81,), (128,))  # 1290 rows, 16 a block
    with applied({"qknorm": {"few_head_rows_from": 0}}):  # 16-row blocks at any T
        assert choose(T=256, Hq=8, Hkv=1)[1:] == ((256, 1), (128,))
    assert choose(T=257, Hq=8, Hkv=1)[1:] == ((161,), (128,))  # 2570 rows, 16 a block
    assert choose(T=8192, Hq=8, Hkv=1)[1:] == ((5120,), (128,))
    assert choose(T=8192, Hq=8, Hkv=4)[1] == (8192,)  # H 16: still
    assert choose(D=256)[0] == qknorm.flat_expression(BF16, BF16, True, 256, True, 4)
    # interleaved D 256: 4-element lanes would take 64 lanes a row, so 8
    assert choose(D=256, is_neox=False)[0] == qknorm.flat_expression(
        BF16, BF16, False, 256, True, 8
    )
    assert choose(D=64)[2] == (32,)
    with applied({"qknorm": FLAT_EVERYWHERE}):  # the flat kernel at every T
        kernel, grid, block = choose(T=128)  # 10240 rows, 16-byte lanes: 16 rows of 8 lanes
        assert kernel == qknorm.flat_expression(BF16, BF16, True, 128, True, 8, guess=True)
        assert grid == (640,) and block == (128,)
        assert choose(T=256)[1] == (1280,)
        assert choose(Hq=8, Hkv=1)[1:] == ((5,), (32,))  # 10 rows: a warp of 2 rows a block
        assert choose(T=64, Hq=8, Hkv=1)[1:] == ((40,), (128,))  # 640 rows, 16 a block
    # 2^20 * 16 * 8 * 128 elements: 64-bit offsets, the (T, splits) kernel
    kernel, grid, block = choose(pages=2**20)
    assert kernel == qknorm.decode_expression(BF16, BF16, True, 128, True, False)
    assert grid == (1, 5) and block == (128,)
    assert choose(T=300, pages=2**20) is None
    for refused in (
        {"T": 257},
        {"T": 1000, "Hq": 16, "Hkv": 2},  # H 20 > decode_heads
        {"D": 80},
        {"R": 64},
        {"fits": False},
    ):
        assert choose(**refused) is None, refused
    with applied({"qknorm": {"decode_narrow_below": 0, "decode_min_blocks": 0}}):
        assert choose()[1:] == ((5,), (128,))  # 16 rows of 8 lanes a block
    # decode_flat 0, decode_tokens 128: the (T, splits) kernel, as before the flat one
    with applied({"qknorm": {"decode_flat": 0, "decode_tokens": 128}}):
        kernel, grid, block = choose()
        assert kernel == qknorm.decode_expression(BF16, BF16, True, 128, True, True)
        assert grid == (1, 5) and block == (128,)  # 80 rows, 16 rows of 8 lanes a block
        assert choose(T=128)[1] == (128, 5)
        assert choose(Hq=8, Hkv=1)[1] == (1, 1)
        assert choose(D=256)[2] == (256,) and choose(D=64)[2] == (64,)
        assert choose(pages=2**20)[0].endswith("false>")
        for refused in ({"T": 129}, {"T": 8192, "Hq": 8, "Hkv": 1}):
            assert choose(**refused) is None, refused
    # the two RMSNorm weights of different dtypes: refused
    views = [view((1, 64, 128)), view((1, 8, 128)), view((1, 8, 128))]
    views += [view((128,), np.float32), view((128,), BF16)]
    views += [view((4096, 128), np.float32), view((2,)), view((1,)), view((1, 64))]
    views += [view((100, 16, 8, 128))] * 2
    assert qknorm._decode_kernel(views, None, True, 128, True) is None


def test_prefill_rows_by_rows_a_token(monkeypatch):
    """Prefill launch shapes (CPU): tokens of at least prefill_rows_many_from head rows
    (Qwen3-32B's 80) take prefill_rows_many rows a lane group (2 blocks of 40 rows a token at
    16 lanes a row), fewer rows (32 / 8 heads' 48, tensor-parallel 8 / 1's 10) prefill_rows;
    prefill_rows_many_from 0 gives every call prefill_rows; decode shapes do not change."""
    from ropekv import qknorm

    assert qknorm.TUNING["prefill_rows_many"] == 4 and qknorm.TUNING["prefill_rows"] == 2
    assert qknorm.TUNING["prefill_rows_many_from"] == 64
    assert qknorm.launch_shape(8192, 80, 16) == (160, 4, 2)
    assert qknorm.launch_shape(8192, 64, 16) == (128, 4, 2)
    assert qknorm.launch_shape(8192, 48, 16) == (128, 2, 3)
    assert qknorm.launch_shape(8192, 10, 16) == (96, 2, 1)
    assert qknorm.launch_shape(1, 80, 16) == (128, 1, 10)
    monkeypatch.setitem(qknorm.TUNING, "prefill_rows_many_from", 0)
    assert qknorm.launch_shape(8192, 80, 16) == (160, 2, 4)


def test_few_head_decode_takes_the_spread_flat_shape():
    """Few-head decode (H <= decode_heads, TUNING tp_flat_*; CPU): from tp_flat_from tokens up to
    decode_tokens (or tp_flat_to) the flat kernel at tp_flat_width elements a lane and blocks
    of tp_flat_rows rows (fewer below decode_min_blocks blocks); below and past that range, or
    tp_flat_from 0, the kernels as before."""
    from ropekv import qknorm

    # one request of T tokens: the kernels without the decode guess, whose choice
    # test_decode_guess_is_compiled_in_for_one_token_a_request_only checks
    choose = functools.partial(_decode_choice, requests=1)
    flat4 = qknorm.flat_expression(BF16, BF16, True, 128, True, 4)
    flat8 = qknorm.flat_expression(BF16, BF16, True, 128, True, 8)
    splits = qknorm.decode_expression(BF16, BF16, True, 128, True, True)
    tp = {"Hq": 8, "Hkv": 1}
    assert qknorm.TUNING["tp_flat_from"] == 0  # off by default: the shape at its former default
    with applied({"qknorm": {"decode_by_token": 0, "tp_flat_from": 16}}):
        assert qknorm.TUNING["tp_flat_to"] == 256
        # below tp_flat_from: the (T, splits) kernel
        assert choose(T=1, **tp) == (splits, (1, 1), (128,))
        assert choose(T=15, **tp) == (splits, (15, 1), (128,))
        # 16 tokens: 160 rows of 16 lanes, 2 a warp; 8 a block would give 20 < 32 blocks: 6
        assert choose(T=16, **tp) == (flat4, (27,), (96,))
        assert choose(T=64, **tp) == (flat4, (80,), (128,))  # 640 rows, 8 a block
        assert choose(T=128, **tp) == (flat4, (160,), (128,))
        # up to tp_flat_to (256) alike; past it the flat kernel's shape as before (16-byte lanes,
        # 16 rows a block)
        assert choose(T=129, **tp) == (flat4, (162,), (128,))
        assert choose(T=256, **tp) == (flat4, (320,), (128,))
        assert choose(T=257, **tp) == (flat8, (161,), (128,))
        with applied({"qknorm": {"tp_flat_to": 0, "few_head_tokens": 0}}):
            assert choose(T=129, **tp) == (flat8, (81,), (128,))
            assert choose(T=256, **tp) == (flat8, (160,), (128,))
        # H 16 still few-head; 64 / 8 heads (80 rows) untouched: the (T, splits) kernel
        assert choose(T=64, Hq=8, Hkv=4)[0] == flat4
        assert choose(T=64) == (splits, (64, 5), (128,))
        # D 64: 8 lanes a row at 4 elements, 4 rows a warp; interleaved D 256 takes 8 elements
        assert choose(T=64, D=64, **tp) == (
            qknorm.flat_expression(BF16, BF16, True, 64, True, 4),
            (80,),
            (64,),
        )
        assert choose(T=64, D=256, is_neox=False, **tp) == (
            qknorm.flat_expression(BF16, BF16, False, 256, True, 8),
            (80,),
            (256,),
        )
        # 64-bit offsets: the (T, splits) kernel, as before
        assert choose(T=64, pages=2**20, **tp)[0].endswith("false>")
        for off in ({"tp_flat_from": 0}, {"decode_flat": 0}):
            with applied({"qknorm": off}):
                assert choose(T=64, **tp) == (splits, (64, 1), (128,)), off
        with applied({"qknorm": {"tp_flat_from": 1, "tp_flat_to": 256}}):
            assert choose(T=1, **tp) == (flat4, (5,), (32,))  # 10 rows: 5 one-warp blocks
            assert choose(T=256, **tp) == (flat4, (320,), (128,))
            assert choose(T=257, **tp) == (flat8, (161,), (128,))
            assert choose(T=300, pages=2**20, **tp) is None  # 64-bit offsets: the general one
        with applied({"qknorm": {"tp_flat_width": 8, "tp_flat_rows": 16}}):
            assert choose(T=64, **tp) == (flat8, (40,), (128,))
        with applied({"qknorm": {"tp_flat_rows": 64, "decode_min_blocks": 0}}):
            # 64 rows of 16 lanes would be 1024 threads: 32 rows, MAX_BLOCK threads
            assert choose(T=64, **tp) == (flat4, (20,), (512,))


# The few-head decode shape (tp_flat_*) on the device: off (the default), its former default
# range, at every token count (flat kernel, 4-element lanes), with big blocks, with 16-byte
# lanes; Tensor-parallel heads 8 / 1 and 8 / 2 (12 rows), D 128 and D 64 (4 rows a warp of 8
# lanes: a warp holds rows of two tokens), decode batches and a ragged prefill-like batch, pages
# out of range and positions past P.
TP_SPREAD_VARIANTS = {
    "default": {},  # (tp_flat_from 0: off)
    "former": {"tp_flat_from": 16},  # the range it had by default before the decode guess
    "every-t": {"tp_flat_from": 1, "tp_flat_to": 1 << 30},
    "wide": {"tp_flat_from": 1, "tp_flat_to": 1 << 30, "tp_flat_rows": 64, "decode_min_blocks": 0},
    "width8": {"tp_flat_from": 1, "tp_flat_to": 1 << 30, "tp_flat_width": 8},
}
TP_SPREAD_CASES = {  # (Hq, Hkv), new, cached, D
    "tp-1": ((8, 1), (1,), (37,), 128),
    "tp-16": ((8, 1), (1,) * 16, tuple(range(0, 160, 10)), 128),
    "tp-128": ((8, 1), (1,) * 128, tuple(range(1, 1 + 7 * 128, 7)), 128),
    "tp-256": ((8, 1), (1,) * 256, tuple(range(0, 768, 3)), 128),
    "tp2-64": ((8, 2), (1,) * 64, tuple(range(5, 5 + 64 * 11, 11)), 128),
    "tp-d64-33": ((8, 1), (1,) * 33, tuple(range(0, 33 * 9, 9)), 64),
    "tp-ragged": ((8, 1), (20, 0, 9, 30, 1, 3), (0, 5, 17, 0, 40, 300), 128),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(TP_SPREAD_CASES))
@pytest.mark.parametrize("variant", sorted(TP_SPREAD_VARIANTS))
@pytest.mark.parametrize("cache_dtype", [BF16, E4M3])
def test_few_head_spread_decode_matches_reference(case, variant, cache_dtype):
    import cupy as cp  # noqa: F401 (GPU only)

    from ropekv import qknorm

    heads, new, cached, D = TP_SPREAD_CASES[case]
    seed = 90 + sorted(TP_SPREAD_CASES).index(case)
    # P: the last tokens of tp-256 and tp-128 have no position
    args, kw, views = _plain_decode_case(
        seed, heads, new, cached, D, cache_dtype, P=700, negative_page=True
    )
    T, gf32 = sum(new), args["q_gamma"].dtype == np.float32
    guess = qknorm.guesses(T, len(new))
    with applied({"qknorm": TP_SPREAD_VARIANTS[variant]}):
        kernel = qknorm._decode_kernel(views, None, True, D, True)
        if variant in ("every-t", "wide") or (variant == "former" and 16 <= T <= 256):
            flat4 = qknorm.flat_expression(BF16, cache_dtype, True, D, gf32, 4, guess)
            assert kernel[0] == flat4, kernel
        elif variant == "width8":
            flat8 = qknorm.flat_expression(BF16, cache_dtype, True, D, gf32, 8, guess)
            assert kernel[0] == flat8, kernel
        elif T <= 256:  # the default (few_head_tokens), or former below tp_flat_from: the (T,
            # splits) kernel, from few_head_rows_from tokens in blocks of 12 rows
            assert kernel and kernel[0].startswith(qknorm.DECODE_KERNEL + "<"), kernel
        check_on_device(args, kw, kv_scale=0.5 if cache_dtype == E4M3 else None)


@pytest.mark.gpu
def test_large_ragged_batch():
    """Thousands of requests, most of them empty: the binary search finds each token's."""
    B = 4195
    new = np.zeros(B, np.int64)
    new[[0, 17, 4000, B - 1]] = [3, 1, 2, 1]
    args, kw = make_case(
        23,
        Hq=8,
        Hkv=2,
        D=64,
        new=tuple(new),
        cached=tuple(np.arange(B) % 9),
        page_size=4,
        layout="HND",
    )
    check_on_device(args, kw)


@pytest.mark.gpu
@pytest.mark.parametrize("in_place, given", [(False, False), (True, False), (False, True)])
def test_repeated_calls_replay_the_launch_plan_with_new_arrays(in_place, given):
    """The second and later calls of one layout replay a cached launch: new pointers, new output
    arrays, the same results as the reference."""
    for seed in (30, 31, 32):
        args, kw = make_case(
            seed,
            Hq=32,
            Hkv=8,
            D=128,
            dtype=BF16,
            cache_dtype=E4M3,
            new=(5, 1, 3),
            cached=(0, 40, 7),
            page_size=16,
        )
        check_on_device(args, kw, in_place=in_place, kv_scale=(0.5, 2.0), given=given)


@pytest.mark.gpu
def test_replayed_call_still_refuses_a_partially_overlapping_output():
    import cupy as cp

    args, kw = make_case(33, Hq=8, Hkv=2, D=64, dtype=BF16, new=(4,), cached=(3,))
    dev = {k: to_device(v) for k, v in args.items()}
    buf = cp.zeros((2 * 4 * 8 * 64,), dev["q"].dtype)
    q = buf[: 4 * 8 * 64].reshape(4, 8, 64)
    q[...] = dev["q"]
    dev["q"] = q
    for _ in range(2):  # the second call replays the launch plan
        op(**dev, **kw, q_out=buf[4 * 8 * 64 :].reshape(4, 8, 64))
    with pytest.raises(ValueError, match="overlap"):
        op(**dev, **kw, q_out=buf[64 : 64 + 4 * 8 * 64].reshape(4, 8, 64))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", sorted(DECODE_VARIANTS))
@pytest.mark.parametrize("clear", [False, True])
@pytest.mark.parametrize("tokens", ["decode", "prefill"])
def test_hostile_indices_never_write_out_of_bounds(tokens, clear, variant):
    """Malformed offsets, lengths and block-table entries: nothing outside the caches is written
    (guard bytes around them stay), the other rows stay byte-identical, q rows of tokens without a
    position are copied unchanged. Decode-sized batches split a token over several blocks."""
    with applied({"qknorm": DECODE_VARIANTS[variant]}):
        _hostile_indices(tokens, clear)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", sorted(DECODE_VARIANTS))
def test_hostile_indices_with_the_decode_guess(variant):
    """As above at 40 requests of a token each, the decode kernels' guess (token t in request t)
    checked against the search's path: where the offsets are not monotonic the path fails for
    some tokens and the search runs, and the result must be the search's, which the reference
    models."""
    with applied({"qknorm": DECODE_VARIANTS[variant]}):
        _hostile_indices("decode", False, requests=40)


def _hostile_indices(tokens, clear, requests=4):
    import cupy as cp

    more = requests - 4  # requests of one token each past the first four
    new = ((1, 1, 1, 1) if tokens == "decode" else (5, 3, 4, 0)) + (1,) * more
    args, kw = make_case(
        40,
        Hq=8,
        Hkv=2,
        D=64,
        dtype=BF16,
        new=new,
        cached=(0, 0, 0, 3) + tuple(range(more)),
        page_size=4,
        packed=True,
    )
    args["cache_lengths"][:4] = [0, 2**31 - 3, -7, 1]
    args["block_table"][0, :2] = [-5, 2**31 - 1]
    if clear:  # request 0 on the two spare pages, so that its last token has a tail to clear
        spare = np.setdiff1d(np.arange(args["paged_kv_cache"][0].shape[0]), args["block_table"])
        args["block_table"][0, :2] = spare[:2]
    args["input_row_offsets"][2] = args["input_row_offsets"][3] + 1  # not monotonic
    guard = 256
    kc, vc = args["paged_kv_cache"]
    pad = np.full(guard, 7, BF16)
    bufs = [cp.asarray(np.concatenate([pad, c.ravel(), pad])) for c in (kc, vc)]
    dev = {k: to_device(v) for k, v in args.items() if k != "paged_kv_cache"}
    qkv = cp.asarray(args["q"].base)
    dev.update(q=qkv[:, :8], k=qkv[:, 8:10], v=qkv[:, 10:])
    dev["paged_kv_cache"] = tuple(b[guard:-guard].reshape(c.shape) for b, c in zip(bufs, (kc, vc)))
    q_ref, kc_ref, vc_ref = expected(args, kw, clear_unused_last_page_rows=clear)
    out = op(**dev, **kw, clear_unused_last_page_rows=clear)
    assert_close(out, q_ref, "q_out")
    mask = written_rows(args, kw)
    if clear:  # the rows the reference clears (it models the kernels' request search)
        changed = (kc_ref.view(np.uint8) != kc.view(np.uint8)).any(-1) & ~mask
        assert changed.sum() == 3 * 2  # rows 1..3 (decode) or 1..3 of page 2 (prefill), 2 heads
        assert not kc_ref[changed].view(np.uint8).any()
        mask |= changed
    for buf, ref, old in zip(bufs, (kc_ref, vc_ref), (kc, vc)):
        host = to_numpy(buf)
        assert (host[:guard].view(np.uint16) == np.full(1, 7, BF16).view(np.uint16)).all()
        assert (host[-guard:].view(np.uint16) == np.full(1, 7, BF16).view(np.uint16)).all()
        got = host[guard:-guard].reshape(old.shape)
        assert_close(got[mask], ref[mask])
        assert_bytes_equal(got[~mask], old[~mask])


@pytest.mark.gpu
@pytest.mark.parametrize("kind", [0, 1, 2, 3])
@pytest.mark.parametrize("B", [3, 700])  # offsets staged in shared memory, or read from global
@pytest.mark.parametrize("T_new", [1, 40])
def test_status_on_device(kind, B, T_new):
    """Malformed offsets: status holds the code, no output byte changes (caches, a given
    q_out); valid ones: status 0 and the reference's result."""
    import cupy as cp

    rng = np.random.default_rng(kind + B + T_new)
    new = np.zeros(B, np.int64)
    new[rng.choice(B, min(B, T_new), replace=False)] = 1
    new[0] += T_new - new.sum()
    args, kw = make_case(
        60 + kind,
        Hq=16,
        Hkv=4,
        D=128,
        dtype=BF16,
        new=tuple(new),
        cached=tuple(rng.integers(0, 40, B)),
        page_size=16,
    )
    args["input_row_offsets"] = malform(args["input_row_offsets"], kind)
    # the first failing check: lowering the last offset below an empty request's is a decrease
    code = reference.ragged_offsets_status(args["input_row_offsets"], T_new)
    assert (code != 0) == (kind != 0)
    dev = {k: to_device(v) for k, v in args.items()}
    q_out = cp.full(dev["q"].shape, 7, dev["q"].dtype)
    status = cp.full(1, 99, cp.int32)
    op(**dev, **kw, q_out=q_out, status=status)
    assert int(status[0]) == code
    if kind:
        assert bool((q_out == 7).all())
        for got, old in zip(dev["paged_kv_cache"], args["paged_kv_cache"]):
            assert_bytes_equal(to_numpy(got), old, "cache after malformed offsets")
    else:
        q_ref, kc_ref, vc_ref = expected(args, kw)
        assert_close(q_out, q_ref, "q_out")
        mask = written_rows(args, kw)
        for got, ref, old in zip(dev["paged_kv_cache"], (kc_ref, vc_ref), args["paged_kv_cache"]):
            got = to_numpy(got)
            assert_close(got[mask], ref[mask])
            assert_bytes_equal(got[~mask], old[~mask])


@pytest.mark.gpu
def test_status_in_a_captured_graph():
    """The check runs on the device: one captured graph, replayed with valid then malformed
    offsets written into the same array, reports 0 then 2 and writes nothing the second time."""
    import cupy as cp

    args, kw = make_case(
        64, Hq=16, Hkv=4, D=128, dtype=BF16, new=(1, 1, 1, 1), cached=(3, 9, 20, 30), page_size=16
    )
    dev = {k: to_device(v) for k, v in args.items()}
    q_out = cp.zeros(dev["q"].shape, dev["q"].dtype)
    status = cp.full(1, 99, cp.int32)

    check_status_in_graph(lambda: op(**dev, **kw, q_out=q_out, status=status), dev, q_out, status)


def check_status_in_graph(run, dev, out, status):
    """``run()``, a call of a paged-cache op with ``status`` and ``out`` given, captured in one
    CUDA graph (after a first call outside the capture, which compiles and plans): replayed with
    valid offsets it reports 0; with decreasing offsets written into ``dev["input_row_offsets"]``
    it reports 2 and leaves ``out`` and ``dev["paged_kv_cache"]`` byte for byte as they were.
    (The fused QKV op's status test uses it too.)"""
    import cupy as cp

    run()
    cp.cuda.Device().synchronize()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        run()
        graph = stream.end_capture()
        status.fill(99)
        graph.launch(stream)
        stream.synchronize()
        assert int(status[0]) == 0
        snapshot = [to_numpy(c) for c in dev["paged_kv_cache"]]
        out_before = to_numpy(out)
        dev["input_row_offsets"][1:3] = cp.asarray(np.array([3, 1], np.int32))  # decreasing
        graph.launch(stream)
        stream.synchronize()
    assert int(status[0]) == 2
    assert_bytes_equal(to_numpy(out), out_before)
    for got, old in zip(dev["paged_kv_cache"], snapshot):
        assert_bytes_equal(to_numpy(got), old)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_gemma_style_rope_then_norm_decode_and_prefill(layout):
    """Both options on at once, at decode and prefill launch shapes, bf16 weights."""
    for new, cached, seed in (((1,) * 8, tuple(range(0, 80, 10)), 50), ((40, 3, 0), (0, 7, 2), 51)):
        args, kw = make_case(
            seed,
            Hq=16,
            Hkv=8,
            D=256,
            dtype=BF16,
            new=new,
            cached=cached,
            page_size=16,
            layout=layout,
            gamma_f32=False,
            packed=True,
        )
        check_on_device(args, kw, norm_order="after_rope", weight_offset=1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype, policy", [(BF16, 2), (E4M3, 2), (BF16, 1)])
def test_matches_flashinfer_cake(cache_dtype, policy):
    """FlashInfer 0.7.2's Cake kernels (packed bf16 qkv, Qwen3-32B heads 64/8/128, NHD, float32
    weights, norm then RoPE) on the same inputs: the same q (the fp8 kernel's q is e4m3) and the
    same cache rows."""
    torch = pytest.importorskip("torch")
    try:
        from flashinfer.cake_fused_qk_rope_append import (
            cake_fused_qk_rmsnorm_rope_append_paged_kv_cache as cake_bf16,
        )
        from flashinfer.cake_fused_qk_rope_fp8_append import (
            cake_fused_qk_rmsnorm_rope_quantize_fp8_append_paged_kv_cache as cake_fp8,
        )
    except Exception as exc:  # noqa: BLE001 - not installed (0.7.2 or later), or its JIT failed
        pytest.skip(f"FlashInfer's Cake kernels unavailable: {exc}")

    new, cached = (1, 7, 0, 20), (5, 0, 3, 30)
    args, kw = make_case(
        41,
        Hq=64,
        Hkv=8,
        D=128,
        dtype=BF16,
        cache_dtype=cache_dtype,
        new=new,
        cached=cached,
        page_size=16,
        packed=True,
    )
    order = {1: "after_rope", 2: "before_rope"}[policy]  # Cake's qk_norm_policy
    q_ref, kc_ref, vc_ref = expected(args, kw, norm_order=order, clear_unused_last_page_rows=True)
    T = args["q"].shape[0]
    qkv = to_device(np.ascontiguousarray(args["q"].base))
    dev = {k: to_device(v) for k, v in args.items() if k != "paged_kv_cache"}
    dev.update(q=qkv[:, :64], k=qkv[:, 64:72], v=qkv[:, 72:])
    ours = tuple(to_device(c) for c in args["paged_kv_cache"])
    theirs = tuple(to_device(c) for c in args["paged_kv_cache"])
    out = op(
        **{**dev, "paged_kv_cache": ours}, **kw, norm_order=order, clear_unused_last_page_rows=True
    )

    t = torch_view  # zero-copy torch views, bf16 and fp8 included

    seq_lens = to_device((np.asarray(cached) + np.asarray(new)).astype(np.int32))
    common = (
        t(qkv).view(T, -1),
        t(dev["cos_sin_cache"]),
        t(seq_lens),
        t(dev["input_row_offsets"]),
        t(dev["block_table"]),
    )
    weights = {"q_norm_weight": t(dev["q_gamma"]), "k_norm_weight": t(dev["k_gamma"])}
    if cache_dtype == BF16:
        q_fi = cake_bf16(
            *common,
            t(theirs[0]),
            t(theirs[1]),
            num_q_heads=64,
            num_kv_heads=8,
            qk_norm_policy=policy,
            clear_unused_last_page_rows=True,
            **weights,
        )
        assert_close(out, q_ref, "q_out")
        assert_close(q_fi, to_numpy(out), "q_out vs Cake")
    else:
        one = torch.ones(1, dtype=torch.float32, device=qkv.device.id)
        q_fi, _, flag = cake_fp8(
            *common,
            (t(theirs[0]), t(theirs[1])),
            is_prefill=True,
            k_scale=one,
            v_scale=one,
            quant_policy=2,
            q_scale_inv=one,
            qk_norm_policy=2,
            **weights,
        )
        assert (flag.cpu().numpy() == 0).all()
        assert_close(q_fi, to_numpy(out).astype(np.float32).astype(E4M3), "q_out vs Cake")
    torch.cuda.synchronize()
    # the written rows and the cleared tails agree (Cake also clears the last page of a request
    # with no new tokens, request 2 here; ropekv leaves it: outside the mask)
    mask = written_rows(args, kw) | tail_rows(args, kw)
    for a, b, ref in zip(ours, theirs, (kc_ref, vc_ref)):
        assert_close(to_numpy(a)[mask], ref[mask], "cache rows vs the reference")
        assert_close(to_numpy(a)[mask], to_numpy(b)[mask], "cache rows vs Cake")


# ---- Quantized outputs: fp8 q (static or dynamic scales), per-token-head KV scales ----------

E5M2 = np.dtype(ml_dtypes.float8_e5m2)
INT8 = np.dtype(np.int8)
MAX_CODE = {E4M3: 448.0, E5M2: 57344.0, INT8: 127.0}
# half a step of the code grid, relative: fp8 mantissas of 3 (e4m3) and 2 (e5m2) bits, int8 at
# its largest code; below the normal range the absolute step rules (in units of the scale)
HALF_STEP = {E4M3: 2.0**-4, E5M2: 2.0**-3}
SUBNORMAL_STEP = {E4M3: 2.0**-9, E5M2: 2.0**-16, INT8: 1.0}


def quant_arrays(args, kw, *, q_dynamic=False, kv_dynamic=False, seed=0):
    """Scale arrays of a quantizing call, filled with stale values (NaN among them) so that
    every slot the call must not write can be compared byte for byte."""
    rng = np.random.default_rng(seed)
    T, Hq, _ = args["q"].shape
    out = {}
    if q_dynamic:
        out["q_scale_out"] = np.full((T, Hq), -3.0, np.float32)
    if kv_dynamic:
        shape = args["paged_kv_cache"][0].shape[:3]

        def stale():
            x = rng.uniform(0.5, 2.0, shape).astype(np.float32)
            x[rng.random(shape) < 0.2] = np.nan
            return x

        out["kv_cache_scales"] = (stale(), stale())
    return out


def expected_quant(
    args,
    kw,
    quant,
    *,
    is_neox=True,
    kv_scale=None,
    q_dtype=None,
    q_scale=None,
    epsilon=1e-6,
    **options,
):
    """The reference's outputs of a quantizing call: a dict of q_out, k_cache, v_cache and the
    scale arrays (copies of those in ``quant``, written)."""
    kc, vc = (c.copy() for c in args["paged_kv_cache"])
    q_out = np.empty(args["q"].shape, args["q"].dtype if q_dtype is None else q_dtype)
    qs = quant.get("q_scale_out")
    qs = None if qs is None else qs.copy()
    ks, vs = (
        (None, None)
        if "kv_cache_scales" not in quant
        else (x.copy() for x in quant["kv_cache_scales"])
    )
    fp8 = kc.dtype in FP8_DTYPES and ks is None
    k_s, v_s = (
        (kv_scale if isinstance(kv_scale, tuple) else (kv_scale or 1.0,) * 2) if fp8 else (1.0, 1.0)
    )
    reference.qk_rmsnorm_rope_append_paged_kv_cache(
        args["q"],
        args["k"],
        args["v"],
        args["q_gamma"],
        args["k_gamma"],
        args["cos_sin_cache"],
        args["input_row_offsets"],
        args["cache_lengths"],
        args["block_table"],
        kc,
        vc,
        q_out,
        epsilon,
        is_neox,
        kw["kv_layout"],
        k_s,
        v_s,
        **options,
        q_scale=1.0 if q_scale is None else q_scale,
        q_scale_out=qs,
        k_scales=ks,
        v_scales=vs,
    )
    return {
        "q_out": q_out,
        "k_cache": kc,
        "v_cache": vc,
        "q_scale_out": qs,
        "k_scales": ks,
        "v_scales": vs,
    }


def with_cache(args, dtype):
    """``args`` with fresh caches of ``dtype`` (zeros) in the same layout."""
    shape = args["paged_kv_cache"][0].shape
    return dict(args, paged_kv_cache=tuple(np.zeros(shape, dtype) for _ in range(2)))


def assert_dequantizes_to(codes, scales, want, dtype, what):
    """``codes * scales`` (per row) within half a code step of ``want`` (float64)."""
    got = reference.dequantize_rows(codes, scales)
    scale = np.asarray(scales, np.float64)[..., None]
    if dtype == INT8:
        tol = 0.5 * scale * (1 + 1e-6) + 1e-6 * np.abs(want)
    else:
        tol = HALF_STEP[dtype] * np.abs(want) + SUBNORMAL_STEP[dtype] * scale
    err = np.abs(got - want)
    bad = np.argwhere(err > tol + 2e-3 * np.abs(want))  # + the 16-bit rounding of ``want``
    assert bad.size == 0, f"{what}: {len(bad)} values off, first at {tuple(bad[0])}"


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("q_dtype", [E4M3, E5M2])
def test_fp8_q_dequantizes_to_the_16_bit_result(q_dtype, dynamic):
    """fp8 q (NumPy backend): the caches are those of the 16-bit call, q's codes times their
    scale give its q within half a code step; a dynamic row's largest code is the largest code
    (its amax maps onto it) and its scale that amax over it."""
    args, kw = make_case(70, Hq=8, Hkv=2, D=64, new=(3, 1, 4), cached=(0, 6, 9))
    plain = dict(args, paged_kv_cache=tuple(c.copy() for c in args["paged_kv_cache"]))
    q16 = op(**plain, **kw).astype(np.float64)
    quant = quant_arrays(args, kw, q_dynamic=dynamic)
    scale = {} if dynamic else {"q_scale": 0.25}
    q8 = op(**args, **kw, q_out_dtype=q_dtype.name, **quant, **scale)
    assert q8.dtype == q_dtype
    for a, b in zip(args["paged_kv_cache"], plain["paged_kv_cache"]):
        assert_bytes_equal(a, b)
    scales = quant["q_scale_out"] if dynamic else np.full(q8.shape[:2], 0.25)
    assert_dequantizes_to(q8, scales, q16, q_dtype, "q")
    if dynamic:
        codes = np.abs(q8.astype(np.float64)).max(-1)
        np.testing.assert_array_equal(codes, MAX_CODE[q_dtype])
        np.testing.assert_allclose(
            quant["q_scale_out"], np.abs(q16).max(-1) / MAX_CODE[q_dtype], rtol=2e-3
        )
    want = expected_quant(
        args, kw, quant_arrays(args, kw, q_dynamic=dynamic), q_dtype=q_dtype, **scale
    )
    assert_bytes_equal(q8, want["q_out"])
    if dynamic:
        assert_bytes_equal(quant["q_scale_out"], want["q_scale_out"])


@pytest.mark.parametrize("clear", [False, True])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2, INT8])
def test_kv_cache_scales_quantize_each_written_row(cache_dtype, layout, clear):
    """Per-token-head KV scales (NumPy backend): each written row's codes times its scale give
    the 16-bit cache row within half a step, its largest code is the largest code; cleared tail
    rows have zero codes and scale 0; every other slot keeps its bytes, in the caches and in the
    scale arrays."""
    args, kw = make_case(71, layout=layout, new=(3, 0, 2, 4), cached=(0, 5, 17, 4))
    args = with_cache(args, cache_dtype)
    args["paged_kv_cache"] = tuple(
        (np.random.default_rng(i).standard_normal(args["paged_kv_cache"][0].shape) * 20).astype(
            cache_dtype
        )
        for i in range(2)
    )
    plain = with_cache(args, args["q"].dtype)
    q16 = op(**plain, **kw, clear_unused_last_page_rows=clear)
    quant = quant_arrays(args, kw, kv_dynamic=True)
    before = [c.copy() for c in (*args["paged_kv_cache"], *quant["kv_cache_scales"])]
    q = op(**args, **kw, **quant, clear_unused_last_page_rows=clear)
    np.testing.assert_array_equal(q, q16)
    written = written_rows(args, kw)
    tail = tail_rows(args, kw) if clear else np.zeros_like(written)
    assert written.sum() == 9 * 2 and tail.sum() == (2 * 2 if clear else 0)
    for codes, scales, want, old_c, old_s in zip(
        args["paged_kv_cache"],
        quant["kv_cache_scales"],
        plain["paged_kv_cache"],
        before[:2],
        before[2:],
    ):
        assert_dequantizes_to(
            codes[written],
            scales[written],
            want[written].astype(np.float64),
            cache_dtype,
            "cache rows",
        )
        np.testing.assert_array_equal(
            np.abs(codes[written].astype(np.float64)).max(-1), MAX_CODE[cache_dtype]
        )
        assert not codes[tail].view(np.uint8).any() and not scales[tail].view(np.uint8).any()
        keep = ~written & ~tail
        assert_bytes_equal(codes[keep], old_c[keep])
        assert_bytes_equal(scales[keep], old_s[keep])
    want = expected_quant(
        dict(args, paged_kv_cache=tuple(before[:2])),
        kw,
        {"kv_cache_scales": tuple(before[2:])},
        clear_unused_last_page_rows=clear,
    )
    for got, name in zip(
        (*args["paged_kv_cache"], *quant["kv_cache_scales"]),
        ("k_cache", "v_cache", "k_scales", "v_scales"),
    ):
        assert_bytes_equal(got, want[name], name)


@given(
    seed=seeds,
    layout=st.sampled_from(["NHD", "HND"]),
    cache_dtype=st.sampled_from([E4M3, E5M2, INT8]),
)
def test_quantized_prefix_cached_run_equals_full_prefill(seed, layout, cache_dtype):
    """Computed scales belong to rows, not to calls: a prefill split over two calls writes the
    same fp8 q, q scales, cache codes and cache scales as one call (NumPy backend)."""
    full, kw = make_case(seed, new=(7, 5), cached=(0, 0), layout=layout)
    full = with_cache(full, cache_dtype)
    q_dtype = None if cache_dtype == INT8 else E4M3
    quant = quant_arrays(full, kw, q_dynamic=q_dtype is not None, kv_dynamic=True, seed=seed)
    steps = dict(full, paged_kv_cache=tuple(c.copy() for c in full["paged_kv_cache"]))
    step_scales = tuple(x.copy() for x in quant["kv_cache_scales"])
    q_full = op(**full, **kw, q_out_dtype=q_dtype, **quant)
    idx1, idx2 = np.r_[0:3, 7:9], np.r_[3:7, 9:12]
    outs, q_scales = [], []
    for idx, offs, lens in ((idx1, [0, 3, 5], [0, 0]), (idx2, [0, 4, 7], [3, 2])):
        qs = {} if q_dtype is None else {"q_scale_out": np.zeros((len(idx), 8), np.float32)}
        outs.append(
            op(
                **dict(
                    steps,
                    q=steps["q"][idx],
                    k=steps["k"][idx],
                    v=steps["v"][idx],
                    input_row_offsets=np.array(offs, np.int32),
                    cache_lengths=np.array(lens, np.int32),
                ),
                **kw,
                q_out_dtype=q_dtype,
                kv_cache_scales=step_scales,
                **qs,
            )
        )
        q_scales.append(qs.get("q_scale_out"))
    order = np.argsort(np.r_[idx1, idx2])
    assert_bytes_equal(np.concatenate(outs)[order], q_full)
    if q_dtype is not None:
        assert_bytes_equal(np.concatenate(q_scales)[order], quant["q_scale_out"])
    for a, b in zip(
        (*steps["paged_kv_cache"], *step_scales),
        (*full["paged_kv_cache"], *quant["kv_cache_scales"]),
    ):
        assert_bytes_equal(a, b)


@pytest.mark.parametrize("kind", [1, 2, 3])
def test_quantized_outputs_untouched_on_a_failing_status(kind):
    """status= with malformed offsets (NumPy backend): q_out, q_scale_out, the caches and their
    scale arrays keep every byte."""
    args, kw = make_case(72, new=(3, 2, 2), cached=(0, 5, 17), cache_dtype=E4M3)
    args["input_row_offsets"] = malform(args["input_row_offsets"], kind)
    quant = quant_arrays(args, kw, q_dynamic=True, kv_dynamic=True)
    q_out = np.full(args["q"].shape, 7, E4M3)
    before = [
        x.copy()
        for x in (q_out, quant["q_scale_out"], *args["paged_kv_cache"], *quant["kv_cache_scales"])
    ]
    status = np.full(1, 99, np.int32)
    op(**args, **kw, q_out=q_out, status=status, **quant)
    assert status[0] == kind
    for got, old in zip(
        (q_out, quant["q_scale_out"], *args["paged_kv_cache"], *quant["kv_cache_scales"]), before
    ):
        assert_bytes_equal(got, old)


def test_q_out_dtype_spellings():
    """A dtype, its name, the ml_dtypes type, or a given fp8 q_out (with or without a matching
    q_out_dtype) select the same output."""
    outs = []
    for spelling in (E4M3, "float8_e4m3fn", ml_dtypes.float8_e4m3fn):
        args, kw = make_case(73)
        outs.append(op(**args, **kw, q_out_dtype=spelling))
    for dtype in (None, "float8_e4m3fn"):
        args, kw = make_case(73)
        given = np.zeros(args["q"].shape, E4M3)
        assert op(**args, **kw, q_out=given, q_out_dtype=dtype) is given
        outs.append(given)
    args, kw = make_case(73)
    assert op(**args, **kw, q_out_dtype="float16").dtype == np.float16  # q's own dtype
    for out in outs:
        assert out.dtype == E4M3
        assert_bytes_equal(out, outs[0])


def test_fp8_q_validation():
    bad(
        TypeError,
        r"q_out_dtype must be float16 or float8_e4m3fn or float8_e5m2 \(a dtype or "
        r"its name\), got 'float32'",
        {"q_out_dtype": "float32"},
    )
    bad(TypeError, "q_out_dtype must be", {"q_out_dtype": "e4m3"})
    bad(
        TypeError,
        r"q_out_dtype \(float8_e5m2\) must be the dtype of the given q_out "
        r"\(float8_e4m3fn\)",
        {"q_out_dtype": "float8_e5m2", "q_out": np.zeros((5, 8, 32), E4M3)},
    )
    bad(
        TypeError,
        "q_out must have dtype float16 or float8_e4m3fn or float8_e5m2, got float32",
        {"q_out": np.zeros((5, 8, 32), np.float32)},
    )
    bad(ValueError, r"q_out must have shape = \(5, 8, 32\)", {"q_out": np.zeros((5, 8, 16), E4M3)})
    bad(
        ValueError,
        "q_scale is only used with a float8 q_out, but q_out is float16",
        {"q_scale": 0.5},
    )
    bad(
        ValueError,
        "q_scale must be a finite positive number",
        {"q_scale": 0.0, "q_out_dtype": E4M3},
    )
    bad(TypeError, "q_scale must be a real number", {"q_scale": "1", "q_out_dtype": E4M3})
    qs = np.zeros((5, 8), np.float32)
    bad(
        ValueError,
        "q_scale_out is only used with a float8 q_out, but q_out is float16",
        {"q_scale_out": qs},
    )
    bad(
        ValueError,
        "q_scale .* and q_scale_out .* exclude each other",
        {"q_scale_out": qs, "q_scale": 1.0, "q_out_dtype": E4M3},
    )
    bad(
        ValueError,
        r"q_scale_out must have shape \(T, Hq\) = \(5, 8\), got \(8, 5\)",
        {"q_scale_out": qs.T.copy(), "q_out_dtype": E4M3},
    )
    bad(
        TypeError,
        "q_scale_out must have dtype float32, got float16",
        {"q_scale_out": qs.astype(np.float16), "q_out_dtype": E4M3},
    )
    ro = qs.copy()
    ro.flags.writeable = False
    bad(BufferError, "q_scale_out is written in place", {"q_scale_out": ro, "q_out_dtype": E4M3})
    bad(
        ValueError,
        "q_scale_out is written but has stride 0",
        {
            "q_scale_out": np.lib.stride_tricks.as_strided(np.zeros(8, np.float32), (5, 8), (0, 4)),
            "q_out_dtype": E4M3,
        },
    )


def test_kv_cache_scales_validation():
    fp8 = tuple(np.zeros((12, 4, 2, 32), E4M3) for _ in range(2))
    int8 = tuple(np.zeros((12, 4, 2, 32), INT8) for _ in range(2))
    sc = tuple(np.zeros((12, 4, 2), np.float32) for _ in range(2))
    bad(
        ValueError,
        r"kv_cache_scales must be a tuple \(k_scales, v_scales\), got ndarray",
        {"kv_cache_scales": sc[0]},
        paged_kv_cache=fp8,
    )
    bad(
        ValueError,
        r"k_scales must have shape \(num_pages, page_size, Hkv\) for NHD = "
        r"\(12, 4, 2\), got \(12, 2, 4\)",
        {"kv_cache_scales": (np.zeros((12, 2, 4), np.float32), sc[1])},
        paged_kv_cache=fp8,
    )
    bad(
        ValueError,
        r"v_scales must have shape \(num_pages, Hkv, page_size\) for HND",
        {"kv_cache_scales": (np.zeros((12, 2, 4), np.float32), sc[1]), "kv_layout": "HND"},
        paged_kv_cache=tuple(np.zeros((12, 2, 4, 32), E4M3) for _ in range(2)),
    )
    bad(
        TypeError,
        "v_scales must have dtype float32, got float64",
        {"kv_cache_scales": (sc[0], sc[1].astype(np.float64))},
        paged_kv_cache=fp8,
    )
    ro = sc[1].copy()
    ro.flags.writeable = False
    bad(
        BufferError,
        "v_scales is written in place",
        {"kv_cache_scales": (sc[0], ro)},
        paged_kv_cache=fp8,
    )
    both = np.zeros((12, 4, 2), np.float32)
    bad(
        ValueError,
        "k_scales is written in place but shares memory with v_scales",
        {"kv_cache_scales": (both, both)},
        paged_kv_cache=fp8,
    )
    bad(
        TypeError,
        "an fp8 q_out .* with an int8 cache is not supported",
        {"kv_cache_scales": sc, "q_out_dtype": E4M3},
        paged_kv_cache=int8,
    )


def assert_codes_close(got, want, what):
    """Quantized codes: fp8 equal or adjacent (assert_close); int8 within one (a float32 kernel
    and the float64 reference may round a value at .5 either way)."""
    got = to_numpy(got)
    if want.dtype == INT8:
        diff = np.abs(got.astype(np.int32) - want.astype(np.int32))
        assert diff.max(initial=0) <= 1, f"{what}: int8 codes differ by {diff.max()}"
    else:
        assert_close(got, want, what)


def assert_scales_close(got, want, what):
    """Computed scales (float32): a float32 kernel's row maximum against the float64 one."""
    got = to_numpy(got).astype(np.float64)
    np.testing.assert_allclose(
        got, want.astype(np.float64), rtol=1e-4, atol=0, equal_nan=True, err_msg=what
    )


def check_quant_on_device(
    args,
    kw,
    quant,
    *,
    is_neox=True,
    kv_scale=None,
    q_dtype=None,
    q_scale=None,
    given=False,
    clear=False,
    status=False,
    **options,
):
    """Run a quantizing call on device copies of ``args`` and ``quant`` (quant_arrays) and compare
    every output with the reference; the slots the call must not write keep their bytes (caches
    and scale arrays)."""
    import cupy as cp

    want = expected_quant(
        args,
        kw,
        quant,
        is_neox=is_neox,
        kv_scale=kv_scale,
        q_dtype=q_dtype,
        q_scale=q_scale,
        clear_unused_last_page_rows=clear,
        **options,
    )
    mask = written_rows(args, kw, options.get("position_ids"))
    if clear:
        mask |= tail_rows(args, kw, options.get("position_ids"))
    dev = {k: to_device(v) for k, v in args.items() if k not in ("q", "k", "v")}
    Hq, Hkv = args["q"].shape[1], args["k"].shape[1]
    if args["q"].base is not None and args["q"].base is args["k"].base:  # keep the packing
        qkv = cp.asarray(args["q"].base)
        dev.update(q=qkv[:, :Hq], k=qkv[:, Hq : Hq + Hkv], v=qkv[:, Hq + Hkv :])
    else:
        dev.update(q=to_device(args["q"]), k=to_device(args["k"]), v=to_device(args["v"]))
    dq = {k: to_device(v) for k, v in quant.items()}
    extra = {"q_out_dtype": q_dtype}
    if given:
        extra = {"q_out": to_device(np.full(args["q"].shape, np.nan, want["q_out"].dtype))}
    if status:
        extra["status"] = cp.full(1, 99, cp.int32)
    out = op(
        **dev,
        **kw,
        is_neox=is_neox,
        kv_scale=kv_scale,
        q_scale=q_scale,
        **extra,
        **dq,
        **{n: to_device(x) for n, x in options.items()},
        clear_unused_last_page_rows=clear,
    )
    if given:
        assert out is extra["q_out"]
    if status:
        assert int(extra["status"][0]) == 0
    assert_codes_close(out, want["q_out"], "q_out")
    if "q_scale_out" in quant:
        assert_scales_close(dq["q_scale_out"], want["q_scale_out"], "q_scale_out")
    caches = dev["paged_kv_cache"]
    scales = dq.get("kv_cache_scales", (None, None))
    for i, name in enumerate(("k", "v")):
        got, ref, old = to_numpy(caches[i]), want[f"{name}_cache"], args["paged_kv_cache"][i]
        assert_codes_close(got[mask], ref[mask], f"{name}_cache")
        assert_bytes_equal(got[~mask], old[~mask], f"untouched {name}_cache rows")
        if scales[i] is not None:
            got_s, old_s = to_numpy(scales[i]), quant["kv_cache_scales"][i]
            assert_scales_close(got_s[mask], want[f"{name}_scales"][mask], f"{name}_scales")
            assert_bytes_equal(got_s[~mask], old_s[~mask], f"untouched {name}_scales")


@pytest.mark.gpu
@given(
    seed=seeds,
    dtype=st.sampled_from(INPUT_DTYPES),
    data=st.data(),
    heads=st.sampled_from([(32, 4), (64, 8), (16, 16), (6, 2)]),
    layout=st.sampled_from(["NHD", "HND"]),
    is_neox=st.sampled_from([True, True, False]),
    page_size=st.sampled_from([1, 16, 32]),
    new=st.lists(st.integers(0, 24), min_size=1, max_size=4),
    q_mode=st.sampled_from([None, "static", "dynamic", "dynamic"]),
    q_dtype=st.sampled_from([E4M3, E4M3, E5M2]),
    kv_mode=st.sampled_from([None, E4M3, E5M2, INT8, INT8]),
    given_q=st.booleans(),
    packed=st.booleans(),
    norm_order=st.sampled_from(["before_rope", "after_rope"]),
    weight_offset=st.sampled_from([0.0, 0.0, 1.0]),
    clear=st.booleans(),
    status=st.booleans(),
    mrope=st.sampled_from([None, None, "chunked", "interleaved"]),
)
def test_quantizing_kernel_matches_reference(
    seed,
    dtype,
    data,
    heads,
    layout,
    is_neox,
    page_size,
    new,
    q_mode,
    q_dtype,
    kv_mode,
    given_q,
    packed,
    norm_order,
    weight_offset,
    clear,
    status,
    mrope,
):
    """fp8 q (static or dynamic scales) and per-token-head KV scales, alone and together, with
    every other option (norm order, weight offset, tail clearing, status, mRoPE, NHD/HND,
    neox/interleaved, packed strided views, a given or new q_out)."""
    if q_mode is None and kv_mode is None:
        kv_mode = E4M3
    if q_mode is not None and kv_mode == INT8:
        kv_mode = E5M2  # fp8 q with an int8 cache is refused
    Hq, Hkv = heads
    D, R = data.draw(
        st.sampled_from([(128, 128), (128, 128), (64, 64), (128, 64), (256, 256), (80, 40)])
    )
    cache_dtype = (
        kv_mode if kv_mode is not None else data.draw(st.sampled_from([dtype, *FP8_DTYPES]))
    )
    cached = data.draw(st.lists(st.integers(0, 200), min_size=len(new), max_size=len(new)))
    kv_scale = (
        data.draw(st.sampled_from([None, 0.5, (2.0, 0.25)]))
        if kv_mode is None and cache_dtype in FP8_DTYPES
        else None
    )
    args, kw = make_case(
        seed,
        Hq=Hq,
        Hkv=Hkv,
        D=D,
        R=R,
        dtype=dtype,
        cache_dtype=cache_dtype,
        new=new,
        cached=cached,
        page_size=page_size,
        layout=layout,
        gamma_f32=True,
        packed=packed,
    )
    if cache_dtype == INT8:
        args["paged_kv_cache"] = tuple(
            np.random.default_rng(seed + i)
            .integers(-127, 128, args["paged_kv_cache"][0].shape)
            .astype(INT8)
            for i in range(2)
        )
    options = {}
    if mrope:
        ids, section = mrope_case(
            np.random.default_rng(seed), args, R, mrope == "interleaved", bad_share=0.1
        )
        options = {
            "position_ids": ids,
            "mrope_section": section,
            "mrope_interleaved": mrope == "interleaved",
        }
    quant = quant_arrays(
        args, kw, q_dynamic=q_mode == "dynamic", kv_dynamic=kv_mode is not None, seed=seed
    )
    check_quant_on_device(
        args,
        kw,
        quant,
        is_neox=is_neox,
        kv_scale=kv_scale,
        q_dtype=None if q_mode is None else q_dtype,
        q_scale=0.125 if q_mode == "static" else None,
        given=given_q,
        clear=clear,
        status=status,
        norm_order=norm_order,
        weight_offset=weight_offset,
        **options,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kv", [E4M3, INT8])
def test_quantized_qwen3_decode_and_prefill(layout, kv):
    """The launch shapes of serving: Qwen3-32B heads at decode (rows split over blocks) and a
    long prefill (two rows per lane group), packed bf16 qkv, dynamic fp8 q with an fp8 cache or
    bf16 q with an int8 cache, both with per-token-head scales."""
    q_dtype = E4M3 if kv != INT8 else None
    for new, cached, seed in (
        ((1,) * 64, tuple(range(0, 640, 10)), 80),
        ((600, 0, 700), (0, 2, 50), 81),
        ((1,) * 200, (7,) * 200, 82),
    ):
        args, kw = make_case(
            seed,
            Hq=64,
            Hkv=8,
            D=128,
            dtype=BF16,
            cache_dtype=kv,
            new=new,
            cached=cached,
            page_size=16,
            layout=layout,
            packed=True,
        )
        quant = quant_arrays(args, kw, q_dynamic=q_dtype is not None, kv_dynamic=True, seed=seed)
        check_quant_on_device(args, kw, quant, q_dtype=q_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", [1, 2, 3])
@pytest.mark.parametrize("T_new", [1, 40])
def test_quantized_outputs_untouched_on_a_failing_status_on_device(kind, T_new):
    """Malformed offsets: status holds the code and q_out, q_scale_out, the caches and their
    scale arrays keep every byte."""
    import cupy as cp

    new = (T_new, 0, 0) if T_new > 1 else (1, 0, 0)
    args, kw = make_case(
        90 + kind,
        Hq=16,
        Hkv=4,
        D=128,
        dtype=BF16,
        cache_dtype=E4M3,
        new=new,
        cached=(3, 9, 20),
        page_size=16,
    )
    args["input_row_offsets"] = malform(args["input_row_offsets"], kind)
    code = reference.ragged_offsets_status(args["input_row_offsets"], T_new)
    assert code != 0
    quant = quant_arrays(args, kw, q_dynamic=True, kv_dynamic=True)
    dev = {k: to_device(v) for k, v in args.items()}
    dq = {k: to_device(v) for k, v in quant.items()}
    q_out = to_device(np.full(args["q"].shape, 7, E4M3))
    status = cp.full(1, 99, cp.int32)
    op(**dev, **kw, q_out=q_out, status=status, **dq)
    assert int(status[0]) == code
    assert bool((q_out.view(cp.uint8) == np.full(1, 7, E4M3).view(np.uint8)[0]).all())
    for got, old in zip(
        (dq["q_scale_out"], *dev["paged_kv_cache"], *dq["kv_cache_scales"]),
        (quant["q_scale_out"], *args["paged_kv_cache"], *quant["kv_cache_scales"]),
    ):
        assert_bytes_equal(to_numpy(got), old, "after malformed offsets")


@pytest.mark.gpu
@pytest.mark.parametrize("clear", [False, True])
@pytest.mark.parametrize("tokens", ["decode", "prefill"])
def test_quantized_hostile_indices_never_write_out_of_bounds(tokens, clear):
    """Malformed offsets, lengths and block-table entries with per-token-head scales and dynamic
    fp8 q: guard bytes around the caches, the scale arrays and q_scale_out stay; every slot but
    the written (and cleared) ones keeps its bytes."""
    import cupy as cp

    new = (1, 1, 1, 1) if tokens == "decode" else (5, 3, 4, 0)
    args, kw = make_case(
        41,
        Hq=8,
        Hkv=2,
        D=64,
        dtype=BF16,
        cache_dtype=E4M3,
        new=new,
        cached=(0, 0, 0, 3),
        page_size=4,
        packed=True,
    )
    args["cache_lengths"] = np.array([0, 2**31 - 3, -7, 1], np.int32)
    args["block_table"][0, :2] = [-5, 2**31 - 1]
    if clear:
        spare = np.setdiff1d(np.arange(args["paged_kv_cache"][0].shape[0]), args["block_table"])
        args["block_table"][0, :2] = spare[:2]
    args["input_row_offsets"][2] = args["input_row_offsets"][3] + 1  # not monotonic
    quant = quant_arrays(args, kw, q_dynamic=True, kv_dynamic=True)
    want = expected_quant(args, kw, quant, q_dtype=E4M3, clear_unused_last_page_rows=clear)
    guard = 64

    def guarded(x):  # a device copy of x inside a buffer of guard bytes (0x5A)
        raw = np.concatenate(
            [
                np.full(guard, 0x5A, np.uint8),
                x.view(np.uint8).ravel(),
                np.full(guard, 0x5A, np.uint8),
            ]
        )
        buf = cp.asarray(raw)
        return buf, buf[guard:-guard].view(x.dtype if x.dtype not in FP8_DTYPES else cp.uint8)

    bufs, dev = [], {}
    for name, x in (
        ("k", args["paged_kv_cache"][0]),
        ("v", args["paged_kv_cache"][1]),
        ("ks", quant["kv_cache_scales"][0]),
        ("vs", quant["kv_cache_scales"][1]),
        ("qs", quant["q_scale_out"]),
    ):
        buf, view = guarded(x)
        if x.dtype in FP8_DTYPES:
            view = view.view(x.dtype)
        bufs.append(buf)
        dev[name] = view.reshape(x.shape)
    rest = {k: to_device(v) for k, v in args.items() if k not in ("q", "k", "v", "paged_kv_cache")}
    qkv = cp.asarray(args["q"].base)
    out = op(
        q=qkv[:, :8],
        k=qkv[:, 8:10],
        v=qkv[:, 10:],
        **rest,
        **kw,
        paged_kv_cache=(dev["k"], dev["v"]),
        kv_cache_scales=(dev["ks"], dev["vs"]),
        q_scale_out=dev["qs"],
        q_out_dtype=E4M3,
        clear_unused_last_page_rows=clear,
    )
    assert_codes_close(out, want["q_out"], "q_out")
    assert_scales_close(dev["qs"], want["q_scale_out"], "q_scale_out")
    for buf in bufs:
        host = to_numpy(buf)
        assert (host[:guard] == 0x5A).all() and (host[-guard:] == 0x5A).all(), "guard bytes"
    mask = written_rows(args, kw)
    for name, i in (("k", 0), ("v", 1)):
        old_c, old_s = args["paged_kv_cache"][i], quant["kv_cache_scales"][i]
        changed = (want[f"{name}_cache"].view(np.uint8) != old_c.view(np.uint8)).any(-1) | (
            want[f"{name}_scales"].view(np.uint32) != old_s.view(np.uint32)
        )
        m = mask | changed  # the rows the reference writes or clears
        got_c, got_s = to_numpy(dev[name]), to_numpy(dev[f"{name}s"])
        assert_codes_close(got_c[m], want[f"{name}_cache"][m], f"{name}_cache")
        assert_scales_close(got_s[m], want[f"{name}_scales"][m], f"{name}_scales")
        assert_bytes_equal(got_c[~m], old_c[~m], f"untouched {name}_cache rows")
        assert_bytes_equal(got_s[~m], old_s[~m], f"untouched {name}_scales")


@pytest.mark.gpu
@pytest.mark.parametrize("is_prefill", [False, True])
def test_dynamic_fp8_q_matches_flashinfer_cake(is_prefill):
    """FlashInfer 0.7.2's Cake fp8 kernel with quant_policy=1 (dynamic per-token-per-head q
    scales) on the same inputs (packed bf16 qkv, Qwen3-32B heads, NHD, e4m3 cache, float32
    weights, norm then RoPE): the same e4m3 q codes (or adjacent) and scales. Cake's prefill
    scales are laid out (B, Hq, round_up(max_seqlen, 128)) by the token's index in its request:
    mapped onto ropekv's (T, Hq)."""
    torch = pytest.importorskip("torch")
    try:
        from flashinfer.cake_fused_qk_rope_fp8_append import (
            cake_fused_qk_rmsnorm_rope_quantize_fp8_append_paged_kv_cache as cake_fp8,
        )
    except Exception as exc:  # noqa: BLE001 - not installed (0.7.2 or later), or its JIT failed
        pytest.skip(f"FlashInfer's Cake kernels unavailable: {exc}")
    import cupy as cp

    new, cached = (
        ((1, 1, 1, 1), (5, 0, 3, 30)) if not is_prefill else ((1, 7, 20, 130), (5, 0, 3, 30))
    )
    args, kw = make_case(
        42,
        Hq=64,
        Hkv=8,
        D=128,
        dtype=BF16,
        cache_dtype=E4M3,
        new=new,
        cached=cached,
        page_size=16,
        packed=True,
    )
    T = args["q"].shape[0]
    qkv = to_device(np.ascontiguousarray(args["q"].base))
    dev = {k: to_device(v) for k, v in args.items() if k != "paged_kv_cache"}
    dev.update(q=qkv[:, :64], k=qkv[:, 64:72], v=qkv[:, 72:])
    ours = tuple(to_device(c) for c in args["paged_kv_cache"])
    theirs = tuple(to_device(c) for c in args["paged_kv_cache"])
    q_scale_out = cp.zeros((T, 64), cp.float32)
    out = op(**{**dev, "paged_kv_cache": ours}, **kw, q_out_dtype=E4M3, q_scale_out=q_scale_out)

    t = torch_view  # zero-copy torch views, bf16 and fp8 included

    seq_lens = to_device((np.asarray(cached) + np.asarray(new)).astype(np.int32))
    one = torch.ones(1, dtype=torch.float32, device=qkv.device.id)
    max_seqlen = max(new)
    q_fi, scale_fi, flag = cake_fp8(
        t(qkv).view(T, -1),
        t(dev["cos_sin_cache"]),
        t(seq_lens),
        t(dev["input_row_offsets"]),
        t(dev["block_table"]),
        (t(theirs[0]), t(theirs[1])),
        is_prefill=is_prefill,
        k_scale=one,
        v_scale=one,
        quant_policy=1,
        max_seqlen=max_seqlen,
        qk_norm_policy=2,
        q_norm_weight=t(dev["q_gamma"]),
        k_norm_weight=t(dev["k_gamma"]),
    )
    torch.cuda.synchronize()
    assert (flag.cpu().numpy() == 0).all()
    scale_fi = scale_fi.cpu().numpy()
    if is_prefill:  # (B, Hq, aligned) by the index inside the request -> (T, Hq)
        offs = args["input_row_offsets"].astype(np.int64)
        b = np.searchsorted(offs, np.arange(T), side="right") - 1
        scale_fi = scale_fi[b, :, np.arange(T) - offs[b]]
    want = expected_quant(args, kw, {"q_scale_out": np.zeros((T, 64), np.float32)}, q_dtype=E4M3)
    assert_codes_close(out, want["q_out"], "q_out vs the reference")
    assert_scales_close(q_scale_out, want["q_scale_out"], "q_scale_out vs the reference")
    assert_codes_close(q_fi, to_numpy(out), "q_out vs Cake")
    np.testing.assert_allclose(
        scale_fi, to_numpy(q_scale_out), rtol=1e-3, err_msg="q scales vs Cake"
    )
    mask = written_rows(args, kw)
    for a, b in zip(ours, theirs):
        assert_codes_close(to_numpy(a)[mask], to_numpy(b)[mask], "cache rows vs Cake")
