"""``fused_qkv_matmul_append_paged_kv_cache``: the QKV projection whose K/V rows land directly in a
paged KV cache (RoPE on Q and K in the epilogue), and ``pack_int4`` for 4-bit weights.

Three paths, picked by the token count T (and, on sm_90, a fourth kernel for 16-bit weights):

* plain calls (no ``status=``, no ``clear_unused_last_page_rows``) of a few tokens with 16-byte
  weight loads take a block-per-row-pairs kernel first, K split over its warps and reduced in
  shared memory, no cluster: ``qkv_gemv_lean`` (CUDA cores) up to ``GEMV_LEAN_MAX_TOKENS`` /
  ``GEMV_LEAN_DENSE_MAX_TOKENS`` tokens (fp8 / 4-bit, 16-bit weights), then, on sm_90,
  ``qkv_lean_mma`` (the same block on ``mma.sync``) up to ``LEAN_MMA_MAX_TOKENS`` /
  ``LEAN_MMA_DENSE_MAX_TOKENS``; the paths below take what these leave.
* fp16 / bf16 weights, ``WGMMA_MIN_TOKENS <= T <= WGMMA_MAX_TOKENS`` (1 to 256), on sm_90
  devices, K a multiple of 64 and 16-byte aligned rows: ``qkv_wgmma``, one launch: the weights
  and hidden rows staged in shared memory (cp.async) and multiplied by Hopper's warpgroup MMA
  (``wgmma``, an sm_90a instruction; the kernel is compiled for that target), split-K over a
  cluster and the epilogue fused as below. Faster than every other path up to 192 tokens, within
  0.93-1.05x of cuBLAS + the epilogue at 193-256 in a third of its host time
  (docs/design/qkv.md). fp8 weights take it too from ``WGMMA_FP8_MIN_TOKENS`` (17) to 128
  tokens (K a multiple of 128), their codes converted to the input dtype in the wgmmas' A
  registers, and 4-bit weights from ``WGMMA_INT4_MIN_TOKENS`` (17) to 224 (groups of a multiple
  of 32), likewise (groups of 32: in shared memory).
* small batches (``MMA_MIN_TOKENS <= T <= MMA_MAX_TOKENS``, ``MMA_MAX_TOKENS_QUANTIZED`` for fp8
  and 4-bit weights, on sm_90 and newer, when D divides 128 and the weights and hidden rows allow
  16-byte loads): ``qkv_mma``, one launch of tensor-core
  (``mma.sync``) weight streaming, split-K over a cluster of CTAs (MMA_SPLIT) reduced through distributed
  shared memory, with the epilogue (RoPE, Q to ``out``, K/V quantized into their pages) fused.
  From ``TILED_MIN_TOKENS`` tokens on, fp8 and 4-bit (and fp16 / bf16) weights with K a whole
  number of stages (``TILED_BK``) run ``qkv_mma_tiled`` instead: the same split and epilogue,
  with the weights and hidden rows staged in shared memory (cp.async, ``TILED_STAGES`` deep) and
  shared by all the warps of a CTA. 16-bit weights take these two kernels only where
  ``qkv_wgmma`` does not apply (another GPU, K not a multiple of 64), and the tiled kernel only
  when ``MMA_MAX_TOKENS`` is raised (it is slower than cuBLAS + the epilogue there).
* decode otherwise (``T <= GEMV_MAX_TOKENS``): ropekv's own weight-streaming skinny GEMM
  (``qkv_gemv``), one launch: every weight byte is read once, accumulation is float32, and the
  epilogue ropes and writes Q to ``out`` and K/V to their pages.
* prefill: cuBLAS (``cublasGemmEx``, float32 accumulation) writes Q|K|V into a temporary, then
  one ropekv launch (``qkv_epilogue``) ropes Q into ``out`` and ropes/scatters K and V into their
  pages. Quantized weights are first dequantized to the input dtype by a ropekv kernel
  (``qkv_dequant``) into a temporary ``(N, K)`` buffer.

A call on a stream being captured into a CUDA graph cannot take the prefill path (a graph cannot
hold its temporaries): up to ``GRAPH_MAX_TOKENS`` tokens it runs the fused kernel above that would
take it with its token cap raised (``qkv_wgmma`` for 16-bit weights, ``qkv_mma_tiled`` /
``qkv_mma`` for the others; see :func:`graph_safe`), and beyond it is refused (``ValueError``).

``status=`` and ``clear_unused_last_page_rows`` run each path's options kernel (``qkv_gemv``,
``qkv_mma``, ``qkv_mma_tiled``, ``qkv_wgmma`` and ``qkv_epilogue`` with their ``OPTS`` flag;
the plain ones compile them out). With
``status`` the offsets are validated in the launch that writes: the fused kernels before their
epilogue, the prefill path in ``qkv_epilogue``, its GEMMs then writing only temporaries (Q too).
"""

from __future__ import annotations

import collections
import functools
import itertools
import numbers
from typing import NamedTuple

import numpy as np

from ropekv import _checks as ck
from ropekv import _declare as decl
from ropekv import reference
from ropekv._arrays import (
    BFLOAT16,
    FLOAT8_E4M3FN,
    FLOAT16,
    FLOAT32,
    FP8_DTYPES,
    HOST,
    INT32,
    UINT8,
    UINT32,
)
from ropekv._compile import c_bool, c_type, name_expression
from ropekv._launch import (
    AS_IS,
    FLAG,
    KEY,
    Gemm,
    Launch,
    Op,
    Output,
    ParamStruct,
    Plan,
    division_fields,
    max_active_clusters,
)
from ropekv._mrope import check_status
from ropekv._types import ArrayLike, StreamLike
from ropekv._vector import widest_aligned

STEM = "qkv"
INPUT_DTYPES = (FLOAT16, BFLOAT16)
LAYOUTS = tuple(decl.PAGED_LAYOUTS)
W_DENSE, W_FP8, W_INT4 = 0, 1, 2
# qkv_wgmma's forms for 4-bit and fp8 weights whose codes it converts into its wgmmas' A
# registers (WGMMA_INT4_REG, WGMMA_FP8_REG; W_INT4 / W_FP8 there: into 16-bit shared-memory
# buffers), mirrored in qkv.cu
W_INT4_REG, W_FP8_REG = 3, 4
_WGMMA_BASE = {W_INT4_REG: W_INT4, W_FP8_REG: W_FP8}  # the format each register form converts

