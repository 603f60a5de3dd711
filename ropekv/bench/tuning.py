"""``ropekv bench --tune``: launch-shape variants of ropekv timed beside its defaults.

An op module's ``TUNING`` dict holds the knobs its launch configuration reads (block sizes, wave
sizes, split thresholds); an upper-case module constant such as ``qkv.GEMV_MAX_TOKENS`` (the
token count up to which the fused QKV projection runs its own GEMV instead of cuBLAS) or
``qkv.FAST_INT4`` can be changed the same way. A variant names changes to them,
``op.key=value[,op.key=value...]`` (values as Python literals: ``paged.heavy=(2,2,3)``,
``qkv.GEMV_MAX_TOKENS=1000``); each variant runs as one more runner,
``ropekv[<variant>]``, on every case of the ops it changes: its outputs are checked against the
default's, then it is timed like a peer (its ratio: variant time / default time, below 1: the
variant is faster). The op's launch plans are dropped when a variant is entered and left, so each
builds its own.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import math

from ropekv.bench.timing import clear_plans
from ropekv.bench.workloads import OPS


def parse(text):
    """``"op.key=value,..."`` -> {op: {key: value}}; ValueError naming what is wrong."""
    changes: dict[str, dict] = {}
    for item in _split(text):
        target, sep, value = item.partition("=")
        op, dot, key = target.strip().partition(".")
        if not sep or not dot or not key:
            raise ValueError(f"expected op.key=value, got {item!r}")
        if op not in OPS:
            raise ValueError(f"unknown op {op!r} in {item!r}; choose from {', '.join(OPS)}")
        try:
            parsed = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            raise ValueError(f"value of {target} must be a Python literal, got {value!r}") from None
        changes.setdefault(op, {})[key.strip()] = parsed
    if not changes:
        raise ValueError("empty variant")
    return changes


def _split(text):
    """Split on the commas outside brackets (``paged.heavy=(2,2,3),paged.light=(1,1,1)``)."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [s for s in items if s.strip()]


def _constant(module, key):
    """Whether ``key`` names an upper-case int / float / bool constant of ``module``."""
    return key.isupper() and isinstance(getattr(module, key, None), (bool, int, float))


# What each tunable accepts, declared per key (``op.key``): SIZE an int of at least 1 (sizes and
# counts), THREADS an int between 1 and 1024 (a block's threads), THRESHOLD an int of at least 0
# (0: off or never, e.g. paged.row_group=0, qknorm.rows_warps=0), SWITCH True or False, TUPLE a
# tuple of as many positive ints as the default, NUMBER a finite float >= 0. Every TUNING key of
# every op module is declared here (a test checks it), and the upper-case constants that are sizes;
# an undeclared key or constant takes what its default's type allows: a bool SWITCH, a tuple TUPLE,
# a float NUMBER, an int THRESHOLD (the loosest rule: a new key is tunable before it is declared).
SIZE, THREADS, THRESHOLD, SWITCH, TUPLE, NUMBER = (
    "size",
    "threads",
    "threshold",
    "switch",
    "tuple",
    "number",
)


def _kinds(op, **keys):
    return {f"{op}.{key}": kind for key, kind in keys.items()}


