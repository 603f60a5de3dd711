"""Kernel instantiations compile through NVRTC for sm_80 and sm_90 (those built on
architecture-specific instructions also for sm_90a, the target they run on), without a GPU, and
every parameter struct declared in Python matches its C struct field for field.

By default a covering set of the instantiations is compiled: per kernel template, every value of
every template parameter and every pair of parameter values that occurs among the instantiations
(a greedy pairwise cover). The exhaustive sweep, every instantiation (about 6,560 compiles, half an
hour on two CPUs from a cold cache), is the ``exhaustive`` marker, run with
``--exhaustive-compile`` or ``ROPEKV_EXHAUSTIVE_COMPILE=1`` (tests/conftest.py)."""

from __future__ import annotations

import concurrent.futures
import importlib
import multiprocessing
import os
import re
import types

import numpy as np
import pytest

from ropekv._compile import arch_specific, compile_offline, kernel_stems, read_source
from ropekv._launch import ParamStruct


def exhaustive_requested():
    """``--exhaustive-compile`` (tests/conftest.py sets the variable) or
    ``ROPEKV_EXHAUSTIVE_COMPILE=1``."""
    return os.environ.get(EXHAUSTIVE_ENV, "") not in ("", "0")


EXHAUSTIVE_ENV = "ROPEKV_EXHAUSTIVE_COMPILE"
if exhaustive_requested():  # asked for: a missing compiler is an error, never a skip
    from cupy_backends.cuda.libs import nvrtc
else:
    nvrtc = pytest.importorskip(
        "cupy_backends.cuda.libs.nvrtc", reason="the compile tests need cupy and the NVRTC wheel"
    )

STEMS = kernel_stems()
C_FIELD_TYPES = {
    np.dtype(np.uint64): "pointer",
    np.dtype(np.int64): ("i64", "long long", "int64_t"),
    np.dtype(np.int32): ("int",),
    np.dtype(np.uint32): ("unsigned", "uint32_t", "unsigned int"),
    np.dtype(np.float32): ("float",),
}


def op_module(stem):
    return importlib.import_module(f"ropekv.{stem}")


def param_structs(module):
    return [v for v in vars(module).values() if isinstance(v, ParamStruct)]


def test_every_kernel_file_has_an_op_module():
    assert "contiguous" in STEMS
    for stem in STEMS:
        module = op_module(stem)
        assert module.STEM == stem
        assert list(module.instantiations()), f"ropekv.{stem} lists no instantiations"


ARCHS = ("sm_80", "sm_90")
ARCH_SPECIFIC = "sm_90a"  # the target of the arch_specific kernels (wgmma)
CHUNK = 64  # instantiations per NVRTC program: small enough to spread a kernel over the CPUs


def split_expression(expression):
    """``"kernel<a, b<c, d>, e>"`` -> ``("kernel", ("a", "b<c, d>", "e"))``: the template
    arguments of a name expression (``ropekv._compile.name_expression``), split at top-level
    commas."""
    name, sep, rest = expression.partition("<")
    assert sep and rest.endswith(">"), f"not a template instantiation: {expression!r}"
    args, depth, start, body = [], 0, 0, rest[:-1]
    for i, ch in enumerate(body):
        depth += (ch == "<") - (ch == ">")
        if ch == "," and depth == 0:
            args.append(body[start:i].strip())
            start = i + 1
    args.append(body[start:].strip())
    return name.strip(), tuple(args)


def _pairs(args):
    """The (position, value) singletons and pairs of one instantiation's template arguments."""
    items = list(enumerate(args))
    return {(a,) for a in items} | {(a, b) for i, a in enumerate(items) for b in items[i + 1 :]}


def covering_set(expressions):
    """A subset of ``expressions`` with every template parameter value and every pair of values
    (of two parameters of one kernel template) that occurs in ``expressions``, in their order:
    greedy, per kernel template, the instantiation covering most still uncovered pairs first."""
    by_kernel = {}
    for e in expressions:
        name, args = split_expression(e)
        by_kernel.setdefault((name, len(args)), []).append((e, _pairs(args)))
    chosen = set()
    for candidates in by_kernel.values():
        uncovered = set().union(*(p for _, p in candidates))
        while uncovered:
            best, pairs = max(candidates, key=lambda c: len(c[1] & uncovered))
            chosen.add(best)
            uncovered -= pairs
    return [e for e in expressions if e in chosen]


def _expressions(stem, arch, sweep="exhaustive"):
    expressions = list(op_module(stem).instantiations())
    if arch == ARCH_SPECIFIC:
        expressions = [e for e in expressions if arch_specific(e)]
    return expressions if sweep == "exhaustive" else covering_set(expressions)


def _chunks(stem, arch, sweep):
    expressions = _expressions(stem, arch, sweep)
    return [expressions[i : i + CHUNK] for i in range(0, len(expressions), CHUNK)]


