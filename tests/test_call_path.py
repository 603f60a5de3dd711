"""The one call path every op shares (``ropekv._launch``): validation rules that hold for every op
(aliasing, broadcast targets, scales, empty heads, legacy DLPack capsules, flags, duplicate slots),
plan keys, and on the GPU: torch tensors, plan replay, streams, threads, devices, alignment."""

from __future__ import annotations

import threading

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ropekv
from ropekv import _arrays as ar
from ropekv import _checks as ck
from ropekv import _launch, _timing
from tests import test_contiguous as tc
from tests import test_mla as tm
from tests import test_paged as tp
from tests import test_qknorm as tq
from tests import test_qkv as tk
from tests.test_arrays import FakeProducer
from tests.tolerance import assert_close, to_device, to_numpy

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


# ---- one case per op, as keyword arguments (NumPy) ---------------------------------------------


def contiguous_case(seed, **kw):
    return ropekv.apply_rope_write_kv, tc.make_case(seed, **kw)


def paged_case(seed, **kw):
    kw.setdefault("B", 2)  # one layout whatever the seed
    return ropekv.rope_quantize_fp8_append_paged_kv_cache, tp.make_case(seed, **kw)


def mla_case(seed, **kw):
    args, more = tm.make_case(seed, **kw)
    return ropekv.mla_rope_rmsnorm_append_paged_kv_cache, {**args, **more}


def qknorm_case(seed, **kw):
    args, more = tq.make_case(seed, **kw)
    return ropekv.qk_rmsnorm_rope_append_paged_kv_cache, {**args, **more}


def qkv_case(seed, **kw):
    kw.setdefault("cached", (2, 5, 0, 1)[: len(kw.get("lengths", (3, 1, 0, 2)))])  # one layout
    args, more = tk.make_case(seed, **kw)
    return ropekv.fused_qkv_matmul_append_paged_kv_cache, {**args, **more}


CASES = {
    "contiguous": contiguous_case,
    "paged": paged_case,
    "mla": mla_case,
    "qknorm": qknorm_case,
    "qkv": qkv_case,
}
CACHE = {
    "contiguous": "kv_cache",
    "paged": "paged_kv_cache",
    "mla": "kv_cache",
    "qknorm": "paged_kv_cache",
    "qkv": "paged_kv_cache",
}
OPS = tuple(CASES)


def copy_kw(kw):
    def cp(x):
        if isinstance(x, np.ndarray):
            return x.copy()
        if isinstance(x, tuple):
            return tuple(cp(y) for y in x)
        return x

    return {k: cp(v) for k, v in kw.items()}


def map_arrays(kw, fn):
    def go(x):
        if isinstance(x, np.ndarray):
            return fn(x)
        if isinstance(x, tuple):
            return tuple(go(y) for y in x)
        return x

    return {k: go(v) for k, v in kw.items()}


def flat(x):
    """The arrays of an output or argument (None, an array or a tuple of them)."""
    if x is None:
        return []
    if isinstance(x, tuple | list):
        return [y for y in x if y is not None]
    return [x]


def assert_op_close(actual, expected, op, what):
    """``assert_close``, except for the fused QKV op, whose cuBLAS path rounds the projection to
    the input dtype (and quantized weights to it) before the epilogue: rows of the head dim are
    compared by relative L2 error there (tests/test_qkv.py's measure)."""
    if op != "qkv":
        assert_close(actual, expected, what)
        return
    actual, expected = to_numpy(actual), np.asarray(expected)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    if actual.size == 0:  # no rows to compare (an empty hidden state: no tokens)
        return
    D = 16 if actual.shape[-1] % 16 == 0 else actual.shape[-1]
    rows = actual.size // D
    same = np.all(
        np.ascontiguousarray(actual).view(np.uint8).reshape(rows, -1)
        == np.ascontiguousarray(expected).view(np.uint8).reshape(rows, -1),
        axis=1,
    )
    a = actual.astype(np.float64).reshape(-1, D)[~same]  # rows both left alone may hold NaN
    e = expected.astype(np.float64).reshape(-1, D)[~same]
    den = np.maximum(np.linalg.norm(e, axis=1), 1e-6)
    err = float((np.linalg.norm(a - e, axis=1) / den).max(initial=0.0))
    tol = 0.1 if np.asarray(expected).dtype.itemsize == 1 else 1e-2
    assert err <= tol, f"{what}: relative row error {err:.3g} > {tol}"


def assert_same(actual_kw, actual_out, expected_kw, expected_out, op):
    """The written arguments and the outputs of a device call against the NumPy backend's."""
    names = ["q", CACHE[op]] if op == "contiguous" else [CACHE[op]]
    for name in names:
        for a, e in zip(flat(actual_kw[name]), flat(expected_kw[name])):
            assert_op_close(a, e, op, f"{op}: {name}")
    for a, e in zip(flat(actual_out), flat(expected_out)):
        assert_op_close(a, to_numpy(e), op, f"{op}: output")


# ---- CPU: the validation every op shares (the reproductions of the reliability review) ---------


def writable_broadcast(shape, dtype):
    """A writable view of one row broadcast over every slot (np.broadcast_to is read-only)."""
    base = np.zeros(shape[-1], dtype)
    return np.lib.stride_tricks.as_strided(
        base, shape, (0,) * (len(shape) - 1) + (base.itemsize,), writeable=True
    )


