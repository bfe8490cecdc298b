"""A traced function run on each device's blocks, its sums over split dimensions canonical.

A value of the evaluation is this device's block of a whole value and, per
dimension, the mesh axes it is split over (:class:`V`). The names are what
matter, not the axes' sizes: a dimension named ``model`` is treated the same on
a mesh whose ``model`` axis has 1, 2, 4 or 8 devices. Every decision of the
rewrite depends on the names and on the canonical block counts only, so every
layout runs the same computation, cut differently over the devices:

* elementwise ops, ``broadcast_in_dim``, ``transpose``, ``squeeze``,
  ``expand_dims``, ``convert_element_type`` and a ``reshape`` that keeps the
  canonical blocks of a split dimension whole run on the blocks (a whole operand
  is sliced to the device's block: exact);
* a **sum over a split dimension** (``reduce_sum``, a ``dot_general`` contracting
  it) is computed as that dimension's canonical blocks (:func:`block_count`:
  ``blocks`` of them, fewer when its size has fewer factors of two), each block's
  partial an op of the same shape on every layout, the partials added in the
  canonical tree over the block index (the device's own blocks first, an aligned
  subtree, then the devices' partials all-gathered and added in the same tree:
  :func:`unsplit._src.bitwise.blocked.moves.fixed_sum`). A split that does not
  divide a dimension's block count is refused (:class:`BlockError`);
* ``reduce_max`` / ``reduce_min`` (and ``and`` / ``or``) over a split dimension take
  ``pmax`` / ``pmin`` (exact in any order);
* ``jit``, ``custom_jvp`` and ``custom_vjp`` bodies are evaluated inline, ``cond``,
  ``while`` and ``scan`` bodies through the same rewrite, a ``remat`` body under
  ``jax.checkpoint`` with its policy;
* any other equation with a split operand runs on **whole** operands (all-gathered:
  exact data movement), its outputs whole on every device: the same computation at
  every degree, at the cost of that op's memory split. :attr:`Rewrite.gathered`
  records each such equation (inspection, tests); a caller that must not gather
  (the optimizer update) sets ``gather_unsupported=False`` and gets
  :class:`Unsupported` instead.

Example:
    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from jax.sharding import PartitionSpec as P
    >>> from unsplit._src.bitwise.blocked import rewrite
    >>> x = jnp.arange(16.0) / 7
    >>> sums = []
    >>> for m in (2, 4, 8):
    ...     gmesh = jax.make_mesh((m,), ("model",), devices=jax.devices()[:m],
    ...                           axis_types=(jax.sharding.AxisType.Auto,))
    ...     f = rewrite.program(lambda x: (jnp.sum(x * x),), gmesh, (x,), (P("model"),), (P(),))
    ...     sums.append(np.asarray(f(x)[0]))
    >>> bool(sums[0] == sums[1] == sums[2])
    True
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core
from jax.sharding import PartitionSpec as P

from unsplit._src import partition
from unsplit._src.bitwise.blocked import control, moves, rules
from unsplit._src.bitwise.blocked.values import (
    DEFAULT_BLOCKS,
    BlockError,
    Dims,
    Unsupported,
    V,
    block_count,
    dims_of,
    replicated,
)
from unsplit._src.step import dot_transposes, jaxpr_eval

__all__ = ["BlockError", "Rewrite", "Unsupported", "V", "dims_of", "program", "replicated"]

# Primitives whose output element i reads only the operands' elements i.
_ELEMENTWISE_NAMES = """abs acos acosh add add_any and asin asinh atan atan2 atanh cbrt ceil clamp
    conj convert_element_type copy copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1
    floor ge gt imag integer_pow is_finite le lgamma log log1p logistic lt max min mul ne neg
    nextafter not or population_count pow real reduce_precision rem round rsqrt select_n
    shift_left shift_right_arithmetic shift_right_logical sign sin sinh sqrt square stop_gradient
    sub tan tanh xor"""
_ELEMENTWISE = frozenset(_ELEMENTWISE_NAMES.split())
_INLINED = frozenset(
    {"jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
     "custom_vjp_call_jaxpr"}
)  # fmt: skip


_ANNOTATIONS = frozenset({"sharding_constraint", "reshard", "mesh_cast"})


def _plain_literal(value: Any) -> Any:
    """A literal's value without the mesh its type was traced on (a plain NumPy array)."""
    return np.asarray(value).view(np.ndarray) if isinstance(value, np.ndarray) else value


