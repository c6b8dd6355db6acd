"""Sphinx configuration of the autopolicy documentation (Sphinx + MyST + autodoc/autosummary).

Build (warnings are errors): ``python -m sphinx -W --keep-going -b html docs docs/_build/html``.
"""

import os
import pathlib
import sys

DOCS = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS / "_ext"))
sys.path.insert(0, str(DOCS.parent))  # the package, also when it is not installed
os.environ.setdefault("KERAS_BACKEND", "jax")  # autopolicy.keras is documented from Keras's JAX backend

project = "autopolicy"
author = "the autopolicy authors"
copyright = "the autopolicy authors"  # noqa: A001  (Sphinx's name)

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "autopolicy_cli_docs",
    "autopolicy_api_docs",
]

# reStructuredText first: autosummary writes its generated stubs with the first suffix.
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]
templates_path = ["_templates"]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

autosummary_generate = True
autosummary_imported_members = False
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # "Attributes:" as fields, not a second description of each dataclass field
napoleon_use_rtype = False

#: Every name in these modules' __all__ must be documented (autopolicy_api_docs checks it).
autopolicy_api_modules = [
    "autopolicy",
    "autopolicy.policies",
    "autopolicy.datasets",
    "autopolicy.nn",
    "autopolicy.search",
    "autopolicy.numerics",
    "autopolicy.numerics.pallas_weight_only",
    "autopolicy.numerics.gemm_forms",
    "autopolicy.train",
    "autopolicy.keras",
    "autopolicy.flax",
    "autopolicy.llamacpp",
    "autopolicy.experiment",
    "autopolicy.report",
    "autopolicy.distributed",
    "autopolicy.cli",
]

html_theme = "alabaster"
html_title = "autopolicy"
html_theme_options = {"description": "The fastest per-layer dtype policies within an accuracy budget, measured "
                                     "on your machine", "fixed_sidebar": True}
smartquotes = False  # "--flag" stays two hyphens in generated and written text
