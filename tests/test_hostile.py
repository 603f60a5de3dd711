"""Hostile index values for every op and every index argument (GPU): int32/int64 extremes, random
values, non-monotone offsets, duplicated slots. The kernels must read and write nothing out of
bounds (compute-sanitizer's memcheck runs over these tests), match the NumPy backend on every
output, and leave every cache row byte-identical to the NumPy backend's -- except rows that two
tokens write, whose contents are undefined (docs/conventions.md)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ropekv import reference
from tests.test_call_path import CACHE, CASES, assert_op_close, copy_kw, flat, map_arrays
from tests.tolerance import assert_close, to_device, to_numpy

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
I32, I64 = np.iinfo(np.int32), np.iinfo(np.int64)
EXTREMES32 = [I32.min, I32.min + 1, -(2**16), -2, -1, 0, 1, 2, 2**16, I32.max - 1, I32.max]
EXTREMES64 = EXTREMES32 + [I64.min, I64.min + 1, -(2**40), 2**40, I64.max - 1, I64.max]

INDEX_ARGS = {
    "contiguous": ("kv_end_lens", "position_ids"),
    "paged": ("pos_ids", "batch_indices", "positions", "kv_indptr", "kv_indices"),
    "mla": ("input_row_offsets", "cache_lengths", "block_table"),
    "qknorm": ("input_row_offsets", "cache_lengths", "block_table"),
    "qkv": ("input_row_offsets", "cache_lengths", "block_table"),
}


def base_case(op, seed, wide):
    """A valid small call; ``wide`` asks for int64 index arrays where the op takes them."""
    if op == "contiguous":
        fn, kw = CASES[op](seed, B=3, S=4, C=8, P=16, pos=True)
        if wide:
            kw["kv_end_lens"] = kw["kv_end_lens"].astype(np.int64)
            kw["position_ids"] = kw["position_ids"].astype(np.int64)
        return fn, kw
    if op == "paged":
        fn, kw = CASES[op](
            seed,
            T=9,
            B=3,
            Hq=2,
            Hkv=1,
            R=16,
            Dn=16,
            cache_dtype=E4M3,
            index_dtypes=np.int64 if wide else np.int32,
            padding=1,
        )
        T, Hq, R = kw["q_rope"].shape
        kw["q_rope_out"] = np.zeros((T, Hq, R), E4M3)  # defined rows for skipped tokens too
        kw["q_nope_out"] = np.zeros((T, Hq, 16), E4M3)
        return fn, kw
    if op == "qkv":
        return CASES[op](seed, lengths=(3, 1, 0, 2), K=32, Hq=2, Hkv=1, D=16, R=16, P=24)
    fn, kw = CASES[op](seed, new=(3, 0, 2, 1), cached=(0, 5, 9, 2))
    if wide:  # the ragged ops read offsets as int32 or uint32
        kw["input_row_offsets"] = kw["input_row_offsets"].astype(np.uint32)
    return fn, kw


@st.composite
def corruptions(draw, op, kw, wide):
    """For each index argument: keep it, or overwrite some entries (extremes, small random values,
    copies of other entries), or shuffle it (offsets lose their order)."""
    out = {}
    for name in INDEX_ARGS[op]:
        x = np.array(kw[name])
        mode = draw(st.sampled_from(["keep", "extremes", "random", "duplicate", "shuffle"]))
        flat_x = x.reshape(-1)
        if mode == "keep" or flat_x.size == 0:
            continue
        if mode == "shuffle":
            flat_x[:] = draw(st.permutations(list(flat_x)))
        else:
            where = draw(st.lists(st.integers(0, flat_x.size - 1), min_size=1, max_size=4))
            for i in where:
                if mode == "extremes":
                    pool = EXTREMES64 if x.dtype == np.int64 else EXTREMES32
                    value = draw(st.sampled_from(pool))
                elif mode == "random":
                    value = draw(st.integers(-3, 3 * flat_x.size + 8))
                else:
                    value = int(flat_x[draw(st.integers(0, flat_x.size - 1))])
                if x.dtype == np.uint32:
                    value &= 0xFFFFFFFF
                flat_x[i] = np.array(value).astype(x.dtype) if x.dtype != np.uint32 else value
        out[name] = x
    return out


def written_rows(op, kw):
    """Per cache, a boolean mask of its rows that two or more tokens write (None: none can)."""
    if op == "contiguous":
        return None
    if op == "paged":
        c0 = kw["paged_kv_cache"][0]
        page, entry = reference.paged_append_slots(
            kw["kv_indices"],
            kw["kv_indptr"],
            kw["batch_indices"],
            kw["positions"],
            kw["page_size"],
            c0.shape[0],
        )
        P = kw["cos_sin_cache"].shape[0]
        pos = np.asarray(kw["pos_ids"]).astype(np.int64)
        writes = (page >= 0) & (pos >= 0) & (pos < P)
        num_pages, page_size = c0.shape[0], kw["page_size"]
    else:
        caches = kw[CACHE[op]]
        c0 = caches[0] if isinstance(caches, tuple) else caches
        hnd = kw.get("kv_layout") == "HND"
        num_pages, page_size = c0.shape[0], c0.shape[2] if hnd else c0.shape[1]
        T = (kw["hidden_state"] if op == "qkv" else kw["q_rope" if op == "mla" else "q"]).shape[0]
        _request, pos, page, entry = reference.ragged_paged_slots(
            kw["input_row_offsets"], kw["cache_lengths"], kw["block_table"], page_size, num_pages, T
        )
        table = kw.get("cos_sin_cache")
        P = table.shape[0] if table is not None else None
        writes = (page >= 0) & (pos >= 0)
        if P is not None:
            writes &= pos < P
        if op == "qkv":
            writes &= pos <= I32.max
    counts = np.zeros((num_pages, page_size), np.int64)
    np.add.at(counts, (page[writes], entry[writes]), 1)
    return counts >= 2


def blank_rows(cache, dup, op, kw):
    """A copy of ``cache`` with the duplicated rows zeroed (their contents are undefined)."""
    c = np.array(to_numpy(cache)).copy()
    if dup is None or not dup.any():
        return c
    pages, entries = np.nonzero(dup)
    if op in ("qknorm", "qkv") and kw.get("kv_layout") == "HND":
        c.view(np.uint8)[pages, :, entries] = 0
    else:
        c.view(np.uint8)[pages, entries] = 0
    return c


@pytest.mark.gpu
@pytest.mark.parametrize("op", list(INDEX_ARGS))
@given(data=st.data(), seed=st.integers(0, 2**16), wide=st.booleans())
def test_hostile_indices(op, data, seed, wide):
    fn, kw = base_case(op, seed, wide)
    kw.update(data.draw(corruptions(op, kw, wide)))
    expected = copy_kw(kw)
    out_expected = fn(**expected)
    dev = map_arrays(kw, to_device)
    out = fn(**dev)
    dup = written_rows(op, kw)
    for a, e in zip(flat(dev[CACHE[op]]), flat(expected[CACHE[op]])):
        assert_op_close(blank_rows(a, dup, op, kw), blank_rows(e, dup, op, kw), op, f"{op} cache")
    if op == "contiguous":
        assert_close(dev["q"], expected["q"], "q")
    for a, e in zip(flat(out), flat(out_expected)):
        assert_op_close(a, to_numpy(e), op, f"{op} output")
