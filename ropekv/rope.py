"""RoPE cos/sin tables in ropekv's layout, with Hugging Face ``rope_scaling`` support.

A table has shape ``(max_position, rotary_dim)`` and dtype float32. Row ``p`` holds
``cos(p * inv_freq)`` in columns ``[:rotary_dim // 2]`` and ``sin(p * inv_freq)`` in columns
``[rotary_dim // 2:]``, both multiplied by the scaling method's attention factor (1.0 except for
YaRN). All maths runs in float64 on the host; the result is cast to float32 once, at the end.

The scaling maths follows ``transformers.modeling_rope_utils`` (``_compute_linear_scaling_rope_
parameters``, ``_compute_llama3_parameters`` and ``_compute_yarn_parameters``), so a model's
``config.rope_scaling`` dict can be passed in unchanged.
"""

from __future__ import annotations

import math
import numbers
import types
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = [
    "SUPPORTED_ROPE_TYPES",
    "cos_sin_cache",
    "freqs_cis_to_cos_sin",
    "inv_frequencies",
]

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

_MISSING = object()


# --------------------------------------------------------------------------- argument checks


def _check_int(name: str, value: Any, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{name} must be an integer >= {minimum}, got {value!r} of type {type(value).__name__}"
        )
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value}")
    return int(value)


def _check_rotary_dim(rotary_dim: Any) -> int:
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, numbers.Integral):
        raise TypeError(
            "rotary_dim must be a positive even integer, "
            f"got {rotary_dim!r} of type {type(rotary_dim).__name__}"
        )
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even integer, got {rotary_dim}")
    return int(rotary_dim)


def _check_positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be a positive finite number, got {value!r} of type {type(value).__name__}"
        )
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


def _scaling_value(scaling: Mapping, key: str, rope_type: str, default: Any = _MISSING) -> Any:
    """Read ``scaling[key]``; a missing required key raises ValueError naming the key."""
    value = scaling.get(key, default)
    if value is _MISSING:
        raise ValueError(
            f"scaling[{key!r}] is required for rope_type {rope_type!r}; "
            f"got keys {sorted(map(str, scaling))}"
        )
    return value


def _scaling_number(scaling: Mapping, key: str, rope_type: str, default: Any = _MISSING) -> float:
    return _check_positive(f"scaling[{key!r}]", _scaling_value(scaling, key, rope_type, default))


def _rope_type(scaling: Mapping | None) -> str:
    if scaling is None:
        return "default"
    if not isinstance(scaling, Mapping):
        raise TypeError(
            "scaling must be None or a Hugging Face rope_scaling dict, "
            f"got {type(scaling).__name__}"
        )
    # Hugging Face reads "rope_type" first and falls back to the legacy "type" key.
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type is None:
        raise ValueError(
            "scaling must name its method under the key 'rope_type' (or legacy 'type'); "
            f"got keys {sorted(map(str, scaling))}"
        )
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unknown rope_type {rope_type!r} in scaling; supported: "
            + ", ".join(repr(t) for t in SUPPORTED_ROPE_TYPES)
        )
    return rope_type


# --------------------------------------------------------------------------- scaling methods


