"""``mla_rope_rmsnorm_append_paged_kv_cache``: MLA query RoPE, latent RMSNorm + RoPE, and the
quantized write of the latent row into a paged cache, in one launch (Modular MAX's
``fused_rope_rmsnorm_quantization_kernel``)."""

from __future__ import annotations

import collections
import functools
from typing import NamedTuple

import numpy as np

from ropekv import _checks as ck
from ropekv import _declare as decl
from ropekv import reference
from ropekv._arrays import BFLOAT16, FLOAT16, FLOAT32, FP8_DTYPES, HOST
from ropekv._compile import c_bool, c_type, name_expression, rope_instantiations
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
    given_or_new,
)
from ropekv._mrope import check_status
from ropekv._types import ArrayLike, StreamLike
from ropekv._vector import vector_width, widest_aligned

STEM = "mla"
KERNEL = "mla_rope_rmsnorm_append"
BLOCK = 256
HEADS_MAX = 4  # q heads one lane group holds (kHeadsMax in the kernel)
INPUT_DTYPES = (FLOAT16, BFLOAT16)
# Launch shape (H200). Below `split_below` tokens (decode) the split kernel: a token's q heads over
# up to Hq / (BLOCK / items) blocks (one head per lane group) while the grid stays within
# `wave_blocks`, over as few as HEADS_MAX allow otherwise. From `split_below` tokens (prefill) the
# token kernel: a block per token walking its heads two at a time.
# Below `lean_below` tokens a plain call (no status, no clear_unused_last_page_rows) takes the lean
# kernel instead: one chunk of one row per thread, blocks of about `lean_block` threads (a token's
# q heads over ceil(Hq / rows) blocks, its kv row in one more block whose first warp normalises
# the latent row); `lean_below=0` is the choice of ee077f9. H200, graph replay, DeepSeek heads
# bf16 -> e4m3, 1 / 16 / 64 / 128 / 256 tokens, lean against split kernel: 1.9 / 2.1 / 2.9 / 3.4 /
# 5.6 us against 2.6 / 2.9 / 3.2 / 3.6 / 4.3 (blocks of 64 and 256 threads within 2% but at 128
# tokens); hence up to 128 tokens.
TUNING = {"wave_blocks": 165, "split_below": 1024, "lean_below": 129, "lean_block": 128}
SPLIT_KERNEL = "mla_rope_rmsnorm_append_split"
LEAN_KERNEL = "mla_rope_rmsnorm_append_lean"
LEAN_LATENT = 2  # latent chunks a lane of the lean kernel's latent warp holds (kLeanLatent)

PARAMS = ParamStruct(
    "MlaParams",
    [
        *(
            (n, np.uint64)
            for n in (
                "q",
                "q_out",
                "kv",
                "gamma",
                "cos_sin",
                "offsets",
                "cache_lengths",
                "block_table",
                "ckv",
                "kpe",
                "status",
            )
        ),
        *(
            (n, np.int64)
            for n in (
                "q_st",
                "q_sh",
                "qo_st",
                "qo_sh",
                "kv_st",
                "cs_sp",
                "bt_sb",
                "ckv_sp",
                "ckv_se",
                "kpe_sp",
                "kpe_se",
                "num_pages",
            )
        ),
        ("epsilon", np.float32),
        ("inv_kv_scale", np.float32),
        *(
            (n, np.int32)
            for n in (
                "T",
                "B",
                "Hq",
                "L",
                "R",
                "P",
                "kv_norm_dim",
                "max_pages",
                "page_size",
                "gamma_f32",
                "heads_per_block",
                "clear",
                "check",
            )
        ),
    ],
)


