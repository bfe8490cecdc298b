"""Tracing for the audit: abstract inputs, named axes, and inputs at another size.

The audit never runs the user's function: it traces it with
``jax.make_jaxpr`` on ``jax.ShapeDtypeStruct`` s. Array leaves (``jax.Array``,
NumPy arrays, ``ShapeDtypeStruct``, tracers) are traced; every other leaf
(Python numbers, strings, callables) is held static, as ``jit`` with
``static_argnums`` would. A collective over an axis name the trace does not
bind (``pmean(x, 'batch')`` in a per-example loss) is traced by binding that
name with ``axis_env``, so the audit can report it instead of failing.

A batched step keeps its inputs' ``NamedSharding`` s: over a mesh with
``Explicit`` axes (``jax.make_mesh``'s default) the sharding is part of an
array's type, and ``shard_map`` checks its ``in_specs`` against it. When the
inputs share one mesh and no mesh is set, the step is traced under it
(``jax.set_mesh``), as a mesh-less ``shard_map`` needs.
"""

from __future__ import annotations

import collections
import contextlib
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import core as jax_core

from unsplit._src.trees import canonical_dtype

_UNBOUND = re.compile(r"unbound axis name: ([^\s.]+)")
_MAX_AXIS_NAMES = 8


class Leaf(NamedTuple):
    """A traced input leaf: its argument index, path and abstract value."""

    arg: int
    path: str
    aval: jax.ShapeDtypeStruct


class Traced(NamedTuple):
    """A traced function: its closed jaxpr, input leaves, output shapes, static leaves."""

    closed: Any
    leaves: list[Leaf]
    out_shape: Any
    static: tuple[tuple[int, str, Any], ...] = ()  # (argument, path, value) of static arrays


def is_array(x: Any) -> bool:
    return isinstance(
        x, jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct | jax_core.Tracer
    )


def is_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


def abstract(x: Any, *, keep_sharding: bool = False) -> jax.ShapeDtypeStruct:
    """A ``ShapeDtypeStruct`` of an array leaf.

    The sharding is dropped (the audit traces one program) unless
    ``keep_sharding`` and it is a ``NamedSharding``: over ``Explicit`` mesh
    axes it is part of the type that ``shard_map`` checks.
    """
    weak = bool(getattr(getattr(x, "aval", None), "weak_type", False))
    sharding = named_sharding(x) if keep_sharding else None
    return jax.ShapeDtypeStruct(
        np.shape(x), canonical_dtype(x.dtype), weak_type=weak, sharding=sharding
    )


def named_sharding(x: Any) -> jax.sharding.NamedSharding | None:
    """``x``'s ``NamedSharding`` (of a concrete mesh), else ``None``."""
    try:
        sharding = getattr(x, "sharding", None)
    except Exception:  # a tracer of an enclosing trace has no sharding to read
        return None
    if isinstance(sharding, jax.sharding.NamedSharding) and isinstance(
        sharding.mesh, jax.sharding.Mesh
    ):
        return sharding
    return None


def _input_mesh(avals: Sequence[Any]) -> contextlib.AbstractContextManager:
    """``jax.set_mesh`` of the one mesh the inputs are sharded over, when none is set."""
    meshes = {s.mesh for s in map(named_sharding, avals) if s is not None}
    if len(meshes) != 1 or not jax.sharding.get_abstract_mesh().empty:
        return contextlib.nullcontext()
    mesh: Any = meshes.pop()  # a concrete Mesh: the inputs' NamedShardings hold one
    return jax.set_mesh(mesh)


def trace(
    fn: Callable,
    args: Sequence[Any],
    names: Sequence[str] | None = None,
    *,
    numpy_static: bool = False,
    keep_sharding: bool = False,
) -> Traced:
    """Traces ``fn(*args)``; array leaves become inputs, other leaves stay static.

    With ``numpy_static`` NumPy arrays stay concrete too, as they are when a
    Python-level step (one that is not itself jitted) receives them and uses
    NumPy on them; whatever reaches JAX becomes a constant of the jaxpr. With
    ``keep_sharding`` the inputs keep their ``NamedSharding`` s and the trace
    runs under their mesh (see the module docs).

    Raises whatever tracing ``fn`` raises, after retrying with unbound axis
    names bound (size 2).
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(list(args))

    def label(path):
        arg = path[0].idx
        return str(names[arg] if names else f"args[{arg}]") + jax.tree_util.keystr(path[1:])

    def held(leaf):
        return numpy_static and isinstance(leaf, np.ndarray | np.generic)

    dynamic = [i for i, (_, leaf) in enumerate(flat) if is_array(leaf) and not held(leaf)]
    leaves = [
        Leaf(
            flat[i][0][0].idx, label(flat[i][0]), abstract(flat[i][1], keep_sharding=keep_sharding)
        )
        for i in dynamic
    ]
    static = [(p[0].idx, label(p), leaf) for p, leaf in flat if is_array(leaf) and held(leaf)]

    def traced(*values):
        full = [leaf for _, leaf in flat]
        for i, value in zip(dynamic, values, strict=True):
            full[i] = value
        return fn(*jax.tree_util.tree_unflatten(treedef, full))

    avals = [leaf.aval for leaf in leaves]
    mesh = _input_mesh(avals) if keep_sharding else contextlib.nullcontext()
    try:
        with mesh:
            closed, out_shape = make_jaxpr(traced, avals)
    except Exception:
        if isinstance(mesh, contextlib.nullcontext):
            raise
        # A step that brings its own mesh: a jax.pmap (a shard_map over its axis name) given
        # arrays placed by flax.jax_utils.replicate (a mesh of axis '_device_put_sharded'),
        # which refuses the inputs' mesh as the context mesh. Traced without it, as it runs.
        closed, out_shape = make_jaxpr(traced, avals)  # its own error, if it has one
    return Traced(closed, leaves, out_shape, tuple(static))


def make_jaxpr(fn: Callable, avals: Sequence[Any]) -> tuple[Any, Any]:
    """``jax.make_jaxpr(fn, return_shape=True)(*avals)``, binding unbound axis names."""
    axis_env: list[tuple[str, int]] = []
    while True:
        try:
            return jax.make_jaxpr(fn, axis_env=axis_env, return_shape=True)(*avals)
        except NameError as e:
            match = _UNBOUND.search(str(e))
            bound = {name for name, _ in axis_env}
            if match is None or match.group(1) in bound or len(axis_env) >= _MAX_AXIS_NAMES:
                raise
            axis_env.append((match.group(1), 2))


def leading_sizes(tree: Any) -> set[int | None]:
    """The leading-axis sizes of a pytree's array leaves (``None`` for scalars)."""
    return {
        (np.shape(x)[0] if np.ndim(x) else None)
        for x in jax.tree_util.tree_leaves(tree)
        if is_array(x)
    }


