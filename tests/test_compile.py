"""Every kernel instantiation compiles through NVRTC for sm_80 and sm_90, without a GPU, and every
parameter struct declared in Python matches its C struct field for field."""

from __future__ import annotations

import importlib
import re

import numpy as np
import pytest

from ropekv._compile import compile_offline, kernel_stems, read_source
from ropekv._launch import ParamStruct

nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc",
                            reason="the compile tests need cupy and the NVRTC wheel")

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


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("stem", STEMS)
def test_kernels_compile(stem, arch):
    expressions = list(op_module(stem).instantiations())
    lowered = compile_offline(stem, expressions, arch)
    assert set(lowered) == set(expressions)
    assert all(lowered.values())


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
                f"{struct.c_name}.{name}: C type {ctype!r} vs NumPy {np.dtype(np_type)}")


def test_local_headers_are_inlined():
    source = read_source("contiguous")
    assert '#include "common.cuh"' not in source
    assert "rotate_neox" in source
