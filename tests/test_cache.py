"""ropekv's disk cache (``ropekv/_cache.py``) and environment (``ropekv/_env.py``), on the CPU:
no home directory, an unwritable or untrusted cache directory, damaged and concurrent entries, a
planted C extension that must not run, a hanging compiler, ``ropekv info``, the boolean rule of
every ``ROPEKV_*`` switch and the page that lists them (``docs/environment.md``)."""

from __future__ import annotations

import concurrent.futures
import importlib.machinery
import os
import pwd
import re
import shutil
import stat
import subprocess
import sys
import sysconfig
import threading
import time
import types
import warnings
from pathlib import Path

import pytest

import ropekv
from ropekv import _cache, _checks, _env, _native, cli

ROOT = Path(__file__).resolve().parent.parent
SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]
TINY = "template <typename T> __global__ void fill(T* p) { p[threadIdx.x] = T(1); }\n"


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch, tmp_path):
    """A private cache directory in tmp_path, no directory resolved and no warning given yet."""
    monkeypatch.setenv("ROPEKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(_cache, "_fallback", [])  # this test's own temporary directory
    _cache._reset()
    yield tmp_path / "cache"
    _cache._reset()


@pytest.fixture
def fresh_native(monkeypatch):
    """``_native.load()`` runs again (its state restored afterwards)."""
    monkeypatch.setattr(_native, "_tried", False)
    monkeypatch.setattr(
        _native,
        "_state",
        {"module": None, "reason": "", "path": None, "cupy": "-", "torch": "-"},
    )


@pytest.fixture
def tiny(monkeypatch):
    """compile_cubin / compile_offline on a one-line kernel; ``.compiles`` counts NVRTC runs."""
    nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    from ropekv import _compile

    state = types.SimpleNamespace(compiles=[])
    real = nvrtc.compileProgram
    monkeypatch.setattr(_compile, "read_source", lambda stem: TINY)
    monkeypatch.setattr(nvrtc, "compileProgram", lambda *a: state.compiles.append(a) or real(*a))
    return state


def needs_cc():
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler")
    if not Path(sysconfig.get_paths()["include"], "Python.h").exists():
        pytest.skip("no Python headers")


def no_home(monkeypatch):
    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.delenv("ROPEKV_CACHE_DIR", raising=False)

    def getpwuid(uid):
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.setattr(pwd, "getpwuid", getpwuid)
    with pytest.raises(RuntimeError):
        Path.home()  # what the old code called on every device call


# ---- item 4: no home directory ---------------------------------------------------------------


def test_no_home_directory_uses_a_private_temporary_cache_with_one_warning(monkeypatch, tiny):
    from ropekv._compile import compile_cubin

    no_home(monkeypatch)
    with pytest.warns(RuntimeWarning, match="no home directory") as caught:
        path, lowered = compile_cubin("tiny", "fill<float>", "sm_90a")
    assert len(caught) == 1
    assert path.read_bytes()[:4] == b"\x7fELF" and "fill" in lowered
    base = _cache.root()
    assert base.name.startswith("ropekv-cache-") and stat.S_IMODE(base.stat().st_mode) == 0o700
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning, no second attempt
        assert compile_cubin("tiny", "fill<float>", "sm_90a") == (path, lowered)
    assert len(tiny.compiles) == 1


def test_info_without_a_home_directory(monkeypatch, capsys, fresh_native):
    no_home(monkeypatch)
    monkeypatch.setenv("ROPEKV_NATIVE", "0")
    with pytest.warns(RuntimeWarning, match="no home directory"):
        assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"ropekv cache +\S*ropekv-cache-", out), out
    assert "no home directory" in out and "cupy cache" in out


# ---- item 5: the cubin cache -----------------------------------------------------------------


def test_an_unwritable_cache_directory_still_gives_a_cubin(monkeypatch, tmp_path, tiny):
    from ropekv._compile import compile_cubin

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("ROPEKV_CACHE_DIR", str(blocker))
    with pytest.warns(RuntimeWarning, match="not a directory"):
        path, _ = compile_cubin("tiny", "fill<float>", "sm_90a")
    assert path.is_file() and blocker.is_file()


