"""The one list of ropekv's public ops: each op's public name, the op module that defines it, its
forms in ``ropekv.torch`` / ``ropekv.jax``, and the bench workload (``ropekv bench --ops`` key,
``ropekv/bench/workloads/<workload>.py``) that times it and builds its ``ropekv check`` cases.

The lists that name every op derive from this table: ``ropekv.torch.__all__``,
``ropekv.jax.__all__``, the bench's ``OP_FUNCTIONS`` / ``OPS`` and workload modules (and so
``ropekv check``), the CLI's ``--ops`` choices, the op modules ``tools/hostcost.py`` times.
``ropekv/__init__.py`` and ``docs/api.rst`` spell the names for static tools and readers;
``tests/test_structure.py`` checks that every op here is in them. Imports nothing when imported
(the CLI's parser reads it); :func:`api_summary` imports the op modules for their declarations.
"""

from __future__ import annotations

from typing import NamedTuple


class OpEntry(NamedTuple):
    name: str  # the public function: ropekv.<name>
    module: str  # the op module defining it: ropekv.<module>
    workload: str  # its bench op key: ropekv/bench/workloads/<workload>.py
    section: str  # its section of the API page (docs/api.rst)
    torch: bool = True  # has ropekv.torch.<name> (torch.library custom ops)
    jax: bool = True  # has ropekv.jax.<name> (jax.jit)


# in the order of the API page and the bench's table
OPS = (
    OpEntry("apply_rope_write_kv", "contiguous", "contiguous", "Contiguous cache"),
    OpEntry(
        "rope_quantize_fp8_append_paged_kv_cache",
        "paged",
        "paged",
        "Paged cache (FlashInfer-compatible)",
    ),
    OpEntry("rope_append_paged_kv_cache", "paged", "paged", "Paged cache (FlashInfer-compatible)"),
    OpEntry("mla_rope_rmsnorm_append_paged_kv_cache", "mla", "mla", "MLA latent cache"),
    OpEntry("qk_rmsnorm_rope_append_paged_kv_cache", "qknorm", "qknorm", "QK RMSNorm"),
    OpEntry("fused_qkv_matmul_append_paged_kv_cache", "qkv", "qkv", "Fused QKV projection"),
    OpEntry(
        "apply_rope_with_cos_sin_cache_inplace",
        "qk_rope",
        "qk_rope",
        "RoPE on Q and K (FlashInfer-, vLLM- and SGLang-compatible)",
    ),
    OpEntry(
        "apply_rope_with_cos_sin_cache",
        "qk_rope",
        "qk_rope",
        "RoPE on Q and K (FlashInfer-, vLLM- and SGLang-compatible)",
    ),
)

# the public functions beside the ops (no kernel of their own): name -> module; the API page
# documents them in its own prose (the checkpoint importers, the RoPE tables), but for those in
# HELPER_SECTIONS, listed after the ops of that section
HELPER_SECTIONS = {"pack_int4": "Fused QKV projection"}
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


def api_summary():
    """The API page's generated part (``docs/_generated/ops.rst``, written by ``docs/conf.py``):
    the summary table of every public function, then a section per op section, its ops (each
    with the table of its arguments, from its declaration) and helpers, in table order."""
    from ropekv import _declare  # (the op modules, for their declarations: the API page only)

    entries = {op.name: op for op in OPS}
    lines = [".. autosummary::", ""]
    lines += [f"   {name}" for name in (*NAMES, *HELPERS)]
    sections: dict[str, list[str]] = {}
    for op in OPS:
        sections.setdefault(op.section, []).append(op.name)
    for name, section in HELPER_SECTIONS.items():
        sections[section].append(name)
    for title, names in sections.items():
        lines += ["", title, "-" * len(title), ""]
        for name in names:
            lines += [f".. autofunction:: {name}", ""]
            if name in NAMES:
                lines += [_declare.declaration(entries[name]).arguments_rst()]
    return "\n".join(lines).rstrip() + "\n"


def workloads():
    """``{bench op key: (the public names it measures, ...)}`` in table order; an op key runs when
    its first function exists."""
    out: dict[str, tuple[str, ...]] = {}
    for op in OPS:
        out[op.workload] = (*out.get(op.workload, ()), op.name)
    return out
