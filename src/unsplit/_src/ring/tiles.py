"""One tile of attention: a block of queries against a block of keys, forward and backward.

Every tile has the same shape (``block`` queries x ``block`` keys, per head) at every
sequence degree, so its dots are the same programs and give the same bits; what differs
between degrees is only which device computes it and when, and the tiles' pieces are then
combined in one canonical tree (:mod:`~unsplit._src.ring.tree`).

* :class:`Partial` -- an online softmax's partial over some keys, for a block of queries:
  the scores' running maximum, the sum of ``exp(score - max)`` (every key: dropout comes
  after the normalization, as in Flax) and the kept weights times the values;
  :func:`merge` joins two (the left operand the lower key blocks);
* :func:`forward` / :func:`backward` -- a tile's partial, and its pieces of the query,
  key and value gradients (FlashAttention's backward: recomputed from the saved
  log-sum-exp, nothing of the tile stored);
* :func:`keep` -- the tile's dropout keep bits, from unsplit's grid rule at the tile's
  *global* positions: weight ``(head, q, k)`` is kept iff lane ``k % 4`` of
  ``threefry2x32(key_head, (q, k // 4))`` is below the threshold, the same bit
  ``unsplit.linen.dot_product_attention`` draws for it (:mod:`unsplit._src.random`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from unsplit._src import random
from unsplit._src.ring import tree

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Options:
    """What every tile of one call shares (static)."""

    block: int  # queries and keys per tile
    scale: float  # the scores' factor (1 / sqrt(depth) by default)
    causal: bool
    threshold: int  # dropout's 16-bit keep threshold; 2**16: no dropout
    precision: Any = None

    @property
    def dropout(self) -> bool:
        return self.threshold < random.LANE_VALUES

    @property
    def keep_probability(self) -> float:
        return self.threshold / random.LANE_VALUES


class Partial(NamedTuple):
    """An online softmax over some keys, for a block of queries (per head)."""

    peak: Array  # [heads, queries]: the largest score so far (-inf: no key yet)
    total: Array  # [heads, queries]: sum of exp(score - peak) over those keys
    out: Array  # [queries, heads, depth]: sum of kept exp(score - peak) / keep * value


def empty(rows: int, heads: int, depth: int, dtype: Any) -> Partial:
    """The partial over no keys: :func:`merge`'s identity (exactly)."""
    return Partial(
        jnp.full((heads, rows), -jnp.inf, dtype),
        jnp.zeros((heads, rows), dtype),
        jnp.zeros((rows, heads, depth), dtype),
    )


def merge(a: Partial, b: Partial) -> Partial:
    """The partial over ``a``'s keys and ``b``'s (elementwise; leading axes allowed)."""
    peak = jnp.maximum(a.peak, b.peak)
    base = jnp.where(peak == -jnp.inf, jnp.zeros_like(peak), peak)  # no key: no NaN
    ca, cb = jnp.exp(a.peak - base), jnp.exp(b.peak - base)

    def rows(c):  # [.., heads, q] -> [.., q, heads, 1]
        return jnp.swapaxes(c, -1, -2)[..., None]

    return Partial(peak, a.total * ca + b.total * cb, a.out * rows(ca) + b.out * rows(cb))


def finish(p: Partial) -> tuple[Array, Array]:
    """The attention output ``[queries, heads, depth]`` and the log-sum-exp ``[heads, queries]``."""
    out = p.out / jnp.swapaxes(p.total, -1, -2)[..., None]
    return out, p.peak + jnp.log(p.total)


def keep(words: Array, row0: Array, col0: Array, options: Options) -> Array:
    """The keep bits ``bool[heads, block, block]`` of the tile at global ``(row0, col0)``.

    ``words``: ``uint32[heads, 2]``, each head's key (``fold_in`` of the example's key by
    the leading coordinates, as the grid layout defines it).
    """
    n = options.block
    k0, k1 = (words[:, i].reshape(-1, 1, 1) for i in (0, 1))
    rows = (row0 + lax.broadcasted_iota(jnp.int32, (1, n, 1), 1)).astype(jnp.uint32)
    t = np.uint32(options.threshold)
    if n % random.LANES == 0:  # a tile's columns start at a multiple of 4: whole hashes
        blocks = col0 // random.LANES + lax.broadcasted_iota(jnp.int32, (1, 1, n // 4), 2)
        w0, w1 = random.threefry2x32(k0, k1, rows, blocks.astype(jnp.uint32))
        lanes = (w0 & 0xFFFF, w0 >> 16, w1 & 0xFFFF, w1 >> 16)
        bits = jnp.stack([lane < t for lane in lanes], axis=-1)
        return bits.reshape(k0.shape[0], n, n)
    cols = (col0 + lax.broadcasted_iota(jnp.int32, (1, 1, n), 2)).astype(jnp.uint32)
    w0, w1 = random.threefry2x32(k0, k1, rows, cols >> 2)
    lane = cols & 3
    word = jnp.where(lane < 2, w0, w1)
    return ((word >> ((lane & 1) * 16)) & 0xFFFF) < t


