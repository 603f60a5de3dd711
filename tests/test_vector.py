"""The shortcuts a first call's validation takes: ``_vector.widest_aligned`` against
``all_aligned`` for every width, and ``mla.ragged_paged`` against ``check_ragged_paged`` (the same
result, or the same error and message)."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from ropekv import _checks as ck
from ropekv._arrays import ArrayView
from ropekv._vector import all_aligned, widest_aligned
from ropekv.mla import ragged_paged


def view(name, ptr, shape, strides, dtype, device=0):
    return ArrayView(name, ptr, tuple(shape), tuple(strides), np.dtype(dtype), device)


def test_widest_aligned_is_all_aligned():
    rng = random.Random(0)
    dtypes = (np.int8, np.float16, np.float32, np.float64)
    for _ in range(20000):
        views = []
        for _ in range(rng.randint(1, 5)):
            ndim = rng.randint(1, 4)
            views.append(view("x", rng.choice((0, 1, 2, 4, 6, 8, 12, 16, 48, 1026)) + 4096,
                              [rng.randint(1, 5) for _ in range(ndim)],
                              [rng.choice((-6, -4, -1, 0, 1, 2, 3, 4, 6, 8, 24, 128))
                               for _ in range(ndim)], rng.choice(dtypes)))
        widest = widest_aligned(views)
        for n in (1, 2, 4, 8, 16):
            assert all_aligned(views, n) == (n <= widest), (views, n, widest)


def _outcome(fn, *args):
    try:
        return tuple(fn(*args))
    except (TypeError, ValueError) as e:
        return type(e), str(e)


def _index_arrays():
    """(offsets, cache_lengths, block_table) views: valid ones and each kind of bad one."""
    B = 3
    good = (view("input_row_offsets", 0, (B + 1,), (1,), np.int32),
            view("cache_lengths", 64, (B,), (1,), np.int32),
            view("block_table", 128, (B, 5), (5, 1), np.int32))
    bad = {
        0: [view("input_row_offsets", 0, (B + 1,), (1,), np.uint32),
            view("input_row_offsets", 0, (B + 1,), (1,), np.int64),
            view("input_row_offsets", 0, (B + 1,), (2,), np.int32),
            view("input_row_offsets", 0, (1,), (7,), np.int32),
            view("input_row_offsets", 0, (0,), (1,), np.int32),
            view("input_row_offsets", 0, (B + 1, 1), (1, 1), np.int32)],
        1: [view("cache_lengths", 64, (B + 1,), (1,), np.int32),
            view("cache_lengths", 64, (B,), (1,), np.uint32),
            view("cache_lengths", 64, (B,), (2,), np.int32),
            view("cache_lengths", 64, (B, 1), (1, 1), np.int32)],
        2: [view("block_table", 128, (B, 5), (8, 1), np.int32),
            view("block_table", 128, (B, 5), (1, 3), np.int32),
            view("block_table", 128, (B, 1), (1, 4), np.int32),
            view("block_table", 128, (B, 0), (0, 0), np.int32),
            view("block_table", 128, (B + 1, 5), (5, 1), np.int32),
            view("block_table", 128, (B, 5), (5, 1), np.int64),
            view("block_table", 128, (B * 5,), (1,), np.int32)],
    }
    yield good
    for i, bads in bad.items():
        for b in bads:
            yield tuple(b if j == i else good[j] for j in range(3))
    for i, j in itertools.combinations(range(3), 2):  # two bad arrays: the first one is named
        yield tuple(bad[k][0] if k in (i, j) else good[k] for k in range(3))


@pytest.mark.parametrize("arrays", list(_index_arrays()))
def test_ragged_paged_is_check_ragged_paged(arrays):
    assert _outcome(ragged_paged, *arrays) == _outcome(ck.check_ragged_paged, *arrays)