def program(
    fn,
    gmesh: jax.sharding.Mesh,
    args: Sequence,
    in_specs: Sequence,
    out_specs: Any,
    *,
    blocks: int = DEFAULT_BLOCKS,
    gather_unsupported: bool = True,
    compiler_options: dict | None = None,
    wrap: Any = None,
    mesh: jax.sharding.Mesh | None = None,
    out_shardings: Any = None,
):
    """``jax.jit`` of ``fn`` run manual over ``gmesh`` with the canonical-block rewrite.

    ``args`` are ``fn``'s arguments (arrays or shape-dtype structs: the whole
    shapes), ``in_specs`` and ``out_specs`` trees of specs over ``gmesh``'s axes,
    shaped like ``args`` and ``fn``'s outputs; ``compiler_options`` go to ``jax.jit``;
    ``wrap`` (optional) transforms the rewritten ``shard_map`` before it is jitted.
    ``mesh`` (optional): a larger mesh holding ``gmesh``'s axes (same sizes) and others,
    over which the program runs manual instead: each group of devices along ``gmesh``'s
    axes computes ``fn`` on its own blocks (the inputs replicated over the other axes), in
    one program for every group. ``out_shardings`` (optional) go to ``jax.jit``.
    """
    if mesh is not None and any(mesh.shape.get(a) != n for a, n in gmesh.shape.items()):
        raise ValueError(f"mesh {dict(mesh.shape)} does not hold gmesh's axes {dict(gmesh.shape)}")
    local, mapped_specs, unflatten = manual(
        fn, gmesh, args, in_specs, out_specs, blocks=blocks, gather_unsupported=gather_unsupported
    )
    ins, outs = mapped_specs
    mapped = jax.shard_map(
        local, mesh=mesh or gmesh, in_specs=tuple(ins), out_specs=list(outs), check_vma=False
    )
    if wrap is not None:
        mapped = wrap(mapped)
    jit_options = {} if out_shardings is None else {"out_shardings": out_shardings}
    run = jax.jit(
        lambda *trees: unflatten(mapped(*jax.tree.leaves(trees))),
        compiler_options=compiler_options,
        **jit_options,
    )
    run.trace(*args)  # raises Unsupported / BlockError now, not on the first call
    return run


def manual(fn, gmesh, args, in_specs, out_specs, *, blocks=DEFAULT_BLOCKS, gather_unsupported=True):
    """``fn``'s per-device function for a ``shard_map`` over ``gmesh``: ``(local, (in
    specs, out specs), unflatten)``; ``local`` takes and returns flat lists of blocks."""
    whole = [jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in jax.tree.leaves(args)]
    closed, shapes = jax.make_jaxpr(
        lambda *leaves: fn(*jax.tree.unflatten(jax.tree.structure(args), leaves)),
        return_shape=True,
    )(*whole)
    ins = _broadcast(tuple(in_specs), tuple(args))
    outs = _broadcast(out_specs, shapes)

    def local(*leaves):
        rewrite = Rewrite(gmesh, blocks, gather_unsupported=gather_unsupported)
        vals = [V(x, dims_of(s, np.ndim(x))) for x, s in zip(leaves, ins, strict=True)]
        got = rewrite.run(closed.jaxpr, closed.consts, vals)
        return [rewrite.to_dims(v, dims_of(s, len(v.dims))) for v, s in zip(got, outs, strict=True)]

    return local, (ins, outs), jax.tree.structure(shapes).unflatten


