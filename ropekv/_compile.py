"""Kernel loader: read ``kernels/<stem>.cu``, compile lazily with NVRTC, cache per device.

Local headers (``#include "common.cuh"``) are inlined into the source text, so CuPy's disk cache,
whose key is the source and the options but not the files behind ``-I``, sees every change.
Nothing compiles at import time.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np

from ropekv import _cache
from ropekv._arrays import BFLOAT16, FLOAT8_E4M3FN, FLOAT8_E5M2, FLOAT16, FLOAT32, INT32, INT64

KERNEL_DIR = Path(__file__).parent / "kernels"
OPTIONS = ("-std=c++17",)

_LOCAL_INCLUDE = re.compile(r'^\s*#include\s+"([^"]+)"\s*$', re.MULTILINE)

# The C type each dtype has in the kernels.
C_TYPES = {
    FLOAT16: "__half",
    BFLOAT16: "__nv_bfloat16",
    FLOAT32: "float",
    FLOAT8_E4M3FN: "__nv_fp8_e4m3",
    FLOAT8_E5M2: "__nv_fp8_e5m2",
    INT32: "int",
    INT64: "long long",
    np.dtype(np.int8): "signed char",  # int8 caches (per-token-head scales)
}


def c_type(dtype):
    return C_TYPES[np.dtype(dtype)]


def c_bool(flag):
    return "true" if flag else "false"


def name_expression(kernel, *template_args):
    """``kernel<arg, ...>`` spelled the same way for compile and lookup."""
    return f"{kernel}<{', '.join(str(a) for a in template_args)}>"


def rope_instantiations(expression, input_dtypes, fp8_dtypes):
    """``expression(dtype, cache_dtype, is_neox, n)`` over the product every RoPE op selects from:
    input dtype, output of that dtype or fp8, neox or interleaved, vector width 8/4/2/1 elements
    (interleaved pairs need at least 2)."""
    for dtype in input_dtypes:
        for is_neox in (True, False):
            for n in (8, 4, 2, 1) if is_neox else (8, 4, 2):
                for cache_dtype in (dtype, *fp8_dtypes):
                    yield expression(dtype, cache_dtype, is_neox, n)


@functools.cache
def read_source(stem):
    """The source of ``kernels/<stem>.cu`` with its local headers inlined once each."""
    seen = set()

    def expand(path):
        def include(match):
            target = (path.parent / match.group(1)).resolve()
            if target in seen:
                return ""
            seen.add(target)
            return f"// begin {match.group(1)}\n{expand(target)}\n// end {match.group(1)}"

        return _LOCAL_INCLUDE.sub(include, path.read_text())

    return expand(KERNEL_DIR / f"{stem}.cu")


def kernel_stems():
    return sorted(p.stem for p in KERNEL_DIR.glob("*.cu"))


@functools.cache
def _header_options():
    """``-I`` for the CUDA runtime headers when they come from a wheel (cuda_fp8.h and friends)."""
    try:
        from cuda.pathfinder import find_nvidia_header_directory
    except ImportError:
        return ()
    try:
        path = find_nvidia_header_directory("cudart")
    except (RuntimeError, OSError):  # no such header set here: NVRTC's default search
        return ()
    return (f"-I{path}",) if path else ()


# Kernels built on architecture-specific instructions (sm_90a's wgmma): they compile for the
# device's "a" target, which CuPy's compiler never selects, so NVRTC builds their cubin here.
ARCH_SPECIFIC = ("qkv_wgmma<",)


def arch_specific(expression):
    return expression.startswith(ARCH_SPECIFIC)


@functools.cache
def _module(stem, expression, device_id):
    import cupy

    with cupy.cuda.Device(device_id):
        module = cupy.RawModule(
            code=read_source(stem),
            options=OPTIONS + _header_options(),
            name_expressions=(expression,),
        )
        module.compile()
    return module


@functools.cache
def get_kernel(stem, expression, device_id):
    """The compiled kernel ``expression`` of ``kernels/<stem>.cu`` for one device (cached)."""
    import cupy

    with cupy.cuda.Device(device_id):
        if arch_specific(expression):
            arch = f"sm_{cupy.cuda.Device(device_id).compute_capability}a"
            path, lowered = compile_cubin(stem, expression, arch)
            return cupy.RawModule(path=str(path)).get_function(lowered)
        return _module(stem, expression, device_id).get_function(expression)


def offline_cache_dir():
    """ropekv's cache directory (:mod:`ropekv._cache`: ``$ROPEKV_CACHE_DIR``, else
    ``~/.cache/ropekv``, else a private temporary one), where :func:`compile_offline` keeps its
    results (``offline/``) and :func:`compile_cubin` its cubins (``cubin/``)."""
    return _cache.root()


def _header_stamp(options):
    """Name, size and mtime of every file in each ``-I`` directory: a header upgraded in place
    (same path, new wheel) changes the cache key."""
    stamp = []
    for option in options:
        if option.startswith("-I"):
            with os.scandir(option[2:]) as entries:
                for entry in entries:
                    if entry.is_file():
                        st = entry.stat()
                        stamp.append((option, entry.name, st.st_size, st.st_mtime_ns))
    return sorted(stamp)


def _offline_key(source, options, expressions, version):
    """SHA-256 of everything the compile result depends on."""
    text = json.dumps([source, options, list(expressions), version, _header_stamp(options)])
    return hashlib.sha256(text.encode()).hexdigest()


def _read_cached(kind, key, expressions):
    """The lowered names of a trusted, intact cache entry for ``expressions``, or None."""
    found = _cache.lookup(kind, key)
    if found is None:
        return None
    path, data, record = found
    try:
        lowered = json.loads(data) if kind == "offline" else record.get("lowered")
    except ValueError:
        return None
    ok = isinstance(lowered, dict) and set(lowered) == set(expressions)
    ok = ok and all(isinstance(v, str) for v in lowered.values())
    return (path, lowered) if ok else None


def compile_offline(stem, expressions, arch):
    """Compile ``expressions`` of ``kernels/<stem>.cu`` for ``arch`` (e.g. ``"sm_90"``) with NVRTC
    alone, without a GPU or driver. Returns ``{expression: lowered name}``; raises RuntimeError
    with the compiler log on failure. Used by the compile tests.

    A successful result is kept on disk (:func:`offline_cache_dir`, ``offline/``; trusted and
    hash-checked before use, :mod:`ropekv._cache`), keyed by a hash
    of the source with its headers inlined, the options, the expressions, the NVRTC version and
    the CUDA headers' file stamps, so an unchanged kernel is not compiled again and a changed one
    always is. Failures are never cached."""
    from cupy_backends.cuda.libs import nvrtc

    source = read_source(stem)
    options = [f"--gpu-architecture={arch}", *OPTIONS, *_header_options()]
    key = _offline_key(source, options, expressions, nvrtc.getVersion())
    entry = f"{stem}-{arch}-{key}"
    cached = _read_cached("offline", entry, expressions)
    if cached is not None:
        return cached[1]
    lowered, _ = _nvrtc_compile(stem, source, expressions, options, arch)
    try:  # a cache that cannot be written only costs the next run a compile
        _cache.store("offline", entry, json.dumps(lowered).encode(), ".json")
    except OSError:
        pass
    return lowered


def _nvrtc_compile(stem, source, expressions, options, arch, cubin=False):
    """NVRTC on ``source``: ``({expression: lowered name}, the cubin or None)``; RuntimeError
    with the compiler log on failure."""
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(source, f"{stem}.cu", [], [])
    try:
        for expression in expressions:
            nvrtc.addNameExpression(prog, expression)
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as exc:
            raise RuntimeError(
                f"NVRTC failed on {stem}.cu for {arch}:\n{nvrtc.getProgramLog(prog)}"
            ) from exc
        lowered = {e: nvrtc.getLoweredName(prog, e) for e in expressions}
        return lowered, nvrtc.getCUBIN(prog) if cubin else None
    finally:
        nvrtc.destroyProgram(prog)


def compile_cubin(stem, expression, arch):
    """The cubin of one kernel of ``kernels/<stem>.cu`` for ``arch`` (e.g. ``"sm_90a"``), built by
    NVRTC and kept on disk beside :func:`compile_offline`'s results (same key): ``(path, lowered
    name)``. A cached cubin is handed on only when it is trusted and hashes to the digest recorded
    when it was built (:mod:`ropekv._cache`); else it is built again. NVRTC runs in this process
    (a library call, no subprocess to time out)."""
    from cupy_backends.cuda.libs import nvrtc

    source = read_source(stem)
    options = [f"--gpu-architecture={arch}", *OPTIONS, *_header_options()]
    key = _offline_key(source, options, [expression], nvrtc.getVersion())
    entry = f"{stem}-{arch}-{key}"
    cached = _read_cached("cubin", entry, [expression])
    if cached is not None:
        return cached[0], cached[1][expression]
    names, cubin = _nvrtc_compile(stem, source, [expression], options, arch, cubin=True)
    return _cache.store("cubin", entry, cubin, ".cubin", lowered=names), names[expression]
