"""``unsplit.nnx.Dropout``: ``flax.nnx.Dropout`` with unsplit's fast prefix-stable mask."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from flax import nnx

from unsplit._src.dropout.functional import layer_dropout

T = TypeVar("T")

_NO_DETERMINISTIC = (
    "No `deterministic` argument was provided to Dropout. Consider one of the following "
    "options:\n\n"
    "1. Pass `deterministic` to the Dropout constructor:\n\n"
    "  self.dropout = nnx.Dropout(..., deterministic=True/False)\n\n"
    "2. Pass `deterministic` to the Dropout __call__:\n\n"
    "  self.dropout(x, deterministic=True/False)\n\n"
    "3. Use `nnx.view` to create a view of the model with a specific `deterministic` "
    "value:\n\n"
    "  model_view = nnx.view(model, deterministic=True/False)\n"
)
_NO_RNGS = (
    "`deterministic` is False, but no `rngs` argument was provided to Dropout as either a "
    "__call__ argument or class attribute. Fix: Dropout(rate, rngs=nnx.Rngs(0)) (or "
    "nnx.Rngs(dropout=0)), call it with rngs=key, or pass deterministic=True."
)


class Dropout(nnx.Dropout):
    """``flax.nnx.Dropout`` whose mask comes from unsplit's prefix-stable 16-bit lanes.

    Everything but the random bits is Flax's: it subclasses ``flax.nnx.Dropout``
    (so filters on ``nnx.Dropout``, ``model.train()`` / ``model.eval()``,
    ``nnx.view`` and ``set_attributes`` work), is named ``Dropout`` (``repr``,
    ``nnx.tabulate``, ``iter_modules``), and has its constructor
    ``Dropout(rate, *, broadcast_dims=(), deterministic=False,
    rng_collection='dropout', rngs=None)``, its ``__call__(inputs, *,
    deterministic=None, rngs=None)`` and its stream resolution: with an
    ``nnx.Rngs`` the layer forks ``rngs[rng_collection]``, which falls back to
    the ``default`` stream (so ``nnx.Rngs(0)`` works, as in Flax), and each
    call draws the next key; a call-time ``rngs`` (``Rngs``, ``RngStream`` or
    key) takes precedence, and so does a call-time ``deterministic``.

    What differs is only the mask: element ``i`` (flat index) depends only on
    ``(key, i)`` and one threefry hash serves four elements; kept elements are
    divided by the keep probability the 16-bit threshold gives (within
    ``2**-17`` of ``1 - rate``). A ``rate`` outside ``[0, 1]`` raises a
    ``ValueError`` where Flax returns a meaningless result.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from unsplit import nnx as unnx
        >>> layer = unnx.Dropout(0.5, rngs=nnx.Rngs(0))
        >>> a, b = layer(jnp.ones(64)), layer(jnp.ones(64))
        >>> bool(jnp.any(a != b)), int(layer.rngs.count[...])
        (True, 2)
        >>> type(layer).__name__, isinstance(layer, nnx.Dropout)
        ('Dropout', True)
    """

    def __init__(
        self,
        rate: float,
        *,
        broadcast_dims: Sequence[int] = (),
        deterministic: bool | None = False,
        rng_collection: str = "dropout",
        rngs: nnx.Rngs | nnx.RngStream | None = None,
    ):
        self.rate = rate
        self.broadcast_dims = broadcast_dims
        self.deterministic = deterministic
        self.rng_collection = rng_collection
        if isinstance(rngs, nnx.Rngs):
            self.rngs = rngs[self.rng_collection].fork()
        elif isinstance(rngs, nnx.RngStream):
            self.rngs = rngs.fork()
        elif rngs is None:
            self.rngs = nnx.data(None)
        else:
            raise TypeError(
                f"rngs must be a Rngs, RngStream or None, but got {type(rngs)}. Fix: "
                f"Dropout(rate, rngs=nnx.Rngs(0)), or rngs=nnx.Rngs({rng_collection}=0)."
            )

    def __call__(
        self,
        inputs: Any,
        *,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | nnx.RngStream | jax.Array | None = None,
    ) -> Any:
        """Applies a random dropout mask to ``inputs`` (as ``flax.nnx.Dropout`` does).

        Args:
            inputs: the inputs to mask.
            deterministic: if true, ``inputs`` are returned as they are; takes
                precedence over the constructor's ``deterministic``.
            rngs: an optional ``nnx.Rngs``, ``nnx.RngStream`` or key; takes
                precedence over the stream stored at construction.

        Returns:
            The masked inputs, kept elements scaled to preserve the mean.
        """
        deterministic = _first_from(deterministic, self.deterministic, error=_NO_DETERMINISTIC)
        if (self.rate == 0.0) or deterministic:
            return inputs
        if self.rate == 1.0:  # no draw: prevents NaN gradients, as flax does
            return jnp.zeros_like(inputs)
        source = _first_from(rngs, self.rngs, error=_NO_RNGS)
        if isinstance(source, nnx.Rngs):
            key = source[self.rng_collection]()
        elif isinstance(source, nnx.RngStream):
            key = source()
        elif isinstance(source, jax.Array):
            key = source
        else:
            raise TypeError(
                f"rngs must be a Rngs, RngStream or jax.Array, but got {type(source)}. Fix: "
                "call it with rngs=jax.random.key(seed), an nnx.Rngs or an nnx.RngStream."
            )
        return layer_dropout(key, inputs, self.rate, self.broadcast_dims)


def _first_from(*values: T | None, error: str) -> T:
    """The first value that is not None (``flax.nnx``'s rule), else ``ValueError(error)``."""
    for value in values:
        if value is not None:
            return value
    raise ValueError(error)
