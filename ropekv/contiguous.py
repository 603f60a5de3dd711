"""``apply_rope_write_kv``: RoPE on Q and K, and the K/V write into a contiguous cache."""

from __future__ import annotations

import collections
import functools
import numbers
from typing import NamedTuple

import numpy as np

from ropekv import _checks as ck
from ropekv import _declare as decl
from ropekv import reference
from ropekv._arrays import (
    BFLOAT16,
    FLOAT16,
    FLOAT32,
    FP8_DTYPES,
    HOST,
    INT32,
    INT64,
)
from ropekv._compile import c_bool, c_type, name_expression
from ropekv._launch import AS_IS, FLAG, KEY, Launch, Op, ParamStruct, Plan, int32_fields_fit
from ropekv._mrope import check_mrope, section_list
from ropekv._types import ArrayLike, StreamLike
from ropekv._vector import vector_width, widest_aligned

STEM = "contiguous"
KERNEL = "apply_rope_write_kv"
KERNEL_SCALED = "apply_rope_write_kv_scaled"  # MODE 3-5: the computed scales, registers capped
LEAN_KERNEL = "apply_rope_write_kv_lean"  # the plain call's decode: one chunk of one row a thread
INPUT_DTYPES = (FLOAT16, BFLOAT16)
INDEX_DTYPES = (INT32, INT64)
SCALED_CACHE_DTYPES = ck.SCALED_CACHE_DTYPES  # caches that may carry per-token-head scales
INT8 = ck.INT8
ROWS_MAX = 4  # head rows one lane group holds (kRowsMax in the kernel)
SCALED_ROWS_MAX = 2  # ... in the computed-scale kernels, MODE 3-5 (kScaledRowsMax)
MAX_ITEMS = 256  # chunks (lanes) per head row: one lane group fits a block
MAX_BLOCK = 256  # threads per block (kMaxBlock, the kernels' __launch_bounds__)
GRID_YZ = 65535  # the largest grid y and z: the lean kernel's S and B
INT32_SPAN = 2**31 - 1  # element offsets below this take the lean kernel's 32-bit offsets

# Launch shape (H200). A token has H = Hq + 2 Hkv head rows (Q, K, V), one lane group per row.
# Few tokens (decode): blocks of about `block` threads, each lane group one row (or a few when that
# keeps the grid within `wave_blocks`), a token's rows split over several blocks so the grid fills
# the GPU. Many tokens (prefill): a block per token, `prefill_rows` rows per lane group (at most
# `max_block` threads).
# Computed scales take `scaled_prefill_rows` rows per lane group in prefill; their kernels
# without mRoPE (MODE 3-5) hold at most 2 rows (80 registers, the plain kernel's occupancy:
# Llama's 48 rows are 4 blocks of 192 threads an SM); MODE 6 (computed scales with mRoPE, ~125
# registers) holds 4 (`mrope_scaled_prefill_rows`).
# `lean_decode`: the plain call (no mRoPE, q_out or computed scales; 16-bit or fp8 caches) at
# decode takes the lean kernel (apply_rope_write_kv_lean: one chunk of one row per thread, the
# index loads issued first, no division), in blocks of about `lean_block` threads (whole rows, a
# token's rows spread evenly over the blocks), one token per block, while the grid stays within
# `lean_wave_blocks`; past that, and for every other call, the kernel above. `lean_decode=False`
# is the launch of ee077f9.
TUNING = {
    "block": 128,
    "wave_blocks": 660,
    "prefill_rows": 3,
    "max_block": 256,
    "scaled_prefill_rows": 2,
    "mrope_scaled_prefill_rows": 4,
    "lean_decode": True,
    "lean_block": 128,
    "lean_wave_blocks": 1056,
}

PARAMS = ParamStruct(
    "RopeWriteKVParams",
    [
        *(
            (n, np.uint64)
            for n in (
                "q",
                "k",
                "v",
                "cache",
                "cos_sin",
                "kv_end_lens",
                "position_ids",
                "kv_scale",
                "q_out",
                "q_scale_out",
                "cache_scales",
            )
        ),
        *(
            (n, np.int64)
            for n in (
                "q_sb",
                "q_ss",
                "q_sh",
                "k_sb",
                "k_ss",
                "k_sh",
                "v_sb",
                "v_ss",
                "v_sh",
                "c_sb",
                "c_skv",
                "c_sh",
                "c_st",
                "cs_sb",
                "cs_sp",
                "qo_sb",
                "qo_ss",
                "qo_sh",
                "qs_sb",
                "qs_ss",
                "qs_sh",
                "ks_sb",
                "ks_skv",
                "ks_sh",
                "ks_st",
            )
        ),
        *((n, np.float32) for n in ("inv_k_scale", "inv_v_scale", "inv_q_scale")),
        *(
            (n, np.int32)
            for n in (
                "B",
                "S",
                "Hq",
                "Hkv",
                "D",
                "R",
                "C",
                "P",
                "write_k_in_place",
                "group",
                "rows",
                "index64",
                "v_scale_index",
                "mrope",
                "mrope_t",
                "mrope_h",
                "mrope_w",
                "mrope_interleaved",
                "items",
                "q_full",
                "q_dynamic",
                "kv_dynamic",
            )
        ),
    ],
)
# The lean kernel's record where its offsets are 32-bit (RopeWriteKVLeanParams): the fields of
# PARAMS it reads, strides as int32 (_wide keeps every stride within it): 3 constant-bank lines of
# 64 bytes instead of 5 (the kernel's note). 64-bit offsets keep PARAMS.
_LEAN_STRIDES = (
    *("q_sb", "q_ss", "q_sh", "k_sb", "k_ss", "k_sh", "v_sb", "v_ss", "v_sh"),
    *("c_sb", "c_skv", "c_sh", "c_st", "cs_sb", "cs_sp"),
)
LEAN_PARAMS = ParamStruct(
    "RopeWriteKVLeanParams",
    [
        *PARAMS.fields[:8],  # q .. kv_scale
        *((n, np.int32) for n in _LEAN_STRIDES),
        *((n, np.float32) for n in ("inv_k_scale", "inv_v_scale")),
        *((n, np.int32) for n in ("S", "Hq", "Hkv", "R", "C", "P", "write_k_in_place", "index64")),
        ("v_scale_index", np.int32),
    ],
)