# Token counts up to this run the CUDA-core skinny GEMM (qkv_gemv); the tensor-core kernel and
# cuBLAS take over above (MMA_* below). Measured on the H200 (`ropekv bench --cases qkv` times it),
# Llama-3-8B fp16 projection: fused 17.4 / 17.6 / 26.4 us at T = 1 / 2 / 4 (graph replay) against
# about 22 us for the cuBLAS GEMM alone; the CUDA-core kernel loses from T = 4 on.
GEMV_MAX_TOKENS = 2
GEMV_TILES = (1, 2, 4, 8, 16)  # tokens per block (the token tile TT)
# 4-bit weights at token tiles up to this can decode as 1 + q/16 floats (fewer instructions, see
# qkv.cu). Off by default: on the H200 it measured slower than the plain decode at T = 1 (15.8 vs
# 14.3 us under graph replay); the tests run both.
FAST_INT4 = False
FAST_INT4_MAX_TILE = 4
# The packed decode of qkv_gemv (16-byte loads, token tiles up to GEMV_PACKED_MAX_TILE): 4-bit
# weights with fp16 inputs as fp16 pairs (magic-number LOP3, (q - zero) * scale rounded once,
# hfma2 into fp16 sums of each 32-value load, added to float32 sums), fp8 weights two codes a
# conversion; all of a row's loads of a chunk in flight at 1-2 tokens. False: the float32 decode
# (ncu at one token, 4-bit: 6.6M instructions, 8.4 a weight, DRAM 13%).
GEMV_PACKED = True
GEMV_PACKED_MAX_TILE = 4
# fp8 weights on the packed decode: off. H200, graph replay, one token, Llama-3-8B projection:
# 4-bit 10.6 us packed against 21.1, fp8 12.1 against 11.7 (no gain: its float32 decode was already
# a conversion a value).
GEMV_PACKED_FP8 = False
# Calls the packed decode takes run qkv_gemv up to this many tokens (above GEMV_MAX_TOKENS: before
# qkv_mma). 2: as before (qkv_mma from MMA_MIN_TOKENS); 4 is the candidate to time (the packed
# decode's token tile of 4).
GEMV_PACKED_MAX_TOKENS = 2
# 4-bit packed decode: the scale applied to each 32-value load's fp16 sums in float32 instead of
# to every weight (4 fewer half2 ops a word of 8 codes). Off: those sums, of up to 16 products of
# |q - zero| <= 15 and x, overflow fp16 where |x| reaches about 270.
GEMV_PACKED_LATE_SCALE = False
# The packed 4-bit decode's form (qkv.cu, qkv_gemv's FORM; other decodes: 0 always). Bit 0: a
# load's (scale, zero) word kept as scale | (2^10 + zero) << 16, its pairs built by two byte
# permutes and one exact hsub2 (was 8 integer ops a row and load); bit 1 (with bit 0): each row's
# scale / zero-point offsets computed once as 32-bit element offsets and a load's group by one
# unsigned division shared by the rows (was a signed division and 64-bit row products a row and
# load; the host drops bit 1 where an offset could pass 2^31). The same pairs, so the same
# results bit for bit. Static SASS (sm_90, fp16, Llama-3-8B): 3743 -> 3360 instructions at one
# token, 4132 -> 3742 at two (166 / 168 registers, no spills). 0: as before. GEMV_FORMS: the
# compiled forms.
GEMV_FORM = 3
GEMV_FORMS = (0, 1, 3)
# qkv_gemv_lean (qkv.cu): plain calls (no options) of fp8 weights, or of 4-bit weights with fp16
# inputs, with 16-byte weight loads, up to this many tokens (token tiles LEAN_TILES); it takes
# them before the packed decode and the tensor-core kernels. K split over a block's 4 warps, a
# 4096-wide 4-bit row one load a lane (ptxas keeps 4 of a lane's 16 loads in flight, fp8 8: see
# qkv.cu), the hidden values in registers, the packed decode's arithmetic. 0: off (qkv_gemv and
# qkv_mma as before). Measured on the H200: docs/design/qkv.md.
GEMV_LEAN_MAX_TOKENS = 2
# ... and plain calls of fp16 / bf16 weights up to this many tokens (before qkv_wgmma): 8 values
# a 16-byte load, float32 products and sums (qkv_gemv's dense arithmetic), a 4096-wide row four
# rounds of loads. 0: off (qkv_wgmma, or qkv_gemv off sm_90, as before). H200, graph replay,
# Llama-3-8B's projection, one token: 14.1-14.7 us against qkv_wgmma's 16.2-16.4; four tokens
# (a tile of 4, two waves of blocks) 19.2 against 16.7, hence 2 (docs/design/qkv.md).
GEMV_LEAN_DENSE_MAX_TOKENS = 2
LEAN_TILES = (1, 2, 4)  # tokens a block; a tile of up to 2 tokens owns 8 row pairs, of 4 owns 4
# qkv_lean_mma (qkv.cu, sm_90): plain calls past the lean GEMV's tokens up to this many (fp8 /
# 4-bit weights, then 16-bit weights), with 16-byte weight loads: qkv_gemv_lean's block and
# load pattern with the products on mma.sync, 8 or 16 tokens a block (LEAN_MMA_TILES), before
# the packed decode and the other tensor-core kernels. 0: off (qkv_mma / qkv_wgmma as before).
# H200, graph replay, Llama-3-8B's projection, us, against the previous kernels in one run:
# 4-bit 4 / 16 tokens 10.1 / 14.7 against qkv_mma's 13.4 / 17.6, fp8 10.8 / 14.4 against 14.9 /
# 17.9, 16-bit 4 tokens 15.8 against qkv_wgmma's 16.4 (16 tokens: 18.2 against 16.8, hence 8).
LEAN_MMA_MAX_TOKENS = 16
LEAN_MMA_DENSE_MAX_TOKENS = 8
LEAN_MMA_TILES = (8, 16)
# qkv_lean_mma's block, (warps, m16 tiles of 8 row pairs), by weight format (16-bit, fp8,
# 4-bit): LEAN_MMA_SHAPE at a tile of 8 tokens, LEAN_MMA_WIDE_SHAPE at 16 (where a head holds the
# block's pairs, else the 8-token shape). LEAN_MMA_SHAPES: the compiled ones; (8, 1) loads 2 of
# a row's 16-byte chunks a lane and round (3 blocks of 8 warps an SM), the others 4. Timed (one
# run, 4-bit 4 / 16 tokens, us): (4, 1) 10.1 / 16.7, (4, 2) 11.7 / 15.7, (8, 2) 13.0 / 18.8,
# (8, 3) 10.4 / 14.7; fp8 (4, 1) 10.8 / 14.4, (8, 3) 11.8 / 14.8; with the L2 prefetch hint (one
# run, 16 tokens) fp8 (4, 1) 13.7 against (8, 3) 14.1, 4-bit 16.6 against 14.9. (8, 1) against
# (4, 1), two processes, 4 / 8 / 16 tokens: fp8 9.8 / 10.2 / 14.5-14.6 against 10.5-10.6 / 10.7 /
# 13.5-13.6, 4-bit 11.7-11.8 / 12.6 against 10.1-10.2 / 10.9 (it spills at 80 registers), 16-bit
# 4 tokens 17.4-17.6 against 15.6-15.8 (docs/design/qkv.md).
LEAN_MMA_SHAPE = ((4, 1), (8, 1), (4, 1))
LEAN_MMA_WIDE_SHAPE = ((8, 3), (4, 1), (8, 3))
LEAN_MMA_SHAPES = ((4, 1), (8, 1), (8, 3))
# qkv_gemv_lean's forms, by weight format (16-bit, fp8, 4-bit): GEMV_LEAN_FORM at a tile of one
# token, GEMV_LEAN_WIDE_FORM at wider tiles. Bit 0: warp 0 loads the tokens' cache rows, the
# pairs' cos / sin values and fp8 scales before its weight loads, staged in shared memory for the
# epilogue (0: the cache rows behind its weight loads, the rest after the reduction); bit 1: a
# lane's hidden values loaded before its weight loads (0: after them); bit 2: blocks of half the
# row pairs, twice as many an SM; bit 3: each row's arithmetic after all of the round's weight
# loads (ptxas then issues them all first). H200, graph replay, one token (us, forms 0 / 1 / 3):
# 4-bit weights 8.5 / 7.7-7.9 / 7.0, fp8 9.1-9.2 / 9.7 / 9.3 (form 2: 9.3). Forms 3 / 7 / 15
# (tools/experiments/qkv_lean_forms.py, two processes, fp16 inputs), one token: 16-bit 14.9 /
# 14.2 / 14.3, fp8 9.3 / 9.5 / 9.0, 4-bit 6.9-7.0 / 6.7 / 7.5; two tokens: 16-bit 15.3 / 14.7 /
# 14.9, fp8 9.9 / 9.9 / 11.5, 4-bit 8.4-8.5 / 9.9-10.0 / 12.0-12.1 (at two tokens forms 7 and 15
# spill quantized weights' values: docs/design/qkv.md).
GEMV_LEAN_FORM = (7, 15, 7)
GEMV_LEAN_WIDE_FORM = (7, 3, 3)
GEMV_LEAN_FORMS = (0, 1, 2, 3, 7, 15)
GEMV_WARPS, GEMV_PAIRS = 4, 2  # mirror qkv.cu
GEMV_SMEM = 46 * 1024  # staged hidden rows, float32, per block (below the 48 KiB default)
# The tensor-core path (qkv_mma, sm_90+): token counts in [MMA_MIN_TOKENS, MMA_MAX_TOKENS]
# (MMA_MAX_TOKENS_QUANTIZED for fp8 and 4-bit weights) run it where it applies (see _mma). Measured
# on the H200 (docs/design/qkv.md), Llama-3-8B projection: the CUDA-core qkv_gemv is faster
# at 1-2 tokens; with fp16 / bf16 weights cuBLAS + the epilogue is as fast from 16 tokens on and
# faster beyond; with quantized weights the cuBLAS path first dequantizes 25-50 MB: it loses at
# every count up to 128, and above to the tiled kernel while one wave holds it (below).
MMA_MIN_TOKENS = 3
MMA_MAX_TOKENS = 16
MMA_MAX_TOKENS_QUANTIZED = 320
# Above MMA_QUANTIZED_ANY_GRID tokens, fp8 and 4-bit weights take the tensor-core path only on
# qkv_mma_tiled and only where its grid of TILED_MAX_TILE-token tiles, unsplit, fits one wave
# (quantized_top). Measured on the H200 (docs/design/qkv.md, "Measured decisions"),
# Llama-3-8B projection (48 row tiles, so 5 token tiles a wave: 320 tokens): fp8
# 67.3-77.8 us against the cuBLAS path's 98.3-111.9 at 144-320 tokens, 4-bit 94.4-97.9 against
# 90.0-103.1 (0.95x at 144, 1.05x at 320, a third of the host time); at 384 tokens (a second
# wave, graph replay) 120.8 / 151.3 against 107.1 / 98.5.
MMA_QUANTIZED_ANY_GRID = 128
# Token tiles: the smallest of MMA_TILES holding T, else several of the largest (adjacent CTAs,
# so the weights they share come from L2).
MMA_TILES = (8, 16, 32, 64)
# qkv_mma_tiled (tensor-core path calls of at least TILED_MIN_TOKENS tokens, every weight
# format): token tiles of TILED_TILES up to TILED_MAX_TILE (as above), 2 x tile / 32 warps a
# CTA; TILED_STAGES stages of TILED_BK k values in shared memory; split-K over clusters of the
# largest of TILED_SPLITS (at most TILED_SPLIT) that keeps the grid within one wave of
# TILED_CTAS_PER_SM CTAs an SM: a weight-streaming kernel is as fast as its busiest SM. Measured
# on the H200 (docs/design/qkv.md), Llama-3-8B projection, fp8 weights: 24.0 / 42.1 us at 64 /
# 128 tokens against qkv_mma's 48.5 / 72.1 (graph replay); at 16 tokens 17.4 against 18.1. With
# fp16 weights cuBLAS + the epilogue stays faster from 24 tokens on (24.6 against 28.3 at 64).
TILED_MIN_TOKENS = 17
TILED_TILES = (32, 64, 128)
TILED_MAX_TILE = 64
TILED_STAGES = 3
TILED_KGROUPS = 1  # warp groups along k (1 or 2): 2 x tile / 32 x TILED_KGROUPS warps a CTA
TILED_SPLIT = 8
TILED_SPLITS = (1, 2, 4, 8)  # the compiled cluster sizes
TILED_CTAS_PER_SM = 2  # at 3 stages (shared memory)
TILED_FORMATS = (W_DENSE, W_FP8, W_INT4)
# k values per stage and the bytes of a staged weight row, as in qkv.cu (4-bit: 64-byte rows,
# and per row and 32 k values an 8-byte {scale, offset + zero} entry)
TILED_BK = {W_DENSE: 64, W_FP8: 128, W_INT4: 128}
TILED_ROW_BYTES = {W_DENSE: 128, W_FP8: 128, W_INT4: 64}
MMA_ROWS, MMA_WARPS = 128, 4  # mirror qkv.cu
# qkv_wgmma (fp16 / bf16 weights on sm_90 devices: wgmma is an sm_90a instruction, compiled for
# that target): calls of WGMMA_MIN_TOKENS to WGMMA_MAX_TOKENS tokens with K a whole number of
# stages (64 x WGMMA_ATOMS k values) and 16-byte aligned rows. Two warpgroups a CTA, split-K over
# clusters of the largest of TILED_SPLITS (at most WGMMA_SPLIT) whose grid fits one wave. Up to
# WGMMA_DEEP_MAX_TOKENS tokens a deep pipeline: all T tokens one tile (the smallest of
# WGMMA_TILES that holds them), one CTA an SM, as many stages as fit (at most WGMMA_DEEP_STAGES:
# 8 at tiles of 32 and 64, 7 at 96, 6 at 128, 5 at 192, 4 at 256), a group of wgmmas left running
# across each k step's barrier. One tile reads the weights from L2 once (two tiles of 128 tokens
# read them twice). Above (up to 256 tokens eagerly, to GRAPH_MAX_TOKENS in CUDA graphs), T split
# evenly over as few tiles of at most WGMMA_MAX_TILE as hold it, two CTAs an SM and at most
# WGMMA_STAGES stages (3 at tiles of 96 and 128, so that two fit), which wins where the grid has
# more CTAs than SMs. Measured on the H200 (docs/design/qkv.md, "Measured decisions"),
# Llama-3-8B projection, eager device time against cuBLAS + the epilogue: faster up to 192
# tokens (27.4 against 28.5 us at 160, 28.3 against 29.3 at 192); at 193-256 within 0.93-1.05x
# (one tile of 256 up to 224 tokens: 33.4-34.4 against 31.8-36.0; above, tiles of 128: 32.2 /
# 33.1 against 33.3 / 31.5 at 240 / 256, where the tile of 256 took 35-36) in one launch, a
# quarter to a third of the cuBLAS path's host time. 257+ tokens keep cuBLAS eagerly.
WGMMA_MIN_TOKENS = 1
WGMMA_MAX_TOKENS = 256
WGMMA_TILES = (32, 64, 96, 128, 192, 256)
WGMMA_MAX_TILE = 128
WGMMA_STAGES = 4
WGMMA_DEEP_STAGES = 8
WGMMA_DEEP_MAX_TOKENS = 224
# fp8 weights take qkv_wgmma too, deep only (WGMMA_FP8_MIN_TOKENS to WGMMA_DEEP_MAX_TOKENS tokens
# and at most WGMMA_FP8_TOP: three stages of a larger tile and their conversion buffers do not
# fit in shared memory; K a multiple of 64 x WGMMA_FP8_ATOMS): each stage's codes are converted
# to the input dtype before its wgmmas (into their A registers: WGMMA_FP8_REG below). Measured
# on the H200 (docs/design/qkv.md), Llama-3-8B projection, against the kernels they took before
# (qkv_mma, qkv_mma_tiled): 20.1 against 23.1 us at 64 tokens, 23.8 against 36.5 at 96, 26.3
# against 37.3 at 128. Below 48 tokens it first lost (at 4-32 tokens, with the 16-bit buffers:
# 17.5-18.4 against 14.0-18.1); with the codes converted into the A registers it took 17 / 24 / 32
# / 40 tokens in 15.7 / 15.9 / 15.9 / 17.0 us against qkv_mma_tiled's 16.7 / 17.2 / 17.5 / 21.5,
# hence from 17 (qkv_lean_mma keeps 1-16).
WGMMA_FP8_MIN_TOKENS = 17
WGMMA_FP8_ATOMS = 2  # 128 codes a staged row: half the conversions and barriers of 64
# ... except where that leaves fewer than WGMMA_FP8_MIN_STAGES stages (tiles of 96 and 128
# tokens: 3, one copied ahead of the one converted; one atom: 8 and 7), as for 4-bit weights
# below; 3 or less (the deep floor) keeps WGMMA_FP8_ATOMS at every tile (fp8 T128 took 26.1 us
# on the H200 in 3 stages, about twice its tensor-core and conversion work).
WGMMA_FP8_MIN_STAGES = 4
WGMMA_FP8_TOP = 128
# fp8 weights on qkv_wgmma converted into the wgmmas' A registers as 4-bit ones are (W_FP8_REG,
# WGMMA_INT4_REG below); False: the 16-bit shared-memory buffers.
WGMMA_FP8_REG = True
# 4-bit weights take the deep qkv_wgmma the same way (WGMMA_INT4_MIN_TOKENS to
# WGMMA_DEEP_MAX_TOKENS tokens, at most WGMMA_INT4_TOP; groups of a multiple of 32, K a multiple
# of 64 x WGMMA_INT4_ATOMS): each stage's packed codes (32-byte rows an atom) are dequantized
# once a CTA into the input dtype (in shared memory, or into the wgmmas' A registers:
# WGMMA_INT4_REG below), (q - zero) * scale rounded once as in
# qkv_mma_tiled, where qkv_mma_tiled dequantizes each weight tile in every warp along the tokens
# and every token tile (the H200 profile: 8.4M / 16.3M instructions at 64 / 128 tokens, issue
# bound; qkv_mma_tiled took 29.6 / 50.0 us there against cuBLAS fp16's 17.5 / 18). 1 << 30
# (ropekv bench --tune: 1073741824) restores the previous kernels (qkv_mma / qkv_mma_tiled) at
# every count. A tile whose deep
# pipeline would hold fewer than WGMMA_INT4_MIN_STAGES stages of WGMMA_INT4_ATOMS atoms (128
# tokens: 3 stages, one in flight while one is multiplied) takes stages of one atom instead
# (8 stages there); 3 or less (the deep kernel's floor) keeps WGMMA_INT4_ATOMS at every tile.
WGMMA_INT4_MIN_TOKENS = 17
WGMMA_INT4_ATOMS = 2
WGMMA_INT4_MIN_STAGES = 4
WGMMA_INT4_TOP = 256
# 4-bit weights with groups of a multiple of 64 on qkv_wgmma: each warpgroup dequantizes the
# codes of its rows into the registers of its wgmmas' A operand (W_INT4_REG), an atom at a time
# while the atom before's wgmmas run, instead of into 16-bit buffers in shared memory read by the
# wgmmas after a second barrier (docs/design/qkv.md has the measurements); False: the buffers.
WGMMA_INT4_REG = True
WGMMA_ATOMS = 1
WGMMA_SPLIT = 8
# The split also keeps the grid's clusters in one wave: a cluster's CTAs share a GPC, so a GPU runs
# fewer clusters of 3+ CTAs at once than its SMs would hold (the H200's 132 SMs at one CTA an SM:
# 66 of 2, 39 of 3, 30 of 4, 15 of 8, cuOccupancyMaxActiveClusters, which the host asks for each
# kernel). Where the largest split that fits the SMs leaves more clusters than that, it takes the
# next smaller one. (32 row tiles, as Qwen3-1.7B's 16 / 8 heads of 128 give, took a split of 4:
# 32 clusters of 4, two of them in a second wave.) False: the SMs alone, as before.
WGMMA_CLUSTER_FIT = True
WGMMA_THREADS = 256  # mirror qkv.cu
WGMMA_CAPABILITY = 90  # the one compute capability whose "a" target has wgmma
# Under CUDA-graph capture, a call of up to GRAPH_MAX_TOKENS tokens that eagerly runs cuBLAS on
# temporaries (freed when the call returns, which a graph cannot hold) runs the fused kernel that
# would take it with its token cap raised: qkv_wgmma for fp16 / bf16 weights, the tensor-core
# kernels for the others (sm_90). Slower than cuBLAS + the epilogue eagerly, but one launch.
# Measured on the H200 (docs/design/qkv.md; the session logs in git history).
GRAPH_MAX_TOKENS = 512
SM_SHARED_BYTES = 228 * 1024  # shared memory an SM of sm_90 holds (each CTA reserves 1 KiB)
# CTAs per cluster (the split of K). 4 and 8 measured the same on the H200 (the block scheduler
# fills one GPC after the other with clusters either way).
MMA_SPLIT = 8
MMA_SPLITS = (4, 8)  # the compiled cluster sizes
# qkv_mma's form for 4-bit weights (qkv.cu, FORM; other weights: 0 always). Bit 0: a load's
# group scale and zero point held as one word, their pairs built per chunk with integer ops (no
# I2F / F2F a load); bit 2: a word of 8 codes dequantized four pairs at once (int4_pairs: one LOP3
# a pair, half of them scaled by one exact hfma2; bf16 as before); both give the same pairs, so
# the same results bit for bit. Static SASS (sm_90, fp16): 2622 -> 2433 instructions at 8 tokens,
# 2728 -> 2553 at 16; side by side on the H200 (graph replay) 4 / 16 tokens 13.7 / 17.6 against
# 14.5 / 18.6 us. 3 CTAs an SM in the launch bounds below 64 tokens (168 registers, no spills)
# was slower: 4-bit 18.9-25.1, fp8 18.7-23.1 against 13.7-18.0 us. Bit 3 (with bit 0): each
# row's scale and zero-point offsets computed once as 32-bit offsets (dropped, as GEMV_FORM bit 1,
# where one could reach 2^31) and a load's group by a multiply-high (fast_div with g_magic,
# g_shift) instead of a signed division and four 64-bit products a load; the same bytes read.
# Taken at token tiles of at most MMA_OFFSETS32_MAX_TILE: side by side on the H200
# (tools/device_ab.py against form 5, graph replay) 4 tokens 0.972 / 0.974x the time in two runs,
# but 16 tokens 1.015x (17.4 -> 17.7 us). 0: as before.
MMA_FORM = 13
MMA_FORMS = (0, 5, 13)
MMA_OFFSETS32_MAX_TILE = 8
MMA_VALS = {W_DENSE: 8, W_FP8: 16, W_INT4: 32}  # k values per 16-byte weight load
# Dynamic shared memory stays below the 48 KiB a kernel may use without opting in, static
# shared memory (token slots, request offsets) included.
MMA_SMEM_MAX = 44 * 1024
EPILOGUE_BLOCK = 128
EPILOGUE_WIDTHS = (8, 2, 1)
DEQUANT_BLOCK = 256

