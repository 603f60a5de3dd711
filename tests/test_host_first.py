"""The first call's host work in C gives what the Python forms give (CPU tests): the overlap
check's pairs (``_native.c``'s ``overlap_pairs`` against ``_checks.overlap_pairs`` and the loop
it replaced), the same error raised for the same pair."""

import numpy as np
import pytest

from ropekv import _arrays as ar
from ropekv import _checks as ck
from ropekv import _native


def _former_check_no_overlap(views, written, inplace=()):
    """check_no_overlap as it was written before the C form (the oracle): one loop that raises
    at the first pair of intersecting spans sharing a byte."""
    spans = []
    for j, v in enumerate(views):
        if v is not None and v.size:
            lo, hi = v.span
            spans.append((j, lo, hi, v.ptr + lo, v.ptr + hi))
    pairs = []
    for i in written:
        a = views[i]
        if a is None or a.size == 0:
            continue
        a_lo, a_hi = a.span
        a_first, a_end = a.ptr + a_lo, a.ptr + a_hi
        for j, b_lo, b_hi, b_first, b_end in spans:
            if j == i or (j < i and j in written):
                continue
            pairs.append((i, j, a_lo, a_hi, b_lo, b_hi))
            if not (a_first < b_end and b_first < a_end):
                continue
            b = views[j]
            pair = frozenset((i, j)) in inplace
            same = (
                a.ptr == b.ptr
                and a.shape == b.shape
                and a.strides == b.strides
                and a.dtype == b.dtype
            )
            if same and pair:
                continue
            if ck.shares_bytes(
                (a.ptr, a.shape, a.strides, a.dtype.itemsize),
                (b.ptr, b.shape, b.strides, b.dtype.itemsize),
            ):
                raise ValueError(ck.overlap_message(a.name, b.name, j in written, pair))
    return pairs


@pytest.fixture(scope="module")
def native():
    module = _native.load()
    if module is None:
        pytest.skip(f"no C extension: {_native.state()}")
    return module


def _outcome(f, *args):
    try:
        return "pairs", f(*args)
    except (ValueError, BufferError) as exc:
        return "error", type(exc).__name__, str(exc)


def _random_arrays(rng, buf):
    """Up to 9 arguments: None, empty, disjoint or overlapping slices and strided (interleaved)
    views of one buffer, some the very same array twice."""
    out = []
    for _ in range(int(rng.integers(2, 10))):
        kind = rng.integers(0, 6)
        if kind == 0:
            out.append(None)
        elif kind == 1 and out and out[-1] is not None:
            out.append(out[-1])  # the very same array (an in-place pair)
        elif kind == 2:  # interleaved halves of rows (K and V in one buffer)
            start = int(rng.integers(0, 16)) * 64
            rows = buf[start : start + 512].view(np.float16).reshape(8, 2, 16)
            out.append(rows[:, int(rng.integers(0, 2))])
        elif kind == 3:  # a reversed view (a negative stride: its span reaches below its pointer)
            start = int(rng.integers(0, 64)) * 32
            out.append(buf[start : start + 64][::-1])
        else:
            start = int(rng.integers(0, 64)) * 32
            n = int(rng.integers(0, 8)) * 16
            out.append(buf[start : start + n])
    return out


def _random_call(rng, buf):
    arrays = _random_arrays(rng, buf)
    views = [None if a is None else ar.as_view(a, f"a{i}") for i, a in enumerate(arrays)]
    n = len(views)
    written = tuple(int(i) for i in rng.permutation(n)[: int(rng.integers(0, n + 1))])
    if rng.integers(0, 4) == 0:
        written = list(written)  # (a plan's written arrays are a tuple; a list reads the same)
    pairs = {
        frozenset((int(i), int(j)))
        for i, j in rng.integers(0, n, (int(rng.integers(0, 3)), 2))
        if i != j
    }
    return views, written, pairs


def test_overlap_pairs_in_c_equal_the_python_form(native, monkeypatch):
    rng = np.random.default_rng(5)
    buf = np.zeros(4096, np.uint8)
    errors = 0
    for _ in range(800):
        views, written, inplace = _random_call(rng, buf)
        found = native.overlap_pairs(views, written)
        assert found is not None
        assert found == ck.overlap_pairs(views, written)
        monkeypatch.setattr(ck, "NATIVE_OVERLAP", [native.overlap_pairs])
        got = _outcome(ck.check_no_overlap, views, written, inplace)
        monkeypatch.setattr(ck, "NATIVE_OVERLAP", [None])
        assert got == _outcome(ck.check_no_overlap, views, written, inplace)
        assert got == _outcome(_former_check_no_overlap, views, written, inplace)
        errors += got[0] == "error"
    assert 50 < errors < 750  # both outcomes well covered


