"""Ring attention's forward and backward passes for one example ``[length, heads, depth]``.

Each device holds ``L / S`` positions (queries, keys, values) of an example whose
sequence is split over the ring's axis (``S`` devices; one device without an axis). The
keys and values travel around the ring (``ppermute``), one shard a step, as in every ring
attention; what is new is the order the pieces are combined in, which makes the result
the same bits at every ``S`` (:mod:`~unsplit._src.ring.tree`):

* forward: at each step a device computes, for each of its query blocks, the partial
  softmax over the shard it holds (its key blocks' tiles stacked, merged in the canonical
  tree) and keeps it in the slot of that shard; after the ring, the ``S`` slots are
  merged in the canonical tree over the shard index. A ring that folded the shards in the
  order they arrive would pair them differently on every device and at every ``S``;
* backward (a ``custom_vjp``: recomputed per tile from the saved log-sum-exp, as
  FlashAttention does): the keys and values travel again; for each key block of the shard
  it holds, a device adds that block's key and value gradients over its query blocks
  (stacked, tree) and its pieces of the query gradient over the key blocks (a binary
  counter, :func:`~unsplit._src.ring.tree.scan_tree`), each shard's in its slot; one
  ``all_to_all`` hands each shard's key and value pieces to the shard's owner, who adds
  them over the devices (tree), as each device adds its query pieces over the shards.

Memory per device: the slots hold ``S`` pieces of the local output (forward) or of the
local gradients (backward): ``S * (L / S) * heads * depth = L * heads * depth`` floats
each, the size of one whole-sequence key (or value) tensor; a tile's scores are
``heads * block**2``; no ``(L / S) x L`` score matrix is ever formed. A ring that folds as
the shards arrive holds one piece instead of ``S``: that is the price of the same bits at
every degree.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from unsplit._src.ring import tiles, tree

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Ring:
    """Where the ring runs and what its tiles compute (static)."""

    axis_name: str | None  # the mesh axis the sequence is split over (None: one device)
    options: tiles.Options

    def place(self) -> tuple[Any, Any]:
        """``(S, this device's index)`` on the ring."""
        if self.axis_name is None:
            return 1, jnp.int32(0)
        return lax.axis_size(self.axis_name), lax.axis_index(self.axis_name)

    def rotate(self, tree_: Any, size: int) -> Any:
        """Each device's arrays sent to the previous device: the next shard arrives."""
        if self.axis_name is None or size == 1:
            return tree_
        perm = [(i, (i - 1) % size) for i in range(size)]
        return jax.tree.map(lambda x: lax.ppermute(x, self.axis_name, perm), tree_)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def attention(q: Array, k: Array, v: Array, words: Array, ring: Ring) -> Array:
    """One example's attention output ``[L / S, heads, depth]`` (see the module docs)."""
    return _forward(q, k, v, words, ring)[0]


def _attention_fwd(q, k, v, words, ring):
    out, lse = _forward(q, k, v, words, ring)
    return out, (q, k, v, words, out, lse)


def _scaled(q: Array, ring: Ring) -> Array:
    """The queries times the scores' factor, once for every tile that reads them."""
    return q * jnp.asarray(ring.options.scale, q.dtype)


def _attention_bwd(ring, residuals, g):
    q, k, v, words, out, lse = residuals
    dq, dk, dv = _backward(q, k, v, words, out, lse, g, ring)
    return dq, dk, dv, None


attention.defvjp(_attention_fwd, _attention_bwd)


def _blocks(x: Array, n: int) -> Array:
    return x.reshape(x.shape[0] // n, n, *x.shape[1:])


def _slots(like: Any, size: int) -> Any:
    """One slot per shard, each shaped like ``like`` (and typed like it)."""
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (size, *x.shape)), like)


def _put(slots: Any, s: Array, piece: Any) -> Any:
    """``piece`` into slot ``s`` (in place in the loop's carry)."""
    return jax.tree.map(lambda x, p: lax.dynamic_update_index_in_dim(x, p, s, 0), slots, piece)


def _add(a: Any, b: Any) -> Any:
    return jax.tree.map(jnp.add, a, b)


