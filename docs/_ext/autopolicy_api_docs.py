"""The API reference: every public name documented once, and shown well.

- ``autopolicy-reexports``: a table of the names of a module's ``__all__`` documented under
  another module (``autopolicy.DTypePolicy`` is ``autopolicy.policies.DTypePolicy``), each a
  link; a name documented nowhere is a warning (an error under ``-W``).
- A check: every name in the ``__all__`` of each module in ``autopolicy_api_modules`` is
  documented somewhere in the site (under its own name or, for a re-export, another), else the
  build warns, naming it. A submodule's members that one of those modules exports are documented
  there, not again.
- Hooks on autodoc: a constant shows its ``#:`` comment rather than its type's docstring, a
  method no docstring inherited from the standard library, and an ``autopolicy.nn`` module its
  ``__init__``'s signature rather than its metaclass's ``__call__(*args, **kwargs)``.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import types
from typing import Any

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx import addnodes
from sphinx.application import Sphinx
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

from autopolicy_cli_docs import literal, table

logger = logging.getLogger(__name__)


def _xref(target: str, text: str) -> addnodes.pending_xref:
    ref = addnodes.pending_xref("", refdomain="py", reftype="obj", reftarget=target, refexplicit=True,
                                refwarn=True)
    ref += literal(text)
    return ref


class ReexportsDirective(SphinxDirective):
    """``.. autopolicy-reexports:: autopolicy``: each name of the module's ``__all__`` found in
    one of the ``:from:`` modules, linked to its documentation there."""

    required_arguments = 1
    option_spec = {"from": directives.unchanged_required, "exclude": directives.unchanged}

    def run(self) -> list[nodes.Node]:
        module = importlib.import_module(self.arguments[0])
        sources = [importlib.import_module(name) for name in self.options["from"].split()]
        exclude = set((self.options.get("exclude") or "").split())
        rows = []
        for name in module.__all__:
            obj = getattr(module, name)
            if name in exclude or isinstance(obj, types.ModuleType):
                continue
            home = next((s for s in sources if name in getattr(s, "__all__", ()) and getattr(s, name) is obj), None)
            if home is None:
                logger.warning("%s.%s is in __all__ but in none of %s: document it (autosummary) and list it in "
                               ":exclude:", module.__name__, name, self.options["from"], location=self.get_location())
                continue
            rows.append([literal(f"{module.__name__}.{name}"), _xref(f"{home.__name__}.{name}",
                                                                      f"{home.__name__}.{name}")])
        return [table(("name", "documented as"), rows, (1, 1))]


def _resolve(fullname: str) -> Any:
    """The object a documented name stands for, or None."""
    parts = fullname.split(".")
    for i in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:i])
        if module in sys.modules:
            obj: Any = sys.modules[module]
            try:
                for part in parts[i:]:
                    obj = getattr(obj, part)
            except AttributeError:
                return None
            return obj
    return None


def _identity(obj: Any) -> Any:
    """What makes two exported names the same object: the object, for classes and functions
    (constants such as strings are compared by name instead)."""
    return id(obj) if (inspect.isclass(obj) or callable(obj)) else None


def check_api_coverage(app: Sphinx, env: Any) -> None:
    """Warns for each public name (``__all__`` of ``autopolicy_api_modules``) the site documents
    nowhere."""
    domain = env.get_domain("py")
    documented = set(domain.objects)
    modules = set(domain.modules)
    same = {_identity(_resolve(name)) for name, entry in domain.objects.items()
            if entry.objtype in ("class", "function", "exception", "data", "decorator")} - {None}
    for module_name in app.config.autopolicy_api_modules:
        module = importlib.import_module(module_name)
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            if isinstance(obj, types.ModuleType):
                if obj.__name__ not in modules:
                    logger.warning("module %s (in %s.__all__) is not documented in the API reference",
                                   obj.__name__, module_name)
                continue
            if f"{module_name}.{name}" in documented or _identity(obj) in same:
                continue
            logger.warning("%s.%s (in __all__) is not documented in the API reference "
                           "(docs/reference/api.md)", module_name, name)


def skip_reexports(app: Sphinx, what: str, name: str, obj: Any, skip: bool, options: Any) -> bool | None:
    """A submodule's members that a main API module exports are documented there, not again."""
    del app, name, skip, options
    if what == "module" and _identity(obj) is not None and _identity(obj) in _MAIN_IDS:
        return True
    return None


