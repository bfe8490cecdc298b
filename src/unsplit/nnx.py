"""Drop-in Flax NNX layers: ``unsplit.nnx.Dropout`` for ``flax.nnx.Dropout``.

Example:
    >>> from flax import nnx
    >>> from unsplit import nnx as unnx
    >>> class MLP(nnx.Module):
    ...     def __init__(self, rngs):
    ...         self.linear = nnx.Linear(3, 4, rngs=rngs)
    ...         self.dropout = unnx.Dropout(0.1, rngs=rngs)
    ...     def __call__(self, x):
    ...         return self.dropout(self.linear(x))
    >>> model = MLP(nnx.Rngs(params=0, dropout=1))
"""

from unsplit._src.dropout import NNXDropout as Dropout

__all__ = ["Dropout"]
