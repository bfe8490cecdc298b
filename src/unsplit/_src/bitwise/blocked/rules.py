"""The canonical-block rewrite's rules, one per kind of equation, over :class:`V` values.

Each rule takes the :class:`~unsplit._src.bitwise.blocked.rewrite.Rewrite`, the
equation and its operands, and returns the outputs (or raises ``Unsupported``:
the rewrite then runs the equation on whole operands). See the rewrite's module
docstring for what each does.
"""

from __future__ import annotations

import itertools
import math
import operator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from unsplit._src.bitwise.blocked import moves
from unsplit._src.bitwise.blocked.values import Dims, Unsupported, V, block_count
from unsplit._src.step import dot_transposes


def elementwise(rw, eqn, vals: list[V]) -> Any:
    ranked = [v for v in vals if v.dims]  # a rank-0 operand (select_n's, clamp's) as it is
    split: list[tuple[str, ...]] = []
    for k in range(len(ranked[0].dims)):  # each dim split as the first operand splits it,
        used = {a for d in split for a in d}  # unless an earlier dim took one of its axes
        split.append(
            next((v.dims[k] for v in ranked if v.dims[k] and not used & set(v.dims[k])), ())
        )
    dims: Dims = tuple(split)

    # An operand's size-1 dimension broadcasts (lax allows it): it stays whole.
    def fit(v: V) -> Any:
        sizes = zip(dims, rw.whole_shape(v), strict=True)
        return rw.to_dims(v, tuple(t if n != 1 else () for t, n in sizes))

    args = [fit(v) if v.dims else v.value for v in vals]
    out = rw.bind(eqn, args)
    return [V(o, dims) for o in out] if eqn.primitive.multiple_results else V(out, dims)


