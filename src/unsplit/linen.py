"""Drop-ins for Flax Linen: ``Dropout`` and ``dot_product_attention`` with unsplit's masks.

Swap the class or the ``attention_fn``; everything but the random bits stays
Flax's (fields, calls, names, rng streams and their fallbacks, errors).

Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> from unsplit import linen as ulinen
    >>> class Block(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x, train):
    ...         x = nn.MultiHeadDotProductAttention(
    ...             num_heads=2, dropout_rate=0.1, deterministic=not train,
    ...             attention_fn=ulinen.dot_product_attention)(x)
    ...         return ulinen.Dropout(0.1, deterministic=not train)(nn.Dense(4)(x))
    >>> x = jnp.ones((2, 8, 4))
    >>> variables = Block().init(jax.random.key(0), x, train=False)
    >>> Block().apply(variables, x, train=True, rngs={"dropout": jax.random.key(1)}).shape
    (2, 8, 4)
"""

from unsplit._src.extras import require

require("flax", extra="flax", what="unsplit.linen")

from unsplit._src.dropout.attention import linen_dot_product_attention as dot_product_attention
from unsplit._src.dropout.linen import Dropout as Dropout

__all__ = ["Dropout", "dot_product_attention"]
