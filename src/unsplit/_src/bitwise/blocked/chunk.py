"""A model-parallel group's chunk program, the same bits at every model-parallel degree.

A group whose params are sharded over model axes (tensor parallel, experts) or
whose loss shards activations over sequence axes computes one chunk together.
Left to XLA's SPMD partitioner, the chunk program sums a contraction split over
``M`` devices as ``M`` partial dots and an all-reduce: other bits at another
``M``. Here the program is manual over the group's axes (``jax.shard_map``): the
chunk's loss and gradient are traced once on the whole arrays' shapes and
evaluated on each device's blocks by the canonical-block rewrite
(:mod:`~unsplit._src.bitwise.blocked.rewrite`): every dot and float sum over a
dimension a group axis splits is computed per canonical block, one op of the
block's shape per block, and the blocks added in the canonical tree, so every
degree that divides the block counts computes the same adds in the same order.
Params stay split (each device unpacks its blocks from its flat vector), and so
do the activations the loss computes on split dimensions.

XLA compiles a one-device program differently from a multi-device one (other
simplifications around the same ops: measured, a degree-1 program gave other
bits than degrees 2, 4 and 8, which agree), so a group of one device runs its
program on two (:func:`pair_devices`: the second computes the same values, and
only the first's are kept).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from unsplit._src import partition
from unsplit._src.bitwise.blocked import rewrite
from unsplit._src.bitwise.blocked.rewrite import V

# Model-parallel groups compute with the canonical-block rewrite (True) or as XLA's SPMD
# program of the group (False: bits only at the same degree). A switch for tests' negative
# controls and measurements, not a setting.
ENABLED = True


def whole_shapes(plan: Any) -> list[jax.ShapeDtypeStruct]:
    """The params' array leaves as whole arrays (their local blocks times the group axes)."""
    flat = plan.params_flat
    out = []
    for shape, dtype, spec in zip(flat.shapes, flat.dtypes, plan.local_specs, strict=True):
        dims = rewrite.dims_of(spec, len(shape))
        whole = tuple(
            n * math.prod(plan.compute.shape[a] for a in d)
            for n, d in zip(shape, dims, strict=True)
        )
        out.append(jax.ShapeDtypeStruct(whole, dtype))
    return out


def chunk_sums(plan: Any, gmesh: jax.sharding.Mesh, fn, vectors, rows, key, blocks: int):
    """One chunk's packed sums (each device its blocks) and its aux (whole on the group).

    ``fn(params, rows, key) -> (grads, loss_sum, weight, aux)`` is the chunk's
    computation on whole arrays; ``vectors`` each device's flat params blocks.
    """
    diff = plan.structure.diff
    diff_specs = [s for s, d in zip(plan.local_specs, diff, strict=True) if d]
    whole = whole_shapes(plan)
    args = (whole, rows, key)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), args)
    closed, out_shapes = jax.make_jaxpr(fn, return_shape=True)(*shapes)
    _, aux_shapes = out_shapes[:3], out_shapes[3]
    row_leaves, row_tree = jax.tree.flatten((rows, key))
    param_dims = [
        rewrite.dims_of(s, len(w.shape)) for s, w in zip(plan.local_specs, whole, strict=True)
    ]
    gentry = partition.entry(plan.group_axes)

    def local(vectors, row_leaves):
        rw = rewrite.Rewrite(gmesh, blocks)
        blocks_ = plan.params_flat.unpack(vectors)
        vals = [V(x, d) for x, d in zip(blocks_, param_dims, strict=True)]
        vals += [rewrite.replicated(x) for x in row_leaves]
        got = rw.run(closed.jaxpr, closed.consts, vals)
        ngrads = len(diff_specs)
        grads = [
            rw.to_dims(v, rewrite.dims_of(s, len(v.dims)))
            for v, s in zip(got[:ngrads], diff_specs, strict=True)
        ]
        loss_sum, weight, *aux = (rw.to_dims(v, ((),) * len(v.dims)) for v in got[ngrads:])
        return tuple(plan.pack_sums([*grads, loss_sum, weight])), aux

    count = len(plan.sums_flat.vectors)
    n_aux = len(jax.tree.leaves(aux_shapes))
    # The flat params vectors (each device its blocks), then the direct (frozen) leaves as
    # they are placed on the group (each device its own shards of them).
    flat = plan.params_flat
    vector_specs = (P(gentry),) * len(flat.vectors) + tuple(flat.directs(plan.local_specs))
    sums, aux = jax.shard_map(
        local,
        mesh=gmesh,
        in_specs=(vector_specs, [P()] * len(row_leaves)),
        out_specs=((P(gentry),) * count, [P()] * n_aux),
        check_vma=False,
    )(tuple(vectors), row_leaves)
    del row_tree
    return list(sums), jax.tree.unflatten(jax.tree.structure(aux_shapes), aux)