def test_overlap_pairs_keep_the_span_objects(native):
    buf = np.zeros(1024, np.uint8)
    views = [ar.as_view(buf[0:64], "q"), None, ar.as_view(buf[128:0:-1], "r")]
    views.append(ar.as_view(buf[512:768], "k_cache"))
    pairs, hits = native.overlap_pairs(views, (3, 0))
    # (written q, index 0 < 3, is compared with k_cache as its own written array)
    assert pairs == [
        (3, 2, 0, 256, -127, 1),
        (0, 2, 0, 64, -127, 1),
        (0, 3, 0, 64, 0, 256),
    ]
    assert hits == [(0, 2)]  # q's bytes [0, 64) and r's [1, 129) intersect
    assert pairs[0][3] is views[3].span[1] and pairs[0][4] is views[2].span[0]
    assert native.overlap_pairs(views, ()) == ([], [])


def test_overlap_pairs_leave_what_they_cannot_read_to_python(native):
    buf = np.zeros(256, np.uint8)
    v = ar.as_view(buf[0:64], "q")
    w = ar.as_view(buf[64:128], "k")
    assert native.overlap_pairs([v, w], (2,)) is None  # an index past the arguments
    assert native.overlap_pairs([v, w], (-1,)) is None
    assert native.overlap_pairs([v, w], (np.int64(1),)) is None  # not an int
    far = ar.as_view(buf[0:64], "far")
    far.ptr = 1 << 63  # past what int64 holds
    assert native.overlap_pairs([v, far], (0,)) is None
    far.ptr = np.uint64(64)  # not an int
    assert native.overlap_pairs([v, far], (0,)) is None
    assert native.overlap_pairs([v] * 65, (0,)) is None  # more arguments than the C replay takes
    with pytest.raises(TypeError):
        native.overlap_pairs(v, (0,))
    odd = ar.as_view(buf[0:64], "odd")
    odd.span = [0, 64]  # no tuple
    assert native.overlap_pairs([v, odd], (0,)) is None


def test_check_no_overlap_names_the_arguments(native, monkeypatch):
    monkeypatch.setattr(ck, "NATIVE_OVERLAP", [native.overlap_pairs])
    buf = np.zeros(256, np.uint8)
    views = [ar.as_view(buf[0:64], "q"), ar.as_view(buf[32:96], "k_cache")]
    with pytest.raises(ValueError, match="k_cache is written in place but shares memory with q"):
        ck.check_no_overlap(views, (1,))
    same = [ar.as_view(buf[0:64], "q"), ar.as_view(buf[0:64], "q_out")]
    assert len(ck.check_no_overlap(same, (1,), {frozenset((0, 1))})) == 1  # in place: allowed
    with pytest.raises(ValueError, match="q_out must be q itself"):
        ck.check_no_overlap([same[0], ar.as_view(buf[0:32], "q_out")], (1,), {frozenset((0, 1))})
    kv = np.zeros((4, 2, 8), np.float16)  # K and V interleaved in one buffer: no shared byte
    k, v = ar.as_view(kv[:, 0], "k_cache"), ar.as_view(kv[:, 1], "v_cache")
    assert ck.check_no_overlap([k, v], (0, 1)) == [(0, 1, *k.span, *v.span)]


def _random_written_call(rng, buf):
    """Views with strides of every kind a written array may have: plain, padded, transposed,
    broadcast (stride 0), reversed, self-overlapping, empty; some read-only."""
    views = []
    for k in range(int(rng.integers(1, 8))):
        kind = int(rng.integers(0, 8))
        base = np.lib.stride_tricks.as_strided
        if kind == 0:
            a = None
        elif kind == 1:
            a = buf[: 4 * 6 * 8].reshape(4, 6, 8)
        elif kind == 2:
            a = buf[: 4 * 6 * 8].reshape(4, 6, 8)[:, :3]  # padded rows
        elif kind == 3:
            a = buf[:48].reshape(6, 8).T  # transposed
        elif kind == 4:
            a = base(buf, (4, 8), (0, 1))  # broadcast rows
        elif kind == 5:
            a = buf[:64][::-1]
        elif kind == 6:
            a = base(buf, (5, 8), (4, 1))  # rows overlapping their neighbours
        else:
            a = buf[:0].reshape(0, 8) if rng.integers(0, 2) else base(buf, (0, 4), (0, 1))
        if a is not None and rng.integers(0, 4) == 0:
            a = a.view()
            a.flags.writeable = False
        views.append(None if a is None else ar.as_view(a, f"w{k}"))
    n = len(views)
    written = tuple(int(i) for i in rng.permutation(n)[: int(rng.integers(0, n + 1))])
    return views, tuple(i for i in written if views[i] is not None)