PARAMS = ParamStruct(
    "QkvParams",
    [
        *(
            (n, np.uint64)
            for n in (
                "hidden",
                "weight",
                "weight_scales",
                "zero_points",
                "q_tmp",
                "k_tmp",
                "v_tmp",
                "offsets",
                "cache_lengths",
                "block_table",
                "cos_sin",
                "out",
                "k_cache",
                "v_cache",
                "status",
            )
        ),
        *(
            (n, np.int64)
            for n in (
                "hidden_s0",
                "weight_row_bytes",
                "ws_s0",
                "zp_s0",
                "qt_s0",
                "kt_s0",
                "vt_s0",
                "bt_s0",
                "cs_s0",
                "out_s0",
                "k_page",
                "k_entry",
                "k_head",
                "v_page",
                "v_entry",
                "v_head",
                "num_pages",
            )
        ),
        *(
            (n, np.int32)
            for n in (
                "T",
                "K",
                "N",
                "B",
                "Hq",
                "Hkv",
                "D",
                "R",
                "P",
                "page_size",
                "max_pages",
                "group_size",
                "kc",
                "is_neox",
                "cache_code",
            )
        ),
        *((n, np.float32) for n in ("k_inv_scale", "v_inv_scale")),
        ("check", np.int32),
        ("clear", np.int32),  # the OPTS kernels' flags
        ("g_magic", np.uint32),  # qkv_mma FORM bit 3: k / group_size (division_magic)
        ("g_shift", np.int32),
    ],
)


# The array arguments in the order the public function hands them to the call path, and the
# kernel pointer field each fills.
ARRAYS = (
    "hidden_state",
    "weight",
    "input_row_offsets",
    "cache_lengths",
    "block_table",
    "k_cache",
    "v_cache",
    "cos_sin_cache",
    "weight_scales",
    "zero_points",
    "out",
    "status",
)
FIELDS = (
    "hidden",
    "weight",
    "offsets",
    "cache_lengths",
    "block_table",
    "k_cache",
    "v_cache",
    "cos_sin",
    "weight_scales",
    "zero_points",
    "out",
    "status",
)
OUT, STATUS = ARRAYS.index("out"), ARRAYS.index("status")
# the arrays whose rows _check_rows checks, in its order
_ROW_CHECKED = ck.argument_indices(
    ARRAYS,
    (
        "hidden_state",
        "weight",
        "block_table",
        "k_cache",
        "v_cache",
        "cos_sin_cache",
        "weight_scales",
        "zero_points",
        "out",
    ),
)
_Views = collections.namedtuple("_Views", ARRAYS)
_SLOTS = {f: (i, 0) for i, f in enumerate(FIELDS)}  # pointer fields <- (argument, byte offset)
NEW = len(ARRAYS)  # ptrs index of the first array a call allocates (out, then workspaces)


def _weight_bytes_min(dtype, fmt):
    return dtype.itemsize if fmt == W_DENSE else 1


def _fast_int4(fmt, vb, tt):
    return fmt == W_INT4 and vb == 16 and tt <= FAST_INT4_MAX_TILE


def _packed(dtype, fmt, vb, tt):
    """Whether qkv_gemv has a packed decode for this (see qkv.cu): 4-bit weights with fp16
    inputs, fp8 weights; 16-byte loads; small token tiles."""
    return (
        vb == 16
        and tt <= GEMV_PACKED_MAX_TILE
        and (fmt == W_FP8 or fmt == W_INT4 and dtype == FLOAT16)
    )


# ``opts`` below: the kernel that reads the options (``status=``, ``clear_unused_last_page_rows``);
# the plain one (False) has them compiled out, so they cost nothing when off.


def gemv_expression(dtype, fmt, vb, tt, fast=True, opts=False, packed=0, form=None):
    """``fast`` selects the cheaper float 4-bit decode where it applies, ``packed`` the packed
    decode (which takes precedence) where it applies: 1, 2 (4-bit: the scale on the sums), or 0
    (see qkv.cu); ``form``: GEMV_FORM's value (None: GEMV_FORM's current one), compiled only
    into the packed 4-bit decode."""
    return _gemv_expression(
        dtype, fmt, vb, tt, fast, opts, packed, GEMV_FORM if form is None else form
    )


@functools.cache  # the expressions: a plan's lookup spells one once per first call
def _gemv_expression(dtype, fmt, vb, tt, fast, opts, packed, form):
    packed = (1 if fmt != W_INT4 else int(packed)) if packed and _packed(dtype, fmt, vb, tt) else 0
    return name_expression(
        "qkv_gemv",
        c_type(dtype),
        fmt,
        vb,
        tt,
        c_bool(fast and not packed and _fast_int4(fmt, vb, tt)),
        gemv_form(fmt, packed, form),
        packed,
        c_bool(opts),
    )


def gemv_form(fmt, packed, form):
    """The FORM qkv_gemv compiles (GEMV_FORM for the packed 4-bit decode, else 0); ``packed``:
    the packed decode the expression takes (0: none)."""
    return int(form) if packed and fmt == W_INT4 else 0


def lean_form(fmt, tt, forms=None):
    """The form qkv_gemv_lean takes for weights ``fmt`` at token tile ``tt``: ``forms`` =
    (GEMV_LEAN_FORM, GEMV_LEAN_WIDE_FORM) (None: their current values), each indexed by ``fmt``."""
    one, wide = (GEMV_LEAN_FORM, GEMV_LEAN_WIDE_FORM) if forms is None else forms
    form = (one if tt == 1 else wide)[fmt]
    if form not in GEMV_LEAN_FORMS:
        name = "GEMV_LEAN_FORM" if tt == 1 else "GEMV_LEAN_WIDE_FORM"
        raise ValueError(f"ropekv.qkv.{name}[{fmt}] must be one of {GEMV_LEAN_FORMS}, got {form!r}")
    return form


def lean_expression(dtype, fmt, tt, form=None):
    """``form``: one of GEMV_LEAN_FORMS (None: :func:`lean_form`'s for ``fmt`` and ``tt``)."""
    form = lean_form(fmt, tt) if form is None else form
    return _lean_expression(dtype, fmt, tt, form)


@functools.cache
def _lean_expression(dtype, fmt, tt, form):
    return name_expression("qkv_gemv_lean", c_type(dtype), fmt, tt, form)


def lean_pairs(tt, form=0):
    """Row pairs a block of qkv_gemv_lean owns at token tile ``tt`` in form ``form`` (qkv.cu's
    lean_block_pairs: half as many with bit 2)."""
    return (8 if tt <= 2 else 4) >> bool(form & 4)


def _lean_tile(T):
    return next((tt for tt in LEAN_TILES if tt >= T), None)


def lean_takes(dtype, fmt):
    """Whether qkv_gemv_lean takes inputs of ``dtype`` with weights ``fmt``: fp8 or 16-bit weights,
    or 4-bit weights with fp16 inputs (with bf16 inputs qkv_lean_mma takes them from one token)."""
    return fmt != W_INT4 or dtype == FLOAT16


def lean_applies(dtype, fmt, vb, D, T, lean_max):
    """Whether qkv_gemv_lean takes a plain call of ``T`` tokens (1 to the largest tile and to
    ``lean_max``, a pair: the most tokens with fp8 / 4-bit weights, with 16-bit weights): the
    inputs and weights it takes (:func:`lean_takes`), 16-byte weight loads
    (:func:`_gemv_width`), and heads of at least one block's pairs (D / 2 >= lean_pairs)."""
    top = lean_max[1] if fmt == W_DENSE else lean_max[0]
    tt = _lean_tile(T) if 0 < T <= top else None
    return tt is not None and vb == 16 and lean_takes(dtype, fmt) and D // 2 >= lean_pairs(tt)


def lean_mma_expression(dtype, fmt, tt, shape):
    """qkv_lean_mma at token tile ``tt`` (8 or 16: one or two n8 tiles) in blocks of ``shape`` =
    (warps, m16 tiles), one of LEAN_MMA_SHAPES."""
    shape = tuple(shape)
    if shape not in LEAN_MMA_SHAPES:
        raise ValueError(
            f"qkv_lean_mma's block (warps, tiles) must be one of {LEAN_MMA_SHAPES}, got {shape!r}"
        )
    return _lean_mma_expression(dtype, fmt, tt, shape)