KINDS = {
    **_kinds(
        "contiguous",
        block=THREADS,
        wave_blocks=THRESHOLD,
        prefill_rows=SIZE,
        max_block=THREADS,
        scaled_prefill_rows=SIZE,
        mrope_scaled_prefill_rows=SIZE,
        lean_decode=SWITCH,
        lean_block=THREADS,
        lean_wave_blocks=THRESHOLD,
        ROWS_MAX=SIZE,
        SCALED_ROWS_MAX=SIZE,
        MAX_BLOCK=THREADS,
        MODE_Q_ROWS=SIZE,
        MODE_KV_ROWS=SIZE,
        MODE_BOTH_ROWS=SIZE,
    ),
    **_kinds(
        "paged",
        light=TUPLE,
        heavy=TUPLE,
        heavy_from=THRESHOLD,
        max_block=THREADS,
        min_blocks=THRESHOLD,
        row_group=THRESHOLD,
        row_block=THREADS,
        row_block_below=THRESHOLD,
        row_block_many=SIZE,
        wave_blocks=THRESHOLD,
        prefill_rows=SIZE,
        max_row_block=THREADS,
        opts_rows=SIZE,
        row_tokens_upto=THRESHOLD,
        wide_rows_below=THRESHOLD,
        wide_row_block=THREADS,
        wide_row_single_from=THRESHOLD,
        lean_below=THRESHOLD,
        lean_prefill_from=THRESHOLD,
        lean_block=THREADS,
        lean_wave_blocks=THRESHOLD,
        lean_max_block=THREADS,
        lean_split_block=THREADS,
        lean_narrow_from=THRESHOLD,
        lean_wide_chunks=THRESHOLD,
        lean_multi=THRESHOLD,
        lean_stream_l2=NUMBER,
        lean_multi_many=THRESHOLD,
        lean_multi_many_from=THRESHOLD,
        lean_multi_upto=THRESHOLD,
        lean_prefill_rows=SIZE,
        lean_prefill_rows_bf16_8bit=SIZE,
        lean_guess=SWITCH,
        MAX_BLOCK=THREADS,
        LEAN_THREADS=THREADS,
    ),
    **_kinds(
        "mla",
        wave_blocks=THRESHOLD,
        split_below=THRESHOLD,
        lean_below=THRESHOLD,
        lean_block=THREADS,
        BLOCK=THREADS,
        HEADS_MAX=SIZE,
    ),
    **_kinds(
        "qknorm",
        block=THREADS,
        wave_blocks=THRESHOLD,
        prefill_rows=SIZE,
        prefill_rows_many=SIZE,
        prefill_rows_many_from=THRESHOLD,
        max_block=THREADS,
        narrow_below=THRESHOLD,
        narrow_width=SIZE,
        decode_tokens=THRESHOLD,
        decode_rows=SIZE,
        decode_flat=THRESHOLD,
        flat_below=THRESHOLD,
        decode_heads=THRESHOLD,
        decode_narrow_below=THRESHOLD,
        decode_min_blocks=THRESHOLD,
        few_head_tokens=THRESHOLD,
        few_head_rows_from=THRESHOLD,
        tp_flat_from=THRESHOLD,
        tp_flat_to=THRESHOLD,
        tp_flat_width=SIZE,
        tp_flat_rows=SIZE,
        decode_by_token=THRESHOLD,
        rows_from=THRESHOLD,
        rows_tokens=THRESHOLD,
        rows_per_lane=THRESHOLD,
        rows_warps=THRESHOLD,
        rows_block_warps=SIZE,
        MAX_BLOCK=THREADS,
    ),
    **_kinds(
        "qkv",
        FAST_INT4_MAX_TILE=SIZE,
        GEMV_PACKED_MAX_TILE=SIZE,
        GEMV_WARPS=SIZE,
        GEMV_PAIRS=SIZE,
        GEMV_SMEM=SIZE,
        TILED_MAX_TILE=SIZE,
        TILED_STAGES=SIZE,
        TILED_KGROUPS=SIZE,
        TILED_SPLIT=SIZE,
        TILED_CTAS_PER_SM=SIZE,
        MMA_ROWS=SIZE,
        MMA_WARPS=SIZE,
        WGMMA_MAX_TILE=SIZE,
        WGMMA_STAGES=SIZE,
        WGMMA_DEEP_STAGES=SIZE,
        WGMMA_FP8_ATOMS=SIZE,
        WGMMA_FP8_MIN_STAGES=SIZE,
        WGMMA_INT4_ATOMS=SIZE,
        WGMMA_INT4_MIN_STAGES=SIZE,
        WGMMA_ATOMS=SIZE,
        WGMMA_SPLIT=SIZE,
        WGMMA_THREADS=THREADS,
        SM_SHARED_BYTES=SIZE,
        MMA_SPLIT=SIZE,
        MMA_SMEM_MAX=SIZE,
        EPILOGUE_BLOCK=THREADS,
        DEQUANT_BLOCK=THREADS,
    ),
    **_kinds(
        "qk_rope",
        block=THREADS,
        wave_blocks=THRESHOLD,
        prefill_rows=SIZE,
        max_block=THREADS,
        lean_decode=SWITCH,
        lean_prefill=SWITCH,
        lean_block=THREADS,
        ROWS_MAX=SIZE,
        MAX_THREADS=THREADS,
    ),
}