@pytest.mark.parametrize("op", ["paged", "qknorm", "qkv"])
def test_one_array_as_both_caches_is_refused(op):
    fn, kw = CASES[op](1)
    c = kw["paged_kv_cache"][0]
    kw["paged_kv_cache"] = (c, c)
    with pytest.raises(
        ValueError, match="k_cache is written in place but shares memory with v_cache"
    ):
        fn(**kw)


def test_contiguous_q_aliasing_k_is_refused():
    fn, kw = contiguous_case(1, Hq=2, Hkv=2)
    kw["k"] = kw["q"]
    with pytest.raises(ValueError, match="q is written in place but shares memory with k"):
        fn(**kw)


def test_mla_kpe_inside_ckv_is_refused():
    fn, kw = mla_case(1, split=True, L=32, R=16)
    ckv = kw["kv_cache"][0]
    kw["kv_cache"] = (ckv, ckv[..., 8:24])  # (num_pages, page_size, R) view inside ckv
    with pytest.raises(
        ValueError, match="ckv_cache is written in place but shares memory with kpe_cache"
    ):
        fn(**kw)


def test_output_overlapping_the_cache_is_refused():
    fn, kw = qknorm_case(2)
    T, Hq, D = kw["q"].shape
    kw["q_out"] = kw["paged_kv_cache"][0].reshape(-1)[: T * Hq * D].reshape(T, Hq, D)
    with pytest.raises(ValueError, match="shares memory with q_out|q_out is written in place"):
        fn(**kw)


def test_paged_output_overlapping_an_input_is_refused():
    fn, kw = paged_case(3, T=6, Hq=2, Hkv=2, R=16, cache_dtype=E4M3)
    q = kw["q_rope"]
    kw["q_rope_out"] = q.view(np.uint8)[:, :, :16].view(E4M3)  # fp8 bytes over q's rows
    with pytest.raises(
        ValueError, match="q_rope_out is written in place but shares memory with q_rope \\(read"
    ):
        fn(**kw)


def test_in_place_output_is_still_allowed():
    fn, kw = qknorm_case(4)
    expected = copy_kw(kw)
    out = fn(**expected)
    q = kw["q"]
    assert fn(**{**kw, "q_out": q}) is q
    np.testing.assert_array_equal(q, out)


@pytest.mark.parametrize("op", OPS)
def test_broadcast_cache_is_refused(op):
    fn, kw = CASES[op](5)
    caches = kw[CACHE[op]]
    if isinstance(caches, tuple):
        kw[CACHE[op]] = (writable_broadcast(caches[0].shape, caches[0].dtype), caches[1])
    else:
        kw[CACHE[op]] = writable_broadcast(caches.shape, caches.dtype)
    with pytest.raises(ValueError, match="is written but has stride 0"):
        fn(**kw)


def test_self_overlapping_written_strides_are_refused():
    fn, kw = qknorm_case(6)
    k = kw["paged_kv_cache"][0]
    rows = np.lib.stride_tricks.as_strided(
        k, k.shape, (k.strides[1], *k.strides[1:]), writeable=True
    )  # pages overlap one another
    kw["paged_kv_cache"] = (rows, kw["paged_kv_cache"][1])
    with pytest.raises(ValueError, match="put several elements at one address"):
        fn(**kw)


@pytest.mark.parametrize("value", [float("nan"), 0.0, -1.0, float("inf")])
@pytest.mark.parametrize("which", ["quant_scale_q", "quant_scale_kv"])
def test_paged_scales_must_be_positive_and_finite(value, which):
    fn, kw = paged_case(7)
    kw[which] = value
    with pytest.raises(ValueError, match=f"{which} must be a finite positive number"):
        fn(**kw)
    heads = kw["q_rope"].shape[1] if which == "quant_scale_q" else kw["k_rope"].shape[1]
    scales = np.ones(heads, np.float32)
    scales[-1] = value
    kw[which] = scales
    with pytest.raises(ValueError, match=f"{which} must hold positive finite scales"):
        fn(**kw)


@pytest.mark.parametrize("value", [0.0, -2.0, float("nan")])
def test_contiguous_host_kv_scale_values_are_checked(value):
    fn, kw = contiguous_case(8, cache_dtype=E4M3)
    kw["kv_scale"] = np.array([1.0, value], np.float32)
    with pytest.raises(ValueError, match="kv_scale must hold positive finite scales"):
        fn(**kw)


@pytest.mark.parametrize(
    "op, kv_scale",
    [("qknorm", -1.0), ("qknorm", (1.0, 0.0)), ("mla", float("nan")), ("qkv", (1.0, -3.0))],
)
def test_ragged_ops_kv_scales_are_checked(op, kv_scale):
    fn, kw = CASES[op](9, cache_dtype=E4M3)
    kw["kv_scale"] = kv_scale
    with pytest.raises(ValueError, match="kv_scale"):
        fn(**kw)


