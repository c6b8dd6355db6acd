"""Phase 1, latency: every tunable layer under every candidate policy, and casts between dtypes."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from autopolicy import _multihost, policies
from autopolicy.numerics import _sharding
from autopolicy.search import timing
from autopolicy.search._defaults import DEFAULT_CANDIDATES, REFERENCE
from autopolicy.search._progress import progress as bar
from autopolicy.search.adapter import ModelAdapter, TunableLayer, supports_kernels
from autopolicy.search.cache import MeasurementCache, key
from autopolicy.search.costs import phase
from autopolicy.search.noise import NOISY_CV
from autopolicy.search.phases import LatencyProfile, LayerTiming, Site

__all__ = ["sites", "candidates_for", "measure_latency", "layer_latency", "kernel_choice", "format_tactics",
           "relative_error", "cast_latency", "stream_bandwidth", "profile"]

#: The largest array :func:`stream_bandwidth` reads (its bytes are allocated once, on the device).
MAX_STREAM_BYTES = 1 << 30


def candidates_for(layer: TunableLayer, candidates: Sequence[policies.DTypePolicy]) -> tuple[policies.DTypePolicy, ...]:
    """float32 first, then the candidates this layer can run (quantized ones need a kernel)."""
    out = [policies.DTypePolicy(REFERENCE)]
    for policy in candidates:
        if layer.supports(policy) and policy not in out:
            out.append(policy)
    return tuple(out)


def sites(layers: Sequence[TunableLayer], candidates: Sequence[policies.DTypePolicy]) -> tuple[Site, ...]:
    """The tunable layers as the solver's chain: a layer is chained to the one before it when it
    consumes that layer's output."""
    out = []
    for i, layer in enumerate(layers):
        chained = i > 0 and layer.producer == layers[i - 1].path
        out.append(Site(i, layer, chained, candidates_for(layer, candidates)))
    return tuple(out)


def _finite(out: Any) -> bool:
    return all(_all_finite(x) for x in jax.tree_util.tree_leaves(out)
               if jnp.issubdtype(jnp.result_type(x), jnp.inexact))


def _all_finite(x: Any) -> bool:
    if getattr(x, "is_fully_addressable", True):  # checked on the host: no compilation per shape
        return bool(np.isfinite(np.asarray(x)).all())
    # jnp.all of an array that spans processes is a scalar replicated on every device: bool()
    # reads this process's copy.
    return bool(jnp.all(jnp.isfinite(x)))


def _as_candidate(program: Any) -> timing.Candidate:
    return timing.Candidate(program.fn, program.args, program.state)


def relative_error(reference: Any, output: Any) -> float:
    """``sum((output - reference)^2) / sum(reference^2)`` over the floating leaves, in float64
    (nan when an output is not finite or the reference is all zeros).

    >>> round(relative_error(jnp.array([1.0, 2.0]), jnp.array([1.0, 2.1])), 6)
    0.002
    """
    num = den = 0.0
    for r, o in zip(jax.tree_util.tree_leaves(reference), jax.tree_util.tree_leaves(output)):
        if not jnp.issubdtype(jnp.result_type(r), jnp.inexact):
            continue
        r64, o64 = _multihost.host_array(r, np.float64), _multihost.host_array(o, np.float64)
        num += float(np.sum((o64 - r64) ** 2))
        den += float(np.sum(r64 ** 2))
    return num / den if den > 0 and math.isfinite(num) else math.nan


#: Another kernel replaces the device's default only when its median is this much lower (the
#: kernels are exactly equivalent: a choice made by noise would only make runs disagree).
TACTIC_MARGIN = 0.05


def _variants(adapter: ModelAdapter, site: Site) -> list[tuple[policies.DTypePolicy, str | None]]:
    """(policy, kernel) pairs to time: one per kernel the adapter offers for the policy, or
    (policy, None) where its mode has no choice (or the adapter offers none)."""
    offers = supports_kernels(adapter)
    out = []
    for policy in site.candidates:
        names = tuple(adapter.layer_kernels(site.path, policy)) if offers else ()
        out += [(policy, name) for name in names] or [(policy, None)]
    return out


def _variant_name(policy: policies.DTypePolicy, kernel: str | None) -> str:
    return policy.name if kernel is None else f"{policy.name}@{kernel}"


