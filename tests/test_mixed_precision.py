"""The TF 2 legacy Policy with a loss scale."""

import pickle

import jax
import pytest

import autopolicy as ap
from autopolicy.mixed_precision import Policy


@pytest.mark.parametrize(
    "name,loss_scale,expected",
    [
        ("mixed_float16", "auto", ("dynamic", 2.0**15, 2000)),
        ("mixed_bfloat16", "auto", None),
        ("float32", "auto", None),
        ("float32", "dynamic", ("dynamic", 2.0**15, 2000)),
        ("mixed_float16", None, None),
        ("mixed_float16", 1024, ("static", 1024.0)),
        ("mixed_float16", 512.0, ("static", 512.0)),
        ("mixed_float16", ap.StaticLossScale(8.0), ("static", 8.0)),
        ("mixed_float16", ap.DynamicLossScale(64.0, growth_interval=10), ("dynamic", 64.0, 10)),
        ("mixed_float16", ap.NoOpLossScale(), None),
    ],
)
def test_loss_scale_choices(name, loss_scale, expected):
    policy = Policy(name, loss_scale)
    ls = policy.loss_scale
    if expected is None:
        assert ls is None
    elif expected[0] == "static":
        assert isinstance(ls, ap.StaticLossScale) and float(ls.loss_scale) == expected[1]
    else:
        assert isinstance(ls, ap.DynamicLossScale)
        assert (float(ls.loss_scale), ls.growth_interval) == expected[1:]
        assert int(ls.counter) == 0
    assert policy.compute_dtype == ap.DTypePolicy(name).compute_dtype


@pytest.mark.parametrize("bad", ["sometimes", -1, 0, float("nan"), True, [2.0]])
def test_invalid_loss_scale(bad):
    with pytest.raises((ValueError, TypeError)) as info:
        Policy("mixed_float16", bad)
    assert repr(bad)[:4] in str(info.value)


def test_legacy_policy_is_a_hashable_dtype_policy():
    p = Policy("mixed_float16")
    assert isinstance(p, ap.DTypePolicy)
    assert p.should_cast_variables
    assert hash(p) == hash(Policy("mixed_float16"))
    assert p != Policy("mixed_float16", loss_scale=None)
    assert pickle.loads(pickle.dumps(p)) == p
    assert jax.jit(lambda x, policy: x, static_argnums=1)(1.0, p) == 1.0
    assert repr(Policy("mixed_bfloat16")) == '<Policy "mixed_bfloat16", loss_scale=None>'


def test_legacy_policy_serializes_as_a_keras_dtype_policy():
    assert ap.serialize(Policy("mixed_float16")) == ap.serialize(ap.DTypePolicy("mixed_float16"))


def test_legacy_policy_can_be_the_global_policy():
    with ap.policy_scope(Policy("mixed_float16", 128)):
        assert isinstance(ap.mixed_precision.global_policy(), Policy)
        assert float(ap.mixed_precision.global_policy().loss_scale.loss_scale) == 128.0
