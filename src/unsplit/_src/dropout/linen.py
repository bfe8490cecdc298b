"""``unsplit.linen.Dropout``: ``flax.linen.Dropout`` with unsplit's fast prefix-stable mask."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from unsplit._src.dropout.functional import layer_dropout


class Dropout(nn.Dropout):
    """``flax.linen.Dropout`` whose mask comes from unsplit's prefix-stable 16-bit lanes.

    Everything but the random bits is Flax's: it subclasses
    ``flax.linen.Dropout`` (so ``isinstance(layer, nn.Dropout)`` holds), has its
    fields (``rate``, ``broadcast_dims=()``, ``deterministic=None``,
    ``rng_collection='dropout'``), its ``__call__(inputs, deterministic=None,
    rng=None)``, its name (auto-named ``Dropout_0`` in a compact module, shown as
    ``Dropout`` in ``nn.tabulate``), its ``deterministic`` rule
    (``nn.merge_param``: the field or the call, not both) and its key:
    ``self.make_rng(self.rng_collection)``, which falls back to the ``'params'``
    stream when ``rng_collection`` is not passed (so ``model.init(key, x)`` with
    a training-mode dropout works, as in Flax).

    What differs is only the mask: element ``i`` (flat index) depends only on
    ``(key, i)`` and one threefry hash serves four elements; kept elements are
    divided by the keep probability the 16-bit threshold gives (within
    ``2**-17`` of ``1 - rate``). A ``rate`` outside ``[0, 1]`` raises a
    ``ValueError`` where Flax returns a meaningless result.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from unsplit import linen as ulinen
        >>> layer = ulinen.Dropout(0.5, deterministic=False)
        >>> y = layer.apply({}, jnp.ones((2, 4)), rngs={"dropout": jax.random.key(0)})
        >>> sorted({float(v) for v in y.ravel()})
        [0.0, 2.0]
        >>> ulinen.Dropout(0.5).apply({}, jnp.ones(3), deterministic=True)
        Array([1., 1., 1.], dtype=float32)
    """

    @nn.compact
    def __call__(
        self, inputs: Any, deterministic: bool | None = None, rng: jax.Array | None = None
    ) -> Any:
        """Applies a random dropout mask to ``inputs`` (as ``flax.linen.Dropout`` does).

        Args:
            inputs: the inputs to mask.
            deterministic: if true, ``inputs`` are returned as they are; given
                here or as the field, not both.
            rng: an optional key; by default ``self.make_rng(self.rng_collection)``.

        Returns:
            The masked inputs, kept elements scaled to preserve the mean.
        """
        deterministic = nn.merge_param("deterministic", self.deterministic, deterministic)
        if (self.rate == 0.0) or deterministic:
            return inputs
        if self.rate == 1.0:  # no draw: prevents NaN gradients, as flax does
            return jnp.zeros_like(inputs)
        if rng is None:
            rng = self.make_rng(self.rng_collection)
        return layer_dropout(rng, inputs, self.rate, self.broadcast_dims)
