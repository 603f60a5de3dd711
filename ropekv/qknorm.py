"""``qk_rmsnorm_rope_append_paged_kv_cache``: Qwen3-style per-head RMSNorm of Q and K, RoPE, and
the K/V append into a paged cache over a ragged batch, in one launch."""

from __future__ import annotations

import collections
import functools
from typing import NamedTuple

import numpy as np

from ropekv import _checks as ck
from ropekv import _declare as decl
from ropekv import reference
from ropekv._arrays import BFLOAT16, FLOAT16, FLOAT32, FP8_DTYPES, HOST, INT32, INT64
from ropekv._compile import c_bool, c_type, name_expression, rope_instantiations
from ropekv._launch import (
    AS_IS,
    FLAG,
    KEY,
    Launch,
    Op,
    Output,
    ParamStruct,
    Plan,
    division_fields,
    dtype_key,
    given_or_new,
)
from ropekv._mrope import check_mrope, check_mrope_indices, check_status, section_list
from ropekv._types import ArrayLike, StreamLike
from ropekv._vector import vector_width, widest_aligned

INT8 = reference.INT8
STEM = "qknorm"
KERNEL = "qk_rmsnorm_rope_append"
DECODE_KERNEL = "qk_rmsnorm_rope_decode"
FLAT_KERNEL = "qk_rmsnorm_rope_decode_flat"  # the decode kernel over flat (token, head) rows
ROWS_KERNEL = "qk_rmsnorm_rope_decode_rows"  # a warp per token, several rows a lane
ROWS_STEPS = (1, 2, 3, 4)  # its kernels by the rows a lane holds (U, a template constant)
FLAT_WIDTHS = (8, 4)  # its elements per lane: 16-byte lanes, or 8-byte lanes for the fewest tokens
DECODE_DIMS = (64, 128, 256)  # head dims with a decode kernel (full-width RoPE, 16-byte lanes)
# requests (= tokens) of the calls whose decode kernel takes the decode guess (guesses)
GUESS_REQUESTS = (32, 512)
INT32_EXTENT = 2**31  # arrays whose element offsets stay below this take 32-bit offset math
INPUT_DTYPES = (FLOAT16, BFLOAT16)
KV_LAYOUTS = tuple(decl.PAGED_LAYOUTS)
NORM_ORDERS = ("before_rope", "after_rope")

PARAMS = ParamStruct(
    "QKNormParams",
    [
        *(
            (n, np.uint64)
            for n in (
                "q",
                "q_out",
                "k",
                "v",
                "q_gamma",
                "k_gamma",
                "cos_sin",
                "offsets",
                "cache_lengths",
                "block_table",
                "k_cache",
                "v_cache",
                "position_ids",
                "status",
                "q_scale_out",
                "k_scales",
                "v_scales",
            )
        ),
        *(
            (n, np.int64)
            for n in (
                "q_st",
                "q_sh",
                "qo_st",
                "qo_sh",
                "k_st",
                "k_sh",
                "v_st",
                "v_sh",
                "cs_sp",
                "bt_sb",
                "kc_sp",
                "kc_se",
                "kc_sh",
                "vc_sp",
                "vc_se",
                "vc_sh",
                "num_pages",
                "pid_st",
            )
        ),
        *((n, np.float32) for n in ("epsilon", "weight_offset", "inv_k_scale", "inv_v_scale")),
        *(
            (n, np.int32)
            for n in (
                "T",
                "B",
                "Hq",
                "Hkv",
                "D",
                "R",
                "P",
                "max_pages",
                "page_size",
                "q_gamma_f32",
                "k_gamma_f32",
                "group",
                "rows",
                "post",
                "clear",
                "mrope",
                "mrope_t",
                "mrope_h",
                "mrope_w",
                "mrope_interleaved",
                "pos64",
                "check",
            )
        ),
        # the quantizing kernels' fields, last (the plain kernels' fields keep their offsets)
        ("q_dynamic", np.int32),
        ("kv_dynamic", np.int32),
        ("inv_q_scale", np.float32),
        *(
            (n, np.int64)
            for n in ("qs_st", "qs_sh", "ks_sp", "ks_se", "ks_sh", "vs_sp", "vs_se", "vs_sh")
        ),
        # the decode kernels' divisions by a token's head rows and by page_size (division_magic)
        ("h_magic", np.uint32),
        ("pg_magic", np.uint32),
        ("h_shift", np.int32),
        ("pg_shift", np.int32),
    ],
)
# The decode kernels' record (QKDecodeParams): the fields of PARAMS they read, in PARAMS's order,
# packed from the same values: 5 constant-bank lines of 64 bytes instead of 7 (the kernel's note).
_DECODE_FIELDS = (
    *PARAMS.names[:10],  # q .. block_table
    "k_cache",
    "v_cache",
    *PARAMS.names[17:34],  # q_st .. num_pages
    "epsilon",
    "inv_k_scale",
    "inv_v_scale",
    "T",
    "B",
    "Hq",
    "Hkv",
    "P",
    "max_pages",
    "page_size",
    "h_magic",
    "pg_magic",
    "h_shift",
    "pg_shift",
)
DECODE_PARAMS = ParamStruct("QKDecodeParams", [f for f in PARAMS.fields if f[0] in _DECODE_FIELDS])
# The record of the decode kernels that store fp8 q (QKDecodeQParams): DECODE_PARAMS's fields and
# the q scale's, in PARAMS's order (the plain decode kernels' record and lines stay as they are).
_QDECODE_FIELDS = (*_DECODE_FIELDS, "q_scale_out", "q_dynamic", "inv_q_scale", "qs_st", "qs_sh")
QDECODE_PARAMS = ParamStruct(
    "QKDecodeQParams", [f for f in PARAMS.fields if f[0] in _QDECODE_FIELDS]
)
# fp8 q types with decode kernels (e5m2 q takes the quantizing generic kernel: compile time)
DECODE_Q_DTYPES = FP8_DTYPES[:1]
MAX_GROUP = 32  # lanes per head row: one chunk each, a row within a warp
ROWS = (1, 2, 4)  # kernels by the head rows one lane group can hold (their register budgets)
MAX_BLOCK = 512  # __launch_bounds__

