"""``apply_rope_with_cos_sin_cache`` and ``apply_rope_with_cos_sin_cache_inplace``: the NumPy
reference against an independent formula, validation (CPU), and the CUDA kernel against the
reference (GPU)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import ropekv
from ropekv import qk_rope, reference
from tests.strategies import random
from tests.tolerance import assert_bytes_equal, assert_close, to_device, to_numpy

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)


def make_case(
    seed,
    nnz=5,
    Hq=4,
    Hk=2,
    D=64,
    R=None,
    P=32,
    dtype=F16,
    fused=False,
    heads3=False,
    pos_dtype=np.int32,
    bad_positions=False,
):
    """NumPy arguments of one call: ``fused``: query and key are views of one fused QKV buffer
    (rows strided); ``heads3``: 3-D ``(nnz, H, D)`` arrays; ``bad_positions``: some positions
    outside ``[0, P)``."""
    rng = np.random.default_rng(seed)
    R = R or D
    if fused:
        qkv = random(rng, (nnz, (Hq + 2 * Hk) * D), dtype)
        query, key = qkv[:, : Hq * D], qkv[:, Hq * D : (Hq + Hk) * D]
    else:
        qkv = None
        query, key = random(rng, (nnz, Hq * D), dtype), random(rng, (nnz, Hk * D), dtype)
    if heads3:
        query, key = query.reshape(nnz, Hq, D), key.reshape(nnz, Hk, D)
    positions = rng.integers(0, P, nnz)
    if bad_positions and nnz:
        bad = rng.random(nnz) < 0.4
        bad[0] = True
        positions[bad] = rng.choice([-1, P, P + 7, -(2**31)], bad.sum())
    return {
        "positions": positions.astype(pos_dtype),
        "query": query,
        "key": key,
        "head_size": D,
        "cos_sin_cache": ropekv.cos_sin_cache(P, R, base=rng.uniform(100, 1e6)),
        "qkv": qkv,
    }


def inplace(args, **kw):
    a = {n: v for n, v in args.items() if n != "qkv"}
    return ropekv.apply_rope_with_cos_sin_cache_inplace(**a, **kw)


def out_of_place(args, **kw):
    a = {n: v for n, v in args.items() if n != "qkv"}
    return ropekv.apply_rope_with_cos_sin_cache(**a, **kw)


def copy_args(args):
    out = dict(args)
    if args["qkv"] is not None:  # keep query and key views of the copied buffer
        qkv = args["qkv"].copy()
        off_q = (args["query"].ctypes.data - args["qkv"].ctypes.data) // qkv.itemsize
        off_k = (args["key"].ctypes.data - args["qkv"].ctypes.data) // qkv.itemsize
        flat = qkv.reshape(-1)
        out["qkv"] = qkv
        out["query"] = np.lib.stride_tricks.as_strided(
            flat[off_q:], args["query"].shape, args["query"].strides
        )
        out["key"] = np.lib.stride_tricks.as_strided(
            flat[off_k:], args["key"].shape, args["key"].strides
        )
        return out
    out["query"], out["key"] = args["query"].copy(), args["key"].copy()
    return out


def direct_rotation(x, positions, head_size, P, R, base, is_neox):
    """float64 rotation of ``x`` (``(nnz, H * D)`` or ``(nnz, H, D)``) written independently of
    the reference: the angle ``p * base ** (-2i / R)`` of pair i, complex multiplication; a
    position outside ``[0, P)`` leaves its token as it came."""
    x = np.asarray(x, np.float64).reshape(x.shape[0], -1, head_size).copy()
    i = np.arange(R // 2)
    for t, p in enumerate(np.asarray(positions, np.int64)):
        if not 0 <= p < P:
            continue
        w = np.exp(1j * p * base ** (-2.0 * i / R))
        if is_neox:
            z = (x[t, :, : R // 2] + 1j * x[t, :, R // 2 : R]) * w
            x[t, :, : R // 2], x[t, :, R // 2 : R] = z.real, z.imag
        else:
            z = (x[t, :, 0:R:2] + 1j * x[t, :, 1:R:2]) * w
            x[t, :, 0:R:2], x[t, :, 1:R:2] = z.real, z.imag
    return x


# ---------------------------------------------------------------------------------------------
# NumPy backend


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("R", [64, 32, 6])
def test_numpy_backend_matches_a_direct_rotation(is_neox, R):
    rng = np.random.default_rng(1)
    nnz, Hq, Hk, D, P = 6, 4, 2, 64, 40
    base = float(rng.uniform(100, 1e6))
    query = random(rng, (nnz, Hq * D), F16)
    key = random(rng, (nnz, Hk, D), F16)
    positions = np.array([0, 3, 39, 40, -1, 17], np.int64)
    expected_q = direct_rotation(query, positions, D, P, R, base, is_neox)
    expected_k = direct_rotation(key, positions, D, P, R, base, is_neox)
    table = ropekv.cos_sin_cache(P, R, base=base)
    q_out, k_out = ropekv.apply_rope_with_cos_sin_cache(
        positions, query, key, D, table, is_neox=is_neox
    )
    tol = {"rtol": 2e-3, "atol": 2e-3}
    np.testing.assert_allclose(q_out.astype(np.float64).reshape(nnz, Hq, D), expected_q, **tol)
    np.testing.assert_allclose(k_out.astype(np.float64), expected_k, **tol)
    ropekv.apply_rope_with_cos_sin_cache_inplace(positions, query, key, D, table, is_neox=is_neox)
    assert_bytes_equal(query, q_out, "in place vs out of place (query)")
    assert_bytes_equal(key, k_out, "in place vs out of place (key)")


def test_out_of_place_leaves_its_inputs_and_matches_in_place():
    args = make_case(2, bad_positions=True, R=32)
    before = copy_args(args)
    q_out, k_out = out_of_place(args)
    assert_bytes_equal(args["query"], before["query"], "query")
    assert_bytes_equal(args["key"], before["key"], "key")
    assert q_out.shape == args["query"].shape and q_out.dtype == args["query"].dtype
    assert k_out.shape == args["key"].shape and k_out.dtype == args["key"].dtype
    assert inplace(args) is None
    assert_bytes_equal(q_out, args["query"], "query")
    assert_bytes_equal(k_out, args["key"], "key")


def test_partial_rotary_dims_pass_through():
    args = make_case(3, D=128, R=64, heads3=True)
    before = copy_args(args)
    inplace(args)
    assert_bytes_equal(args["query"][..., 64:], before["query"][..., 64:], "query [R, D)")
    assert_bytes_equal(args["key"][..., 64:], before["key"][..., 64:], "key [R, D)")
    assert not np.array_equal(args["query"][..., :64], before["query"][..., :64])


def test_strided_rows_of_a_fused_qkv_buffer():
    """query and key are column slices of one (nnz, (Hq + 2 Hk) D) buffer: V stays, and the
    results are those of contiguous copies."""
    args = make_case(4, fused=True, R=48)
    assert args["query"].strides[0] != args["query"].shape[1] * 2
    plain = copy_args(args)
    plain["query"], plain["key"], plain["qkv"] = (
        np.ascontiguousarray(args["query"]),
        np.ascontiguousarray(args["key"]),
        None,
    )
    v_before = args["qkv"][:, (4 + 2) * 64 :].copy()
    inplace(args)
    inplace(plain)
    assert_bytes_equal(args["query"], plain["query"], "query")
    assert_bytes_equal(args["key"], plain["key"], "key")
    assert_bytes_equal(args["qkv"][:, (4 + 2) * 64 :], v_before, "V")


def test_3d_arrays_match_2d_ones():
    args2 = make_case(5)
    args3 = copy_args(args2)
    args3["query"] = args3["query"].reshape(5, 4, 64)
    args3["key"] = args3["key"].reshape(5, 2, 64)
    inplace(args2, is_neox=False)
    inplace(args3, is_neox=False)
    assert_bytes_equal(args3["query"], args2["query"].reshape(5, 4, 64), "query")
    assert_bytes_equal(args3["key"], args2["key"].reshape(5, 2, 64), "key")


@pytest.mark.parametrize("pos_dtype", [np.int32, np.int64])
def test_out_of_range_positions_are_skipped(pos_dtype):
    args = make_case(6, nnz=8, bad_positions=True, pos_dtype=pos_dtype)
    if pos_dtype == np.int64:
        args["positions"][1] = 2**62
    P = args["cos_sin_cache"].shape[0]
    bad = (args["positions"] < 0) | (args["positions"] >= P)
    assert bad.any() and not bad.all()
    before = copy_args(args)
    q_out, k_out = out_of_place(args)
    inplace(args)
    for name, out in (("query", q_out), ("key", k_out)):
        assert_bytes_equal(args[name][bad], before[name][bad], f"{name}: skipped tokens")
        assert_bytes_equal(out[bad], before[name][bad], f"{name} out: skipped tokens copied")
        assert not np.array_equal(args[name][~bad], before[name][~bad])


def test_check_indices_raises_before_writing(monkeypatch):
    monkeypatch.setenv("ROPEKV_CHECK_INDICES", "1")
    args = make_case(7, nnz=4, P=32)
    args["positions"][:] = [0, 5, 32, -1]
    before = copy_args(args)
    with pytest.raises(IndexError, match=r"token 2 has position positions\[2\] = 32, outside"):
        inplace(args)
    assert_bytes_equal(args["query"], before["query"], "query")
    args["positions"][2] = 31
    with pytest.raises(IndexError, match=r"token 3 has position positions\[3\] = -1"):
        out_of_place(args)
    args["positions"][3] = 0
    inplace(args)


def test_empty_batch():
    args = make_case(8, nnz=0)
    assert inplace(args) is None
    q_out, k_out = out_of_place(args)
    assert q_out.shape == (0, 4 * 64) and k_out.shape == (0, 2 * 64)


def test_reference_writes_given_outputs():
    args = make_case(9, heads3=True)
    q_out = np.zeros_like(args["query"])
    k_out = np.zeros_like(args["key"])
    got = reference.apply_rope_with_cos_sin_cache(
        args["positions"],
        args["query"],
        args["key"],
        64,
        args["cos_sin_cache"],
        True,
        q_out,
        k_out,
    )
    assert got[0] is q_out and got[1] is k_out
    expected = out_of_place(args)
    assert_bytes_equal(q_out, expected[0], "query")
    assert_bytes_equal(k_out, expected[1], "key")


# ---------------------------------------------------------------------------------------------
# launch shape (host only)


@pytest.mark.parametrize("T", [1, 4, 16, 64, 128, 256, 1024, 8192])
@pytest.mark.parametrize("H, G", [(40, 8), (9, 8), (40, 16), (2, 4), (96, 32), (3, 256)])
def test_launch_shape_covers_every_row_within_a_block(T, H, G):
    block_x, tokens, rows, splits = qk_rope.launch_shape(T, H, G)
    assert block_x % G == 0 and block_x * tokens <= qk_rope.MAX_THREADS
    assert 1 <= rows <= qk_rope.ROWS_MAX and tokens <= max(T, 1)
    slots = block_x // G
    assert slots * rows * splits >= H  # every row has a lane group
    assert slots * rows * (splits - 1) < H  # and no split is empty


@pytest.mark.parametrize("T", [1, 4, 16, 64, 128, 256, 352, 353, 1024, 8192])
@pytest.mark.parametrize("H, G", [(40, 8), (9, 8), (40, 16), (2, 4), (96, 32), (3, 256), (300, 1)])
@pytest.mark.parametrize("lean_block", [32, 64, 128, 256])
def test_lean_shape_covers_every_row_and_token_within_a_block(monkeypatch, T, H, G, lean_block):
    monkeypatch.setitem(qk_rope.TUNING, "lean_block", lean_block)
    (bx, slots, tokens), (gx, splits), decode = qk_rope.lean_shape(T, H, G)
    assert bx == G and bx * slots * tokens <= qk_rope.MAX_THREADS and 1 <= tokens <= 64
    assert slots * splits >= H and slots * (splits - 1) < H  # every row, no empty split
    assert tokens * gx >= T and tokens * (gx - 1) < T  # every token, no empty block
    if decode:  # one token per block while the grid stays within a wave
        assert tokens == 1 and T * splits <= qk_rope.TUNING["wave_blocks"]
    assert splits <= 65535 and tokens <= max(T, 1)


@pytest.mark.parametrize(
    "tuning, decode_lean, prefill_lean",
    [
        ({}, True, True),  # the defaults: the lean kernel everywhere
        ({"lean_decode": False, "lean_prefill": False}, False, False),  # 041bfbc's launches
        ({"lean_prefill": False}, True, False),
    ],
)
def test_launch_picks_the_kernel_tuning_names(monkeypatch, tuning, decode_lean, prefill_lean):
    for key, value in tuning.items():
        monkeypatch.setitem(qk_rope.TUNING, key, value)
    for T, lean in ((1, decode_lean), (256, decode_lean), (8192, prefill_lean)):
        block, grid, rows, got = qk_rope.launch(T, 40, 8)
        assert got == lean, T
        if lean:
            assert rows == 1 and len(block) == 3 and block[0] == 8
        else:
            block_x, tokens, r, splits = qk_rope.launch_shape(T, 40, 8)
            assert (block, grid, rows) == ((block_x, tokens), (-(-T // tokens), splits), r)


# ---------------------------------------------------------------------------------------------
# validation: one test per rule, all before anything is written


def bad(match, exc=ValueError, call=inplace, **changes):
    args = make_case(10)
    kw = {n: changes.pop(n) for n in list(changes) if n in ("is_neox", "enable_pdl", "stream")}
    args.update(changes)
    before = {n: np.array(args[n], copy=True) for n in ("query", "key")}
    with pytest.raises(exc, match=match):
        call(args, **kw)
    for n, x in before.items():
        if isinstance(args[n], np.ndarray) and args[n].shape == x.shape:
            assert_bytes_equal(np.ascontiguousarray(args[n]), x, f"{n} after a refused call")


@pytest.mark.parametrize("call", [inplace, out_of_place])
def test_dtypes(call):
    bad("query must have dtype float16 or bfloat16, got float32", TypeError, call,
        query=np.zeros((5, 256), np.float32))  # fmt: skip
    bad(r"key must have the dtype of query \(float16\), got bfloat16", TypeError, call,
        key=np.zeros((5, 128), BF16))  # fmt: skip
    bad("positions must have dtype int32 or int64, got float32", TypeError, call,
        positions=np.zeros(5, np.float32))  # fmt: skip
    bad("cos_sin_cache must have dtype float32, got float16", TypeError, call,
        cos_sin_cache=np.zeros((32, 64), np.float16))  # fmt: skip


@pytest.mark.parametrize("value", [0, -64, 4.0, True, "64", None, 2**40])
def test_head_size_must_be_a_positive_int(value):
    bad("head_size must be a positive integer", head_size=value)


def test_shapes():
    bad(r"query must have shape \(nnz, Hq \* head_size\) or \(nnz, Hq, head_size\) with "
        r"head_size=64 and at least one head, got \(5, 96\)", query=np.zeros((5, 96), F16))  # fmt: skip
    bad(r"query must have shape .* got \(5, 4, 32\)", query=np.zeros((5, 4, 32), F16))
    bad(r"query must have shape .* got \(5, 0\)", query=np.zeros((5, 0), F16))
    bad(r"query must have shape .* got \(256,\)", query=np.zeros(256, F16))
    bad(r"query must have shape .* got \(5, 1, 4, 64\)", query=np.zeros((5, 1, 4, 64), F16))
    bad(r"key must have shape \(nnz, Hk \* head_size\) .* got \(5, 100\)",
        key=np.zeros((5, 100), F16))  # fmt: skip
    bad(r"key must have as many tokens as query \(nnz=5\), got shape \(4, 128\)",
        key=np.zeros((4, 128), F16))  # fmt: skip
    bad(r"positions must have shape \(nnz,\) = \(5,\), got \(4,\)",
        positions=np.zeros(4, np.int32))  # fmt: skip
    bad(r"positions must have shape \(nnz,\) = \(5,\), got \(5, 1\)",
        positions=np.zeros((5, 1), np.int32))  # fmt: skip


def test_cos_sin_cache_shape():
    bad(r"cos_sin_cache must have shape \(max_seq_len, rotary_dim\), got \(1, 32, 64\)",
        cos_sin_cache=np.zeros((1, 32, 64), np.float32))  # fmt: skip
    bad(r"cos_sin_cache's rotary dim R .* must be even and in \[2, D=64\], got 128",
        cos_sin_cache=np.zeros((32, 128), np.float32))  # fmt: skip
    bad(r"cos_sin_cache's rotary dim R .* got 33", cos_sin_cache=np.zeros((32, 33), np.float32))
    bad(r"cos_sin_cache's rotary dim R .* got 0", cos_sin_cache=np.zeros((32, 0), np.float32))


def test_layouts():
    q = np.zeros((5, 4, 128), F16)[:, :, ::2]  # last dim strided
    bad("query must be contiguous in its last dimension", query=q)
    bad("positions must be C-contiguous", positions=np.zeros(10, np.int32)[::2])
    table = np.zeros((32, 128), np.float32)[:, ::2]
    bad("cos_sin_cache must be contiguous in its last dimension", cos_sin_cache=table)


def test_flags_and_non_arrays():
    bad("is_neox must be a bool, got 1", TypeError, is_neox=1)
    bad("enable_pdl must be a bool, got 'yes'", TypeError, enable_pdl="yes")
    bad("query must be a NumPy array", TypeError, query=[[0.0] * 256] * 5)
    bad("a required array argument is None", TypeError, key=None)
    bad("stream must be None, a CuPy stream", TypeError, stream="s")


def test_written_arrays():
    q = np.zeros((5, 256), F16)
    q.flags.writeable = False
    bad("query is written in place but its producer exported it read-only", BufferError, query=q)
    args = make_case(11)
    q_out, _ = out_of_place({**args, "query": q})  # out of place: only read
    assert q_out.shape == q.shape
    buf = np.zeros((5, 6 * 64), F16)
    with pytest.raises(ValueError, match="shares memory with key"):
        ropekv.apply_rope_with_cos_sin_cache_inplace(
            args["positions"], buf[:, : 4 * 64], buf[:, 3 * 64 : 5 * 64], 64, args["cos_sin_cache"]
        )
    with pytest.raises(ValueError, match="query is written in place but shares memory with key"):
        inplace({**args, "query": buf[:, :128], "key": buf[:, :128]})


# ---------------------------------------------------------------------------------------------
# the CUDA kernel against the reference


def device_args(args, torch=False):
    """CuPy (or torch) copies; query and key stay views of one buffer when ``args`` has one."""
    import cupy as cp

    dev = {n: to_device(x) for n, x in args.items() if n not in ("query", "key", "qkv")}
    if args["qkv"] is not None:
        qkv = cp.asarray(args["qkv"])
        base = args["qkv"].ctypes.data
        for n in ("query", "key"):
            x = args[n]
            off = x.ctypes.data - base
            dev[n] = cp.ndarray(x.shape, x.dtype, qkv.data + off, x.strides)
        dev["qkv"] = qkv
    else:
        dev["query"], dev["key"], dev["qkv"] = (
            to_device(args["query"]),
            to_device(args["key"]),
            None,
        )
    if torch:
        import torch as th

        dev = {
            n: (th.from_dlpack(x) if x is not None and not isinstance(x, int) else x)
            for n, x in dev.items()
        }
    return dev


def check_against_reference(args, is_neox=True, **kw):
    """In place and out of place on the device (fresh copies each), against the reference; rows
    the call must not write (skipped tokens, pass-through dims in place, V) compared by bytes."""
    P = args["cos_sin_cache"].shape[0]
    R = args["cos_sin_cache"].shape[1]
    D = args["head_size"]
    keep = (args["positions"].astype(np.int64) >= 0) & (args["positions"] < P)
    expected = copy_args(args)
    inplace(expected, is_neox=is_neox)
    dev = device_args(args)
    q_out, k_out = out_of_place(dev, is_neox=is_neox, **kw)
    assert_bytes_equal(dev["query"], args["query"], "query (read only out of place)")
    inplace(dev, is_neox=is_neox, **kw)
    for name, out in (("query", q_out), ("key", k_out)):
        got = to_numpy(dev[name])
        assert_close(got[keep], expected[name][keep], f"{name} in place")
        assert_close(to_numpy(out)[keep], expected[name][keep], f"{name} out of place")
        assert_bytes_equal(got[~keep], args[name][~keep], f"{name}: skipped tokens in place")
        assert_bytes_equal(to_numpy(out)[~keep], args[name][~keep], f"{name} out: skipped")
        rows = got.reshape(got.shape[0], -1, D)
        assert_bytes_equal(
            rows[..., R:], args[name].reshape(rows.shape)[..., R:], f"{name} pass-through"
        )
        assert out.flags.c_contiguous and out.shape == args[name].shape
    if args["qkv"] is not None:
        Hqk = args["query"].shape[-1] + args["key"].shape[-1]
        assert_bytes_equal(to_numpy(dev["qkv"])[:, Hqk:], args["qkv"][:, Hqk:], "V")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("partial", [False, True])
@pytest.mark.parametrize("layout", ["2d", "3d", "fused"])
def test_kernel_matches_reference(dtype, is_neox, D, partial, layout):
    R = D // 2 if partial else D
    for seed, nnz in ((20, 3), (21, 1500)):  # the decode and the prefill launch shapes
        args = make_case(
            seed,
            nnz=nnz,
            Hq=8,
            Hk=2,
            D=D,
            R=R,
            P=64,
            dtype=dtype,
            fused=layout == "fused",
            heads3=layout == "3d",
            pos_dtype=np.int64 if seed % 2 else np.int32,
            bad_positions=True,
        )
        check_against_reference(args, is_neox=is_neox)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "D, R, Hq, Hk, is_neox",
    [
        (80, 64, 2, 2, False),
        (112, 64, 2, 1, True),
        (160, 96, 6, 3, False),
        (192, 128, 3, 2, True),
        (64, 6, 3, 1, True),
        (64, 6, 3, 1, False),
        (128, 128, 32, 8, True),
        (128, 128, 8, 1, False),
        (128, 64, 128, 1, True),
    ],
)
@pytest.mark.parametrize("nnz", [1, 16, 257, 2049])
def test_kernel_odd_head_sizes_and_model_shapes(D, R, Hq, Hk, is_neox, nnz):
    args = make_case(30 + nnz, nnz=nnz, Hq=Hq, Hk=Hk, D=D, R=R, P=4096, bad_positions=True)
    check_against_reference(args, is_neox=is_neox)


LEAN_VARIANTS = [
    {"lean_decode": False, "lean_prefill": False},  # qk_rope on every shape (041bfbc)
    {"lean_prefill": False},  # qk_rope_lean decodes, qk_rope prefills
    {"lean_prefill": True, "lean_block": 32, "max_block": 64},
    {"lean_block": 64, "wave_blocks": 4},  # lean decode up to a few tokens, then qk_rope
]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", LEAN_VARIANTS, ids=lambda v: ",".join(map(str, v.items())))
@pytest.mark.parametrize(
    "D, R, Hq, Hk, is_neox, dtype",
    [
        (128, 128, 32, 8, True, F16),
        (128, 128, 8, 1, False, BF16),
        (64, 32, 4, 2, True, BF16),
        (80, 64, 3, 1, False, F16),
        (64, 6, 3, 1, True, F16),
    ],
)
@pytest.mark.parametrize("nnz", [1, 5, 300])
def test_kernel_choices_match_reference(monkeypatch, variant, D, R, Hq, Hk, is_neox, dtype, nnz):
    """Every kernel the TUNING keys can pick (qk_rope, qk_rope_lean at decode and prefill
    shapes), in place and out of place, int32 and int64 positions, with skipped tokens."""
    for key, value in variant.items():
        monkeypatch.setitem(qk_rope.TUNING, key, value)
    for pos_dtype, fused in ((np.int32, False), (np.int64, True)):
        args = make_case(
            60 + nnz, nnz=nnz, Hq=Hq, Hk=Hk, D=D, R=R, P=512, dtype=dtype, fused=fused,
            pos_dtype=pos_dtype, bad_positions=True,
        )  # fmt: skip
        check_against_reference(args, is_neox=is_neox)


@pytest.mark.gpu
def test_kernel_with_pdl_and_a_stream():
    import cupy as cp

    args = make_case(40, nnz=64, Hq=32, Hk=8, D=128)
    stream = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Device().synchronize()
    # the copies to and from the device on the launch stream too: ordered with the kernels (on
    # the default stream they raced a non-blocking stream's kernels, seen under memcheck)
    with stream:
        check_against_reference(args, enable_pdl=True, stream=stream)
    stream.synchronize()


@pytest.mark.gpu
def test_rows_at_odd_elements():
    """Rows that start at odd elements: neox runs at width 1, interleaved is refused."""
    import cupy as cp

    args = make_case(41, nnz=4, D=64)
    buf = cp.zeros((4, 4 * 64 + 1), F16)
    q = buf[:, 1:]
    q[...] = cp.asarray(args["query"])
    dev = device_args(args)
    expected = copy_args(args)
    inplace(expected)
    inplace({**dev, "query": q})
    assert_close(to_numpy(q), expected["query"], "query at odd elements")
    with pytest.raises(BufferError, match="must start at even elements"):
        inplace({**dev, "query": q}, is_neox=False)


@pytest.mark.gpu
def test_torch_tensors_zero_copy():
    torch = pytest.importorskip("torch")
    for fused in (False, True):
        args = make_case(42, nnz=33, Hq=8, Hk=2, D=128, R=64, fused=fused, bad_positions=True)
        expected = copy_args(args)
        inplace(expected, is_neox=False)
        t = device_args(args, torch=True)
        ptr = t["query"].data_ptr()
        q_out, k_out = out_of_place(t, is_neox=False)
        assert isinstance(q_out, torch.Tensor) and q_out.device == t["query"].device
        inplace(t, is_neox=False)
        torch.cuda.synchronize()
        assert t["query"].data_ptr() == ptr
        for name, out in (("query", q_out), ("key", k_out)):
            assert_close(t[name], expected[name], f"torch {name}")
            assert_close(out, expected[name], f"torch {name} out of place")


@pytest.mark.gpu
def test_repeated_calls_replay_with_new_arrays():
    for seed in (43, 44, 45):
        check_against_reference(make_case(seed, nnz=20, bad_positions=True), is_neox=False)


@pytest.mark.gpu
def test_hostile_positions_never_read_or_write_out_of_bounds():
    args = make_case(46, nnz=6, P=4)
    args["positions"] = np.array([2**31 - 1, -(2**31), 4, -1, 3, 0], np.int32)
    check_against_reference(args)
    args["positions"] = np.array([2**63 - 1, -(2**63), 2**32, 2**32 + 1, 3, 0], np.int64)
    check_against_reference(args)


@pytest.mark.gpu
def test_check_indices_reads_device_positions(monkeypatch):
    monkeypatch.setenv("ROPEKV_CHECK_INDICES", "1")
    args = make_case(47, nnz=4, P=8)
    args["positions"][:] = [0, 1, 9, 2]
    dev = device_args(args)
    with pytest.raises(IndexError, match=r"token 2 has position positions\[2\] = 9"):
        inplace(dev)
    assert_bytes_equal(dev["query"], args["query"], "query")


@pytest.mark.gpu
def test_64_bit_offsets():
    """A token stride past 2**31 elements: the kernel's 64-bit offsets."""
    import cupy as cp

    D, Hq, Hk = 64, 2, 1
    stride = 2**31 + 64
    buf = cp.zeros(stride + Hq * D, F16)  # two query rows 4 GiB apart
    q = cp.lib.stride_tricks.as_strided(buf, (2, Hq * D), (stride * 2, 2))
    args = make_case(48, nnz=2, Hq=Hq, Hk=Hk, D=D, P=8)
    q[...] = cp.asarray(args["query"])
    assert qk_rope._span(2, Hq, D, stride, D) > qk_rope.INT32_SPAN
    expected = copy_args(args)
    inplace(expected)
    dev = device_args(args)
    inplace({**dev, "query": q})
    assert_close(to_numpy(q), expected["query"], "query 4 GiB apart")
    assert_close(to_numpy(dev["key"]), expected["key"], "key")


