"""The C replay of launch plans (``_native.c``): built with the system C compiler on first use,
cached on disk, and optional.

``load()`` gives the extension module, or None when it cannot be had (no C compiler, no Python
headers, ``ROPEKV_NATIVE=0``); every op then replays its plans in Python (``ropekv/_launch.py``),
with the same results, a few microseconds slower per call. ``state()`` says which, and why
(``ropekv info`` prints it).

The build goes to ``$ROPEKV_CACHE_DIR/native`` (default ``~/.cache/ropekv/native``), one file per
(source, Python ABI), written under a temporary name and renamed into place, so concurrent first
uses on one machine do not trip over each other. Compiling takes about a second, once.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shlex
import subprocess
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path

_SOURCE = Path(__file__).with_name("_native.c")
_MODULE = "ropekv._native_ext"
_lock = threading.Lock()
_state = {"module": None, "reason": "not loaded yet", "path": None}
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
    """One line: the C replay in use (and its file), or why not."""
    if _state["module"] is not None:
        return f"C plan replay ({_state['path']})"
    return f"Python plan replay ({_state['reason']})"
