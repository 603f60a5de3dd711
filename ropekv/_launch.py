"""Streams, parameter structs and the launch itself. Only the op modules call into here."""

from __future__ import annotations

import functools
import struct

import numpy as np

from ropekv._compile import get_kernel


def current_stream_ptr():
    import cupy

    return cupy.cuda.get_current_stream().ptr


class _RawStream:
    """A raw ``cudaStream_t`` spelled in the CUDA stream protocol."""

    def __init__(self, ptr):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


@functools.lru_cache(maxsize=64)
def _external_stream(ptr, device_id):
    import cupy

    if hasattr(cupy.cuda.Stream, "from_external"):  # CuPy 14+
        return cupy.cuda.Stream.from_external(_RawStream(ptr))
    return cupy.cuda.ExternalStream(ptr, device_id)


def resolve_stream(stream, device_id):
    """The CuPy stream to launch on: ``stream`` (a CuPy stream, a raw ``cudaStream_t`` int, or any
    object with ``__cuda_stream__`` / ``cuda_stream``, such as ``torch.cuda.Stream``), or the
    current CuPy stream when None."""
    import cupy

    if stream is None:
        return cupy.cuda.get_current_stream()
    if isinstance(stream, cupy.cuda.stream._BaseStream):
        return stream
    return _external_stream(stream_ptr_of(stream), device_id)


def stream_ptr_of(stream):
    """The raw pointer of a ``stream=`` argument without importing CuPy for host calls."""
    if stream is None:
        return None
    if isinstance(stream, int | np.integer):
        return int(stream)
    if hasattr(stream, "ptr"):
        return int(stream.ptr)
    if hasattr(stream, "__cuda_stream__"):
        return int(stream.__cuda_stream__()[1])
    if hasattr(stream, "cuda_stream"):
        return int(stream.cuda_stream)
    raise TypeError(f"stream must be None, a CuPy stream, an int cudaStream_t or an object with "
                    f"cuda_stream, got {type(stream).__qualname__}")


class ParamStruct:
    """A C parameter struct passed by value, declared once as ``[(name, numpy type), ...]``.

    The field order and types must match the struct in the ``.cu`` file; ``tests/test_compile.py``
    checks that they do. Pointers are ``np.uint64``. Packing goes through ``struct`` (about a third
    of the host time of filling a NumPy record field by field).
    """

    _CODES = {"u8": "Q", "i8": "q", "i4": "i", "u4": "I", "f4": "f"}

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

    def values(self, **values):
        """The field values in declaration order; every field must be given."""
        return [values[n] for n in self.names]

    def pack_values(self, values):
        """The struct as a NumPy scalar for a kernel argument, from values in field order."""
        return np.frombuffer(self._struct.pack(*values), self.dtype)[0]

    def pack(self, **values):
        return self.pack_values(self.values(**values))


def launch(stem, expression, device_id, grid, block, args, stream=None, shared_mem=0):
    """Launch ``expression`` of ``kernels/<stem>.cu`` on device ``device_id``, on ``stream`` (any
    form :func:`resolve_stream` takes; None is the current CuPy stream)."""
    import cupy

    kernel = get_kernel(stem, expression, device_id)
    if cupy.cuda.runtime.getDevice() != device_id:
        with cupy.cuda.Device(device_id):
            return launch(stem, expression, device_id, grid, block, args, stream, shared_mem)
    if stream is None:
        kernel(grid, block, args, shared_mem=shared_mem)
        return
    with resolve_stream(stream, device_id):
        kernel(grid, block, args, shared_mem=shared_mem)


class LaunchPlan:
    """A validated launch, replayed while the arrays keep their shapes, strides, dtypes, device and
    alignment: only their pointers are refilled. This keeps the host cost of a repeated call (a
    decode step) near that of the bare launch.

    ``pointers`` lists ``(field, argument, byte offset)``: on replay the parameter ``field`` is set
    to ``ptrs[argument] + offset``."""

    __slots__ = ("block", "device", "expression", "grid", "params", "ptr_fields", "shared_mem",
                 "stem", "values")

    def __init__(self, stem, expression, device, grid, block, params, values, pointers,
                 shared_mem=0):
        self.stem, self.expression, self.device = stem, expression, device
        self.grid, self.block, self.params = grid, block, params
        self.values, self.shared_mem = values, shared_mem
        self.ptr_fields = [(params.names.index(f), arg, off) for f, arg, off in pointers]

    def launch(self, ptrs, stream):
        values = self.values.copy()
        for field, arg, offset in self.ptr_fields:
            values[field] = ptrs[arg] + offset
        launch(self.stem, self.expression, self.device, self.grid, self.block,
               (self.params.pack_values(values),), stream, self.shared_mem)


def overlapping(a, b):
    """Whether CuPy arrays ``a`` and ``b`` may share bytes (their byte ranges intersect)."""
    def span(x):
        lo = hi = x.data.ptr
        for n, st in zip(x.shape, x.strides):
            if n == 0:
                return 0, 0
            if st < 0:
                lo += (n - 1) * st
            else:
                hi += (n - 1) * st
        return lo, hi + x.itemsize

    (a_lo, a_hi), (b_lo, b_hi) = span(a), span(b)
    return a_lo < b_hi and b_lo < a_hi


def new_device_array(shape, dtype, device):
    """``cupy.empty`` on CUDA device ``device``."""
    import cupy

    if cupy.cuda.runtime.getDevice() == device:
        return cupy.empty(shape, dtype)
    with cupy.cuda.Device(device):
        return cupy.empty(shape, dtype)


class PlanCache:
    """Launch plans of one op keyed by the layout of its CuPy arguments."""

    def __init__(self, maxsize=512):
        self.maxsize = maxsize
        self.plans = {}

    @staticmethod
    def signature(arrays, flags):
        """(key, pointers) for CuPy arrays (None allowed), or (None, None) when any argument is
        something else, or a flag is unhashable (those take the full path every time)."""
        import sys

        try:
            hash(flags)
        except TypeError:
            return None, None

        cupy = sys.modules.get("cupy")
        if cupy is None:
            return None, None
        ndarray = cupy.ndarray
        key, ptrs = [flags], []
        for a in arrays:
            if a is None:
                key.append(None)
                ptrs.append(0)
            elif type(a) is ndarray:
                ptr = a.data.ptr
                key.append((a.shape, a.strides, a.dtype, ptr & 15, a.data.device_id))
                ptrs.append(ptr)
            else:
                return None, None
        return tuple(key), ptrs

    def get(self, key):
        return self.plans.get(key)

    def put(self, key, plan):
        if len(self.plans) >= self.maxsize:
            self.plans.clear()
        self.plans[key] = plan
