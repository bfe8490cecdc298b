"""The canonical tree's top levels across devices, as reduce-scatters of two devices.

The canonical tree (:mod:`unsplit._src.bitwise.reduce`) over ``2**k`` groups,
each holding one aligned block, adds sibling groups ``g`` and ``g ^ 1`` first,
then the pairs at distance 2, then 4: recursive halving. A reduce-scatter over
*two* devices adds one value from each, a single exactly rounded add whatever
order the collective's implementation takes (``a + b == b + a``), so ``k``
reduce-scatters of two devices each (``axis_index_groups`` of pairs) give the
canonical tree's bits with a collective's speed (XLA:CPU's
``all_to_all``, which the general fixed-order reduce-scatter uses, took 2-3x a
``psum`` of the same vector; these reduce-scatters and the all-gathers back
take about what the ``psum`` takes).

Two things are not left to the collective's implementation:

* **signed zeros**: an implementation that accumulates into a zero buffer gives
  ``+0`` for ``-0 + -0`` (XLA:CPU's does), where a compiled add gives ``-0``. A
  zero's sign never changes a sum that is not zero (``x + -0 == x + +0 == x``),
  so the paths' totals can differ in their zeros' signs alone, and the total's
  zeros are written ``+0`` where it is divided (the unpack, fused into the
  division; the coupled step's finish): one pass folded into another, where
  writing every level's sums ``+0`` was a pass over each. The chunk programs'
  sums enter as computed (a ``-0`` or a subnormal is an operand; XLA:CPU's adds
  flush subnormals, in its collectives too);
* **the add itself**: :func:`exact` runs the pairwise reduce-scatter beside
  explicit adds on the same devices, on inputs drawn from a fixed seed (normal
  values, subnormals, signed zeros, large and small magnitudes), once per mesh and
  dtype, and the combine takes this path only if every element's bits agree
  (zeros compared as ``+0``)
  (the verdict is an integer ``psum`` over every device, exact, so every
  process decides alike). It is evidence on those inputs, not a proof.

Example:
    >>> import jax, numpy as np
    >>> from unsplit._src.bitwise.combine import pairwise
    >>> pairwise.pairs(8, 0), pairwise.pairs(8, 2)
    ([[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]])
    >>> pairwise.exact(jax.make_mesh((8,), ("data",)), 1, np.float32)
    True
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from unsplit._src import partition
from unsplit._src.bitwise import reduce


def levels(groups: int) -> int | None:
    """``k`` when ``groups == 2**k`` for some ``k >= 1``, else None (no pairwise path)."""
    if groups < 2 or groups & (groups - 1):
        return None
    return groups.bit_length() - 1


def pairs(groups: int, level: int) -> list[list[int]]:
    """The pairs of groups the tree adds at ``level`` (0: siblings ``g``, ``g ^ 1``)."""
    distance = 1 << level
    return [[g, g | distance] for g in range(groups) if not g & distance]


def reduce_scatter(x: jax.Array, axes: Any, groups: int) -> jax.Array:
    """Inside a ``shard_map``: the canonical sum over the ``groups`` (``2**k``) devices
    along ``axes`` (row-major) of ``x`` (its length a multiple of ``groups``), group ``g``
    holding piece ``bit_reversed(g)`` (:func:`all_gather` puts the pieces back in order)."""
    k = levels(groups)
    assert k is not None, groups
    for level in range(k):
        x = jax.lax.psum_scatter(
            x, axes, scatter_dimension=0, tiled=True, axis_index_groups=pairs(groups, level)
        )
    return x


def all_gather(x: jax.Array, axes: Any, groups: int) -> jax.Array:
    """The inverse movement of :func:`reduce_scatter`: every group gets the whole vector."""
    k = levels(groups)
    assert k is not None, groups
    for level in reversed(range(k)):
        x = jax.lax.all_gather(x, axes, axis=0, tiled=True, axis_index_groups=pairs(groups, level))
    return x


def positive_zero(x: Any) -> Any:
    """``x`` with every value that compares equal to zero as ``+0`` when it is a float
    array: ``-0``, and subnormals where the program flushes them (XLA:CPU does)."""
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return x
    return jnp.where(x == 0, jnp.zeros_like(x), x)


def positive_zeros(arrays: list[Any]) -> list[Any]:
    """:func:`positive_zero` of each of ``arrays``."""
    return [positive_zero(x) for x in arrays]


def add(a: Any, b: Any) -> Any:
    """The canonical tree's add: ``a + b`` (a zero's sign left as it comes: see the module's
    docstring; the total's zeros are written ``+0`` before its division)."""
    return a + b


