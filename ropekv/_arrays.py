"""Array intake: NumPy, CuPy, torch, ``__cuda_array_interface__`` or any DLPack producer -> one
internal :class:`ArrayView`, and the layout signature that keys launch plans.

CuPy arrays and torch tensors are read from their attributes (pointer, shape, strides, dtype,
device): no capsule, and torch is never imported unless the caller passed a tensor. Objects with
``__cuda_array_interface__`` (JAX's ``buffer_callback`` buffers, Numba) are read from it; JAX arrays
go through DLPack (their interface does not wait for their pending work). Any other
``__dlpack__`` producer goes through a capsule that ropekv reads itself (legacy ``dltensor`` and
versioned ``dltensor_versioned``; CuPy cannot import float8 through DLPack). The capsule is never
consumed: it is kept alive beside the view, and when it is collected its own destructor releases
the producer's tensor, as the protocol prescribes for an unconsumed capsule.
"""

from __future__ import annotations

import ctypes
import math
import sys

import ml_dtypes
import numpy as np

HOST = -1  # ArrayView.device of host memory

FLOAT16 = np.dtype(np.float16)
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
FLOAT32 = np.dtype(np.float32)
FLOAT8_E4M3FN = np.dtype(ml_dtypes.float8_e4m3fn)
FLOAT8_E5M2 = np.dtype(ml_dtypes.float8_e5m2)
INT32 = np.dtype(np.int32)
INT64 = np.dtype(np.int64)
UINT32 = np.dtype(np.uint32)
UINT8 = np.dtype(np.uint8)
FP8_DTYPES = (FLOAT8_E4M3FN, FLOAT8_E5M2)

# DLPack 1.1 (code, bits) -> dtype. Codes: 0 int, 1 uint, 2 float, 4 bfloat, 6 bool,
# 10 float8_e4m3fn, 12 float8_e5m2.
_DL_DTYPES = {
    (0, 8): np.dtype(np.int8),
    (0, 16): np.dtype(np.int16),
    (0, 32): INT32,
    (0, 64): INT64,
    (1, 8): UINT8,
    (1, 16): np.dtype(np.uint16),
    (1, 32): UINT32,
    (1, 64): np.dtype(np.uint64),
    (2, 16): FLOAT16,
    (2, 32): FLOAT32,
    (2, 64): np.dtype(np.float64),
    (4, 16): BFLOAT16,
    (6, 8): np.dtype(np.bool_),
    (10, 8): FLOAT8_E4M3FN,
    (12, 8): FLOAT8_E5M2,
}
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13
_DL_FLAG_READ_ONLY, _DL_FLAG_IS_COPIED = 1, 2


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [
        ("dl_tensor", _DLTensor),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
    ]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("major", ctypes.c_uint32),
        ("minor", ctypes.c_uint32),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", _DLTensor),
    ]


_capsule_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_get_pointer.restype = ctypes.c_void_p
_capsule_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_is_valid.restype = ctypes.c_int
_capsule_is_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]


class ArrayView:
    """What a kernel launch needs to know of an array, whatever produced it.

    ``strides`` are in elements. ``device`` is the CUDA device id, or ``HOST``. ``host`` is a NumPy
    array aliasing the memory of a host array (the CPU backend writes through it), else None.
    ``owner`` keeps the producer's memory alive; ``array`` is the object the caller passed.
    ``legacy`` marks a legacy (unversioned) DLPack capsule, which carries no read-only flag.
    """

    __slots__ = (
        "array",
        "device",
        "dtype",
        "host",
        "legacy",
        "name",
        "owner",
        "ptr",
        "readonly",
        "shape",
        "size",
        "span",
        "strides",
        "wait",
    )

    def __init__(
        self,
        name,
        ptr,
        shape,
        strides,
        dtype,
        device,
        *,
        readonly=False,
        owner=None,
        host=None,
        array=None,
        legacy=False,
        wait=None,
    ):
        self.name = name
        self.legacy = legacy
        self.wait = wait  # a CAI producer's stream the launch stream must wait for (CAI v3)
        self.ptr = ptr
        self.shape = shape
        self.strides = strides
        self.dtype = dtype
        self.device = device
        self.readonly = readonly
        self.owner = owner
        self.host = host
        self.array = array
        self.size, self.span = _extent(shape, strides, dtype.itemsize)

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def on_host(self):
        return self.device == HOST

    def is_c_contiguous(self):
        if self.size == 0:
            return True
        strides = self.strides
        if len(strides) == 1:  # index arrays
            return strides[0] == 1 or self.shape[0] == 1
        expected = 1
        for n, s in zip(reversed(self.shape), reversed(self.strides)):
            if n != 1 and s != expected:
                return False
            expected *= n
        return True

    def where(self):
        return "host memory" if self.on_host else f"CUDA device {self.device}"

    def __repr__(self):
        return (
            f"ArrayView({self.name}: shape={self.shape}, dtype={self.dtype}, "
            f"strides={self.strides}, {self.where()})"
        )


