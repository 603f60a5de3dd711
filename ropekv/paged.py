"""``rope_quantize_fp8_append_paged_kv_cache`` (FlashInfer 0.5.3's interface) and
``rope_append_paged_kv_cache``: RoPE on Q and K, optional fp8 quantization, and the append of K/V
into a paged KV cache, in one launch."""

from __future__ import annotations

import collections
import functools
import itertools
import numbers
import operator
from typing import NamedTuple

import numpy as np

from ropekv import _checks as ck
from ropekv import _declare as decl
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
    bind_dims,
    gather_strides,
    max_span,
)
from ropekv._compile import c_bool, c_type, name_expression
from ropekv._launch import (
    AS_IS,
    FLAG,
    INT,
    KEY,
    Launch,
    Op,
    Output,
    ParamStruct,
    Plan,
    int32_fields_fit,
    l2_bytes,
)
from ropekv._mrope import check_mrope, check_mrope_indices, check_status, section_list
from ropekv._types import ArrayLike, DTypeLike, StreamLike
from ropekv._vector import vector_width, widest_aligned

STEM = "paged"
INT8 = reference.INT8  # int8 caches: with per-token-head scales only
KERNEL = "rope_append_paged_kv_cache"
INPUT_DTYPES = (FLOAT16, BFLOAT16)
INDEX_DTYPES = (INT32, INT64)
WIDTHS = (8, 4, 2, 1)
LAYOUTS = tuple(decl.PAGED_LAYOUTS)  # a GQA/MHA cache's layouts

# Launch shape, from a sweep on the H200 (`ropekv bench --tune paged.KEY=...` repeats it). A kernel
# shape is (unroll, rot_unroll, min_blocks_per_sm): pass-through / rotary items each thread loads before it stores,
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
# `max_row_block` threads). The option kernel holds at most `opts_rows` rows per lane group.
# A plain row-kernel block of fewer than `row_tokens_upto` threads (a token of few heads: GQA
# under tensor parallelism, 16-24 lanes) takes as many tokens as fit in that many (0: a token a
# block). Heads too wide for `row_group` (MLA's 68-72 chunks) run the row kernel too while a call
# has fewer than `wide_rows_below` head rows (T x (Hq + 1): decode), in blocks of at most
# `wide_row_block` threads, or of one row from `wide_row_single_from` rows; the section kernel's
# per-thread walk of its five sections (a division each) made a longer chain than the row
# kernel's one chunk (0: the section kernel always). H200, graph replay, us (128 heads 1 / 4 / 16
# / 64 tokens; 16 heads 64 / 128 / 256): section 3.1 / 3.4 / 3.7 / 5.2; 3.7 / 3.8 / 4.2; rows in
# 256-thread blocks 2.4 / 2.6 / 3.8 / 6.8; 2.7 / 3.9 / 5.6; a block a row 2.4 / 2.5 / 3.3 / 5.2;
# 2.9 / 3.6 / 4.2.
#
# Section-kernel occupancy (issue 38; the kernel's section_min_blocks): min blocks 5 ("heavy") caps
# interleaved RoPE at 48 registers (ptxas sm_90, bf16 -> e4m3: 8 bytes of spills; FlashInfer's
# MLA kernel runs 48 registers, 34 warps an SM, against our 64 and 28 at 16 heads x 4 x 2048),
# 4 ("light") at 58-62 registers without spills (72 before: 22 warps an SM at 128 heads x 64
# tokens, FlashInfer 32); neox and mRoPE stay at most 4 in the kernel (48 registers spill 432-968
# bytes there). `heavy=(2, 2, 4), light=(1, 1, 1)` restores 0663de9's shapes.
TUNING = {
    "light": (1, 1, 4),
    "heavy": (2, 2, 5),
    "heavy_from": 8,
    "max_block": 128,
    "min_blocks": 1024,
    "row_group": 32,
    "row_block": 256,
    "row_block_below": 256,
    "row_block_many": 128,
    "wave_blocks": 1320,
    "prefill_rows": 4,
    "max_row_block": 256,
    "opts_rows": 4,
    "row_tokens_upto": 128,
    "wide_rows_below": 4096,
    "wide_row_block": 256,
    "wide_row_single_from": 1100,
    "lean_below": 1025,
    "lean_prefill_from": 1025,
    "lean_block": 256,
    "lean_wave_blocks": 2640,
    "lean_max_block": 256,
    "lean_split_block": 128,
    "lean_narrow_from": 1,
    "lean_wide_chunks": 1 << 16,
    "lean_multi": 4,
    "lean_multi_many": 2,
    "lean_multi_many_from": 64,
    "lean_multi_upto": 1 << 22,
    "lean_stream_l2": 0.75,
    "lean_prefill_rows": 1,
    "lean_prefill_rows_bf16_8bit": 2,
    "lean_guess": True,
}
MAX_BLOCK = 512  # __launch_bounds__ of the row kernel
ROW_KERNEL = "rope_append_paged_rows"
# The lean kernel (rope_append_paged_rows_lean: one chunk of one head row per thread, no division
# but the page's, a row's source and destination picked by index) serves plain calls (no option,
# no mRoPE) of fewer than `lean_below` tokens whose head rows fit LEAN_THREADS lanes: GQA / MHA and
# MLA decode. Blocks (G, S, tokens): a token a block and about `lean_block` threads (whole rows, a
# token's rows spread evenly over the blocks) while the grid stays within `lean_wave_blocks`, else
# up to `lean_max_block` threads and as many tokens as fit. Why (ncu, H200, TP 8/1 heads, 16
# tokens): the row kernel ran 43,808 instructions in 16 blocks of 256 threads for 80 threads of
# work a token, 60 registers, and a K / V row's chain (sm_90 SASS) waited for pos_id before it
# read b and pos: four dependent loads. The lean kernel (fp16 -> e4m3, neox: 528 static
# instructions against 736, 48 registers) waits for two in a row on a Q row (pos_id -> cos/sin)
# and three on a K / V row (b, pos -> kv_indptr -> kv_indices, the cos/sin loads beside the page
# id's, the rotation while it is in flight). `lean_below=0` restores the row / section kernels of
# ee077f9. Where it runs comes from a side-by-side H200 run (graph replay, us, lean / row or
# section kernel): head rows of at most `row_group` lanes (GQA / MHA) from `lean_narrow_from`
# tokens (Llama 32 / 8 heads fp16 -> e4m3 1 / 16 / 256 tokens 2.0 / 2.1 / 2.9 against 2.0 / 2.0 /
# 3.1, 1 x 1024 10.2 against 11.9; 8 / 1 heads within 3% either way below 128, so from 128 until
# the slot chain went 32-bit (LeanSlot): then 1.7-2.1 against 1.9-2.3 us at 1-64 tokens, 0.86-0.95x,
# for 32 / 8, 8 / 1 and 4 / 1 heads, fp16 / bf16 inputs, fp16 / e4m3 caches; hence 1), wider rows
# (MLA)
# while a call has at most `lean_wide_chunks` chunks (T x rows x lanes: 128 heads 1 / 16 / 64
# tokens 1.9 / 2.7 / 5.8 against 2.2 / 3.1 / 5.1; 16 heads 128 / 256 tokens 2.8 / 4.0 against
# 3.5 / 4.1); blocks of 256 threads (128: MLA 1 / 16 tokens 2.1 / 3.1, Llama within 5%).
# Narrow rows (GQA / MHA) take it at prefill too, from `lean_prefill_from` tokens (issue 38): the
# row kernel's prefill blocks (4 rows a lane group, 86-88 registers, 96 threads) held 15.6-16.9
# warps an SM (ncu, H200, 8 x 1024, 32 / 8 and 8 / 1 heads: 44-70% of copy bandwidth, 0.98x
# FlashInfer under TP); the lean kernel's 48 registers allow 40 in blocks of 192-240 threads, and
# it already won at 1 x 1024 (10.2 against 11.9 us). The window from `lean_below` to 2,047 tokens
# kept the row kernel until it was timed (H200, fp16 -> e4m3, us, lean / row kernel): 2 x 768 12.0 /
# 14.0, 1 x 1536 12.5 / 14.0, 3 x 600 13.5 / 16.3, 8 / 1 heads 2 x 768 6.5 / 7.4, fp16 cache 2 x 768
# 12.9 / 14.4 (0.83-0.89x); hence `lean_prefill_from` = `lean_below`. `lean_prefill_from=0`
# restores the row kernel from `lean_below` tokens (0663de9).
# Past the wave, blocks whose token's narrow rows need more than `lean_max_block` threads hold at
# most `lean_split_block` (Llama 32 / 8 heads: 3 blocks of 16 rows, 128 threads, not 2 of 24):
# 40 warps an SM at 48 registers instead of 36 (the fp16 -> fp16 form bounded to 48 to join them,
# paged.cu's lean_min_blocks); tokens whose rows fit a block (tensor-parallel heads) keep theirs.
# The measurements: docs/design/kernels.md, "Prefill blocks of 128 threads".
# `lean_split_block=256` restores 52921a7's shapes.
LEAN_KERNEL = "rope_append_paged_rows_lean"
LEAN_THREADS = 256  # kLeanThreads: the lean kernel's __launch_bounds__
# The lean kernel with C = `lean_multi` chunks of a row per thread (rope_append_paged_rows_lean_multi:
# lanes j, j + X, ..., X = ceil(G / C) lanes a row, every chunk loaded before the indices, the
# row's indices, page lookup and addresses found once for its C chunks) takes plain calls of wide
# rows (MLA) past `lean_wide_chunks` chunks, up to `lean_multi_upto` (T x rows x lanes; 0: never,
# today's row / section kernels there), below `lean_below` tokens, where a row's rotary chunks
# fit its X lanes (only a lane's first chunk can be rotary). Why (ncu, H200, MLA 128 heads): the
# one-chunk lean kernel ran 914K instructions at 16 tokens (15 cycles an issue) and lost to the
# section kernel from 64 tokens (128 heads 64 / 128 / 256 tokens 5.8 / 9.7 / 21.8 us against 5.1 /
# 6.4 / 16.5): one chunk a thread keeps too few bytes in flight for wide rows; the section kernel
# ran at 20-22 warps an SM (72 registers) and 1.5x FlashInfer's instructions at 16 heads x 256.
# `lean_wide_chunks=0` gives it the calls the one-chunk lean kernel takes today too. The split
# between the two lean kernels moved from 2^18 to 2^16 chunks on a side-by-side H200 run (graph
# replay, `--tune paged.lean_wide_chunks=0`, time C-chunk / one-chunk): MLA 16 heads 64 / 128
# tokens 0.97x / 0.90x, 128 heads 16 tokens 0.97x, but 1.04-1.11x at 16 heads up to 16 tokens and
# 128 heads up to 4 (at most 37K chunks); 2^16 puts the first three past it.
# C is `lean_multi_many` for tokens of at least `lean_multi_many_from` head rows, `lean_multi`
# below, and the C-chunk kernel runs up to 2^22 chunks (512 tokens of 128 heads: 4.8M, the section
# kernel). Two H200 processes, graph replay, `--tune` (time against the default then, the section
# kernel past 2^19 chunks): 128 heads at 16 / 64 / 128 / 256 tokens, C 2: 0.92-0.95 / 0.92-0.93 /
# 1.02 / 0.94x, C 4: 0.99-1.00 / 0.94-0.96 / 1.08 / 0.95x; 16 heads at 64 / 128 / 256 tokens, C 2:
# 1.02-1.03 / 1.02-1.03 / 0.96-0.98x, against a control of the default at 0.98-1.00x; C 8 was
# 1.06-1.35x slower. With 128 heads at C 4, 16 tokens made 160 blocks of 234 threads on 132 SMs.
# `lean_multi_many=4, lean_multi_upto=524288` restores 2e56501.
LEAN_MULTI_KERNEL = "rope_append_paged_rows_lean_multi"
LEAN_MULTI_CHUNKS = (2, 4)  # chunks a thread compiled beside TUNING's (the compile tests)
# The C-chunk lean kernel loads its rows with the streaming hint (its STREAM form: ld.global.cs,
# evict first) on calls whose rows move more bytes (read and written) than `lean_stream_l2` of
# the device's L2: such a call's inputs are gone from L2 before the next call could read them
# again, and the hint leaves the L2 to its stores. Below that, a call under graph replay finds
# its inputs in L2 on the next replay unless they were marked to go first. Why (H200, 60 MB of
# L2, two processes a tree, graph replay, time with the hint on every call / without): MLA 128
# heads at 256 tokens (57 MB) 16.1 -> 14.6 us (0.904x), at 128 tokens (28 MB) 6.4 -> 7.8 us
# (1.219x). `lean_stream_l2=1e9` restores plain loads everywhere (09fe8e8).
# The lean kernel with U head rows of a token a thread (rope_append_paged_rows_lean_rows: chunk j
# of rows y, y + S, ..., y + (U - 1) S of a block's S U rows, every row's chunk loaded before the
# token's indices, the indices, page id and cos/sin found once for the U rows) can take the lean
# kernel's prefill calls (narrow rows, from `lean_below` tokens); decode keeps one row a thread.
# U is `lean_prefill_rows_bf16_8bit` for bf16 inputs into 8-bit caches, `lean_prefill_rows`
# otherwise (1: the one-row kernel). Why: the one-row kernel took Llama 32 / 8 heads 8 x 1024
# prefill to 74% of copy bandwidth (e4m3 cache; ncu, H200: 28.2M instructions, 48 registers, 51%
# occupancy, DRAM 56%, 10.9 cycles an issue); bf16 -> e4m3 took 62 registers and reached 69%.
# Side by side on the H200 (CUDA events, us, U 2 / 1 / 3 / 4): bf16 -> e4m3 47.5 / 51.9 / 52.4 /
# 56.4; fp16 -> e4m3 8 x 1024 47.5 / 47.9 / 61.7 / 56.7, 4 x 2048 49.8 / 47.8, 32 x 1024 173.4 /
# 177.3; fp16 -> fp16 62.8 / 57.8 (U 2 spills 6-12 bytes at its 64-register cap), bf16 -> bf16
# 62.6 / 57.4; TP 8 / 1 heads 14.9 / 14.8, 4 / 1 11.1 / 11.4. U 2 issued about as many
# instructions a row as U 1 (27.7M against 28.2M): a row's own work, not the shared index chain,
# is most of a thread's instructions. Blocks as lean_shape gives for ceil(H / U) rows (Llama, U
# 2: 8 x 24 threads, a token a block). `lean_prefill_rows_bf16_8bit=1` restores 0a1cafe.
LEAN_ROWS_KERNEL = "rope_append_paged_rows_lean_rows"
LEAN_PREFILL_ROWS = (2, 3, 4)  # rows a thread compiled beside TUNING's (the compile tests)
# The decode guess (`lean_guess`; LeanSlot in paged.cu, the record's `guess` field): a call of
# as many tokens as requests has each lean-kernel K / V thread load kv_indptr[t] and
# kv_indptr[t + 1] beside batch_indices[t] and take them where b is t, so the page id waits for
# two loads in a row instead of three. H200, graph replay, `--tune paged.lean_guess=False` (time
# without / with): paged GQA decode 1.01-1.11x, tensor-parallel 8 / 1 and 4 / 1 heads
# 1.03-1.05x, MLA 16 heads 1.02-1.07x, 128 heads 0.99-1.02x (docs/design/kernels.md).
# `lean_guess=False` restores the three-load chain.
INT32_SPAN = 2**31 - 1  # element offsets below this take the lean kernel's 32-bit offsets
ROWS = (1, 4)  # row kernels by the head rows one lane group can hold (their register budgets)


