"""``fused_qkv_matmul_append_paged_kv_cache``'s ``status=`` and ``clear_unused_last_page_rows``
(issue 14): the NumPy backend against independent checks, the validation of ``status``, the launch
plans each path builds (CPU, CuPy stand-ins and a stubbed driver), and every path on the GPU
against the reference (ragged batches with empty requests, NHD / HND, fp8 caches, hostile
offsets, a captured graph)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import ropekv
from ropekv import _launch, reference
from ropekv import qkv as qkv_mod
from tests import test_replay_cpu as replay_cpu
from tests.test_qknorm import check_status_in_graph
from tests.test_qkv import (
    BF16,
    E4M3,
    E5M2,
    F16,
    LLAMA,
    SWITCH_TOKENS,
    assert_codes_within,
    call,
    expected,
    force_path,
    make_case,
    packed_fp8_within,
    read_only,
    rel_rows,
    rounded_weights,
    taken_path,
    written_mask,
)
from tests.tolerance import assert_close, to_device, to_numpy

hostcost = replay_cpu.hostcost
stubbed = replay_cpu.stubbed  # the fixture: CuPy stand-ins, the driver stubbed


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


def tail_mask(args, kw):
    """Boolean (num_pages, page_size): each request's last-page rows past its new length, from
    the lengths directly (well-formed offsets): requests with new tokens whose last token has a
    position in the table (and in ``[0, P)`` with RoPE) and a page in range."""
    k = args["paged_kv_cache"][0]
    nhd = kw.get("kv_layout", "NHD") == "NHD"
    num_pages, page_size = k.shape[0], k.shape[1] if nhd else k.shape[2]
    offs = np.asarray(args["input_row_offsets"], np.int64)
    lens, table = np.asarray(args["cache_lengths"], np.int64), args["block_table"]
    P = kw["cos_sin_cache"].shape[0] if kw.get("cos_sin_cache") is not None else None
    mask = np.zeros((num_pages, page_size), bool)
    for b in range(len(lens)):
        n = offs[b + 1] - offs[b]
        last = lens[b] + n - 1  # the position of the request's last new token
        if n <= 0 or last < 0 or (P is not None and last >= P):
            continue
        if last // page_size >= table.shape[1]:
            continue
        page = table[b, last // page_size]
        if 0 <= page < num_pages:
            mask[page, last % page_size + 1 :] = True
    return mask


def rows(cache, kw):
    """The cache as (num_pages, page_size, ...) whatever its layout."""
    return cache if kw.get("kv_layout", "NHD") == "NHD" else np.swapaxes(cache, 1, 2)


def assert_bytes_equal(actual, expected, what=""):
    np.testing.assert_array_equal(
        np.ascontiguousarray(to_numpy(actual)).view(np.uint8),
        np.ascontiguousarray(expected).view(np.uint8),
        err_msg=what,
    )


# ---------------------------------------------------------------------------------------------
# NumPy backend


@pytest.mark.parametrize("kind", [0, 1, 2, 3])
def test_status_codes_and_no_writes_on_the_numpy_backend(kind):
    args, kw = make_case(1, lengths=(3, 2, 2), cached=(0, 5, 17))
    args["input_row_offsets"] = malform(args["input_row_offsets"], kind)
    assert reference.ragged_offsets_status(args["input_row_offsets"], 7) == kind
    before = tuple(c.copy() for c in args["paged_kv_cache"])
    out = np.full((7, 64), 7, F16)
    status = np.full(1, 99, np.int32)
    ref = None if kind else expected(args, kw, clear=True)
    assert call(args, kw, out=out, status=status, clear_unused_last_page_rows=True) is out
    assert status[0] == kind
    if kind:
        assert (out == 7).all()
        for got, old in zip(args["paged_kv_cache"], before):
            assert_bytes_equal(got, old)
    else:
        np.testing.assert_array_equal(out, ref[0])
        for got, want in zip(args["paged_kv_cache"], ref[1:]):
            assert_bytes_equal(got, want)


@pytest.mark.parametrize("dtype", [np.int32, np.uint32])
def test_status_reads_offsets_unsigned(dtype):
    """A negative int32 offset is a huge one, as the kernels read it: a last offset of -1 does
    not decrease (code 2 if read signed) but differs from T (code 3)."""
    args, kw = make_case(2, lengths=(3, 2))
    args["input_row_offsets"] = np.array([0, 3, -1], np.int64).astype(dtype)
    status = np.full(1, 99, np.int32)
    call(args, kw, status=status)
    assert status[0] == 3


def test_status_of_an_empty_batch():
    args, kw = make_case(3, lengths=(0, 0), cached=(1, 2))
    before = tuple(c.copy() for c in args["paged_kv_cache"])
    status = np.full(1, 99, np.int32)
    assert call(args, kw, status=status).shape == (0, 64)
    assert status[0] == 0
    args["input_row_offsets"] = np.array([0, 0, 2], np.int32)
    call(args, kw, status=status, clear_unused_last_page_rows=True)
    assert status[0] == 3
    for got, old in zip(args["paged_kv_cache"], before):
        assert_bytes_equal(got, old)


def test_status_0_d_array():
    args, kw = make_case(4)
    status = np.full((), 99, np.int32)
    call(args, kw, status=status)
    assert status == 0


@pytest.mark.parametrize(
    "status, exc, match",
    [
        (np.zeros(1, np.int64), TypeError, "status must have dtype int32, got int64"),
        (np.zeros(2, np.int32), ValueError, r"status must have shape \(1,\) = \(1,\), got \(2,\)"),
        (np.zeros((1, 1), np.int32), ValueError, "status must have shape"),
        (read_only(np.zeros(1, np.int32)), BufferError, "status is written in place"),
    ],
)
def test_status_validation(status, exc, match):
    args, kw = make_case(5)
    before = [c.copy() for c in args["paged_kv_cache"]]
    with pytest.raises(exc, match=match):
        call(args, kw, status=status)
    for c, b in zip(args["paged_kv_cache"], before):
        assert_bytes_equal(c, b)


@pytest.mark.parametrize("value", ["no", 1, None])
def test_clear_flag_must_be_a_bool(value):
    args, kw = make_case(6)
    with pytest.raises(TypeError, match="clear_unused_last_page_rows must be a bool"):
        call(args, kw, clear_unused_last_page_rows=value)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("cache_dtype", [None, E4M3])
@pytest.mark.parametrize("R", [16, None])
def test_clear_unused_last_page_rows_zeroes_the_tails_only(layout, cache_dtype, R):
    """K and V rows past each request's new length on its last page become zeros (tails from the
    lengths, not from the reference's own helper); written rows are those of a call without the
    option; all other rows keep their bytes (NumPy backend)."""
    args, kw = make_case(
        7,
        lengths=(3, 1, 0, 2, 2),
        cached=(0, 5, 7, 4, 2),
        layout=layout,
        cache_dtype=cache_dtype,
        R=R,
        P=64,
    )
    plain = dict(args, paged_kv_cache=tuple(c.copy() for c in args["paged_kv_cache"]))
    before = tuple(c.copy() for c in args["paged_kv_cache"])
    q_plain = call(plain, kw)
    q = call(args, kw, clear_unused_last_page_rows=True)
    np.testing.assert_array_equal(q, q_plain)
    tail, written = tail_mask(args, kw), written_mask(args, kw)
    # request 0 ends at entry 2 (one row), 1 and 3 at entry 1 (two rows each), 2 has no new
    # tokens, 4 ends at the page's last entry
    assert tail.sum() == 5
    assert not (tail & written).any()
    for got, ref, old in zip(args["paged_kv_cache"], plain["paged_kv_cache"], before):
        got, ref, old = (rows(x, kw) for x in (got, ref, old))
        assert not got[tail].view(np.uint8).any()
        assert_bytes_equal(got[written], ref[written])
        assert_bytes_equal(got[~tail & ~written], old[~tail & ~written])


def test_clear_skips_requests_whose_last_token_is_not_written():
    """A last token past the RoPE table, or on a page outside the cache, clears nothing."""
    args, kw = make_case(8, lengths=(2, 2), cached=(63, 0), P=64)
    args["block_table"][1, 0] = args["paged_kv_cache"][0].shape[0] + 3  # out of range
    before = tuple(c.copy() for c in args["paged_kv_cache"])
    call(args, kw, clear_unused_last_page_rows=True)
    written = written_mask(args, kw)
    assert written.sum() == 1  # request 0's position 63 (64 is past the table)
    assert not tail_mask(args, kw).any()
    for got, old in zip(args["paged_kv_cache"], before):
        assert_bytes_equal(rows(got, kw)[~written], rows(old, kw)[~written])


def test_reference_clear_models_the_kernels_request_search():
    """Malformed offsets without status: the token the kernels' search takes as a request's last
    clears that request's page from its entry on (the reference and an independent loop agree)."""
    args, kw = make_case(9, lengths=(2, 2, 2), cached=(0, 0, 0), page_size=8)
    args["input_row_offsets"] = np.array([0, 3, 2, 6], np.int32)  # request 1 ends before it starts
    _, k, _ = expected(args, kw, clear=True)
    _, k0, _ = expected(args, kw)
    offsets = args["input_row_offsets"]
    cleared = (k.view(np.uint8) != k0.view(np.uint8)).any(axis=(2, 3))
    want = np.zeros_like(cleared)
    for t in range(6):  # the kernels' search: the last b with offsets[b] <= t, if t < its end
        b = max(b for b in range(4) if offsets[b] <= t)
        if b == 3 or t >= offsets[b + 1]:
            continue  # in no request
        pos = int(args["cache_lengths"][b]) + t - int(offsets[b])
        if offsets[b + 1] == t + 1:  # its request's last token: the rest of its page
            want[args["block_table"][b, pos // 8], pos % 8 + 1 :] = True
    assert want.any()
    np.testing.assert_array_equal(cleared, want)
    assert not k[want].view(np.uint8).any()


# ---------------------------------------------------------------------------------------------
# Launch plans (CPU: CuPy stand-ins, the driver stubbed)


def _record_expressions(monkeypatch):
    names = []
    monkeypatch.setattr(qkv_mod, "_active_clusters", lambda *a: None)  # (no driver)
    monkeypatch.setattr(
        _launch,
        "function_pointer",
        lambda stem, expression, *a, **k: names.append(expression) or 0x1000,
    )
    return names


def _fake(args, kw, **more):
    dev = {
        n: hostcost.to_cupy(x)
        if isinstance(x, np.ndarray)
        else tuple(hostcost.to_cupy(c) for c in x)
        if isinstance(x, tuple)
        else x
        for n, x in {**args, **kw}.items()
    }
    dev.update(
        {n: hostcost.to_cupy(x) if isinstance(x, np.ndarray) else x for n, x in more.items()}
    )
    return dev


def _field(launch, name):
    """The value of int32 field ``name`` in ``launch``'s parameter record."""
    offset = qkv_mod.PARAMS.dtype.fields[name][1]
    return int(np.frombuffer(launch.rec, np.int32, 1, offset)[0])


KERNEL_PATHS = {  # a plan step's kernel -> the path taken_path names
    "qkv_gemv_lean<": "lean",
    "qkv_lean_mma<": "lean_mma",
    "qkv_gemv<": "gemv",
    "qkv_mma<": "mma",
    "qkv_mma_tiled<": "tiled",
    "qkv_wgmma<": "wgmma",
    "qkv_epilogue<": "cublas",
}


def _plan_path(expressions):
    """The path a plan's steps (their kernels' name expressions; None for a cuBLAS GEMM) take."""
    paths = {
        p for e in expressions if e is not None for k, p in KERNEL_PATHS.items() if e.startswith(k)
    }
    if None in expressions:
        paths.add("cublas")
    return paths


@pytest.mark.parametrize(
    "wfmt, dtype", [("dense", F16), ("dense", BF16), ("fp8", F16), ("int4", F16), ("int4", BF16)]
)
@pytest.mark.parametrize("clear", [False, True])
def test_taken_path_names_the_kernel_the_plan_launches(wfmt, dtype, clear, stubbed, monkeypatch):
    """tests/test_qkv.py's taken_path, which the GPU tests use to choose their reference and to
    check that a forced path is taken, against the steps of the plan the op builds (a Hopper GPU
    of 132 SMs, the driver stubbed): every path forced and the shipped thresholds, token counts
    around each switch, with and without an option."""
    expressions, real, made_all = {}, qkv_mod.Launch, []

    def launch(*a, **k):
        made = real(*a, **k)
        made_all.append(made)  # kept alive, so that no later Launch reuses its id
        expressions[id(made)] = a[1]
        return made

    monkeypatch.setattr(qkv_mod, "Launch", launch)
    shape = {"K": 1024, "Hq": 4, "Hkv": 2, "D": 64, "R": 64, "P": 512, "page_size": 16}
    more = {"clear_unused_last_page_rows": True} if clear else {}
    seen = set()
    for T in (1, 2, 3, 4, 5, 8, 16, 17, 64, 129, 224, 256, 257, 321, 513):
        args, kw = make_case(T, lengths=(T,), wfmt=wfmt, dtype=dtype, **shape)
        for path in (None, "lean", "lean_mma", "gemv", "mma", "tiled", "wgmma", "cublas"):
            with pytest.MonkeyPatch.context() as mp:
                force_path(mp, path)
                taken = taken_path(args, {**kw, **more}, cc=90, sms=132)
                if path is not None and taken != path:
                    continue  # the case cannot take it (a GPU test refuses such a case)
                qkv_mod._OP.clear()
                ropekv.fused_qkv_matmul_append_paged_kv_cache(**_fake(args, kw, **more))
                (plan,) = qkv_mod._OP.plans.values()
            steps = [expressions.get(id(s)) for s in plan.steps]
            assert _plan_path(steps) == {taken}, (T, path, taken, steps)
            seen.add(taken)
    assert {"gemv", "mma", "cublas"} <= seen, seen


def test_lean_mma_takes_the_tokens_past_the_lean_gemv():
    """qkv_lean_mma's rule as shipped (sm_90, 16-byte loads): fp8 / 4-bit weights at 3-16 tokens,
    16-bit weights at 3-8, never at 1-2 (qkv_gemv_lean's), but for 4-bit weights with bf16 inputs,
    which qkv_gemv_lean does not take: 1-16 tokens; never off sm_90 or without 16-byte loads;
    blocks of (4 warps, 1 tile) at 8 tokens and (8 warps, 3 tiles) at 16 where a head holds 24
    pairs, else (4, 1)."""
    lean_max = qkv_mod.lean_max_tokens()
    f16, bf16 = F16, BF16
    for dtype, fmt, low, top in (
        (f16, qkv_mod.W_FP8, 3, 16),
        (bf16, qkv_mod.W_FP8, 3, 16),
        (f16, qkv_mod.W_INT4, 3, 16),
        (bf16, qkv_mod.W_INT4, 1, 16),
        (f16, qkv_mod.W_DENSE, 3, 8),
        (bf16, qkv_mod.W_DENSE, 3, 8),
    ):
        takes = [
            T
            for T in range(1, 40)
            if qkv_mod.lean_mma_applies(dtype, fmt, 16, 128, T, lean_max, 90)
        ]
        assert takes == list(range(low, top + 1)), (dtype, fmt, takes)
        lean = [T for T in range(1, 40) if qkv_mod.lean_applies(dtype, fmt, 16, 128, T, lean_max)]
        assert lean == list(range(1, low)), (dtype, fmt, lean)  # the two kernels meet
        assert not qkv_mod.lean_mma_applies(dtype, fmt, 16, 128, 4, lean_max, 89)
        assert not qkv_mod.lean_mma_applies(dtype, fmt, 0, 128, 4, lean_max, 90)
    W4, W8 = qkv_mod.W_INT4, qkv_mod.W_FP8
    assert qkv_mod.lean_mma_shape(3, 128, W4) == (8, (4, 1))
    assert qkv_mod.lean_mma_shape(8, 128, W8) == (8, (8, 1))  # fp8: 8 warps of 2 loads a round
    assert qkv_mod.lean_mma_shape(8, 128, qkv_mod.W_DENSE) == (8, (4, 1))
    assert qkv_mod.lean_mma_shape(9, 128, W4) == (16, (8, 3))
    assert qkv_mod.lean_mma_shape(9, 128, qkv_mod.W_DENSE) == (16, (8, 3))
    assert qkv_mod.lean_mma_shape(9, 128, W8) == (16, (4, 1))
    assert qkv_mod.lean_mma_shape(16, 32, W4) == (16, (4, 1))  # 16 pairs a head: not 24
    shapes = (((8, 1),) * 3, ((8, 3), (8, 1), (8, 3)))  # given: indexed by the format
    assert qkv_mod.lean_mma_shape(16, 32, W4, shapes) == (16, (8, 1))  # the 8-token shape
    assert qkv_mod.lean_mma_shape(16, 128, W8, shapes) == (16, (8, 1))
    with pytest.raises(ValueError, match=r"LEAN_MMA_WIDE_SHAPE\[2\] must be one of"):
        qkv_mod.lean_mma_shape(16, 128, W4, (((4, 1),) * 3, ((4, 2),) * 3))
    with pytest.raises(ValueError, match=r"LEAN_MMA_SHAPE\[1\] must be one of"):
        qkv_mod.lean_mma_shape(4, 128, W8, (((2, 1),) * 3, ((8, 3),) * 3))
    assert not qkv_mod.lean_mma_applies(f16, qkv_mod.W_INT4, 16, 8, 4, lean_max, 90)  # 4 pairs


@pytest.mark.parametrize("wfmt", ["dense", "fp8", "int4"])
@pytest.mark.parametrize("T", [1, 2])
@pytest.mark.parametrize("forms", [None, ((3, 3, 3), (3, 3, 3)), ((15, 7, 3), (2, 15, 7))])
def test_lean_gemv_form_and_grid_follow_format_and_tile(wfmt, T, forms, stubbed, monkeypatch):
    """A plain call of 1-2 tokens launches qkv_gemv_lean in the form GEMV_LEAN_FORM (a tile of one
    token) or GEMV_LEAN_WIDE_FORM (two) names for its weight format, on a grid of that form's
    blocks: 8 row pairs a block, 4 with form bit 2; a form that is not compiled is refused by
    name."""
    if forms is not None:
        monkeypatch.setattr(qkv_mod, "GEMV_LEAN_FORM", forms[0])
        monkeypatch.setattr(qkv_mod, "GEMV_LEAN_WIDE_FORM", forms[1])
    fmt = {"dense": qkv_mod.W_DENSE, "fp8": qkv_mod.W_FP8, "int4": qkv_mod.W_INT4}[wfmt]
    form = (qkv_mod.GEMV_LEAN_FORM if T == 1 else qkv_mod.GEMV_LEAN_WIDE_FORM)[fmt]
    names = _record_expressions(monkeypatch)
    qkv_mod._OP.clear()
    args, kw = make_case(12, lengths=(T,), wfmt=wfmt, **LLAMA)
    ropekv.fused_qkv_matmul_append_paged_kv_cache(**_fake(args, kw))
    assert names == [qkv_mod.lean_expression(np.dtype(F16), fmt, T, form)], names
    (plan,) = qkv_mod._OP.plans.values()
    pairs = 4 if form & 4 else 8
    assert qkv_mod.lean_pairs(T, form) == pairs
    assert plan.steps[0].grid[:2] == (args["weight"].shape[0] // 2 // pairs, 1)
    name = "GEMV_LEAN_FORM" if T == 1 else "GEMV_LEAN_WIDE_FORM"
    with pytest.raises(ValueError, match=rf"{name}\[{fmt}\] must be one of"):
        qkv_mod.lean_form(fmt, T, ((11,) * 3, (11,) * 3))


@pytest.mark.parametrize(
    "options", [{}, {"clear": True}, {"status": True}, {"clear": True, "status": True}]
)
def test_decode_plan_takes_the_options_kernel_only_with_an_option(options, stubbed, monkeypatch):
    names = _record_expressions(monkeypatch)
    args, kw = make_case(10, lengths=(1, 1))
    more = {}
    if options.get("status"):
        more["status"] = np.zeros(1, np.int32)
    if options.get("clear"):
        more["clear_unused_last_page_rows"] = True
    dev = _fake(args, kw, **more)
    for _ in range(2):  # the first call, then a replay
        ropekv.fused_qkv_matmul_append_paged_kv_cache(**dev)
        (name,) = names
        if options:  # qkv_gemv with its options compiled in
            assert name.startswith("qkv_gemv<") and name.endswith("true>"), name
        else:  # 16-bit weights, plain: qkv_gemv_lean (no options in it)
            assert name.startswith("qkv_gemv_lean<"), name
        (plan,) = qkv_mod._OP.plans.values()
        (launch,) = plan.steps
        assert _field(launch, "check") == int(bool(options.get("status")))
        assert _field(launch, "clear") == int(bool(options.get("clear")))
        # the launch's status pointer: the array's, or null
        index = qkv_mod.PARAMS.names.index("status")
        got = stubbed.pointers(len(stubbed.calls) - 1, index + 1)[index]
        assert got == (dev["status"].data.ptr if options.get("status") else 0)
        assert (qkv_mod.STATUS in plan.written) == bool(options.get("status"))


def test_empty_batch_with_status_launches_one_validating_block(stubbed, monkeypatch):
    names = _record_expressions(monkeypatch)
    args, kw = make_case(11, lengths=(0, 0), cached=(1, 2))
    ropekv.fused_qkv_matmul_append_paged_kv_cache(**_fake(args, kw, status=np.zeros(1, np.int32)))
    (name,) = names
    assert name.startswith("qkv_gemv<") and name.endswith("true>")
    (plan,) = qkv_mod._OP.plans.values()
    assert plan.steps[0].grid == (1, 1, 1)
    names.clear()
    ropekv.fused_qkv_matmul_append_paged_kv_cache(**_fake(args, kw))  # no status: no launch
    assert not names


@pytest.mark.parametrize("status", [False, True])
@pytest.mark.parametrize("cache", ["same", "e4m3"])
def test_prefill_gemms_write_no_caller_array_with_status(status, cache, stubbed, monkeypatch):
    """The cuBLAS path: with status no GEMM writes the caller's ``out`` (with fp8 caches and RoPE
    Q goes through a temporary of its own then), and the epilogue is the options kernel; without
    it the plan is as before (fp8 caches with RoPE: Q straight into ``out``)."""
    names = _record_expressions(monkeypatch)
    force_path(monkeypatch, "cublas")
    args, kw = make_case(12, lengths=(20, 5, 0, 3), cache_dtype=E4M3 if cache == "e4m3" else None)
    out = hostcost.to_cupy(np.zeros((28, 64), F16))
    more = {"status": np.zeros(1, np.int32)} if status else {}
    dev = _fake(args, kw, **more)
    ropekv.fused_qkv_matmul_append_paged_kv_cache(**dev, out=out)
    epilogue = [n for n in names if n.startswith("qkv_epilogue<")]  # (the plan also has the
    # fused kernel it runs under CUDA-graph capture)
    assert len(epilogue) == 1 and epilogue[0].endswith("true>" if status else "false>")
    gemms = [call for call in stubbed.gemms.calls if call[0] == "gemm"]
    targets = [call[15] for call in gemms]  # C
    out_ptr = out.data.ptr
    into_out = [c for c in targets if out_ptr <= c < out_ptr + 28 * 64 * 2]
    if status or cache == "same":
        assert not into_out
    else:
        assert into_out == [out_ptr]  # Q roped in place, as before
    assert len(gemms) == (1 if cache == "same" else 2)


def test_instantiations_cover_the_options_kernels():
    names = set(qkv_mod.instantiations())
    for dtype in (F16, BF16):
        for fmt in (0, 1, 2):
            for tt in qkv_mod.GEMV_TILES:
                assert qkv_mod.gemv_expression(dtype, fmt, 16, tt, opts=True) in names
            for tn in qkv_mod.MMA_TILES:
                for split in qkv_mod.MMA_SPLITS:
                    assert qkv_mod.mma_expression(dtype, fmt, tn, split, True) in names
        for cache in (dtype, E4M3, E5M2):
            for n in qkv_mod.EPILOGUE_WIDTHS:
                assert qkv_mod.epilogue_expression(dtype, cache, dtype, n, True) in names
    assert len(names) == len(list(qkv_mod.instantiations()))


# ---------------------------------------------------------------------------------------------
# GPU: every path against the reference


PATHS = ["mma", "tiled", "wgmma", "gemv", "cublas"]  # wgmma: 16-bit and 4-bit weights


def _case_for(path, seed, **kw):
    """A case every path can take (D divides 128, K in 16-byte loads for the mma kernel)."""
    base = {"K": 256, "Hq": 4, "Hkv": 2, "D": 64, "R": 64, "P": 512, "page_size": 16}
    return make_case(seed, **{**base, **kw})


def check_options(args, kw, monkeypatch, path, clear, status_given, out_given=False):
    """One call on ``path`` (None: the shipped thresholds) with the options against the
    reference: q, the written rows (qkv_gemv with 4-bit weights and fp16 inputs into an fp8
    cache: inside the packed decode's bound, packed_fp8_within), the cleared tails (zero bytes)
    and every other cache byte unchanged; status 0."""
    import cupy as cp

    options = {"clear_unused_last_page_rows": clear, "status": 0 if status_given else None}
    if path is None:
        path = taken_path(args, {**kw, **options})
    else:
        force_path(monkeypatch, path)
        assert taken_path(args, {**kw, **options}) == path, f"the case cannot take the {path} path"
    rounded = (
        path == "cublas"
        and args["weight"].dtype != args["hidden_state"].dtype
        or path in ("mma", "tiled", "wgmma")
        and args["weight"].dtype == np.uint8
    )
    q_ref, k_ref, v_ref = expected(
        *(rounded_weights(args, kw) if rounded else (args, kw)), clear=clear
    )
    originals = [c.copy() for c in args["paged_kv_cache"]]
    dargs = {n: to_device(x) for n, x in args.items()}
    dkw = {n: to_device(x) for n, x in kw.items()}
    status = cp.full(1, 99, cp.int32) if status_given else None
    if out_given:
        dkw["out"] = cp.full(q_ref.shape, 7, q_ref.dtype)
    q = call(dargs, dkw, clear_unused_last_page_rows=clear, status=status)
    if status_given:
        assert int(status[0]) == 0
    D = args["paged_kv_cache"][0].shape[3]
    assert rel_rows(q, q_ref, D) <= 1e-2
    written = written_mask(args, kw)
    tail = tail_mask(args, kw) if clear else np.zeros_like(written)
    assert not (tail & written).any()  # no two requests name one page (make_case)
    within = packed_fp8_within(args, kw, path)
    caches = zip(dargs["paged_kv_cache"], (k_ref, v_ref), originals, "kv", within or (None, None))
    for dc, ref, orig, what, bounds in caches:
        got, ref, orig = (rows(x, kw) for x in (to_numpy(dc), ref, orig))
        keep = ~written & ~tail
        assert_bytes_equal(got[keep], orig[keep], f"{what} cache: unaddressed bytes changed")
        assert not got[tail].view(np.uint8).any(), f"{what} cache: a tail row not cleared"
        assert_bytes_equal(ref[tail], np.zeros_like(ref[tail]), "the reference clears tails")
        if bounds is not None:
            assert_codes_within(got, bounds, written, f"{what} cache")
        elif ref.dtype.itemsize == 1:
            assert_close(
                np.ascontiguousarray(got[written]),
                np.ascontiguousarray(ref[written]),
                f"{what} cache",
            )
        else:
            assert rel_rows(got[written], ref[written], D) <= 1e-2, f"{what} cache"


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", [0, 1, 2, 3])
@pytest.mark.parametrize("B", [4, 300])  # the mma kernel stages up to 256 requests' offsets
@pytest.mark.parametrize("cache", ["same", "e4m3"])
def test_gpu_status_on_every_path(path, kind, B, cache, monkeypatch):
    """Malformed offsets: status holds the code and no byte of the caches or of the given out
    changes (the cuBLAS path with an fp8 cache and RoPE routes Q through its own temporary);
    valid ones: status 0 and the reference's result."""
    import cupy as cp

    T = {"mma": 12, "tiled": 40, "wgmma": 40, "gemv": 2, "cublas": 40}[path]
    rng = np.random.default_rng(kind + B + T)
    lengths = np.zeros(B, np.int64)
    lengths[rng.choice(B, min(B, T), replace=False)] = 1
    lengths[0] += T - lengths.sum()
    args, kw = _case_for(
        path,
        60 + kind,
        lengths=tuple(int(n) for n in lengths),
        cached=tuple(int(c) for c in rng.integers(0, 40, B)),
        cache_dtype=E4M3 if cache == "e4m3" else None,
    )
    args["input_row_offsets"] = malform(args["input_row_offsets"], kind)
    code = reference.ragged_offsets_status(args["input_row_offsets"], T)
    assert (code != 0) == (kind != 0)
    force_path(monkeypatch, path)
    assert taken_path(args, {**kw, "status": 0}) == path  # status= given below
    dev = {n: to_device(x) for n, x in args.items()}
    dkw = {n: to_device(x) for n, x in kw.items()}
    out = cp.full((T, 4 * 64), 7, args["hidden_state"].dtype)
    status = cp.full(1, 99, cp.int32)
    for clear in (False, True):
        call(dev, dkw, out=out, status=status, clear_unused_last_page_rows=clear)
        assert int(status[0]) == code
        if code:
            assert bool((out == 7).all())
            for got, old in zip(dev["paged_kv_cache"], args["paged_kv_cache"]):
                assert_bytes_equal(got, old, "cache after malformed offsets")
    if not code:  # dense weights: every path against the reference itself
        q_ref, _, _ = expected(args, kw, clear=True)
        assert rel_rows(out, q_ref, 64) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
def test_gpu_status_of_an_empty_batch(path, monkeypatch):
    """No tokens: one block validates and writes the code (whatever path the thresholds name)."""
    import cupy as cp

    force_path(monkeypatch, path)
    args, kw = _case_for(path, 70, lengths=(0, 0), cached=(1, 2))
    dev = {n: to_device(x) for n, x in args.items()}
    dkw = {n: to_device(x) for n, x in kw.items()}
    status = cp.full(1, 99, cp.int32)
    assert call(dev, dkw, status=status).shape == (0, 256)
    assert int(status[0]) == 0
    dev["input_row_offsets"] = cp.asarray(np.array([0, 0, 2], np.int32))
    status.fill(99)
    call(dev, dkw, status=status, clear_unused_last_page_rows=True)
    assert int(status[0]) == 3
    for got, old in zip(dev["paged_kv_cache"], args["paged_kv_cache"]):
        assert_bytes_equal(got, old)


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("cache", ["same", "e4m3"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("shift", [1, 16])  # elements: head rows off 16-byte alignment, or on it
def test_gpu_clear_into_cache_views(path, cache, layout, shift, monkeypatch):
    """clear_unused_last_page_rows into caches that are views of wider buffers (each head row
    ``shift`` elements into a row of D + 32), so that the kernels' 16-byte zero stores meet row
    starts off 16-byte alignment (shift 1) and on it (16, fp16: 32 bytes): the tails zero, the
    written rows the reference's, every other byte of the buffers (the columns around the views
    included) unchanged."""
    T = {"mma": 12, "tiled": 40, "wgmma": 40, "gemv": 2, "cublas": 40}[path]
    lengths = (T // 3, 0, T - T // 3)
    args, kw = _case_for(
        path,
        90 + shift,
        lengths=lengths,
        cached=(5, 40, 22),
        layout=layout,
        cache_dtype=E4M3 if cache == "e4m3" else None,
        wfmt="dense" if path == "wgmma" else "fp8",
    )
    force_path(monkeypatch, path)
    assert taken_path(args, {**kw, "clear_unused_last_page_rows": True}) == path
    rounded = path == "cublas"  # cuBLAS multiplies the weights rounded to the input dtype
    q_ref, k_ref, v_ref = expected(
        *(rounded_weights(args, kw) if rounded else (args, kw)), clear=True
    )
    D = args["paged_kv_cache"][0].shape[3]
    rng = np.random.default_rng(shift)
    bufs, views = [], []
    for c in args["paged_kv_cache"]:
        wide = rng.integers(0, 256, c.shape[:3] + ((D + 32) * c.itemsize,), np.uint8)
        wide = wide.view(c.dtype)
        wide[..., shift : shift + D] = c
        buf = to_device(wide)
        bufs.append((wide, buf))
        views.append(buf[..., shift : shift + D])
    dargs = {n: to_device(x) for n, x in args.items()}
    dargs["paged_kv_cache"] = tuple(views)
    q = call(dargs, {n: to_device(x) for n, x in kw.items()}, clear_unused_last_page_rows=True)
    assert rel_rows(q, q_ref, D) <= 1e-2
    written, tail = written_mask(args, kw), tail_mask(args, kw)
    assert tail.any() and written.any()
    for (wide, buf), ref, orig, what in zip(bufs, (k_ref, v_ref), args["paged_kv_cache"], "kv"):
        got = to_numpy(buf)
        around = np.ones(got.shape[-1], bool)
        around[shift : shift + D] = False
        assert_bytes_equal(got[..., around], wide[..., around], f"{what}: bytes around the view")
        got, ref, orig = (rows(x, kw) for x in (got[..., shift : shift + D], ref, orig))
        keep = ~written & ~tail
        assert_bytes_equal(got[keep], orig[keep], f"{what} cache: unaddressed bytes changed")
        assert not got[tail].view(np.uint8).any(), f"{what} cache: a tail row not cleared"
        if ref.dtype.itemsize == 1:
            assert_close(
                np.ascontiguousarray(got[written]),
                np.ascontiguousarray(ref[written]),
                f"{what} cache",
            )
        else:
            assert rel_rows(got[written], ref[written], D) <= 1e-2, f"{what} cache"


@pytest.mark.gpu
@given(
    seed=st.integers(0, 2**32 - 1),
    path=st.sampled_from(PATHS),
    T=st.sampled_from(SWITCH_TOKENS),
    D=st.sampled_from([32, 64, 128]),
    dtype=st.sampled_from([F16, BF16]),
    cache=st.sampled_from(["same", "e4m3", "e5m2"]),
    layout=st.sampled_from(["NHD", "HND"]),
    rope=st.sampled_from(["neox", "interleaved", "partial", "none"]),
    wfmt=st.sampled_from(["dense", "fp8", "int4"]),
    page_size=st.sampled_from([1, 4, 16]),
    status_given=st.booleans(),
    out_given=st.booleans(),
)
def test_gpu_clear_on_every_path(
    seed, path, T, D, dtype, cache, layout, rope, wfmt, page_size, status_given, out_given
):
    """clear_unused_last_page_rows on each path at token counts around the switches: ragged
    batches with empty requests, requests ending anywhere on a page, every weight format, fp8
    caches, partial and no RoPE; against the reference, tails zero, other bytes unchanged."""
    int4_top = min(qkv_mod.WGMMA_INT4_TOP, qkv_mod.WGMMA_DEEP_MAX_TOKENS)
    if path == "wgmma" and (wfmt == "fp8" or wfmt == "int4" and T > int4_top):
        wfmt = "dense"  # (fp8 weights from WGMMA_FP8_MIN_TOKENS, 4-bit up to the deep kernel's)
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.integers(0, T + 1, 3))
    lengths = (int(cuts[0]), 0, int(cuts[1] - cuts[0]), int(cuts[2] - cuts[1]), int(T - cuts[2]))
    R = {"neox": D, "interleaved": D, "partial": D // 4 * 2, "none": None}[rope]
    args, kw = make_case(
        seed,
        lengths=lengths,
        K=256,
        Hq=4,
        Hkv=2,
        D=D,
        R=R,
        P=512,
        page_size=page_size,
        layout=layout,
        dtype=dtype,
        cache_dtype={"same": None, "e4m3": E4M3, "e5m2": E5M2}[cache],
        wfmt=wfmt,
        group_size=32,
        is_neox=rope != "interleaved",
        cached=tuple(int(c) for c in rng.integers(0, 3 * page_size + 2, 5)),
    )
    with pytest.MonkeyPatch.context() as mp:
        check_options(args, kw, mp, path, True, status_given, out_given)


@pytest.mark.gpu
@pytest.mark.parametrize("T", SWITCH_TOKENS)
@pytest.mark.parametrize("wfmt", ["dense", "fp8", "int4"])
def test_gpu_options_at_the_shipped_switches(T, wfmt, monkeypatch):
    """Both options at every token count around a switch, the thresholds as shipped (each call
    takes the path a user's would), requests of mixed lengths with an empty one, fp8 caches and
    HND at some counts (as tests/test_qkv.py's test_gpu_token_counts_around_switches)."""
    cuts = sorted({0, T // 3, T})
    lengths = tuple(b - a for a, b in itertools.pairwise(cuts)) + (0,)
    args, kw = make_case(
        130 + T,
        lengths=lengths,
        wfmt=wfmt,
        group_size=128,
        dtype=BF16 if T % 2 else F16,
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
    check_options(args, kw, monkeypatch, None, True, True, out_given=T % 2 == 0)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "path, wfmt",
    [(p, w) for p in PATHS for w in ("dense", "int4")] + [("tiled", "fp8")],
)
def test_gpu_llama3_8b_with_options(path, wfmt, monkeypatch):
    """Llama-3-8B's projection with both options on: decode (gemv), a small batch (mma) and a
    prefill (cuBLAS), requests ending mid-page."""
    lengths = {
        "gemv": (1, 1),
        "mma": (5, 0, 7),
        "tiled": (60, 0, 69),
        "wgmma": (60, 0, 69),
        "cublas": (60, 0, 69),
    }[path]
    args, kw = make_case(
        80,
        lengths=lengths,
        wfmt=wfmt,
        group_size=128,
        cached=[100 + 37 * i for i in range(len(lengths))],
        **LLAMA,
    )
    check_options(args, kw, monkeypatch, path, True, True)


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("clear", [False, True])
def test_gpu_hostile_offsets_never_write_out_of_bounds(path, clear, monkeypatch):
    """Malformed offsets, lengths and block-table entries without status: guard bytes around the
    caches stay, the rows the reference writes and clears (it models the kernels' request search)
    match, every other byte stays."""
    import cupy as cp

    force_path(monkeypatch, path)
    # request 0 ends mid-page (entry 0 or 2 of 4), so that with clear its last token has a tail
    lengths = {
        "mma": (3, 2, 4, 1),
        "tiled": (11, 4, 7, 2),
        "wgmma": (11, 4, 7, 2),
        "gemv": (1, 0, 1, 0),
        "cublas": (11, 4, 7, 2),
    }[path]
    args, kw = _case_for(path, 90, lengths=lengths, cached=(0, 0, 0, 3), page_size=4, dtype=BF16)
    kc, vc = args["paged_kv_cache"]
    spare = np.setdiff1d(np.arange(kc.shape[0]), args["block_table"])
    args["cache_lengths"] = np.array([0, 2**31 - 3, -7, 1], np.int32)
    args["block_table"][0, :2] = spare[:2] if clear else [-5, 2**31 - 1]
    args["input_row_offsets"][2] = args["input_row_offsets"][3] + 1  # not monotonic
    q_ref, kc_ref, vc_ref = expected(args, kw, clear=clear)
    guard = 256
    pad = np.full(guard, 7, BF16)
    bufs = [cp.asarray(np.concatenate([pad, c.ravel(), pad])) for c in (kc, vc)]
    dev = {n: to_device(x) for n, x in args.items() if n != "paged_kv_cache"}
    dev["paged_kv_cache"] = tuple(b[guard:-guard].reshape(c.shape) for b, c in zip(bufs, (kc, vc)))
    out = call(dev, {n: to_device(x) for n, x in kw.items()}, clear_unused_last_page_rows=clear)
    assert rel_rows(out, q_ref, 64) <= 1e-2
    mask = written_mask(args, kw)
    if clear:
        changed = (kc_ref.view(np.uint8) != kc.view(np.uint8)).any(axis=(2, 3)) & ~mask
        assert changed.any() and not kc_ref[changed].view(np.uint8).any()
        mask |= changed
    for buf, ref, old in zip(bufs, (kc_ref, vc_ref), (kc, vc)):
        host = to_numpy(buf)
        assert (host[:guard].view(np.uint16) == pad.view(np.uint16)).all()
        assert (host[-guard:].view(np.uint16) == pad.view(np.uint16)).all()
        got = host[guard:-guard].reshape(old.shape)
        assert rel_rows(got[mask], ref[mask], 64) <= 1e-2
        assert_bytes_equal(got[~mask], old[~mask])


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["gemv", "mma", "tiled"])
def test_gpu_status_in_a_captured_graph(path, monkeypatch):
    """The check runs on the device: one captured graph of a fused path, replayed with valid then
    malformed offsets written into the same array, reports 0 then 2 and writes nothing the second
    time. (The cuBLAS path is not captured: its temporaries are CuPy's.)"""
    import cupy as cp

    force_path(monkeypatch, path)
    lengths = (1, 1, 1, 1) if path == "gemv" else (2, 1, 3, 2)
    args, kw = _case_for(path, 95, lengths=lengths, cached=(3, 9, 20, 30))
    dev = {n: to_device(x) for n, x in args.items()}
    dkw = {n: to_device(x) for n, x in kw.items()}
    out = cp.zeros((sum(lengths), 256), args["hidden_state"].dtype)
    status = cp.full(1, 99, cp.int32)

    check_status_in_graph(
        lambda: call(dev, dkw, out=out, status=status, clear_unused_last_page_rows=True),
        dev,
        out,
        status,
    )


# ---------------------------------------------------------------------------------------------
# ropekv bench --options


def test_bench_times_the_options_beside_the_plain_call():
    """``ropekv bench --options`` on a QKV case: ``ropekv[+status]`` and ``ropekv[+clear]`` run
    beside the plain call and are checked against it (neither changes the sampled rows)."""
    from ropekv import bench
    from ropekv.bench.workloads import base

    spec = bench.CaseSpec(
        "qkv",
        "qkv tiny 3x2",
        6,
        1,
        base._lazy(
            bench.QkvWL,
            B=3,
            S=2,
            prefix=5,
            K=64,
            Hq=2,
            Hkv=1,
            D=32,
            dtype=np.float16,
            cache_dtype=np.float16,
        ),
    )
    result = bench.run(peers=[], specs=[spec], backend="numpy", options=True, log=lambda *a: None)
    (case,) = result["cases"]
    assert "error" not in case, case
    for label in ("status", "clear"):
        entry = case["peers"][f"ropekv[+{label}]"]
        assert entry["status"] == "ok" and entry["check"] == "ok" and entry["ratio"] > 0, entry