def test_given_outputs():
    """query_out / key_out (ropekv's addition): written whole, returned, strided rows allowed,
    query_out may be query itself; refused when of another shape or dtype or overlapping."""
    args = make_case(12, bad_positions=True, R=32)
    expected = out_of_place(args)
    buf = np.zeros((5, 8 * 64), F16)
    q_out, k_out = buf[:, : 4 * 64], buf[:, 4 * 64 : 6 * 64]  # strided rows of one buffer
    got = out_of_place(args, query_out=q_out, key_out=k_out)
    assert got[0] is q_out and got[1] is k_out
    assert_bytes_equal(q_out, expected[0], "query_out")
    assert_bytes_equal(k_out, expected[1], "key_out")
    assert not buf[:, 6 * 64 :].any()
    only_k = np.zeros_like(args["key"])
    got = out_of_place(args, key_out=only_k)
    assert got[1] is only_k and got[0] is not args["query"]
    assert_bytes_equal(got[0], expected[0], "new query_out")
    same = copy_args(args)
    got = out_of_place(same, query_out=same["query"], key_out=same["key"])  # in place
    assert got[0] is same["query"]
    assert_bytes_equal(same["query"], expected[0], "query_out is query")
    with pytest.raises(ValueError, match=r"query_out must have shape = \(5, 256\), got \(5, 128\)"):
        out_of_place(args, query_out=np.zeros((5, 128), F16))
    with pytest.raises(TypeError, match=r"key_out must have the dtype of key \(float16\)"):
        out_of_place(args, key_out=np.zeros((5, 128), BF16))
    with pytest.raises(
        ValueError, match="key_out is written in place but shares memory with query"
    ):
        out_of_place(args, key_out=args["query"][:, :128])
    with pytest.raises(ValueError, match="query_out must be query itself"):
        q = args["query"]
        view = np.lib.stride_tricks.as_strided(q[:, 64:], q.shape, q.strides)
        out_of_place(args, query_out=view)