def _llama3(inv_freq: np.ndarray, scaling: Mapping) -> np.ndarray:
    factor = _scaling_number(scaling, "factor", "llama3")
    low_freq_factor = _scaling_number(scaling, "low_freq_factor", "llama3")
    high_freq_factor = _scaling_number(scaling, "high_freq_factor", "llama3")
    old_context_len = _scaling_number(scaling, "original_max_position_embeddings", "llama3")
    if not low_freq_factor < high_freq_factor:
        raise ValueError(
            "scaling['low_freq_factor'] must be smaller than scaling['high_freq_factor'], "
            f"got {low_freq_factor} and {high_freq_factor}"
        )

    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2.0 * math.pi / inv_freq
    # Long wavelengths are interpolated, short ones kept, the band between blended smoothly.
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1.0 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn(
    inv_freq: np.ndarray, rotary_dim: int, base: float, scaling: Mapping
) -> tuple[np.ndarray, float]:
    factor = _scaling_number(scaling, "factor", "yarn")
    original_max = _scaling_number(scaling, "original_max_position_embeddings", "yarn")
    # As in transformers, None or 0 falls back to the paper's defaults.
    beta_fast = _check_positive("scaling['beta_fast']", scaling.get("beta_fast") or 32)
    beta_slow = _check_positive("scaling['beta_slow']", scaling.get("beta_slow") or 1)
    truncate = scaling.get("truncate", True)
    if not isinstance(truncate, (bool, np.bool_)):
        raise TypeError(f"scaling['truncate'] must be a bool, got {truncate!r}")

    attention_factor = scaling.get("attention_factor")
    if attention_factor is not None:
        attention_factor = _check_positive("scaling['attention_factor']", attention_factor)
    else:
        mscale = scaling.get("mscale")
        mscale_all_dim = scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            m = _check_positive("scaling['mscale']", mscale)
            m_all = _check_positive("scaling['mscale_all_dim']", mscale_all_dim)
            attention_factor = _yarn_mscale(factor, m) / _yarn_mscale(factor, m_all)
        else:
            attention_factor = _yarn_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        # The dimension whose wavelength fits num_rotations times into the original context.
        return (rotary_dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # prevent a zero-width ramp, as transformers does

    ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolation = 1.0 - ramp
    blended = (inv_freq / factor) * (1.0 - extrapolation) + inv_freq * extrapolation
    return blended, float(attention_factor)


# --------------------------------------------------------------------------- public API


def inv_frequencies(
    rotary_dim: int, base: float = 10000.0, scaling: Mapping | None = None
) -> tuple[np.ndarray, float]:
    """Inverse RoPE frequencies and attention factor, optionally with Hugging Face scaling.

    Parameters
    ----------
    rotary_dim : int
        Number of rotated channels ``R`` per head; a positive even integer.
    base : float, default 10000.0
        RoPE base (``rope_theta`` in Hugging Face configs); positive.
    scaling : dict or None, default None
        A Hugging Face ``rope_scaling`` dict. The method is read from ``"rope_type"`` (or the
        legacy ``"type"``) and must be one of ``"default"``, ``"linear"`` (key ``factor``),
        ``"llama3"`` (``factor``, ``low_freq_factor``, ``high_freq_factor``,
        ``original_max_position_embeddings``) or ``"yarn"`` (``factor``,
        ``original_max_position_embeddings``; optional ``beta_fast`` = 32, ``beta_slow`` = 1,
        ``mscale``, ``mscale_all_dim``, ``attention_factor``, ``truncate`` = True).
        Other keys are ignored.

    Returns
    -------
    inv_freq : numpy.ndarray
        float64 array of shape ``(R // 2,)``; unscaled it is ``base ** (-2 * i / R)``.
    attention_factor : float
        Factor by which cos and sin are multiplied; 1.0 for every method except YaRN.

    Raises
    ------
    TypeError
        If an argument or a scaling value has the wrong type.
    ValueError
        If an argument is out of range, the rope_type is unknown or a required key is missing.

    Examples
    --------
    >>> inv_freq, attn = inv_frequencies(4, base=100.0)
    >>> inv_freq.tolist(), attn
    ([1.0, 0.1], 1.0)
    >>> inv_frequencies(4, base=100.0, scaling={"rope_type": "linear", "factor": 2.0})[0].tolist()
    [0.5, 0.05]
    """
    rotary_dim = _check_rotary_dim(rotary_dim)
    base = _check_positive("base", base)
    rope_type = _rope_type(scaling)

    exponent = np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim
    inv_freq = 1.0 / base**exponent
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / _scaling_number(scaling, "factor", "linear"), 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    return _yarn(inv_freq, rotary_dim, base, scaling)


def _array_module(xp: Any) -> str:
    """Return ``"numpy"`` or ``"cupy"`` for the ``xp`` argument of :func:`cos_sin_cache`."""
    if xp is None:
        return "numpy"
    name = xp.__name__ if isinstance(xp, types.ModuleType) else xp
    if isinstance(name, str) and name in ("numpy", "cupy"):
        return name
    raise ValueError(f"xp must be None, 'numpy', 'cupy', numpy or the cupy module, got {xp!r}")


def cos_sin_cache(
    max_position: int,
    rotary_dim: int,
    *,
    base: float = 10000.0,
    scaling: Mapping | None = None,
    xp: Any = None,
) -> Any:
    """Build the RoPE cos/sin table used by ropekv's kernels.

    Parameters
    ----------
    max_position : int
        Number of positions ``P`` (rows); an integer >= 1.
    rotary_dim : int
        Number of rotated channels ``R`` per head; a positive even integer.
    base : float, default 10000.0
        RoPE base (``rope_theta``); positive.
    scaling : dict or None, default None
        A Hugging Face ``rope_scaling`` dict; see :func:`inv_frequencies`.
    xp : None, module or str, default None
        Array library of the result: ``None``, ``numpy`` or ``"numpy"`` give a NumPy array;
        ``cupy`` or ``"cupy"`` give a CuPy array (computed on the host, then copied over).

    Returns
    -------
    numpy.ndarray or cupy.ndarray
        C-contiguous float32 array of shape ``(P, R)``. With ``theta = p * inv_freq[i]``,
        ``table[p, i] = a * cos(theta)`` and ``table[p, R // 2 + i] = a * sin(theta)`` for
        ``i < R // 2``, where ``a`` is the scaling method's attention factor.

    Raises
    ------
    TypeError
        If an argument has the wrong type.
    ValueError
        If an argument is out of range, ``xp`` is not recognised, the rope_type is unknown or a
        required scaling key is missing.

    Examples
    --------
    >>> table = cos_sin_cache(2048, 128, base=500000.0)
    >>> table.shape, table.dtype
    ((2048, 128), dtype('float32'))
    >>> bool((table[0, :64] == 1).all() and (table[0, 64:] == 0).all())  # cos 1, sin 0 at p = 0
    True
    >>> llama31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
    ...            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    >>> cos_sin_cache(16, 128, base=500000.0, scaling=llama31).shape
    (16, 128)
    """
    max_position = _check_int("max_position", max_position, minimum=1)
    module = _array_module(xp)
    inv_freq, attention_factor = inv_frequencies(rotary_dim, base, scaling)

    angles = np.outer(np.arange(max_position, dtype=np.float64), inv_freq)
    table = np.concatenate([np.cos(angles), np.sin(angles)], axis=1)
    if attention_factor != 1.0:
        table *= attention_factor
    table = np.ascontiguousarray(table, dtype=np.float32)
    if module == "cupy":
        import cupy

        return cupy.asarray(table)
    return table


_BAD_KINDS = {
    "b": "bool",
    "O": "object",
    "S": "bytes",
    "U": "str",
    "M": "datetime",
    "m": "timedelta",
}


def freqs_cis_to_cos_sin(freqs_cis: Any) -> Any:
    """Convert Modular MAX's interleaved ``freqs_cis`` table to ropekv's cos-then-sin layout.

    Parameters
    ----------
    freqs_cis : numpy.ndarray or cupy.ndarray
        Real array of shape ``(P, R)`` with ``R`` even, where column ``2 * i`` is
        ``cos(theta_i)`` and column ``2 * i + 1`` is ``sin(theta_i)``. Any real dtype that
        casts to float32 is accepted (float16, bfloat16, float32, float64, ...). Other
        array-likes are converted with :func:`numpy.asarray`.

    Returns
    -------
    numpy.ndarray or cupy.ndarray
        New C-contiguous float32 array of shape ``(P, R)`` from the same array library as the
        input, with the cosines in columns ``[:R // 2]`` and the sines in ``[R // 2:]``.

    Raises
    ------
    TypeError
        If the dtype is not a real numeric type.
    ValueError
        If the array is not 2-D, its last dimension is odd or it is complex.

    Examples
    --------
    >>> import numpy as np
    >>> freqs_cis = np.array([[1.0, 0.0, 1.0, 0.0], [0.5, 0.75, 0.25, 0.125]])
    >>> freqs_cis_to_cos_sin(freqs_cis).tolist()
    [[1.0, 1.0, 0.0, 0.0], [0.5, 0.25, 0.75, 0.125]]
    """
    # CuPy arrays are kept on the device; the conversion below uses only ndarray methods.
    if not type(freqs_cis).__module__.startswith("cupy"):
        freqs_cis = np.asarray(freqs_cis)
    if freqs_cis.ndim != 2 or freqs_cis.shape[-1] % 2:
        raise ValueError(
            "freqs_cis must be a 2-D array of shape (positions, rotary_dim) with an even "
            f"rotary_dim, got shape {tuple(freqs_cis.shape)}"
        )
    kind = np.dtype(freqs_cis.dtype).kind
    if kind == "c":
        raise ValueError(
            "freqs_cis must hold interleaved real (cos, sin) pairs, got complex dtype "
            f"{freqs_cis.dtype}; pass freqs_cis.view(<real dtype>) instead"
        )
    if kind in _BAD_KINDS:
        raise TypeError(f"freqs_cis must have a real numeric dtype, got {freqs_cis.dtype}")

    half = freqs_cis.shape[-1] // 2
    out = freqs_cis.astype(np.float32, order="C", copy=True)
    out[:, :half] = freqs_cis[:, 0::2]
    out[:, half:] = freqs_cis[:, 1::2]
    return out
