"""Prefix-stable fast random bits: one threefry hash gives four 16-bit lanes.

These are the draws behind :func:`unsplit.dropout`, the ``Dropout`` layers and
the attention functions. Two layouts share one hash and one lane rule.

**Flat layout** (dropout on activations). An element's bits depend only on
``(key, i)``, where ``i`` is its row-major flat index inside the array. So
``lanes16(key, (b, D))`` equals the first ``b`` rows of ``lanes16(key, (B, D))``,
and any two shapes share the bits on their shared flat prefix: padding an
input longer along its leading axis (or a 1-D input at its end) keeps the mask
of the elements it already had. For element ``i``:

* the counter is ``m = i // 4``, passed as the 64-bit pair ``(m >> 32, m & 0xFFFFFFFF)``;
* ``(w0, w1) = threefry2x32(key, (hi, lo))`` (the words
  ``jax.extend.random.threefry_2x32`` returns for the count ``concatenate([hi, lo])``);
* lane ``j = i % 4`` is ``w0 & 0xFFFF``, ``w0 >> 16``, ``w1 & 0xFFFF``, ``w1 >> 16``
  for ``j = 0, 1, 2, 3``.

**Grid layout** (attention weights ``[batch..., heads, q, k]``). An element's
bits depend only on the key and its coordinates, never on the array's extent,
so padding the query or key axis (or adding heads or batch rows) keeps the
bits of every element that was already there. Element ``(c_1, ..., c_n, r, c)``
reads lane ``c % 4`` of ``threefry2x32(key_c, (r, c // 4))``, where
``key_c = fold_in(... fold_in(key, c_1) ..., c_n)`` (``jax.random.fold_in``'s
words: ``threefry2x32(key, (0, c_i))``). The leading coordinates cost one hash
per (batch, head) pair, negligible next to one per four weights.

Both layouts are pinned by golden values in the tests, so a JAX upgrade that
changes the cipher fails loudly. ``jax.random.bernoulli`` hashes once per
element; these hash once per four elements. The hash is written out
(:func:`threefry2x32`) so XLA fuses its 20 rounds into one elementwise loop
with the key words in registers; jax's CPU lowering of the primitive runs the
rounds as a loop over whole arrays, which is slow once the keys vary per
element (per-example keys under ``vmap``, per-head keys).
The masks of the drop-ins (:mod:`unsplit._src.masks`: ``keep_mask_from_data``,
``grid_keep_mask_from_data``) compare the four lanes with the keep
threshold inside the hash's loop and write their four keep bits in one byte:
one hash loop instead of one per 32-bit output word, and a quarter byte
written per element; the bits are those of the lanes.

**Rate resolution.** An element is kept iff its lane is below
``keep_threshold(rate)``, the nearest integer to ``(1 - rate) * 2**16``,
but at least 1 when ``rate < 1``. The keep probability actually used is
``keep_probability(threshold) = threshold / 2**16`` and kept elements are
scaled by its inverse, so ``E[dropout(x)] == x`` exactly at every rate; the
keep probability is within ``2**-17`` (about 7.6e-6) of ``1 - rate``, and rates
in ``(1 - 2**-17, 1)`` keep ``2**-16`` of the elements (scaled by ``2**16``)
instead of rounding to "drop everything". Rates below ``2**-17`` keep every
element (scale 1). (FlashAttention uses 8-bit thresholds, a resolution of
``2**-8``.)

**Independence.** Distinct elements use disjoint bits of the cipher output
(four lanes of one 64-bit block) or different counters or keys, and
threefry2x32 is a block cipher keyed by ``key``, so lanes are as independent as
threefry's outputs. The tests check the keep fraction, the joint law of the
four lanes of a block, neighbours at several lags, and two keys against each
other.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import random as jex_random

from unsplit._src.keys import check_key, is_typed_key

LANE_BITS = 16
LANES = 4  # 16-bit lanes per 64-bit threefry output
LANE_VALUES = 1 << LANE_BITS
MAX_COUNTERS_1D = 1 << 32  # above this many counters, 64-bit index arithmetic
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


@jax.jit
def threefry2x32(
    k0: jax.Array, k1: jax.Array, x0: jax.Array, x1: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The threefry2x32 block cipher (20 rounds), elementwise over same-rank ``uint32`` arrays.

    Bit for bit the function behind ``jax.random`` (the tests compare it with
    ``jax.extend.random.threefry_2x32``), written out so XLA fuses it.

    Example:
        >>> import jax, numpy as np
        >>> from jax.extend import random as jex_random
        >>> from unsplit._src import random
        >>> k = np.array([1, 2], np.uint32)
        >>> w0, w1 = random.threefry2x32(k[0], k[1], np.uint32(0), np.uint32(7))
        >>> bool(np.all(np.array([w0, w1]) == jex_random.threefry_2x32(k, np.array([0, 7], np.uint32))))
        True
    """
    ks = (k0, k1, k0 ^ k1 ^ np.uint32(0x1BD11BDA))
    x0, x1 = x0 + ks[0], x1 + ks[1]
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x0 = x0 + x1
            x1 = (x1 << np.uint32(r)) | (x1 >> np.uint32(32 - r))
            x1 = x0 ^ x1
        x0 = x0 + ks[(i + 1) % 3]
        x1 = x1 + ks[(i + 2) % 3] + np.uint32(i + 1)
    return x0, x1