def scale_case(
    op, cache, q_fp8=False, q_static=False, q_dynamic=False, kv_static=False, kv_dynamic=False
):
    """A call of ``op`` (the ops with fp8 queries and per-token-head KV scales) on caches of dtype
    ``cache``, with the q and KV scale arguments asked for, each in the op's spelling: a float8
    q (``q_fp8``; the contiguous op gets a 16-bit ``q_out`` otherwise, so that a q output
    exists), a static q scale, ``q_scale_out``, a static KV scale, ``kv_cache_scales``."""
    fn, kw = CASES[op](40)
    static_q, static_kv = "q_scale", "kv_scale"
    if op == "contiguous":
        kw.pop("kv_scale", None)
        kw["kv_cache"] = np.zeros(kw["kv_cache"].shape, cache)
        kw["q_out"] = np.zeros(kw["q"].shape, E4M3 if q_fp8 else kw["q"].dtype)
        q, scales = kw["q"], np.zeros(kw["kv_cache"].shape[:-1], np.float32)
    else:
        kw["paged_kv_cache"] = tuple(np.zeros(c.shape, cache) for c in kw["paged_kv_cache"])
        scales = tuple(np.zeros(c.shape[:-1], np.float32) for c in kw["paged_kv_cache"])
        if op == "qknorm":
            q = kw["q"]
            kw["q_out_dtype"] = E4M3 if q_fp8 else None
        else:  # paged: q is stored in the cache dtype; a 16-bit cache needs the unquantized op
            q, static_q, static_kv = kw["q_rope"], "quant_scale_q", "quant_scale_kv"
            kw["quant_scale_q"] = kw["quant_scale_kv"] = None
            if cache.itemsize == 2:
                fn = ropekv.rope_append_paged_kv_cache
    if q_static:
        kw[static_q] = 0.5
    if q_dynamic:
        kw["q_scale_out"] = np.zeros(q.shape[:-1], np.float32)
    if kv_static:
        kw[static_kv] = 1.0
    if kv_dynamic:
        kw["kv_cache_scales"] = scales
    return fn, kw


F16, INT8 = np.dtype(np.float16), np.dtype(np.int8)
# rule: (the bad call, the message every op words alike, the call put right)
SCALE_RULES = {
    "int8 cache without kv_cache_scales": (
        {"cache": INT8},
        r"an int8 \w+ needs kv_cache_scales",
        {"cache": INT8, "kv_dynamic": True},
    ),
    "kv_cache_scales with a 16-bit cache": (
        {"cache": F16, "kv_dynamic": True},
        r"kv_cache_scales needs a float8 or int8 (\w+), but \1 is float16",
        {"cache": E4M3, "kv_dynamic": True},
    ),
    "q_scale_out with a 16-bit q": (
        {"cache": F16, "q_dynamic": True},
        r"q_scale_out is only used with a float8 (\w+), but \1 is float16",
        {"cache": E4M3, "kv_static": True, "q_fp8": True, "q_dynamic": True},
    ),
    "static and dynamic q scales": (
        {"cache": E4M3, "kv_static": True, "q_fp8": True, "q_static": True, "q_dynamic": True},
        r"\w+ \(a static scale\) and q_scale_out \(dynamic scales\) exclude each other",
        {"cache": E4M3, "kv_static": True, "q_fp8": True, "q_dynamic": True},
    ),
    "static and per-token-head KV scales": (
        {"cache": E4M3, "kv_static": True, "kv_dynamic": True},
        (
            r"\w+ \(static scales\) and kv_cache_scales \(per-token-head scales\) exclude each "
            r"other"
        ),
        {"cache": E4M3, "kv_dynamic": True},
    ),
}


@pytest.mark.parametrize("rule", list(SCALE_RULES))
@pytest.mark.parametrize("op", ["contiguous", "qknorm", "paged"])
def test_scale_rules_raise_one_error_in_every_op(op, rule):
    """Issue 14: one bad combination of a dtype and the scale arguments gets the same error type
    and wording in every op (ValueError: a rule between arguments, not a dtype that nothing makes
    valid), and the call put right passes."""
    bad_call, match, fixed = SCALE_RULES[rule]
    fn, kw = scale_case(op, **bad_call)
    with pytest.raises(ValueError, match=match):
        fn(**kw)
    fn, kw = scale_case(op, **fixed)
    fn(**kw)


@pytest.mark.parametrize("T", [5, 600])  # below and above the paged op's decode split
def test_paged_empty_heads_are_a_named_error(T):
    fn, kw = paged_case(10, T=T, Hq=2, Hkv=2, R=16, cache_dtype=E4M3)
    kw["q_rope"], kw["k_rope"], kw["v"] = (x[:, :0] for x in (kw["q_rope"], kw["k_rope"], kw["v"]))
    kw["paged_kv_cache"] = tuple(c[:, :, :0] for c in kw["paged_kv_cache"])
    with pytest.raises(ValueError, match="q_rope must have shape .* with Hq > 0"):
        fn(**kw)
    kw2 = paged_case(10, T=T, Hq=2, Hkv=2, R=16, cache_dtype=E4M3)[1]
    kw2["k_rope"], kw2["v"] = kw2["k_rope"][:, :0], kw2["v"][:, :0]
    kw2["paged_kv_cache"] = tuple(c[:, :, :0] for c in kw2["paged_kv_cache"])
    with pytest.raises(ValueError, match="k_rope must have shape .* with Hkv > 0"):
        fn(**kw2)


def test_qknorm_and_contiguous_empty_kv_heads():
    fn, kw = qknorm_case(11)
    kw["k"], kw["v"] = kw["k"][:, :0], kw["v"][:, :0]
    kw["paged_kv_cache"] = tuple(c[:, :, :0] for c in kw["paged_kv_cache"])
    with pytest.raises(ValueError, match="positive multiple of k's"):
        fn(**kw)
    fn, kw = contiguous_case(11)
    kw["k"], kw["v"] = kw["k"][:, :, :0], kw["v"][:, :, :0]
    kw["kv_cache"] = kw["kv_cache"][:, :, :0]
    with pytest.raises(ValueError, match="positive multiple of k's"):
        fn(**kw)