# the array arguments, in the order the public function hands them to the call path; each is
# also the name of its kernel pointer field
ARRAYS = (
    "q",
    "k",
    "v",
    "kv_cache",
    "cos_sin_cache",
    "kv_end_lens",
    "position_ids",
    "kv_scale",
    "q_out",
    "q_scale_out",
    "kv_cache_scales",
)
FIELDS = (
    "q",
    "k",
    "v",
    "cache",
    "cos_sin",
    "kv_end_lens",
    "position_ids",
    "kv_scale",
    "q_out",
    "q_scale_out",
    "cache_scales",
)
Q_OUT = ARRAYS.index("q_out")

# kernel specialisations (MODE in the kernel): every option compiled out; mRoPE and constant K/V
# scales read; the quantized outputs (q_out, static scales) with constant K/V scales read but
# no mRoPE, in four: static scales only, computed Q scales, computed K/V scales, both computed;
# and every option at run time, mRoPE included (MODE_ALL)
(MODE_PLAIN, MODE_OPTS, MODE_QUANT, MODE_Q_ROWS, MODE_KV_ROWS, MODE_BOTH_ROWS, MODE_ALL) = range(7)


@functools.cache  # a plan's lookup spells it once per first call
def expression(dtype, cache_dtype, is_neox, n, mode=MODE_PLAIN, q_dtype=None):
    """The kernel of one specialisation (``mode``); ``q_dtype``: the Q output's dtype (that of
    ``dtype`` unless a quantized-output mode writes fp8 queries)."""
    kernel = KERNEL_SCALED if MODE_Q_ROWS <= mode <= MODE_BOTH_ROWS else KERNEL
    return name_expression(
        kernel,
        c_type(dtype),
        c_type(cache_dtype),
        c_type(q_dtype or dtype),
        c_bool(is_neox),
        n,
        mode,
    )


@functools.cache
def lean_expression(dtype, cache_dtype, is_neox, n, wide=False):
    """The lean decode kernel of a plain call: input and cache dtypes, RoPE style, vector width,
    64-bit offsets (``wide``) where an array spans 2**31 elements or more."""
    return name_expression(
        LEAN_KERNEL,
        c_type(dtype),
        c_type(cache_dtype),
        c_bool(is_neox),
        n,
        "long long" if wide else "int",
    )