def _scores(q: Array, k: Array, row0: Array, col0: Array, options: Options) -> Array:
    """The tile's scores ``[heads, block, block]`` (``q`` already scaled), causally masked."""
    s = jnp.einsum("qhd,khd->hqk", q, k, precision=options.precision)
    if options.causal:
        n = options.block
        rows = row0 + lax.broadcasted_iota(jnp.int32, (1, n, 1), 1)
        cols = col0 + lax.broadcasted_iota(jnp.int32, (1, 1, n), 2)
        s = jnp.where(cols > rows, -jnp.inf, s)
    return s


def vary(tree: Any, *refs: Any) -> Any:
    """``tree`` varying over every manual axis any of ``refs`` varies over (inside a
    ``shard_map`` with ``check_vma``): the two branches of a ``cond``, a scan's carry and
    its updates then have one type. Outside a manual region: ``tree`` as it is."""
    axes: frozenset = frozenset()
    for r in jax.tree.leaves(refs):
        axes |= _varying(r)

    def one(x):
        missing = tuple(sorted(axes - _varying(x)))
        return lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(one, tree)


def _varying(x: Any) -> frozenset:
    """The manual axes ``x`` varies over (its type's ``mat.varying``; none outside)."""
    return frozenset(getattr(getattr(jax.typeof(x), "mat", None), "varying", ()))


def masked_out(row0: Array, col0: Array, options: Options) -> Array:
    """Whether causal masking hides the whole tile (every key after every query)."""
    if not options.causal:
        return jnp.bool_(False)
    return col0 > row0 + options.block - 1


def forward(q, k, v, words, row0, col0, options: Options) -> Partial:
    """The tile's partial (``q``: ``[block, heads, depth]``, scaled by ``options.scale``;
    ``k`` and ``v`` likewise, unscaled)."""

    def compute():
        s = _scores(q, k, row0, col0, options)
        peak = jnp.max(s, axis=-1)
        base = jnp.where(peak == -jnp.inf, jnp.zeros_like(peak), peak)
        p = jnp.exp(s - base[..., None])
        kept = p
        if options.dropout:
            scaled = p / _const(options.keep_probability, p)
            kept = jnp.where(keep(words, row0, col0, options), scaled, jnp.zeros_like(p))
        out = jnp.einsum("hqk,khd->qhd", kept, v, precision=options.precision)
        return vary(Partial(peak, tree.sum_last(p), out), refs)

    refs = (q, k, v, words, row0, col0)
    nothing = vary(empty(options.block, q.shape[1], v.shape[2], q.dtype), refs)
    return lax.cond(masked_out(row0, col0, options), lambda: nothing, compute)


def backward(q, k, v, g, lse, delta, words, row0, col0, options: Options):
    """The tile's pieces ``(dq, dk, dv)`` of the gradients (``q`` scaled, as for
    :func:`forward`; ``dq`` is the unscaled query's).

    ``g``: the output's cotangent ``[block, heads, depth]``; ``lse``: the forward's
    log-sum-exp ``[heads, block]``; ``delta``: ``sum(g * out, depth)`` ``[heads, block]``.
    """

    def compute():
        s = _scores(q, k, row0, col0, options)
        p = jnp.exp(s - lse[..., None])
        dp = jnp.einsum("qhd,khd->hqk", g, v, precision=options.precision)
        kept = p
        if options.dropout:
            bits = keep(words, row0, col0, options)
            factor = jnp.where(bits, _const(1 / options.keep_probability, p), _const(0, p))
            kept, dp = p * factor, dp * factor
        ds = p * (dp - delta[..., None])
        dq = jnp.einsum("hqk,khd->qhd", ds, k, precision=options.precision)
        dq = dq * _const(options.scale, dq)
        dk = jnp.einsum("hqk,qhd->khd", ds, q, precision=options.precision)
        dv = jnp.einsum("hqk,qhd->khd", kept, g, precision=options.precision)
        return vary((dq, dk, dv), refs)

    refs = (q, k, v, g, lse, delta, words, row0, col0)
    zeros = vary((jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)), refs)
    return lax.cond(masked_out(row0, col0, options), lambda: zeros, compute)


def _const(value: float, like: Array) -> Array:
    return jnp.asarray(value, like.dtype)
