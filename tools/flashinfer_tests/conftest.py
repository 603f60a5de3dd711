"""Run FlashInfer's RoPE tests (``tests/attention/test_rope.py``, flashinfer-ai/flashinfer at
fb28d7242, with ``tests/test_helpers/rope_reference.py``) against ropekv. Their files are not in
this repository: README.md here says where they go.

``flashinfer.apply_rope_with_cos_sin_cache`` and ``flashinfer.apply_rope_with_cos_sin_cache_inplace``
(and their ``flashinfer.rope.`` spellings) are replaced, before the test module is imported, by
thin adapters with FlashInfer's signature that call ropekv's eager functions on the same torch
tensors (zero-copy through ropekv's torch intake). Every test that names
``apply_rope_with_cos_sin_cache`` or ``test_rope_cos_sin_cache`` must reach an adapter, or it
fails: a passing run cannot have tested FlashInfer's own kernel by mistake.

Where FlashInfer is not installed, ``ROPEKV_PEER_STUB_FLASHINFER=1`` puts an empty ``flashinfer``
module (with ``flashinfer.rope``) in its place, holding only the adapters: enough for
``test_rope_cos_sin_cache``, whose reference is PyTorch (vLLM's ``forward_native``).
"""

from __future__ import annotations

import os
import pathlib
import sys
import types

import pytest

CHECKOUT = pathlib.Path(__file__).resolve().parents[2]  # the ropekv checkout
if str(CHECKOUT) not in sys.path:
    sys.path.insert(0, str(CHECKOUT))

import ropekv

# ROPEKV_PEER_FORM=torch runs the adapters through ropekv.torch's custom ops instead of the eager
# functions (what a torch.compile user calls)
if os.environ.get("ROPEKV_PEER_FORM") == "torch":
    import ropekv.torch as _form
else:
    _form = ropekv

try:
    import flashinfer
    import flashinfer.rope
except ImportError:
    if os.environ.get("ROPEKV_PEER_STUB_FLASHINFER", "") in ("", "0"):
        raise
    flashinfer = types.ModuleType("flashinfer")
    flashinfer.rope = types.ModuleType("flashinfer.rope")
    flashinfer.__version__ = "stub (ROPEKV_PEER_STUB_FLASHINFER=1)"
    sys.modules["flashinfer"] = flashinfer
    sys.modules["flashinfer.rope"] = flashinfer.rope

CALLS = {"apply_rope_with_cos_sin_cache": 0, "apply_rope_with_cos_sin_cache_inplace": 0}


def apply_rope_with_cos_sin_cache(positions, query, key, head_size, cos_sin_cache, is_neox=True):
    """FlashInfer's signature; ropekv's kernel."""
    CALLS["apply_rope_with_cos_sin_cache"] += 1
    return _form.apply_rope_with_cos_sin_cache(
        positions, query, key, head_size, cos_sin_cache, is_neox=is_neox
    )


def apply_rope_with_cos_sin_cache_inplace(
    positions, query, key, head_size, cos_sin_cache, is_neox=True
):
    """FlashInfer's signature; ropekv's kernel."""
    CALLS["apply_rope_with_cos_sin_cache_inplace"] += 1
    _form.apply_rope_with_cos_sin_cache_inplace(
        positions, query, key, head_size, cos_sin_cache, is_neox=is_neox
    )


for _module in (flashinfer, flashinfer.rope):
    _module.apply_rope_with_cos_sin_cache = apply_rope_with_cos_sin_cache
    _module.apply_rope_with_cos_sin_cache_inplace = apply_rope_with_cos_sin_cache_inplace


@pytest.fixture(autouse=True)
def _ropekv_must_be_called(request):
    before = sum(CALLS.values())
    yield
    name = request.node.name
    if name.startswith("test_rope_cos_sin_cache") or "cos_sin_cache" in request.node.originalname:
        assert sum(CALLS.values()) > before, f"{name} never reached ropekv's adapters"


def pytest_report_header(config):
    return (
        f"ropekv {ropekv.__version__} from {pathlib.Path(ropekv.__file__).parent}; "
        f"flashinfer {getattr(flashinfer, '__version__', '?')}: "
        f"apply_rope_with_cos_sin_cache(_inplace) replaced by ropekv adapters"
    )


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"ropekv adapter calls: {CALLS}")