def test_an_unwritable_directory_falls_back_when_writing(monkeypatch, fresh_cache, tiny):
    """A trusted directory whose writes fail (read-only file system, full disk)."""
    from ropekv._compile import compile_cubin

    real = _cache.write_atomic

    def write(path, data):
        if fresh_cache in path.parents:
            raise OSError(30, "Read-only file system")
        real(path, data)

    monkeypatch.setattr(_cache, "write_atomic", write)
    with pytest.warns(RuntimeWarning, match="not writable"):
        path, _ = compile_cubin("tiny", "fill<float>", "sm_90a")
    assert path.is_file() and fresh_cache not in path.parents


def test_a_truncated_cubin_is_rebuilt(tiny):
    from ropekv._compile import compile_cubin

    path, _ = compile_cubin("tiny", "fill<float>", "sm_90a")
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) // 2])
    again, _ = compile_cubin("tiny", "fill<float>", "sm_90a")
    assert len(tiny.compiles) == 2 and again.read_bytes() == whole


def test_a_cubin_record_naming_another_file_is_rebuilt(tiny, fresh_cache):
    from ropekv._compile import compile_cubin

    path, _ = compile_cubin("tiny", "fill<float>", "sm_90a")
    (entry,) = (fresh_cache / "cubin").glob("*.entry")
    entry.write_text(entry.read_text().replace(path.name, "../../elsewhere.cubin"))
    assert compile_cubin("tiny", "fill<float>", "sm_90a")[0] == path
    assert len(tiny.compiles) == 2


def test_threads_compiling_one_cubin_all_get_it(tiny):
    from ropekv._compile import compile_cubin

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: compile_cubin("tiny", "fill<float>", "sm_90a"), range(8)))
    assert len(set(results)) == 1 and results[0][0].read_bytes()[:4] == b"\x7fELF"


def test_concurrent_writers_never_show_a_partial_file(fresh_cache, monkeypatch):
    """Writers of one entry with distinct contents and readers at once: a reader gets None or one
    whole content, never part of one; every writer's temporary file is its own and fsync'ed."""
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    contents = [bytes([i]) * (1 << 20) for i in range(6)]
    seen, stop = [], threading.Event()

    def reader():
        while not stop.is_set():
            found = _cache.lookup("cubin", "k")
            if found is not None:
                seen.append(found[1])

    readers = [threading.Thread(target=reader) for _ in range(2)]
    for t in readers:
        t.start()
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        for _ in range(3):
            list(pool.map(lambda c: _cache.store("cubin", "k", c, ".cubin"), contents))
    stop.set()
    for t in readers:
        t.join()
    assert all(data in contents for data in seen)
    assert len(synced) >= 2 * 3 * len(contents)  # data and record, every write
    assert _cache.lookup("cubin", "k")[1] in contents
    assert not list((fresh_cache / "cubin").glob("*.tmp"))


def test_a_poisoned_offline_result_in_a_shared_directory_is_not_used(tiny, fresh_cache):
    from ropekv._compile import compile_offline

    want = compile_offline("tiny", ["fill<float>"], "sm_80")
    (data,) = (fresh_cache / "offline").glob("*.json")
    data.write_text('{"fill<float>": "poisoned"}')  # a mismatched digest
    assert compile_offline("tiny", ["fill<float>"], "sm_80") == want
    assert len(tiny.compiles) == 2
    os.chmod(fresh_cache / "offline", 0o777)  # others could have written it
    with pytest.warns(RuntimeWarning, match="writable by group or others"):
        assert compile_offline("tiny", ["fill<float>"], "sm_80") == want
    assert len(tiny.compiles) == 3


# ---- item 6: what is trusted -----------------------------------------------------------------


