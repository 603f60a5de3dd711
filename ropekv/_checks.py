"""Validation helpers: every op words its errors the same way.

``TypeError`` for dtypes, ``ValueError`` for shapes, layouts, devices and values, ``BufferError``
for memory ropekv cannot address. Each message names the argument, what was expected and what
arrived.
"""

from __future__ import annotations

import ctypes
import functools
import math
import numbers
import operator

import numpy as np

from ropekv._arrays import FLOAT32, FP8_DTYPES, HOST, INT32, UINT32, as_view
from ropekv._env import fast_flag

INT8 = np.dtype(np.int8)
SCALED_CACHE_DTYPES = (*FP8_DTYPES, INT8)  # caches that may carry per-token-head scales


def _dtype_names(dtypes):
    return " or ".join(str(np.dtype(d)) for d in dtypes)


def check_dtype(view, allowed):
    if view.dtype not in allowed:
        raise TypeError(f"{view.name} must have dtype {_dtype_names(allowed)}, got {view.dtype}")


def check_same_dtype(view, other):
    if view.dtype != other.dtype:
        raise TypeError(
            f"{view.name} must have the dtype of {other.name} ({other.dtype}), got {view.dtype}"
        )


def check_ndim(view, ndims, layout):
    """``ndims`` an int or a tuple of them; ``layout`` spells the expected shape, e.g.
    ``"(B, S, Hq, D)"``."""
    n = len(view.shape)
    if n != ndims and not (ndims.__class__ is tuple and n in ndims):
        raise ValueError(f"{view.name} must have shape {layout}, got {view.shape}")


def check_shape(view, expected, layout=None):
    """``expected`` is a tuple of ints or None (any size); ``layout`` names the dims."""
    shape = view.shape
    if shape == expected:  # fully given and equal: the common case, one tuple comparison
        return
    if len(shape) == len(expected):
        for e, n in zip(expected, shape):
            if e is not None and e != n:
                break
        else:
            return
    spelled = tuple("*" if e is None else e for e in expected)
    spelled = str(spelled).replace("'", "")
    where = f" {layout}" if layout else ""
    raise ValueError(f"{view.name} must have shape{where} = {spelled}, got {view.shape}")


# C-level callables of check_last_dim_contiguous's common case: a view's strides, a tuple's last
# item, "is not None" (filter's test)
_STRIDES, _LAST = operator.attrgetter("strides"), operator.itemgetter(-1)
is_given = functools.partial(operator.is_not, None)


def check_last_dim_contiguous(*views):
    """Each view (None: not given) has stride 1 in its last dimension. The common case (every
    given view's last stride 1) in one C-level pass; the loop names the first that fails."""
    lasts = list(map(_LAST, map(_STRIDES, filter(is_given, views))))
    if lasts.count(1) == len(lasts):
        return
    for view in views:
        if view is not None and view.size and view.shape[-1] > 1 and view.strides[-1] != 1:
            raise ValueError(
                f"{view.name} must be contiguous in its last dimension (stride 1), "
                f"got strides {view.strides} (in elements)"
            )


def check_contiguous(view):
    if not view.is_c_contiguous():
        raise ValueError(
            f"{view.name} must be C-contiguous, got shape {view.shape} with strides "
            f"{view.strides} (in elements)"
        )


def check_writable(view):
    if view.readonly:
        raise BufferError(
            f"{view.name} is written in place but its producer exported it read-only (or as a copy)"
        )
    if view.legacy and not _allow_legacy_writes():
        raise BufferError(
            f"{view.name} is written in place but came through a legacy (unversioned) DLPack "
            f"capsule, which cannot say whether the memory may be written (JAX arrays, for one, "
            f"are immutable and export such capsules). Pass an array whose producer exports "
            f"DLPack 1.x capsules or __cuda_array_interface__ (ropekv.jax runs ops inside "
            f"jax.jit), or set ROPEKV_ALLOW_LEGACY_DLPACK_WRITES=1 if you own this memory"
        )