def layer_latency(
    adapter: ModelAdapter,
    site: Site,
    cache: MeasurementCache,
    fingerprint: str,
    repeats: int,
    fresh: set | None = None,
) -> dict[str, LayerTiming]:
    """Times the layer under each of its candidates (interleaved) on its real input.

    A policy whose mode has several kernels (tactics) is timed with each of them, at the layer's
    real shape, and keeps the fastest (its ``kernel``; every kernel's median is in ``tactics``).
    Layers with equal signatures share their cached timings: identical blocks are timed once. A
    cached timing whose spread says it was noisy is measured again, once, in a later run, which
    keeps the earlier run's kernel unless another is clearly faster on both runs' timings (the
    earlier median is kept in the new record, so every layer of that signature decides alike).
    ``finite`` says whether the output on the real input is free of inf/NaN (a float16 overflow
    disqualifies the policy).
    """
    fresh = set() if fresh is None else fresh  # keys measured in this run: trusted as they are
    records: dict[str, dict] = {}
    earlier: dict[str, dict] = {}  # cached records about to be measured again
    todo: dict[str, timing.Candidate] = {}
    keys = {}
    variants = _variants(adapter, site)
    for policy, kernel in variants:
        name = _variant_name(policy, kernel)
        keys[name] = key(fingerprint, "latency", site.layer.signature, policy.name, kernel or "", repeats,
                         timing.METHOD)
        cached = cache.lookup(keys[name])
        # A noisy timing from an earlier run is measured again (once) rather than trusted.
        trusted = cached is not None and (keys[name] in fresh or cached.get("latency_cv", 0.0) <= NOISY_CV
                                          or cached.get("remeasured", True))
        if trusted:
            records[name] = cached
            continue
        if cached is not None:
            earlier[name] = cached
        # Adapters without a choice of kernels take no kernel argument.
        program = adapter.layer_program(site.path, policy, kernel) if kernel else adapter.layer_program(site.path, policy)
        todo[name] = _as_candidate(program)
    if todo:
        ref = todo.get(REFERENCE) or _as_candidate(adapter.layer_program(site.path, policies.get(REFERENCE)))
        plain = {}  # each candidate's program alone (for its output), compiled beside the timing loops
        try:
            for name, c in todo.items():
                plain[name] = timing.compile_async(c.fn, c.state, *c.inputs)
            if REFERENCE not in plain:
                plain[REFERENCE] = timing.compile_async(ref.fn, ref.state, *ref.inputs)
            timings = timing.measure(todo, repeats=repeats, pending=list(plain.values()))
        except BaseException:
            for future in plain.values():
                future.cancel()
            raise
        reference = plain[REFERENCE].result()(ref.state, *ref.inputs)
        for (policy, kernel) in variants:
            name = _variant_name(policy, kernel)
            if name not in todo:
                continue
            cand = todo[name]
            result = plain[name].result()(cand.state, *cand.inputs)
            t = timings[name]
            record = {"latency_s": t.median, "latency_p25_s": t.p25, "latency_p75_s": t.p75, "latency_cv": t.cv,
                      "repeats": t.repeats, "inner": t.inner, "finite": _finite(result),
                      "nbytes": adapter.layer_bytes(site.path, policy), "remeasured": name in earlier,
                      "output_error": relative_error(reference, result), "kernel": kernel or ""}
            if name in earlier:
                record["previous_latency_s"] = earlier[name]["latency_s"]
            if _sharding.spans_devices((cand.state, cand.inputs)):  # what XLA inserted between devices
                record["collectives"] = _sharding.collectives(plain[name].result().as_text())
            records[name] = cache.put(keys[name], record, share=True)
            fresh.add(keys[name])
    out = {}
    for policy in site.candidates:
        mine = [(_variant_name(p, k), k) for p, k in variants if p == policy]
        best = _kept([n for n, _ in mine], records)
        tactics = tuple((k, records[n]["latency_s"]) for n, k in mine if k)
        out[policy.name] = dataclasses.replace(LayerTiming.from_record(records[best]), tactics=tactics)
    return out