@pytest.mark.parametrize("op", OPS)
def test_written_array_from_a_legacy_capsule_is_refused(op, monkeypatch):
    fn, kw = CASES[op](12)
    caches = kw[CACHE[op]]
    first = caches[0] if isinstance(caches, tuple) else caches
    legacy = FakeProducer(first, versioned=False)
    kw[CACHE[op]] = (legacy, caches[1]) if isinstance(caches, tuple) else legacy
    with pytest.raises(BufferError, match="legacy \\(unversioned\\) DLPack capsule"):
        fn(**copy_kw(kw) | {CACHE[op]: kw[CACHE[op]]})
    # a versioned capsule of the same memory is written in place
    kw[CACHE[op]] = (
        (FakeProducer(first), caches[1]) if isinstance(caches, tuple) else FakeProducer(first)
    )
    fn(**kw)
    # and the explicit opt-in
    monkeypatch.setenv("ROPEKV_ALLOW_LEGACY_DLPACK_WRITES", "1")
    kw[CACHE[op]] = (legacy, caches[1]) if isinstance(caches, tuple) else legacy
    fn(**kw)


def test_legacy_capsule_may_be_read():
    fn, kw = contiguous_case(13)
    expected = copy_kw(kw)
    fn(**expected)
    kw["v"] = FakeProducer(kw["v"], versioned=False)
    fn(**kw)
    np.testing.assert_array_equal(kw["kv_cache"], expected["kv_cache"])


@pytest.mark.parametrize(
    "op, flag",
    [
        ("contiguous", "is_neox"),
        ("contiguous", "write_k_in_place"),
        ("paged", "is_neox"),
        ("mla", "is_neox"),
        ("qknorm", "is_neox"),
        ("qkv", "is_neox"),
        ("qknorm", "enable_pdl"),
    ],
)
@pytest.mark.parametrize("value", ["no", 1, None])
def test_flags_must_be_bools(op, flag, value):
    fn, kw = CASES[op](14)
    kw[flag] = value
    with pytest.raises(TypeError, match=f"{flag} must be a bool"):
        fn(**kw)
    kw[flag] = np.bool_(False)  # NumPy's bool is a bool
    fn(**kw)


@pytest.mark.parametrize("kind", ["numpy", pytest.param("cupy", marks=pytest.mark.gpu)])
def test_bool_is_not_an_int_even_after_a_valid_call(kind):
    fn, kw = paged_case(15)
    if kind == "cupy":
        kw = map_arrays(kw, to_device)
    fn(**kw)  # a plan for page_size=4 (on the device)
    with pytest.raises(ValueError, match="page_size must be a positive integer, got True"):
        fn(**{**kw, "page_size": True})


def test_paged_check_indices_blames_a_negative_kv_indptr(monkeypatch):
    fn, kw = paged_case(16, T=6, B=2)
    kw["kv_indptr"] = kw["kv_indptr"].copy()
    kw["kv_indptr"][0] = -3
    monkeypatch.setenv("ROPEKV_CHECK_INDICES", "1")
    with pytest.raises(IndexError, match=r"starts its page-table entries at kv_indptr\[0\] = -3"):
        fn(**kw)


@pytest.mark.parametrize("op", ["paged", "qknorm", "mla", "qkv"])
def test_check_indices_refuses_two_tokens_on_one_row(op, monkeypatch):
    if op == "paged":  # tokens 0 and 1: one request, one position
        fn, kw = paged_case(17, T=8, B=1)
        kw["positions"][1] = kw["positions"][0]
    else:  # request 0's positions 2 and 3, one page each, map to one page
        page_size = 1
        extra = (
            {"new": (3, 1), "cached": (2, 0)}
            if op != "qkv"
            else {"lengths": (3, 1), "cached": (2, 0)}
        )
        fn, kw = CASES[op](17, page_size=page_size, **extra)
        kw["block_table"][0, 3] = kw["block_table"][0, 2]  # positions 2 and 3: one page
    monkeypatch.setenv("ROPEKV_CHECK_INDICES", "1")
    with pytest.raises(IndexError, match="tokens 0 and 1 both write cache row"):
        fn(**kw)


@pytest.mark.parametrize("stride", [0, -64, 32])
def test_qkv_row_strides_a_gemm_can_take(stride):
    fn, kw = qkv_case(18, K=64)
    x = kw["hidden_state"]
    T, K = x.shape
    base = np.zeros(T * 64 + 64, x.dtype)
    start = 0 if stride >= 0 else (T - 1) * 64
    kw["hidden_state"] = np.lib.stride_tricks.as_strided(
        base[start:], (T, K), (stride * x.itemsize, x.itemsize)
    )
    with pytest.raises(
        ValueError, match="hidden_state's row stride must be at least its 64 columns"
    ):
        fn(**kw)


# ---- CPU: plan keys ------------------------------------------------------------------------------


def test_scalar_keys_are_values_and_bools_stay_bools():
    key = _launch.scalar_key
    assert key(np.float32(0.5)) == key(0.5) and hash(key(np.float32(0.5))) == hash(0.5)
    assert key(np.float32(0.5)) != key(np.float32(0.25))
    assert key(True) != 1 and key(True) == key(np.bool_(True)) and key(False) != 0
    assert repr(key(True)) == "True" and type(key(True)).__name__ == "bool"
    assert key([1.0, True]) == (1.0, key(True))