def _pairs_of_checks(views, written):
    return ck.check_written(views, written)[0]


def _python_written(views, written):
    """The written checks as the first call made them before (the oracle), then the overlap."""
    for i in written:
        v = views[i]
        if v.readonly or v.legacy:
            ck.check_writable(v)
        ck.check_write_strides(v)
    return ck.check_no_overlap(views, written)


def test_written_layouts_in_c_decide_as_the_python_checks(native, monkeypatch):
    rng = np.random.default_rng(7)
    buf = np.zeros(4096, np.uint8)
    slow_seen = plain_seen = errors = 0
    for _ in range(600):
        views, written = _random_written_call(rng, buf)
        layouts, ptrs, slow = native.written_layouts(views, written)
        assert layouts == [
            None if v is None else (v.shape, v.strides, v.dtype.itemsize) for v in views
        ]
        assert ptrs == [0 if v is None else v.ptr for v in views]
        assert all(isinstance(p, int) for p in ptrs)
        assert slow == [i for i in written if i in slow]  # in order, a subset
        for i in written:  # what C passes, the Python checks pass
            if i not in slow:
                v = views[i]
                assert not (v.readonly or v.legacy)
                ck.check_write_strides(v)
                plain_seen += 1
            else:
                slow_seen += 1
        monkeypatch.setattr(ck, "NATIVE_WRITTEN", [native.written_layouts])
        monkeypatch.setattr(ck, "NATIVE_OVERLAP", [native.overlap_pairs])
        got = _outcome(_pairs_of_checks, views, written)
        monkeypatch.setattr(ck, "NATIVE_WRITTEN", [None])
        monkeypatch.setattr(ck, "NATIVE_OVERLAP", [None])
        assert got == _outcome(_pairs_of_checks, views, written)
        assert got == _outcome(_python_written, views, written)
        assert got[0] == "error" or ck.check_written(views, written)[1:] == (None, None)
        errors += got[0] == "error"
    assert slow_seen > 100 and plain_seen > 100 and errors > 50


def test_written_checks_raise_their_errors(native, monkeypatch):
    monkeypatch.setattr(ck, "NATIVE_WRITTEN", [native.written_layouts])
    buf = np.zeros(256, np.uint8)
    ro = buf[:64].view()
    ro.flags.writeable = False
    views = [ar.as_view(buf[64:128], "q"), ar.as_view(ro, "k_cache")]
    with pytest.raises(BufferError, match="k_cache is written in place but its producer"):
        ck.check_written(views, (1,))
    bcast = ar.as_view(np.lib.stride_tricks.as_strided(buf, (4, 8), (0, 1)), "v_cache")
    with pytest.raises(ValueError, match="v_cache is written but has stride 0"):
        ck.check_written([views[0], bcast], (1,))
    assert native.written_layouts(views, (2,)) is None  # an index past the arguments
    assert native.written_layouts(views, (np.int64(0),)) is None
    assert native.written_layouts([views[0]] * 65, (0,)) is None
    pairs, layouts, ptrs = ck.check_written(views, (0,))
    assert pairs == [(0, 1, 0, 64, 0, 64)] and ptrs == [views[0].ptr, views[1].ptr]
    assert layouts == [((64,), (1,), 1), ((64,), (1,), 1)]


