"""Per-example sums of (loss, weight, grad, aux): the arithmetic both step modes share.

The user writes the loss of ONE example. :func:`example_sums` vmaps it over a
(micro)batch, each example with its own key ``example_keys(key, ids)[i]``, and
returns the batch's sums ``(Σ loss_sum_i, Σ weight_i, ∇ Σ loss_sum_i)`` and the
examples' aux outputs, stacked. :func:`normalize` divides once by the global
weight. Default mode adds these sums over devices and microbatches in any
order; bitwise mode adds them in one fixed tree over chunks.

Params are any pytree (Flax variables, an ``nnx`` module or state, an Equinox
module). :class:`Params` splits them like ``equinox.filter_value_and_grad``:
gradients for the inexact (floating) array leaves; every other leaf (integer
arrays, PRNG key arrays, Python scalars, static fields) is passed through and
gets ``None`` in the grads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from unsplit._src import frozen as frozen_lib
from unsplit._src import keys as keys_lib
from unsplit._src.step import state_guard, validate

# loss_fn(params, example, key) or, with frozen inputs, loss_fn(params, example, key, frozen)
LossFn = Callable[..., Any]


class Result(NamedTuple):
    """What a step's engine returns: both modes, every layout."""

    loss: jax.Array  # shape=(), the global batch's loss
    grads: Any  # params' structure, None at leaves without a gradient
    aux: Any  # per-example aux stacked in global-batch order, or None
    weight: jax.Array  # shape=(), the global batch's total weight
    params: Any  # the params as the step ran them (bitwise mode: placed on its mesh)


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """The user's one-example loss and how to read its output.

    With ``batch_loss`` (a loss that couples examples, :mod:`unsplit._src.step.coupled`),
    ``loss_fn`` is the one-example *features* function and ``has_aux`` refers to
    ``batch_loss``'s output.
    """

    loss_fn: LossFn
    weighted: bool = False
    has_aux: bool = False
    batch_loss: Callable[[Any, Any], Any] | None = None

    @property
    def coupled(self) -> bool:
        return self.batch_loss is not None


def is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct)


def is_inexact_array(x: Any) -> bool:
    return is_array(x) and jnp.issubdtype(x.dtype, jnp.inexact)


@dataclasses.dataclass(frozen=True)
class Params:
    """A params pytree split into array leaves (traced) and the rest (static).

    ``arrays`` go into the compiled program; ``diff`` marks those that get a
    gradient. ``static`` holds the non-array leaves in order; they must be
    hashable, since they are part of what the compiled program is specialized on.
    """

    treedef: Any
    array_mask: tuple[bool, ...]
    diff: tuple[bool, ...]  # per array leaf
    static: tuple[Any, ...]
    paths: tuple[str, ...]  # per array leaf, for messages
    frozen: tuple[bool, ...] = ()  # per array leaf: a frozen input's (``frozen=``)

    @staticmethod
    def split(params: Any) -> tuple[Params, list[Any]]:
        flat, treedef = jax.tree_util.tree_flatten_with_path(params)
        mask = tuple(is_array(leaf) for _, leaf in flat)
        arrays = [leaf for (_, leaf), m in zip(flat, mask, strict=True) if m]
        static = tuple(leaf for (_, leaf), m in zip(flat, mask, strict=True) if not m)
        paths = tuple(
            jax.tree_util.keystr(path) for (path, _), m in zip(flat, mask, strict=True) if m
        )
        # Frozen inputs (after the params' leaves) get no gradient: they are arguments of
        # the program that the differentiated function closes over, never differentiated.
        trained = frozen_lib.frozen_leaf_count(params)
        trained = len(arrays) if trained is None else sum(mask[:trained])
        diff = tuple(is_inexact_array(x) and i < trained for i, x in enumerate(arrays))
        frozen = tuple(i >= trained for i in range(len(arrays)))
        return Params(treedef, mask, diff, static, paths, frozen), arrays

    def merge(self, arrays: list[Any]) -> Any:
        """The params pytree from its array leaves (and the stored static leaves)."""
        arrays_it, static_it = iter(arrays), iter(self.static)
        leaves = [next(arrays_it) if m else next(static_it) for m in self.array_mask]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)

    def grads_tree(self, grads: list[Any]) -> Any:
        """The grads pytree: each inexact array leaf's gradient, ``None`` elsewhere."""
        grads_it = iter(grads)
        arrays = [next(grads_it) if d else None for d in self.diff]
        arrays_it = iter(arrays)
        leaves = [next(arrays_it) if m else None for m in self.array_mask]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)

    def diff_of(self, arrays: list[Any]) -> list[Any]:
        return [x for x, d in zip(arrays, self.diff, strict=True) if d]

    def with_diff(self, arrays: list[Any], diff_arrays: list[Any]) -> list[Any]:
        it = iter(diff_arrays)
        return [next(it) if d else x for x, d in zip(arrays, self.diff, strict=True)]