def _extent(shape, strides, itemsize):
    """``(size, span)`` of a layout: its element count, and the bytes ``[lo, hi)`` relative to
    its pointer that it touches."""
    size = 1
    lo = hi = 0  # in elements: [lo, hi]
    for n, st in zip(shape, strides):
        size *= n
        if st < 0:
            lo += (n - 1) * st
        else:
            hi += (n - 1) * st
    return size, (lo * itemsize, (hi + 1) * itemsize)


# the C replay's bind_dims where _native routes the first call's C forms in, else None
NATIVE_BIND_DIMS = [None]


def bind_dims(views, program, bound=()):
    """The dims of a first call's arrays bound by name, as an op's declaration spells their shapes
    (``_declare.Declaration.dim_program`` builds ``program``); None where any rule fails (the op's
    own checks then decide, and name the error).

    ``program`` is ``(n_vars, entries, relations)``: per array ``(slot, dims, dtypes, contig)``,
    its view ``views[slot]``, which must be given and of rank ``len(dims)``, dim k binding var
    ``dims[k]`` (the first array to name a var binds it, every later one must agree); ``dtypes``
    the dtypes it may have (empty: any), each a dtype or the slot of the array whose dtype it may
    have; ``contig`` 0 none, 1 stride 1 in its last dim (or no elements there), 2 C-contiguous.
    ``relations``: ``(v, a, b, k)``, var v == var a + var b + k (b < 0: no var b). ``bound``:
    the values of vars 0, 1, ... bound first (scalars such as ``page_size``; not negative).
    Returns the vars' values (-1: not bound). The C form answers in one call (None: this loop
    decides, and is the C form's oracle)."""
    native = NATIVE_BIND_DIMS[0]
    if native is not None:
        found = native(views, program, tuple(bound))
        if found is not None:
            return found
    n_vars, entries, relations = program
    if len(bound) > n_vars or any(value < 0 for value in bound):
        return None
    found = [*bound] + [-1] * (n_vars - len(bound))
    for slot, dims, dtypes, contig in entries:
        v = views[slot]
        if v is None or len(v.shape) != len(dims) or len(v.strides) != len(dims):
            return None
        for var, n in zip(dims, v.shape):
            if found[var] < 0:
                found[var] = n
            elif found[var] != n:
                return None
        if dtypes and not _dtype_allowed(v.dtype, dtypes, views):
            return None
        if contig == 1 and v.size and v.shape[-1] > 1 and v.strides[-1] != 1:
            return None
        if contig == 2 and not v.is_c_contiguous():
            return None
    for var, a, b, k in relations:
        if min(found[var], found[a]) < 0 or (b >= 0 and found[b] < 0):
            return None
        if found[var] != found[a] + (found[b] if b >= 0 else 0) + k:
            return None
    return tuple(found)


def _dtype_allowed(dtype, dtypes, views):
    """Whether ``dtype`` is one of ``dtypes`` (a slot: the dtype of that view, if given)."""
    for d in dtypes:
        if d.__class__ is int:
            if views[d] is None:
                return None  # the C form's answer too: a rule naming a missing array fails
            d = views[d].dtype
        if dtype == d:
            return True
    return False


# the C replay's gather_strides where _native routes the first call's C forms in, else None
NATIVE_GATHER = [None]


def gather_strides(views, program):
    """The strides a parameter record takes from a first call's ``views``: ``program`` is a tuple
    of ``(slot, axis)`` pairs, each the stride of ``views[slot]`` along ``axis``, or 0 where
    ``slot`` is negative or that view is None (an optional array not given). The C form answers
    in one call (None: this loop decides, and is the C form's oracle)."""
    native = NATIVE_GATHER[0]
    if native is not None:
        found = native(views, program)
        if found is not None:
            return found
    out = []
    for slot, axis in program:
        v = None if slot < 0 else views[slot]
        out.append(0 if v is None else v.strides[axis])
    return tuple(out)


# the C replay's max_span where _native routes the first call's C forms in, else None
NATIVE_MAX_SPAN = [None]


