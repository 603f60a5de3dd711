"""What the tests change when tools/sanitize.sh runs them (it sets ROPEKV_UNDER_SANITIZER=1).

torch.compile's CUDA-graph trees check their private memory pool with a debug assertion ("tensor(s)
in the cudagraph pool not tracked as outputs") that fails under compute-sanitizer for any custom op
returning an output the compiled graph drops, ropekv's or a pure-torch one alike, and passes without
the sanitizer. Under the sanitizer that one assertion is switched off; the tests' own checks of the
results still run.
"""

from __future__ import annotations

from ropekv._env import env_flag

TORCH_SETUP = "import torch._inductor.config as _c; _c.triton.slow_path_cudagraph_asserts = False\n"


def active():
    return env_flag("ROPEKV_UNDER_SANITIZER")


def setup_torch():
    """Switch the assertion off in this process (if torch is installed)."""
    try:
        exec(TORCH_SETUP, {})  # noqa: S102 - the snippet test_frameworks_docs' subprocesses run
    except ImportError:
        pass
