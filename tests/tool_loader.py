"""The repository's ``tools/*.py`` scripts loaded as modules, for the tests of the tools (they are
scripts, not a package: each is loaded from its file)."""

import importlib.util
import pathlib

TOOLS = pathlib.Path(__file__).resolve().parents[1] / "tools"


def load_tool(name):
    """``tools/<name>.py`` as a module named ``ropekv_<name>``."""
    spec = importlib.util.spec_from_file_location(f"ropekv_{name}", TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
