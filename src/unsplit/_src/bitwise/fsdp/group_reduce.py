"""Inside an FSDP group: every float sum across its devices in a fixed order of unsplit's.

A chunk program of a group with ``chunk_axes`` splits the chunk's rows over the
chunk axes' devices. Left to XLA (one SPMD program, params sharded over the
group), the devices' partial gradients are added by the reduce-scatter XLA
inserts, in the order of the collectives' implementation: a plain process and
one under ``jax.distributed`` (gloo) gave bits 1.6e-8 apart. Here the program is
manual over the chunk axes (``jax.shard_map`` with ``axis_names``: model and
sequence axes stay XLA's, inside the model's own partitioning):

1. :meth:`GroupReduce.gathered_map`: every device computes its own rows (its
   partial sums of the chunk, full size over the chunk axes) with the params
   all-gathered over the chunk axes (exact data movement): by
   :meth:`GroupReduce.gather_params` once a step for all of a group's chunk
   programs (the runner's), or inside the program (a coupled loss's passes);
2. :meth:`GroupReduce.reduce_scatter`: each device cuts its partial sums into one
   piece per chunk-axes device (the block of a leaf sharded over them; a piece of
   the flat vector of the leaves that are not, and of the loss and weight), an
   ``all_to_all`` brings every device's piece ``d`` to device ``d``, which adds the
   ``G`` pieces in the canonical tree over the device index
   (:func:`unsplit._src.bitwise.reduce.combine`); the unsharded leaves' sums are
   then all-gathered (exact). Each device sends about ``(G - 1) / G`` of its
   partial sums (twice that for leaves not sharded over the group): a ring
   reduce-scatter's bytes, with the order fixed. Never a ``psum``.

Elementwise adds are exactly rounded, so a group's sums depend on its size and
its rows' split only: not on the collectives, the processes or the host layout.

Example:
    >>> import jax.numpy as jnp
    >>> from unsplit._src.bitwise.fsdp import group_reduce
    >>> float(group_reduce.fixed_sum(jnp.arange(4.0)[:, None], lambda a, b: a + b)[0])
    6.0
"""

from __future__ import annotations

import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from unsplit._src import partition
from unsplit._src.bitwise.blocked import rewrite, values
from unsplit._src.bitwise.blocked.moves import block_of, fixed_sum, gather
from unsplit._src.bitwise.flat import FlatPlan

# FSDP groups add their devices' partial sums in unsplit's fixed order (True) or leave
# them to XLA's reduce-scatter (False). A switch for measuring what it costs, not a setting:
# the FSDP-groups benchmark (public API only) turns it off for the steps it builds
# while BENCH_XLA_ENV is "1" (read when a step's programs are made; part of their cache key).
FIXED_ORDER = True
BENCH_XLA_ENV = "UNSPLIT_BENCH_XLA_GROUP_REDUCE"


def fixed_order() -> bool:
    """Whether FSDP groups made now add their devices' sums in unsplit's fixed order."""
    return FIXED_ORDER and os.environ.get(BENCH_XLA_ENV) != "1"


def _add(a, b):
    return a + b


