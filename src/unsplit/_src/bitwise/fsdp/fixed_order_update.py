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
jaxpr is evaluated on each device's blocks by :mod:`~unsplit._src.step.jaxpr_eval`
with a rewrite that tracks which dimensions of every value are split over which
group axes:

* elementwise ops, ``broadcast_in_dim``, ``transpose``, ``squeeze`` and a
  ``reshape`` that keeps each split dimension in whole blocks run on the blocks
  (a replicated operand is sliced to the device's block: exact);
* a ``reduce_sum`` or a ``dot_general`` contracting a split dimension computes
  the device's partial, all-gathers the group's partials and adds them in the
  canonical tree over the device index
  (:func:`unsplit._src.bitwise.group_reduce.fixed_sum`); ``reduce_max`` and
  ``reduce_min`` (and ``reduce_and`` / ``reduce_or``) take ``pmax`` / ``pmin`` (exact in
  any order);
* ``jit``, ``custom_jvp`` and ``custom_vjp`` bodies are evaluated inline, ``cond``
  and ``while`` bodies through the same rewrite;
* an equation whose operands are all replicated runs as it is.

Any other equation on a split dimension (a slice, gather, sort, cumsum or
concatenation along it, a reshape that mixes its blocks) raises
:class:`Unsupported`: the caller then runs the whole update as XLA partitions
it (never silently another result).

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> gmesh = jax.make_mesh((4,), ("fsdp",))
    >>> x = jax.device_put(jnp.arange(8.0), NamedSharding(gmesh, P("fsdp")))
    >>> norm = program(lambda x: (x / jnp.sqrt(jnp.sum(x * x)),), gmesh, (x,), (P("fsdp"),),
    ...                (P("fsdp"),))
    >>> round(float(jnp.sum(norm(x)[0] ** 2)), 5)
    1.0
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.extend import core
from jax.sharding import PartitionSpec as P

from unsplit._src import partition
from unsplit._src.bitwise.fsdp import group_reduce
from unsplit._src.step import jaxpr_eval

Dims = tuple[tuple[str, ...], ...]  # per dimension: the group axes it is split over

# Primitives whose output element i reads only the operands' elements i.
_ELEMENTWISE_NAMES = """abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp conj
    convert_element_type copy copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1 floor ge gt imag
    integer_pow is_finite le lgamma log log1p logistic lt max min mul ne neg nextafter not or
    population_count pow real reduce_precision rem round rsqrt select_n shift_left
    shift_right_arithmetic shift_right_logical sign sin sinh sqrt square sub tan tanh xor"""
_ELEMENTWISE = frozenset(_ELEMENTWISE_NAMES.split())
_INLINED = frozenset({"jit", "pjit", "closed_call", "custom_jvp_call", "custom_vjp_call"})


class Unsupported(Exception):
    """An equation the rewrite does not run on split dimensions (the message says which)."""


class V(NamedTuple):
    """A value of the evaluation: this device's block and how its dimensions are split."""

    value: Any
    dims: Dims


def replicated(x: Any) -> V:
    return V(x, ((),) * np.ndim(x))


def dims_of(spec: P, ndim: int) -> Dims:
    """A leaf's split dimensions from its spec (over the group axes only)."""
    entries = (*spec, *([None] * (ndim - len(spec))))
    return tuple(partition.names(e) for e in entries)


def program(fn, gmesh: jax.sharding.Mesh, args: Sequence, in_specs: Sequence, out_specs: Any):
    """``jax.jit`` of ``fn`` run manual over ``gmesh`` with the fixed-order rewrite.

    ``args`` are ``fn``'s arguments (arrays or shape-dtype structs: the whole
    shapes), ``in_specs`` and ``out_specs`` trees of specs over the group axes,
    shaped like ``args`` and ``fn``'s outputs. Raises :class:`Unsupported` when
    ``fn`` holds an equation the rewrite cannot run on the blocks.
    """
    whole = [jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in jax.tree.leaves(args)]
    closed, shapes = jax.make_jaxpr(
        lambda *leaves: fn(*jax.tree.unflatten(jax.tree.structure(args), leaves)),
        return_shape=True,
    )(*whole)
    ins = jax.tree.leaves(tuple(in_specs), is_leaf=_is_spec)
    outs = jax.tree.leaves(out_specs, is_leaf=_is_spec)
    rewrite = _Rewrite(gmesh)

    def local(*leaves):
        vals = [V(x, dims_of(s, np.ndim(x))) for x, s in zip(leaves, ins, strict=True)]
        got = rewrite.run(closed.jaxpr, closed.consts, vals)
        return [rewrite.to_dims(v, dims_of(s, len(v.dims))) for v, s in zip(got, outs, strict=True)]

    mapped = jax.shard_map(
        local, mesh=gmesh, in_specs=tuple(ins), out_specs=list(outs), check_vma=False
    )
    unflatten = jax.tree.structure(shapes).unflatten
    run = jax.jit(lambda *trees: unflatten(mapped(*jax.tree.leaves(trees))))
    run.trace(*args)  # raises Unsupported now, not on the first call
    return run


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)


