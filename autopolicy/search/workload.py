"""Workloads: an objective of several timed phases, such as a server's prefill then decode steps.

A generation is a prefill of P prompt tokens, then G decode steps, and a choice can win one and
lose the other (a kernel chosen for a one-row decode step can be slower over a 512-row prompt).
A workload states what one unit of work is: :class:`Phase` objects, each a call of the model
(its arguments, like ``tune``'s ``sample_input``), how many such calls one unit makes (its
``weight``), and for a stateful step the carry that chains its calls. ``tune(...,
workload=phases)`` then

- times every layer under every candidate in each phase (its input shape there) and solves on
  the weighted sum of the phases' seconds, a layer's kernel being the one fastest over the sum;
- times each configuration end to end in each phase, in the same rounds, and decides on the
  weighted sum of its phases' times, round by round (paired with float32's);
- reports each phase's time beside the total (``Configuration.phase_latency_s``).

Requests, as the command line writes them (``--workload prefill=512,decode=128``, or several
separated by ``;`` with a ``weight=`` each), are parsed by :func:`parse_requests`; an experiment
turns them into phases (for a language model, :func:`autopolicy.nn.generation.workload_phases`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

from autopolicy.search import timing
from autopolicy.search.cache import key
from autopolicy.search.endtoend import EndToEnd
from autopolicy.search.phases import Configuration, LatencyProfile, LayerTiming

__all__ = ["Phase", "Request", "parse_requests", "check_phases", "combine_profiles", "PhasedEndToEnd"]

_REQUEST_KEYS = ("prefill", "decode", "weight")


@dataclasses.dataclass(frozen=True)
class Phase:
    """One timed call of a workload.

    Attributes:
      name: Its name in reports (``"prefill 512"``); unique within the workload.
      sample_input: The call's arguments (a tuple, or one array), as ``tune``'s ``sample_input``.
      weight: How many such calls one unit of the workload makes (> 0): the total is
        ``sum(weight * seconds per call)``.
      step_carry: For a stateful step (a decode step and its cache): the next call's arguments
        from the last one's and its outputs, as ``tune``'s ``step_carry``. None: stateless.
    """

    name: str
    sample_input: Any
    weight: float = 1.0
    step_carry: Callable[[tuple, Any], tuple] | None = None


@dataclasses.dataclass(frozen=True)
class Request:
    """A generation request: ``prefill`` prompt tokens, then ``decode`` new tokens; ``weight``
    is its share of the traffic (any positive number: the requests' weights are relative).

    >>> Request(512, 128)
    Request(prefill=512, decode=128, weight=1.0)
    """

    prefill: int
    decode: int
    weight: float = 1.0

    def __post_init__(self) -> None:
        for name in ("prefill", "decode"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"A request's {name} must be an int >= 0. Received: {name}={value!r}")
        if self.prefill < 1:
            raise ValueError(f"A request needs a prompt: prefill must be >= 1. Received: prefill={self.prefill}")
        if isinstance(self.weight, bool) or not isinstance(self.weight, (int, float)) or not (
                math.isfinite(self.weight) and self.weight > 0):
            raise ValueError(f"A request's weight must be a finite number > 0. Received: weight={self.weight!r}")


def parse_requests(text: str) -> tuple[Request, ...]:
    """The requests of a workload as the command line writes it: ``prefill=P,decode=G`` with an
    optional ``,weight=W``; several requests separated by ``;``.

    >>> parse_requests("prefill=512,decode=128")
    (Request(prefill=512, decode=128, weight=1.0),)
    >>> [r.weight for r in parse_requests("prefill=64,decode=256,weight=3; prefill=512,decode=16")]
    [3.0, 1.0]

    Raises:
      ValueError: naming the bad part and the form expected.
    """
    form = "prefill=P,decode=G[,weight=W] (several separated by ';'), e.g. prefill=512,decode=128"
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"A workload is {form}. Received: {text!r}")
    requests = []
    for part in text.split(";"):
        fields: dict[str, Any] = {}
        for item in part.split(","):
            name, sep, value = item.partition("=")
            name, value = name.strip(), value.strip()
            if not sep or name not in _REQUEST_KEYS or name in fields:
                raise ValueError(f"Invalid workload request {part.strip()!r}: {item.strip()!r} is not one of "
                                 f"{', '.join(k + '=' for k in _REQUEST_KEYS)} (each once). Expected {form}")
            try:
                fields[name] = float(value) if name == "weight" else int(value)
            except ValueError:
                kind = "a number" if name == "weight" else "an int"
                raise ValueError(f"Invalid workload request {part.strip()!r}: {name} must be {kind}. "
                                 f"Received: {name}={value!r}") from None
        if "prefill" not in fields or "decode" not in fields:
            raise ValueError(f"Invalid workload request {part.strip()!r}: it needs both prefill= and decode=. "
                             f"Expected {form}")
        requests.append(Request(**fields))
    return tuple(requests)


def check_phases(workload: Any) -> tuple[Phase, ...]:
    """``workload`` as a tuple of phases, checked: at least one, each a :class:`Phase` with a
    unique name, a finite weight > 0 and a callable (or no) carry.

    Raises:
      TypeError, ValueError: naming the bad phase.
    """
    if isinstance(workload, Phase):
        workload = (workload,)
    try:
        phases = tuple(workload)
    except TypeError:
        raise TypeError(f"workload must be a sequence of autopolicy.search.Phase, or None. "
                        f"Received: workload={workload!r}") from None
    if not phases:
        raise ValueError("workload must hold at least one Phase (or be None: the sample input's call).")
    names = set()
    for p in phases:
        if not isinstance(p, Phase):
            raise TypeError(f"workload must hold autopolicy.search.Phase objects. Received: {p!r}")
        if not isinstance(p.name, str) or not p.name or "@" in p.name or p.name in names:
            raise ValueError(f"Each phase needs a unique, non-empty name without '@'. Received: name={p.name!r}")
        names.add(p.name)
        if isinstance(p.weight, bool) or not isinstance(p.weight, (int, float)) or not (
                math.isfinite(p.weight) and p.weight > 0):
            raise ValueError(f"Phase {p.name!r}: weight must be a finite number > 0 (calls per unit of work). "
                             f"Received: weight={p.weight!r}")
        if p.step_carry is not None and not callable(p.step_carry):
            raise TypeError(f"Phase {p.name!r}: step_carry must be callable or None. Received: {p.step_carry!r}")
    return phases


def _phase_seconds(profile: LatencyProfile, site: Any, policy: str, seconds: float) -> float:
    """A layer's seconds in one phase's model: no less than its weight bytes at the phase's
    streaming rate (:meth:`LatencyProfile.latency_s`'s rule)."""
    timing = profile.timings[site.path][policy]
    if profile.bandwidth is None or site.layer.gather:
        return seconds
    return max(seconds, timing.nbytes / profile.bandwidth)


def combine_profiles(profiles: Sequence[LatencyProfile], weights: Sequence[float]) -> LatencyProfile:
    """One profile whose layer and cast seconds are the phases' weighted sums (seconds per unit
    of work), on the first phase's sites.

    Each layer's kernel is the one with the least weighted sum among the kernels every phase
    timed (so a layer runs one kernel in every phase); its ``tactics`` are those sums. The
    streaming floor of each phase (:meth:`LatencyProfile.latency_s`) is applied per phase
    before summing, so the combined profile has no bandwidth of its own. Fidelity
    (``output_error``) and bytes are the first phase's.

    Raises:
      ValueError: when the phases' models do not have the same tunable layers.
    """
    first = profiles[0]
    paths = [s.path for s in first.sites]
    for profile in profiles[1:]:
        if [s.path for s in profile.sites] != paths:
            raise ValueError("The workload's phases must run the same tunable layers; their models differ "
                             f"({len(paths)} layers against {len(profile.sites)}).")
    sites = [{s.path: s for s in p.sites} for p in profiles]
    timings: dict[str, dict[str, LayerTiming]] = {}
    for site in first.sites:
        row = {}
        for policy, base in first.timings[site.path].items():
            per_phase = [p.timings[site.path][policy] for p in profiles]
            common = None
            for t in per_phase:
                names = {k for k, _ in t.tactics}
                common = names if common is None else common & names
            if common:
                sums = {k: sum(w * _phase_seconds(p, s[site.path], policy, dict(t.tactics)[k])
                               for w, p, s, t in zip(weights, profiles, sites, per_phase))
                        for k in sorted(common)}
                kernel = min(sums, key=lambda k: sums[k])
                tactics = tuple(sums.items())
            else:
                kernel, tactics = base.kernel, ()
            # The phases' own choices where no common tactic was timed; a chosen kernel's sum.
            total = (dict(tactics)[kernel] if tactics else
                     sum(w * _phase_seconds(p, s[site.path], policy, t.latency_s)
                         for w, p, s, t in zip(weights, profiles, sites, per_phase)))
            scale = total / base.latency_s if base.latency_s > 0 else 1.0
            row[policy] = dataclasses.replace(
                base, latency_s=total, latency_p25_s=base.latency_p25_s * scale,
                latency_p75_s=base.latency_p75_s * scale, latency_cv=max(t.latency_cv for t in per_phase),
                repeats=min(t.repeats for t in per_phase), finite=all(t.finite for t in per_phase),
                kernel=kernel, tactics=tactics)
        timings[site.path] = row
    casts: dict = {}
    for site in first.sites:
        own = [p.site_casts(s[site.path]) for p, s in zip(profiles, sites)]
        for pair in set().union(*own):
            value = sum(w * c.get(pair, 0.0) for w, c in zip(weights, own))
            k = (site.input_shape, *pair)
            casts[k] = max(casts.get(k, 0.0), value)  # sites of one shape in one phase, another in the next
    return LatencyProfile(first.sites, timings, casts, None)


class PhasedEndToEnd(EndToEnd):
    """:class:`~autopolicy.search.endtoend.EndToEnd` over a workload's phases: every round times
    each configuration in every phase (one :class:`EndToEnd` each), and records the weighted sum
    as the configuration's time in that round (so speed-ups pair totals round by round) beside
    each phase's own (``"<key>@<phase>"``); groups are cached under all the phases' identities.

    Args:
      phases: One :class:`EndToEnd` per phase (each with its adapter, arguments and carry).
      names: The phases' names.
      weights: Calls of each phase per unit of work.
    """

    def __init__(self, phases: Sequence[EndToEnd], names: Sequence[str], weights: Sequence[float]):
        first = phases[0]
        super().__init__(None, first.models, first.cache, first.prefix[0],
                         key(*(p.prefix for p in phases), list(names), list(weights)), [], None, first.kernels)
        self.phases, self.names, self.weights = list(phases), list(names), [float(w) for w in weights]

    def _time(self, configs: Sequence[Configuration], rounds: int) -> None:
        added = []
        for phase in self.phases:
            before = len(phase.rounds)
            phase._time(configs, rounds)  # pylint: disable=protected-access
            added.append(phase.rounds[before:])
            self.failed.update(phase.failed)
        for i in range(min(len(a) for a in added)):
            own = [a[i] for a in added]
            common = set.intersection(*(set(r) for r in own)) - set(self.failed)
            entry = {k: sum(w * r[k] for w, r in zip(self.weights, own)) for k in common}
            entry.update({f"{k}@{n}": r[k] for n, r in zip(self.names, own) for k in common})
            self.rounds.append(entry)
        walls = [p.cpu_per_wall for p in self.phases if p.cpu_per_wall == p.cpu_per_wall]
        if walls:
            self._cpu_per_wall.append(sum(walls) / len(walls))

    def phase_medians(self, config: Configuration) -> tuple[tuple[str, float], ...]:
        """``(phase, median seconds per call)`` of ``config`` over the rounds that timed it."""
        k = self.key_of(config)
        out = []
        for name in self.names:
            values = [r[f"{k}@{name}"] for r in self.rounds if f"{k}@{name}" in r]
            if values:
                out.append((name, timing.summarize(values).median))
        return tuple(out)
