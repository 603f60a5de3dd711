"""``apply_rope_write_kv``: validation (CPU), the NumPy backend, and the CUDA kernel against the
reference (GPU)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import ropekv
from ropekv import reference
from tests.strategies import (
    cache_dtypes,
    gqa_heads,
    head_and_rotary_dims,
    input_dtypes,
    packed_views,
    random,
    seeds,
)
from tests.tolerance import assert_bytes_equal, assert_close, to_device, to_numpy

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


def make_case(
    seed,
    B=2,
    S=3,
    Hq=4,
    Hkv=2,
    D=64,
    R=64,
    C=16,
    P=32,
    dtype=np.float16,
    cache_dtype=None,
    lens=True,
    pos=False,
    table_batch=None,
    packed=False,
):
    """NumPy inputs of one call; every array freshly random (the cache too, to catch stray
    writes)."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    cache_dtype = np.dtype(cache_dtype or dtype)
    if packed:
        q, k, v = packed_views(rng, (B, S), (Hq, Hkv, Hkv), D, dtype)
    else:
        q, k, v = (random(rng, (B, S, h, D), dtype) for h in (Hq, Hkv, Hkv))
    table = ropekv.cos_sin_cache(P, R, base=rng.uniform(100, 1e6))
    if table_batch:
        table = np.stack(
            [ropekv.cos_sin_cache(P, R, base=rng.uniform(100, 1e6)) for _ in range(table_batch)]
        )
    args = {
        "q": q,
        "k": k,
        "v": v,
        "kv_cache": random(rng, (B, 2, Hkv, C, D), cache_dtype),
        "cos_sin_cache": table,
    }
    if lens:
        args["kv_end_lens"] = rng.integers(S - 2, C + 3, B).astype(np.int32)
    if pos:
        args["position_ids"] = rng.integers(-2, P + 2, (B, S)).astype(np.int32)
    if cache_dtype in reference.FP8_MAX:
        args["kv_scale"] = rng.uniform(0.25, 2.0, 2).astype(np.float32)
    return args


def call(args, **kw):
    a = dict(args)
    return ropekv.apply_rope_write_kv(
        a.pop("q"), a.pop("k"), a.pop("v"), a.pop("kv_cache"), a.pop("cos_sin_cache"), **a, **kw
    )


def copy_args(args):
    return {n: x.copy() for n, x in args.items()}


def addressed_slots(args, S):
    """Boolean (B, C): slots the call may write."""
    B, C = args["kv_cache"].shape[0], args["kv_cache"].shape[3]
    P = args["cos_sin_cache"].shape[-2]
    lens = args.get("kv_end_lens")
    mask = np.zeros((B, C), bool)
    ids = args.get("position_ids")
    for b in range(B):
        start = 0 if lens is None else int(lens[b]) - S
        for s in range(S):
            slot = start + s
            if ids is not None and ids.ndim == 3:  # mRoPE: all three positions in range
                ok = all(0 <= ids[a, b, s] < P for a in range(3))
            else:
                ok = 0 <= (slot if ids is None else ids[b, s]) < P
            if 0 <= slot < C and ok:
                mask[b, slot] = True
    return mask


def mrope_ids(rng, B, S, P, bad_share=0.1):
    """(3, B, S) int32 positions: image-like tokens (three positions), text-like ones (one), a
    few out of range on one axis."""
    ids = rng.integers(0, P, (3, B, S))
    text = rng.random((B, S)) < 0.3
    ids[:, text] = ids[0][text]
    bad = rng.random((B, S)) < bad_share
    ids[(rng.integers(0, 3, bad.sum()), *np.nonzero(bad))] = rng.choice(
        [-1, P, 2**31 - 1], bad.sum()
    )
    return ids.astype(np.int32)


