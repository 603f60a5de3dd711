"""The case registry: every standard case of ``ropekv bench`` in table order, the selection a run
makes (``--ops``, ``--cases``, ``--quick``), and the small seeded cases of ``ropekv check``."""

from __future__ import annotations

import numpy as np

from ropekv.bench.workloads import MODULES, base


def bench_specs():
    """Every standard case, in table order (the ops that are missing included)."""
    return [spec for module in MODULES.values() for spec in module.specs()]


def check_specs():
    """(op, name, build() -> host Workload) of ``ropekv check``: small seeded shapes, every op that
    exists in ``ropekv``."""
    cases = []

    def add(op, name, cls, **kw):
        if base.op_available(op):
            seed = len(cases) + 7
            cases.append(
                (op, name, lambda cls=cls, kw=kw, seed=seed: cls(np, seed=seed, poison=True, **kw))
            )

    for module in MODULES.values():
        module.check_cases(add)
    return cases


def select_specs(ops=None, quick=False, names=None):
    """The cases to run: those of the chosen ops (all by default) whose op exists in ropekv; with
    ``names``, only those whose name contains one of these strings, or is one preceded by ``=``
    (``=paged gqa fp16->e4m3 1x1``: that case alone, not ``... 1x1024``; no case name holds ``=``)."""
    specs = [s for s in bench_specs() if ops is None or s.op in ops]
    specs = [s for s in specs if base.op_available(s.op)]
    if names:
        specs = [s for s in specs if any(_matches(n, s.name) for n in names)]
    if quick:
        specs = [s for s in specs if s.quick]
    return specs


def _matches(name, case):
    """Whether ``--cases`` string ``name`` selects ``case``: ``=exact`` or a substring."""
    return name[1:] == case if name.startswith("=") else name in case
