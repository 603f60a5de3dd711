"""docs/integration.md: its python blocks run on the NumPy backend and print what the page says."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "integration.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```\n\nprints `(.*?)`", PAGE, re.DOTALL)


def test_every_python_block_is_checked():
    assert len(BLOCKS) == PAGE.count("```python") == 3


def test_the_blocks_print_what_the_page_says():
    for code, printed in BLOCKS:
        done = subprocess.run(
            [sys.executable, "-c", code],
            check=False,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.strip() == printed, code