def call_loss(spec: LossSpec, params: Any, example: Any, key: jax.Array):
    """The user's loss of one example as ``(float32 loss_sum, float32 weight, aux)``."""
    out = frozen_lib.call(spec.loss_fn, params, example, key)
    aux = None
    if spec.has_aux:
        out, aux = validate.aux_pair(out, spec.weighted)
    loss_sum, weight = validate.loss_output(out, spec.weighted)
    return loss_sum, weight, aux


def example_sums(
    spec: LossSpec,
    layout: Params,
    arrays: list[Any],
    batch: Any,
    key: jax.Array,
    ids: keys_lib.Ids64,
    constrain_grads: Callable[[list[Any]], list[Any]] = lambda g: g,
    prepare: Callable[[list[Any]], list[Any]] = lambda a: a,
    *,
    normalized: bool = False,
):
    """Sums of (loss_sum, weight, grad) over a (micro)batch, and the per-example aux.

    Returns ``((loss_sum, weight, grad_sums), aux)`` where ``grad_sums`` is a
    list aligned with the differentiable leaves, in a wide float dtype (float32
    for bf16/f16 params), and ``aux`` is stacked over the batch (or ``None``).
    ``prepare`` maps the differentiable arrays to the ones the loss computes
    with (e.g. FSDP params gathered); gradients flow back through it.

    ``normalized=True`` (the batch is the whole global batch): returns the
    step's ``((loss, weight, grads), aux)`` instead, divided by the weight as
    :func:`normalize` does. The division is the backward pass's seed (the
    cotangent ``1 / weight``, as in ``jnp.mean``), so no pass over the grads is
    added after the backward pass.
    """
    others = arrays

    def one(diff_arrays, example, example_key):
        leaves = layout.with_diff(others, diff_arrays)
        params = layout.merge(leaves)
        with state_guard.watch(params, layout) as guard:
            out = call_loss(spec, params, example, example_key)
        guard.check(returned=out)
        return out

    def total(diff_arrays):
        keys = keys_lib.example_keys(key, ids)
        compute = prepare(diff_arrays)
        loss_sums, weights, aux = jax.vmap(one, in_axes=(None, 0, 0))(compute, batch, keys)
        loss_sum, weight = jnp.sum(loss_sums), jax.lax.stop_gradient(jnp.sum(weights))
        if normalized:
            loss_sum = loss_sum / valid_weight(weight)
        return loss_sum, (weight, aux)

    diff_arrays = layout.diff_of(arrays)
    (loss_sum, (weight, aux)), grads = jax.value_and_grad(total, has_aux=True)(diff_arrays)
    if normalized:
        # Grads of params the loss does not reach are 0 whatever the seed: nan them too.
        # A cond, not a select: no pass over the grads when the weight is valid.
        grads = jax.lax.cond(
            jnp.isfinite(valid_weight(weight)),
            lambda gs: gs,
            lambda gs: [jnp.full_like(g, jnp.nan) for g in gs],
            grads,
        )
        return (loss_sum, weight, constrain_grads(grads)), aux
    grads = constrain_grads([g.astype(wide_float(g.dtype)) for g in grads])
    return (loss_sum, weight, grads), aux


def valid_weight(weight):
    """The total weight if it is a positive finite number, else nan (computed on device)."""
    return jnp.where((weight > 0) & jnp.isfinite(weight), weight, jnp.nan)


def normalize(loss_sum, weight, grad_sums, dtypes):
    """The step's loss and grads: global sums divided once by the global weight.

    A total weight that is not a positive finite number (0, negative, inf,
    nan) gives nan loss and nan grads, computed on device (no host read-back).
    ``dtypes`` are the params' dtypes: each grad is cast back to its param's.
    """
    weight = valid_weight(weight)
    loss = loss_sum / weight
    grads = [(g / weight.astype(g.dtype)).astype(d) for g, d in zip(grad_sums, dtypes, strict=True)]
    return loss, grads


def wide_float(dtype: Any) -> Any:
    """float32 for narrower floats (bf16, f16), the dtype itself otherwise."""
    dtype = jnp.dtype(dtype)
    narrow = jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4
    return jnp.dtype(jnp.float32) if narrow else dtype
