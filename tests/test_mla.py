"""``ropekv.mla_rope_rmsnorm_append_paged_kv_cache``: the reference's properties, the NumPy
backend, every validation rule (CPU), and the kernel against the reference (GPU)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import ropekv
from ropekv import reference
from tests.strategies import FP8_DTYPES, INPUT_DTYPES, seeds
from tests.tolerance import assert_bytes_equal, assert_close, to_device, to_numpy

BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
op = ropekv.mla_rope_rmsnorm_append_paged_kv_cache


def random_cache_bytes(rng, shape, dtype):
    """Cache contents that are not zeros: random finite values (so untouched bytes are visible)."""
    return (rng.standard_normal(shape) * 0.5).astype(dtype)


def make_case(
    seed,
    *,
    Hq=4,
    L=32,
    R=16,
    dtype=np.float16,
    cache_dtype=None,
    new=(3, 0, 2),
    cached=(0, 5, 17),
    page_size=4,
    split=False,
    kv_norm_dim=None,
    gamma_f32=True,
    offsets_dtype=np.int32,
    spare_pages=3,
    P=None,
    kv_scale=None,
):
    """A ragged batch over a shuffled paged cache, as NumPy arrays (keyword arguments of the op).

    Every request owns distinct pages (a random permutation), so no two tokens share a row."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    cache_dtype = dtype if cache_dtype is None else np.dtype(cache_dtype)
    new, cached = np.asarray(new), np.asarray(cached)
    B, T = len(new), int(new.sum())
    ends = cached + new
    pages_per = np.maximum(-(-ends // page_size), 1)
    max_pages = int(pages_per.max()) + 1
    num_pages = int(pages_per.sum()) + spare_pages
    perm = rng.permutation(num_pages)
    table = np.full((B, max_pages), -1, np.int32)
    at = 0
    for b in range(B):
        table[b, : pages_per[b]] = perm[at : at + pages_per[b]]
        at += pages_per[b]
    P = int(ends.max()) + 8 if P is None else P
    n = L if kv_norm_dim is None else kv_norm_dim
    full = random_cache_bytes(rng, (num_pages, page_size, L + R), cache_dtype)
    kv_cache = (
        (np.ascontiguousarray(full[..., :L]), np.ascontiguousarray(full[..., L:]))
        if split
        else full
    )
    args = {
        "q_rope": rng.standard_normal((T, Hq, R)).astype(dtype),
        "kv": (rng.standard_normal((T, L + R)) * 2).astype(dtype),
        "gamma": rng.uniform(0.5, 1.5, n).astype(np.float32 if gamma_f32 else dtype),
        "cos_sin_cache": ropekv.cos_sin_cache(P, R),
        "input_row_offsets": np.concatenate([[0], np.cumsum(new)]).astype(offsets_dtype),
        "cache_lengths": cached.astype(np.int32),
        "block_table": table,
        "kv_cache": kv_cache,
    }
    kw = {"kv_norm_dim": kv_norm_dim}
    if kv_scale is not None:
        kw["kv_scale"] = kv_scale
    return args, kw


def copy_args(args):
    out = {
        k: v.copy() if isinstance(v, np.ndarray) else tuple(x.copy() for x in v)
        for k, v in args.items()
    }
    return out


def cache_parts(kv_cache, L):
    if isinstance(kv_cache, tuple):
        return kv_cache
    return kv_cache[..., :L], kv_cache[..., L:]


def expected(args, kw, is_neox=False, epsilon=1e-6, clear=False):
    """(q_rope_out, ckv, kpe) of the reference on copies of ``args``."""
    a = copy_args(args)
    L = a["kv"].shape[1] - a["q_rope"].shape[2]
    ckv, kpe = cache_parts(a["kv_cache"], L)
    q_out = np.empty_like(a["q_rope"])
    cache = a["kv_cache"][0] if isinstance(a["kv_cache"], tuple) else a["kv_cache"]
    scale = kw.get("kv_scale") or 1.0 if cache.dtype in FP8_DTYPES else 1.0
    reference.mla_rope_rmsnorm_append_paged_kv_cache(
        a["q_rope"],
        a["kv"],
        a["gamma"],
        a["cos_sin_cache"],
        a["input_row_offsets"],
        a["cache_lengths"],
        a["block_table"],
        ckv,
        kpe,
        q_out,
        epsilon,
        kw.get("kv_norm_dim"),
        is_neox,
        scale,
        clear,
    )
    return q_out, np.array(ckv), np.array(kpe)


def tail_rows(args, page_size, num_pages):
    """Boolean (num_pages, page_size): the rows of each request's last page past its new length
    (requests with new tokens whose last page is in the table), from the lengths directly."""
    offs = np.asarray(args["input_row_offsets"], np.int64)
    lens, table = np.asarray(args["cache_lengths"], np.int64), args["block_table"]
    mask = np.zeros((num_pages, page_size), bool)
    for b in range(len(lens)):
        n = offs[b + 1] - offs[b]
        end = lens[b] + n
        if n <= 0 or end % page_size == 0:
            continue
        page = table[b, (end - 1) // page_size]
        if 0 <= page < num_pages:
            mask[page, end % page_size :] = True
    return mask


def written_rows(args):
    """Boolean mask (num_pages, page_size) of the cache rows the call addresses."""
    cache = args["kv_cache"][0] if isinstance(args["kv_cache"], tuple) else args["kv_cache"]
    num_pages, page_size = cache.shape[:2]
    P = args["cos_sin_cache"].shape[0]
    req, pos, page, entry = reference.ragged_paged_slots(
        args["input_row_offsets"],
        args["cache_lengths"],
        args["block_table"],
        page_size,
        num_pages,
        args["q_rope"].shape[0],
    )
    ok = (req >= 0) & (pos < P) & (page >= 0)
    mask = np.zeros((num_pages, page_size), bool)
    mask[page[ok], entry[ok]] = True
    return mask


# ---- CPU: the reference and the NumPy backend ------------------------------------------------


@pytest.mark.parametrize("split", [False, True])
def test_clear_unused_last_page_rows_zeroes_the_tails_only(split):
    """The rows past each request's new length on its last page become zeros; the written rows
    are those of a call without the option; every other row keeps its bytes."""
    args, kw = make_case(8, new=(3, 0, 2, 4), cached=(0, 5, 17, 4), split=split)
    plain = copy_args(args)
    op(**plain, **kw)
    before = copy_args(args)
    op(**args, **kw, clear_unused_last_page_rows=True)
    L = args["kv"].shape[1] - args["q_rope"].shape[2]
    num_pages, page_size = (args["kv_cache"][0] if split else args["kv_cache"]).shape[:2]
    tail, written = tail_rows(args, page_size, num_pages), written_rows(args)
    assert tail.sum() == 1 + 1 + 0 + 0  # request 0 ends at 3, request 2 at 19, request 3 at 8
    assert not (tail & written).any()
    for got, ref, old in zip(
        cache_parts(args["kv_cache"], L),
        cache_parts(plain["kv_cache"], L),
        cache_parts(before["kv_cache"], L),
    ):
        assert not np.asarray(got)[tail].view(np.uint8).any()
        assert_bytes_equal(got[written], ref[written])
        assert_bytes_equal(got[~tail & ~written], old[~tail & ~written])


def malform(offsets, kind):
    offs = offsets.copy()
    if kind == 1:
        offs[0] = 1
    elif kind == 2:
        offs[1] = offs[2] + 1
    elif kind == 3:
        offs[-1] -= 1
    return offs


@pytest.mark.parametrize("kind", [0, 1, 2, 3])
def test_status_codes_and_no_writes_on_the_numpy_backend(kind):
    args, kw = make_case(9, new=(3, 2, 2), cached=(0, 5, 17))
    args["input_row_offsets"] = malform(args["input_row_offsets"], kind)
    before = copy_args(args)
    q_out = np.full_like(args["q_rope"], 7)
    status = np.full(1, 99, np.int32)
    op(**args, **kw, q_rope_out=q_out, status=status)
    assert status[0] == kind == reference.ragged_offsets_status(args["input_row_offsets"], 7)
    if kind:
        assert (q_out == 7).all()
        assert_bytes_equal(args["kv_cache"], before["kv_cache"])
    else:
        q_ref, _, _ = expected(before, kw)
        np.testing.assert_array_equal(q_out, q_ref)


def test_status_validation():
    bad(TypeError, "status must have dtype int32, got uint32", {"status": np.zeros(1, np.uint32)})
    bad(ValueError, r"status must have shape \(1,\)", {"status": np.zeros((1, 1), np.int32)})


def test_numpy_backend_writes_the_addressed_rows():
    args, kw = make_case(0)
    q_ref, ckv_ref, kpe_ref = expected(args, kw)
    before = args["kv_cache"].copy()
    out = op(**args, **kw)
    assert isinstance(out, np.ndarray) and out.dtype == args["q_rope"].dtype
    np.testing.assert_array_equal(out, q_ref)
    L = args["kv"].shape[1] - args["q_rope"].shape[2]
    np.testing.assert_array_equal(args["kv_cache"][..., :L], ckv_ref)
    np.testing.assert_array_equal(args["kv_cache"][..., L:], kpe_ref)
    mask = written_rows(args)
    assert mask.sum() == 5
    assert_bytes_equal(args["kv_cache"][~mask], before[~mask])


@given(seed=seeds, is_neox=st.booleans(), split=st.booleans())
def test_prefix_cached_run_equals_full_prefill(seed, is_neox, split):
    full, kw = make_case(seed, new=(7, 5), cached=(0, 0), split=split)
    first, second = copy_args(full), None
    q_full = op(**full, **kw, is_neox=is_neox)
    # Same tokens in two steps: 3 and 2 tokens first, then the rest after them.
    offs = np.array([0, 3, 5], np.int32)
    idx1 = np.r_[0:3, 7:9]
    idx2 = np.r_[3:7, 9:12]
    step1 = dict(first, q_rope=first["q_rope"][idx1], kv=first["kv"][idx1], input_row_offsets=offs)
    q1 = op(**step1, **kw, is_neox=is_neox)
    second = dict(
        step1,
        q_rope=first["q_rope"][idx2],
        kv=first["kv"][idx2],
        input_row_offsets=np.array([0, 4, 7], np.int32),
        cache_lengths=np.array([3, 2], np.int32),
    )
    q2 = op(**second, **kw, is_neox=is_neox)
    np.testing.assert_array_equal(np.concatenate([q1, q2])[np.argsort(np.r_[idx1, idx2])], q_full)
    caches_full = full["kv_cache"] if split else (full["kv_cache"],)
    caches_steps = first["kv_cache"] if split else (first["kv_cache"],)
    for a, b in zip(caches_steps, caches_full):
        assert_bytes_equal(a, b)


def test_position_zero_is_identity_on_rotary_dims():
    args, kw = make_case(1, new=(1,), cached=(0,), kv_norm_dim=8)
    out = op(**args, **kw)
    np.testing.assert_array_equal(out, args["q_rope"])
    L = args["kv"].shape[1] - args["q_rope"].shape[2]
    page = args["block_table"][0, 0]
    row = args["kv_cache"][page, 0]
    np.testing.assert_array_equal(row[L:], args["kv"][0, L:])  # kpe: rope at 0
    np.testing.assert_array_equal(row[8:L], args["kv"][0, 8:L])  # beyond kv_norm_dim: as is


@given(seed=seeds)
def test_normalised_rows_have_unit_rms(seed):
    args, kw = make_case(seed, L=64)
    args["gamma"] = np.ones_like(args["gamma"])
    op(**args, **kw)
    mask = written_rows(args)
    rows = args["kv_cache"][mask][:, :64].astype(np.float64)
    rms = np.sqrt(np.mean(rows * rows, axis=1))
    np.testing.assert_allclose(rms, 1.0, rtol=2e-3)


def test_fp8_cache_stores_x_over_kv_scale():
    args, kw = make_case(2, cache_dtype=E4M3, kv_scale=0.25)
    _q_ref, ckv, _kpe = expected(args, kw)
    op(**args, **kw)
    L = args["kv"].shape[1] - args["q_rope"].shape[2]
    np.testing.assert_array_equal(args["kv_cache"][..., :L].view(np.uint8), ckv.view(np.uint8))
    # position 0 row of request 0: kpe = fp8(k_pe / 0.25)
    page = args["block_table"][0, 0]
    want = reference.to_dtype(args["kv"][0, L:].astype(np.float64) / 0.25, E4M3)
    np.testing.assert_array_equal(args["kv_cache"][page, 0, L:].view(np.uint8), want.view(np.uint8))


def test_in_place_q_and_uint32_offsets():
    args, kw = make_case(3, offsets_dtype=np.uint32)
    q_ref, _, _ = expected(args, kw)
    q = args["q_rope"]
    out = op(**args, **kw, q_rope_out=q)
    assert out is q
    np.testing.assert_array_equal(q, q_ref)


def test_preallocated_output_is_returned():
    args, kw = make_case(4)
    q_ref, _, _ = expected(args, kw)
    buf = np.zeros_like(args["q_rope"])
    assert op(**args, **kw, q_rope_out=buf) is buf
    np.testing.assert_array_equal(buf, q_ref)


def test_out_of_range_tokens_are_skipped():
    # request 0's second token runs past the table (P = 2), request 1's page is -1.
    args, kw = make_case(5, new=(3, 1), cached=(0, 1), P=2)
    args["block_table"][1] = -1
    before = args["kv_cache"].copy()
    out = op(**args, **kw)
    np.testing.assert_array_equal(out[2], args["q_rope"][2])  # position 2 >= P: copied
    assert not np.array_equal(out[1], args["q_rope"][1])  # position 1: roped
    assert not np.array_equal(out[3], args["q_rope"][3])  # roped although not written
    assert written_rows(args).sum() == 2
    changed = np.any(args["kv_cache"].view(np.uint8) != before.view(np.uint8), axis=-1)
    assert changed.sum() == 2


@pytest.mark.parametrize("breakage", ["no_request", "position", "table", "page"])
def test_check_indices_raises(monkeypatch, breakage):
    args, kw = make_case(6)
    if breakage == "no_request":
        args["input_row_offsets"][-1] -= 1
    elif breakage == "position":
        args["cos_sin_cache"] = args["cos_sin_cache"][:4]
    elif breakage == "table":
        args["block_table"] = np.ascontiguousarray(args["block_table"][:, :1])
    else:
        args["block_table"][2, 17 // 4] = 10_000  # request 2 starts at position 17
    monkeypatch.setenv("ROPEKV_CHECK_INDICES", "1")
    with pytest.raises(IndexError):
        op(**args, **kw)
    monkeypatch.delenv("ROPEKV_CHECK_INDICES")
    op(**args, **kw)  # skipped silently


@pytest.mark.parametrize("lean_block", [32, 64, 96, 128, 256, 1000])
@pytest.mark.parametrize("items", [1, 2, 4, 8, 16, 32])
@pytest.mark.parametrize("Hq", [1, 3, 16, 128, 192])
def test_lean_shape_whole_warps_and_every_head(monkeypatch, lean_block, items, Hq):
    """The lean kernel's blocks: whole warps, at least two (the kv block's latent warp and its
    rotary tail), at most BLOCK threads; the q blocks hold every head, none of them empty."""
    from ropekv import mla

    monkeypatch.setitem(mla.TUNING, "lean_block", lean_block)
    rows, splits = mla.lean_shape(1, Hq, items, 512, 8)
    threads = rows * items
    assert threads % 32 == 0 and 64 <= threads <= mla.BLOCK
    assert threads >= 32 + items
    assert rows * splits >= Hq and (splits - 1) * rows < Hq


def test_lean_shape_declines_what_the_kernel_does_not_cover(monkeypatch):
    from ropekv import mla

    assert mla.lean_shape(1, 128, 8, 512, 8) is not None
    assert mla.lean_shape(mla.TUNING["lean_below"] - 1, 128, 8, 512, 8) is not None
    assert mla.lean_shape(0, 128, 8, 512, 8) is None
    assert mla.lean_shape(mla.TUNING["lean_below"], 128, 8, 512, 8) is None
    assert mla.lean_shape(1, 128, 12, 512, 8) is None  # not a power of two
    assert mla.lean_shape(1, 128, 64, 512, 8) is None  # a row wider than a warp
    assert mla.lean_shape(1, 128, 8, 512, 4) is None  # 128 latent chunks: more than 2 a lane
    monkeypatch.setitem(mla.TUNING, "lean_below", 0)  # ee077f9's choice
    assert mla.lean_shape(1, 128, 8, 512, 8) is None


def test_lean_kernel_is_instantiated():
    from ropekv import mla

    names = set(mla.instantiations())
    assert mla.expression(BF16, E4M3, False, 8, lean=True) in names
    assert mla.expression(np.dtype(np.float16), np.dtype(np.float16), True, 2, lean=True) in names


def test_zero_length_requests_and_empty_batch():
    args, kw = make_case(7, new=(0, 0, 2, 0), cached=(3, 0, 1, 9))
    q_ref, _, _ = expected(args, kw)
    np.testing.assert_array_equal(op(**args, **kw), q_ref)
    empty, kw = make_case(7, new=(0,), cached=(0,))
    out = op(**empty, **kw)
    assert out.shape == (0, 4, 16)


def test_freqs_cis_table_converts():
    rng = np.random.default_rng(0)
    theta = rng.uniform(0, 6, (5, 8))
    freqs_cis = np.stack([np.cos(theta), np.sin(theta)], -1).reshape(5, 16)
    table = ropekv.freqs_cis_to_cos_sin(freqs_cis)
    np.testing.assert_allclose(table[:, :8], np.cos(theta), rtol=1e-6)
    np.testing.assert_allclose(table[:, 8:], np.sin(theta), rtol=1e-6)


# ---- CPU: validation, one test per rule --------------------------------------------------------


def bad(exc, match, kw_extra=None, **changes):
    args, kw = make_case(8)
    args.update(changes)
    kw.update(kw_extra or {})
    with pytest.raises(exc, match=match):
        op(**args, **kw)


def test_q_rope_must_be_3d():
    bad(ValueError, r"q_rope must have shape \(T, Hq, R\)", q_rope=np.zeros((5, 64), np.float16))


def test_q_rope_dtype():
    bad(TypeError, "q_rope must have dtype", q_rope=np.zeros((5, 4, 16), np.float32))


def test_kv_dtype_must_match():
    bad(TypeError, "kv must have the dtype of q_rope", kv=np.zeros((5, 48), BF16))


def test_kv_tokens_must_match():
    bad(ValueError, r"kv must have shape \(T, L \+ R\) with T=5", kv=np.zeros((4, 48), np.float16))


def test_kv_must_be_wider_than_r():
    bad(ValueError, "L > 0", kv=np.zeros((5, 16), np.float16))


def test_table_rotary_dim_must_match_q():
    bad(ValueError, "cos_sin_cache must have shape", cos_sin_cache=ropekv.cos_sin_cache(32, 8))


def test_table_dtype():
    bad(
        TypeError,
        "cos_sin_cache must have dtype float32",
        cos_sin_cache=ropekv.cos_sin_cache(32, 16).astype(np.float64),
    )


def test_kv_norm_dim_range():
    bad(ValueError, r"kv_norm_dim must be an integer in \[1, L=32\]", kw_extra={"kv_norm_dim": 33})
    bad(ValueError, "kv_norm_dim", kw_extra={"kv_norm_dim": 0})


def test_gamma_shape_and_dtype():
    bad(ValueError, r"gamma must have shape \(kv_norm_dim,\)", gamma=np.ones(31, np.float32))
    bad(TypeError, "gamma must have dtype", gamma=np.ones(32, np.float64))


def test_offsets_dtype_and_shape():
    bad(
        TypeError,
        "input_row_offsets must have dtype",
        input_row_offsets=np.array([0, 3, 3, 5], np.int64),
    )
    bad(
        ValueError,
        r"cache_lengths must have shape .*\(B,\)",
        input_row_offsets=np.array([0, 5], np.int32),
    )


def test_cache_lengths_dtype():
    bad(
        TypeError,
        "cache_lengths must have dtype int32",
        cache_lengths=np.array([0, 5, 17], np.int64),
    )


def test_block_table_shape_and_dtype():
    bad(ValueError, "block_table must have shape", block_table=np.zeros((2, 4), np.int32))
    bad(TypeError, "block_table must have dtype int32", block_table=np.zeros((3, 4), np.int64))


def test_cache_shape():
    bad(
        ValueError,
        r"kv_cache must have shape \(num_pages, page_size, L \+ R\)",
        kv_cache=np.zeros((4, 4, 40), np.float16),
    )


def test_split_cache_shapes_and_dtypes():
    bad(
        ValueError,
        r"kpe_cache must have shape",
        kv_cache=(np.zeros((8, 4, 32), np.float16), np.zeros((8, 4, 8), np.float16)),
    )
    bad(
        TypeError,
        "kpe_cache must have the dtype of ckv_cache",
        kv_cache=(np.zeros((8, 4, 32), np.float16), np.zeros((8, 4, 16), BF16)),
    )
    bad(ValueError, r"tuple \(ckv, kpe\)", kv_cache=(np.zeros((8, 4, 32), np.float16),))


def test_cache_dtype():
    bad(TypeError, "kv_cache must have dtype", kv_cache=np.zeros((8, 4, 48), BF16))


def test_kv_scale_only_for_fp8_and_positive():
    bad(ValueError, "only used with float8 caches", kw_extra={"kv_scale": 0.5})
    bad(
        ValueError,
        "kv_scale must be a finite positive",
        kw_extra={"kv_scale": 0.0},
        kv_cache=np.zeros((16, 4, 48), E4M3),
    )
    bad(
        TypeError,
        "kv_scale must be a real number",
        kw_extra={"kv_scale": "1"},
        kv_cache=np.zeros((16, 4, 48), E4M3),
    )


def test_clear_flag_must_be_bool():
    bad(
        TypeError,
        "clear_unused_last_page_rows must be a bool, got 1",
        {"clear_unused_last_page_rows": 1},
    )


def test_epsilon():
    bad(ValueError, "epsilon must be a finite non-negative", kw_extra={"epsilon": -1.0})


def test_last_dim_must_be_contiguous():
    q = np.zeros((5, 4, 32), np.float16)[:, :, ::2]
    bad(ValueError, "q_rope must be contiguous in its last dimension", q_rope=q)


def test_read_only_cache_is_refused():
    args, kw = make_case(8)
    args["kv_cache"].flags.writeable = False
    with pytest.raises(BufferError, match="kv_cache is written in place"):
        op(**args, **kw)


def test_q_rope_out_shape_dtype_and_overlap():
    bad(
        ValueError,
        "q_rope_out must have shape",
        kw_extra={"q_rope_out": np.zeros((5, 4, 8), np.float16)},
    )
    bad(
        TypeError,
        "q_rope_out must have the dtype of q_rope",
        kw_extra={"q_rope_out": np.zeros((5, 4, 16), BF16)},
    )
    args, kw = make_case(8)
    buf = np.zeros((6, 4, 16), np.float16)
    args["q_rope"] = buf[:5]
    with pytest.raises(ValueError, match="overlaps q_rope partially"):
        op(**args, **kw, q_rope_out=buf[1:])


@pytest.mark.gpu
def test_mixed_devices_are_refused():
    import cupy as cp

    args, kw = make_case(8)
    args["gamma"] = cp.asarray(args["gamma"])
    with pytest.raises(ValueError, match="one device"):
        op(**args, **kw)


# ---- GPU: the kernel against the reference ----------------------------------------------------


def check_on_device(
    args, kw, *, is_neox=False, in_place=False, strided=False, given=False, clear=False
):
    """Run the kernel on copies of ``args`` and compare with the reference (``given``: into a
    pre-allocated output; ``clear``: clear_unused_last_page_rows, whose tail rows must be zero)."""
    import cupy as cp

    q_ref, ckv_ref, kpe_ref = expected(args, kw, is_neox, clear=clear)
    mask = written_rows(args)
    if clear:
        cache = args["kv_cache"][0] if isinstance(args["kv_cache"], tuple) else args["kv_cache"]
        tail = tail_rows(args, cache.shape[1], cache.shape[0])
        assert not ckv_ref[tail].view(np.uint8).any()
        mask |= tail
    dev = {k: to_device(v) for k, v in args.items()}
    if strided:  # q_rope and kv sliced out of one packed buffer, as the projection emits them
        T, Hq, R = args["q_rope"].shape
        packed = np.zeros((T, Hq * R + args["kv"].shape[1] + 8), args["q_rope"].dtype)
        packed[:, : Hq * R] = args["q_rope"].reshape(T, Hq * R)
        packed[:, Hq * R + 8 :] = args["kv"]
        packed = cp.asarray(packed)
        dev["q_rope"] = packed[:, : Hq * R].reshape(T, Hq, R)
        dev["kv"] = packed[:, Hq * R + 8 :]
    extra = {"q_rope_out": dev["q_rope"]} if in_place else {}
    if given:
        extra = {"q_rope_out": cp.full(dev["q_rope"].shape, np.nan, dev["q_rope"].dtype)}
    out = op(**dev, **kw, is_neox=is_neox, **extra, clear_unused_last_page_rows=clear)
    assert isinstance(out, cp.ndarray)
    if extra:
        assert out is extra["q_rope_out"]
    assert_close(out, q_ref, "q_rope_out")
    L = args["kv"].shape[1] - args["q_rope"].shape[2]
    ckv, kpe = cache_parts(dev["kv_cache"], L)
    ckv0, kpe0 = cache_parts(args["kv_cache"], L)
    ckv, kpe = to_numpy(ckv), to_numpy(kpe)
    assert_close(ckv[mask], ckv_ref[mask], "ckv rows")
    assert_close(kpe[mask], kpe_ref[mask], "kpe rows")
    assert_bytes_equal(ckv[~mask], np.ascontiguousarray(ckv0)[~mask], "untouched ckv rows")
    assert_bytes_equal(kpe[~mask], np.ascontiguousarray(kpe0)[~mask], "untouched kpe rows")


# (Hq, L, R); 192 x 64 q rows are too large to stage twice in shared memory: read from global
SHAPES = [(16, 256, 32), (32, 128, 64), (16, 128, 64), (4, 96, 32), (192, 64, 64)]


@pytest.mark.gpu
@given(
    seed=seeds,
    dtype=st.sampled_from(INPUT_DTYPES),
    data=st.data(),
    shape=st.sampled_from(SHAPES),
    is_neox=st.sampled_from([False, False, True]),
    split=st.booleans(),
    page_size=st.sampled_from([1, 16, 64]),
    new=st.lists(st.integers(0, 40), min_size=1, max_size=4),
    gamma_f32=st.booleans(),
    in_place=st.booleans(),
    uint32=st.booleans(),
    strided=st.booleans(),
    clear=st.booleans(),
)
def test_kernel_matches_reference(
    seed,
    dtype,
    data,
    shape,
    is_neox,
    split,
    page_size,
    new,
    gamma_f32,
    in_place,
    uint32,
    strided,
    clear,
):
    Hq, L, R = shape
    cache_dtype = data.draw(st.sampled_from([dtype, *FP8_DTYPES]))
    kv_norm_dim = data.draw(st.sampled_from([None, L - 32, 100 if L > 100 else L - 8, 36]))
    cached = data.draw(st.lists(st.integers(0, 300), min_size=len(new), max_size=len(new)))
    kv_scale = data.draw(st.sampled_from([None, 0.5, 3.0])) if cache_dtype in FP8_DTYPES else None
    args, kw = make_case(
        seed,
        Hq=Hq,
        L=L,
        R=R,
        dtype=dtype,
        cache_dtype=cache_dtype,
        new=new,
        cached=cached,
        page_size=page_size,
        split=split,
        kv_norm_dim=kv_norm_dim,
        gamma_f32=gamma_f32,
        offsets_dtype=np.uint32 if uint32 else np.int32,
        kv_scale=kv_scale,
    )
    check_on_device(args, kw, is_neox=is_neox, in_place=in_place, strided=strided, clear=clear)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [BF16, *FP8_DTYPES])
@pytest.mark.parametrize("split", [False, True])
def test_deepseek_v3_prefill_and_decode(cache_dtype, split):
    prefill, kw = make_case(
        11,
        Hq=128,
        L=512,
        R=64,
        dtype=BF16,
        cache_dtype=cache_dtype,
        new=(37, 0, 64),
        cached=(0, 5, 130),
        page_size=64,
        split=split,
        gamma_f32=False,
    )
    check_on_device(prefill, kw)
    decode, kw = make_case(
        12,
        Hq=128,
        L=512,
        R=64,
        dtype=BF16,
        cache_dtype=cache_dtype,
        new=(1,) * 8,
        cached=tuple(range(0, 800, 100)),
        page_size=64,
        split=split,
    )
    check_on_device(decode, kw, in_place=True)


@pytest.mark.gpu
@pytest.mark.parametrize("is_neox", [False, True])
def test_deepseek_v3_long_prefill_runs_the_pipeline(is_neox):
    # 1500 tokens: several tokens per block, so the two-stage pipeline runs at its default size
    args, kw = make_case(
        16,
        Hq=128,
        L=512,
        R=64,
        dtype=BF16,
        cache_dtype=E4M3,
        new=(700, 0, 1, 799),
        cached=(0, 3, 0, 1000),
        page_size=64,
        kv_scale=0.75,
    )
    check_on_device(args, kw, is_neox=is_neox)


@pytest.mark.gpu
@given(seed=seeds, split=st.booleans(), is_neox=st.booleans())
def test_prefix_cached_run_equals_full_prefill_on_device(seed, split, is_neox):
    import cupy as cp

    full, kw = make_case(
        seed,
        Hq=16,
        L=128,
        R=64,
        dtype=BF16,
        cache_dtype=E4M3,
        new=(19, 6),
        cached=(0, 0),
        page_size=16,
        split=split,
    )
    full_d = {k: to_device(v) for k, v in full.items()}
    q_full = op(**full_d, **kw, is_neox=is_neox)
    cut = (11, 2)
    idx1 = np.r_[0 : cut[0], 19 : 19 + cut[1]]
    idx2 = np.r_[cut[0] : 19, 19 + cut[1] : 25]
    steps = {k: to_device(v) for k, v in full.items()}
    q1 = op(
        **dict(
            steps,
            q_rope=to_device(full["q_rope"][idx1]),
            kv=to_device(full["kv"][idx1]),
            input_row_offsets=cp.array([0, cut[0], sum(cut)], cp.int32),
        ),
        **kw,
        is_neox=is_neox,
    )
    q2 = op(
        **dict(
            steps,
            q_rope=to_device(full["q_rope"][idx2]),
            kv=to_device(full["kv"][idx2]),
            input_row_offsets=cp.array([0, 19 - cut[0], 25 - sum(cut)], cp.int32),
            cache_lengths=cp.array(cut, cp.int32),
        ),
        **kw,
        is_neox=is_neox,
    )
    q_steps = np.concatenate([to_numpy(q1), to_numpy(q2)])[np.argsort(np.r_[idx1, idx2])]
    assert_bytes_equal(q_steps, to_numpy(q_full), "q_rope_out")
    a = steps["kv_cache"] if split else (steps["kv_cache"],)
    b = full_d["kv_cache"] if split else (full_d["kv_cache"],)
    for x, y in zip(a, b):
        assert_bytes_equal(x, to_numpy(y))


@pytest.mark.gpu
@pytest.mark.parametrize("clear", [False, True])
def test_hostile_indices_never_write_out_of_bounds(clear):
    """Malformed offsets, lengths and pages: guard bytes stay, only the reference's rows change
    (with ``clear``: also the tail the last token of request 2 clears, rows 3.. of its page)."""
    import cupy as cp

    args, kw = make_case(
        13, Hq=8, L=64, R=32, new=(5, 3, 4), cached=(0, 0, 0), page_size=4, spare_pages=0
    )
    args["cache_lengths"] = np.array([0, 2**31 - 3, -7], np.int32)
    args["block_table"][0, :2] = [-5, 2**31 - 1]
    args["input_row_offsets"] = np.array([0, 5, 2, 12], np.int32)  # decreasing
    guard = 256
    cache = args["kv_cache"]
    buf = cp.asarray(
        np.concatenate(
            [np.full(guard, 7, np.float16), cache.ravel(), np.full(guard, 7, np.float16)]
        )
    )
    dev = {k: to_device(v) for k, v in args.items()}
    dev["kv_cache"] = buf[guard:-guard].reshape(cache.shape)
    q_ref, ckv_ref, kpe_ref = expected(args, kw, clear=clear)
    out = op(**dev, **kw, clear_unused_last_page_rows=clear)
    assert_close(out, q_ref)
    assert written_rows(args).sum() == 3  # tokens 9..11 (request 2, positions 0..2) only
    host = to_numpy(buf)
    assert (host[:guard] == 7).all() and (host[-guard:] == 7).all()
    got = host[guard:-guard].reshape(cache.shape)
    L = 64
    mask = written_rows(args)
    if clear:  # the tail of request 2's page: row 3 of page block_table[2, 0]
        tail = np.zeros_like(mask)
        tail[args["block_table"][2, 0], 3:] = True
        assert not ckv_ref[tail].view(np.uint8).any() and not kpe_ref[tail].view(np.uint8).any()
        mask |= tail
    assert_close(got[..., :L][mask], ckv_ref[mask])
    assert_close(got[..., L:][mask], kpe_ref[mask])
    assert_bytes_equal(got[~mask], cache[~mask])


@pytest.mark.gpu
@pytest.mark.parametrize("kind", [0, 1, 2, 3])
@pytest.mark.parametrize("T_new", [0, 1, 3, 300])  # no tokens; decode (split kernel); prefill
def test_status_on_device(kind, T_new):
    import cupy as cp

    new = (T_new,) if T_new < 3 else (T_new // 3, T_new // 3, T_new - 2 * (T_new // 3))
    if T_new == 0:
        new = (0, 0)
    args, kw = make_case(
        70 + kind,
        Hq=16,
        L=512,
        R=64,
        dtype=BF16,
        new=new,
        cached=tuple(range(3, 3 + len(new))),
        page_size=16,
    )
    if kind == 2 and len(new) < 2:
        args["input_row_offsets"] = np.array([0, T_new, T_new], np.int32)
        args["cache_lengths"] = np.array([3, 4], np.int32)
        args["block_table"] = np.concatenate([args["block_table"]] * 2)
    args["input_row_offsets"] = malform(args["input_row_offsets"], kind)
    code = reference.ragged_offsets_status(args["input_row_offsets"], T_new)
    dev = {k: to_device(v) for k, v in args.items()}
    q_out = cp.full(dev["q_rope"].shape, 7, dev["q_rope"].dtype)
    status = cp.full(1, 99, cp.int32)
    op(**dev, **kw, q_rope_out=q_out, status=status)
    assert int(status[0]) == code
    if code:
        assert kind and bool((q_out == 7).all())
        assert_bytes_equal(to_numpy(dev["kv_cache"]), args["kv_cache"])
    else:
        q_ref, ckv_ref, _kpe_ref = expected(args, kw)
        assert_close(q_out, q_ref, "q_rope_out")
        mask = written_rows(args)
        got = to_numpy(dev["kv_cache"])
        assert_close(got[..., :512][mask], ckv_ref[mask])
        assert_bytes_equal(got[~mask], args["kv_cache"][~mask])


@pytest.mark.gpu
def test_torch_tensors_in_torch_out():
    torch = pytest.importorskip("torch")
    args, kw = make_case(
        14,
        Hq=16,
        L=128,
        R=64,
        dtype=BF16,
        cache_dtype=E4M3,
        new=(3, 4),
        cached=(2, 0),
        page_size=16,
    )
    q_ref, ckv_ref, kpe_ref = expected(args, kw)

    def to_torch(x):
        if x.dtype == E4M3:
            return torch.from_numpy(x.view(np.uint8)).cuda().view(torch.float8_e4m3fn)
        if x.dtype == BF16:
            return torch.from_numpy(x.view(np.int16)).cuda().view(torch.bfloat16)
        return torch.from_numpy(x).cuda()

    dev = {k: to_torch(v) for k, v in args.items()}
    out = op(**dev, **kw)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.is_cuda
    torch.cuda.synchronize()
    assert_close(out, q_ref)
    got = to_numpy(dev["kv_cache"])
    mask = written_rows(args)
    assert_close(got[..., :128][mask], ckv_ref[mask])
    assert_close(got[..., 128:][mask], kpe_ref[mask])


@pytest.mark.gpu
def test_large_ragged_batch():
    """Thousands of requests, most of them empty: the binary search finds each token's."""
    B = 4195
    new = np.zeros(B, np.int64)
    new[[0, 17, 4000, B - 1]] = [3, 1, 2, 1]
    args, kw = make_case(
        15,
        Hq=8,
        L=64,
        R=32,
        new=tuple(new),
        cached=tuple(np.arange(B) % 9),
        page_size=4,
        split=True,
    )
    check_on_device(args, kw)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "split, in_place, given", [(False, False, False), (True, True, False), (True, False, True)]
)
def test_repeated_calls_replay_the_launch_plan_with_new_arrays(split, in_place, given):
    """The second and later calls of one layout replay a cached launch: new pointers, new output
    arrays, the same results as the reference."""
    for seed in (30, 31, 32):
        args, kw = make_case(
            seed,
            Hq=16,
            L=128,
            R=64,
            dtype=BF16,
            cache_dtype=E4M3,
            new=(5, 1, 3),
            cached=(0, 40, 7),
            page_size=16,
            split=split,
            kv_scale=0.5,
        )
        check_on_device(args, kw, in_place=in_place, given=given)


LEAN_VARIANTS = [
    {},  # the defaults: the lean kernel below lean_below tokens
    {"lean_below": 0},  # ee077f9's split kernel
    {"lean_block": 64},
    {"lean_block": 256},
    {"lean_below": 1 << 30},  # the lean kernel at prefill too
]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", LEAN_VARIANTS, ids=lambda v: ",".join(map(str, v.items())))
@pytest.mark.parametrize(
    "new",
    [
        (1,),
        (1,) * 5,
        (1,) * 31,  # the last batch whose request is found among the lanes
        (1, 0, 2, 1, 0, 3) * 5,  # among the lanes, empty requests (equal offsets)
        (1,) * 32,  # staged in shared memory
        (1, 0, 2, 1, 0, 3) * 7,
        tuple(1 if b % 4 == 0 else 0 for b in range(520)),  # past kStageMax: global memory
        (2, 3, 250),
        (300, 0, 900),  # prefill: the lean kernel only with lean_below raised
    ],
    ids=lambda n: f"B{len(n)}T{sum(n)}",
)
@pytest.mark.parametrize(
    "Hq, L, R, is_neox, kv_norm_dim, gamma_f32",
    [
        (128, 512, 64, False, None, False),  # DeepSeek-V3
        (128, 512, 64, True, 448, True),
        (16, 256, 32, False, 200, True),
        (3, 64, 64, True, None, False),
    ],
)
def test_lean_decode_matches_reference(
    monkeypatch, variant, new, Hq, L, R, is_neox, kv_norm_dim, gamma_f32
):
    """The lean decode kernel (plain calls) against the reference at every request-search path
    (among the lanes below 32 requests, shared memory up to 512, global memory past it), tokens
    without a request or position, and pages out of range; ``lean_below`` raised, at prefill."""
    from ropekv import mla

    for key, value in variant.items():
        monkeypatch.setitem(mla.TUNING, key, value)
    rng = np.random.default_rng(len(new) + Hq)
    cached = tuple(int(x) for x in rng.integers(0, 300, len(new)))
    for cache_dtype, split in ((E4M3, True), (BF16, False)):
        args, kw = make_case(
            17 + len(new),
            Hq=Hq,
            L=L,
            R=R,
            dtype=BF16,
            cache_dtype=cache_dtype,
            new=new,
            cached=cached,
            page_size=16,
            split=split,
            kv_norm_dim=kv_norm_dim,
            gamma_f32=gamma_f32,
            P=280,  # some positions past the table: q copied, nothing written
            kv_scale=0.5 if cache_dtype == E4M3 else None,
        )
        args["block_table"][0, 0] = -3  # request 0's first page out of range: roped, not written
        check_on_device(args, kw, is_neox=is_neox, in_place=not split)
