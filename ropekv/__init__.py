"""ropekv: fused RoPE + KV-cache kernels for LLM inference, with a NumPy-style API.

CuPy arrays, NumPy arrays and any DLPack tensor (PyTorch, JAX) are accepted zero-copy; NumPy
inputs run the NumPy reference on the host.
"""

from ropekv.checkpoints import (
    concat_qkv_weights,
    import_awq,
    import_float_quantized,
    import_gptq,
    import_pack_quantized,
)
from ropekv.contiguous import apply_rope_write_kv
from ropekv.mla import mla_rope_rmsnorm_append_paged_kv_cache
from ropekv.paged import rope_append_paged_kv_cache, rope_quantize_fp8_append_paged_kv_cache
from ropekv.qk_rope import apply_rope_with_cos_sin_cache, apply_rope_with_cos_sin_cache_inplace
from ropekv.qknorm import qk_rmsnorm_rope_append_paged_kv_cache
from ropekv.qkv import fused_qkv_matmul_append_paged_kv_cache, pack_int4
from ropekv.rope import cos_sin_cache, freqs_cis_to_cos_sin

__version__ = "0.2.0"

__all__ = [
    "apply_rope_with_cos_sin_cache",
    "apply_rope_with_cos_sin_cache_inplace",
    "apply_rope_write_kv",
    "concat_qkv_weights",
    "cos_sin_cache",
    "freqs_cis_to_cos_sin",
    "fused_qkv_matmul_append_paged_kv_cache",
    "import_awq",
    "import_float_quantized",
    "import_gptq",
    "import_pack_quantized",
    "mla_rope_rmsnorm_append_paged_kv_cache",
    "pack_int4",
    "qk_rmsnorm_rope_append_paged_kv_cache",
    "rope_append_paged_kv_cache",
    "rope_quantize_fp8_append_paged_kv_cache",
]