def test_native_plan_reads_its_pairs_as_the_parser_did(native):
    """NativePlan reads a first call's pair tuples without the argument parser: the same values
    taken (ints, NumPy ints), the same errors (a tuple of another length through the parser)."""
    for pairs in (
        [(1, 0, 0, 64, 0, 32)],
        [(np.int64(1), 0, np.int32(0), 64, 0, 32)],
        [],
    ):
        assert native.NativePlan(0, 3, 1, [], pairs, None) is not None
    with pytest.raises(TypeError):
        native.NativePlan(0, 3, 1, [], [(1, 0, 0, 1.5, 0, 32)], None)
    with pytest.raises(OverflowError):
        native.NativePlan(0, 3, 1, [], [(1, 0, 0, 1 << 64, 0, 32)], None)
    with pytest.raises(ValueError, match="pair names no argument"):
        native.NativePlan(0, 3, 1, [], [(1, 3, 0, 64, 0, 32)], None)
    with pytest.raises(TypeError):
        native.NativePlan(0, 3, 1, [], [(1, 0, 0, 64, 0)], None)  # five values: the parser's


class _OnDevice:
    """A view as check_same_device reads it: a name, a device, where()."""

    def __init__(self, name, device):
        self.name, self.device = name, device

    def where(self):
        return f"CUDA device {self.device}" if self.device >= 0 else "host memory"


def test_same_device_in_c_answers_as_the_loop(native, monkeypatch):
    rng = np.random.default_rng(11)
    for _ in range(300):
        views = [
            None if rng.integers(0, 3) == 0 else _OnDevice(f"a{k}", int(rng.integers(-1, 2)))
            for k in range(int(rng.integers(0, 7)))
        ]
        devices = {v.device for v in views if v is not None}
        want = devices.pop() if len(devices) == 1 else None
        assert native.same_device(views) == want
        assert native.same_device(tuple(views)) == want
        monkeypatch.setattr(ck, "NATIVE_SAME_DEVICE", [native.same_device])
        got = _outcome_any(ck.check_same_device, views)
        monkeypatch.setattr(ck, "NATIVE_SAME_DEVICE", [None])
        assert got == _outcome_any(ck.check_same_device, views)


def _outcome_any(f, *args):
    try:
        return "device", f(*args)
    except (ValueError, AttributeError) as exc:  # (none given: None has no device, as before)
        return "error", type(exc).__name__, str(exc)


def test_same_device_names_both_devices(native, monkeypatch):
    monkeypatch.setattr(ck, "NATIVE_SAME_DEVICE", [native.same_device])
    views = (None, _OnDevice("q", 0), _OnDevice("k_cache", 1))
    with pytest.raises(ValueError, match="q is in CUDA device 0, k_cache is in CUDA device 1"):
        ck.check_same_device(views)
    assert ck.check_same_device((_OnDevice("q", -1), None)) == -1  # the host
    with pytest.raises(AttributeError):
        native.same_device([object()])


_SLOTS = ("NATIVE_OVERLAP", "NATIVE_WRITTEN", "NATIVE_SAME_DEVICE")


def _three_checks(views, written, inplace, devices):
    """What a first call's three checks give: the written checks' pairs (or error), the
    same-device answer (or error)."""
    return (
        _outcome(_pairs_of_checks, views, written),
        _outcome(ck.check_no_overlap, views, written, inplace),
        _outcome_any(ck.check_same_device, devices),
    )


def test_first_call_c_switch_routes_the_three_checks(native, monkeypatch):
    """``_native.first_call_c(False)`` routes the three checks to their Python forms, ``True``
    back to C (the bound C replay's functions); both give the same pairs, devices and errors."""
    from ropekv import _launch

    for name in _SLOTS:
        monkeypatch.setattr(ck, name, [None])
    monkeypatch.setattr(ar, "NATIVE_READ", [None])
    monkeypatch.setattr(ar, "NATIVE_MAX_SPAN", [None])
    monkeypatch.setattr(_native, "FIRST_CALL_C", True)
    monkeypatch.setattr(_launch, "_native_module", [native])
    assert _native.first_call_c() is True and ck.NATIVE_OVERLAP == [None]  # None: no change
    assert _native.first_call_c(True) is True
    assert ck.NATIVE_OVERLAP[0] is native.overlap_pairs
    assert ck.NATIVE_WRITTEN[0] is native.written_layouts
    assert ck.NATIVE_SAME_DEVICE[0] is native.same_device
    assert ar.NATIVE_READ[0] is native.read_views
    assert ar.NATIVE_MAX_SPAN[0] is native.max_span
    rng = np.random.default_rng(34)
    buf = np.zeros(4096, np.uint8)
    calls = []
    for _ in range(300):
        views, written, inplace = _random_call(rng, buf)
        written = tuple(i for i in written if views[i] is not None)  # (_given_indices)
        devices = [
            None if rng.integers(0, 3) == 0 else _OnDevice(f"a{k}", int(rng.integers(-1, 2)))
            for k in range(int(rng.integers(0, 5)))
        ]
        calls.append((views, written, inplace, devices))
    for _ in range(300):
        views, written = _random_written_call(rng, buf)
        calls.append((views, written, (), [_OnDevice("q", 0)]))
    on = [_three_checks(*c) for c in calls]
    assert _native.first_call_c(False) is True
    assert all(getattr(ck, name) == [None] for name in _SLOTS) and not _native.FIRST_CALL_C
    assert ar.NATIVE_READ == [None] and ar.NATIVE_MAX_SPAN == [None]
    off = [_three_checks(*c) for c in calls]
    assert on == off
    assert sum(o[0][0] == "error" for o in on) > 20 and sum(o[2][0] == "error" for o in on) > 20
    assert _native.first_call_c(True) is False and ck.NATIVE_SAME_DEVICE[0] is native.same_device


