"""Keep masks from the fast bits: a 16-bit threshold per drop rate, one hash per four elements.

An element is kept iff its 16-bit lane (:mod:`unsplit._src.random`) is below
``keep_threshold(rate)``; the masks of the drop-ins compare the four lanes of
each hash inside the hash's own loop and pack the four keep bits in one byte
(:func:`keep_mask_from_data`, :func:`grid_keep_mask_from_data`): the same bits
as comparing the lanes, drawn faster.
"""

from __future__ import annotations

import functools
import math
import operator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from unsplit._src import random


def keep_threshold(rate: float) -> int:
    """Returns the 16-bit keep threshold for a drop ``rate`` in ``[0, 1]``.

    An element is kept iff its lane is below the threshold, so the keep
    probability is ``keep_probability(keep_threshold(rate))``.

    Args:
        rate: the drop probability, a Python number in ``[0, 1]``.

    Returns:
        ``round((1 - rate) * 2**16)`` (halves round up), at least 1 when
        ``rate < 1``: an int in ``[0, 2**16]``, 0 only for ``rate == 1``.

    Example:
        >>> from unsplit._src import masks
        >>> masks.keep_threshold(0.1), masks.keep_threshold(0.0), masks.keep_threshold(1.0)
        (58982, 65536, 0)
        >>> masks.keep_threshold(1 - 1e-6)  # never rounds to "drop everything"
        1
    """
    rate = float(rate)
    if rate >= 1.0:
        return 0
    return max(1, math.floor((1.0 - rate) * random.LANE_VALUES + 0.5))


def keep_probability(threshold: int) -> float:
    """The keep probability a threshold gives: ``threshold / 2**16`` (exact in float32).

    Example:
        >>> from unsplit._src import masks
        >>> masks.keep_probability(masks.keep_threshold(0.5))
        0.5
    """
    return threshold / random.LANE_VALUES


def keep_threshold_array(keep: jax.Array) -> jax.Array:
    """:func:`keep_threshold` for a traced keep probability ``keep = 1 - rate`` (``uint32``).

    ``keep`` is clipped to ``[0, 1]``; the rounding is done in float32.
    """
    scaled = jnp.clip(jnp.asarray(keep, jnp.float32), 0.0, 1.0) * np.float32(random.LANE_VALUES)
    rounded = jnp.floor(scaled + np.float32(0.5)).astype(jnp.uint32)
    return jnp.where(scaled > 0, jnp.maximum(rounded, np.uint32(1)), np.uint32(0))


def keep_mask(key: jax.Array, shape: tuple[int, ...], rate: float) -> jax.Array:
    """Returns a prefix-stable boolean keep mask (flat layout), ``True`` with probability ~``1 - rate``.

    Args:
        key: a threefry PRNG key of shape ``()``, or a legacy ``uint32[2]`` key.
        shape: the mask shape.
        rate: the drop probability, in ``[0, 1]`` (resolution ``2**-16``, see
            the module docs).

    Returns:
        A ``bool`` array of ``shape``.

    Example:
        >>> import jax
        >>> from unsplit._src import masks
        >>> mask = masks.keep_mask(jax.random.key(0), (1000, 100), 0.25)
        >>> round(float(mask.mean()), 2)
        0.75
    """
    return random.lanes16(key, shape) < np.uint32(keep_threshold(rate))


@functools.partial(jax.jit, static_argnums=(1, 3))
def grid_keep_mask_from_data(
    data: jax.Array,
    shape: tuple[int, ...],
    threshold: jax.typing.ArrayLike,
    spec: jax.P | None = None,
) -> jax.Array:
    """``grid_lanes16_from_data(data, shape, spec) < threshold``: the same bits, drawn faster.

    The hash's four lanes are compared in the loop that computes it and their
    four keep bits packed into one byte, the only array written (a quarter of a
    byte per element, instead of two 32-bit words per four elements, each word
    written by its own loop over the 20 rounds); the consumer unpacks a bit per
    element. Not for a ``shared`` mask (drawn by :func:`grid_lanes16_from_data`).
    """
    if math.prod(random.check_grid(shape)) == 0:
        return jnp.zeros(shape, jnp.bool_, out_sharding=spec)
    k0, k1, hi, lo, grid_spec = random.grid_counters(data, shape, spec)
    mask = _packed_keep(k0, k1, hi, lo, threshold, data, grid_spec)
    return random.grid_cut(mask, shape, spec, grid_spec)


@functools.partial(jax.jit, static_argnums=(1, 3))
def keep_mask_from_data(
    data: jax.Array,
    shape: tuple[int, ...],
    threshold: jax.typing.ArrayLike,
    spec: jax.P | None = None,
) -> jax.Array:
    """``random.lanes16_from_data(data, shape, spec) < threshold`` (flat layout), drawn packed.

    As :func:`grid_keep_mask_from_data`: one hash loop writes the four keep bits
    of each block in one byte. Shapes whose last axis is not a multiple of 4
    take the lanes' path.
    """
    if (
        not shape
        or shape[-1] % random.LANES
        or math.prod(shape) == 0
        or max(shape) > random.MAX_COUNTERS_1D
    ):
        return random.lanes16_from_data(data, shape, spec) < jnp.asarray(threshold, jnp.uint32)
    grouped = (*shape[:-1], shape[-1] // random.LANES)
    hi, lo = random.counter_words(grouped, spec=spec)
    mask = _packed_keep(data[0], data[1], hi, lo, threshold, data, spec)
    return mask.reshape(shape, out_sharding=spec)


def _packed_keep(k0, k1, hi, lo, threshold, data: jax.Array, spec: jax.P | None) -> jax.Array:
    """The keep bits of each hash's four lanes, ``bool[*hi.shape, 4]``, from one packed byte."""
    w0, w1 = random.threefry2x32(k0, k1, hi, lo)
    t, low = jnp.asarray(threshold, jnp.uint32), np.uint32(random.LANE_VALUES - 1)
    lanes = (
        (w0 & low) < t,
        (w0 >> random.LANE_BITS) < t,
        (w1 & low) < t,
        (w1 >> random.LANE_BITS) < t,
    )
    packed = functools.reduce(
        operator.or_, (bit.astype(jnp.uint8) << np.uint8(j) for j, bit in enumerate(lanes))
    )
    # A division by a runtime 1 (exact) keeps XLA from fusing the hash into the consumer,
    # which reads each byte four times (see _hash).
    one = lax.div(data[0] | np.uint32(1), data[0] | np.uint32(1)).astype(jnp.uint8)
    packed = lax.div(packed, one)
    lane_spec = None if spec is None else jax.P(*spec, None)
    lane = lax.broadcasted_iota(
        jnp.uint8, (*packed.shape, random.LANES), packed.ndim, out_sharding=lane_spec
    )
    return ((packed[..., None] >> lane) & np.uint8(1)).astype(jnp.bool_)