def max_span(views):
    """The widest byte span (``hi - lo`` of :attr:`ArrayView.span`) among ``views`` (None: not
    given; 0 for none), or -1 where a given view is empty. A non-empty view's span is at least
    the sum over its dims of ``|stride| x (extent - 1)`` elements, so it bounds every element
    offset its strides reach from its pointer (an empty one's does not). The C form answers in
    one call (None: this loop)."""
    native = NATIVE_MAX_SPAN[0]
    if native is not None:
        found = native(views)
        if found is not None:
            return found
    widest = 0
    for v in views:
        if v is not None:
            if not v.size:
                return -1
            lo, hi = v.span
            widest = max(widest, hi - lo)
    return widest


_new = object.__new__
# the C replay's view_fields (ropekv/_native.c) once it is loaded: the fields of an ArrayView of a
# CuPy array or torch tensor its struct reads take, read in one call (None for any other)
_VIEW_FIELDS = [None]
# the C replay's read_views where _native routes the first call's C forms in, else None: a first
# call's arguments read in one call (read_arguments)
NATIVE_READ = [None]


def _struct_view(fields, name, dtype, array):
    """The view of a device array from ``_VIEW_FIELDS[0](array)`` (``dtype`` its NumPy dtype)."""
    v = _new(ArrayView)
    v.ptr, v.shape, v.strides, _, v.device, v.size, lo, hi = fields
    v.name, v.dtype, v.span = name, dtype, (lo, hi)
    v.readonly = v.legacy = False
    v.owner = v.array = array
    v.host = None
    return v