def check_element_aligned(view):
    """A device array must start at a multiple of its item size (index and scale arrays are
    loaded whole; data arrays at least element by element)."""
    item = view.dtype.itemsize
    if view.ptr % item and view.size:
        raise BufferError(
            f"{view.name} starts at address {view.ptr:#x}, not a multiple of its "
            f"item size {item} ({view.dtype}); ropekv cannot load it"
        )


def check_write_strides(view):
    """A written array has positive strides on every dimension of size > 1 and no two elements
    at one address (a broadcast or overlapping view would make blocks race)."""
    if view.size == 0:
        return
    reach = 0  # elements spanned by the dims of smaller stride
    for n, stride in zip(reversed(view.shape), reversed(view.strides)):
        if n > 1:
            if stride <= reach:
                break  # not innermost-first with room for each: the general test below
            reach += (n - 1) * stride
    else:
        return
    dims = sorted((s, n, d) for d, (n, s) in enumerate(zip(view.shape, view.strides)) if n > 1)
    reach = 0  # elements spanned by the dims of smaller stride
    for stride, n, d in dims:
        if stride <= 0:
            raise ValueError(
                f"{view.name} is written but has stride {stride} in dimension {d} "
                f"(shape {view.shape}, strides {view.strides}): a written array "
                f"needs positive strides, not a broadcast or reversed view"
            )
        if stride <= reach:
            raise ValueError(
                f"{view.name} is written but its strides {view.strides} (shape "
                f"{view.shape}) put several elements at one address"
            )
        reach += (n - 1) * stride


def shares_bytes(a, b):
    """Whether two strided layouts ``(ptr, shape, strides in elements, itemsize)`` share a byte.

    Exact: NumPy's solver runs on stand-in arrays at those addresses (built over a ctypes buffer
    that is never read), so device pointers work as well as host ones."""

    def lo_hi(ptr, shape, strides, item):
        lo = sum((n - 1) * s for n, s in zip(shape, strides) if s < 0) * item
        hi = sum((n - 1) * s for n, s in zip(shape, strides) if s > 0) * item
        return ptr + lo, ptr + hi + item

    (a_lo, a_hi), (b_lo, b_hi) = lo_hi(*a), lo_hi(*b)
    if not (a_lo < b_hi and b_lo < a_hi):
        return False
    lo, hi = min(a_lo, b_lo), max(a_hi, b_hi)
    buf = (ctypes.c_char * (hi - lo)).from_address(lo)

    def stand_in(ptr, shape, strides, item):
        return np.ndarray(
            (*shape, item),
            np.uint8,
            buffer=buf,
            offset=ptr - lo,
            strides=(*(s * item for s in strides), 1),
        )

    try:
        return bool(np.shares_memory(stand_in(*a), stand_in(*b), max_work=1 << 20))
    except np.exceptions.TooHardError:
        return True  # not provably disjoint


def overlap_message(name, other, other_written, inplace=False):
    """The error for a written array ``name`` sharing bytes with ``other``; ``inplace``: the pair
    may be one array (in place), which this is not."""
    if inplace:
        return (
            f"{name} must be {other} itself (in place) or not overlap it; it overlaps "
            f"{other} partially"
        )
    what = "also written" if other_written else "read"
    return (
        f"{name} is written in place but shares memory with {other} ({what} by this call); "
        f"pass arrays that do not overlap"
    )


# the C replay's overlap_pairs (ropekv/_native.c) once _launch has loaded it, else None: the
# pairs of a first call in one C call (the Python loop below gives the same, and decides where
# it answers None)
NATIVE_OVERLAP = [None]


# the C replay's written_layouts (ropekv/_native.c) once _launch has loaded it, else None
NATIVE_WRITTEN = [None]


