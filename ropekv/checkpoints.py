"""Quantized checkpoints (GPTQ, AWQ, compressed-tensors) repacked once, at load time, into the
weight arguments of :func:`ropekv.fused_qkv_matmul_append_paged_kv_cache`.

The op takes 4-bit weights as ``weight (N, K/2) uint8`` (two values a byte, see
:func:`ropekv.pack_int4`), ``weight_scales (N, K/group_size)`` in the input dtype and optional
``zero_points (N, K/group_size) uint8`` (one 4-bit zero a row and group; 8 when None), and fp8
weights as ``weight (N, K) float8_e4m3fn`` with ``weight_scales (N,) float32``. Checkpoints store
the transposed, int32-packed layouts of the quantizers vLLM and SGLang load:

* GPTQ (AutoGPTQ / GPTQModel): ``qweight (K/8, N) int32`` packed along K, eight nibbles a word,
  the lowest first; ``qzeros (K/g, N/8) int32`` packed along N the same way; ``scales (K/g, N)``;
  ``w = (q - z) * s``. The ``"gptq"`` (v1) checkpoint format stores ``z - 1`` (AutoGPTQ's
  historic convention: a symmetric checkpoint stores 7), ``"gptq_v2"`` stores ``z``.
* AWQ (AutoAWQ's GEMM format): ``qweight (K, N/8) int32`` packed along N with nibble i of a word
  holding column ``8c + [0, 2, 4, 6, 1, 3, 5, 7][i]``; ``qzeros (K/g, N/8)`` the same way;
  ``scales (K/g, N)``; ``w = (q - z) * s``.
* compressed-tensors ``pack-quantized`` int4: ``weight_packed (N, K/8) int32`` packed along K,
  the lowest nibble first, each value stored plus 8 (``q + 8`` for q in [-8, 7]);
  ``weight_scale (N, K/g)``; asymmetric: ``weight_zero_point`` packed along N, ``(N/8, K/g)
  int32`` (stored plus 8 too); ``w = (q - zp) * s``.
* compressed-tensors ``float-quantized`` fp8: ``weight (N, K) float8_e4m3fn`` with
  ``weight_scale (N, 1)`` (per channel) or one value (per tensor); ``w = fp8 * s``.

Every function returns a :class:`QkvWeights` whose dequantized weights (``(q - zero) * scale`` in
ropekv's layout) equal the format's own ``w`` exactly (4-bit scales converted to another dtype
are rounded to it once). Arrays are NumPy, CuPy or torch (CPU or CUDA); the results are of the
kind of the first array, on its device (device arrays are repacked there, by CuPy).
"""

from __future__ import annotations

import contextlib
import sys
from typing import NamedTuple

import numpy as np

from ropekv._arrays import BFLOAT16, FLOAT8_E4M3FN, FLOAT16, FLOAT32, INT32, UINT8, UINT32
from ropekv._types import ArrayLike, DTypeLike

UINT16 = np.dtype(np.uint16)
INT8 = np.dtype(np.int8)
GPTQ_FORMATS = ("gptq", "gptq_v2")
# Nibble i (bits 4i..4i+3) of an AWQ word holds column 8c + AWQ_ORDER[i] ...
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# ... so column 8c + j is nibble _AWQ_NIBBLE[j] of word c.
_AWQ_NIBBLE = tuple(AWQ_ORDER.index(j) for j in range(8))
SCALE_DTYPES = (FLOAT16, BFLOAT16)  # 4-bit scales: the op's input dtypes
_FLOATS = (FLOAT16, BFLOAT16, FLOAT32)  # scales a checkpoint may store
_WORDS = (INT32, UINT32)
# dtypes NumPy / CuPy hold only through ml_dtypes: moved to and from torch as bits
_BITS = {BFLOAT16: np.dtype(np.int16), FLOAT8_E4M3FN: UINT8}
_TORCH_BITS = {"bfloat16": BFLOAT16, "float8_e4m3fn": FLOAT8_E4M3FN}


class QkvWeights(NamedTuple):
    """The weight arguments of :func:`ropekv.fused_qkv_matmul_append_paged_kv_cache`, in
    ropekv's layout.

    Parameters
    ----------
    weight : array
        ``(N, K/2) uint8`` packed 4-bit values (:func:`ropekv.pack_int4`'s layout), or ``(N, K)
        float8_e4m3fn``.
    weight_scales : array
        ``(N, K/group_size)`` in the input dtype (4-bit), or ``(N,) float32`` (fp8).
    group_size : int or None
        Columns a 4-bit scale covers; None for fp8 weights.
    zero_points : array or None
        ``(N, K/group_size) uint8`` 4-bit zero points; None where every zero is 8 (symmetric) and
        for fp8 weights.

    Examples
    --------
    >>> import numpy as np, ropekv
    >>> w = ropekv.import_float_quantized(
    ...     np.ones((4, 8), "float8_e4m3fn"), np.array([0.5], np.float32))
    >>> w.kwargs()["weight_scales"]
    array([0.5, 0.5, 0.5, 0.5], dtype=float32)
    """

    weight: ArrayLike
    weight_scales: ArrayLike
    group_size: int | None = None
    zero_points: ArrayLike | None = None

    def kwargs(self) -> dict:
        """The keyword arguments of the op besides ``weight``.

        Returns
        -------
        dict
            ``weight_scales``, ``group_size`` and ``zero_points``, to pass as ``**w.kwargs()``.

        Examples
        --------
        >>> import numpy as np, ropekv
        >>> w = ropekv.import_float_quantized(
        ...     np.ones((2, 8), "float8_e4m3fn"), np.array([[1.0], [2.0]], np.float32))
        >>> sorted(w.kwargs())
        ['group_size', 'weight_scales', 'zero_points']
        """
        return {
            "weight_scales": self.weight_scales,
            "group_size": self.group_size,
            "zero_points": self.zero_points,
        }