def test_the_cache_directory_is_private(fresh_cache):
    _cache.store("native", "k", b"data")
    for d in (fresh_cache, fresh_cache / "native"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
    for f in (fresh_cache / "native").iterdir():
        assert stat.S_IMODE(f.stat().st_mode) & 0o077 == 0


def test_files_of_another_user_or_writable_by_others_are_refused(fresh_cache, monkeypatch):
    path = _cache.store("cubin", "k", b"cubin")
    assert _cache.lookup("cubin", "k")[1] == b"cubin"
    os.chmod(path, 0o666)
    assert _cache.lookup("cubin", "k") is None
    os.chmod(path, 0o600)
    real = os.fstat

    def foreign(fd):  # tests run as root, which owns everything: another owner, as stat says
        st = real(fd)
        return os.stat_result((st.st_mode, st.st_ino, st.st_dev, st.st_nlink, 4242, *st[5:]))

    monkeypatch.setattr(os, "fstat", foreign)
    assert _cache.lookup("cubin", "k") is None
    monkeypatch.setattr(os, "fstat", real)
    assert _cache.lookup("cubin", "k")[1] == b"cubin"
    link = path.with_name(path.name + ".link")
    os.symlink(path, link)
    with pytest.raises(OSError):
        _cache.read_trusted(link)


def test_a_directory_of_another_user_is_refused(fresh_cache, monkeypatch):
    fresh_cache.mkdir(mode=0o700)
    real = os.stat

    def foreign(path, *a, **k):
        st = real(path, *a, **k)
        if Path(path) == fresh_cache:
            return os.stat_result((st.st_mode, st.st_ino, st.st_dev, st.st_nlink, 4242, *st[5:]))
        return st

    monkeypatch.setattr(os, "stat", foreign)
    with pytest.warns(RuntimeWarning, match="owned by uid 4242"):
        assert _cache.root() != fresh_cache


PLANTED = r"""
#include <Python.h>
#include <stdio.h>
#include <stdlib.h>
PyMODINIT_FUNC PyInit__native_ext(void) {
    FILE *f = fopen(getenv("ROPEKV_TEST_MARKER"), "w");
    if (f) fclose(f);
    PyErr_SetString(PyExc_ImportError, "planted");
    return NULL;
}
"""


@pytest.fixture
def planted(tmp_path, fresh_cache, monkeypatch, fresh_native):
    """A hostile extension (it creates ``marker`` when loaded) at the C replay's cache path, in
    the old layout and as a cache entry with its true digest; ``.genuine``: the real build's
    entry, built first."""
    needs_cc()
    marker = tmp_path / "ran"
    monkeypatch.setenv("ROPEKV_TEST_MARKER", str(marker))
    source = tmp_path / "planted.c"
    source.write_text(PLANTED)
    evil = tmp_path / "planted.so"
    include = sysconfig.get_paths()["include"]
    subprocess.run(
        [
            shutil.which("cc") or shutil.which("gcc"),
            "-shared",
            "-fPIC",
            f"-I{include}",
            str(source),
            "-o",
            str(evil),
        ],
        check=True,
    )
    genuine = _native.build()
    key = _native._key(_native._SOURCE.read_bytes())
    old = fresh_cache / "native" / f"{key}{SUFFIX}"  # where the old code loaded from
    shutil.copy(evil, old)
    return types.SimpleNamespace(
        marker=marker, evil=evil, genuine=genuine, key=key, dir=fresh_cache / "native"
    )


def test_a_planted_extension_in_a_shared_directory_is_not_loaded(planted):
    _cache.store("native", planted.key, planted.evil.read_bytes(), ".so")  # with its digest
    os.chmod(planted.dir, 0o777)
    with pytest.warns(RuntimeWarning, match="writable by group or others"):
        module = _native.load()
    assert not planted.marker.exists()
    assert module is not None and planted.dir not in Path(_native._state["path"]).parents


def test_a_planted_extension_with_a_wrong_digest_is_not_loaded(planted):
    data = planted.genuine.read_bytes()
    shutil.copy(planted.evil, planted.genuine)  # the recorded digest is the genuine build's
    assert _native.load() is not None
    assert not planted.marker.exists()
    assert Path(_native._state["path"]).read_bytes() == data  # built again


def test_info_does_not_load_a_planted_extension(planted, capsys):
    _cache.store("native", planted.key, planted.evil.read_bytes(), ".so")
    os.chmod(planted.dir, 0o775)
    with pytest.warns(RuntimeWarning):
        assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert not planted.marker.exists()
    assert "writable by group or others" in out and "C plan replay" in out


def test_an_extension_that_does_not_load_is_rebuilt(fresh_cache, fresh_native):
    needs_cc()
    data = _native.build().read_bytes()
    key = _native._key(_native._SOURCE.read_bytes())
    _cache.store("native", key, b"not an ELF file", SUFFIX)  # an intact entry that cannot load
    assert _native.load() is not None
    assert Path(_native._state["path"]).read_bytes() == data


# ---- item 11: a hanging compiler -------------------------------------------------------------


def test_a_hanging_c_compiler_falls_back_to_the_python_replay(tmp_path, monkeypatch, fresh_native):
    cc = tmp_path / "hang-cc"
    cc.write_text("#!/bin/sh\nsleep 60\n")
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("ROPEKV_COMPILE_TIMEOUT", "0.5")
    t0 = time.monotonic()
    with pytest.warns(RuntimeWarning, match="ran past 0.5 s") as caught:
        assert _native.load() is None
    assert time.monotonic() - t0 < 10 and len(caught) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _native.load() is None  # not tried again, no second warning
    assert "Python plan replay" in _native.state()


def test_the_compile_timeout_must_be_a_positive_number(monkeypatch):
    for bad in ("0", "-1", "x", "inf", "nan"):
        monkeypatch.setenv("ROPEKV_COMPILE_TIMEOUT", bad)
        with pytest.raises(ValueError, match="ROPEKV_COMPILE_TIMEOUT"):
            _cache.compile_timeout()
    monkeypatch.setenv("ROPEKV_COMPILE_TIMEOUT", "12.5")
    assert _cache.compile_timeout() == 12.5


# ---- item 10: one boolean rule ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "want"),
    [("1", True), ("true", True), ("YES", True), (" On ", True), ("0", False), ("false", False)]
    + [("False", False), ("no", False), ("OFF", False), ("", False), (None, "default")],
)
def test_env_flag_spellings(monkeypatch, value, want):
    if value is None:
        monkeypatch.delenv("ROPEKV_X", raising=False)
    else:
        monkeypatch.setenv("ROPEKV_X", value)
    for default in (True, False):
        expected = default if want == "default" else want
        assert _env.env_flag("ROPEKV_X", default) is expected
        assert _env.fast_flag("ROPEKV_X", default)() is expected


