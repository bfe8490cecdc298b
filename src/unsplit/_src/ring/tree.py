"""The canonical tree over block indices: one fixed pairing of merges, whatever the split.

Ring attention combines pieces over key blocks (an online softmax's partials) and over
query blocks (the keys' and values' gradients). Float merges are not associative, so
the result depends on how they are paired. Here they are always paired in the
**complete binary tree over the global block index** (the tree of
:mod:`unsplit._src.bitwise.reduce`: leaves ``[0, 2**ceil(log2 n))``, absent leaves
dropped, a node without its right half is its left half), left operand the lower
indices. A device's blocks are an aligned subtree of it when their number is a power of
two, so reducing them first and then the devices' results gives the same pairs, the same
bits, at every sequence degree.

Two ways to walk it, the same tree:

* :func:`reduce_stacked` -- pieces stacked on a leading axis, reduced level by level;
* :func:`scan_tree` -- pieces made one at a time in a ``lax.scan``, merged like a binary
  counter: ``log2(n) + 1`` pieces alive, never all ``n``.

Example:
    >>> import jax.numpy as jnp
    >>> from unsplit._src.ring import tree
    >>> minus = lambda a, b: a - b  # not associative: the result shows the pairing
    >>> int(tree.reduce_stacked(jnp.arange(1, 6), minus))  # ((1-2)-(3-4))-5; a fold: -13
    -5
    >>> root, sides = tree.scan_tree(lambda b: (b + 1, 2 * b), 5, minus, jnp.int32(0))
    >>> int(root), sides.tolist()  # the pieces' side outputs, stacked in block order
    (-5, [0, 2, 4, 6, 8])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

Merge = Callable[[Any, Any], Any]


def reduce_stacked(pieces: Any, merge: Merge) -> Any:
    """The canonical tree's root over the leading axis of ``pieces`` (a pytree of arrays)."""
    count = jax.tree.leaves(pieces)[0].shape[0]
    while count > 1:
        pairs = count // 2
        left = jax.tree.map(lambda x, p=pairs: x[0 : 2 * p : 2], pieces)
        right = jax.tree.map(lambda x, p=pairs: x[1 : 2 * p : 2], pieces)
        merged = merge(left, right)
        if count % 2:  # the last node has no right half: it rises as it is
            merged = jax.tree.map(
                lambda m, x: jnp.concatenate([m, x[-1:]]), merged, pieces
            )  # fmt: skip
        pieces, count = merged, pairs + count % 2
    return jax.tree.map(lambda x: x[0], pieces)


def sum_last(x: jax.Array) -> jax.Array:
    """``x`` summed over its last axis in the canonical tree (elementwise adds only).

    A reduction's order is XLA's to choose, and it chooses by the program around it
    (measured: a loop of one trip, inlined, summed a block's rows in another order than
    the same loop of several trips); exactly rounded adds in a fixed tree do not depend
    on it. Behind a barrier, so no product feeding it is fused into an add.
    """
    return reduce_stacked(jax.lax.optimization_barrier(jnp.moveaxis(x, -1, 0)), jnp.add)


def scan_tree(
    piece: Callable[[jax.Array], tuple[Any, Any]], n: int, merge: Merge, like: Any
) -> tuple[Any, Any]:
    """The canonical tree's root over the pieces of blocks ``0, ..., n - 1``, made in a
    ``lax.scan``, and each block's side output stacked (as ``lax.scan``'s outputs).

    Args:
        piece: block index (a traced ``int32``) -> ``(that block's piece, a side output)``
            (pytrees; the side output may be ``None``).
        n: the number of blocks (static).
        merge: ``merge(left, right)`` of two pieces (elementwise over a pytree).
        like: a pytree with a piece's shapes and dtypes (its values are not used).

    The carry holds one pending piece per tree level (a binary counter): block ``b``
    merges with the pending pieces of the levels its trailing one bits name, then
    waits at the next level. A ``lax.switch`` on that count runs exactly those merges
    (``n - 1`` in all, as many as :func:`reduce_stacked` does) and returns the one piece
    that then waits, written in place (the pending pieces are read, never copied).
    """
    levels = max(n.bit_length(), 1)
    # The pending pieces stacked by level (broadcast from ``like``: typed like a piece, how
    # it varies over manual axes too); a block's piece is written in place at its level.
    slots = jax.tree.map(lambda x: jnp.broadcast_to(x, (levels, *jnp.shape(x))), like)

    def joins(count: int):
        def run(slots, carry):  # reads the slots, returns one piece
            for level in range(count):  # the left siblings, lowest level first
                carry = merge(jax.tree.map(lambda s, lv=level: s[lv], slots), carry)
            return carry

        return run

    def push(slots, b):
        carry, side = piece(b)
        # Trailing one bits of b: how many pending pieces are b's left siblings.
        ones = jnp.int32(0)
        for level in range(levels):
            ones = ones + jnp.where((ones == level) & ((b >> level) & 1 == 1), 1, 0)
        carry = jax.lax.switch(ones, [joins(c) for c in range(levels)], slots, carry)
        slots = jax.tree.map(
            lambda s, c: jax.lax.dynamic_update_index_in_dim(s, c, ones, 0), slots, carry
        )  # fmt: skip
        return slots, side

    slots, sides = jax.lax.scan(push, slots, jnp.arange(n, dtype=jnp.int32))
    # The pending pieces of n's one bits are the aligned blocks of [0, n), largest
    # (lowest indices) at the highest level: joined from the lowest level up.
    root = None
    for level in range(levels):
        if (n >> level) & 1:
            here = jax.tree.map(lambda s, lv=level: s[lv], slots)
            root = here if root is None else merge(here, root)
    return root, sides