def test_first_call_c_switch_before_the_c_replay_is_bound(native, monkeypatch):
    """Off before the C replay is bound: binding it leaves the Python forms; on: binding routes
    the C forms (``route_first_call_checks``, what ``_launch.native_module`` calls)."""
    from ropekv import _launch

    for name in _SLOTS:
        monkeypatch.setattr(ck, name, [None])
    monkeypatch.setattr(ar, "NATIVE_READ", [None])
    monkeypatch.setattr(_native, "FIRST_CALL_C", True)
    monkeypatch.setattr(_launch, "_native_module", [_launch._UNBOUND])
    assert _native.first_call_c(False) is True
    assert all(getattr(ck, name) == [None] for name in _SLOTS)
    _native.route_first_call_checks(native)
    assert all(getattr(ck, name) == [None] for name in _SLOTS)
    _native.first_call_c(True)
    assert all(getattr(ck, name) == [None] for name in _SLOTS)  # still unbound: nothing to route
    _native.route_first_call_checks(native)
    assert ck.NATIVE_OVERLAP[0] is native.overlap_pairs and ar.NATIVE_READ[0] is native.read_views
    _native.route_first_call_checks(None)  # no C replay: Python
    assert all(getattr(ck, name) == [None] for name in _SLOTS) and ar.NATIVE_READ == [None]


def test_first_calls_on_host_arrays_give_the_same_outputs_either_way(native, monkeypatch):
    """Whole first calls of bench decode cases (NumPy arrays: the checks run as on a GPU, then
    the host path) with the C forms routed and without: the same outputs, byte for byte."""
    from ropekv.bench import cases, timing

    for name in _SLOTS:
        monkeypatch.setattr(ck, name, [None])
    monkeypatch.setattr(ar, "NATIVE_READ", [None])
    monkeypatch.setattr(_native, "FIRST_CALL_C", True)
    specs = [s for s in cases.bench_specs() if s.decode and s.tokens == 1]
    seen = set()
    for spec in specs:
        if spec.op in seen:
            continue
        seen.add(spec.op)
        got = []
        for on in (True, False, True):
            _native.route_first_call_checks(native if on else None)
            timing.clear_plans()
            w = spec.make(np)
            o = w.new_outputs()
            w.bound(o)()
            got.append({k: np.asarray(v).tobytes() for k, v in o.items()})
        assert got[0] == got[1] == got[2], spec.name
    timing.clear_plans()
    assert len(seen) >= 5, seen


def test_read_views_takes_only_what_its_struct_reads_take(native):
    """``read_views`` builds ArrayViews only for a class whose slots it found (another class is
    refused when configured), and leaves any call with an array its struct reads do not take (NumPy
    arrays, here; CuPy arrays and torch tensors on a GPU: tests/test_native.py) to the Python loop:
    None, and ``read_arguments`` reads it as before."""

    class NoSlots:
        pass

    with pytest.raises(TypeError, match="no slot"):
        native.configure_views(NoSlots)
    with pytest.raises(TypeError, match="ArrayView class"):
        native.configure_views(3)
    native.configure_views(ar.ArrayView)
    arrays = [np.zeros(4, np.float16), None]
    assert native.read_views(arrays, ["a", "b"], {}, set()) is None
    assert native.read_views([None, None], ["a", "b"], {}, set()) == ([None, None], 0, None)
    assert native.read_views([None], [], {}, set()) is None  # a name missing: the loop
    views, kinds, bad = ar.read_arguments(arrays, ["a", "b"])
    assert views[0].shape == (4,) and views[1] is None and kinds == ar.OTHER and bad is None