def test_signature_is_layout_not_identity():
    a, b = np.zeros((4, 8), np.float16), np.zeros((4, 8), np.float16)
    names = ("x", "y")
    ka, pa, _, _ = ar.signature((a, None), names, None)
    kb, pb, _, _ = ar.signature((b, None), names, None)
    assert ka == kb and pa != pb and pa[1] == 0
    kc, _, _, _ = ar.signature((a[:, ::2], None), names, None)
    assert kc != ka  # strides differ
    kd, _, _, _ = ar.signature((a.view(np.int16), None), names, None)
    assert kd != ka  # dtype differs
    ke, _, _, _ = ar.signature(
        (np.zeros(40, np.uint8)[2:34].view(np.float16).reshape(4, 4), None), names, None
    )
    kf, _, _, _ = ar.signature(
        (np.zeros(40, np.uint8)[:32].view(np.float16).reshape(4, 4), None), names, None
    )
    assert ke != kf or (ke[0][4] == kf[0][4])  # the pointer's alignment is part of the key


def test_param_structs_put_pointers_first():
    with pytest.raises(ValueError, match="pointer fields must come first"):
        _launch.ParamStruct("Bad", [("a", np.int32), ("p", np.uint64)])


def _param_structs():
    import importlib

    for stem in ("contiguous", "paged", "mla", "qknorm", "qkv"):
        module = importlib.import_module(f"ropekv.{stem}")
        yield from (v for v in vars(module).values() if isinstance(v, _launch.ParamStruct))


def test_param_struct_tail_is_the_record_past_its_pointers(monkeypatch):
    """pack_tail (a first call's record, from a dict) gives the bytes pack_values gives past the
    pointer fields, for every op's struct; a Launch's record (built on its first read) is its
    pointer fields zeroed, then that tail."""
    monkeypatch.setattr(_launch, "function_pointer", lambda *a, **k: 0x1000)
    monkeypatch.setattr(_launch, "_launch_kernel", lambda *a: 0)  # no driver needed
    structs = list(_param_structs())
    assert structs
    for params in structs:
        n = params.n_pointers
        values = {}
        for k, (name, t) in enumerate(params.fields[n:]):
            kind = np.dtype(t).kind
            values[name] = 0.5 + k if kind == "f" else -(k + 1) if kind == "i" and k % 2 else k + 1
        record = params.pack_values([*(0,) * n, *(values[f] for f in params.names[n:])])
        assert len(record) == params.dtype.itemsize
        assert params.pack_tail(values) == record[8 * n :]
        values.update(dict.fromkeys(params.names[:n], 7))  # pointers without a slot: as given
        launch = _launch.Launch("stem", "kernel<>", 0, (1,), (32,), params, values, {})
        assert launch.slots == [(-1, 7)] * n
        assert launch.tail == record[8 * n :]
        assert bytes(launch.rec) == bytes(8 * n) + record[8 * n :]


def test_overlap_check_gives_the_plans_pairs():
    """check_no_overlap returns the pairs a plan's replay re-checks: each written array against
    every other argument given and not empty, each written pair once, in that order, with their
    byte spans relative to their pointers."""
    buf = np.zeros(4096, np.uint8)
    arrays = [
        buf[0:64],
        None,
        buf[128:256].view(np.float16),
        buf[256:256],
        buf[512:1024],
        buf[1024:1032].view(np.int32),
        None,
        buf[2048:4096].view(np.float32),
    ]
    views = [None if a is None else ar.as_view(a, f"a{i}") for i, a in enumerate(arrays)]
    spans = [None if v is None or v.size == 0 else v.span for v in views]
    given = [j for j, span in enumerate(spans) if span]  # the arrays given, not empty
    for written in [(0,), (4, 7), (7, 0, 4), (3, 2), (2, 3, 5)]:
        pairs = ck.check_no_overlap(views, written)
        assert pairs == [
            (i, j, *spans[i], *spans[j])
            for i in written
            if spans[i]
            for j in given
            if j != i and not (j < i and j in written)
        ]
        plan = _launch.Plan(ar.HOST, written=written)
        plan.finish(views, pairs)
        assert plan.pairs is pairs
        assert plan.views_layout[2] == (views[2].shape, views[2].strides, 2)
    assert ck.check_no_overlap(views, (3,)) == []  # an empty written array is never compared


def test_shares_bytes_is_exact_for_interleaved_views():
    kv = np.zeros((6, 2, 4, 8), np.float16)  # one buffer holding K and V page by page
    k, v = ck.views(None, k=kv[:, 0], v=kv[:, 1]).values()
    lay = [(x.ptr, x.shape, x.strides, 2) for x in (k, v)]
    assert not ck.shares_bytes(*lay)  # spans interleave, bytes do not
    assert ck.shares_bytes(lay[0], lay[0])
    shifted = (lay[1][0] - 2, *lay[1][1:])  # V moved back one element: its first overlaps K
    assert ck.shares_bytes(lay[0], shifted)


def _layouts(min_stride=-6):
    """Small layouts (shape, strides in elements), strides of any sign, zero included."""
    return st.integers(1, 4).flatmap(
        lambda nd: st.tuples(
            st.tuples(*[st.integers(0, 4)] * nd), st.tuples(*[st.integers(min_stride, 40)] * nd)
        )
    )


def _view(shape, strides):
    return ar.ArrayView("x", 1 << 20, shape, strides, np.dtype(np.float16), 0)


