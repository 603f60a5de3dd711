"""One error class per kind of bad input, in every op (``docs/conventions.md``, "Error classes"):
``TypeError`` for types (dtypes, kinds of object, tracing tensors), ``ValueError`` for values
(shapes, out-of-range ints, floats beyond float32), ``BufferError`` for memory ropekv cannot read
(null pointers, tensors without storage, sparse / nested tensors), never ``OverflowError``,
``IndexError``, ``RuntimeError`` or a driver error; ``IndexError`` only for index values under
``ROPEKV_CHECK_INDICES=1``. One test per row of the table; then a fuzz test over every op's
arguments (valid and invalid) that no call raises anything else."""

from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ropekv import _arrays as ar
from ropekv import _launch
from tests.test_arrays import FakeProducer
from tests.test_call_path import CACHE, CASES, LATE_INPUT, OPS, copy_kw, map_arrays

ALLOWED = (TypeError, ValueError, BufferError)


def _torch():
    torch = pytest.importorskip("torch")
    return torch


def _as_torch(kw):
    torch = _torch()
    return map_arrays(copy_kw(kw), lambda x: torch.from_numpy(x.copy()))


# ---- one test per row of the table ----------------------------------------------------------


@pytest.mark.parametrize("op", OPS)
def test_wrong_dtype_is_a_type_error(op):
    fn, kw = CASES[op](1)
    name = LATE_INPUT[op]
    kw[name] = kw[name].astype(np.float64)
    with pytest.raises(TypeError, match=name):
        fn(**kw)


@pytest.mark.parametrize("op", OPS)
def test_wrong_shape_is_a_value_error(op):
    fn, kw = CASES[op](2)
    name = LATE_INPUT[op]
    kw[name] = kw[name][..., None]
    with pytest.raises(ValueError, match=name):
        fn(**kw)


def test_an_array_of_no_known_kind_is_a_type_error():
    fn, kw = CASES["contiguous"](3)
    with pytest.raises(TypeError, match="q must be a NumPy array"):
        fn(**{**kw, "q": [[1.0]]})


def test_a_scalar_of_another_type_is_a_type_error():
    fn, kw = CASES["qknorm"](4)
    with pytest.raises(TypeError, match="epsilon must be a real number"):
        fn(**{**kw, "epsilon": "1e-6"})


@pytest.mark.parametrize(
    "op, name", [("contiguous", "kv_scale"), ("qknorm", "epsilon"), ("mla", "epsilon")]
)
@pytest.mark.parametrize("value", [10**400, -(10**400), 1e300, 3.5e38, float("inf")])
def test_a_float_beyond_float32_is_a_value_error(op, name, value):
    """A value float32 cannot hold (the kernels take their scalars as float32) is refused before
    anything runs, on the NumPy backend too: not an OverflowError, not a struct.error."""
    fn, kw = CASES[op](5)
    with pytest.raises(ValueError, match=name):
        fn(**{**kw, name: value})


@pytest.mark.parametrize("value", [10**400, 1e300, (1.0, 10**400), (1e39, 1.0)])
def test_qkv_kv_scale_beyond_float32_is_a_value_error(value):
    fn, kw = CASES["qkv"](6)
    with pytest.raises(ValueError, match="kv_scale"):
        fn(**{**kw, "kv_scale": value})


@pytest.mark.parametrize("value", [float("nan"), -1.0, 0.0])
def test_a_bad_scale_value_is_a_value_error(value):
    fn, kw = CASES["contiguous"](7)
    with pytest.raises(ValueError, match="kv_scale"):
        fn(**{**kw, "kv_scale": value})


@pytest.mark.parametrize("value", [2**31, 10**400, 4.0, np.float64(4.0), True])
def test_an_int_out_of_range_or_of_another_type_is_a_value_error(value):
    fn, kw = CASES["paged"](8)
    with pytest.raises(ValueError, match="page_size must be a positive integer"):
        fn(**{**kw, "page_size": value})


@pytest.mark.parametrize("layer", [2**63, 10**30, -(2**70)])
def test_layer_idx_beyond_int64_is_a_value_error(layer):
    fn, kw = CASES["qknorm"](9)
    kw["paged_kv_cache"] = tuple(np.stack([c, c.copy()]) for c in kw["paged_kv_cache"])
    with pytest.raises(ValueError, match="layer_idx must be in"):
        fn(**kw, layer_idx=layer)