@functools.cache
def _lean_mma_expression(dtype, fmt, tt, shape):
    warps, mt = shape
    return name_expression("qkv_lean_mma", c_type(dtype), fmt, tt // 8, mt, warps)


def lean_mma_shape(T, D, fmt, shapes=None):
    """qkv_lean_mma's (token tile, (warps, m16 tiles)) for ``T`` tokens, heads of ``D`` and weight
    format ``fmt``; ``shapes``: (LEAN_MMA_SHAPE, LEAN_MMA_WIDE_SHAPE), each indexed by ``fmt``
    (None: their current values). The block's pairs (8 a tile) must lie in at most two heads: D /
    2 of them (the 8-token shape where the wide one's do not)."""
    one, wide = (LEAN_MMA_SHAPE, LEAN_MMA_WIDE_SHAPE) if shapes is None else shapes
    tt = next(t for t in LEAN_MMA_TILES if t >= T)
    name, shape = "LEAN_MMA_SHAPE", tuple(one[fmt])
    if tt > LEAN_MMA_TILES[0] and D // 2 >= 8 * tuple(wide[fmt])[1]:
        name, shape = "LEAN_MMA_WIDE_SHAPE", tuple(wide[fmt])
    if shape not in LEAN_MMA_SHAPES:
        raise ValueError(
            f"ropekv.qkv.{name}[{fmt}] must be one of {LEAN_MMA_SHAPES}, got {shape!r}"
        )
    return tt, shape


def lean_max_tokens():
    """The lean kernels' token counts as set now: (GEMV_LEAN_MAX_TOKENS,
    GEMV_LEAN_DENSE_MAX_TOKENS, LEAN_MMA_MAX_TOKENS, LEAN_MMA_DENSE_MAX_TOKENS), the ``lean_max``
    of lean_applies and lean_mma_applies (a call spells them out: this runs on first calls)."""
    return (
        GEMV_LEAN_MAX_TOKENS,
        GEMV_LEAN_DENSE_MAX_TOKENS,
        LEAN_MMA_MAX_TOKENS,
        LEAN_MMA_DENSE_MAX_TOKENS,
    )


def lean_mma_applies(dtype, fmt, vb, D, T, lean_max, compute_capability, shapes=None):
    """Whether qkv_lean_mma takes a plain call of ``T`` tokens: past qkv_gemv_lean's tokens (its
    first two counts) where qkv_gemv_lean takes the call's inputs and weights, else from one token
    (4-bit weights with bf16 inputs: 2.0x / 3.0x faster than qkv_gemv at 1 / 2 tokens on the
    H200), up to ``lean_max``'s third (fp8 / 4-bit weights) or fourth (16-bit) count and the
    largest tile, 16-byte weight loads, heads of at least a block's pairs, sm_90."""
    dense = fmt == W_DENSE
    low = (lean_max[1] if dense else lean_max[0]) if lean_takes(dtype, fmt) else 0
    top = min(lean_max[3] if dense else lean_max[2], LEAN_MMA_TILES[-1])
    if not (max(low, 0) < T <= top and vb == 16 and compute_capability >= 90):
        return False
    return D // 2 >= 8 * lean_mma_shape(T, D, fmt, shapes)[1][1]


def mma_form(fmt, form):
    """The FORM qkv_mma compiles for ``fmt`` (the bits that change its code, see MMA_FORM)."""
    return form if fmt == W_INT4 else 0


def mma_expression(dtype, fmt, tn, split, opts=False, form=None):
    """``form``: MMA_FORM's value (None: MMA_FORM's current one)."""
    return _mma_expression(
        dtype, fmt, tn, split, opts, mma_form(fmt, MMA_FORM if form is None else form)
    )


@functools.cache
def _mma_expression(dtype, fmt, tn, split, opts, form):
    return name_expression("qkv_mma", c_type(dtype), fmt, tn, split, c_bool(opts), form)


@functools.cache
def tiled_expression(dtype, fmt, tn, split, stages, kgroups, opts=False):
    return name_expression(
        "qkv_mma_tiled", c_type(dtype), fmt, tn, split, stages, kgroups, c_bool(opts)
    )


@functools.cache
def wgmma_expression(dtype, tn, split, stages, atoms, opts=False, deep=True, fp8=False):
    """``fp8``: the weight format (W_DENSE, W_FP8, W_INT4; False / True: dense / fp8)."""
    return name_expression(
        "qkv_wgmma",
        c_type(dtype),
        tn,
        split,
        stages,
        atoms,
        c_bool(opts),
        c_bool(deep),
        int(fp8),
    )


@functools.cache
def epilogue_expression(dtype, cache_dtype, k_dtype, n, opts=False):
    return name_expression(
        "qkv_epilogue", c_type(dtype), c_type(cache_dtype), c_type(k_dtype), n, c_bool(opts)
    )


@functools.cache
def dequant_expression(dtype, fmt):
    return name_expression("qkv_dequant", c_type(dtype), fmt)


def instantiations():
    """Every kernel instantiation a call can select (the compile tests build them all)."""
    for dtype, opts in itertools.product(INPUT_DTYPES, (False, True)):
        for fmt, tt in itertools.product((W_DENSE, W_FP8, W_INT4), GEMV_TILES):
            for vb in (16, _weight_bytes_min(dtype, fmt)):
                yield gemv_expression(dtype, fmt, vb, tt, opts=opts)
                if _fast_int4(fmt, vb, tt):
                    yield gemv_expression(dtype, fmt, vb, tt, fast=False, opts=opts)
                if _packed(dtype, fmt, vb, tt):
                    forms = GEMV_FORMS if fmt == W_INT4 else (0,)
                    for form in forms:
                        yield gemv_expression(dtype, fmt, vb, tt, opts=opts, packed=1, form=form)
                    if fmt == W_INT4:
                        for form in forms:
                            yield gemv_expression(
                                dtype, fmt, vb, tt, opts=opts, packed=2, form=form
                            )
        for fmt, tn, split in itertools.product((W_DENSE, W_FP8, W_INT4), MMA_TILES, MMA_SPLITS):
            forms = {mma_form(fmt, form): None for form in MMA_FORMS}  # in order, once each
            for form in forms:
                yield mma_expression(dtype, fmt, tn, split, opts, form)
        for fmt, tn, split in itertools.product(TILED_FORMATS, TILED_TILES, TILED_SPLITS):
            yield tiled_expression(dtype, fmt, tn, split, TILED_STAGES, TILED_KGROUPS, opts)
        for (tn, deep, wq), split in itertools.product(_wgmma_tiles(), TILED_SPLITS):
            atoms, stages, _ = _wgmma_config(tn, deep, wq, wgmma_settings())
            yield wgmma_expression(dtype, tn, split, stages, atoms, opts, deep, wq)
        for cache_dtype, n in itertools.product((dtype, *FP8_DTYPES), EPILOGUE_WIDTHS):
            yield epilogue_expression(dtype, cache_dtype, dtype, n, opts)
            if cache_dtype in FP8_DTYPES:
                yield epilogue_expression(dtype, cache_dtype, FLOAT32, n, opts)
    for dtype in INPUT_DTYPES:
        for fmt in (W_FP8, W_INT4):
            yield dequant_expression(dtype, fmt)
        for fmt in (W_DENSE, W_FP8, W_INT4):
            if fmt != W_INT4 or dtype == FLOAT16:
                for tt, form in itertools.product(LEAN_TILES, GEMV_LEAN_FORMS):
                    yield lean_expression(dtype, fmt, tt, form)
            for tt, shape in itertools.product(LEAN_MMA_TILES, LEAN_MMA_SHAPES):
                yield lean_mma_expression(dtype, fmt, tt, shape)  # every format and input dtype


# --------------------------------------------------------------------------------- pack_int4


def pack_int4(w_int: ArrayLike, *, signed: bool = True) -> ArrayLike:
    """Pack 4-bit integer weights ``(N, K)`` into the ``uint8 (N, K/2)`` layout of
    :func:`fused_qkv_matmul_append_paged_kv_cache`.

    Packing: byte ``[n, j]`` holds k = 2j in its low nibble and k = 2j + 1 in its high nibble::

        packed[n, j] = (q[n, 2j] & 0xF) | (q[n, 2j + 1] << 4)

    The kernels dequantize ``w = (q - zero) * scale`` with ``zero`` from ``zero_points`` (8 when
    None) and ``scale = weight_scales[n, k // group_size]``.

    Parameters
    ----------
    w_int : integer array, (N, K), K even; NumPy or CuPy (the result is of the same kind)
        signed=True: values in [-8, 7], stored as ``q = w + 8``, so the default zero point 8
        recovers them (symmetric quantization, ``w * scale``). signed=False: values in [0, 15],
        stored as they are (asymmetric quantization with explicit ``zero_points``).
    signed : bool

    Returns
    -------
    array, (N, K/2), uint8
        The packed weights, NumPy or CuPy like ``w_int``.

    Raises
    ------
    TypeError
        ``w_int`` without an integer dtype.
    ValueError
        ``w_int`` not 2-D, an odd K, or values outside ``[-8, 7]`` (``[0, 15]`` with
        ``signed=False``).

    Examples
    --------
    >>> import numpy as np, ropekv
    >>> ropekv.pack_int4(np.array([[-8, 7, 0, 1]]))
    array([[240, 152]], dtype=uint8)
    """
    xp = np
    if type(w_int).__module__.startswith("cupy"):
        import cupy as xp
    arr = w_int
    if arr.ndim != 2:
        raise ValueError(f"w_int must have shape (N, K), got {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"w_int must have an integer dtype, got {arr.dtype}")
    if arr.shape[1] % 2:
        raise ValueError(f"w_int's K (its last dim) must be even, got {arr.shape[1]}")
    lo, hi = (-8, 7) if signed else (0, 15)
    if arr.size:
        mn, mx = int(arr.min()), int(arr.max())
        if mn < lo or mx > hi:
            raise ValueError(
                f"w_int values must lie in [{lo}, {hi}] for signed={signed}, got [{mn}, {mx}]"
            )
    q = arr.astype(xp.int16) + (8 if signed else 0)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).astype(xp.uint8)


# --------------------------------------------------------------------------------- the op


def _check_ragged(voff, vlen, vbt):
    """The checks of the ragged-batch index arrays, in order (each raises its own message)."""
    ck.check_ndim(voff, 1, "(B + 1,)")
    if voff.shape[0] < 1:
        raise ValueError(f"input_row_offsets must have shape (B + 1,), got {voff.shape}")
    ck.check_dtype(voff, (INT32, UINT32))
    _check_contiguous(voff)
    B = voff.shape[0] - 1
    ck.check_shape(vlen, (B,), "(B,)")
    ck.check_dtype(vlen, (INT32,))
    _check_contiguous(vlen)
    ck.check_ndim(vbt, 2, "(B, max_pages)")
    ck.check_shape(vbt, (B, None), "(B, max_pages)")
    ck.check_dtype(vbt, (INT32,))


def _check_contiguous(view):
    # empty arrays may carry stride 0, which ArrayView.is_c_contiguous reads as strided
    if view.size:
        ck.check_contiguous(view)


def _scales(kv_scale):
    """(k_scale, v_scale) floats from None, a float or a pair."""
    if kv_scale is None:
        return 1.0, 1.0
    pair = (
        (kv_scale, kv_scale)
        if isinstance(kv_scale, numbers.Real)
        else tuple(kv_scale)
        if isinstance(kv_scale, tuple)
        else ()
    )
    if len(pair) != 2 or not all(
        isinstance(s, numbers.Real) and not isinstance(s, bool) for s in pair
    ):
        raise ValueError(
            f"kv_scale must be a float or a (k_scale, v_scale) pair of floats, got {kv_scale!r}"
        )
    return (
        ck.check_float(pair[0], "kv_scale", positive=True),
        ck.check_float(pair[1], "kv_scale", positive=True),
    )


def fused_qkv_matmul_append_paged_kv_cache(
    hidden_state: ArrayLike,
    weight: ArrayLike,
    input_row_offsets: ArrayLike,
    cache_lengths: ArrayLike,
    block_table: ArrayLike,
    paged_kv_cache: tuple[ArrayLike, ArrayLike],
    *,
    num_q_heads: int,
    cos_sin_cache: ArrayLike | None = None,
    is_neox: bool = True,
    kv_layout: str = "NHD",
    kv_scale: float | tuple[float, float] | None = None,
    weight_scales: ArrayLike | None = None,
    group_size: int | None = None,
    zero_points: ArrayLike | None = None,
    out: ArrayLike | None = None,
    clear_unused_last_page_rows: bool = False,
    status: ArrayLike | None = None,
    layer_idx: int | None = None,
    enable_pdl: bool = False,
    stream: StreamLike | None = None,
) -> ArrayLike:
    """QKV projection with K/V appended to a paged KV cache and RoPE on Q and K (MAX's
    ``generic_fused_qkv_matmul_kv_cache_paged_ragged``).

    ``qkv = hidden_state @ W.T`` (float32 accumulation), rows of W ordered [Q heads | K heads |
    V heads]; Q goes to ``out``, K and V to their pages. Small batches run one fused ropekv
    kernel that streams the weights once (CUDA cores up to ``ropekv.qkv.GEMV_MAX_TOKENS``
    tokens, tensor cores up to ``MMA_MAX_TOKENS``, ``MMA_MAX_TOKENS_QUANTIZED`` for fp8 and
    4-bit weights); larger ones run cuBLAS then one ropekv epilogue launch (see the module
    docstring).

    Parameters
    ----------
    hidden_state : array, (T, K), float16 or bfloat16
        Tokens of all requests, ragged over ``input_row_offsets``.
    weight : array, the ``nn.Linear`` layout, N = (Hq + 2 Hkv) D
        One of: ``(N, K)`` in the dtype of ``hidden_state``; ``(N, K)`` float8_e4m3fn with
        ``weight_scales (N,)`` float32 (w = fp8 * scale[n]); ``(N, K/2)`` uint8 holding two 4-bit
        values per byte (see :func:`pack_int4`) with ``weight_scales (N, K/group_size)`` in the
        input dtype and optional ``zero_points (N, K/group_size)`` uint8 (low 4 bits used, 8 when
        None), w = (q - zero) * scale in float32.
    input_row_offsets : array, (B + 1,), int32 or uint32
        Request b owns tokens ``[offsets[b], offsets[b + 1])``.
    cache_lengths : array, (B,), int32
        Tokens already cached per request: token t of request b sits at position
        ``p = cache_lengths[b] + t - offsets[b]``.
    block_table : array, (B, max_pages), int32
        Token at position p goes to page ``block_table[b, p // page_size]``, entry
        ``p % page_size``.
    paged_kv_cache : (k_cache, v_cache)
        Each ``(num_pages, page_size, Hkv, D)`` (NHD) or ``(num_pages, Hkv, page_size, D)``
        (HND), the input dtype, float8_e4m3fn or float8_e5m2 (both the same). Written in place;
        Hkv and D come from here.
    num_q_heads : int
        Hq.
    cos_sin_cache : array, (P, R), float32, optional
        RoPE table, cos half then sin half (:func:`ropekv.cos_sin_cache`); R even, at most D,
        dims [R, D) pass through. None: no RoPE.
    is_neox : bool
        Half-split pairs (i, i + R/2) when True, interleaved pairs (2i, 2i + 1) when False.
    kv_layout : "NHD" or "HND"
    kv_scale : float or (float, float), optional
        Dequantization scale(s) of fp8 caches (K and V): stored = fp8(x / scale), round to
        nearest even, saturating. 1.0 by default; only for fp8 caches.
    weight_scales : array, optional
        Per-row (fp8) or per-group (4-bit) weight scales; see ``weight``.
    group_size : int, optional
        Columns per 4-bit scale group; see ``weight``.
    zero_points : array, optional
        4-bit zero points; see ``weight``.
    out : array, (T, Hq D), the input dtype, optional
        Q (roped). Allocated when None, in the caller's array type (torch, CuPy, NumPy).
    clear_unused_last_page_rows : bool
        Also zero, in K and V, the rows of each request's last page past its new length
        ``cache_lengths[b] + input_row_offsets[b + 1] - input_row_offsets[b]`` (FlashInfer Cake's
        option of this name): attention kernels that read whole pages then meet zeros, not stale
        values or NaN. Done by the request's last token, so only when that token is written; a
        request with no new tokens clears nothing. Only the page the block table names for that
        token is touched (two requests naming one page leave its rows undefined).
    status : array, (1,), int32, optional
        Validate ``input_row_offsets`` on the device first, without a host synchronisation (so
        a call on the fused kernels can be captured in a CUDA graph): ``status[0]`` receives 0
        when they are well formed, else the code of the first failing check (1: ``offsets[0] !=
        0``; 2: an offset below the one before it; 3: ``offsets[-1] != T``), and then nothing
        else is written (the caches and a given ``out`` keep every byte; a new ``out`` holds
        undefined values). Every path validates in the launch that writes (the cuBLAS path's
        GEMMs write only temporaries before it). A batch of no tokens still validates and writes
        the code. Written in place.
    layer_idx : int, optional
        Multi-layer caches (MAX's ``kv_collection`` with ``layer_idx``): ``k_cache`` and
        ``v_cache`` then carry a leading ``(num_layers, ...)`` dimension, and only layer
        ``layer_idx`` (an int in ``[0, num_layers)``) is written; its other bytes, and every other
        layer's, stay as they were (``docs/conventions.md``, "Multi-layer caches").
    enable_pdl : bool
        Launch with programmatic dependent launch (see :func:`ropekv.apply_rope_write_kv`).
    stream : CuPy stream, int ``cudaStream_t`` or object with ``cuda_stream``, optional
        By default torch's current stream for torch inputs, else CuPy's (``docs/conventions.md``).

    Returns
    -------
    out : array, (T, Hq D)
        Q, roped (``out`` itself when given).

    Raises
    ------
    TypeError
        A ``weight`` neither of the input dtype, float8_e4m3fn nor uint8 (packed 4-bit), inputs
        that are not fp16 / bf16, non-integer index arrays, or a ``stream`` of an unknown kind.
    ValueError
        Shapes that disagree (``hidden_state`` not ``(T, K)``, ``weight`` not ``(N, K)`` or
        ``(N, K / 2)``, the caches' heads or page size), ``weight_scales`` missing for fp8 or
        4-bit weights or given for 16-bit ones, ``group_size`` missing, odd or not dividing K for
        4-bit weights, ``kv_scale`` with a 16-bit cache or not positive and finite, a
        ``layer_idx`` outside the caches' layers, a written array that overlaps another argument,
        arrays on different devices; and a call on a stream capturing a CUDA graph that would run
        cuBLAS (see :func:`ropekv.qkv.graph_safe`).
    BufferError
        A written array exported read-only (or through a legacy DLPack capsule), or memory not
        aligned to its item size.
    IndexError
        Only with ``ROPEKV_CHECK_INDICES=1``: a token outside every request of
        ``input_row_offsets``, a position outside the table, a page outside ``block_table`` or the
        cache, or two tokens writing one cache row.

    Notes
    -----
    A token outside every request, at a negative position or (with RoPE) at a position outside
    ``[0, P)`` has its Q row written unrotated and writes no K/V; a token with a valid position
    but a block-table index or page id out of range is roped and writes no K/V. Nothing is read or
    written out of bounds. With ``ROPEKV_CHECK_INDICES=1`` such tokens raise ``IndexError``.
    NumPy inputs run the float64 NumPy reference on the host, with the same in-place writes.

    Examples
    --------
    With NumPy arrays (the NumPy reference, on the host), a small projection:

    >>> import numpy as np, ropekv
    >>> T, K, Hq, Hkv, D, pages, ps = 4, 256, 4, 2, 64, 16, 16
    >>> rng = np.random.default_rng(0)
    >>> x = rng.standard_normal((T, K)).astype(np.float16)
    >>> w = (rng.standard_normal(((Hq + 2 * Hkv) * D, K)) / 16).astype(np.float16)
    >>> kc, vc = (np.zeros((pages, ps, Hkv, D), np.float16) for _ in range(2))
    >>> offsets = np.array([0, 1, 2, 3, 4], np.int32)      # four decoding requests
    >>> lengths = np.array([5, 17, 0, 40], np.int32)
    >>> table = np.arange(16, dtype=np.int32).reshape(4, 4)
    >>> q = ropekv.fused_qkv_matmul_append_paged_kv_cache(
    ...     x, w, offsets, lengths, table, (kc, vc), num_q_heads=Hq,
    ...     cos_sin_cache=ropekv.cos_sin_cache(4096, D))
    >>> q.shape, q.dtype
    ((4, 256), dtype('float16'))

    The same call with CuPy arrays runs the CUDA kernel (needs a GPU), here at Llama-3-8B size:

    >>> import cupy as cp  # doctest: +SKIP
    >>> T, K, Hq, Hkv, D, pages, ps = 4, 4096, 32, 8, 128, 64, 16
    >>> x = cp.random.randn(T, K).astype(cp.float16)  # doctest: +SKIP
    >>> w = (cp.random.randn((Hq + 2 * Hkv) * D, K) / 64).astype(cp.float16)  # doctest: +SKIP
    >>> kc, vc = (cp.zeros((pages, ps, Hkv, D), cp.float16) for _ in range(2))  # doctest: +SKIP
    >>> q = ropekv.fused_qkv_matmul_append_paged_kv_cache(  # doctest: +SKIP
    ...     x, w, cp.asarray(offsets), cp.asarray(lengths), cp.asarray(table), (kc, vc),
    ...     num_q_heads=Hq, cos_sin_cache=ropekv.cos_sin_cache(4096, D, xp=cp))
    """
    return _OP(
        (
            hidden_state,
            weight,
            input_row_offsets,
            cache_lengths,
            block_table,
            *_cache_pair(paged_kv_cache),
            cos_sin_cache,
            weight_scales,
            zero_points,
            out,
            status,
        ),
        (
            num_q_heads,
            is_neox,
            kv_layout,
            kv_scale,
            group_size,
            enable_pdl,
            GEMV_MAX_TOKENS,
            FAST_INT4,
            GEMV_PACKED,
            GEMV_PACKED_MAX_TOKENS,
            GEMV_PACKED_LATE_SCALE,
            GEMV_PACKED_FP8,
            (
                GEMV_FORM,
                (
                    GEMV_LEAN_MAX_TOKENS,
                    GEMV_LEAN_DENSE_MAX_TOKENS,
                    LEAN_MMA_MAX_TOKENS,
                    LEAN_MMA_DENSE_MAX_TOKENS,
                ),
                (
                    (GEMV_LEAN_FORM, GEMV_LEAN_WIDE_FORM),
                    (LEAN_MMA_SHAPE, LEAN_MMA_WIDE_SHAPE),
                ),
            ),
            MMA_MIN_TOKENS,
            MMA_MAX_TOKENS,
            (MMA_MAX_TOKENS_QUANTIZED, MMA_QUANTIZED_ANY_GRID),
            MMA_SPLIT,
            (MMA_FORM, MMA_OFFSETS32_MAX_TILE),
            # tiled_settings() and wgmma_settings(), spelled out: this runs on every call
            (
                TILED_MIN_TOKENS,
                TILED_MAX_TILE,
                TILED_STAGES,
                TILED_SPLIT,
                TILED_CTAS_PER_SM,
                TILED_KGROUPS,
            ),
            (
                WGMMA_MIN_TOKENS,
                WGMMA_MAX_TOKENS,
                WGMMA_MAX_TILE,
                WGMMA_STAGES,
                WGMMA_ATOMS,
                WGMMA_SPLIT,
                WGMMA_DEEP_MAX_TOKENS,
                WGMMA_DEEP_STAGES,
                WGMMA_FP8_MIN_TOKENS,
                WGMMA_FP8_ATOMS,
                WGMMA_FP8_MIN_STAGES,
                WGMMA_INT4_MIN_TOKENS,
                WGMMA_INT4_ATOMS,
                WGMMA_INT4_MIN_STAGES,
                WGMMA_INT4_REG,
                WGMMA_FP8_REG,
                WGMMA_CLUSTER_FIT,
            ),
            GRAPH_MAX_TOKENS,
            clear_unused_last_page_rows,
        ),
        stream,
        layer_idx,
    )


def _cache_pair(paged_kv_cache):
    """``paged_kv_cache`` as given when it is a (k_cache, v_cache) pair; else the ValueError."""
    if not isinstance(paged_kv_cache, (tuple, list)) or len(paged_kv_cache) != 2:
        raise ValueError(
            f"paged_kv_cache must be a (k_cache, v_cache) pair, got "
            f"{type(paged_kv_cache).__qualname__}"
        )
    return paged_kv_cache


class _Checked(NamedTuple):
    """What the checks of a first call derive: sizes, the weight format, the cache's scales and
    layout, and the device."""

    T: int
    K: int
    N: int  # (Hq + 2 Hkv) D: the projection's columns
    Hq: int
    Hkv: int
    D: int
    R: int
    P: int
    B: int
    fmt: int  # W_DENSE, W_FP8 or W_INT4
    G: int | None  # the 4-bit weights' group size
    fp8: bool  # a float8 cache
    k_scale: float
    v_scale: float
    nhd: bool
    num_pages: int
    page_size: int
    device: int


def _prepare(views, flags):
    """Validate a first call (:func:`_check`), then the launch plan (:func:`_device_plan`:
    GEMV, fused or cuBLAS path, over the record :func:`_fields` packs) or the NumPy backend
    run."""
    (
        num_q_heads,
        is_neox,
        kv_layout,
        kv_scale,
        group_size,
        pdl,
        gemv_max,
        fast_int4,
        gemv_packed,
        packed_max,
        late_scale,
        packed_fp8,
        (gemv_form, lean_max, lean_forms),
        mma_min,
        mma_max,
        mma_quantized,
        mma_split,
        mma_form,
        tiled,
        wgmma,
        graph_max,
        clear,
    ) = flags
    a = _Views._make(views)
    vx, vt, vout, vstatus = a.hidden_state, a.cos_sin_cache, a.out, a.status
    c = _check(views, num_q_heads, kv_layout, kv_scale, group_size)
    written = _WRITTEN  # those given: Op.first_call drops the others
    outputs = [] if vout is not None else [Output((c.T, c.Hq * c.D), vx.dtype)]

    if ck.check_indices_enabled():
        _check_indices(
            a.input_row_offsets,
            a.cache_lengths,
            a.block_table,
            c.T,
            c.P if vt is not None else None,
            c.page_size,
            c.num_pages,
        )
    plan = functools.partial(Plan, outputs=outputs, written=written, result=_result)
    if c.device == HOST:
        return plan(HOST, host=_host_run(views, c, is_neox, kv_layout, clear))
    if c.T == 0 and vstatus is None:
        return plan(c.device)
    fields, slots = _fields(views, c, is_neox, clear)
    opts = bool(clear or vstatus is not None)  # the kernels that read the options
    gemv = (
        gemv_max,
        fast_int4,
        (gemv_packed, packed_fp8),
        packed_max,
        (late_scale, gemv_form, (lean_max, lean_forms)),
    )
    tuning = (gemv, mma_min, mma_max, mma_quantized, (mma_split, mma_form), tiled, graph_max)
    return _device_plan(
        views, c, fields, slots, outputs, written, is_neox, pdl, opts, tuning, WgmmaSettings(*wgmma)
    )


def _check(views, num_q_heads, kv_layout, kv_scale, group_size):
    """Every check of a first call, in the order of the arguments' errors; a :class:`_Checked`."""
    vx, vw, voff, vlen, vbt, vk, vv, vt, vws, vzp, vout, vstatus = views

    # Tests of the common case first, read in the checkers' order; the checkers (which raise
    # their own messages) only where a test fails: this runs on every first call.
    if not (len(vx.shape) == 2 and vx.dtype in INPUT_DTYPES):
        ck.check_ndim(vx, 2, "(T, K)")
        ck.check_dtype(vx, INPUT_DTYPES)
    T, K = vx.shape
    if K == 0:
        raise ValueError(f"hidden_state must have shape (T, K) with K > 0, got {vx.shape}")
    if num_q_heads.__class__ is int and num_q_heads > 0:
        Hq = num_q_heads
    else:
        Hq = ck.check_positive_int(num_q_heads, "num_q_heads")
    ck.check_choice(kv_layout, "kv_layout", LAYOUTS)
    nhd = kv_layout == "NHD"
    num_pages, page_size, Hkv, D = _check_caches(vk, vv, nhd, vx.dtype)
    N = (Hq + 2 * Hkv) * D
    fmt = _check_weight(vw, vws, vzp, group_size, vx.dtype, N, K)
    G = group_size if fmt == W_INT4 else None

    if not ck.common_ragged_paged(voff, vlen, vbt):
        _check_ragged(voff, vlen, vbt)
    B = voff.shape[0] - 1

    R = P = 0
    if vt is not None:
        if (
            len(vt.shape) == 2
            and vt.dtype == FLOAT32
            and vt.shape[1] % 2 == 0
            and 0 < vt.shape[1] <= D
        ):
            P, R = vt.shape
        else:
            P, R = ck.check_cos_sin_cache(vt, D)
    fp8 = vk.dtype in FP8_DTYPES
    if not fp8 and kv_scale is not None:
        raise ValueError(f"kv_scale is only used with float8 caches, but the cache is {vk.dtype}")
    k_scale, v_scale = _scales(kv_scale)

    if vout is not None:
        ck.check_shape(vout, (T, Hq * D), "(T, Hq * D)")
        ck.check_same_dtype(vout, vx)
    _check_rows(views, K, Hq * D)
    if vstatus is not None:
        check_status(vstatus)
    device = ck.check_same_device(views)
    return _Checked(
        T,
        K,
        N,
        Hq,
        Hkv,
        D,
        R,
        P,
        B,
        fmt,
        G,
        fp8,
        k_scale,
        v_scale,
        nhd,
        num_pages,
        page_size,
        device,
    )


def _check_caches(vk, vv, nhd, dtype):
    """The caches' shapes and dtype; ``(num_pages, page_size, Hkv, D)``."""
    layout = decl.PAGED_LAYOUTS["NHD" if nhd else "HND"]
    if not (len(vk.shape) == 4 and vv.shape == vk.shape):
        ck.check_ndim(vk, 4, layout)
        ck.check_shape(vv, vk.shape, layout)
    num_pages, D = vk.shape[0], vk.shape[3]
    page_size, Hkv = (vk.shape[1], vk.shape[2]) if nhd else (vk.shape[2], vk.shape[1])
    if Hkv == 0 or D == 0 or page_size == 0 or D % 2:
        raise ValueError(
            f"k_cache must have shape {layout} with Hkv, page_size > 0 and D even "
            f"and > 0, got {vk.shape}"
        )
    if vk.dtype != dtype:
        ck.check_dtype(vk, (dtype, *FP8_DTYPES))
    ck.check_same_dtype(vv, vk)
    return num_pages, page_size, Hkv, D


def _check_rows(views, K, out_cols):
    """Rows of stride 1 in their last dimension, and rows that do not overlap (cuBLAS takes them
    as leading dimensions, and so does the GEMV kernel)."""
    vx, vw, vbt, vk, vv, vt, vws, vzp, vout = (views[i] for i in _ROW_CHECKED)
    if (
        vx.strides[-1] != 1
        or vw.strides[-1] != 1
        or vbt.strides[-1] != 1
        or vk.strides[-1] != 1
        or vv.strides[-1] != 1
        or (vt is not None and vt.strides[-1] != 1)
        or vws is not None
        or vzp is not None
        or (vout is not None and vout.strides[-1] != 1)
    ):  # (a test first, as above)
        ck.check_last_dim_contiguous(vx, vw, vbt, vk, vv, vt, vws, vzp, vout)
    for view, cols in ((vx, K), (vw, vw.shape[1]), (vout, out_cols)):
        if view is not None and view.shape[0] > 1 and view.strides[0] < cols:
            raise ValueError(
                f"{view.name}'s row stride must be at least its {cols} columns, got "
                f"strides {view.strides} (in elements) for shape {view.shape}"
            )


def _host_run(views, c, is_neox, kv_layout, clear):
    """The NumPy backend's run of a host call."""
    vx, vw, voff, vlen, vbt, vk, vv, vt, vws, vzp, vout, vstatus = views

    def host(v, outs):
        qout = vout if vout is not None else outs[0]
        if vstatus is not None:
            vstatus.host[...] = reference.ragged_offsets_status(voff.host, c.T)
            if vstatus.host.item():
                return
        if c.T:
            reference.fused_qkv_matmul_append_paged_kv_cache(
                vx.host,
                vw.host,
                voff.host,
                vlen.host,
                vbt.host,
                vk.host,
                vv.host,
                qout.host,
                c.Hq,
                None if vt is None else vt.host,
                is_neox,
                kv_layout,
                c.k_scale,
                c.v_scale,
                None if vws is None else vws.host,
                c.G,
                None if vzp is None else vzp.host,
                clear,
            )

    return host


def _fields(views, c, is_neox, clear):
    """The record's fields past the pointers (a launch's pointers have slots, or are null) and
    the slots."""
    a = _Views._make(views)
    vx, vw, vbt, vk, vv, vt = (
        a.hidden_state,
        a.weight,
        a.block_table,
        a.k_cache,
        a.v_cache,
        a.cos_sin_cache,
    )
    vws, vzp, vout, vstatus = a.weight_scales, a.zero_points, a.out, a.status
    ks, kp, nhd, fp8 = vk.strides, vv.strides, c.nhd, c.fp8
    out_s0 = vout.strides[0] if vout is not None else c.Hq * c.D
    fields = {
        "hidden_s0": vx.strides[0],
        "weight_row_bytes": vw.strides[0] * vw.dtype.itemsize,
        "ws_s0": vws.strides[0] if vws is not None else 0,
        "zp_s0": vzp.strides[0] if vzp is not None else 0,
        "qt_s0": 0,
        "kt_s0": 0,
        "vt_s0": 0,
        "bt_s0": vbt.strides[0],
        "cs_s0": vt.strides[0] if vt is not None else 0,
        "out_s0": out_s0,
        "k_page": ks[0],
        "k_entry": ks[1] if nhd else ks[2],
        "k_head": ks[2] if nhd else ks[1],
        "v_page": kp[0],
        "v_entry": kp[1] if nhd else kp[2],
        "v_head": kp[2] if nhd else kp[1],
        "num_pages": c.num_pages,
        "T": c.T,
        "K": c.K,
        "N": c.N,
        "B": c.B,
        "Hq": c.Hq,
        "Hkv": c.Hkv,
        "D": c.D,
        "R": c.R,
        "P": c.P,
        "page_size": c.page_size,
        "max_pages": vbt.shape[1],
        "group_size": c.G or 0,
        "kc": 0,
        "is_neox": int(is_neox),
        "cache_code": (0 if not fp8 else 1 if vk.dtype == FLOAT8_E4M3FN else 2),
        "k_inv_scale": 1.0 / c.k_scale if fp8 else 1.0,
        "v_inv_scale": 1.0 / c.v_scale if fp8 else 1.0,
        "check": int(vstatus is not None),
        "clear": int(clear),
        **division_fields("g", c.G),
    }
    slots = dict(_SLOTS)
    if vout is None:
        slots["out"] = (NEW, 0)
    return fields, slots


def _device_plan(views, c, fields, slots, outputs, written, is_neox, pdl, opts, tuning, wgmma):
    """The plan of a device call: one fused launch (qkv_wgmma or the tensor-core kernels) where
    one takes it, the GEMV kernel (decode), else cuBLAS and the epilogue, with the fused launch
    as its capture plan up to ``graph_max`` tokens."""
    a = _Views._make(views)
    vx, vw, vk, vv, vt, vout = (
        a.hidden_state,
        a.weight,
        a.k_cache,
        a.v_cache,
        a.cos_sin_cache,
        a.out,
    )
    gemv, mma_min, mma_max, mma_quantized, mma, tiled, graph_max = tuning
    gemv_max, fast_int4, (gemv_packed, packed_fp8), packed_max, forms = gemv
    late_scale, gemv_form, (lean_max, lean_forms) = forms
    T, K, N, D, fmt, device = c.T, c.K, c.N, c.D, c.fmt, c.device
    gemv_packed = gemv_packed and (fmt != W_FP8 or packed_fp8)
    fused = functools.partial(
        _fused_step, fields, slots, vx, vw, c, pdl, opts, (mma_min, *mma, tiled)
    )
    plan = functools.partial(Plan, device, outputs=outputs, written=written, result=_result)
    mma_top = (
        mma_max
        if fmt == W_DENSE
        else quantized_top(K, N, fmt, _sm_count(device), mma_quantized, tiled)
    )
    decode = (fast_int4, gemv_packed, late_scale, gemv_form)
    vb = _gemv_width(vw, fmt, vx.dtype, K, fields["group_size"])[0]
    if not opts and lean_applies(vx.dtype, fmt, vb, D, T, lean_max) and _lean_strides(fields):
        return plan([_gemv_lean(fields, slots, vx, fmt, T, N, device, pdl, lean_forms[0])])
    if (
        not opts
        and lean_mma_applies(
            vx.dtype, fmt, vb, D, T, lean_max, _compute_capability(device), lean_forms[1]
        )
        and _lean_strides(fields)
    ):
        return plan([_lean_mma(fields, slots, vx, fmt, T, N, D, device, pdl, lean_forms[1])])
    if (
        gemv_max < T <= packed_max and gemv_packed and _packed(vx.dtype, fmt, vb, _tile(T))
    ):  # a few tokens more on the packed decode, before the tensor-core kernels
        return plan([_gemv(fields, slots, vx, vw, fmt, T, K, N, device, decode, pdl, opts)])
    step = fused(wgmma, mma_top)
    if step is not None:
        return plan([step])
    # decode, no vector width for the prefill epilogue, or status= with no tokens (one block of
    # the GEMV kernel, which only validates)
    n = None if T <= gemv_max else _epilogue_width(vout, vk, vv, vt, D, c.R, is_neox)
    if n is None:
        return plan([_gemv(fields, slots, vx, vw, fmt, T, K, N, device, decode, pdl, opts)])
    # under CUDA-graph capture, up to graph_max tokens: the fused kernel that would take the call
    # with its token cap raised (slower than cuBLAS eagerly there, but one launch and no
    # temporaries, which a graph can hold)
    step = None
    if T <= graph_max:
        step = fused(
            wgmma._replace(max_tokens=max(wgmma.max_tokens, graph_max)), max(mma_top, graph_max)
        )
    capture = None if step is None else plan([step])
    return _cublas_plan(a, c, fields, slots, outputs, written, n, pdl, opts, capture)


def _fused_step(fields, slots, vx, vw, c, pdl, opts, mma, wgmma, mma_max):
    """The one fused launch that takes the call (qkv_wgmma, else the tensor-core kernels from
    ``mma``'s first count up to ``mma_max`` tokens), or None. ``mma``: (MMA_MIN_TOKENS,
    MMA_SPLIT, (MMA_FORM, MMA_OFFSETS32_MAX_TILE), the tiled kernel's settings)."""
    T, K, N, D, fmt, device = c.T, c.K, c.N, c.D, c.fmt, c.device
    mma_min, mma_split, mma_form, tiled = mma
    if wgmma_takes(fmt, T, K, D, wgmma) and _compute_capability(device) == WGMMA_CAPABILITY:
        step = _wgmma(fields, slots, vx, vw, T, K, N, device, pdl, wgmma, opts, fmt)
        if step is not None:
            return step
    if T and mma_min <= T <= mma_max:
        return _mma(
            fields, slots, vx, vw, fmt, T, K, N, D, device, pdl, mma_split, tiled, opts, mma_form
        )
    return None


def _cublas_plan(a, c, fields, slots, outputs, written, n, pdl, opts, capture):
    """The cuBLAS path's plan (the GEMM into a temporary, then the epilogue at vector width
    ``n``), refused under CUDA-graph capture unless ``capture`` (the plan of one fused launch)
    replaces it."""
    steps, workspaces = _prefill(
        fields,
        slots,
        a.hidden_state,
        a.weight,
        c.fmt,
        a.k_cache.dtype,
        n,
        c.T,
        c.K,
        c.N,
        c.Hq,
        c.Hkv,
        c.D,
        c.device,
        len(outputs),
        pdl,
        opts,
        a.status is not None,
    )
    refusal = (
        f"fused_qkv_matmul_append_paged_kv_cache cannot be recorded in a CUDA graph with "
        f"hidden_state of T={c.T} tokens: {GRAPH_RULE}"
    )
    return Plan(
        c.device,
        steps,
        outputs=outputs + workspaces,
        written=written,
        result=_result,
        capture_refusal=refusal,
        capture_plan=capture,
    )


# Why a call is refused under CUDA-graph capture (the plans' and the frameworks' messages).
GRAPH_RULE = (
    "this call runs cuBLAS on temporaries freed when it returns, which a graph cannot "
    "hold. Calls of up to ropekv.qkv.GEMV_MAX_TOKENS tokens, and on sm_90 of up to "
    "GRAPH_MAX_TOKENS tokens with 16-byte aligned weight and hidden rows, heads that "
    "divide 128 rows and K a multiple of 8 (16 with fp8 weights; 32 with 4-bit ones, "
    "in groups of a multiple of 32), run one kernel and can be recorded (see "
    "ropekv.qkv.graph_safe); run this one outside the graph"
)


def _result(arrays, outs):
    return arrays[OUT] if arrays[OUT] is not None else outs[0]


def _check_weight(vw, vws, vzp, group_size, dtype, N, K):
    """The weight format (W_DENSE, W_FP8, W_INT4), its scales and zero points checked."""
    if vw.dtype == dtype:
        fmt = W_DENSE
        ck.check_shape(vw, (N, K), "(N = (Hq + 2 Hkv) D, K)")
    elif vw.dtype == FLOAT8_E4M3FN:
        fmt = W_FP8
        ck.check_shape(vw, (N, K), "(N = (Hq + 2 Hkv) D, K)")
    elif vw.dtype == UINT8:
        fmt = W_INT4
        if K % 2:
            raise ValueError(f"4-bit weights need an even K, got hidden_state with K={K}")
        ck.check_shape(vw, (N, K // 2), "(N = (Hq + 2 Hkv) D, K / 2) for 4-bit weights")
    else:
        raise TypeError(
            f"weight must have dtype {dtype} (the input dtype), float8_e4m3fn or "
            f"uint8 (packed 4-bit), got {vw.dtype}"
        )
    if fmt == W_DENSE:
        if vws is None and group_size is None and vzp is None:  # (the common case: no loop)
            return fmt
        for name, given in (
            ("weight_scales", vws),
            ("group_size", group_size),
            ("zero_points", vzp),
        ):
            if given is not None:
                raise ValueError(
                    f"{name} is only used with float8 or 4-bit weights, but weight is {vw.dtype}"
                )
    elif fmt == W_FP8:
        for name, given in (("group_size", group_size), ("zero_points", vzp)):
            if given is not None:
                raise ValueError(
                    f"{name} is only used with 4-bit weights, but weight is {vw.dtype}"
                )
        if vws is None:
            raise ValueError(
                f"weight_scales (float32, shape ({N},)) is required for float8 weights"
            )
        ck.check_shape(vws, (N,), "(N,)")
        ck.check_dtype(vws, (FLOAT32,))
        _check_contiguous(vws)
    else:
        G = ck.check_positive_int(group_size, "group_size") if group_size is not None else None
        if G is None:
            raise ValueError("group_size is required for 4-bit weights")
        if G % 2 or K % G:
            raise ValueError(f"group_size must be even and divide K={K}, got {G}")
        if vws is None:
            raise ValueError(
                f"weight_scales ({dtype}, shape ({N}, {K // G})) is required for 4-bit weights"
            )
        ck.check_shape(vws, (N, K // G), "(N, K / group_size)")
        ck.check_dtype(vws, (dtype,))
        if vzp is not None:
            ck.check_shape(vzp, (N, K // G), "(N, K / group_size)")
            ck.check_dtype(vzp, (UINT8,))
    return fmt


def _gemv_width(vw, fmt, dtype, K, group_size):
    """Bytes per weight load: 16 when K (and the group) split into 16-byte loads and every row
    starts 16-byte aligned, else the smallest unit."""
    vals = 16 // dtype.itemsize if fmt == W_DENSE else 16 if fmt == W_FP8 else 32
    ok = (
        _splits16(fmt, vals, K, group_size)
        and vw.ptr % 16 == 0
        and (vw.strides[0] * vw.dtype.itemsize) % 16 == 0
    )
    return (16, vals) if ok else (_weight_bytes_min(dtype, fmt), 2 if fmt == W_INT4 else 1)


def _splits16(fmt, vals, K, group_size):
    """Whether a row of K values, and a 4-bit group of ``group_size``, splits into whole 16-byte
    loads of ``vals`` values each."""
    return K % vals == 0 and (fmt != W_INT4 or group_size % vals == 0)


def _offsets32(fields, N, K):
    """Whether every row's scale and zero-point element offsets, plus K / group_size, stay below
    2^31 (GEMV_FORM bit 1 keeps them as 32-bit unsigned offsets)."""
    G = fields["group_size"]
    groups = K // G if G else 0
    return all(0 <= s and (N - 1) * s + groups < 2**31 for s in (fields["ws_s0"], fields["zp_s0"]))


def _tile(T):
    """qkv_gemv's token tile: the smallest that holds T tokens, else the largest."""
    return next((tt for tt in GEMV_TILES if tt >= T), GEMV_TILES[-1])


def _gemv(fields, slots, vx, vw, fmt, T, K, N, device, decode, pdl, opts=False):
    """The fused decode kernel: one launch (T == 0, status=: one block, which validates).
    ``decode``: (FAST_INT4, GEMV_PACKED, GEMV_PACKED_LATE_SCALE, GEMV_FORM)."""
    dtype = vx.dtype
    vb, vals = _gemv_width(vw, fmt, dtype, K, fields["group_size"])
    tt = _tile(T)
    packed = (2 if decode[2] else 1) if decode[1] and _packed(dtype, fmt, vb, tt) else 0
    form = decode[3]
    if form not in GEMV_FORMS:
        raise ValueError(f"ropekv.qkv.GEMV_FORM must be one of {GEMV_FORMS}, got {form}")
    if form & 2 and not _offsets32(fields, N, K):
        form &= ~2  # 64-bit scale / zero-point addressing, as form 1
    fast = decode[0] and not packed and _fast_int4(fmt, vb, tt)
    # shared memory: x (tt, kc) float32, and for the fast int4 decode its sums (tt, kc / 32)
    kc = GEMV_SMEM * 32 // (tt * 4 * 33) if fast else GEMV_SMEM // (tt * 4)
    kc = K if K <= kc else kc // vals * vals
    smem = tt * kc * 4 + (tt * (kc // 32) * 4 if fast else 0)
    pairs_per_block = GEMV_WARPS * GEMV_PAIRS
    grid = ((N // 2 + pairs_per_block - 1) // pairs_per_block, (T + tt - 1) // tt) if T else (1, 1)
    return Launch(
        STEM,
        gemv_expression(dtype, fmt, vb, tt, fast, opts, packed, form),
        device,
        grid,
        (GEMV_WARPS * 32,),
        PARAMS,
        {**fields, "kc": kc},
        slots,
        shared_mem=smem,
        pdl=pdl,
    )


def _lean_strides(fields):
    """qkv_gemv_lean keeps the weights' row stride (bytes) and the scales' and zero points' row
    strides (elements) as 32-bit values."""
    return all(0 <= fields[k] < 2**32 for k in ("weight_row_bytes", "ws_s0", "zp_s0"))


def _gemv_lean(fields, slots, vx, fmt, T, N, device, pdl, forms):
    """qkv_gemv_lean's launch (where lean_applies): a block of 4 warps a tile's row pairs, in the
    form :func:`lean_form` takes from ``forms``."""
    tt = _lean_tile(T)
    form = lean_form(fmt, tt, forms)
    pairs = lean_pairs(tt, form)
    return Launch(
        STEM,
        lean_expression(vx.dtype, fmt, tt, form),
        device,
        ((N // 2 + pairs - 1) // pairs, (T + tt - 1) // tt),
        (128,),
        PARAMS,
        {**fields, "kc": 0},
        slots,
        pdl=pdl,
    )


def _lean_mma(fields, slots, vx, fmt, T, N, D, device, pdl, shapes):
    """qkv_lean_mma's launch (where lean_mma_applies): blocks of 8 row pairs a m16 tile."""
    tt, shape = lean_mma_shape(T, D, fmt, shapes)
    warps, mt = shape
    return Launch(
        STEM,
        lean_mma_expression(vx.dtype, fmt, tt, shape),
        device,
        ((N // 2 + 8 * mt - 1) // (8 * mt), (T + tt - 1) // tt),
        (32 * warps,),
        PARAMS,
        {**fields, "kc": 0},
        slots,
        pdl=pdl,
    )


@functools.cache
def _compute_capability(device):
    import cupy

    return int(cupy.cuda.Device(device).compute_capability)


def quantized_top(K, N, fmt, sms, quantized, tiled):
    """The most tokens fp8 / 4-bit weights take the tensor-core path at, eagerly, given
    ``quantized`` = (cap, any_grid) (MMA_MAX_TOKENS_QUANTIZED, MMA_QUANTIZED_ANY_GRID): the cap,
    above any_grid only where qkv_mma_tiled takes the call and as many tokens as its unsplit grid
    of ``tiled``'s tiles fits in one wave of ``sms`` SMs (cuBLAS + the epilogue beyond)."""
    cap, any_grid = quantized
    tiled_min, max_tile, _, _, per_sm, _ = tiled
    if cap <= any_grid or not tiled_applies(K, fmt, cap, tiled_min):
        return min(cap, any_grid)
    wave_tokens = (per_sm * sms // -(-N // MMA_ROWS)) * max_tile
    return min(cap, max(any_grid, wave_tokens))


@functools.cache
def _sm_count(device):
    import cupy

    return int(cupy.cuda.Device(device).attributes["MultiProcessorCount"])


def graph_safe(T, K, D, fmt, group_size, compute_capability, dtype=FLOAT16):
    """Whether a call of ``T`` tokens can be recorded in a CUDA graph (one ropekv kernel, no
    temporaries), given contiguous arrays at 16-byte aligned addresses: up to
    ``GEMV_MAX_TOKENS`` tokens (the CUDA-core kernel), where ``qkv_lean_mma`` takes the call
    (sm_90, up to ``LEAN_MMA_MAX_TOKENS`` / ``LEAN_MMA_DENSE_MAX_TOKENS`` tokens), or where the
    tensor-core kernels apply (sm_90, heads that divide 128 rows) up to ``GRAPH_MAX_TOKENS``.
    Eagerly, fp16 / bf16 weights
    run ``qkv_wgmma`` up to ``WGMMA_MAX_TOKENS`` and fp8 / 4-bit weights the tensor-core kernels
    up to ``MMA_MAX_TOKENS_QUANTIZED``, cuBLAS beyond (faster there, on temporaries freed when the
    call returns); a call on a capturing stream runs the fused kernel instead, up to
    ``GRAPH_MAX_TOKENS``. Larger calls, and calls whose arrays are not so aligned, refuse a
    capturing stream (``ValueError``). ``dtype``: the inputs' (:func:`lean_mma_applies`)."""
    if T <= GEMV_MAX_TOKENS:
        return True
    if _splits16(fmt, MMA_VALS[fmt], K, group_size or 0) and lean_mma_applies(
        dtype, fmt, 16, D, T, lean_max_tokens(), compute_capability
    ):
        return True
    wgmma = wgmma_settings()
    wgmma = wgmma._replace(max_tokens=max(wgmma.max_tokens, GRAPH_MAX_TOKENS))
    if fmt == W_DENSE and wgmma_applies(T, K, D, compute_capability, wgmma):
        return True
    top = max(MMA_MAX_TOKENS if fmt == W_DENSE else MMA_MAX_TOKENS_QUANTIZED, GRAPH_MAX_TOKENS)
    return MMA_MIN_TOKENS <= T <= top and mma_applies(
        K, D, fmt, group_size or 0, compute_capability
    )


def mma_applies(K, D, fmt, group_size, compute_capability=90):
    """Whether the shape can run the tensor-core path (given 16-byte aligned weight rows and hidden
    rows, checked per call): thread-block clusters (sm_90), whole heads in a 128-row tile, K in
    16-byte weight loads (and 4-bit groups of whole loads)."""
    vals = MMA_VALS[fmt]
    return (
        compute_capability >= 90
        and MMA_ROWS % D == 0
        and K % 8 == 0
        and K % vals == 0
        and (fmt != W_INT4 or group_size % vals == 0)
    )


def _slice(K, split, unit):
    """K values per CTA of a cluster of ``split``: K / split rounded up to whole ``unit``s."""
    per_cta = -(-K // split)  # ceil(K / split)
    return -(-per_cta // unit) * unit


def _mma_slice(K, fmt, split=None):
    """qkv_mma's K values per CTA of the cluster: whole chunks (4 loads)."""
    return _slice(K, split or MMA_SPLIT, 4 * MMA_VALS[fmt])


def _mma_smem(tn, kc):
    """Dynamic shared memory of qkv_mma: the staged hidden rows (sw k values at a time), later
    the float32 partial sums."""
    sw = min(1024 if tn <= 16 else 512 if tn == 32 else 256, kc)
    xs_stride = sw + 32 if sw % 64 == 0 else sw
    return max(tn * xs_stride * 2, tn * (MMA_ROWS + 4) * 4)


def _tiled_smem(tn, stages, fmt):
    """Dynamic shared memory of qkv_mma_tiled: the stages (weight rows of TILED_ROW_BYTES, hidden
    rows of TILED_BK values, 4-bit scale entries), later the float32 partial sums."""
    bk = TILED_BK[fmt]
    scales = MMA_ROWS * (bk // 32) * 8 if fmt == W_INT4 else 0
    stage = MMA_ROWS * TILED_ROW_BYTES[fmt] + tn * bk * 2 + scales
    return max(stages * stage, tn * (MMA_ROWS + 4) * 4)


def _tiled_split(tiles, split, wave):
    """The largest of TILED_SPLITS up to ``split`` whose grid of ``tiles`` clusters fits one wave
    of ``wave`` CTAs (1 when none does)."""
    best = 1
    for s in TILED_SPLITS:
        if s <= split and tiles * s <= wave:
            best = s
    return best


def tiled_applies(K, fmt, T, tiled_min=None):
    """Whether a call that takes the tensor-core path runs qkv_mma_tiled: at least ``tiled_min``
    (TILED_MIN_TOKENS) tokens, K slices of whole stages (TILED_BK; 4-bit groups are whole
    32-value chunks, as :func:`mma_applies` requires)."""
    tiled_min = TILED_MIN_TOKENS if tiled_min is None else tiled_min
    return fmt in TILED_BK and T >= tiled_min and K % TILED_BK[fmt] == 0


def tiled_settings():
    """The TILED_* settings as the call passes them (the flags' tuple)."""
    return (
        TILED_MIN_TOKENS,
        TILED_MAX_TILE,
        TILED_STAGES,
        TILED_SPLIT,
        TILED_CTAS_PER_SM,
        TILED_KGROUPS,
    )


class WgmmaSettings(NamedTuple):
    """The WGMMA_* settings as a call passes them (one flag of the plan key; see the constants)."""

    min_tokens: int
    max_tokens: int
    max_tile: int
    stages: int
    atoms: int
    split: int
    deep_max_tokens: int
    deep_stages: int
    fp8_min_tokens: int
    fp8_atoms: int
    fp8_min_stages: int
    int4_min_tokens: int
    int4_atoms: int
    int4_min_stages: int
    int4_reg: bool
    fp8_reg: bool
    cluster_fit: bool


def wgmma_settings():
    """The WGMMA_* settings as they are now."""
    return WgmmaSettings(
        WGMMA_MIN_TOKENS,
        WGMMA_MAX_TOKENS,
        WGMMA_MAX_TILE,
        WGMMA_STAGES,
        WGMMA_ATOMS,
        WGMMA_SPLIT,
        WGMMA_DEEP_MAX_TOKENS,
        WGMMA_DEEP_STAGES,
        WGMMA_FP8_MIN_TOKENS,
        WGMMA_FP8_ATOMS,
        WGMMA_FP8_MIN_STAGES,
        WGMMA_INT4_MIN_TOKENS,
        WGMMA_INT4_ATOMS,
        WGMMA_INT4_MIN_STAGES,
        WGMMA_INT4_REG,
        WGMMA_FP8_REG,
        WGMMA_CLUSTER_FIT,
    )


def _wgmma_atoms(wq, wgmma):
    """The atoms (64 k values) a stage of qkv_wgmma holds for weight format ``wq`` (W_DENSE,
    W_FP8, W_INT4 or a register form of the last two; False / True: dense / fp8)."""
    wq = _WGMMA_BASE.get(wq, wq)
    return wgmma.fp8_atoms if wq == W_FP8 else wgmma.int4_atoms if wq == W_INT4 else wgmma.atoms


def wgmma_shape(T, K, D, wgmma, fp8=False):
    """Whether a call has a shape qkv_wgmma takes (given 16-byte aligned rows, checked per
    call): ``wgmma``'s token range, whole heads in a 128-row tile, K in whole stages (of
    ``wgmma.atoms``; ``fp8``, the weight format: of ``wgmma.fp8_atoms`` / ``int4_atoms``), and
    its tile's stages in an SM's shared memory (tuned settings can ask for more than fits)."""
    atoms = _wgmma_atoms(fp8, wgmma)
    if not (
        wgmma.min_tokens <= T <= wgmma.max_tokens and MMA_ROWS % D == 0 and K % (64 * atoms) == 0
    ):
        return False
    deep, tn, _, _, smem = _wgmma_layout(T, wgmma, fp8)
    return _wgmma_per_sm(smem, deep, tn) >= 1


def wgmma_takes(fmt, T, K, D, wgmma):
    """Whether qkv_wgmma takes a call of weight format ``fmt`` (given the device and the
    alignment): :func:`wgmma_shape` with fp16 / bf16 weights, or with fp8 ones (stages of their
    atoms) from ``fp8_min_tokens`` to ``deep_max_tokens`` tokens (the deep kernel), at most
    WGMMA_FP8_TOP; 4-bit ones likewise from ``int4_min_tokens``, at most WGMMA_INT4_TOP (and
    groups of a multiple of 32, which :func:`_wgmma` checks)."""
    if fmt == W_FP8:
        return wgmma.fp8_min_tokens <= T <= min(
            wgmma.deep_max_tokens, WGMMA_FP8_TOP
        ) and wgmma_shape(T, K, D, wgmma, fp8=W_FP8)
    if fmt == W_INT4:
        return wgmma.int4_min_tokens <= T <= min(
            wgmma.deep_max_tokens, WGMMA_INT4_TOP
        ) and wgmma_shape(T, K, D, wgmma, fp8=W_INT4)
    return fmt == W_DENSE and wgmma_shape(T, K, D, wgmma)


def wgmma_applies(T, K, D, compute_capability, wgmma):
    """:func:`wgmma_shape` on a device of ``compute_capability``: sm_90 alone (wgmma is an sm_90a
    instruction; later GPUs run the other paths)."""
    return compute_capability == WGMMA_CAPABILITY and wgmma_shape(T, K, D, wgmma)


def _wgmma_smem(tn, stages, atoms, fp8=False):
    """Dynamic shared memory of qkv_wgmma: the stages (128-byte weight and hidden rows of 64 k
    values an atom; fp8 weight rows of 64 bytes, 4-bit ones of 32 (``fp8``: the weight format),
    and two buffers of their 16-bit conversion), later the float32 partial sums, and 1 KiB to
    align the stages to 1024 bytes."""
    base = _WGMMA_BASE.get(fp8, fp8)
    a_row = 64 if base == W_FP8 else 32 if base == W_INT4 else 128
    # the buffers: quantized weights but for the register forms
    conv = 2 * atoms * MMA_ROWS * 128 if a_row < 128 and fp8 not in _WGMMA_BASE else 0
    stages_bytes = stages * atoms * (MMA_ROWS * a_row + tn * 128) + conv
    return max(stages_bytes, tn * (MMA_ROWS + 4) * 4) + 1024


def _wgmma_per_sm(smem, deep, tn=128):
    """CTAs of qkv_wgmma an SM holds: its launch bound (1 when ``deep``, else 2) and its shared
    memory (the dynamic part; the static part, a 24-byte slot and a 4-byte count a token of the
    ``tn``-token tile and 2 KiB of request offsets and lengths; 1 KiB reserved)."""
    return min(1 if deep else 2, SM_SHARED_BYTES // (smem + 28 * tn + 4 * 1024))


def _wgmma_stages(tn, stages, atoms, deep, fp8=False):
    """The stages of a ``tn``-token tile: ``stages``, fewer where that many would not fit in an
    SM's shared memory (``deep``: one CTA, at least 3 stages; 7 at tiles of 96 tokens, 6 at 128,
    5 at 192, 4 at 256) or would keep a second CTA off it (else: 3 at tiles of 96 and 128 tokens
    on sm_90, at least 2); fewer than that floor are raised to it."""
    floor, per_sm = (3, 1) if deep else (2, 2)
    stages = max(stages, floor)
    while stages > floor and _wgmma_per_sm(_wgmma_smem(tn, stages, atoms, fp8), deep, tn) < per_sm:
        stages -= 1
    return stages


def _wgmma_tile(T, max_tile, deep=False):
    """The token tile of a ``T``-token call: T split evenly over as few tiles of at most
    ``max_tile`` as hold it (``deep``: of at most the largest of WGMMA_TILES, so one tile up to
    256 tokens), each the smallest of WGMMA_TILES that holds its share."""
    max_tile = WGMMA_TILES[-1] if deep else max_tile
    share = -(-T // -(-T // max_tile))
    for tn in WGMMA_TILES:
        if tn >= share or tn >= max_tile:
            break
    return tn


def _wgmma_tiles():
    """The (tile, deep, weight format) triples of the shipped settings (the format False for 16-bit
    weights, True and W_FP8_REG for fp8, W_INT4 and W_INT4_REG for 4-bit), at every token count a
    call can take qkv_wgmma at: eagerly, or under capture (GRAPH_MAX_TOKENS); fp8 and 4-bit
    weights deep only."""
    top = max(WGMMA_MAX_TOKENS, GRAPH_MAX_TOKENS)
    dense = {
        (_wgmma_tile(T, WGMMA_MAX_TILE, deep), deep, False)
        for T in range(WGMMA_MIN_TOKENS, top + 1)
        for deep in [T <= WGMMA_DEEP_MAX_TOKENS]
    }
    fp8_top = min(WGMMA_MAX_TOKENS, WGMMA_DEEP_MAX_TOKENS, WGMMA_FP8_TOP)
    fp8 = {
        (_wgmma_tile(T, WGMMA_MAX_TILE, True), True, wq)
        for T in range(WGMMA_FP8_MIN_TOKENS, fp8_top + 1)
        for wq in (True, W_FP8_REG)
    }
    int4_top = min(WGMMA_MAX_TOKENS, WGMMA_DEEP_MAX_TOKENS, WGMMA_INT4_TOP)
    int4 = {
        (_wgmma_tile(T, WGMMA_MAX_TILE, True), True, wq)
        for T in range(WGMMA_INT4_MIN_TOKENS, int4_top + 1)
        for wq in (W_INT4, W_INT4_REG)
    }
    return sorted(dense | fp8 | int4)


def _wgmma_config(tn, deep, fp8, wgmma):
    """``(atoms, stages, dynamic shared memory)`` of qkv_wgmma at a ``tn``-token tile (``fp8``:
    the weight format; fp8 and 4-bit weights: fewer atoms a stage where their stages would be
    fewer than ``wgmma.fp8_min_stages`` / ``int4_min_stages``)."""
    atoms = _wgmma_atoms(fp8, wgmma)
    want = wgmma.deep_stages if deep else wgmma.stages
    stages = _wgmma_stages(tn, want, atoms, deep, fp8)
    base = _WGMMA_BASE.get(fp8, fp8)
    least = {W_FP8: wgmma.fp8_min_stages, W_INT4: wgmma.int4_min_stages}.get(base, 0)
    while atoms > 1 and stages < least:
        atoms //= 2
        stages = _wgmma_stages(tn, want, atoms, deep, fp8)
    return atoms, stages, _wgmma_smem(tn, stages, atoms, fp8)


def fitting_split(tiles, split, wave, held=None):
    """The largest of TILED_SPLITS up to ``split`` whose grid of ``tiles`` clusters fits one wave
    of ``wave`` CTAs and whose clusters the device runs at once: ``held(s)``, the clusters of
    ``s`` CTAs it holds (None: no such limit, or unknown), WGMMA_CLUSTER_FIT."""
    split = _tiled_split(tiles, split, wave)
    while held is not None and split > 1:
        n = held(split)
        if n is None or tiles <= n:
            break
        split = max(s for s in TILED_SPLITS if s < split)
    return split


def _active_clusters(expression, device, split, smem):
    """How many clusters of qkv_wgmma's ``expression`` (``split`` CTAs each, ``smem`` bytes of
    dynamic shared memory) the device runs at once (None: the driver cannot say)."""
    return max_active_clusters(STEM, expression, device, split, WGMMA_THREADS, smem)


def _wgmma_layout(T, wgmma, fp8=False):
    """``(deep, tile, atoms, stages, dynamic shared memory)`` of a ``T``-token qkv_wgmma
    launch."""
    deep = T <= wgmma.deep_max_tokens
    tn = _wgmma_tile(T, wgmma.max_tile, deep)
    return (deep, tn, *_wgmma_config(tn, deep, fp8, wgmma))


def int4_form(group_size, wgmma):
    """qkv_wgmma's form for 4-bit weights with groups of ``group_size``: W_INT4_REG (codes
    dequantized into the wgmmas' A registers) where ``wgmma.int4_reg`` and every atom of 64 k
    values lies in one group, else W_INT4 (16-bit buffers in shared memory)."""
    return W_INT4_REG if wgmma.int4_reg and group_size % 64 == 0 else W_INT4


def _wgmma(fields, slots, vx, vw, T, K, N, device, pdl, wgmma, opts=False, fp8=False):
    """The qkv_wgmma launch (``fp8``: the weight format; False / True: 16-bit / fp8), or None
    where the rows are not 16-byte aligned (or 4-bit groups are not whole 32-value halves of an
    atom). 4-bit weights whose groups are whole atoms take W_INT4_REG where ``wgmma.int4_reg``,
    fp8 weights W_FP8_REG where ``wgmma.fp8_reg``."""
    split = wgmma.split
    if split not in TILED_SPLITS:
        raise ValueError(f"ropekv.qkv.WGMMA_SPLIT must be one of {TILED_SPLITS}, got {split}")
    if fp8 == W_INT4 and (fields["group_size"] or 1) % 32:
        return None
    if fp8 == W_INT4:
        fp8 = int4_form(fields["group_size"], wgmma)
    elif fp8 == W_FP8 and wgmma.fp8_reg:
        fp8 = W_FP8_REG
    if not (
        vw.ptr % 16 == 0
        and (vw.strides[0] * vw.dtype.itemsize) % 16 == 0
        and vx.ptr % 16 == 0
        and vx.strides[0] % 8 == 0
    ):
        return None
    deep, tn, atoms, stages, smem = _wgmma_layout(T, wgmma, fp8)
    tiles = (-(-N // MMA_ROWS)) * (-(-T // tn))
    expression = functools.partial(wgmma_expression, vx.dtype, tn)
    rest = (stages, atoms, opts, deep, fp8)
    wave = _wgmma_per_sm(smem, deep, tn) * _sm_count(device)
    held = None
    if wgmma.cluster_fit:
        held = lambda s: _active_clusters(expression(s, *rest), device, s, smem)
    split = fitting_split(tiles, split, wave, held)
    kc = _slice(K, split, 64 * atoms)
    return Launch(
        STEM,
        expression(split, *rest),
        device,
        (split, tiles),
        (WGMMA_THREADS,),
        PARAMS,
        {**fields, "kc": kc},
        slots,
        shared_mem=smem,
        pdl=pdl,
    )


def _mma(
    fields, slots, vx, vw, fmt, T, K, N, D, device, pdl, split, tiled, opts=False, form=(0, 0)
):
    """The tensor-core launch (qkv_mma, or qkv_mma_tiled where :func:`tiled_applies`: from
    ``tiled``'s token count on), or None where neither applies. ``form``: (MMA_FORM,
    MMA_OFFSETS32_MAX_TILE)."""
    form, offsets32_max_tile = form
    G = fields["group_size"]
    tiled_min, max_tile, stages, tiled_split, per_sm, kgroups = tiled
    if split not in MMA_SPLITS:
        raise ValueError(f"ropekv.qkv.MMA_SPLIT must be one of {MMA_SPLITS}, got {split}")
    if form not in MMA_FORMS:
        raise ValueError(f"ropekv.qkv.MMA_FORM must be one of {MMA_FORMS}, got {form}")
    if tiled_split not in TILED_SPLITS:
        raise ValueError(f"ropekv.qkv.TILED_SPLIT must be one of {TILED_SPLITS}, got {tiled_split}")
    if not mma_applies(K, D, fmt, G, _compute_capability(device)):
        return None
    if not (
        vw.ptr % 16 == 0
        and (vw.strides[0] * vw.dtype.itemsize) % 16 == 0
        and vx.ptr % 16 == 0
        and (T == 1 or vx.strides[0] % 8 == 0)
    ):
        return None
    tiled = tiled_applies(K, fmt, T, tiled_min)
    # the smallest token tile that holds T tokens, else the largest (no generator); the tiled
    # kernel's up to max_tile
    tile_sizes, largest = (TILED_TILES, max_tile) if tiled else (MMA_TILES, MMA_TILES[-1])
    for tn in tile_sizes:
        if tn >= T or tn >= largest:
            break
    tiles = (-(-N // MMA_ROWS)) * (-(-T // tn))
    if tiled:
        tiled_split = _tiled_split(tiles, tiled_split, per_sm * _sm_count(device))
        kc = _slice(K, tiled_split, TILED_BK[fmt])
        return Launch(
            STEM,
            tiled_expression(vx.dtype, fmt, tn, tiled_split, stages, kgroups, opts),
            device,
            (tiled_split, tiles),
            (2 * tn * kgroups,),
            PARAMS,
            {**fields, "kc": kc},
            slots,
            shared_mem=_tiled_smem(tn, stages, fmt),
            pdl=pdl,
        )
    if form & 8 and (tn > offsets32_max_tile or not _offsets32(fields, N, K)):
        form &= ~8  # 64-bit scale / zero-point addressing, as form 5
    kc = _mma_slice(K, fmt, split)
    smem = _mma_smem(tn, kc)
    if smem > MMA_SMEM_MAX:
        return None
    return Launch(
        STEM,
        mma_expression(vx.dtype, fmt, tn, split, opts, form),
        device,
        (split, tiles),
        (MMA_WARPS * 32,),
        PARAMS,
        {**fields, "kc": kc},
        slots,
        shared_mem=smem,
        pdl=pdl,
    )


def _epilogue_width(vout, vk, vv, vt, D, R, is_neox):
    """Widest vector for the prefill epilogue, or None (then the GEMV path runs instead). A new
    ``out`` (None here) is contiguous and aligned for every width that divides D."""
    # the widest n for which the rows (and the table's) are aligned, read once for every width
    widest = widest_aligned((vk, vv) if vout is None else (vout, vk, vv))
    table_widest = 16 if vt is None else widest_aligned((vt,))
    for n in EPILOGUE_WIDTHS:
        if vt is not None:
            rot = (R // 2) % n == 0 if is_neox else (R % n == 0 and n % 2 == 0)
            if not rot or (D - R) % n or (n if is_neox else max(n // 2, 1)) > table_widest:
                continue
        if D % n == 0 and n <= widest:
            return n
    return None


def _prefill(
    fields,
    slots,
    vx,
    vw,
    fmt,
    cache_dtype,
    n,
    T,
    K,
    N,
    Hq,
    Hkv,
    D,
    device,
    n_out,
    pdl,
    opts=False,
    status=False,
):
    """cuBLAS, then one epilogue launch: ``(steps, workspaces)``. One GEMM into a (T, N)
    temporary in the input dtype; for fp8 caches with RoPE, Q goes straight into ``out`` and K|V
    into a float32 temporary instead (16-bit rounding before a cancelling rotation would cost fp8
    codes); with ``status`` Q goes into a temporary there too, so that nothing the caller sees is
    written before the epilogue has validated the offsets. Quantized weights are first
    dequantized into an (N, K) temporary."""
    dtype = vx.dtype
    k_dtype = FLOAT32 if fields["R"] and cache_dtype in FP8_DTYPES else dtype
    steps, workspaces = [], []
    next_index = NEW + n_out  # workspaces' pointers follow the arguments and the new output
    if fmt == W_DENSE:
        w_slot, w_ld = slots["weight"], vw.strides[0]
    else:
        w_slot, w_ld = (next_index, 0), K
        workspaces.append(Output((N, K), dtype))
        next_index += 1
        total = N * (K // 2 if fmt == W_INT4 else K)
        grid = min((total + DEQUANT_BLOCK - 1) // DEQUANT_BLOCK, 132 * 16)
        steps.append(
            Launch(
                STEM,
                dequant_expression(dtype, fmt),
                device,
                (grid,),
                (DEQUANT_BLOCK,),
                PARAMS,
                fields,
                {**slots, "out": w_slot},
                pdl=pdl,
            )
        )
    row_bytes = w_ld * dtype.itemsize
    x_slot, x_ld = slots["hidden"], vx.strides[0]
    tmp = (next_index, 0)
    if k_dtype == dtype:
        workspaces.append(Output((T, N), dtype))
        steps.append(Gemm(w_slot, w_ld, x_slot, x_ld, tmp, N, N, T, K, dtype, dtype))
        isz = dtype.itemsize
        q_slot, q_ld = tmp, N
        k_slot, v_slot = (next_index, Hq * D * isz), (next_index, (Hq + Hkv) * D * isz)
        kv_ld = N
    else:
        workspaces.append(Output((T, 2 * Hkv * D), k_dtype))
        if status:  # Q through a temporary of its own (the caller's out untouched on failure)
            workspaces.append(Output((T, Hq * D), dtype))
            q_slot, q_ld = (next_index + 1, 0), Hq * D
        else:
            q_slot, q_ld = slots["out"], fields["out_s0"]  # roped in place
        steps.append(Gemm(w_slot, w_ld, x_slot, x_ld, q_slot, q_ld, Hq * D, T, K, dtype, dtype))
        steps.append(
            Gemm(
                (w_slot[0], w_slot[1] + Hq * D * row_bytes),
                w_ld,
                x_slot,
                x_ld,
                tmp,
                2 * Hkv * D,
                2 * Hkv * D,
                T,
                K,
                dtype,
                k_dtype,
            )
        )
        k_slot, v_slot, kv_ld = tmp, (next_index, Hkv * D * 4), 2 * Hkv * D
    steps.append(
        Launch(
            STEM,
            epilogue_expression(dtype, cache_dtype, k_dtype, n, opts),
            device,
            (T,),
            (EPILOGUE_BLOCK,),
            PARAMS,
            {**fields, "qt_s0": q_ld, "kt_s0": kv_ld, "vt_s0": kv_ld},
            {**slots, "q_tmp": q_slot, "k_tmp": k_slot, "v_tmp": v_slot},
            pdl=pdl,
        )
    )
    return steps, workspaces


def _check_indices(voff, vlen, vbt, T, P, page_size, num_pages):
    request, pos, page, entry = reference.ragged_paged_slots(
        ck.host_copy(voff), ck.host_copy(vlen), ck.host_copy(vbt), page_size, num_pages, T
    )
    for t in np.nonzero(
        (request < 0) | (pos < 0) | (page < 0) | ((pos >= P) if P is not None else False)
    )[0]:
        t = int(t)
        if request[t] < 0:
            raise IndexError(f"token {t} lies in no request of input_row_offsets")
        if pos[t] < 0 or (P is not None and pos[t] >= P):
            raise IndexError(
                f"token {t} (request {request[t]}) has position {pos[t]}, outside "
                f"[0, {P if P is not None else 'inf'})"
            )
        raise IndexError(
            f"token {t} (request {request[t]}, position {pos[t]}) has no valid "
            f"page in block_table (block index {pos[t] // page_size}, "
            f"num_pages {num_pages})"
        )
    writes = page >= 0
    ck.check_unique_slots(
        np.stack([page[writes], entry[writes]], 1),
        np.flatnonzero(writes),
        "cache row (page, entry)",
    )


# ---- the declaration (ropekv/_declare.py): the torch and JAX forms follow from it -------------


def _outputs(values):
    from ropekv import _frameworks

    return _frameworks.qkv_outputs(values)


def _capture_check(values, where):
    from ropekv import _frameworks

    _frameworks.qkv_capture_check(values, where)


DECLARATIONS = (
    decl.Declaration(
        "fused_qkv_matmul_append_paged_kv_cache",
        (
            decl.array("hidden_state", shape=("(T, K)",), dtypes=INPUT_DTYPES),
            decl.array(
                "weight",
                shape=("(N, K)", "(N, K / 2)"),
                dtypes=("hidden_state", FLOAT8_E4M3FN, UINT8),
            ),
            *decl.ragged_paged(),
            decl.paged_kv_cache(("hidden_state", *FP8_DTYPES)),
            decl.scalar("num_q_heads", "int"),
            decl.array("cos_sin_cache", optional=True, shape=("(P, R)",), dtypes=(FLOAT32,)),
            decl.scalar("is_neox", "bool", True),
            decl.scalar("kv_layout", "str", "NHD"),
            decl.scalar("kv_scale", "floats", None),
            decl.array(
                "weight_scales",
                optional=True,
                shape=("(N,)", "(N, K / group_size)"),
                dtypes=(FLOAT32, "hidden_state"),
            ),
            decl.scalar("group_size", "int", None),
            decl.array(
                "zero_points", optional=True, shape=("(N, K / group_size)",), dtypes=(UINT8,)
            ),
            decl.out("out", shape=("(T, Hq * D)",), dtypes=("hidden_state",)),
            decl.scalar("clear_unused_last_page_rows", "bool", False),
            decl.status(),
            decl.scalar("layer_idx", "int", None, check=ck.check_layer_idx),
            decl.scalar("enable_pdl", "bool", False),
        ),
        outputs=_outputs,
        capture_check=_capture_check,
    ),
)
# the launch's roles, from the declaration: the arrays written when given
_WRITTEN = DECLARATIONS[0].launch_written(ARRAYS)

_OP = Op(
    "fused_qkv_matmul_append_paged_kv_cache",
    ARRAYS,
    _prepare,
    layered=DECLARATIONS[0].launch_layered(ARRAYS),
    flags=[
        ("num_q_heads", KEY),
        ("is_neox", FLAG),
        ("kv_layout", KEY),
        ("kv_scale", KEY),
        ("group_size", KEY),
        ("enable_pdl", FLAG),
        *(
            (name, AS_IS)
            for name in (
                "GEMV_MAX_TOKENS",
                "FAST_INT4",
                "GEMV_PACKED",
                "GEMV_PACKED_MAX_TOKENS",
                "GEMV_PACKED_LATE_SCALE",
                "GEMV_PACKED_FP8",
                "GEMV_FORM, GEMV_LEAN_*, LEAN_MMA_*",
                "MMA_MIN_TOKENS",
                "MMA_MAX_TOKENS",
                "MMA_*_QUANTIZED",
                "MMA_SPLIT",
                "MMA_FORM, MMA_OFFSETS32_MAX_TILE",
            )
        ),
        ("TILED_*", AS_IS),
        ("WGMMA_*", AS_IS),
        ("GRAPH_MAX_TOKENS", AS_IS),
        ("clear_unused_last_page_rows", FLAG),
    ],
)