def _int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def kind_of(op, key, default):
    """The kind ``op.key`` accepts (:data:`KINDS`, else its default's type's)."""
    kind = KINDS.get(f"{op}.{key}")
    if kind is not None:
        return kind
    if isinstance(default, bool):
        return SWITCH
    if isinstance(default, tuple):
        return TUPLE
    if isinstance(default, float):
        return NUMBER
    return THRESHOLD if _int(default) else None


def check_value(op, key, default, value):
    """ValueError unless ``value`` is one ``op.key`` (whose default is ``default``) accepts
    (its kind: :func:`kind_of`)."""
    where = f"{op}.{key}={value!r}"
    kind = kind_of(op, key, default)
    if kind == SWITCH:
        if not isinstance(value, bool):
            raise ValueError(f"{where}: expected True or False")
    elif kind in (SIZE, THREADS, THRESHOLD):
        low = 0 if kind == THRESHOLD else 1
        high = 1024 if kind == THREADS else None
        if not _int(value) or value < low or (high is not None and value > high):
            bound = f"between {low} and {high}" if high else f"at least {low}"
            raise ValueError(f"{where}: expected an integer {bound}")
    elif kind == NUMBER:
        if not (_int(value) or isinstance(value, float)) or not 0 <= value < math.inf:
            raise ValueError(f"{where}: expected a finite number >= 0")
    elif kind == TUPLE:
        if (
            not isinstance(value, tuple)
            or len(value) != len(default)
            or not all(_int(v) and v >= 1 for v in value)
        ):
            raise ValueError(f"{where}: expected a tuple of {len(default)} positive integers")
    elif type(value) is not type(default):
        raise ValueError(f"{where}: expected a {type(default).__name__}")


def validate(changes):
    """ValueError unless every key named is in its op module's ``TUNING`` dict or is one of the
    module's upper-case scalar constants, and its value is one it accepts (:func:`check_value`)."""
    for op, change in changes.items():
        module = importlib.import_module(f"ropekv.{op}")
        tuning = getattr(module, "TUNING", None)
        tuning = tuning if isinstance(tuning, dict) else {}
        unknown = sorted(k for k in change if k not in tuning and not _constant(module, k))
        if unknown:
            have = sorted(tuning) + sorted(k for k in vars(module) if _constant(module, k))
            raise ValueError(
                f"ropekv.{op} has no TUNING key or constant {', '.join(unknown)}; "
                f"it has {', '.join(have) or 'none'}"
            )
        for key, value in change.items():
            default = tuning[key] if key in tuning else getattr(module, key)
            check_value(op, key, default, value)


@contextlib.contextmanager
def applied(changes):
    """The op modules' ``TUNING`` (and named constants) changed for the duration, their launch
    plans dropped on entry and exit."""
    saved = []
    try:
        for op, change in changes.items():
            module = importlib.import_module(f"ropekv.{op}")
            tuning = getattr(module, "TUNING", {})
            constants = {k: getattr(module, k) for k in change if k not in tuning}
            saved.append((module, dict(tuning), constants))
            for key, value in change.items():
                if key in constants:
                    setattr(module, key, value)
                else:
                    tuning[key] = value
            clear_plans([module])
        yield
    finally:
        for module, tuning, constants in saved:
            if tuning:
                module.TUNING.clear()
                module.TUNING.update(tuning)
            for key, value in constants.items():
                setattr(module, key, value)
            clear_plans([module])