_TARGETS = [(stem, arch) for stem in STEMS for arch in ARCHS] + [
    (stem, ARCH_SPECIFIC) for stem in STEMS if _expressions(stem, ARCH_SPECIFIC)
]
COMPILES = [(stem, arch, "covering") for stem, arch in _TARGETS] + [
    pytest.param(stem, arch, "exhaustive", marks=pytest.mark.exhaustive) for stem, arch in _TARGETS
]


@pytest.fixture(scope="module")
def compiled(request):
    """``compiled(stem, arch)``: the lowered names of every instantiation of ``stem``. The
    selected (stem, arch) tests' compiles all start on the first use, in chunks, on a pool of
    one process per CPU (a cold run compiles a few thousand instantiations); each test then
    waits for its own chunks. One CPU: in this process, as each test asks."""
    wanted = [
        item.callspec.params
        for item in request.session.items
        if getattr(item, "originalname", "") == "test_kernels_compile"
    ]
    exhaustive = exhaustive_requested()
    keys = list(
        dict.fromkeys(
            (p["stem"], p["arch"], p["sweep"])
            for p in wanted
            if p["sweep"] != "exhaustive" or exhaustive  # (else skipped: nothing to compile)
        )
    )
    workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if (workers or 1) < 2 or len(keys) < 2:
        yield lambda stem, arch, sweep: [
            compile_offline(stem, c, arch) for c in _chunks(stem, arch, sweep)
        ]
        return
    jobs = [(key, chunk) for key in keys for chunk in _chunks(*key)]
    jobs.sort(key=lambda j: -len(j[1]))  # the full chunks first: the pool ends together
    context = multiprocessing.get_context("spawn")  # no forked copy of a loaded NVRTC
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        futures = {}
        for key, chunk in jobs:
            futures.setdefault(key, []).append(pool.submit(compile_offline, key[0], chunk, key[1]))
        yield lambda stem, arch, sweep: [f.result() for f in futures[(stem, arch, sweep)]]


@pytest.mark.parametrize("stem, arch, sweep", COMPILES)
def test_kernels_compile(stem, arch, sweep, compiled):
    expressions = _expressions(stem, arch, sweep)
    lowered = {}
    for part in compiled(stem, arch, sweep):
        lowered.update(part)
    assert set(lowered) == set(expressions)
    assert all(lowered.values())


@pytest.mark.parametrize("stem, arch", _TARGETS)
def test_the_covering_set_covers_every_value_pair(stem, arch):
    """The default compile covers, per kernel template, every parameter value and every pair of
    values that the full instantiation list has, with fewer instantiations."""
    full = _expressions(stem, arch)
    cover = _expressions(stem, arch, "covering")
    assert set(cover) <= set(full) and len(cover) < len(full) or len(full) < 4

    def seen(expressions):
        return {
            (split_expression(e)[0], p) for e in expressions for p in _pairs(split_expression(e)[1])
        }

    assert seen(cover) == seen(full)


def test_the_covering_set_is_pairwise():
    full = [f"k<{a}, {b}, {c}>" for a in ("x", "y") for b in (1, 2, 3) for c in ("p", "q")] + [
        "other<true>",
        "other<false>",
        "k<z, 1, p>",
    ]
    cover = covering_set(full)
    assert {"other<true>", "other<false>", "k<z, 1, p>"} <= set(cover)
    assert len(cover) < len(full)
    pairs = set().union(*(_pairs(split_expression(e)[1]) for e in cover if e.startswith("k<")))
    assert pairs == set().union(
        *(_pairs(split_expression(e)[1]) for e in full if e.startswith("k<"))
    )
    assert split_expression("f<a<b, c>, d>") == ("f", ("a<b, c>", "d"))


def _ptx(stem, expression, arch):
    prog = nvrtc.createProgram(read_source(stem), f"{stem}.cu", [], [])
    try:
        nvrtc.addNameExpression(prog, expression)
        from ropekv._compile import OPTIONS, _header_options

        nvrtc.compileProgram(prog, [f"--gpu-architecture={arch}", *OPTIONS, *_header_options()])
        return nvrtc.getPTX(prog).decode()
    finally:
        nvrtc.destroyProgram(prog)


def test_wgmma_kernels_have_their_body_on_sm_90a_only():
    """qkv_wgmma's instructions exist on sm_90a alone: its body is compiled there (the wgmma
    instructions are in the PTX) and left out for sm_90 (a host never picks that build)."""
    from ropekv import qkv

    expression = qkv.wgmma_expression(
        np.dtype(np.float16), 64, 4, qkv.WGMMA_STAGES, qkv.WGMMA_ATOMS
    )
    assert arch_specific(expression)
    assert "wgmma.mma_async" in _ptx("qkv", expression, "compute_90a")
    assert "wgmma.mma_async" not in _ptx("qkv", expression, "compute_90")