@pytest.mark.gpu
@pytest.mark.parametrize("is_neox", [True, False])
def test_kernel_given_outputs(is_neox):
    import cupy as cp

    args = make_case(49, nnz=300, Hq=8, Hk=2, D=128, R=64, bad_positions=True)
    expected = out_of_place(args, is_neox=is_neox)
    dev = device_args(args)
    buf = cp.zeros((300, 12 * 128), F16)
    q_out, k_out = buf[:, : 8 * 128], buf[:, 8 * 128 : 10 * 128]
    got = out_of_place(dev, is_neox=is_neox, query_out=q_out, key_out=k_out)
    assert got[0] is q_out and got[1] is k_out
    assert_close(to_numpy(q_out), expected[0], "query_out")
    assert_close(to_numpy(k_out), expected[1], "key_out")
    assert not to_numpy(buf[:, 10 * 128 :]).any()
    got = out_of_place(dev, is_neox=is_neox, query_out=dev["query"], key_out=dev["key"])
    assert_close(to_numpy(dev["query"]), expected[0], "query_out is query")


# ---- the torch and JAX forms (derived from the declarations) --------------------------------


def _torch_args(case):
    import torch

    return {
        n: torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x
        for n, x in case.items()
        if n != "qkv"
    }


@pytest.mark.parametrize("is_neox", [True, False])
def test_torch_forms_match_the_eager_op(is_neox):
    torch = pytest.importorskip("torch")
    import ropekv.torch as rt

    case = make_case(3)
    expected = ropekv.apply_rope_with_cos_sin_cache(
        **{n: x for n, x in case.items() if n != "qkv"}, is_neox=is_neox
    )
    a = _torch_args(case)
    q, k = rt.apply_rope_with_cos_sin_cache(**a, is_neox=is_neox)
    assert_bytes_equal(q.numpy(), expected[0])
    assert_bytes_equal(k.numpy(), expected[1])
    query, key = a["query"].clone(), a["key"].clone()
    rt.apply_rope_with_cos_sin_cache_inplace(
        a["positions"], query, key, a["head_size"], a["cos_sin_cache"], is_neox
    )
    assert_bytes_equal(query.numpy(), expected[0])
    outs = torch.empty_like(a["query"]), torch.empty_like(a["key"])
    got = rt.apply_rope_with_cos_sin_cache(**a, is_neox=is_neox, query_out=outs[0], key_out=outs[1])
    assert got[0] is outs[0] and got[1] is outs[1]
    assert_bytes_equal(outs[1].numpy(), expected[1])
    compiled = torch.compile(
        lambda p, x, y, t: rt.apply_rope_with_cos_sin_cache(p, x, y, case["head_size"], t),
        fullgraph=True,
    )
    q2, _ = compiled(a["positions"], a["query"], a["key"], a["cos_sin_cache"])
    expected_neox = ropekv.apply_rope_with_cos_sin_cache(
        **{n: x for n, x in case.items() if n != "qkv"}
    )
    assert_bytes_equal(q2.numpy(), expected_neox[0])