# ---------------------------------------------------------------------------- arrays in and out


class _Array(NamedTuple):
    data: object  # a NumPy or CuPy array (bfloat16 / float8 as ml_dtypes dtypes)
    kind: str  # "numpy", "cupy" or "torch"
    device: int  # -1: host memory, else the CUDA device


def _type_name(a):
    return f"{type(a).__module__}.{type(a).__qualname__}"


def _read(a, name):
    """``a`` (NumPy, CuPy, torch) as a NumPy array (host) or a CuPy array (CUDA), zero-copy."""
    if isinstance(a, np.ndarray):
        return _Array(a, "numpy", -1)
    if type(a).__module__.startswith("cupy") and hasattr(a, "device"):
        return _Array(a, "cupy", a.device.id)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(a, torch.Tensor):
        t = a.detach()
        if t.is_conj() or t.is_neg():
            t = t.resolve_conj().resolve_neg()
        logical = _TORCH_BITS.get(str(t.dtype).removeprefix("torch."))
        if logical is not None:  # NumPy / CuPy cannot import these: their bits, viewed back
            t = t.view(torch.int16 if logical.itemsize == 2 else torch.uint8)
        if t.device.type == "cpu":
            try:
                data = t.numpy()
            except TypeError:
                raise TypeError(f"{name} has torch dtype {a.dtype}, which ropekv does not read")
            device = -1
        elif t.is_cuda:
            import cupy

            data, device = cupy.from_dlpack(t), t.get_device()
        else:
            raise ValueError(f"{name} is on torch device {t.device}; pass a CPU or CUDA tensor")
        return _Array(data if logical is None else data.view(logical), "torch", device)
    raise TypeError(f"{name} must be a NumPy or CuPy array or a torch tensor, got {_type_name(a)}")


def _read_all(named):
    """``{name: _Array}`` of the given (not None) arrays, all on one device."""
    arrays = {name: _read(a, name) for name, a in named.items() if a is not None}
    devices = {arr.device for arr in arrays.values()}
    if len(devices) > 1:
        where = ", ".join(
            f"{n} on {'the host' if a.device < 0 else f'CUDA device {a.device}'}"
            for n, a in arrays.items()
        )
        raise ValueError(f"the arrays must be on one device, got {where}")
    return arrays


def _xp(device):
    if device < 0:
        return np
    import cupy

    return cupy


def _on(device):
    """The CuPy device context of ``device`` (nothing for the host)."""
    if device < 0:
        return contextlib.nullcontext()
    import cupy

    return cupy.cuda.Device(device)


def _write(data, like):
    """``data`` (NumPy / CuPy) in the kind of ``like`` (a torch tensor for torch inputs)."""
    if data is None or like.kind != "torch":
        return data
    import torch

    bits = _BITS.get(data.dtype)
    src = data if bits is None else data.view(bits)
    t = torch.from_numpy(src) if like.device < 0 else torch.from_dlpack(src)
    return t if bits is None else t.view(getattr(torch, str(data.dtype)))


def _host(arr):
    """A NumPy copy (or the array itself) of an ``_Array``."""
    return arr.data if arr.device < 0 else arr.data.get()


def _check_dtype(arr, name, allowed):
    if arr.data.dtype not in allowed:
        names = " or ".join(str(d) for d in allowed)
        raise TypeError(f"{name} must have dtype {names}, got {arr.data.dtype}")


def _check_ndim(arr, name, layout):
    if arr.data.ndim != 2:
        raise ValueError(f"{name} must have shape {layout}, got {tuple(arr.data.shape)}")


def _check_shape(arr, name, shape, layout):
    if tuple(arr.data.shape) != shape:
        raise ValueError(f"{name} must have shape {layout} = {shape}, got {tuple(arr.data.shape)}")


def _as_dtype(value):
    """A NumPy dtype from a dtype, its name or a torch dtype (``dtype=``)."""
    if isinstance(value, str) or type(value).__module__ == "torch":
        value = str(value).removeprefix("torch.")
    try:
        dtype = np.dtype(value)
    except TypeError:
        dtype = None
    if dtype is None or dtype not in SCALE_DTYPES:
        raise TypeError(f"dtype must be float16 or bfloat16 (the input dtype), got {value!r}")
    return dtype


