"""Model adapters: how the search reaches the models of each framework.

``autopolicy.adapters.nn`` (autopolicy's own layers) and ``autopolicy.adapters.keras`` (Keras 3)
register themselves when imported; :func:`autopolicy.search.tune` imports the one a model needs.
See :mod:`autopolicy.search.adapter` for the protocol.
"""

__all__: list[str] = []
