"""Sphinx configuration of the edgc manual (`make docs`; the test `tests/core/test_docs.py` builds it
with warnings as errors)."""

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
# The source tree first, so that autodoc documents this checkout even when another one is installed.
sys.path[:0] = [str(DOCS.parent / "src"), str(DOCS / "_ext")]

project = "edgc"
copyright = "the edgc authors"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.mathjax", "edgc_docs"]
# The docstrings are Google-style (`Args:`, `Returns:`, `Raises:`; tests/core/test_docstrings.py): napoleon
# renders them as parameter lists; NumPy-style sections are not read, so no other underlined text becomes one.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build", "img", "_ext", "_static"]
myst_enable_extensions = ["dollarmath", "deflist"]
# GitHub's anchors, so `page.md#a-heading` links work on the site as on GitHub.
myst_heading_anchors = 3
autodoc_member_order = "bysource"
autoclass_content = "both"  # a class's docstring and its __init__'s: the constructor's arguments are in either
autodoc_typehints = "signature"
html_theme = "furo"
html_static_path = ["_static"]
html_css_files = ["edgc.css"]  # wide tables scroll
html_title = "edgc"
