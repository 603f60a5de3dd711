"""``rope_quantize_fp8_append_paged_kv_cache`` (FlashInfer 0.5.3's interface) and
``rope_append_paged_kv_cache``: RoPE on Q and K, optional fp8 quantization, and the append of K/V
into a paged KV cache, in one launch."""

from __future__ import annotations

import functools
import itertools
import sys
import weakref

import numpy as np

from ropekv import _checks as ck
from ropekv import reference
from ropekv._arrays import (
    BFLOAT16,
    FLOAT8_E4M3FN,
    FLOAT8_E5M2,
    FLOAT16,
    FLOAT32,
    FP8_DTYPES,
    HOST,
    INT32,
    INT64,
    as_view,
)
from ropekv._compile import c_bool, c_type, get_kernel, name_expression
from ropekv._launch import ParamStruct, launch, resolve_stream, stream_ptr_of
from ropekv._vector import aligned, vector_width

STEM = "paged"
KERNEL = "rope_append_paged_kv_cache"
INPUT_DTYPES = (FLOAT16, BFLOAT16)
INDEX_DTYPES = (INT32, INT64)
WIDTHS = (8, 4, 2, 1)
LAYOUTS = ("NHD", "HND")

# Launch shape, from benchmarks/bench_paged.py --sweep on the H200. A kernel shape is (unroll,
# rot_unroll, min_blocks_per_sm): pass-through / rotary items each thread loads before it stores,
# and the __launch_bounds__ occupancy hint (template arguments). "light" serves tokens with few
# items per thread (GQA prefill and decode: latency-bound, one item per batch is fastest); "heavy"
# serves threads with at least heavy_from items per token (MLA's 128 query heads: more loads in
# flight), at vector width 8 only (other widths take "light"). max_block: threads per block;
# min_blocks: below this many tokens a token's items are split over several blocks (grid.y), so
# decode fills the GPU.
#
# Heads of at most `row_group` chunks (GQA / MHA head rows) take the row kernel instead: a lane
# group per head row, every row of a thread loaded at once. Few tokens (decode): blocks of
# `row_block` threads (`row_block_many` from `row_block_below` tokens), one row per lane group (or a
# few, keeping the grid within `wave_blocks`), a token's rows split over several blocks. Many
# tokens (prefill): `prefill_rows` rows per lane group, a block per token (at most
# `max_row_block` threads).
TUNING = {"light": (1, 1, 1), "heavy": (2, 2, 4), "heavy_from": 16, "max_block": 128,
          "min_blocks": 1024, "row_group": 32, "row_block": 256, "row_block_below": 256,
          "row_block_many": 128, "wave_blocks": 1320, "prefill_rows": 4, "max_row_block": 256}
MAX_BLOCK = 512  # __launch_bounds__ of the row kernel
ROW_KERNEL = "rope_append_paged_rows"
ROWS = (1, 4)  # row kernels by the head rows one lane group can hold (their register budgets)


