"""ropekv's disk cache: where it is, who may have written it, and how entries are read and written.

Three kinds of entries live under the cache directory (``$ROPEKV_CACHE_DIR``, else
``~/.cache/ropekv``): ``native/`` the C replay extension (``_native.py``), ``cubin/`` the sm_90a
cubins of the ``qkv_wgmma`` kernels and ``offline/`` NVRTC results of the compile tests
(``_compile.py``). Whatever is in them is loaded into the process (a shared library, a cubin
handed to the driver), so nothing is used unless it is trusted:

- every directory is created private to the user (mode 0700) and used only when it is a directory
  that the user owns and that neither group nor others can write; every file likewise (a regular
  file, the user's, not group/other-writable, opened without following a symlink);
- an entry is a data file named by its content's SHA-256 and a record (``<key>.entry``, JSON) that
  names it and holds that digest: the data is read and hashed before it is used, a mismatch (a
  truncated, corrupt or swapped file) makes the caller rebuild it;
- files are written under a temporary name unique to the writer (``mkstemp`` in the same
  directory), flushed to disk (``fsync``) and renamed into place, so a reader never sees half a
  file and concurrent writers never collide;
- when the directory cannot be had (no home directory, not a directory, not writable, not
  trusted) the process uses a private temporary directory instead (``mkdtemp``, removed at exit),
  with one warning per process, and nothing fails for want of a cache.

These costs are paid on the first use of each entry only; the hot path never comes here.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

KINDS = ("native", "cubin", "offline")
COMPILE_TIMEOUT = 300.0  # seconds a compiler may run (ROPEKV_COMPILE_TIMEOUT)
_lock = threading.RLock()
_roots: dict = {}  # (ROPEKV_CACHE_DIR, HOME) -> (root or None, why the configured one is not used)
_fallback: list = []  # the process's private temporary directory, once made
_notes: list = []  # what was refused or failed, for `ropekv info` (the first one was warned)


class UntrustedError(OSError):
    """A cache directory or file another user could have written."""


def configured_dir() -> Path:
    """``$ROPEKV_CACHE_DIR``, else ``~/.cache/ropekv``; OSError when neither can be had."""
    root = os.environ.get("ROPEKV_CACHE_DIR")
    if root:
        return Path(root)
    try:
        return Path.home() / ".cache" / "ropekv"
    except (RuntimeError, KeyError, OSError) as exc:  # no $HOME and no passwd entry
        raise OSError(f"no home directory ({exc}) and no ROPEKV_CACHE_DIR") from None


def _untrusted(st, what) -> str | None:
    """Why a file or directory of stat ``st`` must not be trusted, or None."""
    getuid = getattr(os, "getuid", None)
    if getuid is not None and st.st_uid != getuid():
        return f"{what} is owned by uid {st.st_uid}, not by this user (uid {getuid()})"
    if getuid is not None and st.st_mode & 0o022:
        return f"{what} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def check_dir(path: Path) -> None:
    """Raise (UntrustedError, NotADirectoryError) unless ``path`` is a trusted directory."""
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"{path} is not a directory")
    why = _untrusted(st, str(path))
    if why:
        raise UntrustedError(why)


def _private_dir(path: Path) -> Path:
    """``path``, created (0700) when missing, checked either way."""
    try:
        path.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    check_dir(path)
    return path


def note(message) -> None:
    """Record a cache problem; the first of the process is also a warning."""
    with _lock:
        _notes.append(message)
        first = len(_notes) == 1
    if first:
        warnings.warn(f"ropekv: {message}", RuntimeWarning, stacklevel=3)


def notes() -> list:
    return list(_notes)


def fallback_dir() -> Path | None:
    """The process's private temporary cache (made once, removed at exit), or None."""
    with _lock:
        if not _fallback:
            try:
                path = Path(tempfile.mkdtemp(prefix="ropekv-cache-"))
            except OSError:
                _fallback.append(None)
            else:
                atexit.register(shutil.rmtree, path, True)
                _fallback.append(path)
        return _fallback[0]


def root() -> Path | None:
    """The cache directory in use: the configured one when it is (or can be made) a trusted
    directory, else the process's temporary one (one warning), else None (no disk cache)."""
    key = (os.environ.get("ROPEKV_CACHE_DIR"), os.environ.get("HOME"))
    with _lock:
        if key not in _roots:
            try:
                _roots[key] = (_private_dir(configured_dir()), None)
            except OSError as exc:
                why = f"{exc}: using a temporary cache directory for this process"
                _roots[key] = (None, why)
                note(why)
        path, _ = _roots[key]
        return path if path is not None else fallback_dir()