def check_written(views, written, inplace=()):
    """A first call's checks of its written arrays (``written``: indices of given views), in
    order: each writable (:func:`check_writable`, where read-only or a legacy capsule), with
    strides that put no two elements at one address (:func:`check_write_strides`), and sharing
    no byte with another argument (:func:`check_no_overlap`). Returns ``(pairs, layouts, ptrs)``:
    the overlap pairs, and each view's ``(shape, strides, itemsize)`` and pointer (0 and None for
    None), or None, None where the C replay is not loaded (``NATIVE_WRITTEN``: they come with the
    views it passes at once; the others are checked here)."""
    native = NATIVE_WRITTEN[0]
    found = None if native is None else native(views, written)
    layouts, ptrs, slow = (None, None, written) if found is None else found
    for i in slow:
        v = views[i]
        if v.readonly or v.legacy:  # else writable: no call
            check_writable(v)
        check_write_strides(v)
    return check_no_overlap(views, written, inplace), layouts, ptrs


def check_no_overlap(views, written, inplace=()):
    """No written array shares a byte with any other argument, except the pairs of ``inplace``
    (index pairs) when they are the very same array (same pointer and layout). Byte spans are
    compared first; the exact test runs only where two spans intersect.

    Returns the pairs it compared, ``(i, j, lo_i, hi_i, lo_j, hi_j)``: written array ``i``
    against argument ``j`` (both given, not empty) with their byte spans relative to their
    pointers, which a plan's replay re-checks on new pointers (``Plan.finish``). The pairs and
    the intersecting ones come from C where the C replay is loaded (``NATIVE_OVERLAP``: one call
    instead of a loop over a hundred pairs or so), else from :func:`overlap_pairs`."""
    native = NATIVE_OVERLAP[0]
    found = None if native is None else native(views, written)
    pairs, hits = overlap_pairs(views, written) if found is None else found
    for i, j in hits:
        _check_pair(views, written, inplace, i, j)
    return pairs


def overlap_pairs(views, written):
    """``(pairs, hits)``: the pairs :func:`check_no_overlap` returns and ``(i, j)`` of those whose
    byte ranges intersect, in order (the Python form of ``_native.c``'s ``overlap_pairs``)."""
    # (j, lo, hi, absolute lo, absolute hi) of the arrays given, not empty
    spans = []
    for j, v in enumerate(views):
        if v is not None and v.size:
            lo, hi = v.span
            spans.append((j, lo, hi, v.ptr + lo, v.ptr + hi))
    pairs, hits = [], []
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
            if a_first < b_end and b_first < a_end:  # disjoint spans: most pairs stop before
                hits.append((i, j))
    return pairs, hits


def _check_pair(views, written, inplace, i, j):
    """Raise where written array ``i`` shares bytes with argument ``j`` (their byte spans
    intersect), but for an ``inplace`` pair that is the very same array."""
    a, b = views[i], views[j]
    pair = frozenset((i, j)) in inplace
    same = a.ptr == b.ptr and a.shape == b.shape and a.strides == b.strides and a.dtype == b.dtype
    if same and pair:
        return
    if shares_bytes(
        (a.ptr, a.shape, a.strides, a.dtype.itemsize),
        (b.ptr, b.shape, b.strides, b.dtype.itemsize),
    ):
        raise ValueError(overlap_message(a.name, b.name, j in written, pair))


def check_flag(value, name):
    """A bool flag (``bool`` or ``numpy.bool_``), as a Python bool."""
    if value is True or value is False:
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {value!r} of type {type(value).__name__}")


FLOAT32_MAX = float(np.finfo(np.float32).max)  # a kernel takes its scalars as float32
INT32_MAX = 2**31 - 1
_FAST_MAX = FLOAT32_MAX  # check_float's shortcut bound (tests set it to -inf to bypass it)


