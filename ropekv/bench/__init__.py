"""``ropekv bench``: every op against its peers and the copy bandwidth, in one run.

One *workload* per case builds the inputs once (CuPy arrays; the same memory is handed to PyTorch
and FlashInfer through DLPack), and gives every runner (ropekv and each peer) its own outputs with
the same initial contents. Before any timing, each runner is called once and its outputs are
compared with ropekv's on a sample of tokens (q rows and the cache rows those tokens address); a
peer that disagrees is still timed but flagged in the table.

The package, by concern:

``workloads/``  one module per op family: its workload class, its peers' calls, its cases
``cases``       the registry: every standard case, the selection of a run, ``ropekv check``'s cases
``peers``       which peers can run, and the runners (ropekv's and each peer's)
``timing``      one runner on one case (events, CUDA-graph replay, host time; ``ropekv._timing``)
``runner``      the run, the environment record, ``main``
``report``      the table and text (``report.text``), the JSON record, the plot (times per op,
                speedup over the best peer)
``frameworks``  ``--frameworks``: ropekv under ``torch.compile``, CUDA graphs and ``jax.jit``
``arrays``, ``compare``  host / device copies and the output comparison (shared with ``check``)

``ropekv.check`` imports from here; nothing here imports ``ropekv.check``.
"""

from ropekv.bench import report
from ropekv.bench.arrays import gpu_status, torch_view
from ropekv.bench.cases import bench_specs, check_specs, select_specs
from ropekv.bench.peers import PEERS, Runner, make_runners, peer_availability
from ropekv.bench.report import format_table, plot, speedups, table_rows, write_json
from ropekv.bench.runner import (
    context_lost,
    environment,
    git_revision,
    main,
    progress,
    run,
    source_digest,
)
from ropekv.bench.timing import torch_graph_us
from ropekv.bench.workloads import (
    DECODE_SWEEP,
    OP_FUNCTIONS,
    OPS,
    SWEEP,
    CaseSpec,
    ContiguousWL,
    MlaWL,
    PagedWL,
    QknormWL,
    QkvWL,
    Workload,
    op_available,
)
from ropekv.bench.workloads.mla import RMSNORM_SRC

__all__ = [
    "DECODE_SWEEP",
    "OPS",
    "OP_FUNCTIONS",
    "PEERS",
    "RMSNORM_SRC",
    "SWEEP",
    "CaseSpec",
    "ContiguousWL",
    "MlaWL",
    "PagedWL",
    "QknormWL",
    "QkvWL",
    "Runner",
    "Workload",
    "bench_specs",
    "check_specs",
    "context_lost",
    "environment",
    "format_table",
    "git_revision",
    "gpu_status",
    "main",
    "make_runners",
    "op_available",
    "peer_availability",
    "plot",
    "progress",
    "report",
    "run",
    "select_specs",
    "source_digest",
    "speedups",
    "table_rows",
    "torch_graph_us",
    "torch_view",
    "write_json",
]
