"""Fast, prefix-stable dropout: the function, and the masked select every drop-in shares.

* :func:`dropout` -- ``dropout(key, x, rate, *, broadcast_dims=())``, for
  code where keys are passed explicitly;
* :func:`masked` -- ``select(mask, x, 0)`` with the mask drawn from
  :mod:`unsplit._src.random` (flat or grid layout); its ``jax.custom_vjp``
  draws the mask again in the backward pass instead of storing it. The layers
  (``unsplit.linen``, ``unsplit.nnx``, ``unsplit.equinox``) and the attention
  functions scale ``x`` their library's way, then call it.

Semantics follow Flax: ``rate`` is the drop probability; ``rate == 0`` returns
the input itself and ``rate == 1`` returns zeros (no draw, no NaN gradients);
kept elements are divided by the keep probability in ``x``'s dtype;
``broadcast_dims`` share one mask along those axes (the mask is drawn with
those axes of size 1). The keep probability is the one the 16-bit threshold
actually gives (``masks.keep_probability``), so ``E[dropout(x)] == x``
exactly at every rate (see :mod:`unsplit._src.random` for the resolution).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.core  # jax.core.Tracer: imported, so type checkers see the module
import jax.numpy as jnp
import numpy as np
from jax import lax

from unsplit._src import masks, random


class MaskLayout(NamedTuple):
    """Which mask :func:`masked` draws: its layout, shape and shardings (static)."""

    grid: bool  # False: flat index (layers); True: per-coordinate (attention weights)
    shape: tuple[int, ...]  # the mask's shape: x's, with broadcast axes of size 1
    x_spec: jax.P | None = None  # x's PartitionSpec under an explicit mesh
    spec: jax.P | None = None  # the mask's


class BroadcastDimsError(ValueError, IndexError):
    """A ``broadcast_dims`` entry is not an axis of the input.

    A ``ValueError`` for unsplit, and an ``IndexError`` like the one Flax's
    layers raise for it (they index a list of the input's axes).
    """


def dropout(
    key: jax.Array, x: jax.typing.ArrayLike, rate: float, *, broadcast_dims: Sequence[int] = ()
) -> jax.Array:
    """Zeroes each element of ``x`` with probability ``rate`` and scales the rest to keep the mean.

    The mask element at flat index ``i`` depends only on ``(key, i)``, so a
    longer (padded) ``x`` keeps the same mask on the shared prefix. Give each
    example its own key (``unsplit.example_keys``) and ``jax.vmap`` over them.

    Args:
        key: a threefry PRNG key of shape ``()`` (``jax.random.key``), or a
            legacy ``uint32[2]`` key.
        x: a floating-point (or complex) array.
        rate: the drop probability, a Python number in ``[0, 1]`` (resolution
            ``2**-16``). ``0`` returns ``x``; ``1`` returns zeros.
        broadcast_dims: axes of ``x`` that share one mask (the mask is drawn
            with these axes of size 1).

    Returns:
        An array of ``x``'s shape and dtype: kept elements are ``x / p`` with
        ``p = keep_threshold(rate) / 2**16`` the keep probability used (within
        ``2**-17`` of ``1 - rate``), so the expectation is exactly ``x``.

    Raises:
        ValueError: ``rate`` is outside ``[0, 1]``, or a ``broadcast_dims``
            entry is not an axis of ``x``.
        TypeError: ``rate`` is traced, ``x`` is not floating point, or ``key``
            is not a threefry key.

    Example:
        >>> import jax, jax.numpy as jnp, unsplit
        >>> y = unsplit.dropout(jax.random.key(0), jnp.ones((2, 4)), 0.5)
        >>> sorted({float(v) for v in y.ravel()})
        [0.0, 2.0]
        >>> keys = unsplit.example_keys(jax.random.key(1), jnp.arange(8))
        >>> jax.vmap(lambda k, x: unsplit.dropout(k, x, 0.1))(keys, jnp.ones((8, 16))).shape
        (8, 16)
    """
    rate = check_rate(rate)
    x = jnp.asarray(x)
    check_inexact(x)
    data = random.key_data(key)
    shape = mask_shape(x.shape, broadcast_dims)
    if rate == 0.0:
        return x
    if rate == 1.0:
        return jnp.zeros_like(x)
    return flat_dropout(data, x, rate, shape)


def layer_dropout(
    key: jax.Array, inputs: Any, rate: Any, broadcast_dims: Sequence[int]
) -> jax.Array:
    """The draw of a Flax-style layer once Flax would draw (``0 < rate < 1``, not deterministic)."""
    rate = check_rate(rate)
    x = jnp.asarray(inputs)
    shape = mask_shape(x.shape, broadcast_dims)
    scaled = _scale(x, rate)  # first, as flax: an integer x fails here under strict promotion
    check_inexact(x)
    return flat_dropout(random.key_data(key), scaled, rate, shape, scaled=True)


def _scale(x: jax.Array, rate: float) -> jax.Array:
    # A Python float divisor keeps x's dtype, as flax's ``inputs / keep_prob``.
    return x / masks.keep_probability(masks.keep_threshold(rate))


def flat_dropout(
    data: jax.Array, x: jax.Array, rate: float, shape: tuple[int, ...], *, scaled: bool = False
) -> jax.Array:
    """``select(mask, x / p, 0)`` in the flat layout, for ``0 < rate < 1`` (``x / p`` given if scaled)."""
    threshold = masks.keep_threshold(rate)
    if not scaled:
        x = _scale(x, rate)
    x_spec, spec = sharding_specs(x, shape)
    return masked(data, np.uint32(threshold), x, MaskLayout(False, shape, x_spec, spec))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def masked(data: jax.Array, threshold: Any, x: jax.Array, layout: MaskLayout) -> jax.Array:
    """``select(lanes < threshold, x, 0)``, the lanes drawn in ``layout`` from the key words.

    Args:
        data: the key's ``uint32[2]`` words.
        threshold: the keep threshold (``uint32``; may be traced).
        x: the (already scaled) values; the mask broadcasts to its shape.
        layout: the mask's layout, shape and shardings.

    Returns:
        ``x`` where the mask keeps, zeros elsewhere (a shared attention mask,
        ``broadcast_dropout=True``, multiplies ``x`` by 0 or 1, as Flax does).
        Its gradient is the cotangent masked the same way; the mask is drawn
        again, never stored.
    """
    return _select(data, threshold, x, layout)


def _masked_fwd(data, threshold, x, layout):
    return _select(data, threshold, x, layout), (data, threshold)


def _masked_bwd(layout, residuals, g):
    # The residuals are the key and threshold alone: the mask is drawn again, never stored.
    data, threshold = residuals
    return None, None, _select(data, threshold, g, layout)


masked.defvjp(_masked_fwd, _masked_bwd)


@functools.partial(jax.jit, static_argnums=(3,))
def _select(data: jax.Array, threshold: Any, x: jax.Array, layout: MaskLayout) -> jax.Array:
    shared = layout.shape != x.shape  # a broadcast mask: drawn once at its own shape
    if layout.grid and not shared:
        mask = masks.grid_keep_mask_from_data(data, layout.shape, threshold, layout.spec)
    elif layout.grid:
        lanes = random.grid_lanes16_from_data(data, layout.shape, layout.spec, shared)
        mask = lanes < jnp.asarray(threshold, jnp.uint32)
    elif not shared:
        mask = masks.keep_mask_from_data(data, layout.shape, threshold, layout.spec)
    else:
        lanes = random.lanes16_from_data(data, layout.shape, layout.spec, shared)
        mask = lanes < jnp.asarray(threshold, jnp.uint32)
    if shared and layout.grid:
        # Attention weights (finite) times a small 0/1 multiplier, as flax multiplies:
        # XLA fuses it into the attention's matmuls instead of writing the weights again.
        return x * mask.astype(x.dtype)
    mask = jnp.broadcast_to(mask, x.shape, out_sharding=layout.x_spec)
    return lax.select(mask, x, jnp.zeros_like(x))


def sharding_specs(x: jax.Array, shape: tuple[int, ...]) -> tuple[jax.P | None, jax.P | None]:
    """x's and the mask's PartitionSpecs when x is sharded over explicit mesh axes, else None."""
    spec = getattr(jax.typeof(x).sharding, "spec", None)
    if spec is None or all(entry is None for entry in spec):
        return None, None
    entries = (*spec, *([None] * (len(shape) - len(spec))))
    return spec, jax.P(*(None if size == 1 else e for size, e in zip(shape, entries, strict=True)))


def check_rate(rate: Any) -> float:
    """Returns ``rate`` as a float, or raises a clear error unless it is in ``[0, 1]``."""
    if isinstance(rate, jax.core.Tracer):
        raise TypeError(
            f"dropout rate must be a concrete Python number; got a traced value {rate=}. "
            "Fix: pass the rate as a static Python float (e.g. rate=0.1), not a jit argument "
            "(use static_argnames for it)."
        )
    try:
        value = float(rate)
    except (TypeError, ValueError):
        raise TypeError(
            f"dropout rate must be a number in [0, 1]; got {rate=!r} of type "
            f"{type(rate).__name__}. Fix: pass e.g. rate=0.1."
        ) from None
    if not 0.0 <= value <= 1.0:  # also refuses NaN
        raise ValueError(
            f"dropout rate must be in [0, 1] (the probability of dropping an element, "
            f"not of keeping it); got {rate=}. Fix: pass e.g. rate=0.1; for a keep "
            "probability p use rate=1 - p."
        )
    return value


def check_inexact(x: jax.Array) -> None:
    """Raises unless ``x`` is floating point or complex (what dividing by the keep probability keeps)."""
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        raise TypeError(
            f"dropout needs a floating-point input; got dtype={x.dtype}. Fix: cast it, e.g. "
            "x.astype(jnp.float32) (kept elements are scaled by 1 / (1 - rate))."
        )


def mask_shape(shape: tuple[int, ...], broadcast_dims: Sequence[int]) -> tuple[int, ...]:
    """``shape`` with the ``broadcast_dims`` axes set to 1 (as flax does)."""
    out = list(shape)
    for dim in broadcast_dims:
        try:
            out[operator.index(dim)] = 1
        except (TypeError, IndexError):
            raise BroadcastDimsError(
                f"broadcast_dims must be axes of the input; got {broadcast_dims=} for an "
                f"input of shape {tuple(shape)}. Fix: use axes in [-{len(shape)}, "
                f"{len(shape) - 1}], e.g. broadcast_dims=(0,) to share the mask over axis 0."
            ) from None
    return tuple(out)
