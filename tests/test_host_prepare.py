"""The prepare step's shortcuts (CPU tests) give what the forms they replaced give: QK-norm's
32-bit extent test, Launch's pointer slots."""

import numpy as np

from ropekv import _arrays as ar
from ropekv import qknorm
from ropekv._launch import division_fields, division_magic


def _extent(shape, strides):
    """One past the largest element offset of an array (None with a negative stride): the form
    qknorm's 32-bit test had."""
    if any(st < 0 for st in strides):
        return None
    return 1 + sum((n - 1) * st for n, st in zip(shape, strides)) if all(shape) else 0


def _former_i32(views):
    """The decode choice's test as it was: every _extent below INT32_EXTENT (None fails)."""
    extents = [_extent(v.shape, v.strides) for v in views]
    return all(e is not None and e < qknorm.INT32_EXTENT for e in extents)


def _view(rng, dtype):
    nd = int(rng.integers(1, 5))
    shape = tuple(int(x) for x in rng.choice([0, 1, 2, 3, 7, 1 << 10, 1 << 16, 1 << 20], nd))
    strides = tuple(
        int(x) for x in rng.choice([-(1 << 20), -3, -1, 0, 1, 2, 5, 1 << 10, 1 << 12, 1 << 21], nd)
    )
    return ar.ArrayView("x", 1 << 20, shape, strides, np.dtype(dtype), 0)


def test_all_below_int32_equals_the_extent_form():
    rng = np.random.default_rng(34)
    seen = set()
    for _ in range(4000):
        views = [_view(rng, rng.choice(["float16", "float32", "uint8", "int64"])) for _ in range(3)]
        want = _former_i32(views)
        seen.add(want)
        assert qknorm._all_below_int32(views) == want, [(v.shape, v.strides) for v in views]
        for v in views:  # one view alone, also at the boundary
            assert qknorm._all_below_int32([v]) == _former_i32([v])
    assert seen == {True, False}


