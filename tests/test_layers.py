"""Multi-layer caches (``layer_idx``, ``docs/conventions.md`` "Multi-layer caches") in the fused
QKV, MLA and QK-norm ops: one layer of a ``(num_layers, ...)`` cache is written as the one-layer
call writes its cache, every other byte stays; ``layer_idx`` is checked (type, range, the arrays'
layer dimension) before anything launches; one plan serves every layer and its replay offsets the
pointers (CPU, on the stand-ins of ``tools/hostcost.py``); the same on the GPU against the NumPy
backend, CuPy arrays and torch tensors."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import ropekv
from ropekv import _launch
from tests.test_call_path import CASES, assert_op_close, copy_kw, map_arrays
from tests.test_replay_cpu import PREFILL, hostcost, stubbed  # noqa: F401 - a fixture
from tests.tolerance import to_device, to_numpy

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
OPS = ("qkv", "mla", "mla_split", "qknorm")
CACHE = {
    "qkv": "paged_kv_cache",
    "mla": "kv_cache",
    "mla_split": "kv_cache",
    "qknorm": "paged_kv_cache",
}
DECODE = {"qkv": {"lengths": (1, 1)}}  # the fused kernel path (cuBLAS has no CPU stub)


def case(op, seed, **kw):
    if op == "mla_split":
        return CASES["mla"](seed, split=True, **kw)
    return CASES[op](seed, **kw)


def caches(kw, op):
    c = kw[CACHE[op]]
    return list(c) if isinstance(c, tuple) else [c]


def with_caches(kw, op, arrays):
    c = kw[CACHE[op]]
    return {**kw, CACHE[op]: tuple(arrays) if isinstance(c, tuple) else arrays[0]}


def layered(kw, op, num_layers, layer, seed=0):
    """``kw`` with every cache replaced by a ``(num_layers, ...)`` one of random contents whose
    layer ``layer`` holds the one-layer cache."""
    rng = np.random.default_rng(seed)
    out = []
    for c in caches(kw, op):
        full = (rng.standard_normal((num_layers, *c.shape)) * 0.5).astype(c.dtype)
        full[layer] = c
        out.append(full)
    return with_caches(kw, op, out)


def assert_layer_written(op, before, after, expected, layer, what):
    """Layer ``layer`` of each cache of ``after`` matches ``expected``'s (the one-layer call), the
    other layers are byte-identical to ``before``."""
    for b, a, e in zip(caches(before, op), caches(after, op), caches(expected, op)):
        a = to_numpy(a)
        assert a.shape == b.shape
        others = [i for i in range(b.shape[0]) if i != layer]
        assert np.array_equal(a[others].view(np.uint8), b[others].view(np.uint8)), (
            f"{what}: another layer changed"
        )
        assert_op_close(a[layer], e, "qkv" if op == "qkv" else op, f"{what}: layer {layer}")


# ---- CPU: the NumPy backend --------------------------------------------------------------------


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("layer", [0, 2])
def test_numpy_writes_only_its_layer(op, layer):
    fn, kw = case(op, 1)
    one = copy_kw(kw)
    expected_out = fn(**one)
    multi = layered(kw, op, 3, layer)
    before = copy_kw(multi)
    out = fn(**multi, layer_idx=layer)
    assert np.array_equal(np.asarray(out).view(np.uint8), np.asarray(expected_out).view(np.uint8))
    for b, a, e in zip(caches(before, op), caches(multi, op), caches(one, op)):
        others = [i for i in range(b.shape[0]) if i != layer]
        assert np.array_equal(a[others].view(np.uint8), b[others].view(np.uint8))
        assert np.array_equal(a[layer].view(np.uint8), e.view(np.uint8))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("bad", [True, np.bool_(False), 1.0, "0", np.float32(1), [0]])
def test_layer_idx_must_be_an_int(op, bad):
    fn, kw = case(op, 2)
    multi = layered(kw, op, 2, 0)
    before = copy_kw(multi)
    with pytest.raises(TypeError, match=r"layer_idx must be an int, got "):
        fn(**multi, layer_idx=bad)
    for b, a in zip(caches(before, op), caches(multi, op)):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("layer", [-1, 3, 100])
def test_layer_idx_out_of_range(op, layer):
    fn, kw = case(op, 3)
    multi = layered(kw, op, 3, 0)
    before = copy_kw(multi)
    with pytest.raises(
        ValueError,
        match=rf"layer_idx must be in \[0, num_layers\) = \[0, 3\), "
        rf"the leading dimension of \w+ \(shape \(3, .*got "
        rf"{layer}$",
    ):
        fn(**multi, layer_idx=layer)
    for b, a in zip(caches(before, op), caches(multi, op)):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("op", OPS)
def test_numpy_integer_layer_idx(op):
    fn, kw = case(op, 4)
    multi = layered(kw, op, 2, 1)
    fn(**multi, layer_idx=np.int64(1))
    multi2 = layered(kw, op, 2, 1)
    fn(**multi2, layer_idx=1)
    for a, b in zip(caches(multi, op), caches(multi2, op)):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("op", OPS)
def test_one_layer_cache_with_layer_idx_is_refused(op):
    """A cache without the layer dimension: its first dim is taken for layers, and the layer's
    view then lacks one dimension (the op's shape error, before any launch)."""
    fn, kw = case(op, 5)
    with pytest.raises(ValueError, match="must have"):
        fn(**kw, layer_idx=0)


@pytest.mark.parametrize("op", ["qkv", "qknorm", "mla_split"])
def test_layer_counts_must_agree(op):
    fn, kw = case(op, 6)
    multi = layered(kw, op, 3, 0)
    c = caches(multi, op)
    c[1] = c[1][:2]
    with pytest.raises(ValueError, match=r"must have as many layers as \w+ \(3\) with layer_idx"):
        fn(**with_caches(multi, op, c), layer_idx=0)


@pytest.mark.parametrize("op", OPS)
def test_layered_cache_without_layer_idx_is_refused(op):
    fn, kw = case(op, 7)
    with pytest.raises(ValueError, match="must have"):
        fn(**layered(kw, op, 2, 0))


@pytest.mark.parametrize("op", ["qkv", "qknorm"])
def test_an_input_overlapping_another_layer_is_refused(op):
    """The shared checks see the whole multi-layer array: an argument inside another layer of a
    written cache is refused (the rule holds alike for every layer a plan serves)."""
    fn, kw = case(op, 8)
    multi = layered(kw, op, 2, 0)
    k_cache = multi["paged_kv_cache"][0]
    name = "hidden_state" if op == "qkv" else "q"
    x = kw[name]
    inside = k_cache[1].reshape(-1).view(np.uint8)[: x.nbytes].view(x.dtype).reshape(x.shape)
    inside[...] = x
    with pytest.raises(
        ValueError, match=f"k_cache is written in place but shares memory with {name}"
    ):
        fn(**{**multi, name: inside}, layer_idx=0)


def test_layers_alignment():
    layers = _launch.Layers(4, [(5, 4096), (6, 4096)], 1, "k_cache", (4, 8))
    assert not layers.strict and not layers.misaligned(3)
    odd = _launch.Layers(4, [(5, 4096), (6, 24)], 1, "k_cache", (4, 8))
    assert odd.strict and odd.misaligned(0) and not odd.misaligned(1) and odd.misaligned(2)
    assert not odd.misaligned(3)  # 72 bytes: 8 past 16, as 24


def test_op_refuses_unknown_layered_names():
    with pytest.raises(ValueError, match="layered names no argument"):
        _launch.Op("x", ("a", "b"), None, layered=("c",))


# ---- CPU: the replay (the stand-ins of tools/hostcost.py, driver stubbed) -----------------------


def _ptr(x):
    return x.data.ptr


@pytest.mark.parametrize("op", OPS)
def test_one_plan_serves_every_layer(op, stubbed):  # noqa: F811 - the fixture
    fn, kw = case(op, 9, **DECODE.get(op, {}))
    dev = map_arrays(layered(kw, op, 5, 0), hostcost.to_cupy)
    ops = [o for o in stubbed_ops() if o.layered]
    fn(**dev, layer_idx=0)
    (owner,) = [o for o in ops if o.layer_plans]
    assert len(owner.layer_plans) == 1 and not owner.plans
    plan = next(iter(owner.layer_plans.values()))
    launch = plan.steps[-1]
    names = list(owner.names)
    cache_args = [
        names.index(n)
        for n in {
            "qkv": ("k_cache", "v_cache"),
            "qknorm": ("k_cache", "v_cache"),
            "mla": ("kv_cache",),
            "mla_split": ("ckv_cache", "kpe_cache"),
        }[op]
    ]
    for layer in (3, 1, 4, 0):
        n_calls = len(stubbed.calls)
        fn(**dev, layer_idx=layer)
        assert len(stubbed.calls) > n_calls
        assert len(owner.layer_plans) == 1 and not owner.plans
        fields = stubbed.pointers(len(stubbed.calls) - 1, launch.n_ptr)
        seen = set()
        for field, (arg, offset) in zip(fields, launch.slots):
            if arg in cache_args:
                c = caches(dev, op)[cache_args.index(arg)]
                assert field == _ptr(c) + layer * c.strides[0] + offset
                seen.add(arg)
        assert seen == set(cache_args)
    n_calls = len(stubbed.calls)
    with pytest.raises(ValueError, match=r"\[0, 5\), .* got 5"):  # the replay checks the range
        fn(**dev, layer_idx=5)
    with pytest.raises(TypeError, match="layer_idx must be an int"):
        fn(**dev, layer_idx=True)
    assert len(stubbed.calls) == n_calls
    # without layer_idx, a one-layer cache of that layout is another plan
    fn(**map_arrays(kw, hostcost.to_cupy))
    assert len(owner.plans) == 1 and len(owner.layer_plans) == 1


def test_a_captured_prefill_qkv_call_writes_its_layer(stubbed):  # noqa: F811 - the fixture
    """Under CUDA-graph capture a prefill QKV call with layer_idx runs its plan's capture plan (one
    fused launch, no GEMM) on the addressed layer of its caches, and checks the layer range as
    the plan does."""
    fn, kw = case("qkv", 9, **PREFILL["qkv"])
    dev = map_arrays(layered(kw, "qkv", 5, 0), hostcost.to_cupy)
    stubbed.gemms.capturing = True
    (owner,) = [o for o in stubbed_ops() if o.name.startswith("fused_qkv")]
    names = list(owner.names)
    for layer in (0, 3):
        n_calls = len(stubbed.calls)
        fn(**dev, layer_idx=layer)
        assert len(stubbed.calls) == n_calls + 1 and not stubbed.gemms.calls
        (plan,) = owner.layer_plans.values()
        launch = plan.capture_plan.steps[0]
        fields = stubbed.pointers(len(stubbed.calls) - 1, launch.n_ptr)
        for name, c in zip(("k_cache", "v_cache"), caches(dev, "qkv")):
            written = [
                (field, offset)
                for field, (arg, offset) in zip(fields, launch.slots)
                if arg == names.index(name)
            ]
            assert written and all(
                field == _ptr(c) + layer * c.strides[0] + offset for field, offset in written
            )
    n_calls = len(stubbed.calls)
    with pytest.raises(ValueError, match=r"\[0, 5\), .* got 5"):
        fn(**dev, layer_idx=5)
    assert len(stubbed.calls) == n_calls


def stubbed_ops():
    return [
        v
        for m in (ropekv.mla, ropekv.qknorm, ropekv.qkv)
        for v in vars(m).values()
        if isinstance(v, _launch.Op)
    ]


ODD = {"D": 4, "Hq": 2, "Hkv": 1, "page_size": 1, "cache_dtype": E4M3}  # 116-byte layers


def test_odd_layer_stride_revalidates_other_alignments(stubbed, monkeypatch):  # noqa: F811
    fn, kw = case("qknorm", 11, **ODD)
    dev = map_arrays(layered(kw, "qknorm", 4, 0), hostcost.to_cupy)
    firsts = []
    first_call = _launch.Op.first_call
    monkeypatch.setattr(
        _launch.Op, "first_call", lambda self, *a: firsts.append(a[-1]) or first_call(self, *a)
    )
    for layer in (0, 4 // 4, 0, 1, 2, 3, 0):
        fn(**dev, layer_idx=layer)
    # layer 0 validated the plan; layers 1, 2, 3 start 116, 232, 348 bytes further (4, 8, 12
    # past 16): each such call is validated again, uncached
    assert firsts == [0, 1, 1, 2, 3]
    assert len(ropekv.qknorm._OP.layer_plans) == 1


def test_replay_rechecks_overlap_with_every_layer(stubbed):  # noqa: F811
    fn, kw = case("qknorm", 10)
    dev = map_arrays(layered(kw, "qknorm", 3, 0), hostcost.to_cupy)
    fn(**dev, layer_idx=1)
    k = dev["paged_kv_cache"][0]
    with pytest.raises(
        ValueError, match="k_cache is written in place but shares memory with v_cache"
    ):
        fn(**{**dev, "paged_kv_cache": (k, k)}, layer_idx=2)


# ---- GPU: against the NumPy backend ------------------------------------------------------------


def _run_device(op, seed, num_layers, layer, convert, cache_dtype=None, **more):
    decode = more.pop("decode", False)
    extra = dict(DECODE.get(op, {})) if decode else {}
    if cache_dtype is not None:
        extra["cache_dtype"] = cache_dtype
    fn, kw = case(op, seed, **extra, **more)
    one = copy_kw(kw)
    expected_out = fn(**one)
    multi = layered(kw, op, num_layers, layer, seed)
    before = copy_kw(multi)
    dev = map_arrays(multi, convert)
    out = fn(**dev, layer_idx=layer)
    assert_layer_written(op, before, dev, one, layer, op)
    assert_op_close(out, expected_out, "qkv" if op == "qkv" else op, f"{op}: output")
    return fn, kw, dev


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("cache_dtype", [None, E4M3])
def test_device_layer_against_numpy(op, cache_dtype):
    for layer in (0, 3, 1):  # one plan, replayed on other layers
        _run_device(op, 20 + layer, 4, layer, to_device, cache_dtype)
    _run_device(op, 30, 4, 2, to_device, cache_dtype, decode=True)


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_device_layer_torch(op):
    torch = pytest.importorskip("torch")
    from tests.test_call_path import to_torch

    _, _, dev = _run_device(op, 40, 3, 2, to_torch)
    assert all(isinstance(c, torch.Tensor) for c in caches(dev, op))


@pytest.mark.gpu
@given(
    op=st.sampled_from(OPS),
    num_layers=st.integers(1, 6),
    data=st.data(),
    seed=st.integers(0, 2**31 - 1),
    fp8=st.booleans(),
)
def test_device_layers_property(op, num_layers, data, seed, fp8):
    layer = data.draw(st.integers(0, num_layers - 1))
    _run_device(op, seed, num_layers, layer, to_device, E4M3 if fp8 else None)


@pytest.mark.gpu
def test_device_odd_layer_stride():
    """A layer stride that is not a multiple of 16 bytes: layers of another alignment than the
    validated one are validated again (and written alike)."""
    import cupy as cp

    fn, kw = case("qknorm", 50, **ODD)
    assert kw["paged_kv_cache"][0].nbytes % 16 == 4
    for layer in (0, 1, 2, 3):
        one = copy_kw(kw)
        fn(**one)
        multi = layered(kw, "qknorm", 4, layer)
        before = copy_kw(multi)
        dev = map_arrays(multi, to_device)
        fn(**dev, layer_idx=layer)
        cp.cuda.get_current_stream().synchronize()
        assert_layer_written("qknorm", before, dev, one, layer, "odd stride")


# ---- per-token-head KV scales carry the layer dimension too (the QK-norm op) -------------------


def _layered_scales_call(convert, seed=5, num_layers=3, layer=1, layout="NHD"):
    fn, kw = case("qknorm", seed, cache_dtype=E4M3, layout=layout)
    shape = kw["paged_kv_cache"][0].shape[:-1]
    rng = np.random.default_rng(seed)
    scales = tuple(rng.uniform(1, 2, shape).astype(np.float32) for _ in range(2))
    one = copy_kw(dict(kw, kv_cache_scales=scales))
    expected_out = fn(**one)
    multi = layered(kw, "qknorm", num_layers, layer, seed)
    full = []
    for s in scales:
        f = rng.uniform(3, 4, (num_layers, *shape)).astype(np.float32)
        f[layer] = s
        full.append(f)
    multi["kv_cache_scales"] = tuple(full)
    before = copy_kw(multi)
    dev = map_arrays(multi, convert)
    out = fn(**dev, layer_idx=layer)
    assert_layer_written("qknorm", before, dev, one, layer, "layered scales")
    for b, a, e in zip(before["kv_cache_scales"], dev["kv_cache_scales"], one["kv_cache_scales"]):
        a = to_numpy(a)
        others = [i for i in range(num_layers) if i != layer]
        assert np.array_equal(a[others], b[others]), "another layer's scales changed"
        np.testing.assert_allclose(a[layer], e, rtol=1e-6)
    assert_op_close(out, expected_out, "qknorm", "layered scales: q")


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_numpy_layered_kv_cache_scales(layout):
    _layered_scales_call(lambda x: x, layout=layout)


def test_layered_kv_cache_scales_need_the_layer_dimension():
    fn, kw = case("qknorm", 6, cache_dtype=E4M3)
    shape = kw["paged_kv_cache"][0].shape[:-1]
    multi = layered(kw, "qknorm", 3, 0)
    one_layer = tuple(np.ones(shape, np.float32) for _ in range(2))
    with pytest.raises(ValueError, match="k_scales"):
        fn(**multi, kv_cache_scales=one_layer, layer_idx=0)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_device_layered_kv_cache_scales(layout):
    for layer in (1, 2):  # one plan, replayed on another layer
        _layered_scales_call(to_device, seed=7 + layer, layer=layer, layout=layout)