class _Aligned:
    """A view as widest_aligned reads it: a pointer, element strides, a dtype."""

    def __init__(self, ptr, strides, dtype):
        self.ptr, self.strides, self.dtype = ptr, strides, dtype


def _python_form(slot, fn, views):
    """``fn(views)`` with the C form in ``slot`` (a module's ``NATIVE_...`` holder) routed off:
    its Python loop."""
    saved = slot[0]
    slot[0] = None
    try:
        return fn(views)
    finally:
        slot[0] = saved


def _widest_loop(views):
    """_vector.widest_aligned's Python loop (its C form routed off)."""
    from ropekv import _vector

    return _python_form(_vector.NATIVE_WIDEST, _vector.widest_aligned, views)


def test_widest_aligned_in_c_answers_as_the_loop(native, monkeypatch):
    from ropekv import _vector

    rng = np.random.default_rng(17)
    dtypes = [np.dtype(t) for t in ("u1", "f2", "f4", "f8", "i8")]
    for _ in range(3000):
        views = []
        for _ in range(int(rng.integers(0, 9))):
            dims = int(rng.integers(0, 5))
            strides = tuple(
                int(rng.choice([0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 64, 96, 1 << 40]))
                * int(rng.choice([1, -1]))
                for _ in range(dims)
            )
            ptr = int(rng.integers(0, 1 << 20)) * int(rng.choice([1, 2, 4, 8, 16, 256]))
            views.append(_Aligned(ptr + (0x7F << 40), strides, dtypes[rng.integers(0, 5)]))
        want = _widest_loop(views)
        assert native.widest_aligned(views) == want
        assert native.widest_aligned(tuple(views)) == want
        monkeypatch.setattr(_vector, "NATIVE_WIDEST", [native.widest_aligned])
        assert _vector.widest_aligned(views) == want


def test_widest_aligned_in_c_leaves_the_unusual_to_the_loop(native):
    f2 = np.dtype("f2")
    for views in (
        [_Aligned(16, (1 << 70, 1), f2)],  # a stride past int64
        [_Aligned(16.0, (8, 1), f2)],  # a pointer that is no int
        [_Aligned(16, [8, 1], f2)],  # strides that are no tuple
        [_Aligned(16, (8, 1), np.dtype([]))],  # itemsize 0 (the loop divides by it)
        [None],
    ):
        assert native.widest_aligned(views) is None
    assert native.widest_aligned([_Aligned(16, (1 << 70, 1), f2)]) is None
    assert _widest_loop([_Aligned(18, (1 << 70, 1), f2)]) == 1


def _span_loop(views):
    """_arrays.max_span's Python loop (its C form routed off)."""
    return _python_form(ar.NATIVE_MAX_SPAN, ar.max_span, views)


def _random_layout(rng):
    dims = int(rng.integers(0, 5))
    shape = tuple(int(rng.choice([0, 1, 2, 3, 7, 64, 1 << 20])) for _ in range(dims))
    strides = tuple(
        int(rng.choice([0, 1, 2, 5, 64, 1 << 20, 1 << 33])) * int(rng.choice([1, -1]))
        for _ in range(dims)
    )
    return shape, strides


def _random_views(rng, n, dtypes):
    """``n`` views of random layouts (:func:`_random_layout`; the k-th of dtype ``dtypes[k %
    len(dtypes)]``), about one in four None."""
    views = []
    for k in range(n):
        if rng.integers(0, 4) == 0:
            views.append(None)
            continue
        shape, strides = _random_layout(rng)
        dtype = dtypes[k % len(dtypes)]
        views.append(ar.ArrayView(f"a{k}", 1 << 30, shape, strides, dtype, 0))
    return views


def test_max_span_in_c_answers_as_the_loop(native, monkeypatch):
    rng = np.random.default_rng(23)
    dtypes = [np.dtype(t) for t in ("u1", "f2", "f4", "i8")]
    for _ in range(3000):
        views = _random_views(rng, int(rng.integers(0, 9)), dtypes)
        want = _span_loop(views)
        assert native.max_span(views) == want
        assert native.max_span(tuple(views)) == want
        monkeypatch.setattr(ar, "NATIVE_MAX_SPAN", [native.max_span])
        assert ar.max_span(views) == want