def mrope_section_for(R, interleaved):
    x = (R // 2) // 3
    return (R // 2 - 2 * x, x, x)


# ---------------------------------------------------------------------------------------------
# NumPy backend


def test_numpy_backend_matches_a_direct_rotation():
    """The CPU path ropes q in place and writes roped K / V into the slots, checked against
    complex-number rotation written independently here."""
    args = make_case(1, lens=False)
    before = copy_args(args)
    call(args, write_k_in_place=True)
    S, D = 3, 64
    table = before["cos_sin_cache"][:S]
    theta = np.arctan2(table[:, D // 2 :], table[:, : D // 2]).astype(np.float64)

    def rot(x):
        x = x.astype(np.float64)
        z = (x[..., : D // 2] + 1j * x[..., D // 2 :]) * np.exp(1j * theta)[None, :, None]
        return np.concatenate([z.real, z.imag], -1)

    np.testing.assert_allclose(args["q"].astype(np.float64), rot(before["q"]), rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(args["k"].astype(np.float64), rot(before["k"]), rtol=2e-3, atol=2e-3)
    cache = args["kv_cache"].astype(np.float64)
    np.testing.assert_allclose(
        cache[:, 0, :, :S].transpose(0, 2, 1, 3), rot(before["k"]), rtol=2e-3, atol=2e-3
    )
    np.testing.assert_array_equal(args["kv_cache"][:, 1, :, :S].transpose(0, 2, 1, 3), before["v"])
    assert_bytes_equal(args["kv_cache"][:, :, :, S:], before["kv_cache"][:, :, :, S:])


def test_numpy_backend_skips_padding_and_out_of_range_tokens():
    args = make_case(2, pos=True, S=6, C=8, P=8)
    args["position_ids"][0, :] = [-1, 0, 9, 3, -5, 7]
    args["kv_end_lens"][:] = [6, 10]  # sequence 1: slots 4..9, two past C
    before = copy_args(args)
    call(args)
    mask = addressed_slots(before, 6)
    assert mask[1].sum() == 4
    cache, old = args["kv_cache"], before["kv_cache"]
    for b in range(2):
        for c in range(8):
            if not mask[b, c]:
                assert_bytes_equal(cache[b, :, :, c], old[b, :, :, c], f"slot ({b}, {c})")
    # padded / skipped tokens leave q untouched
    assert_bytes_equal(args["q"][0, [0, 2, 4]], before["q"][0, [0, 2, 4]])
    assert_bytes_equal(args["q"][1, 4:], before["q"][1, 4:])


def test_write_k_in_place_off_leaves_k():
    args = make_case(3)
    before = copy_args(args)
    call(args)
    assert_bytes_equal(args["k"], before["k"])
    assert_bytes_equal(args["v"], before["v"])


def test_check_indices_raises(monkeypatch):
    monkeypatch.setenv("ROPEKV_CHECK_INDICES", "1")
    args = make_case(4, C=16)
    args["kv_end_lens"][:] = [3, 17]
    with pytest.raises(IndexError, match=r"token \(b=1, s=2\) lands in cache slot 16"):
        call(args)
    args = make_case(4, pos=True, P=32)
    args["kv_end_lens"][:] = [3, 3]
    args["position_ids"][:] = 1
    args["position_ids"][0, 1] = 40
    with pytest.raises(IndexError, match=r"token \(b=0, s=1\) has RoPE position 40"):
        call(args)
    args["position_ids"][0, 1] = -1  # padding is not an error
    call(args)


# ---------------------------------------------------------------------------------------------
# validation: one test per rule, all before any launch


def bad(match, exc=ValueError, **changes):
    """``changes``: arguments replaced, or keywords (mrope_*) added."""
    args = make_case(5)
    kw = {n: changes.pop(n) for n in list(changes) if n.startswith("mrope")}
    args.update(changes)
    with pytest.raises(exc, match=match):
        call(args, **kw)


def test_q_must_be_4d():
    bad(
        r"q must have shape \(B, S, Hq, D\), got \(2, 3, 256\)", q=np.zeros((2, 3, 256), np.float16)
    )


def test_q_dtype():
    bad(
        "q must have dtype float16 or bfloat16, got float32",
        TypeError,
        q=np.zeros((2, 3, 4, 64), np.float32),
    )


def test_k_shape():
    bad(
        r"k must have shape \(B, S, Hkv, D\) = \(2, 3, \*, 64\), got \(2, 3, 2, 32\)",
        k=np.zeros((2, 3, 2, 32), np.float16),
    )


def test_v_shape():
    bad(
        r"v must have shape \(B, S, Hkv, D\) = \(2, 3, 2, 64\), got \(2, 3, 1, 64\)",
        v=np.zeros((2, 3, 1, 64), np.float16),
    )


def test_k_dtype_must_match_q():
    bad(
        r"k must have the dtype of q \(float16\), got bfloat16",
        TypeError,
        k=np.zeros((2, 3, 2, 64), ml_dtypes.bfloat16),
    )


def test_head_counts():
    bad(
        r"q's head count \(3\) must be a positive multiple of k's \(2\)",
        q=np.zeros((2, 3, 3, 64), np.float16),
    )


def test_cache_shape():
    bad(
        r"kv_cache must have shape \(B, 2, Hkv, C, D\) = \(2, 2, 2, \*, 64\), got \(2, 2, 2, 16, 32\)",
        kv_cache=np.zeros((2, 2, 2, 16, 32), np.float16),
    )


def test_cache_dtype():
    bad(
        "kv_cache must have dtype float16 or float8_e4m3fn or float8_e5m2 or int8, got float32",
        TypeError,
        kv_cache=np.zeros((2, 2, 2, 16, 64), np.float32),
    )


def test_table_dtype():
    bad(
        "cos_sin_cache must have dtype float32, got float64",
        TypeError,
        cos_sin_cache=np.zeros((32, 64)),
    )


def test_table_batch():
    bad(r"Bc 1 or B=2, got \(3, 32, 64\)", cos_sin_cache=np.zeros((3, 32, 64), np.float32))


def test_rotary_dim():
    bad(
        r"rotary dim R \(its last dim\) must be even and in \[2, D=64\], got 66",
        cos_sin_cache=np.zeros((32, 66), np.float32),
    )
    bad("got 5", cos_sin_cache=np.zeros((32, 5), np.float32))


def test_kv_end_lens_shape_and_dtype():
    bad(
        r"kv_end_lens must have shape \(B,\) = \(2,\), got \(3,\)",
        kv_end_lens=np.zeros(3, np.int32),
    )
    bad(
        "kv_end_lens must have dtype int32 or int64, got float32",
        TypeError,
        kv_end_lens=np.zeros(2, np.float32),
    )


def test_position_ids_shape_and_dtype():
    bad(
        r"position_ids must have shape \(B, S\) = \(2, 3\), got \(2, 4\)",
        position_ids=np.zeros((2, 4), np.int32),
    )
    bad(
        "position_ids must have dtype int32 or int64, got float32",
        TypeError,
        position_ids=np.zeros((2, 3), np.float32),
    )


def test_index_arrays_must_be_contiguous():
    bad("kv_end_lens must be C-contiguous", kv_end_lens=np.zeros(4, np.int32)[::2])


def test_fp8_cache_needs_kv_scale():
    bad(
        r"kv_scale \(a number, a pair, or float32 of shape \(2,\) or \(\)\) or kv_cache_scales is "
        r"required for a float8_e4m3fn kv_cache",
        kv_cache=np.zeros((2, 2, 2, 16, 64), E4M3),
    )


@pytest.mark.parametrize(
    "scale",
    [
        0.5,
        2,
        np.float32(0.5),
        np.array(0.5, np.float32),
        (0.5, 2.0),
        np.array(0.5, np.float32)[None][0],
    ],
)
def test_kv_scale_as_constants_matches_the_array(scale):
    """A number, a 0-d array or a pair is the same as the (2,) array it spells."""
    args = make_case(11, cache_dtype=E4M3)
    pair = np.broadcast_to(np.asarray(scale, np.float32).reshape(-1), (2,)).copy()
    ref = copy_args(args)
    ref["kv_scale"] = pair
    call(ref)
    args["kv_scale"] = scale
    call(args)
    assert_bytes_equal(args["kv_cache"], ref["kv_cache"])
    assert_bytes_equal(args["q"], ref["q"])


def test_kv_scale_0d_array_is_one_scale_for_k_and_v():
    args = make_case(12, cache_dtype=E4M3)
    ref = copy_args(args)
    ref["kv_scale"] = np.full(2, 0.75, np.float32)
    call(ref)
    args["kv_scale"] = np.array(0.75, np.float32)  # 0-d host array: a constant
    call(args)
    assert_bytes_equal(args["kv_cache"], ref["kv_cache"])


@pytest.mark.parametrize(
    "scale, exc, match",
    [
        (True, TypeError, "kv_scale must be a real number, got True of type bool"),
        (np.bool_(True), TypeError, "kv_scale must be a real number"),
        (0.0, ValueError, "kv_scale must be a finite positive number, got 0.0"),
        (float("nan"), ValueError, "kv_scale must be a finite positive number"),
        ((1.0, -1.0), ValueError, r"kv_scale\[1\] must be a finite positive number"),
        ((1.0, 2.0, 3.0), ValueError, "kv_scale must be a number, a"),
        ("1.0", TypeError, "kv_scale must be a NumPy array, a CuPy array"),
    ],
)
def test_kv_scale_constants_are_checked(scale, exc, match):
    bad(match, exc, kv_cache=np.zeros((2, 2, 2, 16, 64), E4M3), kv_scale=scale)


def test_kv_scale_constant_only_for_fp8():
    bad("kv_scale is only used with float8 caches, but kv_cache is float16", kv_scale=1.0)


def test_kv_scale_only_for_fp8():
    bad(
        "kv_scale is only used with float8 caches, but kv_cache is float16",
        kv_scale=np.ones(2, np.float32),
    )


def test_kv_scale_shape():
    bad(
        r"kv_scale must have shape \(2,\) or \(\) = \(2,\), got \(3,\)",
        kv_cache=np.zeros((2, 2, 2, 16, 64), E4M3),
        kv_scale=np.ones(3, np.float32),
    )
    bad(
        r"kv_scale must have shape \(2,\) or \(\), got \(1, 2\)",
        kv_cache=np.zeros((2, 2, 2, 16, 64), E4M3),
        kv_scale=np.ones((1, 2), np.float32),
    )


@pytest.mark.parametrize("interleaved", [False, True])
def test_mrope_of_text_tokens_is_plain_rope(interleaved):
    """Three equal positions give the 1-D rotation, byte for byte."""
    args = make_case(13, pos=True)
    ref = copy_args(args)
    call(ref)
    args["position_ids"] = np.stack([args["position_ids"]] * 3)
    call(args, mrope_section=mrope_section_for(64, interleaved), mrope_interleaved=interleaved)
    for name in ("q", "kv_cache"):
        assert_bytes_equal(args[name], ref[name])


def test_mrope_rotates_image_tokens_by_their_sections():
    """An image token's Q: half-dims [0, t) rotated by the temporal position, [t, t + h) by the
    height, the rest by the width (checked against three plain rotations)."""
    args = make_case(14, lens=False, S=1, B=1)
    before = copy_args(args)
    args["position_ids"] = np.array([3, 9, 20], np.int32).reshape(3, 1, 1)
    call(args, mrope_section=(8, 12, 12))
    rotated = []
    for p in (3, 9, 20):
        one = copy_args(before)
        one["position_ids"] = np.array([[p]], np.int32)
        call(one)
        rotated.append(one["q"].astype(np.float64))
    want = rotated[2].copy()
    for lo, hi, a in ((0, 8, 0), (8, 20, 1)):
        want[..., lo:hi] = rotated[a][..., lo:hi]
        want[..., 32 + lo : 32 + hi] = rotated[a][..., 32 + lo : 32 + hi]
    np.testing.assert_allclose(args["q"].astype(np.float64), want, rtol=2e-3, atol=2e-3)


def test_mrope_validation():
    ids = np.zeros((3, 2, 3), np.int32)
    bad(
        r"mrope_section \(t, h, w\) must be non-negative and sum to R/2 = 32",
        position_ids=ids,
        mrope_section=(8, 8, 8),
    )
    bad(r"position_ids \(3, B, S\) is required with mrope_section", mrope_section=(8, 12, 12))
    bad(
        r"position_ids must have shape \(3, B, S\) = \(3, 2, 3\), got \(2, 3\)",
        position_ids=np.zeros((2, 3), np.int32),
        mrope_section=(8, 12, 12),
    )
    bad(r"position_ids must have shape \(B, S\) = \(2, 3\), got \(3, 2, 3\)", position_ids=ids)
    bad(
        "does not fit the interleaved layout",
        position_ids=ids,
        mrope_section=(0, 16, 16),
        mrope_interleaved=True,
    )
    bad("mrope_interleaved must be a bool", TypeError, mrope_interleaved=1)


def test_mrope_check_indices(monkeypatch):
    args = make_case(15, lens=False)
    args["position_ids"] = np.ones((3, 2, 3), np.int32)
    args["position_ids"][1, 1, 2] = 99
    monkeypatch.setenv("ROPEKV_CHECK_INDICES", "1")
    with pytest.raises(IndexError, match=r"token \(b=1, s=2\) has RoPE position 99"):
        call(args, mrope_section=(8, 12, 12))


def test_non_bool_flags_are_refused():
    for flag in ("write_k_in_place", "is_neox", "enable_pdl"):
        args = make_case(5)
        with pytest.raises(TypeError, match=f"{flag} must be a bool, got 'no'"):
            call(args, **{flag: "no"})


def test_last_dim_must_be_contiguous():
    bad(
        r"q must be contiguous in its last dimension \(stride 1\)",
        q=np.zeros((2, 3, 4, 128), np.float16)[..., ::2],
    )


def test_read_only_q_is_refused():
    q = np.zeros((2, 3, 4, 64), np.float16)
    q.flags.writeable = False
    bad("q is written in place but its producer exported it read-only", BufferError, q=q)


def test_not_an_array_is_refused():
    bad(
        "v must be a NumPy array, a CuPy array, a torch tensor or an object with "
        "__cuda_array_interface__ or __dlpack__",
        TypeError,
        v=[1, 2],
    )


def test_empty_batch_is_a_no_op():
    args = make_case(6, B=0, lens=False)
    call(args)


# ---------------------------------------------------------------------------------------------
# GPU: the kernel against the reference


def device_args(args):
    """CuPy copies; packed q/k/v stay slices of one device buffer (strided)."""
    import cupy as cp

    out = {}
    q = args["q"]
    if q.base is not None and args["k"].base is q.base:
        buf = cp.asarray(q.base)
        Hq, Hkv = q.shape[2], args["k"].shape[2]
        out.update(q=buf[:, :, :Hq], k=buf[:, :, Hq : Hq + Hkv], v=buf[:, :, Hq + Hkv :])
    for n, x in args.items():
        out.setdefault(n, to_device(x))
    return out


def check_against_reference(args, **kw):
    expected = copy_args(args)
    if args["q"].base is not None:  # keep the packed layout for the host run too
        expected.update(q=args["q"].copy(), k=args["k"].copy(), v=args["v"].copy())
    dev = device_args(args)
    call(dev, **kw)
    call(expected, **kw)
    S = args["q"].shape[1]
    mask = addressed_slots(args, S)
    for name in ("q", "k", "v"):
        assert_close(dev[name], expected[name], name)
    got = to_numpy(dev["kv_cache"])
    assert_close(got, expected["kv_cache"], "kv_cache")
    untouched = ~mask
    assert_bytes_equal(
        got.transpose(0, 3, 1, 2, 4)[untouched],
        args["kv_cache"].transpose(0, 3, 1, 2, 4)[untouched],
        "unaddressed slots",
    )


@pytest.mark.gpu
@given(
    seed=seeds,
    dtype=input_dtypes,
    data=st.data(),
    heads=gqa_heads(),
    dims=head_and_rotary_dims(),
    B=st.integers(1, 4),
    S=st.integers(1, 9),
    extra_c=st.integers(0, 24),
    lens=st.booleans(),
    pos=st.booleans(),
    table_batch=st.sampled_from([None, 1, "B"]),
    packed=st.booleans(),
    write_k=st.booleans(),
    is_neox=st.booleans(),
    mrope=st.sampled_from([None, None, "chunked", "interleaved"]),
)
def test_kernel_matches_reference(
    seed,
    dtype,
    data,
    heads,
    dims,
    B,
    S,
    extra_c,
    lens,
    pos,
    table_batch,
    packed,
    write_k,
    is_neox,
    mrope,
):
    cache_dtype = data.draw(cache_dtypes(dtype))
    (Hq, Hkv), (D, R) = heads, dims
    if not is_neox and (R % 2 or D % 2):
        return
    args = make_case(
        seed,
        B=B,
        S=S,
        Hq=Hq,
        Hkv=Hkv,
        D=D,
        R=R,
        C=S + extra_c,
        P=S + extra_c + 4,
        dtype=dtype,
        cache_dtype=cache_dtype,
        lens=lens,
        pos=pos,
        packed=packed,
        table_batch=B if table_batch == "B" else table_batch,
    )
    kw = {}
    if mrope:
        args["position_ids"] = mrope_ids(np.random.default_rng(seed), B, S, S + extra_c + 4)
        if data.draw(st.booleans()):
            args["position_ids"] = args["position_ids"].astype(np.int64)
        kw = {
            "mrope_section": mrope_section_for(R, mrope == "interleaved"),
            "mrope_interleaved": mrope == "interleaved",
        }
    check_against_reference(args, write_k_in_place=write_k, is_neox=is_neox, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "cache_dtype", [np.float16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2]
)
def test_llama_prefill_and_decode_shapes(cache_dtype):
    args = make_case(
        7, B=2, S=64, Hq=32, Hkv=8, D=128, R=128, C=256, P=512, cache_dtype=cache_dtype
    )
    args["kv_end_lens"][:] = [64, 200]
    check_against_reference(args)
    args = make_case(8, B=16, S=1, Hq=32, Hkv=8, D=128, R=128, C=64, P=64, cache_dtype=cache_dtype)
    check_against_reference(args)


@pytest.mark.gpu
def test_fp8_saturates_on_device():
    args = make_case(9, cache_dtype=E4M3, lens=False)
    args["v"][...] = np.float16(60000)
    args["kv_scale"][:] = [1.0, 1.0]
    check_against_reference(args)
    cache = to_numpy(device_args(args)["kv_cache"])
    assert cache.shape[0] == 2


@pytest.mark.gpu
@given(
    seed=seeds,
    form=st.sampled_from(["float", "pair", "host 0-d", "device 0-d", "device (2,)"]),
    cache_dtype=st.sampled_from([E4M3, np.dtype(ml_dtypes.float8_e5m2)]),
    S=st.integers(1, 40),
)
def test_kernel_kv_scale_forms_match_the_reference(seed, form, cache_dtype, S):
    """Constant scales (a number, a pair, a 0-d host array) and device arrays ((2,), ()) give the
    reference's cache; unaddressed slots stay."""
    import cupy as cp

    args = make_case(
        seed, S=S, Hq=8, Hkv=2, D=128, R=128, C=S + 8, P=S + 8, cache_dtype=cache_dtype
    )
    k_s, v_s = (float(x) for x in args["kv_scale"])
    scale = {
        "float": k_s,
        "pair": (k_s, v_s),
        "host 0-d": np.array(k_s, np.float32),
        "device 0-d": cp.asarray(np.array(k_s, np.float32)),
        "device (2,)": cp.asarray(args["kv_scale"]),
    }[form]
    if form in ("float", "host 0-d", "device 0-d"):
        args["kv_scale"][:] = k_s
    expected = copy_args(args)
    call(expected)
    dev = device_args({n: x for n, x in args.items() if n != "kv_scale"})
    call(dev, kv_scale=scale)
    assert_close(dev["q"], expected["q"], "q")
    got = to_numpy(dev["kv_cache"])
    assert_close(got, expected["kv_cache"], "kv_cache")
    untouched = ~addressed_slots(args, S)
    assert_bytes_equal(
        got.transpose(0, 3, 1, 2, 4)[untouched],
        args["kv_cache"].transpose(0, 3, 1, 2, 4)[untouched],
        "unaddressed slots",
    )


@pytest.mark.gpu
def test_torch_tensors_in_place_zero_copy():
    torch = pytest.importorskip("torch")
    args = make_case(10, Hq=8, Hkv=2, D=128, R=128, cache_dtype=E4M3)
    expected = copy_args(args)
    call(expected, write_k_in_place=True)
    dev = device_args(args)
    t = {
        n: torch.from_dlpack(x) if x.dtype.itemsize > 1 or x.dtype.kind in "iuf" else None
        for n, x in dev.items()
    }
    cache_u8 = torch.from_dlpack(dev["kv_cache"].view(np.uint8))
    t["kv_cache"] = cache_u8.view(torch.float8_e4m3fn)
    ptr = t["kv_cache"].data_ptr()
    call(t, write_k_in_place=True)
    torch.cuda.synchronize()
    assert t["kv_cache"].data_ptr() == ptr
    assert_close(t["kv_cache"], expected["kv_cache"], "torch fp8 cache")
    assert_close(t["q"], expected["q"], "torch q")
    assert_close(t["k"], expected["k"], "torch k")


@pytest.mark.gpu
def test_jax_arrays_are_read_zero_copy():
    jax = pytest.importorskip("jax")
    args = make_case(11, D=128, R=128)
    expected = copy_args(args)
    call(expected)
    dev = device_args(args)
    # JAX's arrays on the CuPy arrays' device: with two GPUs the two libraries' current devices
    # can differ (the suite on a two-H200 machine found q on device 1 and JAX's k on device 0)
    (gpu,) = [d for d in jax.devices("gpu") if d.local_hardware_id == dev["q"].device.id]
    jk, jv, jt = (jax.device_put(args[n], gpu) for n in ("k", "v", "cos_sin_cache"))
    dev.update(k=jk, v=jv, cos_sin_cache=jt)
    call(dev)
    assert_close(dev["kv_cache"], expected["kv_cache"], "cache from JAX inputs")
    assert_close(dev["q"], expected["q"], "q")


@pytest.mark.gpu
def test_jax_inputs_still_in_flight_are_waited_for():
    """JAX dispatches asynchronously: k and v here are still being copied to the device (behind
    a 1 GiB copy queued first) when ropekv is called, and the table feeds on a computation still
    running (a chain of large matrix products). The kernel must read them after both. (ropekv
    takes JAX arrays through DLPack, whose stream handshake orders that work; the earlier read of
    their __cuda_array_interface__ passed this test too on the H200, twice, but a suite run read
    K rows of zeros through it in test_jax_arrays_are_read_zero_copy.)"""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    args = make_case(12, D=128, R=128)
    expected = copy_args(args)
    call(expected)
    dev = device_args(args)
    (gpu,) = [d for d in jax.devices("gpu") if d.local_hardware_id == dev["q"].device.id]
    big = jax.device_put(np.ones(1 << 28, np.float32), gpu)  # 1 GiB on the copy queue first
    jk, jv = (jax.device_put(args[n], gpu) for n in ("k", "v"))
    with jax.default_device(gpu):
        w = jax.random.normal(jax.random.key(0), (4096, 4096), jnp.float32)
        for _ in range(6):  # tens of milliseconds of device work, queued
            w = jnp.tanh(w @ w)
        zero = (w[0, 0] * 0).astype(jnp.float16)  # 0, known only once the chain has run
        jt = jax.device_put(args["cos_sin_cache"], gpu) + zero.astype(jnp.float32)
    dev.update(k=jk, v=jv, cos_sin_cache=jt)
    call(dev)
    assert_close(dev["kv_cache"], expected["kv_cache"], "cache from in-flight JAX inputs")
    assert_close(dev["q"], expected["q"], "q")
    del big


@pytest.mark.gpu
def test_explicit_stream():
    import cupy as cp

    args = make_case(12)
    expected = copy_args(args)
    call(expected)
    dev = device_args(args)
    stream = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Device().synchronize()  # the copies above ran on the null stream: s must see them
    call(dev, stream=stream)
    stream.synchronize()
    assert_close(dev["kv_cache"], expected["kv_cache"])
    dev2 = device_args(args)
    cp.cuda.Device().synchronize()
    call(dev2, stream=stream.ptr)
    stream.synchronize()
    assert_close(dev2["q"], expected["q"])


@pytest.mark.gpu
def test_hostile_indices_never_write_out_of_bounds():
    """Extreme index values: nothing outside the addressed slots changes, nothing crashes."""
    import cupy as cp

    args = make_case(13, pos=True, S=4, C=8, P=8)
    args["kv_end_lens"][:] = [np.iinfo(np.int32).max, np.iinfo(np.int32).min]
    args["position_ids"][:] = np.iinfo(np.int32).max
    check_against_reference(args)
    cp.cuda.Device().synchronize()


@pytest.mark.gpu
def test_mixing_host_and_device_arrays_is_refused():
    args = make_case(14)
    dev = device_args(args)
    dev["kv_cache"] = args["kv_cache"]
    with pytest.raises(ValueError, match="q is in CUDA device 0, kv_cache is in host memory"):
        call(dev)


@pytest.mark.gpu
def test_repeated_calls_with_new_arrays_of_one_layout():
    """The second call of a layout replays a cached launch plan: it must use the new pointers."""
    for seed in (15, 16, 17):
        args = make_case(seed, cache_dtype=E4M3, pos=True)
        check_against_reference(args)


@pytest.mark.gpu
def test_check_indices_reads_device_index_arrays(monkeypatch):
    monkeypatch.setenv("ROPEKV_CHECK_INDICES", "1")
    args = make_case(18, C=16)
    args["kv_end_lens"][:] = [3, 40]
    dev = device_args(args)
    before = to_numpy(dev["kv_cache"]).copy()
    with pytest.raises(IndexError, match=r"token \(b=1, s=0\) lands in cache slot 37"):
        call(dev)
    assert_bytes_equal(dev["kv_cache"], before, "cache after a refused call")


# ---------------------------------------------------------------------------------------------
# q_out, fp8 queries (static or dynamic scales), per-token-head KV scales (issue 14)

E5M2 = np.dtype(ml_dtypes.float8_e5m2)
INT8 = np.dtype(np.int8)
Q_MODES = ("self", "copy", "static e4m3", "static e5m2", "dynamic e4m3", "dynamic e5m2")


def quant_case(seed, q_mode=None, kv_dtype=None, strided=False, **kw):
    """``make_case`` plus the new outputs: ``q_mode`` one of Q_MODES (None: q roped in place),
    ``kv_dtype`` an fp8 or int8 cache with ``kv_cache_scales``. Outputs start as random bytes
    (stray writes show); with ``strided`` the scale arrays are slices of larger ones."""
    rng = np.random.default_rng(seed + 1)
    args = make_case(seed, **kw)
    B, S, Hq, D = args["q"].shape
    Hkv, C = args["kv_cache"].shape[2], args["kv_cache"].shape[3]

    def scales(shape):
        full = rng.uniform(-3, 3, (*shape[:-1], shape[-1] + 3 if strided else shape[-1]))
        return full.astype(np.float32)[..., : shape[-1]]

    if q_mode == "self":
        args["q_out"] = args["q"]
    elif q_mode is not None:
        dtype = (
            args["q"].dtype
            if q_mode == "copy"
            else np.dtype(
                getattr(ml_dtypes, "float8_" + {"e4m3": "e4m3fn", "e5m2": "e5m2"}[q_mode[-4:]])
            )
        )
        args["q_out"] = (
            rng.integers(0, 256, (B, S, Hq, D), np.uint8).view(dtype)
            if dtype.itemsize == 1
            else random(rng, (B, S, Hq, D), dtype)
        )
        if q_mode.startswith("static"):
            args["q_scale"] = float(rng.uniform(0.01, 0.5))
        elif q_mode.startswith("dynamic"):
            args["q_scale_out"] = scales((B, S, Hq))
    if kv_dtype is not None:
        args.pop("kv_scale", None)
        args["kv_cache"] = rng.integers(0, 256, (B, 2, Hkv, C, D), np.uint8).view(kv_dtype)
        args["kv_cache_scales"] = scales((B, 2, Hkv, C))
    return args


def quant_copy(args):
    """A deep copy keeping ``q_out is q`` and the scale arrays' strides."""
    out = {}
    for n, x in args.items():
        if not isinstance(x, np.ndarray):  # q_scale
            out[n] = x
        elif n in ("q_scale_out", "kv_cache_scales") and x.base is not None:
            out[n] = x.base.copy()[tuple(slice(0, s) for s in x.shape)]
        elif not (n == "q_out" and x is args["q"]):
            out[n] = x.copy()
    if "q_out" in args and args["q_out"] is args["q"]:
        out["q_out"] = out["q"]
    return out


def assert_codes_close(actual, expected, what):
    """int8 codes equal or adjacent (float32 kernel against the float64 reference)."""
    a, e = to_numpy(actual).astype(np.int32), np.asarray(expected).astype(np.int32)
    bad = np.argwhere(np.abs(a - e) > 1)
    assert bad.size == 0, f"{what}: {len(bad)} int8 codes differ by more than one"


def assert_output_close(actual, expected, what):
    if np.dtype(expected.dtype) == INT8:
        assert_codes_close(actual, expected, what)
    else:
        assert_close(actual, expected, what)


def test_numpy_q_out_receives_the_roped_queries_and_q_is_only_read():
    args = make_case(20, pos=True, S=6, C=8, P=8)
    args["position_ids"][0, :2] = [-1, 9]  # two skipped tokens
    ref = copy_args(args)
    call(ref)  # in place
    q = args["q"].copy()
    q.flags.writeable = False  # q is only read
    args["q"] = q
    q_out = np.zeros_like(q)
    got = call(args, q_out=q_out)
    assert got is q_out
    assert_bytes_equal(args["q"], make_case(20, pos=True, S=6, C=8, P=8)["q"], "q")
    assert_bytes_equal(q_out, ref["q"], "q_out (skipped tokens: q as it came)")
    assert_bytes_equal(args["kv_cache"], ref["kv_cache"])


def test_numpy_q_out_is_q_is_the_in_place_call():
    args = make_case(21, pos=True)
    ref = copy_args(args)
    assert call(ref) is None
    got = call(args, q_out=args["q"])
    assert got is args["q"]
    assert_bytes_equal(args["q"], ref["q"])
    assert_bytes_equal(args["kv_cache"], ref["kv_cache"])


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
def test_numpy_fp8_q_out_static_and_dynamic_scales(fp8):
    """Static: stored = fp8(q / q_scale); dynamic: per row, max |code| is max_code and the row
    dequantizes to the roped q."""
    args = make_case(22, lens=False)
    ref = copy_args(args)
    call(ref)
    roped = ref["q"].astype(np.float64)
    static = np.zeros(args["q"].shape, fp8)
    call(copy_args(args), q_out=static, q_scale=0.25)
    assert_close(static, reference.to_dtype(roped / 0.25, fp8), "static q_out")  # adjacent codes
    dyn, scales = np.zeros(args["q"].shape, fp8), np.zeros(args["q"].shape[:3], np.float32)
    call(copy_args(args), q_out=dyn, q_scale_out=scales)
    amax = np.abs(roped).max(-1)
    np.testing.assert_allclose(scales, amax / reference.MAX_CODE[np.dtype(fp8)], rtol=2e-3)
    np.testing.assert_array_equal(
        np.abs(dyn.astype(np.float64)).max(-1), reference.MAX_CODE[np.dtype(fp8)]
    )
    err = np.abs(reference.dequantize_rows(dyn, scales) - roped)
    assert (err <= 0.13 * np.abs(roped) + 1e-3 * amax[..., None]).all()


@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2, INT8])
def test_numpy_per_token_head_kv_scales(cache_dtype):
    """Each written K/V row dequantizes to the 16-bit cache's row; unwritten slots keep their
    bytes in the cache and in the scales."""
    args = quant_case(23, kv_dtype=cache_dtype, pos=True, S=5, C=9, P=12)
    plain = make_case(23, pos=True, S=5, C=9, P=12)
    call(plain)
    before = quant_copy(args)
    call(args)
    mask = addressed_slots(args, 5)
    cache, scales = args["kv_cache"], args["kv_cache_scales"]
    assert mask.any() and not mask.all()
    for b, c in zip(*np.nonzero(mask)):
        want = plain["kv_cache"][b, :, :, c].astype(np.float64)  # (2, Hkv, D)
        got = reference.dequantize_rows(cache[b, :, :, c], scales[b, :, :, c])
        np.testing.assert_allclose(got, want, rtol=0.13, atol=0.01 * np.abs(want).max())
        if cache_dtype == INT8:
            assert (np.abs(cache[b, :, :, c].astype(int)).max(-1) == 127).all()
    for b, c in zip(*np.nonzero(~mask)):
        assert_bytes_equal(
            np.ascontiguousarray(cache[b, :, :, c]), before["kv_cache"][b, :, :, c], "cache slot"
        )
        assert_bytes_equal(
            np.ascontiguousarray(scales[b, :, :, c]),
            before["kv_cache_scales"][b, :, :, c],
            "scales",
        )


def test_numpy_q_out_on_q_memory_is_in_place():
    """A second view of q's memory with q's layout is allowed, as in place."""
    args = make_case(24, pos=True)
    ref = copy_args(args)
    call(ref)
    call(args, q_out=args["q"][:])
    assert_bytes_equal(args["q"], ref["q"])


def qbad(match, exc=ValueError, q_mode=None, kv_dtype=None, **changes):
    args = quant_case(25, q_mode, kv_dtype)
    args.update(changes)
    for n in [n for n, x in args.items() if x is None]:
        del args[n]
    with pytest.raises(exc, match=match):
        call(args)


def test_q_out_shape():
    qbad(
        r"q_out must have shape \(B, S, Hq, D\) = \(2, 3, 4, 64\), got \(2, 3, 4, 32\)",
        q_out=np.zeros((2, 3, 4, 32), np.float16),
    )
    qbad(
        r"q_out must have shape \(B, S, Hq, D\), got \(2, 3, 256\)",
        q_out=np.zeros((2, 3, 256), np.float16),
    )


def test_q_out_dtype():
    qbad(
        "q_out must have dtype float16 or float8_e4m3fn or float8_e5m2, got bfloat16",
        TypeError,
        q_out=np.zeros((2, 3, 4, 64), ml_dtypes.bfloat16),
    )
    qbad("q_out must have dtype .*, got int8", TypeError, q_out=np.zeros((2, 3, 4, 64), np.int8))


def test_q_out_last_dim_contiguous():
    qbad(
        r"q_out must be contiguous in its last dimension",
        q_out=np.zeros((2, 3, 4, 128), np.float16)[..., ::2],
    )


def test_q_out_must_not_overlap_other_arguments():
    args = make_case(26)
    on_cache = args["kv_cache"].reshape(-1)[: 2 * 3 * 4 * 64].reshape(2, 3, 4, 64)
    with pytest.raises(ValueError, match="q_out"):
        call(args, q_out=on_cache)


def test_q_out_read_only_is_refused():
    q_out = np.zeros((2, 3, 4, 64), np.float16)
    q_out.flags.writeable = False
    qbad(
        "q_out is written in place but its producer exported it read-only", BufferError, q_out=q_out
    )


def test_fp8_q_out_on_q_memory_is_refused():
    args = make_case(27)
    with pytest.raises(ValueError, match="q_out"):
        call(args, q_out=args["q"].view(np.uint8)[..., :64].view(E4M3))


def test_q_scale_rules():
    qbad("q_scale is only used with a float8 q_out, but q_out is not given", q_scale=0.5)
    qbad(
        "q_scale is only used with a float8 q_out, but q_out is float16", q_mode="copy", q_scale=0.5
    )
    qbad("q_scale must be a finite positive number, got 0.0", q_mode="static e4m3", q_scale=0.0)
    qbad("q_scale must be a real number", TypeError, q_mode="static e4m3", q_scale="1")
    qbad("q_scale .* and q_scale_out .* exclude each other", q_mode="dynamic e4m3", q_scale=0.5)


def test_q_scale_out_rules():
    qbad(
        "q_scale_out is only used with a float8 q_out, but q_out is not given",
        q_scale_out=np.zeros((2, 3, 4), np.float32),
    )
    qbad(
        "q_scale_out is only used with a float8 q_out, but q_out is float16",
        q_mode="copy",
        q_scale_out=np.zeros((2, 3, 4), np.float32),
    )
    qbad(
        r"q_scale_out must have shape \(B, S, Hq\) = \(2, 3, 4\), got \(2, 3, 5\)",
        q_mode="dynamic e5m2",
        q_scale_out=np.zeros((2, 3, 5), np.float32),
    )
    qbad(
        r"q_scale_out must have shape \(B, S, Hq\), got \(6, 4\)",
        q_mode="dynamic e5m2",
        q_scale_out=np.zeros((6, 4), np.float32),
    )
    qbad(
        "q_scale_out must have dtype float32, got float16",
        TypeError,
        q_mode="dynamic e5m2",
        q_scale_out=np.zeros((2, 3, 4), np.float16),
    )
    ro = np.zeros((2, 3, 4), np.float32)
    ro.flags.writeable = False
    qbad("q_scale_out is written in place", BufferError, q_mode="dynamic e5m2", q_scale_out=ro)


def test_kv_cache_scales_rules():
    qbad(
        "kv_scale .* and kv_cache_scales .* exclude each other",
        kv_dtype=E4M3,
        kv_scale=np.ones(2, np.float32),
    )
    qbad(
        r"kv_cache_scales must have shape \(B, 2, Hkv, C\) = \(2, 2, 2, 16\), got "
        r"\(2, 2, 2, 15\)",
        kv_dtype=INT8,
        kv_cache_scales=np.zeros((2, 2, 2, 15), np.float32),
    )
    qbad(
        r"kv_cache_scales must have shape \(B, 2, Hkv, C\), got \(2, 2, 2\)",
        kv_dtype=INT8,
        kv_cache_scales=np.zeros((2, 2, 2), np.float32),
    )
    qbad(
        "kv_cache_scales must have dtype float32, got float64",
        TypeError,
        kv_dtype=INT8,
        kv_cache_scales=np.zeros((2, 2, 2, 16)),
    )


def test_kv_cache_scales_must_not_overlap_the_cache():
    args = quant_case(28, kv_dtype=INT8)
    args["kv_cache_scales"] = (
        args["kv_cache"]
        .view(np.uint8)
        .reshape(-1)[: 2 * 2 * 2 * 16 * 4]
        .view(np.float32)
        .reshape(2, 2, 2, 16)
    )
    with pytest.raises(ValueError, match="kv_cache_scales"):
        call(args)


# ---------------------------------------------------------------------------------------------
# GPU: the new outputs against the reference


def check_quant_against_reference(args, **kw):
    """Kernel and reference on copies of ``args``; every output compared, q unchanged when
    q_out is another array, unaddressed cache slots and scales byte-identical."""
    import cupy as cp

    expected = quant_copy(args)
    call(expected, **kw)
    dev = device_args({n: x for n, x in args.items() if n != "q_out" or x is not args["q"]})
    if "q_out" in args and args["q_out"] is args["q"]:
        dev["q_out"] = dev["q"]
    for n in ("q_scale_out", "kv_cache_scales"):  # keep the strided layouts on the device
        if n in args and args[n].base is not None:
            dev[n] = cp.asarray(args[n].base)[tuple(slice(0, s) for s in args[n].shape)]
    got_out = call(dev, **kw)
    if "q_out" in args:
        assert got_out is dev["q_out"]
        assert_output_close(dev["q_out"], expected["q_out"], "q_out")
        if args["q_out"] is not args["q"]:
            assert_bytes_equal(dev["q"], args["q"], "q (only read)")
    else:
        assert got_out is None
        assert_close(dev["q"], expected["q"], "q")
    for name in ("k", "v"):
        assert_close(dev[name], expected[name], name)
    if "q_scale_out" in args:
        assert_close(dev["q_scale_out"], expected["q_scale_out"], "q_scale_out")
    got = to_numpy(dev["kv_cache"])
    assert_output_close(got, expected["kv_cache"], "kv_cache")
    untouched = ~addressed_slots(args, args["q"].shape[1])
    assert_bytes_equal(
        got.transpose(0, 3, 1, 2, 4)[untouched],
        args["kv_cache"].transpose(0, 3, 1, 2, 4)[untouched],
        "unaddressed slots",
    )
    if "kv_cache_scales" in args:
        got_s = to_numpy(dev["kv_cache_scales"])
        written = addressed_slots(args, args["q"].shape[1])
        assert_close(
            got_s.transpose(0, 3, 1, 2)[written],
            expected["kv_cache_scales"].transpose(0, 3, 1, 2)[written],
            "kv scales",
        )
        assert_bytes_equal(
            np.ascontiguousarray(got_s.transpose(0, 3, 1, 2)[untouched]),
            np.ascontiguousarray(args["kv_cache_scales"].transpose(0, 3, 1, 2)[untouched]),
            "unaddressed scales",
        )


@pytest.mark.gpu
@given(
    seed=seeds,
    dtype=input_dtypes,
    data=st.data(),
    heads=gqa_heads(),
    dims=head_and_rotary_dims(),
    B=st.integers(1, 4),
    S=st.integers(1, 9),
    extra_c=st.integers(0, 24),
    lens=st.booleans(),
    pos=st.booleans(),
    table_batch=st.sampled_from([None, 1, "B"]),
    packed=st.booleans(),
    write_k=st.booleans(),
    is_neox=st.booleans(),
    mrope=st.sampled_from([None, None, "chunked", "interleaved"]),
    q_mode=st.sampled_from((None, *Q_MODES)),
    kv_dtype=st.sampled_from([None, E4M3, E5M2, INT8]),
    strided=st.booleans(),
)
def test_kernel_quantized_outputs_match_reference(
    seed,
    dtype,
    data,
    heads,
    dims,
    B,
    S,
    extra_c,
    lens,
    pos,
    table_batch,
    packed,
    write_k,
    is_neox,
    mrope,
    q_mode,
    kv_dtype,
    strided,
):
    (Hq, Hkv), (D, R) = heads, dims
    if not is_neox and (R % 2 or D % 2):
        return
    cache_dtype = data.draw(cache_dtypes(dtype)) if kv_dtype is None else None
    args = quant_case(
        seed,
        q_mode,
        kv_dtype,
        strided,
        B=B,
        S=S,
        Hq=Hq,
        Hkv=Hkv,
        D=D,
        R=R,
        C=S + extra_c,
        P=S + extra_c + 4,
        dtype=dtype,
        cache_dtype=cache_dtype,
        lens=lens,
        pos=pos,
        packed=packed,
        table_batch=B if table_batch == "B" else table_batch,
    )
    kw = {}
    if mrope:
        args["position_ids"] = mrope_ids(np.random.default_rng(seed), B, S, S + extra_c + 4)
        kw = {
            "mrope_section": mrope_section_for(R, mrope == "interleaved"),
            "mrope_interleaved": mrope == "interleaved",
        }
    check_quant_against_reference(args, write_k_in_place=write_k, is_neox=is_neox, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("q_mode", Q_MODES)
@pytest.mark.parametrize("kv_dtype", [None, E4M3, INT8])
def test_llama_quantized_prefill_and_decode(q_mode, kv_dtype):
    """Llama shapes (one group of 16 lanes a row, prefill and decode launch shapes), and a
    head dim whose rows need more than a warp (the shared-memory row reduction)."""
    for seed, shape in (
        (30, {"B": 2, "S": 64, "Hq": 32, "Hkv": 8, "D": 128, "R": 128, "C": 256, "P": 512}),
        (31, {"B": 16, "S": 1, "Hq": 32, "Hkv": 8, "D": 128, "R": 128, "C": 64, "P": 64}),
        (32, {"B": 3, "S": 5, "Hq": 4, "Hkv": 2, "D": 256, "R": 6, "C": 16, "P": 32}),
    ):
        args = quant_case(seed, q_mode, kv_dtype, pos=True, **shape)
        check_quant_against_reference(args)


@pytest.mark.gpu
def test_dynamic_scales_of_extreme_rows():
    """A zero row gets scale 1e-6 / max_code; a huge one saturates nothing (its own scale); an
    infinity gives scale inf, as the reference."""
    args = quant_case(33, "dynamic e4m3", INT8, lens=False, Hq=4, Hkv=2, D=128, R=128)
    args["q"][0, 0, 0] = 0
    args["q"][0, 0, 1] = np.float16(60000)
    args["v"][0, 1, 0] = 0
    args["v"][1, 2, 1, 5] = np.float16(np.inf)
    check_quant_against_reference(args)


@pytest.mark.gpu
def test_quantized_outputs_replay_with_new_arrays():
    """A replayed plan writes the new q_out and scale arrays (pointers refilled)."""
    for seed in (34, 35, 36):
        args = quant_case(seed, "dynamic e5m2", E4M3, pos=True)
        check_quant_against_reference(args)


@pytest.mark.gpu
def test_quantized_hostile_indices_never_write_out_of_bounds():
    args = quant_case(37, "dynamic e4m3", INT8, pos=True, S=4, C=8, P=8)
    args["kv_end_lens"][:] = [np.iinfo(np.int32).max, np.iinfo(np.int32).min]
    args["position_ids"][:] = np.iinfo(np.int32).max
    check_quant_against_reference(args)


@given(
    T=st.integers(1, 20000),
    H=st.integers(1, 200),
    group=st.sampled_from([1, 2, 4, 8, 16, 32]),
    prefill_rows=st.sampled_from([None, 1, 2, 3, 4]),
    rows_max=st.sampled_from([2, 4]),
)
def test_launch_shape_covers_every_row_within_rows_max(T, H, group, prefill_rows, rows_max):
    """Every head row has a lane group, no group holds more rows than its kernel does (2 in the
    computed-scale kernels, MODE 3-5), and a block never passes 256 threads."""
    from ropekv import contiguous

    block, rows, splits = contiguous.launch_shape(T, H, group, prefill_rows, rows_max)
    assert block % group == 0 and group <= block <= 256
    assert 1 <= rows <= rows_max
    assert (block // group) * rows * splits >= H


def test_computed_scale_modes_use_the_register_capped_kernel():
    from ropekv import contiguous as c

    f16, e4 = np.dtype(np.float16), np.dtype(ml_dtypes.float8_e4m3fn)
    for mode in (c.MODE_Q_ROWS, c.MODE_KV_ROWS, c.MODE_BOTH_ROWS):
        assert c.expression(f16, e4, True, 8, mode, e4).startswith(c.KERNEL_SCALED + "<")
    for mode in (c.MODE_PLAIN, c.MODE_OPTS, c.MODE_QUANT, c.MODE_ALL):
        assert c.expression(f16, e4, True, 8, mode, e4).startswith(c.KERNEL + "<")
    # Llama prefill (48 rows of 8 lanes): 2 rows a group, 192 threads
    assert c.launch_shape(8192, 48, 8, c.TUNING["scaled_prefill_rows"], c.SCALED_ROWS_MAX) == (
        192,
        2,
        1,
    )


# ---------------------------------------------------------------------------------------------
# the lean decode kernel (apply_rope_write_kv_lean): the plain call's decode


@pytest.mark.parametrize("B, S", [(1, 1), (4, 1), (64, 1), (256, 1), (352, 1), (353, 1), (2, 9)])
@pytest.mark.parametrize("H, items", [(48, 8), (9, 8), (48, 16), (3, 4), (6, 256), (300, 1)])
@pytest.mark.parametrize("lean_block", [32, 128, 256])
def test_lean_shape_covers_every_row_within_a_block(monkeypatch, B, S, H, items, lean_block):
    from ropekv import contiguous

    monkeypatch.setitem(contiguous.TUNING, "lean_block", lean_block)
    shape = contiguous.lean_shape(B, S, H, items)
    slots = max(1, min(H, lean_block // items, 256 // items))
    if B * S * -(-H // slots) > contiguous.TUNING["lean_wave_blocks"]:
        assert shape is None  # past a wave: the kernel of launch_shape
        return
    (bx, rows), (splits, gy, gz) = shape
    assert bx == items and bx * rows <= contiguous.MAX_BLOCK and (gy, gz) == (S, B)
    assert rows * splits >= H and rows * (splits - 1) < H  # every row, no empty block
    monkeypatch.setitem(contiguous.TUNING, "lean_decode", False)
    assert contiguous.lean_shape(B, S, H, items) is None


@pytest.fixture
def kernels_planned(monkeypatch):
    """The kernels the plans of calls on stand-in device arrays name (tools/hostcost.py's fakes
    and tests/test_replay_cpu.py's stubbed driver, Python replay); every op's plans dropped
    before and after (a fake plan must never serve a real array)."""
    from ropekv import _launch
    from tests import test_replay_cpu as rc

    ops = rc.all_ops()
    for op in ops:
        op.clear()
        op.reset_caller(native=False)
    rc.set_known_type(monkeypatch, 0, rc.hostcost.FakeCupyArray)
    names = []
    monkeypatch.setattr(
        _launch, "function_pointer", lambda stem, expr, *a, **k: names.append(expr) or 0x1000
    )
    monkeypatch.setattr(_launch, "current_stream_ptr", lambda device=-1: 0x5000)
    monkeypatch.setattr(_launch, "_launch_kernel", rc.Launches())
    monkeypatch.setattr(_launch, "_RUNTIME", [rc.hostcost._Runtime])
    yield names
    for op in ops:
        op.clear()
        op.reset_caller()
    _launch._native_module[0] = _launch._UNBOUND


def plan_kernel(names, args, **kw):
    from tests import test_replay_cpu as rc

    names.clear()
    call(rc.map_arrays(args, rc.hostcost.to_cupy), **kw)
    (name,) = names
    return name


def test_plain_decode_takes_the_lean_kernel(kernels_planned, monkeypatch):
    """The plain call at decode (16-bit or fp8 caches, device or constant scales, lens, position
    ids, write_k_in_place) plans the lean kernel; q_out, computed scales, mRoPE, a grid past
    lean_wave_blocks and lean_decode=False plan rope_write_kv's; 64-bit offsets past INT32_SPAN."""
    from ropekv import contiguous

    lean = contiguous.LEAN_KERNEL + "<"
    for cache_dtype in (np.float16, E4M3):
        args = make_case(70, B=4, S=1, Hq=32, Hkv=8, D=128, R=128, cache_dtype=cache_dtype)
        assert plan_kernel(kernels_planned, args).startswith(lean)
        assert plan_kernel(kernels_planned, args, write_k_in_place=True).startswith(lean)
        name = plan_kernel(kernels_planned, make_case(71, S=2, pos=True, cache_dtype=cache_dtype))
        assert name.startswith(lean) and name.endswith(", int>")
    const = make_case(72, cache_dtype=E4M3)
    del const["kv_scale"]
    assert plan_kernel(kernels_planned, const, kv_scale=(0.5, 2.0)).startswith(lean)
    prefill = make_case(73, B=8, S=256, C=256, P=256, lens=False)  # 2048 blocks
    assert plan_kernel(kernels_planned, prefill).startswith(contiguous.KERNEL + "<")
    args = make_case(74, B=2, S=1, D=128, R=128)
    q_out = {**args, "q_out": np.zeros_like(args["q"])}
    assert not plan_kernel(kernels_planned, q_out).startswith(lean)
    mrope = make_case(75, B=2, S=1, D=48, R=48)
    mrope["position_ids"] = mrope_ids(np.random.default_rng(1), 2, 1, 32)
    section = mrope_section_for(48, False)
    assert not plan_kernel(kernels_planned, mrope, mrope_section=section).startswith(lean)
    rows = quant_case(76, kv_dtype=E4M3)
    assert not plan_kernel(kernels_planned, rows).startswith(lean)
    monkeypatch.setattr(contiguous, "INT32_SPAN", 0)  # (a constant: plans are dropped)
    contiguous._OP.clear()
    assert plan_kernel(kernels_planned, args).endswith(", long long>")
    monkeypatch.setitem(contiguous.TUNING, "lean_decode", False)
    assert plan_kernel(kernels_planned, args).startswith(contiguous.KERNEL + "<")


LEAN_VARIANTS = [
    {},  # the defaults: the lean kernel at decode
    {"lean_decode": False},  # rope_write_kv on every shape (ee077f9)
    {"lean_block": 32},  # more blocks a token, fewer rows a block
    {"lean_wave_blocks": 4},  # lean up to a few tokens, then rope_write_kv
]


@pytest.fixture(params=[False, True], ids=["int offsets", "64-bit offsets"])
def lean_offsets(request, monkeypatch):
    """The lean kernel's 32-bit offsets, or its 64-bit ones for every array (INT32_SPAN 0)."""
    from ropekv import contiguous

    if request.param:
        monkeypatch.setattr(contiguous, "INT32_SPAN", 0)
    contiguous._OP.clear()  # INT32_SPAN is no plan key
    yield request.param
    contiguous._OP.clear()


@pytest.mark.gpu
@pytest.mark.parametrize("variant", LEAN_VARIANTS, ids=lambda v: ",".join(map(str, v.items())))
@pytest.mark.parametrize(
    "D, R, Hq, Hkv, is_neox, dtype, cache_dtype",
    [
        (128, 128, 32, 8, True, np.float16, np.float16),
        (128, 128, 32, 8, True, np.float16, E4M3),
        (128, 128, 8, 1, False, ml_dtypes.bfloat16, ml_dtypes.float8_e5m2),
        (64, 32, 4, 2, True, ml_dtypes.bfloat16, ml_dtypes.bfloat16),
        (80, 64, 3, 1, False, np.float16, E4M3),
        (64, 6, 3, 1, True, np.float16, np.float16),
    ],
)
@pytest.mark.parametrize("B, S", [(1, 1), (5, 1), (300, 1), (3, 7)])
def test_lean_decode_kernel_choices_match_reference(
    monkeypatch, lean_offsets, variant, D, R, Hq, Hkv, is_neox, dtype, cache_dtype, B, S
):
    """Every kernel the TUNING keys pick for the plain call (the lean kernel with 32- and 64-bit
    offsets, rope_write_kv): int32 and int64 indices, slots and positions out of range, position
    ids, a table per sequence, packed q/k/v, write_k_in_place, device and constant scales."""
    from ropekv import contiguous

    for key, value in variant.items():
        monkeypatch.setitem(contiguous.TUNING, key, value)
    for i, index_dtype in enumerate((np.int32, np.int64)):
        args = make_case(
            80 + i + B, B=B, S=S, Hq=Hq, Hkv=Hkv, D=D, R=R, C=S + 6, P=S + 8, dtype=dtype,
            cache_dtype=cache_dtype, pos=bool(i), table_batch=B if i else None, packed=bool(i),
        )  # fmt: skip
        args["kv_end_lens"] = args["kv_end_lens"].astype(index_dtype)
        args["kv_end_lens"][0] = np.iinfo(index_dtype).min if i else np.iinfo(index_dtype).max
        if "position_ids" in args:
            args["position_ids"] = args["position_ids"].astype(index_dtype)
        check_against_reference(args, write_k_in_place=bool(i), is_neox=is_neox)
        if "kv_scale" in args:  # the same scales as constants
            const = copy_args(args)
            scale = tuple(float(x) for x in const.pop("kv_scale"))
            expected = copy_args(const)
            call(expected, kv_scale=scale, is_neox=is_neox)
            dev = device_args(const)
            call(dev, kv_scale=scale, is_neox=is_neox)
            assert_close(dev["q"], expected["q"], "q")
            assert_close(dev["kv_cache"], expected["kv_cache"], "kv_cache")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", LEAN_VARIANTS[:2], ids=["lean", "rope_write_kv"])
@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), 1e-39])
def test_a_device_scale_outside_the_positive_floats_writes_nothing(monkeypatch, variant, bad):
    """A kv_scale array holding a scale whose reciprocal is not a positive finite float (0,
    negative, NaN, inf, a denormal whose reciprocal overflows) makes the kernel write nothing:
    q, k and the cache stay byte-identical."""
    from ropekv import contiguous

    for key, value in variant.items():
        monkeypatch.setitem(contiguous.TUNING, key, value)
    for which in (0, 1):
        args = make_case(90 + which, B=3, S=1, Hq=8, Hkv=2, D=128, R=128, cache_dtype=E4M3)
        args["kv_scale"][which] = np.float32(bad)
        dev = device_args(args)
        call(dev, write_k_in_place=True)
        for name in ("q", "k", "kv_cache"):
            assert_bytes_equal(to_numpy(dev[name]), args[name], name)


def test_lean_record_by_offset_width():
    """The lean kernel's call packs LEAN_PARAMS (int32 strides) where its offsets are 32-bit and
    PARAMS where they are 64-bit: an array spanning 2**31 elements, or a stride outside int32
    even where every span fits (a dimension of extent one)."""
    from types import SimpleNamespace

    from ropekv import contiguous

    assert contiguous.LEAN_PARAMS.dtype.itemsize < contiguous.PARAMS.dtype.itemsize
    view = SimpleNamespace(span=(0, 1024), dtype=np.dtype(np.float16))
    a = SimpleNamespace(q=view, k=view, v=view, kv_cache=view, cos_sin_cache=view)
    values = dict.fromkeys(contiguous._LEAN_STRIDES, 8)
    assert not contiguous._wide(a, values)
    assert contiguous._wide(a, values | {"q_sb": 2**31})
    assert contiguous._wide(a, values | {"c_st": -(2**31)})
    far = SimpleNamespace(span=(0, 2**32 + 2), dtype=np.dtype(np.float16))
    assert contiguous._wide(SimpleNamespace(**{**vars(a), "kv_cache": far}), values)
