"""NumPy references of every ropekv operation (float64 maths).

They are the CPU backend (NumPy inputs run here, with the same in-place writes as the kernels) and
the oracle of every GPU test. Imports only NumPy and ml_dtypes.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

FP8_MAX = {
    np.dtype(ml_dtypes.float8_e4m3fn): float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max),
    np.dtype(ml_dtypes.float8_e5m2): float(ml_dtypes.finfo(ml_dtypes.float8_e5m2).max),
}


INT8 = np.dtype(np.int8)

# The largest code of each quantized type: a computed scale maps a row's largest |x| onto it
# (int8 is symmetric: [-127, 127]).
MAX_CODE = {**FP8_MAX, INT8: 127.0}


def is_fp8(dtype):
    return np.dtype(dtype) in FP8_MAX


def to_dtype(x, dtype):
    """Round float64 ``x`` to ``dtype``: nearest even; fp8 saturates to its largest finite value
    (infinities too), NaN stays NaN; int8 saturates to [-127, 127] and NaN becomes 0."""
    dtype = np.dtype(dtype)
    if dtype == INT8:
        x = np.nan_to_num(np.asarray(x, np.float64), nan=0.0)
        return np.clip(np.rint(x), -127, 127).astype(INT8)
    if dtype in FP8_MAX:
        limit = FP8_MAX[dtype]
        x = np.clip(x, -limit, limit)
    return np.asarray(x, np.float64).astype(dtype)


def quantize_rows(x, dtype):
    """Quantize each row (last axis) of float64 ``x`` with its own computed scale (dynamic fp8 Q,
    per-token-head KV scales; ``docs/conventions.md``): ``a = max(max|x|, 1e-6)`` (NaN
    elements ignored), stored ``= to_dtype(x * (max_code / a))``; returns ``(stored, scale)``
    with the float64 dequantization scales ``a / max_code`` of shape ``x.shape[:-1]``."""
    code = MAX_CODE[np.dtype(dtype)]
    x = np.asarray(x, np.float64)
    amax = (
        np.fmax.reduce(np.abs(x), axis=-1, initial=0.0) if x.shape[-1] else np.zeros(x.shape[:-1])
    )
    a = np.fmax(amax, 1e-6)
    with np.errstate(invalid="ignore"):
        stored = to_dtype(x * (code / a)[..., None], dtype)
    return stored, a / code


def dequantize_rows(stored, scale):
    """float64 values of rows stored with per-row scales (the inverse of :func:`quantize_rows`)."""
    return np.asarray(stored, np.float64) * np.asarray(scale, np.float64)[..., None]


def rope(x, cos, sin, is_neox):
    """Rotate the leading ``2 * cos.shape[-1]`` dims of ``x`` (float64, ``(..., D)``).

    ``cos``/``sin`` broadcast against ``x[..., :R/2]``. neox pairs (i, i + R/2); interleaved pairs
    (2i, 2i + 1). Dims ``[R, D)`` pass through.
    """
    x = np.array(x, np.float64)
    half = cos.shape[-1]
    if is_neox:
        a, b = x[..., :half].copy(), x[..., half : 2 * half].copy()
        x[..., :half] = a * cos - b * sin
        x[..., half : 2 * half] = b * cos + a * sin
    else:
        a, b = x[..., 0 : 2 * half : 2].copy(), x[..., 1 : 2 * half : 2].copy()
        x[..., 0 : 2 * half : 2] = a * cos - b * sin
        x[..., 1 : 2 * half : 2] = b * cos + a * sin
    return x


def split_cos_sin(rows):
    """float32 table rows ``(..., R)`` -> float64 cos, sin ``(..., R/2)``."""
    rows = np.asarray(rows, np.float64)
    half = rows.shape[-1] // 2
    return rows[..., :half], rows[..., half:]


def mrope_rows(half, mrope_section, interleaved=False):
    """Which position (0 temporal, 1 height, 2 width) each rotary half-dim ``i`` of an mRoPE
    rotation takes its angle from, int64 ``(half,)``.

    Sections ``(t, h, w)`` count half-dims and sum to ``half``. Qwen2-VL (``interleaved=False``):
    0 for ``i < t``, 1 for ``t <= i < t + h``, 2 otherwise. Qwen3-VL (``interleaved=True``): 1 when
    ``i % 3 == 1`` and ``i < 3h``, 2 when ``i % 3 == 2`` and ``i < 3w``, 0 otherwise.
    """
    t, h, w = (int(x) for x in mrope_section)
    i = np.arange(half, dtype=np.int64)
    if interleaved:
        rows = np.zeros(half, np.int64)
        rows[(i % 3 == 1) & (i < 3 * h)] = 1
        rows[(i % 3 == 2) & (i < 3 * w)] = 2
        return rows
    return np.where(i < t, 0, np.where(i < t + h, 1, 2)).astype(np.int64)


def _nonempty(table):
    """``table`` (a ``(P, R)`` cos/sin table), or one zero row for a table of no rows: the rows of
    tokens outside the table are gathered (at row 0) and never used, as the kernels skip them."""
    table = np.asarray(table)
    return table if table.shape[0] else np.zeros((1, *table.shape[1:]), table.dtype)


def mrope_cos_sin(table, positions, mrope_section, interleaved=False):
    """float64 ``(n, R/2)`` cos and sin of an mRoPE rotation: half-dim i of token j from table row
    ``positions[mrope_rows(...)[i], j]`` (``positions`` ``(3, n)``, every value a valid row)."""
    half = table.shape[-1] // 2
    rows = np.asarray(positions, np.int64)[mrope_rows(half, mrope_section, interleaved)].T
    cols = np.arange(half)
    cos_sin = np.asarray(table, np.float64)
    return cos_sin[rows, cols], cos_sin[rows, half + cols]


def apply_rope_write_kv(
    q,
    k,
    v,
    kv_cache,
    cos_sin_cache,
    kv_end_lens=None,
    position_ids=None,
    kv_scale=None,
    write_k_in_place=False,
    is_neox=True,
    mrope_section=None,
    mrope_interleaved=False,
    q_out=None,
    q_scale=None,
    q_scale_out=None,
    kv_cache_scales=None,
):
    """Reference of :func:`ropekv.apply_rope_write_kv` on NumPy arrays, written in place.

    With ``mrope_section``, ``position_ids`` is ``(3, B, S)`` and a token is kept when its slot is
    in ``[0, C)`` and all three positions are in ``[0, P)``.

    Without ``q_out``, the kept tokens' q rows are roped in place and the others keep theirs. With
    ``q_out`` (``(B, S, Hq, D)``) every token's row is written there: roped when the token is
    kept, as it came otherwise; in q_out's dtype, an fp8 one divided by ``q_scale`` (default 1)
    or, with ``q_scale_out`` (``(B, S, Hq)``), quantized per row (:func:`quantize_rows`) with the
    row's scale written to ``q_scale_out``. With ``kv_cache_scales`` (``(B, 2, Hkv, C)``) each
    written K and V row is quantized per row and its scale written to the same slot there;
    ``kv_scale`` is then unused. Returns ``q_out``.
    """
    B, S = q.shape[:2]
    mrope = mrope_section is not None
    C = kv_cache.shape[3]
    table = cos_sin_cache if cos_sin_cache.ndim == 3 else cos_sin_cache[None]
    P = table.shape[1]
    fp8 = is_fp8(kv_cache.dtype)
    per_row = kv_cache_scales is not None
    # kv_scale: a number or 0-d array (one scale for K and V), or a pair / (2,) array
    k_scale, v_scale = (
        np.broadcast_to(np.asarray(kv_scale, np.float64).reshape(-1), (2,))
        if fp8 and not per_row
        else (1.0, 1.0)
    )
    q_rows = None if q_out is None else np.array(q, np.float64)  # every token's q_out row
    for b in range(B):
        start = 0 if kv_end_lens is None else int(kv_end_lens[b]) - S
        if start >= C or start + S <= 0:  # every slot outside [0, C) (and int64-safe below)
            continue
        slots = start + np.arange(S, dtype=np.int64)
        if mrope:
            pos3 = np.asarray(position_ids[:, b], np.int64)  # (3, S)
            keep = (slots >= 0) & (slots < C) & np.all((pos3 >= 0) & (pos3 < P), axis=0)
        else:
            pos = slots if position_ids is None else np.asarray(position_ids[b], np.int64)
            keep = (slots >= 0) & (slots < C) & (pos >= 0) & (pos < P)
        if not keep.any():
            continue
        s_idx, slot = np.nonzero(keep)[0], slots[keep]
        rows = table[b if table.shape[0] > 1 else 0]
        if mrope:
            cos, sin = mrope_cos_sin(rows, pos3[:, keep], mrope_section, mrope_interleaved)
        else:
            cos, sin = split_cos_sin(rows[pos[keep]])
        cos, sin = cos[:, None, :], sin[:, None, :]
        q_rot = rope(q[b, s_idx].astype(np.float64), cos, sin, is_neox)
        k_rot = rope(k[b, s_idx].astype(np.float64), cos, sin, is_neox)
        if q_rows is None:
            q[b, s_idx] = to_dtype(q_rot, q.dtype)
        else:
            q_rows[b, s_idx] = q_rot
        if write_k_in_place:
            k[b, s_idx] = to_dtype(k_rot, k.dtype)
        # rows are (n, Hkv, D); the cache holds (Hkv, C, D) per sequence and K/V
        v_val = v[b, s_idx].astype(np.float64)
        for kv, val, scale in ((0, k_rot, k_scale), (1, v_val, v_scale)):
            if per_row:
                stored, row_scales = quantize_rows(val, kv_cache.dtype)
                kv_cache_scales[b, kv][:, slot] = row_scales.T
            else:
                stored = to_dtype(val / scale, kv_cache.dtype)
            kv_cache[b, kv][:, slot] = stored.transpose(1, 0, 2)
    if q_out is not None:
        if q_scale_out is not None:
            stored, q_scale_out[...] = quantize_rows(q_rows, q_out.dtype)
        else:
            divisor = float(1.0 if q_scale is None else q_scale) if is_fp8(q_out.dtype) else 1.0
            stored = to_dtype(q_rows / divisor, q_out.dtype)
        q_out[...] = stored
    return q_out


def heads_view(x, head_size):
    """``x`` ``(T, H * head_size)`` or ``(T, H, head_size)`` as a ``(T, H, head_size)`` view of the
    same memory (its last dimension contiguous)."""
    x = np.asarray(x)
    if x.ndim == 3:
        return x
    T, width = x.shape
    if width % head_size:
        raise ValueError(f"rows of {width} elements are not whole heads of {head_size}")
    # a view whatever the strides (a row's heads split its last dimension); NumPy 2.5 deprecates
    # setting .shape, and reshape may copy
    s0, s1 = x.strides
    return np.lib.stride_tricks.as_strided(
        x, (T, width // head_size, head_size), (s0, head_size * s1, s1)
    )


def apply_rope_with_cos_sin_cache(
    positions, query, key, head_size, cos_sin_cache, is_neox=True, query_out=None, key_out=None
):
    """Reference of :func:`ropekv.apply_rope_with_cos_sin_cache` (``query_out`` / ``key_out``
    given) and of its ``_inplace`` form (both None: ``query`` and ``key`` are written).

    ``query`` / ``key`` are ``(T, H * head_size)`` or ``(T, H, head_size)``; ``cos_sin_cache``
    ``(P, R)``. The first R dims of every head are rotated by the table row of the token's position;
    dims ``[R, head_size)`` pass through. A token whose position falls outside ``[0, P)`` is not
    rotated: in place its rows stay as they came, out of place they are copied unrotated. Returns
    ``(query_out, key_out)`` (``(query, key)`` in place)."""
    in_place = query_out is None
    if in_place:
        query_out, key_out = query, key
    pos = np.asarray(positions).astype(np.int64)
    P = cos_sin_cache.shape[0]
    keep = np.nonzero((pos >= 0) & (pos < P))[0]
    cos, sin = split_cos_sin(np.asarray(cos_sin_cache)[pos[keep]])
    for x, out in ((query, query_out), (key, key_out)):
        x3, out3 = heads_view(x, head_size), heads_view(out, head_size)
        if not in_place:
            out3[...] = x3
        if keep.size:
            out3[keep] = to_dtype(rope(x3[keep], cos[:, None], sin[:, None], is_neox), x.dtype)
    return query_out, key_out


# ---- Ragged batches over a paged cache: MLA RoPE + RMSNorm, and QK-norm + RoPE ---------------


# ``status=`` codes of the ops that take ragged offsets: the first failing check (0: valid)
STATUS_OK, STATUS_FIRST_NOT_ZERO, STATUS_DECREASING, STATUS_LAST_NOT_T = 0, 1, 2, 3


def ragged_offsets_status(input_row_offsets, num_tokens):
    """The ``status`` code of ``input_row_offsets`` (read as 32-bit unsigned, as the kernels do)
    for a batch of ``num_tokens`` tokens: 1 when ``offsets[0] != 0``, else 2 when an offset is
    smaller than the one before it, else 3 when ``offsets[-1] != num_tokens``, else 0. Valid
    offsets are therefore within ``[0, num_tokens]``."""
    offs = np.asarray(input_row_offsets).astype(np.uint32).astype(np.int64)
    if offs[0] != 0:
        return STATUS_FIRST_NOT_ZERO
    if np.any(np.diff(offs) < 0):
        return STATUS_DECREASING
    if offs[-1] != num_tokens:
        return STATUS_LAST_NOT_T
    return STATUS_OK


def ragged_paged_slots(
    input_row_offsets, cache_lengths, block_table, page_size, num_pages, num_tokens
):
    """Where each of ``num_tokens`` tokens of a ragged batch goes, as the kernels compute it.

    Returns int64 arrays ``(request, pos, page, entry)`` of shape ``(T,)``: request -1 for a token
    outside every request (then pos and page are -1 too); page -1 when the position is negative,
    past the block table's row or names a page outside ``[0, num_pages)``. Offsets are compared as
    32-bit unsigned values and the request found by the kernels' binary search (the last b with
    ``offsets[b] <= t``), so malformed offsets give the kernels' answer too.
    """
    offsets = np.asarray(input_row_offsets).astype(np.uint32).astype(np.int64)
    lengths = np.asarray(cache_lengths, np.int64)
    table = np.asarray(block_table)
    B = offsets.shape[0] - 1
    t = np.arange(num_tokens, dtype=np.int64)
    lo, hi = np.zeros_like(t), np.full_like(t, B + 1)
    while (lo < hi).any():
        active = lo < hi
        mid = (lo + hi) // 2
        go = active & (offsets[np.minimum(mid, B)] <= t)
        lo = np.where(go, mid + 1, lo)
        hi = np.where(active & ~go, mid, hi)
    b = lo - 1
    bc = np.clip(b, 0, max(B - 1, 0))
    inside = (b >= 0) & (b < B)
    if B:
        inside &= (offsets[bc] <= t) & (t < offsets[np.minimum(bc + 1, B)])
    request = np.where(inside, b, -1)
    pos = np.where(inside, lengths[bc] + t - offsets[bc] if B else -1, -1)
    index = np.where(pos >= 0, pos // page_size, -1)
    max_pages = table.shape[1] if table.ndim == 2 else 0
    in_table = inside & (index >= 0) & (index < max_pages)
    page = np.full_like(t, -1)
    if in_table.any():
        page[in_table] = table[bc[in_table], index[in_table]]
    page = np.where(in_table & (page >= 0) & (page < num_pages), page, -1)
    entry = np.where(page >= 0, pos - index * page_size, 0)
    return request, pos, page, entry


def rms_norm(x, gamma, epsilon):
    """``x / sqrt(mean(x^2) + epsilon) * gamma`` over the last axis, float64."""
    x = np.asarray(x, np.float64)
    ms = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(ms + epsilon) * np.asarray(gamma, np.float64)


def mla_rope_rmsnorm_append_paged_kv_cache(
    q_rope,
    kv,
    gamma,
    cos_sin_cache,
    input_row_offsets,
    cache_lengths,
    block_table,
    ckv_cache,
    kpe_cache,
    q_rope_out,
    epsilon=1e-6,
    kv_norm_dim=None,
    is_neox=False,
    kv_scale=1.0,
    clear_unused_last_page_rows=False,
):
    """Reference of :func:`ropekv.mla_rope_rmsnorm_append_paged_kv_cache`, written in place.

    ``ckv_cache (num_pages, page_size, L)`` and ``kpe_cache (num_pages, page_size, R)`` are the two
    parts of the cache (views into one ``(num_pages, page_size, L + R)`` array for MAX's layout).
    Tokens with no valid position have their q row copied unrotated and write nothing; tokens with
    a valid position but no valid page are roped and write nothing.
    """
    T = q_rope.shape[0]
    P, R = cos_sin_cache.shape
    L = kv.shape[1] - R
    n = L if kv_norm_dim is None else int(kv_norm_dim)
    num_pages, page_size = ckv_cache.shape[:2]
    request, pos, page, entry = ragged_paged_slots(
        input_row_offsets, cache_lengths, block_table, page_size, num_pages, T
    )
    roped = (request >= 0) & (pos >= 0) & (pos < P)
    write = roped & (page >= 0)
    cos, sin = split_cos_sin(_nonempty(cos_sin_cache)[np.where(roped, pos, 0)])
    q = np.array(q_rope, np.float64)
    q[roped] = rope(q[roped], cos[roped][:, None, :], sin[roped][:, None, :], is_neox)
    q_rope_out[...] = to_dtype(q, q_rope_out.dtype)
    if not write.any():
        return
    scale = float(kv_scale) if is_fp8(ckv_cache.dtype) else 1.0
    x = np.asarray(kv[write], np.float64)
    latent = x[:, :L].copy()
    latent[:, :n] = rms_norm(latent[:, :n], gamma, epsilon)
    pe = rope(x[:, L:], cos[write], sin[write], is_neox)
    ckv_cache[page[write], entry[write]] = to_dtype(latent / scale, ckv_cache.dtype)
    kpe_cache[page[write], entry[write]] = to_dtype(pe / scale, kpe_cache.dtype)
    if clear_unused_last_page_rows:
        clear_last_page_rows((ckv_cache, kpe_cache), input_row_offsets, request, page, entry, write)


def qk_rmsnorm_rope_append_paged_kv_cache(
    q,
    k,
    v,
    q_gamma,
    k_gamma,
    cos_sin_cache,
    input_row_offsets,
    cache_lengths,
    block_table,
    k_cache,
    v_cache,
    q_out,
    epsilon=1e-6,
    is_neox=True,
    kv_layout="NHD",
    k_scale=1.0,
    v_scale=1.0,
    norm_order="before_rope",
    weight_offset=0.0,
    clear_unused_last_page_rows=False,
    position_ids=None,
    mrope_section=None,
    mrope_interleaved=False,
    q_scale=1.0,
    q_scale_out=None,
    k_scales=None,
    v_scales=None,
):
    """Reference of :func:`ropekv.qk_rmsnorm_rope_append_paged_kv_cache`, written in place.

    Caches are ``(num_pages, page_size, Hkv, D)`` (NHD) or ``(num_pages, Hkv, page_size, D)``
    (HND). Tokens with no valid position have their q row copied unchanged and write nothing.
    ``norm_order="after_rope"`` ropes first and normalises the rotated row; the weights are
    ``gamma + weight_offset``. ``clear_unused_last_page_rows``: see :func:`clear_last_page_rows`.
    With ``mrope_section``, ``position_ids`` ``(3, T)`` gives the rotation (:func:`mrope_cos_sin`)
    and a token is roped (and written) when all three are in ``[0, P)``; its cache slot still
    comes from the cache lengths.

    fp8 queries (``q_out`` of an fp8 dtype): every q row (those copied unchanged too) is stored
    as ``fp8(q / q_scale)``, or, with ``q_scale_out`` (float32 ``(T, Hq)``, written), quantized
    with its own computed scale (:func:`quantize_rows`), which lands in ``q_scale_out``.
    Per-token-head KV scales (``k_scales``, ``v_scales``: the caches' shape without D, written):
    each written K and V row is quantized with its computed scale, written to the same slot; the
    static ``k_scale`` / ``v_scale`` are then unused. Cleared tail rows get scale 0.
    """
    T = q.shape[0]
    P = cos_sin_cache.shape[0]
    num_pages = k_cache.shape[0]
    page_size = k_cache.shape[1] if kv_layout == "NHD" else k_cache.shape[2]
    request, pos, page, entry = ragged_paged_slots(
        input_row_offsets, cache_lengths, block_table, page_size, num_pages, T
    )
    if mrope_section is not None:
        pos3 = np.asarray(position_ids, np.int64)
        roped = (request >= 0) & (pos >= 0) & np.all((pos3 >= 0) & (pos3 < P), axis=0)
        cos, sin = mrope_cos_sin(
            _nonempty(cos_sin_cache), np.where(roped, pos3, 0), mrope_section, mrope_interleaved
        )
    else:
        roped = (request >= 0) & (pos >= 0) & (pos < P)
        cos, sin = split_cos_sin(_nonempty(cos_sin_cache)[np.where(roped, pos, 0)])
    write = roped & (page >= 0)
    cos, sin = cos[:, None, :], sin[:, None, :]
    q_w = np.asarray(q_gamma, np.float64) + float(weight_offset)
    k_w = np.asarray(k_gamma, np.float64) + float(weight_offset)

    def norm_rope(x, w, c, s):
        if norm_order == "after_rope":
            return rms_norm(rope(x, c, s, is_neox), w, epsilon)
        return rope(rms_norm(x, w, epsilon), c, s, is_neox)

    qf = np.array(q, np.float64)
    qf[roped] = norm_rope(qf[roped], q_w, cos[roped], sin[roped])
    if q_scale_out is not None:
        q_out[...], q_scale_out[...] = quantize_rows(qf, q_out.dtype)
    else:
        q_out[...] = to_dtype(qf / (float(q_scale) if is_fp8(q_out.dtype) else 1.0), q_out.dtype)
    if not write.any():
        return
    fp8 = is_fp8(k_cache.dtype)
    ks, vs = (float(k_scale), float(v_scale)) if fp8 else (1.0, 1.0)
    kf = norm_rope(np.asarray(k[write], np.float64), k_w, cos[write], sin[write])
    vf = np.asarray(v[write], np.float64)
    pg, en = page[write], entry[write]
    # the slot of each written row: (n, Hkv, D) selections either way
    at = (pg, en) if kv_layout == "NHD" else (pg, slice(None), en)
    if k_scales is not None:
        k_cache[at], k_scales[at] = quantize_rows(kf, k_cache.dtype)
        v_cache[at], v_scales[at] = quantize_rows(vf, v_cache.dtype)
    else:
        k_cache[at] = to_dtype(kf / ks, k_cache.dtype)
        v_cache[at] = to_dtype(vf / vs, v_cache.dtype)
    if clear_unused_last_page_rows:
        entry_axis = 1 if kv_layout == "NHD" else 2
        arrays = (k_cache, v_cache) + (() if k_scales is None else (k_scales, v_scales))
        clear_last_page_rows(arrays, input_row_offsets, request, page, entry, write, entry_axis)


def clear_last_page_rows(caches, input_row_offsets, request, page, entry, written, entry_axis=1):
    """``clear_unused_last_page_rows``: zero, in each cache, the entries after the one the last
    token of each request wrote, to the end of that page (the rows past the request's new
    length). The last token of request b is ``input_row_offsets[b + 1] - 1`` (offsets read as
    32-bit unsigned, as the kernels do); a request whose last token is not written (no token, no
    position, no page) clears nothing. ``entry_axis`` is the caches' page-entry axis (per-token
    scale arrays, the caches' shape without D, are cleared alike)."""
    offsets = np.asarray(input_row_offsets).astype(np.uint32).astype(np.int64)
    t = np.arange(len(request))
    last = written & (request >= 0)
    last[last] = offsets[request[last] + 1] == t[last] + 1
    for tok in np.flatnonzero(last):
        for cache in caches:  # caches, or their scale arrays (the same leading axes)
            index = [slice(None)] * cache.ndim
            index[0], index[entry_axis] = page[tok], slice(entry[tok] + 1, None)
            cache[tuple(index)] = np.zeros((), cache.dtype)


# ---- Fused QKV projection with the K/V rows appended to a paged cache ------------------------


def dequantize_weight(weight, weight_scales=None, group_size=None, zero_points=None):
    """float64 ``(N, K)`` weights of :func:`ropekv.fused_qkv_matmul_append_paged_kv_cache`.

    float16/bfloat16 weights as they are; float8 weights times their per-row ``weight_scales``
    ``(N,)``; uint8 ``(N, K/2)`` 4-bit weights (low nibble = even k, high nibble = odd k) as
    ``(w - zero) * scale`` with ``scale = weight_scales[n, k // group_size]`` and ``zero`` from
    ``zero_points`` (4-bit values, 8 when None).
    """
    w = np.asarray(weight)
    if w.dtype == np.uint8:
        nib = np.empty((w.shape[0], 2 * w.shape[1]), np.float64)
        nib[:, 0::2] = w & 0xF
        nib[:, 1::2] = w >> 4
        zero = 8.0
        if zero_points is not None:
            zero = np.repeat(np.asarray(zero_points, np.float64) % 16, group_size, axis=1)
        scale = np.repeat(np.asarray(weight_scales, np.float64), group_size, axis=1)
        return (nib - zero) * scale
    w = w.astype(np.float64)
    if weight_scales is not None:
        w = w * np.asarray(weight_scales, np.float64)[:, None]
    return w


def fused_qkv_matmul_append_paged_kv_cache(
    hidden_state,
    weight,
    input_row_offsets,
    cache_lengths,
    block_table,
    k_cache,
    v_cache,
    out,
    num_q_heads,
    cos_sin_cache=None,
    is_neox=True,
    kv_layout="NHD",
    k_scale=1.0,
    v_scale=1.0,
    weight_scales=None,
    group_size=None,
    zero_points=None,
    clear_unused_last_page_rows=False,
):
    """Reference of :func:`ropekv.fused_qkv_matmul_append_paged_kv_cache`, written in place.

    ``qkv = hidden_state @ W.T`` in float64 (W dequantized), rows ordered [Q heads | K heads |
    V heads]. A token with a valid position (inside a request, ``p >= 0`` and, with a table,
    ``p < P``) has Q and K roped at p; a token without one has its Q row written unrotated and
    writes nothing; a token with a valid position but no valid page writes nothing.
    ``clear_unused_last_page_rows``: see :func:`clear_last_page_rows`. (``status=`` is checked by
    the caller with :func:`ragged_offsets_status` first: on a nonzero code nothing is called.)
    """
    T = hidden_state.shape[0]
    Hq = int(num_q_heads)
    num_pages, D = k_cache.shape[0], k_cache.shape[3]
    page_size, Hkv = k_cache.shape[1:3] if kv_layout == "NHD" else k_cache.shape[2:0:-1]
    w = dequantize_weight(weight, weight_scales, group_size, zero_points)
    qkv = np.asarray(hidden_state, np.float64) @ w.T
    q = qkv[:, : Hq * D].reshape(T, Hq, D)
    k = qkv[:, Hq * D : (Hq + Hkv) * D].reshape(T, Hkv, D)
    v = qkv[:, (Hq + Hkv) * D :].reshape(T, Hkv, D)
    request, pos, page, entry = ragged_paged_slots(
        input_row_offsets, cache_lengths, block_table, page_size, num_pages, T
    )
    valid = (request >= 0) & (pos >= 0)
    if cos_sin_cache is not None:
        valid &= pos < cos_sin_cache.shape[0]
        cos, sin = split_cos_sin(_nonempty(cos_sin_cache)[np.where(valid, pos, 0)])
        cos, sin = cos[:, None, :], sin[:, None, :]
        q[valid] = rope(q[valid], cos[valid], sin[valid], is_neox)
        k[valid] = rope(k[valid], cos[valid], sin[valid], is_neox)
    out[...] = to_dtype(q.reshape(T, Hq * D), out.dtype)
    write = valid & (page >= 0)
    if not write.any():
        return out
    fp8 = is_fp8(k_cache.dtype)
    ks, vs = (float(k_scale), float(v_scale)) if fp8 else (1.0, 1.0)
    pg, en = page[write], entry[write]
    if kv_layout == "NHD":
        k_cache[pg, en] = to_dtype(k[write] / ks, k_cache.dtype)
        v_cache[pg, en] = to_dtype(v[write] / vs, v_cache.dtype)
    else:  # advanced indices around a slice: the selection is (n, Hkv, D)
        k_cache[pg, :, en] = to_dtype(k[write] / ks, k_cache.dtype)
        v_cache[pg, :, en] = to_dtype(v[write] / vs, v_cache.dtype)
    if clear_unused_last_page_rows:
        clear_last_page_rows(
            (k_cache, v_cache),
            input_row_offsets,
            request,
            page,
            entry,
            write,
            1 if kv_layout == "NHD" else 2,
        )
    return out


# ---- FlashInfer-style paged append: kv_indptr / kv_indices, batch_indices / positions -------


def paged_append_slots(kv_indices, kv_indptr, batch_indices, positions, page_size, num_pages):
    """Where each token of :func:`ropekv.rope_append_paged_kv_cache` goes, as the kernel computes
    it: int64 ``(page, entry)`` of shape ``(T,)``, page -1 for a token that writes no cache row.

    Token i of request ``b = batch_indices[i]`` at ``p = positions[i]`` reads page-table entry
    ``it = kv_indptr[b] + p // page_size`` and lands in page ``kv_indices[it]``, entry
    ``p % page_size``. No row: ``b < 0`` (padding) or ``b >= B``, ``p < 0``, ``kv_indptr[b]``
    outside ``[0, I]`` (I = len(kv_indices)), ``it`` outside ``[kv_indptr[b], min(kv_indptr[b + 1],
    I))``, or a page id outside ``[0, num_pages)``.
    """
    indices = np.asarray(kv_indices).astype(np.int64)
    indptr = np.asarray(kv_indptr).astype(np.int64)
    b = np.asarray(batch_indices).astype(np.int64)
    p = np.asarray(positions).astype(np.int64)
    B, I = indptr.shape[0] - 1, indices.shape[0]
    ok = (b >= 0) & (b < B) & (p >= 0) & (I > 0)
    bc = np.where(ok, b, 0)
    first = indptr[bc] if B > 0 else np.zeros_like(b)
    last = indptr[bc + 1] if B > 0 else np.zeros_like(b)
    ok &= (first >= 0) & (first <= I)
    first = np.where(ok, first, 0)
    hi = np.clip(last, first, I)  # first <= hi <= I: no overflow below
    it = first + np.where(ok, p, 0) // page_size
    ok &= np.where(ok, p, 0) // page_size < hi - first
    page = np.full(b.shape, -1, np.int64)
    page[ok] = indices[it[ok]]
    ok &= (page >= 0) & (page < num_pages)
    page = np.where(ok, page, -1)
    entry = np.where(ok, p % page_size, 0)
    return page, entry


# ``status=`` codes of the FlashInfer-style paged ops' kv_indptr (after the ragged offsets' 1-3)
STATUS_INDPTR_FIRST_NOT_ZERO, STATUS_INDPTR_DECREASING, STATUS_INDPTR_PAST_INDICES = 4, 5, 6


def paged_indptr_status(kv_indptr, num_indices):
    """The ``status`` code of ``kv_indptr`` (values as signed 64-bit integers, as the kernel reads
    them) over ``num_indices`` page-table entries: 4 when ``kv_indptr[0] != 0``, else 5 when an
    entry is smaller than the one before it, else 6 when ``kv_indptr[-1] > num_indices``, else 0
    (then every entry lies in ``[0, num_indices]``)."""
    indptr = np.asarray(kv_indptr).astype(np.int64)
    if indptr[0] != 0:
        return STATUS_INDPTR_FIRST_NOT_ZERO
    if np.any(np.diff(indptr) < 0):
        return STATUS_INDPTR_DECREASING
    if indptr[-1] > num_indices:
        return STATUS_INDPTR_PAST_INDICES
    return STATUS_OK


def _head_scales(scale, heads):
    """A float or a ``(heads,)`` array -> float64 ``(heads, 1)``."""
    return np.broadcast_to(np.asarray(scale, np.float64).reshape(-1, 1), (heads, 1))


def rope_append_paged_kv_cache(
    q_rope,
    k_rope,
    q_nope,
    k_nope,
    v,
    cos_sin_cache,
    pos_ids,
    paged_kv_cache,
    kv_indices,
    kv_indptr,
    batch_indices,
    positions,
    is_neox=True,
    quant_scale_q=1.0,
    quant_scale_kv=1.0,
    page_size=16,
    kv_layout="NHD",
    q_rope_out=None,
    q_nope_out=None,
    mrope_section=None,
    mrope_interleaved=False,
    q_scale_out=None,
    kv_cache_scales=None,
):
    """Reference of :func:`ropekv.rope_append_paged_kv_cache` (and of the fp8 op), in place.

    The q outputs and the cache rows have the cache dtype; with an fp8 cache every value is
    multiplied by its scale (a float, or per head ``(Hq,)`` / ``(Hkv,)``) before rounding, otherwise
    the scales are ignored. A token whose ``pos_ids`` falls outside the table has its q rows
    written unrotated (scaled and quantized like the others) and no cache row; a token without a
    cache slot (:func:`paged_append_slots`) has its q rows written and no cache row. Returns
    ``(q_rope_out, q_nope_out)``, allocated when None. With ``mrope_section``, ``pos_ids`` is
    ``(3, T)`` and a token has a position when all three are in the table.

    ``q_scale_out`` (float32 ``(T, Hq)``, fp8 outputs): each Q head row, its rope and nope dims
    together, is quantized with its computed scale (:func:`quantize_rows`) instead of the static
    one, and the dequantization scale is written there. ``kv_cache_scales`` (``(k_scales,
    v_scales)``, float32, the caches' shape without the last dim; GQA/MHA): every written K row
    (rope and nope together) and V row likewise, its scale written at the row's (page, entry,
    head); the caches may then be int8 too.
    """
    T, Hq, R = q_rope.shape
    mla = k_rope.ndim == 2
    k_rope = k_rope[:, None] if mla else k_rope
    Dn = 0 if q_nope is None else q_nope.shape[-1]
    if q_nope is not None and mla:
        k_nope = k_nope[:, None]
    cache0, cache1 = paged_kv_cache
    out = np.dtype(cache0.dtype)
    if q_rope_out is None:
        q_rope_out = np.empty((T, Hq, R), out)
    if q_nope_out is None:
        q_nope_out = np.empty((T, Hq, Dn), out)
    fp8 = out in MAX_CODE  # quantized: fp8, or int8 (with kv_cache_scales)
    Hkv = k_rope.shape[1]
    qs = _head_scales(quant_scale_q if fp8 else 1.0, Hq)
    ks = _head_scales(quant_scale_kv if fp8 and kv_cache_scales is None else 1.0, Hkv)

    pos = np.asarray(pos_ids).astype(np.int64)
    P = cos_sin_cache.shape[0]
    if mrope_section is not None:
        tok = np.nonzero(np.all((pos >= 0) & (pos < P), axis=0))[0]

        def cos_sin_of(t):
            return mrope_cos_sin(cos_sin_cache, pos[:, t], mrope_section, mrope_interleaved)
    else:
        tok = np.nonzero((pos >= 0) & (pos < P))[0]

        def cos_sin_of(t):
            return split_cos_sin(cos_sin_cache[pos[t]])

    q = np.array(q_rope, np.float64)
    if tok.size:
        cos, sin = cos_sin_of(tok)
        q[tok] = rope(q[tok], cos[:, None, :], sin[:, None, :], is_neox)
    if q_scale_out is not None:
        row = q if not Dn else np.concatenate([q, np.asarray(q_nope, np.float64)], axis=-1)
        stored, scale = quantize_rows(row, out)
        q_rope_out[...], q_nope_out[...] = stored[..., :R], stored[..., R:]
        q_scale_out[...] = scale.astype(np.float32)
    else:
        q_rope_out[...] = to_dtype(q * qs, out)
        if Dn:
            q_nope_out[...] = to_dtype(np.asarray(q_nope, np.float64) * qs, out)
    if tok.size == 0:
        return q_rope_out, q_nope_out

    num_pages = cache0.shape[0]
    page, entry = paged_append_slots(
        kv_indices, kv_indptr, batch_indices, positions, page_size, num_pages
    )
    w = tok[page[tok] >= 0]
    if w.size == 0:
        return q_rope_out, q_nope_out
    pg, en = page[w], entry[w]
    wcos, wsin = cos_sin_of(w)
    k_rot = rope(k_rope[w], wcos[:, None, :], wsin[:, None, :], is_neox) * ks  # (n, Hkv, R)
    k_rest = np.asarray(k_nope[w], np.float64) * ks if Dn else None
    if mla:  # (ckv_cache (pages, ps, Dn), kpe_cache (pages, ps, R))
        cache1[pg, en] = to_dtype(k_rot[:, 0], out)
        if Dn:
            cache0[pg, en] = to_dtype(k_rest[:, 0], out)
        return q_rope_out, q_nope_out
    k_row = k_rot if k_rest is None else np.concatenate([k_rot, k_rest], axis=-1)
    v_row = np.asarray(v[w], np.float64) * ks
    if kv_cache_scales is not None:  # computed per row: ks is 1
        (k_row, k_sc), (v_row, v_sc) = quantize_rows(k_row, out), quantize_rows(v_row, out)
        k_scales, v_scales = kv_cache_scales
        if kv_layout == "NHD":
            k_scales[pg, en], v_scales[pg, en] = k_sc, v_sc
        else:
            k_scales[pg, :, en], v_scales[pg, :, en] = k_sc, v_sc
    else:
        k_row, v_row = to_dtype(k_row, out), to_dtype(v_row, out)
    if kv_layout == "NHD":
        cache0[pg, en] = k_row
        cache1[pg, en] = v_row
    else:  # advanced indices around a slice: the selection is (n, Hkv, D)
        cache0[pg, :, en] = k_row
        cache1[pg, :, en] = v_row
    return q_rope_out, q_nope_out


def rope_quantize_fp8_append_paged_kv_cache(*args, **kwargs):
    """Reference of :func:`ropekv.rope_quantize_fp8_append_paged_kv_cache`: the same as
    :func:`rope_append_paged_kv_cache` on fp8 caches."""
    return rope_append_paged_kv_cache(*args, **kwargs)
