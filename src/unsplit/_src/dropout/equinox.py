"""``unsplit.equinox.Dropout``: ``equinox.nn.Dropout`` with unsplit's fast prefix-stable mask."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import equinox as eqx
import jax
import jax.core  # jax.core.Tracer: imported, so type checkers see the module
import jax.numpy as jnp
import numpy as np
from jax import lax

from unsplit._src import masks, random
from unsplit._src.dropout.functional import MaskLayout, check_rate, masked, sharding_specs

_NO_KEY = (
    "Dropout requires a key when running in non-deterministic mode. Fix: call it with "
    "key=jax.random.key(seed) (per example: a key from unsplit.example_keys), or with "
    "inference=True (eqx.nn.inference_mode(model) for a whole model)."
)


class Dropout(eqx.nn.Dropout):
    """``equinox.nn.Dropout`` whose mask comes from unsplit's prefix-stable 16-bit lanes.

    Everything but the random bits is Equinox's: it subclasses
    ``eqx.nn.Dropout`` (so ``isinstance`` checks, ``eqx.nn.inference_mode`` and
    ``eqx.tree_at`` on its fields work), with its fields ``p=0.5`` and
    ``inference=False``, its ``__call__(x, *, key=None, inference=None)`` (a
    call-time ``inference`` wins; a Python ``p == 0`` never draws), its error
    without a key, the deprecated ``deterministic`` aliases, and its handling
    of a ``p`` that is a JAX array or traced (no gradient flows into ``p``;
    the output dtype is that of ``x / (1 - p)``).

    What differs is only the mask: element ``i`` (flat index) depends only on
    ``(key, i)`` and one threefry hash serves four elements; kept elements are
    divided by the keep probability the 16-bit threshold gives (within
    ``2**-17`` of ``1 - p``), so the expectation is exact; ``p == 1`` gives
    zeros with zero (not NaN) gradients. A concrete ``p`` outside ``[0, 1]``
    raises a ``ValueError``; a traced one is clipped to ``[0, 1]``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from unsplit import equinox as ueqx
        >>> dropout = ueqx.Dropout(p=0.5)
        >>> y = dropout(jnp.ones(8), key=jax.random.key(0))
        >>> sorted({float(v) for v in y})
        [0.0, 2.0]
        >>> dropout(jnp.ones(2), inference=True)
        Array([1., 1.], dtype=float32)
    """

    if TYPE_CHECKING:  # Equinox's own __init__ (type checkers would derive one from the fields)

        def __init__(
            self, p: float = 0.5, inference: bool = False, *, deterministic: bool | None = None
        ) -> None: ...

    @jax.named_scope("unsplit.equinox.Dropout")
    def __call__(
        self,
        x: Any,
        *,
        key: Any = None,
        inference: bool | None = None,
        deterministic: bool | None = None,
    ) -> jax.Array:
        """Applies dropout (as ``eqx.nn.Dropout`` does).

        Args:
            x: an array of any shape.
            key: a threefry PRNG key (``jax.random.key``); needed unless inference.
            inference: ``True`` returns ``x``; ``None`` uses ``self.inference``.
            deterministic: deprecated alias of ``inference``.

        Returns:
            ``x`` with each element dropped with probability ``p`` and the rest
            divided by the keep probability.
        """
        if deterministic is not None:
            inference = deterministic
            warnings.warn(
                "Dropout()(deterministic=...) is deprecated in favour of Dropout()(inference=...)",
                stacklevel=2,
            )
        if inference is None:
            inference = self.inference
        if isinstance(self.p, (int, float)) and self.p == 0:
            inference = True
        if inference:
            return x
        if key is None:
            raise RuntimeError(_NO_KEY)
        return equinox_dropout(key, x, self.p)


def equinox_dropout(key: Any, x: Any, p: Any) -> jax.Array:
    """Equinox's draw, ``where(mask, x / (1 - p), 0)``, with unsplit's mask; ``p`` may be traced."""
    q = 1 - lax.stop_gradient(p)  # Equinox's keep probability: its dtype sets the output's
    if isinstance(p, jax.core.Tracer):
        threshold = masks.keep_threshold_array(q)
        divisor = jnp.maximum(threshold, np.uint32(1)).astype(jnp.float32) / random.LANE_VALUES
    else:
        threshold = np.uint32(masks.keep_threshold(check_rate(p)))
        divisor = masks.keep_probability(max(int(threshold), 1))  # p == 1: all dropped anyway
    data = random.key_data(key)
    x = jnp.asarray(x)
    dtype = jnp.result_type(x, q)
    scaled = x.astype(dtype) / jnp.asarray(divisor, dtype)
    x_spec, spec = sharding_specs(scaled, x.shape)
    return masked(data, threshold, scaled, MaskLayout(False, x.shape, x_spec, spec))