def _kept(names: Sequence[str], records: dict[str, dict]) -> str:
    """The kernel a layer keeps: :func:`_winner` of its timings, or, where some were measured
    again in this run (their records hold the earlier run's median), the earlier run's winner
    unless another is clearly faster on both runs' timings together (the mean of the two medians),
    so that choices within the noise do not flip: each flip changes the models, and their end-to-end
    timings could not be reused. A timing measured once counts as both runs' (the same median).
    Decided from the records alone, so every layer of a signature keeps the same kernel."""
    if not any("previous_latency_s" in records[n] for n in names):
        return _winner(names, records)
    earlier = {n: {"latency_s": records[n].get("previous_latency_s", records[n]["latency_s"])} for n in names}
    before = _winner(names, earlier)
    both = {n: (earlier[n]["latency_s"] + records[n]["latency_s"]) / 2 for n in names}
    fastest = min(names, key=both.get)
    return fastest if both[fastest] < (1.0 - TACTIC_MARGIN) * both[before] else before


def _winner(names: Sequence[str], records: dict[str, dict]) -> str:
    """The first of ``names`` (the device's default kernel) unless another is faster by more than
    ``TACTIC_MARGIN``, then the fastest."""
    fastest = min(names, key=lambda n: records[n]["latency_s"])
    return fastest if records[fastest]["latency_s"] < (1.0 - TACTIC_MARGIN) * records[names[0]]["latency_s"] else names[0]


def format_tactics(tactics: Sequence[tuple[str, float]]) -> str:
    """``"s8s8 1.21 ms, u8s8 3.02 ms"``: every kernel timed ("" when there was one or none).

    >>> format_tactics((("s8s8", 1.21e-3), ("u8s8", 3.02e-3)))
    's8s8 1.21 ms, u8s8 3.02 ms'
    """
    if len(tactics) < 2:
        return ""
    return ", ".join(f"{name} {seconds * 1e3:.3g} ms" for name, seconds in tactics)


def kernel_choice(latency: LatencyProfile) -> dict[str, dict[str, str]]:
    """``{layer path: {policy name: kernel}}``: the fastest kernel of each policy of each layer,
    where its mode has several (what :func:`layer_latency` measured)."""
    return {path: {name: t.kernel for name, t in by_policy.items() if len(t.tactics) > 1}
            for path, by_policy in latency.timings.items()
            if any(len(t.tactics) > 1 for t in by_policy.values())}


def cast_latency(
    needed: Iterable[tuple[tuple[int, ...], str, str]],
    cache: MeasurementCache,
    fingerprint: str,
    repeats: int,
) -> dict[tuple[tuple[int, ...], str, str], float]:
    """Seconds to cast an activation of ``shape`` from one dtype to another, per triple."""
    result, todo, keys = {}, {}, {}
    for shape, source, target in sorted(set(needed)):
        name = json.dumps([list(shape), source, target])
        keys[name] = (key(fingerprint, "cast", list(shape), source, target, repeats, timing.METHOD),
                      (shape, source, target))
        cached = cache.lookup(keys[name][0])
        if cached is not None:
            result[keys[name][1]] = cached
            continue
        x = jnp.ones(shape, jnp.dtype(source))
        todo[name] = timing.Candidate(lambda _, a, t=jnp.dtype(target): a.astype(t), (x,))
    if todo:
        timings = timing.measure(todo, repeats=repeats)
        for name in todo:
            cache_key, triple = keys[name]
            result[triple] = cache.get_or_measure(cache_key, lambda s=timings[name].median: s, share=True)
    return result


def _needed_casts(layer_sites: Sequence[Site]) -> list[tuple[tuple[int, ...], str, str]]:
    needed = []
    for i, site in enumerate(layer_sites):
        own = {p.compute_dtype for p in site.candidates}
        before = {p.compute_dtype for p in layer_sites[i - 1].candidates} if site.chained else {REFERENCE}
        needed += [(site.input_shape, a, b) for a in before for b in own if a != b]
    return needed


