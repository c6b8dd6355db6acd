"""Doctests of modules that import an optional extra are collected only where it is installed."""

import importlib.util

collect_ignore = []
if importlib.util.find_spec("flax") is None or importlib.util.find_spec("qwix") is None:
    collect_ignore += ["autopolicy/flax.py", "autopolicy/adapters/flax.py", "autopolicy/adapters/_flax_rules.py",
                       "autopolicy/adapters/_flax_save.py"]
