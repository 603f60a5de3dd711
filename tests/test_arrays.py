"""Array intake: NumPy, CuPy-less DLPack producers (fp8 included), zero-copy and the stream
protocol. Runs without a GPU: a fake producer hands out real DLPack capsules over host memory."""

from __future__ import annotations

import ctypes
import sys

import ml_dtypes
import numpy as np
import pytest

from ropekv import _arrays as ar
from ropekv import _checks as ck

ALL_DTYPES = [
    np.float16,
    ml_dtypes.bfloat16,
    np.float32,
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e5m2,
    np.int32,
    np.int64,
]
DL_CODES = {
    np.dtype(np.float16): (2, 16),
    np.dtype(ml_dtypes.bfloat16): (4, 16),
    np.dtype(np.float32): (2, 32),
    np.dtype(ml_dtypes.float8_e4m3fn): (10, 8),
    np.dtype(ml_dtypes.float8_e5m2): (12, 8),
    np.dtype(np.int32): (0, 32),
    np.dtype(np.int64): (0, 64),
}

_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class FakeProducer:
    """A DLPack producer over a NumPy array's memory, reporting any device type and dtype code."""

    def __init__(
        self, array, *, device=(1, 0), versioned=True, flags=0, code=None, lanes=1, strides=True
    ):
        self.array = array
        self.device = device
        self.versioned = versioned
        self.flags = flags
        self.code = code or DL_CODES[array.dtype]
        self.lanes = lanes
        self.with_strides = strides
        self.stream_seen = "not called"

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, *, stream=None, max_version=None):
        self.stream_seen = stream
        a = self.array
        self._shape = (ctypes.c_int64 * a.ndim)(*a.shape)
        self._strides = (ctypes.c_int64 * a.ndim)(*(s // a.itemsize for s in a.strides))
        if self.versioned and max_version is not None:
            m = ar._DLManagedTensorVersioned()
            m.major, m.minor, m.flags = 1, 1, self.flags
            name = b"dltensor_versioned"
        else:
            m = ar._DLManagedTensor()
            name = b"dltensor"
        t = m.dl_tensor
        t.data = a.ctypes.data
        t.device.device_type, t.device.device_id = self.device
        t.ndim = a.ndim
        t.dtype.code, t.dtype.bits = self.code
        t.dtype.lanes = self.lanes
        t.shape = self._shape
        t.strides = self._strides if self.with_strides else None
        t.byte_offset = 0
        self._managed, self._name = m, name  # kept alive with the producer
        return _capsule_new(ctypes.addressof(m), name, None)


def random_array(dtype, shape=(3, 4, 5), seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: np.dtype(d).name)
def test_numpy_intake_is_zero_copy(dtype):
    a = random_array(dtype)[:, 1:3]
    v = ar.as_view(a, "x")
    assert v.ptr == a.ctypes.data and v.shape == a.shape and v.dtype == np.dtype(dtype)
    assert v.strides == tuple(s // a.itemsize for s in a.strides)
    assert v.on_host and v.host is a


@pytest.mark.parametrize("versioned", [True, False])
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: np.dtype(d).name)
def test_dlpack_intake_every_dtype(dtype, versioned):
    a = random_array(dtype)
    v = ar.as_view(FakeProducer(a, versioned=versioned), "x")
    assert v.dtype == np.dtype(dtype) and v.shape == a.shape and v.ptr == a.ctypes.data
    assert v.on_host
    # the host view aliases the producer's memory: a write through it is seen by the producer
    v.host[0, 0, 0] = np.array(2.0).astype(dtype)
    assert a[0, 0, 0] == np.array(2.0).astype(dtype)


def test_dlpack_strided_and_compact():
    a = random_array(np.float16, (4, 6, 8))[:, ::2]
    v = ar.as_view(FakeProducer(a), "x")
    assert v.strides == (48, 16, 1)
    np.testing.assert_array_equal(v.host, a)
    c = random_array(np.float32, (2, 3))
    v = ar.as_view(FakeProducer(c, strides=False), "x")
    assert v.strides == (3, 1)


def test_numpy_own_dlpack_capsule():
    """NumPy is a real producer: read its capsule through an object exposing only __dlpack__."""
    a = random_array(np.float32)

    class Wrapper:
        def __dlpack__(self, **kw):
            return a.__dlpack__(**kw)

        def __dlpack_device__(self):
            return a.__dlpack_device__()

    v = ar.as_view(Wrapper(), "x")
    assert v.ptr == a.ctypes.data and v.dtype == np.float32
    np.testing.assert_array_equal(v.host, a)


def test_jax_arrays_go_through_dlpack_not_their_array_interface(monkeypatch):
    """A JAX array is read through DLPack even though it has __cuda_array_interface__: JAX's
    interface (version 2, no stream) is exported while the array's work may still run, where
    DLPack's stream handshake orders it before the launch."""
    import types

    class Tracer:
        pass

    class Array:
        pass

    fake = types.ModuleType("jax")
    fake.Array, fake.core = Array, types.SimpleNamespace(Tracer=Tracer)
    monkeypatch.setitem(sys.modules, "jax", fake)
    a = random_array(np.float16)
    producer = FakeProducer(a)

    class JaxLike(Array):
        cai_read = False

        @property
        def __cuda_array_interface__(self):  # JAX's: version 2, no stream
            JaxLike.cai_read = True
            return {"shape": a.shape, "typestr": "<f2", "data": (a.ctypes.data, True), "version": 2}

        def __dlpack__(self, **kw):
            return producer.__dlpack__(**kw)

        def __dlpack_device__(self):
            return producer.__dlpack_device__()

    v = ar.as_view(JaxLike(), "k")
    assert not JaxLike.cai_read
    assert producer.stream_seen is None  # __dlpack__ was called (a host array: no stream)
    assert v.ptr == a.ctypes.data and v.shape == a.shape and v.dtype == np.float16


def test_read_only_flag_is_honoured():
    v = ar.as_view(FakeProducer(random_array(np.float16), flags=ar._DL_FLAG_READ_ONLY), "q")
    assert v.readonly
    with pytest.raises(BufferError, match="q is written in place"):
        ck.check_writable(v)


def test_copied_flag_counts_as_not_writable():
    v = ar.as_view(FakeProducer(random_array(np.float16), flags=ar._DL_FLAG_IS_COPIED), "kv")
    with pytest.raises(BufferError, match="kv"):
        ck.check_writable(v)


def test_unknown_dtype_code():
    with pytest.raises(TypeError, match=r"x has DLPack dtype \(code=9, bits=8"):
        ar.as_view(FakeProducer(random_array(ml_dtypes.float8_e4m3fn), code=(9, 8)), "x")


def test_vector_lanes_refused():
    with pytest.raises(TypeError, match="lanes=2"):
        ar.as_view(FakeProducer(random_array(np.float16), lanes=2), "x")


def test_unknown_device_type():
    with pytest.raises(BufferError, match="device type 4"):
        ar.as_view(FakeProducer(random_array(np.float16), device=(4, 0)), "x")


def test_not_an_array():
    with pytest.raises(
        TypeError,
        match="q must be a NumPy array, a CuPy array, a torch tensor or "
        "an object with __cuda_array_interface__ or __dlpack__, "
        "got builtins.list",
    ):
        ar.as_view([1.0, 2.0], "q")


@pytest.mark.parametrize("given, expected", [(1234, 1234), (0, 1)])
def test_cuda_producer_gets_the_consumer_stream(given, expected):
    """DLPack stream protocol: the producer is told ropekv's stream (0, the legacy default
    stream, is spelled 1); host producers are given no stream."""
    p = FakeProducer(random_array(np.float16), device=(2, 3))
    v = ar.as_view(p, "x", stream_ptr=given)
    assert p.stream_seen == expected and v.device == 3 and v.host is None
    h = FakeProducer(random_array(np.float16))
    ar.as_view(h, "x", stream_ptr=given)
    assert h.stream_seen is None


def test_mixed_devices_name_both_arrays():
    host = ar.as_view(random_array(np.float16), "q")
    dev = ar.as_view(
        FakeProducer(random_array(np.float16), device=(2, 0)), "kv_cache", stream_ptr=5
    )
    with pytest.raises(ValueError, match="q is in host memory, kv_cache is in CUDA device 0"):
        ck.check_same_device([host, dev])
    dev1 = ar.as_view(FakeProducer(random_array(np.float16), device=(2, 1)), "k", stream_ptr=5)
    with pytest.raises(ValueError, match="kv_cache is in CUDA device 0, k is in CUDA device 1"):
        ck.check_same_device([dev, dev1])


torch_dtypes = [
    ("float16", np.float16),
    ("bfloat16", ml_dtypes.bfloat16),
    ("float32", np.float32),
    ("float8_e4m3fn", ml_dtypes.float8_e4m3fn),
    ("float8_e5m2", ml_dtypes.float8_e5m2),
    ("int32", np.int32),
    ("int64", np.int64),
]


@pytest.mark.parametrize("name, dtype", torch_dtypes, ids=[n for n, _ in torch_dtypes])
def test_torch_cpu_tensor_zero_copy(name, dtype):
    torch = pytest.importorskip("torch")
    t = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4).to(getattr(torch, name))
    v = ar.as_view(t, "x")
    assert v.dtype == np.dtype(dtype) and v.shape == (2, 3, 4) and v.ptr == t.data_ptr()
    v.host[1, 2, 3] = np.array(5).astype(dtype)
    assert float(t[1, 2, 3].float()) == 5.0
