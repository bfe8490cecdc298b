"""Losses that couple examples: per-example features, one loss of the global batch.

``value_and_grad(features_fn, batch_loss=batch_loss_fn)`` computes, for every
schedule, what one device computes over the whole global batch::

    features = vmap(features_fn)(params, batch, example_keys(key, ids))
    loss, grads = jax.value_and_grad(lambda p: batch_loss_fn(p, features(p)))(params)

in two passes over the microbatches, so that only one microbatch's activations
are alive at a time (plus the global batch's features):

1. each microbatch's features, forward only, gathered in global-batch order;
2. ``loss, (g_direct, g_features) = value_and_grad(batch_loss_fn, argnums=(0, 1))``
   once, on the global features;
3. each microbatch recomputed and pulled back with its rows of ``g_features``
   (``jax.vjp``); its param grads summed over microbatches and devices, plus
   ``g_direct`` once (params ``batch_loss_fn`` uses directly, e.g. a learnable
   temperature, get their gradient once, not once per microbatch).

The recomputation draws the same noise as the first pass by construction: an
example's key is ``example_keys(key, ids)[i]`` in both.

This module holds the arithmetic both step modes share (checked calls of the
user's two functions, and the three passes for default mode's program);
bitwise mode runs the same passes as fixed one-chunk programs
(:mod:`unsplit._src.bitwise.coupled`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from unsplit._src import frozen as frozen_lib
from unsplit._src import keys as keys_lib
from unsplit._src.step import state_guard, sums, validate


def check_features(features: Any) -> Any:
    """``features_fn``'s output for one example: a pytree of floating-point arrays."""
    leaves = jax.tree_util.tree_leaves_with_path(features, is_leaf=lambda x: x is None)
    if not leaves:
        raise TypeError(
            "features_fn must return one example's features, a pytree of floating-point "
            f"arrays (e.g. {{'image': img_emb, 'text': txt_emb}}); got {validate.describe(features, 'it')} "
            "with no array in it. Fix: return the arrays batch_loss needs for this example."
        )
    for path, leaf in leaves:
        where = f"features{jax.tree_util.keystr(path)}"
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype") or isinstance(leaf, str):
            raise TypeError(
                f"features_fn must return a pytree of arrays for one example; {where} is "
                f"{validate.describe(leaf, 'it')}. Fix: return jnp arrays only (put Python values and "
                "settings in batch_loss's closure, not in the features)."
            )
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            raise TypeError(
                f"features_fn's outputs are differentiated (batch_loss's gradient flows "
                f"back through them), so they must be floating point; {where} has dtype "
                f"{leaf.dtype}. Fix: cast it (e.g. counts.astype(jnp.float32)); integer "
                "data batch_loss needs can be recomputed there or passed as floats."
            )
    return features


def check_batch_loss(out: Any, has_aux: bool) -> tuple[jax.Array, Any]:
    """``batch_loss_fn``'s output as ``(scalar loss, aux)``."""
    aux = None
    if has_aux:
        out, aux = validate.aux_pair(out, False, "batch_loss", "the global batch")
    elif isinstance(out, tuple | list):
        raise TypeError(
            f"batch_loss returned {validate.describe(out, 'it')}; it must return the scalar loss of the "
            "global batch. Fix: pass has_aux=True if it returns (loss, aux)."
        )
    if not hasattr(out, "shape") or jnp.shape(out) != ():
        raise TypeError(
            f"batch_loss must return the scalar loss of the global batch; got "
            f"{validate.describe(out, 'it')}. Fix: reduce over the batch inside batch_loss "
            "(e.g. jnp.mean over examples)."
        )
    if not jnp.issubdtype(jnp.result_type(out), jnp.floating):
        raise TypeError(
            f"batch_loss must return a floating-point loss to be differentiated; got dtype "
            f"{jnp.result_type(out)}. Fix: compute it in float32."
        )
    return out, aux