def launch_shape(T, Hq, items):
    """(splits, heads per block) for T tokens of Hq q heads of ``items`` chunks each."""
    groups = BLOCK // items
    fewest = -(-Hq // (groups * HEADS_MAX))
    most = -(-Hq // groups)
    splits = max(fewest, min(most, -(-TUNING["wave_blocks"] // T)))
    per_block = -(-Hq // splits)
    return -(-Hq // per_block), per_block


def lean_shape(T, Hq, items, L, n):
    """``(rows, splits)`` of the lean kernel for T tokens of Hq q heads of ``items`` chunks each
    (blocks of ``(items, rows)`` threads, grid ``(T, 1 + splits)``), or None where it does not
    apply: T outside ``[1, lean_below)``, ``items`` not a power of two of at most 32, or a latent
    row of more than 32 LEAN_LATENT chunks."""
    if not (
        0 < T < TUNING["lean_below"]
        and items <= 32
        and items & (items - 1) == 0
        and L // n <= 32 * LEAN_LATENT
    ):
        return None
    unit = 32 // items  # rows of a warp: blocks are whole warps
    threads = max(64, min(BLOCK, TUNING["lean_block"] // 32 * 32))
    rows = max(threads // items, 2 * unit)  # at least two warps: the kv block's
    splits = -(-Hq // rows)
    even = -(-Hq // splits)  # the heads spread evenly over the splits, in whole warps
    rows = max(-(-even // unit) * unit, 2 * unit)
    return rows, splits


@functools.cache  # a plan's lookup spells it once per first call
def expression(dtype, cache_dtype, is_neox, n, split=False, opts=False, lean=False):
    """``opts``: the kernel that reads the options (tail clearing); the plain one has them
    compiled out. ``lean``: the lean decode kernel (plain calls only)."""
    if lean:
        return name_expression(LEAN_KERNEL, c_type(dtype), c_type(cache_dtype), c_bool(is_neox), n)
    return name_expression(
        SPLIT_KERNEL if split else KERNEL,
        c_type(dtype),
        c_type(cache_dtype),
        c_bool(is_neox),
        n,
        c_bool(opts),
    )


def instantiations():
    """Every kernel instantiation a call can select (the compile tests build them all)."""
    for split in (False, True):
        for opts in (False, True):
            yield from rope_instantiations(
                lambda *a, s=split, o=opts: expression(*a, s, o), INPUT_DTYPES, FP8_DTYPES
            )
    yield from rope_instantiations(lambda *a: expression(*a, lean=True), INPUT_DTYPES, FP8_DTYPES)


# ---- helpers shared with ropekv.qknorm ---------------------------------------------------------


def check_output(out, src):
    """``out`` receives rows of ``src``: same shape and dtype, contiguous last dim (it is written,
    and may be ``src`` itself: the call path checks writability and overlap)."""
    ck.check_shape(out, src.shape, None)
    ck.check_same_dtype(out, src)
    ck.check_last_dim_contiguous(out)


def mla_rope_rmsnorm_append_paged_kv_cache(
    q_rope: ArrayLike,
    kv: ArrayLike,
    gamma: ArrayLike,
    cos_sin_cache: ArrayLike,
    input_row_offsets: ArrayLike,
    cache_lengths: ArrayLike,
    block_table: ArrayLike,
    kv_cache: ArrayLike | tuple[ArrayLike, ArrayLike],
    *,
    epsilon: float = 1e-6,
    kv_norm_dim: int | None = None,
    is_neox: bool = False,
    kv_scale: float | None = None,
    q_rope_out: ArrayLike | None = None,
    clear_unused_last_page_rows: bool = False,
    status: ArrayLike | None = None,
    layer_idx: int | None = None,
    enable_pdl: bool = False,
    stream: StreamLike | None = None,
) -> ArrayLike:
    """MLA: rope the query's rotary part, RMS-normalise and rope the latent kv row, and write it
    (quantized) into a paged cache, over a ragged batch, in one launch.

    Mirrors Modular MAX's ``fused_rope_rmsnorm_quantization_kernel``. Token ``t`` of request ``b``
    (``input_row_offsets[b] <= t < input_row_offsets[b + 1]``) has position
    ``p = cache_lengths[b] + t - input_row_offsets[b]`` and is written to page
    ``block_table[b, p // page_size]``, entry ``p % page_size``.

    Parameters
    ----------
    q_rope : array, (T, Hq, R), float16 or bfloat16
        Rotary part of the queries.
    kv : array, (T, L + R), the dtype of ``q_rope``
        Latent rows: ``kv[:, :L]`` (``kv_lora_rank`` dims) then the R rotary key dims.
    gamma : array, (kv_norm_dim,), the dtype of ``q_rope`` or float32
        RMSNorm weight.
    cos_sin_cache : array, (P, R), float32
        ``[:R/2]`` cos, ``[R/2:]`` sin (see :func:`ropekv.cos_sin_cache`; MAX's interleaved
        ``freqs_cis`` converts with :func:`ropekv.freqs_cis_to_cos_sin`).
    input_row_offsets : array, (B + 1,), int32 or uint32
        Request b owns tokens ``[offsets[b], offsets[b + 1])``; zero-length requests are allowed.
    cache_lengths : array, (B,), int32
        Tokens already cached per request.
    block_table : array, (B, max_pages), int32
        Page ids of each request (rows may be strided).
    kv_cache : array (num_pages, page_size, L + R), or tuple (ckv, kpe)
        MAX's one-head layout, or FlashInfer's ``ckv (num_pages, page_size, L)`` and
        ``kpe (num_pages, page_size, R)``. dtype: that of ``q_rope``, float8_e4m3fn or
        float8_e5m2. Written in place; only the addressed rows change.
    epsilon : float
        RMSNorm epsilon.
    kv_norm_dim : int, optional
        Normalised latent dims, in ``[1, L]``; default L. Dims ``[kv_norm_dim, L)`` pass through.
    is_neox : bool
        False (the MLA default) rotates interleaved pairs (2i, 2i + 1); True half-split pairs
        (i, i + R/2).
    kv_scale : float, optional
        Dequantization scale of an fp8 cache (default 1.0): stored = fp8(x / kv_scale), round to
        nearest even, saturating. Not accepted for 16-bit caches.
    q_rope_out : array, (T, Hq, R), the dtype of ``q_rope``, optional
        Receives the roped queries; ``q_rope`` itself means in place. By default a new array in the
        caller's array type (CuPy, torch, NumPy); any other array must not overlap an argument.
    clear_unused_last_page_rows : bool
        Also zero the rows (ckv and kpe) of each request's last page past its new length
        ``cache_lengths[b] + input_row_offsets[b + 1] - input_row_offsets[b]`` (FlashInfer Cake's
        option of this name), so attention kernels reading whole pages meet zeros. Done by the
        request's last token, so only when that token is written; a request with no new tokens
        clears nothing; only the page the block table names for that token is touched.
    status : array, (1,), int32, optional
        Validate ``input_row_offsets`` on the device first (no host synchronisation, CUDA-graph
        capturable): ``status[0]`` receives 0 when they are well formed, else the code of the
        first failing check (1: ``offsets[0] != 0``; 2: an offset below the one before it; 3:
        ``offsets[-1] != T``), and then nothing else is written (``docs/conventions.md``).
    layer_idx : int, optional
        Multi-layer caches: ``kv_cache`` (or ``ckv`` and ``kpe``) then carry a leading
        ``(num_layers, ...)`` dimension, and only layer ``layer_idx`` (an int in
        ``[0, num_layers)``) is written (``docs/conventions.md``, "Multi-layer caches").
    enable_pdl : bool
        Launch with programmatic dependent launch (see :func:`ropekv.apply_rope_write_kv`).
    stream : CuPy stream, int ``cudaStream_t`` or object with ``cuda_stream``, optional
        By default torch's current stream for torch inputs, else CuPy's (``docs/conventions.md``).

    Returns
    -------
    q_rope_out : array, (T, Hq, R)
        The roped queries (``q_rope_out`` itself when given).

    Raises
    ------
    TypeError
        Arrays of a dtype not listed above (``kv`` unlike ``q_rope``, a gamma that is neither the
        input dtype nor float32, non-integer index arrays), or a ``stream`` of an unknown kind.
    ValueError
        Shapes that disagree (``kv`` not ``(T, L + R)``, the table's R unlike ``q_rope``'s, a
        page size of 0), ``kv_norm_dim`` outside ``[1, L]``, ``kv_cache`` neither one array nor a
        ``(ckv, kpe)`` pair, ``kv_scale`` with a 16-bit cache, a ``layer_idx`` outside the
        caches' layers, a written array that overlaps another argument, or arrays on different
        devices.
    BufferError
        A written array exported read-only (or through a legacy DLPack capsule), memory not
        aligned to its item size, or rows starting at odd elements with ``is_neox=False``.
    IndexError
        Only with ``ROPEKV_CHECK_INDICES=1``: offsets that decrease or run past T, a token outside
        every request, a position outside the table, a page outside ``block_table`` or the
        cache, or two tokens writing one cache row.

    Notes
    -----
    The latent row is ``ckv = x[:n] / sqrt(mean(x[:n]^2) + epsilon) * gamma`` followed by
    ``x[n:L]`` unchanged, ``kpe = rope(x[L:])``, all in float32 and rounded once. A token outside
    every request, or whose position falls outside ``[0, P)``, has its q row copied unrotated and
    writes nothing; a token whose page index falls outside the block table row or whose page id is
    outside ``[0, num_pages)`` is roped but writes nothing. With ``ROPEKV_CHECK_INDICES=1`` such a
    token raises ``IndexError`` instead (checked on the host first). Two tokens addressing one
    cache row leave that row undefined: its ``ckv_cache`` and ``kpe_cache`` parts, and each
    16-byte piece of them, may come from either token, a mix that neither token wrote
    (``ROPEKV_CHECK_INDICES=1`` raises ``IndexError`` naming both). NumPy inputs run the NumPy
    reference on the host.

    Examples
    --------
    With NumPy arrays (the NumPy reference, on the host):

    >>> import numpy as np, ropekv
    >>> T, Hq, L, R, pages, page_size = 6, 16, 512, 64, 8, 16
    >>> rng = np.random.default_rng(0)
    >>> q_rope = rng.standard_normal((T, Hq, R)).astype(np.float16)
    >>> kv = rng.standard_normal((T, L + R)).astype(np.float16)
    >>> gamma = np.ones(L, np.float32)
    >>> table = ropekv.cos_sin_cache(4096, R)
    >>> offsets = np.array([0, 4, 6], np.int32)         # two requests: 4 and 2 new tokens
    >>> lengths = np.array([0, 10], np.int32)           # the second has 10 tokens cached
    >>> block_table = np.array([[3, 0], [5, 1]], np.int32)
    >>> cache = np.zeros((pages, page_size, L + R), np.float16)
    >>> q_out = ropekv.mla_rope_rmsnorm_append_paged_kv_cache(
    ...     q_rope, kv, gamma, table, offsets, lengths, block_table, cache)
    >>> q_out.shape, bool(cache[5, 10:12].any()), bool(cache[5, 12:].any())  # rows 10, 11 of page 5
    ((6, 16, 64), True, False)

    The same call with CuPy arrays runs the CUDA kernel (needs a GPU):

    >>> import cupy as cp  # doctest: +SKIP
    >>> q_out = ropekv.mla_rope_rmsnorm_append_paged_kv_cache(  # doctest: +SKIP
    ...     *(cp.asarray(x) for x in (q_rope, kv, gamma, table, offsets, lengths, block_table,
    ...                               cache)))
    """
    split = isinstance(kv_cache, (tuple, list))
    if split and len(kv_cache) != 2:
        raise ValueError(
            f"kv_cache must be one array (num_pages, page_size, L + R) or a tuple "
            f"(ckv, kpe), got a {type(kv_cache).__name__} of {len(kv_cache)} arrays"
        )
    caches = tuple(kv_cache) if split else (kv_cache, None)
    return (_SPLIT if split else _JOINED)(
        (
            q_rope,
            kv,
            gamma,
            cos_sin_cache,
            input_row_offsets,
            cache_lengths,
            block_table,
            *caches,
            q_rope_out,
            status,
        ),
        (
            epsilon,
            kv_norm_dim,
            is_neox,
            kv_scale,
            enable_pdl,
            tuple(TUNING.values()),
            clear_unused_last_page_rows,
        ),
        stream,
        layer_idx,
    )


class _Checked(NamedTuple):
    """What the checks of a first call derive: sizes, the caches (``caches``: ``(ckv, kpe)``
    views, or the one joined cache's), the validated scalars and the device."""

    split: bool
    T: int
    Hq: int
    R: int
    L: int
    P: int
    n_norm: int
    B: int
    max_pages: int
    caches: tuple
    num_pages: int
    page_size: int
    scale: float | None
    epsilon: float
    device: int


def _prepare(views, flags):
    """Validate a first call (:func:`_check`), choose the vector width and launch shape
    (:func:`_choose`) and pack the launch plan (:func:`_pack`), or the NumPy backend run."""
    a, f = _Views._make(views), _Flags._make(flags)
    c = _check(a, f)
    written = _WRITTEN  # those given: Op.first_call drops the others (kpe_cache when joined)
    outputs = [] if a.q_rope_out is not None else [Output((c.T, c.Hq, c.R), a.q_rope.dtype)]
    plan = functools.partial(
        Plan, outputs=outputs, written=written, inplace=_INPLACE, result=_RESULT
    )
    if ck.check_indices_enabled():
        ck.check_paged_indices(
            a.input_row_offsets, a.cache_lengths, a.block_table, c.page_size, c.num_pages, c.T, c.P
        )
    if c.device == HOST:
        return plan(HOST, host=_host_run(a, f, c))
    if c.T == 0 and a.status is None:
        return plan(c.device)
    plain = not f.clear_unused_last_page_rows and a.status is None
    n, split_heads, splits, per_block, lean = _choose(a, f.is_neox, c, plain)
    return plan(c.device, [_pack(a, f, c, n, split_heads, splits, per_block, lean)])


def _check(a, f):
    """Every check of a first call, in the order of the arguments' errors; a :class:`_Checked`."""
    vq, vkv, vg, vt = a.q_rope, a.kv, a.gamma, a.cos_sin_cache
    split = a.kpe_cache is not None or a.kv_cache.name == "ckv_cache"

    # Tests of the common case first, read in the checkers' order; the checkers (which raise
    # their own messages) only where a test fails: this runs on every first call.
    if not (
        len(vq.shape) == 3
        and vq.dtype in INPUT_DTYPES
        and len(vkv.shape) == 2
        and vkv.dtype == vq.dtype
    ):
        ck.check_ndim(vq, 3, "(T, Hq, R)")
        ck.check_dtype(vq, INPUT_DTYPES)
        ck.check_ndim(vkv, 2, "(T, L + R)")
        ck.check_same_dtype(vkv, vq)
    T, Hq, R = vq.shape
    if vkv.shape[0] != T:
        raise ValueError(
            f"kv must have shape (T, L + R) with T={T} (q_rope's tokens), got {vkv.shape}"
        )
    if not (len(vt.shape) == 2 and vt.dtype == FLOAT32):
        ck.check_ndim(vt, 2, "(P, R)")
        ck.check_dtype(vt, (FLOAT32,))
    P = vt.shape[0]
    if vt.shape[1] != R or R % 2 or R == 0:
        raise ValueError(
            f"cos_sin_cache must have shape (P, R) with R = q_rope's last dim "
            f"({R}), even and positive, got {vt.shape}"
        )
    L = vkv.shape[1] - R
    if L <= 0:
        raise ValueError(f"kv must have shape (T, L + R) with L > 0 and R = {R}, got {vkv.shape}")
    n_norm = _check_norm_dim(f.kv_norm_dim, L)
    gamma_dtypes = (vq.dtype, FLOAT32)
    if (
        vg.shape != (n_norm,) or vg.dtype not in gamma_dtypes or vg.strides != ck.UNIT_STRIDE
    ):  # (stride 1: contiguous)
        ck.check_shape(vg, (n_norm,), "(kv_norm_dim,)")
        ck.check_dtype(vg, gamma_dtypes)
        ck.check_contiguous(vg)
    B, max_pages = ck.check_ragged_paged(a.input_row_offsets, a.cache_lengths, a.block_table)
    caches, num_pages, page_size = _check_caches(a, split, L, R)
    scale = ck.check_cache_scale(f.kv_scale, caches[0].dtype)
    epsilon = ck.check_float(f.epsilon, "epsilon", positive=False)
    if (
        vq.strides[-1] != 1
        or vkv.strides[-1] != 1
        or vt.strides[-1] != 1
        or caches[0].strides[-1] != 1
        or caches[-1].strides[-1] != 1
    ):
        ck.check_last_dim_contiguous(vq, vkv, vt, *caches)
    if a.q_rope_out is not None:
        check_output(a.q_rope_out, vq)
    if a.status is not None:
        check_status(a.status)
    device = ck.check_same_device(a)
    return _Checked(
        split,
        T,
        Hq,
        R,
        L,
        P,
        n_norm,
        B,
        max_pages,
        caches,
        num_pages,
        page_size,
        scale,
        epsilon,
        device,
    )


def _check_norm_dim(kv_norm_dim, L):
    """``kv_norm_dim``: an integer in ``[1, L]`` (None: L), as a Python int."""
    n_norm = L if kv_norm_dim is None else kv_norm_dim
    if (
        n_norm.__class__ is not int
        and not isinstance(n_norm, int | np.integer)
        or not (0 < n_norm <= L)
    ):
        raise ValueError(f"kv_norm_dim must be an integer in [1, L={L}], got {kv_norm_dim!r}")
    return int(n_norm)


def _check_caches(a, split, L, R):
    """The cache (joined) or caches (split); ``(caches, num_pages, page_size)``."""
    if split:
        vckv, vkpe = a.kv_cache, a.kpe_cache
        if vkpe is None:
            raise ValueError(
                "kv_cache must be one array or a tuple (ckv, kpe) of two arrays, got None for kpe"
            )
        if not (
            len(vckv.shape) == 3
            and vckv.shape[2] == L
            and vkpe.shape == (*vckv.shape[:2], R)
            and vkpe.dtype == vckv.dtype
        ):
            ck.check_ndim(vckv, 3, "(num_pages, page_size, L)")
            ck.check_shape(vckv, (None, None, L), "(num_pages, page_size, L)")
            ck.check_shape(vkpe, (*vckv.shape[:2], R), "(num_pages, page_size, R)")
            ck.check_same_dtype(vkpe, vckv)
        num_pages, page_size = vckv.shape[:2]
        caches = (vckv, vkpe)
    else:
        vc = a.kv_cache
        if not (len(vc.shape) == 3 and vc.shape[2] == L + R):
            ck.check_ndim(vc, 3, "(num_pages, page_size, L + R)")
            ck.check_shape(vc, (None, None, L + R), "(num_pages, page_size, L + R)")
        num_pages, page_size = vc.shape[:2]
        caches = (vc,)
    vcache = caches[0]
    if vcache.dtype != a.q_rope.dtype:
        ck.check_dtype(vcache, (a.q_rope.dtype, *FP8_DTYPES))
    if page_size == 0:
        raise ValueError(
            f"{vcache.name} must have a page_size (dim 1) of at least 1, got {vcache.shape}"
        )
    return caches, num_pages, page_size


def _host_run(a, f, c):
    """The NumPy backend's run of a host call."""
    vgiven, vstatus, voff, L, T = a.q_rope_out, a.status, a.input_row_offsets, c.L, c.T

    def host(v, outs):
        vout = vgiven if vgiven is not None else outs[0]
        if vstatus is not None:
            vstatus.host[...] = reference.ragged_offsets_status(voff.host, T)
            if vstatus.host.item():
                return
        if not T:
            return
        full = c.caches[0].host
        ckv_h, kpe_h = (
            (c.caches[0].host, c.caches[1].host) if c.split else (full[..., :L], full[..., L:])
        )
        reference.mla_rope_rmsnorm_append_paged_kv_cache(
            a.q_rope.host,
            a.kv.host,
            a.gamma.host,
            a.cos_sin_cache.host,
            voff.host,
            a.cache_lengths.host,
            a.block_table.host,
            ckv_h,
            kpe_h,
            vout.host,
            c.epsilon,
            c.n_norm,
            f.is_neox,
            1.0 if c.scale is None else c.scale,
            f.clear_unused_last_page_rows,
        )

    return host


def _choose(a, is_neox, c, plain=False):
    """``(vector width, split_heads, splits, heads per block, lean)`` of a device call; ``lean``:
    the lean kernel takes it (a plain call, ``plain``, of a shape :func:`lean_shape` accepts),
    then ``splits`` q blocks of ``heads per block`` heads each."""
    vq, vkv, vg, caches, R, L = a.q_rope, a.kv, a.gamma, c.caches, c.R, c.L
    vout = a.q_rope_out if a.q_rope_out is not None else vq  # a new output is laid out as q
    # the widest n for which the data rows (and the table's) are aligned, read once for every
    # width tried (widest_aligned)
    widest = widest_aligned((vq, vkv, vg, *caches) if vout is vq else (vq, vout, vkv, vg, *caches))
    table_widest = widest_aligned((a.cos_sin_cache,))

    def fits(n):
        rot = (R // 2) % n == 0 if is_neox else (R % n == 0 and n % 2 == 0)
        return (
            rot
            and L % n == 0
            and c.n_norm % n == 0
            and n <= widest
            and (n if is_neox else n // 2) <= table_widest
        )

    n = vector_width(vq.dtype.itemsize, fits)
    if n is None:
        raise BufferError(
            f"interleaved RoPE reads element pairs: the rows of q_rope, q_rope_out, "
            f"kv and the cache must start at even elements; got {vq}, {vout}, "
            f"{vkv}, {caches[0]}"
        )
    if (R // 2 if is_neox else R) // n > BLOCK:
        raise ValueError(
            f"rotary dim R={R} needs more than {BLOCK} threads per head row at a "
            f"vector width of {n}"
        )
    items = (R // 2 if is_neox else R) // n
    lean = lean_shape(c.T, c.Hq, items, L, n) if plain else None
    if lean is not None:
        rows, splits = lean
        return n, True, splits, rows, True
    split_heads = c.T < TUNING["split_below"]
    splits, per_block = (
        launch_shape(max(c.T, 1), c.Hq, (R // 2 if is_neox else R) // n)
        if split_heads
        else (1, c.Hq)
    )
    return n, split_heads, splits, per_block, False


def _pack(a, f, c, n, split_heads, splits, per_block, lean=False):
    """The launch of a device call: its record's values and pointer slots, and the kernel."""
    vq, vgiven, vcache, T, Hq, R = a.q_rope, a.q_rope_out, c.caches[0], c.T, c.Hq, c.R
    out_strides = (Hq * R, R) if vgiven is None else vgiven.strides[:2]
    ckv_s, kpe_s = (c.caches[0].strides, c.caches[-1].strides)
    values = {  # the fields past the pointers (every given pointer has a slot, below; status
        # is null without one)
        "q_st": vq.strides[0],
        "q_sh": vq.strides[1],
        "qo_st": out_strides[0],
        "qo_sh": out_strides[1],
        "kv_st": a.kv.strides[0],
        "cs_sp": a.cos_sin_cache.strides[0],
        "bt_sb": a.block_table.strides[0],
        "ckv_sp": ckv_s[0],
        "ckv_se": ckv_s[1],
        "kpe_sp": kpe_s[0],
        "kpe_se": kpe_s[1],
        "num_pages": c.num_pages,
        "epsilon": c.epsilon,
        "inv_kv_scale": 1.0 / c.scale if c.scale else 1.0,
        "T": T,
        "B": c.B,
        "Hq": Hq,
        "L": c.L,
        "R": R,
        "P": c.P,
        "kv_norm_dim": c.n_norm,
        "max_pages": c.max_pages,
        "page_size": c.page_size,
        "gamma_f32": int(a.gamma.dtype == FLOAT32),
        "heads_per_block": per_block,
        "clear": int(f.clear_unused_last_page_rows),
        "check": int(a.status is not None),
    }
    # pointer fields <- (argument index, byte offset); a new q output comes after the arguments
    slots = dict(_SLOTS)
    slots["kpe"] = (_KPE_CACHE, 0) if c.split else (_KV_CACHE, c.L * vcache.dtype.itemsize)
    slots["q_out"] = (_Q_ROPE_OUT, 0) if vgiven is not None else (len(_ARGS), 0)
    if a.status is not None:
        slots["status"] = (_STATUS, 0)
    # status= with no tokens: one block, which validates
    opts = f.clear_unused_last_page_rows or a.status is not None
    items = (R // 2 if f.is_neox else R) // n
    return Launch(
        STEM,
        expression(vq.dtype, vcache.dtype, f.is_neox, n, split_heads, opts, lean),
        c.device,
        (T, 1 + splits) if lean else (max(T, 1), splits),
        (items, per_block) if lean else (BLOCK,),
        PARAMS,
        values,
        slots,
        pdl=f.enable_pdl,
    )


_NAMES = (
    "q_rope",
    "kv",
    "gamma",
    "cos_sin_cache",
    "input_row_offsets",
    "cache_lengths",
    "block_table",
)
_FLAGS = [
    ("epsilon", KEY),
    ("kv_norm_dim", INT),
    ("is_neox", FLAG),
    ("kv_scale", KEY),
    ("enable_pdl", FLAG),
    ("tuning", AS_IS),
    ("clear_unused_last_page_rows", FLAG),
]
# the arguments of a call by role: the split caches (ckv_cache, kpe_cache) as kv_cache, kpe_cache
_ARGS = (*_NAMES, "kv_cache", "kpe_cache", "q_rope_out", "status")
_Views = collections.namedtuple("_Views", _ARGS)
_Flags = collections.namedtuple("_Flags", [name for name, _ in _FLAGS])
# made once (a first call copies or reads them): argument roles by name (the arguments written,
# the in-place pair, the result), and the slots of the arguments every call gives
_KV_CACHE, _KPE_CACHE, _Q_ROPE_OUT, _STATUS = ck.argument_indices(
    _ARGS, ("kv_cache", "kpe_cache", "q_rope_out", "status")
)
_RESULT = given_or_new(_Q_ROPE_OUT)
_SLOTS = {
    field: (ck.argument_indices(_ARGS, name), 0)
    for field, name in (
        ("q", "q_rope"),
        ("kv", "kv"),
        ("gamma", "gamma"),
        ("cos_sin", "cos_sin_cache"),
        ("offsets", "input_row_offsets"),
        ("cache_lengths", "cache_lengths"),
        ("block_table", "block_table"),
        ("ckv", "kv_cache"),
    )
}


# ---- the declaration (ropekv/_declare.py): the torch and JAX forms follow from it -------------


def _outputs(values):
    from ropekv import _frameworks

    return _frameworks.mla_outputs(values)


DECLARATIONS = (
    decl.Declaration(
        "mla_rope_rmsnorm_append_paged_kv_cache",
        (
            decl.array("q_rope", shape=("(T, Hq, R)",), dtypes=INPUT_DTYPES),
            decl.array("kv", shape=("(T, L + R)",), dtypes=("q_rope",)),
            decl.array("gamma", shape=("(kv_norm_dim,)",), dtypes=("q_rope", FLOAT32)),
            decl.array("cos_sin_cache", shape=("(P, R)",), dtypes=(FLOAT32,)),
            *decl.ragged_paged(),
            decl.arg(
                "kv_cache",
                decl.WRITTEN,
                "tensor_or_pair",
                parts=("kv_cache", "kpe_cache"),
                aka=("ckv_cache", "kpe_cache"),  # the split form's
                layered=True,
                shape=(
                    "(num_pages, page_size, L + R)",
                    "(num_pages, page_size, L)",
                    "(num_pages, page_size, R)",
                ),
                dtypes=("q_rope", *FP8_DTYPES),
            ),
            decl.scalar("epsilon", "float", 1e-6),
            decl.scalar("kv_norm_dim", "int", None),
            decl.scalar("is_neox", "bool", False),
            decl.scalar("kv_scale", "float", None),
            decl.out("q_rope_out", into="q_rope", shape=("(T, Hq, R)",), dtypes=("q_rope",)),
            decl.scalar("clear_unused_last_page_rows", "bool", False),
            decl.status(),
            decl.scalar("layer_idx", "int", None, check=ck.check_layer_idx),
            decl.scalar("enable_pdl", "bool", False),
        ),
        outputs=_outputs,
    ),
)
# the launch's roles, from the declaration: the arrays written when given, the pair that may be
# one array (q_rope_out = q_rope)
_WRITTEN = DECLARATIONS[0].launch_written(_ARGS)
_INPLACE = DECLARATIONS[0].launch_in_place(_ARGS)


def _op(names):
    """The op's one call path for one form of its cache (``names``: its launch arrays)."""
    layered = DECLARATIONS[0].launch_layered(names)
    return Op(DECLARATIONS[0].name, names, _prepare, layered=layered, flags=_FLAGS)


_JOINED = _op(_ARGS)
_SPLIT = _op((*_NAMES, "ckv_cache", "kpe_cache", "q_rope_out", "status"))
