"""The search: measure each layer under each policy on this machine, solve, verify, emit a map."""

from autopolicy.search import hardware, solver, timing
from autopolicy.search.profiling import profile
from autopolicy.search.result import TuneResult, load_run
from autopolicy.search.tuner import DEFAULT_CANDIDATES, tune

__all__ = ["tune", "profile", "TuneResult", "load_run", "DEFAULT_CANDIDATES", "hardware", "solver", "timing"]
