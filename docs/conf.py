"""Sphinx configuration of ropekv's documentation (build: see README, "Documentation")."""

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS.parent))  # document this checkout, installed or not

import ropekv
from ropekv import _registry

# The API page's op list and sections come from the op registry (ropekv/_registry.py): written
# here, before Sphinx reads docs/api.rst, which includes it.
(DOCS / "_generated").mkdir(exist_ok=True)
(DOCS / "_generated" / "ops.rst").write_text(_registry.api_summary())

project = "ropekv"
author = "the ropekv authors"
copyright = "the ropekv authors, Apache-2.0"
version = release = ropekv.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "numpydoc",
    "myst_parser",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
# design/: contributors' notes (decisions and their measurements), read in the repository next to
# the code; the published site is for users (see docs/design/README.md).
exclude_patterns = ["_build", "design", "_generated"]

# Public functions only; their docstrings are numpydoc, rendered by numpydoc.
autodoc_default_options = {"members": False}
autosummary_generate = False
# The signatures' type aliases (ropekv/_types.py) are Any at run time; render them by name, linked
# to their definitions on the API page, instead of as "Any".
autodoc_type_aliases = {
    "ArrayLike": "ropekv._types.ArrayLike",
    "StreamLike": "ropekv._types.StreamLike",
    "DTypeLike": "ropekv._types.DTypeLike",
}
numpydoc_show_class_members = False
numpydoc_xref_param_type = False
# Structure, not style: every parameter documented and no stray text read as one (PR01, PR02,
# PR04, PR05), a described Returns section where something is returned (RT01, RT03), an example
# (EX01), a docstring at all (GL08). Terse "name : type, shape, dtype" entries are the house style.
numpydoc_validation_checks = {"GL08", "PR01", "PR02", "PR04", "PR05", "RT01", "RT03", "EX01"}

# Markdown pages: `#` headings become link targets, so "conventions.md#the-cossin-table" works.
myst_heading_anchors = 3

html_theme = "alabaster"
html_title = f"ropekv {release}"
# Wide enough for the 100-column code and the API summary table.
html_theme_options = {
    "description": "Fused RoPE + KV-cache CUDA kernels",
    "fixed_sidebar": True,
    "page_width": "1240px",
    "body_max_width": "none",
}
html_static_path = ["_static"]
html_css_files = ["ropekv.css"]