def directory(kind: str) -> Path | None:
    """``root()/kind`` as a trusted directory, else the temporary one's (noted), else None."""
    base = root()
    for candidate in (base, fallback_dir()):
        if candidate is None:
            continue
        try:
            return _private_dir(candidate / kind)
        except OSError as exc:
            if candidate == base:
                note(f"{exc}: using a temporary cache directory for this process")
    return None


def read_trusted(path: Path) -> bytes:
    """The bytes of ``path``: a regular file of this user that group and others cannot write,
    opened without following a symlink. OSError (UntrustedError) otherwise."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UntrustedError(f"{path} is not a regular file")
        why = _untrusted(st, str(path))
        if why:
            raise UntrustedError(why)
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """``data`` to ``path``: a temporary file unique to this writer in the same directory (mode
    0600), fsync'ed, then renamed over ``path``. OSError when it cannot be written."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def lookup(kind: str, key: str):
    """``(data path, data, record)`` of the entry ``key`` when it is there, trusted and its data
    hashes to the digest recorded, else None (the caller builds it and calls :func:`store`)."""
    base = directory(kind)
    if base is None:
        return None
    try:
        record = json.loads(read_trusted(base / f"{key}.entry"))
        digest, name = record["sha256"], record["file"]
        if not (isinstance(name, str) and name.startswith(f"{key}-{digest[:16]}")) or "/" in name:
            return None
        data = read_trusted(base / name)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if _digest(data) != digest:
        return None
    return base / name, data, record


def store(kind: str, key: str, data: bytes, suffix: str = "", **meta) -> Path:
    """Keep ``data`` as the entry ``key`` (``meta`` in its record); returns the data file's path.
    A directory that cannot be written gives way to the temporary one (noted); OSError when no
    directory can take it."""
    digest = _digest(data)
    name = f"{key}-{digest[:16]}{suffix}"
    record = json.dumps({"sha256": digest, "file": name, **meta}).encode()
    base, error = directory(kind), None
    while base is not None:
        try:
            write_atomic(base / name, data)
            write_atomic(base / f"{key}.entry", record)
            return base / name
        except OSError as exc:
            error, temporary = exc, _temporary(kind)
            if temporary is None or temporary == base:
                break
            note(f"cache directory {base} not writable ({exc}): using a temporary one")
            base = temporary
    raise error or OSError("no directory for ropekv's cache")


def _temporary(kind):
    base = fallback_dir()
    if base is None:
        return None
    try:
        return _private_dir(base / kind)
    except OSError:
        return None


def compile_timeout() -> float:
    """``$ROPEKV_COMPILE_TIMEOUT`` (seconds, > 0), else :data:`COMPILE_TIMEOUT`."""
    text = os.environ.get("ROPEKV_COMPILE_TIMEOUT", "").strip()
    if not text:
        return COMPILE_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise ValueError(
            f"ROPEKV_COMPILE_TIMEOUT must be a positive number of seconds, got {text!r}"
        )
    return value


def run_tool(cmd, timeout=None):
    """``cmd`` in its own process group, its output captured; the whole group killed after
    ``timeout`` seconds (default :func:`compile_timeout`) and TimeoutExpired raised, so a hung
    compiler (or a child of it holding the pipes) cannot block the caller."""
    timeout = compile_timeout() if timeout is None else timeout
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=hasattr(os, "killpg"),
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        if hasattr(os, "killpg"):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def describe() -> str:
    """One line for ``ropekv info``: the cache directory in use and its entries, or why none."""
    path = root()
    if path is None:
        return f"none (no disk cache: {'; '.join(_notes) or 'no temporary directory'})"
    counts = []
    for kind in KINDS:
        d = path / kind
        counts.append(f"{kind} {sum(1 for _ in d.glob('*.entry')) if d.is_dir() else 0}")
    text = f"{path} (entries: {', '.join(counts)})"
    if _notes:  # refused, missing or unwritable: what was noted, last first
        text += f"; {_notes[-1]}"
    return text


def _reset() -> None:
    """Forget the resolved directories and notes (tests)."""
    with _lock:
        _roots.clear()
        _notes.clear()