def infer_batch_argnums(args: Sequence[Any], axis: int = 0) -> tuple[int, ...]:
    """Which arguments hold the batch: every array leaf has one size ``B`` at ``axis``
    (the leading one; 1 for the arguments a ``jax.pmap`` takes stacked per device).

    Key arguments are never the batch. With several candidates the first
    argument (the params, by convention) is dropped, and the candidates
    sharing the most common size are kept.
    """
    candidates = []
    for i, arg in enumerate(args):
        leaves = [x for x in jax.tree_util.tree_leaves(arg) if is_array(x)]
        if not leaves or any(is_key(x) for x in leaves):
            continue
        sizes = {np.shape(x)[axis] if np.ndim(x) > axis else None for x in leaves}
        if len(sizes) == 1 and None not in sizes:
            candidates.append((i, sizes.pop()))
    if len(candidates) > 1:
        candidates = [(i, b) for i, b in candidates if i != 0]
    if not candidates:
        return ()
    counts = collections.Counter(b for _, b in candidates)
    size = max(counts, key=lambda b: (counts[b], -[c for _, c in candidates].index(b)))
    return tuple(i for i, b in candidates if b == size)


def resize_batch(
    args: Sequence[Any],
    argnums: Sequence[int],
    factor: int,
    stacked: frozenset[str] = frozenset(),
) -> list[Any]:
    """``args`` with the batch arguments' batch axes times ``factor``.

    The batch axis is the leading one, or the second for the leaves named in
    ``stacked`` (labels ``args[i]...`` as :func:`trace` gives them): a
    ``jax.pmap`` ped step takes its batch stacked per device, ``(devices, B,
    ...)``, and a larger batch is a larger batch per device, not more devices.
    NumPy leaves are repeated (they stay concrete); the other array leaves
    become ``ShapeDtypeStruct`` s (keeping a ``NamedSharding``). Per-example
    key arguments (a key array whose leading size is the batch size, or whose
    leading two are a stacked leaf's) are resized too.
    """

    def axis(path):
        return 1 if f"args[{path[0].idx}]{jax.tree_util.keystr(path[1:])}" in stacked else 0

    def size(path, x):
        return np.shape(x)[axis(path)] if np.ndim(x) > axis(path) else None

    flat = jax.tree_util.tree_flatten_with_path(list(args))[0]
    batch = [(p, x) for p, x in flat if p[0].idx in argnums and is_array(x)]
    sizes = {size(p, x) for p, x in batch}
    per_device = {np.shape(x)[:2] for p, x in batch if axis(p) == 1}

    def grow(path, x, a=None):
        a = axis(path) if a is None else a
        if isinstance(x, np.ndarray):
            return np.concatenate([x] * factor, axis=a)
        shape = list(np.shape(x))
        shape[a] *= factor
        return jax.ShapeDtypeStruct(
            tuple(shape), canonical_dtype(x.dtype), sharding=named_sharding(x)
        )

    out = []
    for i, arg in enumerate(args):
        if i in argnums:
            out.append(
                jax.tree_util.tree_map_with_path(
                    lambda p, x, i=i: (
                        grow((jax.tree_util.SequenceKey(i), *p), x) if is_array(x) else x
                    ),
                    arg,
                )
            )
        elif is_key(arg) and np.shape(arg)[:2] in per_device:  # (devices, B) example keys
            out.append(grow((jax.tree_util.SequenceKey(i),), arg, 1))
        elif is_key(arg) and np.ndim(arg) and np.shape(arg)[0] in sizes:
            out.append(grow((jax.tree_util.SequenceKey(i),), arg))
        else:
            out.append(arg)
    return out


def shrink_example(example: Any) -> Any | None:
    """The example with the leading axis of every leaf of size >= 2 halved; ``None`` if none is."""
    changed = False

    def shrink(x):
        nonlocal changed
        if not is_array(x) or np.ndim(x) == 0 or np.shape(x)[0] < 2:
            return x
        changed = True
        shape = np.shape(x)
        return jax.ShapeDtypeStruct((shape[0] // 2, *shape[1:]), canonical_dtype(x.dtype))

    out = jax.tree.map(shrink, example)
    return out if changed else None


def abstract_tree(tree: Any) -> Any:
    """``tree`` with its array leaves as ``ShapeDtypeStruct`` s (other leaves kept)."""
    return jax.tree.map(lambda x: abstract(x) if is_array(x) else x, tree)
