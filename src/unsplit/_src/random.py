"""Prefix-stable fast random bits: one threefry hash gives four 16-bit lanes.

These are the draws behind :func:`unsplit.dropout` and the ``Dropout`` layers.

**The rule.** An element's bits depend only on ``(key, i)``, where ``i`` is
its row-major flat index inside the array. So ``lanes16(key, (b, D))`` equals
the first ``b`` rows of ``lanes16(key, (B, D))``, and more generally any two
shapes share the bits on their shared flat prefix: padding an input longer
along its leading axis (or a 1-D input at its end) keeps the mask of the
elements it already had. Padding a non-leading axis changes the flat indices,
hence the bits.

**The layout** (pinned by golden values in the tests, so a JAX upgrade that
changes the cipher fails loudly). For element ``i``:

* the counter is ``m = i // 4``, passed as the 64-bit pair ``(m >> 32, m & 0xFFFFFFFF)``;
* ``(w0, w1) = threefry2x32(key, (hi, lo))`` (``jax.extend.random.threefry_2x32``;
  the words are its output's two halves for the count ``concatenate([hi, lo])``);
* lane ``j = i % 4`` is ``w0 & 0xFFFF``, ``w0 >> 16``, ``w1 & 0xFFFF``, ``w1 >> 16``
  for ``j = 0, 1, 2, 3``.

``jax.random.bernoulli`` hashes once per element; this hashes once per four
elements, which is where the dropout layers' speed comes from.

**Rate resolution.** An element is kept iff its lane is below
``keep_threshold(rate) = round((1 - rate) * 2**16)``, so the keep probability
is ``keep_threshold(rate) / 2**16``: ``rate`` is quantized to multiples of
``2**-16`` (about 1.5e-5) and the keep probability is within ``2**-17`` of
``1 - rate``. Rates below ``2**-17`` keep every element. (FlashAttention uses
8-bit thresholds, a resolution of ``2**-8``.)

**Independence.** Distinct elements use disjoint bits of the cipher output
(four lanes of one 64-bit block) or different counters, and threefry2x32 is a
block cipher keyed by ``key``, so lanes are as independent as threefry's
outputs; keys from ``unsplit.example_keys`` give independent masks per
example. The tests check the keep fraction, the joint law of the four lanes of
a block, neighbours at several lags, and two keys against each other.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import random as jex_random

from unsplit._src.keys import check_key, is_typed_key

LANE_BITS = 16
LANES = 4  # 16-bit lanes per 64-bit threefry output
_LANE_VALUES = 1 << LANE_BITS
_MAX_COUNTERS_1D = 1 << 32  # above this many counters, 64-bit index arithmetic


def keep_threshold(rate: float) -> int:
    """Returns the 16-bit keep threshold for a drop ``rate`` in ``[0, 1]``.

    An element is kept iff its lane is below the threshold, so the keep
    probability is ``keep_threshold(rate) / 2**16``.

    Args:
        rate: the drop probability, a Python number in ``[0, 1]``.

    Returns:
        ``round((1 - rate) * 2**16)`` (halves round up), an int in ``[0, 2**16]``.

    Example:
        >>> from unsplit._src import random
        >>> random.keep_threshold(0.1), random.keep_threshold(0.0), random.keep_threshold(1.0)
        (58982, 65536, 0)
    """
    return math.floor((1.0 - float(rate)) * _LANE_VALUES + 0.5)


def lanes16(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Returns prefix-stable 16-bit random values (as ``uint32``) of ``shape``.

    Args:
        key: a threefry PRNG key of shape ``()`` (``jax.random.key``), or a
            legacy ``uint32[2]`` key.
        shape: the output shape.

    Returns:
        A ``uint32`` array of ``shape`` with values in ``[0, 2**16)``; element
        ``i`` (row-major flat index) depends only on ``(key, i)``.

    Example:
        >>> import jax, numpy as np
        >>> from unsplit._src import random
        >>> key = jax.random.key(0)
        >>> long, short = random.lanes16(key, (5, 3)), random.lanes16(key, (2, 3))
        >>> bool(np.all(long[:2] == short))
        True
    """
    return lanes16_from_data(key_data(key), tuple(shape))


def keep_mask(key: jax.Array, shape: tuple[int, ...], rate: float) -> jax.Array:
    """Returns a prefix-stable boolean keep mask: ``True`` with probability ``1 - rate``.

    Args:
        key: a threefry PRNG key of shape ``()``, or a legacy ``uint32[2]`` key.
        shape: the mask shape.
        rate: the drop probability, in ``[0, 1]`` (resolution ``2**-16``, see
            the module docs).

    Returns:
        A ``bool`` array of ``shape``.

    Example:
        >>> import jax
        >>> from unsplit._src import random
        >>> mask = random.keep_mask(jax.random.key(0), (1000, 100), 0.25)
        >>> round(float(mask.mean()), 2)
        0.75
    """
    return mask_from_data(key_data(key), tuple(shape), keep_threshold(rate))


