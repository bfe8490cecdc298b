"""Drop-in Flax Linen layers: ``unsplit.linen.Dropout`` for ``flax.linen.Dropout``.

Example:
    >>> import flax.linen as nn
    >>> from unsplit import linen as ulinen
    >>> class MLP(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x, train):
    ...         return ulinen.Dropout(0.1, deterministic=not train)(nn.Dense(4)(x))
"""

from unsplit._src.dropout import LinenDropout as Dropout

__all__ = ["Dropout"]
