"""One module per op family: its :class:`~ropekv.bench.workloads.base.Workload` subclass (inputs,
the ropekv call, its peers' calls on the same memory), ``specs()`` (the bench cases) and
``check_cases(add)`` (the small cases of ``ropekv check``)."""

import importlib

from ropekv import _registry
from ropekv.bench.workloads.base import (
    DECODE_SWEEP,
    OP_FUNCTIONS,
    OPS,
    SWEEP,
    CaseSpec,
    Workload,
    op_available,
)
from ropekv.bench.workloads.contiguous import ContiguousWL
from ropekv.bench.workloads.mla import MlaWL
from ropekv.bench.workloads.paged import PagedWL
from ropekv.bench.workloads.qknorm import QknormWL
from ropekv.bench.workloads.qkv import QkvWL

# op key -> its module, in table order (the registry's workloads)
MODULES = {key: importlib.import_module(f"{__name__}.{key}") for key in _registry.workloads()}

__all__ = [
    "DECODE_SWEEP",
    "MODULES",
    "OPS",
    "OP_FUNCTIONS",
    "SWEEP",
    "CaseSpec",
    "ContiguousWL",
    "MlaWL",
    "PagedWL",
    "QknormWL",
    "QkvWL",
    "Workload",
    "op_available",
]