def _local_shape(rw, shape, dims: Dims) -> tuple[int, ...]:
    return tuple(n // rw.size(d) for n, d in zip(shape, dims, strict=True))


def broadcast_in_dim(rw, eqn, vals):
    (x, *rest) = vals
    if rest:
        raise Unsupported("broadcast_in_dim with dynamic shapes")
    shape, where = eqn.params["shape"], eqn.params["broadcast_dimensions"]
    dims: list[tuple[str, ...]] = [()] * len(shape)
    for i, d in enumerate(where):
        dims[d] = x.dims[i] if np.shape(x.value)[i] * rw.size(x.dims[i]) == shape[d] else ()
    value = rw.to_dims(x, tuple(dims[d] for d in where))
    params = {**eqn.params, "shape": _local_shape(rw, shape, tuple(dims)), "sharding": None}
    return V(rw.bind(eqn, [value], params), tuple(dims))


def transpose(rw, eqn, vals):
    (x,) = vals
    dims = tuple(x.dims[p] for p in eqn.params["permutation"])
    return V(rw.bind(eqn, [x.value]), dims)


def squeeze(rw, eqn, vals):
    (x,) = vals
    gone = set(eqn.params["dimensions"])
    dims = tuple(d for k, d in enumerate(x.dims) if k not in gone)
    return V(rw.bind(eqn, [x.value]), dims)


def reshape(rw, eqn, vals):
    """A reshape that keeps each split dimension's canonical blocks whole: the output dim
    whose suffix product equals the split dim's takes its split (its size must be a
    multiple of the input dim's block count, so each block stays contiguous)."""
    (x,) = vals
    old, new = eqn.invars[0].aval.shape, tuple(eqn.params["new_sizes"])
    if eqn.params.get("dimensions") is not None:
        raise Unsupported("reshape with a permutation")
    dims: list[tuple[str, ...]] = [()] * len(new)
    for k, axes in enumerate(x.dims):
        if not axes:
            continue
        suffix, inner = math.prod(old[k:]), math.prod(old[k + 1 :])
        to = [m for m in range(len(new)) if math.prod(new[m:]) == suffix and new[m] > 1]
        # Decided on the block count, never on the axes' sizes: every degree reshapes alike.
        count = block_count(old[k], rw.blocks)
        # Each canonical block of the dimension (its elements, contiguous) must be whole rows
        # of the output dimension that takes the split.
        row = math.prod(new[to[0] + 1 :]) if to else 1
        if not to or (old[k] // count * inner) % row or new[to[0]] % count or dims[to[0]]:
            raise Unsupported(f"reshape {old} -> {new} mixes the blocks of a split dimension")
        rw.local_blocks(old[k], axes)  # the split must divide the blocks
        dims[to[0]] = axes
    params = {**eqn.params, "new_sizes": _local_shape(rw, new, tuple(dims)), "sharding": None}
    return V(rw.bind(eqn, [x.value], params), tuple(dims))


class Named(NamedTuple):
    """A split dimension of an op's operands: where it is, its blocks, what becomes of it."""

    lhs: int | None  # its index in the (first) operand, or None
    rhs: int | None  # its index in the second operand (a dot's), or None
    axes: tuple[str, ...]
    count: int  # this device's canonical blocks
    size: int  # one block's size
    out: int | None  # its index in the output, or None where the op sums over it


def _blocks(rw, named: list[Named], operands: list[Any], op) -> Any:
    """``op`` on each of this device's canonical blocks (one op of the block's shape per
    block, fenced by ``optimization_barrier`` so XLA neither merges nor refuses them), the
    blocks of summed dimensions added in the canonical tree (the device's own blocks, then
    across the devices), the others put back in place."""
    results = []
    for idx in itertools.product(*(range(n.count) for n in named)):
        parts = list(operands)
        for n, i in zip(named, idx, strict=True):
            for side, dim in enumerate((n.lhs, n.rhs)):
                if dim is not None:
                    lo = i * n.size
                    parts[side] = jax.lax.slice_in_dim(parts[side], lo, lo + n.size, axis=dim)
        parts = jax.lax.optimization_barrier(parts)
        results.append(jax.lax.optimization_barrier(op(*parts)))
    out = jnp.stack(results).reshape(*(n.count for n in named), *results[0].shape)
    lead = list(named)
    for k in reversed(range(len(lead))):  # sums: the innermost first
        if lead[k].out is None:
            out = rw.tree_sum(out, k, lead[k].axes)
            del lead[k]
    for k in reversed(range(len(lead))):  # kept: each blocks dim back beside its dimension
        out_dim = lead[k].out
        assert out_dim is not None  # the summed ones are gone
        pos = len(lead) - 1 + out_dim  # the block's dim, counted with the leading ones
        out = jnp.moveaxis(out, k, pos)
        shape = list(out.shape)
        out = out.reshape(*shape[:pos], shape[pos] * shape[pos + 1], *shape[pos + 2 :])
        del lead[k]
    # Fenced: the ops around it fuse alike at every degree (measured: a LayerNorm's sum fused
    # with the tree's adds at one degree and with a gather's at another gave other bits).
    return jax.lax.optimization_barrier(out)


def _no_out_sharding(params: dict) -> dict:
    return {**params, "out_sharding": None} if "out_sharding" in params else dict(params)


def tree_reduce(x: Any, axes) -> Any:
    """``jnp.sum(x, axes)`` as a fixed tree of elementwise adds (halves added, zero-padded to
    a power of two), never XLA's ``reduce``: XLA emits a reduce fused with its neighbours,
    and the order of its adds depends on them (measured on CPU: a LayerNorm's sum gave
    other bits at another tensor-parallel degree, its producers being other ops). The
    sum within one canonical block; :func:`canonical_sum` adds blocks."""
    for a in sorted(axes, reverse=True):
        n = x.shape[a]
        size = 1 << max(n - 1, 0).bit_length()
        if size != n:
            x = jnp.pad(x, [(0, size - n) if k == a else (0, 0) for k in range(x.ndim)])
        while x.shape[a] > 1:
            half = x.shape[a] // 2
            x = jax.lax.slice_in_dim(x, 0, half, axis=a) + jax.lax.slice_in_dim(
                x, half, 2 * half, axis=a
            )
        x = jnp.squeeze(x, a)
    return x


def canonical_sum(x: Any, axes, blocks: int) -> Any:
    """``jnp.sum(x, axes)`` of a whole (unsplit) value as the split value's sum is computed:
    one axis at a time, the innermost first, each as its canonical blocks' sums
    (:func:`tree_reduce`) added in the canonical tree. A dimension split over devices at
    one degree and whole at another (too few elements to split there) so gets the same
    bits: measured, an FSDP group of 8 holding Adafactor's 8-element factor whole summed
    it in another order than groups of 2 and 4 holding it split."""
    for a in sorted(axes, reverse=True):
        n = x.shape[a]
        count = block_count(n, blocks)
        if count == 1:
            x = tree_reduce(x, (a,))
            continue
        x = x.reshape(*x.shape[:a], count, n // count, *x.shape[a + 1 :])
        x = tree_reduce(x, (a + 1,))  # each block's own sum
        x = moves.fixed_sum(jnp.moveaxis(x, a, 0), operator.add)  # the blocks, canonical tree
    return x


def summed(rw, eqn, x: Any) -> Any:
    """A ``reduce_sum`` equation on whole ``x``: a float sum as :func:`canonical_sum`, else
    XLA's."""
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return canonical_sum(x, eqn.params["axes"], rw.blocks).astype(eqn.outvars[0].aval.dtype)
    return rw.bind(eqn, [x], _no_out_sharding(eqn.params))


def reduce_sum(rw, eqn, vals):
    """One reduced axis at a time, the innermost first (the order :func:`canonical_sum`
    takes on a whole value): a split axis per canonical block of it (a reduce of the
    block's shape, :func:`tree_reduce`) with the blocks added in the canonical tree; a
    whole axis as :func:`canonical_sum`. Other split dimensions stay split."""
    (x,) = vals
    if not jnp.issubdtype(x.value.dtype, jnp.inexact):  # exact in any order: one reduce
        return _reduce_axes(rw, eqn, x, tuple(eqn.params["axes"]))
    for a in sorted(eqn.params["axes"], reverse=True):
        x = _reduce_axes(rw, eqn, x, (a,))
    return x


def _reduce_axes(rw, eqn, x: V, axes: tuple[int, ...]) -> V:
    """``x`` summed over ``axes`` (one float axis, or any integer axes)."""
    reduced = set(axes)
    whole = rw.whole_shape(x)
    kept = [k for k in range(len(x.dims)) if k not in reduced]
    named = []
    for k, split in enumerate(x.dims):
        if split:
            count = rw.local_blocks(whole[k], split)
            size = np.shape(x.value)[k] // count
            named.append(Named(k, None, split, count, size, kept.index(k) if k in kept else None))
    whole_axes = tuple(a for a in axes if not x.dims[a])

    def block_sum(b):
        if not jnp.issubdtype(b.dtype, jnp.inexact):
            return rw.bind(eqn, [b], {**_no_out_sharding(eqn.params), "axes": axes})
        if whole_axes:  # the one axis, whole here
            return canonical_sum(b, axes, rw.blocks).astype(eqn.outvars[0].aval.dtype)
        return tree_reduce(b, axes).astype(eqn.outvars[0].aval.dtype)  # one block of it

    out = _blocks(rw, named, [x.value], block_sum)
    return V(out, tuple(x.dims[k] for k in kept))


def _reduce_exact(collective):
    def rule(rw, eqn, vals):
        (x,) = vals
        reduced = set(eqn.params["axes"])
        params = {**eqn.params}
        if "out_sharding" in params:
            params["out_sharding"] = None
        out = rw.bind(eqn, [x.value], params)
        dims = tuple(d for k, d in enumerate(x.dims) if k not in reduced)
        axes = tuple(a for a in rw.axes if any(a in x.dims[k] for k in reduced))
        return V(collective(out, axes) if axes else out, dims)

    return rule


def _pmax(x, axes):
    return jax.lax.pmax(x, axes)


def _pmin(x, axes):
    return jax.lax.pmin(x, axes)


def _as_int(collective):
    return lambda x, axes: collective(x.astype(np.int32), axes).astype(x.dtype)


def _dot_dims(lhs: V, rhs: V, numbers, swapped: bool = False) -> tuple[list, list]:
    """How both operands of a dot are split: a contracted or batch pair alike (the left's
    split, else the right's), and no axis twice in an operand or in the output (a free
    dimension that would repeat one is taken whole: exact). ``swapped``: a dot whose
    operands were swapped (``dot_transposes``) chooses as the original did (the right
    operand first)."""
    (lc, rc), (lb, rb) = numbers
    ldims, rdims = list(lhs.dims), list(rhs.dims)
    for i, j in (*zip(lc, rc, strict=True), *zip(lb, rb, strict=True)):
        ldims[i] = rdims[j] = (rdims[j] or ldims[i]) if swapped else (ldims[i] or rdims[j])
    lfree = [k for k in range(len(ldims)) if k not in (*lc, *lb)]
    rfree = [k for k in range(len(rdims)) if k not in (*rc, *rb)]
    used = {a for k in (*lc, *lb) for a in ldims[k]}
    order = ((rdims, rfree), (ldims, lfree)) if swapped else ((ldims, lfree), (rdims, rfree))
    for dims, free in order:
        for k in free:
            if used & set(dims[k]):
                dims[k] = ()
            used |= set(dims[k])
    return ldims, rdims


def dot_general(rw, eqn, vals):
    """Per canonical block of every split dimension (contracted, batch or free): a dot of
    the block's shape; the blocks of contracted dimensions added in the canonical tree."""
    lhs, rhs = vals
    numbers = eqn.params["dimension_numbers"]
    (lc, rc), (lb, rb) = numbers
    ldims, rdims = _dot_dims(lhs, rhs, numbers, dot_transposes.is_swapped(eqn))
    lx, rx = rw.to_dims(lhs, tuple(ldims)), rw.to_dims(rhs, tuple(rdims))
    lwhole = rw.whole_shape(V(lx, tuple(ldims)))
    rwhole = rw.whole_shape(V(rx, tuple(rdims)))
    lfree = [k for k in range(len(ldims)) if k not in (*lc, *lb)]
    rfree = [k for k in range(len(rdims)) if k not in (*rc, *rb)]
    named = []

    def add(li, ri, axes, whole, local, out):
        count = rw.local_blocks(whole, axes)
        named.append(Named(li, ri, axes, count, local // count, out))

    for i, j in zip(lc, rc, strict=True):
        if ldims[i]:
            add(i, j, ldims[i], lwhole[i], np.shape(lx)[i], None)
    for n, (i, j) in enumerate(zip(lb, rb, strict=True)):
        if ldims[i]:
            add(i, j, ldims[i], lwhole[i], np.shape(lx)[i], n)
    for n, k in enumerate(lfree):
        if ldims[k]:
            add(k, None, ldims[k], lwhole[k], np.shape(lx)[k], len(lb) + n)
    for n, k in enumerate(rfree):
        if rdims[k]:
            add(None, k, rdims[k], rwhole[k], np.shape(rx)[k], len(lb) + len(lfree) + n)
    params = _no_out_sharding(eqn.params)
    out = _blocks(rw, named, [lx, rx], lambda a, b: rw.bind(eqn, [a, b], params))
    dims = (*(ldims[i] for i in lb), *(ldims[k] for k in lfree), *(rdims[k] for k in rfree))
    return V(out, dims)


RULES: dict[str, Any] = {
    "broadcast_in_dim": broadcast_in_dim,
    "transpose": transpose,
    "squeeze": squeeze,
    "reshape": reshape,
    "reduce_sum": reduce_sum,
    "reduce_max": _reduce_exact(_pmax),
    "reduce_min": _reduce_exact(_pmin),
    "reduce_and": _reduce_exact(_as_int(_pmin)),
    "reduce_or": _reduce_exact(_as_int(_pmax)),
    "dot_general": dot_general,
}