def key_data(key: jax.Array) -> jax.Array:
    """Returns the ``uint32[2]`` words of a validated threefry key."""
    check_key(key)
    return jax.random.key_data(key) if is_typed_key(key) else jnp.asarray(key)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def mask_from_data(
    data: jax.Array, shape: tuple[int, ...], threshold: int, spec: jax.P | None = None
) -> jax.Array:
    """The keep mask from raw key words: ``lanes16 < threshold``."""
    return lanes16_from_data(data, shape, spec) < jnp.uint32(threshold)


@functools.partial(jax.jit, static_argnums=(1, 2))
def lanes16_from_data(
    data: jax.Array, shape: tuple[int, ...], spec: jax.P | None = None
) -> jax.Array:
    """:func:`lanes16` from raw ``uint32[2]`` key words.

    ``spec`` (a ``PartitionSpec`` for ``shape`` under an explicit mesh) makes
    every device draw only its own shard.
    """
    size = math.prod(shape)
    if size == 0:
        return jnp.zeros(shape, jnp.uint32)
    if max(shape, default=0) > _MAX_COUNTERS_1D:
        raise ValueError(
            f"each axis of a dropout mask must have at most 2**32 elements; got {shape=}. "
            "Fix: reshape the input so no single axis is that long."
        )
    if shape and shape[-1] % LANES == 0:
        # Block m = i // 4 is the flat index in ``shape`` with its last axis cut
        # by 4; built from per-axis iotas, so the SPMD partitioner can shard it.
        grouped = (*shape[:-1], shape[-1] // LANES)
        lanes = _lanes(data, counter_words(grouped, spec=spec), spec)
        return lanes.reshape(shape, out_sharding=spec)
    blocks = -(-size // LANES)
    lanes = _lanes(data, counter_words((blocks,)), None)
    lanes = lanes.reshape(-1)[:size].reshape(shape)
    return lanes if spec is None else jax.sharding.reshard(lanes, spec)


def _lanes(data: jax.Array, counters: tuple[jax.Array, jax.Array], spec: jax.P | None) -> jax.Array:
    """Four 16-bit lanes per counter: shape ``counters.shape + (4,)``."""
    hi, lo = counters
    # The primitive behind jax.extend.random.threefry_2x32, without its ravel, so
    # sharded counters stay sharded.
    w0, w1 = jex_random.threefry2x32_p.bind(data[0], data[1], hi, lo)
    # The lane axis is innermost, so XLA reads each hash output once for its
    # four lanes and the reshape to the caller's shape is free (row-major).
    lane_spec = None if spec is None else jax.P(*spec, None)
    lane = lax.broadcasted_iota(jnp.uint32, (*hi.shape, LANES), hi.ndim, out_sharding=lane_spec)
    word = jnp.where(lane < 2, w0[..., None], w1[..., None])
    return (word >> ((lane & 1) * LANE_BITS)) & (_LANE_VALUES - 1)


def counter_words(
    shape: tuple[int, ...], *, wide: bool | None = None, spec: jax.P | None = None
) -> tuple[jax.Array, jax.Array]:
    """Returns the row-major flat indices of ``shape`` as 64-bit ``(hi, lo)`` ``uint32`` words.

    With ``wide=None`` the 64-bit arithmetic is used only when the size
    exceeds ``2**32``; ``wide=True`` forces it (for tests).
    """
    if wide is None:
        wide = math.prod(shape) > _MAX_COUNTERS_1D
    hi = jnp.zeros(shape, jnp.uint32, out_sharding=spec)
    lo = jnp.zeros(shape, jnp.uint32, out_sharding=spec)
    for axis in range(len(shape)):
        if shape[axis] == 1:
            continue
        stride = math.prod(shape[axis + 1 :])
        index = lax.broadcasted_iota(jnp.uint32, shape, axis, out_sharding=spec)
        if not wide:
            lo = lo + index * jnp.uint32(stride)  # exact: every partial sum is < 2**32
            continue
        part_hi, part_lo = mul_wide(index, stride)
        lo = lo + part_lo
        hi = hi + part_hi + (lo < part_lo).astype(jnp.uint32)  # carry
    return hi, lo


def mul_wide(a: jax.Array, c: int) -> tuple[jax.Array, jax.Array]:
    """``(hi, lo)`` words of ``a * c mod 2**64`` for ``uint32`` ``a`` and a constant ``0 <= c < 2**64``."""
    c_hi, c_lo = c >> 32, c & 0xFFFFFFFF
    a1, a0 = a >> 16, a & 0xFFFF
    b1, b0 = jnp.uint32(c_lo >> 16), jnp.uint32(c_lo & 0xFFFF)
    low = a0 * b0  # each 16x16 partial product fits 32 bits
    mid1, mid2 = a1 * b0, a0 * b1
    lo = low + (mid1 << 16)
    carry = (lo < low).astype(jnp.uint32)
    lo2 = lo + (mid2 << 16)
    carry = carry + (lo2 < lo).astype(jnp.uint32)
    hi = a1 * b1 + (mid1 >> 16) + (mid2 >> 16) + carry + a * jnp.uint32(c_hi)
    return hi, lo2