def check_float(value, name, *, positive):
    """A finite real scalar (> 0 when ``positive``, else >= 0) that float32 holds (a kernel
    record takes it as a float32), as a Python float."""
    cls = value.__class__
    if cls is float and (0.0 < value if positive else 0.0 <= value) and value <= _FAST_MAX:
        return value  # the common case, valid as it is (NaN fails both tests)
    if (
        cls is not float
        and cls is not int
        and (isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real))
    ):
        raise TypeError(
            f"{name} must be a real number, got {value!r} of type {type(value).__name__}"
        )
    what = "positive" if positive else "non-negative"
    try:
        value = float(value)
    except (OverflowError, ValueError):  # an int beyond any float (10**400)
        raise ValueError(
            f"{name} must be a finite {what} number of at most {FLOAT32_MAX:.7g} (float32), "
            f"got {_short_repr(value)}"
        ) from None
    ok = math.isfinite(value) and (value > 0 if positive else value >= 0)
    if not ok:
        raise ValueError(f"{name} must be a finite {what} number, got {value!r}")
    if value > FLOAT32_MAX:
        raise ValueError(
            f"{name} must be at most {FLOAT32_MAX:.7g} (float32, as the kernels take it), "
            f"got {value!r}"
        )
    return value


def _short_repr(value, limit=60):
    """``repr(value)``, cut to ``limit`` characters (an int of 400 digits)."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's digit limit for str()
        return f"an integer of about {value.bit_length() * 0.30103:.0f} digits"
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def check_cache_scale(kv_scale, cache_dtype, name="kv_scale"):
    """The dequantization scale of an fp8 cache (1.0 by default); None for 16-bit caches."""
    if cache_dtype in FP8_DTYPES:
        return 1.0 if kv_scale is None else check_float(kv_scale, name, positive=True)
    if kv_scale is not None:
        raise ValueError(f"{name} is only used with float8 caches, but the cache is {cache_dtype}")
    return None


def check_q_out_dtype(value, vq, vgiven):
    """The dtype q is stored in: ``q_out_dtype`` (``q``'s dtype or fp8, as a dtype or its name)
    and a given ``q_out``'s dtype, which must agree."""
    if value is None and vgiven is None:  # the default: q's dtype
        return vq.dtype
    allowed = (vq.dtype, *FP8_DTYPES)
    dtype = None
    if value is not None:
        try:
            dtype = np.dtype(value)
        except TypeError:
            dtype = None
        if dtype not in allowed:
            names = " or ".join(str(d) for d in allowed)
            raise TypeError(f"q_out_dtype must be {names} (a dtype or its name), got {value!r}")
    if vgiven is None:
        return vq.dtype if dtype is None else dtype
    check_shape(vgiven, vq.shape, None)
    check_dtype(vgiven, allowed)
    if dtype is not None and dtype != vgiven.dtype:
        raise TypeError(
            f"q_out_dtype ({dtype}) must be the dtype of the given q_out ({vgiven.dtype}) or None"
        )
    check_last_dim_contiguous(vgiven)
    return vgiven.dtype


def check_scale_values(view):
    """A scale array's values are positive and finite (read on the host: host arrays always, device
    arrays under ``ROPEKV_CHECK_INDICES``, which already synchronises)."""
    values = host_copy(view).astype(np.float64)
    bad = ~(np.isfinite(values) & (values > 0))
    if bad.any():
        i = tuple(int(x) for x in np.argwhere(bad)[0])
        raise ValueError(
            f"{view.name} must hold positive finite scales, got {values[i]!r} at {list(i)}"
        )


def check_q_scales(
    q_dtype,
    q_name,
    static_name,
    static_given,
    dynamic,
    shape=None,
    layout=None,
    *,
    static_needs_fp8=True,
    hint="",
):
    """The scales of a quantized q output: a static scale (``static_name``, ``static_given``) or
    dynamic ones written to ``q_scale_out`` (``dynamic``: its view or None, of ``shape`` spelled
    ``layout``), never both, and each only with a float8 q (``q_dtype``, None when the call has
    no q output; ``q_name`` names where that dtype comes from; ``hint`` ends the message).
    ``static_needs_fp8=False``: the op ignores a static scale without quantization (FlashInfer's
    paged ops). The static value itself is the op's to check (its forms differ)."""
    fp8 = q_dtype in FP8_DTYPES
    if dynamic is not None:
        if not fp8:
            raise ValueError(
                f"q_scale_out is only used with a float8 {q_name}, but {q_name} is "
                f"{'not given' if q_dtype is None else q_dtype}{hint}"
            )
        if static_given:
            raise ValueError(
                f"{static_name} (a static scale) and q_scale_out (dynamic scales) "
                f"exclude each other: give one"
            )
        check_scale_array(dynamic, shape, layout)
    elif static_given and static_needs_fp8 and not fp8:
        raise ValueError(
            f"{static_name} is only used with a float8 {q_name}, but {q_name} is "
            f"{'not given' if q_dtype is None else q_dtype}{hint}"
        )


def check_cache_scales(cache_dtype, cache_name, static_name, static_given, given, layout):
    """Per-token-head KV scales (``kv_cache_scales``; ``given``: whether passed, spelled
    ``layout``) against the cache dtype (``cache_dtype``, named ``cache_name``) and the static
    cache scales (``static_name``, ``static_given``): they need a float8 or int8 cache, an int8
    cache needs them, and they exclude static scales. All ``ValueError``: each rule ties one
    argument to another's presence or dtype (as ``kv_scale`` required for a float8 cache); a
    dtype that no argument makes valid stays the op's ``TypeError``."""
    if given:
        if cache_dtype not in SCALED_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_scales needs a float8 or int8 {cache_name}, but "
                f"{cache_name} is {cache_dtype}"
            )
        if static_given:
            raise ValueError(
                f"{static_name} (static scales) and kv_cache_scales (per-token-head "
                f"scales) exclude each other: give one"
            )
    elif cache_dtype == INT8:
        raise ValueError(
            f"an int8 {cache_name} needs kv_cache_scales {layout} float32: int8 "
            f"rows are stored with per-token-head scales only"
        )