def lanes16(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Returns prefix-stable 16-bit random values (as ``uint32``) of ``shape`` (flat layout).

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


def grid_lanes16(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Returns 16-bit random values (as ``uint32``) of ``shape`` in the grid layout.

    Args:
        key: a threefry PRNG key of shape ``()``, or a legacy ``uint32[2]`` key.
        shape: ``(*leading, rows, cols)``, at least two axes.

    Returns:
        A ``uint32`` array of ``shape``; element ``(*c, r, k)`` depends only on
        ``(key, c, r, k)``, whatever the extents.

    Example:
        >>> import jax, numpy as np
        >>> from unsplit._src import random
        >>> key = jax.random.key(0)
        >>> small, big = random.grid_lanes16(key, (2, 3, 5)), random.grid_lanes16(key, (4, 6, 10))
        >>> bool(np.all(big[:2, :3, :5] == small))
        True
    """
    return grid_lanes16_from_data(key_data(key), tuple(shape))


def key_data(key: jax.Array) -> jax.Array:
    """Returns the ``uint32[2]`` words of a validated threefry key."""
    check_key(key)
    return jax.random.key_data(key) if is_typed_key(key) else jnp.asarray(key)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def lanes16_from_data(
    data: jax.Array, shape: tuple[int, ...], spec: jax.P | None = None, shared: bool = False
) -> jax.Array:
    """:func:`lanes16` from raw ``uint32[2]`` key words.

    ``spec`` (a ``PartitionSpec`` for ``shape`` under an explicit mesh) makes
    every device draw only its own shard. ``shared=True`` for a mask that is
    then broadcast (see :func:`_hash`): same bits.
    """
    size = math.prod(shape)
    if size == 0:
        return jnp.zeros(shape, jnp.uint32)
    if max(shape, default=0) > MAX_COUNTERS_1D:
        raise ValueError(
            f"each axis of a dropout mask must have at most 2**32 elements; got {shape=}. "
            "Fix: reshape the input so no single axis is that long."
        )
    if shape and shape[-1] % LANES == 0:
        # Block m = i // 4 is the flat index in ``shape`` with its last axis cut
        # by 4; built from per-axis iotas, so the SPMD partitioner can shard it.
        grouped = (*shape[:-1], shape[-1] // LANES)
        hi, lo = counter_words(grouped, spec=spec)
        lanes = _lanes(*_hash(data[0], data[1], hi, lo, shared, data), spec)
        return lanes.reshape(shape, out_sharding=spec)
    blocks = -(-size // LANES)
    hi, lo = counter_words((blocks,))
    lanes = _lanes(*_hash(data[0], data[1], hi, lo, shared, data), None)
    lanes = lanes.reshape(-1)[:size].reshape(shape)
    return lanes if spec is None else jax.sharding.reshard(lanes, spec)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def grid_lanes16_from_data(
    data: jax.Array, shape: tuple[int, ...], spec: jax.P | None = None, shared: bool = False
) -> jax.Array:
    """:func:`grid_lanes16` from raw ``uint32[2]`` key words.

    ``spec`` (a ``PartitionSpec`` for ``shape`` under an explicit mesh) makes
    every device draw only its own shard of the leading axes and rows.
    ``shared=True`` for a mask that is then broadcast (see :func:`_hash`).
    """
    if math.prod(check_grid(shape)) == 0:
        return jnp.zeros(shape, jnp.uint32, out_sharding=spec)
    k0, k1, hi, lo, grid_spec = grid_counters(data, shape, spec)
    lanes = _lanes(*_hash(k0, k1, hi, lo, shared, data), grid_spec)
    return grid_cut(lanes, shape, spec, grid_spec)


def check_grid(shape: tuple[int, ...]) -> tuple[int, ...]:
    if len(shape) < 2:
        raise ValueError(f"the grid layout needs at least two axes (rows, cols); got {shape=}.")
    rows, cols = shape[-2:]
    if rows > MAX_COUNTERS_1D or -(-cols // LANES) > MAX_COUNTERS_1D:
        raise ValueError(
            f"the grid layout takes at most 2**32 rows and 2**34 columns; got {shape=}."
        )
    return shape


def grid_counters(data: jax.Array, shape: tuple[int, ...], spec: jax.P | None):
    """The grid layout's per-block key words and counters, and the spec of its blocks."""
    *lead, rows, cols = shape
    n = len(lead)
    entries = (None,) * len(shape) if spec is None else (*spec, *(None,) * (len(shape) - len(spec)))
    # The columns stay whole on each device (they are cut into blocks of four).
    grid_spec = None if spec is None else jax.P(*entries[:-1], None)
    lead_spec = None if spec is None else jax.P(*entries[:n])
    k0, k1 = data[0], data[1]
    for axis in range(n):  # key_c = fold_in(... fold_in(key, c_1) ..., c_n)
        coord = lax.broadcasted_iota(jnp.uint32, tuple(lead), axis, out_sharding=lead_spec)
        k0, k1 = threefry2x32(k0, k1, jnp.zeros_like(coord), coord)
    blocks = -(-cols // LANES)
    ones = (1,) * n
    row_spec = None if spec is None else jax.P(*(None,) * n, entries[n], None)
    hi = lax.broadcasted_iota(jnp.uint32, (*ones, rows, 1), n, out_sharding=row_spec)
    lo = lax.broadcasted_iota(jnp.uint32, (*ones, 1, blocks), n + 1)
    if lead:
        key_spec = None if spec is None else jax.P(*entries[:n], None, None)
        k0 = k0.reshape((*lead, 1, 1), out_sharding=key_spec)
        k1 = k1.reshape((*lead, 1, 1), out_sharding=key_spec)
    return k0, k1, hi, lo, grid_spec


def grid_cut(lanes: jax.Array, shape: tuple[int, ...], spec, grid_spec) -> jax.Array:
    """Per-block lanes ``[..., blocks, 4]`` as ``shape``: the blocks' lanes row-major, cut to the columns."""
    cols = shape[-1]
    width = lanes.shape[-2] * LANES
    lanes = lanes.reshape((*lanes.shape[:-2], width), out_sharding=grid_spec)
    lanes = lanes if cols == width else lanes[..., :cols]
    return lanes if spec is None else jax.sharding.reshard(lanes, spec)


def _hash(k0, k1, x0, x1, shared: bool, data: jax.Array) -> tuple[jax.Array, jax.Array]:
    """threefry2x32 words, each computed once per block of four lanes.

    The four lanes of a block read the same two words, and XLA, fusing the
    written-out hash into the lanes' consumer, would compute it once per lane.
    Dividing the words by a runtime 1 (exact) stops that: XLA does not fuse an
    expensive op (a division) into a consumer that reads each element several
    times, so the words are written once (2 bytes per element) and read by the
    lanes. A ``shared`` mask (broadcast afterwards: ``broadcast_dims``,
    attention's ``broadcast_dropout``) uses jax's threefry primitive, which XLA
    never fuses on CPU (a loop over whole arrays, as for ``jax.random.bernoulli``),
    so it is drawn once at its own shape, not for every element of the full array.
    """
    if shared:
        shape = jnp.broadcast_shapes(*(jnp.shape(a) for a in (k0, k1, x0, x1)))
        words = [jnp.broadcast_to(a, shape) for a in (k0, k1, x0, x1)]
        w0, w1 = jex_random.threefry2x32_p.bind(*words)
        return w0, w1
    w0, w1 = threefry2x32(k0, k1, x0, x1)
    one = lax.div(data[0] | np.uint32(1), data[0] | np.uint32(1))  # 1, not a constant
    return lax.div(w0, one), lax.div(w1, one)


def _lanes(w0: jax.Array, w1: jax.Array, spec: jax.P | None) -> jax.Array:
    """Four 16-bit lanes per hash output: shape ``w0.shape + (4,)``."""
    # The lane axis is innermost, so XLA reads each hash output once for its
    # four lanes and the reshape to the caller's shape is free (row-major).
    # (Stacking four slices instead makes XLA recompute the hash per lane.)
    lane_spec = None if spec is None else jax.P(*spec, None)
    lane = lax.broadcasted_iota(jnp.uint32, (*w0.shape, LANES), w0.ndim, out_sharding=lane_spec)
    word = jnp.where(lane < 2, w0[..., None], w1[..., None])
    return (word >> ((lane & 1) * LANE_BITS)) & np.uint32(LANE_VALUES - 1)


def counter_words(
    shape: tuple[int, ...], *, wide: bool | None = None, spec: jax.P | None = None
) -> tuple[jax.Array, jax.Array]:
    """Returns the row-major flat indices of ``shape`` as 64-bit ``(hi, lo)`` ``uint32`` words.

    With ``wide=None`` the 64-bit arithmetic is used only when the size
    exceeds ``2**32``; ``wide=True`` forces it (for tests).
    """
    if wide is None:
        wide = math.prod(shape) > MAX_COUNTERS_1D
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
