"""Latency measurement on the target: jitted, warmed up, amortized, interleaved, medians.

Each candidate runs ``inner`` times inside one compiled loop, so dispatch overhead is paid once
per timed call (off CPUs, where a call's launch and synchronization and a loop's iterations cost
tens to hundreds of microseconds, a call is sized so they are a small share of it, and each
iteration runs several calls: :func:`choose_inner`, :func:`compile_loop`). Every call perturbs
its input by ``eps * carry`` where ``eps`` is a runtime zero and ``carry`` depends on the
previous output, and every output is carried out of the loop: XLA can neither hoist the work out
of the loop nor drop any of it. Candidates are timed round-robin in a fresh random order each
round, so drift (thermal, other processes) hits them alike.

With several JAX processes (``jax.distributed``) every process times the same programs in the
same order (the rounds' order is seeded, the number of calls per timed call agreed), and each
sample is the slowest process's (:func:`autopolicy._multihost.slowest`): a program over a mesh
that spans hosts is as fast as its slowest host, and every process then holds the same samples,
so every decision made from them is the same on each.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import os
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from autopolicy import _multihost
from autopolicy.numerics import _sharding

__all__ = ["Timing", "Candidate", "Timer", "choose_inner", "compile_async", "compile_lowered", "compile_loop", "check_carry", "measure", "summarize"]

#: Part of every cached timing's key: measurements taken by an older method (or an older kernel
#: implementation) are not reused.
METHOD = "loop-carry-7"
TARGET_CALL_SECONDS = 2e-3  # each timed call runs at least this long (amortizes dispatch)
MAX_INNER = 10000
#: The most of a timed call its fixed cost may take (:func:`choose_inner`).
FIXED_SHARE = 0.05
MAX_CALL_TARGETS = 5
#: Steps each timed call of a stateful candidate (a decode step and its cache: ``Candidate.carry``)
#: runs at least. A decoding loop runs its steps back to back in one program, so the step is timed
#: that way, the call's dispatch shared by the steps: sized from one step, as other whole models are
#: on CPUs, a SmolLM2 decode step (about 12 ms) ran once a call and carried 2-8 ms of the call's own
#: cost (2-core EPYC: 15.7 ms in the tune against 11.8 ms a token in ``greedy_generate``'s loop at
#: the same cache depth).
CARRIED_STEPS = 8
#: Calls per loop iteration off CPUs: a GPU's while loop costs ~35 us an iteration (its condition
#: goes to the host), many times a small layer's work; on an H200, layers of `encoder_latency`
#: timed one call an iteration summed to 4.3x the model, eight calls 1.0-1.3x.
UNROLL = 8


@dataclasses.dataclass(frozen=True)
class Timing:
    """Seconds per call of one candidate: median, quartiles, coefficient of variation."""

    median: float
    p25: float
    p75: float
    cv: float
    repeats: int
    inner: int  # calls per timed call (loop iterations times the calls each runs)
    samples: tuple[float, ...] = ()  # per-call seconds of each round, in round order

    def as_dict(self, prefix: str = "") -> dict[str, Any]:
        return {f"{prefix}{k}": (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(self).items()}


@dataclasses.dataclass
class Candidate:
    """``fn(state, *inputs)`` to time (``state`` may be None).

    Both are jit arguments, so weights in ``state`` stay runtime values, never compile-time
    constants. The loop perturbs ``inputs`` (never ``state``) from one iteration to the next.

    ``carry``, for a stateful step (a decoder's step with its key/value cache): ``carry(inputs,
    outputs)`` gives the next step's inputs, in the structure, shapes and dtypes of ``inputs``.
    The loop then feeds each step's state to the next, and each timed call starts where the last
    one stopped, its inputs donated: the step updates its state in place, as steady-state
    decoding does, instead of copying it from loop-invariant inputs every step (on SmolLM2's
    11.8 MB cache, 1.4-3.8 ms of a 11.4 ms int8 step).
    """

    fn: Callable[..., Any]
    inputs: tuple
    state: Any = None
    carry: Callable[[tuple, Any], tuple] | None = None

    def call(self, state: Any, inputs: tuple) -> Any:
        return self.fn(state, *inputs)


def _perturb(args: tuple, carry: jax.Array, eps: jax.Array) -> tuple:
    """Adds ``eps * carry`` (a runtime zero) to the first numeric input, elementwise.

    An elementwise add fuses into the layer's first operation and costs nothing measurable; a
    one-element update would copy the whole (loop-invariant) input every iteration.
    """
    leaves, treedef = jax.tree_util.tree_flatten(args)
    for i, leaf in enumerate(leaves):
        numeric = jnp.issubdtype(leaf.dtype, jnp.number) if isinstance(leaf, jax.Array) else False
        if numeric and leaf.size:
            leaves[i] = leaf + (eps * carry).astype(leaf.dtype)
            break
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _zeros_like_type(shape: Any) -> jax.Array:
    """Zeros of an abstract value's shape and dtype, with its sharding under Explicit mesh axes
    (a loop's carry must keep one type)."""
    sharding = getattr(shape, "sharding", None)
    spec = getattr(sharding, "spec", None)
    if spec is not None and any(entry is not None for entry in spec):
        return jnp.zeros(shape.shape, shape.dtype, out_sharding=sharding)
    return jnp.zeros(shape.shape, shape.dtype)


def compile_loop(candidate: Candidate, inner: int | None = None, unroll: int | None = None) -> Callable[..., None]:
    """Compiles dependent calls of the candidate, once, and returns a blocking runner.

    The number of iterations is a runtime argument of the compiled loop: ``runner(n)`` runs
    ``n`` (default ``inner``), so estimating a call's time and timing many calls share one
    compilation (whole models take seconds to compile). Each iteration runs ``unroll`` calls
    (``runner.calls_per_iteration``; default :data:`UNROLL` off CPUs, else 1; a stateful step
    runs one).
    """

    sharded = _sharding.spans_devices((candidate.state, candidate.inputs))
    if candidate.carry is not None and not sharded:
        return _compile_carried_loop(candidate, inner)
    if unroll is None:
        unroll = 1 if _platform(candidate) == "cpu" else UNROLL

    def loop(state, inputs, eps, count):
        def step(scalar):
            return candidate.call(state, _perturb(inputs, scalar, eps))

        def body(i, carry):
            scalar, out = carry
            for k in range(unroll):
                if sharded:
                    # A scalar taken from a sharded output would add a collective to every call
                    # timed (and Explicit axes refuse the slice): the inputs are perturbed by
                    # the call's index instead (times the runtime zero), which differs in every
                    # call, so no call can be hoisted out of the loop. (An optimization barrier
                    # tying the inputs to the previous outputs did not stop XLA:CPU from
                    # hoisting it: 64 iterations of a sharded 1024 x 1024 Dense took 1.7x one.)
                    index = (i * unroll + k).astype(jnp.float32)
                    out = candidate.call(state, _perturb(inputs, index, eps))
                    continue
                out = step(scalar)
                first = jax.tree_util.tree_leaves(out)[0]
                # Every output is part of the loop's result, so none of it can be dropped; the
                # next call depends on this one through ``scalar``, so nothing can be hoisted.
                scalar = scalar + first.reshape(-1)[0].astype(jnp.float32) * eps
            return scalar, out

        zero = jnp.zeros((), jnp.float32)
        shapes = jax.eval_shape(step, zero)
        init = (zero, jax.tree_util.tree_map(_zeros_like_type, shapes))
        return jax.lax.fori_loop(0, count, body, init)

    state = candidate.state
    arrays, rebuild, _ = _split_inputs(candidate.inputs)
    arrays = [jnp.asarray(a) for a in arrays]
    lowered = jax.jit(lambda st, arr, eps, n: loop(st, rebuild(arr), eps, n)).lower(
        state, arrays, jnp.float32(0.0), jnp.int32(1))
    # XLA compiles in a pool thread (the GIL released) while the caller lowers its next
    # candidates; the first call, or ``ready()``, waits for it.
    future = _compile_pool().submit(lowered.compile)
    eps = jnp.float32(0.0)
    default = jnp.int32(1 if inner is None else inner)
    cell: list = []

    def ready() -> Any:
        """The compiled loop (what XLA made of it: ``.as_text()``), once compiled."""
        if not cell:
            cell.append(future.result())
        return cell[0]

    def run(count: int | None = None) -> None:
        compiled = cell[0] if cell else ready()
        jax.block_until_ready(compiled(state, arrays, eps, default if count is None else jnp.int32(count)))

    run.ready = ready
    run.cancel = future.cancel
    run.calls_per_iteration = unroll
    return run


_POOL: list[concurrent.futures.ThreadPoolExecutor] = []


def compile_async(fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
    """``jax.jit(fn)`` lowered for ``args`` here and compiled in the pool that compiles timing
    loops: the future's result is the compiled program (call it with ``args``). Pass the future
    to :func:`measure` (``pending``) so that it is compiled before anything is timed."""
    return compile_lowered(jax.jit(fn).lower(*args))


def compile_lowered(lowered: Any) -> concurrent.futures.Future:
    """``lowered.compile()`` (a ``jax.stages.Lowered``) in the pool that compiles timing loops."""
    return _compile_pool().submit(lowered.compile)


def _compile_pool() -> concurrent.futures.ThreadPoolExecutor:
    """Threads that compile timing loops, one per core this process may use: XLA's CPU compiler
    runs one thread per compilation (a layer's four candidates compiled in 0.13 s on two threads
    against 0.19 s one after another, on a 2-core Xeon)."""
    if not _POOL:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        _POOL.append(concurrent.futures.ThreadPoolExecutor(max(1, cores), thread_name_prefix="autopolicy-compile"))
    return _POOL[0]


def _split_inputs(inputs: tuple) -> tuple[list, Callable[[Sequence[Any]], tuple], Callable[[tuple], tuple]]:
    """``(arrays, rebuild, arrays_of)``: the inputs' arrays (traced; anything else, flags or
    None, stays a Python constant), ``rebuild(arrays)`` -> inputs, and ``arrays_of(inputs)`` ->
    the arrays of inputs of the same structure (a stateful step's next inputs)."""
    leaves, treedef = jax.tree_util.tree_flatten(tuple(inputs))
    dynamic = [i for i, x in enumerate(leaves) if isinstance(x, (jax.Array, np.ndarray))]

    def rebuild(values):
        full = list(leaves)
        for i, v in zip(dynamic, values):
            full[i] = v
        return jax.tree_util.tree_unflatten(treedef, full)

    def arrays_of(following):
        following_leaves, following_def = jax.tree_util.tree_flatten(tuple(following))
        if following_def != treedef:
            raise ValueError(f"carry(inputs, outputs) must return the inputs' structure {treedef}. "
                             f"Received: {following_def}")
        return [following_leaves[i] for i in dynamic]

    return [leaves[i] for i in dynamic], rebuild, arrays_of


def _carried_step(candidate: Candidate) -> tuple[Callable[..., Any], list]:
    """``(step, arrays)`` of a stateful candidate: ``step(state, arrays, scalar, eps)`` runs one
    step and returns ``(scalar, kept outputs, next arrays)`` (the outputs not fed back are kept,
    so that none is dropped); ``arrays`` are the inputs' arrays."""
    arrays, rebuild, arrays_of = _split_inputs(candidate.inputs)

    def step(state, arrays, scalar, eps):
        current = rebuild(arrays)
        out = candidate.call(state, _perturb(current, scalar, eps))
        nxt = arrays_of(candidate.carry(current, out))
        fed = {id(x) for x in nxt}
        kept = [x for x in jax.tree_util.tree_leaves(out) if id(x) not in fed]
        first = jax.tree_util.tree_leaves(out)[0]
        return scalar + first.reshape(-1)[0].astype(jnp.float32) * eps, kept, nxt

    return step, arrays


def check_carry(candidate: Candidate) -> tuple[Callable[..., Any], list]:
    """Raises ValueError unless ``candidate.carry`` returns its inputs' structure, shapes and
    dtypes (traced only: nothing runs); else returns :func:`_carried_step`'s ``(step, arrays)``."""
    step, arrays = _carried_step(candidate)
    zero = jnp.zeros((), jnp.float32)
    _, _, nxt = jax.eval_shape(step, candidate.state, arrays, zero, zero)
    given = [jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)) for a in arrays]
    got = [jax.ShapeDtypeStruct(n.shape, n.dtype) for n in nxt]
    if got != given:
        raise ValueError(f"carry(inputs, outputs) must keep the inputs' shapes and dtypes {given}. Received: {got}")
    return step, arrays


