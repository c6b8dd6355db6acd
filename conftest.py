"""Doctests of modules that import an optional extra are collected only where it is installed
(the extra's own test tier, in the README, runs them)."""

import importlib.util

collect_ignore = []
if importlib.util.find_spec("flax") is None or importlib.util.find_spec("qwix") is None:
    collect_ignore += ["autopolicy/flax.py", "autopolicy/adapters/flax.py", "autopolicy/adapters/_flax_rules.py",
                       "autopolicy/adapters/_flax_save.py"]
if importlib.util.find_spec("keras") is None:
    collect_ignore += ["autopolicy/keras.py", "autopolicy/_cli_keras.py", "autopolicy/_tuned_keras.py",
                       "autopolicy/adapters/keras.py",
                       "autopolicy/adapters/_keras_kernels.py", "autopolicy/adapters/_keras_layers.py",
                       "autopolicy/adapters/_keras_models.py"]
