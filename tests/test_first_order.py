"""The first-order accuracy estimate (autopolicy.search.first_order) and the nn adapter's probes:
gradients against finite differences and per-example gradients, the shapes of what is captured,
one compilation per layer signature, argument errors, the cache and resuming, and the estimate's
ranking of a tiny llama's layers against measured loss changes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from autopolicy import nn, policies, search
from autopolicy.adapters.nn import NNAdapter
from autopolicy.nn import _context, generation
from autopolicy.search import first_order
from autopolicy.search.adapter import OutputGradients, get_adapter, supports_first_order
from autopolicy.search.cache import MeasurementCache

INT8, INT4 = policies.get("int8_from_float32"), policies.get("int4_from_float32")
BF16 = policies.get("mixed_bfloat16")
LLAMA = nn.LlamaConfig(vocab_size=40, dim=32, blocks=1, heads=4, kv_heads=2, mlp_dim=48, rope_base=100.0)


def _spearman(x, y):
    rx, ry = np.argsort(np.argsort(x)), np.argsort(np.argsort(y))
    return float(np.corrcoef(rx, ry)[0, 1])


@pytest.fixture(scope="module")
def llama():
    ids = jnp.asarray(np.random.default_rng(0).integers(0, LLAMA.vocab_size, (4, 12)), jnp.int32)
    model = nn.LlamaDecoder(LLAMA, name="tiny").build(jax.random.key(0), ids)
    adapter = get_adapter(model, (ids,), [(ids,)])
    return adapter, ids, adapter.output_gradients(generation.token_nll, (ids,))


def _mlp_loss(model, x, labels):
    logp = jax.nn.log_softmax(model(x).astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, labels[:, None], axis=-1)[:, 0]


@pytest.fixture(scope="module")
def mlp():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((16, 12)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 5, 16), jnp.int32)
    model = nn.Sequential([nn.Dense(20, activation="tanh", name="hidden"), nn.Dense(5, name="out")],
                          name="mlp").build(jax.random.key(3), x)
    adapter = get_adapter(model, (x,), [(x,)])
    return adapter, x, labels


def _loss_with_added(adapter, path, added, x, labels):
    """The mean loss with ``added`` added to the output of the layer at ``path``."""
    def hook(layer, args, kwargs):
        return (lambda out: out + added) if layer.path == path else None

    with _context.call_hook(hook):
        return float(jnp.mean(_mlp_loss(adapter.model, x, labels)))


def test_first_order_term_equals_a_finite_difference_along_the_int8_error(mlp):
    adapter, x, labels = mlp
    captured = adapter.output_gradients(_mlp_loss, (x, labels))
    path = "mlp/hidden"
    (reference,), = adapter.layer_outputs(path, policies.get("float32"), captured)
    (quantized,), = adapter.layer_outputs(path, INT4, captured)
    error = quantized - reference
    assert float(jnp.max(jnp.abs(error))) > 1e-3  # a real quantization error, not zeros
    terms = first_order.combine([first_order._sums(captured.gradients[path], ((quantized,),), ((reference,),))
                                 | {"examples": captured.examples}])
    step = 1e-2  # central difference along the error: its remainder is O(step^2)
    slope = (_loss_with_added(adapter, path, step * error, x, labels)
             - _loss_with_added(adapter, path, -step * error, x, labels)) / (2 * step)
    np.testing.assert_allclose(terms["first"], slope, rtol=2e-3)
    # and the whole change is the first-order term plus a small remainder
    whole = _loss_with_added(adapter, path, error, x, labels) - float(jnp.mean(_mlp_loss(adapter.model, x, labels)))
    assert abs(whole - terms["first"]) < 0.2 * abs(whole)


def test_fisher_term_equals_per_example_gradients_squared(mlp):
    """Each example's loss reads only its own output row here, so the diagonal empirical
    Fisher 0.5/N sum_n sum_i (dl_n/dy_ni)^2 e_ni^2 is exactly the Fisher term."""
    adapter, x, labels = mlp
    captured = adapter.output_gradients(_mlp_loss, (x, labels))
    assert captured.examples == 16
    path = "mlp/out"
    (reference,), = adapter.layer_outputs(path, policies.get("float32"), captured)
    (quantized,), = adapter.layer_outputs(path, INT4, captured)
    error = np.asarray(quantized - reference, np.float64)
    logits = np.asarray(reference)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    per_example = probs - np.eye(5)[np.asarray(labels)]  # d l_n / d logits_n of cross-entropy
    expected = 0.5 * np.mean(np.sum(per_example ** 2 * error ** 2, axis=-1))
    record = first_order._sums(captured.gradients[path], ((quantized,),), ((reference,),))
    terms = first_order.combine([record | {"examples": captured.examples}])
    np.testing.assert_allclose(terms["fisher"], expected, rtol=1e-4)
    np.testing.assert_allclose(captured.gradients[path][0][0], per_example / 16, rtol=1e-4, atol=1e-7)


def test_gradient_capture_covers_every_tunable_layer_with_its_output_shape(llama):
    adapter, ids, captured = llama
    paths = [layer.path for layer in adapter.layers()]
    assert set(captured.gradients) == set(paths) == set(captured.inputs)
    assert captured.examples == 4 * 11  # next-token losses: (batch, time - 1)
    shapes = {"embedding": (4, 12, 32), "attention/query": (4, 12, 4, 8), "attention/key": (4, 12, 2, 8),
              "attention/attention_output": (4, 12, 32), "mlp/gate": (4, 12, 48), "mlp/down": (4, 12, 32),
              "head": (4, 12, 40)}
    for suffix, shape in shapes.items():
        path = next(p for p in paths if p.endswith(suffix))
        (grad,), = captured.gradients[path]  # one call, one output leaf
        assert grad.shape == shape and grad.dtype == jnp.float32, (path, grad.shape)
        assert float(jnp.sum(jnp.abs(grad))) > 0
    (args, kwargs), = captured.inputs["tiny/embedding"]
    np.testing.assert_array_equal(args[0], ids)
    np.testing.assert_allclose(captured.loss, float(jnp.mean(generation.token_nll(adapter.model, ids))), rtol=1e-6)


def test_layer_runner_compiles_once_per_signature_and_matches_the_layer(llama):
    adapter, _, captured = llama
    (a,), = adapter.layer_outputs("tiny/block_0/mlp/gate", INT8, captured)
    (b,), = adapter.layer_outputs("tiny/block_0/mlp/up", INT8, captured)
    signatures = {layer.path: layer.signature for layer in adapter.layers()}
    assert signatures["tiny/block_0/mlp/gate"] == signatures["tiny/block_0/mlp/up"]  # Dense(48) on one input
    groups = [k for k in adapter._runner._programs if k[:2] == (signatures["tiny/block_0/mlp/up"], INT8.name)]
    assert len(groups) == 1  # two layers, one program
    layer = adapter.model.layers_by_path()["tiny/block_0/mlp/up"].with_dtype_policy(INT8)
    (args, kwargs), = captured.inputs["tiny/block_0/mlp/up"]
    np.testing.assert_allclose(b, layer(*args, **kwargs), rtol=1e-6, atol=1e-6)
    assert float(jnp.max(jnp.abs(a - b))) > 1e-3  # each ran its own weights


def test_mlp_estimate_ranks_candidates_like_measured_loss_changes(mlp):
    adapter, x, labels = mlp
    captured = adapter.output_gradients(_mlp_loss, (x, labels))
    pairs = [(path, c) for path in ("mlp/hidden", "mlp/out") for c in (INT8, INT4, BF16)]
    records = first_order.batch_terms(adapter, captured, pairs)
    base = float(jnp.mean(_mlp_loss(adapter.model, x, labels)))
    estimated, measured = [], []
    for path, policy in pairs:
        estimated.append(first_order.loss_change(first_order.combine([records[(path, policy.name)]]), "both"))
        tuned = adapter.with_policies(adapter.complete_map({path: policy}))
        measured.append(float(jnp.mean(_mlp_loss(tuned, x, labels))) - base)
    assert _spearman(measured, estimated) > 0.9
    np.testing.assert_allclose(estimated, measured, rtol=0.25, atol=1e-5)


@pytest.mark.slow
def test_tiny_llama_estimate_ranks_layers_like_measured_loss_changes(llama):
    adapter, ids, captured = llama
    pairs = [(l.path, c) for l in adapter.layers() for c in (INT8, INT4) if l.supports(c)]
    records = first_order.batch_terms(adapter, captured, pairs)
    base = float(jnp.mean(generation.token_nll(adapter.model, ids)))
    estimated, measured = [], []
    for path, policy in pairs:
        terms = first_order.combine([records[(path, policy.name)]])
        estimated.append(first_order.loss_change(terms, "both"))
        tuned = adapter.with_policies(adapter.complete_map({path: policy}))
        measured.append(float(jnp.mean(generation.token_nll(tuned, ids))) - base)
    assert len(pairs) == 17  # the embedding has no int4 kernel
    # An untrained model: the first-order term dominates and ranks the pairs almost exactly;
    # int8 errors are small enough for the expansion to give the changes themselves.
    assert _spearman(measured, estimated) > 0.9
    int8 = [i for i, (_, policy) in enumerate(pairs) if policy == INT8]
    np.testing.assert_allclose(np.take(estimated, int8), np.take(measured, int8), rtol=0.1, atol=1e-4)


class _Counting:
    """Wraps an adapter, counting its backward passes."""

    def __init__(self, adapter):
        self.adapter, self.passes = adapter, 0

    def output_gradients(self, loss_fn, batch):
        self.passes += 1
        return self.adapter.output_gradients(loss_fn, batch)

    def layer_outputs(self, *args):
        return self.adapter.layer_outputs(*args)


def test_terms_are_cached_per_batch_and_a_rerun_resumes(mlp, tmp_path):
    adapter, x, labels = mlp
    counting = _Counting(adapter)
    batches = [(x[:8], labels[:8]), (x[8:], labels[8:])]
    pairs = [("mlp/hidden", INT8), ("mlp/hidden", INT4), ("mlp/out", INT4)]
    keyed = lambda b, p, n: f"{b}|{p}|{n}"  # noqa: E731
    with MeasurementCache(tmp_path) as cache:
        first = first_order.measure_terms(counting, cache, keyed, _mlp_loss, batches, pairs)
    assert counting.passes == 2 and len(first[("mlp/out", INT4.name)]) == 2
    with MeasurementCache(tmp_path) as cache:
        again = first_order.measure_terms(counting, cache, keyed, _mlp_loss, batches, pairs)
        assert cache.hits == 6 and cache.misses == 0
    assert counting.passes == 2 and again == first
    with MeasurementCache(tmp_path) as cache:  # a run killed during batch 1: only it is run again
        del cache.entries["1|mlp/out|int4_from_float32"]
        resumed = first_order.measure_terms(counting, cache, keyed, _mlp_loss, batches, pairs)
    assert counting.passes == 3
    assert resumed == first


def test_combine_weights_batches_by_their_examples():
    one = {"finite": True, "dot": 1.0, "square": 2.0, "signal": 1.0, "noise": 0.1, "examples": 10}
    two = {"finite": True, "dot": -3.0, "square": 1.0, "signal": 1.0, "noise": 0.1, "examples": 30}
    terms = first_order.combine([one, two])
    assert terms["first"] == pytest.approx((10 * 1.0 + 30 * -3.0) / 40)
    assert terms["fisher"] == pytest.approx(0.5 * (100 * 2.0 + 900 * 1.0) / 40)
    assert terms["sqnr_db"] == pytest.approx(10.0)
    assert first_order.combine([one, {"finite": False, "examples": 3}])["finite"] is False


@pytest.mark.parametrize("link,change,expected", [("exp", 0.01, 20.0 * np.expm1(0.01)), ("loss", 0.25, 0.25),
                                                  ("fitted", 0.5, 1.5), ("exp", -0.1, 0.0)])
def test_metric_cost_per_link(link, change, expected):
    assert first_order.metric_cost(change, link, 20.0, scale=3.0) == pytest.approx(expected)


def test_the_cautious_estimate_never_credits_a_layer_for_improving_the_loss():
    assert first_order.loss_change({"first": -0.3, "fisher": 0.2}, "cautious") == pytest.approx(0.2)
    assert first_order.loss_change({"first": 0.1, "fisher": 0.2}, "cautious") == pytest.approx(0.3)
    assert first_order.loss_change({"first": -0.3, "fisher": 0.2}, "both") == pytest.approx(-0.1)
    assert first_order.ESTIMATOR == "cautious"
    with pytest.raises(ValueError, match=r"estimator must be one of \['first', 'fisher', 'both', 'cautious'\]. "
                                         r"Received: estimator='sum'"):
        first_order.loss_change({"first": 0.0, "fisher": 0.0}, "sum")


def _profile(costs):
    Status = search.phases.Status
    entries = {path: {name: search.phases.LayerAccuracy(Status.FIRST_ORDER, cost=c) for name, c in row.items()}
               for path, row in costs.items()}
    entries["head"] = {"float32": search.phases.LayerAccuracy(Status.REFERENCE, cost=0.0),
                       "int8": search.phases.LayerAccuracy(Status.SLOWER)}
    return search.phases.AccuracyProfile(entries, "first_order", 0)


def test_calibrate_scales_each_candidate_to_its_uniform_policys_change_in_the_loss():
    # Perplexity 20 (exp link): costs 0.5 and 1.5 are loss changes log1p(c / 20); the uniform
    # policy rose by 4, a loss change of log1p(4 / 20), which the scaled costs add up to.
    profile = _profile({"a": {"int8": 0.5, "int4": 2.0}, "b": {"int8": 1.5, "int4": 6.0}})
    out = first_order.calibrate(profile, "exp", 20.0, {"int8": 4.0, "int4": -1.0})
    loss = lambda c: np.log1p(c / 20.0)  # noqa: E731
    assert out.scales["int8"] == pytest.approx(loss(4.0) / (loss(0.5) + loss(1.5)))
    assert loss(out.get("a", "int8").cost) + loss(out.get("b", "int8").cost) == pytest.approx(loss(4.0))
    assert out.get("a", "int8").cost / out.get("b", "int8").cost == pytest.approx(0.32, abs=0.01)
    # The uniform policy improved the metric: its layers cost nothing.
    assert out.scales["int4"] == 0.0 and out.get("b", "int4").cost == 0.0
    # What has no estimate, and a candidate with no finite observation, are left as they were.
    assert out.get("head", "int8").status == search.phases.Status.SLOWER
    assert out.get("head", "float32").cost == 0.0
    same = first_order.calibrate(profile, "loss", 20.0, {"int8": float("nan")})
    assert same.scales is None and same.get("a", "int8").cost == 0.5
    # In the metric's units for other links.
    loss_link = first_order.calibrate(profile, "loss", 20.0, {"int8": 1.0})
    assert loss_link.get("a", "int8").cost == pytest.approx(0.25) and loss_link.get("b", "int8").cost == pytest.approx(0.75)


def test_bad_arguments_are_clear_errors(mlp):
    adapter, x, labels = mlp
    model = adapter.model
    accuracy = lambda m: 0.9  # noqa: E731
    with pytest.raises(ValueError, match=r"profile_accuracy='first_order' needs loss_fn=.*Received: loss_fn=None"):
        search.tune(model, accuracy, x, profile_accuracy="first_order", progress=False)
    with pytest.raises(ValueError, match=r"loss_link must be one of \['exp', 'loss', 'fitted'\]. Received: "
                                         r"loss_link='log'"):
        search.tune(model, accuracy, x, profile_accuracy="first_order", loss_fn=_mlp_loss, loss_link="log")
    with pytest.raises(ValueError, match="loss_link='exp' reads the metric as exp\\(loss\\).*higher_is_better=True"):
        search.tune(model, accuracy, x, loss_fn=_mlp_loss, loss_link="exp")
    with pytest.raises(TypeError, match="loss_fn must be a function"):
        search.tune(model, accuracy, x, loss_fn="cross_entropy")
    with pytest.raises(ValueError, match=r"profile_accuracy must be one of \['auto', 'first_order', 'measure', "
                                         r"'always'\]"):
        search.tune(model, accuracy, x, profile_accuracy="fisher")
    with pytest.raises(TypeError, match="loss_fn must return floating"):
        adapter.output_gradients(lambda m, x, labels: labels, (x, labels))


def test_an_adapter_without_gradients_is_refused_for_first_order():
    class Plain:  # the protocol's required methods only
        pass

    assert supports_first_order(Plain()) is False
    with pytest.raises(ValueError, match=r"needs an adapter with \['output_gradients', 'layer_outputs'\]; Plain"):
        first_order.check_arguments("first_order", _mlp_loss, "fitted", True, Plain())


def test_output_gradients_is_a_frozen_record(llama):
    _, _, captured = llama
    assert isinstance(captured, OutputGradients)
    with pytest.raises(AttributeError):
        captured.loss = 0.0


@pytest.mark.slow
def test_tune_with_first_order_solves_from_the_estimate_and_a_rerun_measures_nothing(tmp_path, monkeypatch):
    """tune with profile_accuracy="first_order" on an MLP whose float32 answers are its labels
    (so quantizing costs loss): costs from the estimate, no one-layer evaluation, a chosen map
    within budget; the rerun reads every figure, the first-order terms included, from the
    run's cache. Whether the fastest map meets the budget depends on this machine's timings, so
    that first check is made to fail here, and no candidate is skipped as slower than float32:
    the estimate always runs, on every candidate."""
    monkeypatch.setattr(search.verify, "fastest_first", lambda *args, **kwargs: ([], False))
    monkeypatch.setattr(first_order, "dominated", lambda *args: False)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((64, 32)), jnp.float32)
    model = nn.Sequential([nn.Dense(64, activation="tanh", name="hidden"), nn.Dense(64, activation="tanh", name="mid"),
                           nn.Dense(5, name="out")], name="mlp").build(jax.random.key(3), x)
    labels = jnp.argmax(model(x), -1).astype(jnp.int32)
    metric = lambda m: float(jnp.mean(_mlp_loss(m, x, labels)))  # noqa: E731
    kwargs = dict(candidates=("int8_from_float32", "int4_from_float32"), max_drop=1e-4, relative=False,
                  higher_is_better=False, loss_inputs=[(x, labels)], profile_accuracy="first_order",
                  loss_fn=_mlp_loss, loss_link="loss", progress=False, repeats=3, confirm_seconds=1.0,
                  cache_dir=str(tmp_path))
    result = search.tune(model, metric, x, **kwargs)
    assert result.accuracy.method == "first_order"
    estimated = [(path, name, a) for path, table in result.accuracy.entries.items() for name, a in table.items()
                 if a.status == search.phases.Status.FIRST_ORDER]
    assert len(estimated) == 6 and all(a.cost >= 0 and np.isfinite(a.sqnr_db) for _, _, a in estimated)
    for path in ("mlp/hidden", "mlp/mid", "mlp/out"):
        table = result.accuracy.entries[path]
        assert table["int8_from_float32"].sqnr_db > table["int4_from_float32"].sqnr_db + 15
    assert max(result.accuracy.entries[p]["int4_from_float32"].cost for p in ("mlp/hidden", "mlp/mid")) > 1e-4
    assert result.evaluations["profile"] == 0
    assert result.chosen.meets_budget and result.budget.meets(result.chosen.metric)
    # Each candidate's estimates were scaled to add up to its uniform policy's measured change.
    uniforms = {c.uniform: c for c in result.configurations if c.kind == "uniform" and c.uniform != "float32"}
    assert set(result.accuracy.scales) == {"int8_from_float32", "int4_from_float32"}
    for name, u in uniforms.items():
        total = sum(result.accuracy.entries[p][name].cost for p in ("mlp/hidden", "mlp/mid", "mlp/out"))
        assert total == pytest.approx(max(result.budget.drop(u.metric), 0.0), rel=1e-6, abs=1e-12)
    passes = []
    original = NNAdapter.output_gradients
    monkeypatch.setattr(NNAdapter, "output_gradients", lambda self, *a: passes.append(1) or original(self, *a))
    again = search.tune(model, metric, x, **kwargs)
    assert passes == []  # every first-order term came from the cache
    assert again.accuracy.entries == result.accuracy.entries


def test_experiment_validates_its_loss_fields():
    from autopolicy.experiment import Experiment

    base = dict(name="x", model=object(), eval_fn=lambda m: 1.0, sample_input=np.ones(2))
    assert Experiment(**base, loss_fn=_mlp_loss, loss_link="exp").loss_link == "exp"
    with pytest.raises(ValueError, match=r"loss_link must be one of \['exp', 'loss', 'fitted'\]. Received: "
                                         r"loss_link='perplexity'"):
        Experiment(**base, loss_link="perplexity")
    with pytest.raises(TypeError, match="loss_fn must be a function"):
        Experiment(**base, loss_fn=3)


def test_cli_offers_first_order():
    from autopolicy import cli

    args = cli.build_parser().parse_args(["tune", "smollm2", "--profile-accuracy", "first_order"])
    assert args.profile_accuracy == "first_order"
