"""Exact moves inside a manual region, and the canonical tree over a leading axis.

Gathering a device's block over mesh axes and slicing a device's block out of a
whole value move data only (exact); :func:`fixed_sum` adds rows in the canonical
tree over their index. The canonical-block rewrite and FSDP groups' fixed-order
sums both build on them.

Example:
    >>> import jax.numpy as jnp
    >>> from unsplit._src.bitwise.blocked import moves
    >>> float(moves.fixed_sum(jnp.arange(4.0)[:, None], lambda a, b: a + b)[0])  # ((0+1)+(2+3))
    6.0
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from unsplit._src import partition
from unsplit._src.bitwise import reduce


def fixed_sum(rows: jax.Array, add) -> jax.Array:
    """``rows[0] + rows[1] + ...`` in the canonical tree over the row index."""
    n = rows.shape[0]
    return reduce.combine({(s, 1): rows[s] for s in range(n)}, n, add)


# Up to this many devices the partials are all-gathered and added (the same tree): XLA:CPU
# scheduled the one collective's buffers more tightly than two exchanges' (measured on the
# sequence test's chunk program: 2.36 vs 2.63 MB at 2 devices, 1.28 vs 1.41 MB at 4).
GATHER_UP_TO = 4


def pairwise_sum(x: jax.Array, axes: tuple[str, ...], n: int) -> jax.Array:
    """The ``n`` devices' ``x`` over ``axes`` (inside a manual region) added in the canonical
    tree over their index, the total on every device.

    The tree's aligned pairs, then pairs of pairs: at each level a device swaps its
    subtree's sum with the neighbouring subtree's (``ppermute`` to index ``i ^ d``) and
    adds it (IEEE addition is commutative, so both sides get the same bits), so a device
    holds two values of ``x``'s size (an all-gather held ``n``) and receives ``log2(n)`` of
    them. ``n`` is a power of two (the canonical blocks' counts are); up to
    :data:`GATHER_UP_TO` devices the partials are all-gathered and added in the same tree.
    """
    if n & (n - 1):
        raise ValueError(f"pairwise_sum needs a power of two devices; got {n}")
    if n <= GATHER_UP_TO:
        return fixed_sum(jax.lax.all_gather(x, partition.entry(axes), axis=0), jnp.add)
    d = 1
    while d < n:
        x = x + jax.lax.ppermute(x, partition.entry(axes), [(i, i ^ d) for i in range(n)])
        d *= 2
    return x


def gather(x: jax.Array, spec: P, chunk: tuple[str, ...]) -> jax.Array:
    """``x`` (this device's block over the ``chunk`` axes, inside a manual region) whole over
    them (exact); ``spec`` says which dimensions are split over which axes."""
    key = jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
    impl = jax.random.key_impl(x) if key else None
    data = jax.random.key_data(x) if key else x
    for dim, entry in enumerate(spec):
        axes = tuple(n for n in partition.names(entry) if n in chunk)
        if axes:
            data = jax.lax.all_gather(data, partition.entry(axes), axis=dim, tiled=True)
    return jax.random.wrap_key_data(data, impl=impl) if key else data


def block_of(x, spec: P, block: tuple[int, ...], sizes, coord, axes) -> jax.Array:
    """One device's block of ``x`` (whole over ``axes``, inside a manual region) along the
    dims ``spec`` splits over them (exact slicing).

    ``sizes`` maps every axis to its size, ``block`` is the block's shape and
    ``coord(name)`` the device's coordinate on axis ``name`` (a Python int, or
    ``None`` for this device's own ``axis_index``).
    """
    for dim, entry in enumerate(spec):
        names = partition.names(entry)
        if not any(n in axes for n in names):
            continue
        index: Any = 0
        for n in names:  # row-major over the entry's axes, as the spec lays blocks out
            here = coord(n) if n in axes else None
            here = jax.lax.axis_index(n) if here is None else here
            index = index * sizes[n] + here
        size = block[dim]
        if isinstance(index, int):
            x = jax.lax.slice_in_dim(x, index * size, (index + 1) * size, axis=dim)
        else:
            x = jax.lax.dynamic_slice_in_dim(x, index * size, size, axis=dim)
    return x