@settings(max_examples=300)
@given(layout=_layouts())
def test_written_strides_rule_is_the_sorted_test(layout):
    """check_write_strides' one-pass path for innermost-first layouts accepts exactly what the
    general rule (dims by increasing stride, each past the reach of the smaller ones) accepts."""
    shape, strides = layout
    reach, ok = 0, True
    for stride, n in sorted((s, n) for n, s in zip(shape, strides) if n > 1):
        ok = ok and stride > reach
        reach += (n - 1) * stride
    ok = ok or 0 in shape
    if ok:
        ck.check_write_strides(_view(shape, strides))
    else:
        with pytest.raises(ValueError, match="x is written but"):
            ck.check_write_strides(_view(shape, strides))


@settings(max_examples=300)
@given(layout=_layouts(min_stride=0))
def test_c_contiguity_is_numpys(layout):
    shape, strides = layout
    base = np.zeros(1024, np.float16)
    a = np.lib.stride_tricks.as_strided(base, shape, tuple(s * 2 for s in strides))
    assert _view(shape, strides).is_c_contiguous() == a.flags.c_contiguous


@settings(max_examples=300)
@given(layout=_layouts(), expected=st.lists(st.one_of(st.none(), st.integers(0, 4)), max_size=4))
def test_check_shape_matches_each_given_dim(layout, expected):
    shape, strides = layout
    expected = tuple(expected)
    ok = len(shape) == len(expected) and all(e is None or e == n for e, n in zip(expected, shape))
    if ok:
        ck.check_shape(_view(shape, strides), expected)
    else:
        with pytest.raises(ValueError, match=r"x must have shape = "):
            ck.check_shape(_view(shape, strides), expected)


def test_interleaved_k_and_v_caches_of_one_buffer_are_accepted():
    fn, kw = qknorm_case(19)
    k, v = kw["paged_kv_cache"]
    both = np.stack([k, v], axis=1)  # (num_pages, 2, page_size, Hkv, D)
    expected = copy_kw(kw)
    fn(**expected)
    fn(**{**kw, "paged_kv_cache": (both[:, 0], both[:, 1])})
    np.testing.assert_array_equal(both[:, 0], expected["paged_kv_cache"][0])
    np.testing.assert_array_equal(both[:, 1], expected["paged_kv_cache"][1])


# ---- GPU --------------------------------------------------------------------------------------------


def torch_or_skip():
    return pytest.importorskip("torch")


def to_torch(x):
    """A torch CUDA copy of a NumPy array (bf16 / fp8 through their bits)."""
    torch = torch_or_skip()
    x = np.ascontiguousarray(x)
    names = {
        np.dtype(ml_dtypes.bfloat16): torch.bfloat16,
        E4M3: torch.float8_e4m3fn,
        np.dtype(ml_dtypes.float8_e5m2): torch.float8_e5m2,
    }
    if x.dtype in names:
        bits = np.uint8 if x.itemsize == 1 else np.int16
        return torch.from_numpy(x.view(bits)).cuda().view(names[x.dtype])
    return torch.from_numpy(x).cuda()


def pointers(kw, op):
    return [ropekv._launch.pointer_of(c) for c in flat(kw[CACHE[op]])]


def check_device_call(op, seed, convert, **case):
    fn, kw = CASES[op](seed, **case)
    expected = copy_kw(kw)
    out_expected = fn(**expected)
    dev = map_arrays(kw, convert)
    before = pointers(dev, op)
    out = fn(**dev)
    assert pointers(dev, op) == before  # written in place
    assert_same(dev, out, expected, out_expected, op)
    return fn, dev


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_torch_tensors_every_op(op):
    torch = torch_or_skip()
    fn, dev = check_device_call(op, 20, to_torch)
    out = fn(**dev)
    for x in flat(out):
        assert isinstance(x, torch.Tensor) and x.is_cuda


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("kind", ["cupy", "torch"])
def test_replay_with_new_arrays_of_one_layout(op, kind):
    convert = to_device if kind == "cupy" else to_torch
    module = {
        "contiguous": ropekv.contiguous,
        "paged": ropekv.paged,
        "mla": ropekv.mla,
        "qknorm": ropekv.qknorm,
        "qkv": ropekv.qkv,
    }[op]
    ops = [v for v in vars(module).values() if isinstance(v, _launch.Op)]
    check_device_call(op, 21, convert)
    count = sum(len(o.plans) for o in ops)
    for _ in range(2):  # new arrays (new pointers), the same layout: a replay, not a new plan
        check_device_call(op, 21, convert)
    assert sum(len(o.plans) for o in ops) == count


@pytest.mark.gpu
def test_replay_with_changed_strides_and_a_reused_address():
    import cupy as cp

    # packed q/k/v (strided) after contiguous ones of the same shapes: another plan, still right
    check_device_call("qknorm", 24, to_device)
    check_device_call("qknorm", 24, to_device, packed=True)
    # a freed cache whose address comes back as a cache of another layout
    fn, kw = qknorm_case(25)
    dev = map_arrays(kw, to_device)
    fn(**dev)
    address = dev["paged_kv_cache"][0].data.ptr
    del dev
    cp.get_default_memory_pool().free_all_blocks()
    check_device_call("qknorm", 25, to_device, layout="HND")
    check_device_call("qknorm", 25, to_device)
    assert address  # the check above ran whichever address the pool handed out


