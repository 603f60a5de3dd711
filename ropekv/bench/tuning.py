"""``ropekv bench --tune``: launch-shape variants of ropekv timed beside its defaults.

An op module's ``TUNING`` dict holds the knobs its launch configuration reads (block sizes, wave
sizes, split thresholds). A variant names changes to them, ``op.key=value[,op.key=value...]``
(values as Python literals: ``paged.heavy=(2,2,3)``); each variant runs as one more runner,
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


def validate(changes):
    """ValueError unless every op module has a ``TUNING`` dict holding every key named."""
    for op, change in changes.items():
        tuning = getattr(importlib.import_module(f"ropekv.{op}"), "TUNING", None)
        if not isinstance(tuning, dict):
            raise ValueError(f"ropekv.{op} has no TUNING to change")
        unknown = sorted(set(change) - set(tuning))
        if unknown:
            raise ValueError(f"ropekv.{op}.TUNING has no {', '.join(unknown)}; it has "
                             f"{', '.join(sorted(tuning))}")


def _drop_plans(module):
    from ropekv._launch import Op

    for value in vars(module).values():
        if isinstance(value, Op) and isinstance(getattr(value, "plans", None), dict):
            value.plans.clear()


@contextlib.contextmanager
def applied(changes):
    """The op modules' ``TUNING`` changed for the duration, their launch plans dropped on entry
    and exit."""
    saved = []
    try:
        for op, change in changes.items():
            module = importlib.import_module(f"ropekv.{op}")
            saved.append((module, dict(module.TUNING)))
            module.TUNING.update(change)
            _drop_plans(module)
        yield
    finally:
        for module, tuning in saved:
            module.TUNING.clear()
            module.TUNING.update(tuning)
            _drop_plans(module)