# Launch shape (H200). A token has H = Hq + 2 Hkv head rows (Q, K, V), one lane group per row.
# Few tokens (decode): blocks of `block` threads, each lane group one row (or a few when that
# keeps the grid within `wave_blocks`), a token's rows split over several blocks so the grid fills
# the GPU; below `narrow_below` tokens at a vector width of at most `narrow_width` elements (more
# lanes per row, shorter per-thread work). Many tokens (prefill): about `prefill_rows` rows per
# lane group, a token's rows over as few blocks of at most `max_block` threads as that allows,
# balanced (Qwen3-32B's 80 rows: 2 blocks of 40; Qwen3-8B's 48: 2 of 24). Tokens of at least
# `prefill_rows_many_from` rows (0: never) take `prefill_rows_many` rows a lane group instead:
# side by side on the H200 (CUDA events, 8 x 1024, us, 4 rows against 2), Qwen3-32B's 80 rows
# bf16 / e4m3 cache 104.2 / 102.1 against 106.4 / 105.4, but 32 / 8 heads' 48 rows 68.9 against
# 63.8.
TUNING = {
    "block": 128,
    "wave_blocks": 660,
    "prefill_rows": 2,
    "prefill_rows_many": 4,
    "prefill_rows_many_from": 64,
    "max_block": 160,
    "narrow_below": 32,
    "narrow_width": 4,
    # the decode kernels (`_decode_kernel`). The (T, splits) kernel: up to `decode_tokens` tokens
    # (0: never), grid (T, ceil(H / rows)), blocks of up to `decode_rows` head rows. The flat
    # kernel (`decode_flat` 1): rows of every token in one sequence, ceil(T H / rows) blocks, no
    # idle lanes whatever H (needs 32-bit offsets, else the (T, splits) kernel). It runs below
    # `flat_below` tokens where a token has more than `decode_heads` head rows (H = Hq + 2 Hkv),
    # and past `decode_tokens` tokens where it has at most that many (Tensor-parallel heads, 8 /
    # 1: 10 rows; their prefill); 4 elements per lane below `decode_narrow_below` tokens (8
    # otherwise), blocks made smaller (down to one warp) while the grid has fewer than
    # `decode_min_blocks` blocks. H200, us (decode: graph replay; 8 x 1024: CUDA events), flat /
    # (T, splits) or general kernel: 64 / 8 heads 1, 16, 64, 256 tokens 1.9 / 2.0, 2.1 / 2.2, 2.9
    # / 2.8, 6.2 / 5.9; 8 / 1 heads 4, 64, 256 tokens 2.0 / 1.8, 2.6 / 2.5, 3.2 / 3.3, 8 x 1024
    # 16.2 / 24.0.
    "decode_tokens": 128,
    "decode_rows": 16,
    "decode_flat": 1,
    "flat_below": 17,
    "decode_heads": 16,
    "decode_narrow_below": 32,
    "decode_min_blocks": 32,
    # few-head decode (H <= decode_heads) in the (T, splits) kernel up to `few_head_tokens`
    # tokens (past decode_tokens), in blocks of the fewest whole warps that hold a token's H rows
    # (12 rows for 8 / 1 heads' 10 at D 128, not decode_rows' 16) from `few_head_rows_from`
    # tokens. With the decode guess, in one process on the H200 (`ropekv bench --tune`, graph
    # replay, 8 / 1 heads, bf16 and e4m3 caches, time against the flat kernel past 128 tokens and
    # 16-row blocks): 256 tokens 0.88-0.91x (0.92-0.94x with 16-row blocks), 128 tokens
    # 0.98-0.99x, 64 tokens 1.00x, 1-16 tokens 1.06-1.08x (hence from 128 tokens only).
    "few_head_tokens": 256,
    "few_head_rows_from": 128,
    # few-head decode (H <= decode_heads: Tensor-parallel 8 / 1 heads, 10 rows a token) in the
    # (T, splits) range: from `tp_flat_from` tokens (0: never, the (T, splits) kernel as before)
    # up to decode_tokens tokens, or up to `tp_flat_to` past them (0: the flat kernel's shape
    # above from decode_tokens + 1), the flat kernel at `tp_flat_width` elements a lane (4: 16
    # lanes of a D 128 neox row, 2 rows a warp, where the (T, splits) kernel and the flat one
    # past decode_narrow_below give a warp 4) and blocks of `tp_flat_rows` rows (made smaller
    # below decode_min_blocks blocks, as above): twice the warps for the same rows, as Cake
    # spreads them (ncu, TP 256 x 1: ropekv 160 blocks x 128, 4.8 warps / SM; Cake 384 x 128,
    # 8.8 warps / SM, the same instruction count). Side by side on the H200 (graph replay, TP 8 / 1
    # heads, bf16 cache): 64 tokens 2.4 against 2.5 us, 256 tokens (tp_flat_to 256) 3.1 against
    # 3.2-3.3; 1-16 tokens unchanged (tp_flat_from 1 took 1 / 4 tokens 0.1 us slower). Off
    # since the decode guess (GUESS_REQUESTS): with it, in one process on the H200 (`ropekv
    # bench --tune qknorm.tp_flat_from=0`, graph replay), the kernels without the spread shape
    # took 0.95-0.96x its time at 16 / 64 / 128 tokens (bf16 and e4m3 caches; 64 tokens 2.1
    # against 2.2 us) and 0.99-1.01x at 256.
    "tp_flat_from": 0,
    "tp_flat_to": 256,
    "tp_flat_width": 4,
    "tp_flat_rows": 8,
    # the token-rows decode kernel (`_rows_launch`, `decode_by_token` 1; 0: the kernels above,
    # as before it): a warp per token holding S U of its head rows (S = 32 / lanes per row, 4 at
    # D 128 neox; U steps), the request search, position and page once per warp and the cos/sin
    # values and weights once per lane for its U rows. Plain calls of up to `rows_tokens` tokens
    # with 32-bit offsets. U: `rows_per_lane` (1-4), or with 0 the smallest U whose grid has at
    # most `rows_warps` warps (4 past it), then balanced over the warps a token takes; blocks of
    # up to `rows_block_warps` warps (tokens). U is a template constant (ROWS_STEPS). It takes
    # calls of at least `rows_from` head rows (T x (Hq + 2 Hkv)): side by side on the H200 (graph
    # replay, us, this kernel against the kernels above) it lost below that (Qwen3-32B 64 / 8
    # heads 1 / 16 / 64 / 128 tokens 2.1 / 2.4 / 3.4 / 4.1 against 1.9 / 2.2 / 2.8 / 3.5; 8 / 1
    # heads 2.1-3.5 against 1.8-3.2 at 1-256 tokens) and won at 256 x 80 rows (5.2 against 5.8).
    "decode_by_token": 1,
    "rows_from": 16384,
    "rows_tokens": 256,
    "rows_per_lane": 0,
    "rows_warps": 512,
    "rows_block_warps": 4,
}


def kernel_rows(rows):
    """The smallest kernel ROWS that holds ``rows`` rows per lane group."""
    return next(r for r in ROWS if r >= rows)