@pytest.mark.parametrize("value", ["2", "maybe", "tru", "0x1", "enable"])
def test_env_flag_rejects_other_values(monkeypatch, value):
    monkeypatch.setenv("ROPEKV_X", value)
    with pytest.raises(ValueError, match="ROPEKV_X"):
        _env.env_flag("ROPEKV_X")
    with pytest.raises(ValueError, match="ROPEKV_X"):
        _env.fast_flag("ROPEKV_X")()


def legacy_view():
    return types.SimpleNamespace(name="k_cache", readonly=False, legacy=True)


@pytest.mark.parametrize("value", ["false", "no", "off", "0", ""])
def test_legacy_dlpack_writes_stay_off_for_false_spellings(monkeypatch, value):
    monkeypatch.setenv("ROPEKV_ALLOW_LEGACY_DLPACK_WRITES", value)
    with pytest.raises(BufferError, match="legacy"):
        _checks.check_writable(legacy_view())


def test_legacy_dlpack_writes_on_and_a_typo(monkeypatch):
    monkeypatch.setenv("ROPEKV_ALLOW_LEGACY_DLPACK_WRITES", "true")
    _checks.check_writable(legacy_view())
    monkeypatch.setenv("ROPEKV_ALLOW_LEGACY_DLPACK_WRITES", "ture")
    with pytest.raises(ValueError, match="ROPEKV_ALLOW_LEGACY_DLPACK_WRITES"):
        _checks.check_writable(legacy_view())


def test_check_indices_and_native_switches_follow_the_rule(monkeypatch, fresh_native):
    monkeypatch.setenv("ROPEKV_CHECK_INDICES", "false")
    assert not _checks.check_indices_enabled()
    assert _env._raw_get(_env.CHECK_INDICES_KEY, _env.EMPTY_KEY) in _env.OFF
    monkeypatch.setenv("ROPEKV_CHECK_INDICES", "Yes")
    assert _checks.check_indices_enabled()
    monkeypatch.setenv("ROPEKV_NATIVE", "off")
    assert _native.load() is None and "ROPEKV_NATIVE=off" in _native.state()


# ---- the page that lists them ----------------------------------------------------------------


def test_every_variable_read_is_documented():
    names = set()
    for path in Path(ropekv.__file__).resolve().parent.rglob("*.py"):  # as imported
        names.update(re.findall(r"\bROPEKV_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    page = (ROOT / "docs" / "environment.md").read_text()
    documented = set(re.findall(r"`(ROPEKV_[A-Z0-9_]+)`", page))
    assert names, "no ROPEKV_ variable found in the package"
    assert names <= documented, f"not in docs/environment.md: {sorted(names - documented)}"
    assert set(_env.VARIABLES) <= names | {"ROPEKV_COMPILE_TIMEOUT"}
    for name in ("ROPEKV_NO_MEMORY_POOL", "ROPEKV_UNDER_SANITIZER"):  # the tests' own
        assert name in page


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