def check_scale_array(view, shape, layout):
    """A float32 scale array of ``shape`` (spelled ``layout``)."""
    check_ndim(view, len(shape), layout)
    check_shape(view, shape, layout)
    check_dtype(view, (FLOAT32,))


def check_unique_slots(rows, tokens, what="cache row"):
    """``ROPEKV_CHECK_INDICES``: two tokens that write one cache row leave it undefined (its
    16-byte pieces may come from either): raise ``IndexError`` naming both. ``rows`` is an (n, k)
    int array of written rows' coordinates, ``tokens`` the n tokens writing them."""
    if len(rows) < 2:
        return
    rows = np.asarray(rows, np.int64).reshape(len(rows), -1)
    order = np.lexsort(rows.T[::-1])
    sorted_rows = rows[order]
    same = np.all(sorted_rows[1:] == sorted_rows[:-1], axis=1)
    if same.any():
        k = int(np.argmax(same))
        t0, t1 = sorted((int(tokens[order[k]]), int(tokens[order[k + 1]])))
        raise IndexError(
            f"tokens {t0} and {t1} both write {what} {tuple(sorted_rows[k])}: the "
            f"row's contents would be undefined"
        )


# the C replay's same_device (ropekv/_native.c) once _launch has loaded it, else None
NATIVE_SAME_DEVICE = [None]


def check_same_device(views):
    """All views (None: not given) on one device; returns that device (``HOST`` or a CUDA id).
    The C replay's ``same_device`` answers the common case (one device) in one call; the loop
    below names the two devices of a mixed call (and raises as before when none is given)."""
    native = NATIVE_SAME_DEVICE[0]
    if native is not None:
        device = native(views)
        if device is not None:
            return device
    first = None
    for view in views:
        if view is None:
            continue
        if first is None:
            first = view
        elif view.device != first.device:
            raise ValueError(
                f"all arrays must be on one device: {first.name} is in "
                f"{first.where()}, {view.name} is in {view.where()}"
            )
    return first.device


def check_cos_sin_cache(view, D, ndims=(2,), layout="(P, R)"):
    """A float32 cos/sin table whose last dim, the rotary dim R, is even and in [2, D]; returns
    ``(P, R)``."""
    check_ndim(view, ndims, layout)
    check_dtype(view, (FLOAT32,))
    P, R = view.shape[-2:]
    if R % 2 or not 0 < R <= D:
        raise ValueError(
            f"{view.name}'s rotary dim R (its last dim) must be even and in [2, D={D}], got {R}"
        )
    return P, R


