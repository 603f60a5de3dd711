"""The one call path of every op: intake, validation on the first call of a layout, a launch plan,
and its replay.

An op module declares an :class:`Op`: the names of its array arguments and a ``prepare`` function
that validates the arrays of a first call and returns a :class:`Plan` (its kernel launches with
their parameter records, the outputs to allocate, which arguments it writes, what it returns).
Everything else lives here, once for every op:

* the plan cache, keyed by the flags and the layout of every array (shape, strides, dtype, device,
  pointer alignment; :func:`ropekv._arrays.signature`; the C replay builds the same keys), never by object identity or address; a call repeating
  the newest replay's key (an engine's layers) is matched by value before any hashing of layouts;
* the checks every op shares (read-only, legacy DLPack capsules, element alignment, written
  arrays' strides, overlap between written arrays and every other argument), run on the first
  call of a layout; on replay, overlap is re-checked from the pointers alone;
* the stream rule: ``stream=`` when given, else torch's current stream on the arrays' device when
  any argument is a torch tensor, else CuPy's current stream on that device;
* the launch: the driver's ``cuLaunchKernel`` (``cuLaunchKernelEx`` with programmatic dependent
  launch when asked) on a parameter record whose pointer fields are refilled per call;
* the replay in C (``_native.c``, built on first use by ``_native.py``; Python when it cannot be
  built): a repeated call of a known layout, with CuPy arrays or torch tensors, is read, matched,
  checked for overlap and launched there (kernels and cuBLAS GEMMs), with the same keys, plans
  and stream rule as the Python replay below (which serves everything else: first calls, other
  array kinds, arrays whose ranges touch a written one);
* multi-layer caches (``docs/conventions.md``): an op names the arguments that may carry a leading
  ``(num_layers, ...)`` dimension (``Op(..., layered=...)``); a call with ``layer_idx`` validates
  the arrays of that layer (its ``prepare`` never sees the layer dimension), and its plan, keyed
  by layout as any other, serves every layer: a replay checks ``layer_idx`` against the layer count
  and adds ``layer_idx`` times each array's layer stride to its pointer (:class:`Layers`).
"""

from __future__ import annotations

import ctypes
import functools
import math
import operator
import struct
import sys
import threading
from itertools import compress, repeat
from operator import is_not
from typing import ClassVar

import numpy as np

from ropekv import _arrays as ar
from ropekv import _checks as ck
from ropekv._arrays import signature
from ropekv._compile import get_kernel
from ropekv._env import CHECK_INDICES_KEY, EMPTY_KEY, OFF, _raw_get  # ROPEKV_CHECK_INDICES

# ---------------------------------------------------------------------------------- streams


class _RawStream:
    """A raw ``cudaStream_t`` spelled in the CUDA stream protocol."""

    def __init__(self, ptr):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


def stream_ptr_of(stream):
    """The raw pointer of a ``stream=`` argument: a CuPy stream, an int ``cudaStream_t``, or any
    object with ``__cuda_stream__`` / ``cuda_stream`` (``torch.cuda.Stream``). None stays None."""
    if stream is None:
        return None
    if isinstance(stream, (int, np.integer)) and not isinstance(stream, bool):
        return int(stream)
    if hasattr(stream, "ptr"):
        return int(stream.ptr)
    if hasattr(stream, "__cuda_stream__"):
        return int(stream.__cuda_stream__()[1])
    if hasattr(stream, "cuda_stream"):
        return int(stream.cuda_stream)
    raise TypeError(
        f"stream must be None, a CuPy stream, an int cudaStream_t or an object with "
        f"__cuda_stream__ / cuda_stream, got {type(stream).__qualname__}"
    )


def current_stream_ptr(device=-1):
    """CuPy's current stream on ``device`` (-1: the current device)."""
    global _cupy_current_stream
    if _cupy_current_stream is None:
        import cupy

        _cupy_current_stream = cupy.cuda.get_current_stream
    return _cupy_current_stream(device).ptr


_cupy_current_stream = None  # cupy.cuda.get_current_stream, bound on the first call
_torch_raw_stream = None  # torch's current raw stream of a device, bound on the first call


def _torch_stream_ptr(device):
    global _torch_raw_stream
    if _torch_raw_stream is None:
        torch = sys.modules["torch"]
        _torch_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if _torch_raw_stream is None:  # the private accessor moved: the public one costs more
            _torch_raw_stream = lambda d: torch.cuda.current_stream(d).cuda_stream
    return _torch_raw_stream(device)


@functools.lru_cache(maxsize=64)
def cupy_stream(ptr, device):
    """A CuPy stream object for a raw pointer (for CuPy allocations and cuBLAS on it)."""
    import cupy

    if hasattr(cupy.cuda.Stream, "from_external"):  # CuPy 14+
        with cupy.cuda.Device(device):
            return cupy.cuda.Stream.from_external(_RawStream(ptr))
    return cupy.cuda.ExternalStream(ptr, device)


# ---------------------------------------------------------------------------------- records


class ParamStruct:
    """A C parameter struct passed by value, declared once as ``[(name, numpy type), ...]``.

    The field order and types must match the struct in the ``.cu`` file; ``tests/test_compile.py``
    checks that they do. Pointers are ``np.uint64`` and come first: a launch refills them per call
    and keeps the rest of the record.
    """

    _CODES: ClassVar[dict[str, str]] = {"u8": "Q", "i8": "q", "i4": "i", "u4": "I", "f4": "f"}

    def __init__(self, c_name, fields):
        self.c_name = c_name
        self.fields = tuple(fields)
        self.names = tuple(n for n, _ in self.fields)
        self.dtype = np.dtype(list(self.fields), align=True)
        fmt, end = "=", 0
        for name in self.names:
            field_dtype, offset = self.dtype.fields[name][:2]
            fmt += "x" * (offset - end) + self._CODES[field_dtype.str[1:]]
            end = offset + field_dtype.itemsize
        self._struct = struct.Struct(fmt + "x" * (self.dtype.itemsize - end))
        kinds = [np.dtype(t) == np.uint64 for _, t in self.fields]
        n = self.n_pointers = kinds.index(False) if False in kinds else len(kinds)
        if any(kinds[n:]):
            raise ValueError(f"{c_name}: pointer fields must come first")
        # the record past its pointer fields (8 bytes each, first, so no padding before the rest),
        # packed from a dict of values: made once per struct, as a first call packs a record
        self.pointer_names, rest = self.names[:n], self.names[n:]
        self._tail_struct = struct.Struct("=" + fmt[1 + n :] + "x" * (self.dtype.itemsize - end))
        self._rest = (
            operator.itemgetter(*rest)
            if len(rest) > 1
            else (lambda values, name=rest[0]: (values[name],))
            if rest
            else (lambda values: ())
        )
        self.pack_pointers = struct.Struct(f"={n}Q").pack_into

    def pack_values(self, values):
        """The record of the field values, given in declaration order."""
        return self._struct.pack(*values)

    def pack_tail(self, values):
        """The record past its pointer fields, of ``values`` (``{field: value}``, every field
        that is no pointer given)."""
        return self._tail_struct.pack(*self._rest(values))


