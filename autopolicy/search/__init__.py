"""The search: measure each layer under each policy on this machine, solve, verify, emit a map.

The search reaches models only through a :class:`ModelAdapter` (see
:mod:`autopolicy.search.adapter`); :func:`register_adapter` plugs in a new kind of model.
"""

from autopolicy.search import hardware, phases, result, solver, timing
from autopolicy.search._defaults import DEFAULT_CANDIDATES
from autopolicy.search.adapter import ModelAdapter, Program, TunableLayer, get_adapter, register_adapter
from autopolicy.search.phases import (
    AccuracyProfile,
    Budget,
    Configuration,
    LatencyProfile,
    LayerAccuracy,
    LayerTiming,
    Problem,
    Site,
)
from autopolicy.search.profiling import profile
from autopolicy.search.result import TuneResult, load_kernels, load_run
from autopolicy.search.tuner import tune
from autopolicy.search.workload import Phase, Request, parse_requests

__all__ = [
    "tune",
    "Phase",
    "Request",
    "parse_requests",
    "profile",
    "TuneResult",
    "load_run",
    "load_kernels",
    "DEFAULT_CANDIDATES",
    "ModelAdapter",
    "TunableLayer",
    "Program",
    "register_adapter",
    "get_adapter",
    "LatencyProfile",
    "LayerTiming",
    "AccuracyProfile",
    "LayerAccuracy",
    "Budget",
    "Problem",
    "Configuration",
    "Site",
    "hardware",
    "phases",
    "result",
    "solver",
    "timing",
]