def check_positive_int(value, name, limit=INT32_MAX):
    """A positive ``int`` (or NumPy integer) of at most ``limit`` (a kernel record takes it as an
    int32), as a Python int."""
    if (
        value.__class__ is not int
        and (isinstance(value, bool) or not isinstance(value, int | np.integer))
        or value <= 0
    ):
        raise ValueError(f"{name} must be a positive integer, got {_short_repr(value)}")
    if value > limit:
        raise ValueError(
            f"{name} must be a positive integer of at most {limit}, got {_short_repr(value)}"
        )
    return int(value)


def check_choice(value, name, choices):
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def views(stream_ptr, **arrays):
    """``as_view`` each non-None keyword; None stays None."""
    return {name: None if a is None else as_view(a, name, stream_ptr) for name, a in arrays.items()}


def check_indices_enabled():
    """``ROPEKV_CHECK_INDICES=1``: check index arrays on the host before launching."""
    return _check_indices()


_check_indices = fast_flag("ROPEKV_CHECK_INDICES")
_allow_legacy_writes = fast_flag("ROPEKV_ALLOW_LEGACY_DLPACK_WRITES")


def host_copy(view):
    """A NumPy copy of a (small) index array, for ``ROPEKV_CHECK_INDICES``."""
    if view.device == HOST:
        return np.asarray(view.host)
    import cupy

    mem = cupy.cuda.UnownedMemory(
        view.ptr, view.size * view.dtype.itemsize, view.owner, view.device
    )
    arr = cupy.ndarray(
        view.shape,
        view.dtype,
        cupy.cuda.MemoryPointer(mem, 0),
        tuple(s * view.dtype.itemsize for s in view.strides),
    )
    return cupy.asnumpy(arr)


# ---- Ragged batches over a paged cache (input_row_offsets, cache_lengths, block_table) -------


def check_ragged_paged(offsets, cache_lengths, block_table):
    """Validate the ragged-batch index arrays of the paged ops (MLA, QK-norm, fused QKV).

    ``input_row_offsets`` int32 or uint32 ``(B + 1,)``, ``cache_lengths`` int32 ``(B,)`` and
    ``block_table`` int32 ``(B, max_pages)`` (rows may be strided). Returns ``(B, max_pages)``.
    """
    if common_ragged_paged(offsets, cache_lengths, block_table):
        return block_table.shape
    check_ndim(offsets, 1, "(B + 1,)")
    check_dtype(offsets, (INT32, UINT32))
    check_contiguous(offsets)
    if offsets.shape[0] < 1:
        raise ValueError(
            f"{offsets.name} must have shape (B + 1,) with at least one entry, got {offsets.shape}"
        )
    B = offsets.shape[0] - 1
    check_shape(cache_lengths, (B,), "(B,)")
    check_dtype(cache_lengths, (INT32,))
    check_contiguous(cache_lengths)
    check_ndim(block_table, 2, "(B, max_pages)")
    check_shape(block_table, (B, None), "(B, max_pages)")
    check_dtype(block_table, (INT32,))
    check_last_dim_contiguous(block_table)
    return B, block_table.shape[1]


def common_ragged_paged(offsets, cache_lengths, block_table):
    """Whether the index arrays have the common valid layout, which the checkers of
    :func:`check_ragged_paged` (and the fused QKV op's own, ``qkv._check_ragged``) would pass:
    offsets int32 or uint32 and lengths int32, both 1-D of stride 1, the table int32
    ``(B, max_pages)`` with rows of stride 1. Each array is read only once those before it pass,
    as the checkers read them (this runs on every first call)."""
    shape = offsets.shape
    return (
        len(shape) == 1
        and offsets.dtype in _OFFSET_DTYPES
        and offsets.strides == UNIT_STRIDE
        and shape[0] >= 1
        and cache_lengths.shape == (shape[0] - 1,)
        and cache_lengths.dtype == INT32
        and cache_lengths.strides == UNIT_STRIDE
        and len(block_table.shape) == 2
        and block_table.shape[0] == shape[0] - 1
        and block_table.dtype == INT32
        and block_table.strides[1] == 1
    )