def division_magic(d):
    """``(magic, shift)`` with ``n // d == (((magic * n) >> 32) + n) >> shift`` for every ``0 <= n <
    2**31`` and ``1 <= d < 2**31`` (the round-up method of Granlund and Montgomery; the kernels'
    ``fast_div`` in common.cuh): ``shift`` is ceil(log2 d), ``magic`` floor(2**32 (2**shift - d) /
    d) + 1, below 2**32. A kernel that divides by a call's constant on its critical path takes
    these as two fields of its record."""
    shift = (d - 1).bit_length()
    return ((1 << 32) * ((1 << shift) - d)) // d + 1, shift


def division_fields(prefix, d):
    """``{prefix_magic, prefix_shift}``: :func:`division_magic` of ``d`` as the two record fields a
    kernel divides by (``d`` 0: both 0, for a record whose kernel does not divide)."""
    magic, shift = division_magic(d) if d else (0, 0)
    return {f"{prefix}_magic": magic, f"{prefix}_shift": shift}


def int32_fields_fit(values, names):
    """Whether the values of ``values`` (``{field: value}``) named in ``names`` all lie within
    +-(2**31 - 1): what a record declaring those fields int32 (the lean kernels' strides) holds;
    a call whose values do not takes the record of 64-bit fields."""
    get = _FIELD_GETTERS.get(names)
    if get is None:  # once per tuple of names (an op's): the values gathered in one C call
        held = [values[n] for n in names]
        if len(names) > 1 and names.__class__ is tuple:
            _FIELD_GETTERS[names] = operator.itemgetter(*names)
    else:
        held = get(values)
    return -(2**31 - 1) <= min(held) and max(held) <= 2**31 - 1


_FIELD_GETTERS = {}  # int32_fields_fit's gathers, by tuple of field names


_launch_kernel = None  # cupy_backends' cuLaunchKernel wrapper, bound on the first launch


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared_mem", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_LaunchAttribute)),
        ("num_attrs", ctypes.c_uint),
    ]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


@functools.cache
def _cu_launch_kernel_ex():
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuLaunchKernelEx
    fn.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


@functools.cache
def function_pointer(stem, expression, device, shared_mem=0):
    """The ``CUfunction`` of a kernel on ``device`` (compiled and loaded on first use; cached, as
    the kernel is: a plan of a new layout looks it up without entering the device)."""
    import cupy

    kernel = get_kernel(stem, expression, device)
    with cupy.cuda.Device(device):
        # past 48 KiB of shared memory a block (static included) needs the kernel's opt-in
        if shared_mem and shared_mem + kernel.shared_size_bytes > 48 * 1024:
            kernel.max_dynamic_shared_size_bytes = shared_mem
        return kernel.kernel.ptr


@functools.cache
def l2_bytes(device):
    """The L2 cache of CUDA device ``device``, in bytes (60 MiB on the H200)."""
    from cupy.cuda import runtime

    return runtime.deviceGetAttribute(runtime.cudaDevAttrL2CacheSize, device)


@functools.cache
def _cu_occupancy_max_active_clusters():
    lib = ctypes.CDLL("libcuda.so.1")
    fn = getattr(lib, "cuOccupancyMaxActiveClusters", None)
    if fn is not None:
        fn.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.POINTER(_LaunchConfig)]
        fn.restype = ctypes.c_int
    return fn


@functools.cache
def max_active_clusters(stem, expression, device, cluster, threads, shared_mem=0):
    """How many clusters of ``cluster`` CTAs of a kernel (its cluster dims compiled in, blocks of
    ``threads``, ``shared_mem`` bytes of dynamic shared memory) ``device`` runs at once
    (``cuOccupancyMaxActiveClusters``), or None where the driver cannot say. A cluster's CTAs
    share one GPC, so this can be less than the SMs' CTAs over ``cluster``: on the H200 (132 SMs)
    at one CTA an SM, 30 clusters of 4 and 15 of 8."""
    import cupy

    query = _cu_occupancy_max_active_clusters()
    if query is None:
        return None
    fn = function_pointer(stem, expression, device, shared_mem)
    config = _LaunchConfig()
    config.grid[:] = (cluster, 1, 1)
    config.block[:] = (threads, 1, 1)
    config.shared_mem = shared_mem
    n = ctypes.c_int(0)
    with cupy.cuda.Device(device):
        if query(ctypes.byref(n), fn, ctypes.byref(config)) != 0:
            return None
    return n.value


def _driver_launch():
    """cupy_backends' ``cuLaunchKernel`` wrapper (a C call, cheaper than ctypes' conversions)."""
    global _launch_kernel
    if _launch_kernel is None:
        from cupy_backends.cuda.api.driver import launchKernel as _launch_kernel
    return _launch_kernel


_get_ident = threading.get_ident
_build_lock = threading.Lock()  # Launch._build
_pack_pointer = struct.Struct("=Q").pack_into


def _given_indices(views, indices):
    """The tuple of ``indices`` whose view is not None, in their order (C-level iteration: a
    first call filters its written arrays with it)."""
    if not indices:
        return ()
    return tuple(compress(indices, map(is_not, map(views.__getitem__, indices), repeat(None))))


def _pointer_slots(names, values, slots):
    """``[(argument, byte offset)]`` of the pointer fields ``names``: each field's slot, and for
    a field without one ``(-1, its value in values, 0 when absent)`` (a slot is a non-empty
    tuple). One map over the names; a loop only where some field lacks a slot."""
    found = list(map(slots.get, names))
    if all(found):
        return found
    get = values.get
    return [s or (-1, int(get(f, 0))) for s, f in zip(found, names)]


