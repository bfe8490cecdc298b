"""Totals whose bits do not follow the sharding: ``unsplit.canonical_sum``."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def canonical_sum(tree: Any, axis: int = 0) -> Any:
    """Sums every leaf of ``tree`` over ``axis`` in an order that does not depend on its sharding.

    ``jnp.sum`` of a sharded array adds per shard, then across shards: other
    shardings, other bits. This gathers each leaf whole (exact data movement)
    onto one device per process and sums it there with one program compiled
    for one device, so a bitwise step's per-example ``aux`` (bit-identical
    across schedules) gives bit-identical totals too (token counts, accuracy
    sums, any metric).

    Example:
        >>> import jax, jax.numpy as jnp, unsplit
        >>> mesh = jax.make_mesh((4,), ("data",))
        >>> x = jax.device_put(jnp.arange(8.0), jax.sharding.NamedSharding(mesh, jax.P("data")))
        >>> float(unsplit.canonical_sum(x))
        28.0
    """
    leaves = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
    # A concrete array's NamedSharding has a concrete Mesh (the stubs allow an AbstractMesh).
    meshes = {cast(Mesh, x.sharding.mesh) for x in leaves if isinstance(x.sharding, NamedSharding)}
    if len(meshes) > 1:
        raise ValueError(
            f"canonical_sum got arrays on {len(meshes)} different meshes; expected one. Fix: "
            "sum the arrays of each mesh separately."
        )
    if not meshes:  # one device already: one program on whole arrays
        return _summed(axis)(tree)
    (mesh,) = meshes
    whole = jax.jit(lambda t: t, out_shardings=NamedSharding(mesh, P()))(tree)
    device = next(d for d in mesh.devices.flat if d.process_index == jax.process_index())
    local = jax.tree.map(
        lambda x: next(s.data for s in x.addressable_shards if s.device == device), whole
    )
    return _summed(axis)(local)


@functools.cache
def _summed(axis: int) -> Callable:
    return jax.jit(lambda t: jax.tree.map(lambda x: jax.numpy.sum(x, axis=axis), t))