_MAIN_IDS: set[int] = set()


def _main_ids(app: Sphinx) -> None:
    ids = _MAIN_IDS
    for module_name in app.config.autopolicy_api_modules:
        module = importlib.import_module(module_name)
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            if not isinstance(obj, types.ModuleType) and _identity(obj) is not None:
                ids.add(_identity(obj))


def _attribute_doc(name: str, obj: Any) -> list[str]:
    """The ``#:`` comment of a constant where a module of the package defines it (autodoc reads
    comments only in the module it documents, and a re-export has none there)."""
    from sphinx.pycode import ModuleAnalyzer  # pylint: disable=import-outside-toplevel

    short = name.rsplit(".", 1)[-1]
    top = name.split(".", 1)[0]
    for module_name, module in sorted(sys.modules.items()):
        if module is None or not (module_name == top or module_name.startswith(top + ".")):
            continue
        for attribute, value in list(vars(module).items()):
            if value is not obj or (attribute != short and isinstance(obj, (str, int, float))):
                continue
            try:
                docs = ModuleAnalyzer.for_module(module_name).find_attr_docs()
            except Exception:  # pylint: disable=broad-except  # no source (a C extension)
                continue
            if ("", attribute) in docs:
                return list(docs[("", attribute)])
    return []


def _inherited_from_outside(name: str) -> bool:
    """Whether a method without a docstring of its own would show one of a class outside the
    package (``RayExecutor.submit``: ``concurrent.futures.Executor``'s)."""
    owner, _, member = name.rpartition(".")
    cls = _resolve(owner)
    if not inspect.isclass(cls) or getattr(vars(cls).get(member), "__doc__", "") is not None:
        return False
    source = next((c for c in cls.__mro__[1:] if getattr(vars(c).get(member), "__doc__", None)), None)
    return source is not None and not source.__module__.startswith(name.split(".", 1)[0])


def clean_docstrings(app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: list[str]) -> None:
    """A constant shows its ``#:`` comment, never its type's docstring (``str(object='')``,
    "Built-in immutable sequence"); a method shows no docstring of the standard library's."""
    del app, options
    if what in ("data", "attribute") and not inspect.isclass(obj) and not callable(obj) \
            and getattr(obj, "__doc__", None) == getattr(type(obj), "__doc__", None):
        lines[:] = _attribute_doc(name, obj)
    elif what == "method" and _inherited_from_outside(name):
        lines[:] = []


def init_signatures(app: Sphinx, what: str, name: str, obj: Any, options: Any, signature: str | None,
                    return_annotation: str | None) -> tuple[str, str | None] | None:
    """A class whose metaclass defines ``__call__(*args, **kwargs)`` (``autopolicy.nn``'s modules)
    shows its ``__init__``'s signature, not that one."""
    del app, name, options
    if what not in ("class", "exception") or not inspect.isclass(obj) or type(obj) is type \
            or "__call__" not in vars(type(obj)) or not inspect.isfunction(getattr(obj, "__init__", None)):
        return None
    from sphinx.util.inspect import signature as sphinx_signature  # pylint: disable=import-outside-toplevel
    from sphinx.util.inspect import stringify_signature  # pylint: disable=import-outside-toplevel

    try:
        init = sphinx_signature(obj.__init__, bound_method=True)
    except (TypeError, ValueError):
        return None
    return stringify_signature(init, show_return_annotation=False), return_annotation


def setup(app: Sphinx) -> dict[str, Any]:
    os.environ.setdefault("KERAS_BACKEND", "jax")
    app.add_config_value("autopolicy_api_modules", [], "env")
    app.add_directive("autopolicy-reexports", ReexportsDirective)
    app.connect("builder-inited", _main_ids)
    app.connect("autodoc-skip-member", skip_reexports)
    app.connect("autodoc-process-docstring", clean_docstrings)
    app.connect("autodoc-process-signature", init_signatures)
    app.connect("env-check-consistency", check_api_coverage)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
