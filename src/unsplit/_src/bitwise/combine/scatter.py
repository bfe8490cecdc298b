"""Grad totals divided where the combine's reduce-scatter leaves them, in pieces.

The combine's reduce-scatter leaves group ``g`` one ``1 / groups`` piece of every sums
vector. For a large leaf with a vector of its own (:class:`~.flat.FlatPlan`'s
``alone``), the fused combine-and-unpack program (:func:`layouts`) does not all-gather
the total and then divide it on every device:

- :data:`PIECE`: each group divides its piece by the weight (1 / groups of the
  division's work) and the divided pieces are all-gathered into the grad;
- :data:`SHARD`: a leaf whose dimension 0 is split over exactly the groups' axes (FSDP:
  ``P("data", None)`` with ``data`` the groups' axis). Piece ``g`` *is* group ``g``'s
  shard (row-major: rows ``[g r, (g + 1) r)``), so it is divided where it lies and never
  all-gathered. The pairwise reduce-scatter leaves group ``g`` piece
  ``bit_reversed(g)``: one collective permute (:func:`in_order`) puts them in order.

The shared vectors (small leaves, the loss and the weight) stay :data:`WHOLE`:
all-gathered, unpacked, then divided. Data movement and where the division runs are all
that change: every layout gives the bits of the all-gathered total divided
(:func:`divided` keeps the division a division).

Example:
    >>> from unsplit._src.bitwise.combine import scatter
    >>> scatter.bit_reversed(1, 8), scatter.bit_reversed(3, 8), scatter.bit_reversed(2, 4)
    (4, 6, 1)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from unsplit._src import partition
from unsplit._src.bitwise.combine import pairwise
from unsplit._src.bitwise.flat import FlatPlan
from unsplit._src.step import sums


def bit_reversed(g: int, groups: int) -> int:
    """``g``'s bits in reverse order, over ``log2(groups)`` bits (``groups``: a power of 2)."""
    bits = groups.bit_length() - 1
    return int(format(g, f"0{bits}b")[::-1], 2) if bits else 0


def in_order(piece: jax.Array, axes: Any, groups: int) -> jax.Array:
    """Inside a ``shard_map``: the pairwise reduce-scatter's pieces (group ``g`` holding piece
    ``bit_reversed(g)``) moved so that group ``g`` holds piece ``g`` (one collective permute)."""
    perm = [(g, bit_reversed(g, groups)) for g in range(groups)]
    if all(a == b for a, b in perm):
        return piece
    return jax.lax.ppermute(piece, axes, perm)


# How the step's combine-and-unpack program leaves each sums vector (:func:`layouts`).
WHOLE = "whole"  # all-gathered by the combine, unpacked, then divided by the weight
SHARD = "shard"  # an FSDP leaf's piece: divided where it lies, never all-gathered
PIECE = "piece"  # a large leaf's piece: divided, then all-gathered (1 / groups of the division)


def layouts(plan: Any) -> tuple[str, ...]:
    """Per sums vector: :data:`SHARD`, :data:`PIECE` or :data:`WHOLE` (see above).

    A vector of one grad leaf alone (:class:`~unsplit._src.bitwise.flat.FlatPlan`'s
    ``alone``, unpadded) is a :data:`PIECE` where there are several groups; a
    :data:`SHARD` when the leaf's spec on the user's mesh splits dimension 0 over
    exactly the outer batch axes (in order) and no other dimension over them, and the
    groups divide that dimension. The shared vectors (the small leaves, the loss and the
    weight) are :data:`WHOLE`.
    """
    flat = plan.sums_flat
    out = [WHOLE] * len(flat.vectors)
    if plan.groups < 2:
        return tuple(out)
    outer = tuple(plan.outer_axes)
    count = [0] * len(flat.vectors)
    for v, _ in flat.slots:
        count[v] += 1
    diff_specs = [s for s, d in zip(plan.specs, plan.structure.diff, strict=True) if d]
    for i, spec in enumerate(diff_specs):
        v, _ = flat.slots[i]
        shape = flat.shapes[i]
        if count[v] != 1 or not shape or flat.lengths[v] != math.prod(shape):
            continue
        out[v] = PIECE
        rest = {n for e in spec[1:] for n in partition.names(e)}
        if (
            partition.names(spec[0]) == outer
            and not rest & set(outer)
            and shape[0] % plan.groups == 0
        ):
            out[v] = SHARD
    return tuple(out)


def pieces_plan(plan: Any, layouts: tuple[str, ...]) -> FlatPlan:
    """The sums' flat layout as the unpack gets them: a ``SHARD`` vector's leaf as its
    dimension 0 divided by the groups, a ``PIECE`` vector's as a flat piece."""
    flat = plan.sums_flat
    shapes = list(flat.shapes)
    lengths = list(flat.lengths)
    for i, (v, _) in enumerate(flat.slots):
        if v < 0 or layouts[v] == WHOLE:
            continue
        lengths[v] //= plan.groups
        if layouts[v] == SHARD:
            shapes[i] = (shapes[i][0] // plan.groups, *shapes[i][1:])
        else:
            shapes[i] = (lengths[v],)
    return dataclasses.replace(flat, shapes=tuple(shapes), lengths=tuple(lengths))


def divided(piece: jax.Array, weight: jax.Array, dtype: Any) -> jax.Array:
    """``piece / weight`` cast to ``dtype``: :func:`~unsplit._src.step.sums.normalize`'s
    division of one grad (its zeros first written ``+0``, as the unpack writes every
    total's), with the weight broadcast behind an optimization barrier.

    Seen as ``x / broadcast(w)``, XLA:CPU rewrote some such divisions in the combined
    program into ``x * broadcast(1 / w)`` (measured: a third of a leaf's elements 1 ulp
    off); a divisor XLA cannot see as a broadcast keeps the division as written.
    """
    w = sums.valid_weight(weight).astype(piece.dtype)
    w = jax.lax.optimization_barrier(jnp.broadcast_to(w, piece.shape))
    return (pairwise.positive_zero(piece) / w).astype(dtype)


def piece_spec(plan: Any) -> P:
    """The global layout of a scattered vector's pieces on the compute mesh (each device its
    piece of its own vector: groups row-major, then the group axes)."""
    return P(partition.entry((*partition.names(plan.outer_entry), *plan.group_axes)))


def shard_spec(plan: Any, local_spec: P) -> P:
    """A scattered leaf's grad, as the unpack's ``shard_map`` puts it out: dimension 0 over the
    outer axes, the others as inside its group."""
    return P(plan.outer_entry, *local_spec[1:])
