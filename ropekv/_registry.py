"""The one list of ropekv's public ops: each op's public name, the op module that defines it, its
forms in ``ropekv.torch`` / ``ropekv.jax``, and the bench workload (``ropekv bench --ops`` key,
``ropekv/bench/workloads/<workload>.py``) that times it and builds its ``ropekv check`` cases.

The lists that name every op derive from this table: ``ropekv.torch.__all__``,
``ropekv.jax.__all__``, the bench's ``OP_FUNCTIONS`` / ``OPS`` and workload modules (and so
``ropekv check``), the CLI's ``--ops`` choices, the op modules ``tools/hostcost.py`` times.
``ropekv/__init__.py`` and ``docs/api.rst`` spell the names for static tools and readers;
``tests/test_structure.py`` checks that every op here is in them. Imports nothing: the CLI's
parser reads it.
"""

from __future__ import annotations

from typing import NamedTuple


class OpEntry(NamedTuple):
    name: str  # the public function: ropekv.<name>
    module: str  # the op module defining it: ropekv.<module>
    workload: str  # its bench op key: ropekv/bench/workloads/<workload>.py
    torch: bool = True  # has ropekv.torch.<name> (torch.library custom ops)
    jax: bool = True  # has ropekv.jax.<name> (jax.jit)


# in the order of the API page and the bench's table
OPS = (
    OpEntry("apply_rope_write_kv", "contiguous", "contiguous"),
    OpEntry("rope_quantize_fp8_append_paged_kv_cache", "paged", "paged"),
    OpEntry("rope_append_paged_kv_cache", "paged", "paged"),
    OpEntry("mla_rope_rmsnorm_append_paged_kv_cache", "mla", "mla"),
    OpEntry("qk_rmsnorm_rope_append_paged_kv_cache", "qknorm", "qknorm"),
    OpEntry("fused_qkv_matmul_append_paged_kv_cache", "qkv", "qkv"),
    OpEntry("apply_rope_with_cos_sin_cache_inplace", "qk_rope", "qk_rope", torch=False, jax=False),
    OpEntry("apply_rope_with_cos_sin_cache", "qk_rope", "qk_rope", torch=False, jax=False),
)

# the public functions beside the ops (no kernel of their own): name -> module
HELPERS = {
    "pack_int4": "qkv",
    "cos_sin_cache": "rope",
    "freqs_cis_to_cos_sin": "rope",
    "import_gptq": "checkpoints",
    "import_awq": "checkpoints",
    "import_pack_quantized": "checkpoints",
    "import_float_quantized": "checkpoints",
    "concat_qkv_weights": "checkpoints",
}

NAMES = tuple(op.name for op in OPS)
TORCH = tuple(op.name for op in OPS if op.torch)
JAX = tuple(op.name for op in OPS if op.jax)
OP_MODULES = tuple(dict.fromkeys(op.module for op in OPS))  # ropekv.<module>, each once


def workloads():
    """``{bench op key: (the public names it measures, ...)}`` in table order; an op key runs when
    its first function exists."""
    out: dict[str, tuple[str, ...]] = {}
    for op in OPS:
        out[op.workload] = (*out.get(op.workload, ()), op.name)
    return out