# Long: the two manual stages of one group (its rows, then the fixed-order reduce-scatter)
# share the layout of its pieces (which leaves are sharded over the chunk axes, the flat plans).
class GroupReduce:
    """One FSDP group's manual programs (``plan``: the step's, ``gmesh``: the group's mesh)."""

    def __init__(self, plan: Any, gmesh: jax.sharding.Mesh):
        self.plan, self.gmesh = plan, gmesh
        self.chunk = plan.chunk_axes
        self.centry = partition.entry(self.chunk)
        self.gentry = partition.entry(plan.group_axes)
        self.sizes = tuple(gmesh.shape[a] for a in self.chunk)
        self.size = math.prod(self.sizes)
        # The params as the manual region takes them: each device's block over the chunk axes.
        self.chunk_specs = tuple(partition.keep_axes(s, self.chunk) for s in plan.local_specs)
        diff = plan.structure.diff
        self.diff_specs = [s for s, d in zip(plan.local_specs, diff, strict=True) if d]
        shapes, dtypes = plan.sums_flat.shapes, plan.sums_flat.dtypes
        self.block_shapes = shapes[:-2]  # each grad's block on one device of the group
        self.sharded = [i for i, s in enumerate(self.diff_specs) if self._names_chunk(s)]
        self.whole = [i for i, s in enumerate(self.diff_specs) if not self._names_chunk(s)]
        # The flat layout of the rest (leaves whole over the chunk axes, then loss_sum and
        # weight), cut into one piece per device.
        rest = [*self.whole, len(shapes) - 2, len(shapes) - 1]
        self.rest_flat = FlatPlan.of(
            [np.empty((0,), dtypes[i]) for i in rest], [shapes[i] for i in rest]
        )

    def _names_chunk(self, spec: P) -> bool:
        return bool(partition.spec_axes(spec) & set(self.chunk))

    def gather_params(self, arrays) -> list:
        """The params' array leaves (each device its block) whole over the chunk axes (exact
        all-gathers; the group's other axes stay as they are): what :meth:`chunk_sums`
        takes with ``whole=True``, gathered once for all of a group's chunks."""
        chunk = self.chunk
        return jax.shard_map(
            lambda xs: [gather(x, s, chunk) for x, s in zip(xs, self.chunk_specs, strict=True)],
            mesh=self.gmesh,
            in_specs=(list(self.chunk_specs),),
            out_specs=[P()] * len(self.chunk_specs),
            axis_names=set(chunk),
            check_vma=False,
        )(list(arrays))

    def gathered_map(self, fn, arrays, rows, key, out_specs, rows_spec=None, whole=False):
        """``fn(params, rows, key)`` per device: params whole over the chunk axes, its rows.

        ``arrays`` are the params' array leaves on the group mesh (each device its
        block; ``whole``: already whole over the chunk axes, from :meth:`gather_params`),
        ``rows`` split over the chunk axes (or as ``rows_spec`` says); ``out_specs``
        over the chunk axes only (the group's other axes stay XLA's, inside the region).
        """
        chunk = self.chunk
        specs = [P()] * len(self.chunk_specs) if whole else list(self.chunk_specs)

        def local(arrays, rows, key):
            if whole:
                return fn(arrays, rows, key)
            full = [gather(x, s, chunk) for x, s in zip(arrays, self.chunk_specs, strict=True)]
            return fn(full, rows, key)

        return jax.shard_map(
            local,
            mesh=self.gmesh,
            in_specs=(
                specs,
                P(self.centry) if rows_spec is None else rows_spec,
                P(),
            ),
            out_specs=out_specs,
            axis_names=set(chunk),
            check_vma=False,
        )(list(arrays), rows, key)

    def row_blocks(self) -> int:
        """How many canonical row blocks each device computes, one after the other.

        A chunk has ``block_count(chunk, blocks)`` row blocks of at least two rows
        (one-row blocks gave other bits next to each other than alone: XLA fuses a
        one-row weight gradient, a product, into the adds after it), shared by the
        group's devices, so groups of 2, 4 or 8 devices give the same bits (each block
        one computation of the same shape). A group with more devices than blocks
        computes one block per device (:func:`warn_group_size` says so).
        """
        count = values.block_count(self.plan.chunk, self.plan.canonical_blocks)
        return count // self.size if count % self.size == 0 else 1

    def chunk_sums(self, fn, arrays, rows, key, whole=False):
        """A chunk's packed sums (each device its blocks) and its aux (rows split).

        ``fn(params, rows, key) -> (grads, loss_sum, weight, aux)`` computes one
        device's rows with the params whole over the chunk axes (``arrays`` gathered
        here, or already whole: ``whole``), one canonical row block at a time
        (:meth:`row_blocks`, fenced from each other), their sums added in the
        canonical tree.
        """
        count = self.row_blocks()
        canonical = rewrite.explicit_sums(fn)

        def partial(full, rows, key):
            n = jax.tree.leaves(rows)[0].shape[0] // count
            parts = []
            for b in range(count):
                block = jax.tree.map(lambda x, b=b: x[b * n : (b + 1) * n], rows)
                full_b, block = jax.lax.optimization_barrier((full, block))
                parts.append(jax.lax.optimization_barrier(canonical(full_b, block, key)))
            grads, loss_sum, weight = (
                [fixed_sum(jnp.stack(g), _add) for g in zip(*(p[0] for p in parts), strict=True)],
                fixed_sum(jnp.stack([p[1] for p in parts]), _add),
                fixed_sum(jnp.stack([p[2] for p in parts]), _add),
            )
            aux = jax.tree.map(lambda *xs: jnp.concatenate(xs), *(p[3] for p in parts))
            return [g[None] for g in grads], loss_sum[None], weight[None], aux

        each = P(self.centry)
        grads, loss_sum, weight, aux = self.gathered_map(
            partial, arrays, rows, key, ([each] * len(self.diff_specs), each, each, each),
            whole=whole,
        )  # fmt: skip
        return self.reduce_scatter(grads, loss_sum, weight), aux

    def reduce_scatter(self, grads, loss_sum, weight) -> list:
        """Every device's partial sums (stacked over the chunk axes) -> the packed sums,
        each device its blocks, added in the canonical tree over the devices."""
        # Per device: its partial grads, whole over the chunk axes, blocked over the others.
        in_specs = [
            P(self.centry, *(None if self._names_chunk(P(e)) else e for e in s))
            for s in self.diff_specs
        ]
        count = len(self.plan.sums_flat.vectors)
        return list(
            jax.shard_map(
                self._local_reduce,
                mesh=self.gmesh,
                in_specs=(in_specs, P(self.centry), P(self.centry)),
                out_specs=(P(self.gentry),) * count,
                check_vma=False,
            )(list(grads), loss_sum, weight)
        )

    def _local_reduce(self, grads, loss_sum, weight):
        parts = [g[0] for g in grads]
        out: list[Any] = [None] * len(parts)
        for i in self.sharded:  # one all_to_all per leaf: its pieces are views, no buffer copy
            pieces = self._pieces(parts[i], self.diff_specs[i], self.block_shapes[i])
            out[i] = fixed_sum(jax.lax.all_to_all(pieces, self.centry, 0, 0, tiled=True), _add)
        # The leaves whole over the chunk axes, the loss and the weight: a flat vector per dtype
        # cut into one piece per device, reduced like the blocks, then all-gathered (exact).
        rest = self.rest_flat.pack([*(parts[i] for i in self.whole), loss_sum[0], weight[0]])
        whole = []
        for r in rest:
            n = r.shape[0]
            if not n:
                whole.append(r)
                continue
            piece = -(-n // self.size)
            rows = jnp.pad(r, (0, piece * self.size - n)).reshape(self.size, piece)
            mine = fixed_sum(jax.lax.all_to_all(rows, self.centry, 0, 0, tiled=True), _add)
            whole.append(jax.lax.all_gather(mine, self.centry, tiled=True)[:n])
        *whole_grads, loss_total, weight_total = self.rest_flat.unpack(whole)
        for i, x in zip(self.whole, whole_grads, strict=True):
            out[i] = x
        return tuple(self.plan.pack_sums([*out, loss_total, weight_total]))

    def _pieces(self, x: jax.Array, spec: P, block: tuple[int, ...]) -> jax.Array:
        """``x`` (whole over the chunk axes) as ``(devices, *block)``: row ``d`` device ``d``'s
        block. One dimension split over the chunk axes in their order (the usual FSDP spec):
        a reshape; otherwise each device's block sliced out."""
        dims = [k for k, e in enumerate(spec) if self._names_chunk(P(e))]
        if len(dims) == 1 and partition.names(spec[dims[0]]) == self.chunk:
            k = dims[0]
            split = (*x.shape[:k], self.size, x.shape[k] // self.size, *x.shape[k + 1 :])
            return jnp.moveaxis(x.reshape(split), k, 0)
        return jnp.stack([self._block(x, spec, block, d) for d in range(self.size)])

    def _block(self, x: jax.Array, spec: P, block: tuple[int, ...], d: int) -> jax.Array:
        """Device ``d``'s block of ``x`` (whole over the chunk axes) along the dims ``spec``
        shards over them; its other axes' coordinates are this device's."""
        coords = dict(zip(self.chunk, np.unravel_index(d, self.sizes), strict=True))
        return block_of(x, spec, block, self.gmesh.shape, lambda n: int(coords[n]), self.chunk)
