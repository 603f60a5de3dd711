"""Vector width: how many elements one thread moves per access (16 bytes at most)."""

from __future__ import annotations

from math import gcd


def aligned(view, n_elements):
    """True when ``view``'s pointer and every stride but the last are multiples of an access of
    ``n_elements`` (capped at 16 bytes), so row starts stay aligned for that access."""
    return all_aligned((view,), n_elements)


def all_aligned(views, n_elements):
    """``aligned(view, n_elements)`` for every view of ``views`` (one loop, no generator)."""
    for view in views:
        item = view.dtype.itemsize
        access = n_elements * item
        if access > 16:  # noqa: PLR1730 - not min(): this runs per array of every first call
            access = 16
        if view.ptr % access:
            return False
        for s in view.strides[:-1]:
            if s * item % access:
                return False
    return True


def vector_width(itemsize, fits, widths=(8, 4, 2, 1)):
    """The widest ``n`` (in elements of ``itemsize`` bytes, at most 16 bytes) with ``fits(n)``, or
    None when no width fits."""
    for n in widths:
        if n * itemsize <= 16 and fits(n):
            return n
    return None


def widest_aligned(views):
    """The largest ``n`` with ``all_aligned(views, n)`` for every power of two up to it (16:
    every width), in one pass: a first call that tries several widths reads each view once.

    An access of ``min(n * itemsize, 16)`` bytes (a power of two) divides a pointer and every
    stride but the last exactly when it divides their bitwise or (or their gcd: both have the
    same lowest set bit), so a view allows ``n`` up to that lowest set bit (below 16 bytes), in
    elements."""
    widest = 16
    for view in views:
        item = view.dtype.itemsize
        # (an access is at most 16 bytes: 16-byte aligned allows every width)
        bits = (view.ptr | gcd(*view.strides[:-1]) * item) & 15
        if bits:
            n = (bits & -bits) // item
            if n < widest:
                widest = n
    return widest