def test_all_below_int32_at_the_boundary():
    for dtype in ("float16", "float32", "uint8"):
        d = np.dtype(dtype)
        for n in (qknorm.INT32_EXTENT - 1, qknorm.INT32_EXTENT, qknorm.INT32_EXTENT + 1):
            for shape, strides in (((n,), (1,)), ((2, (n + 1) // 2), ((n + 1) // 2, 1))):
                v = ar.ArrayView("x", 256, shape, strides, d, 0)
                assert qknorm._all_below_int32([v]) == _former_i32([v]), (dtype, shape, strides)
        # a negative stride fails even on a dimension of one element or an empty array
        for shape in ((1, 4), (0, 4)):
            v = ar.ArrayView("x", 256, shape, (-4, 1), d, 0)
            assert not qknorm._all_below_int32([v]) and not _former_i32([v])


def test_pointer_slots_equal_the_former_list():
    from ropekv import _launch

    rng = np.random.default_rng(7)
    names = tuple(f"p{i}" for i in range(12))
    for _ in range(500):
        slots = {
            f: (int(rng.integers(0, 9)), int(rng.integers(0, 3)) * 16)
            for f in names
            if rng.random() < 0.7
        }
        values = {f: int(rng.integers(0, 1 << 40)) for f in names if rng.random() < 0.5}
        get, slot = values.get, slots.get
        want = [slot(f) or (-1, int(get(f, 0))) for f in names]
        assert _launch._pointer_slots(names, values, slots) == want


def test_given_indices_keep_the_given_in_order():
    from ropekv import _launch

    rng = np.random.default_rng(3)
    for _ in range(300):
        views = [None if rng.random() < 0.4 else object() for _ in range(int(rng.integers(0, 12)))]
        indices = tuple(
            int(i) for i in rng.permutation(len(views))[: int(rng.integers(0, len(views) + 1))]
        )
        want = tuple([i for i in indices if views[i] is not None])
        assert _launch._given_indices(views, indices) == want
        assert _launch._given_indices(tuple(views), list(indices)) == want


def _former_last_dim(*views):
    for view in views:
        if view is not None and view.size and view.shape[-1] > 1 and view.strides[-1] != 1:
            raise ValueError(
                f"{view.name} must be contiguous in its last dimension (stride 1), "
                f"got strides {view.strides} (in elements)"
            )


def _outcome(f, *args):
    try:
        f(*args)
    except Exception as exc:  # noqa: BLE001
        return type(exc), str(exc)
    return None


def test_check_last_dim_contiguous_equals_the_former_loop():
    from ropekv import _checks as ck

    rng = np.random.default_rng(5)
    seen = set()
    for _ in range(3000):
        views = []
        for k in range(int(rng.integers(0, 7))):
            if rng.random() < 0.2:
                views.append(None)
                continue
            nd = int(rng.integers(1, 4))
            shape = tuple(int(x) for x in rng.choice([0, 1, 2, 5], nd))
            strides = tuple(int(x) for x in rng.choice([1, 1, 1, 2, -1, 0, 8], nd))
            views.append(ar.ArrayView(f"a{k}", 256, shape, strides, np.dtype("float16"), 0))
        want = _outcome(_former_last_dim, *views)
        seen.add(want is None)
        assert _outcome(ck.check_last_dim_contiguous, *views) == want
    assert seen == {True, False}


def test_paged_index64_equals_the_former_loop():
    from types import SimpleNamespace

    from ropekv import _checks as ck
    from ropekv import paged

    # the index arrays in the order of the record's index64 bits (paged.cu's)
    indices = ck.argument_indices(
        paged._GQA_ARGS, ("pos_ids", "batch_indices", "positions", "kv_indptr", "kv_indices")
    )
    rng = np.random.default_rng(1)
    for _ in range(64):
        dtypes = [np.dtype(rng.choice(["int32", "int64"])) for _ in paged._GQA_ARGS]
        a = paged._Views._make([SimpleNamespace(dtype=d) for d in dtypes])
        want = 0
        for i, index in enumerate(indices):
            if a[index].dtype == np.dtype(np.int64):
                want |= 1 << i
        got = paged._index64(a)
        assert got == want and type(got) is int


def test_optional_slot_tables_name_the_fields_as_before():
    from ropekv import contiguous

    start = len(contiguous._ARGUMENT_SLOTS)
    assert contiguous._OPTIONAL_SLOTS == tuple(
        (i, contiguous.FIELDS[i], (i, 0)) for i in range(start, len(contiguous.FIELDS))
    )
    assert qknorm._OPTIONAL_SLOTS == tuple(
        (i, qknorm.FIELDS[i], (i, 0)) for i in range(qknorm._Q_OUT + 1, len(qknorm.FIELDS))
    )
    assert contiguous._OPTIONAL_SLOTS and qknorm._OPTIONAL_SLOTS


def test_divisions_by_magic_numbers_are_exact():
    """Kernels divide by a call's constants (QK-norm decode: a token's head rows, page_size;
    qkv_mma: group_size) as a multiply-high, an add and a shift (fast_div) with the host's (magic,
    shift): exact for every dividend below 2**31, divisors 1 to 2**31 - 1 (powers of two, their
    neighbours and others)."""
    rng = np.random.default_rng(41)
    divisors = [*range(1, 600), *(1 << k for k in range(31)), *((1 << k) + 1 for k in range(31))]
    divisors += [*((1 << k) - 1 for k in range(2, 32)), *rng.integers(1, 2**31, 400).tolist()]
    for d in divisors:
        magic, shift = division_magic(d)
        assert 0 < magic < 2**32 and 0 <= shift <= 31
        n = np.array(
            [0, 1, d - 1, d, d + 1, 2 * d - 1, 2 * d, 2**31 - 1, 2**31 - 2, 2**31 - d]
            + rng.integers(0, 2**31, 64).tolist(),
            dtype=np.uint64,
        )
        n = n[n < 2**31]
        got = (((np.uint64(magic) * n) >> np.uint64(32)) + n) >> np.uint64(shift)
        np.testing.assert_array_equal(got, n // np.uint64(d), err_msg=str(d))


def test_division_fields_name_the_records_two_fields():
    """A record's divisor as its two named fields (QK-norm's h / pg, qkv_mma's g); divisor 0 (a
    record whose kernel does not divide, qkv without groups) gives zeros."""
    assert division_fields("g", 128) == dict(zip(("g_magic", "g_shift"), division_magic(128)))
    assert division_fields("pg", 16) == {"pg_magic": division_magic(16)[0], "pg_shift": 4}
    assert division_fields("g", 0) == {"g_magic": 0, "g_shift": 0}