def _skipped(ring: Ring, s: Array, j: Array, compute, nothing):
    """``compute()``, or ``nothing`` for a shard wholly after every local query (causal)."""
    if not ring.options.causal:
        return compute()
    return lax.cond(s > j, lambda: nothing, compute)


def _forward(q, k, v, words, ring: Ring) -> tuple[Array, Array]:
    o = ring.options
    n = o.block
    size, j = ring.place()
    rows, heads, depth = q.shape
    qb = _blocks(_scaled(q, ring), n)
    refs = (q, k, v, words, j)
    like = tiles.vary(tiles.empty(n, heads, depth, q.dtype), refs)  # a skipped shard

    def shard(kc, vc, s):
        kb, vb = _blocks(kc, n), _blocks(vc, n)

        def query_block(i):
            def tile(_, b):
                col0 = s * kc.shape[0] + b * n
                return None, tiles.forward(qb[i], kb[b], vb[b], words, j * rows + i * n, col0, o)

            # The tiles' partials stacked (one shard's keys: as much as its values), then
            # merged level by level: nb - 1 merges.
            _, pieces = lax.scan(tile, None, jnp.arange(kb.shape[0]))
            return tree.reduce_stacked(pieces, tiles.merge)

        return lax.map(query_block, jnp.arange(qb.shape[0]))

    nothing = jax.tree.map(lambda x: jnp.broadcast_to(x, (qb.shape[0], *x.shape)), like)

    def step(carry, t):
        kc, vc, slots = carry
        s = (j + t) % size
        partial = _skipped(ring, s, j, lambda: shard(kc, vc, s), nothing)
        return (*ring.rotate((kc, vc), size), _put(slots, s, partial)), None

    (_, _, slots), _ = lax.scan(step, (k, v, _slots(nothing, size)), jnp.arange(size))
    root = tree.reduce_stacked(slots, tiles.merge)
    out, lse = tiles.finish(root)  # [blocks, n, heads, depth], [blocks, heads, n]
    return out.reshape(q.shape), lse


def _backward(q, k, v, words, out, lse, g, ring: Ring) -> tuple[Array, Array, Array]:
    o = ring.options
    n = o.block
    size, j = ring.place()
    rows = q.shape[0]
    qb, gb = _blocks(_scaled(q, ring), n), _blocks(g, n)
    ob = _blocks(out, n)
    delta = jnp.swapaxes(tree.sum_last(gb * ob), -1, -2)  # [blocks, heads, n]
    refs = (q, k, v, words, out, lse, g, j)

    def zeros(x):
        return tiles.vary(jnp.zeros_like(x), refs)

    def shard(kc, vc, s):
        kb, vb = _blocks(kc, n), _blocks(vc, n)

        def key_block(b):
            def tile(_, i):
                row0, col0 = j * rows + i * n, s * kc.shape[0] + b * n
                return None, tiles.backward(
                    qb[i], kb[b], vb[b], gb[i], lse[i], delta[i], words, row0, col0, o
                )

            _, (dq, dk, dv) = lax.scan(tile, None, jnp.arange(qb.shape[0]))
            # This key block's gradients over the local query blocks (stacked: one
            # shard's queries), and its pieces of every local query block's.
            return dq, (tree.reduce_stacked(dk, jnp.add), tree.reduce_stacked(dv, jnp.add))

        dq, dkv = tree.scan_tree(key_block, kb.shape[0], jnp.add, zeros(qb))
        return dq, dkv

    nothing = (zeros(qb), (zeros(_blocks(k, n)),) * 2)

    def step(carry, t):
        kc, vc, slots = carry
        s = (j + t) % size
        pieces = _skipped(ring, s, j, lambda: shard(kc, vc, s), nothing)
        return (*ring.rotate((kc, vc), size), _put(slots, s, pieces)), None

    (_, _, (dq, (dk, dv))), _ = lax.scan(
        step, (k, v, _slots(nothing, size)), jnp.arange(size)
    )  # fmt: skip
    if ring.axis_name is not None and size > 1:  # each shard's pieces to its owner
        dk, dv = (lax.all_to_all(x, ring.axis_name, 0, 0, tiled=True) for x in (dk, dv))
    dq, dk, dv = (tree.reduce_stacked(x, jnp.add) for x in (dq, dk, dv))
    return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)
