"""Whole-model timings of configurations, in paired rounds, cached as a group.

Every configuration is compiled once; rounds time all of them (or a pair) in a random order,
so any two that shared a round compare paired. A group of rounds is cached under the set of
configurations it timed (each its map and the kernels its layers run): a rerun of the same run
reuses it and makes the same decision without timing, and a later run whose kernel choice
changed on some of them times only those again.
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
                 shapes: list, step_carry: Callable[[tuple, Any], tuple] | None = None,
                 kernels: dict[str, dict[str, str]] | None = None):
        self.adapter = adapter
        # {path: {policy: kernel}}: the kernel each layer runs under each policy (the profile's
        # choice), part of each configuration's identity in the rounds (key_of).
        self.kernels = kernels or {}
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

    def key_of(self, config: Configuration) -> str:
        """``config``'s identity in the rounds: its :func:`config_key` and the kernel each of its
        layers runs, so that a later run whose profile chose another kernel somewhere (a
        float8 layer's, say) still finds the rounds of the configurations that do not run it."""
        own = sorted((path, self.kernels[path][name]) for path, name in config.assignment.items()
                     if name in self.kernels.get(path, {}))
        return key(config_key(config), own) if own else config_key(config)

    def failure(self, config: Configuration) -> str:
        """Why ``config``'s model could not be timed ("" when it was)."""
        return self.failed.get(self.key_of(config), "")

    def time_group(self, configs: Sequence[Configuration], rounds: int, tag: str) -> str:
        """Times ``rounds`` rounds of ``configs`` together, or loads them from the cache.

        Where the same maps were timed before with another kernel on some of them (a later run
        whose profile chose differently there), the rounds of the unchanged ones are kept and
        only the changed ones are timed, with the first configuration (the reference) for
        their pairs.

        Returns the group's cache key (see :meth:`persist`)."""
        keys = sorted({self.key_of(c) for c in configs})
        group = key(*self.prefix, tag, keys, rounds)
        # The group these maps had last (looked up first, so that a rerun reuses this entry too).
        latest = key(*self.prefix, tag, sorted({config_key(c) for c in configs}), rounds, "latest")
        earlier = self.cache.lookup(latest)
        cached = self.cache.lookup(group)
        self._starts[group] = len(self.rounds)
        self.from_cache = cached is not None
        if cached is not None:
            self.rounds += [dict(r) for r in cached["rounds"]]
            self._cached_groups.add(group)
            return group
        # Peeked, not looked up: the new group records the rounds it keeps, and a rerun reads it.
        earlier_rounds = (self.cache.peek(earlier["group"]) or {}).get("rounds") if earlier else None
        same = set(keys) & set().union(*(r.keys() for r in earlier_rounds)) if earlier_rounds else set()
        todo = list(configs)
        if self.key_of(configs[0]) in same:  # the reference's rounds pair the kept ones
            # (A workload's rounds also hold each phase's time as "<key>@<phase>".)
            self.rounds += [{k: v for k, v in r.items() if k.split("@", 1)[0] in same} for r in earlier_rounds]
            todo = [c for c in configs if self.key_of(c) not in same]
        if todo:
            self._time(todo if todo == list(configs) else [configs[0]] + todo, rounds)
        self.cache.put(latest, {"group": group}, share=True)  # written with the group (persist flushes)
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
        keys = sorted({self.key_of(c) for c in configs})
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
        names = {self.key_of(c): c for c in configs if self.key_of(c) not in self.failed}
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
        k = self.key_of(config)
        return [r[k] for r in self.rounds if k in r]

    def rounds_together(self, configs: Sequence[Configuration]) -> int:
        """How many rounds timed every one of ``configs``."""
        keys = {self.key_of(c) for c in configs}
        return sum(1 for r in self.rounds if keys <= r.keys())

    def summary(self, config: Configuration) -> timing.Timing:
        return timing.summarize(self.samples(config))

    def speedup(self, candidate: Configuration, reference: Configuration) -> Speedup:
        """``candidate``'s speed-up over ``reference`` from the rounds that timed both."""
        a, b = self.key_of(candidate), self.key_of(reference)
        if a == b:
            n = len(self.samples(candidate))
            return Speedup(1.0, 1.0, 1.0, n)
        pairs = [(r[b], r[a]) for r in self.rounds if a in r and b in r]
        return paired_speedup([p[0] for p in pairs], [p[1] for p in pairs])

    @property
    def cpu_per_wall(self) -> float:
        values = [v for v in self._cpu_per_wall if v == v]
        return sum(values) / len(values) if values else float("nan")