def test_max_span_in_c_leaves_the_unusual_to_the_loop(native):
    from types import SimpleNamespace as NS

    assert native.max_span([]) == 0 and native.max_span([None]) == 0
    assert native.max_span([NS(size=1, span=(0, 1 << 62))]) is None  # past +-2**61
    assert native.max_span([NS(size=1, span=[0, 8])]) is None  # no tuple
    assert native.max_span([NS(size=1, span=(0.0, 8))]) is None  # no int
    assert native.max_span([NS(size=0, span=(0.0, 8))]) == -1  # empty: no bound, span unread
    with pytest.raises(AttributeError):
        native.max_span([NS(size=1)])


def test_a_span_bounds_the_reach_of_its_strides():
    """What the paged op's bound of its 32-bit offsets rests on (``paged._span_bound``): a
    non-empty view's byte span is at least the sum over its dims of ``|stride| x (extent - 1)``,
    the farthest element its strides reach from its pointer (in elements); an empty one's span
    need not be, and max_span answers -1 for it."""
    rng = np.random.default_rng(5)
    for _ in range(5000):
        shape, strides = _random_layout(rng)
        itemsize = int(rng.choice([1, 2, 4, 8]))
        view = ar.ArrayView("a", 0, shape, strides, np.dtype(f"u{itemsize}"), 0)
        reach = sum(abs(s) * max(n - 1, 0) for n, s in zip(shape, strides))
        if view.size:
            lo, hi = view.span
            assert hi - lo >= reach and _span_loop([view]) == hi - lo
        else:
            assert _span_loop([None, view]) == -1


def _bind_loop(views, program, bound):
    """_arrays.bind_dims' Python loop (its C form routed off)."""
    return _python_form(ar.NATIVE_BIND_DIMS, lambda v: ar.bind_dims(v, program, bound), views)


_BIND_DTYPES = [np.dtype(t) for t in ("f2", "f4", "i4", "i8")]


def _random_binding(rng):
    """A program over a few random arrays and views that mostly fit it: the dims of a truth,
    with now and then a size, a rank, a dtype, a stride or an array wrong."""
    n_vars = int(rng.integers(1, 7))
    truth = [int(rng.choice([0, 1, 2, 3, 8])) for _ in range(n_vars)]
    n_scalars = int(rng.integers(0, min(n_vars, 2) + 1))
    bound = tuple(truth[:n_scalars])
    entries, views = [], []
    for slot in range(int(rng.integers(1, 6))):
        dims = tuple(int(v) for v in rng.integers(0, n_vars, int(rng.integers(1, 4))))
        shape = [truth[v] for v in dims]
        dtype = _BIND_DTYPES[int(rng.integers(0, 4))]
        strides, step = [], 1
        for n in reversed(shape):
            strides.insert(0, step)
            step *= max(n, 1)
        wrong = int(rng.integers(0, 12))
        if wrong == 0:
            shape[-1] += 1
        elif wrong == 1:
            shape, strides = shape + [1], strides + [1]
        elif wrong == 2:
            strides[-1] = 2
        elif wrong == 3:
            strides[0] = -strides[0]
        view = ar.ArrayView(f"a{slot}", 1 << 30, tuple(shape), tuple(strides), dtype, 0)
        views.append(None if wrong == 4 else view)
        rule = int(rng.integers(0, 4))
        if rule == 0:
            dtypes = ()
        elif rule == 1 and slot:
            dtypes = (int(rng.integers(0, slot)),)  # an earlier array's dtype
        elif rule == 2:
            dtypes = (dtype, _BIND_DTYPES[0]) if wrong != 5 else (_BIND_DTYPES[1],)
        else:
            dtypes = (_BIND_DTYPES[int(rng.integers(0, 4))], int(rng.integers(0, slot + 1)))
        entries.append((slot, dims, dtypes, int(rng.integers(0, 3))))
    relations = []
    for _ in range(int(rng.integers(0, 3))):
        a, b = (int(x) for x in rng.integers(-1, n_vars, 2))
        a = max(a, 0)
        k = truth[a] + (truth[b] if b >= 0 else 0)
        v = int(rng.integers(0, n_vars))
        relations.append((v, a, b, truth[v] - k + int(rng.integers(0, 12) == 0)))
    return views, (n_vars, tuple(entries), tuple(relations)), bound