def c_struct_fields(source, name):
    """[(field name, declared C type)] of ``struct name { ... };`` in a kernel source."""
    body = re.search(r"struct\s+" + name + r"\s*\{(.*?)\};", source, re.DOTALL)
    assert body, f"struct {name} not found"
    fields = []
    for decl in re.sub(r"//[^\n]*", "", body.group(1)).split(";"):
        decl = " ".join(decl.split())
        if not decl:
            continue
        ctype, names = re.match(r"(.*?)(\w+(?:\s*,\s*\w+)*)$", decl).groups()
        pointer = "*" in ctype
        ctype = ctype.replace("*", "").strip()
        for field in names.split(","):
            fields.append((field.strip(), "pointer" if pointer else ctype))
    return fields


@pytest.mark.parametrize("stem", STEMS)
def test_param_structs_match_c(stem):
    source = read_source(stem)
    for struct in param_structs(op_module(stem)):
        c_fields = c_struct_fields(source, struct.c_name)
        assert [n for n, _ in c_fields] == list(struct.names), struct.c_name
        for (name, ctype), (_, np_type) in zip(c_fields, struct.fields):
            allowed = C_FIELD_TYPES[np.dtype(np_type)]
            assert ctype == allowed if allowed == "pointer" else ctype in allowed, (
                f"{struct.c_name}.{name}: C type {ctype!r} vs NumPy {np.dtype(np_type)}"
            )


def test_local_headers_are_inlined():
    source = read_source("contiguous")
    assert '#include "common.cuh"' not in source
    assert "rotate_neox" in source


# ---- the on-disk cache of compile_offline --------------------------------------------------------

TINY = "template <typename T> __global__ void fill(T* p) { p[threadIdx.x] = T(1); }\n"


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """compile_offline on a one-line kernel (``.source``, changeable), with an empty cache in
    tmp_path and the list of NVRTC compiles it ran (``.compiles``)."""
    from ropekv import _compile

    state = types.SimpleNamespace(source=TINY, compiles=[])
    real = nvrtc.compileProgram
    monkeypatch.setenv("ROPEKV_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_compile, "read_source", lambda stem: state.source)
    monkeypatch.setattr(nvrtc, "compileProgram", lambda *a: state.compiles.append(a) or real(*a))
    return state


def test_an_unchanged_kernel_compiles_once(tiny, tmp_path):
    first = compile_offline("tiny", ["fill<float>"], "sm_80")
    assert compile_offline("tiny", ["fill<float>"], "sm_80") == first
    assert len(tiny.compiles) == 1
    assert len(list((tmp_path / "offline").glob("tiny-sm_80-*.json"))) == 1


def test_arch_and_expressions_are_part_of_the_key(tiny):
    compile_offline("tiny", ["fill<float>"], "sm_80")
    compile_offline("tiny", ["fill<float>"], "sm_90")
    compile_offline("tiny", ["fill<float>", "fill<int>"], "sm_80")
    assert len(tiny.compiles) == 3


def test_a_changed_kernel_recompiles_and_its_error_is_not_hidden(tiny):
    compile_offline("tiny", ["fill<float>"], "sm_80")
    tiny.source = TINY.replace("T(1)", "T(1) +")
    with pytest.raises(RuntimeError, match="NVRTC failed on tiny.cu for sm_80"):
        compile_offline("tiny", ["fill<float>"], "sm_80")
    with pytest.raises(RuntimeError):  # a failure is never cached
        compile_offline("tiny", ["fill<float>"], "sm_80")
    assert len(tiny.compiles) == 3


def test_a_corrupt_entry_recompiles(tiny, tmp_path):
    want = compile_offline("tiny", ["fill<float>"], "sm_80")
    (entry,) = (tmp_path / "offline").glob("*.json")
    entry.write_text("{not json")
    assert compile_offline("tiny", ["fill<float>"], "sm_80") == want
    assert len(tiny.compiles) == 2


def test_an_unwritable_cache_still_compiles(tiny, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("ROPEKV_CACHE_DIR", str(blocker))
    assert compile_offline("tiny", ["fill<float>"], "sm_80") == {"fill<float>": "_Z4fillIfEvPT_"}


def test_a_cubin_is_built_once_and_kept(tiny, tmp_path):
    """compile_cubin (the arch-specific kernels' loader builds their cubin with it): a cubin file
    and the lowered name, compiled once per source and arch; a lost cubin file is built again."""
    from ropekv._compile import compile_cubin

    path, lowered = compile_cubin("tiny", "fill<float>", "sm_90a")
    assert path.is_file() and path.read_bytes()[:4] == b"\x7fELF"  # a cubin is an ELF file
    assert "fill" in lowered
    assert compile_cubin("tiny", "fill<float>", "sm_90a") == (path, lowered)
    assert len(tiny.compiles) == 1
    path.unlink()
    assert compile_cubin("tiny", "fill<float>", "sm_90a") == (path, lowered)
    assert len(tiny.compiles) == 2 and path.is_file()
    compile_cubin("tiny", "fill<float>", "sm_90")  # another arch: another cubin
    assert len(tiny.compiles) == 3