def _compile_carried_loop(candidate: Candidate, inner: int | None) -> Callable[..., None]:
    """:func:`compile_loop` for a stateful step (``candidate.carry``): the inputs' arrays are the
    loop's carry, donated to each call and replaced by what it returns."""
    step, arrays = check_carry(candidate)

    def loop(state, arrays, eps, count):
        zero = jnp.zeros((), jnp.float32)
        _, kept, _ = jax.eval_shape(step, state, arrays, zero, eps)

        def body(_, c):
            scalar, _, current = c
            return step(state, current, scalar, eps)

        init = (zero, [jnp.zeros(k.shape, k.dtype) for k in kept], list(arrays))
        return jax.lax.fori_loop(0, count, body, init)

    def once(state, arrays, eps):
        return step(state, arrays, jnp.zeros((), jnp.float32), eps)

    # The state goes in as its flat leaves: a call then skips flattening the model's modules in
    # Python (a decode step's call is timed alone, with nothing to overlap that with).
    state, state_def = jax.tree_util.tree_flatten(candidate.state)

    def once_flat(leaves, arrays, eps):
        return once(jax.tree_util.tree_unflatten(state_def, leaves), arrays, eps)

    def loop_flat(leaves, arrays, eps, n):
        return loop(jax.tree_util.tree_unflatten(state_def, leaves), arrays, eps, n)

    # Copies: the calls donate them, and the caller's arrays must stay valid.
    holder = [[jnp.array(a, copy=True) for a in arrays]]
    eps = jnp.float32(0.0)
    default = 1 if inner is None else int(inner)
    # Compiled on first use: a call of one step runs the step alone, not a loop of one (on
    # SmolLM2 a loop of one step took about 4 ms more than the 11.3 ms int8 step).
    compiled: dict[bool, Any] = {}

    def run(count: int | None = None) -> None:
        n = default if count is None else int(count)
        single = n == 1
        if single not in compiled:
            fn, extra = (once_flat, ()) if single else (loop_flat, (jnp.int32(n),))
            compiled[single] = jax.jit(fn, donate_argnums=(1,)).lower(state, holder[0], eps, *extra).compile()
        result = compiled[single](state, holder[0], eps, *(() if single else (jnp.int32(n),)))
        holder[0] = list(result[2])  # the next call starts from this one's state
        jax.block_until_ready(result)

    # The Timer runs one untimed step right before each timed call: a decoding loop's steps
    # follow one another, so the step timed finds its weights where the last step left them,
    # not where another candidate's calls pushed them out (on SmolLM2, int8 steps timed cold
    # took 18.8 ms, steady ones 11.4-13.7).
    run.prime = lambda: run(1)
    return run