def _element_strides(name, byte_strides, itemsize):
    if itemsize == 1:
        return tuple(byte_strides)
    out = []
    for s in byte_strides:
        if s % itemsize:
            raise BufferError(
                f"{name} has a byte stride of {s}, not a multiple of its item size "
                f"{itemsize}; ropekv cannot address it"
            )
        out.append(s // itemsize)
    return tuple(out)


def _from_numpy(a, name):
    return ArrayView(
        name,
        a.ctypes.data,
        a.shape,
        _element_strides(name, a.strides, a.itemsize),
        a.dtype,
        HOST,
        readonly=not a.flags.writeable,
        owner=a,
        host=a,
        array=a,
    )


def _from_cupy(a, name):
    """The view of a CuPy array: read from its struct where the C replay's ``view_fields`` takes
    it, else from its attributes."""
    if KNOWN_TYPES[0] is _Never:
        _note_type(type(a), "cupy")
    fields = None if _VIEW_FIELDS[0] is None else _VIEW_FIELDS[0](a)
    if fields is not None:  # read from its struct
        return _struct_view(fields, name, fields[3], a)
    return _cupy_attributes(a, name)


def _cupy_attributes(a, name):
    """The view of a CuPy array read from its attributes (no struct read): one pass over the byte
    strides gives the element strides, the size and the byte span (_element_strides, _extent and
    the view built without the keyword handling of a class call, in one)."""
    data, item = a.data, a.itemsize
    shape, byte_strides = a.shape, a.strides
    strides = []
    size = 1
    lo = hi = 0  # bytes
    for n, s in zip(shape, byte_strides):
        if s % item:
            _element_strides(name, byte_strides, item)  # raises, naming the stride
        strides.append(s // item)
        size *= n
        if s < 0:
            lo += (n - 1) * s
        else:
            hi += (n - 1) * s
    v = _new(ArrayView)
    v.name, v.ptr, v.shape, v.strides = name, data.ptr, shape, tuple(strides)
    v.dtype, v.device, v.readonly, v.legacy = a.dtype, data.device_id, False, False
    v.owner = v.array = a
    v.host = None
    v.size, v.span = size, (lo, hi + item)
    return v


# ---- torch tensors, read from their attributes (torch is only ever touched when passed one) ----

_TORCH_NAMES = {
    "float16": FLOAT16,
    "bfloat16": BFLOAT16,
    "float32": FLOAT32,
    "float64": np.dtype(np.float64),
    "float8_e4m3fn": FLOAT8_E4M3FN,
    "float8_e5m2": FLOAT8_E5M2,
    "int8": np.dtype(np.int8),
    "int16": np.dtype(np.int16),
    "int32": INT32,
    "int64": INT64,
    "uint8": UINT8,
    "uint16": np.dtype(np.uint16),
    "uint32": UINT32,
    "uint64": np.dtype(np.uint64),
    "bool": np.dtype(np.bool_),
}
_TORCH_TO_NUMPY = {}  # torch.dtype -> numpy dtype, filled on the first torch tensor
_NUMPY_TO_TORCH = {}


def _torch_maps():
    if not _TORCH_TO_NUMPY:
        torch = sys.modules["torch"]
        for name, dtype in _TORCH_NAMES.items():
            if hasattr(torch, name):
                _TORCH_TO_NUMPY[getattr(torch, name)] = dtype
                _NUMPY_TO_TORCH[dtype] = getattr(torch, name)
    return _TORCH_TO_NUMPY


def torch_dtype(dtype):
    """The torch dtype of a NumPy dtype (torch already imported by the caller)."""
    _torch_maps()
    return _NUMPY_TO_TORCH[np.dtype(dtype)]


def null_message(name, shape, what="a null data pointer"):
    return (
        f"{name} has {what} but shape {tuple(shape)} (a tensor without memory: a zero tensor, "
        f"a freed or resized storage, a meta tensor); pass an array whose memory exists"
    )


TRACED_TORCH = (
    "{name} is a {what}: ropekv's eager ops launch kernels on real memory and cannot run inside "
    "torch.compile / torch.func tracing. Inside compiled code call the ops ropekv.torch registers "
    "(torch.ops.ropekv.*, see docs/frameworks.md)"
)
TRACED_JAX = (
    "{name} is a JAX tracer ({cls}): ropekv's eager ops launch kernels on real memory and cannot "
    "run inside jax.jit / jax.vmap / jax.grad tracing. Inside traced code use ropekv.jax (its "
    "functions are jax.jit-able, see docs/frameworks.md)"
)

_VERIFIED_TORCH_DEVICES = set()  # devices whose torch struct reads agreed with the attributes


def _verified_fields(t, fields):
    """The struct read ``fields`` of ``t`` when they agree with its attributes on the first tensor
    of each device (the offsets were probed on one device); else the torch struct reads are turned
    off for the process (``_native.torch_reads_failed``) and None: the attributes read it."""
    device = fields[4]
    if device in _VERIFIED_TORCH_DEVICES:
        return fields
    want = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.get_device(), t.is_cuda)
    got = (fields[0], fields[1], fields[2], device, True)
    if got == want:
        _VERIFIED_TORCH_DEVICES.add(device)
        return fields
    from ropekv import _native

    _native.torch_reads_failed(
        f"a struct read on CUDA device {device} gave {got[:4]}, the attributes {want[:4]}"
    )
    return None


def _traced_torch(t, torch):
    """What tracing tensor ``t`` is (a FakeTensor, a functional or functorch wrapper), or None."""
    cls = type(t)
    if cls is not torch.Tensor and cls.__module__.startswith("torch._subclasses"):
        return f"{cls.__name__} (a tracing tensor)"
    c = torch._C
    if getattr(c, "_functorch", None) is not None and c._functorch.is_functorch_wrapped_tensor(t):
        return "torch.func wrapper tensor (vmap / grad / functionalize)"
    if torch._is_functional_tensor(t):
        return "functional tensor (torch.func.functionalize / torch.compile)"
    return None


def _from_torch(t, name):
    fields = None if _VIEW_FIELDS[0] is None else _VIEW_FIELDS[0](t)
    if fields is not None and fields[4] >= 0:  # a plain strided GPU tensor, read from its struct
        dtype = (_TORCH_TO_NUMPY or _torch_maps()).get(fields[3])
        if dtype is not None and _verified_fields(t, fields) is not None:
            if fields[0] == 0 and fields[5]:
                raise BufferError(null_message(name, fields[1]))
            return _struct_view(fields, name, dtype, t)
    torch = sys.modules["torch"]
    traced = _traced_torch(t, torch)
    if traced is not None:
        raise TypeError(TRACED_TORCH.format(name=name, what=traced))
    dtype = (_TORCH_TO_NUMPY or _torch_maps()).get(t.dtype)
    if dtype is None:
        raise TypeError(f"{name} has torch dtype {t.dtype}, which ropekv does not read")
    if t.layout != torch.strided:
        raise BufferError(f"{name} is a {t.layout} tensor; ropekv reads strided tensors only")
    if t.is_nested:
        raise BufferError(f"{name} is a nested tensor; ropekv reads strided tensors only")
    if t.is_neg() or t.is_conj():
        raise BufferError(
            f"{name} carries a lazy negation/conjugation bit; pass "
            f"{name}.resolve_neg() / .resolve_conj()"
        )
    if KNOWN_TYPES[1] is _Never:
        _note_type(type(t), "torch")
    try:
        ptr, shape, strides = t.data_ptr(), tuple(t.shape), tuple(t.stride())
        storage = t.untyped_storage()
        base, nbytes = storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError) as exc:
        raise BufferError(f"{name} has no storage ropekv can read: {exc}") from None
    size, (lo, hi) = _extent(shape, strides, dtype.itemsize)
    if size:
        if not ptr or not base:
            raise BufferError(null_message(name, shape))
        first = ptr - base + lo  # the bytes of the storage the tensor touches: [first, end)
        if first < 0 or first + (hi - lo) > nbytes:
            raise BufferError(
                f"{name} (shape {shape}, strides {strides}, storage offset "
                f"{t.storage_offset()}) reaches bytes [{first}, {first + hi - lo}) of its "
                f"storage, which holds {nbytes} bytes; pass a tensor within its storage"
            )
    device = t.get_device()
    if device >= 0 and not t.is_cuda:
        raise BufferError(
            f"{name} is on torch device {t.device}; ropekv accepts CPU and CUDA tensors"
        )
    if device < 0:
        if t.device.type != "cpu":
            raise BufferError(
                f"{name} is on torch device {t.device}; ropekv accepts CPU and CUDA tensors"
            )
        host = _host_array(ptr, shape, tuple(s * dtype.itemsize for s in strides), dtype, False)
        return ArrayView(name, ptr, shape, strides, dtype, HOST, owner=t, host=host, array=t)
    v = _new(ArrayView)  # no keyword handling of a class call: every tensor of a first call
    v.name, v.ptr, v.shape, v.strides, v.dtype, v.device = name, ptr, shape, strides, dtype, device
    v.readonly = v.legacy = False
    v.owner = v.array = t
    v.host = None
    v.size, v.span = size, (lo, hi)
    return v


