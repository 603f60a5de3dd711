"""Vector width: how many elements one thread moves per access (16 bytes at most)."""

from __future__ import annotations

from math import gcd


def vector_width(itemsize, fits, widths=(8, 4, 2, 1)):
    """The widest ``n`` (in elements of ``itemsize`` bytes, at most 16 bytes) with ``fits(n)``, or
    None when no width fits."""
    for n in widths:
        if n * itemsize <= 16 and fits(n):
            return n
    return None


# the C replay's widest_aligned (ropekv/_native.c) once _launch has loaded it, else None (routed
# with the first call's other C forms: _native.route_first_call_checks)
NATIVE_WIDEST = [None]


def widest_aligned(views):
    """The widest access every view of ``views`` is aligned for, in elements (16: every width): a
    power of two ``n`` fits exactly when ``n <= widest_aligned(views)``, that is when each view's
    pointer and every stride but its last are multiples of an access of ``n`` elements (capped at
    16 bytes), so row starts stay aligned for it. One pass: a first call that tries several
    widths reads each view once.

    An access of ``min(n * itemsize, 16)`` bytes (a power of two) divides a pointer and every
    stride but the last exactly when it divides their bitwise or (or their gcd: both have the
    same lowest set bit), so a view allows ``n`` up to that lowest set bit (below 16 bytes), in
    elements. The C form answers in one call where it can read every view (None: this loop)."""
    native = NATIVE_WIDEST[0]
    if native is not None:
        found = native(views)
        if found is not None:
            return found
    widest = 16
    for view in views:
        item = view.dtype.itemsize
        # (an access is at most 16 bytes: 16-byte aligned allows every width)
        bits = (view.ptr | gcd(*view.strides[:-1]) * item) & 15
        if bits:
            n = (bits & -bits) // item
            widest = min(widest, n)
    return widest