def lean_shape(B, S, H, items):
    """``(block, grid)`` of the lean kernel for B x S tokens of H head rows at ``items`` lanes per
    row: blocks of ``(items, rows)`` threads, grid ``(splits, S, B)``; None where ``TUNING``
    leaves the call to the kernel of :func:`launch_shape` (``lean_decode`` off, or a grid past
    ``lean_wave_blocks`` or past the grid's y / z limits)."""
    if not TUNING["lean_decode"] or B > GRID_YZ or S > GRID_YZ:
        return None
    slots = max(1, min(H, TUNING["lean_block"] // items, MAX_BLOCK // items))
    splits = -(-H // slots)
    if B * S * splits > TUNING["lean_wave_blocks"]:
        return None
    return (items, -(-H // splits)), (splits, S, B)


def launch_shape(T, H, group, prefill_rows=None, rows_max=ROWS_MAX):
    """(block, rows, splits) for T tokens of H head rows at ``group`` lanes per row: grid (T,
    splits), ``rows`` rows per lane group (``prefill_rows`` in prefill, by default TUNING's; at
    most ``rows_max``, what the kernel holds)."""
    slots = max(1, TUNING["block"] // group)
    for rows in (1, 2, 4):
        if rows > rows_max:
            break
        splits = -(-H // (slots * rows))
        if T * splits <= TUNING["wave_blocks"]:
            return slots * group, -(-H // (slots * splits)), splits
    slots = min(
        -(-H // min(rows_max, prefill_rows or TUNING["prefill_rows"])),
        max(1, TUNING["max_block"] // group),
    )
    rows = min(rows_max, -(-H // slots))
    return slots * group, rows, -(-H // (slots * rows))


def instantiations():
    """Every kernel instantiation a call can select (the compile tests build them all)."""
    for dtype in INPUT_DTYPES:
        for is_neox in (True, False):
            for n in (8, 4, 2, 1) if is_neox else (8, 4, 2):
                for cache_dtype in (dtype, *FP8_DTYPES):
                    for mode in (MODE_PLAIN, MODE_OPTS):
                        yield expression(dtype, cache_dtype, is_neox, n, mode)
                for mode in range(MODE_QUANT, MODE_BOTH_ROWS + 1):
                    q_rows, kv_rows = mode in (MODE_Q_ROWS, MODE_BOTH_ROWS), mode >= MODE_KV_ROWS
                    for cache_dtype in SCALED_CACHE_DTYPES if kv_rows else (dtype, *FP8_DTYPES):
                        for q_dtype in FP8_DTYPES if q_rows else (dtype, *FP8_DTYPES):
                            yield expression(dtype, cache_dtype, is_neox, n, mode, q_dtype)
                for cache_dtype in (dtype, *SCALED_CACHE_DTYPES):
                    for q_dtype in (dtype, *FP8_DTYPES):
                        yield expression(dtype, cache_dtype, is_neox, n, MODE_ALL, q_dtype)
                for cache_dtype in (dtype, *FP8_DTYPES):
                    for wide in (False, True):
                        yield lean_expression(dtype, cache_dtype, is_neox, n, wide)


def pow2(n):
    return 1 << max(0, n - 1).bit_length()


def apply_rope_write_kv(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    kv_cache: ArrayLike,
    cos_sin_cache: ArrayLike,
    *,
    kv_end_lens: ArrayLike | None = None,
    position_ids: ArrayLike | None = None,
    kv_scale: float | tuple[float, float] | ArrayLike | None = None,
    write_k_in_place: bool = False,
    is_neox: bool = True,
    mrope_section: tuple[int, int, int] | None = None,
    mrope_interleaved: bool = False,
    q_out: ArrayLike | None = None,
    q_scale: float | None = None,
    q_scale_out: ArrayLike | None = None,
    kv_cache_scales: ArrayLike | None = None,
    enable_pdl: bool = False,
    stream: StreamLike | None = None,
) -> ArrayLike | None:
    """Apply RoPE to Q and K and write K/V into a contiguous KV cache, in one launch.

    Mirrors TensorRT-Edge-LLM's ``launchApplyRopeWriteKV`` family. Its three launchers map onto
    keywords of this one function:

    ===========================================  ================================================
    TensorRT-Edge-LLM                            ropekv
    ===========================================  ================================================
    ``launchApplyRopeWriteKV`` (prefill)         ``kv_end_lens=None or lens, write_k_in_place=True``
    ``launchApplyRopeWriteKV`` (chunked/decode)  ``kv_end_lens=lens`` (K roped only in the cache)
    ``launchApplyRopeWriteKVTreeDecoding``       ``kv_end_lens=lens, position_ids=ids``
    ``launchApplyRopeWriteKVSplitQKV``           ``kv_end_lens=lens`` (the default
                                                 ``write_k_in_place=False``)
    ===========================================  ================================================

    Parameters
    ----------
    q : array, (B, S, Hq, D), float16 or bfloat16
        Queries, roped in place (only read when ``q_out`` is another array).
    k, v : array, (B, S, Hkv, D), the dtype of ``q``
        Keys and values; Hq is a multiple of Hkv. ``k`` is written only with
        ``write_k_in_place=True``.
    kv_cache : array, (B, 2, Hkv, C, D), the dtype of ``q``, float8_e4m3fn, float8_e5m2 or int8
        ``kv_cache[:, 0]`` holds K (roped), ``kv_cache[:, 1]`` holds V. Written in place; only the
        addressed slots change. int8 only with ``kv_cache_scales``.
    cos_sin_cache : array, (P, R) or (Bc, P, R) with Bc 1 or B, float32
        ``[:R/2]`` cos, ``[R/2:]`` sin (see :func:`ropekv.cos_sin_cache`). R is even and at most D;
        dims ``[R, D)`` pass through unrotated.
    kv_end_lens : array, (B,), int32 or int64, optional
        Cache end of each sequence after writing: token s lands in slot ``kv_end_lens[b] - S + s``.
        None means slot ``s`` (prefill into an empty cache).
    position_ids : array, (B, S), int32 or int64, optional
        RoPE position of each token (tree decoding); by default the slot. A negative id marks
        padding: that token is neither roped nor written. With ``mrope_section``: ``(3, B, S)``,
        each token's temporal, height and width positions (required); a token with any of them
        outside ``[0, P)`` is skipped.
    kv_scale : float, (float, float), or float32 array (2,) or (), optional
        K and V dequantization scales, required for fp8 caches: stored = fp8(x / scale), rounded
        to nearest even and saturated to the largest finite value. A number (or a 0-d NumPy
        array) is one scale for K and V, a pair one each; both enter the launch as constants.
        A device array is read by the kernel (``(2,)``: K then V; ``()``: one for both), so it
        may change between calls or graph replays; a scale that is not positive and finite
        there makes the kernel write nothing. Not with ``kv_cache_scales``.
    write_k_in_place : bool
        Also write the roped K back into ``k``.
    is_neox : bool
        True rotates half-split pairs (i, i + R/2); False interleaved pairs (2i, 2i + 1).
    mrope_section : (int, int, int), optional
        mRoPE (Qwen2-VL): ``(t, h, w)`` rotary half-dims per axis, summing to R/2; half-dim i
        takes its angle from the temporal position for ``i < t``, height for ``t <= i < t + h``,
        width otherwise (``docs/conventions.md``).
    mrope_interleaved : bool
        Qwen3-VL's interleaved mRoPE: height when ``i % 3 == 1`` and ``i < 3h``, width when
        ``i % 3 == 2`` and ``i < 3w``, temporal otherwise.
    q_out : array, (B, S, Hq, D), the dtype of ``q``, float8_e4m3fn or float8_e5m2, optional
        Receives the roped queries instead of ``q`` (then ``q`` is only read). Every token's row
        is written: a token skipped for its slot or position gets its row as it came, unrotated
        (quantized like the others). ``q_out is q`` is the in-place default.
    q_scale : float, optional
        Static dequantization scale of an fp8 ``q_out``: stored = fp8(q / q_scale), rounded to
        nearest even and saturated (default 1.0). Only with an fp8 ``q_out``; not with
        ``q_scale_out``.
    q_scale_out : array, (B, S, Hq), float32, optional
        Dynamic scales of an fp8 ``q_out``: each token's Q head is quantized with its own scale
        ``max(amax, 1e-6) / max_code`` (amax: the row's largest magnitude after RoPE; max_code
        448 for e4m3, 57344 for e5m2), written here (``docs/conventions.md``, "Computed
        scales"): ``q ~ q_out * q_scale_out[..., None]``.
    kv_cache_scales : array, (B, 2, Hkv, C), float32, optional
        Per-token-head cache scales (K then V, as the cache): each written K and V row is
        quantized with its own computed scale (as ``q_scale_out``, with int8's max code 127),
        which lands in the same slot here; slots not written keep their scales. Needs a
        float8 or int8 cache; replaces ``kv_scale``.
    enable_pdl : bool
        Launch with programmatic dependent launch (Hopper and later): the kernel may start while
        the previous kernel on the stream finishes, and waits for it before reading memory.
    stream : CuPy stream, int ``cudaStream_t`` or object with ``cuda_stream``, optional
        Stream to launch on; by default torch's current stream when an argument is a torch
        tensor, else CuPy's current stream, on the arrays' device (``docs/conventions.md``).

    Returns
    -------
    array or None
        ``q_out`` when given; otherwise None (everything is written in place: ``q``, the cache,
        and ``k`` with ``write_k_in_place``).

    Raises
    ------
    TypeError
        An array of a dtype not listed above (``k`` / ``v`` / a 16-bit cache unlike ``q``, a
        non-float32 table or scale array, a non-integer index array), a non-bool flag, a
        non-number scale, or a ``stream`` of an unknown kind.
    ValueError
        Shapes that disagree (Hq not a multiple of Hkv, R odd or above D, ``kv_end_lens`` not
        ``(B,)``), an fp8 cache without ``kv_scale`` or ``kv_cache_scales``, an int8 cache without
        ``kv_cache_scales``, both of a static / dynamic scale pair, ``q_scale`` or
        ``q_scale_out`` without an fp8 ``q_out``, a written array that overlaps another argument,
        arrays on different devices, or rows not contiguous in their last dimension.
    BufferError
        A written array exported read-only (or through a legacy DLPack capsule), memory not
        aligned to its item size, or (``is_neox=False``) rows starting at odd elements.
    IndexError
        Only with ``ROPEKV_CHECK_INDICES=1``: a token whose cache slot falls outside ``[0, C)`` or
        whose position falls outside ``[0, P)``.

    Notes
    -----
    ``q`` (or ``q_out``) is written in place, so it must not overlap ``k``, ``v``, the cache or
    the table; no written array may overlap another argument (``ValueError``), except ``q_out``
    that is ``q`` itself.

    A token whose slot falls outside ``[0, C)`` or whose position falls outside ``[0, P)`` is
    skipped (not roped, not written). With ``ROPEKV_CHECK_INDICES=1`` such a token raises
    ``IndexError`` instead (checked on the host before the launch).

    NumPy inputs run the NumPy reference on the host, with the same in-place writes.

    Examples
    --------
    With NumPy arrays (the NumPy reference, on the host):

    >>> import numpy as np, ropekv
    >>> B, S, Hq, Hkv, D, C = 2, 16, 32, 8, 128, 1024
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((B, S, Hq, D)).astype(np.float16)
    >>> k, v = (rng.standard_normal((B, S, Hkv, D)).astype(np.float16) for _ in range(2))
    >>> cache = np.zeros((B, 2, Hkv, C, D), np.float16)
    >>> ropekv.apply_rope_write_kv(q, k, v, cache, ropekv.cos_sin_cache(C, D))
    >>> bool((cache[:, 1, :, :S] == v.transpose(0, 2, 1, 3)).all())  # V in slots [0, S)
    True

    The same call with CuPy arrays runs the CUDA kernel (needs a GPU):

    >>> import cupy as cp  # doctest: +SKIP
    >>> q = cp.random.randn(B, S, Hq, D).astype(cp.float16)  # doctest: +SKIP
    >>> k, v = (cp.random.randn(B, S, Hkv, D).astype(q.dtype) for _ in range(2))  # doctest: +SKIP
    >>> cache = cp.zeros((B, 2, Hkv, C, D), cp.float16)  # doctest: +SKIP
    >>> table = ropekv.cos_sin_cache(C, D, xp=cp)  # doctest: +SKIP
    >>> ropekv.apply_rope_write_kv(q, k, v, cache, table)  # doctest: +SKIP

    fp8 queries with a scale per token and head, and an int8 cache with per-token-head scales:

    >>> import ml_dtypes
    >>> q_fp8 = np.zeros(q.shape, ml_dtypes.float8_e4m3fn)
    >>> q_scales = np.zeros((B, S, Hq), np.float32)
    >>> cache8 = np.zeros((B, 2, Hkv, C, D), np.int8)
    >>> cache_scales = np.zeros((B, 2, Hkv, C), np.float32)
    >>> out = ropekv.apply_rope_write_kv(
    ...     q, k, v, cache8, ropekv.cos_sin_cache(C, D), q_out=q_fp8, q_scale_out=q_scales,
    ...     kv_cache_scales=cache_scales)
    >>> out is q_fp8, bool((q_scales > 0).all())
    (True, True)
    """
    scale, scale_array = _scale_arg(kv_scale)
    in_place = q_out is q  # the plain in-place call: q_out is not a second array
    out = _OP(
        (
            q,
            k,
            v,
            kv_cache,
            cos_sin_cache,
            kv_end_lens,
            position_ids,
            scale_array,
            None if in_place else q_out,
            q_scale_out,
            kv_cache_scales,
        ),
        (
            write_k_in_place,
            is_neox,
            enable_pdl,
            scale,
            tuple(TUNING.values()),
            mrope_section,
            mrope_interleaved,
            q_scale,
        ),
        stream,
    )
    return q if in_place else out


def _scale_arg(value):
    """``kv_scale`` as ``(constant, array)``: a number, a pair or a 0-d NumPy array goes into the
    plan key as its value(s), anything else is an array argument of the call."""
    cls = value.__class__
    if value is None or cls is float or cls is int or cls is tuple or cls is list:
        return value, None
    if isinstance(value, np.ndarray) and value.ndim == 0:
        return value.item(), None
    if isinstance(value, numbers.Real) or cls is bool or cls is np.bool_:
        return value, None
    return None, value


def _constant_scales(value):
    """(k_scale, v_scale) from a constant ``kv_scale``: positive finite numbers."""
    if isinstance(value, tuple):
        if len(value) != 2:
            raise ValueError(
                f"kv_scale must be a number, a (k_scale, v_scale) pair or a float32 "
                f"array of shape (2,) or (), got {len(value)} values"
            )
        return tuple(
            ck.check_float(x, f"kv_scale[{i}]", positive=True) for i, x in enumerate(value)
        )
    s = ck.check_float(value, "kv_scale", positive=True)
    return s, s


def _check_quantized_outputs(vq, vc, vqo, q_scale, vqs, vcs, kv_scale_given):
    """q_out, q_scale, q_scale_out and kv_cache_scales against q and the cache; returns the
    static Q scale (1.0 when none applies)."""
    if vqo is None and vqs is None and vcs is None and q_scale is None and vc.dtype != INT8:
        return 1.0  # nothing given to check (an int8 cache demands kv_cache_scales)
    B, S, Hq, D = vq.shape
    Hkv, C = vc.shape[2], vc.shape[3]
    if vqo is not None:
        ck.check_ndim(vqo, 4, "(B, S, Hq, D)")
        ck.check_shape(vqo, (B, S, Hq, D), "(B, S, Hq, D)")
        if vqo.dtype != vq.dtype:
            ck.check_dtype(vqo, (vq.dtype, *FP8_DTYPES))
        ck.check_last_dim_contiguous(vqo)
    ck.check_q_scales(
        None if vqo is None else vqo.dtype,
        "q_out",
        "q_scale",
        q_scale is not None,
        vqs,
        (B, S, Hq),
        "(B, S, Hq)",
    )
    ck.check_cache_scales(
        vc.dtype, "kv_cache", "kv_scale", kv_scale_given, vcs is not None, "(B, 2, Hkv, C)"
    )
    if vcs is not None:
        ck.check_scale_array(vcs, (B, 2, Hkv, C), "(B, 2, Hkv, C)")
    if q_scale is not None:
        q_scale = ck.check_float(q_scale, "q_scale", positive=True)
    return 1.0 if q_scale is None else q_scale


def _check_qkv(vq, vk, vv):
    """The checks of q, k and v, in order (each raises its own message)."""
    ck.check_ndim(vq, 4, "(B, S, Hq, D)")
    ck.check_dtype(vq, INPUT_DTYPES)
    B, S, _Hq, D = vq.shape
    ck.check_ndim(vk, 4, "(B, S, Hkv, D)")
    Hkv = vk.shape[2]
    ck.check_shape(vk, (B, S, None, D), "(B, S, Hkv, D)")
    ck.check_shape(vv, (B, S, Hkv, D), "(B, S, Hkv, D)")
    ck.check_same_dtype(vk, vq)
    ck.check_same_dtype(vv, vq)


class _Checked(NamedTuple):
    """What the checks of a first call derive: sizes, the validated scales and the device."""

    B: int
    S: int
    Hq: int
    Hkv: int
    D: int
    C: int
    P: int
    R: int
    sections: tuple | None
    fp8: bool  # a float8 cache
    scales: tuple  # the constant (k, v) scales
    q_static: float
    device: int


def _prepare(views, flags):
    """Validate a first call (:func:`_check`), choose the kernel specialisation (:func:`_mode`)
    and pack its launch (:func:`_launch`: vector width, launch shape, record), or the NumPy
    backend run."""
    a, f = _Views._make(views), _Flags._make(flags)
    c = _check(a, f)
    written = _WRITTEN_OUT if a.q_out is not None else _WRITTEN_Q
    written += _WRITTEN_K if f.write_k_in_place else ()
    result = (lambda arrays, outs: arrays[Q_OUT]) if a.q_out is not None else None

    check_indices = ck.check_indices_enabled()
    if a.kv_scale is not None and (c.device == HOST or check_indices):
        ck.check_scale_values(a.kv_scale)
    if check_indices:
        _check_indices(a.kv_end_lens, a.position_ids, c.B, c.S, c.C, c.P, c.sections is not None)
    plan = functools.partial(Plan, written=written, inplace=_INPLACE, result=result)
    if c.device == HOST:
        return plan(HOST, host=_host_run(a, f, c) if c.B * c.S else None)
    if c.B * c.S == 0:
        return plan(c.device)
    return plan(c.device, [_launch(a, f, c, _mode(a, c))])


def _check(a, f):
    """Every check of a first call, in the order of the arguments' errors; a :class:`_Checked`."""
    vq, vk, vv, vc, vt, vlens, vpos = (
        a.q,
        a.k,
        a.v,
        a.kv_cache,
        a.cos_sin_cache,
        a.kv_end_lens,
        a.position_ids,
    )

    # Tests of the common case first, read in the checkers' order; the checkers (which raise
    # their own messages) only where a test fails: this runs on every first call.
    if not (
        len(vq.shape) == 4
        and vq.dtype in INPUT_DTYPES
        and len(vk.shape) == 4
        and vk.shape[:2] == vq.shape[:2]
        and vk.shape[3] == vq.shape[3]
        and vv.shape == vk.shape
        and vk.dtype == vq.dtype
        and vv.dtype == vq.dtype
    ):
        _check_qkv(vq, vk, vv)
    B, S, Hq, D = vq.shape
    Hkv = vk.shape[2]
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"q's head count ({Hq}) must be a positive multiple of k's ({Hkv})")
    if D == 0:
        raise ValueError(f"q must have shape (B, S, Hq, D) with D > 0, got {vq.shape}")
    if not (len(vc.shape) == 5 and vc.shape[:3] == (B, 2, Hkv) and vc.shape[4] == D):
        ck.check_ndim(vc, 5, "(B, 2, Hkv, C, D)")
        ck.check_shape(vc, (B, 2, Hkv, None, D), "(B, 2, Hkv, C, D)")
    C = vc.shape[3]
    if vc.dtype != vq.dtype:
        ck.check_dtype(vc, (vq.dtype, *SCALED_CACHE_DTYPES))
    if (
        len(vt.shape) in _TABLE_NDIMS
        and vt.dtype == FLOAT32
        and vt.shape[-1] % 2 == 0
        and 0 < vt.shape[-1] <= D
    ):
        P, R = vt.shape[-2:]
    else:
        P, R = ck.check_cos_sin_cache(vt, D, _TABLE_NDIMS, "(P, R) or (Bc, P, R)")
    if vt.ndim == 3 and vt.shape[0] not in (1, B):
        raise ValueError(
            f"cos_sin_cache must have shape (P, R) or (Bc, P, R) with Bc 1 or B={B}, got {vt.shape}"
        )
    if vlens is not None and (
        vlens.shape != (B,) or vlens.dtype not in INDEX_DTYPES or vlens.strides != ck.UNIT_STRIDE
    ):  # (stride 1: contiguous)
        ck.check_shape(vlens, (B,), "(B,)")
        ck.check_dtype(vlens, INDEX_DTYPES)
        ck.check_contiguous(vlens)
    sections = check_mrope(f.mrope_section, f.mrope_interleaved, R, vpos, (3, B, S), "(3, B, S)")
    if vpos is not None and sections is None:
        ck.check_shape(vpos, (B, S), "(B, S)")
        ck.check_dtype(vpos, INDEX_DTYPES)
        ck.check_contiguous(vpos)
    fp8 = vc.dtype in FP8_DTYPES
    q_static, scales = _check_scales(a, f, fp8)
    if (
        vq.strides[-1] != 1
        or vk.strides[-1] != 1
        or vv.strides[-1] != 1
        or vc.strides[-1] != 1
        or vt.strides[-1] != 1
    ):  # (a test first, as above)
        ck.check_last_dim_contiguous(vq, vk, vv, vc, vt)
    device = ck.check_same_device(a)
    return _Checked(B, S, Hq, Hkv, D, C, P, R, sections, fp8, scales, q_static, device)


def _check_scales(a, f, fp8):
    """The quantized outputs and the K/V scales; ``(q_static, constant (k, v) scales)``."""
    vc, vscale, vcs = a.kv_cache, a.kv_scale, a.kv_cache_scales
    given = vscale is not None or f.kv_scale is not None
    q_static = _check_quantized_outputs(a.q, vc, a.q_out, f.q_scale, a.q_scale_out, vcs, given)
    if fp8 and not given and vcs is None:
        raise ValueError(
            f"kv_scale (a number, a pair, or float32 of shape (2,) or ()) or "
            f"kv_cache_scales is required for a {vc.dtype} kv_cache"
        )
    if not fp8 and given:
        raise ValueError(f"kv_scale is only used with float8 caches, but kv_cache is {vc.dtype}")
    scales = _constant_scales(f.kv_scale) if f.kv_scale is not None else (1.0, 1.0)
    if vscale is not None:
        ck.check_ndim(vscale, (0, 1), "(2,) or ()")
        if vscale.ndim == 1:
            ck.check_shape(vscale, (2,), "(2,) or ()")
        ck.check_dtype(vscale, (FLOAT32,))
        ck.check_contiguous(vscale)
    return q_static, scales


def _host_run(a, f, c):
    """The NumPy backend's run of a host call."""

    def h(view):
        return None if view is None else view.host

    def host(v, _):
        reference.apply_rope_write_kv(
            a.q.host,
            a.k.host,
            a.v.host,
            a.kv_cache.host,
            a.cos_sin_cache.host,
            h(a.kv_end_lens),
            h(a.position_ids),
            c.scales if a.kv_scale is None else a.kv_scale.host,
            f.write_k_in_place,
            f.is_neox,
            c.sections,
            f.mrope_interleaved,
            h(a.q_out),
            c.q_static,
            h(a.q_scale_out),
            h(a.kv_cache_scales),
        )

    return host


def _mode(a, c):
    """The kernel specialisation of a device call (``MODE_*``)."""
    vqs, vcs = a.q_scale_out, a.kv_cache_scales
    quant = a.q_out is not None or vcs is not None
    if quant and c.sections is not None:
        return MODE_ALL
    if quant:
        return MODE_QUANT + (vqs is not None) + 2 * (vcs is not None)
    if c.sections is not None:
        return MODE_OPTS
    # constant K/V scales: the quantized-output kernel (Q in place through q_out = q), whose
    # code reads no mRoPE (80 registers against MODE_OPTS' 120)
    return MODE_QUANT if c.fp8 and a.kv_scale is None else MODE_PLAIN


def _choose(a, is_neox, c, mode):
    """``(vector width, items, lanes per head row, block, rows, splits)`` of a device call."""
    vq, vk, vv, vc, vqo = a.q, a.k, a.v, a.kv_cache, a.q_out
    vout = vq if vqo is None else vqo
    R, D = c.R, c.D

    # the widest n for which the data rows (and the table's) are aligned, read once for every
    # width tried (widest_aligned)
    widest = widest_aligned((vq, vk, vv, vc) if vout is vq else (vq, vk, vv, vc, vout))
    table_widest = widest_aligned((a.cos_sin_cache,))

    def fits(n):
        rot = (R // 2) % n == 0 if is_neox else (R % n == 0 and n % 2 == 0)
        cos_width = n if is_neox else n // 2
        return rot and (D - R) % n == 0 and n <= widest and cos_width <= table_widest

    n = vector_width(vq.dtype.itemsize, fits)
    if n is None:  # only interleaved RoPE can get here (neox fits at width 1)
        raise BufferError(
            f"interleaved RoPE reads element pairs: the rows of q, k, v, kv_cache "
            f"and q_out must start at even elements; got q {vq}, k {vk}, v {vv}, "
            f"kv_cache {vc}, q_out {vqo}"
        )
    items = ((R // 2) // n if is_neox else R // n) + (D - R) // n
    if items > MAX_ITEMS:
        raise ValueError(
            f"head dim D={D} with rotary dim R={R} needs {items} threads per head "
            f"row, more than the {MAX_ITEMS} a block has"
        )
    dynamic = a.q_scale_out is not None or a.kv_cache_scales is not None
    group = pow2(items) if dynamic else items  # computed scales reduce over aligned lane groups
    scaled = MODE_Q_ROWS <= mode <= MODE_BOTH_ROWS  # the 2-row, 80-register kernels
    block, rows, splits = launch_shape(
        c.B * c.S,
        c.Hq + 2 * c.Hkv,
        group,
        TUNING["scaled_prefill_rows"]
        if scaled
        else TUNING["mrope_scaled_prefill_rows"]
        if dynamic
        else None,
        SCALED_ROWS_MAX if scaled else ROWS_MAX,
    )
    return n, items, group, block, rows, splits


def _launch(a, f, c, mode):
    """The kernel launch of a validated device call: the vector width and launch shape
    (:func:`_choose`), the record's values and pointer slots."""
    vq, vqo = a.q, a.q_out
    vout = vq if vqo is None else vqo
    n, items, group, block, rows, splits = _choose(a, f.is_neox, c, mode)
    values = _values(a, f, c, items, group, rows)
    slots = dict(_ARGUMENT_SLOTS)  # q .. cos_sin_cache, all given (checked)
    for i, field, slot in _OPTIONAL_SLOTS:  # the optional arrays given
        if a[i] is not None:
            slots[field] = slot
    if vqo is None:
        slots["q_out"] = _Q_IN_PLACE  # Q roped in place: the kernel writes through q_out = q
    if (
        vqo is None
        and a.q_scale_out is None
        and a.kv_cache_scales is None
        and a.kv_scale is None
        and not c.sections
    ):
        values.update(_NO_OPTIONS)
    else:
        values.update(_option_values(a, c.sections))
    plain = vqo is None and a.q_scale_out is None and a.kv_cache_scales is None
    lean = lean_shape(c.B, c.S, c.Hq + 2 * c.Hkv, items) if plain and not c.sections else None
    params = PARAMS
    if lean is not None:  # the plain call's decode: the lean kernel
        wide = _wide(a, values)
        kernel = lean_expression(vq.dtype, a.kv_cache.dtype, f.is_neox, n, wide)
        block_shape, grid = lean
        params = PARAMS if wide else LEAN_PARAMS
    else:
        kernel = expression(vq.dtype, a.kv_cache.dtype, f.is_neox, n, mode, vout.dtype)
        block_shape, grid = (block,), (c.B * c.S, splits)
    return Launch(
        STEM, kernel, c.device, grid, block_shape, params, values, slots, pdl=f.enable_pdl
    )


def _wide(a, values):
    """Whether an array the lean kernel addresses (q, k, v, the cache, the table) spans 2**31
    elements or more from its pointer, or a stride of the record's ``values`` lies outside int32
    (a stride of a dimension of extent one can be any value; the 32-bit form's record,
    LEAN_PARAMS, holds them as int32): then its offsets are 64-bit."""
    views = (a.q, a.k, a.v, a.kv_cache, a.cos_sin_cache)
    return any(
        max(-v.span[0], v.span[1]) // v.dtype.itemsize > INT32_SPAN for v in views
    ) or not int32_fields_fit(values, _LEAN_STRIDES)


def _values(a, f, c, items, group, rows):
    """The record's fields past the pointers but the options' (every given pointer has a slot,
    :func:`_launch`; the others are null)."""
    vq, vk, vv, vc, vt, vlens, vpos = (
        a.q,
        a.k,
        a.v,
        a.kv_cache,
        a.cos_sin_cache,
        a.kv_end_lens,
        a.position_ids,
    )
    vout = vq if a.q_out is None else a.q_out
    table_strides = vt.strides if vt.ndim == 3 else (0, *vt.strides)
    q_st, k_st, v_st, c_st, qo_st = vq.strides, vk.strides, vv.strides, vc.strides, vout.strides
    return {
        "q_sb": q_st[0],
        "q_ss": q_st[1],
        "q_sh": q_st[2],
        "k_sb": k_st[0],
        "k_ss": k_st[1],
        "k_sh": k_st[2],
        "v_sb": v_st[0],
        "v_ss": v_st[1],
        "v_sh": v_st[2],
        "c_sb": c_st[0],
        "c_skv": c_st[1],
        "c_sh": c_st[2],
        "c_st": c_st[3],
        "cs_sb": table_strides[0] if vt.ndim == 3 and vt.shape[0] > 1 else 0,
        "cs_sp": table_strides[1],
        "qo_sb": qo_st[0],
        "qo_ss": qo_st[1],
        "qo_sh": qo_st[2],
        "inv_k_scale": 1.0 / c.scales[0],
        "inv_v_scale": 1.0 / c.scales[1],
        "inv_q_scale": 1.0 / c.q_static,
        "B": c.B,
        "S": c.S,
        "Hq": c.Hq,
        "Hkv": c.Hkv,
        "D": c.D,
        "R": c.R,
        "C": c.C,
        "P": c.P,
        "write_k_in_place": int(f.write_k_in_place),
        "group": group,
        "rows": rows,
        "index64": (
            int(vlens is not None and vlens.dtype == INT64)
            | 2 * int(vpos is not None and vpos.dtype == INT64)
        ),
        "mrope_interleaved": int(f.mrope_interleaved),
        "items": items,
    }


def _option_values(a, sections):
    """The record's option fields when an option is used."""
    vqs, vcs, vscale = a.q_scale_out, a.kv_cache_scales, a.kv_scale
    qs_strides = vqs.strides if vqs is not None else (0, 0, 0)
    cs_strides = vcs.strides if vcs is not None else (0, 0, 0, 0)
    return {
        "qs_sb": qs_strides[0],
        "qs_ss": qs_strides[1],
        "qs_sh": qs_strides[2],
        "ks_sb": cs_strides[0],
        "ks_skv": cs_strides[1],
        "ks_sh": cs_strides[2],
        "ks_st": cs_strides[3],
        "mrope": int(bool(sections)),
        "mrope_t": sections[0] if sections else 0,
        "mrope_h": sections[1] if sections else 0,
        "mrope_w": sections[2] if sections else 0,
        "v_scale_index": int(vscale is not None and vscale.ndim == 1),
        "q_full": int(a.q_out is not None),
        "q_dynamic": int(vqs is not None),
        "kv_dynamic": int(vcs is not None),
    }


# made once (a first call copies or reads them): the slots of the arguments every call gives
# (q .. cos_sin_cache), the option fields when no option is used (no q_out, computed scales,
# mRoPE or kv_scale array); the written arrays and the in-place pair follow from the declaration
# (the end of this module)
_Q_IN_PLACE = (ck.argument_indices(ARRAYS, "q"), 0)
_ARGUMENT_SLOTS = {f: (i, 0) for i, f in enumerate(FIELDS[: ARRAYS.index("kv_end_lens")])}
# (argument, field, slot) of the optional arrays' pointer fields: _launch adds those given
_OPTIONAL_SLOTS = tuple((i, FIELDS[i], (i, 0)) for i in range(len(_ARGUMENT_SLOTS), len(FIELDS)))
_NO_OPTIONS = dict.fromkeys(
    (
        "qs_sb",
        "qs_ss",
        "qs_sh",
        "ks_sb",
        "ks_skv",
        "ks_sh",
        "ks_st",
        "mrope",
        "mrope_t",
        "mrope_h",
        "mrope_w",
        "v_scale_index",
        "q_full",
        "q_dynamic",
        "kv_dynamic",
    ),
    0,
)
_TABLE_NDIMS = (2, 3)

_FLAGS = [
    ("write_k_in_place", FLAG),
    ("is_neox", FLAG),
    ("enable_pdl", FLAG),
    ("kv_scale", KEY),
    ("tuning", AS_IS),
    ("mrope_section", KEY),
    ("mrope_interleaved", FLAG),
    ("q_scale", KEY),
]
_Views = collections.namedtuple("_Views", ARRAYS)
_Flags = collections.namedtuple("_Flags", [name for name, _ in _FLAGS])
_OP = Op("apply_rope_write_kv", ARRAYS, _prepare, flags=_FLAGS)


def _check_indices(vlens, vpos, B, S, C, P, mrope=False):
    """``ROPEKV_CHECK_INDICES``: IndexError for the first token the kernel would skip (padding,
    a negative position id, aside; with mRoPE, a negative id on any axis). Tokens never share a
    cache row here (b is a cache dim)."""
    s = np.arange(S)
    if vlens is None:
        slot = np.broadcast_to(s, (B, S))
    else:
        lens = ck.host_copy(vlens).astype(np.int64)
        slot = lens[:, None] - S + s[None, :]
    pos = slot if vpos is None else ck.host_copy(vpos).astype(np.int64)
    if mrope:  # the largest of the three positions stands for the token
        live, pos = (pos >= 0).all(axis=0), pos.max(axis=0)
    else:
        live = np.ones((B, S), bool) if vpos is None else pos >= 0
    bad_slot = live & ((slot < 0) | (slot >= C))
    bad_pos = live & ((pos < 0) | (pos >= P))
    bad = np.flatnonzero(bad_slot | bad_pos)
    if not bad.size:
        return
    b, t = divmod(int(bad[0]), S)
    if bad_slot[b, t]:
        end = "" if vlens is None else f" (kv_end_lens[{b}]={int(lens[b])})"
        raise IndexError(
            f"token (b={b}, s={t}) lands in cache slot {int(slot[b, t])}, outside [0, C={C}){end}"
        )
    raise IndexError(
        f"token (b={b}, s={t}) has RoPE position {int(pos[b, t])}, outside the "
        f"cos_sin_cache's [0, P={P})"
    )


# ---- the declaration (ropekv/_declare.py): the torch and JAX forms follow from it -------------

DECLARATIONS = (
    decl.Declaration(
        "apply_rope_write_kv",
        (
            decl.array("q", shape=("(B, S, Hq, D)",), dtypes=INPUT_DTYPES),
            decl.array(
                "k", written_when="write_k_in_place", shape=("(B, S, Hkv, D)",), dtypes=("q",)
            ),
            decl.array("v", shape=("(B, S, Hkv, D)",), dtypes=("q",)),
            decl.written(
                "kv_cache", shape=("(B, 2, Hkv, C, D)",), dtypes=("q", *SCALED_CACHE_DTYPES)
            ),
            decl.array("cos_sin_cache", shape=("(P, R)", "(Bc, P, R)"), dtypes=(FLOAT32,)),
            decl.array("kv_end_lens", optional=True, shape=("(B,)",), dtypes=INDEX_DTYPES),
            decl.array(
                "position_ids", optional=True, shape=("(B, S)", "(3, B, S)"), dtypes=INDEX_DTYPES
            ),
            decl.scalar(
                "kv_scale",
                "floats_or_tensor",
                None,
                parts=("kv_scale", "kv_scales"),
                shape=("(2,)", "()"),
                dtypes=(FLOAT32,),
            ),
            decl.scalar("write_k_in_place", "bool", False),
            decl.scalar("is_neox", "bool", True),
            decl.scalar("mrope_section", "ints", None, check=section_list),
            decl.scalar("mrope_interleaved", "bool", False),
            decl.out(
                "q_out",
                into="q",
                default_into=True,
                shape=("(B, S, Hq, D)",),
                dtypes=("q", *FP8_DTYPES),
            ),
            decl.scalar("q_scale", "float", None),
            decl.written("q_scale_out", optional=True, shape=("(B, S, Hq)",), dtypes=(FLOAT32,)),
            decl.written(
                "kv_cache_scales", optional=True, shape=("(B, 2, Hkv, C)",), dtypes=(FLOAT32,)
            ),
            decl.scalar("enable_pdl", "bool", False),
        ),
    ),
)
# the launch's roles, from the declaration: the arrays written when given (q_out, or q itself
# without one: q_out's default is q), k too with write_k_in_place; the pair that may be one array
_WRITTEN_OUT = DECLARATIONS[0].launch_written(ARRAYS)
_WRITTEN_Q = tuple(sorted(ARRAYS.index("q") if i == Q_OUT else i for i in _WRITTEN_OUT))
_WRITTEN_K = DECLARATIONS[0].launch_written_when(ARRAYS)
_INPLACE = DECLARATIONS[0].launch_in_place(ARRAYS)