@functools.cache
def _verdict(devices: tuple, shape: tuple, names: tuple, leading: int, dtype: Any) -> bool:
    mesh = Mesh(np.asarray(devices, dtype=object).reshape(shape), names)
    axes = partition.entry(names[:leading])
    groups = int(np.prod(shape[:leading]))
    size = 64 * groups
    every = P(names)
    inputs = _draw(int(np.prod(shape)), size, dtype)

    def check(x):
        got = all_gather(reduce_scatter(x, axes, groups), axes, groups)
        parts = jax.lax.all_gather(x, axes, axis=0, tiled=False)  # (groups, size)
        want = reduce.combine({(g, 1): parts[g] for g in range(groups)}, groups, add)
        bits = jax.lax.bitcast_convert_type
        width = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[jnp.dtype(dtype).itemsize]
        got, want = positive_zero(got), positive_zero(want)  # as the unpack writes totals
        differ = jnp.sum(bits(got, width) != bits(want, width), dtype=jnp.int32)
        return jax.lax.psum(differ, names)[None]  # integers: exact in any order

    program = jax.jit(
        jax.shard_map(check, mesh=mesh, in_specs=every, out_specs=every, check_vma=False)
    )
    x = jax.make_array_from_callback(
        inputs.shape, NamedSharding(mesh, every), lambda index: inputs[index]
    )
    with jax.set_mesh(None):  # its own mesh, whatever the caller's context
        out = program(x)
    return int(np.asarray(out.addressable_shards[0].data)[0]) == 0


def exact(mesh: Mesh, leading: int, dtype: Any) -> bool:
    """Whether :func:`reduce_scatter` and :func:`all_gather` over the ``leading`` axes of
    ``mesh`` (the groups) gave the canonical tree's bits for ``dtype`` (checked once)."""
    grid = np.asarray(mesh.devices)
    if levels(int(np.prod(grid.shape[:leading]))) is None:
        return False
    key = (tuple(grid.flat), grid.shape, tuple(mesh.axis_names), leading, jnp.dtype(dtype))
    try:
        return _verdict(*key)
    except (NotImplementedError, TypeError, ValueError) as e:
        # A JAX or backend without reduce-scatters of pairs (``axis_index_groups`` is a
        # pmap-era option) fails to trace or compile the check: the general path runs.
        _REFUSED[key] = f"{type(e).__name__}: {e}"
        return False


# Why a check could not run, per mesh and dtype (for a look when the general path ran).
_REFUSED: dict[tuple, str] = {}


def _draw(devices: int, size: int, dtype: Any) -> np.ndarray:
    """Each device's ``size`` values: normal, subnormal, zeros of either sign, huge and tiny."""
    rng = np.random.default_rng(0)
    info = jnp.finfo(dtype)
    x = rng.normal(size=(devices, size))
    x[:, : size // 8] *= float(info.smallest_subnormal) * 64
    x[:, size // 8 : size // 4] = np.copysign(0.0, x[:, size // 8 : size // 4])  # -0 and +0
    huge = slice(size // 4, size // 4 + size // 16)  # positive: sums overflow to +inf only
    x[:, huge] = np.minimum(np.abs(x[:, huge]), 3) * float(info.max) / 16
    x[:, -size // 8 :] *= float(info.tiny)
    return x.reshape(-1).astype(dtype)
