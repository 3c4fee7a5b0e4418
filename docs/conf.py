"""Sphinx configuration of pallas_emb's documentation site.

Built from the Markdown pages in this directory (MyST) and an API reference
generated from the docstrings of every public name (autodoc + autosummary,
Google-style sections through napoleon):

    pip install ".[docs]" && python -m sphinx -W -b html docs docs/_build/html

`-W` turns every warning into an error: a broken cross-reference between
pages, a public name without a docstring (`_require_docstring` below), a
page left out of the table of contents. The test suite builds it so
(`tests/test_docs.py`).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Import-time work of the library (JAX's backends) must not reach for a TPU.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

project = "pallas_emb"
author = "the pallas_emb authors"
copyright = "2026, the pallas_emb authors"  # noqa: A001 (Sphinx's name)
release = "0.1.0"

extensions = [
  "myst_parser",
  "sphinx.ext.autodoc",
  "sphinx.ext.autosummary",
  "sphinx.ext.napoleon",
  "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "benchmarks/*.json", "Thumbs.db", ".DS_Store"]
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]
autosummary_generate = True
# A class page: its docstring and its documented members (no summary tables).
templates_path = ["_templates"]
autodoc_member_order = "bysource"
autodoc_typehints = "none"
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# Attributes sections as fields of their class: autodoc documents the members.
napoleon_use_ivar = True
# "Returns: (a, b): ..." describes a tuple, not a type to cross-reference.
napoleon_use_rtype = False
html_theme = "alabaster"
html_title = "pallas_emb"
html_theme_options = {"description": "Row-sharded embedding tables for JAX", "fixed_sidebar": True}
suppress_warnings = ["myst.header"]
# Docstrings write `name` for code, as Markdown does.
default_role = "code"


def _require_docstring(app, what, name, obj, options, lines):
  """A public name without a docstring is a build error (with -W)."""
  del options
  if not any(line.strip() for line in lines) and what in ("class", "function", "exception"):
    from sphinx.util import logging  # pylint: disable=g-import-not-at-top

    logging.getLogger(__name__).warning(f"{name} has no docstring")


def setup(app):
  app.connect("autodoc-process-docstring", _require_docstring)