def features_of(
    spec: sums.LossSpec,
    structure: sums.Params,
    arrays: list[Any],
    diff_arrays: list[Any],
    rows: Any,
    key: jax.Array,
    ids: keys_lib.Ids64,
) -> Any:
    """The features of ``rows`` (a leading batch axis), each example with its own key."""

    def one(diff_arrays, example, example_key):
        params = structure.merge(structure.with_diff(arrays, diff_arrays))
        with state_guard.watch(params, structure) as guard:
            out = frozen_lib.call(spec.loss_fn, params, example, example_key)
        guard.check(returned=out)
        return check_features(out)

    keys = keys_lib.example_keys(key, ids)
    return jax.vmap(one, in_axes=(None, 0, 0))(diff_arrays, rows, keys)


def batch_loss_of(
    spec: sums.LossSpec, structure: sums.Params, arrays: list[Any], diff_arrays, features
):
    """``(loss, aux)`` of the global batch's features."""
    batch_loss = spec.batch_loss
    assert batch_loss is not None, "a coupled loss has a batch_loss"
    params = structure.merge(structure.with_diff(arrays, diff_arrays))
    return check_batch_loss(frozen_lib.call(batch_loss, params, features), spec.has_aux)


def loss_and_feature_grads(spec, structure, arrays, diff_arrays, features):
    """Pass 2: ``(loss, aux, g_direct, g_features)``, once on the global features."""
    (loss, aux), (g_direct, g_features) = jax.value_and_grad(
        lambda d, f: batch_loss_of(spec, structure, arrays, d, f), argnums=(0, 1), has_aux=True
    )(diff_arrays, features)
    return loss, aux, g_direct, g_features


def pulled_back(spec, structure, arrays, diff_arrays, rows, key, ids, cotangent) -> list[Any]:
    """Pass 3 for some rows: their features recomputed, pulled back with their cotangents."""
    _, pull = jax.vjp(
        lambda d: features_of(spec, structure, arrays, d, rows, key, ids), diff_arrays
    )
    (grads,) = pull(cotangent)
    return [g.astype(sums.wide_float(g.dtype)) for g in grads]


def global_value_and_grads(
    spec: sums.LossSpec,
    structure: sums.Params,
    arrays: list[Any],
    batch: Any,
    key: jax.Array,
    ids: keys_lib.Ids64,
    *,
    microbatches: int,
    microbatched: Callable[[Any], Any],
    unmicrobatched: Callable[[Any], Any],
    constrain_grads: Callable[[list[Any]], list[Any]] = lambda g: g,
):
    """Default mode's ``(loss, grads, aux)`` of the global batch, inside its program.

    One microbatch: the plain formula (``value_and_grad`` through both
    functions). Several: the three passes, each a ``lax.scan`` over the
    microbatches (``microbatched`` cuts ``(B, ...)`` into ``(k, B // k, ...)``
    keeping each device's rows; ``unmicrobatched`` is its inverse).
    """
    diff = structure.diff_of(arrays)
    dtypes = [jnp.result_type(a) for a in diff]
    if microbatches == 1:

        def total(d):
            features = features_of(spec, structure, arrays, d, batch, key, ids)
            return batch_loss_of(spec, structure, arrays, d, features)

        (loss, aux), grads = jax.value_and_grad(total, has_aux=True)(diff)
        return loss, constrain_grads(list(grads)), aux

    xs = jax.tree.map(microbatched, (batch, ids))

    def forward(carry, x):  # pass 1: forward only, nothing kept but the features
        return carry, features_of(spec, structure, arrays, diff, x[0], key, x[1])

    _, features = jax.lax.scan(forward, None, xs)
    features = jax.tree.map(unmicrobatched, features)
    loss, aux, g_direct, g_features = loss_and_feature_grads(
        spec, structure, arrays, diff, features
    )
    cotangents = jax.tree.map(microbatched, g_features)

    def backward(carry, x):  # pass 3: recompute one microbatch, pull it back
        (rows, row_ids), cotangent = x
        grads = pulled_back(spec, structure, arrays, diff, rows, key, row_ids, cotangent)
        return [a + g for a, g in zip(carry, constrain_grads(grads), strict=True)], None

    # The sums start from g_direct (no separate zeros and final add: one params-sized
    # buffer fewer).
    start = constrain_grads(
        [g.astype(sums.wide_float(a.dtype)) for g, a in zip(g_direct, diff, strict=True)]
    )
    grad_sums, _ = jax.lax.scan(backward, start, (xs, cotangents))
    grads = [s.astype(d) for s, d in zip(grad_sums, dtypes, strict=True)]
    return loss, constrain_grads(grads), aux
