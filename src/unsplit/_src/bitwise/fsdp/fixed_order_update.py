"""An FSDP group's optimizer update with every float sum across its devices in a fixed order.

``jax.jit(update)`` on leaves sharded over a group lets XLA partition each
reduction over a sharded dimension (``clip_by_global_norm``'s norm, LAMB's
trust ratios, Adafactor's row and column means) into a local reduce and an
all-reduce, whose order is the collectives': a plain process, one under
``jax.distributed`` (gloo) and a group spread over hosts may give other bits.

:func:`program` runs the update manual over the group's axes instead
(``jax.shard_map``, each device its blocks). The update is traced on the whole
arrays' shapes (its means divide by the whole sizes, its shape-dependent choices,
such as Adafactor's factored dimensions, are those of the whole arrays), and its
jaxpr is evaluated on each device's blocks by the canonical-block rewrite
(:mod:`~unsplit._src.bitwise.blocked.rewrite`), which tracks which dimensions of
every value are split over which group axes:

* elementwise ops, ``broadcast_in_dim``, ``transpose``, ``squeeze`` and a
  ``reshape`` that keeps each split dimension in whole blocks run on the blocks
  (a replicated operand is sliced to the device's block: exact);
* a ``reduce_sum`` or a ``dot_general`` over a split dimension is computed per
  canonical block of it (``blocks`` of them), the device's blocks added in the
  canonical tree, then the group's partials all-gathered and added in the same
  tree: the bits do not depend on the group's size (any size dividing the
  blocks); every float sum is a fixed tree of adds, not XLA's ``reduce``; ``reduce_max`` and
  ``reduce_min`` (and ``reduce_and`` / ``reduce_or``) take ``pmax`` / ``pmin`` (exact in
  any order);
* ``jit``, ``custom_jvp`` and ``custom_vjp`` bodies are evaluated inline, ``cond``
  and ``while`` bodies through the same rewrite;
* an equation whose operands are all replicated runs as it is.

Any other equation on a split dimension (a slice, gather, sort, cumsum or
concatenation along it, a reshape that mixes its blocks) raises
:class:`Unsupported`, and a group size that does not divide a dimension's blocks
:class:`BlockError`: the caller then runs the whole update as XLA partitions it
(never silently another result).

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> gmesh = jax.make_mesh((4,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> x = jax.device_put(jnp.arange(8.0), NamedSharding(gmesh, P("fsdp")))
    >>> norm = program(lambda x: (x / jnp.sqrt(jnp.sum(x * x)),), gmesh, (x,), (P("fsdp"),),
    ...                (P("fsdp"),))
    >>> round(float(jnp.sum(norm(x)[0] ** 2)), 5)
    1.0
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from unsplit._src.bitwise import canonical_dots
from unsplit._src.bitwise.blocked import rewrite
from unsplit._src.bitwise.blocked.values import DEFAULT_BLOCKS, BlockError, Unsupported

__all__ = ["BlockError", "Unsupported", "program"]


def program(
    fn,
    gmesh: jax.sharding.Mesh,
    args: Sequence,
    in_specs: Sequence,
    out_specs: Any,
    *,
    blocks: int = DEFAULT_BLOCKS,
    mesh: jax.sharding.Mesh | None = None,
    out_shardings: Any = None,
):
    """``jax.jit`` of ``fn`` run manual over ``gmesh`` with every float sum across the group
    in unsplit's fixed order. ``args`` are ``fn``'s arguments (arrays or shape-dtype
    structs: the whole shapes), ``in_specs`` and ``out_specs`` trees of specs over the
    group axes. With ``mesh`` (the whole mesh, which holds the group axes and others),
    every group runs in one program over it, each on its own shards (the same per-device
    code as one group's program). Raises :class:`Unsupported` or :class:`BlockError` when
    the update holds an equation the rewrite cannot run on the blocks."""
    where = {"mesh": mesh, "out_shardings": out_shardings}
    # On CPU, as the chunk programs: XLA's default level, every product rounded on its own
    # (no FMA that another group size's fusions would not make), at every array length the
    # same element code (canonical_dots.cpu_options). Level 0 (canonical_dots.exact_elementwise)
    # gave the same bits and cost 1.3x the train step on the FSDP-groups benchmark.
    if canonical_dots.is_cpu(gmesh.devices.flat):
        return rewrite.program(
            fn, gmesh, args, in_specs, out_specs, blocks=blocks, gather_unsupported=False,
            compiler_options=canonical_dots.cpu_options(), wrap=canonical_dots.canonicalize,
            **where,
        )  # fmt: skip
    return rewrite.program(
        fn, gmesh, args, in_specs, out_specs, blocks=blocks, gather_unsupported=False, **where
    )
