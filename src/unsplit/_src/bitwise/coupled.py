"""Bitwise mode for losses that couple examples (``batch_loss``): the programs of its passes.

The passes of :mod:`unsplit._src.step.coupled`, each as a program whose
inputs do not depend on the schedule:

1. ``features`` (a chunk program, one per one-device group, compiled once and
   relocated like the sums' chunk program): one chunk's features, forward only.
   The chunks' features are moved to one device and concatenated in
   global-batch order (exact data movement).
2. ``loss`` (one one-device program over the whole global batch's features):
   ``loss, aux, g_direct`` (packed like the sums) and ``g_features``. Its
   inputs are the same for every schedule, so are its bits.
3. ``pullback`` (a chunk program): one chunk recomputed and pulled back with
   its rows of ``g_features``, packed like the sums; the chunks' results are
   added in the canonical tree (:mod:`unsplit._src.bitwise.reduce`) as the
   per-example step's chunk sums are.

``finish`` adds ``g_direct`` to the tree's total (one exactly rounded add)
and gives the grads the params' shardings.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from unsplit._src import keys as keys_lib
from unsplit._src.bitwise.plan import Plan
from unsplit._src.step import coupled, sums


def check_supported(plan: Plan) -> None:
    """Bitwise coupled steps run one-device groups (for now), in any number of processes."""
    if plan.group_axes:
        raise NotImplementedError(
            "bitwise=True with batch_loss runs each chunk on one device; got params sharded "
            f"over the model axes {plan.group_axes} (tensor parallel). Fix: use bitwise=False "
            "(same result within float rounding), or keep the params replicated or sharded "
            "over the batch axes (FSDP) only."
        )


def features_program(plan: Plan, spec: sums.LossSpec):
    """Pass 1: one chunk's features (no gradient)."""
    structure = plan.structure

    def run(vectors, chunk, hi, lo, key):
        arrays = plan.params_flat.unpack(vectors)
        ids = keys_lib.Ids64(hi=hi, lo=lo)
        return coupled.features_of(
            spec, structure, arrays, structure.diff_of(arrays), chunk, key, ids
        )

    return run


def loss_program(plan: Plan, spec: sums.LossSpec):
    """Pass 2: ``(loss, aux, g_direct packed like the sums, g_features)`` of the global batch."""
    structure = plan.structure

    def run(vectors, features):
        arrays = plan.params_flat.unpack(vectors)
        diff = structure.diff_of(arrays)
        loss, aux, g_direct, g_features = coupled.loss_and_feature_grads(
            spec, structure, arrays, diff, features
        )
        return loss, aux, _pack(plan, g_direct), g_features

    return run


def pullback_program(plan: Plan, spec: sums.LossSpec):
    """Pass 3: one chunk's param grads from its features' cotangents, packed like the sums."""
    structure = plan.structure

    def run(vectors, chunk, hi, lo, key, cotangent):
        arrays = plan.params_flat.unpack(vectors)
        ids = keys_lib.Ids64(hi=hi, lo=lo)
        grads = coupled.pulled_back(
            spec, structure, arrays, structure.diff_of(arrays), chunk, key, ids, cotangent
        )
        return _pack(plan, grads)

    return run


def _pack(plan: Plan, grads):
    """Grads (wide floats) as the sums' flat vectors; the loss and weight slots are 0."""
    grads = [g.astype(sums.wide_float(g.dtype)) for g in grads]
    zero = [jnp.zeros((), d) for d in plan.sums_flat.dtypes[-2:]]
    return plan.sums_flat.pack([*grads, *zero])


def finish_program(plan: Plan, grad_shardings):
    """The tree's total plus ``g_direct`` -> the grads pytree, in the params' dtypes and shardings."""
    structure = plan.structure
    dtypes = [
        d for d, is_diff in zip(plan.params_flat.dtypes, structure.diff, strict=True) if is_diff
    ]

    def finish(totals, direct):
        vectors = [t + d for t, d in zip(totals, direct, strict=True)]
        *grads, _, _ = plan.sums_flat.unpack(vectors)
        grads = [g.astype(d) for g, d in zip(grads, dtypes, strict=True)]
        return structure.grads_tree(grads)

    return jax.jit(finish, out_shardings=structure.grads_tree(grad_shardings))
