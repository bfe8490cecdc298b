"""Drop-in for Equinox: ``unsplit.equinox.Dropout`` for ``equinox.nn.Dropout``.

Same fields and call as Equinox's (``Dropout(p=0.5, inference=False)``,
``dropout(x, *, key=None, inference=None)``); only the random bits differ.

Example:
    >>> import jax, jax.numpy as jnp, equinox as eqx
    >>> from unsplit import equinox as ueqx
    >>> model = eqx.nn.Sequential([eqx.nn.Linear(3, 4, key=jax.random.key(0)),
    ...                            ueqx.Dropout(p=0.1)])
    >>> model(jnp.ones(3), key=jax.random.key(1)).shape
    (4,)
    >>> eqx.nn.inference_mode(model).layers[1].inference
    True
"""

from unsplit._src.extras import require

require("equinox", extra="equinox", what="unsplit.equinox")

from unsplit._src.dropout.equinox import Dropout as Dropout

__all__ = ["Dropout"]
