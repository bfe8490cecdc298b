"""The combine program: the groups' blocks added in the canonical tree, on the compute mesh.

Each group's chunk sums end as aligned blocks of the canonical tree
(:mod:`unsplit._src.bitwise.reduce`); the combine adds every group's blocks into
the root and gives every group the total. Two ways, with the same bits:

* ``2**k`` groups that each hold one block: the tree's top levels are pairs of
  groups, added by reduce-scatters of two devices
  (:mod:`unsplit._src.bitwise.combine.pairwise`), when that collective is seen to add
  exactly on these devices; then all-gathers of two devices back;
* otherwise: a fixed-order reduce-scatter by ``all_to_all`` (every group gets
  every group's blocks of its piece and adds them in the tree), then an all-gather.

Never a ``psum`` over more than two devices: its order of adds is the collective's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from unsplit._src import partition
from unsplit._src.bitwise import reduce
from unsplit._src.bitwise.combine import pairwise, scatter
from unsplit._src.bitwise.plan import Plan


def slots_spec(plan: Plan) -> P:
    """The combine's inputs: every group's blocks stacked, ``(groups, slots, length)``; or,
    when each group holds one block, the chunk programs' outputs end to end, ``(groups *
    length,)``, with no stacking program (one launch and one copy per group less)."""
    if plan.slots == 1:
        return P(partition.entry((*partition.names(plan.outer_entry), *plan.group_axes)))
    return P(plan.outer_entry, None, partition.entry(plan.group_axes))


def program(plan: Plan, layouts: tuple[str, ...] = ()):
    """The groups' blocks -> the total, added in the canonical tree (on the compute mesh).

    ``layouts`` (per sums vector, :func:`~unsplit._src.bitwise.combine.scatter.layouts`;
    default all ``WHOLE``): a ``SHARD`` vector comes out as each group's piece of the
    total in group order, a ``PIECE`` one as the piece the reduce-scatter leaves (for
    :func:`gather` after the unpack divides it); both with spec ``scatter.piece_spec``.

    By pairs of devices where :func:`_pairwise` allows it; otherwise this general way.
    A fixed-order reduce-scatter, then an all-gather: each flat vector is cut into
    one piece per group; an ``all_to_all`` brings every group's blocks of piece
    ``g`` to group ``g``, which adds them in the canonical tree
    (:func:`reduce.combine`: elementwise, so each element is added in the same
    order whatever piece it falls in); an ``all_gather`` gives every group the
    whole total. Each device sends ``2 (G - 1) / G`` of its vectors (times the
    blocks a group holds, one when each group's share is one aligned subtree):
    a ring all-reduce's bytes, with the order fixed. Never a ``psum``.
    """
    layouts = layouts or (scatter.WHOLE,) * len(plan.sums_flat.vectors)
    if _pairwise(plan):
        return _pairwise_combine(plan, layouts)
    mesh = plan.compute
    batch = plan.outer_entry
    n = len(plan.sums_flat.vectors)
    groups = plan.groups
    layout = [plan.blocks(g) for g in range(groups)]

    def add(a, b):
        return [pairwise.add(x, y) for x, y in zip(a, b, strict=True)]

    def exchange(s):
        """(1, slots, length) -> (groups, slots, piece): every group's blocks of my piece."""
        piece = -(-s.shape[2] // groups)
        # Each piece sliced from the input, only the short last one padded: one copy of the
        # sums before the all_to_all where padding the whole vector first made two.
        parts = [s[0, :, g * piece : (g + 1) * piece] for g in range(groups)]
        parts = [jnp.pad(p, ((0, 0), (0, piece - p.shape[1]))) for p in parts]
        return jax.lax.all_to_all(jnp.stack(parts), batch, split_axis=0, concat_axis=0, tiled=True)

    def local(*slots):  # each (1, slots, length): this group's blocks
        if plan.slots == 1:  # each group's one block as the chunk program wrote it
            slots = tuple(s.reshape(1, 1, -1) for s in slots)
        length = [s.shape[2] for s in slots]
        mine = [exchange(s) for s in slots] if groups > 1 else [s for s in slots]
        named = {
            block: [m[g, j] for m in mine]
            for g, blocks in enumerate(layout)
            for j, block in enumerate(blocks)
        }
        piece = reduce.combine(named, plan.chunks, add)
        if groups == 1:
            return tuple(piece)
        return tuple(
            jax.lax.all_gather(p, batch, tiled=True)[:n_] if kind == scatter.WHOLE else p
            for p, n_, kind in zip(piece, length, layouts, strict=True)
        )

    return jax.jit(
        jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(slots_spec(plan),) * n,
            out_specs=_out_specs(plan, layouts),
            check_vma=False,
        )
    )


def _out_specs(plan: Plan, layouts: tuple[str, ...]) -> tuple[P, ...]:
    """The totals' specs: whole on every group, or each group's piece."""
    whole = P(partition.entry(plan.group_axes))
    return tuple(whole if kind == scatter.WHOLE else scatter.piece_spec(plan) for kind in layouts)


def gather(plan: Plan):
    """``piece -> total`` inside a ``shard_map`` over the outer axes: the inverse of the
    combine's reduce-scatter for a ``PIECE`` vector (exact data movement)."""
    groups, outer = plan.groups, plan.outer_entry
    if _pairwise(plan):  # its pieces in bit-reversed group order
        return lambda piece: pairwise.all_gather(piece, outer, groups)
    return lambda piece: jax.lax.all_gather(piece, outer, tiled=True)


def _pairwise(plan: Plan) -> bool:
    """Whether the combine can add the groups by reduce-scatters of two devices
    (:mod:`~unsplit._src.bitwise.combine.pairwise`): ``2**k`` groups, each holding one block, and
    the collective seen to add exactly."""
    if plan.slots != 1 or pairwise.levels(plan.groups) is None:
        return False
    leading = len(plan.outer_axes)
    return all(pairwise.exact(plan.compute, leading, d) for d in plan.sums_flat.vectors)


def _pairwise_combine(plan: Plan, layouts: tuple[str, ...]):
    """:func:`program` as reduce-scatters and all-gathers of two devices each."""
    n = len(plan.sums_flat.vectors)
    groups, outer = plan.groups, plan.outer_entry

    def local(*vectors):
        # Each vector's length is a multiple of the groups: the sums' layout is padded (plan).
        pieces = [pairwise.reduce_scatter(v, outer, groups) for v in vectors]
        moves = {
            scatter.WHOLE: lambda p: pairwise.all_gather(p, outer, groups),
            scatter.SHARD: lambda p: scatter.in_order(p, outer, groups),
            scatter.PIECE: lambda p: p,
        }
        return tuple(moves[kind](p) for p, kind in zip(pieces, layouts, strict=True))

    return jax.jit(
        jax.shard_map(
            local,
            mesh=plan.compute,
            in_specs=(slots_spec(plan),) * n,
            out_specs=_out_specs(plan, layouts),
            check_vma=False,
        )
    )
