"""``apply_rope_with_cos_sin_cache`` and ``apply_rope_with_cos_sin_cache_inplace`` (FlashInfer's
interface, as vLLM and SGLang call it): RoPE on Q and K from a cos/sin table, no cache."""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from ropekv import _checks as ck
from ropekv import _declare as decl
from ropekv import reference
from ropekv._arrays import BFLOAT16, FLOAT16, FLOAT32, HOST, INT32, INT64
from ropekv._compile import c_bool, c_type, name_expression
from ropekv._launch import AS_IS, FLAG, INT, Launch, Op, Output, ParamStruct, Plan
from ropekv._types import ArrayLike, StreamLike
from ropekv._vector import vector_width, widest_aligned

STEM = "qk_rope"
KERNEL = "qk_rope"
LEAN_KERNEL = "qk_rope_lean"  # one chunk of one head row per thread (the decode kernel)
INPUT_DTYPES = (FLOAT16, BFLOAT16)
INDEX_DTYPES = (INT32, INT64)
ROWS_MAX = 4  # head rows one lane group holds (kRowsMax in the kernel)
MAX_THREADS = 256  # threads per block (kMaxThreads, the kernel's __launch_bounds__)
INT32_SPAN = 2**31 - 1  # element offsets below this take the kernel's 32-bit offsets

# Launch shape. A token has H = Hq + Hk head rows, one lane group of `items` lanes per row (a
# lane per chunk of N elements). Few tokens (decode): one row per lane group, blocks of about
# `block` threads, a token's rows split over several blocks while the grid stays within
# `wave_blocks`. Many tokens (prefill): `prefill_rows` rows per lane group (the cos/sin values a
# lane loads serve all of them), several tokens per block up to `max_block` threads.
# `lean_decode` / `lean_prefill`: the lean kernel (qk_rope_lean: one chunk of one row per thread,
# 20-32 registers, the position load issued first) instead of qk_rope on the decode / prefill
# launch shapes; its decode blocks hold about `lean_block` threads (whole rows, a token's rows
# spread evenly over the blocks), its prefill blocks a token's rows (up to `max_block` threads)
# and as many tokens as fit. H200, graph replay: decode 1-256 tokens 7-22% faster than qk_rope,
# prefill 8192 tokens equal (32/8 heads) and 6% faster (8/1). `lean_decode=False,
# lean_prefill=False` is the launch of 041bfbc.
TUNING = {
    "block": 128,
    "wave_blocks": 1056,
    "prefill_rows": 4,
    "max_block": 256,
    "lean_decode": True,
    "lean_prefill": True,
    "lean_block": 128,
}

PARAMS = ParamStruct(
    "QKRopeParams",
    [
        *((n, np.uint64) for n in ("q", "k", "q_out", "k_out", "cos_sin", "positions")),
        *(
            (n, np.int64)
            for n in ("q_st", "q_sh", "k_st", "k_sh", "qo_st", "qo_sh", "ko_st", "ko_sh", "cs_sp")
        ),
        *(
            (n, np.int32)
            for n in ("T", "Hq", "Hk", "D", "R", "P", "items", "rows", "pos64", "copy")
        ),
    ],
)

# the array arguments, in the order the public functions hand them to the call path
ARRAYS = ("positions", "query", "key", "cos_sin_cache", "query_out", "key_out")


@functools.cache  # a plan's lookup spells it once per first call
def expression(dtype, is_neox, n, wide=False, lean=False):
    """The kernel instantiation: input dtype, RoPE style, vector width (elements), 64-bit
    offsets (``wide``) where an array spans 2**31 elements or more, and the lean kernel
    (``lean``) or qk_rope."""
    return name_expression(
        LEAN_KERNEL if lean else KERNEL,
        c_type(dtype),
        c_bool(is_neox),
        n,
        "long long" if wide else "int",
    )


