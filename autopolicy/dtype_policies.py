"""Keras's name for :mod:`autopolicy.policies` (``keras.dtype_policies``)."""

from autopolicy.policies import *  # noqa: F401,F403
from autopolicy.policies import __all__  # noqa: F401
