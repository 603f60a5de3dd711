"""The shortcuts a first call's validation takes: ``_vector.widest_aligned`` against
``all_aligned`` for every width, ``check_ragged_paged`` and ``check_float`` with their common-case
test against their checkers alone (the same result, or the same error and message); the fused QKV
op's ragged-array checkers pass whatever that common-case test passes."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest

from ropekv import _checks as ck
from ropekv import qkv
from ropekv._arrays import ArrayView
from ropekv._vector import widest_aligned


def view(name, ptr, shape, strides, dtype, device=0):
    return ArrayView(name, ptr, tuple(shape), tuple(strides), np.dtype(dtype), device)


def all_aligned(views, n_elements):
    """The definition: every view's pointer and every stride but its last are multiples of an
    access of ``n_elements`` (capped at 16 bytes)."""
    for v in views:
        access = min(16, n_elements * v.dtype.itemsize)
        if v.ptr % access or any(s * v.dtype.itemsize % access for s in v.strides[:-1]):
            return False
    return True


def test_widest_aligned_is_all_aligned():
    rng = random.Random(0)
    dtypes = (np.int8, np.float16, np.float32, np.float64)
    for _ in range(20000):
        views = []
        for _ in range(rng.randint(1, 5)):
            ndim = rng.randint(1, 4)
            views.append(
                view(
                    "x",
                    rng.choice((0, 1, 2, 4, 6, 8, 12, 16, 48, 1026)) + 4096,
                    [rng.randint(1, 5) for _ in range(ndim)],
                    [rng.choice((-6, -4, -1, 0, 1, 2, 3, 4, 6, 8, 24, 128)) for _ in range(ndim)],
                    rng.choice(dtypes),
                )
            )
        widest = widest_aligned(views)
        for n in (1, 2, 4, 8, 16):
            assert all_aligned(views, n) == (n <= widest), (views, n, widest)


def _outcome(fn, *args, **kwargs):
    try:
        result = fn(*args, **kwargs)
    except (TypeError, ValueError) as e:
        return type(e), str(e)
    return tuple(result) if isinstance(result, tuple) else (type(result), result)


def _index_arrays():
    """(offsets, cache_lengths, block_table) views: valid ones and each kind of bad one."""
    B = 3
    good = (
        view("input_row_offsets", 0, (B + 1,), (1,), np.int32),
        view("cache_lengths", 64, (B,), (1,), np.int32),
        view("block_table", 128, (B, 5), (5, 1), np.int32),
    )
    bad = {
        0: [
            view("input_row_offsets", 0, (B + 1,), (1,), np.uint32),
            view("input_row_offsets", 0, (B + 1,), (1,), np.int64),
            view("input_row_offsets", 0, (B + 1,), (2,), np.int32),
            view("input_row_offsets", 0, (1,), (7,), np.int32),
            view("input_row_offsets", 0, (0,), (1,), np.int32),
            view("input_row_offsets", 0, (B + 1, 1), (1, 1), np.int32),
        ],
        1: [
            view("cache_lengths", 64, (B + 1,), (1,), np.int32),
            view("cache_lengths", 64, (B,), (1,), np.uint32),
            view("cache_lengths", 64, (B,), (2,), np.int32),
            view("cache_lengths", 64, (B, 1), (1, 1), np.int32),
        ],
        2: [
            view("block_table", 128, (B, 5), (8, 1), np.int32),
            view("block_table", 128, (B, 5), (1, 3), np.int32),
            view("block_table", 128, (B, 1), (1, 4), np.int32),
            view("block_table", 128, (B, 0), (0, 0), np.int32),
            view("block_table", 128, (B + 1, 5), (5, 1), np.int32),
            view("block_table", 128, (B, 5), (5, 1), np.int64),
            view("block_table", 128, (B * 5,), (1,), np.int32),
        ],
    }
    yield good
    for i, bads in bad.items():
        for b in bads:
            yield tuple(b if j == i else good[j] for j in range(3))
    for i, j in itertools.combinations(range(3), 2):  # two bad arrays: the first one is named
        yield tuple(bad[k][0] if k in (i, j) else good[k] for k in range(3))


@pytest.mark.parametrize("arrays", list(_index_arrays()))
def test_check_ragged_paged_shortcut_is_its_checkers(arrays, monkeypatch):
    shortcut = _outcome(ck.check_ragged_paged, *arrays)
    if ck.common_ragged_paged(*arrays):  # the fused QKV op's checkers pass it too
        assert _outcome(qkv._check_ragged, *arrays) == (type(None), None)
    monkeypatch.setattr(ck, "common_ragged_paged", lambda *a: False)
    assert shortcut == _outcome(ck.check_ragged_paged, *arrays)


@pytest.mark.parametrize("positive", [False, True])
@pytest.mark.parametrize(
    "value",
    [
        1.5,
        0.0,
        -0.0,
        -1.0,
        1e308,
        float("inf"),
        float("-inf"),
        float("nan"),
        2,
        np.float32(0.5),
        np.float64(3.0),
        True,
        "1",
    ],
)
def test_check_float_shortcut_is_its_checks(value, positive, monkeypatch):
    shortcut = _outcome(ck.check_float, value, "x", positive=positive)
    monkeypatch.setattr(ck, "_FAST_MAX", -math.inf)  # the common-case test never passes
    checks = _outcome(ck.check_float, value, "x", positive=positive)
    assert shortcut == checks