def _fastest_of_3(runner: Callable[[int], None], count: int) -> float:
    """The fastest of three calls of ``count`` iterations, the slowest process's (every process
    must run the same number of calls)."""
    return float(_multihost.slowest([min(_time_once(lambda: runner(count)) for _ in range(3))])[0])


def _platform(candidate: Candidate) -> str:
    """The platform of the candidate's arrays (the default backend's if it holds none)."""
    for leaf in jax.tree_util.tree_leaves((candidate.state, candidate.inputs)):
        if isinstance(leaf, jax.Array):
            return next(iter(leaf.devices())).platform
    return jax.default_backend()


def choose_inner(runner: Callable[[int], None], target_seconds: float = TARGET_CALL_SECONDS,
                 fixed_is_work: bool = False) -> int:
    """The iterations per timed call: enough for the call to last ``target_seconds`` and for its
    fixed cost (dispatch, the loop's set-up, and on a GPU the program's launch and
    synchronization) to be at most :data:`FIXED_SHARE` of it (the call lasting at most
    ``MAX_CALL_TARGETS`` targets).

    ``fixed_is_work`` (the search passes it on CPUs): the fixed cost is partly the layer's own
    work, which reads only the weights so that XLA can hoist it out of the loop (a cast or a
    reorder of the weights, say), and which a model pays in every call. The calls are then sized
    from one iteration alone (``target_seconds`` of it, fixed cost included), which keeps a share
    of it: on a 2-core Xeon, ``encoder_latency``'s int8 layers sized by the slope summed to 0.57x
    the model, sized from one iteration 1.07x (``benchmarks/bench_layer_sum.py``).

    A call of ``n`` iterations takes about ``fixed + n * per_iteration``. Both are estimated from
    calls of 1 iteration and of ``m`` (enough for ``target_seconds`` by the first, and at least
    2), ``m`` doubled while the longer call is not clearly longer (the slope between two nearly
    equal times is noise). Sizing from one iteration alone, as the timing method "loop-carry-5"
    did everywhere, let the fixed cost inflate short layers: on an H100 a 128-token Dense ran 5
    iterations per call and was timed at 0.2 ms, and layers timed alone summed to 26x the model;
    on a 2-core Xeon a 1024 x 1024 Dense on 1024 rows (6.3 ms of work) took 1 ms more in a call
    of one iteration.
    """
    one = _fastest_of_3(runner, 1)
    if fixed_is_work:
        return int(min(MAX_INNER, max(1, math.ceil(target_seconds / max(one, 1e-7)))))
    if one >= MAX_CALL_TARGETS * target_seconds:
        return 1
    low_n, low_t = 1, one
    n = int(min(MAX_INNER, max(2, math.ceil(target_seconds / max(one, 1e-7)))))
    while True:
        t = _fastest_of_3(runner, n)
        if t - low_t >= 0.25 * t or n >= MAX_INNER:
            break
        low_n, low_t, n = n, t, min(2 * n, MAX_INNER)
    per_iteration = max((t - low_t) / (n - low_n), 1e-9)
    fixed = max(t - n * per_iteration, 0.0)
    wanted = min(max(target_seconds, fixed / FIXED_SHARE), MAX_CALL_TARGETS * target_seconds)
    return int(min(MAX_INNER, max(1, math.ceil(wanted / per_iteration))))


