"""The C replay of launch plans (``_native.c``): built with the system C compiler on first use,
cached on disk, and optional.

``load()`` gives the extension module, or None when it cannot be had (no C compiler, no Python
headers, ``ROPEKV_NATIVE=0``); every op then replays its plans in Python (``ropekv/_launch.py``),
with the same results, a few microseconds slower per call. ``state()`` says which, and why
(``ropekv info`` prints it).

CuPy arrays are read from their object struct (``raw_layout``), at offsets that
``configure_cupy_reads`` finds on arrays it makes and checks against the arrays' attributes before
turning the reads on (``ROPEKV_NATIVE_CUPY=0`` keeps the attributes); torch tensors are always read
through their attributes.

The build goes to ``$ROPEKV_CACHE_DIR/native`` (default ``~/.cache/ropekv/native``), one file per
(source, Python ABI), written under a temporary name and renamed into place, so concurrent first
uses on one machine do not trip over each other. Compiling takes about a second, once.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.machinery
import importlib.util
import os
import shlex
import subprocess
import sys
import struct
import sysconfig
import tempfile
import threading
from pathlib import Path

_SOURCE = Path(__file__).with_name("_native.c")
_MODULE = "ropekv._native_ext"
_lock = threading.Lock()
_state = {"module": None, "reason": "not loaded yet", "path": None, "cupy": "not probed yet"}
_tried = False


def cache_dir() -> Path:
    root = os.environ.get("ROPEKV_CACHE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "ropekv"
    return base / "native"


def _compiler():
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    return shlex.split(cc)


def _target(source: bytes) -> Path:
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    digest = hashlib.sha256(source + sys.version.encode() + suffix.encode()).hexdigest()[:16]
    return cache_dir() / f"_native_ext-{digest}{suffix}"


def build(target: Path | None = None) -> Path:
    """Compile ``_native.c`` into ``target`` (default: the cache path); returns the path.
    Raises OSError / CalledProcessError with the compiler's message when it cannot."""
    source = _SOURCE.read_bytes()
    target = target or _target(source)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    include = sysconfig.get_paths()["include"]
    if not Path(include, "Python.h").exists():
        raise OSError(f"no Python headers at {include} (install the python3-dev package)")
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        cmd = [*_compiler(), "-O2", "-std=c11", "-shared", "-fPIC", "-Wall",
               f"-I{include}", str(_SOURCE), "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise subprocess.CalledProcessError(done.returncode, cmd, done.stdout, done.stderr)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _import(path: Path):
    loader = importlib.machinery.ExtensionFileLoader(_MODULE, str(path))
    spec = importlib.util.spec_from_file_location(_MODULE, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def load():
    """The extension module (built on the first call in this environment), or None."""
    global _tried
    if _tried:
        return _state["module"]
    with _lock:
        if _tried:
            return _state["module"]
        if os.environ.get("ROPEKV_NATIVE", "1") == "0":
            _state["reason"] = "disabled by ROPEKV_NATIVE=0"
        else:
            try:
                path = build()
                _state.update(module=_import(path), path=str(path), reason=None)
            except subprocess.CalledProcessError as exc:
                _state["reason"] = (f"{shlex.join(exc.cmd)} failed: "
                                    f"{(exc.stderr or exc.stdout or '').strip()[:500]}")
            except (OSError, ImportError) as exc:
                _state["reason"] = f"{type(exc).__name__}: {exc}"
        _tried = True
    return _state["module"]


def state() -> str:
    """One line: the C replay in use (and its file, and how it reads CuPy arrays), or why not."""
    if _state["module"] is not None:
        cupy = _state["cupy"]
        reads = ("CuPy arrays read from their struct" if cupy is None
                 else f"CuPy arrays read through their attributes: {cupy}")
        return f"C plan replay ({_state['path']}; {reads})"
    return f"Python plan replay ({_state['reason']})"


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
    return [base[1:6, ::2, 3:], base[2, 1:], base[3, 4, 5], base[::-1, 2], base.T[1:],
            cupy.empty((0, 3), cupy.int32), cupy.broadcast_to(base[0, 0, 1:4], (5, 3)),
            flat[16:80].view(ml_dtypes.float8_e4m3fn).reshape(4, 16),
            cupy.empty((2, 3, 4, 5, 6), cupy.float32)[:, 1]]


def find_cupy_offsets(probes):
    """``(shape, strides, dtype, data, ptr)``: byte offsets of a ``cupy.ndarray``'s shape and
    strides vectors (their begin and end pointers), its dtype and MemoryPointer, and that
    pointer's address, found on the ``probes`` (:func:`_probes`): each is the one place of the
    struct that holds the value the attributes give, for every probe. LookupError when not so."""
    size = type(probes[0]).__basicsize__
    pointer_size = type(probes[0].data).__basicsize__
    words = [_words(a, size) for a in probes]
    dtype = _common([{8 * k for k, w in enumerate(ws) if w == id(a.dtype)}
                     for a, ws in zip(probes, words)], "the dtype")
    data = _common([{8 * k for k, w in enumerate(ws) if w == id(a.data)}
                    for a, ws in zip(probes, words)], "the MemoryPointer")
    moved = [a for a in probes if a.data.ptr != a.data.mem.ptr]  # views: ptr is not the base's
    ptr = _common([{8 * k for k, w in enumerate(_words(a.data, pointer_size)) if w == a.data.ptr}
                   for a in moved], "the data pointer")
    # vectors: (begin, end) word pairs whose distance is ndim words in every probe, read only then
    pairs = set.intersection(*[
        {k for k in range(len(ws) - 1)
         if ws[k + 1] - ws[k] == 8 * a.ndim and (a.ndim == 0 or ws[k] > 4096)}
        for a, ws in zip(probes, words)])

    def holding(attr):
        return {8 * k for k in pairs
                if all(struct.unpack(f"{a.ndim}q", ctypes.string_at(ws[k], 8 * a.ndim))
                       == getattr(a, attr) for a, ws in zip(probes, words))}

    return _common([holding("shape")], "the shape"), _common([holding("strides")], "the strides"), \
        dtype, data, ptr


def configure_cupy_reads(module) -> None:
    """Turn on the C replay's struct reads of CuPy arrays when the offsets are found and its
    reads give what the attributes do on every probe (``_state["cupy"]``: None, else why not)."""
    module.configure_cupy(None)  # off until found and checked (or for good, by the environment)
    if os.environ.get("ROPEKV_NATIVE_CUPY", "1") == "0":
        _state["cupy"] = "disabled by ROPEKV_NATIVE_CUPY=0"
        return
    try:
        import cupy

        probes = _probes(cupy)
        module.configure_cupy(cupy.ndarray, cupy.cuda.MemoryPointer, *find_cupy_offsets(probes))
        for a in probes:  # the C reads against the attributes, every probe
            got = module.raw_layout(a)
            want = (a.shape, a.strides, a.dtype, a.data.ptr)
            if got != want:
                raise LookupError(f"a struct read gave {got}, the attributes {want}")
    except Exception as exc:  # noqa: BLE001 - any failure keeps the attributes
        module.configure_cupy(None)
        _state["cupy"] = f"{type(exc).__name__}: {exc}"
    else:
        _state["cupy"] = None