def test_int_flags_key_plans_by_type():
    """An int argument's key: 4 and np.int64(4) share a plan; 4.0, True and "4" never do (a plan
    validated for 4 would serve them)."""
    key = _launch.int_key
    assert key(4) == 4 and key(np.int64(4)) == 4 and type(key(np.int64(4))) is int
    for bad in (4.0, np.float64(4.0), True, "4"):
        assert key(bad) != 4 and key(bad) != key(4)
        assert repr(key(bad)) == repr(bad)
    assert key(4.0) == key(4.0) and hash(key(4.0)) == hash(key(4.0))
    assert key(None) is None


@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr", "nested"])
def test_tensors_without_strided_storage_are_a_buffer_error(layout):
    """Sparse, CSR and nested tensors: BufferError naming the argument, not torch's RuntimeError
    ("Cannot access data pointer of Tensor that doesn't have storage")."""
    torch = _torch()
    fn, kw = CASES["contiguous"](10)
    args = _as_torch(kw)
    k = args["k"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if layout == "sparse_coo":
            args["k"] = k.to_sparse()
        elif layout == "sparse_csr":
            args["k"] = k.reshape(k.shape[0], -1).to_sparse_csr()
        else:
            args["k"] = torch.nested.nested_tensor(list(k))
    with pytest.raises(BufferError, match="^k "):
        fn(**args)


def test_a_zero_tensor_is_a_buffer_error():
    """``torch._efficientzerotensor``: no memory behind it (data_ptr() is 0)."""
    torch = _torch()
    fn, kw = CASES["contiguous"](11)
    args = _as_torch(kw)
    args["q"] = torch._efficientzerotensor(args["q"].shape, dtype=args["q"].dtype)
    with pytest.raises(BufferError, match="^q "):
        fn(**args)


@pytest.mark.parametrize("offset", [0, 1])
def test_a_resized_storage_is_a_buffer_error(offset):
    """A tensor whose storage was resized to 0 bytes: data_ptr() gives 0 (or, at a storage offset,
    the offset alone); the CPU backend read and wrote through it."""
    _torch()
    fn, kw = CASES["contiguous"](12)
    args = _as_torch(kw)
    k = args["k"].clone().reshape(-1)
    n = args["k"].numel()
    full = k.new_zeros(n + offset)
    args["k"] = full[offset:].view(args["k"].shape)
    full.untyped_storage().resize_(0)
    with pytest.raises(BufferError, match="^k has a null data pointer"):
        fn(**args)


def test_a_tensor_beyond_its_storage_is_a_buffer_error():
    torch = _torch()
    fn, kw = CASES["contiguous"](13)
    args = _as_torch(kw)
    k = args["k"].clone()
    k.untyped_storage().resize_(k.untyped_storage().nbytes() // 2)
    del torch
    with pytest.raises(BufferError, match="^k .* reaches bytes"):
        fn(**args | {"k": k})


def test_a_dlpack_capsule_with_a_null_pointer_is_a_buffer_error(monkeypatch):
    fn, kw = CASES["contiguous"](14)
    producer = FakeProducer(kw["v"].copy())
    dlpack = producer.__dlpack__

    def null(**kwargs):
        capsule = dlpack(**kwargs)
        producer._managed.dl_tensor.data = None
        return capsule

    monkeypatch.setattr(producer, "__dlpack__", null)
    with pytest.raises(BufferError, match="^v has a null data pointer"):
        fn(**{**kw, "v": producer})


def test_a_torch_device_of_another_type_is_not_cuda():
    """A tensor on a non-CUDA device with an index (``xpu:0``) is refused, not launched on as a CUDA
    tensor of device 0 (here a subclass whose get_device() says 0 on a CPU tensor)."""
    torch = _torch()

    class OtherDevice(torch.Tensor):
        def get_device(self):
            return 0

    fn, kw = CASES["contiguous"](15)
    args = _as_torch(kw)
    args["q"] = args["q"].as_subclass(OtherDevice)
    with pytest.raises(BufferError, match="q is on torch device"):
        fn(**args)


# ---- tracing: TypeError naming ropekv.torch / ropekv.jax (issue 33) ---------------------------


def test_fake_tensors_are_a_type_error_naming_ropekv_torch():
    torch = _torch()
    from torch._subclasses.fake_tensor import FakeTensorMode

    fn, kw = CASES["contiguous"](16)
    args = _as_torch(kw)
    with FakeTensorMode() as mode:
        fake = {
            k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in args.items()
        }
        with pytest.raises(TypeError, match=r"q is a FakeTensor .*ropekv\.torch"):
            fn(**fake)


def test_functionalized_calls_are_a_type_error_naming_ropekv_torch():
    torch = _torch()
    fn, kw = CASES["contiguous"](17)
    args = _as_torch(kw)
    names = [k for k, v in args.items() if isinstance(v, torch.Tensor)]
    rest = {k: v for k, v in args.items() if k not in names}

    def f(*tensors):
        return fn(**dict(zip(names, tensors)), **rest)

    with pytest.raises(TypeError, match=r"ropekv\.torch"):
        torch.func.functionalize(f)(*[args[k] for k in names])


def test_a_dynamo_traced_call_is_a_type_error_naming_ropekv_torch(monkeypatch):
    """While Dynamo traces (``torch.compiler._is_compiling_flag``), an eager op raises TypeError
    naming ropekv.torch before it reads anything; under ``torch.compile(fullgraph=True)`` Dynamo
    reports that TypeError (its own error class, the message kept); without fullgraph the call
    graph-breaks and runs eagerly."""
    torch = _torch()
    fn, kw = CASES["contiguous"](18)
    args = _as_torch(kw)
    fn(**_as_torch(kw))  # torch seen: the flag is read from now on
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)
    with pytest.raises(TypeError, match=r"ropekv\.torch"):
        fn(**args)
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", False)

    compiled = torch.compile(lambda a: fn(**a), backend="eager", fullgraph=True)
    with pytest.raises(Exception, match=r"ropekv\.torch") as info:
        compiled(args)
    assert "TypeError" in str(info.value)


def test_jax_tracers_are_a_type_error_naming_ropekv_jax():
    jax = pytest.importorskip("jax")
    fn, kw = CASES["contiguous"](19)
    names = [k for k, v in kw.items() if isinstance(v, np.ndarray)]
    rest = {k: v for k, v in kw.items() if k not in names}

    def f(*arrays):
        return fn(**dict(zip(names, arrays)), **rest)

    with pytest.raises(TypeError, match=r"JAX tracer .*ropekv\.jax"):
        jax.jit(f)(*[kw[k] for k in names])


# ---- index values: the one IndexError, opt-in -------------------------------------------------


def test_index_values_under_check_indices_are_an_index_error(monkeypatch):
    from tests import test_paged as tp

    monkeypatch.setenv("ROPEKV_CHECK_INDICES", "1")
    fn, kw = CASES["paged"](20)
    kw["kv_indptr"] = kw["kv_indptr"].copy()
    kw["kv_indptr"][0] = -5
    with pytest.raises(IndexError):
        fn(**kw)
    del tp


# ---- the backends agree: a table of no rows skips every token (issue 37 item 9) ---------------


@pytest.mark.parametrize("op", ["mla", "qknorm", "qkv", "contiguous", "paged"])
def test_a_cos_sin_cache_of_no_rows_skips_every_token(op):
    """Every op returns with a (P = 0, R) table: every position lies outside it, so no token is
    roped or written (the NumPy backend of mla, qknorm and qkv raised IndexError)."""
    fn, kw = CASES[op](21)
    kw["cos_sin_cache"] = kw["cos_sin_cache"][:0]
    before = {k: v.copy() for k, v in kw.items() if isinstance(v, np.ndarray)}
    cache = CACHE[op]
    caches = kw[cache] if isinstance(kw[cache], tuple) else (kw[cache],)
    saved = [c.copy() for c in caches]
    fn(**kw)
    for c, s in zip(caches, saved):
        np.testing.assert_array_equal(c.view(np.uint8), s.view(np.uint8))
    del before


# ---- fuzz: any argument, valid or not: the call returns or raises one of the three -------------

_DTYPES = [
    np.float16,
    np.float32,
    np.float64,
    np.int32,
    np.int64,
    np.uint32,
    np.int8,
    np.uint8,
    ml_dtypes.bfloat16,
    ml_dtypes.float8_e4m3fn,
]
_SCALARS = [
    0,
    -1,
    1,
    4.0,
    2**31,
    2**63,
    10**400,
    -(10**400),
    1e300,
    float("nan"),
    float("inf"),
    -0.0,
    1e-45,
    True,
    None,
    "x",
    (1.0, 2.0),
    [1, 2],
    np.float32(1.5),
    np.int64(3),
]
_MUTATIONS = ["dtype", "shape", "stride", "empty", "none", "kind", "scalar", "zero_dim", "swap"]


def _mutate(kw, name, how, draw):
    value = kw[name]
    arrays = [k for k, v in kw.items() if isinstance(v, np.ndarray)]
    if how == "scalar" or not isinstance(value, np.ndarray):
        if isinstance(value, tuple) and value and isinstance(value[0], np.ndarray):
            i = draw(st.integers(0, len(value) - 1))
            parts = list(value)
            part = parts[i]  # an earlier mutation may have made it None
            choices = [None] if part is None else [None, part[::2], part.astype(np.float32)]
            parts[i] = draw(st.sampled_from(choices))
            kw[name] = tuple(parts)
        else:
            kw[name] = draw(st.sampled_from(_SCALARS))
        return
    if how == "dtype":
        kw[name] = value.astype(draw(st.sampled_from(_DTYPES)))
    elif how == "shape":
        if value.ndim and draw(st.booleans()):
            kw[name] = value[..., : max(0, value.shape[-1] - draw(st.integers(1, 3)))]
        else:
            kw[name] = value[None] if draw(st.booleans()) else value.reshape(-1)
    elif how == "stride":
        if value.ndim >= 2 and draw(st.booleans()):
            kw[name] = np.swapaxes(value, 0, -1)
        elif value.ndim:
            wide = np.repeat(value, 2, axis=0)
            kw[name] = wide[::2] if draw(st.booleans()) else wide[::-2]
        else:
            kw[name] = np.broadcast_to(value, (2,))
    elif how == "empty":
        kw[name] = value[:0] if value.ndim else value.reshape(1)[:0]
    elif how == "none":
        kw[name] = None
    elif how == "kind":
        kw[name] = draw(st.sampled_from([value.tolist(), 3, "array", object(), b"\x00" * 8]))
    elif how == "zero_dim":
        kw[name] = np.asarray(value.reshape(-1)[0] if value.size else 0, value.dtype)
    elif how == "swap":
        kw[name] = kw[draw(st.sampled_from(arrays))]


def fuzz_case(data, op):
    """A case of ``op`` with one to three arguments mutated (drawn from ``data``)."""
    fn, kw = CASES[op](data.draw(st.integers(0, 3)))
    names = sorted(kw)
    for _ in range(data.draw(st.integers(0, 3))):
        name = data.draw(st.sampled_from(names))
        how = data.draw(st.sampled_from(_MUTATIONS))
        _mutate(kw, name, how, data.draw)
    return fn, kw


def call_allowed(fn, kw):
    """The call's result, or the exception it raised when that is one of ALLOWED (anything else
    fails the test)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return fn(**kw)
        except ALLOWED as exc:
            return exc


@pytest.mark.parametrize("op", OPS)
@given(data=st.data())
def test_fuzz_every_call_returns_or_raises_one_of_three(op, data):
    fn, kw = fuzz_case(data, op)
    call_allowed(fn, kw)


@pytest.mark.parametrize("op", OPS)
@given(data=st.data())
def test_fuzz_torch_cpu_tensors(op, data):
    torch = _torch()
    fn, kw = fuzz_case(data, op)

    def convert(x):
        x = x.copy()  # fresh C-order strides (torch takes no negative strides, empty or not)
        if x.dtype in (np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e4m3fn)):
            raw = torch.from_numpy(x.reshape(-1).view(np.uint8))  # 0-d: view it as 1-d
            return raw.view(ar.torch_dtype(x.dtype)).reshape(x.shape)
        return torch.from_numpy(x)

    call_allowed(fn, map_arrays(kw, convert))


# ---- on the GPU: the same rules, both backends agree, the context survives -----------------------


def _context_alive():
    import cupy

    assert float(cupy.arange(4, dtype=cupy.float32).sum()) == 6.0  # a trivial op still works
    cupy.cuda.Device().synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
@given(data=st.data())
def test_gpu_fuzz_both_backends_agree_and_the_context_survives(op, data):
    """The fuzz cases on both backends: each call returns or raises one of the three classes;
    where both return, they return and write the same (the NumPy backend under
    ``ROPEKV_CHECK_INDICES=1``, whose IndexError for duplicate or skipped index values leaves the
    case out: undefined rows cannot be compared); afterwards the CUDA context still works."""
    import os

    from tests.test_call_path import assert_same
    from tests.tolerance import to_device

    fn, kw = fuzz_case(data, op)
    host = copy_kw(kw)
    os.environ["ROPEKV_CHECK_INDICES"] = "1"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                expected = fn(**host)
            except (*ALLOWED, IndexError) as exc:
                expected = exc
    finally:
        del os.environ["ROPEKV_CHECK_INDICES"]
    dev = map_arrays(copy_kw(kw), to_device)
    got = call_allowed(fn, dev)
    _context_alive()
    if isinstance(expected, Exception) or isinstance(got, Exception):
        return
    assert_same(dev, got, host, expected, op)


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_gpu_a_null_pointer_is_refused_on_first_call_and_replay(op):
    """A torch CUDA tensor without memory (a zero tensor on a first call; a storage resized to 0
    bytes, of a planned layout, on a replay: the C replay reads the storage's null data pointer)
    is a BufferError naming it; nothing launches on address 0 and the context survives."""
    torch = _torch()
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    from tests.test_call_path import to_torch

    fn, kw = CASES[op](60)
    name = LATE_INPUT[op]
    args = map_arrays(copy_kw(kw), to_torch)
    args[name] = torch._efficientzerotensor(
        args[name].shape, dtype=args[name].dtype, device=args[name].device
    )
    with pytest.raises(BufferError, match=f"^{name} "):
        fn(**args)
    fn(**map_arrays(copy_kw(kw), to_torch))  # plans
    fn(**map_arrays(copy_kw(kw), to_torch))  # replays
    for offset in (0, 1):
        args = map_arrays(copy_kw(kw), to_torch)
        t = args[name]
        full = t.new_zeros(t.numel() + offset)
        args[name] = full[offset:].view(t.shape)
        full.untyped_storage().resize_(0)
        with pytest.raises(BufferError, match=f"^{name} has a null data pointer"):
            fn(**args)
    torch.cuda.synchronize()
    _context_alive()


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_gpu_a_cai_producers_stream_is_waited_for_without_stream(op):
    """CAI v3 without ``stream=``: the producer's work on its own stream (an input written after a
    25 ms spin) is complete before the kernel reads it, on the first call and on a replay."""
    import cupy as cp

    from ropekv import _timing
    from tests.test_call_path import assert_same
    from tests.tolerance import to_device

    class Produced:
        def __init__(self, array, stream):
            cai = dict(array.__cuda_array_interface__)
            cai["stream"] = stream.ptr
            self.__cuda_array_interface__ = cai
            self.array = array

    fn, kw = CASES[op](61)
    expected = copy_kw(kw)
    out_expected = fn(**expected)
    name = LATE_INPUT[op]
    for _ in range(2):  # a first call, then a replay
        dev = map_arrays(copy_kw(kw), to_device)
        target, real = dev[name], to_device(kw[name])
        cp.cuda.runtime.memset(target.data.ptr, 0, target.nbytes)
        cp.cuda.Device().synchronize()
        s = cp.cuda.Stream(non_blocking=True)
        with s:
            _timing.spin(25_000)  # 25 ms on s
        cp.cuda.runtime.memcpyAsync(target.data.ptr, real.data.ptr, target.nbytes, 3, s.ptr)
        out = fn(**{**dev, name: Produced(target, s)})
        cp.cuda.Device().synchronize()
        assert_same(dev, out, expected, out_expected, op)


@pytest.mark.gpu
def test_gpu_a_dlpack_producer_on_another_device_gets_that_devices_stream():
    """Two GPUs, device 0 current: a DLPack producer on device 1 is asked for the launch stream on
    device 1 (CuPy's current stream there)."""
    import cupy as cp

    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    fn, kw = CASES["qknorm"](62)
    name = LATE_INPUT["qknorm"]
    seen = []
    with cp.cuda.Device(1):
        dev = map_arrays(copy_kw(kw), cp.asarray)
        s1 = cp.cuda.Stream(non_blocking=True)
    inner = dev[name]

    class Producer:
        def __dlpack_device__(self):
            return inner.__dlpack_device__()

        def __dlpack__(self, **kwargs):
            seen.append(kwargs.get("stream"))
            return inner.__dlpack__(**kwargs)

    # s1 current on device 1 (CuPy keeps a current stream per device), device 0 current
    with cp.cuda.Device(1), s1, cp.cuda.Device(0):
        fn(**{**dev, name: Producer()})
    cp.cuda.Device(1).synchronize()
    assert seen and seen[0] == s1.ptr