def stream_bandwidth(nbytes: int, cache: MeasurementCache, fingerprint: str, repeats: int) -> float:
    """Bytes per second at which the default device reads ``nbytes`` of float32 (rounded up to
    64 MiB, at most :data:`MAX_STREAM_BYTES`): a multiply-and-sum over them, timed like a layer.

    Cached per machine and size. On a 2-core Xeon VM it read 26 GB/s when the VM was quiet (the
    rate at which XLA's float32 matrix-vector product and the int8 kernel stream a 256 MB
    weight), 18.8 GB/s in a tune on the busy VM.
    """
    size = min(MAX_STREAM_BYTES, -(-max(nbytes, 1) // (64 << 20)) * (64 << 20))
    cache_key = key(fingerprint, "stream-bandwidth", size, repeats, timing.METHOD)

    def measure() -> float:
        weights = jnp.ones((size // 4,), jnp.float32)
        # The scalar input changes each iteration, so the sum cannot be hoisted out of the loop.
        reads = timing.Candidate(lambda w, x: jnp.sum(w * x[0]), (jnp.ones((1,), jnp.float32),), weights)
        seconds = timing.measure({"stream": reads}, repeats=max(3, repeats // 4))["stream"].median
        return size / seconds

    return float(cache.get_or_measure(cache_key, measure, share=True))


def _bandwidth(platform_name: str, layer_sites: Sequence[Site], timings: dict, cache: MeasurementCache,
               fingerprint: str, repeats: int) -> float | None:
    """The streaming floor's bandwidth, or None where it does not apply: the float32 weights of
    the layers that read all their weights fit in the last-level cache (they stay cached from one
    call of the model to the next), or layers span several devices (each reads only its shard)."""
    from autopolicy.search import hardware  # pylint: disable=import-outside-toplevel

    streamed = sum(timings[s.path][REFERENCE].nbytes for s in layer_sites if not s.layer.gather)
    spans = any(t.collectives for table in timings.values() for t in table.values())
    if spans or streamed <= hardware.cache_bytes(platform_name):
        return None
    return stream_bandwidth(streamed, cache, fingerprint, repeats)


def measure_latency(
    adapter: ModelAdapter,
    layer_sites: Sequence[Site],
    cache: MeasurementCache,
    fingerprint: str,
    repeats: int,
    progress: bool = False,
) -> LatencyProfile:
    """Phase 1: the latency profile of every site, and of the casts the solver may insert."""
    timings, fresh = {}, set()
    with phase("layer latency"):
        for site in bar(progress, layer_sites, "latency", len(layer_sites)):
            timings[site.path] = layer_latency(adapter, site, cache, fingerprint, repeats, fresh)
            cache.flush()
    with phase("casts"):
        casts = cast_latency(_needed_casts(layer_sites), cache, fingerprint, repeats)
        cache.flush()
        bandwidth = _bandwidth(jax.devices()[0].platform, layer_sites, timings, cache, fingerprint, repeats)
        cache.flush()
    return LatencyProfile(tuple(layer_sites), timings, casts, bandwidth)


def profile(
    model: Any,
    sample_input: Any,
    candidates: Sequence[Any] = DEFAULT_CANDIDATES,
    repeats: int = 20,
    cache_dir: str | None = None,
    progress: bool = True,
    adapter: Any = None,
):
    """Latency only: every tunable layer under every candidate, as a DataFrame.

    Columns: ``layer, class, input_shape, policy, latency_s, latency_cv, ratio_to_float32,
    finite_output, nbytes, kernel, tactics`` (``kernel``: the kernel kept where the mode names
    one; ``tactics``: every kernel's median where there were several). No accuracy is measured
    (see :func:`autopolicy.search.tune`).
    """
    import pandas as pd  # pylint: disable=import-outside-toplevel

    from autopolicy.search import hardware  # pylint: disable=import-outside-toplevel
    from autopolicy.search.adapter import get_adapter  # pylint: disable=import-outside-toplevel

    args = sample_input if isinstance(sample_input, tuple) else (sample_input,)
    made = get_adapter(model, args, [args], adapter)
    layer_sites = sites(made.layers(), [policies.get(c) for c in candidates])
    if not layer_sites:
        raise ValueError("The model has no tunable layers.")
    fingerprint = _multihost.from_leader(hardware.fingerprint())  # process 0's: the same cache keys on each
    rows = []
    with MeasurementCache(cache_dir) as cache:
        for site in bar(progress, layer_sites, "latency", len(layer_sites)):
            table = layer_latency(made, site, cache, fingerprint, repeats)
            cache.flush()
            for name, t in table.items():
                rows.append({
                    "layer": site.path, "class": site.layer.kind,
                    "input_shape": "x".join(map(str, site.input_shape)), "policy": name,
                    "latency_s": t.latency_s, "latency_cv": t.latency_cv,
                    "ratio_to_float32": table[REFERENCE].latency_s / t.latency_s,
                    "finite_output": t.finite, "nbytes": t.nbytes, "kernel": t.kernel,
                    "tactics": format_tactics(t.tactics),
                })
    return pd.DataFrame(rows)
