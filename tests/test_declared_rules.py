"""Each op's declared shapes and dtypes (``ropekv/_declare.py``: ``Arg.shape``, ``Arg.dtypes``)
hold in its eager checks: for every array of every ``ropekv check`` case (every op, each mode),
an array of a rank no declared shape has is a ``ValueError`` naming it, and an array of a dtype
the declaration does not allow is a ``TypeError`` naming it, both raised before anything runs
(the NumPy backend: a call that got through would compute). So the declaration, which the API
page prints, never promises less than the op refuses."""

from __future__ import annotations

import functools
import re

import ml_dtypes
import numpy as np
import pytest

import ropekv
from ropekv import _declare, _registry
from ropekv.bench.cases import check_specs

# every dtype a caller might hand in: each array is tried with those its declaration excludes
DTYPES = tuple(
    np.dtype(d)
    for d in (
        np.float16,
        ml_dtypes.bfloat16,
        np.float32,
        np.float64,
        ml_dtypes.float8_e4m3fn,
        ml_dtypes.float8_e5m2,
        np.int8,
        np.uint8,
        np.int16,
        np.int32,
        np.int64,
        np.uint32,
        np.bool_,
    )
)
CASES = check_specs()


def _declarations():
    return {d.name: d for d in _declare.declarations("torch") + _declare.declarations("jax")}


def test_every_array_declares_its_shapes_and_dtypes():
    """Every array argument (and every number-or-array one) says what it may be."""
    for d in _declarations().values():
        for a in d.inputs:
            if a.is_array or a.form in ("float_or_tensor", "floats_or_tensor"):
                assert a.shape and a.dtypes, f"{d.name}: {a.name} declares no shape or dtypes"
                for ref in (x for x in a.dtypes if isinstance(x, str)):
                    assert ref in d.by_name and d.by_name[ref].is_array, (d.name, a.name, ref)
            else:
                assert not (a.shape or a.dtypes), f"{d.name}: {a.name} is not an array"


def test_spelled_shapes_have_ranks():
    a = _declare.array("x", shape=("(T, Hq * D)", "(B + 1,)", "()"), dtypes=(np.float32,))
    assert a.ndims == (0, 1, 2)
    with pytest.raises(ValueError, match="spelled as a tuple"):
        _declare.array("x", shape=("T, D",))


def _call(build):
    """``(function, declaration, {name: value})`` of a check case's one ropekv call."""
    w = build()
    call = w.bound(w.new_outputs())
    if not isinstance(call, functools.partial) or call.func.__name__ not in _registry.NAMES:
        pytest.skip("the case makes other than one ropekv call")
    decl = _declarations()[call.func.__name__]
    values = decl.bind(call.args, call.keywords, call.func.__name__)
    return getattr(ropekv, call.func.__name__), decl, values


def _arrays(a, value):
    """``[(slot, array)]``: the NumPy arrays of argument ``a``'s value, ``slot`` None for the
    value itself or the index in its pair."""
    if isinstance(value, np.ndarray):
        return [(None, value)]
    if isinstance(value, tuple) and a.is_array:
        return [(i, x) for i, x in enumerate(value) if isinstance(x, np.ndarray)]
    return []


def _replaced(values, a, slot, array):
    out = dict(values)
    if slot is None:
        out[a.name] = array
    else:
        pair = list(values[a.name])
        pair[slot] = array
        out[a.name] = tuple(pair)
    return out


def _expect(errors, fn, values, cls, names, what):
    """Call ``fn(**values)``; record in ``errors`` anything but a ``cls`` naming one of
    ``names``."""
    try:
        fn(**values)
    except cls as e:
        if not any(re.search(rf"\b{re.escape(n)}\b", str(e)) for n in names):
            errors.append(f"{what}: {cls.__name__} names none of {names}: {e}")
    except Exception as e:  # noqa: BLE001 - reported with the argument that caused it
        errors.append(f"{what}: {type(e).__name__} instead of {cls.__name__}: {e}")
    else:
        errors.append(f"{what}: accepted")


@pytest.mark.parametrize("build", [c[2] for c in CASES], ids=[f"{c[0]}: {c[1]}" for c in CASES])
def test_declared_ranks_and_dtypes_are_enforced(build):
    fn, decl, values = _call(build)

    def dtype_of(name):
        v = values.get(name)
        return v.dtype if isinstance(v, np.ndarray) else None

    errors, tried = [], 0
    for a in decl.inputs:
        names = (a.name, *a.parts, *a.aka)
        for slot, x in _arrays(a, values.get(a.name)):
            what = f"{a.name}" + ("" if slot is None else f"[{slot}]")
            rank = max(a.ndims) + 1
            wrong = x.reshape(x.shape + (1,) * (rank - x.ndim))
            _expect(errors, fn, _replaced(values, a, slot, wrong), ValueError, names, what)
            allowed = a.allowed_dtypes(dtype_of)
            for dtype in DTYPES:
                if dtype not in allowed:
                    other = np.zeros(x.shape, dtype)
                    tried += 1
                    _expect(
                        errors,
                        fn,
                        _replaced(values, a, slot, other),
                        TypeError,
                        names,
                        f"{what} as {dtype}",
                    )
    assert tried, "no array of the case was tried"
    assert not errors, "\n".join(errors)