# ---- __cuda_array_interface__ (JAX buffer_callback buffers, Numba, ...) ------------------------


def _from_cai(obj, name, cai, stream_ptr):
    try:
        shape = tuple(int(n) for n in cai["shape"])
        ptr, readonly = cai["data"]
        typestr = cai["typestr"]
    except Exception as exc:
        raise BufferError(f"{name}: malformed __cuda_array_interface__: {exc}") from exc
    dtype = np.dtype(typestr) if typestr[1:2] in ("f", "i", "u", "b") else None
    if dtype is None or dtype.kind == "V":  # bfloat16 / float8 have no typestr: ask the object
        try:
            dtype = np.dtype(obj.dtype)
        except Exception as exc:
            raise TypeError(
                f"{name}: __cuda_array_interface__ typestr {typestr!r} names no dtype "
                f"ropekv reads, and the object has no usable .dtype"
            ) from exc
    byte_strides = cai.get("strides")
    if byte_strides is None:
        strides, acc = [], 1
        for n in reversed(shape):
            strides.append(acc)
            acc *= n
        strides = tuple(reversed(strides))
    else:
        strides = _element_strides(name, byte_strides, dtype.itemsize)
    mask = cai.get("mask")
    if mask is not None:
        raise BufferError(
            f"{name} has a __cuda_array_interface__ mask; ropekv reads unmasked arrays only"
        )
    ptr = int(ptr or 0)
    # CAI v3: an int stream the producer's work is on (1: the legacy default stream, 2: the
    # per-thread default stream; 0 is not allowed), or None: no synchronization needed. The
    # launch stream waits for it before the launch (_launch.wait_producers), whatever stream
    # the call launches on.
    producer_stream = cai.get("stream")
    if producer_stream is not None and (
        producer_stream.__class__ is bool
        or not isinstance(producer_stream, int | np.integer)
        or producer_stream <= 0
    ):
        raise BufferError(
            f"{name}: malformed __cuda_array_interface__: stream must be None or a positive "
            f"int (1: legacy default stream, 2: per-thread default stream), got "
            f"{producer_stream!r}"
        )
    if not ptr:
        if math.prod(shape):
            raise BufferError(null_message(name, shape))
        device = _cai_current_device()
    else:
        device = _cai_device(ptr)
    return ArrayView(
        name,
        ptr,
        shape,
        strides,
        dtype,
        device,
        readonly=bool(readonly),
        owner=obj,
        array=obj,
        wait=None if producer_stream is None else int(producer_stream),
    )


def _cai_device(ptr):
    """The CUDA device of a device pointer."""
    import cupy

    return cupy.cuda.runtime.pointerGetAttributes(ptr).device


def _cai_current_device():
    import cupy

    return cupy.cuda.runtime.getDevice()


def _consumer_stream(stream_ptr, device, arrays=None):
    """The stream a DLPack producer on CUDA device ``device`` orders its work before: the launch
    stream, ``stream_ptr`` when given, else the stream rule's on that device (torch's current
    stream when ``arrays`` holds a torch tensor, else CuPy's). In the protocol's spelling: 1 is
    the legacy default stream, 0 is not allowed."""
    if stream_ptr is None:
        from ropekv import _launch

        if arrays is not None and any(is_torch(a) for a in arrays):
            stream_ptr = _launch._torch_stream_ptr(device)
        else:
            stream_ptr = _launch.current_stream_ptr(device)
    return stream_ptr if stream_ptr else 1