def test_bind_dims_in_c_answers_as_the_loop(native, monkeypatch):
    """The C form of ``_arrays.bind_dims`` binds, and refuses, every random program as the loop
    does: the same dims, or None."""
    native.configure_views(ar.ArrayView)
    rng = np.random.default_rng(35)
    answers = []
    for _ in range(4000):
        views, program, bound = _random_binding(rng)
        want = _bind_loop(views, program, bound)
        assert native.bind_dims(views, program, bound) == want, (views, program, bound)
        assert native.bind_dims(tuple(views), program, bound) == want
        monkeypatch.setattr(ar, "NATIVE_BIND_DIMS", [native.bind_dims])
        assert ar.bind_dims(views, program, bound) == want
        answers.append(want is not None)
    assert 400 < sum(answers) < 3600  # bound and refused, both often


def test_bind_dims_in_c_leaves_the_unusual_to_the_loop(native):
    """What the C form cannot read (a view of another class, a program it does not know) gets
    None, and the loop decides; a malformed program's count is an error."""
    native.configure_views(ar.ArrayView)
    view = ar.ArrayView("a", 1 << 30, (2, 3), (3, 1), np.dtype("f4"), 0)
    program = (2, ((0, (0, 1), (), 1),), ())
    assert native.bind_dims([view], program, ()) == (2, 3)
    assert native.bind_dims([view], program, (2, 4)) is None  # a scalar the view disagrees with
    assert native.bind_dims([view], program, (-1,)) is None  # a negative scalar binds nothing
    assert native.bind_dims([view], program, (1, 2, 3)) is None  # more scalars than dims
    assert native.bind_dims([ar.ArrayView.__new__(ar.ArrayView)], program, ()) is None
    assert native.bind_dims([None], program, ()) is None
    assert native.bind_dims([view], (2, ((5, (0, 1), (), 1),), ()), ()) is None  # no slot 5
    assert native.bind_dims([view], (99, (), ()), ()) is None  # more dims than it holds
    with pytest.raises(TypeError):
        native.bind_dims([view], ("2", (), ()), ())


def _gather_loop(views, program):
    """_arrays.gather_strides' Python loop (its C form routed off)."""
    return _python_form(ar.NATIVE_GATHER, lambda v: ar.gather_strides(v, program), views)


def test_gather_strides_in_c_answers_as_the_loop(native, monkeypatch):
    """The C form of ``_arrays.gather_strides`` reads every random program's strides as the loop
    does, zeros where a slot is negative or its array not given."""
    native.configure_views(ar.ArrayView)
    rng = np.random.default_rng(41)
    for _ in range(2000):
        views = _random_views(rng, int(rng.integers(1, 8)), [np.dtype("f2")])
        program = []
        for _ in range(int(rng.integers(0, 30))):
            slot = int(rng.integers(-1, len(views)))
            v = views[slot] if slot >= 0 else None
            if v is not None and not v.strides:
                slot = -1  # a 0-d view has no axis to read
            axis = int(rng.integers(0, len(v.strides))) if slot >= 0 and v is not None else 0
            program.append((slot, axis))
        program = tuple(program)
        want = _gather_loop(views, program)
        assert len(want) == len(program)
        assert native.gather_strides(views, program) == want
        assert native.gather_strides(tuple(views), program) == want
        monkeypatch.setattr(ar, "NATIVE_GATHER", [native.gather_strides])
        assert ar.gather_strides(views, program) == want


def test_gather_strides_in_c_leaves_the_unusual_to_the_loop(native):
    """A view C cannot read, an axis it lacks or a slot past the views: None (the loop decides,
    and raises where it must)."""
    native.configure_views(ar.ArrayView)
    view = ar.ArrayView("a", 1 << 30, (2, 3), (3, 1), np.dtype("f4"), 0)
    assert native.gather_strides([view, None], ((0, 1), (1, 0), (-1, 5), (0, 0))) == (1, 0, 0, 3)
    assert native.gather_strides([view], ((0, 2),)) is None  # no axis 2
    assert native.gather_strides([view], ((0, -1),)) is None
    assert native.gather_strides([view], ((1, 0),)) is None  # no slot 1
    assert native.gather_strides([ar.ArrayView.__new__(ar.ArrayView)], ((0, 0),)) is None
    with pytest.raises(IndexError):
        _gather_loop([view], ((0, 2),))
    with pytest.raises(TypeError):
        native.gather_strides([view], [(0, 0)])  # the program is a tuple