@pytest.mark.gpu
def test_scale_objects_are_keyed_by_value():
    """A freed np.float32 scale whose id is reused by another value must not reuse a plan."""
    for value in (0.5, 2.0, 0.5, 3.0):
        fn, kw = paged_case(26, cache_dtype=E4M3)
        kw["quant_scale_q"] = np.float32(value)
        kw["quant_scale_kv"] = np.float32(4.0 / value)
        expected = copy_kw(kw)
        out_expected = fn(**expected)
        dev = map_arrays(kw, to_device)
        out = fn(**dev)
        assert_same(dev, out, expected, out_expected, "paged")


@pytest.mark.gpu
def test_swapped_torch_storage_is_written():
    """``t.data = ...`` keeps the tensor object and swaps its memory: the next call writes the new
    memory (plans are keyed by layout, pointers read per call)."""
    torch = torch_or_skip()
    fn, kw = paged_case(27, cache_dtype=E4M3)
    dev = map_arrays(kw, to_torch)
    fn(**dev)
    k_cache = dev["paged_kv_cache"][0]
    fresh = torch.zeros_like(k_cache.view(torch.uint8))
    k_cache.data = fresh.view(k_cache.dtype)
    expected = copy_kw(kw)
    expected["paged_kv_cache"] = (
        np.zeros_like(kw["paged_kv_cache"][0]),
        expected["paged_kv_cache"][1],
    )
    out_expected = fn(**expected)
    out = fn(**dev)
    torch.cuda.synchronize()
    assert k_cache.data_ptr() == fresh.data_ptr()
    assert_same(dev, out, expected, out_expected, "paged")


# per op, an input the stream tests write on the launch stream only after a long spin
LATE_INPUT = {"contiguous": "v", "paged": "v", "mla": "kv", "qknorm": "v", "qkv": "hidden_state"}


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_torch_current_stream_is_the_default(op):
    """Inside ``torch.cuda.stream(s)`` every kernel (and the QKV op's cuBLAS GEMM) runs on s,
    behind s's earlier work: an input written on s after a long sleep is seen by the op. The plan
    is made first, so the call under test is a replay (a first call compiles and loads kernels,
    which waits for the device and would hide a launch on another stream)."""
    torch = torch_or_skip()
    fn, kw = CASES[op](28)
    expected = copy_kw(kw)
    out_expected = fn(**expected)
    fn(**map_arrays(copy_kw(kw), to_torch))
    dev = map_arrays(kw, to_torch)
    name = LATE_INPUT[op]
    real = dev[name].clone()
    dev[name].zero_()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)  # about 25 ms of GPU time on s
        dev[name].copy_(real)
        out = fn(**dev)
    s.synchronize()
    assert_same(dev, out, expected, out_expected, op)


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_explicit_stream_orders_every_step(op):
    """``stream=`` with CuPy arrays while CuPy's current stream is another: every step of a
    replayed plan (the QKV op's cuBLAS GEMM included) runs behind the stream's earlier work."""
    import cupy as cp

    fn, kw = CASES[op](30)
    expected = copy_kw(kw)
    out_expected = fn(**expected)
    fn(**map_arrays(copy_kw(kw), to_device))  # the plan exists: the call below is a replay
    dev = map_arrays(kw, to_device)
    name = LATE_INPUT[op]
    target, real = dev[name], to_device(kw[name])
    cp.cuda.runtime.memset(target.data.ptr, 0, target.nbytes)
    cp.cuda.Device().synchronize()
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        _timing.spin(25_000)  # 25 ms on s
    cp.cuda.runtime.memcpyAsync(target.data.ptr, real.data.ptr, target.nbytes, 3, s.ptr)
    out = fn(**dev, stream=s)
    s.synchronize()
    assert_same(dev, out, expected, out_expected, op)


@pytest.mark.gpu
def test_explicit_stream_overrides_the_default():
    import cupy as cp

    fn, kw = qknorm_case(29)
    expected = copy_kw(kw)
    out_expected = fn(**expected)
    dev = map_arrays(kw, to_device)
    cp.cuda.Device().synchronize()  # the copies ran on the null stream: order them first
    s = cp.cuda.Stream(non_blocking=True)
    for stream in (s, s.ptr):
        out = fn(**dev, stream=stream)
        s.synchronize()
        assert_same(dev, out, expected, out_expected, "qknorm")


@pytest.mark.gpu
def test_two_threads_replaying_one_plan():
    """Two threads making the same call at once (same layout, one plan) each get their results."""
    import cupy as cp

    fn, kw = qknorm_case(30)
    fn(**map_arrays(kw, to_device))  # the plan exists
    errors = []

    def work(seed):
        try:
            with cp.cuda.Stream(non_blocking=True):
                for i in range(20):
                    check_device_call("qknorm", seed * 100 + i, to_device)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


