"""Progress of the phases of a run: bars on a terminal, one line per phase elsewhere
(:mod:`autopolicy._progress`)."""

from autopolicy._progress import progress

__all__ = ["progress"]