def row_launch_shape(T, H, group, max_rows=ROWS[-1], width=None):
    """(block, rows, splits) of the row kernel for T tokens of H head rows at ``group`` lanes per
    row: grid (T, splits), ``rows`` rows per lane group (the kernel's ROWS: 1 when rows is 1), at
    most ``max_rows``; ``width``: the decode blocks' threads (by default ``row_block`` or
    ``row_block_many``)."""
    if width is None:
        width = TUNING["row_block"] if T < TUNING["row_block_below"] else TUNING["row_block_many"]
    slots = max(1, min(width, MAX_BLOCK) // group)
    splits = -(-H // slots)
    if T * splits <= TUNING["wave_blocks"] or max_rows < 2:
        return slots * group, 1, splits
    for rows in (2, ROWS[-1]) if max_rows >= ROWS[-1] else (2,):
        splits = -(-H // (slots * rows))
        if T * splits <= TUNING["wave_blocks"]:
            return slots * group, -(-H // (slots * splits)), splits
    slots = min(
        -(-H // min(TUNING["prefill_rows"], max_rows)),
        max(1, min(TUNING["max_row_block"], MAX_BLOCK) // group),
    )
    rows = min(ROWS[-1], max_rows, -(-H // slots))
    return slots * group, rows, -(-H // (slots * rows))


def _lean_fits(T, H, group):
    """Whether TUNING gives a plain call of T tokens of H head rows at ``group`` lanes a row to the
    lean kernel (the comment above LEAN_KERNEL)."""
    if T <= 0 or group > LEAN_THREADS:
        return False
    if group > TUNING["row_group"]:
        return T < TUNING["lean_below"] and T * H * group <= TUNING["lean_wide_chunks"]
    if T < TUNING["lean_below"]:
        return T >= TUNING["lean_narrow_from"]
    # prefill (lean_below 0: no lean kernel at all, ee077f9)
    return TUNING["lean_below"] > 0 and 0 < TUNING["lean_prefill_from"] <= T


def _lean_multi_lanes(T, H, group, ri):
    """Lanes a row of the C-chunk lean kernel for a plain call of T tokens of H head rows of
    ``group`` chunks (``ri`` of them rotary), or 0 where TUNING leaves the call to the others
    (the comment above LEAN_MULTI_KERNEL)."""
    chunks = T * H * group
    if not 0 < T < TUNING["lean_below"] or group <= TUNING["row_group"]:
        return 0
    if not TUNING["lean_wide_chunks"] < chunks <= TUNING["lean_multi_upto"]:
        return 0
    many = H >= TUNING["lean_multi_many_from"]
    lanes = -(-group // max(1, TUNING["lean_multi_many" if many else "lean_multi"]))
    return lanes if ri <= lanes <= LEAN_THREADS else 0


def _lean_rows(T, group, dtype, out_dtype):
    """Head rows a thread of the lean kernel for a call of T tokens it takes, inputs of ``dtype``
    into outputs of ``out_dtype``: ``lean_prefill_rows_bf16_8bit`` (bf16 into 8-bit outputs) or
    ``lean_prefill_rows`` for narrow rows (at most ``row_group`` lanes) from ``lean_below``
    tokens, else 1 (the comment above LEAN_ROWS_KERNEL)."""
    if group > TUNING["row_group"] or T < TUNING["lean_below"]:
        return 1
    bf16_8bit = dtype == BFLOAT16 and np.dtype(out_dtype).itemsize == 1
    return max(1, TUNING["lean_prefill_rows_bf16_8bit" if bf16_8bit else "lean_prefill_rows"])


def lean_shape(T, H, G):
    """``(block, grid)`` of the lean kernel for T tokens of H head rows at G lanes per row:
    blocks of ``(G, S, tokens)`` threads (S rows of ``tokens`` tokens), grid ``(ceil(T /
    tokens), ceil(H / S))``. Decode (the grid within ``lean_wave_blocks``): a token a block, the
    rows spread evenly over the blocks; past it, blocks of at most ``lean_max_block`` threads, or
    ``lean_split_block`` where a token's narrow rows need more than that."""
    cap = max(1, LEAN_THREADS // G)  # rows a block can hold
    slots = max(1, min(H, TUNING["lean_block"] // G, cap))
    splits = -(-H // slots)
    if T * splits <= TUNING["lean_wave_blocks"]:
        return (G, -(-H // splits), 1), (T, splits)
    limit = min(TUNING["lean_max_block"], LEAN_THREADS)
    if G * H > limit and G <= TUNING["row_group"]:  # narrow rows, a token's over several blocks
        limit = min(limit, TUNING["lean_split_block"])
    slots = max(1, min(H, limit // G, cap))
    splits = -(-H // slots)
    slots = -(-H // splits)
    tokens = max(1, min(T, 64, limit // (G * slots)))  # blockDim.z is at most 64
    return (G, slots, tokens), (-(-T // tokens), splits)


def row_tokens(T, block):
    """Tokens a plain row-kernel block of ``block`` threads a token holds (its blockDim.y): when
    one token's rows fill fewer than ``row_tokens_upto`` threads, as many as fit in that many,
    the most that make whole warps if any do (24-lane tokens: 4, 96 threads)."""
    fit = min(TUNING["row_tokens_upto"], MAX_BLOCK) // block
    whole = [k for k in range(fit, 0, -1) if k * block % 32 == 0]
    return max(1, min(T, whole[0] if whole else fit))


def launch_shape(items, T, n):
    """(block, splits, kernel shape) for T tokens of ``items`` items each at vector width n."""
    block = min(TUNING["max_block"], -(-items // 32) * 32)
    splits = 1
    if T < TUNING["min_blocks"]:
        splits = max(1, min(-(-items // block), -(-TUNING["min_blocks"] // T)))
    heavy = n == 8 and items >= TUNING["heavy_from"] * block * splits
    return block, splits, TUNING["heavy" if heavy else "light"]


_POINTERS = (
    "q_rope",
    "q_nope",
    "k_rope",
    "k_nope",
    "v",
    "q_rope_out",
    "q_nope_out",
    "kr_cache",
    "kn_cache",
    "v_cache",
    "cos_sin",
    "pos_ids",
    "batch_indices",
    "positions",
    "kv_indptr",
    "kv_indices",
    "q_scales",
    "kv_scales",
)
_STRIDES = (
    "qr_sn",
    "qr_sh",
    "qn_sn",
    "qn_sh",
    "kr_sn",
    "kr_sh",
    "kn_sn",
    "kn_sh",
    "v_sn",
    "v_sh",
    "qro_sn",
    "qro_sh",
    "qno_sn",
    "qno_sh",
    "krc_sp",
    "krc_se",
    "krc_sh",
    "knc_sp",
    "knc_se",
    "knc_sh",
    "vc_sp",
    "vc_se",
    "vc_sh",
    "cs_sp",
    "num_pages",
    "num_indices",
    "pid_st",
)
_INTS = (
    "Hq",
    "Hkv",
    "Hv",
    "R",
    "Dn",
    "B",
    "page_size",
    "P",
    "index64",
    "group",
    "rows",
    "mrope",
    "mrope_t",
    "mrope_h",
    "mrope_w",
    "mrope_interleaved",
)
PARAMS = ParamStruct(
    "PagedParams",
    [
        *((n, np.uint64) for n in _POINTERS),
        *((n, np.int64) for n in _STRIDES),
        ("q_scale", np.float32),
        ("kv_scale", np.float32),
        *((n, np.int32) for n in (*_INTS, "guess")),
    ],
)
# The lean kernels' record where their offsets are 32-bit (PagedLeanParams): the fields of PARAMS
# they read, strides and extents as int32 (_lean_wide keeps every stride within it): 5 constant-bank
# lines of 64 bytes instead of 8 (the kernel's note). 64-bit offsets keep PARAMS.
LEAN_PARAMS = ParamStruct(
    "PagedLeanParams",
    [
        *((n, np.uint64) for n in _POINTERS),
        *((n, np.int32) for n in _STRIDES),
        ("q_scale", np.float32),
        ("kv_scale", np.float32),
        *(
            (n, np.int32)
            for n in ("Hq", "Hkv", "Hv", "R", "B", "page_size", "P", "index64", "group", "guess")
        ),
    ],
)
# The option kernel's record: the plain one's fields with the options' pointers and strides (a
# struct of its own, so the plain kernel's record stays as it was before the options).
OPTS_PARAMS = ParamStruct(
    "PagedOptsParams",
    [
        *((n, np.uint64) for n in (*_POINTERS, "q_scale_out", "k_scales", "v_scales", "status")),
        *(
            (n, np.int64)
            for n in (
                *_STRIDES,
                "qso_sn",
                "qso_sh",
                "ks_sp",
                "ks_se",
                "ks_sh",
                "vs_sp",
                "vs_se",
                "vs_sh",
            )
        ),
        ("q_scale", np.float32),
        ("kv_scale", np.float32),
        *((n, np.int32) for n in (*_INTS, "T")),
    ],
)

_DTYPE_NAMES = {
    "float8_e4m3fn": FLOAT8_E4M3FN,
    "float8_e5m2": FLOAT8_E5M2,
    "float16": FLOAT16,
    "half": FLOAT16,
    "bfloat16": BFLOAT16,
    "int8": INT8,
}
# status= codes of kv_indptr (1-3 are the ragged offsets' codes; docs/conventions.md)
STATUS_CODES = {
    reference.STATUS_INDPTR_FIRST_NOT_ZERO: "kv_indptr[0] != 0",
    reference.STATUS_INDPTR_DECREASING: "an entry of kv_indptr below the one before",
    reference.STATUS_INDPTR_PAST_INDICES: "kv_indptr[-1] > len(kv_indices)",
}


# the lean kernel's forms with a count: C chunks of a row, or U head rows, a thread
_LEAN_FORMS = {"lean_multi": LEAN_MULTI_KERNEL, "lean_rows": LEAN_ROWS_KERNEL}
_LEAN_RECORDS = {"lean", *_LEAN_FORMS}  # the shapes whose 32-bit form takes LEAN_PARAMS


@functools.cache
def expression(dtype, out_dtype, is_neox, n, shape, mrope=False, opts=False):
    """The section kernel of ``shape`` (unroll, rot_unroll, min blocks), or the row kernel when
    ``shape`` is ``("rows", ROWS)``; ``mrope``: the one that reads mRoPE sections (the plain one
    has mRoPE compiled out); ``opts``: the kernel that reads the options, compiled out of the
    plain one (the row kernel: computed scales and status; the section kernel: status only)."""
    if shape[0] in _LEAN_FORMS:
        # ("lean_rows", head rows a thread, 64-bit offsets) or
        # ("lean_multi", chunks a thread, streaming hint, 64-bit offsets)
        counts = (shape[1], c_bool(shape[2])) if shape[0] == "lean_multi" else (shape[1],)
        return name_expression(
            _LEAN_FORMS[shape[0]],
            c_type(dtype),
            c_type(out_dtype),
            c_bool(is_neox),
            n,
            *counts,
            "long long" if shape[-1] else "int",
        )
    if shape[0] == "lean":  # ("lean", 64-bit offsets)
        return name_expression(
            LEAN_KERNEL,
            c_type(dtype),
            c_type(out_dtype),
            c_bool(is_neox),
            n,
            "long long" if shape[1] else "int",
        )
    if shape[0] == "rows":
        return name_expression(
            ROW_KERNEL + ("_opts" if opts else ""),
            c_type(dtype),
            c_type(out_dtype),
            c_bool(is_neox),
            n,
            shape[1],
            c_bool(mrope),
        )
    return name_expression(
        KERNEL + ("_status" if opts else ""),
        c_type(dtype),
        c_type(out_dtype),
        c_bool(is_neox),
        n,
        *shape,
        c_bool(mrope),
    )


def instantiations():
    """Every kernel instantiation a call can select (the compile tests build them all)."""
    for dtype, is_neox, n in itertools.product(INPUT_DTYPES, (True, False), WIDTHS):
        if not is_neox and n == 1:
            continue
        shapes = (TUNING["light"], TUNING["heavy"]) if n == 8 else (TUNING["light"],)
        shapes = (*dict.fromkeys(shapes), *(("rows", r) for r in ROWS))
        for out_dtype, shape, mrope in itertools.product(
            (dtype, *FP8_DTYPES), shapes, (False, True)
        ):
            yield expression(dtype, out_dtype, is_neox, n, shape, mrope)
            if shape[0] != "rows":  # status= alone on heads too wide for a lane group
                yield expression(dtype, out_dtype, is_neox, n, shape, mrope, True)
        for out_dtype, rows, mrope in itertools.product(
            (dtype, *FP8_DTYPES, INT8), ROWS, (False, True)
        ):
            yield expression(dtype, out_dtype, is_neox, n, ("rows", rows), mrope, True)
        for out_dtype, wide in itertools.product((dtype, *FP8_DTYPES), (False, True)):
            yield expression(dtype, out_dtype, is_neox, n, ("lean", wide))
            tuned = (TUNING["lean_multi"], TUNING["lean_multi_many"])
            for chunks in dict.fromkeys((*(max(1, c) for c in tuned), *LEAN_MULTI_CHUNKS)):
                for stream in (False, True):
                    shape = ("lean_multi", chunks, stream, wide)
                    yield expression(dtype, out_dtype, is_neox, n, shape)
            tuned = (TUNING["lean_prefill_rows"], TUNING["lean_prefill_rows_bf16_8bit"])
            for rows in dict.fromkeys((*tuned, *LEAN_PREFILL_ROWS)):
                if rows > 1:
                    yield expression(dtype, out_dtype, is_neox, n, ("lean_rows", rows, wide))


def rope_quantize_fp8_append_paged_kv_cache(
    q_rope: ArrayLike,
    k_rope: ArrayLike,
    q_nope: ArrayLike | None,
    k_nope: ArrayLike | None,
    v: ArrayLike | None,
    cos_sin_cache: ArrayLike,
    pos_ids: ArrayLike,
    paged_kv_cache: tuple[ArrayLike, ArrayLike],
    kv_indices: ArrayLike,
    kv_indptr: ArrayLike,
    batch_indices: ArrayLike,
    positions: ArrayLike,
    is_neox: bool = True,
    quantize_dtype: DTypeLike | None = None,
    quant_scale_q: float | ArrayLike | None = None,
    quant_scale_kv: float | ArrayLike | None = None,
    page_size: int = 16,
    kv_layout: str = "NHD",
    q_rope_out: ArrayLike | None = None,
    q_nope_out: ArrayLike | None = None,
    enable_pdl: bool = False,
    *,
    mrope_section: tuple[int, int, int] | None = None,
    mrope_interleaved: bool = False,
    q_scale_out: ArrayLike | None = None,
    kv_cache_scales: tuple[ArrayLike, ArrayLike] | None = None,
    status: ArrayLike | None = None,
    stream: StreamLike | None = None,
) -> tuple[ArrayLike, ArrayLike]:
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
        RoPE position of each token; with ``mrope_section``, ``(3, nnz)``: each token's
        temporal, height and width positions (a token with any outside ``[0, P)`` has none).
    paged_kv_cache : (k_cache, v_cache) or (ckv_cache, kpe_cache), written in place
        GQA/MHA: each ``(num_pages, page_size, Hkv, R + Dn)`` for ``kv_layout="NHD"`` or
        ``(num_pages, Hkv, page_size, R + Dn)`` for ``"HND"``. MLA: ``ckv_cache (num_pages,
        page_size, Dn)`` and ``kpe_cache (num_pages, page_size, R)``. float8_e4m3fn or
        float8_e5m2, the quantize dtype; int8 with ``kv_cache_scales``. Only the addressed rows
        change.
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
        float8_e4m3fn or float8_e5m2 (int8 with ``kv_cache_scales``), as a NumPy/ml_dtypes
        dtype, a string or a torch dtype. By default that of ``q_rope_out``, else
        ``q_nope_out``, else the cache. The q outputs and the caches have this dtype.
    quant_scale_q, quant_scale_kv : float, or float32 array (Hq,) / (Hkv,), optional
        Quantization multiplies: stored = fp8(x * scale), round to nearest even, saturating to
        the largest finite value (int8 q outputs: to [-127, 127]). Arrays give one scale per
        head. Scales must be positive and finite (device arrays are checked under
        ``ROPEKV_CHECK_INDICES=1``). None (the default) is 1.0; giving one together with the
        computed scales that replace it (``q_scale_out``, ``kv_cache_scales``) is a
        ``ValueError``.
    page_size : int
        Entries per page; must match the cache shape.
    kv_layout : {"NHD", "HND"}
        GQA/MHA cache layout; ignored for MLA.
    q_rope_out, q_nope_out : arrays, (nnz, Hq, R) / (nnz, Hq, Dn), the quantize dtype, optional
        Written in place and returned when given (they must not overlap another argument, but
        may be ``q_rope`` / ``q_nope`` themselves when the dtypes agree); otherwise allocated in
        the caller's array type (CuPy, torch or NumPy).
    mrope_section : (int, int, int), optional
        mRoPE (Qwen2-VL): ``(t, h, w)`` rotary half-dims per axis summing to R/2; half-dim i
        takes the temporal position for ``i < t``, height for ``t <= i < t + h``, width
        otherwise; ``pos_ids`` is then ``(3, nnz)`` (``docs/conventions.md``).
    mrope_interleaved : bool
        Qwen3-VL's interleaved mRoPE (height when ``i % 3 == 1`` and ``i < 3h``, width when
        ``i % 3 == 2`` and ``i < 3w``, temporal otherwise).
    q_scale_out : array, (nnz, Hq), float32, optional, written
        Dynamic fp8 queries (fp8 quantize dtype only): each token's Q head is quantized with its
        own scale, computed from the largest magnitude of its rope and nope dims together after
        RoPE (``a = max(amax, 1e-6)``, stored = fp8(q * max_code / a), max_code 448 for e4m3,
        57344 for e5m2), and the **dequantization** scale ``a / max_code`` is written here
        (q ~ stored * scale), shared by that row of ``q_rope_out`` and ``q_nope_out``. Replaces
        ``quant_scale_q`` (``docs/conventions.md``, "Computed scales" and "fp8 queries").
    kv_cache_scales : (k_scales, v_scales), float32 arrays, optional, written
        Per-token-head KV scales (GQA/MHA caches only: the MLA cache has no heads to scale): each
        of the cache's shape without its last dim, ``(num_pages, page_size, Hkv)`` for NHD,
        ``(num_pages, Hkv, page_size)`` for HND. Each written K row (rope and nope dims together,
        after RoPE) and V row is quantized with its computed scale (as ``q_scale_out``'s) and that
        dequantization scale is written to the same (page, entry, head) of its array; other
        entries keep their bytes. The cache may then be fp8 or int8 (max_code 127, round to
        nearest even, NaN stored as 0). Replaces ``quant_scale_kv``.
    status : array, (1,), int32, optional, written
        Validate ``kv_indptr`` on the device, in the same launch, with no host synchronisation
        (CUDA-graph capturable): ``status[0]`` receives 0 when ``kv_indptr[0] == 0``, it never
        decreases and ``kv_indptr[-1] <= len(kv_indices)``, else 4, 5 or 6 for the first failing
        check, in that order; with a nonzero code nothing else is written (caches, scale arrays
        and given q outputs keep every byte; new q outputs hold undefined values). Tokens with
        bad indices under a valid ``kv_indptr`` are still skipped one by one.
    enable_pdl : bool
        Launch with programmatic dependent launch (Hopper and later): the kernel may start while
        the previous kernel on the stream finishes, and waits for it before reading memory.
    stream : CuPy stream, int ``cudaStream_t`` or object with ``cuda_stream``, optional
        Stream to launch on; by default torch's current stream when an argument is a torch
        tensor, else CuPy's current stream, on the arrays' device (``docs/conventions.md``).

    Returns
    -------
    (q_rope_out, q_nope_out)
        The quantized queries; ``q_nope_out`` has shape (nnz, Hq, 0) when ``q_nope`` is None.

    Raises
    ------
    TypeError
        ``quantize_dtype`` (or an output or cache) not float8_e4m3fn / float8_e5m2, inputs that
        are not fp16 / bf16 or disagree in dtype, index arrays that are not integers, a scale that
        is neither a float nor a float32 array, or a ``stream`` of an unknown kind.
    ValueError
        Shapes that disagree (``q_rope`` / ``k_rope`` / ``v`` token counts, R odd, ``kv_indptr``
        not ``(batch_size + 1,)``), ``paged_kv_cache`` not a pair, only one of ``q_nope`` /
        ``k_nope``, ``v`` given for MLA or missing for GQA, a static scale together with
        ``q_scale_out`` or ``kv_cache_scales``, ``kv_cache_scales`` on MLA caches, a written array
        that overlaps another argument, or arrays on different devices.
    BufferError
        A written array exported read-only (or through a legacy DLPack capsule), memory not
        aligned to its item size, rows starting at odd elements with ``is_neox=False``, or head
        rows too wide for the option kernel at the rows' alignment.
    IndexError
        Only with ``ROPEKV_CHECK_INDICES=1``: a token whose ``pos_ids`` entry lies outside the
        table, whose ``batch_indices`` entry lies outside ``[0, batch_size)``, whose position is
        negative, or whose page-table entry or page lies outside ``kv_indices`` / the cache; or
        two tokens writing one cache row.

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
    With NumPy arrays (the NumPy reference, on the host): one request of four tokens in page 0.

    >>> import ml_dtypes, numpy as np, ropekv
    >>> T, Hq, Hkv, D, page_size, num_pages = 4, 32, 8, 128, 16, 8
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((T, Hq, D)).astype(np.float16)
    >>> k, v = (rng.standard_normal((T, Hkv, D)).astype(np.float16) for _ in range(2))
    >>> fp8 = ml_dtypes.float8_e4m3fn
    >>> cache = [np.zeros((num_pages, page_size, Hkv, D), fp8) for _ in range(2)]
    >>> pos = np.arange(T, dtype=np.int32)
    >>> q8, _ = ropekv.rope_quantize_fp8_append_paged_kv_cache(
    ...     q, k, None, None, v, ropekv.cos_sin_cache(1024, D), pos, cache,
    ...     np.arange(num_pages, dtype=np.int32), np.array([0, 1], np.int32),
    ...     np.zeros(T, np.int32), pos)
    >>> q8.shape, q8.dtype
    ((4, 32, 128), dtype(float8_e4m3fn))

    The same call with CuPy arrays runs the CUDA kernel (needs a GPU):

    >>> import cupy as cp  # doctest: +SKIP
    >>> q = cp.random.randn(T, Hq, D).astype(cp.float16)  # doctest: +SKIP
    >>> k, v = (cp.random.randn(T, Hkv, D).astype(cp.float16) for _ in range(2))  # doctest: +SKIP
    >>> cache = [cp.zeros((num_pages, page_size, Hkv, D), cp.uint8).view(fp8)  # doctest: +SKIP
    ...          for _ in range(2)]
    >>> table = ropekv.cos_sin_cache(1024, D, xp=cp)  # doctest: +SKIP
    >>> pos = cp.arange(T, dtype=cp.int32)  # doctest: +SKIP
    >>> q8, _ = ropekv.rope_quantize_fp8_append_paged_kv_cache(  # doctest: +SKIP
    ...     q, k, None, None, v, table, pos, cache, cp.arange(num_pages, dtype=cp.int32),
    ...     cp.array([0, 1], cp.int32), cp.zeros(T, cp.int32), pos)
    """
    return _call(
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
        is_neox,
        quantize_dtype,
        quant_scale_q,
        quant_scale_kv,
        page_size,
        kv_layout,
        q_rope_out,
        q_nope_out,
        enable_pdl,
        stream,
        quantize=True,
        mrope=(mrope_section, mrope_interleaved),
        options=(q_scale_out, kv_cache_scales, status),
    )


def rope_append_paged_kv_cache(
    q_rope: ArrayLike,
    k_rope: ArrayLike,
    q_nope: ArrayLike | None,
    k_nope: ArrayLike | None,
    v: ArrayLike | None,
    cos_sin_cache: ArrayLike,
    pos_ids: ArrayLike,
    paged_kv_cache: tuple[ArrayLike, ArrayLike],
    kv_indices: ArrayLike,
    kv_indptr: ArrayLike,
    batch_indices: ArrayLike,
    positions: ArrayLike,
    is_neox: bool = True,
    quantize_dtype: DTypeLike | None = None,
    quant_scale_q: float | ArrayLike | None = None,
    quant_scale_kv: float | ArrayLike | None = None,
    page_size: int = 16,
    kv_layout: str = "NHD",
    q_rope_out: ArrayLike | None = None,
    q_nope_out: ArrayLike | None = None,
    enable_pdl: bool = False,
    *,
    mrope_section: tuple[int, int, int] | None = None,
    mrope_interleaved: bool = False,
    q_scale_out: ArrayLike | None = None,
    kv_cache_scales: tuple[ArrayLike, ArrayLike] | None = None,
    status: ArrayLike | None = None,
    stream: StreamLike | None = None,
) -> tuple[ArrayLike, ArrayLike]:
    """Apply RoPE to Q and K and append K/V to a paged KV cache, in one launch, without
    quantization when the cache has the input dtype.

    The same arguments and semantics as :func:`rope_quantize_fp8_append_paged_kv_cache`, except
    that the cache may also be float16/bfloat16 (the dtype of ``q_rope``): then the q outputs and
    cache rows are the roped values rounded to that dtype and the scales are ignored (computed
    scales need an fp8 or int8 cache). fp8 caches
    behave exactly as in :func:`rope_quantize_fp8_append_paged_kv_cache`. ``quantize_dtype``, when
    given, must be the cache dtype.

    Parameters
    ----------
    q_rope, k_rope, q_nope, k_nope, v : array or None
        As in :func:`rope_quantize_fp8_append_paged_kv_cache`.
    cos_sin_cache, pos_ids : array
        As there.
    paged_kv_cache : (k_cache, v_cache) or (ckv_cache, kpe_cache), written in place
        As there; the dtype may also be that of ``q_rope`` (float16 or bfloat16).
    kv_indices, kv_indptr, batch_indices, positions : array
        As there.
    is_neox : bool
        As there.
    quantize_dtype : dtype, optional
        The cache dtype when given.
    quant_scale_q, quant_scale_kv : float, or float32 array (Hq,) / (Hkv,), optional
        As there, for fp8 (and int8) caches; ignored for 16-bit caches.
    page_size : int
        Entries per page; must match the cache shape.
    kv_layout : {"NHD", "HND"}
        GQA/MHA cache layout; ignored for MLA.
    q_rope_out, q_nope_out : array, optional
        In the cache dtype; as there.
    mrope_section : (int, int, int), optional
        mRoPE (Qwen2-VL): ``(t, h, w)`` rotary half-dims per axis summing to R/2; half-dim i
        takes the temporal position for ``i < t``, height for ``t <= i < t + h``, width
        otherwise; ``pos_ids`` is then ``(3, nnz)`` (``docs/conventions.md``).
    mrope_interleaved : bool
        Qwen3-VL's interleaved mRoPE (height when ``i % 3 == 1`` and ``i < 3h``, width when
        ``i % 3 == 2`` and ``i < 3w``, temporal otherwise).
    q_scale_out : array, (nnz, Hq), float32, optional, written
        As there: dynamic per-token-head Q scales, with an fp8 cache only.
    kv_cache_scales : (k_scales, v_scales), float32 arrays, optional, written
        As there: per-token-head KV scales, with an fp8 or int8 cache (GQA/MHA only).
    status : array, (1,), int32, optional, written
        As there: ``kv_indptr`` validated on the device, codes 4-6, nothing written on failure.
    enable_pdl : bool
        Accepted for compatibility.
    stream : CuPy stream, int ``cudaStream_t`` or object with ``cuda_stream``, optional
        As there.

    Returns
    -------
    (q_rope_out, q_nope_out)
        The roped queries in the cache dtype; ``q_nope_out`` has shape (nnz, Hq, 0) when
        ``q_nope`` is None.

    Raises
    ------
    TypeError
        Inputs that are not fp16 / bf16 or disagree in dtype (the caches take the inputs'
        dtype), index arrays that are not integers, or a ``stream`` of an unknown kind.
    ValueError
        Shapes that disagree (token counts, R odd, ``kv_indptr`` not ``(batch_size + 1,)``),
        ``paged_kv_cache`` not a pair, only one of ``q_nope`` / ``k_nope``, ``v`` given for MLA or
        missing for GQA, a written array that overlaps another argument, or arrays on different
        devices.
    BufferError
        A written array exported read-only (or through a legacy DLPack capsule), memory not
        aligned to its item size, or rows starting at odd elements with ``is_neox=False``.
    IndexError
        Only with ``ROPEKV_CHECK_INDICES=1``: a token whose ``pos_ids``, ``batch_indices``,
        position, page-table entry or page lies outside its range, or two tokens writing one
        cache row.

    Examples
    --------
    With NumPy arrays (the NumPy reference, on the host), a float16 cache in the HND layout:

    >>> import numpy as np, ropekv
    >>> T, Hq, Hkv, D, page_size, num_pages = 4, 32, 8, 128, 16, 8
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((T, Hq, D)).astype(np.float16)
    >>> k, v = (rng.standard_normal((T, Hkv, D)).astype(np.float16) for _ in range(2))
    >>> cache = [np.zeros((num_pages, Hkv, page_size, D), np.float16) for _ in range(2)]
    >>> pos = np.arange(T, dtype=np.int32)
    >>> q_roped, _ = ropekv.rope_append_paged_kv_cache(
    ...     q, k, None, None, v, ropekv.cos_sin_cache(1024, D), pos, cache,
    ...     np.arange(num_pages, dtype=np.int32), np.array([0, 1], np.int32),
    ...     np.zeros(T, np.int32), pos, kv_layout="HND")
    >>> bool((cache[1][0, :, :T] == v.transpose(1, 0, 2)).all())  # V in page 0, entries 0..3
    True

    The same call with CuPy arrays runs the CUDA kernel (needs a GPU):

    >>> import cupy as cp  # doctest: +SKIP
    >>> q = cp.random.randn(T, Hq, D).astype(cp.float16)  # doctest: +SKIP
    >>> k, v = (cp.random.randn(T, Hkv, D).astype(cp.float16) for _ in range(2))  # doctest: +SKIP
    >>> cache = [cp.zeros((num_pages, Hkv, page_size, D), cp.float16)  # doctest: +SKIP
    ...          for _ in range(2)]
    >>> table = ropekv.cos_sin_cache(1024, D, xp=cp)  # doctest: +SKIP
    >>> pos = cp.arange(T, dtype=cp.int32)  # doctest: +SKIP
    >>> q_roped, _ = ropekv.rope_append_paged_kv_cache(  # doctest: +SKIP
    ...     q, k, None, None, v, table, pos, cache, cp.arange(num_pages, dtype=cp.int32),
    ...     cp.array([0, 1], cp.int32), cp.zeros(T, cp.int32), pos, kv_layout="HND")
    """
    return _call(
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
        is_neox,
        quantize_dtype,
        quant_scale_q,
        quant_scale_kv,
        page_size,
        kv_layout,
        q_rope_out,
        q_nope_out,
        enable_pdl,
        stream,
        quantize=False,
        mrope=(mrope_section, mrope_interleaved),
        options=(q_scale_out, kv_cache_scales, status),
    )


def as_dtype(value, name="quantize_dtype"):
    """A NumPy dtype from a NumPy/ml_dtypes dtype, a string (``"float8_e4m3fn"``,
    ``"torch.float8_e4m3fn"``) or a torch dtype (matched by name; torch is never imported)."""
    if value is None:
        return None
    if isinstance(value, str) or type(value).__module__ == "torch":
        key = str(value).removeprefix("torch.")
        if key in _DTYPE_NAMES:
            return _DTYPE_NAMES[key]
        raise TypeError(
            f"{name} must be float8_e4m3fn or float8_e5m2 (a dtype, its name or a "
            f"torch dtype), got {value!r}"
        )
    try:
        return np.dtype(value)
    except TypeError:
        raise TypeError(
            f"{name} must be float8_e4m3fn or float8_e5m2 (a dtype, its name or a "
            f"torch dtype), got {value!r}"
        ) from None


def _scale_arg(value, name):
    """A scale argument as ``(flag, array)``: a number goes into the plan key as its value, an
    array is an argument of the call."""
    cls = value.__class__
    if value is None or cls is float or cls is int:  # None: not given (1.0)
        return value, None
    if cls is bool or cls is np.bool_:
        raise TypeError(f"{name} must be a float or a float32 array, got {value!r}")
    if isinstance(value, numbers.Real):
        return value, None
    return None, value


def _call(
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
    is_neox,
    quantize_dtype,
    quant_scale_q,
    quant_scale_kv,
    page_size,
    kv_layout,
    q_rope_out,
    q_nope_out,
    enable_pdl,
    stream,
    quantize,
    mrope,
    options,
):
    if not isinstance(paged_kv_cache, (tuple, list)) or len(paged_kv_cache) != 2:
        raise ValueError(
            f"paged_kv_cache must be a pair (k_cache, v_cache) or (ckv_cache, "
            f"kpe_cache), got {type(paged_kv_cache).__qualname__}"
            + (
                f" of length {len(paged_kv_cache)}"
                if isinstance(paged_kv_cache, (tuple, list))
                else ""
            )
        )
    # a scale that is None or a float enters the key as it is (the common call: no function call)
    q_scale, q_scales = (
        (quant_scale_q, None)
        if quant_scale_q is None or quant_scale_q.__class__ is float
        else _scale_arg(quant_scale_q, "quant_scale_q")
    )
    kv_scale, kv_scales = (
        (quant_scale_kv, None)
        if quant_scale_kv is None or quant_scale_kv.__class__ is float
        else _scale_arg(quant_scale_kv, "quant_scale_kv")
    )
    q_scale_out, kv_cache_scales, status = options
    if kv_cache_scales is None:
        kv_cache_scales = (None, None)
    elif (
        not isinstance(kv_cache_scales, (tuple, list))
        or len(kv_cache_scales) != 2
        or any(x is None for x in kv_cache_scales)
    ):
        raise ValueError(
            f"kv_cache_scales must be a pair of arrays (k_scales, v_scales), got "
            f"{type(kv_cache_scales).__qualname__}"
            + (
                f" of length {len(kv_cache_scales)}"
                if isinstance(kv_cache_scales, (tuple, list))
                else ""
            )
        )
    op = _MLA if getattr(k_rope, "ndim", None) == 2 else _GQA
    return op(
        (
            q_rope,
            k_rope,
            q_nope,
            k_nope,
            v,
            cos_sin_cache,
            pos_ids,
            *paged_kv_cache,
            kv_indices,
            kv_indptr,
            batch_indices,
            positions,
            q_rope_out,
            q_nope_out,
            q_scales,
            kv_scales,
            q_scale_out,
            *kv_cache_scales,
            status,
        ),
        (
            quantize,
            is_neox,
            quantize_dtype,
            q_scale,
            kv_scale,
            page_size,
            kv_layout,
            enable_pdl,
            tuple(TUNING.values()),
            mrope[0],
            mrope[1],
        ),
        stream,
    )


def _scales(view, value, name, heads):
    """(scalar, view) of a validated scale: positive finite; an array of one per head."""
    if view is None:
        return ck.check_float(value, name, positive=True), None
    ck.check_dtype(view, (FLOAT32,))
    ck.check_shape(view, (heads,), "(Hq,)" if name == "quant_scale_q" else "(Hkv,)")
    ck.check_contiguous(view)
    if view.device == HOST or ck.check_indices_enabled():
        ck.check_scale_values(view)
    return 1.0, view


def output_dtype(vqr, views, quantize_dtype, quantize, mla, kv_dyn, static_given):
    """``(dtype, its source's name)`` of the cache and of the q outputs: ``quantize_dtype``, else that of the first of
    ``views`` (``(q_rope_out, q_nope_out, cache)``, None where not given) that is present;
    checked against the op (``quantize``: the FP8 op; ``mla``; ``kv_dyn``: ``kv_cache_scales``
    given; ``static_given``: static KV scales given). The eager op and ``ropekv._frameworks``
    (torch fake tensors, JAX abstract values) both call it, so their errors are the same."""
    # int8 comes with computed scales only (GQA/MHA), and they need a quantized cache: those
    # rules are ValueErrors (check_cache_scales); a dtype no argument makes valid is a TypeError
    allowed = (*(FP8_DTYPES if quantize else (vqr.dtype, *FP8_DTYPES)), *(() if mla else (INT8,)))
    out_dtype = as_dtype(quantize_dtype)
    if out_dtype is None:  # FlashInfer's order: q_rope_out, q_nope_out, then (ropekv) the cache
        given = next(x for x in views if x is not None)
        out_dtype, source = given.dtype, given.name
        if out_dtype not in allowed:
            hint = (
                " (rope_append_paged_kv_cache writes float16/bfloat16 caches)"
                if quantize
                else f" (float16/bfloat16 only as the input dtype {vqr.dtype})"
            )
            raise TypeError(
                f"{given.name} must have dtype {_spelled(quantize, vqr, kv_dyn)}, "
                f"got {out_dtype}{hint}"
            )
    elif out_dtype not in allowed:
        raise TypeError(
            f"quantize_dtype must be {_spelled(quantize, vqr, kv_dyn)}, got {out_dtype}"
        )
    else:
        source = "quantize_dtype"
    ck.check_cache_scales(
        out_dtype,
        source,
        "quant_scale_kv",
        static_given,
        kv_dyn,
        "(k_scales, v_scales)",
    )
    return out_dtype, source


def _spelled(quantize, vqr, kv_dyn):
    """The cache dtypes an error names: those of the op (int8 only with ``kv_cache_scales``)."""
    dtypes = (*FP8_DTYPES, INT8) if kv_dyn else FP8_DTYPES if quantize else (vqr.dtype, *FP8_DTYPES)
    return " or ".join(map(str, dtypes))


def _check_options(vqso, vksc, vvsc, vstatus, mla, Hkv, num_pages, page_size, kv_layout):
    """Validate ``kv_cache_scales`` and ``status`` (``q_scale_out``: ``ck.check_q_scales``); the
    option arrays' strides (elements) as PARAMS fields (zeros for those not given)."""
    if vqso is None and vksc is None and vstatus is None:  # no options: nothing to check
        return _NO_OPTIONS
    st = dict.fromkeys(
        ("qso_sn", "qso_sh", "ks_sp", "ks_se", "ks_sh", "vs_sp", "vs_se", "vs_sh"), 0
    )
    if vqso is not None:
        st.update(qso_sn=vqso.strides[0], qso_sh=vqso.strides[1])
    if vksc is not None:
        if mla:
            raise ValueError(
                "kv_cache_scales (per-token-head KV scales) are for GQA/MHA caches: "
                "the MLA caches (ckv_cache, kpe_cache) hold one latent row per "
                "token and have no heads to scale; use quant_scale_kv"
            )
        spelled = (
            "(num_pages, page_size, Hkv)" if kv_layout == "NHD" else "(num_pages, Hkv, page_size)"
        )
        shape = (num_pages, page_size, Hkv) if kv_layout == "NHD" else (num_pages, Hkv, page_size)
        for view, pre in ((vksc, "ks"), (vvsc, "vs")):
            ck.check_scale_array(view, shape, f"{spelled} for {kv_layout}")
            sp, a, b = view.strides
            se, sh = (a, b) if kv_layout == "NHD" else (b, a)
            st.update({f"{pre}_sp": sp, f"{pre}_se": se, f"{pre}_sh": sh})
    if vstatus is not None:
        check_status(vstatus)
    return st


class _Checked(NamedTuple):
    """What the checks of a first call derive: sizes, the output dtype, the cache destinations
    (``(argument, byte offset)`` of the K-rope, K-nope and V rows), the validated scales and the
    options' strides."""

    mla: bool
    T: int
    Hq: int
    Hkv: int
    R: int
    Dn: int
    P: int
    sections: tuple | None
    page_size: int
    kv_layout: str
    out_dtype: np.dtype
    num_pages: int
    kr: tuple
    kn: tuple
    vd: tuple
    q_scale: float
    vqs: object
    kv_scale: float
    vks: object
    scale_st: dict
    inputs: list
    given_outs: list
    device: int


class _Choice(NamedTuple):
    """The kernel a call runs and its launch shape."""

    n: int  # vector width
    group: int  # chunks of a head row
    shape: tuple  # the kernel's: section (unroll, rot_unroll, min blocks) or ("rows", ROWS)
    block: int
    rows: int
    splits: int
    opts: bool  # the option kernel
    tokens: int  # tokens a block (the plain row kernel's blockDim.y), else 1


def _prepare(views, flags):
    """Validate a first call (:func:`_check`), choose the kernel and its launch shape
    (:func:`_choose`) and pack the launch plan (:func:`_pack`), or the NumPy backend run."""
    a, f = _Views._make(views), _Flags._make(flags)
    c = _check(a, f)
    outputs, out_slots, result = _outputs(a, c)
    written = _WRITTEN  # those given: Op.first_call drops the others
    inplace = _INPLACE if c.out_dtype == a.q_rope.dtype else ()  # fp8 outputs never alias q
    if ck.check_indices_enabled():
        _check_indices(
            a.pos_ids,
            a.batch_indices,
            a.positions,
            a.kv_indptr,
            a.kv_indices,
            c.P,
            c.page_size,
            c.num_pages,
            c.sections,
        )
    plan = functools.partial(Plan, outputs=outputs, written=written, inplace=inplace, result=result)
    if c.device == HOST:
        return plan(HOST, host=_host_run(a, f, c))
    if c.T == 0 and a.status is None:
        return plan(c.device)
    choice = _choose(a, f.is_neox, c, lean=not c.sections)
    return plan(c.device, [_pack(a, f, c, choice, out_slots)])


def _check(a, f):
    """Every check of a first call, in the order of the arguments' errors; a :class:`_Checked`.
    The shapes, dtypes and strides of the common calls are bound in one C call first
    (:func:`_check_bound`); any other call, and any call that fails there, is checked here."""
    c = _check_bound(a, f)
    if c is not None:
        return c
    vqr, vkr, vqn, vkn, vv = a.q_rope, a.k_rope, a.q_nope, a.k_nope, a.v
    mla = vkr.ndim == 2
    T, Hq, Hkv, R, Dn = _check_inputs(vqr, vkr, vqn, vkn, vv, mla)
    for view in filter(ck.is_given, (vkr, vqn, vkn, vv)):
        if view.dtype != vqr.dtype:
            ck.check_same_dtype(view, vqr)
    P, sections = _check_indexing(a, R, T, f.mrope_section, f.mrope_interleaved)
    page_size = ck.check_positive_int(f.page_size, "page_size")
    kv_layout = ck.check_choice(f.kv_layout, "kv_layout", LAYOUTS)
    if a.cache0.dtype != a.cache1.dtype:
        raise TypeError(
            f"{a.cache1.name} must have the dtype of {a.cache0.name} ({a.cache0.dtype}), got "
            f"{a.cache1.dtype}"
        )
    return _check_rest(a, f, mla, (T, Hq, Hkv, R, Dn, P), sections, page_size, kv_layout)


def _check_bound(a, f):
    """:func:`_check` of a call without mRoPE whose arrays bind the dims of their declared shapes
    (:func:`_form`) in one C call (:func:`ropekv._arrays.bind_dims`), with their declared dtypes
    and strides: the same :class:`_Checked`, or None (any other call), which :func:`_check`'s
    checks then take in order. Past the binding, the rest runs in their order too
    (:func:`_check_rest`), so a call that binds raises what they would."""
    page_size, kv_layout, mla = f.page_size, f.kv_layout, a.k_rope.ndim == 2
    if (
        f.mrope_section is not None
        or page_size.__class__ is not int
        or not 0 < page_size <= ck.INT32_MAX
        or kv_layout not in LAYOUTS
        or (a.q_nope is None) != (a.k_nope is None)
        or (a.v is None) != mla
        or a.cache0.dtype != a.cache1.dtype
    ):
        return None
    form = _form(
        f.quantize,
        mla,
        a.q_nope is not None,
        kv_layout,
        a.q_rope_out is not None,
        a.q_nope_out is not None,
    )
    found = bind_dims(a, form.program, (page_size, *form.scalars))
    if found is None:
        return None
    T, Hq, R, Hkv, Dn, P, num_pages, pointers = form.dims(found)
    if R == 0 or R % 2 or Hq == 0 or Hkv == 0 or pointers < 1:
        return None  # (pointers: kv_indptr's batch_size + 1 entries)
    dims = (T, Hq, Hkv, R, Dn, P)
    return _check_rest(a, f, mla, dims, None, page_size, kv_layout, num_pages)


def _check_rest(a, f, mla, dims, sections, page_size, kv_layout, num_pages=None):
    """The checks of a first call past its inputs, indices, ``page_size``, ``kv_layout`` and the
    caches' shared dtype, in their order: the output dtype's rules, the caches' shapes, the
    scales and options, the q outputs, the rows' strides, the device; the :class:`_Checked`.
    ``dims``: ``(T, Hq, Hkv, R, Dn, P)``; ``num_pages``: the caches' pages where every shape and
    stride rule already holds (:func:`_check_bound`), else None (checked here)."""
    T, Hq, Hkv, R, Dn, P = dims
    vqr, vc0, vc1, vqro, vqno = a.q_rope, a.cache0, a.cache1, a.q_rope_out, a.q_nope_out
    kv_dyn = a.k_scales is not None
    static_kv = f.quant_scale_kv is not None or a.quant_scale_kv is not None
    out_dtype, source = output_dtype(
        vqr, (vqro, vqno, vc0), f.quantize_dtype, f.quantize, mla, kv_dyn, static_kv
    )
    _check_out_dtype((vc0, vc1), out_dtype)
    checked = num_pages is not None
    if not checked:
        num_pages = _check_caches(vc0, vc1, mla, page_size, kv_layout, Hkv, R, Dn)
    kr, kn, vd = _cache_rows(mla, R, out_dtype)
    q_scale, vqs, kv_scale, vks, scale_st = _check_scales(
        a, f, out_dtype, source, mla, (T, Hq, Hkv), (num_pages, page_size, kv_layout)
    )
    if vqro is not None and not checked:
        ck.check_shape(vqro, (T, Hq, R), "(nnz, Hq, R)")
    if vqno is not None and not checked:
        ck.check_shape(vqno, (T, Hq, Dn), "(nnz, Hq, no_rope_dim)")
    given_outs = [x for x in (vqro, vqno) if x is not None]
    _check_out_dtype(given_outs, out_dtype)
    inputs = list(filter(ck.is_given, (vqr, a.k_rope, a.q_nope, a.k_nope, a.v)))
    if not checked:
        ck.check_last_dim_contiguous(*inputs, a.cos_sin_cache, vc0, vc1, *given_outs)
    return _Checked(
        mla,
        T,
        Hq,
        Hkv,
        R,
        Dn,
        P,
        sections,
        page_size,
        kv_layout,
        out_dtype,
        num_pages,
        kr,
        kn,
        vd,
        q_scale,
        vqs,
        kv_scale,
        vks,
        scale_st,
        inputs,
        given_outs,
        ck.check_same_device(a),
    )


class _Form(NamedTuple):
    """A form of call :func:`_check_bound` binds: its program, the values of its scalar dims past
    ``page_size``, and the getter of ``(nnz, Hq, R, Hkv, no_rope_dim, P, num_pages, batch_size +
    1)`` from the bound dims."""

    program: tuple
    scalars: tuple
    dims: object


@functools.cache
def _form(quantize, mla, nope, kv_layout, q_rope_out, q_nope_out):
    """The :class:`_Form` of calls of the FP8 op (``quantize``) or not, MLA or GQA / MHA caches,
    q_nope and k_nope given (``nope``), ``kv_layout``, and the q outputs given: each array's
    shape, one of its declared ones (the declaration refuses any other), made once a form."""
    names = _MLA_ARGS if mla else _GQA_ARGS
    spellings = {
        "q_rope": "(nnz, Hq, R)",
        "k_rope": "(nnz, R)" if mla else "(nnz, Hkv, R)",
        "cos_sin_cache": "(P, R)",
        "pos_ids": "(nnz,)",
        "kv_indices": "(total_pages,)",
        "kv_indptr": "(batch_size + 1,)",
        "batch_indices": "(nnz,)",
        "positions": "(nnz,)",
    }
    if nope:
        spellings["q_nope"] = "(nnz, Hq, no_rope_dim)"
        spellings["k_nope"] = "(nnz, no_rope_dim)" if mla else "(nnz, Hkv, no_rope_dim)"
    if mla:
        spellings["ckv_cache"] = "(num_pages, page_size, no_rope_dim)"
        spellings["kpe_cache"] = "(num_pages, page_size, R)"
    else:
        spellings["v"] = "(nnz, Hkv, head_dim)"
        spellings["k_cache"] = spellings["v_cache"] = decl.PAGED_LAYOUTS[kv_layout]
    if q_rope_out:
        spellings["q_rope_out"] = "(nnz, Hq, R)"
    if q_nope_out:
        spellings["q_nope_out"] = "(nnz, Hq, no_rope_dim)"
    scalars = {"page_size": None}  # the call's; the others' values follow from the form
    if mla:
        scalars["Hkv"] = 1
    if not nope:
        scalars["no_rope_dim"] = 0
    index = ("pos_ids", "kv_indices", "kv_indptr", "batch_indices", "positions")
    found, program = DECLARATIONS[0 if quantize else 1].dim_program(
        names,
        spellings,
        () if mla else ("head_dim = R + no_rope_dim", "D = R + no_rope_dim"),
        rows=[n for n in spellings if n not in index],
        contiguous=index,
        scalars=tuple(scalars),
    )
    dims = ("nnz", "Hq", "R", "Hkv", "no_rope_dim", "P", "num_pages", "batch_size + 1")
    return _Form(program, tuple(scalars.values())[1:], operator.itemgetter(*map(found.get, dims)))


def _check_inputs(vqr, vkr, vqn, vkn, vv, mla):
    """The shapes of q and k (rope and nope parts) and v; ``(T, Hq, Hkv, R, Dn)``."""
    ck.check_ndim(vqr, 3, "(nnz, Hq, R)")
    ck.check_dtype(vqr, INPUT_DTYPES)
    T, Hq, R = vqr.shape
    if R == 0 or R % 2:
        raise ValueError(f"q_rope's rotary dim R (its last dim) must be even and positive, got {R}")
    if Hq == 0:
        raise ValueError(f"q_rope must have shape (nnz, Hq, R) with Hq > 0, got {vqr.shape}")
    ck.check_ndim(vkr, (2, 3), "(nnz, Hkv, R) (GQA/MHA) or (nnz, R) (MLA)")
    if mla:
        ck.check_shape(vkr, (T, R), "(nnz, R)")
        Hkv = 1
    else:
        ck.check_shape(vkr, (T, None, R), "(nnz, Hkv, R)")
        Hkv = vkr.shape[1]
        if Hkv == 0:
            raise ValueError(f"k_rope must have shape (nnz, Hkv, R) with Hkv > 0, got {vkr.shape}")
    if (vqn is None) != (vkn is None):
        raise ValueError(
            f"q_nope and k_nope must both be arrays or both be None, got q_nope "
            f"{'None' if vqn is None else vqn.shape}, k_nope "
            f"{'None' if vkn is None else vkn.shape}"
        )
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
            raise ValueError(
                "v is required for GQA/MHA (3-D k_rope): an array of shape (nnz, "
                f"Hkv, head_dim) = ({T}, {Hkv}, {D}), got None"
            )
        ck.check_shape(vv, (T, Hkv, D), "(nnz, Hkv, head_dim)")
    return T, Hq, Hkv, R, Dn


def _check_indexing(a, R, T, mrope_section, mrope_interleaved):
    """The cos/sin table, the mRoPE sections and the index arrays; ``(P, sections)``."""
    vt, vpos, vbat, vposn = a.cos_sin_cache, a.pos_ids, a.batch_indices, a.positions
    vind, vptr = a.kv_indices, a.kv_indptr
    ck.check_ndim(vt, 2, "(P, R)")
    ck.check_dtype(vt, (FLOAT32,))
    ck.check_shape(vt, (None, R), "(P, R)")
    sections = check_mrope(mrope_section, mrope_interleaved, R, vpos, (3, T), "(3, nnz)")
    tokens = (T,)
    for view in (vbat, vposn) if sections else (vpos, vbat, vposn):
        if view.shape != tokens:  # (the checker raises; a test first: this runs per first call)
            ck.check_shape(view, tokens, "(nnz,)")
    ck.check_ndim(vind, 1, "(total_pages,)")
    ck.check_ndim(vptr, 1, "(batch_size + 1,)")
    if vptr.shape[0] < 1:
        raise ValueError(
            f"kv_indptr must have shape (batch_size + 1,), at least one entry, got {vptr.shape}"
        )
    for view in (vpos, vbat, vposn, vptr, vind):
        if view.dtype not in INDEX_DTYPES:
            ck.check_dtype(view, INDEX_DTYPES)  # raises
        # an empty array may report any stride; a 1-D one of stride 1 is contiguous (no call)
        if view.size > 1 and view.strides != ck.UNIT_STRIDE:
            ck.check_contiguous(view)
    return vt.shape[0], sections


def _check_caches(vc0, vc1, mla, page_size, kv_layout, Hkv, R, Dn):
    """The caches' shapes; their ``num_pages``."""
    if mla:
        ck.check_ndim(vc0, 3, "(num_pages, page_size, no_rope_dim)")
        num_pages = vc0.shape[0]
        ck.check_shape(vc0, (num_pages, page_size, Dn), "(num_pages, page_size, no_rope_dim)")
        ck.check_shape(vc1, (num_pages, page_size, R), "(num_pages, page_size, rope_dim)")
        return num_pages
    nhd = kv_layout == "NHD"
    spelled, spelled_for = decl.paged_layout(kv_layout)
    ck.check_ndim(vc0, 4, spelled)
    num_pages = vc0.shape[0]
    D = R + Dn
    shape = (num_pages, page_size, Hkv, D) if nhd else (num_pages, Hkv, page_size, D)
    ck.check_shape(vc0, shape, spelled_for)
    ck.check_shape(vc1, shape, spelled_for)
    return num_pages


def _cache_rows(mla, R, out_dtype):
    """``(kr, kn, vd)``: the destinations ``(argument, byte offset)`` of the K-rope, K-nope and V
    rows (their strides: :func:`_stride_program`)."""
    if mla:
        return (_KPE_CACHE, 0), (_CKV_CACHE, 0), (-1, 0)  # (no V: no argument)
    # K-nope: past the rope dims of the K rows
    return (_K_CACHE, 0), (_K_CACHE, R * out_dtype.itemsize), (_V_CACHE, 0)


def _check_out_dtype(views, out_dtype):
    """The caches and the given q outputs have the cache dtype ``out_dtype``."""
    for view in views:
        if view.dtype != out_dtype:
            raise TypeError(
                f"{view.name} must have the quantize dtype {out_dtype}, got {view.dtype}"
            )


def _check_scales(a, f, out_dtype, source, mla, heads, cache):
    """The static scales (``quant_scale_q``, ``quant_scale_kv``) and the options; ``(q_scale,
    q_scales view, kv_scale, kv_scales view, the options' strides)``. ``heads``: ``(T, Hq,
    Hkv)``; ``cache``: ``(num_pages, page_size, kv_layout)``."""
    T, Hq, Hkv = heads
    q_scale, vqs, kv_scale, vks = (
        f.quant_scale_q,
        a.quant_scale_q,
        f.quant_scale_kv,
        a.quant_scale_kv,
    )
    ck.check_q_scales(
        out_dtype,
        source,
        "quant_scale_q",
        q_scale is not None or vqs is not None,
        a.q_scale_out,
        (T, Hq),
        "(nnz, Hq)",
        static_needs_fp8=False,
    )
    q_scale, vqs = _scales(vqs, 1.0 if q_scale is None else q_scale, "quant_scale_q", Hq)
    kv_scale, vks = _scales(vks, 1.0 if kv_scale is None else kv_scale, "quant_scale_kv", Hkv)
    scale_st = _check_options(a.q_scale_out, a.k_scales, a.v_scales, a.status, mla, Hkv, *cache)
    return q_scale, vqs, kv_scale, vks, scale_st


def _outputs(a, c):
    """The outputs a call allocates, the slots of ``(q_rope_out, q_nope_out)`` (the given
    arguments', else the new outputs', whose pointers follow the arguments'), and the result."""
    outputs, slot, out_slots = [], len(_GQA_ARGS), []
    for index, shape in ((_Q_ROPE_OUT, (c.T, c.Hq, c.R)), (_Q_NOPE_OUT, (c.T, c.Hq, c.Dn))):
        if a[index] is None:
            outputs.append(Output(shape, c.out_dtype))
            out_slots.append(slot)
            slot += 1
        else:
            out_slots.append(index)
    given = (a.q_rope_out is not None, a.q_nope_out is not None)
    return outputs, out_slots, _RESULTS[given]


def _results(qro, qno):
    """``(q_rope_out, q_nope_out)`` of a call, by which of them the caller gave (a plan's layout
    fixes which): the given arguments (at indices ``qro``, ``qno``), else the new outputs."""

    def both(arrays, outs):
        return arrays[qro], arrays[qno]

    def rope_given(arrays, outs):
        return arrays[qro], outs[0]

    def nope_given(arrays, outs):
        return outs[0], arrays[qno]

    def none_given(arrays, outs):
        return outs[0], outs[1]

    return {
        (True, True): both,
        (True, False): rope_given,
        (False, True): nope_given,
        (False, False): none_given,
    }


def _host_run(a, f, c):
    """The NumPy backend's run of a host call."""
    vqro, vqno, vptr, vind, vstatus = (
        a.q_rope_out,
        a.q_nope_out,
        a.kv_indptr,
        a.kv_indices,
        a.status,
    )

    def host(v, outs):
        new = iter(outs)
        qro, qno = (x if x is not None else next(new) for x in (vqro, vqno))

        def h(view):
            return None if view is None else view.host

        if vstatus is not None:
            vstatus.host[...] = reference.paged_indptr_status(vptr.host, vind.shape[0])
            if vstatus.host.item():
                return
        if not c.T:
            return
        reference.rope_append_paged_kv_cache(
            a.q_rope.host,
            a.k_rope.host,
            h(a.q_nope),
            h(a.k_nope),
            h(a.v),
            a.cos_sin_cache.host,
            a.pos_ids.host,
            (a.cache0.host, a.cache1.host),
            vind.host,
            vptr.host,
            a.batch_indices.host,
            a.positions.host,
            f.is_neox,
            c.q_scale if c.vqs is None else c.vqs.host,
            c.kv_scale if c.vks is None else c.vks.host,
            c.page_size,
            c.kv_layout,
            qro.host,
            qno.host,
            c.sections,
            f.mrope_interleaved,
            q_scale_out=h(a.q_scale_out),
            kv_cache_scales=(h(a.k_scales), h(a.v_scales)) if a.k_scales is not None else None,
        )

    return host


def _choose(a, is_neox, c, lean=False):
    """The vector width, the kernel (section or row, plain or with the options; the lean kernel
    where ``lean`` allows it: :func:`_prepare` passes False for mRoPE) and the launch shape of a
    device call."""
    vqr, vqso, vksc, vstatus = a.q_rope, a.q_scale_out, a.k_scales, a.status
    R, Dn, T, Hq, Hkv, mla = c.R, c.Dn, c.T, c.Hq, c.Hkv, c.mla
    # the widest n for which the data rows (and the table's) are aligned, read once for every
    # width tried (widest_aligned)
    widest = widest_aligned((*c.inputs, a.cache0, a.cache1, *c.given_outs))
    table_widest = widest_aligned((a.cos_sin_cache,))

    def fits(n):
        rot = (R // 2) % n == 0 if is_neox else (R % n == 0 and n % 2 == 0)
        return rot and Dn % n == 0 and n <= widest and (n if is_neox else n // 2) <= table_widest

    n = vector_width(vqr.dtype.itemsize, fits)
    if n is None:  # only interleaved RoPE with misaligned pointers can get here (R is even)
        raise BufferError(
            "interleaved RoPE reads element pairs: every row of q_rope, k_rope, "
            "q_nope, k_nope, v, the caches and the q outputs must start at an even "
            "element"
        )
    ri = R // (2 * n) if is_neox else R // n
    items = (Hq + Hkv) * (ri + Dn // n) + (0 if mla else Hkv * (R + Dn) // n)
    group = ri + Dn // n  # chunks of a head row
    opts = vqso is not None or vksc is not None or vstatus is not None
    # the options live in the row kernel, but for status= alone on heads too wide for a lane
    # group (MLA's 576-element rows), which the section kernel checks as it is (its _status
    # variant; the row kernel at 72 lanes a row ran such calls at half the bandwidth)
    status_only = vstatus is not None and vqso is None and vksc is None and T > 0
    if opts and not status_only and group > MAX_BLOCK:
        raise BufferError(
            f"q_scale_out, kv_cache_scales and status run the row kernel, a lane "
            f"per {n} elements of a head row: rows of {R + Dn} elements need {group} "
            f"lanes, more than {MAX_BLOCK}; align the rows of the inputs, caches "
            f"and q outputs to {16 // vqr.dtype.itemsize * vqr.dtype.itemsize} "
            f"bytes"
        )
    H = Hq + Hkv + (0 if mla else Hkv)  # head rows of a token
    if lean and not opts and _lean_fits(T, H, group):
        rows = _lean_rows(T, group, vqr.dtype, c.out_dtype)
        if rows > 1:  # U head rows a thread: blocks (G, S, tokens) of S U rows
            (_, slots, tokens), (_, splits) = lean_shape(T, -(-H // rows), group)
            return _Choice(n, group, ("lean_rows", rows), group, slots, splits, False, tokens)
        (_, slots, tokens), (_, splits) = lean_shape(T, H, group)
        # ("lean", 64-bit offsets): the offsets' width is settled by _pack, from the strides
        return _Choice(n, group, ("lean", False), group, slots, splits, False, tokens)
    lanes = _lean_multi_lanes(T, H, group, ri) if lean and not opts else 0
    if lanes:  # C chunks a thread: blocks (lanes, S, tokens)
        (_, slots, tokens), (_, splits) = lean_shape(T, H, lanes)
        chunks = -(-group // lanes)
        return _Choice(n, group, ("lean_multi", chunks), lanes, slots, splits, False, tokens)
    # heads too wide for a lane group of row_group (MLA) at decode: the row kernel too
    wide = not opts and group <= MAX_BLOCK and T * H < TUNING["wide_rows_below"]
    tokens = 1
    if group <= TUNING["row_group"] or (opts and not status_only) or wide:
        # status= with no tokens: one block, which only validates
        block, rows, splits = row_launch_shape(
            max(T, 1),
            H,
            group,
            TUNING["opts_rows"] if opts else ROWS[-1],
            _wide_block(T * H, group) if wide and group > TUNING["row_group"] else None,
        )
        shape = ("rows", 1 if rows == 1 else ROWS[-1])
        if not opts:
            tokens = row_tokens(T, block)
    else:
        (block, splits, shape), rows = launch_shape(items, T, n), 0
    return _Choice(n, group, shape, block, rows, splits, opts, tokens)


def _wide_block(rows, group):
    """Threads per block of rows too wide for a lane group, ``rows`` of them in the call: up to
    ``wide_row_block``, a row a block (``group`` lanes) from ``wide_row_single_from`` rows."""
    return group if rows >= TUNING["wide_row_single_from"] else TUNING["wide_row_block"]


def _pack(a, f, c, choice, out_slots):
    """The launch of a device call: its record's values and pointer slots."""
    values = _values(a, f, c, choice)
    if choice.opts:  # the fields OPTS_PARAMS adds (Launch reads only its struct's fields)
        values.update(c.scale_st, T=c.T)
    slots = dict(_ARGUMENT_SLOTS)  # and those that depend on the call:
    slots["kr_cache"], slots["kn_cache"], slots["v_cache"] = c.kr, c.kn, c.vd
    slots["q_rope_out"], slots["q_nope_out"] = (out_slots[0], 0), (out_slots[1], 0)
    shape, block = choice.shape, (choice.block, choice.tokens)
    params = OPTS_PARAMS if choice.opts else PARAMS
    if shape[0] == "lean":  # blocks (G, S, tokens); 64-bit offsets where a span needs them
        shape = ("lean", _lean_wide(values, c, a))
        block = (choice.group, choice.rows, choice.tokens)
    elif shape[0] in _LEAN_FORMS:  # blocks (lanes: G for U rows, S, tokens), lean offsets
        if shape[0] == "lean_multi":
            shape = (*shape, _lean_stream(a, c))
        shape = (*shape, _lean_wide(values, c, a))
        block = (choice.block, choice.rows, choice.tokens)
    if shape[0] in _LEAN_RECORDS and not shape[-1]:  # 32-bit offsets: the lean record
        params = LEAN_PARAMS
    kernel = expression(
        a.q_rope.dtype,
        c.out_dtype,
        f.is_neox,
        choice.n,
        shape,
        bool(c.sections),
        choice.opts,
    )
    return Launch(
        STEM,
        kernel,
        c.device,
        (-(-max(c.T, 1) // choice.tokens), choice.splits),
        block,
        params,
        values,
        slots,
        pdl=f.enable_pdl,
    )


def _lean_stream(a, c):
    """Whether the C-chunk lean kernel takes the streaming hint on its row loads: the call's head
    rows move more bytes (read and written) than ``lean_stream_l2`` of the device's L2 (the
    comment above LEAN_MULTI_CHUNKS)."""
    H = c.Hq + c.Hkv + (0 if c.mla else c.Hkv)
    moved = c.T * H * (c.R + c.Dn) * (a.q_rope.dtype.itemsize + c.out_dtype.itemsize)
    return moved > TUNING["lean_stream_l2"] * l2_bytes(c.device)


def _lean_wide(values, c, views):
    """Whether the lean kernels take 64-bit offsets and index arithmetic: an array's span past
    INT32_SPAN elements, a stride outside int32 (the 32-bit form's record, LEAN_PARAMS, holds
    them as int32; a stride of a dimension of extent one can be any value), or an index value a
    slot can use (a request below B, a position below num_indices x page_size, a page id below
    num_pages) that may not fit in 31 bits. The 32-bit form reads the index entries' words and
    treats an int64 entry with a high word as out of range, which is exact only under the last
    rule.

    The span is bounded first from the call's ``views`` (:func:`_span_bound`, one C call), and
    computed exactly (:func:`_lean_span`) only where that bound passes INT32_SPAN: the same
    answer, as the bound is never below the span."""
    index_limit = max(values["B"] + 1, values["num_indices"] * c.page_size + 1, c.num_pages)
    return (
        index_limit > INT32_SPAN
        or not int32_fields_fit(values, _STRIDES)
        or (_span_bound(views, c) > INT32_SPAN and _lean_span(values, c) > INT32_SPAN)
    )


def _span_bound(views, c):
    """A bound of :func:`_lean_span` from the arrays themselves: each term of it is an array's
    reach from its pointer (``|stride| x (extent - 1)`` summed over its dims, in elements), at
    most its byte span (:func:`ropekv._arrays.max_span`), or a new q output's, below ``T x Hq x
    D``, plus the row of D elements. An empty array gives no bound (INT32_SPAN + 1: the exact
    span decides)."""
    widest = max_span(views)
    if widest < 0:
        return INT32_SPAN + 1
    D = c.R + c.Dn
    return max(widest, c.T * c.Hq * D) + D


def _lean_span(values, c):
    """The largest element offset from an array's base that the lean kernel forms (strides in
    elements, from the record's ``values``): every input, q output, cache and the table. Written
    out term by term (a first call computes it; a loop of generators cost 4x the bytecode)."""
    v, D = values, c.R + c.Dn
    t, q, k = max(c.T - 1, 0), max(c.Hq - 1, 0), max(c.Hkv - 1, 0)
    p, e = max(c.num_pages - 1, 0), max(c.page_size - 1, 0)
    return D + max(
        t * abs(v["qr_sn"]) + q * abs(v["qr_sh"]),
        t * abs(v["qn_sn"]) + q * abs(v["qn_sh"]),
        t * abs(v["kr_sn"]) + k * abs(v["kr_sh"]),
        t * abs(v["kn_sn"]) + k * abs(v["kn_sh"]),
        t * abs(v["v_sn"]) + k * abs(v["v_sh"]),
        t * abs(v["qro_sn"]) + q * abs(v["qro_sh"]),
        t * abs(v["qno_sn"]) + q * abs(v["qno_sh"]),
        p * abs(v["krc_sp"]) + e * abs(v["krc_se"]) + k * abs(v["krc_sh"]),
        p * abs(v["knc_sp"]) + e * abs(v["knc_se"]) + k * abs(v["knc_sh"]),
        p * abs(v["vc_sp"]) + e * abs(v["vc_se"]) + k * abs(v["vc_sh"]),
        max(c.P - 1, 0) * abs(v["cs_sp"]),
    )


def _decode_guess(T, B):
    """The record's guess field: 1 for calls of T tokens into B requests where T == B (decode's
    one token a request) while ``lean_guess`` is on."""
    return int(bool(TUNING["lean_guess"]) and T == B)


def _index64(a):
    """The record's index64: bit i set where the i-th of pos_ids, batch_indices, positions,
    kv_indptr and kv_indices is int64."""
    return (
        (a.pos_ids.dtype == INT64)
        | (a.batch_indices.dtype == INT64) << 1
        | (a.positions.dtype == INT64) << 2
        | (a.kv_indptr.dtype == INT64) << 3
        | (a.kv_indices.dtype == INT64) << 4
    )


# the record's stride fields (elements), in its order: inputs, q outputs, caches (page, entry,
# head), the table's position stride
_STRIDE_FIELDS = PARAMS.names[PARAMS.names.index("qr_sn") : PARAMS.names.index("cs_sp") + 1]
# the record's fields a first call's _Checked holds as they are
_CHECKED_FIELDS = ("num_pages", "q_scale", "kv_scale", "Hq", "Hkv", "R", "Dn", "page_size", "P")
_checked_values = operator.itemgetter(*map(_Checked._fields.index, _CHECKED_FIELDS))


@functools.cache
def _stride_program(mla, kv_layout):
    """The :func:`ropekv._arrays.gather_strides` program of the record's :data:`_STRIDE_FIELDS`
    (``(slot of _Views, axis)``; slot -1, or an array not given: 0): the arrays' strides, and the
    ``(page, entry, head)`` strides of the cache rows :func:`_cache_rows` names (K-rope and K-nope
    rows in ``k_cache``, V rows in ``v_cache``, in either layout; MLA: K-rope rows in
    ``kpe_cache``, K-nope in ``ckv_cache``, no heads and no V). A q output not given reads 0 here
    (:func:`_values` puts the new output's strides)."""
    slot = _Views._fields.index
    zero = (-1, 0)

    def rows(name, *axes):
        return tuple((slot(name), axis) for axis in axes)

    if mla:
        k_in, caches = (
            (*rows("k_rope", 0), zero, *rows("k_nope", 0), zero, zero, zero),
            (*rows("cache1", 0, 1), zero, *rows("cache0", 0, 1), zero, zero, zero, zero),
        )
    else:
        axes = (0, 1, 2) if kv_layout == "NHD" else (0, 2, 1)
        k_in = rows("k_rope", 0, 1) + rows("k_nope", 0, 1) + rows("v", 0, 1)
        caches = rows("cache0", *axes) * 2 + rows("cache1", *axes)
    program = (
        *rows("q_rope", 0, 1),
        *rows("q_nope", 0, 1),
        *k_in,
        *rows("q_rope_out", 0, 1),
        *rows("q_nope_out", 0, 1),
        *caches,
        *rows("cos_sin_cache", 0),
    )
    assert len(program) == len(_STRIDE_FIELDS)
    return program


def _values(a, f, c, choice):
    """The record's fields past the pointers (every pointer field has a slot, :func:`_pack`): the
    strides gathered in one call (:func:`_stride_program`), then the sizes and the choice."""
    values = dict(zip(_STRIDE_FIELDS, gather_strides(a, _stride_program(c.mla, c.kv_layout))))
    values.update(zip(_CHECKED_FIELDS, _checked_values(c)))
    if a.q_rope_out is None:  # a new output: C-contiguous (T, Hq, R)
        values["qro_sn"], values["qro_sh"] = c.Hq * c.R, c.R
    if a.q_nope_out is None:
        values["qno_sn"], values["qno_sh"] = c.Hq * c.Dn, c.Dn
    T, B, sections = c.T, a.kv_indptr.shape[0] - 1, c.sections
    values.update(
        num_indices=a.kv_indices.shape[0],
        Hv=0 if c.mla else c.Hkv,
        B=B,
        index64=_index64(a),
        group=choice.group,
        rows=choice.rows,
        pid_st=T,
        mrope=int(bool(sections)),
        mrope_t=sections[0] if sections else 0,
        mrope_h=sections[1] if sections else 0,
        mrope_w=sections[2] if sections else 0,
        mrope_interleaved=int(f.mrope_interleaved),
        # the lean kernels' decode guess (LeanSlot in paged.cu): one token a request
        guess=_decode_guess(T, B),
    )
    return values


_NAMES = ("q_rope", "k_rope", "q_nope", "k_nope", "v", "cos_sin_cache", "pos_ids")
_TAIL = (
    "kv_indices",
    "kv_indptr",
    "batch_indices",
    "positions",
    "q_rope_out",
    "q_nope_out",
    "quant_scale_q",
    "quant_scale_kv",
    "q_scale_out",
    "k_scales",
    "v_scales",
    "status",
)
_GQA_ARGS = (*_NAMES, "k_cache", "v_cache", *_TAIL)
_MLA_ARGS = (*_NAMES, "ckv_cache", "kpe_cache", *_TAIL)
# argument positions, by name (the same in both: the caches differ only in name). Made once (a
# first call reads them): the caches, the outputs, the pointer fields' slots that are the same
# for every call (an argument at offset 0); the written arrays and the in-place pairs follow from
# the declaration (the end of this module)
_K_CACHE, _V_CACHE = ck.argument_indices(_GQA_ARGS, ("k_cache", "v_cache"))
_CKV_CACHE, _KPE_CACHE = ck.argument_indices(_MLA_ARGS, ("ckv_cache", "kpe_cache"))
_Q_ROPE_OUT, _Q_NOPE_OUT = ck.argument_indices(_GQA_ARGS, ("q_rope_out", "q_nope_out"))
_RESULTS = _results(_Q_ROPE_OUT, _Q_NOPE_OUT)
# record pointer field <- argument
_ARGUMENT_SLOTS = {
    field: (ck.argument_indices(_GQA_ARGS, name), 0)
    for field, name in (
        ("q_rope", "q_rope"),
        ("k_rope", "k_rope"),
        ("q_nope", "q_nope"),
        ("k_nope", "k_nope"),
        ("v", "v"),
        ("cos_sin", "cos_sin_cache"),
        ("pos_ids", "pos_ids"),
        ("kv_indices", "kv_indices"),
        ("kv_indptr", "kv_indptr"),
        ("batch_indices", "batch_indices"),
        ("positions", "positions"),
        ("q_scales", "quant_scale_q"),
        ("kv_scales", "quant_scale_kv"),
        ("q_scale_out", "q_scale_out"),
        ("k_scales", "k_scales"),
        ("v_scales", "v_scales"),
        ("status", "status"),
    )
}
_NO_OPTIONS = dict.fromkeys(
    ("qso_sn", "qso_sh", "ks_sp", "ks_se", "ks_sh", "vs_sp", "vs_se", "vs_sh"), 0
)  # _check_options without options (read, never written)
_FLAGS = [
    ("quantize", AS_IS),
    ("is_neox", FLAG),
    ("quantize_dtype", KEY),
    ("quant_scale_q", AS_IS),
    ("quant_scale_kv", AS_IS),  # scales: reals, never bools
    ("page_size", INT),
    ("kv_layout", KEY),
    ("enable_pdl", FLAG),
    ("tuning", AS_IS),
    ("mrope_section", KEY),
    ("mrope_interleaved", FLAG),
]
# the arguments of a call by role: the MLA caches (ckv_cache, kpe_cache) as cache0, cache1, like
# the GQA/MHA ones (k_cache, v_cache); quant_scale_q / quant_scale_kv are the scale arrays
_Views = collections.namedtuple("_Views", (*_NAMES, "cache0", "cache1", *_TAIL))
_Flags = collections.namedtuple("_Flags", [name for name, _ in _FLAGS])
_GQA = Op("rope_append_paged_kv_cache", _GQA_ARGS, _prepare, flags=_FLAGS)
_MLA = Op("rope_append_paged_kv_cache", _MLA_ARGS, _prepare, flags=_FLAGS)


def _check_indices(vpos, vbat, vposn, vptr, vind, P, page_size, num_pages, mrope=None):
    """``ROPEKV_CHECK_INDICES``: IndexError for the first token the kernel would skip (padding,
    ``batch_indices < 0``, aside), and for two tokens writing one cache row."""
    if mrope:
        check_mrope_indices(vpos, P)
    pos, b, p = (ck.host_copy(x).astype(np.int64) for x in (vpos, vbat, vposn))
    pos = pos[0] if mrope else pos  # in range: checked
    indptr, indices = (ck.host_copy(x).astype(np.int64) for x in (vptr, vind))
    bad = np.nonzero((pos < 0) | (pos >= P))[0]
    if bad.size:
        i = int(bad[0])
        raise IndexError(
            f"token {i} has pos_ids[{i}] = {pos[i]}, outside the cos_sin_cache's [0, P={P})"
        )
    B, num_indices = indptr.shape[0] - 1, indices.shape[0]
    page, entry = reference.paged_append_slots(indices, indptr, b, p, page_size, num_pages)
    for i in np.nonzero((b >= 0) & (page < 0))[0]:
        i = int(i)
        if b[i] >= B:
            raise IndexError(
                f"token {i} has batch_indices[{i}] = {b[i]}, outside [0, "
                f"batch_size={B}) (kv_indptr has {B + 1} entries)"
            )
        if p[i] < 0:
            raise IndexError(f"token {i} has a negative position, positions[{i}] = {p[i]}")
        first, last = indptr[b[i]], indptr[b[i] + 1]
        if not 0 <= first <= num_indices:
            raise IndexError(
                f"token {i} (request {b[i]}) starts its page-table entries at "
                f"kv_indptr[{b[i]}] = {first}, outside [0, {num_indices}] "
                f"(kv_indices has {num_indices} entries)"
            )
        it = first + p[i] // page_size
        if not first <= it < min(last, num_indices):
            raise IndexError(
                f"token {i} (request {b[i]}, position {p[i]}) needs page-table entry "
                f"kv_indptr[{b[i]}] + {p[i]} // {page_size} = {it}, outside the request's "
                f"[{first}, {last}) or kv_indices' [0, {num_indices})"
            )
        raise IndexError(
            f"token {i} (request {b[i]}, position {p[i]}) maps to page "
            f"kv_indices[{it}] = {indices[it]}, outside [0, num_pages={num_pages})"
        )
    writes = page >= 0
    ck.check_unique_slots(
        np.stack([page[writes], entry[writes]], 1),
        np.flatnonzero(writes),
        "cache row (page, entry)",
    )


# ---- the declarations (ropekv/_declare.py): the torch and JAX forms follow from them ----------


def _declaration(name, outputs, cache_dtypes):
    """The two paged ops take the same arguments (FlashInfer's, then ropekv's options); the
    caches' dtypes (``cache_dtypes``, those of the q outputs too) tell them apart."""
    return decl.Declaration(
        name,
        (
            decl.array("q_rope", shape=("(nnz, Hq, R)",), dtypes=INPUT_DTYPES),
            decl.array("k_rope", shape=("(nnz, Hkv, R)", "(nnz, R)"), dtypes=("q_rope",)),
            decl.array(
                "q_nope", nullable=True, shape=("(nnz, Hq, no_rope_dim)",), dtypes=("q_rope",)
            ),
            decl.array(
                "k_nope",
                nullable=True,
                shape=("(nnz, Hkv, no_rope_dim)", "(nnz, no_rope_dim)"),
                dtypes=("q_rope",),
            ),
            decl.array("v", nullable=True, shape=("(nnz, Hkv, head_dim)",), dtypes=("q_rope",)),
            decl.array("cos_sin_cache", shape=("(P, R)",), dtypes=(FLOAT32,)),
            decl.array("pos_ids", shape=("(nnz,)", "(3, nnz)"), dtypes=INDEX_DTYPES),
            decl.arg(
                "paged_kv_cache",
                decl.WRITTEN,
                "pair",
                parts=("k_cache", "v_cache"),
                aka=("ckv_cache", "kpe_cache"),  # MLA's (2-D k_rope)
                shape=(
                    *decl.PAGED_LAYOUTS.values(),
                    "(num_pages, page_size, no_rope_dim)",
                    "(num_pages, page_size, R)",
                ),
                dtypes=cache_dtypes,
            ),
            decl.array("kv_indices", shape=("(total_pages,)",), dtypes=INDEX_DTYPES),
            decl.array("kv_indptr", shape=("(batch_size + 1,)",), dtypes=INDEX_DTYPES),
            decl.array("batch_indices", shape=("(nnz,)",), dtypes=INDEX_DTYPES),
            decl.array("positions", shape=("(nnz,)",), dtypes=INDEX_DTYPES),
            decl.scalar("is_neox", "bool", True),
            decl.scalar("quantize_dtype", "dtype", None),
            decl.scalar(
                "quant_scale_q",
                "float_or_tensor",
                None,
                parts=("quant_scale_q", "quant_scales_q"),
                shape=("(Hq,)",),
                dtypes=(FLOAT32,),
            ),
            decl.scalar(
                "quant_scale_kv",
                "float_or_tensor",
                None,
                parts=("quant_scale_kv", "quant_scales_kv"),
                shape=("(Hkv,)",),
                dtypes=(FLOAT32,),
            ),
            decl.scalar("page_size", "int", 16),
            decl.scalar("kv_layout", "str", "NHD"),
            decl.out("q_rope_out", alias="q_rope", shape=("(nnz, Hq, R)",), dtypes=cache_dtypes),
            decl.out(
                "q_nope_out", alias="q_nope", shape=("(nnz, Hq, no_rope_dim)",), dtypes=cache_dtypes
            ),
            decl.scalar("enable_pdl", "bool", False),
            decl.scalar("mrope_section", "ints", None, check=section_list),
            decl.scalar("mrope_interleaved", "bool", False),
            decl.written("q_scale_out", optional=True, shape=("(nnz, Hq)",), dtypes=(FLOAT32,)),
            decl.kv_cache_scales(),
            decl.status(),
        ),
        outputs=outputs,
    )


def _fp8_outputs(values):
    from ropekv import _frameworks

    return _frameworks.paged_fp8_outputs(values)


def _append_outputs(values):
    from ropekv import _frameworks

    return _frameworks.paged_append_outputs(values)


DECLARATIONS = (
    _declaration("rope_quantize_fp8_append_paged_kv_cache", _fp8_outputs, (*FP8_DTYPES, INT8)),
    _declaration("rope_append_paged_kv_cache", _append_outputs, ("q_rope", *FP8_DTYPES, INT8)),
)
# the launch's roles, from the declaration (both ops alike): the arrays written when given, the
# pairs that may be one array (q_rope_out = q_rope, q_nope_out = q_nope)
_WRITTEN = DECLARATIONS[0].launch_written(_GQA_ARGS)
_INPLACE = DECLARATIONS[0].launch_in_place(_GQA_ARGS)