def instantiations():
    """Every kernel instantiation a call can select (the compile tests build them all)."""
    for lean in (False, True):
        for dtype in INPUT_DTYPES:
            for is_neox in (True, False):
                for n in (8, 4, 2, 1) if is_neox else (8, 4, 2):
                    for wide in (False, True):
                        yield expression(dtype, is_neox, n, wide, lean)


def launch_shape(T, H, G):
    """``(block_x, tokens, rows, splits)`` for T tokens of H head rows at G lanes per row: blocks
    of ``(block_x, tokens)`` threads, grid ``(ceil(T / tokens), splits)``, ``rows`` rows per lane
    group."""
    cap = max(1, MAX_THREADS // G)  # lane groups a block can hold
    slots = max(1, min(H, TUNING["block"] // G, cap))
    splits = -(-H // slots)
    if T * splits <= TUNING["wave_blocks"]:  # decode: one row per lane group
        slots = -(-H // splits)  # the rows spread evenly over the splits
        return slots * G, 1, 1, splits
    rows = max(1, min(ROWS_MAX, TUNING["prefill_rows"]))
    slots = max(1, min(-(-H // rows), TUNING["max_block"] // G, cap))
    rows = min(ROWS_MAX, -(-H // slots))
    splits = -(-H // (slots * rows))
    block_x = slots * G
    tokens = max(1, min(T, min(TUNING["max_block"], MAX_THREADS) // block_x))
    return block_x, tokens, rows, splits


def lean_shape(T, H, G):
    """``(block, grid, decode)`` of the lean kernel for T tokens of H head rows at G lanes per
    row: blocks of ``(G, S, tokens)`` threads (S rows of ``tokens`` tokens), grid
    ``(ceil(T / tokens), ceil(H / S))``; ``decode``: the decode shape (one token per block),
    taken while the grid stays within ``wave_blocks``."""
    cap = max(1, MAX_THREADS // G)  # rows a block can hold
    slots = max(1, min(H, TUNING["lean_block"] // G, cap))
    splits = -(-H // slots)
    if T * splits <= TUNING["wave_blocks"]:  # decode: the rows spread evenly over the splits
        return (G, -(-H // splits), 1), (T, splits), True
    limit = min(TUNING["max_block"], MAX_THREADS)
    slots = max(1, min(H, limit // G, cap))
    splits = -(-H // slots)
    slots = -(-H // splits)
    tokens = max(1, min(T, 64, limit // (G * slots)))  # blockDim.z is at most 64
    return (G, slots, tokens), (-(-T // tokens), splits), False


def launch(T, H, G):
    """``(block, grid, rows per lane group, lean)`` of T tokens of H head rows at G lanes per
    row: the lean kernel's shape (:func:`lean_shape`) where ``TUNING`` picks it for that shape
    (``lean_decode``, ``lean_prefill``), else qk_rope's (:func:`launch_shape`)."""
    block, grid, decode = lean_shape(T, H, G)
    if TUNING["lean_decode" if decode else "lean_prefill"]:
        return block, grid, 1, True
    block_x, tokens, rows, splits = launch_shape(T, H, G)
    return (block_x, tokens), (-(-T // tokens), splits), rows, False


class _Rows(NamedTuple):
    """A data array seen as ``(T, H, D)`` rows: what ``widest_aligned`` reads."""

    ptr: int
    strides: tuple
    dtype: np.dtype


def _heads(view, head_size, layout):
    """``(H, token stride, head stride)`` of a ``(T, H * D)`` or ``(T, H, D)`` query or key;
    ValueError for any other shape."""
    shape = view.shape
    if len(shape) == 2 and shape[1] % head_size == 0 and shape[1]:
        return shape[1] // head_size, view.strides[0], head_size
    if len(shape) == 3 and shape[2] == head_size and shape[1]:
        return shape[1], view.strides[0], view.strides[1]
    raise ValueError(
        f"{view.name} must have shape {layout} with head_size={head_size} and at least one "
        f"head, got {view.shape}"
    )


def _span(T, H, D, st, sh):
    """The largest element offset from a row base that the kernel forms (strides in elements)."""
    return max(T - 1, 0) * abs(st) + max(H - 1, 0) * abs(sh) + D


class _Checked(NamedTuple):
    """What validation of a first call found: sizes and each array's (token, head) strides."""

    device: int
    T: int
    Hq: int
    Hk: int
    D: int
    P: int
    R: int
    q: tuple  # (token stride, head stride) of query, key and the two outputs' rows
    k: tuple
    qo: tuple
    ko: tuple


_LAYOUT = "(nnz, H * head_size) or (nnz, H, head_size)"
_POSITIONS, _QUERY, _KEY, _TABLE, _QUERY_OUT, _KEY_OUT = ck.argument_indices(
    ARRAYS, ("positions", "query", "key", "cos_sin_cache", "query_out", "key_out")
)


def _prepare(views, flags, in_place):
    """Validate a first call (:func:`_check`), choose the kernel and launch shape
    (:func:`_choose`) and pack the launch (:func:`_pack`); or the NumPy backend run."""
    head_size, is_neox, pdl, _ = flags
    vpos, vq, vk, vt, vqo, vko = views
    c = _check(views, head_size, in_place)
    if in_place:
        written, outputs, result = _WRITTEN_IN_PLACE, [], None
    else:
        written = _WRITTEN  # those given: Op.first_call drops the others
        outputs = [Output(v.shape, v.dtype) for v, o in ((vq, vqo), (vk, vko)) if o is None]
        result = _RESULTS[vqo is not None, vko is not None]
    plan = functools.partial(
        Plan, outputs=outputs, written=written, inplace=_INPLACE, result=result
    )
    if ck.check_indices_enabled():
        _check_indices(vpos, c.P)
    if c.device == HOST:

        def host(v, outs):
            reference.apply_rope_with_cos_sin_cache(
                vpos.host,
                vq.host,
                vk.host,
                c.D,
                vt.host,
                is_neox,
                *_host_outputs(in_place, vqo, vko, outs),
            )

        return plan(HOST, host=host if c.T else None)
    if c.T == 0:
        return plan(c.device)
    launch = _pack(views, c, is_neox, in_place, pdl, *_choose(views, c, is_neox, in_place))
    return plan(c.device, [launch])


def _check(views, head_size, in_place):
    """Every check of a first call, in the arguments' order; a :class:`_Checked`."""
    vpos, vq, vk, vt, vqo, vko = views
    D = ck.check_positive_int(head_size, "head_size")
    ck.check_ndim(vq, (2, 3), "(nnz, Hq * head_size) or (nnz, Hq, head_size)")
    ck.check_dtype(vq, INPUT_DTYPES)
    Hq, q_st, q_sh = _heads(vq, D, "(nnz, Hq * head_size) or (nnz, Hq, head_size)")
    T = vq.shape[0]
    ck.check_ndim(vk, (2, 3), "(nnz, Hk * head_size) or (nnz, Hk, head_size)")
    if vk.shape[0] != T:
        raise ValueError(f"key must have as many tokens as query (nnz={T}), got shape {vk.shape}")
    ck.check_same_dtype(vk, vq)
    Hk, k_st, k_sh = _heads(vk, D, "(nnz, Hk * head_size) or (nnz, Hk, head_size)")
    if vpos.shape != (T,) or vpos.dtype not in INDEX_DTYPES or vpos.strides != ck.UNIT_STRIDE:
        ck.check_shape(vpos, (T,), "(nnz,)")
        ck.check_dtype(vpos, INDEX_DTYPES)
        ck.check_contiguous(vpos)
    P, R = ck.check_cos_sin_cache(vt, D, (2,), "(max_seq_len, rotary_dim)")
    ck.check_last_dim_contiguous(vq, vk, vt)
    for vo, vin in ((vqo, vq), (vko, vk)):  # given outputs (out of place only)
        if vo is not None:
            ck.check_shape(vo, vin.shape)
            ck.check_same_dtype(vo, vin)
            ck.check_last_dim_contiguous(vo)
    device = ck.check_same_device(views)
    # the output rows: query and key themselves, given outputs, or new C-contiguous arrays
    # (whose allocations are aligned)
    qo = (q_st, q_sh) if in_place else (Hq * D, D) if vqo is None else _heads(vqo, D, _LAYOUT)[1:]
    ko = (k_st, k_sh) if in_place else (Hk * D, D) if vko is None else _heads(vko, D, _LAYOUT)[1:]
    return _Checked(device, T, Hq, Hk, D, P, R, (q_st, q_sh), (k_st, k_sh), qo, ko)


def _choose(views, c, is_neox, in_place):
    """``(vector width, threads per head row, launch, 64-bit offsets)`` of a device call; the
    launch is ``(block, grid, rows per lane group, lean kernel)``."""
    _, vq, vk, vt, vqo, vko = views
    item, R, D = vq.dtype, c.R, c.D
    widest = widest_aligned(
        (
            _Rows(vq.ptr, (*c.q, 1), item),
            _Rows(vk.ptr, (*c.k, 1), item),
            _Rows(0 if vqo is None else vqo.ptr, (*c.qo, 1), item),
            _Rows(0 if vko is None else vko.ptr, (*c.ko, 1), item),
        )
    )
    table_widest = widest_aligned((vt,))
    copy = not in_place

    def fits(n):
        rot = (R // 2) % n == 0 if is_neox else (R % n == 0 and n % 2 == 0)
        cos_width = n if is_neox else n // 2
        return rot and (not copy or (D - R) % n == 0) and n <= widest and cos_width <= table_widest

    n = vector_width(vq.dtype.itemsize, fits)
    if n is None:  # only interleaved RoPE can get here (neox fits at width 1)
        raise BufferError(
            f"interleaved RoPE reads element pairs: the head rows of query and key must start "
            f"at even elements; got query {vq}, key {vk}"
        )
    items = ((R // 2) // n if is_neox else R // n) + ((D - R) // n if copy else 0)
    if items > MAX_THREADS:
        raise ValueError(
            f"head_size={D} with rotary dim R={R} needs {items} threads per head row, "
            f"more than the {MAX_THREADS} a block has"
        )
    T = c.T
    spans = (
        _span(T, c.Hq, D, *c.q),
        _span(T, c.Hk, D, *c.k),
        _span(T, c.Hq, D, *c.qo),
        _span(T, c.Hk, D, *c.ko),
        _span(c.P, 1, R, vt.strides[0], 0),
    )
    wide = max(spans) > INT32_SPAN
    return n, items, launch(T, c.Hq + c.Hk, items), wide


def _pack(views, c, is_neox, in_place, pdl, n, items, shape, wide):
    """The launch of a device call: its record's values and pointer slots, and the kernel."""
    vpos, vq, _, vt, vqo, vko = views
    block, grid, rows, lean = shape
    values = {
        "q_st": c.q[0],
        "q_sh": c.q[1],
        "k_st": c.k[0],
        "k_sh": c.k[1],
        "qo_st": c.qo[0],
        "qo_sh": c.qo[1],
        "ko_st": c.ko[0],
        "ko_sh": c.ko[1],
        "cs_sp": vt.strides[0],
        "T": c.T,
        "Hq": c.Hq,
        "Hk": c.Hk,
        "D": c.D,
        "R": c.R,
        "P": c.P,
        "items": items,
        "rows": rows,
        "pos64": int(vpos.dtype == INT64),
        "copy": int(not in_place),
    }
    return Launch(
        STEM,
        expression(vq.dtype, is_neox, n, wide, lean),
        c.device,
        grid,
        block,
        PARAMS,
        values,
        _IN_PLACE_SLOTS if in_place else _OUTPUT_SLOTS[vqo is not None, vko is not None],
        pdl=pdl,
    )


def _host_outputs(in_place, vqo, vko, outs):
    """The NumPy backend's ``(query_out, key_out)``: None in place, else given or new arrays."""
    if in_place:
        return None, None
    new = iter(outs)
    return tuple((next(new) if v is None else v).host for v in (vqo, vko))


def _check_indices(vpos, P):
    """``ROPEKV_CHECK_INDICES``: IndexError for the first token whose position the kernel would
    skip."""
    pos = ck.host_copy(vpos).astype(np.int64)
    bad = np.flatnonzero((pos < 0) | (pos >= P))
    if bad.size:
        t = int(bad[0])
        raise IndexError(
            f"token {t} has position positions[{t}] = {int(pos[t])}, outside the "
            f"cos_sin_cache's [0, max_seq_len={P})"
        )


# made once, by argument name: the pointer slots of each form (the record's pointer field ->
# (argument, 0); new outputs follow the arguments), the in-place pairs, the result
_BASE_SLOTS = {
    "q": (_QUERY, 0),
    "k": (_KEY, 0),
    "cos_sin": (_TABLE, 0),
    "positions": (_POSITIONS, 0),
}
_IN_PLACE_SLOTS = {**_BASE_SLOTS, "q_out": _BASE_SLOTS["q"], "k_out": _BASE_SLOTS["k"]}


def _output_slots(q_given, k_given):
    """Given outputs are their arguments; new ones follow the arguments, in order."""
    new = len(ARRAYS)
    q = (_QUERY_OUT, 0) if q_given else (new, 0)
    k = (_KEY_OUT, 0) if k_given else (new + (not q_given), 0)
    return {**_BASE_SLOTS, "q_out": q, "k_out": k}


def _result_of(q_given, k_given):
    def result(arrays, outs):
        new = iter(outs)
        return (
            arrays[_QUERY_OUT] if q_given else next(new),
            arrays[_KEY_OUT] if k_given else next(new),
        )

    return result


_OUTPUT_SLOTS = {(q, k): _output_slots(q, k) for q in (False, True) for k in (False, True)}
_RESULTS = {(q, k): _result_of(q, k) for q in (False, True) for k in (False, True)}
_FLAGS = [("head_size", INT), ("is_neox", FLAG), ("enable_pdl", FLAG), ("tuning", AS_IS)]
_IN_PLACE = Op(
    "apply_rope_with_cos_sin_cache_inplace",
    ARRAYS,
    functools.partial(_prepare, in_place=True),
    flags=_FLAGS,
)
_OUT_OF_PLACE = Op(
    "apply_rope_with_cos_sin_cache",
    ARRAYS,
    functools.partial(_prepare, in_place=False),
    flags=_FLAGS,
)


def apply_rope_with_cos_sin_cache_inplace(
    positions: ArrayLike,
    query: ArrayLike,
    key: ArrayLike,
    head_size: int,
    cos_sin_cache: ArrayLike,
    is_neox: bool = True,
    *,
    enable_pdl: bool = False,
    stream: StreamLike | None = None,
) -> None:
    """Apply RoPE to ``query`` and ``key`` in place, each token at its position's table row.

    FlashInfer's ``apply_rope_with_cos_sin_cache_inplace`` (the rotation vLLM and SGLang call every
    step): the same arguments and results, plus ropekv's ``enable_pdl`` and ``stream``.

    Parameters
    ----------
    positions : array, (nnz,), int32 or int64
        The RoPE position of each token: the row of ``cos_sin_cache`` it is rotated by.
    query : array, (nnz, Hq * head_size) or (nnz, Hq, head_size), float16 or bfloat16
        Queries. Rows may be strided (a view of a fused QKV buffer); the last dimension must be
        contiguous.
    key : array, (nnz, Hk * head_size) or (nnz, Hk, head_size), the dtype of ``query``
        Keys, laid out as ``query`` (Hk need not divide Hq).
    head_size : int
        Dims per head: a 2-D ``query`` / ``key`` is read as ``(nnz, -1, head_size)``.
    cos_sin_cache : array, (max_seq_len, rotary_dim), float32
        ``[:rotary_dim/2]`` cos, ``[rotary_dim/2:]`` sin (see :func:`ropekv.cos_sin_cache`);
        rotary_dim is even and at most ``head_size``. Dims ``[rotary_dim, head_size)`` of every
        head pass through unrotated.
    is_neox : bool
        True rotates half-split pairs (i, i + rotary_dim/2); False interleaved pairs (2i, 2i + 1).
    enable_pdl : bool
        Launch with programmatic dependent launch (Hopper and later): the kernel may start while
        the previous kernel on the stream finishes, and waits for it before reading memory.
    stream : CuPy stream, int ``cudaStream_t`` or object with ``cuda_stream``, optional
        Stream to launch on; by default torch's current stream when an argument is a torch
        tensor, else CuPy's current stream, on the arrays' device (``docs/conventions.md``).

    Returns
    -------
    None
        ``query`` and ``key`` hold the rotated values.

    Raises
    ------
    TypeError
        ``query`` not float16 or bfloat16, ``key`` of another dtype than ``query``, ``positions``
        not int32 or int64, ``cos_sin_cache`` not float32, a non-bool flag, an argument that is
        no array, or a ``stream`` of an unknown kind.
    ValueError
        ``head_size`` not a positive integer, a ``query`` / ``key`` whose shape does not split into
        heads of ``head_size`` (or of no head), a token count that differs between ``positions``,
        ``query`` and ``key``, a ``cos_sin_cache`` that is not 2-D or whose rotary dim is odd or
        above ``head_size``, rows not contiguous in their last dimension, ``positions`` not
        contiguous, or arrays on different devices.
    BufferError
        Memory ropekv cannot address: an array not aligned to its item size, (``is_neox=False``)
        head rows starting at odd elements.
    IndexError
        Only with ``ROPEKV_CHECK_INDICES=1``: a position outside ``[0, max_seq_len)``.

    Notes
    -----
    Only the rotary dims are read and written. A token whose position falls outside
    ``[0, max_seq_len)`` is skipped: its rows keep their values, and no table row is read for it.
    ``query`` and ``key`` must not overlap each other or the other arguments (``ValueError``);
    views of one fused QKV buffer that do not share bytes are fine. NumPy inputs run the NumPy
    reference on the host, with the same in-place writes.

    Examples
    --------
    With NumPy arrays (the NumPy reference, on the host):

    >>> import numpy as np, ropekv
    >>> nnz, Hq, Hk, D = 4, 32, 8, 128
    >>> rng = np.random.default_rng(0)
    >>> query = rng.standard_normal((nnz, Hq * D)).astype(np.float16)
    >>> key = rng.standard_normal((nnz, Hk * D)).astype(np.float16)
    >>> positions = np.array([0, 1, 2, 7], np.int32)
    >>> table = ropekv.cos_sin_cache(4096, D)
    >>> before = query.copy()
    >>> ropekv.apply_rope_with_cos_sin_cache_inplace(positions, query, key, D, table)
    >>> bool((query[0] == before[0]).all()), bool((query[3] == before[3]).all())  # position 0
    (True, False)

    The same call with CuPy arrays (or torch tensors) runs the CUDA kernel (needs a GPU):

    >>> import cupy as cp  # doctest: +SKIP
    >>> q, k = cp.asarray(query), cp.asarray(key)  # doctest: +SKIP
    >>> ropekv.apply_rope_with_cos_sin_cache_inplace(  # doctest: +SKIP
    ...     cp.asarray(positions), q, k, D, cp.asarray(table))
    """
    return _IN_PLACE(
        (positions, query, key, cos_sin_cache, None, None),
        (head_size, is_neox, enable_pdl, tuple(TUNING.values())),
        stream,
    )


def apply_rope_with_cos_sin_cache(
    positions: ArrayLike,
    query: ArrayLike,
    key: ArrayLike,
    head_size: int,
    cos_sin_cache: ArrayLike,
    is_neox: bool = True,
    *,
    query_out: ArrayLike | None = None,
    key_out: ArrayLike | None = None,
    enable_pdl: bool = False,
    stream: StreamLike | None = None,
) -> tuple[ArrayLike, ArrayLike]:
    """Apply RoPE to ``query`` and ``key`` into new arrays, each token at its position's table
    row.

    FlashInfer's ``apply_rope_with_cos_sin_cache``: the same arguments and results, plus
    ropekv's ``enable_pdl`` and ``stream``.

    Parameters
    ----------
    positions : array, (nnz,), int32 or int64
        The RoPE position of each token: the row of ``cos_sin_cache`` it is rotated by.
    query : array, (nnz, Hq * head_size) or (nnz, Hq, head_size), float16 or bfloat16
        Queries. Rows may be strided (a view of a fused QKV buffer); the last dimension must be
        contiguous.
    key : array, (nnz, Hk * head_size) or (nnz, Hk, head_size), the dtype of ``query``
        Keys, laid out as ``query`` (Hk need not divide Hq).
    head_size : int
        Dims per head: a 2-D ``query`` / ``key`` is read as ``(nnz, -1, head_size)``.
    cos_sin_cache : array, (max_seq_len, rotary_dim), float32
        ``[:rotary_dim/2]`` cos, ``[rotary_dim/2:]`` sin (see :func:`ropekv.cos_sin_cache`);
        rotary_dim is even and at most ``head_size``. Dims ``[rotary_dim, head_size)`` of every
        head pass through unrotated.
    is_neox : bool
        True rotates half-split pairs (i, i + rotary_dim/2); False interleaved pairs (2i, 2i + 1).
    query_out, key_out : array, the shapes and dtype of ``query`` / ``key``, optional
        Receive the results instead of new arrays (ropekv's addition, not FlashInfer's: engines
        that capture CUDA graphs pass preallocated buffers). Rows may be strided; the last
        dimension must be contiguous. ``query_out`` may be ``query`` itself (in place); it must
        not overlap any other argument. Every element is written.
    enable_pdl : bool
        Launch with programmatic dependent launch (Hopper and later): the kernel may start while
        the previous kernel on the stream finishes, and waits for it before reading memory.
    stream : CuPy stream, int ``cudaStream_t`` or object with ``cuda_stream``, optional
        Stream to launch on; by default torch's current stream when an argument is a torch
        tensor, else CuPy's current stream, on the arrays' device (``docs/conventions.md``).

    Returns
    -------
    (query_out, key_out) : (array, array)
        The given outputs, or new arrays of the shapes and dtype of ``query`` and ``key``
        (C-contiguous, of the kind of the inputs: torch tensors when an argument is a torch
        tensor, else CuPy arrays, or NumPy arrays on the host), holding the rotated values and the
        pass-through dims.

    Raises
    ------
    TypeError
        ``query`` not float16 or bfloat16, ``key`` of another dtype than ``query``, ``positions``
        not int32 or int64, ``cos_sin_cache`` not float32, a non-bool flag, an argument that is
        no array, or a ``stream`` of an unknown kind.
    ValueError
        ``head_size`` not a positive integer, a ``query`` / ``key`` whose shape does not split into
        heads of ``head_size`` (or of no head), a token count that differs between ``positions``,
        ``query`` and ``key``, a ``cos_sin_cache`` that is not 2-D or whose rotary dim is odd or
        above ``head_size``, rows not contiguous in their last dimension, ``positions`` not
        contiguous, arrays on different devices, a given output of another shape than its input,
        or one that overlaps another argument (other than ``query_out is query``, ``key_out is
        key``).
    BufferError
        Memory ropekv cannot address: an array not aligned to its item size, (``is_neox=False``)
        head rows starting at odd elements.
    IndexError
        Only with ``ROPEKV_CHECK_INDICES=1``: a position outside ``[0, max_seq_len)``.

    Notes
    -----
    A token whose position falls outside ``[0, max_seq_len)`` is not rotated: its rows are copied
    as they came, and no table row is read for it. ``query`` and ``key`` are only read.

    Examples
    --------
    With NumPy arrays (the NumPy reference, on the host); a partial rotary dim of 64:

    >>> import numpy as np, ropekv
    >>> nnz, Hq, Hk, D = 4, 8, 1, 128
    >>> rng = np.random.default_rng(0)
    >>> query = rng.standard_normal((nnz, Hq, D)).astype(np.float16)
    >>> key = rng.standard_normal((nnz, Hk, D)).astype(np.float16)
    >>> positions = np.arange(nnz)
    >>> q_out, k_out = ropekv.apply_rope_with_cos_sin_cache(
    ...     positions, query, key, D, ropekv.cos_sin_cache(4096, 64), is_neox=False)
    >>> q_out.shape, bool((q_out[..., 64:] == query[..., 64:]).all())
    ((4, 8, 128), True)
    """
    return _OUT_OF_PLACE(
        (positions, query, key, cos_sin_cache, query_out, key_out),
        (head_size, is_neox, enable_pdl, tuple(TUNING.values())),
        stream,
    )


# ---- the declarations (ropekv/_declare.py): the torch and JAX forms follow from them ----------


def _outputs(values):
    """The output rule: ``query_out`` and ``key_out`` are shaped and typed like their inputs."""
    return {
        "query_out": (values["query"].shape, values["query"].dtype),
        "key_out": (values["key"].shape, values["key"].dtype),
    }


_QUERY = ("(nnz, Hq * head_size)", "(nnz, Hq, head_size)")
_KEY = ("(nnz, Hk * head_size)", "(nnz, Hk, head_size)")
_FLASHINFER_ARGS = (
    decl.array("positions", shape=("(nnz,)",), dtypes=INDEX_DTYPES),
    decl.array("query", shape=_QUERY, dtypes=INPUT_DTYPES),
    decl.array("key", shape=_KEY, dtypes=("query",)),
    decl.scalar("head_size", "int"),
    decl.array("cos_sin_cache", shape=("(max_seq_len, rotary_dim)",), dtypes=(FLOAT32,)),
    decl.scalar("is_neox", "bool", True),
)
DECLARATIONS = (
    decl.Declaration(
        "apply_rope_with_cos_sin_cache_inplace",
        (
            *(
                a._replace(role=decl.WRITTEN) if a.name in ("query", "key") else a
                for a in _FLASHINFER_ARGS
            ),
            decl.scalar("enable_pdl", "bool", False),
        ),
    ),
    decl.Declaration(
        "apply_rope_with_cos_sin_cache",
        (
            *_FLASHINFER_ARGS,
            decl.out("query_out", into="query", shape=_QUERY, dtypes=("query",)),
            decl.out("key_out", into="key", shape=_KEY, dtypes=("query",)),
            decl.scalar("enable_pdl", "bool", False),
        ),
        outputs=_outputs,
    ),
)
# the launch's roles, from the declarations: the arrays each writes (the _inplace op query and
# key; the other its outputs, when given), the pairs that may be one array (query_out = query,
# key_out = key)
_WRITTEN_IN_PLACE = DECLARATIONS[0].launch_written(ARRAYS)
_WRITTEN = DECLARATIONS[1].launch_written(ARRAYS)
_INPLACE = DECLARATIONS[1].launch_in_place(ARRAYS)
