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


def validate(changes):
    """ValueError unless every key named is in its op module's ``TUNING`` dict or is one of the
    module's upper-case scalar constants."""
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


def _drop_plans(module):
    from ropekv._launch import Op

    for value in vars(module).values():
        if isinstance(value, Op) and isinstance(getattr(value, "plans", None), dict):
            value.plans.clear()


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
            _drop_plans(module)
        yield
    finally:
        for module, tuning, constants in saved:
            if tuning:
                module.TUNING.clear()
                module.TUNING.update(tuning)
            for key, value in constants.items():
                setattr(module, key, value)
            _drop_plans(module)
