"""ropekv: fused RoPE + KV-cache kernels for LLM inference, with a NumPy-style API.

CuPy arrays, NumPy arrays and any DLPack tensor (PyTorch, JAX) are accepted zero-copy; NumPy
inputs run the NumPy reference on the host.
"""

from ropekv.contiguous import apply_rope_write_kv
from ropekv.rope import cos_sin_cache, freqs_cis_to_cos_sin

__version__ = "0.1.0"

__all__ = ["apply_rope_write_kv", "cos_sin_cache", "freqs_cis_to_cos_sin"]
