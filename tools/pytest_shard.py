"""pytest plugin: run every ``SHARD_N``-th collected test, from the ``SHARD_I``-th on (0-based).

``tools/sanitize.sh memcheck-shards N`` runs the GPU suite under memcheck as N such processes at
once (pytest-xdist's workers do not start under compute-sanitizer; one process no longer fits in
the device machines' 10 minutes a command). Load it with ``-p pytest_shard`` and ``tools/`` on
``PYTHONPATH``.
"""

import os


def pytest_collection_modifyitems(config, items):
    n, i = int(os.environ.get("SHARD_N", "1")), int(os.environ.get("SHARD_I", "0"))
    if n <= 1:
        return
    keep = [it for k, it in enumerate(items) if k % n == i]
    drop = [it for k, it in enumerate(items) if k % n != i]
    config.hook.pytest_deselected(items=drop)
    items[:] = keep
