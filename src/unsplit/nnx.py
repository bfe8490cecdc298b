"""Drop-ins for Flax NNX: ``Dropout`` and ``dot_product_attention`` with unsplit's masks.

Swap the class or the ``attention_fn``; everything but the random bits stays
Flax's (constructor, call, names, rng streams and their fallbacks, errors).

Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from unsplit import nnx as unnx
    >>> class MLP(nnx.Module):
    ...     def __init__(self, rngs):
    ...         self.linear = nnx.Linear(3, 4, rngs=rngs)
    ...         self.dropout = unnx.Dropout(0.1, rngs=rngs)
    ...     def __call__(self, x):
    ...         return self.dropout(self.linear(x))
    >>> model = MLP(nnx.Rngs(0))  # one default stream, as in Flax
    >>> model(jnp.ones((2, 3))).shape
    (2, 4)
"""

from unsplit._src.extras import require

require("flax", extra="flax", what="unsplit.nnx")

from unsplit._src.dropout.attention import nnx_dot_product_attention as dot_product_attention
from unsplit._src.dropout.nnx import Dropout as Dropout

__all__ = ["Dropout", "dot_product_attention"]