def explicit_sums(fn):
    """``fn`` with every float ``reduce_sum`` in it a fixed tree of adds (no split dims: the
    rewrite with no mesh axes), traced once per call's input types.

    XLA emits a ``reduce`` fused with its neighbours, and the order of its adds follows
    them: the same rows computed next to other computations (an FSDP group of 2 devices
    computes 4 row blocks one after the other, one of 8 devices one) gave other bits.
    """

    def wrapped(*args):
        closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
        rw = Rewrite(None, DEFAULT_BLOCKS)
        vals = [replicated(x) for x in jax.tree.leaves(args)]
        out = [v.value for v in rw.run(closed.jaxpr, closed.consts, vals)]
        return jax.tree.unflatten(jax.tree.structure(shapes), out)

    return wrapped


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)


def _broadcast(specs: Any, tree: Any) -> list[P]:
    """One spec per leaf of ``tree`` from ``specs``, a tree prefix of it."""
    per = jax.tree.map(
        lambda s, sub: _Each(s, len(jax.tree.leaves(sub))), specs, tree, is_leaf=_is_spec
    )
    # Not lists of specs: a list in the user's tree (params as a list of arrays) would be
    # taken for one.
    return [s for each in jax.tree.leaves(per) for s in [each.spec] * each.count]


class _Each:
    """A spec for each of ``count`` leaves (a leaf of the tree of them)."""

    def __init__(self, spec: P, count: int):
        self.spec, self.count = spec, count


def _as_int(collective, x, axes: tuple[str, ...]) -> Any:
    """A boolean (or integer) reduction across ``axes`` done on int32 values."""
    return collective(x.astype(np.int32), axes).astype(x.dtype)


def _add(a, b):
    return a + b


