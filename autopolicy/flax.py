"""Policy maps on Flax NNX models: apply one to a copy, export it as Qwix rules.

Not imported by ``import autopolicy`` (importing this module imports Flax and Qwix); reachable
as ``autopolicy.flax`` on first use. ``autopolicy.search.tune`` accepts an NNX model directly.

>>> import jax, jax.numpy as jnp
>>> from flax import nnx
>>> import autopolicy.flax as apf
>>> class Net(nnx.Module):
...     def __init__(self, rngs):
...         self.hidden, self.out = nnx.Linear(8, 16, rngs=rngs), nnx.Linear(16, 4, rngs=rngs)
...     def __call__(self, x):
...         return self.out(nnx.relu(self.hidden(x)))
>>> net, x = Net(nnx.Rngs(0)), jax.random.normal(jax.random.key(1), (2, 8))
>>> tuned = apf.apply_policy_map(net, {"out": "mixed_bfloat16"}, x)
>>> tuned(x).dtype, net(x).dtype  # the original is untouched
(dtype(bfloat16), dtype('float32'))
>>> [rule.module_path for rule in apf.qwix_rules({"hidden": "int8_from_float32", "out": "mixed_bfloat16"})]
['hidden']
"""

from autopolicy.adapters._flax_save import load, save
from autopolicy.adapters.flax import (FlaxAdapter, apply_policy_map, quantized_layer, qwix_rules, rules_to_json,
                                      rules_to_python)

__all__ = ["FlaxAdapter", "apply_policy_map", "quantized_layer", "qwix_rules", "rules_to_json", "rules_to_python",
           "save", "load"]