def row_launch_shape(T, H, group):
    """(block, rows, splits) of the row kernel for T tokens of H head rows at ``group`` lanes per
    row: grid (T, splits), ``rows`` rows per lane group (the kernel's ROWS: 1 when rows is 1)."""
    width = TUNING["row_block"] if T < TUNING["row_block_below"] else TUNING["row_block_many"]
    slots = max(1, min(width, MAX_BLOCK) // group)
    splits = -(-H // slots)
    if T * splits <= TUNING["wave_blocks"]:
        return slots * group, 1, splits
    for rows in (2, ROWS[-1]):
        splits = -(-H // (slots * rows))
        if T * splits <= TUNING["wave_blocks"]:
            return slots * group, -(-H // (slots * splits)), splits
    slots = min(-(-H // TUNING["prefill_rows"]),
                max(1, min(TUNING["max_row_block"], MAX_BLOCK) // group))
    rows = min(ROWS[-1], -(-H // slots))
    return slots * group, rows, -(-H // (slots * rows))


def launch_shape(items, T, n):
    """(block, splits, kernel shape) for T tokens of ``items`` items each at vector width n."""
    block = min(TUNING["max_block"], -(-items // 32) * 32)
    splits = 1
    if T < TUNING["min_blocks"]:
        splits = max(1, min(-(-items // block), -(-TUNING["min_blocks"] // T)))
    heavy = n == 8 and items >= TUNING["heavy_from"] * block * splits
    return block, splits, TUNING["heavy" if heavy else "light"]


PARAMS = ParamStruct("PagedParams", [
    *((n, np.uint64) for n in (
        "q_rope", "q_nope", "k_rope", "k_nope", "v", "q_rope_out", "q_nope_out", "kr_cache",
        "kn_cache", "v_cache", "cos_sin", "pos_ids", "batch_indices", "positions", "kv_indptr",
        "kv_indices", "q_scales", "kv_scales")),
    *((n, np.int64) for n in (
        "qr_sn", "qr_sh", "qn_sn", "qn_sh", "kr_sn", "kr_sh", "kn_sn", "kn_sh", "v_sn", "v_sh",
        "qro_sn", "qro_sh", "qno_sn", "qno_sh", "krc_sp", "krc_se", "krc_sh", "knc_sp", "knc_se",
        "knc_sh", "vc_sp", "vc_se", "vc_sh", "cs_sp", "num_pages", "num_indices")),
    ("q_scale", np.float32), ("kv_scale", np.float32),
    *((n, np.int32) for n in ("Hq", "Hkv", "Hv", "R", "Dn", "B", "page_size", "P", "index64",
                              "group", "rows")),
])

_DTYPE_NAMES = {
    "float8_e4m3fn": FLOAT8_E4M3FN, "float8_e5m2": FLOAT8_E5M2, "float16": FLOAT16,
    "half": FLOAT16, "bfloat16": BFLOAT16,
}
_TORCH_NAMES = {FLOAT16: "float16", BFLOAT16: "bfloat16", FLOAT8_E4M3FN: "float8_e4m3fn",
                FLOAT8_E5M2: "float8_e5m2"}


@functools.cache
def expression(dtype, out_dtype, is_neox, n, shape):
    """The section kernel of ``shape`` (unroll, rot_unroll, min blocks), or the row kernel when
    ``shape`` is ``("rows", ROWS)``."""
    if shape[0] == "rows":
        return name_expression(ROW_KERNEL, c_type(dtype), c_type(out_dtype), c_bool(is_neox), n,
                               shape[1])
    return name_expression(KERNEL, c_type(dtype), c_type(out_dtype), c_bool(is_neox), n, *shape)


def instantiations():
    """Every kernel instantiation a call can select (the compile tests build them all)."""
    for dtype, is_neox, n in itertools.product(INPUT_DTYPES, (True, False), WIDTHS):
        if not is_neox and n == 1:
            continue
        shapes = (TUNING["light"], TUNING["heavy"]) if n == 8 else (TUNING["light"],)
        shapes = (*dict.fromkeys(shapes), *(("rows", r) for r in ROWS))
        for out_dtype, shape in itertools.product((dtype, *FP8_DTYPES), shapes):
            yield expression(dtype, out_dtype, is_neox, n, shape)


def rope_quantize_fp8_append_paged_kv_cache(
        q_rope, k_rope, q_nope, k_nope, v, cos_sin_cache, pos_ids, paged_kv_cache, kv_indices,
        kv_indptr, batch_indices, positions, is_neox=True, quantize_dtype=None, quant_scale_q=1.0,
        quant_scale_kv=1.0, page_size=16, kv_layout="NHD", q_rope_out=None, q_nope_out=None,
        enable_pdl=False, *, stream=None):
    """Apply RoPE to Q and K, quantize Q, K and V to fp8, and append K/V to a paged KV cache, in
    one launch.

    A drop-in for FlashInfer 0.5.3's ``flashinfer.rope.rope_quantize_fp8_append_paged_kv_cache``
    (same argument names, order, defaults and results) that needs no PyTorch, plus per-head
    scales, padding tokens and bounds-checked indices.

    Parameters
    ----------
    q_rope : array, (nnz, Hq, R), float16 or bfloat16
        Query rotary dims.
    k_rope : array, (nnz, Hkv, R) for GQA/MHA or (nnz, R) for MLA, the dtype of ``q_rope``
        Key rotary dims. Its rank selects the architecture.
    q_nope : array, (nnz, Hq, Dn), or None
        Query non-rotary dims; None (with ``k_nope`` None) when every dim is rotary.
    k_nope : array, (nnz, Hkv, Dn) (GQA/MHA) or (nnz, Dn) (MLA), or None
        Key non-rotary dims: the ``[R, R + Dn)`` part of each K cache row (GQA/MHA) or the
        ``ckv_cache`` row (MLA).
    v : array, (nnz, Hkv, R + Dn), or None
        Values (GQA/MHA); must be None for MLA.
    cos_sin_cache : array, (P, R), float32
        ``[:R/2]`` cos, ``[R/2:]`` sin per position (see :func:`ropekv.cos_sin_cache`).
    pos_ids : array, (nnz,), int32 or int64
        RoPE position of each token.
    paged_kv_cache : (k_cache, v_cache) or (ckv_cache, kpe_cache), written in place
        GQA/MHA: each ``(num_pages, page_size, Hkv, R + Dn)`` for ``kv_layout="NHD"`` or
        ``(num_pages, Hkv, page_size, R + Dn)`` for ``"HND"``. MLA: ``ckv_cache (num_pages,
        page_size, Dn)`` and ``kpe_cache (num_pages, page_size, R)``. float8_e4m3fn or
        float8_e5m2, the quantize dtype. Only the addressed rows change.
    kv_indices : array, (I,), int32 or int64
        Page ids of every request's pages, concatenated.
    kv_indptr : array, (B + 1,), int32 or int64
        Request b owns ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]``.
    batch_indices, positions : arrays, (nnz,), int32 or int64
        Request and position in it of each token (``flashinfer.get_batch_indices_positions``).
        Token i lands in page ``kv_indices[kv_indptr[b] + positions[i] // page_size]``, entry
        ``positions[i] % page_size``, with ``b = batch_indices[i]``; ``b < 0`` marks padding: the
        token's q outputs are written, no cache row.
    is_neox : bool
        True rotates half-split pairs (i, i + R/2); False interleaved pairs (2i, 2i + 1).
    quantize_dtype : dtype, optional
        float8_e4m3fn or float8_e5m2, as a NumPy/ml_dtypes dtype, a string or a torch dtype. By
        default that of ``q_rope_out``, else ``q_nope_out``, else the cache, else float8_e4m3fn.
    quant_scale_q, quant_scale_kv : float, or float32 array (Hq,) / (Hkv,)
        Quantization multiplies: stored = fp8(x * scale), round to nearest even, saturating to
        the largest finite value. Arrays give one scale per head.
    page_size : int
        Entries per page; must match the cache shape.
    kv_layout : {"NHD", "HND"}
        GQA/MHA cache layout; ignored for MLA.
    q_rope_out, q_nope_out : arrays, (nnz, Hq, R) / (nnz, Hq, Dn), the quantize dtype, optional
        Written in place and returned when given; otherwise allocated in the array type of
        ``q_rope`` (CuPy, torch or NumPy).
    enable_pdl : bool
        Accepted for compatibility; ropekv launches without programmatic dependent launch.
    stream : CuPy stream, int ``cudaStream_t`` or object with ``cuda_stream``, optional
        Stream to launch on; by default torch's current stream for torch inputs, else the current
        CuPy stream.

    Returns
    -------
    (q_rope_out, q_nope_out)
        The quantized queries; ``q_nope_out`` has shape (nnz, Hq, 0) when ``q_nope`` is None.

    Notes
    -----
    A token whose ``pos_ids`` entry falls outside ``[0, P)`` has its q outputs written unrotated
    (quantized with the q scale) and no cache row. A token whose cache slot is invalid --
    ``batch_indices`` outside ``[0, B)``, a negative position, ``kv_indptr[b]`` outside ``[0, I]``
    (I = len(kv_indices)), a page-table index outside ``[kv_indptr[b], min(kv_indptr[b + 1],
    I))``, a page id outside ``[0, num_pages)`` -- writes its q outputs but no cache row.
    Nothing is ever read or written out of bounds. With ``ROPEKV_CHECK_INDICES=1`` such tokens
    (padding aside) raise ``IndexError`` instead, checked on the host before the launch.

    NumPy inputs run the NumPy reference on the host, with the same in-place writes.

    Examples
    --------
    >>> import cupy as cp, ml_dtypes, ropekv
    >>> T, Hq, Hkv, D, page_size, num_pages = 4, 32, 8, 128, 16, 8
    >>> q = cp.random.randn(T, Hq, D).astype(cp.float16)
    >>> k, v = (cp.random.randn(T, Hkv, D).astype(cp.float16) for _ in range(2))
    >>> cache = [cp.zeros((num_pages, page_size, Hkv, D), cp.uint8).view(ml_dtypes.float8_e4m3fn)
    ...          for _ in range(2)]
    >>> table = ropekv.cos_sin_cache(1024, D, xp=cp)
    >>> pos = cp.arange(T, dtype=cp.int32)
    >>> q8, _ = ropekv.rope_quantize_fp8_append_paged_kv_cache(
    ...     q, k, None, None, v, table, pos, cache, cp.arange(num_pages, dtype=cp.int32),
    ...     cp.array([0, 1], cp.int32), cp.zeros(T, cp.int32), pos)
    """
    return _run(q_rope, k_rope, q_nope, k_nope, v, cos_sin_cache, pos_ids, paged_kv_cache,
                kv_indices, kv_indptr, batch_indices, positions, is_neox, quantize_dtype,
                quant_scale_q, quant_scale_kv, page_size, kv_layout, q_rope_out, q_nope_out,
                stream, quantize=True)


def rope_append_paged_kv_cache(
        q_rope, k_rope, q_nope, k_nope, v, cos_sin_cache, pos_ids, paged_kv_cache, kv_indices,
        kv_indptr, batch_indices, positions, is_neox=True, quantize_dtype=None, quant_scale_q=1.0,
        quant_scale_kv=1.0, page_size=16, kv_layout="NHD", q_rope_out=None, q_nope_out=None,
        enable_pdl=False, *, stream=None):
    """Apply RoPE to Q and K and append K/V to a paged KV cache, in one launch, without
    quantization when the cache has the input dtype.

    The same arguments and semantics as :func:`rope_quantize_fp8_append_paged_kv_cache`, except
    that the cache may also be float16/bfloat16 (the dtype of ``q_rope``): then the q outputs and
    cache rows are the roped values rounded to that dtype and the scales are ignored. fp8 caches
    behave exactly as in :func:`rope_quantize_fp8_append_paged_kv_cache`. ``quantize_dtype``, when
    given, must be the cache dtype.

    Examples
    --------
    >>> import cupy as cp, ropekv
    >>> T, Hq, Hkv, D, page_size, num_pages = 4, 32, 8, 128, 16, 8
    >>> q = cp.random.randn(T, Hq, D).astype(cp.float16)
    >>> k, v = (cp.random.randn(T, Hkv, D).astype(cp.float16) for _ in range(2))
    >>> cache = [cp.zeros((num_pages, Hkv, page_size, D), cp.float16) for _ in range(2)]
    >>> table = ropekv.cos_sin_cache(1024, D, xp=cp)
    >>> pos = cp.arange(T, dtype=cp.int32)
    >>> q_roped, _ = ropekv.rope_append_paged_kv_cache(
    ...     q, k, None, None, v, table, pos, cache, cp.arange(num_pages, dtype=cp.int32),
    ...     cp.array([0, 1], cp.int32), cp.zeros(T, cp.int32), pos, kv_layout="HND")
    """
    return _run(q_rope, k_rope, q_nope, k_nope, v, cos_sin_cache, pos_ids, paged_kv_cache,
                kv_indices, kv_indptr, batch_indices, positions, is_neox, quantize_dtype,
                quant_scale_q, quant_scale_kv, page_size, kv_layout, q_rope_out, q_nope_out,
                stream, quantize=False)


def as_dtype(value, name="quantize_dtype"):
    """A NumPy dtype from a NumPy/ml_dtypes dtype, a string (``"float8_e4m3fn"``,
    ``"torch.float8_e4m3fn"``) or a torch dtype (matched by name; torch is never imported)."""
    if value is None:
        return None
    if isinstance(value, str) or type(value).__module__ == "torch":
        key = str(value).removeprefix("torch.")
        if key in _DTYPE_NAMES:
            return _DTYPE_NAMES[key]
        raise TypeError(f"{name} must be float8_e4m3fn or float8_e5m2 (a dtype, its name or a "
                        f"torch dtype), got {value!r}")
    try:
        return np.dtype(value)
    except TypeError:
        raise TypeError(f"{name} must be float8_e4m3fn or float8_e5m2 (a dtype, its name or a "
                        f"torch dtype), got {value!r}") from None


def _is_torch(obj):
    return type(obj).__module__.startswith("torch")


def _allocate(like, shape, dtype, device):
    """An empty array of ``like``'s kind (torch, CuPy or NumPy) on ``device``."""
    if _is_torch(like):
        return like.new_empty(shape, dtype=getattr(sys.modules["torch"], _TORCH_NAMES[dtype]))
    if device == HOST:
        return np.empty(shape, dtype)
    import cupy

    if cupy.cuda.runtime.getDevice() != device:
        with cupy.cuda.Device(device):
            return _allocate(like, shape, dtype, device)
    if dtype.itemsize == 1:
        return cupy.empty(shape, cupy.uint8).view(dtype)
    return cupy.empty(shape, dtype)


def _scale(value, name, heads, views_out):
    """A scale argument: a number -> (float, None); an array -> (1.0, view of shape (heads,))."""
    if isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool):
        return float(value), None
    view = as_view(value, name)
    ck.check_dtype(view, (FLOAT32,))
    ck.check_shape(view, (heads,), "(Hq,)" if name == "quant_scale_q" else "(Hkv,)")
    ck.check_contiguous(view)
    views_out.append(view)
    return 1.0, view


def _run(q_rope, k_rope, q_nope, k_nope, v, cos_sin_cache, pos_ids, paged_kv_cache, kv_indices,
         kv_indptr, batch_indices, positions, is_neox, quantize_dtype, quant_scale_q,
         quant_scale_kv, page_size, kv_layout, q_rope_out, q_nope_out, stream, quantize):
    torch_stream = stream is None and _is_torch(q_rope) and q_rope.is_cuda
    if torch_stream:
        stream = sys.modules["torch"].cuda.current_stream(q_rope.device).cuda_stream
    key = None
    if not ck.check_indices_enabled() and (torch_stream or not _is_torch(q_rope)):
        try:  # the fast path: the same objects and scalars as an earlier validated call
            key = (quantize, is_neox, quantize_dtype, page_size, kv_layout, stream, id(q_rope),
                   id(k_rope), id(q_nope), id(k_nope), id(v), id(cos_sin_cache), id(pos_ids),
                   id(paged_kv_cache[0]), id(paged_kv_cache[1]), id(kv_indices), id(kv_indptr),
                   id(batch_indices), id(positions), id(q_rope_out), id(q_nope_out),
                   quant_scale_q if type(quant_scale_q) in _NUMBERS else id(quant_scale_q),
                   quant_scale_kv if type(quant_scale_kv) in _NUMBERS else id(quant_scale_kv),
                   *TUNING.values())
            plan = _PLANS.get(key)
        except (TypeError, IndexError, KeyError):  # unhashable or malformed: the slow path says
            key = plan = None
        if plan is not None:
            return plan[0](q_rope, q_rope_out, q_nope_out)
    if not isinstance(paged_kv_cache, tuple | list) or len(paged_kv_cache) != 2:
        raise ValueError(f"paged_kv_cache must be a pair (k_cache, v_cache) or (ckv_cache, "
                         f"kpe_cache), got {type(paged_kv_cache).__qualname__}"
                         + (f" of length {len(paged_kv_cache)}"
                            if isinstance(paged_kv_cache, tuple | list) else ""))
    mla = getattr(k_rope, "ndim", None) == 2
    names = ("ckv_cache", "kpe_cache") if mla else ("k_cache", "v_cache")
    a = ck.views(stream_ptr_of(stream), q_rope=q_rope, k_rope=k_rope, q_nope=q_nope,
                 k_nope=k_nope, v=v, cos_sin_cache=cos_sin_cache, pos_ids=pos_ids,
                 kv_indices=kv_indices, kv_indptr=kv_indptr, batch_indices=batch_indices,
                 positions=positions, q_rope_out=q_rope_out, q_nope_out=q_nope_out,
                 **{names[0]: paged_kv_cache[0], names[1]: paged_kv_cache[1]})
    vqr, vkr, vqn, vkn, vv = (a[n] for n in ("q_rope", "k_rope", "q_nope", "k_nope", "v"))
    vt, vpos, vind, vptr = (a[n] for n in ("cos_sin_cache", "pos_ids", "kv_indices", "kv_indptr"))
    vbat, vposn, vqro, vqno = (a[n] for n in ("batch_indices", "positions", "q_rope_out",
                                              "q_nope_out"))
    vc0, vc1 = a[names[0]], a[names[1]]

    # -- inputs
    ck.check_ndim(vqr, 3, "(nnz, Hq, R)")
    ck.check_dtype(vqr, INPUT_DTYPES)
    T, Hq, R = vqr.shape
    if R == 0 or R % 2:
        raise ValueError(f"q_rope's rotary dim R (its last dim) must be even and positive, got "
                         f"{R}")
    ck.check_ndim(vkr, (2, 3), "(nnz, Hkv, R) (GQA/MHA) or (nnz, R) (MLA)")
    if mla:
        ck.check_shape(vkr, (T, R), "(nnz, R)")
        Hkv = 1
    else:
        ck.check_shape(vkr, (T, None, R), "(nnz, Hkv, R)")
        Hkv = vkr.shape[1]
    if (vqn is None) != (vkn is None):
        raise ValueError(f"q_nope and k_nope must both be arrays or both be None, got q_nope "
                         f"{'None' if vqn is None else vqn.shape}, k_nope "
                         f"{'None' if vkn is None else vkn.shape}")
    Dn = 0
    if vqn is not None:
        ck.check_ndim(vqn, 3, "(nnz, Hq, no_rope_dim)")
        Dn = vqn.shape[2]
        ck.check_shape(vqn, (T, Hq, Dn), "(nnz, Hq, no_rope_dim)")
        if mla:
            ck.check_shape(vkn, (T, Dn), "(nnz, no_rope_dim)")
        else:
            ck.check_shape(vkn, (T, Hkv, Dn), "(nnz, Hkv, no_rope_dim)")
    D = R + Dn
    if mla and vv is not None:
        raise ValueError(f"v must be None for MLA (2-D k_rope), got an array of shape {vv.shape}")
    if not mla:
        if vv is None:
            raise ValueError("v is required for GQA/MHA (3-D k_rope): an array of shape (nnz, "
                             f"Hkv, head_dim) = ({T}, {Hkv}, {D}), got None")
        ck.check_shape(vv, (T, Hkv, D), "(nnz, Hkv, head_dim)")
    inputs = [x for x in (vqr, vkr, vqn, vkn, vv) if x is not None]
    for view in inputs[1:]:
        ck.check_same_dtype(view, vqr)
    ck.check_ndim(vt, 2, "(P, R)")
    ck.check_dtype(vt, (FLOAT32,))
    ck.check_shape(vt, (None, R), "(P, R)")
    P = vt.shape[0]
    for view in (vpos, vbat, vposn):
        ck.check_shape(view, (T,), "(nnz,)")
    for view in (vind, vptr):
        ck.check_ndim(view, 1, "(total_pages,)" if view is vind else "(batch_size + 1,)")
    if vptr.shape[0] < 1:
        raise ValueError(f"kv_indptr must have shape (batch_size + 1,), at least one entry, got "
                         f"{vptr.shape}")
    indices = (vpos, vbat, vposn, vptr, vind)
    for view in indices:
        ck.check_dtype(view, INDEX_DTYPES)
        if view.size > 1:  # an empty array may report any stride
            ck.check_contiguous(view)

    # -- cache and output dtype
    page_size = ck.check_positive_int(page_size, "page_size")
    kv_layout = ck.check_choice(kv_layout, "kv_layout", LAYOUTS)
    if vc0.dtype != vc1.dtype:
        raise TypeError(f"{vc1.name} must have the dtype of {vc0.name} ({vc0.dtype}), got "
                        f"{vc1.dtype}")
    allowed = FP8_DTYPES if quantize else (vqr.dtype, *FP8_DTYPES)
    spelled = " or ".join(map(str, allowed))
    out_dtype = as_dtype(quantize_dtype)
    if out_dtype is None:  # FlashInfer's order: q_rope_out, q_nope_out, then (ropekv) the cache
        given = next(x for x in (vqro, vqno, vc0) if x is not None)
        out_dtype = given.dtype
        if out_dtype not in allowed:
            hint = (" (rope_append_paged_kv_cache writes float16/bfloat16 caches)" if quantize
                    else f" (float16/bfloat16 only as the input dtype {vqr.dtype})")
            raise TypeError(f"{given.name} must have dtype {spelled}, got {out_dtype}{hint}")
    elif out_dtype not in allowed:
        raise TypeError(f"quantize_dtype must be {spelled}, got {out_dtype}")
    for view in (vc0, vc1):
        if view.dtype != out_dtype:
            raise TypeError(f"{view.name} must have the quantize dtype {out_dtype}, got "
                            f"{view.dtype}")

    # -- cache shapes: strides (page, entry, head) of the K-rope, K-nope and V destinations
    if mla:
        ck.check_ndim(vc0, 3, "(num_pages, page_size, no_rope_dim)")
        num_pages = vc0.shape[0]
        ck.check_shape(vc0, (num_pages, page_size, Dn), "(num_pages, page_size, no_rope_dim)")
        ck.check_shape(vc1, (num_pages, page_size, R), "(num_pages, page_size, rope_dim)")
        kr = (vc1, 0, (vc1.strides[0], vc1.strides[1], 0))
        kn = (vc0, 0, (vc0.strides[0], vc0.strides[1], 0))
        vd = (None, 0, (0, 0, 0))
    else:
        spelled = ("(num_pages, page_size, Hkv, head_dim)" if kv_layout == "NHD"
                   else "(num_pages, Hkv, page_size, head_dim)")
        ck.check_ndim(vc0, 4, spelled)
        num_pages = vc0.shape[0]
        shape = (num_pages, page_size, Hkv, D) if kv_layout == "NHD" else (num_pages, Hkv,
                                                                            page_size, D)
        ck.check_shape(vc0, shape, f"{spelled} for {kv_layout}")
        ck.check_shape(vc1, shape, f"{spelled} for {kv_layout}")
        k_st, v_st = vc0.strides, vc1.strides
        k_st = (k_st[0], k_st[1], k_st[2]) if kv_layout == "NHD" else (k_st[0], k_st[2], k_st[1])
        v_st = (v_st[0], v_st[1], v_st[2]) if kv_layout == "NHD" else (v_st[0], v_st[2], v_st[1])
        kr, kn, vd = (vc0, 0, k_st), (vc0, R, k_st), (vc1, 0, v_st)

    # -- scales and outputs
    scale_views = []
    q_scale, vqs = _scale(quant_scale_q, "quant_scale_q", Hq, scale_views)
    kv_scale, vks = _scale(quant_scale_kv, "quant_scale_kv", Hkv, scale_views)
    outs = [x for x in (vqro, vqno) if x is not None]
    if vqro is not None:
        ck.check_shape(vqro, (T, Hq, R), "(nnz, Hq, R)")
    if vqno is not None:
        ck.check_shape(vqno, (T, Hq, Dn), "(nnz, Hq, no_rope_dim)")
    for view in outs:
        if view.dtype != out_dtype:
            raise TypeError(f"{view.name} must have the quantize dtype {out_dtype}, got "
                            f"{view.dtype}")
    for view in (*inputs, vt, vc0, vc1, *outs):
        ck.check_last_dim_contiguous(view)
    for view in (vc0, vc1, *outs):
        ck.check_writable(view)
    device = ck.check_same_device([*inputs, vt, *indices, vc0, vc1, *outs, *scale_views])

    if ck.check_indices_enabled():
        _check_indices(vpos, vbat, vposn, vptr, vind, P, page_size, num_pages)

    given = (q_rope_out is not None, q_nope_out is not None)
    if q_rope_out is None:
        q_rope_out = _allocate(q_rope, (T, Hq, R), out_dtype, device)
        vqro = as_view(q_rope_out, "q_rope_out", stream_ptr_of(stream))
    if q_nope_out is None:
        q_nope_out = _allocate(q_rope, (T, Hq, Dn), out_dtype, device)
        vqno = as_view(q_nope_out, "q_nope_out", stream_ptr_of(stream))
    if T == 0:
        return q_rope_out, q_nope_out

    if device == HOST:
        def host(view):
            return None if view is None else view.host

        reference.rope_append_paged_kv_cache(
            vqr.host, vkr.host, host(vqn), host(vkn), host(vv), vt.host, vpos.host,
            (vc0.host, vc1.host), vind.host, vptr.host, vbat.host, vposn.host, bool(is_neox),
            q_scale if vqs is None else vqs.host, kv_scale if vks is None else vks.host,
            page_size, kv_layout, vqro.host, vqno.host)
        return q_rope_out, q_nope_out

    is_neox = bool(is_neox)
    data = [*inputs, vc0, vc1, vqro] + ([vqno] if Dn else [])

    def fits(n):
        rot = (R // 2) % n == 0 if is_neox else (R % n == 0 and n % 2 == 0)
        return (rot and Dn % n == 0 and all(aligned(x, n) for x in data)
                and aligned(vt, n if is_neox else n // 2))

    n = vector_width(vqr.dtype.itemsize, fits)
    if n is None:  # only interleaved RoPE with misaligned pointers can get here (R is even)
        raise ValueError("interleaved RoPE needs every row start aligned to a pair of elements")
    ri = R // (2 * n) if is_neox else R // n
    items = (Hq + Hkv) * (ri + Dn // n) + (0 if mla else Hkv * D // n)
    group = ri + Dn // n  # chunks of a head row
    if group <= TUNING["row_group"]:
        block, rows, splits = row_launch_shape(T, Hq + Hkv + (0 if mla else Hkv), group)
        shape = ("rows", 1 if rows == 1 else ROWS[-1])
    else:
        (block, splits, shape), rows = launch_shape(items, T, n), 0
    itemsize = out_dtype.itemsize
    index64 = sum(1 << i for i, view in enumerate(indices) if view.dtype == INT64)
    zero2 = (0, 0)
    qn_st = vqn.strides[:2] if vqn is not None else zero2
    kn_in = (vkn.strides[0], 0 if mla else vkn.strides[1]) if vkn is not None else zero2
    params = PARAMS.pack(
        q_rope=vqr.ptr, q_nope=0 if vqn is None else vqn.ptr, k_rope=vkr.ptr,
        k_nope=0 if vkn is None else vkn.ptr, v=0 if vv is None else vv.ptr,
        q_rope_out=vqro.ptr, q_nope_out=vqno.ptr,
        kr_cache=kr[0].ptr + kr[1] * itemsize, kn_cache=kn[0].ptr + kn[1] * itemsize,
        v_cache=0 if vd[0] is None else vd[0].ptr, cos_sin=vt.ptr, pos_ids=vpos.ptr,
        batch_indices=vbat.ptr, positions=vposn.ptr, kv_indptr=vptr.ptr, kv_indices=vind.ptr,
        q_scales=0 if vqs is None else vqs.ptr, kv_scales=0 if vks is None else vks.ptr,
        qr_sn=vqr.strides[0], qr_sh=vqr.strides[1], qn_sn=qn_st[0], qn_sh=qn_st[1],
        kr_sn=vkr.strides[0], kr_sh=0 if mla else vkr.strides[1], kn_sn=kn_in[0],
        kn_sh=kn_in[1], v_sn=0 if vv is None else vv.strides[0],
        v_sh=0 if vv is None else vv.strides[1], qro_sn=vqro.strides[0], qro_sh=vqro.strides[1],
        qno_sn=vqno.strides[0], qno_sh=vqno.strides[1], krc_sp=kr[2][0], krc_se=kr[2][1],
        krc_sh=kr[2][2], knc_sp=kn[2][0], knc_se=kn[2][1], knc_sh=kn[2][2], vc_sp=vd[2][0],
        vc_se=vd[2][1], vc_sh=vd[2][2], cs_sp=vt.strides[0], num_pages=num_pages,
        num_indices=vind.shape[0], q_scale=q_scale, kv_scale=kv_scale, Hq=Hq, Hkv=Hkv,
        Hv=0 if mla else Hkv, R=R, Dn=Dn, B=vptr.shape[0] - 1, page_size=page_size, P=P,
        index64=index64, group=group, rows=rows)
    expr = expression(vqr.dtype, out_dtype, is_neox, n, shape)
    launch(STEM, expr, device, (T, splits), (block,), (params,), stream)
    if key is not None:
        arrays = (q_rope, k_rope, q_nope, k_nope, v, cos_sin_cache, pos_ids, *paged_kv_cache,
                  kv_indices, kv_indptr, batch_indices, positions, q_rope_out if given[0] else None,
                  q_nope_out if given[1] else None, quant_scale_q, quant_scale_kv, stream)
        _remember(key, arrays, _Plan(
            get_kernel(STEM, expr, device), (T, splits), (block,), params, device,
            None if stream is None or torch_stream else resolve_stream(stream, device),
            out_dtype, ((T, Hq, R), (T, Hq, Dn)), given))
    return q_rope_out, q_nope_out


# ---- The eager fast path: a call whose arrays (the same objects) and scalars repeat those of an
# earlier, validated call reuses its launch. Arrays are identified by id() while alive: a weak
# reference to each drops the plan when any of them is collected, so an id is never reused while
# its plan exists. Only what the validation read is cached (pointers, shapes, strides, dtypes, all
# fixed for an array object); index values are read by the kernel on every call.

_PLANS = {}
_MAX_PLANS = 64
_SCALARS = (int, float, np.number)
_NUMBERS = (int, float)
_POINTERS = {name: PARAMS.dtype.fields[name][1] // 8 for name in ("q_rope_out", "q_nope_out")}


class _Plan:
    """One validated launch: the kernel, its shape and its parameter record, launched through the
    driver (one call, no per-call argument marshalling); new q outputs are allocated and their
    pointers patched into the record on each call."""

    __slots__ = ("__weakref__", "args", "args_ptr", "block", "device", "func", "given", "grid",
                 "kernel", "out_dtype", "record", "shapes", "stream", "words")

    def __init__(self, kernel, grid, block, params, device, stream, out_dtype, shapes, given):
        import cupy

        self.kernel, self.grid, self.block = kernel, grid, block
        self.record = np.array([params], PARAMS.dtype)
        self.words = self.record.view(np.uint64)  # pointer fields, patched for new outputs
        self.args = np.array([self.record.ctypes.data], np.uint64)  # void* kernelParams[1]
        self.args_ptr = int(self.args.ctypes.data)
        with cupy.cuda.Device(device):
            self.func = kernel.kernel.ptr
        self.device, self.stream, self.out_dtype = device, stream, out_dtype
        self.shapes, self.given = shapes, given

    def __call__(self, q_rope, q_rope_out, q_nope_out):
        # Not thread-safe for one plan: new output pointers are patched into its record.
        import cupy
        from cupy_backends.cuda.api import driver

        previous = cupy.cuda.runtime.getDevice()
        if previous != self.device:
            cupy.cuda.runtime.setDevice(self.device)
        try:
            if not self.given[0]:
                q_rope_out = _allocate(q_rope, self.shapes[0], self.out_dtype, self.device)
                self.words[_POINTERS["q_rope_out"]] = _pointer(q_rope_out)
            if not self.given[1]:
                q_nope_out = _allocate(q_rope, self.shapes[1], self.out_dtype, self.device)
                self.words[_POINTERS["q_nope_out"]] = _pointer(q_nope_out)
            if self.stream is not None:
                stream = self.stream.ptr
            elif _is_torch(q_rope):
                stream = sys.modules["torch"].cuda.current_stream(q_rope.device).cuda_stream
            else:
                stream = cupy.cuda.get_current_stream().ptr
            (gx, gy), (bx,) = self.grid, self.block
            driver.launchKernel(self.func, gx, gy, 1, bx, 1, 1, 0, stream, self.args_ptr, 0)
        finally:
            if previous != self.device:
                cupy.cuda.runtime.setDevice(previous)
        return q_rope_out, q_nope_out


def _pointer(x):
    return x.data_ptr() if _is_torch(x) else x.data.ptr


def _remember(key, objects, plan):
    """Cache ``plan`` under ``key`` while every object of ``objects`` lives."""
    def forget(_, key=key):
        _PLANS.pop(key, None)

    try:
        plan_refs = [weakref.ref(x, forget) for x in objects
                     if x is not None and not isinstance(x, _SCALARS)]
    except TypeError:  # an object without weak references: no plan
        return
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.pop(next(iter(_PLANS)))
    _PLANS[key] = (plan, plan_refs)


def _check_indices(vpos, vbat, vposn, vptr, vind, P, page_size, num_pages):
    """``ROPEKV_CHECK_INDICES``: IndexError for the first token the kernel would skip (padding,
    ``batch_indices < 0``, aside)."""
    pos, b, p = (ck.host_copy(x).astype(np.int64) for x in (vpos, vbat, vposn))
    indptr, indices = (ck.host_copy(x).astype(np.int64) for x in (vptr, vind))
    bad = np.nonzero((pos < 0) | (pos >= P))[0]
    if bad.size:
        i = int(bad[0])
        raise IndexError(f"token {i} has pos_ids[{i}] = {pos[i]}, outside the cos_sin_cache's "
                         f"[0, P={P})")
    B = indptr.shape[0] - 1
    page, _ = reference.paged_append_slots(indices, indptr, b, p, page_size, num_pages)
    for i in np.nonzero((b >= 0) & (page < 0))[0]:
        i = int(i)
        if b[i] >= B:
            raise IndexError(f"token {i} has batch_indices[{i}] = {b[i]}, outside [0, "
                             f"batch_size={B}) (kv_indptr has {B + 1} entries)")
        if p[i] < 0:
            raise IndexError(f"token {i} has a negative position, positions[{i}] = {p[i]}")
        it = indptr[b[i]] + p[i] // page_size
        if not indptr[b[i]] <= it < indptr[b[i] + 1] or not 0 <= it < indices.shape[0]:
            raise IndexError(
                f"token {i} (request {b[i]}, position {p[i]}) needs page-table entry "
                f"kv_indptr[{b[i]}] + {p[i]} // {page_size} = {it}, outside the request's "
                f"[{indptr[b[i]]}, {indptr[b[i] + 1]}) or kv_indices' [0, {indices.shape[0]})")
        raise IndexError(f"token {i} (request {b[i]}, position {p[i]}) maps to page "
                         f"kv_indices[{it}] = {indices[it]}, outside [0, num_pages={num_pages})")