def test_torch_outputs_that_are_the_inputs_run_the_in_place_op():
    """``query_out=query, key_out=key`` through ropekv.torch: the ``_in_place`` variant (a custom
    op may not read and write one tensor through two arguments), with the eager results."""
    pytest.importorskip("torch")
    from torch.utils._python_dispatch import TorchDispatchMode

    import ropekv.torch as rt

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "ropekv":
                self.ops.append(func._opname)
            return func(*args, **(kwargs or {}))

    case = {n: x for n, x in make_case(5).items() if n != "qkv"}
    expected = ropekv.apply_rope_with_cos_sin_cache(**case)
    a = _torch_args(make_case(5))
    with Recorder() as recorder:
        q, k = rt.apply_rope_with_cos_sin_cache(**a, query_out=a["query"], key_out=a["key"])
    assert q is a["query"] and k is a["key"]
    assert recorder.ops == ["apply_rope_with_cos_sin_cache_in_place"]
    assert_bytes_equal(q.numpy(), expected[0])
    assert_bytes_equal(k.numpy(), expected[1])


def test_torch_schemas_write_what_flashinfer_writes():
    """The in-place op writes query and key; the allocating one nothing (it returns both)."""
    torch = pytest.importorskip("torch")
    import ropekv.torch  # noqa: F401 - registers the ops

    def written(name):
        schema = getattr(torch.ops.ropekv, name).default._schema
        return {a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write}

    assert written("apply_rope_with_cos_sin_cache_inplace") == {"query", "key"}
    assert written("apply_rope_with_cos_sin_cache") == set()
    assert written("apply_rope_with_cos_sin_cache_out") == {"query_out", "key_out"}
    assert len(torch.ops.ropekv.apply_rope_with_cos_sin_cache.default._schema.returns) == 2


def test_jax_forms_match_the_eager_op():
    jax = pytest.importorskip("jax")
    import ropekv.jax as rj

    case = {n: x for n, x in make_case(4).items() if n != "qkv"}
    expected = ropekv.apply_rope_with_cos_sin_cache(**case)
    arrays = {n: jax.numpy.asarray(x) if isinstance(x, np.ndarray) else x for n, x in case.items()}
    for fn in (rj.apply_rope_with_cos_sin_cache, rj.apply_rope_with_cos_sin_cache_inplace):
        q, k = jax.jit(fn, static_argnums=(3,))(
            arrays["positions"],
            arrays["query"],
            arrays["key"],
            case["head_size"],
            arrays["cos_sin_cache"],
        )
        assert_bytes_equal(np.asarray(q), expected[0])
        assert_bytes_equal(np.asarray(k), expected[1])