def _get_capsule(obj, name, device_type, stream_ptr, device_id=-1, arrays=None):
    kwargs = {}
    if device_type in (_DL_CUDA, _DL_CUDA_MANAGED):
        kwargs["stream"] = _consumer_stream(stream_ptr, device_id, arrays)
    try:
        return obj.__dlpack__(max_version=(1, 1), **kwargs)
    except TypeError:
        # Producers older than the DLPack 1.0 Python API take no max_version.
        try:
            return obj.__dlpack__(**kwargs)
        except Exception as exc:
            raise BufferError(f"{name}: __dlpack__() failed: {exc}") from exc
    except Exception as exc:
        raise BufferError(f"{name}: __dlpack__() failed: {exc}") from exc


def _host_array(ptr, shape, byte_strides, dtype, readonly):
    """A NumPy array aliasing host memory at ``ptr`` (no copy)."""
    if any(n == 0 for n in shape):
        return np.empty(shape, dtype)
    lo = sum((n - 1) * s for n, s in zip(shape, byte_strides) if s < 0)
    hi = sum((n - 1) * s for n, s in zip(shape, byte_strides) if s > 0)
    buf = (ctypes.c_char * (hi - lo + dtype.itemsize)).from_address(ptr + lo)
    base = np.frombuffer(buf, np.uint8)
    flat = np.ndarray(shape, dtype, buffer=base, offset=-lo, strides=byte_strides)
    if readonly:
        flat.flags.writeable = False
    return flat


def _from_dlpack(obj, name, stream_ptr, arrays=None):
    try:
        device_type, device_id = (int(x) for x in obj.__dlpack_device__())
    except Exception as exc:
        raise BufferError(f"{name}: __dlpack_device__() failed: {exc}") from exc
    if device_type not in (_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED):
        raise BufferError(
            f"{name} lives on DLPack device type {device_type}; ropekv accepts CPU "
            f"(1), CUDA (2), CUDA host (3) and CUDA managed (13) memory"
        )
    capsule = _get_capsule(obj, name, device_type, stream_ptr, device_id, arrays)
    if _capsule_is_valid(capsule, b"dltensor_versioned"):
        managed = _DLManagedTensorVersioned.from_address(
            _capsule_get_pointer(capsule, b"dltensor_versioned")
        )
        if managed.major != 1:
            raise BufferError(
                f"{name}: DLPack version {managed.major}.{managed.minor} is not "
                f"supported (ropekv reads 1.x)"
            )
        flags = managed.flags
    elif _capsule_is_valid(capsule, b"dltensor"):
        managed = _DLManagedTensor.from_address(_capsule_get_pointer(capsule, b"dltensor"))
        flags = None  # a legacy capsule says nothing about read-only memory
    else:
        raise BufferError(f"{name}: __dlpack__() returned {capsule!r}, not a DLPack capsule")
    t = managed.dl_tensor
    code, bits, lanes = t.dtype.code, t.dtype.bits, t.dtype.lanes
    dtype = _DL_DTYPES.get((code, bits))
    if dtype is None or lanes != 1:
        raise TypeError(
            f"{name} has DLPack dtype (code={code}, bits={bits}, lanes={lanes}), "
            f"which ropekv does not read"
        )
    shape = tuple(t.shape[i] for i in range(t.ndim))
    if t.strides:
        strides = tuple(t.strides[i] for i in range(t.ndim))
    else:
        strides, acc = [], 1
        for n in reversed(shape):
            strides.append(acc)
            acc *= n
        strides = tuple(reversed(strides))
    if not t.data and math.prod(shape):
        raise BufferError(null_message(name, shape))
    ptr = (t.data or 0) + t.byte_offset
    legacy = flags is None
    readonly = not legacy and bool(flags & (_DL_FLAG_READ_ONLY | _DL_FLAG_IS_COPIED))
    writeable = getattr(obj, "writeable", None)
    if legacy and isinstance(writeable, bool):
        # the producer says it itself (JAX's buffer_callback Buffers: outputs are writeable)
        legacy, readonly = False, not writeable
    if device_type in (_DL_CPU, _DL_CUDA_HOST):
        byte_strides = tuple(s * dtype.itemsize for s in strides)
        host = _host_array(ptr, shape, byte_strides, dtype, readonly)
        return ArrayView(
            name,
            ptr,
            shape,
            strides,
            dtype,
            HOST,
            readonly=readonly,
            owner=(obj, capsule),
            host=host,
            array=obj,
            legacy=legacy,
        )
    return ArrayView(
        name,
        ptr,
        shape,
        strides,
        dtype,
        device_id,
        readonly=readonly,
        owner=(obj, capsule),
        array=obj,
        legacy=legacy,
    )


