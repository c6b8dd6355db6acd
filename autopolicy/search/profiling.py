"""Latency of every layer under every candidate policy, and of casts between compute dtypes."""

from __future__ import annotations

import dataclasses
import json
from collections import OrderedDict
from typing import Any, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from autopolicy import policies
from autopolicy.nn.protocol import LayerCall
from autopolicy.search import timing
from autopolicy.search.cache import MeasurementCache, key

__all__ = ["LayerSite", "sites", "candidates_for", "layer_latency", "cast_latency", "cast_input", "profile"]


@dataclasses.dataclass
class LayerSite:
    """A tunable layer where it sits in the model: its real inputs and its producer."""

    index: int
    path: str
    layer: Any
    call: LayerCall
    chained: bool  # its first input is the previous tunable layer's output
    candidates: list[policies.DTypePolicy]

    @property
    def input_shape(self) -> tuple[int, ...]:
        first = jax.tree_util.tree_leaves((self.call.args, self.call.kwargs))[0]
        return tuple(np.shape(first))

    def signature(self) -> dict[str, Any]:
        """What the layer's latency depends on: class, configuration, weight shapes, inputs."""
        shapes = [(tuple(np.shape(x)), str(jnp.result_type(x))) for x in jax.tree_util.tree_leaves(self.layer)]
        inputs = [(tuple(np.shape(x)), str(jnp.result_type(x)))
                  for x in jax.tree_util.tree_leaves((self.call.args, self.call.kwargs))]
        config = self.layer.__dict__.get("_config") or type(self.layer).__name__
        return {"class": type(self.layer).__name__, "config": config, "weights": shapes, "inputs": inputs}


def candidates_for(layer: Any, candidates: Sequence[policies.DTypePolicy]) -> list[policies.DTypePolicy]:
    """float32 first, then the candidates this layer can run (quantized ones need a kernel)."""
    out = [policies.DTypePolicy("float32")]
    for policy in candidates:
        mode = policy.quantization_mode
        if mode is not None and mode not in layer.supported_quantization_modes:
            continue
        if policy not in out:
            out.append(policy)
    return out


def sites(
    tunable: "OrderedDict[str, Any]",
    calls: "OrderedDict[str, LayerCall]",
    candidates: Sequence[policies.DTypePolicy],
) -> list[LayerSite]:
    """The tunable layers that ran on the sample input, in execution order."""
    ordered = [p for p in calls if p in tunable]
    out = []
    for i, path in enumerate(ordered):
        producer = calls[path].producer
        chained = i > 0 and producer == ordered[i - 1]
        out.append(LayerSite(i, path, tunable[path], calls[path], chained, candidates_for(tunable[path], candidates)))
    return out


def cast_input(args: Any, dtype: str) -> Any:
    """Casts the floating arrays of ``args`` to ``dtype`` (what autocast would do)."""
    target = jnp.dtype(dtype)

    def leaf(x):
        if isinstance(x, (jax.Array, np.ndarray)) and jnp.issubdtype(x.dtype, jnp.floating):
            return jnp.asarray(x).astype(target)
        return x

    return jax.tree_util.tree_map(leaf, args)


def _call_layer(layer, args, kwargs):
    return layer(*args, **kwargs)


def _finite(out: Any) -> bool:
    return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree_util.tree_leaves(out)
               if jnp.issubdtype(jnp.result_type(x), jnp.inexact))


def layer_latency(
    site: LayerSite,
    variants: dict[str, Any],
    cache: MeasurementCache,
    fingerprint: str,
    repeats: int,
) -> dict[str, dict[str, Any]]:
    """Times the layer under each candidate (interleaved) on its real input.

    Returns ``{policy: {"latency_s", "latency_p25_s", "latency_p75_s", "latency_cv", "repeats",
    "inner", "finite", "nbytes"}}``; ``finite`` says whether its output on the real input is
    free of inf/NaN (a float16 overflow disqualifies the policy).
    """
    signature = site.signature()
    out: dict[str, dict[str, Any]] = {}
    todo: dict[str, timing.Candidate] = {}
    keys = {}
    for name, layer in variants.items():
        keys[name] = key(fingerprint, "latency", signature, name, repeats, timing.METHOD)
        if keys[name] in cache:
            out[name] = cache.entries[keys[name]]
            continue
        policy = policies.get(name)
        args, kwargs = cast_input((site.call.args, site.call.kwargs), policy.compute_dtype)
        todo[name] = timing.Candidate(lambda lay, a, k: _call_layer(lay, a, k), (args, kwargs), layer)
    if todo:
        timings = timing.measure(todo, repeats=repeats)
        for name, cand in todo.items():
            result = cand.fn(cand.state, *cand.inputs)
            record = {
                **timings[name].as_dict("latency_"),
                "finite": _finite(result),
                "nbytes": int(variants[name].nbytes()),
            }
            record["latency_s"] = record.pop("latency_median")
            out[name] = cache.get_or_measure(keys[name], lambda r=record: r)
    return {name: out[name] for name in variants}


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
        if keys[name][0] in cache:
            result[keys[name][1]] = cache.entries[keys[name][0]]
            continue
        x = jnp.ones(shape, jnp.dtype(source))
        todo[name] = timing.Candidate(lambda a, t=jnp.dtype(target): a.astype(t), (x,))
    if todo:
        timings = timing.measure(todo, repeats=repeats)
        for name in todo:
            cache_key, triple = keys[name]
            result[triple] = cache.get_or_measure(cache_key, lambda s=timings[name].median: s)
    return result


def profile(
    model: Any,
    sample_input: Any,
    candidates: Sequence[Any] = ("float32", "mixed_bfloat16", "mixed_float16", "int8_from_float32",
                                 "float8_from_float32"),
    repeats: int = 20,
    cache_dir: str | None = None,
    progress: bool = True,
):
    """Latency only: every tunable layer under every candidate, as a DataFrame.

    Columns: ``layer, class, input_shape, policy, latency_s, latency_cv, ratio_to_float32,
    finite_output, nbytes``. No accuracy is measured (see :func:`autopolicy.search.tune`).
    """
    import pandas as pd  # pylint: disable=import-outside-toplevel

    from autopolicy.nn.protocol import NNModel  # pylint: disable=import-outside-toplevel
    from autopolicy.search import hardware  # pylint: disable=import-outside-toplevel

    adapter = NNModel(model)
    args = sample_input if isinstance(sample_input, tuple) else (sample_input,)
    wanted = [policies.get(c) for c in candidates]
    layer_sites = sites(adapter.tunable_layers(), adapter.record_calls(*args), wanted)
    if not layer_sites:
        raise ValueError("The model has no tunable layers.")
    fingerprint = hardware.fingerprint()
    cache = MeasurementCache(cache_dir)
    rows = []
    from autopolicy.search._progress import progress as bar  # pylint: disable=import-outside-toplevel

    for site in bar(progress, layer_sites, "latency", len(layer_sites)):
        variants = {p.name: adapter.layer_with_policy(site.path, p) for p in site.candidates}
        table = layer_latency(site, variants, cache, fingerprint, repeats)
        cache.flush()
        for name, record in table.items():
            rows.append({
                "layer": site.path, "class": type(site.layer).__name__,
                "input_shape": "x".join(map(str, site.input_shape)), "policy": name,
                "latency_s": record["latency_s"], "latency_cv": record["latency_cv"],
                "ratio_to_float32": table["float32"]["latency_s"] / record["latency_s"],
                "finite_output": record["finite"], "nbytes": record["nbytes"],
            })
    return pd.DataFrame(rows)
