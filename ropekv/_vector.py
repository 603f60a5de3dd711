"""Vector width: how many elements one thread moves per access (16 bytes at most)."""

from __future__ import annotations


def aligned(view, n_elements):
    """True when ``view``'s pointer and every stride but the last are multiples of an access of
    ``n_elements`` (capped at 16 bytes), so row starts stay aligned for that access."""
    access = min(16, n_elements * view.dtype.itemsize)
    if view.ptr % access:
        return False
    return all((s * view.dtype.itemsize) % access == 0 for s in view.strides[:-1])


def vector_width(itemsize, fits, widths=(8, 4, 2, 1)):
    """The widest ``n`` (in elements of ``itemsize`` bytes, at most 16 bytes) with ``fits(n)``, or
    None when no width fits."""
    for n in widths:
        if n * itemsize <= 16 and fits(n):
            return n
    return None