def is_cupy(obj):
    return type(obj).__module__.startswith("cupy")


def is_torch(obj):
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def as_view(obj, name, stream_ptr=None, arrays=None):
    """Wrap ``obj`` (NumPy, CuPy, torch, ``__cuda_array_interface__`` or DLPack array) as an
    :class:`ArrayView`, zero-copy.

    ``stream_ptr`` is the CUDA stream ropekv will launch on (None: the stream rule's, on the
    array's device, which ``arrays``, the call's arguments, decide): a DLPack producer is asked
    to order its pending work before it; a CAI producer's stream is noted on the view
    (``wait``), for the launch stream to wait for (the stream protocols).
    """
    cls = obj.__class__
    if cls is KNOWN_TYPES[0]:
        return _from_cupy(obj, name)
    if cls is KNOWN_TYPES[1]:
        return _from_torch(obj, name)
    if cls is ArrayView:
        return obj
    if isinstance(obj, np.ndarray):
        return _from_numpy(obj, name)
    if is_cupy(obj) and hasattr(obj, "data") and hasattr(obj, "device"):
        return _from_cupy(obj, name)
    if is_torch(obj):
        return _from_torch(obj, name)
    jax = sys.modules.get("jax")
    if jax is not None:
        if isinstance(obj, jax.core.Tracer):
            raise TypeError(TRACED_JAX.format(name=name, cls=type(obj).__name__))
        if isinstance(obj, jax.Array):
            # DLPack, not its __cuda_array_interface__: that one (version 2, no stream) is
            # exported while the array's transfer or computation may still be running (JAX
            # dispatches asynchronously), so a kernel could read memory not yet written; JAX's
            # __dlpack__(stream=) makes the launch stream wait for that work
            return _from_dlpack(obj, name, stream_ptr, arrays)
    try:  # (a producer may raise its own error, not AttributeError, for a dtype CAI cannot spell)
        cai = getattr(obj, "__cuda_array_interface__", None)
    except Exception:  # noqa: BLE001 - then DLPack it is
        cai = None
    if cai is not None:
        return _from_cai(obj, name, cai, stream_ptr)
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        return _from_dlpack(obj, name, stream_ptr, arrays)
    raise TypeError(
        f"{name} must be a NumPy array, a CuPy array, a torch tensor or an object with "
        f"__cuda_array_interface__ or __dlpack__, got "
        f"{type(obj).__module__}.{type(obj).__qualname__}"
    )


def read_arguments(arrays, names, stream_ptr=None):
    """A first call's arguments read in one pass: ``(views, kinds, misaligned)``, the
    :func:`as_view` of each array of ``arrays`` (named by ``names``; None stays None), the OR of
    their kinds (``CUPY`` / ``TORCH`` / ``OTHER``, as :func:`signature` gives them) and the device
    arrays whose pointer is no multiple of their item size, in argument order (None when there is
    none: the caller checks those once every argument is read, as it would in a pass of its own).

    CuPy arrays and torch tensors of the exact base types go to their readers directly, a CuPy
    array straight to its struct read when the C replay has one (a first call reads every
    argument: a call less per array). Where the C replay's ``read_views`` is routed in
    (:data:`NATIVE_READ`), it reads the whole call when every array is None, a CuPy array or a
    torch tensor its struct reads take; else this loop does."""
    fast = NATIVE_READ[0]
    if fast is not None:
        read = fast(arrays, names, _TORCH_TO_NUMPY, _VERIFIED_TORCH_DEVICES)
        if read is not None:
            if KNOWN_TYPES[0] is _Never or KNOWN_TYPES[1] is _Never:
                for a in arrays:
                    if a is not None:
                        _note_type(type(a), "torch" if is_torch(a) else "cupy")
            return read
    (cupy_array, torch_tensor), fields_of = KNOWN_TYPES, _VIEW_FIELDS[0]
    views, kinds, misaligned = [], 0, None
    for a, name in zip(arrays, names):
        if a is None:
            views.append(None)
            continue
        cls = a.__class__
        if cls is cupy_array:
            fields = None if fields_of is None else fields_of(a)
            v = (
                _cupy_attributes(a, name)
                if fields is None
                else _struct_view(fields, name, fields[3], a)
            )
            kinds |= CUPY
        elif cls is torch_tensor:
            v = _from_torch(a, name)
            kinds |= TORCH
        else:
            v = as_view(a, name, stream_ptr, arrays)
            kinds |= TORCH if is_torch(a) else CUPY if is_cupy(a) else OTHER
        if v.device != HOST and v.ptr % v.dtype.itemsize:
            misaligned = [v] if misaligned is None else [*misaligned, v]
        if not v.ptr and v.size:  # (a null pointer is aligned: this is its one check)
            raise BufferError(null_message(name, v.shape))
        views.append(v)
    return views, kinds, misaligned


