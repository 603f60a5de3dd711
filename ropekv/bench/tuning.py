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


# What a tunable accepts follows its default: a bool takes a bool; an int a non-negative int
# (0: off, for thresholds such as paged.row_group=0, paged.lean_multi_upto=0,
# qknorm.decode_by_token=0), at least 1 for the sizes and counts whose name ends in a word of
# _POSITIVE (but a key whose default is 0, and the thresholds of _THRESHOLDS), at most 1024
# threads for a block; a float a finite non-negative number; a tuple a tuple of as many positive
# ints.
_POSITIVE = {
    "atoms",
    "block",
    "bytes",
    "ctas_per_sm",
    "kgroups",
    "many",
    "max",
    "pairs",
    "rows",
    "smem",
    "split",
    "stages",
    "threads",
    "tile",
    "warps",
    "width",
}
_THREADS = {"block", "threads"}
# keys ending in a word of _POSITIVE that are thresholds, not sizes: 0 is one of their values
# (qknorm.rows_warps: the grid's warps up to which fewer rows a lane are taken; 0: never, always
# the most)
_THRESHOLDS = {"qknorm.rows_warps"}


def _int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def check_value(op, key, default, value):
    """ValueError unless ``value`` is one ``op.key`` (whose default is ``default``) accepts."""
    where = f"{op}.{key}={value!r}"
    last = key.lower().rsplit("_", 1)[-1]
    last = "ctas_per_sm" if key.lower().endswith("ctas_per_sm") else last
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ValueError(f"{where}: expected True or False")  # noqa: TRY004 - a usage error
    elif _int(default):
        size = last in _POSITIVE and default != 0 and f"{op}.{key}" not in _THRESHOLDS
        low = 1 if size else 0
        high = 1024 if last in _THREADS else None
        if not _int(value) or value < low or (high is not None and value > high):
            bound = f"between {low} and {high}" if high else f"at least {low}"
            raise ValueError(f"{where}: expected an integer {bound}")
    elif isinstance(default, float):
        if not (_int(value) or isinstance(value, float)) or not 0 <= value < math.inf:
            raise ValueError(f"{where}: expected a finite number >= 0")
    elif isinstance(default, tuple):
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