class Launch:
    """One kernel launch of a plan: the compiled function on one device, its grid, block and
    parameter record. The record's pointer fields are ``slots``: ``field -> (argument, byte
    offset)``, filled per call with ``ptrs[argument] + offset`` (``ptrs`` lists the call's
    arguments, then its outputs, then 0); a pointer field without a slot keeps ``values[field]``.
    ``tail`` is the record past its pointer fields.

    What the Python replay (:meth:`run`) needs beyond that (the ctypes record, its argument
    vector, the gather of pointers, the bound launch) is built on its first run, or on the first
    read of ``rec``: a plan the C replay serves never needs it, and a first call skips its cost.
    The record lives in the launch and is rewritten by the thread that built it; another thread
    packs a record of its own, so two threads replaying one plan never share one.
    """

    __slots__ = (
        "_rec",
        "argv",
        "argv_ptr",
        "block",
        "config",
        "func",
        "gather",
        "grid",
        "launch",
        "n_ptr",
        "offsets",
        "owner",
        "pack_into",
        "pdl",
        "shared_mem",
        "slots",
        "tail",
    )

    def __init__(
        self, stem, expression, device, grid, block, params, values, slots, shared_mem=0, pdl=False
    ):
        self.func = function_pointer(stem, expression, device, shared_mem)
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.block = tuple(block) + (1,) * (3 - len(block))
        self.shared_mem = shared_mem
        self.n_ptr = params.n_pointers
        self.slots = _pointer_slots(params.pointer_names, values, slots)
        self.tail = params.pack_tail(values)  # every other field, as given
        self.pack_into = params.pack_pointers
        self.pdl = pdl
        self._rec = None  # the Python replay's record and the rest: _build, on the first run

    @property
    def rec(self):
        """The parameter record (a ctypes buffer) the Python replay refills per call."""
        if self._rec is None:
            self._build()
        return self._rec

    def _build(self):
        with _build_lock:  # once, by the first thread: run() reads _rec, set last, unlocked
            if self._rec is not None:
                return
            n = self.n_ptr
            rec = ctypes.create_string_buffer(8 * n + len(self.tail))
            rec[8 * n :] = self.tail  # pointer fields zero, refilled per call
            self.argv = (ctypes.c_void_p * 1)(ctypes.addressof(rec))
            self.argv_ptr = ctypes.addressof(self.argv)
            self.owner = _get_ident()
            # pointer fields = ptrs gathered in one C call, plus the few non-zero offsets
            indices = [a for a, _ in self.slots]
            self.gather = (
                operator.itemgetter(*indices)
                if len(indices) > 1
                else (lambda ptrs, i=indices[0]: (ptrs[i],))
            )
            self.offsets = [(k, o) for k, (_, o) in enumerate(self.slots) if o]
            self.config = self._config() if self.pdl else None
            # the launch with everything but the stream and the record bound
            self.launch = (
                None
                if self.pdl
                else functools.partial(
                    _driver_launch(), self.func, *self.grid, *self.block, self.shared_mem
                )
            )
            self._rec = rec

    def _config(self):
        attr = _LaunchAttribute()
        attr.id = _PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value = (1).to_bytes(4, "little") + bytes(60)
        config = _LaunchConfig()
        config.grid[:] = self.grid
        config.block[:] = self.block
        config.shared_mem = self.shared_mem
        config.attrs = ctypes.pointer(attr)
        config.num_attrs = 1
        config._attr = attr  # keep it alive with the config
        return config

    def run(self, ptrs, stream_ptr):
        rec = self._rec
        if rec is None:
            self._build()
            rec = self._rec
        if _get_ident() == self.owner:
            argv = self.argv
            argv_ptr = self.argv_ptr
        else:  # another thread: a record of its own
            rec = ctypes.create_string_buffer(8 * self.n_ptr + len(self.tail))
            rec[8 * self.n_ptr :] = self.tail
            argv = (ctypes.c_void_p * 1)(ctypes.addressof(rec))
            argv_ptr = ctypes.addressof(argv)
        values = self.gather(ptrs)
        self.pack_into(rec, 0, *values)
        for k, o in self.offsets:  # the few pointer fields at an offset into their argument
            _pack_pointer(rec, 8 * k, values[k] + o)
        if self.launch is not None:
            self.launch(stream_ptr, argv_ptr, 0)
            return
        config = self.config if rec is self._rec else self._config()
        config.stream = stream_ptr
        err = _cu_launch_kernel_ex()(ctypes.byref(config), self.func, argv, None)
        if err:
            _driver_failed(err, "cuLaunchKernelEx")


# ---------------------------------------------------------------------------------- cuBLAS


class Gemm:
    """A cuBLAS step of a plan (``cublasGemmEx``, float32 accumulation): row-major
    ``C (n, m) = B (n, k) @ A (m, k)^T``, operands at ``(argument, byte offset)`` slots of the
    call's pointers, as a :class:`Launch`'s pointer fields. In cuBLAS's column-major terms:
    ``C^T (m x n) = A^T B^T`` with A (k x m, ``lda``) read transposed and B (k x n, ``ldb``).

    Both replays make the same three calls on the calling thread's CuPy cuBLAS handle of the
    plan's device (current during the steps): ``cublasSetStream`` (the launch stream),
    ``cublasSetPointerMode`` (alpha = 1 and beta = 0 on the host), ``cublasGemmEx``. CuPy's own
    cuBLAS calls set the handle's stream again before each call, so nothing of CuPy's is
    disturbed."""

    __slots__ = ("a", "args", "b", "c")

    def __init__(self, a, lda, b, ldb, c, ldc, m, n, k, dtype, c_dtype):
        self.a, self.b, self.c = a, b, c
        self.args = (m, n, k, lda, ldb, ldc, _CUDA_R[dtype], _CUDA_R[c_dtype])

    def run(self, ptrs, stream_ptr):
        set_stream, set_pointer_mode, gemm_ex = _cublas_calls()
        m, n, k, lda, ldb, ldc, ab_type, c_type = self.args
        (a, ao), (b, bo), (c, co) = self.a, self.b, self.c
        handle = _cublas_handle()
        status = (
            set_stream(handle, stream_ptr)
            or set_pointer_mode(handle, 0)
            or gemm_ex(
                handle,
                1,
                0,
                m,
                n,
                k,
                _ALPHA,
                ptrs[a] + ao,
                ab_type,
                lda,
                ptrs[b] + bo,
                ab_type,
                ldb,
                _BETA,
                ptrs[c] + co,
                c_type,
                ldc,
                _CUBLAS_COMPUTE_32F,
                _CUBLAS_GEMM_DEFAULT,
            )
        )
        if status:
            _cublas_failed(status)


_CUDA_R = {ar.FLOAT16: 2, ar.BFLOAT16: 14, ar.FLOAT32: 0}  # cudaDataType
_CUBLAS_COMPUTE_32F = 68
_CUBLAS_GEMM_DEFAULT = -1
_ALPHA_BETA = (ctypes.c_float * 2)(1.0, 0.0)  # CUBLAS_POINTER_MODE_HOST: read at the call
_ALPHA = ctypes.addressof(_ALPHA_BETA)
_BETA = _ALPHA + 4
_CUBLAS_LIB = "libcublas.so"
_CUBLAS_SYMBOLS = ("cublasSetStream_v2", "cublasSetPointerMode_v2", "cublasGemmEx")


def _cublas_handle():
    """The calling thread's CuPy cuBLAS handle of the current device."""
    import cupy

    return cupy.cuda.device.get_cublas_handle()


def _cublas_failed(status):
    """Raise a failed cuBLAS call's error (CuPy's, as its wrappers raise it, where CuPy has it)."""
    try:
        from cupy_backends.cuda.libs.cublas import CUBLASError

        error = CUBLASError(status)
    except Exception:  # noqa: BLE001 - no CuPy cuBLAS to name it: the status alone
        error = RuntimeError(f"cuBLAS failed with status {status}")
    raise error


@functools.cache
def cublas_entry_points():
    """The addresses of ``cublasSetStream_v2``, ``cublasSetPointerMode_v2`` and ``cublasGemmEx`` in
    the cuBLAS library CuPy loaded (a handle of CuPy's is only good with that very library): its
    path in ``/proc/self/maps``, else its soname (``dlopen`` of a loaded library's soname returns
    that library). OSError when CuPy's cuBLAS cannot be loaded or found."""
    try:
        from cupy_backends.cuda.api import runtime
        from cupy_backends.cuda.libs import cublas  # noqa: F401 - loads CuPy's libcublas
    except ImportError as e:
        raise OSError(f"CuPy's cuBLAS cannot be loaded: {e}") from None
    name = f"{_CUBLAS_LIB}.{runtime.runtimeGetVersion() // 1000}"
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(None, 5)  # address perms offset dev inode [path]
                path = fields[5].strip() if len(fields) == 6 else ""
                if path.rsplit("/", 1)[-1].startswith(_CUBLAS_LIB + "."):
                    name = path
                    break
    except OSError:
        pass
    lib = ctypes.CDLL(name)
    return tuple(ctypes.cast(getattr(lib, s), ctypes.c_void_p).value for s in _CUBLAS_SYMBOLS)


_CUBLAS_CALLS = [None]