def launch_shape(T, H, group):
    """(block, rows, splits) for T tokens of H head rows at ``group`` lanes per row: grid (T,
    splits), ``rows`` rows per lane group (the kernel's ROWS is ``kernel_rows(rows)``)."""
    slots = TUNING["block"] // group
    for rows in ROWS:
        splits = -(-H // (slots * rows))
        if T * splits <= TUNING["wave_blocks"]:
            return TUNING["block"], -(-H // (slots * splits)), splits
    per_warp = 32 // group  # lane groups per warp: blocks are whole warps
    many = 0 < TUNING["prefill_rows_many_from"] <= H
    target = TUNING["prefill_rows_many" if many else "prefill_rows"]
    max_slots = max(per_warp, min(TUNING["max_block"], MAX_BLOCK) // group // per_warp * per_warp)
    splits = -(-H // (max_slots * target))
    per_block = -(-H // splits)  # rows of one block, balanced
    slots = min(max_slots, -(-per_block // (target * per_warp)) * per_warp)
    rows = min(ROWS[-1], -(-per_block // slots))
    return slots * group, rows, -(-H // (slots * rows))


@functools.cache  # a plan's lookup spells it once per first call
def expression(dtype, cache_dtype, is_neox, n, rows=1, opts=0, q_dtype=None):
    """``opts``: 0 the plain kernel (every option compiled out, so they cost nothing when off);
    1 the one that reads the light options (norm order, weight offset, tail clearing, status);
    2 that one with mRoPE too. ``q_dtype``: None for those; else the dtype q is stored in, and
    the kernel also compiles in fp8 q and computed scales (fp8 q with a static or dynamic scale,
    per-token-head KV scales); those kernels come with ``opts`` 0 or 2 only: quantizing alone
    runs without the options' code, with any other option it runs the kernel of them all (a
    third set of quantizing kernels would cost compile time for little)."""
    quant = q_dtype is not None
    return name_expression(
        KERNEL,
        c_type(dtype),
        c_type(cache_dtype),
        c_type(q_dtype if quant else dtype),
        c_bool(is_neox),
        n,
        rows,
        int(opts),
        c_bool(quant),
    )


def decode_expression(dtype, cache_dtype, is_neox, D, gamma_f32, i32, guess=False, q_dtype=None):
    """The decode kernel: head dim ``D`` (one of DECODE_DIMS), float32 RMSNorm weights or
    weights of ``dtype``, 32-bit or 64-bit offsets; ``guess``: the decode guess for the request
    search (:func:`guesses`); ``q_dtype``: q stored as this fp8 type (DECODE_Q_DTYPES; a static
    or computed scale), None: as ``dtype``."""
    return name_expression(
        DECODE_KERNEL,
        c_type(dtype),
        c_type(cache_dtype),
        c_bool(is_neox),
        D,
        c_bool(gamma_f32),
        c_bool(i32),
        c_bool(guess),
        *(() if q_dtype is None else (c_type(q_dtype),)),
    )


def flat_expression(dtype, cache_dtype, is_neox, D, gamma_f32, n, guess=False, q_dtype=None):
    """The flat decode kernel (32-bit offsets): head dim ``D`` (one of DECODE_DIMS), ``n``
    elements per lane (one of FLAT_WIDTHS); ``guess`` and ``q_dtype`` as for
    :func:`decode_expression`."""
    return name_expression(
        FLAT_KERNEL,
        c_type(dtype),
        c_type(cache_dtype),
        c_bool(is_neox),
        D,
        c_bool(gamma_f32),
        n,
        c_bool(guess),
        *(() if q_dtype is None else (c_type(q_dtype),)),
    )


def rows_expression(dtype, cache_dtype, is_neox, D, gamma_f32, rows, guess=False):
    """The token-rows decode kernel (32-bit offsets, 8 elements a lane): head dim ``D`` (one of
    DECODE_DIMS), ``rows`` (one of ROWS_STEPS) rows a lane; ``guess`` as for
    :func:`decode_expression`."""
    return name_expression(
        ROWS_KERNEL,
        c_type(dtype),
        c_type(cache_dtype),
        c_bool(is_neox),
        D,
        c_bool(gamma_f32),
        rows,
        c_bool(guess),
    )


def guesses(T, B):
    """Whether a decode kernel takes its request search from the decode guess (token t in
    request t, checked against the binary search's own path: ``kernels/common.cuh``,
    ``RequestGuess``): calls of as many tokens as requests, from GUESS_REQUESTS[0] requests (the
    search among the lanes below) to GUESS_REQUESTS[1] (the kernels' ``kStageMax``: the path's
    probes fit its slots). The other calls take kernels without its code, which measured faster
    where it does not run (Qwen3-32B one to 16 tokens 1.03-1.07x the time with it compiled in)."""
    return T == B and GUESS_REQUESTS[0] <= B <= GUESS_REQUESTS[1]


def flat_lanes(D, is_neox, n):
    """Lanes per head row of the flat decode kernel at ``n`` elements per lane (None past a
    warp)."""
    lanes = D // (2 * n) if is_neox else D // n
    return lanes if lanes <= MAX_GROUP else None


def instantiations():
    """Every kernel instantiation a call can select (the compile tests build them all)."""
    for dtype in INPUT_DTYPES:
        for cache_dtype in (dtype, *FP8_DTYPES):
            for is_neox in (True, False):
                for D in DECODE_DIMS:
                    for gamma_f32 in (True, False):
                        for rows in ROWS_STEPS:
                            for guess in (False, True):
                                yield rows_expression(
                                    dtype, cache_dtype, is_neox, D, gamma_f32, rows, guess
                                )
    for dtype in INPUT_DTYPES:
        for cache_dtype in (dtype, *FP8_DTYPES):
            for is_neox in (True, False):
                for D in DECODE_DIMS:
                    for gamma_f32 in (True, False):
                        for n in FLAT_WIDTHS:
                            if not flat_lanes(D, is_neox, n):
                                continue
                            for guess in (False, True):
                                for q_dtype in (None, *DECODE_Q_DTYPES):
                                    yield flat_expression(
                                        dtype, cache_dtype, is_neox, D, gamma_f32, n, guess, q_dtype
                                    )
    for dtype in INPUT_DTYPES:
        for cache_dtype in (dtype, *FP8_DTYPES):
            for is_neox in (True, False):
                for D in DECODE_DIMS:
                    for gamma_f32 in (True, False):
                        for i32 in (True, False):
                            for guess in (False, True):
                                for q_dtype in (None, *DECODE_Q_DTYPES):
                                    yield decode_expression(
                                        dtype,
                                        cache_dtype,
                                        is_neox,
                                        D,
                                        gamma_f32,
                                        i32,
                                        guess,
                                        q_dtype,
                                    )
    for rows in ROWS:
        for opts in (0, 1, 2):
            yield from rope_instantiations(
                lambda *a, r=rows, o=opts: expression(*a, r, o), INPUT_DTYPES, FP8_DTYPES
            )
    for rows in ROWS:
        for opts in (0, 2):
            for dtype in INPUT_DTYPES:
                for q_dtype, cache_dtype in quant_pairs(dtype):
                    for is_neox in (True, False):
                        for n in (8, 4, 2, 1) if is_neox else (8, 4, 2):
                            yield expression(dtype, cache_dtype, is_neox, n, rows, opts, q_dtype)


def quant_pairs(dtype):
    """(q dtype, cache dtype) of the quantizing kernels for inputs of ``dtype``: q in ``dtype``
    with an fp8 or int8 cache (per-token-head scales), or fp8 q with a cache in ``dtype`` or
    fp8. fp8 q with an int8 cache (no attention kernel reads that pair) is refused."""
    yield from ((dtype, c) for c in (*FP8_DTYPES, INT8))
    yield from ((q, c) for q in FP8_DTYPES for c in (dtype, *FP8_DTYPES))


def _kv_scales(kv_scale, cache_dtype):
    """(k_scale, v_scale) from a float or a pair; None for 16-bit caches."""
    if isinstance(kv_scale, tuple):
        if len(kv_scale) != 2:
            raise ValueError(
                f"kv_scale must be a float or a (k_scale, v_scale) pair, got {len(kv_scale)} values"
            )
        k, v = (
            ck.check_cache_scale(s, cache_dtype, f"kv_scale[{i}]") for i, s in enumerate(kv_scale)
        )
        return None if k is None else (k, v)
    s = ck.check_cache_scale(kv_scale, cache_dtype)
    return None if s is None else (s, s)


def qk_rmsnorm_rope_append_paged_kv_cache(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    q_gamma: ArrayLike,
    k_gamma: ArrayLike,
    cos_sin_cache: ArrayLike,
    input_row_offsets: ArrayLike,
    cache_lengths: ArrayLike,
    block_table: ArrayLike,
    paged_kv_cache: tuple[ArrayLike, ArrayLike],
    *,
    epsilon: float = 1e-6,
    is_neox: bool = True,
    kv_layout: str = "NHD",
    kv_scale: float | tuple[float, float] | None = None,
    q_out: ArrayLike | None = None,
    q_out_dtype: object = None,
    q_scale: float | None = None,
    q_scale_out: ArrayLike | None = None,
    kv_cache_scales: tuple[ArrayLike, ArrayLike] | None = None,
    norm_order: str = "before_rope",
    weight_offset: float = 0.0,
    clear_unused_last_page_rows: bool = False,
    position_ids: ArrayLike | None = None,
    mrope_section: tuple[int, int, int] | None = None,
    mrope_interleaved: bool = False,
    status: ArrayLike | None = None,
    layer_idx: int | None = None,
    enable_pdl: bool = False,
    stream: StreamLike | None = None,
) -> ArrayLike:
    """Qwen3-style attention input: RMS-normalise each Q and K head, rope both, and append K/V to
    a paged cache over a ragged batch, in one launch.

    Token ``t`` of request ``b`` has position ``p = cache_lengths[b] + t - input_row_offsets[b]``
    and is written to page ``block_table[b, p // page_size]``, entry ``p % page_size``, exactly as
    in :func:`ropekv.mla_rope_rmsnorm_append_paged_kv_cache`.

    Parameters
    ----------
    q : array, (T, Hq, D), float16 or bfloat16
    k, v : array, (T, Hkv, D), the dtype of ``q``
        Strided views (q, k, v sliced out of one packed qkv buffer) are read without copying.
    q_gamma, k_gamma : array, (D,), the dtype of ``q`` or float32
        RMSNorm weights of the Q and K heads.
    cos_sin_cache : array, (P, R), float32
        ``[:R/2]`` cos, ``[R/2:]`` sin; R even and at most D, dims ``[R, D)`` are normalised but not
        rotated.
    input_row_offsets : array, (B + 1,), int32 or uint32
    cache_lengths : array, (B,), int32
    block_table : array, (B, max_pages), int32
    paged_kv_cache : tuple (k_cache, v_cache)
        Each ``(num_pages, page_size, Hkv, D)`` for NHD or ``(num_pages, Hkv, page_size, D)`` for
        HND; dtype that of ``q``, float8_e4m3fn or float8_e5m2 (or int8, with
        ``kv_cache_scales``). Written in place; only the addressed rows change.
    epsilon : float
    is_neox : bool
        True (Qwen3) rotates half-split pairs (i, i + R/2); False interleaved pairs.
    kv_layout : "NHD" or "HND"
    kv_scale : float or (float, float), optional
        Dequantization scale(s) of an fp8 cache, for K and V (default 1.0): stored =
        fp8(x / scale), round to nearest even, saturating. Not accepted for 16-bit caches, nor
        with ``kv_cache_scales``.
    q_out : array, (T, Hq, D), the dtype of ``q``, float8_e4m3fn or float8_e5m2, optional
        Receives the normalised, roped queries; ``q`` itself means in place (same dtype). By
        default a new array of ``q_out_dtype`` in the caller's array type; any other array must
        not overlap an argument. An fp8 ``q_out`` stores each row quantized (``q_scale`` or
        ``q_scale_out``).
    q_out_dtype : dtype or str, optional
        The dtype of the new ``q_out``: ``q``'s (the default), ``float8_e4m3fn`` or
        ``float8_e5m2`` (a NumPy / ml_dtypes dtype, or its name). With a given ``q_out`` it may
        be left out, or must be that array's dtype.
    q_scale : float, optional
        Static dequantization scale of an fp8 ``q_out`` (default 1.0): stored =
        fp8(q / q_scale), round to nearest even, saturating (finite, positive; a constant of
        the launch, as ``kv_scale``). Not accepted for a 16-bit ``q_out``, nor with
        ``q_scale_out``.
    q_scale_out : array, (T, Hq), float32, optional
        Dynamic fp8 queries (FlashInfer Cake's ``quant_policy=1``): each q row (one token's
        head) is stored as ``fp8(q * (max_code / a))`` with ``a = max(max|q|, 1e-6)`` over the
        row after the norm and RoPE (``max_code`` 448 for e4m3, 57344 for e5m2), and its
        dequantization scale ``a / max_code`` is written here, so ``q ~ q_out * q_scale_out[...,
        None]`` (``docs/conventions.md``, "Computed scales"). Needs an fp8 ``q_out``; written in
        place, every row (those of tokens without a position too).
    kv_cache_scales : tuple (k_scales, v_scales), optional
        Per-token-head KV scales: float32 arrays of the caches' shape without D (NHD
        ``(num_pages, page_size, Hkv)``, HND ``(num_pages, Hkv, page_size)``). Each written K and
        V row is quantized with its own computed scale (as ``q_scale_out``'s rows, ``max_code``
        127 for int8) and that dequantization scale is written to the same slot here; slots the
        call does not write keep their bytes (with ``clear_unused_last_page_rows`` the cleared
        rows' slots become 0). The caches must be float8_e4m3fn, float8_e5m2 or int8; replaces
        ``kv_scale``. Written in place.
    norm_order : "before_rope" or "after_rope"
        ``"before_rope"`` (Qwen3, the default) normalises each head and then ropes it;
        ``"after_rope"`` ropes first and normalises the rotated row (FlashInfer Cake's
        ``qk_norm_policy=1``, TensorRT-Edge-LLM's ``qkNormPostRope``). A rotation keeps a row's
        sum of squares, so the two differ only in where ``gamma`` meets the rotation.
    weight_offset : float
        Added to every ``q_gamma`` and ``k_gamma`` value in float32 before use: 0.0 (default)
        uses the weights as they are, 1.0 gives Gemma's ``(1 + w)`` convention, whose
        checkpoints store ``w`` centred on 0. A number, not a ``gemma=`` flag, so it states the
        arithmetic rather than naming a model; finite and non-negative.
    clear_unused_last_page_rows : bool
        Also zero, in K and V, the rows of each request's last page past its new length
        ``cache_lengths[b] + input_row_offsets[b + 1] - input_row_offsets[b]`` (FlashInfer Cake's
        option of this name): attention kernels that read whole pages then meet zeros, not stale
        values or NaN. Done by the request's last token, so only when that token is written; a
        request with no new tokens clears nothing. Only the page the block table names for that
        token is touched (two requests naming one page leave its rows undefined).
    position_ids : array, (3, T), int32 or int64, optional
        mRoPE (Qwen2-VL, Qwen3-VL): each token's temporal, height and width positions; required
        with ``mrope_section`` and only used with it. They give the rotation; the cache slot
        still comes from ``cache_lengths`` (the positions cannot name it: a vision token's three
        positions are not its place in the sequence). A token with any of them outside
        ``[0, P)`` is treated as a token without a position (q copied, nothing written).
    mrope_section : (int, int, int), optional
        ``(t, h, w)`` rotary half-dims per axis, summing to R/2 (Qwen2-VL / Qwen3-VL configs'
        ``mrope_section``, e.g. ``(16, 24, 24)`` or ``(24, 20, 20)`` for R = 128). Half-dim i
        uses the temporal position for ``i < t``, height for ``t <= i < t + h``, width otherwise.
    mrope_interleaved : bool
        Qwen3-VL's interleaved layout instead: half-dim i uses height when ``i % 3 == 1`` and
        ``i < 3h``, width when ``i % 3 == 2`` and ``i < 3w``, temporal otherwise.
    status : array, (1,), int32, optional
        Validate ``input_row_offsets`` on the device first, without a host synchronisation (so
        the call can be captured in a CUDA graph), as FlashInfer Cake's fp8 op does:
        ``status[0]`` receives 0 when they are well formed, else the code of the first failing
        check (1: ``offsets[0] != 0``; 2: an offset below the one before it; 3: ``offsets[-1]
        != T``), and then nothing else is written (the caches, ``q_out`` and, when ``q_out``
        is new, its contents undefined). Written in place.
    layer_idx : int, optional
        Multi-layer caches: ``k_cache`` and ``v_cache`` (and ``kv_cache_scales``' arrays, when
        given) then carry a leading ``(num_layers, ...)`` dimension, and only layer
        ``layer_idx`` (an int in ``[0, num_layers)``) is written (``docs/conventions.md``,
        "Multi-layer caches").
    enable_pdl : bool
        Launch with programmatic dependent launch (see :func:`ropekv.apply_rope_write_kv`).
    stream : CuPy stream, int ``cudaStream_t`` or object with ``cuda_stream``, optional
        By default torch's current stream for torch inputs, else CuPy's (``docs/conventions.md``).

    Returns
    -------
    q_out : array, (T, Hq, D)
        The normalised, roped queries (``q_out`` itself when given), in ``q_out_dtype``.

    Raises
    ------
    TypeError
        Arrays of a dtype not listed above, a ``q_out_dtype`` that is not one of its names or
        differs from a given ``q_out``, an fp8 ``q_out`` with an int8 cache, non-integer index
        arrays, or a ``stream`` of an unknown kind.
    ValueError
        Shapes that disagree (Hq not a multiple of Hkv, gammas not ``(D,)``, a page size of 0),
        ``paged_kv_cache`` or ``kv_cache_scales`` not a pair, ``position_ids`` without
        ``mrope_section``, both of a static / dynamic scale pair, an int8 cache without
        ``kv_cache_scales``, a ``layer_idx`` outside the caches' layers, a written array that
        overlaps another argument, or arrays on different devices.
    BufferError
        A written array exported read-only (or through a legacy DLPack capsule), memory not
        aligned to its item size, rows starting at odd elements with ``is_neox=False``, or a head
        dim too wide for a lane group at the rows' alignment.
    IndexError
        Only with ``ROPEKV_CHECK_INDICES=1``: offsets that decrease or run past T, a token outside
        every request, a position outside the table, a page outside ``block_table`` or the
        cache, or two tokens writing one cache row.

    Notes
    -----
    Each head row becomes ``rope(x / sqrt(mean(x^2) + epsilon) * gamma)`` (``norm_order=
    "after_rope"``: ``rope(x) / sqrt(mean(x^2) + epsilon) * gamma``) with ``gamma = weight +
    weight_offset``, in float32 and rounded once (Hugging Face's Qwen3 rounds to the model dtype
    between the norm and the rope; this does not). V is written unchanged (quantized for fp8
    caches). A token outside every request, or whose position falls outside ``[0, P)``, has its q
    row copied unchanged and writes nothing; a token whose page is outside the block table row or
    the cache is normalised and roped but writes nothing. ``ROPEKV_CHECK_INDICES=1`` raises
    ``IndexError`` for such tokens instead. NumPy inputs run the NumPy reference on the host.

    Examples
    --------
    With NumPy arrays (the NumPy reference, on the host): one request, 7 tokens cached, 5 new
    ones at positions 7..11 of page 2.

    >>> import numpy as np, ropekv
    >>> T, Hq, Hkv, D = 5, 32, 8, 128
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((T, Hq, D)).astype(np.float16)
    >>> k, v = (rng.standard_normal((T, Hkv, D)).astype(np.float16) for _ in range(2))
    >>> gamma = np.ones(D, np.float32)
    >>> caches = tuple(np.zeros((4, 16, Hkv, D), np.float16) for _ in range(2))
    >>> q_out = ropekv.qk_rmsnorm_rope_append_paged_kv_cache(
    ...     q, k, v, gamma, gamma, ropekv.cos_sin_cache(4096, D, base=1e6),
    ...     np.array([0, 5], np.int32), np.array([7], np.int32), np.array([[2, 0]], np.int32),
    ...     caches)
    >>> q_out.shape, bool((caches[1][2, 7:12] == v).all())
    ((5, 32, 128), True)

    fp8 queries with a dynamic scale per token and head (each row's largest value maps onto
    e4m3's largest code, 448; ``q_out * q_scale_out[..., None]`` recovers the queries):

    >>> q_scale_out = np.empty((T, Hq), np.float32)
    >>> q8 = ropekv.qk_rmsnorm_rope_append_paged_kv_cache(
    ...     q, k, v, gamma, gamma, ropekv.cos_sin_cache(4096, D, base=1e6),
    ...     np.array([0, 5], np.int32), np.array([7], np.int32), np.array([[2, 0]], np.int32),
    ...     caches, q_out_dtype="float8_e4m3fn", q_scale_out=q_scale_out)
    >>> q8.dtype.name, float(np.abs(q8.astype(np.float32)).max())
    ('float8_e4m3fn', 448.0)

    The same call with CuPy arrays runs the CUDA kernel (needs a GPU):

    >>> import cupy as cp  # doctest: +SKIP
    >>> dev = [cp.asarray(x) for x in (q, k, v, gamma, gamma)]  # doctest: +SKIP
    >>> q_out = ropekv.qk_rmsnorm_rope_append_paged_kv_cache(  # doctest: +SKIP
    ...     *dev, ropekv.cos_sin_cache(4096, D, base=1e6, xp=cp),
    ...     cp.array([0, 5], cp.int32), cp.array([7], cp.int32), cp.array([[2, 0]], cp.int32),
    ...     tuple(cp.zeros((4, 16, Hkv, D), cp.float16) for _ in range(2)))
    """
    if not isinstance(paged_kv_cache, (tuple, list)) or len(paged_kv_cache) != 2:
        raise ValueError(
            f"paged_kv_cache must be a tuple (k_cache, v_cache), got "
            f"{type(paged_kv_cache).__name__}"
        )
    if kv_cache_scales is not None and (
        not isinstance(kv_cache_scales, (tuple, list)) or len(kv_cache_scales) != 2
    ):
        raise ValueError(
            f"kv_cache_scales must be a tuple (k_scales, v_scales), got "
            f"{type(kv_cache_scales).__name__}"
        )
    kv_cache_scales = (None, None) if kv_cache_scales is None else kv_cache_scales
    return _OP(
        (
            q,
            k,
            v,
            q_gamma,
            k_gamma,
            cos_sin_cache,
            input_row_offsets,
            cache_lengths,
            block_table,
            *paged_kv_cache,
            q_out,
            position_ids,
            status,
            q_scale_out,
            *kv_cache_scales,
        ),
        (
            epsilon,
            is_neox,
            kv_layout,
            kv_scale,
            enable_pdl,
            tuple(TUNING.values()),
            norm_order,
            weight_offset,
            clear_unused_last_page_rows,
            mrope_section,
            mrope_interleaved,
            q_out_dtype,
            q_scale,
        ),
        stream,
        layer_idx,
    )


def _q_quant(q_dtype, q_scale, vqs, T, Hq):
    """(q_scale, dynamic) of the q output: its static scale (1.0 for fp8; None for 16-bit) and
    whether ``q_scale_out`` receives computed scales."""
    if vqs is None and q_scale is None:  # no scale given: check_q_scales has nothing to check
        return (1.0 if q_dtype in FP8_DTYPES else None), False
    ck.check_q_scales(
        q_dtype,
        "q_out",
        "q_scale",
        q_scale is not None,
        vqs,
        (T, Hq),
        "(T, Hq)",
        hint=" (pass q_out_dtype='float8_e4m3fn' or an fp8 q_out)",
    )
    if vqs is not None:
        return None, True
    if q_dtype not in FP8_DTYPES:
        return None, False
    return (1.0 if q_scale is None else ck.check_float(q_scale, "q_scale", positive=True)), False


def _cache_scale_arrays(vks, vvs, vkc, kv_scale, expected, layout):
    """Whether per-token-head KV scales are given, after checking them against the caches
    (``expected``: the caches' shape, spelled ``layout``)."""
    if vks is None and vkc.dtype != INT8:  # none given, none needed: nothing to check
        return False
    ck.check_cache_scales(
        vkc.dtype,
        "k_cache",
        "kv_scale",
        kv_scale is not None,
        vks is not None,
        "(k_scales, v_scales)",
    )
    if vks is None:
        return False
    spelled = layout.replace(", D)", ")")
    shape = expected[:3]
    ck.check_scale_array(vks, shape, spelled)
    ck.check_scale_array(vvs, shape, spelled)
    return True


def _check_qkv(vq, vk, vv):
    """The checks of q, k and v, in order (each raises its own message)."""
    ck.check_ndim(vq, 3, "(T, Hq, D)")
    ck.check_dtype(vq, INPUT_DTYPES)
    T, _Hq, D = vq.shape
    ck.check_ndim(vk, 3, "(T, Hkv, D)")
    Hkv = vk.shape[1]
    ck.check_shape(vk, (T, None, D), "(T, Hkv, D)")
    ck.check_shape(vv, (T, Hkv, D), "(T, Hkv, D)")
    ck.check_same_dtype(vk, vq)
    ck.check_same_dtype(vv, vq)


class _Checked(NamedTuple):
    """What the checks of a first call derive: sizes, the validated scalars and scales, the q
    output's dtype and the device."""

    post: bool  # norm_order "after_rope"
    weight_offset: float
    epsilon: float
    T: int
    Hq: int
    Hkv: int
    D: int
    P: int
    R: int
    sections: tuple | None
    B: int
    max_pages: int
    num_pages: int
    page_size: int
    kv_dynamic: bool
    k_scale: float
    v_scale: float
    q_dtype: np.dtype
    q_scale: float | None
    q_dynamic: bool
    device: int


def _prepare(views, flags):
    """Validate a first call (:func:`_check`), choose the vector width and launch shape
    (:func:`_choose`) and pack the launch plan (:func:`_pack`), or the NumPy backend run."""
    a, f = _Views._make(views), _Flags._make(flags)
    c = _check(a, f)
    written = _WRITTEN  # those given: Op.first_call drops the others (q_out when new)
    outputs = [] if a.q_out is not None else [Output((c.T, c.Hq, c.D), c.q_dtype)]
    plan = functools.partial(
        Plan, outputs=outputs, written=written, inplace=_INPLACE, result=_RESULT
    )
    if ck.check_indices_enabled():
        # with mRoPE the cache position needs no table row; the three positions are checked
        ck.check_paged_indices(
            a.input_row_offsets,
            a.cache_lengths,
            a.block_table,
            c.page_size,
            c.num_pages,
            c.T,
            c.P if c.sections is None else np.iinfo(np.int64).max,
        )
        if c.sections is not None:
            check_mrope_indices(a.position_ids, c.P)
    if c.device == HOST:
        return plan(HOST, host=_host_run(a, f, c))
    if c.T == 0 and a.status is None:
        return plan(c.device)
    return plan(c.device, [_pack(a, f, c, *_choose(a, f.is_neox, c))])


def _check(a, f):
    """Every check of a first call, in the order of the arguments' errors; a :class:`_Checked`."""
    vq, vk, vv, vt, vkc, vvc = a.q, a.k, a.v, a.cos_sin_cache, a.k_cache, a.v_cache
    ck.check_choice(f.kv_layout, "kv_layout", KV_LAYOUTS)
    ck.check_choice(f.norm_order, "norm_order", NORM_ORDERS)
    weight_offset = ck.check_float(f.weight_offset, "weight_offset", positive=False)

    # Tests of the common case first, read in the checkers' order; the checkers (which raise
    # their own messages) only where a test fails: this runs on every first call.
    if not (
        len(vq.shape) == 3
        and vq.dtype in INPUT_DTYPES
        and len(vk.shape) == 3
        and vk.shape[0] == vq.shape[0]
        and vk.shape[2] == vq.shape[2]
        and vv.shape == vk.shape
        and vk.dtype == vq.dtype
        and vv.dtype == vq.dtype
    ):
        _check_qkv(vq, vk, vv)
    T, Hq, D = vq.shape
    Hkv = vk.shape[1]
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"q's head count ({Hq}) must be a positive multiple of k's ({Hkv})")
    gamma_dtypes, gamma_shape = (vq.dtype, FLOAT32), (D,)
    for view in (a.q_gamma, a.k_gamma):
        if (
            view.shape != gamma_shape
            or view.dtype not in gamma_dtypes
            or view.strides != ck.UNIT_STRIDE
        ):  # (stride 1: contiguous)
            ck.check_shape(view, gamma_shape, "(D,)")
            ck.check_dtype(view, gamma_dtypes)
            ck.check_contiguous(view)
    P, R = ck.check_cos_sin_cache(vt, D)
    sections = check_mrope(
        f.mrope_section, f.mrope_interleaved, R, a.position_ids, (3, T), "(3, T)"
    )
    if sections is None and a.position_ids is not None:
        raise ValueError(
            "position_ids is only used with mrope_section (the positions of a "
            "token come from cache_lengths and input_row_offsets otherwise)"
        )
    B, max_pages = ck.check_ragged_paged(a.input_row_offsets, a.cache_lengths, a.block_table)
    num_pages, page_size, kv_dynamic, scales = _check_caches(a, f.kv_layout, f.kv_scale, Hkv, D)
    epsilon = ck.check_float(f.epsilon, "epsilon", positive=False)
    ck.check_last_dim_contiguous(vq, vk, vv, vt, vkc, vvc)
    q_dtype = ck.check_q_out_dtype(f.q_out_dtype, vq, a.q_out)
    q_scale, q_dynamic = _q_quant(q_dtype, f.q_scale, a.q_scale_out, T, Hq)
    if q_dtype in FP8_DTYPES and vkc.dtype == INT8:
        raise TypeError(
            f"an fp8 q_out ({q_dtype}) with an int8 cache is not supported (no "
            f"attention kernel reads that pair); use an fp8 cache or a {vq.dtype} "
            f"q_out"
        )
    if a.status is not None:
        check_status(a.status)
    device = ck.check_same_device(a)
    k_scale, v_scale = scales if scales else (1.0, 1.0)
    return _Checked(
        f.norm_order == "after_rope",
        weight_offset,
        epsilon,
        T,
        Hq,
        Hkv,
        D,
        P,
        R,
        sections,
        B,
        max_pages,
        num_pages,
        page_size,
        kv_dynamic,
        k_scale,
        v_scale,
        q_dtype,
        q_scale,
        q_dynamic,
        device,
    )


def _check_caches(a, kv_layout, kv_scale, Hkv, D):
    """The caches and their scales; ``(num_pages, page_size, kv_dynamic, static scales)``."""
    vkc, vvc = a.k_cache, a.v_cache
    nhd = kv_layout == "NHD"
    layout, spelled = decl.paged_layout(kv_layout)
    ck.check_ndim(vkc, 4, layout)
    num_pages = vkc.shape[0]
    page_size = vkc.shape[1] if nhd else vkc.shape[2]
    expected = (num_pages, page_size, Hkv, D) if nhd else (num_pages, Hkv, page_size, D)
    ck.check_shape(vkc, expected, spelled)
    ck.check_shape(vvc, expected, spelled)
    if vkc.dtype != a.q.dtype:
        ck.check_dtype(vkc, (a.q.dtype, *FP8_DTYPES, INT8))
    kv_dynamic = _cache_scale_arrays(a.k_scales, a.v_scales, vkc, kv_scale, expected, spelled)
    ck.check_same_dtype(vvc, vkc)
    if page_size == 0:
        raise ValueError(f"k_cache must have a page_size of at least 1, got {vkc.shape}")
    scales = None if kv_dynamic else _kv_scales(kv_scale, vkc.dtype)
    return num_pages, page_size, kv_dynamic, scales


def _host_run(a, f, c):
    """The NumPy backend's run of a host call."""
    vgiven, vstatus, voff = a.q_out, a.status, a.input_row_offsets

    def host(v, outs):
        vout = vgiven if vgiven is not None else outs[0]
        if vstatus is not None:
            vstatus.host[...] = reference.ragged_offsets_status(voff.host, c.T)
            if vstatus.host.item():
                return
        if c.T:
            reference.qk_rmsnorm_rope_append_paged_kv_cache(
                a.q.host,
                a.k.host,
                a.v.host,
                a.q_gamma.host,
                a.k_gamma.host,
                a.cos_sin_cache.host,
                voff.host,
                a.cache_lengths.host,
                a.block_table.host,
                a.k_cache.host,
                a.v_cache.host,
                vout.host,
                c.epsilon,
                f.is_neox,
                f.kv_layout,
                c.k_scale,
                c.v_scale,
                f.norm_order,
                c.weight_offset,
                f.clear_unused_last_page_rows,
                None if a.position_ids is None else a.position_ids.host,
                c.sections,
                f.mrope_interleaved,
                1.0 if c.q_scale is None else c.q_scale,
                *(None if x is None else x.host for x in (a.q_scale_out, a.k_scales, a.v_scales)),
            )

    return host


def _choose(a, is_neox, c):
    """``(vector width, lanes per head row, block, rows, splits)`` of a device call."""
    vq, vk, vv, vkc = a.q, a.k, a.v, a.k_cache
    vout = a.q_out if a.q_out is not None else vq  # a new output is laid out (and aligned) as q
    R, D = c.R, c.D

    # the widest n for which the data rows (and the table's) are aligned, read once for every
    # width tried (widest_aligned)
    widest = widest_aligned((vq, vout, vk, vv, a.q_gamma, a.k_gamma, vkc, a.v_cache))
    table_widest = widest_aligned((a.cos_sin_cache,))

    def fits(n):
        rot = (R // 2) % n == 0 if is_neox else (R % n == 0 and n % 2 == 0)
        return (
            rot and (D - R) % n == 0 and n <= widest and (n if is_neox else n // 2) <= table_widest
        )

    n = vector_width(vq.dtype.itemsize, fits)
    if n is None:
        raise BufferError(
            f"interleaved RoPE reads element pairs: the rows of q, q_out, k, v and "
            f"the caches must start at even elements; got {vq}, {vout}, {vk}, {vv}, "
            f"{vkc}"
        )

    # lanes per head row: one chunk each, a power of two so a row's sum is a shuffle within a warp
    def lanes(n):
        return (R // 2 if is_neox else R) // n + (D - R) // n

    if c.T < TUNING["narrow_below"]:  # decode: more lanes per row, less work per thread
        # (8, 4, 2, 1) up to narrow_width: the widths tried for decode
        widths = tuple([w for w in (8, 4, 2, 1) if w <= TUNING["narrow_width"]])
        narrow = vector_width(vq.dtype.itemsize, fits, widths)
        if narrow and lanes(narrow) <= MAX_GROUP:
            n = narrow
    items = lanes(n)
    if items > MAX_GROUP:
        raise BufferError(
            f"head dim D={D} at a vector width of {n} elements needs {items} lanes "
            f"per head row, more than {MAX_GROUP}; align the rows of q, k, v and "
            f"the caches to {16 // vq.dtype.itemsize * vq.dtype.itemsize} bytes"
        )
    group = 1 << (items - 1).bit_length()
    # status= with no tokens: one block, which only validates
    block, rows, splits = launch_shape(max(c.T, 1), c.Hq + 2 * c.Hkv, group)
    return n, group, block, rows, splits, fits(8)


def _pack(a, f, c, n, group, block, rows, splits, fits8):
    """The launch of a device call: its record's values and pointer slots, and the kernel (the
    decode kernel where :func:`_decode_kernel` takes the call)."""
    values = _values(a, f, c, group, rows)
    # the optional arrays' pointers and fields (their zeros, read only, when none is given)
    slots = dict(_ARGUMENT_SLOTS)  # q .. v_cache, all given (checked above)
    slots["q_out"] = _GIVEN_OUTPUT if a.q_out is not None else _NEW_OUTPUT
    if (
        a.position_ids is None
        and a.status is None
        and a.q_scale_out is None
        and a.k_scales is None
        and a.v_scales is None
    ):
        values.update(_NO_OPTIONS)
    else:
        for i, field, slot in _OPTIONAL_SLOTS:  # the optional arrays given
            if a[i] is not None:
                slots[field] = slot
        values.update(_option_values(a, f.kv_layout, c.sections))
    opts = (
        2
        if c.sections is not None
        else int(
            bool(
                c.post
                or c.weight_offset != 0.0
                or f.clear_unused_last_page_rows
                or a.status is not None
            )
        )
    )
    # fp8 q or computed scales: a quantizing kernel (the others compile none of it)
    q_fp8 = c.q_dtype if c.q_dtype != a.q.dtype else None
    quant = q_fp8 is not None or c.kv_dynamic
    if quant and opts:
        opts = 2
    # the decode kernels: plain calls, q in its own dtype or fp8 (DECODE_Q_DTYPES), K / V rows
    # with static scales
    decode = None
    if not (opts or c.kv_dynamic) and (q_fp8 is None or q_fp8 in DECODE_Q_DTYPES):
        decode = _decode_kernel(a[:11], a.q_out, f.is_neox, c.R, fits8, q_fp8)
    params = PARAMS
    if decode:
        kernel, grid, block_shape = decode
        params = DECODE_PARAMS if q_fp8 is None else QDECODE_PARAMS
    else:
        kernel = expression(
            a.q.dtype,
            a.k_cache.dtype,
            f.is_neox,
            n,
            kernel_rows(rows),
            opts,
            c.q_dtype if quant else None,
        )
        grid, block_shape = (max(c.T, 1), splits), (block,)
    return Launch(
        STEM,
        kernel,
        c.device,
        grid,
        block_shape,
        params,
        values,
        slots,
        pdl=f.enable_pdl,
    )


def _values(a, f, c, group, rows):
    """The record's fields past the pointers but the options' (every given pointer has a slot,
    :func:`_pack`; the others are null)."""
    vq, vk, vv, vkc, vvc, vgiven = a.q, a.k, a.v, a.k_cache, a.v_cache, a.q_out
    if f.kv_layout == "NHD":
        kc = (vkc.strides[0], vkc.strides[1], vkc.strides[2])
        vc = (vvc.strides[0], vvc.strides[1], vvc.strides[2])
    else:
        kc = (vkc.strides[0], vkc.strides[2], vkc.strides[1])
        vc = (vvc.strides[0], vvc.strides[2], vvc.strides[1])
    out_strides = vgiven.strides[:2] if vgiven is not None else (c.Hq * c.D, c.D)
    return {
        "q_st": vq.strides[0],
        "q_sh": vq.strides[1],
        "qo_st": out_strides[0],
        "qo_sh": out_strides[1],
        "k_st": vk.strides[0],
        "k_sh": vk.strides[1],
        "v_st": vv.strides[0],
        "v_sh": vv.strides[1],
        "cs_sp": a.cos_sin_cache.strides[0],
        "bt_sb": a.block_table.strides[0],
        "kc_sp": kc[0],
        "kc_se": kc[1],
        "kc_sh": kc[2],
        "vc_sp": vc[0],
        "vc_se": vc[1],
        "vc_sh": vc[2],
        "num_pages": c.num_pages,
        "epsilon": c.epsilon,
        "weight_offset": c.weight_offset,
        "inv_k_scale": 1.0 / c.k_scale,
        "inv_v_scale": 1.0 / c.v_scale,
        "T": c.T,
        "B": c.B,
        "Hq": c.Hq,
        "Hkv": c.Hkv,
        "D": c.D,
        "R": c.R,
        "P": c.P,
        "max_pages": c.max_pages,
        "page_size": c.page_size,
        "q_gamma_f32": int(a.q_gamma.dtype == FLOAT32),
        "k_gamma_f32": int(a.k_gamma.dtype == FLOAT32),
        "group": group,
        "rows": rows,
        "post": int(c.post),
        "clear": int(f.clear_unused_last_page_rows),
        "pid_st": c.T,
        "mrope_interleaved": int(f.mrope_interleaved),
        "inv_q_scale": 1.0 / c.q_scale if c.q_scale is not None else 1.0,
        "q_dynamic": int(c.q_dynamic),
        "kv_dynamic": int(c.kv_dynamic),
        **division_fields("h", c.Hq + 2 * c.Hkv),
        **division_fields("pg", c.page_size),
    }


def _option_values(a, kv_layout, sections):
    """The record's option fields when an option array is given."""

    def entry_strides(view):  # (page, entry, head) of a scale array, whatever the layout
        if view is None:
            return (0, 0, 0)
        st = view.strides
        return (st[0], st[1], st[2]) if kv_layout == "NHD" else (st[0], st[2], st[1])

    vpid, vqs = a.position_ids, a.q_scale_out
    ks_st, vs_st = entry_strides(a.k_scales), entry_strides(a.v_scales)
    qs_st = vqs.strides if vqs is not None else (0, 0)
    return {
        "mrope": int(sections is not None),
        "mrope_t": sections[0] if sections else 0,
        "mrope_h": sections[1] if sections else 0,
        "mrope_w": sections[2] if sections else 0,
        "pos64": int(vpid is not None and vpid.dtype == INT64),
        "check": int(a.status is not None),
        "qs_st": qs_st[0],
        "qs_sh": qs_st[1],
        "ks_sp": ks_st[0],
        "ks_se": ks_st[1],
        "ks_sh": ks_st[2],
        "vs_sp": vs_st[0],
        "vs_se": vs_st[1],
        "vs_sh": vs_st[2],
    }


_ARGS = (
    "q",
    "k",
    "v",
    "q_gamma",
    "k_gamma",
    "cos_sin_cache",
    "input_row_offsets",
    "cache_lengths",
    "block_table",
    "k_cache",
    "v_cache",
    "q_out",
    "position_ids",
    "status",
    "q_scale_out",
    "k_scales",
    "v_scales",
)


def _all_below_int32(views):
    """Whether every view's extent (one past its largest element offset) is below INT32_EXTENT,
    with no negative stride: read from what reading the view already derived (its size and
    byte span ``[lo, hi)``, hi = (1 + the largest element offset) * itemsize with no negative
    stride); a first call runs it on eight arrays."""
    for v in views:
        if min(v.strides) < 0:
            return False
        if v.size and v.span[1] >= INT32_EXTENT * v.dtype.itemsize:
            return False
    return True


def _decode_kernel(views, vgiven, is_neox, R, fits8, q_dtype=None):
    """(kernel, grid, block) of a decode kernel for a plain call (no option, no computed K / V
    scales: the caller checks; ``q_dtype``: q stored as this fp8 type, not taken by the
    token-rows kernel) of at most TUNING["decode_tokens"] tokens (TUNING["few_head_tokens"] with
    at most TUNING["decode_heads"] head rows a token; or, the flat kernel, of at most
    TUNING["decode_heads"] head rows a token: TUNING's comment) whose geometry it was compiled for (D in
    DECODE_DIMS, R == D, 16-byte lanes aligned, both RMSNorm weights of one dtype); None
    otherwise (``fits8``: the rows are aligned for 8-element lanes). 32-bit offsets when every
    array's extent in elements allows (the flat kernel and the token-rows kernel need them);
    the token-rows kernel first, from TUNING["rows_from"] head rows up to TUNING["rows_tokens"]
    tokens."""
    vq, vk, vv, vqg, vkg, vt, voff, _vlen, vbt, vkc, vvc = views[:11]
    T, Hq, D = vq.shape
    Hkv = vk.shape[1]
    H = Hq + 2 * Hkv
    few_heads = H <= TUNING["decode_heads"]
    few = T <= TUNING["decode_tokens"] or (few_heads and T <= TUNING["few_head_tokens"])
    flat = TUNING["decode_flat"] and (not few if few_heads else T < TUNING["flat_below"])
    # few-head decode in the flat kernel's spread shape (TUNING's tp_flat_* comment)
    spread = bool(
        TUNING["decode_flat"]
        and few_heads
        and TUNING["tp_flat_from"]
        and TUNING["tp_flat_from"] <= T
        and (few or T <= TUNING["tp_flat_to"])
    )
    flat = flat or spread
    by_token = (
        q_dtype is None
        and TUNING["decode_by_token"]
        and TUNING["rows_from"] <= T * H
        and T <= TUNING["rows_tokens"]
    )
    if not (
        0 < T
        and (few or flat or by_token)
        and D in DECODE_DIMS
        and R == D
        and vqg.dtype == vkg.dtype
        and fits8
        and vq.dtype.itemsize == 2
    ):
        return None
    # a new output: (T, Hq, D) contiguous, extent T * Hq * D
    i32 = _all_below_int32(
        (vq, vk, vv, vt, vbt, vkc, vvc)
        if vgiven is None
        else (vq, vk, vv, vt, vbt, vkc, vvc, vgiven)
    ) and (vgiven is not None or T * Hq * D < INT32_EXTENT)
    f32 = vqg.dtype == FLOAT32
    guess = guesses(T, voff.shape[0] - 1)
    if by_token and i32:
        return _rows_launch(vq.dtype, vkc.dtype, is_neox, T, H, D, f32, guess)
    if spread and i32:
        width, rows = TUNING["tp_flat_width"], TUNING["tp_flat_rows"]
        return _flat_launch(vq.dtype, vkc.dtype, is_neox, T, H, D, f32, guess, width, rows, q_dtype)
    if flat and i32:
        return _flat_launch(vq.dtype, vkc.dtype, is_neox, T, H, D, f32, guess, q_dtype=q_dtype)
    if not few:
        return None
    group = D // 16 if is_neox else D // 8  # lanes per row (16-byte lanes of 8 elements)
    rows = max(32 // group, min(TUNING["decode_rows"], MAX_BLOCK // group))
    if few_heads and TUNING["few_head_rows_from"] and T >= TUNING["few_head_rows_from"]:
        rows = min(rows, H)  # (whole warps below)
    block = -(-rows * group // 32) * 32  # whole warps
    rows = block // group
    kernel = decode_expression(vq.dtype, vkc.dtype, is_neox, D, f32, i32, guess, q_dtype)
    return kernel, (T, -(-H // rows)), (block,)


def rows_shape(T, H, D, is_neox):
    """(U, warps a token, warps a block) of the token-rows decode kernel: T tokens of H head rows,
    S = 32 / lanes rows of a warp a step (TUNING's comment)."""
    S = 32 // (D // 16 if is_neox else D // 8)
    U = TUNING["rows_per_lane"]
    if not U:
        fits = (u for u in ROWS_STEPS if T * -(-H // (S * u)) <= TUNING["rows_warps"])
        U = next(fits, ROWS_STEPS[-1])
    U = max(1, min(ROWS_STEPS[-1], U))
    per_token = -(-H // (S * U))
    U = -(-H // (S * per_token))  # balanced: the fewest steps for that many warps
    return U, per_token, max(1, min(TUNING["rows_block_warps"], T, MAX_BLOCK // 32))


def _rows_launch(dtype, cache_dtype, is_neox, T, H, D, gamma_f32, guess):
    """(kernel, grid, block) of the token-rows decode kernel: grid (ceil(T / warps), warps a
    token), blocks of ``warps`` warps (one token each)."""
    U, per_token, warps = rows_shape(T, H, D, is_neox)
    kernel = rows_expression(dtype, cache_dtype, is_neox, D, gamma_f32, U, guess)
    return kernel, (-(-T // warps), per_token), (32 * warps,)


def _flat_launch(
    dtype,
    cache_dtype,
    is_neox,
    T,
    H,
    D,
    gamma_f32,
    guess,
    width=None,
    block_rows=None,
    q_dtype=None,
):
    """(kernel, grid, block) of the flat decode kernel: T H rows, blocks of whole warps of up to
    TUNING["decode_rows"] rows, fewer (down to a warp's) while the grid has fewer than
    TUNING["decode_min_blocks"] blocks. ``width`` (elements a lane, FLAT_WIDTHS; 8 where 4
    would take more than a warp a row) and ``block_rows`` replace TUNING's choices when given
    (the few-head decode shape)."""
    n = 8
    if width is not None:
        n = width if width in FLAT_WIDTHS and flat_lanes(D, is_neox, width) else 8
    elif T < TUNING["decode_narrow_below"] and flat_lanes(D, is_neox, 4):
        n = 4
    group = flat_lanes(D, is_neox, n)
    per_warp = 32 // group  # rows of a warp
    rows = TUNING["decode_rows"] if block_rows is None else block_rows
    rows = max(per_warp, min(rows, MAX_BLOCK // group)) // per_warp * per_warp
    total = T * H
    if TUNING["decode_min_blocks"]:
        spread = -(-total // TUNING["decode_min_blocks"])  # rows a block at the minimum grid
        rows = min(rows, max(per_warp, -(-spread // per_warp) * per_warp))
    kernel = flat_expression(dtype, cache_dtype, is_neox, D, gamma_f32, n, guess, q_dtype)
    return kernel, (-(-total // rows),), (rows * group,)


# the PARAMS pointer field of each argument, in argument order
FIELDS = (
    "q",
    "k",
    "v",
    "q_gamma",
    "k_gamma",
    "cos_sin",
    "offsets",
    "cache_lengths",
    "block_table",
    "k_cache",
    "v_cache",
    "q_out",
    "position_ids",
    "status",
    "q_scale_out",
    "k_scales",
    "v_scales",
)
# made once (a first call copies or reads them): argument roles by name: the arguments written
# (q_out always: given or new; the others when given), the in-place pair, the result; the slots
# of the arguments every call gives (q .. v_cache), q_out's (a new one follows the arguments),
# the option fields when no option array is given (mRoPE is off without position_ids:
# check_mrope demands them)
_Q_OUT = ck.argument_indices(_ARGS, "q_out")
_RESULT = given_or_new(_Q_OUT)
_ARGUMENT_SLOTS = {f: (i, 0) for i, f in enumerate(FIELDS[:_Q_OUT])}
# (argument, field, slot) of the optional arrays past q_out: _pack adds those given
_OPTIONAL_SLOTS = tuple((i, FIELDS[i], (i, 0)) for i in range(_Q_OUT + 1, len(FIELDS)))
_GIVEN_OUTPUT, _NEW_OUTPUT = (_Q_OUT, 0), (len(_ARGS), 0)
_NO_OPTIONS = {
    "mrope": 0,
    "mrope_t": 0,
    "mrope_h": 0,
    "mrope_w": 0,
    "pos64": 0,
    "check": 0,
    "qs_st": 0,
    "qs_sh": 0,
    "ks_sp": 0,
    "ks_se": 0,
    "ks_sh": 0,
    "vs_sp": 0,
    "vs_se": 0,
    "vs_sh": 0,
}
_FLAGS = [
    ("epsilon", KEY),
    ("is_neox", FLAG),
    ("kv_layout", KEY),
    ("kv_scale", KEY),
    ("enable_pdl", FLAG),
    ("tuning", AS_IS),
    ("norm_order", KEY),
    ("weight_offset", KEY),
    ("clear_unused_last_page_rows", FLAG),
    ("mrope_section", KEY),
    ("mrope_interleaved", FLAG),
    ("q_out_dtype", dtype_key),
    ("q_scale", KEY),
]
_Views = collections.namedtuple("_Views", _ARGS)
_Flags = collections.namedtuple("_Flags", [name for name, _ in _FLAGS])


# ---- the declaration (ropekv/_declare.py): the torch and JAX forms follow from it -------------


def _outputs(values):
    from ropekv import _frameworks

    return _frameworks.qknorm_outputs(values)


DECLARATIONS = (
    decl.Declaration(
        "qk_rmsnorm_rope_append_paged_kv_cache",
        (
            decl.array("q", shape=("(T, Hq, D)",), dtypes=INPUT_DTYPES),
            decl.array("k", shape=("(T, Hkv, D)",), dtypes=("q",)),
            decl.array("v", shape=("(T, Hkv, D)",), dtypes=("q",)),
            decl.array("q_gamma", shape=("(D,)",), dtypes=("q", FLOAT32)),
            decl.array("k_gamma", shape=("(D,)",), dtypes=("q", FLOAT32)),
            decl.array("cos_sin_cache", shape=("(P, R)",), dtypes=(FLOAT32,)),
            *decl.ragged_paged(),
            decl.paged_kv_cache(("q", *FP8_DTYPES, INT8)),
            decl.scalar("epsilon", "float", 1e-6),
            decl.scalar("is_neox", "bool", True),
            decl.scalar("kv_layout", "str", "NHD"),
            decl.scalar("kv_scale", "floats", None),
            decl.out("q_out", into="q", shape=("(T, Hq, D)",), dtypes=("q", *FP8_DTYPES)),
            decl.scalar("q_out_dtype", "dtype", None),
            decl.scalar("q_scale", "float", None),
            decl.written("q_scale_out", optional=True, shape=("(T, Hq)",), dtypes=(FLOAT32,)),
            decl.kv_cache_scales(layered=True),
            decl.scalar("norm_order", "str", "before_rope"),
            decl.scalar("weight_offset", "float", 0.0),
            decl.scalar("clear_unused_last_page_rows", "bool", False),
            decl.array("position_ids", optional=True, shape=("(3, T)",), dtypes=(INT32, INT64)),
            decl.scalar("mrope_section", "ints", None, check=section_list),
            decl.scalar("mrope_interleaved", "bool", False),
            decl.status(),
            decl.scalar("layer_idx", "int", None, check=ck.check_layer_idx),
            decl.scalar("enable_pdl", "bool", False),
        ),
        outputs=_outputs,
    ),
)
# the launch's roles, from the declaration: the arrays written when given (q_out always: given
# or new), the pair that may be one array (q_out = q)
_WRITTEN = DECLARATIONS[0].launch_written(_ARGS)
_INPLACE = DECLARATIONS[0].launch_in_place(_ARGS)

_OP = Op(
    "qk_rmsnorm_rope_append_paged_kv_cache",
    _ARGS,
    _prepare,
    layered=DECLARATIONS[0].launch_layered(_ARGS),
    flags=_FLAGS,
)
