"""Validation of the option keywords shared by several ops: mRoPE (the ops that take
positions) and ``status=`` (the ops that take ragged offsets)."""

from __future__ import annotations

import numbers

import numpy as np

from ropekv import _checks as ck
from ropekv._arrays import INT32, INT64
from ropekv.reference import mrope_rows


def section_list(section):
    """``mrope_section`` as a list of three ints (None stays None), as the framework forms pass it
    (a torch schema's ``SymInt[]``); anything else gets the eager op's message. Plain ``type``
    tests first: ``torch.compile`` traces them without a graph break."""
    if section is None:
        return None
    if (
        type(section) in (tuple, list)
        and len(section) == 3
        and all(type(x) is int for x in section)
    ):
        return list(section)
    if (
        not isinstance(section, tuple | list)
        or len(section) != 3
        or not all(
            isinstance(x, int | np.integer) and not isinstance(x, bool | np.bool_) for x in section
        )
    ):
        raise ValueError(f"mrope_section must be three integers (t, h, w), got {section!r}")
    return [int(x) for x in section]


def check_mrope(section, interleaved, R, vpos, shape, layout):
    """``(t, h, w)`` of a valid ``mrope_section`` for rotary dim ``R``, with ``position_ids``
    (``vpos``) of ``shape`` spelled ``layout``; None (and no ``position_ids`` of that shape
    demanded) when ``section`` is None. Sections count rotary half-dims and sum to R/2; with
    ``interleaved`` (Qwen3-VL) the stride-3 layout must give each axis its count."""
    if section is None:
        return None
    if (
        not isinstance(section, tuple)
        or len(section) != 3
        or not all(
            isinstance(x, numbers.Integral) and not isinstance(x, bool | np.bool_) for x in section
        )
    ):
        raise ValueError(f"mrope_section must be three integers (t, h, w), got {section!r}")
    t, h, w = (int(x) for x in section)
    if min(t, h, w) < 0 or t + h + w != R // 2:
        raise ValueError(
            f"mrope_section (t, h, w) must be non-negative and sum to R/2 = "
            f"{R // 2} (rotary half-dims), got {section!r}"
        )
    if interleaved:
        counts = tuple(np.bincount(mrope_rows(R // 2, (t, h, w), True), minlength=3).tolist())
        if counts != (t, h, w):
            raise ValueError(
                f"mrope_section {section!r} does not fit the interleaved layout of "
                f"R/2 = {R // 2} half-dims (it gives the axes {counts}): h and w "
                f"must be at most about a third of R/2 each"
            )
    if vpos is None:
        raise ValueError(f"position_ids {layout} is required with mrope_section")
    ck.check_shape(vpos, shape, layout)
    ck.check_dtype(vpos, (INT32, INT64))
    ck.check_contiguous(vpos)
    return t, h, w


def check_mrope_indices(vpos, P):
    """``ROPEKV_CHECK_INDICES``: IndexError for the first token with an mRoPE position outside the
    cos/sin table's ``[0, P)`` (the kernels skip such a token)."""
    pos = ck.host_copy(vpos).astype(np.int64).reshape(3, -1)
    bad = np.argwhere((pos < 0) | (pos >= P))
    if bad.size:
        axis, t = (int(x) for x in bad[np.argmin(bad[:, 1])])
        raise IndexError(
            f"token {t} has {('temporal', 'height', 'width')[axis]} position "
            f"{int(pos[axis, t])} (position_ids[{axis}, {t}]), outside the "
            f"cos_sin_cache's [0, P={P})"
        )


def check_status(view):
    """``status=``: an int32 array of one element (``(1,)`` or ``()``), written by the op."""
    ck.check_ndim(view, (0, 1), "(1,)")
    if view.ndim == 1:
        ck.check_shape(view, (1,), "(1,)")
    ck.check_dtype(view, (INT32,))
    ck.check_element_aligned(view)