class Rewrite:
    """Per-equation rules on a mesh's blocks (see the module docstring)."""

    def __init__(
        self, gmesh: jax.sharding.Mesh | None, blocks: int, *, gather_unsupported: bool = True
    ):
        self.gmesh = gmesh
        self.axes = tuple(gmesh.axis_names) if gmesh is not None else ()
        self.blocks = blocks
        self.gather_unsupported = gather_unsupported
        self.gathered: list[str] = []  # the equations run on whole operands, by primitive

    def size(self, axes: tuple[str, ...]) -> int:
        if not axes:
            return 1
        assert self.gmesh is not None  # named axes come from a mesh
        return math.prod(self.gmesh.shape[a] for a in axes)

    def run(self, jaxpr: core.Jaxpr, consts: Sequence, vals: Sequence[V]) -> list[V]:
        rewrite = dot_transposes.folded(jaxpr, self.equation)
        out = jaxpr_eval.evaluate(
            jaxpr, [replicated(c) for c in consts], vals, rewrite, literal=_plain_literal
        )
        return [v if isinstance(v, V) else replicated(v) for v in out]  # a literal output too

    def equation(self, eqn: core.JaxprEqn, invals: list) -> Any:
        vals = [v if isinstance(v, V) else replicated(v) for v in invals]
        name = eqn.primitive.name
        split = any(any(v.dims) for v in vals)
        if name in _INLINED:
            body = next(
                eqn.params[k] for k in ("jaxpr", "call_jaxpr", "fun_jaxpr") if k in eqn.params
            )
            if isinstance(body, core.ClosedJaxpr):
                return self.run(body.jaxpr, body.consts, vals)
            return self.run(body, (), vals)
        if name in _ANNOTATIONS:  # always: they name the split dims of activations
            return self.annotated(eqn, vals[0])
        if name in control.RULES:  # always: the sums inside are the rewrite's too
            rule = control.RULES[name]
        elif name == "reduce_sum" and not split:
            return replicated(rules.summed(self, eqn, vals[0].value))
        elif not split:  # every device holds the same whole values
            return self.plain(eqn, vals)
        elif name in _ELEMENTWISE:
            return rules.elementwise(self, eqn, vals)
        else:
            rule = rules.RULES.get(name)
        try:
            if rule is None:
                raise Unsupported(f"{name} on a split dimension")
            return rule(self, eqn, vals)
        except Unsupported:
            if not self.gather_unsupported:
                raise
        self.gathered.append(name)
        whole = [V(self.to_dims(v, ((),) * len(v.dims)), ((),) * len(v.dims)) for v in vals]
        if name in control.RULES:
            return control.RULES[name](self, eqn, whole)
        return self.plain(eqn, whole)

    def bind(self, eqn, values: Sequence, params: dict | None = None) -> Any:
        """``eqn``'s primitive on local values: its params' shardings dropped (the values are
        one device's blocks inside the manual region, not arrays on a mesh)."""
        params = dict(eqn.params if params is None else params)
        for k in ("sharding", "out_sharding"):
            if params.get(k) is not None:
                params[k] = None
        return jaxpr_eval.bind(eqn, values, params)

    def annotated(self, eqn, x: V) -> V:
        """A sharding annotation of the loss: the value split as it says over this mesh's
        axes (exact), its other axes dropped (data parallel here)."""
        sharding = eqn.params.get("sharding", eqn.params.get("dst_sharding"))
        spec = getattr(sharding, "spec", sharding)
        if spec is None:
            return x
        entries = (*spec, *([None] * (len(x.dims) - len(spec))))
        dims = tuple(
            d if e is P.UNCONSTRAINED else tuple(n for n in partition.names(e) if n in self.axes)
            for e, d in zip(entries, x.dims, strict=True)
        )
        return V(self.to_dims(x, dims), dims)

    def plain(self, eqn, vals: list[V]) -> Any:
        out = self.bind(eqn, [v.value for v in vals])
        if eqn.primitive.multiple_results:
            return [replicated(o) for o in out]
        return replicated(out)

    def whole_shape(self, v: V) -> tuple[int, ...]:
        return tuple(n * self.size(d) for n, d in zip(np.shape(v.value), v.dims, strict=True))

    def to_dims(self, v: V, dims: Dims) -> Any:
        """``v``'s blocks split as ``dims`` says (exact: all-gathers and slices)."""
        if v.dims == dims:
            return v.value
        shape = self.whole_shape(v)
        moved = list(zip(v.dims, dims, strict=True))
        gather = P(*(partition.entry(d) if d != t else None for d, t in moved))
        x = moves.gather(v.value, gather, self.axes)
        cut = P(*(partition.entry(t) if d != t else None for d, t in moved))
        block = tuple(n // self.size(t) for n, t in zip(shape, dims, strict=True))
        assert self.gmesh is not None  # a split to change: named axes come from a mesh
        return moves.block_of(x, cut, block, self.gmesh.shape, lambda n: None, self.axes)

    def local_blocks(self, size: int, axes: tuple[str, ...]) -> int:
        """How many of a dimension's canonical blocks (whole ``size``, split over ``axes``)
        each device holds; refuses a split that does not divide them."""
        count, devices = block_count(size, self.blocks), self.size(axes)
        if count % devices:
            raise BlockError(
                f"a dimension of size {size} split over {axes} ({devices} devices) has "
                f"{count} canonical block(s) of two elements or more (blocks={self.blocks}), "
                f"which {devices} devices cannot share: its sums would depend on the degree. "
                f"Fix: a degree of at most {count} for this dimension (a power of two), a "
                f"larger dimension (at least {2 * devices} elements), or blocks="
                f"{max(devices, self.blocks)} if the dimension allows it."
            )
        return count // devices

    def tree_sum(self, x: Any, dim: int, axes: tuple[str, ...]) -> Any:
        """``x``'s local canonical blocks along ``dim`` added in the canonical tree, then the
        devices' partials over ``axes`` in the same tree (:func:`moves.pairwise_sum`)."""
        x = jax.numpy.moveaxis(x, dim, 0)
        local = moves.fixed_sum(x, _add)
        if self.size(axes) == 1:
            return local
        # Exchanged flat: a 1-D collective puts no layout constraint on the values around it
        # (a gathered N-D value got another layout than the one-device program's, and with
        # it other simplifications of the ops next to it).
        total = moves.pairwise_sum(local.reshape(-1), axes, self.size(axes))
        return total.reshape(local.shape)
