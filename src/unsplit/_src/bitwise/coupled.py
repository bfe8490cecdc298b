"""Bitwise mode for losses that couple examples (``batch_loss``): the programs of its passes.

The passes of :mod:`unsplit._src.step.coupled`, each as a program whose
inputs do not depend on the schedule:

1. ``features`` (a chunk program per group -- one device, or the group's
   model-parallel or FSDP-group devices -- compiled once and relocated onto the
   other groups like the sums' chunk program): one chunk's features, forward
   only. The chunks' features are gathered onto one group per process in
   global-batch order (exact data movement).
2. ``loss`` (one program on that group over the whole global batch's
   features): ``loss, aux, g_direct`` (packed like the sums) and
   ``g_features``. Its inputs are the same for every schedule, so are its
   bits.
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
from jax.sharding import PartitionSpec as P

from unsplit._src import keys as keys_lib
from unsplit._src import partition
from unsplit._src.bitwise import programs
from unsplit._src.bitwise.combine.pairwise import positive_zero
from unsplit._src.bitwise.plan import Plan
from unsplit._src.step import coupled, sums


def features_program(plan: Plan, spec: sums.LossSpec, group: int):
    """Pass 1: one chunk's features (no gradient), on group ``group``'s devices.

    Multi-device groups return them whole on every device of the group (FSDP
    groups: each device its piece of the chunk's rows, computed with the params
    gathered over the chunk axes: no float sum across them).
    """
    io = programs.GroupIO(plan, group)
    spec = io.retargeted(spec)  # its shardings, on the group's mesh
    structure = plan.structure

    def compute(arrays, rows, key):
        chunk, hi, lo = rows
        ids = keys_lib.Ids64(hi=hi, lo=lo)
        return coupled.features_of(
            spec, structure, arrays, structure.diff_of(arrays), chunk, key, ids
        )

    def run(vectors, chunk, hi, lo, key):
        arrays = io.unpack(vectors)
        if io.reducer is not None:
            return io.reducer.gathered_map(compute, arrays, (chunk, hi, lo), key, P(io.centry))
        features = compute(arrays, io.rows((chunk, hi, lo)), key)
        return io.rows(features) if plan.chunk_axes else io.replicated(features)

    return run


def loss_program(plan: Plan, spec: sums.LossSpec, group: int):
    """Pass 2: ``(loss, aux, g_direct packed like the sums, g_features)`` of the global batch.

    On group ``group``'s devices, from the whole global features on each of them.
    """
    io = programs.GroupIO(plan, group)
    structure = plan.structure

    def compute(arrays, features, _):
        diff = structure.diff_of(arrays)
        return coupled.loss_and_feature_grads(spec, structure, arrays, diff, features)

    def run(vectors, features):
        arrays = io.unpack(vectors)
        if io.reducer is not None:  # every device computes it all (no sum across devices)
            loss, aux, g_direct, g_features = io.reducer.gathered_map(
                compute, arrays, features, None, P(), rows_spec=P()
            )
        else:
            loss, aux, g_direct, g_features = compute(arrays, io.replicated(features), None)
        loss, aux, g_features = io.replicated((loss, aux, g_features))
        return loss, aux, _pack(plan, io, g_direct), g_features

    return run


def pullback_program(plan: Plan, spec: sums.LossSpec, group: int):
    """Pass 3: one chunk's param grads from its features' cotangents, packed like the sums
    (FSDP groups: their devices' grads added in a fixed order, as the sums' chunk program)."""
    io = programs.GroupIO(plan, group)
    spec = io.retargeted(spec)  # its shardings, on the group's mesh
    structure = plan.structure

    def compute(arrays, rows, key):
        chunk, hi, lo, cotangent = rows
        ids = keys_lib.Ids64(hi=hi, lo=lo)
        grads = coupled.pulled_back(
            spec, structure, arrays, structure.diff_of(arrays), chunk, key, ids, cotangent
        )
        grads = [g.astype(sums.wide_float(g.dtype)) for g in grads]
        loss_sum, weight = (jnp.zeros((), d) for d in plan.sums_flat.dtypes[-2:])
        return grads, loss_sum, weight, None

    def run(vectors, chunk, hi, lo, key, cotangent):
        packed, _ = io.sums(compute, vectors, (chunk, hi, lo, cotangent), key)
        return packed

    return run


def _pack(plan: Plan, io: programs.GroupIO, grads):
    """Grads (wide floats) as the sums' flat vectors; the loss and weight slots are 0."""
    grads = [g.astype(sums.wide_float(g.dtype)) for g in grads]
    loss_sum, weight = (jnp.zeros((), d) for d in plan.sums_flat.dtypes[-2:])
    return io.pack_sums(grads, loss_sum, weight)


def finish_program(plan: Plan, grad_shardings):
    """The tree's total plus ``g_direct`` -> the grads pytree, in the params' dtypes and shardings.

    Each device unpacks its own blocks (``shard_map`` over the step's mesh), as
    :func:`programs.unpack_program` does.
    """
    structure = plan.structure
    dtypes = [
        d for d, is_diff in zip(plan.params_flat.dtypes, structure.diff, strict=True) if is_diff
    ]
    diff_specs = tuple(s for s, d in zip(plan.local_specs, structure.diff, strict=True) if d)
    n = len(plan.sums_flat.vectors)

    def local(*vectors):
        *grads, _, _ = plan.sums_flat.unpack(vectors)
        return tuple(grads)

    split = jax.shard_map(
        local,
        mesh=plan.layout.mesh,
        in_specs=(P(partition.entry(plan.group_axes)),) * n,
        out_specs=diff_specs,
        check_vma=False,
    )

    def finish(totals, direct):
        # Zeros written +0, as the unpack writes every total's (pairwise's docstring).
        grads = split(*(positive_zero(t + d) for t, d in zip(totals, direct, strict=True)))
        grads = [g.astype(d) for g, d in zip(grads, dtypes, strict=True)]
        return structure.grads_tree(grads)

    return jax.jit(finish, out_shardings=structure.grads_tree(grad_shardings))
