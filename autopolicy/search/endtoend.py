"""Whole-model timings of configurations, in paired rounds, cached as a group.

Every configuration is compiled once; rounds time all of them (or a pair) in a random order,
so any two that shared a round compare paired. A group of rounds is cached under the set of
maps it timed: a rerun of the same run reuses it and makes the same decision without timing.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from autopolicy import _multihost, policies
from autopolicy.search import timing
from autopolicy.search.cache import MeasurementCache, key
from autopolicy.search.confidence import Speedup, paired_speedup
from autopolicy.search.phases import Configuration, failed

__all__ = ["EndToEnd", "config_key"]


def config_key(config: Configuration) -> str:
    """A configuration's identity for timing: its map (equal maps are one model), and the
    kernels it runs where they are not the profile's."""
    if config.kernels:
        return key(policies.serialize(config.policy_map), [list(k) for k in config.kernels])
    return key(policies.serialize(config.policy_map))


class EndToEnd:
    """Paired end-to-end timings of the configurations of one run.

    Args:
      adapter: The model adapter (its ``model_program`` turns a model into a timed program).
      models: The models by configuration name.
      cache, fingerprint, digest, shapes: Where and under what the groups are cached.
    """

    def __init__(self, adapter: Any, models: dict, cache: MeasurementCache, fingerprint: str, digest: str,
                 shapes: list, step_carry: Callable[[tuple, Any], tuple] | None = None):
        self.adapter = adapter
        self.step_carry = step_carry  # a stateful step's carry (timing.Candidate.carry)
        self.models = models
        self.cache = cache
        self.prefix = (fingerprint, digest, shapes, timing.METHOD)
        self.rounds: list[dict[str, float]] = []  # seconds per call by config key, round by round
        self.timer: timing.Timer | None = None
        self.extra_seconds = 0.0  # spent on rounds taken to settle close calls
        self.from_cache = False
        self._cpu_per_wall: list[float] = []
        self._starts: dict[str, int] = {}
        self._cached_groups: set[str] = set()
        self.failed: dict[str, str] = {}  # config key -> why its program could not be built or compiled

    def failure(self, config: Configuration) -> str:
        """Why ``config``'s model could not be timed ("" when it was)."""
        return self.failed.get(config_key(config), "")

    def time_group(self, configs: Sequence[Configuration], rounds: int, tag: str) -> str:
        """Times ``rounds`` rounds of ``configs`` together, or loads them from the cache.

        Returns the group's cache key (see :meth:`persist`)."""
        keys = sorted({config_key(c) for c in configs})
        group = key(*self.prefix, tag, keys, rounds)
        cached = self.cache.lookup(group)
        self._starts[group] = len(self.rounds)
        self.from_cache = cached is not None
        if cached is not None:
            self.rounds += [dict(r) for r in cached["rounds"]]
            self._cached_groups.add(group)
            return group
        self._time(configs, rounds)
        self.persist(group)
        return group

    def time_until(self, configs: Sequence[Configuration], rounds: int, step: int,
                   pending: Callable[[], Sequence[Configuration]], tag: str, first: bool = False) -> str:
        """Times ``configs`` in steps of ``step`` rounds, then only those ``pending()`` names
        (asked after each step, on every round so far: the configurations whose figures are
        still undecided, with their reference), until it names none or ``rounds`` rounds; or
        loads the rounds from the cache. With ``first``, ``pending()`` is asked before the
        first step too: configurations that earlier groups' rounds already decided are not
        timed again (none at all when it names none).

        Returns the group's cache key (see :meth:`persist`)."""
        keys = sorted({config_key(c) for c in configs})
        group = key(*self.prefix, tag, keys, rounds, step, "narrowing")
        cached = self.cache.lookup(group)
        self._starts[group] = len(self.rounds)
        self.from_cache = cached is not None
        if cached is not None:
            self.rounds += [dict(r) for r in cached["rounds"]]
            self._cached_groups.add(group)
            return group
        done, todo = 0, list(pending() if first else configs)
        while done < rounds and todo:
            self._time(todo, min(step, rounds - done))
            done += step
            todo = list(pending())
        self.persist(group)
        return group

    def persist(self, group: str) -> None:
        """Caches every round taken since ``group`` began (its extra rounds included); a group
        that came from the cache is left as it was (a group timed afresh after one that was
        cached is still saved)."""
        if group not in self._cached_groups:
            # Shared with later runs on this machine (keyed by its fingerprint and the model).
            self.cache.put(group, {"rounds": self.rounds[self._starts[group]:]}, share=True)
            self.cache.flush()

    def _time(self, configs: Sequence[Configuration], rounds: int) -> None:
        names = {config_key(c): c for c in configs if config_key(c) not in self.failed}
        todo = {}
        for k, config in list(names.items()):
            if self.timer is not None and k in self.timer.runners:
                continue
            try:  # a configuration whose program fails to build or compile is excluded, not fatal
                if config.name not in self.models:
                    raise RuntimeError(f"its model could not be built ({config.excluded or 'no model'})")
                program = self.adapter.model_program(self.models[config.name])
                todo[k] = timing.Candidate(program.fn, program.args, program.state, carry=self.step_carry)
            except Exception as e:  # pylint: disable=broad-except
                self.failed[k] = failed("compile or run", e)
                del names[k]
        if todo:
            if self.timer is None:
                # A whole model's call is long next to a loop iteration's own cost: its loop is
                # not unrolled (eight copies of a model would multiply its compile time).
                self.timer = timing.Timer({}, unroll=1)
            errors: dict[str, Exception] = {}
            self.timer.add(todo, errors=errors)  # compiled in parallel, then warmed up one by one
            for k, e in errors.items():
                self.failed[k] = failed("compile or run", e)
                del names[k]
        if not names:
            return
        before = {k: len(self.timer.samples[k]) for k in names}
        self.timer.rounds(rounds, list(names))
        for i in range(rounds):
            self.rounds.append({k: self.timer.samples[k][before[k] + i] for k in names})
        self._cpu_per_wall.append(self.timer.cpu_per_wall)

    def more(self, configs: Sequence[Configuration], rounds: int) -> bool:
        """Takes more rounds of ``configs`` to settle a close call; False when it cannot (the
        latest group came from the cache: the cached decision stands). A group timed afresh
        after groups loaded from the cache (a later run's new map) may take them."""
        if self.from_cache:
            return False
        start = time.perf_counter()
        self._time(configs, rounds)
        # The slowest process's time: every process must stop taking rounds at the same moment.
        self.extra_seconds += float(_multihost.slowest([time.perf_counter() - start])[0])
        return True

    def samples(self, config: Configuration) -> list[float]:
        k = config_key(config)
        return [r[k] for r in self.rounds if k in r]

    def rounds_together(self, configs: Sequence[Configuration]) -> int:
        """How many rounds timed every one of ``configs``."""
        keys = {config_key(c) for c in configs}
        return sum(1 for r in self.rounds if keys <= r.keys())

    def summary(self, config: Configuration) -> timing.Timing:
        return timing.summarize(self.samples(config))

    def speedup(self, candidate: Configuration, reference: Configuration) -> Speedup:
        """``candidate``'s speed-up over ``reference`` from the rounds that timed both."""
        a, b = config_key(candidate), config_key(reference)
        if a == b:
            n = len(self.samples(candidate))
            return Speedup(1.0, 1.0, 1.0, n)
        pairs = [(r[b], r[a]) for r in self.rounds if a in r and b in r]
        return paired_speedup([p[0] for p in pairs], [p[1] for p in pairs])

    @property
    def cpu_per_wall(self) -> float:
        values = [v for v in self._cpu_per_wall if v == v]
        return sum(values) / len(values) if values else float("nan")