def _as_int(collective, x, axes: set[str]) -> Any:
    """A boolean (or integer) reduction across ``axes`` done on int32 values."""
    return collective(x.astype(np.int32), tuple(sorted(axes))).astype(x.dtype)


# Long: one rule per kind of equation, all over the same per-value dims.
class _Rewrite:
    """Per-equation rules on a group mesh's blocks (see the module docstring)."""

    def __init__(self, gmesh: jax.sharding.Mesh):
        self.gmesh = gmesh
        self.axes = tuple(gmesh.axis_names)

    def size(self, axes: tuple[str, ...]) -> int:
        return math.prod(self.gmesh.shape[a] for a in axes)

    def run(self, jaxpr: core.Jaxpr, consts: Sequence, vals: Sequence[V]) -> list[V]:
        out = jaxpr_eval.evaluate(jaxpr, [replicated(c) for c in consts], vals, self.equation)
        return [v if isinstance(v, V) else replicated(v) for v in out]  # a literal output too

    def equation(self, eqn: core.JaxprEqn, invals: list) -> Any:
        vals = [v if isinstance(v, V) else replicated(v) for v in invals]
        name = eqn.primitive.name
        if not any(any(v.dims) for v in vals):  # every device holds the same whole values
            out = jaxpr_eval.bind(eqn, [v.value for v in vals])
            return (
                [replicated(o) for o in out] if eqn.primitive.multiple_results else replicated(out)
            )
        if name in _INLINED:
            body = next(
                eqn.params[k] for k in ("jaxpr", "call_jaxpr", "fun_jaxpr") if k in eqn.params
            )
            if isinstance(body, core.ClosedJaxpr):
                return self.run(body.jaxpr, body.consts, vals)
            return self.run(body, (), vals)
        if name in _ELEMENTWISE:
            return self._elementwise(eqn, vals)
        rules = {
            "broadcast_in_dim": self._broadcast_in_dim,
            "transpose": self._transpose,
            "squeeze": self._squeeze,
            "reshape": self._reshape,
            "reduce_sum": self._reduce_sum,
            "reduce_max": self._reduce_max,
            "reduce_min": self._reduce_min,
            "reduce_and": self._reduce_and,
            "reduce_or": self._reduce_or,
            "dot_general": self._dot_general,
            "cond": self._cond,
            "while": self._while,
        }
        if name not in rules:
            raise Unsupported(f"{name} on a dimension split over the group")
        return rules[name](eqn, vals)

    def whole_shape(self, v: V) -> tuple[int, ...]:
        return tuple(n * self.size(d) for n, d in zip(np.shape(v.value), v.dims, strict=True))

    def to_dims(self, v: V, dims: Dims) -> Any:
        """``v``'s blocks split as ``dims`` says (exact: all-gathers and slices)."""
        if v.dims == dims:
            return v.value
        shape = self.whole_shape(v)
        moved = list(zip(v.dims, dims, strict=True))
        gather = P(*(partition.entry(d) if d != t else None for d, t in moved))
        x = group_reduce.gather(v.value, gather, self.axes)
        cut = P(*(partition.entry(t) if d != t else None for d, t in moved))
        block = tuple(n // self.size(t) for n, t in zip(shape, dims, strict=True))
        return group_reduce.block_of(x, cut, block, self.gmesh.shape, lambda n: None, self.axes)

    def fixed_sum(self, x: Any, axes: set[str]) -> Any:
        """The group's partials ``x`` added in the canonical tree over the device index."""
        order = tuple(a for a in self.axes if a in axes)
        rows = jax.lax.all_gather(x, partition.entry(order), axis=0)
        return group_reduce.fixed_sum(rows, lambda a, b: a + b)

    def _elementwise(self, eqn, vals: list[V]) -> Any:
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
            sizes = zip(dims, self.whole_shape(v), strict=True)
            return self.to_dims(v, tuple(t if n != 1 else () for t, n in sizes))

        args = [fit(v) if v.dims else v.value for v in vals]
        out = jaxpr_eval.bind(eqn, args)
        return [V(o, dims) for o in out] if eqn.primitive.multiple_results else V(out, dims)

    def _broadcast_in_dim(self, eqn, vals):
        (x, *rest) = vals
        if rest:
            raise Unsupported("broadcast_in_dim with dynamic shapes")
        shape, where = eqn.params["shape"], eqn.params["broadcast_dimensions"]
        dims = [()] * len(shape)
        for i, d in enumerate(where):
            dims[d] = x.dims[i]
        local = tuple(n // self.size(d) for n, d in zip(shape, dims, strict=True))
        params = {**eqn.params, "shape": local, "sharding": None}
        return V(jaxpr_eval.bind(eqn, [x.value], params), tuple(dims))

    def _transpose(self, eqn, vals):
        (x,) = vals
        dims = tuple(x.dims[p] for p in eqn.params["permutation"])
        return V(jaxpr_eval.bind(eqn, [x.value]), dims)

    def _squeeze(self, eqn, vals):
        (x,) = vals
        gone = set(eqn.params["dimensions"])
        dims = tuple(d for k, d in enumerate(x.dims) if k not in gone)
        return V(jaxpr_eval.bind(eqn, [x.value]), dims)

    def _reshape(self, eqn, vals):
        """A reshape that keeps the split dimension's blocks whole: the output dim whose suffix
        product equals the split dim's takes its split (it must divide by the group)."""
        (x,) = vals
        old, new = eqn.invars[0].aval.shape, tuple(eqn.params["new_sizes"])
        split = [k for k, d in enumerate(x.dims) if d]
        if eqn.params.get("dimensions") is not None or len(split) != 1:
            raise Unsupported("reshape of several split dimensions or with a permutation")
        (k,) = split
        axes, suffix = x.dims[k], math.prod(old[k:])
        to = [m for m in range(len(new)) if math.prod(new[m:]) == suffix and new[m] > 1]
        if not to or new[to[0]] % self.size(axes):
            raise Unsupported(f"reshape {old} -> {new} mixes the blocks of a split dimension")
        dims = tuple(axes if m == to[0] else () for m in range(len(new)))
        local = tuple(n // self.size(d) for n, d in zip(new, dims, strict=True))
        params = {**eqn.params, "new_sizes": local, "sharding": None}
        return V(jaxpr_eval.bind(eqn, [x.value], params), dims)

    def _reduce(self, eqn, vals, across):
        (x,) = vals
        reduced = set(eqn.params["axes"])
        params = {**eqn.params, **({"out_sharding": None} if "out_sharding" in eqn.params else {})}
        out = jaxpr_eval.bind(eqn, [x.value], params)
        dims = tuple(d for k, d in enumerate(x.dims) if k not in reduced)
        axes = {a for k in reduced for a in x.dims[k]}
        return V(across(out, axes) if axes else out, dims)

    def _reduce_sum(self, eqn, vals):
        return self._reduce(eqn, vals, self.fixed_sum)

    def _reduce_max(self, eqn, vals):
        return self._reduce(eqn, vals, lambda x, axes: jax.lax.pmax(x, tuple(sorted(axes))))

    def _reduce_min(self, eqn, vals):
        return self._reduce(eqn, vals, lambda x, axes: jax.lax.pmin(x, tuple(sorted(axes))))

    def _reduce_and(self, eqn, vals):  # exact: all devices' booleans, as 0/1, by pmin
        return self._reduce(eqn, vals, lambda x, axes: _as_int(jax.lax.pmin, x, axes))

    def _reduce_or(self, eqn, vals):
        return self._reduce(eqn, vals, lambda x, axes: _as_int(jax.lax.pmax, x, axes))

    def _dot_general(self, eqn, vals):
        lhs, rhs = vals
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        ldims, rdims = list(lhs.dims), list(rhs.dims)
        for i, j in (*zip(lc, rc, strict=True), *zip(lb, rb, strict=True)):
            if ldims[i] and rdims[j] and ldims[i] != rdims[j]:
                raise Unsupported("dot_general of dimensions split over other axes")
            ldims[i] = rdims[j] = ldims[i] or rdims[j]
        for dims in (ldims, rdims):  # a free dim and a contracted one split over one axis
            named = [a for d in dims for a in d]
            if len(named) != len(set(named)):
                raise Unsupported("dot_general with two dimensions split over one axis")
        args = [self.to_dims(lhs, tuple(ldims)), self.to_dims(rhs, tuple(rdims))]
        out = jaxpr_eval.bind(eqn, args, {**eqn.params, "out_sharding": None})
        lfree = [d for k, d in enumerate(ldims) if k not in (*lc, *lb)]
        rfree = [d for k, d in enumerate(rdims) if k not in (*rc, *rb)]
        dims = (*(ldims[i] for i in lb), *lfree, *rfree)
        named = [a for d in dims for a in d]
        if len(named) != len(set(named)):
            raise Unsupported("dot_general whose output has two dimensions split over one axis")
        axes = {a for i in lc for a in ldims[i]}
        return V(self.fixed_sum(out, axes) if axes else out, dims)

    def _cond(self, eqn, vals):
        index, *ops = vals
        branches = eqn.params["branches"]
        dims = self._agree([self._out_dims(b.jaxpr, b.consts, ops) for b in branches])
        fns = [self._local_fn(b.jaxpr, b.consts, ops, dims) for b in branches]
        outs = jax.lax.switch(index.value, fns, *[v.value for v in ops])
        return [V(o, d) for o, d in zip(outs, dims, strict=True)]

    def _while(self, eqn, vals):
        p = eqn.params
        cconsts, bconsts = vals[: p["cond_nconsts"]], vals[p["cond_nconsts"] :][: p["body_nconsts"]]
        carry = vals[p["cond_nconsts"] + p["body_nconsts"] :]
        body = p["body_jaxpr"]
        for _ in range(len(carry) + 1):  # split dims only spread: a fixed point comes soon
            dims = [v.dims for v in carry]
            new = self._agree([dims, self._out_dims(body.jaxpr, body.consts, [*bconsts, *carry])])
            if list(new) == dims:
                break
            carry = [V(self.to_dims(v, d), d) for v, d in zip(carry, new, strict=True)]
        cond = p["cond_jaxpr"]
        test = self._local_fn(cond.jaxpr, cond.consts, [*cconsts, *carry], [()], cconsts)
        step = self._local_fn(body.jaxpr, body.consts, [*bconsts, *carry], dims, bconsts)
        out = jax.lax.while_loop(
            lambda c: test(*c)[0], lambda c: step(*c), [v.value for v in carry]
        )
        return [V(o, d) for o, d in zip(out, dims, strict=True)]

    def _out_dims(self, jaxpr, consts, ops: list[V]) -> list[Dims]:
        seen: list[Dims] = []

        def run(*xs):
            got = self.run(jaxpr, consts, [V(x, v.dims) for x, v in zip(xs, ops, strict=True)])
            seen.extend(v.dims for v in got)
            return [v.value for v in got]

        jax.make_jaxpr(run)(*[v.value for v in ops])
        return seen

    def _agree(self, options: list) -> list[Dims]:
        """Per output, the split every option can be brought to (exactly), or Unsupported."""
        out = []
        for per in zip(*options, strict=True):
            split = {d for d in per if any(d)}
            if len(split) > 1:
                raise Unsupported("a loop or branch output split in two ways")
            out.append(split.pop() if split else per[0])
        return out

    def _local_fn(self, jaxpr, consts, ops: list[V], dims, fixed: Sequence[V] = ()):
        """The nested jaxpr as a function of its blocks (``fixed``: leading operands closed
        over), its outputs brought to ``dims``."""

        def fn(*xs):
            got = self.run(
                jaxpr, consts,
                [*fixed, *(V(x, v.dims) for x, v in zip(xs, ops[len(fixed):], strict=True))],
            )  # fmt: skip
            return [self.to_dims(v, d) for v, d in zip(got, dims, strict=True)]

        return fn