# ---- layout signatures: the key of a launch plan ---------------------------------------------
# CuPy arrays and torch tensors of the exact base types are read inline (the Python replay of a plan
# costs little more than these attribute reads; the C replay, _native.c, reads the same keys);
# any other object goes through as_view.

CUPY, TORCH, OTHER = 1, 2, 4  # kinds of array in a call, OR-ed together


class _Never:  # stands for cupy.ndarray / torch.Tensor until the caller first passes one
    pass


# [cupy.ndarray, torch.Tensor], each _Never until the caller first passes one (_note_type): the
# one record of them, which the C replay holds too (_launch.native_hooks)
KNOWN_TYPES = [_Never, _Never]


# [torch.compiler] once a torch tensor was seen: every call reads its _is_compiling_flag, True
# while Dynamo traces (an eager op cannot run there: _launch.Op.__call__ says what can)
TORCH_COMPILER = [None]


if "torch" in sys.modules and hasattr(
    getattr(sys.modules["torch"], "compiler", None), "_is_compiling_flag"
):
    TORCH_COMPILER[0] = sys.modules["torch"].compiler


def _note_type(cls, kind):
    if kind == "cupy" and KNOWN_TYPES[0] is _Never:
        KNOWN_TYPES[0] = sys.modules["cupy"].ndarray
    elif kind == "torch" and KNOWN_TYPES[1] is _Never:
        torch = sys.modules["torch"]
        KNOWN_TYPES[1] = torch.Tensor
        compiler = getattr(torch, "compiler", None)
        if hasattr(compiler, "_is_compiling_flag"):
            TORCH_COMPILER[0] = compiler


def signature(arrays, names=None, stream_ptr=None):
    """``(key, ptrs, kinds, keep)`` of a call's array arguments (None allowed): ``key`` holds every
    array's layout (shape, strides, dtype, device, pointer alignment; for other producers also the
    read-only and legacy-capsule flags), never its identity or address. ``ptrs`` the data pointers
    (0 for None), ``kinds`` the OR of CUPY / TORCH / OTHER, ``keep`` the views of other producers
    (their capsules must live until the launch; None when there is none). Host arrays give device
    -1 in the key.

    The one implementation of the layout key in Python (the C replay, ``_native.c``, builds the
    same keys; tests check both agree). It runs on every call the C replay does not take: CuPy
    arrays and torch tensors of the exact base types are read inline, in one loop; anything else
    goes through :func:`as_view`, or, when ``names`` is None (the replay's first try), gives None
    at once: the caller then reads the call again with the arguments' ``names``."""
    cupy_array, torch_tensor = KNOWN_TYPES
    n = len(arrays)
    key, ptrs, kinds, keep = [None] * n, [0] * n, 0, None  # None: key None, pointer 0
    for i, a in enumerate(arrays):
        cls = a.__class__
        if cls is cupy_array:
            data = a.data
            ptrs[i] = p = data.ptr
            key[i] = (a.shape, a.strides, a.dtype, p & 15 if p else 16, data.device_id)
            kinds |= CUPY
            continue
        if a is None:
            continue
        # a torch tensor of the base type: its is_cuda first (a tensor of another device type
        # never shares a CUDA plan); a lazy negation (not in the key: the first-call path refuses
        # it) or a tensor without storage (data_ptr() raises RuntimeError: the first-call path
        # names it) is read as another kind is, below
        if cls is torch_tensor:
            try:
                if not a.is_neg():
                    ptrs[i] = p = a.data_ptr()
                    key[i] = (
                        a.is_cuda,
                        a.shape,
                        a.stride(),
                        a.dtype,
                        p & 15 if p else 16,
                        a.get_device(),
                    )
                    kinds |= TORCH
                    continue
            except RuntimeError:
                pass
        if names is None:
            return None
        v = as_view(a, names[i], stream_ptr, arrays)
        if cls is not torch_tensor and cls in KNOWN_TYPES:
            # the first CuPy array / torch tensor ever seen (now known): read again
            return signature(arrays, names, stream_ptr)
        ptrs[i] = p = v.ptr
        key[i] = (2, v.shape, v.strides, v.dtype, p & 15 if p else 16, v.device) + (
            v.readonly,
            v.legacy,
        )
        kinds |= TORCH if is_torch(a) else CUPY if is_cupy(a) else OTHER
        keep = [v] if keep is None else [*keep, v]
    return tuple(key), ptrs, kinds, keep