# ---------------------------------------------------------------------------- bit layouts


def _le_bytes(words, xp):
    """int32 words ``(..., C)`` as their little-endian bytes ``(..., 4C)`` uint8 (C-contiguous):
    byte 4c + m holds nibbles 2m (low) and 2m + 1 (high) of word c."""
    w = xp.ascontiguousarray(words)
    if xp is np:
        w = w.astype(w.dtype.newbyteorder("<"), copy=False)
    return w.view(UINT8)


def _nibbles(words, xp):
    """int32 words ``(R, C)`` unpacked: ``(R, 8C)`` uint8, element 8c + j nibble j of word c."""
    b = _le_bytes(words, xp)
    out = xp.empty((b.shape[0], 2 * b.shape[1]), UINT8)
    out[:, 0::2] = b & 0xF
    out[:, 1::2] = b >> 4
    return out


def _awq_columns(nibbles, xp):
    """AWQ-packed nibbles ``(R, 8C)`` (:func:`_nibbles`) in column order."""
    R, C8 = nibbles.shape
    order = xp.asarray(np.array(_AWQ_NIBBLE, np.int64))
    return xp.take(nibbles.reshape(R, C8 // 8, 8), order, axis=2).reshape(R, C8)


def _pack_pairs(q, xp):
    """4-bit values ``(N, K)`` uint8 in ropekv's layout ``(N, K/2)`` (:func:`ropekv.pack_int4`)."""
    q = xp.ascontiguousarray(q)
    return xp.ascontiguousarray(q[:, 0::2] | (q[:, 1::2] << 4))


def _float32(s, xp):
    """float16 / bfloat16 / float32 scales as float32 (exact)."""
    if s.dtype == BFLOAT16:
        return (xp.ascontiguousarray(s.view(UINT16)).astype(UINT32) << 16).view(FLOAT32)
    return s.astype(FLOAT32)


def _round_scales(s, dtype, xp):
    """Scales (any of _FLOATS) in ``dtype`` (float16 / bfloat16 / float32), rounded to nearest
    even once (bfloat16 from its bits, as ml_dtypes rounds; CuPy has no bfloat16 arithmetic)."""
    if s.dtype == dtype and dtype != BFLOAT16:
        return xp.ascontiguousarray(s).astype(dtype)  # a copy
    if s.dtype == dtype:
        return xp.ascontiguousarray(s.view(UINT16)).copy().view(BFLOAT16)
    f = xp.ascontiguousarray(_float32(s, xp))
    if dtype != BFLOAT16:
        return f.astype(dtype)
    u = f.view(UINT32)
    rounded = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
    bits = xp.where(xp.isnan(f), (u >> 16) | 0x40, rounded).astype(UINT16)
    return bits.view(BFLOAT16)


def _group_size(K, groups, group_size, what):
    """The group size of ``groups`` scale groups over K columns, checked against ``group_size``
    (None: not given; -1: one group, GPTQ's per-channel spelling)."""
    if group_size is not None:
        if isinstance(group_size, bool) or not isinstance(group_size, int | np.integer):
            raise ValueError(f"group_size must be a positive integer or -1, got {group_size!r}")
        G = K if group_size == -1 else int(group_size)
        if G <= 0:
            raise ValueError(f"group_size must be a positive integer or -1, got {group_size!r}")
        if K % G:
            raise ValueError(f"group_size must divide K={K}, got {G}")
        if groups != K // G:
            raise ValueError(
                f"{what} has {groups} groups of columns, but K={K} in groups of {G} needs {K // G}"
            )
    else:
        if groups <= 0 or K % groups:
            raise ValueError(f"{what}'s {groups} groups must divide K={K} evenly")
        G = K // groups
    if G % 2:
        raise ValueError(f"4-bit weights need an even group_size, got {G} (K={K})")
    return G


def _check_g_idx(g_idx, K, G):
    """Refuse act-order: ``g_idx`` must be ``arange(K) // G``."""
    if g_idx is None:
        return
    g = np.asarray(_host(g_idx)).reshape(-1)
    if g.dtype.kind not in "iu":
        raise TypeError(f"g_idx must have an integer dtype, got {g.dtype}")
    if g.shape != (K,):
        raise ValueError(f"g_idx must have shape (K,) = ({K},), got {tuple(g.shape)}")
    if not np.array_equal(g, np.arange(K) // G):
        raise ValueError(
            "act-order (desc_act) checkpoints are not supported: g_idx is not arange(K) // "
            f"group_size (group_size {G}); ropekv's 4-bit weights take contiguous groups"
        )


def _int4(weight, scales_kn, zeros_kn, G, dtype, like, xp, transposed=True):
    """The QkvWeights of ropekv-packed ``weight``, scales and zeros ``(groups, N)`` (``transposed``;
    else ``(N, groups)``); zero points None where every zero is 8."""
    if transposed:
        scales_kn = scales_kn.T
        zeros_kn = None if zeros_kn is None else zeros_kn.T
    scales = _round_scales(scales_kn, dtype, xp)
    zeros = None
    if zeros_kn is not None and not bool((zeros_kn == 8).all()):
        zeros = xp.ascontiguousarray(zeros_kn).astype(UINT8)
    return QkvWeights(_write(weight, like), _write(scales, like), G, _write(zeros, like))


# ---------------------------------------------------------------------------- the formats


def import_gptq(
    qweight: ArrayLike,
    qzeros: ArrayLike | None,
    scales: ArrayLike,
    *,
    g_idx: ArrayLike | None = None,
    group_size: int | None = None,
    desc_act: bool = False,
    checkpoint_format: str = "gptq",
    dtype: DTypeLike | None = None,
) -> QkvWeights:
    """Repack a 4-bit GPTQ linear layer (AutoGPTQ / GPTQModel, as vLLM loads it) for
    :func:`ropekv.fused_qkv_matmul_append_paged_kv_cache`.

    The layer's weight ``W (N, K)`` is ``W[n, k] = (q[k, n] - z[k // g, n]) * scales[k // g,
    n]``; q is nibble ``k % 8`` (bits ``4 (k % 8)`` up) of ``qweight[k // 8, n]`` and the stored
    zero nibble ``n % 8`` of ``qzeros[k // g, n // 8]``. ``checkpoint_format="gptq"`` (v1, what
    AutoGPTQ and GPTQModel write unless told otherwise) stores ``z - 1``: the zero is ``(stored +
    1) & 15``, as AutoGPTQ's own dequantization reads it (a symmetric checkpoint stores 7, zero
    8); ``"gptq_v2"`` stores ``z`` itself. Act-order checkpoints (``desc_act=True``, a ``g_idx``
    other than ``arange(K) // g``) are refused.

    Parameters
    ----------
    qweight : array, (K/8, N), int32
        Eight 4-bit values a word along K, the lowest nibble first.
    qzeros : array, (K/g, N/8), int32, or None
        Eight zero points a word along N. None: symmetric, every zero 8.
    scales : array, (K/g, N), float16, bfloat16 or float32
        One scale a group of g columns of K and a row of N.
    g_idx : array, (K,), integer, optional
        The group of each k; must be ``arange(K) // g`` (no act-order).
    group_size : int, optional
        g (``-1``: one group over K). By default read from the shapes (``K / scales.shape[0]``).
    desc_act : bool
        The checkpoint's ``desc_act``; True (act-order) is refused.
    checkpoint_format : {"gptq", "gptq_v2"}
        How zeros are stored (see above): the ``checkpoint_format`` of GPTQModel's
        ``quantize_config.json``; AutoGPTQ checkpoints are ``"gptq"``.
    dtype : dtype, optional
        The input dtype of the calls (float16 or bfloat16): the scales are stored in it, rounded
        to nearest even where they are of another dtype. By default the dtype of ``scales``.

    Returns
    -------
    QkvWeights
        ``weight (N, K/2) uint8``, ``weight_scales (N, K/g)`` in ``dtype``, ``group_size`` g and
        ``zero_points (N, K/g) uint8`` (None when every zero is 8), of the kind of ``qweight``
        (NumPy, CuPy or torch) on its device.

    Raises
    ------
    TypeError
        ``qweight`` or ``qzeros`` not int32 (or uint32), ``scales`` not float16 / bfloat16 /
        float32, float32 scales without ``dtype``, a ``dtype`` other than float16 / bfloat16, an
        array neither NumPy, CuPy nor torch.
    ValueError
        Act-order (``desc_act=True`` or a permuted ``g_idx``), shapes that disagree, a
        ``group_size`` that does not divide K or is odd, an unknown ``checkpoint_format``, arrays
        on different devices.

    Examples
    --------
    A symmetric v1 checkpoint of K = 64, N = 16 and groups of 32 (column n holds q[k] = k % 8):

    >>> import numpy as np, ropekv
    >>> K, N, g = 64, 16, 32
    >>> qweight = np.full((K // 8, N), 0x76543210, np.int32)
    >>> qzeros = np.full((K // g, N // 8), 0x77777777, np.int32)  # 7 + 1 = 8
    >>> scales = np.full((K // g, N), 0.01, np.float16)
    >>> w = ropekv.import_gptq(qweight, qzeros, scales)
    >>> w.weight.shape, w.group_size, w.zero_points
    ((16, 32), 32, None)
    >>> w.weight[0, :4]                  # k = 0 and 1 in byte 0, low nibble first
    array([ 16,  50,  84, 118], dtype=uint8)
    """
    if desc_act:
        raise ValueError(
            "act-order (desc_act=True) checkpoints are not supported: ropekv's 4-bit weights "
            "take contiguous groups of K"
        )
    if checkpoint_format not in GPTQ_FORMATS:
        raise ValueError(
            f"checkpoint_format must be one of {', '.join(map(repr, GPTQ_FORMATS))}, "
            f"got {checkpoint_format!r}"
        )
    arrays = _read_all({"qweight": qweight, "qzeros": qzeros, "scales": scales})
    g_arr = None if g_idx is None else _read(g_idx, "g_idx")
    vw, vz, vs = arrays["qweight"], arrays.get("qzeros"), arrays["scales"]
    _check_dtype(vw, "qweight", _WORDS)
    _check_ndim(vw, "qweight", "(K/8, N)")
    _check_dtype(vs, "scales", _FLOATS)
    _check_ndim(vs, "scales", "(K/g, N)")
    if vz is not None:
        _check_dtype(vz, "qzeros", _WORDS)
    target = _target_dtype(dtype, vs, "scales")
    K, N = 8 * vw.data.shape[0], vw.data.shape[1]
    groups = vs.data.shape[0]
    _check_shape(vs, "scales", (groups, N), "(K/g, N)")
    G = _group_size(K, groups, group_size, "scales")
    if vz is not None:
        if N % 8:
            raise ValueError(f"qzeros packs N in words of 8: N={N} must be a multiple of 8")
        _check_shape(vz, "qzeros", (groups, N // 8), "(K/g, N/8)")
    _check_g_idx(g_arr, K, G)
    xp = _xp(vw.device)
    with _on(vw.device):
        weight = _le_bytes(vw.data.T, xp)  # (N, K/2): byte 4i + m of row n is byte m of [i, n]
        zeros = None
        if vz is not None:
            zeros = _nibbles(vz.data, xp)
            if checkpoint_format == "gptq":
                zeros = (zeros + 1) & 0xF
        return _int4(weight, vs.data, zeros, G, target, vw, xp)


def _target_dtype(dtype, scales, name):
    if dtype is not None:
        return _as_dtype(dtype)
    if scales.data.dtype in SCALE_DTYPES:
        return scales.data.dtype
    raise TypeError(
        f"{name} has dtype {scales.data.dtype}: pass dtype= (float16 or bfloat16, the input "
        f"dtype of the calls), which the 4-bit scales are rounded to"
    )


def import_awq(
    qweight: ArrayLike,
    qzeros: ArrayLike,
    scales: ArrayLike,
    *,
    group_size: int | None = None,
    dtype: DTypeLike | None = None,
) -> QkvWeights:
    """Repack a 4-bit AWQ linear layer (AutoAWQ's GEMM format, as vLLM loads it) for
    :func:`ropekv.fused_qkv_matmul_append_paged_kv_cache`.

    The layer's weight ``W (N, K)`` is ``W[n, k] = (q[k, n] - z[k // g, n]) * scales[k // g,
    n]``; q is nibble i (bits ``4i`` up) of ``qweight[k, n // 8]`` where ``[0, 2, 4, 6, 1, 3, 5,
    7][i] == n % 8`` (AWQ's interleaved order), and z likewise in ``qzeros[k // g, n // 8]``.

    Parameters
    ----------
    qweight : array, (K, N/8), int32
        Eight 4-bit values a word along N, interleaved.
    qzeros : array, (K/g, N/8), int32
        Eight zero points a word along N, interleaved.
    scales : array, (K/g, N), float16, bfloat16 or float32
        One scale a group of g columns of K and a row of N.
    group_size : int, optional
        g; by default read from the shapes (``K / scales.shape[0]``).
    dtype : dtype, optional
        The input dtype of the calls (float16 or bfloat16): the scales are stored in it, rounded
        to nearest even where they are of another dtype. By default the dtype of ``scales``.

    Returns
    -------
    QkvWeights
        ``weight (N, K/2) uint8``, ``weight_scales (N, K/g)`` in ``dtype``, ``group_size`` g and
        ``zero_points (N, K/g) uint8`` (None when every zero is 8), of the kind of ``qweight``
        (NumPy, CuPy or torch) on its device.

    Raises
    ------
    TypeError
        ``qweight`` or ``qzeros`` not int32 (or uint32), ``scales`` not float16 / bfloat16 /
        float32, float32 scales without ``dtype``, a ``dtype`` other than float16 / bfloat16, an
        array neither NumPy, CuPy nor torch.
    ValueError
        Shapes that disagree, a ``group_size`` that does not divide K or is odd, arrays on
        different devices.

    Examples
    --------
    K = 64, N = 8 and groups of 32; row k of the weight words holds columns 0-7 with values
    q = 0, 1, ..., 7, stored interleaved (nibbles 0, 2, 4, 6, 1, 3, 5, 7), zero 3:

    >>> import numpy as np, ropekv
    >>> K, N, g = 64, 8, 32
    >>> qweight = np.full((K, N // 8), 0x75316420, np.int32)
    >>> qzeros = np.full((K // g, N // 8), 0x33333333, np.int32)
    >>> scales = np.full((K // g, N), 0.5, np.float16)
    >>> w = ropekv.import_awq(qweight, qzeros, scales)
    >>> w.weight[:, 0]                   # column n holds n at every k: byte 0 = n | n << 4
    array([  0,  17,  34,  51,  68,  85, 102, 119], dtype=uint8)
    >>> w.zero_points[:, 0]
    array([3, 3, 3, 3, 3, 3, 3, 3], dtype=uint8)
    """
    arrays = _read_all({"qweight": qweight, "qzeros": qzeros, "scales": scales})
    vw, vz, vs = arrays["qweight"], arrays["qzeros"], arrays["scales"]
    _check_dtype(vw, "qweight", _WORDS)
    _check_ndim(vw, "qweight", "(K, N/8)")
    _check_dtype(vz, "qzeros", _WORDS)
    _check_dtype(vs, "scales", _FLOATS)
    _check_ndim(vs, "scales", "(K/g, N)")
    target = _target_dtype(dtype, vs, "scales")
    K, N = vw.data.shape[0], 8 * vw.data.shape[1]
    groups = vs.data.shape[0]
    _check_shape(vs, "scales", (groups, N), "(K/g, N)")
    _check_shape(vz, "qzeros", (groups, N // 8), "(K/g, N/8)")
    G = _group_size(K, groups, group_size, "scales")
    xp = _xp(vw.device)
    with _on(vw.device):
        q = _awq_columns(_nibbles(vw.data, xp), xp)  # (K, N)
        weight = _pack_pairs(q.T, xp)
        zeros = _awq_columns(_nibbles(vz.data, xp), xp)
        return _int4(weight, vs.data, zeros, G, target, vw, xp)


def import_pack_quantized(
    weight_packed: ArrayLike,
    weight_scale: ArrayLike,
    weight_shape: ArrayLike | tuple[int, int] | None = None,
    weight_zero_point: ArrayLike | None = None,
    *,
    weight_g_idx: ArrayLike | None = None,
    group_size: int | None = None,
    dtype: DTypeLike | None = None,
) -> QkvWeights:
    """Repack a compressed-tensors ``pack-quantized`` 4-bit linear layer (group or channel
    strategy, symmetric or asymmetric; llm-compressor's W4A16) for
    :func:`ropekv.fused_qkv_matmul_append_paged_kv_cache`.

    The layer's weight ``W (N, K)`` is ``W[n, k] = (q[n, k] - zp[n, k // g]) * weight_scale[n, k
    // g]`` with q in [-8, 7] stored as ``q + 8`` in nibble ``k % 8`` of ``weight_packed[n, k //
    8]`` (compressed-tensors' ``pack_to_int32``), and zp (0 when symmetric) in [-8, 7] stored as
    ``zp + 8`` in nibble ``n % 8`` of ``weight_zero_point[n // 8, k // g]``.

    Parameters
    ----------
    weight_packed : array, (N, ceil(K/8)), int32
        Eight 4-bit values a word along K, the lowest nibble first.
    weight_scale : array, (N, K/g), float16, bfloat16 or float32
        ``(N, 1)`` for the channel strategy (one group over K).
    weight_shape : array or tuple, (2,), optional
        ``(N, K)``; by default ``(weight_packed.shape[0], 8 * weight_packed.shape[1])``.
    weight_zero_point : array, optional
        Asymmetric schemes: ``(ceil(N/8), K/g) int32`` packed along N as the compressor writes
        it, or ``(N, K/g) int8`` unpacked values in [-8, 7]. None: symmetric.
    weight_g_idx : array, (K,), integer, optional
        The ``actorder="group"`` index; must be ``arange(K) // g`` (no act-order).
    group_size : int, optional
        g; by default read from the shapes (``K / weight_scale.shape[1]``).
    dtype : dtype, optional
        The input dtype of the calls (float16 or bfloat16): the scales are stored in it, rounded
        to nearest even where they are of another dtype. By default the dtype of
        ``weight_scale``.

    Returns
    -------
    QkvWeights
        ``weight (N, K/2) uint8``, ``weight_scales (N, K/g)`` in ``dtype``, ``group_size`` g and
        ``zero_points (N, K/g) uint8`` (None when every zero point is 0, stored 8), of the kind
        of ``weight_packed`` (NumPy, CuPy or torch) on its device.

    Raises
    ------
    TypeError
        ``weight_packed`` not int32, ``weight_zero_point`` neither int32 (packed) nor int8,
        ``weight_scale`` not float16 / bfloat16 / float32, float32 scales without ``dtype``, a
        ``dtype`` other than float16 / bfloat16, an array neither NumPy, CuPy nor torch.
    ValueError
        Act-order (a permuted ``weight_g_idx``), shapes that disagree, an odd K, a group size
        that does not divide K or is odd, unpacked zero points outside [-8, 7], arrays on
        different devices.

    Examples
    --------
    N = 2, K = 16 in one group (channel strategy), q = -8, -7, ..., 7 in both rows:

    >>> import numpy as np, ropekv
    >>> packed = np.array([[0x76543210, -0x01234568]] * 2, np.int32)  # q + 8 = 0, 1, ..., 15
    >>> w = ropekv.import_pack_quantized(packed, np.full((2, 1), 0.25, np.float16), (2, 16))
    >>> w.weight[0]
    array([ 16,  50,  84, 118, 152, 186, 220, 254], dtype=uint8)
    >>> w.group_size, w.zero_points
    (16, None)
    """
    arrays = _read_all(
        {"weight_packed": weight_packed, "weight_scale": weight_scale, "zp": weight_zero_point}
    )
    vw, vs, vz = arrays["weight_packed"], arrays["weight_scale"], arrays.get("zp")
    g_arr = None if weight_g_idx is None else _read(weight_g_idx, "weight_g_idx")
    _check_dtype(vw, "weight_packed", (INT32,))
    _check_ndim(vw, "weight_packed", "(N, K/8)")
    _check_dtype(vs, "weight_scale", _FLOATS)
    _check_ndim(vs, "weight_scale", "(N, K/g)")
    target = _target_dtype(dtype, vs, "weight_scale")
    if weight_shape is None:
        N, K = vw.data.shape[0], 8 * vw.data.shape[1]
    else:
        shape = weight_shape
        if not isinstance(shape, tuple | list):
            shape = _host(_read(weight_shape, "weight_shape")).reshape(-1).tolist()
        if len(shape) != 2 or not all(isinstance(n, int | np.integer) for n in shape):
            raise ValueError(f"weight_shape must be (N, K), got {weight_shape!r}")
        N, K = (int(n) for n in shape)
    if K % 2 or K <= 0:
        raise ValueError(f"4-bit weights need an even K > 0, got weight_shape ({N}, {K})")
    _check_shape(vw, "weight_packed", (N, -(-K // 8)), "(N, ceil(K/8))")
    groups = vs.data.shape[1]
    _check_shape(vs, "weight_scale", (N, groups), "(N, K/g)")
    G = _group_size(K, groups, group_size, "weight_scale")
    if vz is not None:
        if vz.data.dtype == INT32:
            _check_shape(vz, "weight_zero_point", (-(-N // 8), groups), "(ceil(N/8), K/g)")
        elif vz.data.dtype == INT8:
            _check_shape(vz, "weight_zero_point", (N, groups), "(N, K/g)")
        else:
            raise TypeError(
                f"weight_zero_point must have dtype int32 (packed) or int8, got {vz.data.dtype}"
            )
    _check_g_idx(g_arr, K, G)
    xp = _xp(vw.device)
    with _on(vw.device):
        weight = _le_bytes(vw.data, xp)[:, : K // 2]  # q + 8: ropekv's nibbles as they are
        zeros = None
        if vz is not None and vz.data.dtype == INT32:
            zeros = _nibbles(vz.data.T, xp)[:, :N]  # (groups, N): zp + 8
        elif vz is not None:
            zp = vz.data
            if zp.size and not bool(((zp >= -8) & (zp <= 7)).all()):
                raise ValueError("weight_zero_point values (int8) must lie in [-8, 7]")
            zeros = (zp.astype(np.int16) + 8).astype(UINT8).T
        return _int4(xp.ascontiguousarray(weight), vs.data.T, zeros, G, target, vw, xp)


def import_float_quantized(weight: ArrayLike, weight_scale: ArrayLike) -> QkvWeights:
    """The arguments of a compressed-tensors ``float-quantized`` fp8 linear layer (channel or
    tensor strategy; llm-compressor's FP8 / FP8_DYNAMIC) for
    :func:`ropekv.fused_qkv_matmul_append_paged_kv_cache`.

    The layer's weight ``W (N, K)`` is ``W[n, k] = weight[n, k] * weight_scale[n]`` (per
    channel) or ``* weight_scale`` (per tensor). The fp8 codes are used as they are; the scales
    become ropekv's per-row float32 ``(N,)`` (exact: float16 / bfloat16 widen to float32).
    Block and group strategies (scales over columns) are refused.

    Parameters
    ----------
    weight : array, (N, K), float8_e4m3fn
    weight_scale : array, float16, bfloat16 or float32
        ``(N, 1)`` or ``(N,)`` per channel, one value (``()``, ``(1,)``, ``(1, 1)``) per tensor.

    Returns
    -------
    QkvWeights
        ``weight`` itself (not copied) and ``weight_scales (N,) float32``, of the kind of
        ``weight`` (NumPy, CuPy or torch) on its device; ``group_size`` and ``zero_points``
        None.

    Raises
    ------
    TypeError
        ``weight`` not float8_e4m3fn, ``weight_scale`` not float16 / bfloat16 / float32, an
        array neither NumPy, CuPy nor torch.
    ValueError
        ``weight`` not 2-D, ``weight_scale`` of another shape (block or group scales), arrays on
        different devices.

    Examples
    --------
    >>> import numpy as np, ropekv
    >>> w8 = np.full((3, 16), 1.5, "float8_e4m3fn")
    >>> w = ropekv.import_float_quantized(w8, np.array([[2.0], [4.0], [0.5]], np.float16))
    >>> w.weight is w8, w.weight_scales
    (True, array([2. , 4. , 0.5], dtype=float32))
    """
    arrays = _read_all({"weight": weight, "weight_scale": weight_scale})
    vw, vs = arrays["weight"], arrays["weight_scale"]
    _check_dtype(vw, "weight", (FLOAT8_E4M3FN,))
    _check_ndim(vw, "weight", "(N, K)")
    _check_dtype(vs, "weight_scale", _FLOATS)
    N = vw.data.shape[0]
    shape = tuple(vs.data.shape)
    if shape not in ((N, 1), (N,)) and vs.data.size != 1:
        raise ValueError(
            f"weight_scale must have shape (N, 1) or (N,) with N={N} (per channel) or hold one "
            f"value (per tensor), got {shape}: ropekv's fp8 weights take one scale a row"
        )
    xp = _xp(vw.device)
    with _on(vw.device):
        s = _float32(vs.data, xp).reshape(-1)
        scales = xp.ascontiguousarray(xp.broadcast_to(s, (N,))).astype(FLOAT32)
        return QkvWeights(weight, _write(scales, vw))


def concat_qkv_weights(*parts: QkvWeights) -> QkvWeights:
    """Stack the weights of separate projections (``q_proj``, ``k_proj``, ``v_proj`` of a
    checkpoint, each from the import functions) into the one ``[Q | K | V]`` projection of
    :func:`ropekv.fused_qkv_matmul_append_paged_kv_cache`.

    Rows are concatenated in order (weights, scales and zero points, which are 8 for a part
    without them); fp8 parts keep their per-row scales, so per-tensor scales of the three
    projections need no requantization.

    Parameters
    ----------
    *parts : QkvWeights
        The projections in row order, all 4-bit of one group size and scale dtype, or all fp8;
        their arrays of one kind, on one device.

    Returns
    -------
    QkvWeights
        The stacked weights, of the kind of the parts.

    Raises
    ------
    TypeError
        Parts that are not QkvWeights, or weights or scales of different dtypes.
    ValueError
        No part, 4-bit parts of different group sizes or K, arrays on different devices.

    Examples
    --------
    >>> import numpy as np, ropekv
    >>> fp8 = lambda n, s: ropekv.import_float_quantized(
    ...     np.ones((n, 16), "float8_e4m3fn"), np.array(s, np.float32))
    >>> w = ropekv.concat_qkv_weights(fp8(4, 0.5), fp8(2, 2.0), fp8(2, 1.0))
    >>> w.weight.shape, w.weight_scales
    ((8, 16), array([0.5, 0.5, 0.5, 0.5, 2. , 2. , 1. , 1. ], dtype=float32))
    """
    if not parts:
        raise ValueError("concat_qkv_weights needs at least one part")
    for i, p in enumerate(parts):
        if not isinstance(p, QkvWeights):
            raise TypeError(f"part {i} must be a QkvWeights, got {_type_name(p)}")
    read = [
        _read_all({f"part {i} {f}": getattr(p, f) for f in ("weight", "weight_scales")})
        for i, p in enumerate(parts)
    ]
    first = read[0]["part 0 weight"]
    devices = {a.device for r in read for a in r.values()}
    if len(devices) > 1:
        raise ValueError(f"the parts' arrays must be on one device, got devices {sorted(devices)}")
    ws = [r[f"part {i} weight"].data for i, r in enumerate(read)]
    ss = [r[f"part {i} weight_scales"].data for i, r in enumerate(read)]
    for i in range(1, len(parts)):
        for what, arrs in (("weight", ws), ("weight_scales", ss)):
            if arrs[i].dtype != arrs[0].dtype:
                raise TypeError(
                    f"part {i}'s {what} has dtype {arrs[i].dtype}, part 0's {arrs[0].dtype}"
                )
        if parts[i].group_size != parts[0].group_size or ws[i].shape[1:] != ws[0].shape[1:]:
            raise ValueError(
                f"part {i} (group_size {parts[i].group_size}, weight {tuple(ws[i].shape)}) "
                f"does not stack under part 0 (group_size {parts[0].group_size}, weight "
                f"{tuple(ws[0].shape)})"
            )
    xp = _xp(first.device)
    with _on(first.device):

        def stack(arrays):
            dtype = arrays[0].dtype
            bits = _BITS.get(dtype)
            if bits is None:
                return xp.concatenate([xp.ascontiguousarray(a) for a in arrays])
            out = xp.concatenate([xp.ascontiguousarray(a.view(bits)) for a in arrays])
            return out.view(dtype)

        zeros = None
        if any(p.zero_points is not None for p in parts):
            zs = []
            for i, p in enumerate(parts):
                if p.zero_points is None:
                    zs.append(xp.full(ss[i].shape, 8, UINT8))
                else:
                    z = _read(p.zero_points, f"part {i} zero_points")
                    if z.device != first.device:
                        raise ValueError(f"part {i}'s zero_points are on another device")
                    zs.append(z.data)
            zeros = stack(zs)
        return QkvWeights(
            _write(stack(ws), first),
            _write(stack(ss), first),
            parts[0].group_size,
            _write(zeros, first),
        )