def _inner_of(runner: Callable[[int], None], candidate: Candidate, target_seconds: float) -> int:
    """Iterations per timed call of ``candidate``: :func:`choose_inner`'s, and for a stateful
    step at least :data:`CARRIED_STEPS`, sized by the slope (its loop hoists nothing a decoding
    loop would not hoist too)."""
    if candidate.carry is not None:
        return int(min(MAX_INNER, max(CARRIED_STEPS, choose_inner(runner, target_seconds))))
    return choose_inner(runner, target_seconds, fixed_is_work=_platform(candidate) == "cpu")


def _time_once(run: Callable[[], None]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


class Timer:
    """Compiled candidates that can be timed for more paired rounds at any time.

    Each round times every candidate once, in a fresh random order, so the i-th samples of two
    candidates come from the same round: their ratio is a paired comparison, and drift (other
    processes, clock changes) hits both alike.

    Args:
      candidates: ``{name: Candidate(fn, inputs, state)}``.
      warmup: Untimed rounds after compilation.
      target_seconds: Each timed call runs ``inner`` iterations to last at least this long.
      seed: Seeds the order of candidates in each round.
      unroll: Calls per loop iteration (:func:`compile_loop`; default: by platform).
    """

    def __init__(self, candidates: Mapping[str, Candidate], warmup: int = 2,
                 target_seconds: float = TARGET_CALL_SECONDS, seed: int = 0, unroll: int | None = None):
        self.runners: dict[str, tuple[Callable[[], None], int]] = {}
        self.primes: dict[str, Callable[[], None] | None] = {}
        self.samples: dict[str, list[float]] = {}
        self.warmup = warmup
        self.target_seconds = target_seconds
        self.unroll = unroll
        self._rng = np.random.default_rng(seed)
        self._cpu = 0.0
        self._wall = 0.0
        self.add(candidates)

    def add(self, candidates: Mapping[str, Candidate], pending: Sequence[concurrent.futures.Future] = (),
            errors: dict[str, Exception] | None = None) -> None:
        """Compiles and warms up more candidates (names must be new).

        All are compiled (in parallel, :func:`compile_loop`) before any is timed, and so are
        the caller's ``pending`` compilations (:func:`compile_async`): nothing compiles while a
        candidate is timed. With ``errors``, a candidate that fails to compile or run is left
        out, its exception kept there, instead of raising."""
        for name in candidates:
            if name in self.runners:
                raise ValueError(f"Timer already has a candidate named {name!r}.")
        runners: dict[str, Callable[..., None]] = {}
        try:
            for name, cand in candidates.items():
                try:  # traced and lowered here; a program that fails to trace fails here
                    runners[name] = compile_loop(cand, unroll=self.unroll)
                except Exception as e:  # pylint: disable=broad-except
                    if errors is None:
                        raise
                    errors[name] = e
            for name, runner in list(runners.items()):
                try:
                    getattr(runner, "ready", lambda: None)()
                except Exception as e:  # pylint: disable=broad-except
                    if errors is None:
                        raise
                    errors[name] = e
                    del runners[name]
            concurrent.futures.wait(list(pending))  # their errors are the caller's to see
        except BaseException:  # an error or Ctrl-C: no compilation left queued behind it
            for runner in runners.values():
                getattr(runner, "cancel", lambda: None)()
            raise
        for name, runner in runners.items():
            try:  # a stateful step compiles here, on its first call
                runner(1)
                inner = _inner_of(runner, candidates[name], self.target_seconds)
            except Exception as e:  # pylint: disable=broad-except
                if errors is None:
                    raise
                errors[name] = e
                continue
            # Calls per timed call: each iteration may run several (``compile_loop``'s unroll).
            self.runners[name] = (functools.partial(runner, inner), inner * getattr(runner, "calls_per_iteration", 1))
            self.primes[name] = getattr(runner, "prime", None)
            self.samples[name] = []
            for _ in range(self.warmup):
                self.runners[name][0]()

    def rounds(self, count: int, names: Sequence[str] | None = None) -> None:
        """Times ``count`` more rounds of ``names`` (default: every candidate)."""
        names = list(self.runners) if names is None else list(names)
        cpu, wall = _cpu_seconds(), time.perf_counter()
        taken = np.zeros((count, len(names)))
        for r in range(count):
            for i in self._rng.permutation(len(names)):
                run, inner = self.runners[names[i]]
                if self.primes[names[i]] is not None:  # a stateful step: one untimed step first
                    self.primes[names[i]]()
                taken[r, i] = _time_once(run) / inner
        self._cpu += _cpu_seconds() - cpu
        self._wall += time.perf_counter() - wall
        if taken.size:  # with several processes, each sample is the slowest's
            taken = _multihost.slowest(taken)
        for r in range(count):
            for i, name in enumerate(names):
                self.samples[name].append(float(taken[r, i]))

    def timing(self, name: str) -> Timing:
        return summarize(self.samples[name], self.runners[name][1])

    def timings(self) -> dict[str, Timing]:
        return {name: self.timing(name) for name in self.runners}

    @property
    def cpu_per_wall(self) -> float:
        """This process's CPU seconds per wall second while timing (nan before any round)."""
        return self._cpu / self._wall if self._wall > 0 else float("nan")


def _cpu_seconds() -> float:
    return time.process_time()  # every thread of this process, user and system


def summarize(samples: Sequence[float], inner: int = 1) -> Timing:
    """Median, quartiles and a robust coefficient of variation of per-call seconds.

    >>> t = summarize([1.0, 2.0, 3.0, 4.0, 5.0])
    >>> t.median, t.p25, t.p75, round(t.cv, 3), t.repeats
    (3.0, 2.0, 4.0, 0.494, 5)
    """
    arr = np.asarray(samples, dtype=np.float64)
    median = float(np.median(arr))
    q25, q75 = np.percentile(arr, [25, 75])
    # A robust coefficient of variation: scaled inter-quartile range over the median.
    cv = float((q75 - q25) / 1.349 / median) if median > 0 else float("nan")
    return Timing(median, float(q25), float(q75), cv, len(arr), inner, tuple(float(x) for x in arr))


def measure(
    candidates: Mapping[str, Candidate],
    repeats: int = 15,
    warmup: int = 2,
    target_seconds: float = TARGET_CALL_SECONDS,
    seed: int = 0,
    pending: Sequence[concurrent.futures.Future] = (),
) -> dict[str, Timing]:
    """Times every candidate, interleaved, and returns seconds per call.

    Args:
      candidates: ``{name: Candidate(fn, inputs, state)}``.
      repeats: Timed rounds (each times every candidate once).
      warmup: Untimed rounds after compilation.
      target_seconds: Each timed call runs ``inner`` iterations to last at least this long.
      seed: Seeds the order of candidates in each round.
      pending: The caller's compilations (:func:`compile_async`) to finish before any timing.
    """
    if repeats < 3:
        raise ValueError(f"repeats must be >= 3 for a median and quartiles. Received: repeats={repeats}")
    timer = Timer({}, warmup, target_seconds, seed)
    timer.add(candidates, pending)
    timer.rounds(repeats)
    return timer.timings()