@pytest.mark.gpu
def test_replay_rechecks_overlap_from_pointers():
    import cupy as cp

    fn, kw = qknorm_case(31)
    dev = map_arrays(kw, to_device)
    fn(**dev)  # the plan exists
    k = dev["paged_kv_cache"][0]
    with pytest.raises(
        ValueError, match="k_cache is written in place but shares memory with v_cache"
    ):
        fn(**{**dev, "paged_kv_cache": (k, k)})
    T, Hq, D = dev["q"].shape
    fn(**dev, q_out=cp.empty((T, Hq, D), dev["q"].dtype))  # the plan with a given output
    buf = cp.empty((T + 1) * Hq * D, dev["q"].dtype)  # q and q_out one row apart in one buffer
    q = buf[Hq * D :].reshape(T, Hq, D)
    q[...] = dev["q"]
    with pytest.raises(ValueError, match="q_out must be q itself \\(in place\\) or not overlap it"):
        fn(**{**dev, "q": q}, q_out=buf[: T * Hq * D].reshape(T, Hq, D))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "op, name",
    [
        ("contiguous", "kv_end_lens"),
        ("paged", "pos_ids"),
        ("paged", "kv_indices"),
        ("mla", "cache_lengths"),
        ("qknorm", "input_row_offsets"),
        ("qkv", "block_table"),
    ],
)
def test_misaligned_index_array_is_refused(op, name):
    import cupy as cp

    fn, kw = CASES[op](32)
    dev = map_arrays(kw, to_device)
    x = dev[name]
    buf = cp.zeros(x.nbytes + 16, cp.uint8)
    bad = buf[2 : 2 + x.nbytes].view(x.dtype).reshape(x.shape)
    bad[...] = x
    with pytest.raises(
        BufferError, match=f"{name} starts at address .* not a multiple of its item size"
    ):
        fn(**{**dev, name: bad})
    check_device_call(op, 32, to_device)  # the context is alive


@pytest.mark.gpu
@pytest.mark.parametrize(
    "op, name", [("qkv", "hidden_state"), ("qknorm", "q"), ("contiguous", "v"), ("mla", "kv")]
)
def test_misaligned_data_array_is_refused(op, name):
    import cupy as cp

    fn, kw = CASES[op](33)
    dev = map_arrays(kw, to_device)
    x = dev[name]
    buf = cp.zeros(x.nbytes + 16, cp.uint8)
    bad = buf[1 : 1 + x.nbytes].view(x.dtype).reshape(x.shape)
    with pytest.raises(BufferError, match=f"{name} starts at address"):
        fn(**{**dev, name: bad})
    check_device_call(op, 33, to_device)


@pytest.mark.gpu
def test_device_scale_values_are_checked_under_check_indices(monkeypatch):
    fn, kw = contiguous_case(34, cache_dtype=E4M3)
    kw["kv_scale"] = np.array([1.0, 0.0], np.float32)
    dev = map_arrays(kw, to_device)
    monkeypatch.setenv("ROPEKV_CHECK_INDICES", "1")
    with pytest.raises(ValueError, match="kv_scale must hold positive finite scales"):
        fn(**dev)


@pytest.mark.gpu
def test_device_zero_kv_scale_writes_nothing():
    """Unchecked on the host (no sync), a zero scale on the device makes the kernel write nothing
    instead of inf/NaN codes."""
    fn, kw = contiguous_case(35, cache_dtype=E4M3)
    kw["kv_scale"] = np.array([1.0, 0.0], np.float32)
    dev = map_arrays(kw, to_device)
    fn(**dev)
    np.testing.assert_array_equal(
        to_numpy(dev["kv_cache"]).view(np.uint8), kw["kv_cache"].view(np.uint8)
    )


def gpu_count():
    try:
        import cupy as cp

        return cp.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001
        return 0


@pytest.mark.gpu
@pytest.mark.skipif(gpu_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("kind", ["cupy", "torch"])
@pytest.mark.parametrize("op", OPS)
def test_arrays_on_the_second_gpu(op, kind):
    import cupy as cp

    torch = torch_or_skip() if kind == "torch" else None

    def convert(x):
        if kind == "torch":
            return to_torch(x).to("cuda:1")
        with cp.cuda.Device(1):
            return to_device(x)

    with cp.cuda.Device(0):
        _fn, _dev = check_device_call(op, 36, convert)
    if torch is not None:
        torch.cuda.synchronize(1)


@pytest.mark.gpu
@pytest.mark.skipif(gpu_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("op", OPS)
def test_torch_stream_on_the_second_gpu(op):
    """Torch tensors on cuda:1 inside ``torch.cuda.stream(s)`` (s on cuda:1) while CuPy's current
    device is 0: the op runs on s, behind s's earlier work, and a read on s sees the cache."""
    import cupy as cp

    torch = torch_or_skip()

    def convert(x):
        return to_torch(x).to("cuda:1")

    fn, kw = CASES[op](38)
    expected = copy_kw(kw)
    out_expected = fn(**expected)
    with cp.cuda.Device(0):
        fn(**map_arrays(copy_kw(kw), convert))  # the plan exists: the call below is a replay
        dev = map_arrays(kw, convert)
        name = LATE_INPUT[op]
        real = dev[name].clone()
        dev[name].zero_()
        torch.cuda.synchronize(1)
        s = torch.cuda.Stream(device=1)
        with torch.cuda.stream(s):
            torch.cuda._sleep(50_000_000)  # about 25 ms of GPU time on s
            dev[name].copy_(real)
            out = fn(**dev)
            cache = [c.clone() for c in flat(dev[CACHE[op]])]  # read on s
        s.synchronize()
    assert_same(dev, out, expected, out_expected, op)
    for got, want in zip(cache, flat(dev[CACHE[op]])):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(gpu_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("kind", ["cupy", "torch"])
def test_two_threads_driving_two_gpus(kind):
    """One thread per GPU, every op in turn, the same layouts on both devices (one plan each)."""
    import cupy as cp

    if kind == "torch":
        torch_or_skip()
    errors = []

    def work(device):
        def convert(x):
            if kind == "torch":
                return to_torch(x).to(f"cuda:{device}")
            with cp.cuda.Device(device):
                return to_device(x)

        try:
            with cp.cuda.Device(device):
                for i in range(3 * len(OPS)):
                    check_device_call(OPS[i % len(OPS)], 37 + i, convert)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(d,)) for d in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