def _cublas_calls():
    """The three cuBLAS functions of :class:`Gemm` as ctypes calls (the Python replay's)."""
    calls = _CUBLAS_CALLS[0]
    if calls is None:
        c_int, c_void_p = ctypes.c_int, ctypes.c_void_p
        set_stream, set_pointer_mode, gemm_ex = cublas_entry_points()
        calls = _CUBLAS_CALLS[0] = (
            ctypes.CFUNCTYPE(c_int, c_void_p, c_void_p)(set_stream),
            ctypes.CFUNCTYPE(c_int, c_void_p, c_int)(set_pointer_mode),
            ctypes.CFUNCTYPE(
                c_int,
                c_void_p,
                c_int,
                c_int,
                c_int,
                c_int,
                c_int,
                c_void_p,
                c_void_p,
                c_int,
                c_int,
                c_void_p,
                c_int,
                c_int,
                c_void_p,
                c_void_p,
                c_int,
                c_int,
                c_int,
                c_int,
            )(gemm_ex),
        )
    return calls


# ---------------------------------------------------------------------------------- plans


class _BoolKey:
    """A bool in a plan key: equal only to the same bool (True == 1 would let a plan validated for
    the int 1 serve an argument that must be rejected)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return type(other) is _BoolKey and other.value == self.value

    def __hash__(self):
        return hash((_BoolKey, self.value))

    def __repr__(self):
        return repr(self.value)


_BoolKey.__name__ = _BoolKey.__qualname__ = "bool"  # error messages name the caller's type


def scalar_key(value):
    """A scalar argument as it enters a plan key: its value, so two equal values share a plan and
    a freed object's reused ``id`` never matters; bools stay distinct from ints, lists become
    tuples. Validation sees this value too (a bool's repr and type name are kept)."""
    cls = value.__class__
    if cls is bool or cls is _NP_BOOL:
        return _BoolKey(bool(value))
    if cls is list:
        return tuple(scalar_key(v) for v in value)
    return value


class _TypedKey:
    """A non-int value of an int argument in a plan key: equal only to the same value of the same
    type (4.0 == 4 would let a plan validated for the int 4 serve a float that must be refused).
    Validation sees it as the value: its repr and type name are the value's."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return (
            type(other) is _TypedKey
            and type(other.value) is type(self.value)
            and other.value == self.value
        )

    def __hash__(self):
        try:
            return hash((type(self.value), self.value))
        except TypeError:  # an unhashable value: one bucket (it never validates anyway)
            return hash(_TypedKey)

    def __repr__(self):
        return repr(self.value)


def int_key(value):
    """An int argument's value as it enters a plan key (:data:`INT`): None and ints as they are, a
    NumPy integer as its int, a bool as :func:`scalar_key` keeps it, anything else a
    :class:`_TypedKey`."""
    cls = value.__class__
    if cls is int or value is None:
        return value
    if cls is bool or cls is _NP_BOOL:
        return _BoolKey(bool(value))
    if isinstance(value, np.integer):
        return int(value)
    return _TypedKey(value)


_NP_BOOL = np.bool_
_NP_DTYPE = np.dtype  # (the C replay is handed these two: native_hooks)


class Output:
    """An array a call allocates: an output the caller gave none of, or a temporary of the
    launches (the fused QKV op's cuBLAS path), freed once they are queued. Both come from the
    caller's allocator, torch's when an argument is a torch tensor, else CuPy's, on the launch
    stream: the pool hands a freed temporary out again only behind those launches on that stream,
    and a torch caller's temporaries stay in torch's pool (``torch.cuda.memory_allocated`` counts
    them, ``torch.cuda.empty_cache`` returns them)."""

    __slots__ = ("dtype", "shape", "size")

    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.size = math.prod(self.shape)

    def allocate(self, kinds, device, stream_ptr, explicit=True):
        """On ``device`` (current) for a launch on ``stream_ptr``; ``explicit`` False says that
        stream is the caller's current one (CuPy's or torch's), where allocations already go."""
        if kinds & ar.TORCH:
            torch = sys.modules["torch"]
            where = "cpu" if device == ar.HOST else torch.device("cuda", device)
            if not explicit or device == ar.HOST:
                return torch.empty(self.shape, dtype=ar.torch_dtype(self.dtype), device=where)
            with torch.cuda.stream(torch.cuda.ExternalStream(stream_ptr, device=where)):
                return torch.empty(self.shape, dtype=ar.torch_dtype(self.dtype), device=where)
        if device == ar.HOST:
            return np.empty(self.shape, self.dtype)
        if explicit:  # CuPy's pool orders reuse on the stream it allocates on
            with cupy_stream(stream_ptr, device):
                return self._cupy()
        return self._cupy()

    def empty(self, kinds, device):
        """This zero-size output, made once per process for its array type, device, shape and
        dtype (it holds nothing, so every call and plan may hand out the same one; a first call
        then allocates nothing for it)."""
        key = (bool(kinds & ar.TORCH), device, self.shape, self.dtype)
        out = _EMPTY_OUTPUTS.get(key)
        if out is None:
            out = self.allocate(kinds, device, None, False)
            _bounded_put(_EMPTY_OUTPUTS, key, out, 64)
        return out

    def _cupy(self):
        import cupy

        if self.dtype in ar.FP8_DTYPES:  # CuPy allocates float8 as bytes
            return cupy.empty(self.shape, cupy.uint8).view(self.dtype)
        return cupy.empty(self.shape, self.dtype)


_EMPTY_OUTPUTS = {}  # (torch, device, shape, dtype) -> a zero-size output (Output.empty)


def pointer_of(array):
    cls = array.__class__
    if cls is ar.KNOWN_TYPES[0]:
        return array.data.ptr
    if cls is ar.KNOWN_TYPES[1] or ar.is_torch(array):
        return array.data_ptr()
    if isinstance(array, np.ndarray):
        return array.ctypes.data
    return array.data.ptr


class Plan:
    """What the first call of a layout validated: how to launch, and what to check on replay.

    ``steps`` are :class:`Launch` es (or objects with the same ``run(ptrs, stream_ptr)``);
    ``outputs`` the :class:`Output` s a call allocates, their pointers following the arguments'
    in ``ptrs``; ``written`` the indices of the arguments the op writes; ``inplace`` pairs of
    argument indices that may be the very same array (same pointer and layout); ``result(arrays,
    outputs)`` gives the op's return value; ``host(views, output_views)`` runs the NumPy backend
    (device ``HOST``). ``cacheable`` False keeps the plan out of the cache (a one-off layout).
    ``capture_refusal``: the ValueError message of a call on a stream being captured into a CUDA
    graph, for plans a graph cannot hold (temporaries freed when the call returns);
    ``capture_plan``: the plan such a call runs instead, where one exists (one kernel, no
    temporaries: the fused QKV kernels beyond the token counts they win at eagerly).
    """

    def __init__(
        self,
        device,
        steps=(),
        *,
        outputs=(),
        written=(),
        inplace=(),
        result=None,
        host=None,
        cacheable=True,
        capture_refusal=None,
        capture_plan=None,
    ):
        self.device = device
        self.capture_refusal = capture_refusal
        self.capture_plan = capture_plan
        self.steps = list(steps)
        self.outputs = list(outputs)
        self.written = tuple(written)
        self.inplace = {frozenset(p) for p in inplace}
        self.result = result
        self.host = host
        self.cacheable = cacheable
        self.pairs = None  # set by finish(): (i, j, lo_i, hi_i, lo_j, hi_j) byte spans to check
        self.checked = {}  # pointer tuples that passed the overlap check (a few, newest last)
        self.last_checked = None  # the newest of them, as a list
        self.empties = {}  # array kinds -> zero-size outputs, made once (make_outputs)
        self.exact = {}  # (i, j, pointer delta) -> whether the two arrays share bytes
        self.layers = None  # a Layers when the plan serves multi-layer arrays (layer_idx)
        self.native = None  # its launches as C data, when the C replay serves it (_native.c)

    def finish(self, views, pairs, layouts=None):
        """Record what the replay's overlap check needs (from the first call): the layouts of the
        arrays (``layouts`` where the caller has them: ``(shape, strides, itemsize)`` or None for
        each view), and ``pairs``, the written arrays' pairs with their byte spans as
        :func:`ropekv._checks.check_no_overlap` gave them for these views and ``written``."""
        if layouts is None:
            layouts = [None if v is None else (v.shape, v.strides, v.dtype.itemsize) for v in views]
        self.views_layout = layouts
        self.pairs = pairs

    def make_outputs(self, kinds, stream_ptr, explicit):
        """The outputs of a call and their pointers. Zero-size ones (FlashInfer's q_nope_out
        without nope dims) are made once per plan and array kind and handed out again (they hold
        nothing); so are the lists when every output has zero size."""
        empties = self.empties.get(kinds)
        if empties is None:
            outs = [None if o.size else o.empty(kinds, self.device) for o in self.outputs]
            ptrs = [0 if x is None else pointer_of(x) for x in outs]
            empties = self.empties[kinds] = (outs, ptrs, all(x is not None for x in outs))
        outs, ptrs, complete = empties
        if complete:
            return outs, ptrs
        outs, ptrs = list(outs), list(ptrs)
        for i, o in enumerate(self.outputs):
            if o.size:
                outs[i] = o.allocate(kinds, self.device, stream_ptr, explicit)
                ptrs[i] = pointer_of(outs[i])
        return outs, ptrs

    def check_overlap(self, ptrs, names):
        for i, j, lo_i, hi_i, lo_j, hi_j in self.pairs:
            pi, pj = ptrs[i], ptrs[j]
            if pi + lo_i < pj + hi_j and pj + lo_j < pi + hi_i:
                key = (i, j, pj - pi)
                shared = self.exact.get(key)
                if shared is None:
                    shared = self.exact[key] = ck.shares_bytes(
                        (pi, *self.views_layout[i]), (pj, *self.views_layout[j])
                    )
                if shared:
                    inplace = frozenset((i, j)) in self.inplace
                    if not (inplace and pi == pj and self.views_layout[i] == self.views_layout[j]):
                        raise ValueError(
                            ck.overlap_message(names[i], names[j], j in self.written, inplace)
                        )

    def replay(self, arrays, ptrs, kinds, stream_ptr, names, layer=None):
        """Launch on new pointers (``ptrs`` of ``arrays``; of layer ``layer`` of the multi-layer
        ones when given); returns the op's result."""
        if layer is not None and not 0 <= layer < self.layers.count:
            raise ValueError(self.layers.range_message(layer))
        if self.pairs and ptrs != self.last_checked:
            seen = tuple(ptrs)
            if seen not in self.checked:
                self.check_overlap(ptrs, names)
                _bounded_put(self.checked, seen, True, 8)
            self.last_checked = ptrs
        device = self.device
        given = stream_ptr
        if stream_ptr is None:  # the stream rule: torch's if an argument is a torch tensor
            explicit = False
            stream_ptr = (
                _torch_stream_ptr(device) if kinds & ar.TORCH else current_stream_ptr(device)
            )
        else:
            explicit = True
        if self.capture_refusal is not None and stream_capturing(stream_ptr):
            alternative = self.capture_plan
            if alternative is None:
                raise ValueError(self.capture_refusal)
            # the same arguments (their overlap checked above), launched as one kernel
            return alternative.replay(arrays, ptrs, kinds, given, names, layer)
        runtime = _RUNTIME[0] or _runtime()
        previous = runtime.getDevice()
        if previous != device:
            runtime.setDevice(device)
        try:
            if self.outputs:
                outs, out_ptrs = self.make_outputs(kinds, stream_ptr, explicit)
                ptrs = [*ptrs, *out_ptrs, 0]
            else:  # a new list: ptrs stays last_checked as it was checked
                outs = ()
                ptrs = [*ptrs, 0]
            if layer is not None:  # the layer's pointers (the checks above saw whole arrays)
                for i, stride in self.layers.strides:
                    ptrs[i] += layer * stride
            for step in self.steps:
                step.run(ptrs, stream_ptr)
        finally:
            if previous != device:
                runtime.setDevice(previous)
        return None if self.result is None else self.result(arrays, outs)


def launch_stream(device, kinds, stream_ptr):
    """The stream a call launches on (the stream rule): ``stream_ptr`` when given, else torch's
    current stream on ``device`` when an argument is a torch tensor, else CuPy's."""
    if stream_ptr is not None:
        return stream_ptr
    return _torch_stream_ptr(device) if kinds & ar.TORCH else current_stream_ptr(device)


def wait_producers(views, device, kinds, stream_ptr):
    """CAI v3: before the launch, the launch stream waits for the stream each
    ``__cuda_array_interface__`` producer among ``views`` named (``ArrayView.wait``): an event
    recorded on the producer's stream, waited for on the launch stream (nothing when the two are
    one stream). Runs whether or not the call passed ``stream=``."""
    consumer = None
    for v in views:
        producer = None if v is None else getattr(v, "wait", None)
        if producer is None:
            continue
        if consumer is None:
            consumer = launch_stream(device, kinds, stream_ptr)
        if producer != consumer and not (producer == 1 and consumer == 0):
            stream_wait(producer, consumer, device)


def stream_wait(producer, consumer, device):
    """Make stream ``consumer`` wait for the work queued so far on stream ``producer`` (both raw
    ``cudaStream_t`` values of ``device``; 1 and 2: the legacy and per-thread default streams)."""
    import cupy

    with cupy.cuda.Device(device):
        event = cupy.cuda.Event(disable_timing=True)
        event.record(cupy_stream(producer, device))
        cupy_stream(consumer, device).wait_event(event)


def _bounded_put(table, key, value, limit):
    """``table[key] = value``, first dropping the oldest entry when ``limit`` is reached (other
    threads may be doing the same: a vanished entry is fine)."""
    while len(table) >= limit:
        try:
            table.pop(next(iter(table)), None)
        except (StopIteration, RuntimeError):
            break
    table[key] = value


_RUNTIME = [None]


def _runtime():
    from cupy_backends.cuda.api import runtime

    _RUNTIME[0] = runtime
    return runtime


def _driver_failed(code, call="cuLaunchKernel"):
    """Raise the error of a failed driver call (a launch of either replay, the capture query):
    CuPy's driver error where CuPy has it (the Python replay's launch wrapper raises that one)."""
    try:
        from cupy_backends.cuda.api.driver import CUDADriverError

        error = CUDADriverError(code)  # it asks the driver for the code's name
    except Exception:  # noqa: BLE001 - no CuPy or no driver to name it: the code alone
        error = RuntimeError(f"{call} failed with CUresult {code}")
    raise error


@functools.cache
def _cu_stream_is_capturing():
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuStreamIsCapturing
    fn.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
    fn.restype = ctypes.c_int
    return fn


def stream_capturing(stream_ptr):
    """Whether the stream is capturing work into a CUDA graph (``cuStreamIsCapturing``)."""
    status = ctypes.c_int(0)
    err = _cu_stream_is_capturing()(stream_ptr, ctypes.byref(status))
    if err:
        _driver_failed(err, "cuStreamIsCapturing")
    return status.value != 0


_MISS = object()  # the C replay's answer "take the Python path"
# A new plan's first launch: True, by the C replay's Caller.launch on the pointers the first call
# read and checked; False, by a second call of the C replay (which reads, keys and checks again)
FIRST_LAUNCH_DIRECT = True


class _NewLayout:
    """The C replay's answer for a call it read whole (its flags already normal, every argument
    None, a CuPy array or a torch tensor) whose layout has no plan: ``layout``, the key the Python
    path would build, so that the first call need not read the arguments twice."""

    __slots__ = ("layout",)

    def __init__(self, layout):
        self.layout = layout


_UNBOUND = object()  # native_module() before its first call


def native_hooks():
    """Everything of Python the C replay uses, handed to each ``_native.Caller`` when it is bound
    (it looks no name up): a tuple in the order of ``_native.c``'s ``H_*`` entries. Functions are
    taken as they are when the op binds its replay (``Op.bind_caller``; ``reset_caller`` binds
    again); the two lists are read on every call."""
    return (
        ar.KNOWN_TYPES,  # [cupy.ndarray, torch.Tensor]: the exact types read (each once seen)
        current_stream_ptr,  # the stream rule: CuPy's current stream on a device
        _torch_stream_ptr,  # the stream rule with a torch tensor: torch's current stream
        stream_capturing,  # whether a stream captures (plans that refuse or re-plan capture)
        _RUNTIME,  # [CuPy's runtime module] once bound: getDevice / setDevice
        _driver_failed,  # raises the error of a failed cuLaunchKernel(Ex)
        _cublas_handle,  # the calling thread's cuBLAS handle (GEMM steps)
        _cublas_failed,  # raises the error of a failed cuBLAS call
        _NewLayout,  # the answer for a call read whole whose layout has no plan
        _NP_BOOL,  # numpy.bool_: never a normal key value (flags_are_normal)
        _NP_DTYPE,  # numpy.dtype: a normal dtype-like value (flags_are_normal)
    )


def _native_launchers():
    """The addresses of the driver's ``cuLaunchKernel`` and ``cuLaunchKernelEx`` (the library CuPy
    loaded; the process has one). OSError without a driver."""
    lib = ctypes.CDLL("libcuda.so.1")
    ex = getattr(lib, "cuLaunchKernelEx", None)  # CUDA 12.0+ drivers
    return (
        ctypes.cast(lib.cuLaunchKernel, ctypes.c_void_p).value,
        None if ex is None else ctypes.cast(ex, ctypes.c_void_p).value,
    )


_native_module = [_UNBOUND]  # the configured C replay module, or None
_TORCH_COMPILER = ar.TORCH_COMPILER  # [torch.compiler] once torch is seen, else [None]
_native_has_ex = [False]  # whether it has cuLaunchKernelEx (launches with enable_pdl=True)
_torch_probed = [False]  # whether that module's torch struct reads were probed (torch_reads)
_native_cublas_bound = [None]  # whether that module has the cuBLAS functions (_native_cublas)


def native_module():
    """The C replay (``_native.c``) with the driver's launch functions bound, or None when it
    cannot be built, there is no driver (then every call replays in Python) or the interpreter
    runs without the GIL: the C replay needs it (``_native.c`` declares ``Py_MOD_GIL_USED``), and
    loading it would turn a free-threaded interpreter's GIL back on for the process."""
    module = _native_module[0]
    if module is _UNBOUND:
        from ropekv import _native

        module = None
        try:
            launchers = _native_launchers()  # no driver: nothing to build the C replay for
        except OSError:
            launchers = None
        if launchers is not None and _gil_enabled():
            module = _native.load()
            if module is not None:
                module.configure(*launchers)
                _native_has_ex[0] = launchers[1] is not None
                _native.configure_cupy_reads(module)
                ar._VIEW_FIELDS[0] = module.view_fields  # first calls read arrays through it
                # and check their writes, spans and device (_native.FIRST_CALL_C: else Python)
                _native.route_first_call_checks(module)
        _native_module[0] = module
        _torch_probed[0] = False
        _native_cublas_bound[0] = None
    return module


def _gil_enabled():
    """Whether the GIL is on (always, but on a free-threaded build run without it)."""
    enabled = getattr(sys, "_is_gil_enabled", None)
    return True if enabled is None else bool(enabled())


def _native_cublas(module):
    """Whether the C replay has the cuBLAS functions of :class:`Gemm` (bound on the first plan
    with a GEMM; False for good when CuPy's cuBLAS cannot be found)."""
    bound = _native_cublas_bound[0]
    if bound is None:
        try:
            module.configure_cublas(*cublas_entry_points())
            bound = True
        except (OSError, AttributeError, ValueError):
            bound = False
        _native_cublas_bound[0] = bound
    return bound


def torch_reads(device):
    """Probe the C replay's struct reads of torch tensors on ``device`` (once per process, on the
    first plan of a call with torch tensors: torch may be imported but never used on a GPU)."""
    module = native_module()
    if module is not None and not _torch_probed[0]:
        from ropekv import _native

        _torch_probed[0] = True
        _native.configure_torch_reads(module, device)


def native_plan(plan, n_args):
    """``plan``'s steps as C data (``_native.NativePlan``), or None when the C replay cannot
    serve it (no C replay, a step that is neither a :class:`Launch` nor a :class:`Gemm`, a GEMM
    without CuPy's cuBLAS at hand, a PDL launch without ``cuLaunchKernelEx``)."""
    module = native_module()
    if module is None:
        return None
    steps, gemm, pdl = [], False, False  # the steps as C data, in one pass over them
    for s in plan.steps:
        cls = type(s)
        if cls is Launch:
            steps.append((s.func, s.grid, s.block, s.shared_mem, s.pdl, s.slots, s.tail))
            pdl = pdl or s.pdl
        elif cls is Gemm:
            steps.append(((s.a, s.b, s.c), s.args))
            gemm = True
        else:
            return None
    if gemm and not _native_cublas(module):
        return None
    if pdl and not _native_has_ex[0]:
        return None
    layers = plan.layers
    if layers is not None:
        layers = (layers.count, layers.strict, layers.strides)
    try:
        return module.NativePlan(
            plan.device,
            n_args,
            len(plan.outputs),
            steps,
            plan.pairs or (),
            layers,
            plan.capture_refusal is not None,
        )
    except ValueError:  # a record or an argument count the C replay does not take
        return None


class _Plans(dict):
    """An op's plans by key ``(flags, layout)``, and ``last``: ``(hash of flags, flags, layout,
    plan)`` of the newest replay. A call repeating it (an engine's layers, one layout) skips
    hashing the layout; it matches on equal hashes and values, as a dict lookup would."""

    _NONE = (None, None, None, None)

    def __init__(self):
        super().__init__()
        self.last = self._NONE

    def clear(self):
        self.last = self._NONE
        super().clear()


class Layers:
    """The layer dimension of a plan's multi-layer arguments (a call with ``layer_idx``).

    ``strides``: ``(argument index, bytes per layer)`` of each multi-layer array the call passed;
    ``count`` their layer count. The plan's checks and vector widths were chosen for one layer's
    arrays; they hold for every layer whose arrays start at the same alignment, which is every
    layer when each layer stride is a multiple of 16 bytes (``strict`` False, the usual case).
    Otherwise only the layers of the validated offset alignment replay the plan; the others take
    the first-call path (uncached).
    """

    __slots__ = ("count", "name", "shape", "strict", "strides", "validated")

    def __init__(self, count, strides, layer, name, shape):
        self.count, self.name, self.shape = count, name, shape
        self.strides = tuple(strides)
        self.strict = any(s & 15 for _, s in self.strides)
        self.validated = self.alignment(layer)

    def alignment(self, layer):
        return tuple(layer * s & 15 for _, s in self.strides)

    def misaligned(self, layer):
        return self.strict and self.alignment(layer) != self.validated

    def range_message(self, layer):
        return ck.layer_range_message(layer, self.count, self.name, self.shape)


def select_layer(views, indices, layer):
    """``(views, Layers)``: ``views`` with each multi-layer array (the ``indices`` given) replaced
    by a view of its layer ``layer``; ValueError when one has no leading dimension, when their
    layer counts differ or when ``layer`` is out of range."""
    given = [(i, views[i]) for i in indices if views[i] is not None]
    if not given:
        raise ValueError("layer_idx is given but no multi-layer array is")
    first = given[0][1]
    for _, v in given:
        if v.ndim == 0:
            raise ValueError(
                f"{v.name} must have a leading layer dimension (num_layers, ...) "
                f"with layer_idx, got shape {v.shape}"
            )
        if v.shape[0] != first.shape[0]:
            raise ValueError(
                f"{v.name} must have as many layers as {first.name} "
                f"({first.shape[0]}) with layer_idx, got shape {v.shape}"
            )
    count = first.shape[0]
    if not 0 <= layer < count:
        raise ValueError(ck.layer_range_message(layer, count, first.name, first.shape))
    out, strides = list(views), []
    for i, v in given:
        stride = v.strides[0] * v.dtype.itemsize
        strides.append((i, stride))
        out[i] = ar.ArrayView(
            v.name,
            v.ptr + layer * stride,
            v.shape[1:],
            v.strides[1:],
            v.dtype,
            v.device,
            readonly=v.readonly,
            owner=v.owner,
            host=None if v.host is None else v.host[layer],
            array=v.array,
            legacy=v.legacy,
        )
    return out, Layers(count, strides, layer, first.name, first.shape)


def dtype_key(value):
    """A dtype argument (QK-norm's ``q_out_dtype``) as it enters the plan key: a dtype, a name
    or None (validated later)."""
    if value is None or isinstance(value, (str, np.dtype)):
        return value
    if type(value).__module__ == "torch":  # torch.float8_e4m3fn: its name
        return str(value).removeprefix("torch.")
    try:
        return np.dtype(value)
    except TypeError:
        return repr(value)  # refused by validation


def given_or_new(index):
    """The result of an op with one optional output argument at ``index``: it, or the new one."""

    def result(arrays, outs):
        return arrays[index] if arrays[index] is not None else outs[0]

    return result


# How a scalar argument enters a plan key (``Op(..., flags=[(name, kind), ...])``)
AS_IS = 0  # as given (already a key: a tuple of tuning values, a validated scale)
KEY = 1  # scalar_key(value): compared by value, bools kept apart from ints, lists as tuples
FLAG = 2  # check_flag(value, name): a bool (TypeError otherwise)
INT = 4  # an int argument (or None): kept as it is when an int, a NumPy integer as its int, any
# other value as a key equal only to a value of its own type (int_key): 4.0 never replays the plan
# of 4, which validation would refuse
# or a function of the value: a dtype-like argument, returned as is when None, a str or a NumPy
# dtype (the C replay takes those as they come; anything else goes through the function)
_DTYPE_LIKE = 3  # the C replay's name (_native.c's DTYPE) for the kind given as a function


# the classes of a value already normal for each kind of flag (True and False are the only bools)
_PLAIN, _BOOL, _INT = (
    frozenset((float, int, str, tuple, type(None))),
    frozenset((bool,)),
    frozenset((int,)),
)
_NORMAL_CLASSES_MAX = 64  # tuples of classes remembered per op (the classes of one call's flags)


def _normalizer(spec):
    """The function that turns a call's scalar arguments into its plan's flags (one per entry of
    ``spec``): it runs on every call the C replay does not take.

    Whether a value is already normal depends on its class alone, so which entries of a call need
    their normalization is remembered per tuple of the values' classes: a call whose values are
    all normal returns its flags as they are (entries given as a function, a dtype-like one, still
    go through it), any other normalizes just the entries that are not (and raises what
    :func:`ropekv._checks.check_flag` and the key functions raise)."""
    n = len(spec)
    checks = []  # (index, classes already normal, normalization) of every entry of a key kind
    calls = []  # (index, function) of the entries given as a function (always applied)
    for i, (name, kind) in enumerate(spec):
        if kind == KEY:
            checks.append((i, _PLAIN, scalar_key))
        elif kind == FLAG:
            checks.append((i, _BOOL, _flag_of(name)))
        elif kind == INT:
            checks.append((i, _INT, int_key))
        elif kind != AS_IS:
            calls.append((i, kind))
    known = {}  # tuple of the values' classes -> ((index, function), ...) to apply, in order

    def work(classes):
        if len(classes) != n:
            raise ValueError(f"expected {n} flags, got {len(classes)}")
        fixes = [(i, fix) for i, normal, fix in checks if classes[i] not in normal]
        todo = tuple(sorted(fixes + calls, key=operator.itemgetter(0)))  # errors in entry order
        if len(known) >= _NORMAL_CLASSES_MAX:
            known.clear()
        known[classes] = todo
        return todo

    def normalize(flags):
        classes = tuple(map(type, flags))
        todo = known.get(classes)
        if todo is None:
            todo = work(classes)
        if not todo:  # every value is already normal
            return flags
        out = list(flags)
        for i, fn in todo:
            out[i] = fn(out[i])
        return tuple(out)

    return normalize


def _flag_of(name):
    """The normalization of the bool flag ``name``: its value as a bool, else TypeError."""

    def flag(value):
        return ck.check_flag(value, name)

    return flag


def _given(flags):
    return flags


class Op:
    """One public operation on the one call path: ``names`` of its array arguments, in the order
    its wrapper passes them, and ``prepare(views, flags) -> Plan`` (validates a first call and
    raises the named error of any bad input before anything launches). ``layered`` names the
    arguments that carry a leading ``(num_layers, ...)`` dimension when a call gives
    ``layer_idx`` (caches, and any per-layer array beside them, such as scale arrays); ``prepare``
    then sees one layer of each. Plans of such calls live in ``layer_plans``, one per layout for
    every layer.

    ``flags`` names the scalar arguments the wrapper passes, in order, each with how it enters
    the plan key (:data:`AS_IS`, :data:`KEY`, :data:`FLAG` or a function, above): the wrapper
    passes them as the caller gave them, and ``prepare`` sees them normalized. The C replay takes
    a call whose values are already normal as it comes (a bool flag that is a bool, a key that is
    no bool and no list); any other goes through the normalization (and its errors) in Python."""

    MAX_PLANS = 256

    def __init__(self, name, names, prepare, layered=(), flags=()):
        self.name = name
        self.names = tuple(names)
        self.prepare = prepare
        kinds = [k if k in (AS_IS, KEY, FLAG, INT) else _DTYPE_LIKE for _, k in flags]
        self.flag_kinds = tuple(kinds) if flags else None  # None: the wrapper normalizes
        self.normalize = _normalizer(flags) if flags else _given
        self.plans = _Plans()
        self.layer_plans = _Plans()
        unknown = set(layered) - set(self.names)
        if unknown:
            raise ValueError(f"{name}: layered names no argument: {sorted(unknown)}")
        self.layered = tuple(self.names.index(n) for n in layered)
        self.caller = None  # the C replay of this op's plans (_native.Caller), when bound
        self.caller_bound = False  # bound with the first plan of a device call (first_call)

    def bind_caller(self):
        """Bind the C replay of this op (``_native.Caller``; None where it cannot be had)."""
        module = native_module()
        self.caller = (
            None
            if module is None
            else module.Caller(self.names, self.flag_kinds, native_hooks(), _MISS)
        )
        self.caller_bound = True

    def reset_caller(self, native=True):
        """Drop the C replay: bound again with the next device plan (``native``), or never (every
        plan replays in Python)."""
        self.caller = None
        self.caller_bound = not native

    def clear(self):
        """Forget every plan (of one-layer and of multi-layer calls)."""
        self.plans.clear()
        self.layer_plans.clear()

    def __call__(self, arrays, flags, stream=None, layer_idx=None):
        compiler = _TORCH_COMPILER[0]  # torch.compiler once torch is imported, else None
        if compiler is not None and compiler._is_compiling_flag:  # Dynamo is tracing this call
            raise TypeError(
                ar.TRACED_TORCH.format(name=f"{self.name}'s call", what="call traced by Dynamo")
            )
        stream_ptr = None if stream is None else stream_ptr_of(stream)
        if layer_idx is None:
            plans = self.plans
        else:
            if layer_idx.__class__ is not int:
                layer_idx = ck.check_layer_idx(layer_idx)
            if not self.layered:
                raise TypeError(f"{self.name} takes no layer_idx")
            plans = self.layer_plans
        if _raw_get(CHECK_INDICES_KEY, EMPTY_KEY) in OFF:  # else: the first call checks indices
            caller = self.caller
            if caller is not None:  # the replay in C; a new layout or array kind: on in Python
                done = caller(arrays, flags, stream_ptr, layer_idx, plans)
                if done is not _MISS:
                    if done.__class__ is _NewLayout:  # read in C, not planned: its key as read
                        return self.first_call(
                            arrays, flags, stream_ptr, (flags, done.layout), layer_idx
                        )
                    return done
            flags = self.normalize(flags)
            read = signature(arrays)
            if read is None:  # an argument of another kind: its view (and capsule) lives here
                # (a null pointer has its own alignment key, 16: only an empty array's plan has
                # it, so a non-empty array at address 0 always takes the first-call path)
                read = signature(arrays, self.names, stream_ptr)
            layout, ptrs, kinds, keep = read
            try:
                h = hash(flags)
            except TypeError:  # an unhashable flag: every call takes the first-call path
                return self.first_call(arrays, flags, stream_ptr, None, layer_idx)
            last_h, last_flags, last_layout, plan = plans.last
            if not (h == last_h and layout == last_layout and flags == last_flags):
                key = (flags, layout)
                plan = plans.get(key)
                if plan is None:
                    return self.first_call(arrays, flags, stream_ptr, key, layer_idx)
                plans.last = (h, flags, layout, plan)
            if layer_idx is not None and plan.layers.misaligned(layer_idx):
                return self.first_call(arrays, flags, stream_ptr, None, layer_idx)
            if keep is not None:  # CAI producers' streams: the launch stream waits for them
                wait_producers(keep, plan.device, kinds, stream_ptr)
            return plan.replay(arrays, ptrs, kinds, stream_ptr, self.names, layer_idx)
        return self.first_call(arrays, self.normalize(flags), stream_ptr, None, layer_idx)

    def first_call(self, arrays, flags, stream_ptr, key, layer=None):
        """Validate and plan a call (``layer``: its ``layer_idx``), cache the plan under ``key``
        (None: not cached) and launch it. The shared checks (writability, strides, overlap) see
        whole arrays, every layer of a multi-layer one: what a replay re-checks from pointers
        holds for every layer alike."""
        # the views and kinds of array in one pass over the arguments; element alignment, once
        # every argument is read, before the op's own checks (they pick vector widths from it)
        views, kinds, misaligned = ar.read_arguments(arrays, self.names, stream_ptr)
        if misaligned is not None:
            for v in misaligned:
                ck.check_element_aligned(v)  # raises (unless empty)
        layers = None
        op_views = views
        if layer is not None:
            op_views, layers = select_layer(views, self.layered, layer)
        try:
            plan = self.prepare(op_views, flags)
        except AttributeError:  # a required array given as None (its view read as an array)
            given_none = [n for n, v in zip(self.names, op_views) if v is None]
            if not given_none:
                raise
            raise TypeError(
                f"{self.name}: a required array argument is None (None given for "
                f"{', '.join(given_none)}; only the optional ones may be None)"
            ) from None
        plan.layers = layers
        if plan.capture_plan is not None:  # it replays the same (multi-layer) arguments
            plan.capture_plan.layers = layers
        written = plan.written = _given_indices(views, plan.written)
        # writable, strides, overlap; the views' layouts and pointers where C read them at once
        pairs, layouts, ptrs = ck.check_written(views, written, plan.inplace)
        if plan.device == ar.HOST:
            return self.run_host(plan, arrays, op_views, kinds, stream_ptr)
        if kinds & ar.OTHER:  # CAI producers' streams: the launch stream waits for them
            wait_producers(views, plan.device, kinds, stream_ptr)
        plan.finish(views, pairs, layouts)
        plans = self.plans if layer is None else self.layer_plans
        if key is not None and plan.cacheable:
            if not self.caller_bound:
                self.bind_caller()
            if self.caller is not None:
                plan.native = native_plan(plan, len(views))
                if kinds & ar.TORCH:
                    torch_reads(plan.device)
            _bounded_put(plans, key, plan, self.MAX_PLANS)
        if ptrs is None:
            ptrs = [0 if v is None else v.ptr for v in views]
        if plan.pairs:  # check_no_overlap above passed these pointers: the replay need not
            plan.checked[tuple(ptrs)] = True
            plan.last_checked = ptrs
        if plan.native is not None:  # cached with launches in C: the C replay launches it
            # as the newest replay, which the C replay matches by value with no hashing of the
            # layout (and sets itself on a table hit)
            plans.last = (hash(flags), flags, key[1], plan)
            if FIRST_LAUNCH_DIRECT:  # these pointers, read and checked above: no second read
                done = self.caller.launch(plan, arrays, ptrs, kinds, stream_ptr, layer)
            else:
                done = self.caller(arrays, flags, stream_ptr, layer, plans)
            if done is not _MISS:
                return done
        return plan.replay(arrays, ptrs, kinds, stream_ptr, self.names, layer)

    def run_host(self, plan, arrays, views, kinds, stream_ptr):
        outs = [o.allocate(kinds, ar.HOST, None, False) for o in plan.outputs]
        out_views = [ar.as_view(o, f"output {i}") for i, o in enumerate(outs)]
        if plan.host is not None:
            plan.host(views, out_views)
        return None if plan.result is None else plan.result(arrays, outs)
