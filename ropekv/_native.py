"""The C replay of launch plans (``_native.c``): built with the system C compiler on first use,
cached on disk, and optional.

``load()`` gives the extension module, or None when it cannot be had (no C compiler, no Python
headers, ``ROPEKV_NATIVE=0``); every op then replays its plans in Python (``ropekv/_launch.py``),
with the same results, a few microseconds slower per call. ``state()`` says which, and why
(``ropekv info`` prints it).

CuPy arrays are read from their object struct (``raw_layout``), at offsets that
``configure_cupy_reads`` finds on arrays it makes and checks against the arrays' attributes before
turning the reads on (``ROPEKV_NATIVE_CUPY=0`` keeps the attributes). torch tensors are read from
their C++ TensorImpl the same way, at offsets ``configure_torch_reads`` finds on tensors it makes
on the device of the first call with torch tensors (``ROPEKV_NATIVE_TORCH=0`` keeps the
attributes). Either falls back to the attributes for good when a probe does not find or confirm
its offsets, and ``state()`` says why.

The build goes to ``native/`` of ropekv's cache (``$ROPEKV_CACHE_DIR``, default
``~/.cache/ropekv``; :mod:`ropekv._cache`), one entry per (source, Python ABI): a file loaded only
when it is the user's, in a directory of the user's that no one else can write, and its SHA-256
is the one recorded when it was built (else it is built again), written atomically under a name
unique to the writer. The compiler runs at most ``ROPEKV_COMPILE_TIMEOUT`` seconds (then plans
replay in Python, with a warning). Compiling takes about a second, once.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import shlex
import struct
import subprocess
import sys
import sysconfig
import tempfile
import threading
import warnings
from pathlib import Path

from ropekv import _cache
from ropekv._env import env_flag

_SOURCE = Path(__file__).with_name("_native.c")
_MODULE = "ropekv._native_ext"
_lock = threading.Lock()
_state = {
    "module": None,
    "reason": "not loaded yet",
    "path": None,
    "cupy": "not probed yet",
    "torch": "not probed yet",
}
_tried = False


def cache_dir() -> Path | None:
    """Where the extension is kept (``native/`` of ropekv's cache, :mod:`ropekv._cache`)."""
    return _cache.directory("native")


def _compiler():
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    return shlex.split(cc)


def _key(source: bytes) -> str:
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    digest = hashlib.sha256(source + sys.version.encode() + suffix.encode()).hexdigest()[:16]
    return f"_native_ext-{digest}"


def _compile(target: Path) -> None:
    """The compiler on ``_native.c`` into ``target``: OSError / CalledProcessError with its
    message, TimeoutExpired after ``ROPEKV_COMPILE_TIMEOUT`` seconds (the compiler killed)."""
    include = sysconfig.get_paths()["include"]
    if not Path(include, "Python.h").exists():
        raise OSError(f"no Python headers at {include} (install the python3-dev package)")
    cmd = [
        *_compiler(),
        "-O2",
        "-std=c11",
        "-shared",
        "-fPIC",
        "-Wall",
        f"-I{include}",
        str(_SOURCE),
        "-o",
        str(target),
    ]
    done = _cache.run_tool(cmd)
    if done.returncode:
        raise subprocess.CalledProcessError(done.returncode, cmd, done.stdout, done.stderr)


def build(target: Path | None = None, rebuild: bool = False) -> Path:
    """Compile ``_native.c`` into ``target``, or (default) into ropekv's cache, where a trusted
    entry whose content hash matches is reused unless ``rebuild``; returns the path. Raises
    OSError / CalledProcessError / TimeoutExpired when it cannot."""
    if target is not None:
        _compile(target)
        return target
    source = _SOURCE.read_bytes()
    key = _key(source)
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    found = None if rebuild else _cache.lookup("native", key)
    if found is not None:
        return found[0]
    with tempfile.TemporaryDirectory(prefix="ropekv-build-") as tmp:
        out = Path(tmp, f"ext{suffix}")
        _compile(out)
        return _cache.store("native", key, out.read_bytes(), suffix)


def _import(path: Path):
    loader = importlib.machinery.ExtensionFileLoader(_MODULE, str(path))
    spec = importlib.util.spec_from_file_location(_MODULE, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _build_and_import():
    path = build()
    try:
        return path, _import(path)
    except ImportError:  # a cached file that does not load: built again, once
        path = build(rebuild=True)
        return path, _import(path)


def load():
    """The extension module (built on the first call in this environment), or None."""
    global _tried
    if _tried:
        return _state["module"]
    with _lock:
        if _tried:
            return _state["module"]
        if not env_flag("ROPEKV_NATIVE", True):
            _state["reason"] = f"disabled by ROPEKV_NATIVE={os.environ['ROPEKV_NATIVE']}"
        else:
            try:
                path, module = _build_and_import()
                _state.update(module=module, path=str(path), reason=None)
            except subprocess.CalledProcessError as exc:
                _state["reason"] = (
                    f"{shlex.join(exc.cmd)} failed: "
                    f"{(exc.stderr or exc.stdout or '').strip()[:500]}"
                )
            except subprocess.TimeoutExpired as exc:
                _state["reason"] = f"the C compiler ran past {exc.timeout:g} s and was stopped"
                warnings.warn(
                    f"ropekv: {_state['reason']} (ROPEKV_COMPILE_TIMEOUT); launch plans replay "
                    "in Python",
                    RuntimeWarning,
                    stacklevel=2,
                )
            except (OSError, ImportError) as exc:
                _state["reason"] = f"{type(exc).__name__}: {exc}"
        _tried = True
    return _state["module"]


def state() -> str:
    """One line: the C replay in use (and its file, and how it reads CuPy arrays), or why not."""
    if _state["module"] is not None:
        cupy, torch = _state["cupy"], _state["torch"]
        reads = (
            "CuPy arrays read from their struct"
            if cupy is None
            else f"CuPy arrays read through their attributes: {cupy}"
        )
        reads += (
            "; torch tensors read from their TensorImpl"
            if torch is None
            else f"; torch tensors read through their attributes: {torch}"
        )
        return f"C plan replay ({_state['path']}; {reads})"
    return f"Python plan replay ({_state['reason']})"


# ---- the first call's checks and argument reads in C, or in Python ------------------------------

# Whether a first call runs the C forms of its three checks, of its alignment test and of its
# argument reads where the C replay is loaded: ``overlap_pairs`` (``_checks.check_no_overlap``'s
# pairs), ``written_layouts`` (``_checks.check_written``'s layouts, pointers and plain-stride
# test), ``same_device`` (``_checks.check_same_device``), ``widest_aligned``
# (``_vector.widest_aligned``, the ops' vector widths), ``max_span`` (``_arrays.max_span``, the
# paged op's bound of its 32-bit offsets) and ``read_views``
# (``_arrays.read_arguments``: the views of a call whose arrays its struct reads take). Off, they
# run their Python forms, with the same results, the same errors and plans that replay the same
# (tests/test_host_first.py, and tests/test_native.py on a GPU for the reads). On the H200 host
# first calls drift more than the checks save (first_call_drift.py);
# tools/experiments/first_call_c.py times both settings interleaved in one process. Change it
# through :func:`first_call_c`, not by assignment (the callers read the routed functions, not
# this flag).
FIRST_CALL_C = True
NATIVE_READ_CONFIGURED = [None]  # the module whose read_views knows ArrayView's slots


def route_first_call_checks(module):
    """Give ``_checks`` the C forms of the three checks and ``_arrays`` the C argument reader from
    ``module`` (the configured C replay, or None: their Python forms) where :data:`FIRST_CALL_C` is
    on, else None (Python)."""
    from ropekv import _arrays as ar
    from ropekv import _checks as ck
    from ropekv import _vector

    on = module is not None and FIRST_CALL_C
    _vector.NATIVE_WIDEST[0] = module.widest_aligned if on else None
    ar.NATIVE_MAX_SPAN[0] = module.max_span if on else None
    ar.NATIVE_BIND_DIMS[0] = module.bind_dims if on else None
    ar.NATIVE_GATHER[0] = module.gather_strides if on else None
    ck.NATIVE_OVERLAP[0] = module.overlap_pairs if on else None
    ck.NATIVE_WRITTEN[0] = module.written_layouts if on else None
    ck.NATIVE_SAME_DEVICE[0] = module.same_device if on else None
    if on and NATIVE_READ_CONFIGURED[0] is not module:
        module.configure_views(ar.ArrayView)
        NATIVE_READ_CONFIGURED[0] = module
    ar.NATIVE_READ[0] = module.read_views if on else None


def first_call_c(on=None):
    """Turn the C forms of the first call's three checks and argument reads on or off
    (:data:`FIRST_CALL_C`; ``on=None`` changes nothing) from the next first call on, and return the
    setting before. Plans already made stay (they are the same either way); the C replay is not
    loaded by this (when it loads later, it follows the setting)."""
    global FIRST_CALL_C
    before = FIRST_CALL_C
    if on is not None:
        FIRST_CALL_C = bool(on)
        from ropekv import _launch

        module = _launch._native_module[0]
        route_first_call_checks(None if module is _launch._UNBOUND else module)
    return before


# ---- CuPy arrays read from their struct ------------------------------------------------------


def _words(obj, nbytes):
    """The first ``nbytes`` of ``obj``'s own struct, as signed 64-bit words."""
    return struct.unpack(f"{nbytes // 8}q", ctypes.string_at(id(obj), nbytes // 8 * 8))


def _common(found, what):
    """The one offset in every probe's set of candidates."""
    common = set.intersection(*found)
    if len(common) != 1:
        raise LookupError(f"{what} at {len(common)} places of the struct (expected one)")
    return common.pop()


def _probes(cupy):
    """CuPy arrays of distinct layouts: views with offsets, 0-d, empty, broadcast, reversed, fp8."""
    import ml_dtypes

    base = cupy.empty((7, 9, 11), cupy.float16)
    flat = cupy.empty(1000, cupy.uint8)
    return [
        base[1:6, ::2, 3:],
        base[2, 1:],
        base[3, 4, 5],
        base[::-1, 2],
        base.T[1:],
        cupy.empty((0, 3), cupy.int32),
        cupy.broadcast_to(base[0, 0, 1:4], (5, 3)),
        flat[16:80].view(ml_dtypes.float8_e4m3fn).reshape(4, 16),
        cupy.empty((2, 3, 4, 5, 6), cupy.float32)[:, 1],
    ]


def find_cupy_offsets(probes):
    """``(shape, strides, dtype, data, ptr)``: byte offsets of a ``cupy.ndarray``'s shape and
    strides vectors (their begin and end pointers), its dtype and MemoryPointer, and that
    pointer's address, found on the ``probes`` (:func:`_probes`): each is the one place of the
    struct that holds the value the attributes give, for every probe. LookupError when not so."""
    size = type(probes[0]).__basicsize__
    pointer_size = type(probes[0].data).__basicsize__
    words = [_words(a, size) for a in probes]
    dtype = _common(
        [{8 * k for k, w in enumerate(ws) if w == id(a.dtype)} for a, ws in zip(probes, words)],
        "the dtype",
    )
    data = _common(
        [{8 * k for k, w in enumerate(ws) if w == id(a.data)} for a, ws in zip(probes, words)],
        "the MemoryPointer",
    )
    moved = [a for a in probes if a.data.ptr != a.data.mem.ptr]  # views: ptr is not the base's
    ptr = _common(
        [
            {8 * k for k, w in enumerate(_words(a.data, pointer_size)) if w == a.data.ptr}
            for a in moved
        ],
        "the data pointer",
    )
    # vectors: (begin, end) word pairs whose distance is ndim words in every probe, read only then
    pairs = set.intersection(
        *[
            {
                k
                for k in range(len(ws) - 1)
                if ws[k + 1] - ws[k] == 8 * a.ndim and (a.ndim == 0 or ws[k] > 4096)
            }
            for a, ws in zip(probes, words)
        ]
    )

    def holding(attr):
        return {
            8 * k
            for k in pairs
            if all(
                struct.unpack(f"{a.ndim}q", ctypes.string_at(ws[k], 8 * a.ndim)) == getattr(a, attr)
                for a, ws in zip(probes, words)
            )
        }

    return (
        _common([holding("shape")], "the shape"),
        _common([holding("strides")], "the strides"),
        dtype,
        data,
        ptr,
    )


def configure_cupy_reads(module) -> None:
    """Turn on the C replay's struct reads of CuPy arrays when the offsets are found and its
    reads give what the attributes do on every probe (``_state["cupy"]``: None, else why not)."""
    module.configure_cupy(None)  # off until found and checked (or for good, by the environment)
    if not env_flag("ROPEKV_NATIVE_CUPY", True):
        _state["cupy"] = f"disabled by ROPEKV_NATIVE_CUPY={os.environ['ROPEKV_NATIVE_CUPY']}"
        return
    try:
        import cupy

        probes = _probes(cupy)
        module.configure_cupy(cupy.ndarray, cupy.cuda.MemoryPointer, *find_cupy_offsets(probes))
        for a in probes:  # the C reads against the attributes, every probe
            got = module.raw_layout(a)
            want = (a.shape, a.strides, a.dtype, a.data.ptr, -1)
            if got != want:
                raise LookupError(f"a struct read gave {got}, the attributes {want}")
    except Exception as exc:  # noqa: BLE001 - any failure keeps the attributes
        module.configure_cupy(None)
        _state["cupy"] = f"{type(exc).__name__}: {exc}"
    else:
        _state["cupy"] = None


# ---- torch tensors read from their TensorImpl -------------------------------------------------
# torch's C++ structs have no Python-visible layout, so every offset is found the way CuPy's are:
# as the one place holding the value an attribute gives, on every probe tensor. What this relies
# on of torch (each checked on the probes, else the attributes stay): the Python object holds the
# TensorImpl pointer that ``Tensor._cdata`` gives (torch >= 2.10); the TensorImpl declares its
# storage, then the SizesAndStrides (ndim, then the sizes and strides inline up to a capacity, else
# behind a pointer), storage_offset_, numel_, data_type_ (a uint16 index), device_opt_ (type,
# index, engaged) and, last, key_set_; a StorageImpl holds its data pointer and the one flag byte
# that routes data_ptr() through a check (copy-on-write, throw or warn on mutable access).

_SCAN_BYTES = 384  # at most, of a TensorImpl scanned for its key set, its last field
_STORAGE_BYTES = 80  # at most, of a StorageImpl searched for the data pointer and the check byte
_DEVICE_TYPES = {"cpu": 0, "cuda": 1}  # c10::DeviceType codes


def _uwords(address, nbytes):
    """``nbytes`` at ``address`` as unsigned 64-bit words."""
    return struct.unpack(f"{nbytes // 8}Q", ctypes.string_at(address, nbytes // 8 * 8))


@functools.cache
def _usable_size():
    """The C library's ``malloc_usable_size`` (glibc, musl, jemalloc), or None."""
    try:
        fn = ctypes.CDLL(None).malloc_usable_size
    except (AttributeError, OSError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p], ctypes.c_size_t
    return fn


def _object_bytes(address, limit):
    """How many bytes of the C++ object at ``address`` (a TensorImpl or StorageImpl, allocated by
    ``new``) may be read: its allocation's usable size, at most ``limit``. LookupError when that
    size cannot be had (the probe then reads nothing beyond what it knows)."""
    usable = _usable_size()
    if usable is None:
        raise LookupError("no malloc_usable_size to bound the reads of torch's C++ structs")
    size = usable(address)
    if size < 16:
        raise LookupError(f"an allocation of {size} bytes at {address:#x} holds no TensorImpl")
    return min(size, limit) // 8 * 8


def _torch_probes(torch, device):
    """torch tensors of distinct layouts on ``device``: views with storage offsets, 0-d, empty,
    broadcast (stride 0), transposed, fp8, and 4 to 7 dimensions (sizes outside the TensorImpl)."""
    base = torch.empty((7, 9, 11), dtype=torch.float16, device=device)
    flat = torch.empty(1000, dtype=torch.uint8, device=device)
    return [
        base[1:6, ::2, 3:],
        base[2, 1:],
        base[3, 4, 5],
        base.transpose(0, 2)[1:],
        base[1:4, 5],
        torch.empty((0, 3), dtype=torch.int32, device=device),
        base[0, 0, 1:4].expand(5, 3),
        flat[16:80].view(torch.float8_e4m3fn).view(4, 16),
        flat[40:].view(torch.int64),
        torch.empty((2, 3, 4, 5, 6), dtype=torch.float32, device=device)[:, 1],
        torch.empty((3, 2, 3, 2, 3, 2), dtype=torch.bfloat16, device=device)[1:],
        torch.empty((2,) * 7, dtype=torch.float32, device=device).transpose(0, 6)[1:],
    ]


def find_torch_offsets(torch, probes):
    """The TensorImpl's offsets, as ``configure_torch`` takes them (impl, storage, ndim, cap,
    offset, numel, dtype, device, keyset; the storage's two come from
    :func:`find_storage_offsets`), and the probes' key set, found on ``probes``
    (:func:`_torch_probes`, all on one device). LookupError when any is not found once."""
    basic = type(probes[0]).__basicsize__
    impl = _common(
        [{8 * k for k, w in enumerate(_uwords(id(t), basic)) if w == t._cdata} for t in probes],
        "the TensorImpl pointer",
    )
    keysets = {torch._C._dispatch_keys(t).raw_repr() for t in probes}
    if len(keysets) != 1:
        raise LookupError(f"the probes have {len(keysets)} dispatch key sets (expected one)")
    keyset_value = keysets.pop()
    found = []
    for t in probes:  # the key set is the TensorImpl's last field: read no further than it, and
        # never past the object's allocation, word by word up to the first match
        end = _object_bytes(t._cdata, _SCAN_BYTES)
        at = next((b for b in range(0, end, 8) if _uwords(t._cdata + b, 8)[0] == keyset_value), -1)
        found.append({at})
    keyset = _common(found, "the key set")
    if keyset < 0:
        raise LookupError("the key set is not in the TensorImpl's first bytes")
    words = [_uwords(t._cdata, keyset) for t in probes]
    storage = _common(
        [
            {8 * k for k, w in enumerate(ws) if w == t.untyped_storage()._cdata}
            for t, ws in zip(probes, words)
        ],
        "the storage pointer",
    )
    small = [
        (t.dim(), tuple(t.shape), tuple(t.stride()), ws)
        for t, ws in zip(probes, words)
        if 1 <= t.dim() <= 3
    ]
    ndim = _common(
        [
            {8 * k for k in range(len(ws) - n) if ws[k] == n and ws[k + 1 : k + 1 + n] == shape}
            for n, shape, _, ws in small
        ],
        "the sizes",
    )
    k = ndim // 8 + 1
    cap = _common(
        [
            {c for c in range(3, 17) if ws[k + c : k + c + n] == strides}
            for n, _, strides, ws in small
        ],
        "the inline strides",
    )
    offset = _common(
        [
            {8 * k for k, w in enumerate(ws) if w == t.storage_offset()}
            for t, ws in zip(probes, words)
        ],
        "the storage offset",
    )
    numel = _common(
        [{8 * k for k, w in enumerate(ws) if w == t.numel()} for t, ws in zip(probes, words)],
        "numel",
    )
    dtype, device = _dtype_device_offsets(probes, numel, keyset)
    return (impl, storage, ndim, cap, offset, numel, dtype, device, keyset), keyset_value


def _dtype_device_offsets(probes, numel, keyset):
    """The TensorImpl's dtype and device offsets (for :func:`find_torch_offsets`): between its
    numel (at ``numel``) and its key set (at ``keyset``), the one uint16 that is the same for the
    probes of one dtype and differs between dtypes, and the one 3-byte run (device type, index,
    has-value) that matches every probe's device."""
    raw = [ctypes.string_at(t._cdata, keyset) for t in probes]
    after = range(numel + 8, keyset)  # data_type_ and device_opt_ lie between numel_ and key_set_

    def dtype_at(b):  # the same uint16 for the same dtype, different ones for different dtypes
        seen = {}
        for t, r in zip(probes, raw):
            seen.setdefault(t.dtype, set()).add(int.from_bytes(r[b : b + 2], "little"))
        return all(len(v) == 1 for v in seen.values()) and len(set.union(*seen.values())) == len(
            seen
        )

    dtype = _common([{b for b in after[::2] if b + 2 <= keyset and dtype_at(b)}], "the dtype")
    device = _common(
        [
            {
                b
                for b in after
                if r[b : b + 3]
                == bytes(
                    (
                        _DEVICE_TYPES[t.device.type],
                        (-1 if t.device.index is None else t.device.index) & 255,
                        1,
                    )
                )
            }
            for t, r in zip(probes, raw)
        ],
        "the device",
    )
    return dtype, device


def find_storage_offsets(torch, device):
    """``(data, check)``: a StorageImpl's data pointer (the one word that holds it in a storage
    whose deleter context is not that pointer, a NumPy array's on the CPU) and its
    mutable-data-pointer check byte (the one byte that both the throw and the warn flag set)."""
    import numpy as np

    host = torch.from_numpy(np.empty(16, np.float32))
    cdata = host.untyped_storage()._cdata
    data = _common(
        [
            {
                8 * k
                for k, w in enumerate(_uwords(cdata, _object_bytes(cdata, _STORAGE_BYTES)))
                if w == host.untyped_storage().data_ptr()
            }
        ],
        "the storage's data pointer",
    )
    changed = []
    for flag in (
        torch._C._set_throw_on_mutable_data_ptr,
        torch._C._set_warn_deprecated_on_mutable_data_ptr,
    ):
        t = torch.empty(4, device=device)
        cdata = t.untyped_storage()._cdata
        n = _object_bytes(cdata, _STORAGE_BYTES)
        before = ctypes.string_at(cdata, n)
        flag(t)
        after = ctypes.string_at(cdata, n)
        changed.append({b for b in range(data + 8, n) if before[b] != after[b]})
    return data, _common(changed, "the storage's check byte")


def _refused(torch, device):
    """Tensors the struct reads must leave to the attributes: one that must not be written, an
    inference tensor, a lazy negation."""
    must_not_write = torch.empty(4, device=device)
    torch._C._set_throw_on_mutable_data_ptr(must_not_write)
    with torch.inference_mode():
        inference = torch.empty(4, device=device)
    return [must_not_write, inference, torch._neg_view(torch.empty(4, device=device))]


def torch_reads_failed(reason) -> None:
    """Turn the C replay's torch struct reads off for the process: a read disagreed with the
    attributes (``_arrays._verified_fields``, on a device other than the probed one)."""
    module = _state["module"]
    if module is not None:
        module.configure_torch(None)
    _state["torch"] = f"LookupError: {reason}"


def configure_torch_reads(module, device) -> None:
    """Turn on the C replay's struct reads of torch tensors on devices of ``device``'s type (a
    torch device or index) when the offsets are found on tensors made there, its reads give what
    the attributes do on every probe and it leaves the tensors it must to the attributes
    (``_state["torch"]``: None, else why not). The first calls of new layouts read torch tensors
    through them too (``_arrays._from_torch``, through ``view_fields``). ``device`` None: off."""
    module.configure_torch(None)
    if device is None:
        _state["torch"] = "not probed yet"
        return
    if not env_flag("ROPEKV_NATIVE_TORCH", True):
        _state["torch"] = f"disabled by ROPEKV_NATIVE_TORCH={os.environ['ROPEKV_NATIVE_TORCH']}"
        return
    try:
        from ropekv import _arrays

        torch = sys.modules["torch"]
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        # the probes are normal tensors even when the first call runs in inference mode (its
        # tensors would all be inference tensors, which the reads must leave to the attributes)
        with torch.inference_mode(False):
            _probe_torch(module, torch, device, _arrays)
    except Exception as exc:  # noqa: BLE001 - any failure keeps the attributes
        module.configure_torch(None)
        _state["torch"] = f"{type(exc).__name__}: {exc}"
    else:
        _arrays._VERIFIED_TORCH_DEVICES.clear()
        if device.index is not None:
            _arrays._VERIFIED_TORCH_DEVICES.add(device.index)
        module.enable_torch()  # verified: the reads go live
        _state["torch"] = None


def _probe_torch(module, torch, device, _arrays):
    """Find, stage (``configure_torch``: not live) and verify the torch reads on ``device``;
    raises when any check fails."""
    probes = _torch_probes(torch, device)
    offsets, keyset_value = find_torch_offsets(torch, probes)
    storage = find_storage_offsets(torch, device)
    dtype_at = offsets[6]
    dtypes = []
    for name in _arrays._TORCH_NAMES:
        dtype = getattr(torch, name, None)
        if dtype is not None:
            t = torch.empty(16, dtype=torch.uint8, device=device).view(dtype)
            index = int.from_bytes(ctypes.string_at(t._cdata + dtype_at, 2), "little")
            dtypes.append((index, dtype, t.element_size()))
    module.configure_torch(
        torch.Tensor,
        (*offsets, *storage),
        keyset_value,
        _DEVICE_TYPES[device.type],
        tuple(dtypes),
    )
    checks = probes + [
        torch.empty(16, dtype=torch.uint8, device=device).view(d) for _, d, _ in dtypes
    ]
    for t in checks:  # the staged C reads against the attributes, every probe
        got = module.raw_layout(t, True)
        want = (tuple(t.shape), t.stride(), t.dtype, t.data_ptr(), t.get_device())
        if got != want:
            raise LookupError(f"a struct read gave {got}, the attributes {want}")
    for t in _refused(torch, device):
        if module.raw_layout(t, True) is not None:
            raise LookupError("a struct read took a tensor it must leave to the attributes")


# ---- torch tensors read through torch's DLPack C exchange API ---------------------------------

_DL_DEVICE_TYPES = {"cpu": 1, "cuda": 2}  # DLDeviceType codes


def configure_torch_exchange(module, device) -> None:
    """Read torch tensors on devices of ``device``'s type through torch's DLPack C exchange API
    (``torch.Tensor.__dlpack_c_exchange_api__``, DLPack 1.x): its dtype codes are found on
    tensors made there and its reads checked against the attributes on every probe layout before
    they are turned on; any failure leaves them off (LookupError / ValueError raised, the
    attributes read torch tensors). ``device`` None: off."""
    module.configure_exchange(None)
    if device is None:
        return
    from ropekv import _arrays

    torch = sys.modules["torch"]
    capsule = getattr(torch.Tensor, "__dlpack_c_exchange_api__", None)
    if capsule is None:
        raise LookupError(f"torch {torch.__version__} has no DLPack C exchange API")
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    dl_type = _DL_DEVICE_TYPES[device.type]
    try:
        with torch.inference_mode(False):
            module.configure_exchange(torch.Tensor, capsule, dl_type, ())  # the probe's reads
            dtypes, seen = [], set()
            for name in _arrays._TORCH_NAMES:
                dtype = getattr(torch, name, None)
                if dtype is None:
                    continue
                t = torch.empty(16, dtype=torch.uint8, device=device).view(dtype)
                try:
                    code, bits, lanes = module.dl_read(t)[3]
                except (RuntimeError, BufferError, TypeError):
                    continue  # a dtype DLPack has no code for: the attributes read it
                if lanes != 1 or (code, bits) in seen:
                    raise LookupError(f"torch exports {dtype} as DLPack {(code, bits, lanes)}")
                seen.add((code, bits))
                dtypes.append((code, bits, dtype, t.element_size()))
            module.configure_exchange(torch.Tensor, capsule, dl_type, tuple(dtypes))
            checks = _torch_probes(torch, device) + [
                torch.empty(16, dtype=torch.uint8, device=device).view(d) for _, _, d, _ in dtypes
            ]
            for t in checks:
                got = module.raw_layout(t)
                want = (tuple(t.shape), t.stride(), t.dtype, t.data_ptr(), t.get_device())
                if got != want:
                    raise LookupError(f"an exchange read gave {got}, the attributes {want}")
            if module.raw_layout(torch._neg_view(torch.empty(4, device=device))) is not None:
                raise LookupError("an exchange read took a lazy negation")
    except Exception:
        module.configure_exchange(None)
        raise