_OFFSET_DTYPES = (INT32, UINT32)
UNIT_STRIDE = (1,)  # the strides of a 1-D array of stride 1 (contiguous)


def check_paged_indices(
    offsets, cache_lengths, block_table, page_size, num_pages, num_tokens, num_positions
):
    """``ROPEKV_CHECK_INDICES``: raise IndexError for the first token that the kernels would skip
    (outside every request, position outside ``[0, num_positions)``, page outside the block table
    or the cache), and for offsets that decrease or run past ``num_tokens``."""
    from ropekv.reference import ragged_paged_slots

    offs = host_copy(offsets).astype(np.uint32).astype(np.int64)
    lens, table = host_copy(cache_lengths), host_copy(block_table)
    if np.any(np.diff(offs) < 0):
        b = int(np.argmax(np.diff(offs) < 0))
        raise IndexError(
            f"{offsets.name} must not decrease, got {offs[b]} then {offs[b + 1]} at "
            f"[{b}], [{b + 1}]"
        )
    if offs[-1] > num_tokens:
        raise IndexError(f"{offsets.name}[-1] = {offs[-1]} runs past the {num_tokens} tokens")
    request, pos, page, entry = ragged_paged_slots(
        offs, lens, table, page_size, num_pages, num_tokens
    )
    for t in np.nonzero((request < 0) | (pos < 0) | (pos >= num_positions) | (page < 0))[0]:
        t = int(t)
        if request[t] < 0:
            raise IndexError(
                f"token {t} belongs to no request of {offsets.name} "
                f"(offsets[0] = {offs[0]}, offsets[-1] = {offs[-1]})"
            )
        b, p = int(request[t]), int(pos[t])
        if not 0 <= p < num_positions:
            raise IndexError(
                f"token {t} (request {b}) has position {p} = {cache_lengths.name}"
                f"[{b}] + {t - offs[b]}, outside the cos_sin_cache's "
                f"[0, P={num_positions})"
            )
        index = p // page_size
        if index >= table.shape[1]:
            raise IndexError(
                f"token {t} (request {b}, position {p}) needs {block_table.name}"
                f"[{b}, {index}], past its {table.shape[1]} pages per request"
            )
        raise IndexError(
            f"token {t} (request {b}, position {p}) maps to page "
            f"{block_table.name}[{b}, {index}] = {table[b, index]}, outside "
            f"[0, num_pages={num_pages})"
        )
    writes = page >= 0
    check_unique_slots(
        np.stack([page[writes], entry[writes]], 1),
        np.flatnonzero(writes),
        "cache row (page, entry)",
    )


def check_layer_idx(value):
    """``layer_idx`` of a multi-layer cache: an ``int`` (or NumPy integer), not a bool; as a
    Python int (its range is checked against the arrays' layer count)."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
        raise TypeError(f"layer_idx must be an int, got {value!r} of type {type(value).__name__}")
    return int(value)


def layer_range_message(layer_idx, num_layers, name, shape):
    return (
        f"layer_idx must be in [0, num_layers) = [0, {num_layers}), the leading dimension "
        f"of {name} (shape {shape}), got {layer_idx}"
    )


def argument_indices(names, wanted):
    """The positions in an op's argument ``names`` (the tuple its ``Op`` is given) of the names in
    ``wanted``, as a tuple; of ``wanted`` itself when it is one name (a ``str``), as an int. The
    op modules write argument roles (written arrays, in-place pairs, pointer slots) by name with
    it, once, at import."""
    if isinstance(wanted, str):
        return names.index(wanted)
    return tuple(names.index(name) for name in wanted)
