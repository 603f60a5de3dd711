"""Validation helpers: every op words its errors the same way.

``TypeError`` for dtypes, ``ValueError`` for shapes, layouts, devices and values, ``BufferError``
for memory ropekv cannot address. Each message names the argument, what was expected and what
arrived.
"""

from __future__ import annotations

import os

import numpy as np

from ropekv._arrays import FLOAT32, HOST, as_view


def _dtype_names(dtypes):
    return " or ".join(str(np.dtype(d)) for d in dtypes)


def check_dtype(view, allowed):
    if view.dtype not in allowed:
        raise TypeError(f"{view.name} must have dtype {_dtype_names(allowed)}, got {view.dtype}")


def check_same_dtype(view, other):
    if view.dtype != other.dtype:
        raise TypeError(f"{view.name} must have the dtype of {other.name} ({other.dtype}), "
                        f"got {view.dtype}")


def check_ndim(view, ndims, layout):
    """``layout`` spells the expected shape, e.g. ``"(B, S, Hq, D)"``."""
    ndims = (ndims,) if isinstance(ndims, int) else ndims
    if view.ndim not in ndims:
        raise ValueError(f"{view.name} must have shape {layout}, got {view.shape}")


def check_shape(view, expected, layout=None):
    """``expected`` is a tuple of ints or None (any size); ``layout`` names the dims."""
    ok = len(view.shape) == len(expected) and all(
        e is None or e == n for e, n in zip(expected, view.shape))
    if not ok:
        spelled = tuple("*" if e is None else e for e in expected)
        spelled = str(spelled).replace("'", "")
        where = f" {layout}" if layout else ""
        raise ValueError(f"{view.name} must have shape{where} = {spelled}, got {view.shape}")


def check_last_dim_contiguous(view):
    if view.size and view.shape[-1] > 1 and view.strides[-1] != 1:
        raise ValueError(f"{view.name} must be contiguous in its last dimension (stride 1), got "
                         f"strides {view.strides} (in elements)")


def check_contiguous(view):
    if not view.is_c_contiguous():
        raise ValueError(f"{view.name} must be C-contiguous, got shape {view.shape} with strides "
                         f"{view.strides} (in elements)")


def check_writable(view):
    if view.readonly:
        raise BufferError(f"{view.name} is written in place but its producer exported it "
                          f"read-only (or as a copy)")


def check_same_device(views):
    """All views on one device; returns that device (``HOST`` or a CUDA id)."""
    first = views[0]
    for view in views[1:]:
        if view.device != first.device:
            raise ValueError(f"all arrays must be on one device: {first.name} is in "
                             f"{first.where()}, {view.name} is in {view.where()}")
    return first.device


def check_cos_sin_cache(view, D, ndims=(2,), layout="(P, R)"):
    """A float32 cos/sin table whose last dim, the rotary dim R, is even and in [2, D]; returns
    ``(P, R)``."""
    check_ndim(view, ndims, layout)
    check_dtype(view, (FLOAT32,))
    P, R = view.shape[-2:]
    if R % 2 or not 0 < R <= D:
        raise ValueError(f"{view.name}'s rotary dim R (its last dim) must be even and in "
                         f"[2, D={D}], got {R}")
    return P, R


def check_positive_int(value, name):
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
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
    return os.environ.get("ROPEKV_CHECK_INDICES", "") not in ("", "0")


def host_copy(view):
    """A NumPy copy of a (small) index array, for ``ROPEKV_CHECK_INDICES``."""
    if view.device == HOST:
        return np.asarray(view.host)
    import cupy

    mem = cupy.cuda.UnownedMemory(view.ptr, view.size * view.dtype.itemsize, view.owner,
                                  view.device)
    arr = cupy.ndarray(view.shape, view.dtype, cupy.cuda.MemoryPointer(mem, 0),
                       tuple(s * view.dtype.itemsize for s in view.strides))
    return cupy.asnumpy(arr)


# ---- Ragged batches over a paged cache (input_row_offsets, cache_lengths, block_table) -------


def check_ragged_paged(offsets, cache_lengths, block_table):
    """Validate the ragged-batch index arrays of the paged ops (MLA, QK-norm, fused QKV).

    ``input_row_offsets`` int32 or uint32 ``(B + 1,)``, ``cache_lengths`` int32 ``(B,)`` and
    ``block_table`` int32 ``(B, max_pages)`` (rows may be strided). Returns ``(B, max_pages)``.
    """
    from ropekv._arrays import INT32, UINT32

    check_ndim(offsets, 1, "(B + 1,)")
    check_dtype(offsets, (INT32, UINT32))
    check_contiguous(offsets)
    if offsets.shape[0] < 1:
        raise ValueError(f"{offsets.name} must have shape (B + 1,) with at least one entry, got "
                         f"{offsets.shape}")
    B = offsets.shape[0] - 1
    check_shape(cache_lengths, (B,), "(B,)")
    check_dtype(cache_lengths, (INT32,))
    check_contiguous(cache_lengths)
    check_ndim(block_table, 2, "(B, max_pages)")
    check_shape(block_table, (B, None), "(B, max_pages)")
    check_dtype(block_table, (INT32,))
    check_last_dim_contiguous(block_table)
    return B, block_table.shape[1]


def check_paged_indices(offsets, cache_lengths, block_table, page_size, num_pages, num_tokens,
                        num_positions):
    """``ROPEKV_CHECK_INDICES``: raise IndexError for the first token that the kernels would skip
    (outside every request, position outside ``[0, num_positions)``, page outside the block table
    or the cache), and for offsets that decrease or run past ``num_tokens``."""
    from ropekv.reference import ragged_paged_slots

    offs = host_copy(offsets).astype(np.uint32).astype(np.int64)
    lens, table = host_copy(cache_lengths), host_copy(block_table)
    if np.any(np.diff(offs) < 0):
        b = int(np.argmax(np.diff(offs) < 0))
        raise IndexError(f"{offsets.name} must not decrease, got {offs[b]} then {offs[b + 1]} at "
                         f"[{b}], [{b + 1}]")
    if offs[-1] > num_tokens:
        raise IndexError(f"{offsets.name}[-1] = {offs[-1]} runs past the {num_tokens} tokens")
    request, pos, page, _ = ragged_paged_slots(offs, lens, table, page_size, num_pages,
                                               num_tokens)
    for t in np.nonzero((request < 0) | (pos < 0) | (pos >= num_positions) | (page < 0))[0]:
        t = int(t)
        if request[t] < 0:
            raise IndexError(f"token {t} belongs to no request of {offsets.name} "
                             f"(offsets[0] = {offs[0]}, offsets[-1] = {offs[-1]})")
        b, p = int(request[t]), int(pos[t])
        if not 0 <= p < num_positions:
            raise IndexError(f"token {t} (request {b}) has position {p} = {cache_lengths.name}"
                             f"[{b}] + {t - offs[b]}, outside the cos_sin_cache's "
                             f"[0, P={num_positions})")
        index = p // page_size
        if index >= table.shape[1]:
            raise IndexError(f"token {t} (request {b}, position {p}) needs {block_table.name}"
                             f"[{b}, {index}], past its {table.shape[1]} pages per request")
        raise IndexError(f"token {t} (request {b}, position {p}) maps to page "
                         f"{block_table.name}[{b}, {index}] = {table[b, index]}, outside "
                         f"[0, num_pages={num_pages})")
